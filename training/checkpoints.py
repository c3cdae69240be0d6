"""The checkpoints a run writes: `step-NNNNNN.ckpt` every so many steps (the newest few kept, `last.ckpt`
linking the newest), `best.ckpt` at the lowest validation loss, each written whole or not at all. Where
best.ckpt and a step file hold the same step's state after its validation, they are one file (a hard
link), not two copies. What a checkpoint holds is checkpoint.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO

import checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's writer, writing each file whole or not at all (checkpoint.save)."""

    def save_checkpoint(self, ckpt: dict[str, Any], path, storage_options=None) -> None:
        checkpoint.save(ckpt, Path(path))


class PeriodicCheckpoints(L.Callback):
    """Saves `step-NNNNNN.ckpt` every `every_n_steps` optimizer steps and at the end, points `last.ckpt`
    at the newest, and deletes all but the newest `keep`. `validate_every`: steps between validations
    (None: by time, or never); a step that validates is saved after its validation."""

    def __init__(self, folder: Path, every_n_steps: int, keep: int, validate_every: int | None = None):
        self.folder, self.every_n_steps, self.keep = Path(folder), every_n_steps, keep
        self.validate_every = validate_every
        self.saved_step, self.saved_validated = -1, False  # the step last written, and whether after its validation
        self.after_validation: int | None = None  # a step whose file waits for the step's validation

    @property
    def last(self) -> Path:
        return self.folder / checkpoint.LAST_NAME

    def save(self, trainer: L.Trainer) -> Path:
        """Checkpoint the current state (every process must call this; the first writes)."""
        step = trainer.global_step
        path = checkpoint.step_file(self.folder, step)
        # the step's file, written before the step's validation, is written again after it
        validated = trainer.lightning_module.validated_step == step
        if self.saved_step == step and (self.saved_validated or not validated):
            return path
        trainer.save_checkpoint(path, weights_only=False)  # the whole state: weights, optimizer, loops
        self.saved_step, self.saved_validated = step, validated
        if trainer.is_global_zero:
            best = next((c for c in trainer.callbacks if isinstance(c, BestCheckpoint)), None)
            if validated and best is not None and best.saved_step == step:
                # best.ckpt was written after this step's validation: the same weights, and this file
                # holds the state of the step's end too
                checkpoint.share(path, best.path)
            checkpoint.link_last(self.last, path)
            steps = checkpoint.step_files(self.folder)
            for old in steps[: max(0, len(steps) - self.keep)]:
                old.unlink(missing_ok=True)
        return path

    def holds_validated(self, step: int) -> bool:
        """Whether this process wrote the step's file with the state after the step's validation."""
        return self.saved_step == step and self.saved_validated

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:  # files of a write that was cut short; never mistaken for checkpoints
            for stale in self.folder.glob(".*.tmp"):
                stale.unlink(missing_ok=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self.saved_step:
            if self.validate_every and step % self.validate_every == 0:
                # the step validates next: its file holds the state after that, so that a run continued
                # from it neither skips that validation nor lacks it in its logs and loss curve
                self.after_validation = step
            else:
                self.save(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        step = trainer.global_step
        if self.after_validation == step or self.saved_step == step:  # (validated by time: written before it)
            self.after_validation = None
            self.save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        # the final state, after the final validation, so that a run stopped before its end is
        # recorded only has its end to run
        self.save(trainer)


class BestCheckpoint(L.Callback):
    """best.ckpt: the checkpoint of the lowest validation loss, written after each validation that lowers it.
    Where the step's own file holds the state after the same validation (PeriodicCheckpoints), the two are
    one file: the step file is made best.ckpt's, which knows this step to be the best."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / checkpoint.BEST_NAME
        self.score: float | None = None  # the lowest validation loss so far
        self.saved_step = -1  # the step best.ckpt was last written at, by this process

    def on_validation_end(self, trainer, pl_module) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.sanity_checking or trainer.state.fn != "fit" or loss is None or not torch.isfinite(loss):
            return
        if self.score is not None and float(loss) >= self.score:
            return
        self.score, self.saved_step = float(loss), trainer.global_step
        trainer.save_checkpoint(self.path, weights_only=False)
        periodic = next((c for c in trainer.callbacks if isinstance(c, PeriodicCheckpoints)), None)
        if trainer.is_global_zero and periodic is not None and periodic.holds_validated(self.saved_step):
            checkpoint.share(self.path, checkpoint.step_file(periodic.folder, self.saved_step))

    def state_dict(self) -> dict[str, Any]:
        return {"score": self.score}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.score = state_dict.get("score")
