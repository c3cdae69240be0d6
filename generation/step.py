"""What makes a decoding step fast beyond the model's own forward, on a GPU and on a large CPU model.

At one token a step the GPU's cost is kernel launches (a dozen or more a layer, for every token),
not arithmetic. A CUDA graph replays all of them with one launch, but only with the same shapes and
the same memory every time. So `StaticStep` keeps the token and the position in fixed tensors, and
passes the position to `GPT.last_logits` as a 0-d tensor: the KV cache then writes at that position
and the attention reads the whole cache under a mask of the filled positions (`KVCache.update`).
`CudaGraphStep` records that call; each later token is one replay.

A large model on a CPU is the opposite case: each step reads every weight from memory once, so its
speed is that of the matrix-vector products. `pack_linears` swaps its Linear layers for copies whose
weights oneDNN has laid out for it, which it reads faster than the plain layout.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from model import GPT
from model.cache import KVCache


class StaticStep:
    """step(idx (B, 1), pos: int) -> logits (B, vocab): `GPT.last_logits(idx, pos)` with positions
    0..pos-1 in `caches`.

    The model's own forward on fixed buffers; on a CPU it is only slower than `GPT.last_logits` with
    an int position, and it exists to be recorded as a CUDA graph (the tests run it as it is)."""

    def __init__(self, model: GPT, caches: list[KVCache]):
        # weakly: steps are kept per model in a WeakKeyDictionary, and a strong reference from the
        # value would keep its key, the model, alive for good
        self.model, self.caches = weakref.proxy(model), caches
        device = model.transformer.wte.weight.device
        self.token = torch.zeros(caches[0].k.size(0), 1, dtype=torch.long, device=device)  # (B, 1)
        self.pos = torch.zeros((), dtype=torch.long, device=device)

    def forward(self) -> torch.Tensor:
        return self.model.last_logits(self.token, start_pos=self.pos)

    def run(self) -> torch.Tensor:
        return self.forward()

    def __call__(self, idx: torch.Tensor, pos: int) -> torch.Tensor:
        self.token.copy_(idx)
        self.pos.fill_(pos)
        for cache in self.caches:  # what the write at a tensor position leaves to the caller
            cache.length = pos + 1
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
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.forward()

    def run(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


# One recorded graph per model, reused while its batch size, dtype and weights' memory stay the same.
_graph_steps: weakref.WeakKeyDictionary[GPT, tuple[tuple, CudaGraphStep]] = weakref.WeakKeyDictionary()


def use_cuda_graph(model: GPT) -> bool:
    return model.transformer.wte.weight.device.type == "cuda" and not model.training


def graph_step(model: GPT, batch_size: int) -> CudaGraphStep | None:
    """The model's recorded step for this batch size (recorded now if need be), its caches attached;
    None where recording fails, with a warning (decoding then runs the model eagerly)."""
    params = tuple(p.data_ptr() for p in model.parameters())
    key = (batch_size, model.transformer.wte.weight.dtype, params)
    known = _graph_steps.get(model)
    if known is not None and known[0] == key:
        model.set_kv_cache(batch_size, caches=known[1].caches)
        return known[1]
    _graph_steps.pop(model, None)  # one graph per model: free the old one's caches first
    try:
        step = CudaGraphStep(model, model.set_kv_cache(batch_size))
    except RuntimeError as err:
        model.clear_kv_cache()
        warnings.warn(f"CUDA graph recording failed ({err}); decoding without it", stacklevel=3)
        return None
    _graph_steps[model] = (key, step)
    return step


PACK_ABOVE_BYTES = 64 * 2**20  # weights this large stream from memory every step: worth packing


def pack_linears(model: GPT) -> dict[str, nn.Linear]:
    """Swap the Linear layers of a large float32 model in eval mode on a CPU with oneDNN for packed
    copies (`torch.utils.mkldnn`), and return the originals by name, for `unpack_linears`; for any
    other model, do nothing and return {}. The blocks stay as they are written: only their Linear
    modules change, and each gives the same numbers up to float rounding."""
    weight = model.transformer.wte.weight
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    cpu = weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    if not cpu or model.training or size <= PACK_ABOVE_BYTES:
        return {}
    from torch.utils import mkldnn  # its import warns that TorchScript is deprecated: only when used

    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    for name, linear in linears.items():
        model.set_submodule(name, mkldnn.to_mkldnn(linear))
    return linears


def unpack_linears(model: GPT, linears: dict[str, nn.Linear]) -> None:
    """Put back the Linear layers `pack_linears` took out."""
    for name, linear in linears.items():
        model.set_submodule(name, linear)
