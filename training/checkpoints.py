"""Checkpoints that survive anything: atomic writes, periodic saves with pruning, and a clean stop on
SIGINT/SIGTERM. Which files a run folder holds, and which one a resumed run continues from, is
shell.run_folder's.
"""

from __future__ import annotations

import io
import logging
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy

from shell.ctrl_c import WATCH
from shell.run_folder import RunFolder
from training import failpoints

log = logging.getLogger(__name__)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint beside its target and renames it into place once it is complete and
    on disk, so a kill or a full disk mid-write leaves the previous file whole."""

    def __init__(self):
        super().__init__()
        self.failed_steps: set[int] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        step = int(checkpoint.get("global_step", 0))
        try:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            data = buffer.getbuffer()
            with open(tmp, "wb") as out:
                if step not in self.failed_steps and failpoints.active("enospc", step):
                    self.failed_steps.add(step)
                    raise failpoints.disk_full(tmp)
                if step not in self.failed_steps and failpoints.active("kill_save", step):
                    out.write(data[: len(data) // 2])
                    out.flush()
                    failpoints.kill_now()
                if failpoints.once("ctrl_c_save", step):
                    out.write(data[: len(data) // 2])
                    failpoints.interrupt_now()
                    failpoints.interrupt_now()
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except BaseException as err:  # a full disk, Ctrl-C twice: nothing was overwritten, and no part is left
            tmp.unlink(missing_ok=True)
            if isinstance(err, OSError):  # shell.run says what is left, and how to go on
                raise OSError(err.errno, err.strerror, str(path)) from None
            raise


class FSDP2Strategy(ModelParallelStrategy):
    """trainer.strategy=fsdp: Lightning's ModelParallelStrategy with every process one data-parallel
    rank (no tensor parallelism); GPTModule.configure_model shards the model. Unlike Lightning's FSDP1
    strategy it runs on CPUs (gloo) as well as GPUs.

    Each checkpoint is gathered whole on the first process and written as one process writes it: plain
    tensors under the model's own names, the tied weights one tensor, and the optimizer state numbered
    as one process's optimizer numbers it, group by group (Lightning's own strategy numbers it in the
    model's order), so that a run continues on any number of devices, with or without sharding."""

    def __init__(self):
        super().__init__(tensor_parallel_size=1, save_distributed_checkpoint=False)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # the world size, known only now
        super().setup_environment()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()  # whole on the first process, empty on the others
        if state:
            first: dict[torch.nn.Parameter, str] = {}
            for name, param in self.model.named_parameters(remove_duplicate=False):
                state[name] = state[first.setdefault(param, name)]
        return state

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
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
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        whole = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=whole)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", []), strict=False):
            named = rekeyed(state, self.parameter_names(optimizer).__getitem__)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=named, options=whole)
        return checkpoint

    def parameter_names(self, optimizer) -> list[str]:
        """The optimizer's parameters by name, in the order one process's optimizer numbers them."""
        names = {param: name for name, param in self.model.named_parameters()}  # a tied weight by its first name
        return [names[param] for group in optimizer.param_groups for param in group["params"]]


def rekeyed(state: dict[str, Any], key) -> dict[str, Any]:
    """An optimizer state dict with each parameter's key (a number or a name) replaced by key(it)."""
    groups = [{**group, "params": [key(param) for param in group["params"]]} for group in state["param_groups"]]
    return {"state": {key(param): values for param, values in state["state"].items()}, "param_groups": groups}


def realign_accumulation(checkpoint: dict[str, Any], accumulation: int) -> None:
    """A run continued on another number of devices keeps its global batch, so each process takes another
    number of micro-batches per step. Lightning finds where a step ends from its count of micro-batches,
    restored from the checkpoint: counted in the old accumulation, the first step would take what is left
    to the next multiple of the new one (half a batch, say). The counts are rescaled to the new one."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    steps = checkpoint.get("global_step", 0)
    if not progress or steps <= 0 or progress["total"]["ready"] % steps:
        return
    before = progress["total"]["ready"] // steps
    if before == accumulation:
        return
    for counts in (progress["total"], progress["current"]):
        ready = counts["ready"] // before * accumulation
        for field in counts:  # the others trail "ready" by the micro-batches under way as it was saved
            counts[field] = ready - (counts["ready"] - counts[field])


class PeriodicCheckpoints(L.Callback):
    """Saves `step-NNNNNN.ckpt` every `every_n_steps` optimizer steps and at the end, points
    `last.ckpt` at the newest, and deletes all but the newest `keep`."""

    def __init__(self, folder: RunFolder, every_n_steps: int, keep: int, validate_every: int | None = None):
        self.folder, self.every_n_steps, self.keep = folder, every_n_steps, keep
        self.validate_every = validate_every  # steps between validations (None: by time, or never)
        self.saved_step, self.saved_validated = -1, False  # the step last written, and whether after its validation
        self.after_validation: int | None = None  # a step whose file waits for the step's validation
        self.stopped_at: int | None = None  # the step a signal stopped the run at (see GracefulStop)

    def save(self, trainer: L.Trainer) -> Path:
        """Checkpoint the current state (every process must call this; rank 0 writes)."""
        step = trainer.global_step
        path = self.folder.step_checkpoint(step)
        # the step's file, written before the step's validation, is written again after it (not after a
        # stop: the validation a stop lets finish is not part of the state a continued run starts from)
        validated = self.stopped_at is None and trainer.lightning_module.validated_step == step
        if self.saved_step == step and (self.saved_validated or not validated):
            return path
        trainer.save_checkpoint(path, weights_only=False)  # the whole state: weights, optimizer, loops
        self.saved_step, self.saved_validated = step, validated
        if trainer.is_global_zero:
            link_last(self.folder.last, path)
            self.prune()
        return path

    def prune(self) -> None:
        steps = self.folder.step_checkpoints()
        for old in steps[: max(0, len(steps) - self.keep)]:
            old.unlink(missing_ok=True)

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:  # files of a write that was cut short; never mistaken for checkpoints
            for stale in self.folder.checkpoints.glob(".*.tmp"):
                stale.unlink(missing_ok=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if failpoints.active("kill", step) and step != self.saved_step:
            failpoints.kill_now()
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
        # the final state, whatever the step, after the final validation (written again if the step's
        # file was written before it), so that a run stopped before its end is recorded is only ended
        self.save(trainer)
        if failpoints.active("kill_end", trainer.global_step):
            failpoints.kill_now()


def link_last(link: Path, target: Path) -> None:
    """Point link (last.ckpt) at target, a file beside it, replacing the link atomically."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    os.replace(tmp, link)


class BestCheckpoint(ModelCheckpoint):
    """best.ckpt: the checkpoint of the lowest validation loss (Lightning's ModelCheckpoint), which stays
    the best when the run folder was moved or copied before it is resumed. Lightning forgets the best
    score saved under another folder, so the first validation after would replace best.ckpt whatever it
    scored; here the score is kept and the paths saved are read as the same files in the new folder."""

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


class GracefulStop(L.Callback):
    """On SIGINT or SIGTERM: finish the optimizer step under way, checkpoint, and stop.

    A second SIGINT while stopping interrupts at once (the checkpoint is already written).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, checkpoints: PeriodicCheckpoints):
        self.checkpoints = checkpoints
        self.requested: str | None = None
        self.stopped_at: int | None = None
        self.saved: Path | None = None
        self.previous: dict[int, Any] = {}
        self.last_step = 0

    def handle(self, signum, frame) -> None:
        if self.requested == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        self.requested = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then saving a checkpoint and stopping", self.requested)

    def on_train_start(self, trainer, pl_module) -> None:
        self.last_step = trainer.global_step
        for sig in self.SIGNALS:  # after Lightning's own SIGTERM handler, which would stop mid-epoch
            self.previous[sig] = signal.signal(sig, self.handle)
        WATCH.training_started()  # (Ctrl-C while a launch's processes start: shell.ctrl_c)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.last_step:
            return  # accumulating: the optimizer step is not finished yet
        self.last_step = trainer.global_step
        requested = self.requested is not None
        if trainer.world_size > 1:
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if 0 < trainer.max_steps <= trainer.global_step:
            return  # the last step: the run ends here anyway, and records its end
        if requested and self.stopped_at is None:
            self.saved = self.checkpoints.save(trainer)
            self.stopped_at = self.checkpoints.stopped_at = trainer.global_step
            # Lightning validates whenever should_stop is set; a stop validates only where the run would
            # have anyway, so that it comes at once and a resumed run's history is an uninterrupted one's
            epoch_loop = trainer.fit_loop.epoch_loop
            scheduled = epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
            if trainer.world_size > 1:  # (a validation every so much time: each process has its own clock)
                scheduled = trainer.strategy.reduce_boolean_decision(scheduled, all=False)
            trainer.should_stop = True
            epoch_loop._skip_next_val = not scheduled

    def on_train_end(self, trainer, pl_module) -> None:
        self.restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.restore()
