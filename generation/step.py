"""One decoding step: the GPT forward pass for a single new position per row, against the KV cache.

It is `Block.forward` for T = 1 (tested equal), written for speed. At one token a step a small model's
matrices are tiny and the cost is in calls, not arithmetic: module calls, attribute lookups, transposes
into heads and back. So each layer's weights are gathered once per generation, the layers run as
functions on (B, C) rows (for one position the heads of attention's output are already side by side),
and each position's keys and values go into the cache with one copy (`KVCache.append`).

A large model on a CPU is the opposite case: each step reads every weight from memory once, so its
speed is that of the matrix-vector products. For those the linear layers run from oneDNN-packed
copies of their weights, which it reads about 1.6x faster than the plain layout.

On a GPU the cost is kernel launches (some 150 per token for GPT-2 small). `StaticStep` keeps the token
and the position in tensors, so every step has the same shapes and addresses, and `CudaGraphStep`
records one step as a CUDA graph that each later token replays with a single launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from model.cache import KVCache
    from model.gpt import GPT, CausalSelfAttention

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


def layer_norm_fn(norm: nn.LayerNorm):
    shape, weight, bias, eps = norm.normalized_shape, norm.weight, norm.bias, norm.eps
    return lambda x: F.layer_norm(x, shape, weight, bias, eps)


class Layer(NamedTuple):
    """One block's parts as functions on (B, C) rows, named as in `Block`."""

    ln_1: object
    c_attn: object
    attn: CausalSelfAttention  # its `attend` is the attention the block computes
    attn_c_proj: object
    cache: KVCache
    ln_2: object
    c_fc: object
    mlp_c_proj: object


class OneTokenStep:
    """step(token (B,), pos) -> logits (B, vocab), with positions 0..pos-1 already in the caches.

    `pos` is an int, or a 0-d tensor (see `KVCache.append`). Built per generation with the caches the
    model's layers hold: it holds the model's current weights, so it must not outlive a change to
    them. Inference only: there is no dropout.
    """

    def __init__(self, model: GPT):
        packed = pack_weights(model)
        t = model.transformer
        self.wte, self.wpe = t.wte.weight, t.wpe.weight
        self.ln_f = layer_norm_fn(t.ln_f)
        self.lm_head = linear_fn(model.lm_head, packed) if packed else model.lm_head  # the module: hooks see it
        self.n_head = model.config.n_head
        self.layers = [
            Layer(
                ln_1=layer_norm_fn(block.ln_1),
                c_attn=linear_fn(block.attn.c_attn, packed),
                attn=block.attn,
                attn_c_proj=linear_fn(block.attn.c_proj, packed),
                cache=block.attn.kv_cache,
                ln_2=layer_norm_fn(block.ln_2),
                c_fc=linear_fn(block.mlp.c_fc, packed),
                mlp_c_proj=linear_fn(block.mlp.c_proj, packed),
            )
            for block in t.h
        ]

    def __call__(self, token: torch.Tensor, pos: int | torch.Tensor) -> torch.Tensor:
        position = self.wpe[pos] if isinstance(pos, int) else self.wpe.index_select(0, pos.view(1))
        x = self.wte[token] + position  # (B, C)
        for layer in self.layers:  # Block.forward: x + attn(ln_1(x)), then x + mlp(ln_2(x))
            x = x + self.attention(layer, layer.ln_1(x), pos)
            x = x + layer.mlp_c_proj(F.gelu(layer.c_fc(layer.ln_2(x)), approximate="tanh"))
        return self.lm_head(self.ln_f(x))

    def attention(self, layer: Layer, x: torch.Tensor, pos: int | torch.Tensor) -> torch.Tensor:
        """CausalSelfAttention.forward for one position: (B, C) -> (B, C)."""
        B, C = x.shape
        qkv = layer.c_attn(x).view(B, 3, self.n_head, C // self.n_head)  # [q | k | v], each by head
        keys, values, mask = layer.cache.append(pos, qkv[:, 1:])  # this position's k and v: one copy
        y = layer.attn.attend(qkv[:, 0].unsqueeze(2), keys, values, mask)  # (B, nh, 1, hs)
        return layer.attn_c_proj(y.view(B, C))  # for one position the heads are already side by side


class StaticStep:
    """The one-token step with its inputs in fixed tensors: step(token (B,), pos: int) -> logits.

    The token and the position are copied into buffers that live as long as the step, and the
    attention reads the whole cache under a mask, so every call runs the same operations on the same
    memory. On a CPU that is only slower than `OneTokenStep`; it exists to be recorded as a CUDA graph.
    """

    def __init__(self, model: GPT, caches: list[KVCache]):
        self.caches = caches
        device = model.transformer.wte.weight.device
        self.token = torch.zeros(caches[0].kv.size(0), dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        model.set_kv_cache(0, caches=caches)
        self.step = OneTokenStep(model)

    def run(self) -> torch.Tensor:
        return self.step(self.token, self.pos)

    def __call__(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        self.token.copy_(token)
        self.pos.fill_(pos)
        for cache in self.caches:
            cache.mark_filled(pos + 1)
        return self.run()


class CudaGraphStep(StaticStep):
    """`StaticStep` recorded once as a CUDA graph; each token is then one graph replay.

    Build it before the prompt's prefill: recording runs the step a few times, which writes into
    the caches at position 0. The logits it returns are the graph's output buffer, overwritten by
    the next call: sample from them before calling again.
    """

    def __init__(self, model: GPT, caches: list[KVCache]):
        super().__init__(model, caches)
        side = torch.cuda.Stream()  # warm-up runs off the main stream, as graph capture requires
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.step(self.token, self.pos)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.step(self.token, self.pos)

    def run(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits
