"""The training progress: on a terminal, a bar of optimizer steps (or the time budget) with the loss, the
latest validation and tokens per second, console log lines written above it; where the output is a
file or a pipe (nohup, a cluster's job log, CI), plain lines, at most one every LINE_SECONDS, and one
after each validation."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import IO

from lightning.pytorch.callbacks import ProgressBar as LightningProgressBar
from lightning.pytorch.callbacks import Timer, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

LINE_SECONDS = 30.0  # the shortest time between two progress lines in a log file (validations add theirs)


def progress_callback(accumulation: int, stream: IO | None = None) -> LightningProgressBar:
    """The run's progress, for where it is shown (`stream`, sys.stdout unless given): the bar on a
    terminal; plain lines elsewhere, where each redraw of a bar would be one more line of the log."""
    stream = sys.stdout if stream is None else stream
    return ProgressBar(accumulation) if on_a_terminal(stream) else ProgressLines()


def on_a_terminal(stream: IO | None) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # a stand-in without isatty, or a closed stream
        return False


class BudgetBar(Tqdm):
    """The training bar of a run limited by time: `n` and `total` are seconds, shown as the time spent
    of the budget, with the optimizer step. The time spent may pass the budget while the last step and
    its validation finish; the bar then stays full."""

    FORMAT = "{l_bar}{bar}| {spent}/{budget} [step {step}{postfix}]"

    def __init__(self, *args, spent: float = 0.0, step: int = 0, **kwargs) -> None:
        self.spent, self.step = spent, step  # before tqdm's first draw reads them
        super().__init__(*args, bar_format=self.FORMAT, **kwargs)

    @property
    def format_dict(self) -> dict:
        values = super().format_dict
        return {
            **values,
            "spent": self.format_interval(self.spent),
            "budget": self.format_interval(self.total or 0),
            "step": self.step,
        }


class AboveTheBars(logging.Handler):
    """Stands in for a console log handler while a bar is drawn: tqdm clears the bars, the handler writes
    its line, tqdm draws them again, so that no log line lands inside a bar."""

    def __init__(self, console: logging.StreamHandler) -> None:
        super().__init__(console.level)
        self.console = console

    def handle(self, record: logging.LogRecord) -> bool:
        with Tqdm.external_write_mode(file=self.console.stream):
            return self.console.handle(record)


class ProgressBar(TQDMProgressBar):
    """A tqdm bar over optimizer steps, or over the time budget of a run limited by `trainer.max_time`
    (max_steps=-1), that shows loss, validation figures and tokens per second.

    It redraws at most every REDRAW_SECONDS: a redraw after every step costs about half a millisecond,
    a few percent of a small model's step on a CPU. The validation bar is throttled the same way, and
    hidden when the output is not a terminal (a log file), where each of its redraws would be a line.
    While the training bar is up, console log lines are written above it; it closes when the training
    epoch ends, so that Lightning's last words ("`Trainer.fit` stopped: ...") get a line of their own."""

    SHOWN = {"train/loss": "loss", "val/loss": "val_loss", "val/bpc": "val_bpc", "train/tokens_per_sec": "tok/s"}
    REDRAW_SECONDS = 0.2

    def __init__(self, accumulation: int) -> None:
        super().__init__()
        self.accumulation = accumulation
        self.drawn_at = self.val_drawn_at = float("-inf")
        self.batches_done: int | None = None  # the count the bar shows once it is next drawn
        self.started_at = 0  # the micro-batches of the steps done when the bar was made
        self.timer: Timer | None = None  # the time budget, for runs limited by time
        self.lifted: list[logging.Logger] = []  # loggers whose console handlers write above the bar

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = {**pl_module.latest_train_values, **super().get_metrics(trainer, pl_module)}
        shown = {}
        for key, label in self.SHOWN.items():
            if key in metrics:
                value = float(metrics[key])
                shown[label] = f"{value:.0f}" if label == "tok/s" else f"{value:.3f}"
        return shown

    def init_train_tqdm(self) -> Tqdm:
        """Steps done of max_steps (in micro-batches), counted from the step a resumed run starts at, so
        that its rate and time left are its own; or, without max_steps, time spent of trainer.max_time
        (Lightning's Timer keeps the time of the runs before a resume)."""
        trainer = self.trainer
        timers = [c for c in trainer.callbacks if isinstance(c, Timer) and c.time_remaining() is not None]
        self.timer = timers[0] if trainer.max_steps <= 0 and timers else None
        common = dict(
            desc="training",
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
        )
        if self.timer is not None:
            spent, budget = self.timer.time_elapsed(), self.timer.time_elapsed() + self.timer.time_remaining()
            return BudgetBar(spent=spent, step=trainer.global_step, total=budget, initial=min(spent, budget), **common)
        total = trainer.max_steps * self.accumulation if trainer.max_steps > 0 else None
        self.started_at, self.batches_done = trainer.global_step * self.accumulation, None
        return Tqdm(total=total, initial=self.started_at, bar_format=self.BAR_FORMAT, **common)

    def init_validation_tqdm(self) -> Tqdm:
        below_training = self.trainer.state.fn != "validate"
        return Tqdm(
            desc=self.validation_description,
            position=2 * self.process_position + below_training,
            disable=self.is_disabled or not sys.stdout.isatty(),
            leave=not below_training,
            dynamic_ncols=True,
            file=sys.stdout,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.lift_console_logs()

    def on_train_epoch_start(self, trainer, *args) -> None:
        # the bar counts the run's steps, not the epoch's batches: it is made in on_train_start (which a
        # run resumed within its epoch goes through, and this hook not), and made again only if closed
        if self.is_enabled and self.train_progress_bar.disable:
            self.train_progress_bar = self.init_train_tqdm()
            self.lift_console_logs()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # counted from where the bar started, as batch_idx is in the micro-batches of the run that wrote the
        # checkpoint, which another number of devices divides into steps differently
        self.batches_done = (self.batches_done or self.started_at) + 1
        last = self.timer is None and self.batches_done == self.train_progress_bar.total
        if time.perf_counter() - self.drawn_at >= self.REDRAW_SECONDS or last:
            self.redraw(trainer, pl_module)

    def redraw(self, trainer, pl_module, count: bool = True, draw: bool = True) -> None:
        """The bar with the latest figures; with `count`, also the steps (or time) done so far."""
        bar = self.train_progress_bar
        if bar.disable:
            return
        if count and self.timer is not None:
            bar.spent, bar.step = self.timer.time_elapsed(), trainer.global_step
            bar.n = min(bar.spent, bar.total)
        elif count and self.batches_done is not None:
            bar.n = self.batches_done
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        if draw:
            bar.refresh()
            self.drawn_at = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.redraw(trainer, pl_module, draw=False)
        self.train_progress_bar.close()  # draws the bar once more, and ends its line
        self.drop_console_logs()

    def on_train_end(self, *args) -> None:
        super().on_train_end(*args)
        self.drop_console_logs()

    def on_exception(self, trainer, pl_module, exception) -> None:
        try:
            self.train_progress_bar.close()  # so that the traceback starts on a line of its own
        except TypeError:  # raised before there is a bar
            pass
        self.drop_console_logs()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        now = time.perf_counter()
        if now - self.val_drawn_at >= self.REDRAW_SECONDS or batch_idx + 1 == self.val_progress_bar.total:
            self.val_drawn_at = now
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.val_progress_bar.close()
        self.reset_dataloader_idx_tracker()
        if trainer.state.fn == "fit" and not trainer.sanity_checking and not trainer.should_stop:
            # the new figures, and the steps done: with validations closer together than REDRAW_SECONDS,
            # this is the only redraw between them
            self.redraw(trainer, pl_module)  # at the end, closing draws them

    def lift_console_logs(self) -> None:
        """Console log handlers (Hydra's on the root logger, Lightning's own) write above the bars."""
        if self.is_disabled:
            return
        consoles = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
        named = logging.Logger.manager.loggerDict.values()
        loggers = [logging.getLogger(), *(v for v in named if isinstance(v, logging.Logger))]
        for logger in loggers:
            if logger in self.lifted:
                continue
            handlers = [
                AboveTheBars(h) if isinstance(h, logging.StreamHandler) and h.stream in consoles else h
                for h in logger.handlers
            ]
            if handlers != logger.handlers:
                logger.handlers = handlers
                self.lifted.append(logger)

    def drop_console_logs(self) -> None:
        for logger in self.lifted:
            logger.handlers = [h.console if isinstance(h, AboveTheBars) else h for h in logger.handlers]
        self.lifted.clear()


class ProgressLines(LightningProgressBar):
    """The run's progress as plain lines, for output that is not a terminal: while training, one line
    at most every `interval` seconds (step, loss, tokens per second, time left), one after each
    validation (its loss and bits per character), and one at the last step. Being Lightning's progress
    bar callback, it stands in for Lightning's own bar. `clock`: seconds, time.monotonic unless a test
    gives its own; `out`: where the lines go, sys.stdout as it is at each line unless given."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, interval: float = LINE_SECONDS, out: IO | None = None
    ) -> None:
        super().__init__()
        self.clock, self.interval, self.out = clock, interval, out
        self.enabled = True
        self.started_at = self.written_at = 0.0
        self.start_step = self.seen_step = 0  # the step this run started from, and the last one seen
        self.written_step = -1  # the step of the last training line
        self.timer: Timer | None = None  # the time budget, for runs limited by time

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
        step = trainer.global_step
        if step == self.seen_step:
            return  # accumulating: the optimizer step is not finished yet
        self.seen_step = step
        last = 0 < trainer.max_steps <= step
        if last or self.clock() - self.written_at >= self.interval:
            self.write_training_line(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        values = pl_module.latest_val_values
        if trainer.sanity_checking or "val/loss" not in values:
            return
        figures = [f"val_loss {values['val/loss']:.3f}"]
        if "val/bpc" in values:
            figures.append(f"val_bpc {values['val/bpc']:.3f}")
        self.write(" | ".join([self.step_words(trainer), *figures]))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step not in (self.written_step, self.start_step):  # stopped early, or by time
            self.write_training_line(trainer, pl_module)

    def write_training_line(self, trainer, pl_module) -> None:
        """A line such as: step 120/1814 | loss 2.410 | 11,200 tok/s | 2m31s left"""
        values = pl_module.latest_train_values
        figures = [self.step_words(trainer)]
        if "train/loss" in values:
            figures.append(f"loss {values['train/loss']:.3f}")
        if "train/tokens_per_sec" in values:
            figures.append(f"{values['train/tokens_per_sec']:,.0f} tok/s")
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
        """The time left: of the time budget, or at this run's own pace (since it started or resumed);
        at the end, the time it took."""
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
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
