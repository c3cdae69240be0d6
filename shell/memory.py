"""Whether a CPU run's training step fits in the memory this machine has free, said before it starts: one that
cannot is killed by the kernel part way into its first step with no word of why. The estimate is of what a step
must hold at the least: the weights, their gradients and optimizer moments (16 bytes a parameter with AdamW,
12 with Muon), and per token of the micro-batch the activations kept for the backward pass (about 14 floats
per width per layer, the attention weights where the explicit kernel writes them, 3 per vocabulary entry for
the logits). tests/test_memory_estimate.py holds it against what the model keeps; whole steps were measured at
1.1-1.4 times the estimate, so a run whose estimate fits but not 1.4 times it is warned."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from model import GPTConfig

GiB = 2**30
PROCESS_MEMORY = 300 * 2**20  # what a training process holds before its model (Python, torch, Lightning)
MEASURED_OVER_ESTIMATE = 1.4  # the most a whole step's peak was measured above the estimate


class StepMemory(NamedTuple):
    activations: int  # bytes kept for the backward pass of one micro-batch
    state: int  # bytes of weights, gradients and optimizer moments

    @property
    def total(self) -> int:
        return self.activations + self.state


def parameter_count(config: GPTConfig) -> int:
    """The model's parameters (the tied lm_head counted once), biases included."""
    C, L = config.n_embd, config.n_layer
    return config.vocab_size * C + config.block_size * C + L * (12 * C * C + 13 * C) + 2 * C


def step_memory(
    config: GPTConfig, micro_batch: int, precision: str = "32-true", optimizer: str = "adamw"
) -> StepMemory:
    """A lower estimate of what one training step holds at its peak: 64-bit doubles both parts, 16-bit halves
    the activations, and the weights too where it is "true"."""
    C, L, T, V = config.n_embd, config.n_layer, config.block_size, config.vocab_size
    precision = str(precision)
    weight, activation = (8, 8) if precision.startswith("64") else (2, 2) if precision.endswith("16-true") else (4, 4)
    activation = 2 if "16" in precision else activation
    attention_weights = config.n_head * T if config.attention == "explicit" else 0
    per_token = L * (14 * C + attention_weights) + 3 * V
    moments = 2 if optimizer == "adamw" else 1
    return StepMemory(activation * per_token * micro_batch * T, weight * (2 + moments) * parameter_count(config))


def free_memory(meminfo: str | None = None, cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process could still take: MemAvailable plus free swap, or less where a cgroup (a container's or
    a scheduler's limit) allows less; None where it cannot be told."""
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
        limit, used = ((cgroup / name).read_text().strip() for name in ("memory.max", "memory.current"))
        if limit.isdigit() and used.isdigit():
            free = min(free, int(limit) - int(used))
    except OSError:
        pass
    return free


def check_fits(
    config: GPTConfig, micro_batch: int, precision: str, optimizer: str, processes: int, free: int | None
) -> str | None:
    """Why a CPU run of this shape cannot fit in `free` bytes with `processes` processes (DDP's each hold a whole
    step); None where it may."""
    if free is None:
        return None
    need = step_memory(config, micro_batch, precision, optimizer)
    if need.total * processes <= free:
        if processes > 1 and (need.total + PROCESS_MEMORY) * processes > free:
            return (
                f"{processes} processes (trainer.devices) take at least {size(PROCESS_MEMORY)} each before their model "
                f"(Python, torch, Lightning), {size((need.total + PROCESS_MEMORY) * processes)} in all with their "
                f"training steps, more than the {size(free)} this machine has free; start fewer"
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


def tight_fit(
    config: GPTConfig, micro_batch: int, precision: str, optimizer: str, processes: int, free: int | None
) -> str | None:
    """A warning for a run whose estimate fits in `free` and whose most measured above it does not."""
    need = step_memory(config, micro_batch, precision, optimizer).total * processes
    if free is None or not need <= free < need * MEASURED_OVER_ESTIMATE:
        return None
    return (
        f"a training step of this model at data.batch_size={micro_batch} needs at least {size(need)}, and up to about "
        f"{size(int(need * MEASURED_OVER_ESTIMATE))}, of the {size(free)} this machine has free; if the run is killed "
        "with no message, use a smaller data.batch_size (with tokens_per_step set to keep the global batch)"
    )


def size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB"


def process_count_here(world_size: int, num_nodes: int) -> int:
    return max(1, world_size // max(1, num_nodes))


def this_machine_free() -> int | None:
    return free_memory() if os.name == "posix" else None
