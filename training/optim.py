"""AdamW with parameter groups, and the learning-rate schedules."""

from __future__ import annotations

import math
import time

import torch
from torch import nn

SCHEDULES = ("cosine", "linear", "constant")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Multiplier of the peak learning rate at an optimizer step.

    Linear warmup from ~0 to 1 over warmup_steps, then `schedule` from 1 down to min_lr_ratio at
    total_steps (and min_lr_ratio after it). total_steps <= 0 means unknown: the decay is skipped.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {schedule!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= 0:
        return 1.0
    return decay_factor((step - warmup_steps) / max(1, total_steps - warmup_steps), min_lr_ratio, schedule)


def decay_factor(progress: float, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Multiplier after warmup, `progress` of the way (0 to 1) through the decay."""
    progress = min(1.0, max(0.0, progress))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


class TimeBudgetSchedule:
    """For runs limited by time, not steps (trainer.max_time with max_steps=-1): warmup over steps,
    then the decay follows the share of the time budget spent, so the learning rate reaches its
    floor when the time is up, whatever the machine's speed."""

    def __init__(self, seconds: float, warmup_steps: int, min_lr_ratio: float, schedule: str):
        if schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.seconds, self.warmup_steps, self.min_lr_ratio, self.schedule = seconds, warmup_steps, min_lr_ratio, schedule
        self.started: float | None = None  # when the first step ran

    def __call__(self, step: int) -> float:
        now = time.monotonic()
        if self.started is None:
            self.started = now
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return decay_factor((now - self.started) / self.seconds, self.min_lr_ratio, self.schedule)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear weights, embeddings) decay; biases and LayerNorm gains do not."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():  # a tied weight is listed once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_adamw(model: nn.Module, lr: float, weight_decay: float, betas, eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW with the fused kernel (one pass over each tensor, on GPUs and, since torch 2.4, CPUs:
    about 4x faster than the per-tensor loop on a CPU), else the default implementation."""
    groups = parameter_groups(model, weight_decay)
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without a fused kernel
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
