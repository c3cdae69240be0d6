"""The decoding loop: the prompt runs once (prefill), then one token per step against the KV cache.

Both are the same call, `GPT.last_logits(tokens the cache does not hold yet, start_pos=how many it
holds)`, so decoding runs the model's own blocks. On a GPU each one-token step is a replay of that
call recorded as a CUDA graph (`generation.step`). `stream` yields each step's tokens as they are
sampled (and hands the logits they came from to `on_logits`); `generate` collects them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator

import torch

from generation.sampling import Generators, check_sampling, sample
from generation.step import graph_step, pack_linears, unpack_linears, use_cuda_graph
from model import GPT


class Window:
    """The tokens so far, (B, T + max_new_tokens) preallocated, and the window of them the model sees.

    A prompt longer than block_size is seen through its last block_size tokens. Past block_size the
    window slides in jumps: when it is full, it restarts from its last block_size // 2 tokens (one
    prefill of those), because learned absolute positions do not let cached keys shift to new
    positions. Without the cache, every step runs the same window from scratch, so both modes see
    the same context at every step and greedy decoding gives the same tokens.

    Until `close`, the model is set up for decoding: its layers hold the KV caches, and a large model
    on a CPU has packed Linear layers (`generation.step.pack_linears`).
    """

    def __init__(self, model: GPT, idx: torch.Tensor, max_new_tokens: int, use_cache: bool):
        self.model, self.use_cache = model, use_cache
        self.block_size = model.config.block_size
        self.tokens = torch.empty(idx.size(0), idx.size(1) + max_new_tokens, dtype=idx.dtype, device=idx.device)
        self.tokens[:, : idx.size(1)] = idx
        self.total = idx.size(1)  # tokens so far
        self.start = max(0, self.total - self.block_size)  # first token of the window
        self.cached = 0  # how many tokens of the window the cache holds; always 0 without one
        self.graph = None
        if use_cache and use_cuda_graph(model):
            self.graph = graph_step(model, idx.size(0))
        if use_cache and self.graph is None:
            model.set_kv_cache(idx.size(0))
        self.packed = pack_linears(model) if use_cache else {}

    def next_logits(self) -> torch.Tensor:
        """Logits (B, vocab) of the token after the last one."""
        if self.total - self.start > self.block_size:
            self.start, self.cached = self.total - max(1, self.block_size // 2), 0
        new = self.tokens[:, self.start + self.cached : self.total]  # (B, T): what the cache does not hold yet
        if self.graph is not None and new.size(1) == 1:
            logits = self.graph(new, self.cached)
        else:  # the prompt (prefill), the window after a slide, one token, or without a cache the window
            logits = self.model.last_logits(new, start_pos=self.cached)
        if self.use_cache:
            self.cached = self.total - self.start
        return logits

    def append(self, token: torch.Tensor) -> None:
        self.tokens[:, self.total] = token
        self.total += 1

    def close(self) -> None:
        """Give the model back as it was: without caches, with its own Linear layers."""
        unpack_linears(self.model, self.packed)
        if self.use_cache:
            self.model.clear_kv_cache()


class StopTokens:
    """Which rows have produced one of the stop tokens. A finished row repeats its stop token from then
    on (its sampling generator still advances, which touches no other row)."""

    def __init__(self, stop_tokens: Iterable[int] | None, idx: torch.Tensor):
        self.stops = torch.tensor(sorted(set(stop_tokens or ())), dtype=torch.long, device=idx.device)
        self.any = self.stops.numel() > 0
        self.finished_with = torch.full((idx.size(0),), -1, dtype=torch.long, device=idx.device)  # -1: going on

    def apply(self, next_token: torch.Tensor) -> torch.Tensor:
        """next_token (B,), with each finished row's stop token in its place."""
        if not self.any:
            return next_token
        done = self.finished_with >= 0
        next_token = torch.where(done, self.finished_with, next_token)
        self.finished_with = torch.where(~done & torch.isin(next_token, self.stops), next_token, self.finished_with)
        return next_token

    def all_finished(self) -> bool:
        return self.any and bool((self.finished_with >= 0).all())


def stream(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: Generators = None,
    stop_tokens: Iterable[int] | None = None,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), at most max_new_tokens times; the stream ends early
    once every row has produced one of `stop_tokens`. What the model sees: `Window`. Tokens stay on
    the model's device; nothing waits for the device except what reads them. They are inference
    tensors (made under torch.inference_mode): read them, or clone them outside inference mode
    before autograd sees them. `generate` returns a normal one. `on_logits` is handed each step's
    logits, (B, vocab), before its tokens are yielded (the studio shows what else could have come)."""
    check_prompt(idx, max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    stops = StopTokens(stop_tokens, idx)
    # Each stretch of work between two yields runs in inference mode (cheaper per operation than
    # no_grad, which counts for one token at a time); the caller's code between them does not.
    with torch.inference_mode():
        window = Window(model, idx, max_new_tokens, use_cache)
    try:
        for _ in range(max_new_tokens):
            with torch.inference_mode():
                logits = window.next_logits()  # (B, vocab)
                next_token = stops.apply(sample(logits, temperature, top_k, top_p, generator))
                window.append(next_token)
            if on_logits is not None:
                on_logits(logits)
            yield next_token
            if stops.all_finished():
                break
    finally:
        if not sys.is_finalizing():  # (at exit, torch is being torn down and the model goes with it)
            window.close()


def check_prompt(idx: torch.Tensor, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError("idx must be a (batch, tokens) tensor holding at least one token")


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: Generators = None,
    stop_tokens: Iterable[int] | None = None,
) -> torch.Tensor:
    """idx (B, T) with the sampled tokens appended: (B, T + max_new_tokens), or fewer new tokens
    when every row has stopped early at one of `stop_tokens` (see `stream`)."""
    new = list(stream(model, idx, max_new_tokens, temperature, top_k, top_p, use_cache, generator, stop_tokens))
    return torch.cat((idx, torch.stack(new, dim=1)), dim=1)
