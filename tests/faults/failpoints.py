"""Fault injection for the tests, from outside the program: the tests run train.py (or any script) with
this folder on PYTHONPATH and TINYGPT2_FAILPOINT set, and sitecustomize.py, which Python imports at start,
installs the faults below: Lightning callbacks added to every Trainer the process makes, and wrappers
around the writes the tests break (checkpoint.write_bytes, data.prepare.join_shards). Nothing of this is
in the program itself.

TINYGPT2_FAILPOINT holds comma-separated points, each `name:first[-last]` in optimizer steps:

    kill:5        SIGKILL the process when step 5 has finished (before its checkpoint)
    kill_save:5   SIGKILL the process halfway through writing the first checkpoint file of step 5
    kill_end:5    SIGKILL the process when training has ended at step 5 and its last checkpoint is
                  written, before the run's result is recorded
    kill_val:5    SIGKILL the process as the validation after step 5 begins
    sigint:5      send the process SIGINT (Ctrl-C) as step 5 begins (its first micro-batch)
    sigterm:5     send the process SIGTERM (`kill`, a scheduler's stop) as step 5 begins
    ctrl_c_save:5 send the process SIGINT twice (Ctrl-C, and again) halfway through writing the first
                  checkpoint file of step 5
    nan:3-5       make the loss of steps 3 to 5 not a number
    nan_weights:4 make a weight not a number after step 4 (an update that broke the weights)
    enospc:4      fail the first checkpoint write of step 4 with "no space left on device"
    cache_enospc:1  fail the joining of a token cache entry's shards (its largest write) as a full disk does

Steps count from 1 (the step that makes global_step 1 is step 1).
"""

from __future__ import annotations

import errno
import functools
import importlib.abc
import importlib.util
import os
import signal
import sys
from pathlib import Path

ENV = "TINYGPT2_FAILPOINT"
FOLDER = Path(__file__).resolve().parent  # what the tests put on PYTHONPATH


def points() -> dict[str, tuple[int, int]]:
    found = {}
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        name, _, steps = item.partition(":")
        first, _, last = steps.partition("-")
        found[name.strip()] = (int(first), int(last or first))
    return found


def active(name: str, step: int) -> bool:
    """Whether failpoint `name` covers optimizer step `step` (1-based)."""
    span = points().get(name)
    return span is not None and span[0] <= step <= span[1]


FIRED: set[tuple[str, int]] = set()


def once(name: str, step: int) -> bool:
    """active(), but true only the first time in this process."""
    if (name, step) in FIRED or not active(name, step):
        return False
    FIRED.add((name, step))
    return True


def kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def interrupt_now(signum: int = signal.SIGINT) -> None:
    os.kill(os.getpid(), signum)


# ---- the training loop -----------------------------------------------------------------------------


def fault_callbacks():
    """Two callbacks: one that runs before the run's own at each hook (a kill before the step's
    checkpoint), one after them (weights broken after the step's checkpoint, as an update would)."""
    import lightning as L

    class Faults(L.Callback):
        def __init__(self, early: bool):
            self.early = early

        def on_fit_start(self, trainer, pl_module) -> None:
            if self.early:
                pl_module.model.lm_head.register_forward_hook(
                    lambda head, args, logits: (
                        logits * float("nan") if pl_module.training and active("nan", trainer.global_step + 1) else None
                    )
                )

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.early and once("sigint", trainer.global_step + 1):
                interrupt_now()
            if self.early and once("sigterm", trainer.global_step + 1):
                interrupt_now(signal.SIGTERM)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if not pl_module.step_done:
                return
            if self.early and active("kill", step):
                kill_now()
            if not self.early and once("nan_weights", step):
                weight = pl_module.model.transformer.wte.weight
                import torch

                with torch.no_grad():
                    (weight.to_local() if pl_module.sharded else weight)[0, 0] = float("nan")

        def on_validation_epoch_start(self, trainer, pl_module) -> None:
            if self.early and not trainer.sanity_checking and active("kill_val", trainer.global_step):
                kill_now()

        def on_train_end(self, trainer, pl_module) -> None:
            if not self.early and active("kill_end", trainer.global_step):
                kill_now()

    return Faults(early=True), Faults(early=False)


def add_to_trainers(trainer_class) -> None:
    """Every Trainer made from now on gets the two fault callbacks, first and last."""
    original = trainer_class.__init__
    if getattr(original, "with_faults", False):
        return

    @functools.wraps(original)  # (its signature is what the settings check trainer.* against)
    def __init__(self, *args, callbacks=None, **kwargs):
        early, late = fault_callbacks()
        callbacks = [callbacks] if callbacks is not None and not isinstance(callbacks, list) else callbacks or []
        original(self, *args, callbacks=[early, *callbacks, late], **kwargs)

    __init__.with_faults = True
    trainer_class.__init__ = __init__


# ---- writes ----------------------------------------------------------------------------------------

SAVING_STEP: list[int] = []  # the step of the checkpoint being written


def wrap_checkpoint(module) -> None:
    save, write_bytes = module.save, module.write_bytes
    failed: set[int] = set()

    def save_at_step(ckpt, path):
        SAVING_STEP[:] = [int(ckpt.get("global_step", 0))]
        return save(ckpt, path)

    def faulty_write(out, data) -> None:
        step = SAVING_STEP[0] if SAVING_STEP else -1
        if step not in failed and active("enospc", step):
            failed.add(step)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), out.name)
        if step not in failed and active("kill_save", step):
            out.write(data[: len(data) // 2])
            out.flush()
            kill_now()
        if once("ctrl_c_save", step):
            out.write(data[: len(data) // 2])
            interrupt_now()
            interrupt_now()
        write_bytes(out, data)

    module.save, module.write_bytes = save_at_step, faulty_write


def wrap_token_cache(module) -> None:
    join_shards = module.join_shards

    def faulty_join(folder, count, target, names=None):
        if names is None and "cache_enospc" in points():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(target) / "train.bin"))
        return join_shards(folder, count, target, names)

    module.join_shards = faulty_join


# ---- installing them -------------------------------------------------------------------------------

WRAPPERS = {
    "lightning.pytorch.trainer.trainer": lambda module: add_to_trainers(module.Trainer),
    "checkpoint": wrap_checkpoint,
    "data.prepare": wrap_token_cache,
}


class AfterImport(importlib.abc.MetaPathFinder):
    """Wraps each module of WRAPPERS as it is imported."""

    def find_spec(self, name, path, target=None):
        if name not in WRAPPERS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            WRAPPERS[name](module)

        spec.loader.exec_module = exec_and_wrap
        return spec


def install() -> None:
    """Install the faults in this process: now for the modules already imported, else as they are."""
    for name, wrap in WRAPPERS.items():
        if name in sys.modules:
            wrap(sys.modules[name])
    if not any(isinstance(finder, AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, AfterImport())
