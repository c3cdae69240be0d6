"""The run's progress: Lightning's tqdm bar on a terminal, plain lines anywhere else (a log file, `nohup`, CI),
where each redraw of a bar would be one more line."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import IO

from lightning.pytorch.callbacks import ProgressBar, Timer, TQDMProgressBar
from tqdm.contrib.logging import logging_redirect_tqdm

LINE_SECONDS = 30.0  # the shortest time between two progress lines off a terminal (validations add theirs)
SHOWN = {"train/loss": "loss", "val/loss": "val_loss", "val/bpc": "val_bpc", "train/tokens_per_sec": "tok/s"}


def progress_callback(accumulation: int, stream: IO | None = None) -> ProgressBar:
    stream = sys.stdout if stream is None else stream
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # a stand-in without isatty, or a closed stream
        terminal = False
    return StepsBar(accumulation) if terminal else ProgressLines()


class StepsBar(TQDMProgressBar):
    """Lightning's bar over the run's micro-batches (its steps times the accumulation), from where a resumed run
    starts, redrawn every ten steps, with the loss, the latest validation and tokens per second; console log
    lines are written above it rather than through it."""

    def __init__(self, accumulation: int) -> None:
        super().__init__(refresh_rate=10 * accumulation)
        self.accumulation, self.seen = accumulation, 0
        self.redirect = logging_redirect_tqdm(loggers=[logging.getLogger(), logging.getLogger("lightning.pytorch")])

    def init_train_tqdm(self):
        bar = super().init_train_tqdm()
        trainer = self.trainer
        bar.total = trainer.max_steps * self.accumulation if trainer.max_steps > 0 else None  # (a time limit)
        bar.initial = bar.n = trainer.global_step * self.accumulation
        bar.set_description("training")
        return bar

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.redirect.__enter__()

    def on_train_epoch_start(self, trainer, *args) -> None:
        self.seen = 0  # a run is one epoch: the bar made as training starts (a resumed one too) counts it whole

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.seen += 1  # (Lightning's batch index goes on from the batches a resumed run counted on other devices)
        bar = self.train_progress_bar
        if (n := bar.initial + self.seen) % self.refresh_rate == 0 or n == bar.total:
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = {**pl_module.latest_train_values, **super().get_metrics(trainer, pl_module)}
        return {
            label: f"{float(metrics[key]):.{0 if label == 'tok/s' else 3}f}"
            for key, label in SHOWN.items()
            if key in metrics
        }

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self.redirect.__exit__(None, None, None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.train_progress_bar is not None:  # so that what follows starts on a line of its own
            self.train_progress_bar.close()
        self.redirect.__exit__(None, None, None)


class ProgressLines(ProgressBar):
    """Progress as plain lines: while training, one at most every `interval` seconds (step, loss, tokens per
    second, time left), one after each validation, and one at the last step. `clock`: seconds, time.monotonic
    unless a test gives its own; `out`: where the lines go, sys.stdout as it is at each line unless given."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, interval: float = LINE_SECONDS, out: IO | None = None
    ):
        super().__init__()
        self.clock, self.interval, self.out = clock, interval, out
        self.enabled = True
        self.started_at = self.written_at = 0.0
        self.start_step = self.seen_step = 0  # the step this run started from, and the last one seen
        self.written_step = -1  # the step of the last training line
        self.timer: Timer | None = None  # the time budget of a run limited by time

    def disable(self) -> None:  # (Lightning's call, in processes other than the first)
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def on_train_start(self, trainer, pl_module) -> None:
        self.started_at = self.written_at = self.clock()
        self.start_step = self.seen_step = trainer.global_step
        timers = [c for c in trainer.callbacks if isinstance(c, Timer) and c.time_remaining() is not None]
        self.timer = timers[0] if trainer.max_steps <= 0 and timers else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.seen_step:
            return  # accumulating: the optimizer step is not finished yet
        self.seen_step = trainer.global_step
        if 0 < trainer.max_steps <= trainer.global_step or self.clock() - self.written_at >= self.interval:
            self.write_training_line(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        values = pl_module.latest_val_values
        if trainer.sanity_checking or "val/loss" not in values:
            return
        figures = [
            f"val_loss {values['val/loss']:.3f}",
            *([f"val_bpc {values['val/bpc']:.3f}"] if "val/bpc" in values else []),
        ]
        self.write(" | ".join([self.step_words(trainer), *figures]))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step not in (self.written_step, self.start_step):  # stopped early, or by time
            self.write_training_line(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if getattr(exception, "at_checkpoint", False):  # stopped by a signal (shell.stops), its checkpoint written
            self.on_train_end(trainer, pl_module)

    def write_training_line(self, trainer, pl_module) -> None:
        """A line such as: step 120/1814 | loss 2.410 | 11,200 tok/s | 2m31s left"""
        values = pl_module.latest_train_values
        figures = [self.step_words(trainer)]
        figures += [f"loss {values['train/loss']:.3f}"] if "train/loss" in values else []
        figures += [f"{values['train/tokens_per_sec']:,.0f} tok/s"] if "train/tokens_per_sec" in values else []
        figures += [words] if (words := self.time_words(trainer)) else []
        self.write(" | ".join(figures))
        self.written_step = trainer.global_step

    def step_words(self, trainer) -> str:
        return (
            f"step {trainer.global_step}/{trainer.max_steps}"
            if trainer.max_steps > 0
            else f"step {trainer.global_step}"
        )

    def time_words(self, trainer) -> str | None:
        """The time left, of the time budget or at this run's own pace; at the end, the time it took."""
        now, step = self.clock(), trainer.global_step
        if self.timer is not None:
            left = self.timer.time_remaining() or 0.0
        elif step > self.start_step and trainer.max_steps > 0:
            left = (now - self.started_at) / (step - self.start_step) * max(0, trainer.max_steps - step)
        else:
            return None
        return f"{duration(left)} left" if left > 0 else f"took {duration(now - self.started_at)}"

    def write(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.out or sys.stdout, flush=True)
            self.written_at = self.clock()


def duration(seconds: float) -> str:
    """45s, 2m31s, 1h02m"""
    hours, rest = divmod(max(0, round(seconds)), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
