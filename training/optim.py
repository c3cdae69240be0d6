"""The optimizers (AdamW with parameter groups; Muon for the blocks' weight matrices beside AdamW for the
rest) and the learning-rate schedules."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

# How the learning rate decays after warmup: from 1 at the decay's start (progress 0) to 0 at its end
# (progress 1); lr_factor lifts it to end at min_lr_ratio instead. The names are optim.schedule's choices.
SCHEDULES: dict[str, Callable[[float], float]] = {
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1.0 - progress,
    "constant": lambda progress: 1.0,
}


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Multiplier of the peak learning rate at an optimizer step.

    Linear warmup from ~0 to 1 over warmup_steps, then `schedule` from 1 down to min_lr_ratio at
    total_steps (and min_lr_ratio after it). total_steps <= 0 means unknown: the decay is skipped.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= 0:
        return 1.0
    return decay_factor((step - warmup_steps) / max(1, total_steps - warmup_steps), min_lr_ratio, schedule)


def decay_factor(progress: float, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Multiplier after warmup, `progress` of the way (0 to 1) through the decay."""
    decay = SCHEDULES[schedule](min(1.0, max(0.0, progress)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


class TimeBudgetSchedule:
    """For runs limited by time, not steps (trainer.max_time with max_steps=-1): warmup over steps,
    then the decay follows the share of the time budget spent, so the learning rate reaches its
    floor when the time is up, whatever the machine's speed. `elapsed`: the training time spent so far
    (Lightning's Timer, which a resumed run restores, so the decay goes on where it stopped); without
    it, the time since the first step."""

    def __init__(
        self,
        seconds: float,
        warmup_steps: int,
        min_lr_ratio: float,
        schedule: str,
        elapsed: Callable[[], float] | None = None,
    ):
        self.seconds, self.warmup_steps, self.min_lr_ratio, self.schedule = (
            seconds,
            warmup_steps,
            min_lr_ratio,
            schedule,
        )
        self.elapsed = elapsed
        self.started: float | None = None  # when the first step ran

    def __call__(self, step: int) -> float:
        now = time.monotonic()
        if self.started is None:
            self.started = now
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        spent = self.elapsed() if self.elapsed is not None else now - self.started
        return decay_factor(spent / self.seconds, self.min_lr_ratio, self.schedule)


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


def make_optimizer(model: nn.Module, optim: dict) -> torch.optim.Optimizer:
    """The optimizer optim.name names (adamw when a run's settings predate the choice)."""
    return OPTIMIZERS[optim.get("name", "adamw")](model, optim)


def block_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the linear layers inside the transformer blocks (attention and MLP projections):
    the hidden matrices Muon is meant for. Embeddings and the tied output layer are not among them."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".h." in f".{name}" and module.weight.requires_grad:
            found.append(module.weight)
    return found


def orthogonalize(matrix: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """Newton-Schulz iterations that take a matrix towards the nearest one with all singular values
    about 1 (U V^T of its SVD), as torch.optim.Muon does: in bfloat16 on GPUs, where it is fast, and in
    float32 (or the matrix's wider type) elsewhere, as a CPU without bfloat16 units multiplies bfloat16
    matrices some 30 times slower."""
    a, b, c = coefficients
    x = matrix.to(torch.bfloat16 if matrix.is_cuda else torch.promote_types(matrix.dtype, torch.float32))
    wide = x.size(0) <= x.size(1)
    if not wide:
        x = x.T  # the Gram matrix x x^T is then the smaller of the two
    x = x / x.norm().clamp(min=eps)  # singular values at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def update_scale(shape: torch.Size, adjust_lr_fn: str | None) -> float:
    """How much the learning rate is scaled for a matrix of this shape (torch.optim.Muon's adjust_lr_fn):
    "match_rms_adamw" gives the update the size an AdamW update has; "original" or None, sqrt(rows / cols)
    for tall matrices."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # the quintic's coefficients (torch.optim.Muon's, from Muon's authors)


class Muon(torch.optim.Optimizer):
    """Muon as torch.optim.Muon (torch 2.9+) defines it, with the same settings and state (one momentum
    buffer per matrix, so either loads the other's state_dict): momentum, Nesterov's look-ahead, the
    update orthogonalised by `orthogonalize`, decoupled weight decay, the step scaled by `update_scale`.
    Written here so that it runs on every torch the project supports, and on a CPU in float32, where
    torch's, orthogonalising in bfloat16, spends about a second a step on the default model."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NEWTON_SCHULZ,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
    ):
        if lr < 0 or weight_decay < 0 or momentum < 0:
            raise ValueError(f"lr, weight_decay and momentum must be >= 0, got {lr}, {weight_decay}, {momentum}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() != 2:
                    raise ValueError(f"Muon takes matrices only; got a parameter of shape {tuple(param.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update.to(param.dtype), alpha=-lr * update_scale(param.shape, group["adjust_lr_fn"]))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """Muon (momentum, then the update orthogonalised by Newton-Schulz iterations) for the blocks' weight
    matrices, AdamW for embeddings, biases and LayerNorm gains, seen by Lightning and the learning-rate
    schedule as one optimizer: its param_groups are both optimizers' own groups (so the schedule sets
    both), its state_dict holds both. Muon's step is scaled to match AdamW's update size
    (adjust_lr_fn="match_rms_adamw"), so one optim.lr serves both."""

    def __init__(self, model: nn.Module, lr: float, weight_decay: float, betas, momentum: float):
        matrices = block_matrices(model)
        chosen = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
        self.muon = Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn="match_rms_adamw")
        decay = [p for p in rest if p.dim() >= 2]  # the embeddings (one of them tied to the output layer)
        no_decay = [p for p in rest if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        try:
            self.adamw = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=True)
        except (RuntimeError, ValueError):
            self.adamw = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas))
        self.combined = False  # while Optimizer.__init__ checks the groups, they are its own list
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self.combined = True

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizers' groups, looked up each time: loading a state replaces their dicts.
        (getattr, not this instance's __dict__: Lightning's optimizer wrapper subclasses this class and
        forwards attributes it lacks to the optimizer it wraps.)"""
        if not getattr(self, "combined", False):
            return self.__dict__.setdefault("registering", [])
        return [*self.muon.param_groups, *self.adamw.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.__dict__["registering"] = value

    @property
    def state(self) -> dict:
        """Both optimizers' per-parameter state (the dicts themselves, so moving them to a device works)."""
        return {**self.muon.state, **self.adamw.state}

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ sets an empty one; the inner optimizers keep theirs
        pass

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(
                "this optimizer state is not optim=muon's (muon and adamw); continue the run with its own optim"
            )
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


# optim.name's choices: each makes its optimizer from the model and the optim settings
OPTIMIZERS: dict[str, Callable[[nn.Module, dict], torch.optim.Optimizer]] = {
    "adamw": lambda model, o: make_adamw(model, o["lr"], o["weight_decay"], o["betas"]),
    "muon": lambda model, o: MuonAdamW(model, o["lr"], o["weight_decay"], o["betas"], o["momentum"]),
}
