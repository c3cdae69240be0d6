"""Callbacks: speed and MFU, text samples, the loss curve, the progress bar, a validation at the end."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from tokenizers import Tokenizer

from generation.session import Sampling, Session
from shell.flops import device_peak_flops, flops_per_token, record_cpu_rate
from shell.run_folder import write_atomically
from training.module import logging_step, step_finished

log = logging.getLogger(__name__)


class Throughput(L.Callback):
    """Logs train/tokens_per_sec (all processes, over a sliding window of batches), train/mfu
    (model FLOPs utilisation against the device's peak, never above 1) and train/tokens_seen."""

    def __init__(self, tokens_per_step: int, world_size: int, precision: str, window: int = 20):
        self.tokens_per_step, self.world_size, self.precision = tokens_per_step, world_size, precision
        self.times: deque[float] = deque(maxlen=window + 1)
        self.tokens: deque[int] = deque(maxlen=window + 1)
        self.flops_per_token: float | None = None
        self.peak: float | None = None
        self.device: torch.device | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self.flops_per_token = flops_per_token(pl_module.model.config)
        self.device = pl_module.device
        self.peak = device_peak_flops(pl_module.device, self.precision)
        if self.peak is None:
            log.info("peak FLOP/s of %s unknown: train/mfu is not logged", pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(batch[0].numel() * self.world_size)
        if not step_finished(trainer):
            return
        pl_module.log_train("train/tokens_seen", float(trainer.global_step * self.tokens_per_step))
        if len(self.times) < 2:
            return
        rate = sum(list(self.tokens)[1:]) / (self.times[-1] - self.times[0])  # tokens after the first stamp
        pl_module.log_train("train/tokens_per_sec", rate)
        if self.peak:
            achieved = rate / self.world_size * self.flops_per_token
            # a peak that is passed is raised (said, and remembered on a CPU) on logging steps alone; another
            # step keeps its figure, capped at 1, for the case that a time limit makes it the last
            logged = logging_step(trainer, step_done=True)
            pl_module.log_train("train/mfu", self.utilisation(achieved) if logged else min(1.0, achieved / self.peak))

    def utilisation(self, achieved: float) -> float:
        """One device's achieved FLOP/s over its peak. A rate above the peak shows the peak too low (a
        CPU running above every clock it names): the peak is raised to it, and on a CPU remembered
        for later runs, so the figure never exceeds 1."""
        if achieved > self.peak:
            log.info(
                "%s reached %.4g FLOP/s, above its assumed peak of %.4g: the peak is raised to it",
                self.device,
                achieved,
                self.peak,
            )
            self.peak = achieved
            if self.device is not None and self.device.type == "cpu":
                record_cpu_rate(achieved, bf16="bf16" in str(self.precision))
        return achieved / self.peak

    def on_validation_start(self, trainer, pl_module) -> None:
        # validation (and sampling) time is not training time: restart the window
        self.times.clear()
        self.tokens.clear()


class TextSamples(L.Callback):
    """After every validation, continues fixed prompts and logs the text: a table in wandb, text in
    TensorBoard, and `samples.md` in the run folder."""

    def __init__(
        self,
        path: Path,
        tokenizer_json: str,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        seed: int,
        resume_step: int | None = None,
    ):
        self.path = Path(path)
        self.resume_step = resume_step
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.prompts = list(prompts) or [""]
        self.sampling = Sampling(max_new_tokens, temperature, top_k)
        self.seed = seed

    def generate(self, model, prompt: str) -> str:
        """The prompt and its continuation, as `generate.py` would write it with the same settings."""
        generator = torch.Generator(device=model.transformer.wte.weight.device).manual_seed(self.seed)
        return prompt + Session(model, self.tokenizer).complete(prompt, self.sampling, 1, [generator]).texts[0]

    def on_fit_start(self, trainer, pl_module) -> None:
        """A resumed run's samples.md keeps what was written before the checkpoint it continues from, as
        metrics.csv does: the samples of validations logged at or after its step are written again."""
        if self.resume_step is None or not trainer.is_global_zero or not self.path.is_file():
            return
        text = self.path.read_text(encoding="utf-8")
        for header in re.finditer(r"^## step (\d+), ", text, re.MULTILINE):
            # a section starts the file or follows the closing fence of the one before
            starts_section = header.start() == 0 or text[: header.start()].endswith("```\n\n")
            if starts_section and int(header.group(1)) >= self.resume_step:
                write_atomically(self.path, text[: header.start()])
                return

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None and not torch.isfinite(loss):
            return  # weights that give no finite loss give no probabilities to sample from
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            rows = [(prompt, self.generate(model, prompt)) for prompt in self.prompts]
        finally:
            model.train(was_training)
        # the step Lightning logged this validation's scalars at, as its own LearningRateMonitor reads it
        # (global_step - 1 after an optimizer step): the samples sit beside the val/loss they follow
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        with open(self.path, "a", encoding="utf-8") as out:
            for prompt, text in rows:
                out.write(f"## step {step}, prompt {prompt!r}\n\n```\n{text}\n```\n\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                table = [[step, prompt, text] for prompt, text in rows]
                logger.log_text("samples", columns=["step", "prompt", "text"], data=table, step=step)
            elif isinstance(logger, TensorBoardLogger):
                for i, (prompt, text) in enumerate(rows):
                    logger.experiment.add_text(
                        f"samples/{i}", f"**{prompt}**\n\n    " + text.replace("\n", "\n    "), step
                    )


class LossCurve(L.Callback):
    """Keeps train and val loss against tokens seen and draws `loss.png` in the run folder when the
    run ends. The history is part of the checkpoint, so a resumed run draws the whole curve.

    Each step's training loss stays on the device until a logging step reads the losses of the steps
    since the last in one go: a GPU step never waits for its loss to come back."""

    def __init__(self, path: Path, tokens_per_step: int):
        self.path = Path(path)
        self.tokens_per_step = tokens_per_step
        self.train: list[tuple[float, float]] = []
        self.val: list[tuple[float, float]] = []
        self.pending: list[torch.Tensor] = []  # micro-batch losses of the optimizer step under way
        self.unread: list[tuple[float, torch.Tensor]] = []  # (tokens seen, mean loss) of steps not yet read
        self.last_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.last_step = trainer.global_step  # above 0 when resuming

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None or not trainer.is_global_zero:
            return
        self.pending.append(loss.detach())
        if trainer.global_step != self.last_step:  # an optimizer step just happened
            tokens = trainer.global_step * self.tokens_per_step
            mean = self.pending[0] if len(self.pending) == 1 else torch.stack(self.pending).mean()
            self.unread.append((tokens, mean))
            self.pending.clear()
            self.last_step = trainer.global_step
            if logging_step(trainer, step_done=True):
                self.read()

    def read(self) -> None:
        """The unread steps' losses into the history, with one transfer from the device."""
        if self.unread:
            losses = torch.stack([loss.float() for _, loss in self.unread]).tolist()
            self.train.extend((tokens, loss) for (tokens, _), loss in zip(self.unread, losses, strict=True))
            self.unread.clear()

    def on_validation_end(self, trainer, pl_module) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None and not trainer.sanity_checking:
            self.val.append((trainer.global_step * self.tokens_per_step, float(loss)))

    def on_fit_end(self, trainer, pl_module) -> None:
        self.read()
        if trainer.is_global_zero and (self.train or self.val):
            draw_loss_curve(self.path, self.train, self.val, title=self.path.parent.name)

    def state_dict(self) -> dict[str, Any]:
        self.read()
        return {"train": self.train, "val": self.val}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train, self.val = [tuple(p) for p in state["train"]], [tuple(p) for p in state["val"]]


def draw_loss_curve(path: Path, train: list[tuple[float, float]], val: list[tuple[float, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    if train:
        tokens, losses = zip(*train, strict=True)
        ax.plot(tokens, losses, color="tab:blue", alpha=0.25, linewidth=0.8)
        ax.plot(tokens, smooth(losses), color="tab:blue", linewidth=1.8, label="train loss (smoothed)")
    if val:
        tokens, losses = zip(*val, strict=True)
        ax.plot(tokens, losses, "o-", color="tab:orange", linewidth=1.8, label="val loss")
        ax.annotate(f"{losses[-1]:.3f}", (tokens[-1], losses[-1]), textcoords="offset points", xytext=(4, 6))
    ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter())
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"tinygpt2 {title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # a stop mid-write leaves the old picture
    try:
        fig.savefig(partial, format="png")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        plt.close(fig)


def smooth(values, points: int = 40) -> list[float]:
    """Centred moving average over about len(values) / points neighbours: no lag, no start-up bias."""
    half = max(0, len(values) // points) // 2
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half) : i + half + 1]
        out.append(sum(window) / len(window))
    return out


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


class ValidateAtEnd(L.Callback):
    """Ends training through `should_stop` at the last step, so that Lightning validates there and the
    checkpoints (best and last) describe the final weights."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True
