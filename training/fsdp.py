"""trainer.strategy=fsdp: PyTorch's FSDP2 (`fully_shard`) through Lightning's ModelParallelStrategy, every
process a data-parallel rank. Each block is sharded on its own; the model's root holds the embeddings, the
last LayerNorm and the tied output layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy

from model import GPT


def shard(model: GPT, mesh, precision: str) -> None:
    """Shards the model in place over the processes of a 1-D device mesh: each block is a unit of its
    own, its weights gathered just before its forward and its backward and freed after; the model itself
    holds the rest, whose output layer's weight is the token embedding's (one parameter, sharded once, so
    the two stay tied). Each process keeps, and the optimizer updates, a shard of every weight.

    Under bf16-mixed the weights are gathered and computed with in bf16 and the gradients reduced in
    fp32, while the shards stay fp32 (FSDP2's MixedPrecisionPolicy); Lightning's autocast keeps the
    LayerNorms, softmax and loss in fp32 as on one device."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "bf16-mixed":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


class FSDP2Strategy(ModelParallelStrategy):
    """trainer.strategy=fsdp: Lightning's ModelParallelStrategy with every process one data-parallel
    rank (no tensor parallelism); GPTModule.configure_model shards the model. Unlike Lightning's FSDP1
    strategy it runs on CPUs (gloo) as well as GPUs.

    Each checkpoint is gathered whole on the first process and written as one process writes it: plain
    tensors under the model's own names, the tied weights one tensor, and the optimizer state numbered
    as one process's optimizer numbers it, group by group (Lightning's own strategy numbers it in the
    model's order), so that a run continues on any number of devices, with or without sharding."""

    def __init__(self, world_size: int):
        super().__init__(data_parallel_size=world_size, tensor_parallel_size=1, save_distributed_checkpoint=False)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()  # whole on the first process, empty on the others
        if state:
            first: dict[torch.nn.Parameter, str] = {}
            for name, param in self.model.named_parameters(remove_duplicate=False):
                state[name] = state[first.setdefault(param, name)]
        return state

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # keyed by parameter name; empty on all processes but the first
        state = get_optimizer_state_dict(self.model, optimizer, options=whole)
        if not state:
            return state
        number = {name: i for i, name in enumerate(self.parameter_names(optimizer))}
        return rekeyed(state, number.__getitem__)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """A whole checkpoint (this strategy's or one process's), each process taking its shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        ckpt = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        whole = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, ckpt.pop("state_dict"), options=whole)
        for optimizer, state in zip(self.optimizers, ckpt.get("optimizer_states", []), strict=False):
            named = rekeyed(state, self.parameter_names(optimizer).__getitem__)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=named, options=whole)
        return ckpt

    def parameter_names(self, optimizer) -> list[str]:
        """The optimizer's parameters by name, in the order one process's optimizer numbers them."""
        names = {param: name for name, param in self.model.named_parameters()}  # a tied weight by its first name
        return [names[param] for group in optimizer.param_groups for param in group["params"]]


def rekeyed(state: dict[str, Any], key) -> dict[str, Any]:
    """An optimizer state dict with each parameter's key (a number or a name) replaced by key(it)."""
    groups = [{**group, "params": [key(param) for param in group["params"]]} for group in state["param_groups"]]
    return {"state": {key(param): values for param, values in state["state"].items()}, "param_groups": groups}
