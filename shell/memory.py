"""Whether a training step can fit in this machine's memory, said before the run makes anything.

A CPU run whose micro-batch cannot fit is killed by the kernel part way into its first step, with no
word of why (the shell says "Killed") and a run folder left without a checkpoint. The estimate here is
of what a step must hold at the least, so that a run refused for it could not have trained:

- the weights, their gradients and AdamW's two moments: 16 bytes a parameter (12 with Muon, whose
  matrices keep one), and
- the activations kept for the backward pass, per token of the micro-batch: about 14 floats per
  width per layer (the inputs of the two LayerNorms, of c_attn, c_proj, c_fc and the GELU, q, k and
  v, the MLP's 4x hidden layer before and after the GELU, and the residual sums), the attention
  weights (one float per head and key) when the explicit kernel writes them out, and three floats per
  vocabulary entry for the logits, their softmax and its gradient.

The blocks' share is checked against what the model keeps for its backward pass, counted by torch's
saved-tensor hooks (tests/test_memory_estimate.py); the peak memory of whole training steps, measured
on a CPU (a process's maxrss at batches 64 and 256), grew by 1.1-1.4 times the estimate: a run whose
estimate fits in the memory free, but not 1.4 times it, is warned. Half the activations under a 16-bit
precision (and the weights too, with bf16-true); twice both with 64-bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from model import GPTConfig

GiB = 2**30


class StepMemory(NamedTuple):
    activations: int  # bytes kept for the backward pass of one micro-batch
    state: int  # bytes of weights, gradients and optimizer moments

    @property
    def total(self) -> int:
        return self.activations + self.state


def parameter_count(config: GPTConfig) -> int:
    """The model's parameters (the tied lm_head counted once), biases included."""
    C, L = config.n_embd, config.n_layer
    per_block = 12 * C * C + 13 * C  # four weight matrices, their biases, two LayerNorms
    return config.vocab_size * C + config.block_size * C + L * per_block + 2 * C


def float_bytes(precision: str) -> tuple[int, int]:
    """(bytes of a weight, bytes of an activation) under a Lightning precision: 64-bit doubles both,
    16-bit "true" halves both, mixed 16-bit halves the activations only."""
    precision = str(precision)
    if precision.startswith("64"):
        return 8, 8
    if "16" in precision:
        return (2, 2) if precision.endswith("true") else (4, 2)
    return 4, 4


def step_memory(
    config: GPTConfig, micro_batch: int, precision: str = "32-true", optimizer: str = "adamw"
) -> StepMemory:
    """A lower estimate of what one training step holds at its peak (see the module's docstring)."""
    C, L, T, V = config.n_embd, config.n_layer, config.block_size, config.vocab_size
    attention_weights = config.n_head * T if config.attention == "explicit" else 0
    floats_per_token = L * (14 * C + attention_weights) + 3 * V
    weight, activation = float_bytes(precision)
    moments = 2 if optimizer == "adamw" else 1
    return StepMemory(activation * floats_per_token * micro_batch * T, weight * (2 + moments) * parameter_count(config))


def free_memory(meminfo: str | None = None, cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process could still take: the kernel's MemAvailable plus free swap, or less where a
    cgroup (a container's or a scheduler's limit) allows less. None where it cannot be told."""
    try:
        text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if rest.split() and rest.split()[0].isdigit():
            fields[name] = int(rest.split()[0]) * 1024
    if "MemAvailable" not in fields:
        return None
    free = fields["MemAvailable"] + fields.get("SwapFree", 0)
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = (cgroup / "memory.current").read_text().strip()
        if limit.isdigit() and used.isdigit():
            free = min(free, int(limit) - int(used))
    except OSError:
        pass
    return free


# What a training process holds of its own before its model and data, at least: Python, torch and
# Lightning (a run of a tiny model peaked at 0.5 GiB resident, the libraries' shared pages included)
PROCESS_MEMORY = 300 * 2**20


def check_fits(
    config: GPTConfig, micro_batch: int, precision: str, optimizer: str, processes: int, free: int | None
) -> str | None:
    """Why a CPU run of this shape cannot fit in `free` bytes with `processes` processes on this machine
    (DDP's each hold a whole step); None where it may."""
    if free is None:
        return None
    need = step_memory(config, micro_batch, precision, optimizer)
    if need.total * processes <= free:
        if processes > 1 and (need.total + PROCESS_MEMORY) * processes > free:
            return (
                f"{processes} processes (trainer.devices) take at least {size(PROCESS_MEMORY)} each before their "
                f"model (Python, torch, Lightning), {size((need.total + PROCESS_MEMORY) * processes)} in all with "
                f"their training steps, more than the {size(free)} this machine has free; start fewer"
            )
        return None
    each = " each" if processes > 1 else ""
    here = f"{size(free)} this machine has free" + (f" for {processes} processes" if processes > 1 else "")
    if need.state * processes > free:
        return (
            f"this model's weights, gradients and optimizer state alone take {size(need.state)}{each}, more than the "
            f"{here}; choose a smaller model"
        )
    return (
        f"a training step of this model at data.batch_size={micro_batch} needs at least {size(need.total)}{each} "
        f"({size(need.activations)} of activations for {micro_batch} x {config.block_size} tokens, {size(need.state)} "
        f"of weights, gradients and optimizer state), more than the {here}; use a smaller data.batch_size (with "
        "tokens_per_step set, gradient accumulation keeps the global batch) or a smaller model"
    )


def size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB"


MEASURED_OVER_ESTIMATE = 1.4  # the most a whole step's peak was measured above the estimate


def tight_fit(
    config: GPTConfig, micro_batch: int, precision: str, optimizer: str, processes: int, free: int | None
) -> str | None:
    """A warning for a run that may fit and may not: its estimate fits in `free`, and the most it was
    measured above the estimate does not."""
    if free is None:
        return None
    need = step_memory(config, micro_batch, precision, optimizer).total * processes
    if need <= free < need * MEASURED_OVER_ESTIMATE:
        return (
            f"a training step of this model at data.batch_size={micro_batch} needs at least {size(need)}, and up to "
            f"about {size(int(need * MEASURED_OVER_ESTIMATE))}, of the {size(free)} this machine has free; if the run "
            "is killed with no message, use a smaller data.batch_size (with tokens_per_step set to keep the global batch)"
        )
    return None


def process_count_here(world_size: int, num_nodes: int) -> int:
    return max(1, world_size // max(1, num_nodes))


def this_machine_free() -> int | None:
    return free_memory() if os.name == "posix" else None
