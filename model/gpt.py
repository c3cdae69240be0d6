"""A GPT-2 decoder, written the way the GPT-2 block is drawn.

Module and parameter names match the GPT-2 checkpoints (`transformer.h.0.attn.c_attn.weight`, ...),
so weights move to and from Hugging Face `transformers` by name alone (its `Conv1D` stores the
linear weights transposed; `model.hf` handles that).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.cache import KVCache
from model.config import GPTConfig


def dropout(p: float) -> nn.Module:
    """nn.Dropout(p), or at p = 0 nn.Identity: the same numbers without dropout's checks, which each
    decoded token would pass through twice in every layer."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


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
        self.attn_dropout = dropout(config.dropout)
        self.resid_dropout = dropout(config.dropout)
        self.kv_cache: KVCache | None = None  # only set while generating

    def forward(self, x: torch.Tensor, start_pos: int | torch.Tensor = 0, weights: list | None = None) -> torch.Tensor:
        """x (B, T, C), whose first position is start_pos, -> (B, T, C). `weights`: a list that the
        attention weights (B, nh, T, S) are appended to. start_pos may be a 0-d tensor while a KV cache
        is set (see `KVCache.update`)."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # one matrix multiply for every head's q, k, v
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        mask = None
        if self.kv_cache is not None:
            k, v, mask = self.kv_cache.update(start_pos, k, v)  # (B, nh, S, hs): every position so far
        y = self.attend(q, k, v, mask, weights)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q, k, v, mask: torch.Tensor | None = None, weights: list | None = None) -> torch.Tensor:
        """Queries q (B, nh, T, hs), the last T of the S positions of keys and values k, v
        (B, nh, S, hs), -> (B, nh, T, hs). Each query sees its own position and those before it;
        `mask` (bool, True = may attend, broadcastable to (T, S)) replaces that rule when given.

        The "sdpa" kernel computes it in one call; "explicit" (and any call that asks for the weights)
        writes out the steps of the GPT-2 paper. Both give the same numbers."""
        T, S = q.size(-2), k.size(-2)
        causal = mask is None and T > 1  # one query (decoding) sits last and may see every key
        if weights is None and self.kernel == "sdpa":
            dropout_p = self.dropout if self.training else 0.0
            if causal and T == S:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
            mask = causal_mask(T, S, q.device) if causal else mask
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # scores (B, nh, T, S)
        if causal or mask is not None:
            att = att.masked_fill(~(causal_mask(T, S, q.device) if causal else mask), float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        if weights is not None:
            weights.append(att)
        return att @ v


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU is the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = dropout(config.dropout)

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

    def forward(
        self, x: torch.Tensor, start_pos: int | torch.Tensor = 0, attention: list | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), start_pos, attention)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=dropout(config.dropout),
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

    def trunk(
        self, idx: torch.Tensor, start_pos: int | torch.Tensor = 0, attention: list | None = None
    ) -> torch.Tensor:
        """Embed idx, whose first token sits at position start_pos, and run every block: (B, T, C).
        `attention`: a list that each layer appends its attention weights (B, nh, T, S) to."""
        T = idx.size(1)
        if isinstance(start_pos, int) and start_pos + T > self.config.block_size:  # a tensor is not read: no wait
            raise ValueError(
                f"sequence of {start_pos + T} tokens is longer than the model's block_size "
                f"({self.config.block_size}); crop it to the last {self.config.block_size} tokens"
            )
        pos = torch.arange(T, device=idx.device) + start_pos  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, start_pos, attention)
        return x

    def last_logits(self, idx: torch.Tensor, start_pos: int | torch.Tensor = 0) -> torch.Tensor:
        """Logits (B, vocab) of the last position only; lm_head never sees the others. With KV caches
        set, idx (B, T) continues the positions they hold: the prompt (prefill), then one token a step."""
        x = self.trunk(idx, start_pos)[:, -1, :]
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def attention_weights(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """Attention weights of every layer, each (B, nh, T, T): the forward pass, keeping them."""
        weights: list[torch.Tensor] = []
        self.trunk(idx, attention=weights)
        return weights

    # ---- generation ------------------------------------------------------------------------------

    def set_kv_cache(
        self, batch_size: int, device=None, dtype=None, caches: list[KVCache] | None = None
    ) -> list[KVCache]:
        """Give every attention layer a KV cache of block_size positions, new and empty, or `caches`
        (one per layer, as an earlier call returned them), and return them."""
        if caches is None:
            weight, c = self.transformer.wte.weight, self.config
            device, dtype = device or weight.device, dtype or weight.dtype
            caches = [
                KVCache(batch_size, c.n_head, c.block_size, c.head_size, device, dtype) for _ in self.transformer.h
            ]
        for block, cache in zip(self.transformer.h, caches, strict=True):
            block.attn.kv_cache = cache
        return caches

    def clear_kv_cache(self) -> None:
        for block in self.transformer.h:
            block.attn.kv_cache = None

    def cache_length(self) -> int:
        """Positions the KV cache holds now (0 when there is no cache)."""
        cache = self.transformer.h[0].attn.kv_cache
        return 0 if cache is None else cache.length
