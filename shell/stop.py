"""SIGINT (Ctrl-C) or SIGTERM (`kill`, a scheduler's stop) while a run trains: the step under way ends,
a checkpoint is written, and the run stops with the command that continues it. Outside the training
loop, shell.ctrl_c takes them."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import lightning as L

from shell.ctrl_c import WATCH
from training.checkpoints import PeriodicCheckpoints

log = logging.getLogger(__name__)


class GracefulStop(L.Callback):
    """On SIGINT or SIGTERM while training: finish the optimizer step under way, checkpoint, and stop.
    A second SIGINT while stopping interrupts at once (the checkpoint is already written)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: str | None = None  # the signal taken, by name
        self.stopped_at: int | None = None  # the step it stopped the run at
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
        WATCH.training_started()

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
            self.stop(trainer)

    def stop(self, trainer) -> None:
        """Checkpoint now and stop. Lightning validates whenever should_stop is set; a stop validates only
        where the run would have anyway, so that it comes at once and a resumed run's history is an
        uninterrupted one's."""
        checkpoints = next(c for c in trainer.callbacks if isinstance(c, PeriodicCheckpoints))
        self.saved = checkpoints.save(trainer)
        self.stopped_at = checkpoints.stopped_at = trainer.global_step
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
