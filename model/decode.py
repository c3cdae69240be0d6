"""One decoding step: the GPT forward pass for a single new position per row, against the KV cache.

It is the same maths as `GPT.forward` for T = 1 (tested equal), written for speed. At one token a
step a small model's matrices are tiny, and the cost is in calls, not arithmetic: module calls,
attribute lookups, transposes into heads and back. So the weights of every layer are gathered once
per generation into plain tuples, the layers are called as functions on (B, C) rows (for one
position the heads of attention's output are already side by side), and keys and values are written
into the cache with one copy.

A large model on a CPU is the opposite case: each step reads every weight from memory once, so its
speed is that of the matrix-vector products. For those the linear layers run from oneDNN-packed
copies of their weights, which it reads about 1.6x faster than the plain layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from .gpt import GPT

PACK_ABOVE_BYTES = 64 * 2**20  # weights this large stream from memory every step: worth packing


def pack_weights(model: nn.Module) -> bool:
    """Whether packed weights will speed up decoding this model: float32 on a CPU with oneDNN, and
    too large to stay in the CPU's caches between steps."""
    weight = model.transformer.wte.weight
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and sum(p.numel() * p.element_size() for p in model.parameters()) > PACK_ABOVE_BYTES
    )


def linear_fn(layer: nn.Linear, packed: bool):
    """A function x -> layer(x): from packed weights, or F.linear on the layer's own tensors."""
    if packed:
        from torch.utils import mkldnn

        return mkldnn.to_mkldnn(layer)
    weight, bias = layer.weight, layer.bias
    return lambda x: F.linear(x, weight, bias)


class OneTokenStep:
    """step(token (B,), pos) -> logits (B, vocab), with positions 0..pos-1 already in the cache.

    Built per generation (the cache must be set): it holds the model's current weights, so it must
    not outlive a change to them. Inference only: there is no dropout.
    """

    def __init__(self, model: GPT):
        packed = pack_weights(model)
        t = model.transformer
        self.wte, self.wpe = t.wte.weight, t.wpe.weight
        self.norm = (t.ln_f.normalized_shape, t.ln_f.weight, t.ln_f.bias, t.ln_f.eps)
        self.lm_head = linear_fn(model.lm_head, packed) if packed else model.lm_head  # the module: hooks see it
        self.n_head = model.config.n_head
        self.caches = [block.attn.kv_cache for block in t.h]
        self.layers = []
        for block in t.h:
            attn, mlp = block.attn, block.mlp
            self.layers.append(
                (
                    (block.ln_1.normalized_shape, block.ln_1.weight, block.ln_1.bias, block.ln_1.eps),
                    linear_fn(attn.c_attn, packed),
                    linear_fn(attn.c_proj, packed),
                    (block.ln_2.normalized_shape, block.ln_2.weight, block.ln_2.bias, block.ln_2.eps),
                    linear_fn(mlp.c_fc, packed),
                    linear_fn(mlp.c_proj, packed),
                    attn.kv_cache.kv,  # (B, 2, nh, max_len, hs)
                    attn.explicit_attention if attn.kernel == "explicit" else None,
                )
            )

    def __call__(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        x = self.wte[token] + self.wpe[pos]  # (B, C)
        B, C = x.shape
        for ln_1, c_attn, c_proj, ln_2, c_fc, mlp_proj, kv, explicit in self.layers:
            qkv = c_attn(F.layer_norm(x, *ln_1)).view(B, 3, self.n_head, C // self.n_head)  # [q | k | v] by head
            kv[:, :, :, pos] = qkv[:, 1:]  # this position's keys and values, in one copy
            q, keys, values = qkv[:, 0].unsqueeze(2), kv[:, 0, :, : pos + 1], kv[:, 1, :, : pos + 1]  # (B, nh, ., hs)
            y = explicit(q, keys, values)[0] if explicit else F.scaled_dot_product_attention(q, keys, values)
            x = x + c_proj(y.view(B, C))  # (B, nh, 1, hs) -> (B, C): heads side by side
            x = x + mlp_proj(F.gelu(c_fc(F.layer_norm(x, *ln_2)), approximate="tanh"))
        for cache in self.caches:
            cache.length = pos + 1
        return self.lm_head(F.layer_norm(x, *self.norm))
