"""A GPT-2 decoder, written the way the GPT-2 block is drawn.

Module and parameter names match the GPT-2 checkpoints (`transformer.h.0.attn.c_attn.weight`, ...),
so weights move to and from Hugging Face `transformers` by name alone (its `Conv1D` stores the
linear weights transposed; `model.hf` handles that).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .decode import OneTokenStep
from .sampling import Generators, check_sampling, sample


class KVCache:
    """Keys and values of one attention layer, preallocated and written by position.

    Decoding writes one position per step into the same buffers, so nothing is copied or
    regrown as the sequence gets longer.
    """

    def __init__(self, batch_size: int, n_head: int, max_len: int, head_size: int, device, dtype):
        # keys and values side by side, (B, 2, nh, max_len, hs), so that one copy writes both
        self.kv = torch.zeros((batch_size, 2, n_head, max_len, head_size), device=device, dtype=dtype)
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]  # views, (B, nh, max_len, hs)
        self.length = 0  # positions filled so far

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nh, T, hs) at positions start_pos.. and return all filled positions."""
        end = start_pos + k.size(2)
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


def causal_mask(n_queries: int, n_keys: int, device) -> torch.Tensor:
    """(T, S) bool mask: the T queries are the last T of the S positions; True = may attend."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n_queries)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.kernel = config.attention
        self.dropout = config.dropout
        # q, k and v for all heads come from one matrix: (C, 3C) holds the per-head projections side by side
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.kv_cache: KVCache | None = None  # only set while generating

    def forward(self, x: torch.Tensor, start_pos: int = 0, need_weights: bool = False):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(start_pos, k, v)  # (B, nh, S, hs), S = start_pos + T

        weights = None
        if need_weights or self.kernel == "explicit":
            y, weights = self.explicit_attention(q, k, v)
        else:
            y = self.fused_attention(q, k, v)

        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        y = self.resid_dropout(self.c_proj(y))
        return (y, weights) if need_weights else y

    def explicit_attention(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention of the GPT-2 paper, step by step; returns y and the weights (B, nh, T, S)."""
        T, S = q.size(-2), k.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, S)
        if T > 1:  # one query (decoding) sits last and may see every key
            att = att.masked_fill(~causal_mask(T, S, q.device), float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v, att  # (B, nh, T, hs)

    def fused_attention(self, q, k, v) -> torch.Tensor:
        """The same computation in one kernel call."""
        T, S = q.size(-2), k.size(-2)
        dropout_p = self.dropout if self.training else 0.0
        if T == S:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=T > 1)
        mask = None if T == 1 else causal_mask(T, S, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU is the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), start_pos)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one tensor embeds and unembeds
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms, and the two
        projections that write into the residual stream scaled by 1/sqrt(2 * n_layer), because each
        block adds to the stream twice and the sum's variance grows with every addition."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.transformer.h:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters counted once (the tied lm_head is wte); non_embedding leaves out wpe and wte."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel() + self.transformer.wte.weight.numel()
        return n

    # ---- forward ---------------------------------------------------------------------------------

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) token ids -> logits (B, T, vocab) and the mean cross-entropy against targets
        (B, T), or None without targets. Targets of -1 are ignored."""
        logits = self.lm_head(self.transformer.ln_f(self.trunk(idx)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def trunk(self, idx: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """Embed idx, whose first token sits at position start_pos, and run every block: (B, T, C)."""
        T = idx.size(1)
        if start_pos + T > self.config.block_size:
            raise ValueError(
                f"sequence of {start_pos + T} tokens is longer than the model's block_size "
                f"({self.config.block_size}); crop it to the last {self.config.block_size} tokens"
            )
        pos = torch.arange(start_pos, start_pos + T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, start_pos)
        return x

    def last_logits(self, idx: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """Logits (B, vocab) of the last position only; lm_head never sees the others."""
        x = self.trunk(idx, start_pos)[:, -1, :]
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def attention_weights(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """Attention weights of every layer, each (B, nh, T, T), from the explicit path."""
        T = idx.size(1)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device)))
        maps = []
        for block in self.transformer.h:
            y, weights = block.attn(block.ln_1(x), need_weights=True)
            x = x + y
            x = x + block.mlp(block.ln_2(x))
            maps.append(weights)
        return maps

    # ---- generation ------------------------------------------------------------------------------

    def set_kv_cache(self, batch_size: int, device=None, dtype=None) -> None:
        """Give every attention layer an empty cache of block_size positions."""
        weight = self.transformer.wte.weight
        for block in self.transformer.h:
            block.attn.kv_cache = KVCache(
                batch_size,
                self.config.n_head,
                self.config.block_size,
                self.config.head_size,
                device or weight.device,
                dtype or weight.dtype,
            )

    def clear_kv_cache(self) -> None:
        for block in self.transformer.h:
            block.attn.kv_cache = None

    def cache_length(self) -> int:
        """Positions the KV cache holds now (0 when there is no cache)."""
        cache = self.transformer.h[0].attn.kv_cache
        return 0 if cache is None else cache.length

    @torch.inference_mode()  # cheaper per operation than no_grad, which counts for one token at a time
    def stream(
        self,
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

        With the cache, the prompt runs once (prefill), then one token per step. Past block_size the
        window slides in jumps: when it is full, it restarts from its last block_size // 2 tokens
        (one prefill of those), because learned absolute positions do not let cached keys shift to
        new positions. Without the cache, every step runs the same window from scratch, so both
        modes see the same context at every step and greedy decoding gives the same tokens.

        A row that has produced one of `stop_tokens` is finished: from then on it repeats that token
        (its sampling generator still advances, which touches no other row), and the stream ends
        as soon as every row is finished.

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
        block_size = self.config.block_size
        keep = max(1, block_size // 2)
        tokens = torch.empty(idx.size(0), idx.size(1) + max_new_tokens, dtype=idx.dtype, device=idx.device)
        tokens[:, : idx.size(1)] = idx
        total = idx.size(1)  # tokens so far
        window_start = 0  # first token of the current window
        cached = 0  # how many tokens of the window the cache holds
        step = None  # one-token decoding (inference only: it has no dropout)
        if use_cache:
            self.set_kv_cache(idx.size(0))
            if not self.training:
                step = OneTokenStep(self)
        try:
            for _ in range(max_new_tokens):
                if total - window_start > block_size:
                    window_start, cached = total - keep, 0
                if step is not None and total - window_start - cached == 1:
                    logits = step(tokens[:, total - 1], pos=cached)
                elif use_cache:  # prefill: the prompt, or the window after a slide
                    logits = self.last_logits(tokens[:, window_start + cached : total], start_pos=cached)
                else:
                    logits = self.last_logits(tokens[:, window_start:total])
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
            if use_cache:
                self.clear_kv_cache()

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        generator: Generators = None,
        stop_tokens: Iterable[int] | None = None,
    ) -> torch.Tensor:
        """idx (B, T) with the sampled tokens appended: (B, T + max_new_tokens), or fewer new
        tokens when every row has stopped early at one of `stop_tokens` (see `stream`)."""
        new = list(self.stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache, generator, stop_tokens))
        return torch.cat((idx, torch.stack(new, dim=1)), dim=1)

    # ---- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, path, map_location="cpu") -> GPT:
        """A model in eval mode from a `.ckpt` file, a run folder, or a Hugging Face GPT-2 folder
        (config.json + model.safetensors or pytorch_model.bin, e.g. one written by export.py)."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(path, map_location=map_location).model
