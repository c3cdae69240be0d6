"""Callbacks: training speed, and a validation (hence a checkpoint) at the very last step."""

from __future__ import annotations

import time
from collections import deque

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


class TokensPerSecond(L.Callback):
    """Logs train/tokens_per_sec: tokens of every process, over a sliding window of recent batches."""

    def __init__(self, window: int = 20):
        self.times: deque[float] = deque(maxlen=window + 1)
        self.tokens: deque[int] = deque(maxlen=window + 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        inputs = batch[0]
        self.times.append(time.perf_counter())
        self.tokens.append(inputs.numel() * trainer.world_size)
        if len(self.times) >= 2:
            elapsed = self.times[-1] - self.times[0]
            tokens = sum(list(self.tokens)[1:])  # tokens processed after the first timestamp
            pl_module.log("train/tokens_per_sec", tokens / elapsed, prog_bar=True)

    def on_validation_end(self, trainer, pl_module) -> None:
        # validation time is not training time: start the window afresh
        self.times.clear()
        self.tokens.clear()


class ValidateAtEnd(L.Callback):
    """Ends training through `should_stop` at the last step, so that Lightning validates there and the
    checkpoints (best and last) describe the final weights."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


class ProgressBar(TQDMProgressBar):
    """A tqdm bar over optimizer steps that shows loss, validation figures and tokens per second."""

    SHOWN = {"train/loss": "loss", "val/loss": "val_loss", "val/bpc": "val_bpc", "train/tokens_per_sec": "tok/s"}

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        shown = {}
        for key, label in self.SHOWN.items():
            if key in metrics:
                value = float(metrics[key])
                shown[label] = f"{value:.0f}" if label == "tok/s" else f"{value:.3f}"
        return shown

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        if trainer.max_steps > 0:
            self.train_progress_bar.reset(total=trainer.max_steps * trainer.accumulate_grad_batches)
        self.train_progress_bar.set_description("training")
