"""SIGINT (Ctrl-C) or SIGTERM (`kill`, a scheduler's stop) while a run trains: the run stops after the
micro-batch under way, a checkpoint of its last finished optimizer step is written, and it stops with the
command that continues it (train.py then exits with 130 or 143, as for a stop before training: a stopped
run is not a finished one). Outside the training loop, shell.ctrl_c takes them."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import lightning as L

import checkpoint
from shell.ctrl_c import WATCH
from training.checkpoints import PeriodicCheckpoints

log = logging.getLogger(__name__)


class GracefulStop(L.Callback):
    """On SIGINT or SIGTERM while training: stop after the micro-batch under way, checkpoint the last
    finished optimizer step, and stop. A step of many micro-batches (gradient accumulation) may take
    minutes, longer than a scheduler waits after its SIGTERM: a stop inside one drops the part done (its
    gradients are never applied), and the checkpoint is the state as the step began, which a continued run
    takes up as an uninterrupted one would. A second SIGINT while stopping interrupts at once (the
    checkpoint is already written)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: str | None = None  # the signal taken, by name
        self.stopped_at: int | None = None  # the step it stopped the run at
        self.saved: Path | None = None
        self.previous: dict[int, Any] = {}
        self.dropped = 0  # micro-batches of the step under way that a stop dropped
        self.step_rng: dict[str, Any] | None = None  # the random generators as the step under way began

    def handle(self, signum, frame) -> None:
        if self.requested == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        self.requested = signal.Signals(signum).name
        log.warning("%s received: stopping after this micro-batch, then saving a checkpoint", self.requested)

    def on_train_start(self, trainer, pl_module) -> None:
        for sig in self.SIGNALS:  # after Lightning's own SIGTERM handler, which would stop mid-epoch
            self.previous[sig] = signal.signal(sig, self.handle)
        WATCH.training_started()

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.accumulation > 1 and pl_module.micro_batch == 0:  # a step begins (a few kB copied)
            self.step_rng = checkpoint.rng_states()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.stopped_at is not None:
            return
        requested = self.requested is not None
        if trainer.world_size > 1:  # every micro-batch, as Lightning itself asks the processes of a stop
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if not requested:
            return
        if not pl_module.step_done:
            self.stop_inside_step(trainer, pl_module)
        elif not 0 < trainer.max_steps <= trainer.global_step:  # (the last step: the run ends there anyway)
            self.stop(trainer)

    def stop_inside_step(self, trainer, pl_module) -> None:
        """Stop part way through a step's micro-batches: the checkpoint is the state as the step began (see
        on_save_checkpoint), and no validation runs."""
        self.dropped = pl_module.micro_batch
        if self.step_rng is not None:  # dropout drew from them in the micro-batches dropped
            checkpoint.set_rng_states(self.step_rng)
        log.warning(
            "%s: the step under way is dropped after %d of its %d micro-batches; the run continues from step %d",
            self.requested, self.dropped, pl_module.accumulation, trainer.global_step,
        )  # fmt: skip
        self.stop(trainer, validate=False)

    def stop(self, trainer, validate: bool = True) -> None:
        """Checkpoint now and stop. Lightning validates whenever should_stop is set; a stop validates only
        where the run would have anyway, so that it comes at once and a resumed run's history is an
        uninterrupted one's."""
        checkpoints = next(c for c in trainer.callbacks if isinstance(c, PeriodicCheckpoints))
        self.saved = checkpoints.save(trainer)  # (the step's own, if written already)
        self.stopped_at = checkpoints.stopped_at = trainer.global_step
        epoch_loop = trainer.fit_loop.epoch_loop
        scheduled = validate and epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
        if trainer.world_size > 1:  # (a validation every so much time: each process has its own clock)
            scheduled = trainer.strategy.reduce_boolean_decision(scheduled, all=False)
        trainer.should_stop = True
        epoch_loop._skip_next_val = not scheduled

    def on_save_checkpoint(self, trainer, pl_module, ckpt: dict[str, Any]) -> None:
        if self.dropped:
            forget_micro_batches(ckpt, self.dropped)

    def on_train_end(self, trainer, pl_module) -> None:
        self.restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.restore()


def forget_micro_batches(ckpt: dict[str, Any], count: int) -> None:
    """A checkpoint written `count` micro-batches into an optimizer step, made the one written as the step
    began: the weights, the optimizer and the schedule change only at a step's end, the data is drawn by
    step (data.datamodule.StepSampler), and Lightning's counts of micro-batches, which decide when it
    validates, go back by `count`."""
    loop = ckpt["loops"]["fit_loop"]
    for counts in (loop["epoch_loop.batch_progress"]["total"], loop["epoch_loop.batch_progress"]["current"]):
        for name in counts:
            counts[name] -= count
    loop["epoch_loop.state_dict"]["_batches_that_stepped"] -= count
