"""The callbacks that log and sample: speed and MFU, text samples after every validation, the loss curve,
and a validation at the last step."""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from tokenizers import Tokenizer

from data.writes import write_atomically
from generation.session import Sampling, Session
from training.module import logged_step, logging_step

log = logging.getLogger(__name__)


class Throughput(L.Callback):
    """Logs train/tokens_per_sec (all processes, over a sliding window of batches), train/tokens_seen and
    train/mfu: model FLOPs utilisation against the device's peak, never above 1. `peak_flops(device,
    precision)` says a device's peak (None: unknown, and no MFU); `on_faster(device, precision, rate)`
    hears of a device that ran faster than it, whose peak is then raised to that rate."""

    def __init__(
        self,
        tokens_per_step: int,
        world_size: int,
        precision: str,
        peak_flops: Callable[[torch.device, str], float | None] | None = None,
        on_faster: Callable[[torch.device, str, float], None] | None = None,
        window: int = 20,
    ):
        self.tokens_per_step, self.world_size, self.precision = tokens_per_step, world_size, precision
        self.peak_flops, self.on_faster = peak_flops, on_faster
        self.times: deque[float] = deque(maxlen=window + 1)
        self.tokens: deque[int] = deque(maxlen=window + 1)
        self.flops_per_token = 0.0
        self.peak: float | None = None
        self.device: torch.device | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self.flops_per_token = pl_module.model.config.flops_per_token()
        self.device = pl_module.device
        self.peak = self.peak_flops(self.device, self.precision) if self.peak_flops else None
        if self.peak_flops and self.peak is None:
            log.info("peak FLOP/s of %s unknown: train/mfu is not logged", self.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(batch[0].numel() * self.world_size)
        if not pl_module.step_done:
            return
        pl_module.log_train("train/tokens_seen", float(trainer.global_step * self.tokens_per_step))
        if len(self.times) < 2:
            return
        rate = sum(list(self.tokens)[1:]) / (self.times[-1] - self.times[0])  # tokens after the first stamp
        pl_module.log_train("train/tokens_per_sec", rate)
        if self.peak:
            achieved = rate / self.world_size * self.flops_per_token
            # a peak passed is raised on logging steps alone; on another step the figure is capped at 1
            logged = logging_step(trainer)
            pl_module.log_train("train/mfu", self.utilisation(achieved) if logged else min(1.0, achieved / self.peak))

    def utilisation(self, achieved: float) -> float:
        """One device's achieved FLOP/s over its peak. A rate above the peak shows the peak too low (a
        CPU running above every clock it names): the peak is raised to it, so the figure never exceeds 1."""
        if achieved > self.peak:
            log.info("%s reached %.4g FLOP/s, above its assumed peak of %.4g: the peak is raised to it",
                     self.device, achieved, self.peak)  # fmt: skip
            self.peak = achieved
            if self.on_faster:
                self.on_faster(self.device, self.precision, achieved)
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
        step = logged_step(trainer)  # beside the val/loss it follows
        with open(self.path, "a", encoding="utf-8") as out:
            for prompt, text in rows:
                out.write(f"## step {step}, prompt {prompt!r}\n\n```\n{text}\n```\n\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                log_wandb_table(logger, step, rows)
            elif isinstance(logger, TensorBoardLogger):
                for i, (prompt, text) in enumerate(rows):
                    logger.experiment.add_text(
                        f"samples/{i}", f"**{prompt}**\n\n    " + text.replace("\n", "\n    "), step
                    )


def log_wandb_table(logger: WandbLogger, step: int, rows: list[tuple[str, str]]) -> None:
    """The samples as a wandb table. wandb writes the table into a temporary folder before it stages it
    for its log; that folder is made in the wandb run's own tmp/, not the system's, where a process that
    ends without cleaning up (killed) would leave a copy of the samples."""
    run = logger.experiment
    table = [[step, prompt, text] for prompt, text in rows]
    with temporary_files_in(None if run.disabled else Path(run.dir).parent / "tmp"):
        logger.log_text("samples", columns=["step", "prompt", "text"], data=table, step=step)


@contextmanager
def temporary_files_in(folder: Path | None) -> Iterator[None]:
    """The temporary files and folders Python's tempfile makes meanwhile go into `folder` (made if need
    be); with None, into the system's temporary folder as always."""
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    before, tempfile.tempdir = tempfile.tempdir, str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = before


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
            if logging_step(trainer):
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


class ValidateAtEnd(L.Callback):
    """Ends training through `should_stop` at the last step, so that Lightning validates there and the
    checkpoints (best and last) describe the final weights."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True
