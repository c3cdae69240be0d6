"""A step whose gradient is not finite (a NaN or inf loss, an overflow) is skipped, not applied; too many
in a row, or weights that are no longer finite, end the run with TrainingDiverged. The decision is made on
the device, so that a GPU step never waits for its loss to come back; the counts are read back only on
logging steps and checkpoints."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss or the weights stopped being finite numbers. `instead`: what else may help."""

    def __init__(self, message: str, instead: str = ""):
        super().__init__(message)
        self.instead = instead


class NonFiniteSteps:
    """Counts, on the device, the updates skipped, the non-finite steps in a row, and the longest such run
    since the counts were last read."""

    def __init__(self, max_in_a_row: int, skipped: int = 0, in_a_row: int = 0, settled_step: int = 0):
        self.max_in_a_row = max_in_a_row
        self.skipped, self.in_a_row = skipped, in_a_row  # as last read back from the device
        self.counts = torch.tensor([skipped, in_a_row, in_a_row])
        self.settled_step = settled_step  # the counts of the steps up to this one have been read

    def skip_if_not_finite(self, norm: torch.Tensor, optimizer) -> None:
        """Count this step, and make the optimizer leave weights and moments alone if `norm` is not
        finite. Fused AdamW takes the decision as its `found_inf` flag, on the device; other optimizers
        (Muon, AdamW without a fused kernel) are given no gradients, which needs the decision on the host."""
        finite = torch.isfinite(norm)
        counts = self.counts.to(finite.device)
        bad = (~finite).to(counts.dtype)
        in_a_row = (counts[1] + 1) * bad
        self.counts = torch.stack([counts[0] + bad, in_a_row, torch.maximum(counts[2], in_a_row)])
        if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and optimizer.defaults.get("fused"):
            optimizer.found_inf = (~finite).float()
        elif not finite:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None  # AdamW and Muon skip parameters without a gradient

    def settle(self, step: int) -> int | None:
        """Read back the counts through optimizer step `step` (the one wait for the device they cost):
        warn of updates skipped since the last read, and stop the run when max_in_a_row steps in a row
        were not finite. Returns the total skipped when some were, for the loggers."""
        if step <= self.settled_step:
            return None
        skipped, in_a_row, longest = (int(v) for v in self.counts.tolist())
        since, self.settled_step = self.settled_step + 1, step
        self.counts[2] = self.counts[1]  # the longest run from here on starts with the current one
        new, self.skipped, self.in_a_row = skipped - self.skipped, skipped, in_a_row
        if new == 1 and since == step:
            log.warning("step %d: the loss or its gradient is not finite; this update is skipped", step)
        elif new:
            log.warning(
                "steps %d-%d: %d of their updates skipped, as the loss or its gradient was not finite", since, step, new
            )
        if longest >= self.max_in_a_row:
            raise TrainingDiverged(
                f"training diverged: {longest} steps in a row (up to step {step}) had a non-finite loss",
                instead="raise optim.max_nonfinite_in_a_row to wait longer",
            )
        return skipped if new else None

    def state(self) -> dict[str, int]:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}


def check_weights(model: torch.nn.Module, step: int, clip: float | None, strategy, sharded: bool) -> None:
    """Refuse to checkpoint weights that are no longer finite: the checkpoints written so far stay the
    newest. Sharded, each process checks its shards and the processes add up what they found (every
    process saves a checkpoint, so all must decide alike)."""
    named = list(model.named_parameters())
    if not sharded:
        bad = next((name for name, p in named if not torch.isfinite(p).all()), None)
    else:
        broken = torch.stack([~torch.isfinite(p.to_local()).all() for _, p in named]).float()
        found = strategy.reduce(broken, reduce_op="sum").nonzero()
        bad = named[int(found[0])][0] if len(found) else None
    if bad is not None:
        raise TrainingDiverged(
            f"training diverged: at step {step} the weights are no longer finite ({bad}), and no checkpoint was "
            "written from them",
            instead=f"clip the gradients harder than trainer.gradient_clip_val={clip}"
            if clip
            else "clip the gradients: trainer.gradient_clip_val=1.0",
        )
