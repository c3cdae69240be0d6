"""The LightningModule: a GPT, its loss, its optimizer, and what gets logged."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch

from model import GPT, GPTConfig
from model.checkpoint import META_KEY

from .optim import lr_factor, make_adamw


class GPTModule(L.LightningModule):
    """Trains `self.model`, a plain GPT.

    Every checkpoint it writes carries, under `tinygpt2`, the model config, the tokenizer and the
    resolved run config, so `GPT.from_checkpoint` needs nothing else.
    """

    def __init__(
        self,
        model_config: GPTConfig,
        optim: dict[str, Any],
        max_steps: int,
        val_tokens_per_char: float,
        tokenizer_json: str | None = None,
        run_config: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.model = GPT(model_config)
        self.optim = dict(optim)
        self.max_steps = max_steps
        self.val_tokens_per_char = val_tokens_per_char
        self.tokenizer_json = tokenizer_json
        self.run_config = run_config or {}
        self.val_loss_sum = torch.zeros(())
        self.val_token_count = torch.zeros(())

    # ---- steps -----------------------------------------------------------------------------------

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        _, loss = self.model(inputs, targets)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self.val_loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.val_token_count = torch.zeros((), device=self.device, dtype=torch.float64)

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        _, loss = self.model(inputs, targets)
        self.val_loss_sum += loss.double() * targets.numel()
        self.val_token_count += targets.numel()

    def on_validation_epoch_end(self) -> None:
        total = self.trainer.strategy.reduce(self.val_loss_sum, reduce_op="sum")
        count = self.trainer.strategy.reduce(self.val_token_count, reduce_op="sum")
        loss = (total / count.clamp(min=1)).float()
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)  # equal on every process already
        self.log("val/perplexity", torch.exp(loss), sync_dist=True)
        # bits per character: mean nats per token, times tokens per character, over ln 2
        self.log("val/bpc", loss * self.val_tokens_per_char / math.log(2), prog_bar=True, sync_dist=True)

    # ---- optimisation ----------------------------------------------------------------------------

    def configure_optimizers(self):
        opt = self.optim
        optimizer = make_adamw(self.model, opt["lr"], opt["weight_decay"], opt["betas"])
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_factor(step, opt["warmup_steps"], self.max_steps, opt["min_lr_ratio"], opt["schedule"]),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by global norm and log the norm before clipping (one norm computation for both)."""
        if gradient_clip_algorithm not in (None, "norm") or self.trainer.strategy.__class__.__name__.startswith("FSDP"):
            # value clipping, and FSDP's sharded norm, are Lightning's own
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        max_norm = gradient_clip_val if gradient_clip_val else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.log("train/grad_norm", norm)

    # ---- checkpoints -----------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[META_KEY] = {
            "model_config": self.model.config.to_dict(),
            "tokenizer": self.tokenizer_json,
            "config": self.run_config,
        }
