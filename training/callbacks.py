"""Callbacks: speed and MFU, text samples, the loss curve, the progress bar, a validation at the end."""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from tokenizers import Tokenizer

from generation.session import Sampling, Session

from .flops import device_peak_flops, flops_per_token
from .module import logging_step

log = logging.getLogger(__name__)


class Throughput(L.Callback):
    """Logs train/tokens_per_sec (all processes, over a sliding window of batches), train/mfu
    (model FLOPs utilisation against the device's peak) and train/tokens_seen."""

    def __init__(self, tokens_per_step: int, world_size: int, precision: str, window: int = 20):
        self.tokens_per_step, self.world_size, self.precision = tokens_per_step, world_size, precision
        self.times: deque[float] = deque(maxlen=window + 1)
        self.tokens: deque[int] = deque(maxlen=window + 1)
        self.flops_per_token: float | None = None
        self.peak: float | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self.flops_per_token = flops_per_token(pl_module.model.config)
        self.peak = device_peak_flops(pl_module.device, self.precision)
        if self.peak is None:
            log.info("peak FLOP/s of %s unknown: train/mfu is not logged", pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(batch[0].numel() * self.world_size)
        if not logging_step(trainer, step_done=True):
            return
        pl_module.log_train("train/tokens_seen", float(trainer.global_step * self.tokens_per_step))
        if len(self.times) < 2:
            return
        rate = sum(list(self.tokens)[1:]) / (self.times[-1] - self.times[0])  # tokens after the first stamp
        pl_module.log_train("train/tokens_per_sec", rate)
        if self.peak:
            per_device = rate / self.world_size
            pl_module.log_train("train/mfu", per_device * self.flops_per_token / self.peak)

    def on_validation_start(self, trainer, pl_module) -> None:
        # validation (and sampling) time is not training time: restart the window
        self.times.clear()
        self.tokens.clear()


class TextSamples(L.Callback):
    """After every validation, continues fixed prompts and logs the text: a table in wandb, text in
    TensorBoard, and `samples.md` in the run folder."""

    def __init__(self, path: Path, tokenizer_json: str, prompts: list[str], max_new_tokens: int,
                 temperature: float, top_k: int | None, seed: int):
        self.path = Path(path)
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.prompts = list(prompts) or [""]
        self.sampling = Sampling(max_new_tokens, temperature, top_k)
        self.seed = seed

    def generate(self, model, prompt: str) -> str:
        """The prompt and its continuation, as `generate.py` would write it with the same settings."""
        generator = torch.Generator(device=model.transformer.wte.weight.device).manual_seed(self.seed)
        return prompt + Session(model, self.tokenizer).complete(prompt, self.sampling, 1, [generator]).texts[0]

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
        step = trainer.global_step
        with open(self.path, "a", encoding="utf-8") as out:
            for prompt, text in rows:
                out.write(f"## step {step}, prompt {prompt!r}\n\n```\n{text}\n```\n\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_text("samples", columns=["step", "prompt", "text"], data=[[step, p, t] for p, t in rows])
            elif isinstance(logger, TensorBoardLogger):
                for i, (prompt, text) in enumerate(rows):
                    logger.experiment.add_text(f"samples/{i}", f"**{prompt}**\n\n    " + text.replace("\n", "\n    "), step)


class LossCurve(L.Callback):
    """Keeps train and val loss against tokens seen and draws `loss.png` in the run folder when the
    run ends. The history is part of the checkpoint, so a resumed run draws the whole curve."""

    def __init__(self, path: Path, tokens_per_step: int):
        self.path = Path(path)
        self.tokens_per_step = tokens_per_step
        self.train: list[tuple[float, float]] = []
        self.val: list[tuple[float, float]] = []
        self.pending: list[float] = []  # micro-batch losses of the optimizer step under way
        self.last_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.last_step = trainer.global_step  # above 0 when resuming

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None or not trainer.is_global_zero:
            return
        self.pending.append(float(loss))
        if trainer.global_step != self.last_step:  # an optimizer step just happened
            tokens = trainer.global_step * self.tokens_per_step
            self.train.append((tokens, sum(self.pending) / len(self.pending)))
            self.pending.clear()
            self.last_step = trainer.global_step

    def on_validation_end(self, trainer, pl_module) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None and not trainer.sanity_checking:
            self.val.append((trainer.global_step * self.tokens_per_step, float(loss)))

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and (self.train or self.val):
            draw_loss_curve(self.path, self.train, self.val, title=self.path.parent.name)

    def state_dict(self) -> dict[str, Any]:
        return {"train": self.train, "val": self.val}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train, self.val = [tuple(p) for p in state["train"]], [tuple(p) for p in state["val"]]


def draw_loss_curve(path: Path, train: list[tuple[float, float]], val: list[tuple[float, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    if train:
        tokens, losses = zip(*train)
        ax.plot(tokens, losses, color="tab:blue", alpha=0.25, linewidth=0.8)
        ax.plot(tokens, smooth(losses), color="tab:blue", linewidth=1.8, label="train loss (smoothed)")
    if val:
        tokens, losses = zip(*val)
        ax.plot(tokens, losses, "o-", color="tab:orange", linewidth=1.8, label="val loss")
        ax.annotate(f"{losses[-1]:.3f}", (tokens[-1], losses[-1]), textcoords="offset points", xytext=(4, 6))
    ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter())
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"tinygpt2 {title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def smooth(values, points: int = 40) -> list[float]:
    """Centred moving average over about len(values) / points neighbours: no lag, no start-up bias."""
    half = max(0, len(values) // points) // 2
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half) : i + half + 1]
        out.append(sum(window) / len(window))
    return out


class ProgressBar(TQDMProgressBar):
    """A tqdm bar over optimizer steps that shows loss, validation figures and tokens per second.

    It redraws at most every REDRAW_SECONDS: a redraw after every step costs about half a millisecond,
    a few percent of a small model's step on a CPU."""

    SHOWN = {"train/loss": "loss", "val/loss": "val_loss", "val/bpc": "val_bpc", "train/tokens_per_sec": "tok/s"}
    REDRAW_SECONDS = 0.2

    def __init__(self, accumulation: int) -> None:
        super().__init__()
        self.accumulation = accumulation
        self.drawn_at = float("-inf")
        self.batches_done: int | None = None  # the count the bar shows once it is next drawn

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = {**pl_module.latest_train_values, **super().get_metrics(trainer, pl_module)}
        shown = {}
        for key, label in self.SHOWN.items():
            if key in metrics:
                value = float(metrics[key])
                shown[label] = f"{value:.0f}" if label == "tok/s" else f"{value:.3f}"
        return shown

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        if trainer.max_steps > 0:
            self.train_progress_bar.reset(total=trainer.max_steps * self.accumulation)
            self.train_progress_bar.n = trainer.global_step * self.accumulation
        self.train_progress_bar.set_description("training")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches_done = batch_idx + 1
        now = time.perf_counter()
        if now - self.drawn_at >= self.REDRAW_SECONDS or self.batches_done == self.train_progress_bar.total:
            self.drawn_at = now
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.batches_done is not None and not self.train_progress_bar.disable:
            self.train_progress_bar.n = self.batches_done  # the steps since the last redraw
        super().on_train_epoch_end(trainer, pl_module)


class ValidateAtEnd(L.Callback):
    """Ends training through `should_stop` at the last step, so that Lightning validates there and the
    checkpoints (best and last) describe the final weights."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True
