"""The decoding loop: the prompt runs once (prefill), then one token per step against the KV cache.

`stream` yields each step's tokens as they are sampled; `generate` collects them. `GPT.stream` and
`GPT.generate` call these.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Iterable, Iterator

import torch

from generation.sampling import Generators, check_sampling, sample
from generation.step import CudaGraphStep, OneTokenStep
from model import GPT

# One recorded CUDA graph per model, reused while its batch size, dtype and weights' memory stay the same.
_graph_steps: weakref.WeakKeyDictionary[GPT, tuple[tuple, CudaGraphStep]] = weakref.WeakKeyDictionary()


def use_cuda_graph(model: GPT) -> bool:
    weight = model.transformer.wte.weight
    return weight.device.type == "cuda" and not model.training


def graph_step(model: GPT, batch_size: int) -> CudaGraphStep | None:
    """The model's recorded step for this batch size (recorded now if need be), its caches attached;
    None where recording fails, with a warning (decoding then runs step by step)."""
    params = tuple(p.data_ptr() for p in model.parameters())
    key = (batch_size, model.transformer.wte.weight.dtype, params)
    known = _graph_steps.get(model)
    if known is not None and known[0] == key:
        model.set_kv_cache(batch_size, caches=known[1].caches)
        return known[1]
    _graph_steps.pop(model, None)  # one graph per model: free the old one's caches first
    try:
        step = CudaGraphStep(model, model.new_kv_caches(batch_size))
    except RuntimeError as err:
        warnings.warn(f"CUDA graph recording failed ({err}); decoding without it", stacklevel=3)
        return None
    _graph_steps[model] = (key, step)
    return step


def one_token_step(model: GPT, batch_size: int):
    """The step that decodes one position with the caches it attaches to the model: a CUDA graph on a
    GPU, the eager fast step elsewhere, and none in training mode (dropout: the model's own forward)."""
    if model.training:
        model.set_kv_cache(batch_size)
        return None
    if use_cuda_graph(model):
        step = graph_step(model, batch_size)
        if step is not None:
            return step
    model.set_kv_cache(batch_size)
    return OneTokenStep(model)


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
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), at most max_new_tokens times.

    With the cache, the prompt runs once (prefill), then one token per step; a prompt longer than
    block_size is seen through its last block_size tokens. Past block_size the
    window slides in jumps: when it is full, it restarts from its last block_size // 2 tokens
    (one prefill of those), because learned absolute positions do not let cached keys shift to
    new positions. Without the cache, every step runs the same window from scratch, so both
    modes see the same context at every step and greedy decoding gives the same tokens.

    A row that has produced one of `stop_tokens` is finished: from then on it repeats that token
    (its sampling generator still advances, which touches no other row), and the stream ends
    as soon as every row is finished. Tokens stay on the model's device; nothing waits for the
    device except what reads them.

    The yielded tensors are inference tensors (made under torch.inference_mode): read them, or
    clone them outside inference mode before autograd sees them. `generate` returns a normal one.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError("idx must be a (batch, tokens) tensor holding at least one token")
    check_sampling(temperature, top_k, top_p)
    stops = torch.tensor(sorted(set(stop_tokens or ())), dtype=torch.long, device=idx.device)
    has_stops = stops.numel() > 0
    finished_with = torch.full((idx.size(0),), -1, dtype=torch.long, device=idx.device)  # -1: still going
    block_size = model.config.block_size
    keep = max(1, block_size // 2)
    # Each stretch of work between two yields runs in inference mode (cheaper per operation than
    # no_grad, which counts for one token at a time); the caller's code between them does not.
    with torch.inference_mode():
        tokens = torch.empty(idx.size(0), idx.size(1) + max_new_tokens, dtype=idx.dtype, device=idx.device)
        tokens[:, : idx.size(1)] = idx
        step = one_token_step(model, idx.size(0)) if use_cache else None
    total = idx.size(1)  # tokens so far
    window_start = max(0, total - block_size)  # first token of the current window: a long prompt's last block_size
    cached = 0  # how many tokens of the window the cache holds
    try:
        for _ in range(max_new_tokens):
            with torch.inference_mode():
                if total - window_start > block_size:
                    window_start, cached = total - keep, 0
                if step is not None and total - window_start - cached == 1:
                    logits = step(tokens[:, total - 1], pos=cached)
                elif use_cache:  # prefill: the prompt, or the window after a slide
                    logits = model.last_logits(tokens[:, window_start + cached : total], start_pos=cached)
                else:
                    logits = model.last_logits(tokens[:, window_start:total])
                cached = total - window_start
                next_token = sample(logits, temperature, top_k, top_p, generator)
                if has_stops:
                    done = finished_with >= 0
                    next_token = torch.where(done, finished_with, next_token)
                    finished_with = torch.where(~done & torch.isin(next_token, stops), next_token, finished_with)
                tokens[:, total] = next_token
                total += 1
            yield next_token
            if has_stops and bool((finished_with >= 0).all()):
                break
    finally:
        # A stream left unfinished until the interpreter exits is closed while torch's modules are being
        # torn down; the process drops the caches with everything else then.
        if use_cache and not sys.is_finalizing():
            model.clear_kv_cache()


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
