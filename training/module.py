"""The LightningModule: a GPT, and the training step written out as nanoGPT's loop writes it (forward,
backward, clipping, the optimizer step, the schedule), validation in bits per character, and the values
sent to the loggers."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer

import checkpoint
from model import GPT, GPTConfig
from training.fsdp import shard
from training.guard import NonFiniteSteps, check_weights
from training.optim import TimeBudgetSchedule, lr_factor, make_optimizer


class GPTModule(L.LightningModule):
    """Trains `self.model`, a plain GPT. One optimizer step is `accumulation` micro-batches.

    Every checkpoint it writes describes itself (model config, tokenizer, the run's settings: see
    checkpoint.add_run_state), and Lightning keeps its other arguments as plain values, so that
    `GPTModule.load_from_checkpoint` rebuilds it under weights-only loading."""

    def __init__(
        self,
        model_config: GPTConfig | dict[str, Any],
        optim: dict[str, Any],
        max_steps: int,
        val_tokens_per_char: float,
        tokenizer_json: str | None = None,
        run_config: dict[str, Any] | None = None,
        max_time_seconds: float | None = None,
        accumulation: int = 1,
        gradient_clip_val: float | None = 1.0,
        gradient_clip_algorithm: str | None = "norm",
    ):
        super().__init__()
        self.automatic_optimization = False  # the step is written out in training_step
        config = GPTConfig.from_dict(model_config) if isinstance(model_config, dict) else model_config
        self.save_hyperparameters(  # plain values; the tokenizer and settings are in the description already
            dict(model_config=config.to_dict(), optim=dict(optim), max_steps=max_steps, accumulation=accumulation,
                 val_tokens_per_char=val_tokens_per_char, max_time_seconds=max_time_seconds,
                 gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm),
            logger=False,
        )  # fmt: skip
        self.model = GPT(config)
        self.optim, self.max_steps, self.max_time_seconds = dict(optim), max_steps, max_time_seconds
        self.val_tokens_per_char, self.accumulation = val_tokens_per_char, accumulation
        self.tokenizer_json, self.run_config = tokenizer_json, run_config or {}
        self.clip_val, self.clip_algorithm = gradient_clip_val, gradient_clip_algorithm or "norm"
        self.nonfinite = NonFiniteSteps(int(self.optim["max_nonfinite_in_a_row"]))
        self.micro_batch = 0  # micro-batches of the optimizer step under way
        self.step_done = False  # whether the last micro-batch ended an optimizer step
        self.sharded = False  # whether configure_model sharded the model (trainer.strategy=fsdp)
        self.train_values: dict[str, Any] = {}  # this step's values for the loggers (see log_train)
        self.step_losses: list[torch.Tensor] = []  # the losses of this step's micro-batches
        self.latest_train_values: dict[str, float] = {}  # the last ones sent: the progress bar's, the result's
        self.latest_val_values: dict[str, float] = {}  # the last validation's
        self.validated_step = -1  # the step the last validation followed

    def configure_model(self) -> None:
        """Under trainer.strategy=fsdp (a device mesh given by Lightning's ModelParallelStrategy), shard the
        model over the processes, once (Lightning calls this for every fit, validate or test)."""
        if self.device_mesh is not None and not self.sharded:
            shard(self.model, self.device_mesh["data_parallel"], self.trainer.precision)
            self.sharded = True

    # ---- the training step --------------------------------------------------------------------------

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch  # (B, T) each: targets are the inputs shifted by one token
        _, loss = self.model(inputs, targets)  # forward: the mean cross-entropy over the B*T predictions
        self.manual_backward(loss / self.accumulation)  # backward: gradients add up over the micro-batches
        self.step_losses.append(loss.detach())
        self.micro_batch += 1
        self.step_done = self.micro_batch == self.accumulation
        if not self.step_done:
            return loss  # more micro-batches make up this step
        self.micro_batch = 0
        optimizer, schedule = self.optimizers(), self.lr_schedulers()
        norm = self.clip_gradients_(optimizer)  # clip: the gradient's global norm down to gradient_clip_val
        self.nonfinite.skip_if_not_finite(norm, optimizer.optimizer)  # a NaN or inf gradient: no update
        self.log_train("train/lr", optimizer.optimizer.param_groups[0]["lr"])
        optimizer.step()  # update the weights
        optimizer.zero_grad(set_to_none=True)  # the next step's gradients start from zero
        schedule.step()  # the learning rate of the next step
        self.log_train("train/grad_norm", norm)
        return loss

    def clip_gradients_(self, optimizer) -> torch.Tensor:
        """Clip the gradients to gradient_clip_val, by their global norm (or each value, with
        gradient_clip_algorithm=value); returns the norm before clipping. Sharded, each process holds a
        shard of every gradient, and full_tensor() completes the norm across processes."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # 16-mixed: the gradients are scaled until the optimizer step, unless unscaled now
            scaler.unscale_(optimizer.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if self.sharded else norm
        if self.clip_val and self.clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, self.clip_val)
        elif self.clip_val:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_val, norm)  # (a skipped step's: no matter)
        return norm

    def configure_optimizers(self):
        """The optimizer (optim.name) and its learning-rate schedule, stepped once per optimizer step: by
        steps to trainer.max_steps, or, for a run limited only by time, by the share of the time spent."""
        opt = self.optim
        optimizer = make_optimizer(self.model, opt)
        if self.max_steps <= 0 and self.max_time_seconds:
            timers = [c for c in self.trainer.callbacks if isinstance(c, Timer)]
            spent = (lambda: timers[0].time_elapsed("train")) if timers else None  # restored on resume
            budget = TimeBudgetSchedule(
                self.max_time_seconds, opt["warmup_steps"], opt["min_lr_ratio"], opt["schedule"], elapsed=spent
            )

            def factor(step: int) -> float:  # a function, which LambdaLR leaves out of checkpoints
                return budget(step)
        else:

            def factor(step: int) -> float:
                return lr_factor(step, opt["warmup_steps"], self.max_steps, opt["min_lr_ratio"], opt["schedule"])

        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor)}

    # ---- what the loggers get -----------------------------------------------------------------------

    def log_train(self, name: str, value: float | torch.Tensor) -> None:
        """Keep a training value of this step (a tensor kept costs no wait for the device); the step's
        values go to the loggers together at its end, on logging steps (see send_train_values)."""
        self.train_values[name] = value

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if not self.step_done:
            return
        if logging_step(self.trainer):
            self.settle_nonfinite()
        self.send_train_values()
        self.train_values.clear()  # (a step that logs nothing)
        self.step_losses.clear()

    def settle_nonfinite(self) -> None:
        """The counts of skipped updates read back from the device (see training.guard), and logged."""
        skipped = self.nonfinite.settle(self.trainer.global_step)
        if skipped is not None:
            self.log_train("train/skipped_steps", float(skipped))

    def send_train_values(self) -> None:
        """On logging steps, send the step's values (the module's and the callbacks') to every logger in
        one call; once per step: at its end, or before its checkpoint is written (which then holds them).
        Lightning's self.log would keep each in a collection it can reduce over an epoch, which costs
        about a millisecond a value, a few percent of a small model's step on a CPU."""
        trainer = self.trainer
        if not self.step_done or not logging_step(trainer) or not (self.train_values or self.step_losses):
            return
        if self.step_losses:  # the step's loss over all its tokens: every micro-batch's, every process's
            loss = torch.stack(self.step_losses).mean()
            self.train_values["train/loss"] = trainer.strategy.reduce(loss, reduce_op="mean")
            self.step_losses.clear()
        values = {name: float(value) for name, value in self.train_values.items()}
        self.train_values.clear()
        self.latest_train_values.update(values)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=logged_step(trainer))
            logger.save()

    # ---- validation: the loss over every validation window, and bits per character -----------------

    def on_validation_epoch_start(self) -> None:
        self.val_loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.val_token_count = torch.zeros((), device=self.device, dtype=torch.float64)
        self.val_batches_behind = self.batches_behind() if self.sharded else 0

    def validation_step(self, batch, batch_idx) -> None:
        inputs, targets = batch
        _, loss = self.model(inputs, targets)
        self.val_loss_sum += loss.double() * targets.numel()
        self.val_token_count += targets.numel()

    def on_validation_epoch_end(self) -> None:
        for _ in range(self.val_batches_behind):  # scoring nothing: see batches_behind
            self.model(torch.zeros((1, 1), dtype=torch.long, device=self.device))
        total = self.trainer.strategy.reduce(self.val_loss_sum, reduce_op="sum")
        count = self.trainer.strategy.reduce(self.val_token_count, reduce_op="sum")
        loss = (total / count.clamp(min=1)).float()
        bpc = loss * self.val_tokens_per_char / math.log(2)  # nats per token x tokens per character, in bits
        values = {"val/loss": loss, "val/perplexity": torch.exp(loss), "val/bpc": bpc}
        for name, value in values.items():  # for the progress bar, best.ckpt and the callbacks
            self.log(name, value, prog_bar=name != "val/perplexity", logger=False, sync_dist=True)
        if self.trainer.sanity_checking:
            return
        self.latest_val_values = {name: float(value) for name, value in values.items()}
        self.validated_step = self.trainer.global_step
        for logger in self.trainer.loggers:
            logger.log_metrics(self.latest_val_values, step=logged_step(self.trainer))
            logger.save()

    def batches_behind(self) -> int:
        """How many fewer validation batches this process has than the one with the most (the windows do
        not always split evenly). A sharded model's forward is a collective, every process gathering the
        weights together, so a process that ends its share early runs as many forwards as it lacks."""
        trainer = self.trainer
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        mine = torch.tensor(float(sum(counts)), device=self.device)
        most = trainer.strategy.reduce(mine.clone(), reduce_op="max")
        return int(most - mine)

    # ---- checkpoints: what checkpoint.py writes beside Lightning's own state -----------------------

    def on_save_checkpoint(self, ckpt: dict[str, Any]) -> None:
        trainer = self.trainer
        self.settle_nonfinite()  # the counts up to now, into the checkpoint
        if trainer.training:
            self.send_train_values()  # logged before the checkpoint of their step exists
        check_weights(self.model, trainer.global_step, self.clip_val, trainer.strategy, self.sharded)
        description = checkpoint.describe_model(self.model.config, self.tokenizer_json, self.run_config)
        latest = {
            "train": self.latest_train_values,
            "val": self.latest_val_values,
            "validated_step": self.validated_step,
        }
        checkpoint.add_run_state(ckpt, description, self.nonfinite.state(), latest)

    def on_load_checkpoint(self, ckpt: dict[str, Any]) -> None:
        resuming = ckpt.get("loops") is not None and self.has_trainer()  # load_from_checkpoint leaves the generators
        if resuming:
            checkpoint.realign_accumulation(ckpt, self.accumulation)  # before Lightning reads its loops' counts
        state = checkpoint.read_run_state(ckpt, restore_rng=resuming)
        skipped, in_a_row = state.counts.get("skipped", 0), state.counts.get("in_a_row", 0)
        self.nonfinite = NonFiniteSteps(self.nonfinite.max_in_a_row, skipped, in_a_row, ckpt.get("global_step", 0))
        self.latest_train_values = dict(state.latest.get("train", {}))
        self.latest_val_values = dict(state.latest.get("val", {}))
        self.validated_step = state.latest.get("validated_step", -1)

    def has_trainer(self) -> bool:
        try:
            return self.trainer is not None
        except RuntimeError:  # Lightning's "not attached to a Trainer"
            return False

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path, map_location=None, **kwargs: Any) -> GPTModule:
        """Lightning's loader, for a tinygpt2 checkpoint or a run folder (its best, else last checkpoint);
        the tokenizer and the run's settings come from the checkpoint's own description."""
        path = checkpoint.resolve_checkpoint(checkpoint_path)
        header = checkpoint.read_header(path)  # tensors stay on disk; Lightning reads the file next
        if header["model_config"] is None:
            raise checkpoint.CheckpointError(f"{path} has no model description; was it written by tinygpt2?")
        described: dict[str, Any] = {"tokenizer_json": header["tokenizer"], "run_config": header["settings"]}
        if not header["hyperparameters"]:
            described.update(checkpoint.module_arguments(path, header))
        return super().load_from_checkpoint(path, map_location, **{**described, **kwargs})


def logged_step(trainer) -> int:
    """The step the loggers file this step's values at: Lightning numbers logged steps from 0, so the
    values of the 500th step (and the validation after it) go to step 499."""
    return max(trainer.global_step - 1, 0)


def logging_step(trainer) -> bool:
    """Whether the optimizer step just done sends its values to the loggers: every
    trainer.log_every_n_steps steps, and the last (one a time limit or a stop ends is known to be the
    last only once it is done)."""
    step = trainer.global_step
    return step % trainer.log_every_n_steps == 0 or 0 < trainer.max_steps <= step or run_ends(trainer)


def run_ends(trainer) -> bool:
    """Whether the run ends after this step (its last step, its time limit, or a stop on no improvement)."""
    return trainer.should_stop
