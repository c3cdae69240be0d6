"""Ctrl-C (SIGINT) and SIGTERM (`kill`, a scheduler's stop). While the run trains, `StopOnSignal` ends it after
the micro-batch under way with a checkpoint of its last finished step; anywhere else, `stops_raised` makes
them a `Stopped` where the program is. Either way the process exits with 128 + the signal's number (130,
143), as a shell reports a process the signal ended, so that `train.py && next` never takes a stopped run
for a finished one."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import Any

import lightning as L

import checkpoint
from training.checkpoints import PeriodicCheckpoints

log = logging.getLogger(__name__)

STOPS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):  # as KeyboardInterrupt: no library's `except Exception` takes it
    """A stop signal, raised where the program was; `at_checkpoint`: the training loop took it after the
    micro-batch under way and wrote the checkpoint of its last finished step."""

    def __init__(self, signum: int, at_checkpoint: bool = False):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.at_checkpoint = signum, at_checkpoint

    @property
    def status(self) -> int:
        return 128 + self.signum


def stop(signum, frame) -> None:
    raise Stopped(signum)


class HeldStops:
    """A stop signal's handler that keeps the signal for later: from choosing a run's folder until the job that
    takes back what it made (Hydra makes the folder and its record in between), where stops_raised raises it."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def __call__(self, signum, frame) -> None:
        self.taken.append(signum)


def hold_stops() -> None:
    holder = HeldStops()
    for signum in STOPS:
        signal.signal(signum, holder)


@contextlib.contextmanager
def stops_raised() -> Iterator[None]:
    """While held, SIGINT and SIGTERM raise Stopped where the program is (one held before, at once); the handlers
    before come back after."""
    before = {signum: signal.signal(signum, stop) for signum in STOPS}
    try:
        if taken := [s for h in before.values() if isinstance(h, HeldStops) for s in h.taken]:
            for holder in before.values():
                holder.taken.clear()
            raise Stopped(taken[0])
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


class StopOnSignal(L.Callback):
    """A stop signal while training stops the run after the micro-batch under way, with a checkpoint: of the
    step just done, after its validation where the step validates (so that a continued run neither repeats
    nor lacks it); inside a step of many micro-batches (which may take longer than a scheduler waits), of
    the step's start, the part done dropped. A stop at the last step lets the run end. A second Ctrl-C
    stops at once. `validate_every`: steps between validations (None: by time)."""

    def __init__(self, validate_every: int | None):
        self.validate_every = validate_every
        self.checkpoints: PeriodicCheckpoints | None = None
        self.requested: int | None = None  # the signal taken
        self.dropped = 0  # micro-batches of the step under way that the stop dropped
        self.step_rng: dict[str, Any] | None = None  # the random generators as the step under way began
        self.after_validation = False
        self.before: dict[int, Any] = {}

    def handle(self, signum, frame) -> None:
        if self.requested == signal.SIGINT == signum:
            raise Stopped(signum)  # asked twice: stop now
        self.requested = signum
        log.warning("%s received: stopping after this micro-batch, then saving a checkpoint", self.name)

    def on_train_start(self, trainer, pl_module) -> None:
        self.checkpoints = next(c for c in trainer.callbacks if isinstance(c, PeriodicCheckpoints))
        self.before = {signum: signal.signal(signum, self.handle) for signum in STOPS}  # in place of Lightning's own

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.accumulation > 1 and pl_module.micro_batch == 0:  # a step begins (a few kB copied)
            self.step_rng = checkpoint.rng_states()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        requested = self.requested is not None
        if trainer.world_size > 1:  # every micro-batch, so that every process stops at the same one
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if not requested or self.after_validation or 0 < trainer.max_steps <= trainer.global_step:
            return  # (at the last step the run ends anyway)
        if pl_module.step_done and self.validate_every and trainer.global_step % self.validate_every == 0:
            self.after_validation = True  # the step validates: its checkpoint comes after
            return
        if not pl_module.step_done:
            self.dropped = pl_module.micro_batch
            if self.step_rng is not None:  # dropout drew from them in the micro-batches dropped
                checkpoint.set_rng_states(self.step_rng)
            log.warning(
                "%s: the step under way is dropped after %d of its %d micro-batches; the run continues from step %d",
                self.name, self.dropped, pl_module.accumulation, trainer.global_step,
            )  # fmt: skip
        self.stop(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.after_validation and not trainer.sanity_checking:
            self.stop(trainer)

    def stop(self, trainer) -> None:
        self.checkpoints.save(trainer)
        raise Stopped(self.requested or signal.SIGTERM, at_checkpoint=True)  # (SIGTERM: another process took it)

    @property
    def name(self) -> str:
        return signal.Signals(self.requested or signal.SIGTERM).name

    def on_save_checkpoint(self, trainer, pl_module, ckpt: dict[str, Any]) -> None:
        """A checkpoint written part way through a step is the one written as the step began: the weights,
        optimizer and schedule change only at a step's end, the data is drawn by step (StepSampler), and
        Lightning's counts of micro-batches, which decide when it validates, go back by those dropped."""
        progress = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        for counts in (progress["total"], progress["current"]):
            for name in counts:
                counts[name] -= self.dropped

    def on_train_end(self, trainer, pl_module) -> None:
        self.give_back()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.give_back()

    def give_back(self) -> None:
        for signum, handler in self.before.items():
            signal.signal(signum, handler)
        self.before.clear()
