"""The checkpoints a run writes: `step-NNNNNN.ckpt` every so many steps (the newest few kept, `last.ckpt`
linking the newest), `best.ckpt` at the lowest validation loss, each written whole or not at all. Where
best.ckpt and a step file hold the same step's state after its validation, they are one file (a hard
link), not two copies. What a checkpoint holds is checkpoint.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

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
        self.stopped_at: int | None = None  # the step a signal stopped the run at (set by the shell)

    @property
    def last(self) -> Path:
        return self.folder / checkpoint.LAST_NAME

    def save(self, trainer: L.Trainer) -> Path:
        """Checkpoint the current state (every process must call this; the first writes)."""
        step = trainer.global_step
        path = checkpoint.step_file(self.folder, step)
        # the step's file, written before the step's validation, is written again after it (not after a
        # stop: the validation a stop lets finish is not part of the state a continued run starts from)
        validated = self.stopped_at is None and trainer.lightning_module.validated_step == step
        if self.saved_step == step and (self.saved_validated or not validated):
            return path
        trainer.save_checkpoint(path, weights_only=False)  # the whole state: weights, optimizer, loops
        self.saved_step, self.saved_validated = step, validated
        if trainer.is_global_zero:
            best = next((c for c in trainer.callbacks if isinstance(c, BestCheckpoint)), None)
            if validated and best is not None and best.saved_step == step:
                # best.ckpt was written after this step's validation: the same weights, and this file
                # holds the state of the step's end too
                checkpoint.share(path, best.saved_to)
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


class BestCheckpoint(ModelCheckpoint):
    """best.ckpt: the checkpoint of the lowest validation loss (Lightning's ModelCheckpoint), which stays
    the best when the run folder was moved or copied before it is resumed: the paths it saved are read
    as the same files in the new folder, where Lightning would forget the score."""

    def __init__(self, folder: Path):
        super().__init__(
            dirpath=folder,
            filename=Path(checkpoint.BEST_NAME).stem,
            monitor="val/loss",
            mode="min",
            save_top_k=1,
            auto_insert_metric_name=False,
            enable_version_counter=False,
        )
        self.saved_step = -1  # the step best.ckpt was last written at, by this process
        self.saved_to: Path | None = None

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        """best.ckpt; the step's file, written after the same validation (PeriodicCheckpoints), becomes
        the same file: it then also knows this step to be the best, which it was written too early to."""
        super()._save_checkpoint(trainer, filepath)
        self.saved_step = step = trainer.global_step
        self.saved_to = Path(filepath)
        periodic = next((c for c in trainer.callbacks if isinstance(c, PeriodicCheckpoints)), None)
        if trainer.is_global_zero and periodic is not None and periodic.holds_validated(step):
            checkpoint.share(self.saved_to, checkpoint.step_file(periodic.folder, step))

    @property
    def state_key(self) -> str:  # ModelCheckpoint's own, so that either reads the other's saved state
        return "ModelCheckpoint" + super().state_key.removeprefix(type(self).__qualname__)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_in = state_dict.get("dirpath")
        if saved_in and self.dirpath and saved_in != self.dirpath:
            state_dict = moved(state_dict, Path(saved_in), Path(self.dirpath))
        super().load_state_dict(state_dict)


def moved(state: dict[str, Any], old: Path, new: Path) -> dict[str, Any]:
    """ModelCheckpoint's saved state with the paths of files under `old` made the same files under `new`."""

    def here(path: Any) -> Any:
        if not isinstance(path, str) or not path or not Path(path).is_relative_to(old):
            return path
        return str(new / Path(path).relative_to(old))

    state = {key: here(value) for key, value in state.items()}
    state["best_k_models"] = {here(path): score for path, score in (state.get("best_k_models") or {}).items()}
    return {**state, "dirpath": str(new)}
