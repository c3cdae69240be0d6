"""The LightningModule: a GPT, its loss, its optimizer, and what gets logged."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Timer

from checkpoint import CheckpointError, describe_model, read_header, resolve_checkpoint
from model import GPT, GPTConfig
from shell.checks import time_budget_seconds
from shell.errors import TrainingDiverged
from training import failpoints
from training.checkpoints import realign_accumulation
from training.optim import TimeBudgetSchedule, lr_factor, make_optimizer

log = logging.getLogger(__name__)


def logging_step(trainer, step_done: bool = False) -> bool:
    """Whether this optimizer step's training values go to the loggers: every trainer.log_every_n_steps
    steps, and at the last (one a time limit or a stop ends is known to be the last only once it is
    done). `step_done`: called after the batch (global_step counts the step if it is done)."""
    step = trainer.global_step if step_done else trainer.global_step + 1
    if step_done and not step_finished(trainer):
        return False
    return step % trainer.log_every_n_steps == 0 or 0 < trainer.max_steps <= step or run_ends(trainer)


def run_ends(trainer) -> bool:
    """Whether the run ends after this step (its time limit, or a stop on no improvement), not stopped
    by a signal to go on later (GracefulStop, whose stopped_at is then set): a stopped run logs what an
    uninterrupted one would, so that the resumed run's history is the same."""
    if not trainer.should_stop:
        return False
    return all(getattr(callback, "stopped_at", None) is None for callback in trainer.callbacks)


def step_finished(trainer) -> bool:
    """Whether the batch that just ended finished an optimizer step: under gradient accumulation the
    others only add to the gradients."""
    return trainer.global_step != getattr(trainer.lightning_module, "batch_start_step", None)


class GPTModule(L.LightningModule):
    """Trains `self.model`, a plain GPT.

    Every checkpoint it writes carries the model config, the tokenizer and the run's settings
    (checkpoint.describe_model), so `GPT.from_checkpoint` and resuming need nothing else,
    and its other arguments as plain values (Lightning's hyper_parameters), so that
    `GPTModule.load_from_checkpoint` rebuilds it under weights-only loading.
    """

    def __init__(
        self,
        model_config: GPTConfig | dict[str, Any],
        optim: dict[str, Any],
        max_steps: int,
        val_tokens_per_char: float,
        tokenizer_json: str | None = None,
        run_config: dict[str, Any] | None = None,
        max_time_seconds: float | None = None,
    ):
        super().__init__()
        if isinstance(model_config, dict):
            model_config = GPTConfig.from_dict(model_config)
        # The tokenizer and the run's settings are in every checkpoint already (describe_model), and
        # the loggers get the run's settings from shell.run: neither is kept here a second time.
        self.save_hyperparameters(
            {
                "model_config": model_config.to_dict(),
                "optim": dict(optim),
                "max_steps": max_steps,
                "val_tokens_per_char": val_tokens_per_char,
                "max_time_seconds": max_time_seconds,
            },
            logger=False,
        )
        self.max_time_seconds = max_time_seconds
        self.model = GPT(model_config)
        self.optim = dict(optim)
        self.max_nonfinite_in_a_row = int(self.optim["max_nonfinite_in_a_row"])
        self.nonfinite_in_a_row = 0  # as last read back from the device (see settle_nonfinite)
        self.skipped_steps = 0
        # on the device: updates skipped, non-finite steps in a row, the longest such run since the last read
        self.nonfinite = torch.zeros(3)
        self.settled_step = 0  # the counts of the optimizer steps up to this one have been read
        self.parameters_list: list[torch.nn.Parameter] | None = None
        self.sharded = False  # whether configure_model sharded the model (trainer.strategy=fsdp)
        self.train_values: dict[str, Any] = {}  # this step's values for the loggers (see log_train)
        self.step_losses: list[torch.Tensor] = []  # the losses of this step's micro-batches
        self.latest_train_values: dict[str, float] = {}  # the last ones sent: the progress bar's, the result's
        self.latest_val_values: dict[str, float] = {}  # the last validation's, and the step it followed
        self.validated_step = -1
        self.logged_step = -1
        self.batch_start_step: int | None = None  # global_step as the batch under way began
        self.max_steps = max_steps
        self.val_tokens_per_char = val_tokens_per_char
        self.tokenizer_json = tokenizer_json
        self.run_config = run_config or {}
        self.val_loss_sum = torch.zeros(())
        self.val_token_count = torch.zeros(())
        self.val_batches_behind = 0  # extra forwards a sharded model owes at the end of validation

    # ---- sharding --------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Under trainer.strategy=fsdp (Lightning's ModelParallelStrategy, which gives the module its
        device mesh), shards the model over the processes (see `shard`). Lightning calls this hook
        for every fit, validate or test, and load_from_checkpoint calls it without a trainer: the
        model is sharded once, and only under a mesh."""
        if self.device_mesh is None or self.sharded:
            return
        shard(self.model, self.device_mesh["data_parallel"], self.trainer.precision)
        self.sharded = True
        self.parameters_list = None

    # ---- steps -----------------------------------------------------------------------------------

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        _, loss = self.model(inputs, targets)
        if failpoints.active("nan", self.trainer.global_step + 1):
            loss = loss * float("nan")
        if failpoints.once("sigint", self.trainer.global_step + 1):
            failpoints.interrupt_now()
        self.step_losses.append(loss.detach())  # each micro-batch's: the step's loss is their mean
        return loss

    def log_train(self, name: str, value: float | torch.Tensor) -> None:
        """Keeps a training value of this step; on_train_batch_end sends them to the loggers together on
        a logging step. Every step keeps its values (a tensor kept costs no wait for the device), as a
        run that a time limit or a stop ends is known to end only once its last step is done."""
        self.train_values[name] = value

    def on_train_batch_start(self, batch, batch_idx) -> None:
        # Lightning numbers what it logs itself (validation, and the samples beside it) by a count of its
        # own, _batches_that_stepped, which it restores on resume and then advances by one or not
        # depending on where in its loop the checkpoint was written; it counts the steps done
        self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.trainer.global_step
        if self.trainer.global_step != self.batch_start_step:  # a new optimizer step: the last one's values
            self.train_values.clear()  # were sent, or were not to be
            self.step_losses.clear()
        self.batch_start_step = self.trainer.global_step  # see step_finished

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        trainer = self.trainer
        if failpoints.active("nan_weights", trainer.global_step):
            weight = self.model.transformer.wte.weight
            with torch.no_grad():
                (weight.to_local() if self.sharded else weight)[0, 0] = float("nan")  # sharded: each its first row
        self.send_train_values()

    def send_train_values(self) -> None:
        """On logging steps, sends the step's training values (from here and the callbacks) to every
        logger in one call, numbered as Lightning numbers what it logs; once per step, at the step's
        end or, on a step that is checkpointed, before its checkpoint is written (which then holds them).

        Lightning's self.log keeps each value in a collection that it can reduce over the epoch and
        sync across processes, which per-step values do not need; it cost about a millisecond a value,
        a few percent of a small model's step on a CPU."""
        trainer = self.trainer
        if (
            not (self.train_values or self.step_losses)
            or not logging_step(trainer, step_done=True)
            or trainer.global_step == self.logged_step
        ):
            return  # (with gradient accumulation, the other micro-batches of a logged step)
        self.logged_step = trainer.global_step
        if self.step_losses:  # the step's loss over all its tokens: every micro-batch's, every process's
            loss = torch.stack(self.step_losses).mean()
            self.step_losses.clear()
            self.train_values["train/loss"] = trainer.strategy.reduce(loss, reduce_op="mean")
        values = {name: float(value) for name, value in self.train_values.items()}
        self.train_values.clear()
        self.latest_train_values.update(values)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step - 1)
            logger.save()

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking and failpoints.active("kill_val", self.trainer.global_step):
            failpoints.kill_now()
        self.val_loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.val_token_count = torch.zeros((), device=self.device, dtype=torch.float64)
        self.val_batches_behind = self.batches_behind() if self.sharded else 0

    def validation_step(self, batch, batch_idx):
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
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)  # equal on every process already
        self.log("val/perplexity", torch.exp(loss), sync_dist=True)
        # bits per character: mean nats per token, times tokens per character, over ln 2
        bpc = loss * self.val_tokens_per_char / math.log(2)
        self.log("val/bpc", bpc, prog_bar=True, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.latest_val_values = {
                "val/loss": float(loss),
                "val/perplexity": float(torch.exp(loss)),
                "val/bpc": float(bpc),
            }
            self.validated_step = self.trainer.global_step

    def batches_behind(self) -> int:
        """How many fewer validation batches this process has than the one with the most (the windows
        do not always split evenly). A sharded model's forward is a collective, every process gathering
        the weights together, so a process that ends its share early runs as many forwards as it lacks."""
        trainer = self.trainer
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        mine = torch.tensor(float(sum(counts)), device=self.device)
        most = trainer.strategy.reduce(mine.clone(), reduce_op="max")
        return int(most - mine)

    # ---- optimisation ----------------------------------------------------------------------------

    def configure_optimizers(self):
        opt = self.optim
        optimizer = make_optimizer(self.model, opt)
        if self.max_steps <= 0 and self.max_time_seconds:
            budget = TimeBudgetSchedule(
                self.max_time_seconds,
                opt["warmup_steps"],
                opt["min_lr_ratio"],
                opt["schedule"],
                elapsed=self.training_time(),
            )

            def factor(step: int) -> float:  # a function, which LambdaLR leaves out of checkpoints:
                return budget(step)  # the time spent comes back with Lightning's Timer instead
        else:

            def factor(step: int) -> float:
                return lr_factor(step, opt["warmup_steps"], self.max_steps, opt["min_lr_ratio"], opt["schedule"])

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def training_time(self):
        """The training time spent so far, as Lightning's Timer (trainer.max_time) counts it across a
        resume; None without a trainer or a Timer."""
        trainer = self._trainer
        timers = [c for c in trainer.callbacks if isinstance(c, Timer)] if trainer is not None else []
        return (lambda: timers[0].time_elapsed("train")) if timers else None

    def on_before_optimizer_step(self, optimizer) -> None:
        self.log_train("train/lr", optimizer.param_groups[0]["lr"])

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by global norm and log the norm before clipping (one norm computation for both).

        A non-finite norm (a NaN or inf loss, or an overflow) skips the step's update: the weights and
        the optimizer's moments and step count stay as they were. Gradients are averaged across
        processes before this point, so every process makes the same decision. Sharded, each process
        holds a shard of every gradient (a DTensor) and the norm over its shards is partial:
        full_tensor() completes it across processes, so each clips by, and decides on, the norm of
        the whole gradient. Value clipping (trainer.gradient_clip_algorithm=value) is checked the same
        way, then clipped by Lightning.

        The decision is made on the device, so that a GPU step never waits for its loss to come back:
        fused AdamW takes it as its `found_inf` flag (the input GradScaler uses) and skips the update
        in its own kernel. Optimizers without that input (optim=muon; AdamW where no fused kernel
        exists) are given no gradients instead, which needs the decision on the host (a wait for the
        GPU). The counts of skipped steps come back on logging steps (trainer.log_every_n_steps) and
        checkpoints: see settle_nonfinite.
        """
        if self.parameters_list is None:  # walking the module tree each step costs more than the norm of a small model
            self.parameters_list = list(self.model.parameters())
        params = [p for p in self.parameters_list if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.sharded:
            norm = norm.full_tensor()
        finite = torch.isfinite(norm)
        self.count_nonfinite(finite)
        inner = getattr(optimizer, "_optimizer", optimizer)  # Lightning's wrapper, or the optimizer itself
        if takes_found_inf(inner):
            inner.found_inf = (~finite).float()
        elif not finite:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None  # AdamW and Muon skip parameters without a gradient
        if logging_step(self.trainer):
            self.settle_nonfinite(self.trainer.global_step + 1)  # through the step under way
        if gradient_clip_algorithm not in (None, "norm"):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        elif gradient_clip_val:
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)  # a skipped step's: no matter
        self.log_train("train/grad_norm", norm)

    def count_nonfinite(self, finite: torch.Tensor) -> None:
        """Counts this step on the device: updates skipped, non-finite steps in a row, and the longest
        such run since the counts were last read."""
        counts = self.nonfinite.to(finite.device)
        bad = (~finite).to(counts.dtype)
        in_a_row = (counts[1] + 1) * bad
        self.nonfinite = torch.stack([counts[0] + bad, in_a_row, torch.maximum(counts[2], in_a_row)])

    def settle_nonfinite(self, step: int) -> None:
        """Reads back the counts through optimizer step `step` (the one wait for the device they
        cost): warns of updates skipped since the last read, logs their total, and stops the run when
        optim.max_nonfinite_in_a_row steps in a row were not finite."""
        if step <= self.settled_step:
            return
        skipped, in_a_row, longest = (int(v) for v in self.nonfinite.tolist())
        since, self.settled_step = self.settled_step + 1, step
        self.nonfinite[2] = self.nonfinite[1]  # the longest run from here on starts with the current one
        new = skipped - self.skipped_steps
        self.skipped_steps, self.nonfinite_in_a_row = skipped, in_a_row
        if new:
            if since == step:
                log.warning("step %d: the loss or its gradient is not finite; this update is skipped", step)
            else:
                log.warning(
                    "steps %d-%d: %d of their updates skipped, as the loss or its gradient was not finite",
                    since,
                    step,
                    new,
                )
            self.log_train("train/skipped_steps", float(skipped))
        if longest >= self.max_nonfinite_in_a_row:
            raise TrainingDiverged(
                f"training diverged: {longest} steps in a row (up to step {step}) had a non-finite loss",
                instead="raise optim.max_nonfinite_in_a_row to wait longer",
            )

    # ---- checkpoints -----------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._trainer is not None:
            self.settle_nonfinite(self.trainer.global_step)  # the counts up to now, into the checkpoint
            if self.trainer.training:
                self.send_train_values()  # logged before the checkpoint of their step exists
        bad = self.nonfinite_parameter()
        if bad is not None:  # never a checkpoint of broken weights: the ones written so far stay the newest
            clip = self.trainer.gradient_clip_val
            raise TrainingDiverged(
                f"training diverged: at step {self.trainer.global_step} the weights are no longer finite ({bad}), and no "
                "checkpoint was written from them",
                instead=f"clip the gradients harder than trainer.gradient_clip_val={clip}"
                if clip
                else "clip the gradients: trainer.gradient_clip_val=1.0",
            )
        checkpoint.update(describe_model(self.model.config, self.tokenizer_json, self.run_config))
        checkpoint["rng_states"] = rng_states()
        checkpoint["nonfinite"] = {"skipped": self.skipped_steps, "in_a_row": self.nonfinite_in_a_row}
        # what a run that resume= only ends reports, and whether its final validation is still to run
        checkpoint["latest_values"] = {
            "train": dict(self.latest_train_values),
            "val": dict(self.latest_val_values),
            "validated_step": self.validated_step,
        }

    def nonfinite_parameter(self) -> str | None:
        """The name of the first parameter holding a NaN or an inf, or None. Sharded, each process
        checks its shards and the processes add up what they found (every process saves a checkpoint,
        so all must decide alike)."""
        named = list(self.model.named_parameters())
        if not self.sharded:
            return next((name for name, p in named if not torch.isfinite(p).all()), None)
        broken = torch.stack([~torch.isfinite(p.to_local()).all() for _, p in named]).float()
        found = self.trainer.strategy.reduce(broken, reduce_op="sum").nonzero()
        return named[int(found[0])][0] if len(found) else None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "rng_states" in checkpoint and self._trainer is not None:  # resuming; load_from_checkpoint leaves them
            set_rng_states(checkpoint["rng_states"])
            realign_accumulation(checkpoint, self.trainer.accumulate_grad_batches)  # before Lightning reads it
        counts = checkpoint.get("nonfinite", {})
        self.skipped_steps, self.nonfinite_in_a_row = counts.get("skipped", 0), counts.get("in_a_row", 0)
        self.nonfinite = torch.tensor([self.skipped_steps, self.nonfinite_in_a_row, self.nonfinite_in_a_row])
        self.settled_step = checkpoint.get("global_step", 0)
        latest = checkpoint.get("latest_values", {})
        self.latest_train_values, self.latest_val_values = dict(latest.get("train", {})), dict(latest.get("val", {}))
        self.validated_step = latest.get("validated_step", -1)

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path,
        map_location=None,
        hparams_file=None,
        strict=None,
        weights_only=None,
        **kwargs: Any,
    ) -> GPTModule:
        """Lightning's loader, for a tinygpt2 checkpoint or a run folder (its best, else last checkpoint).

        The tokenizer and the run's settings come from the checkpoint's own description. A checkpoint
        written before the module saved its hyperparameters is described by that alone; it did not record
        the validation's tokens per character, so val/bpc is nan unless `val_tokens_per_char=` is given."""
        path = resolve_checkpoint(checkpoint_path)
        header = read_header(path)  # tensors stay on disk; Lightning reads the file next
        if header["model_config"] is None:
            raise CheckpointError(f"{path} has no model description; was it written by tinygpt2?")
        described: dict[str, Any] = {"tokenizer_json": header["tokenizer"], "run_config": header["settings"]}
        if not header["hyperparameters"]:
            described.update(described_before_hyperparameters(path, header))
        return super().load_from_checkpoint(
            path, map_location, hparams_file, strict, weights_only, **{**described, **kwargs}
        )


def takes_found_inf(optimizer) -> bool:
    """Whether the optimizer skips its update on a device-side flag: fused Adam and AdamW, whose
    kernel reads `found_inf` (and leaves the weights, the moments and the step count alone when set)."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def shard(model: GPT, mesh, precision: str) -> None:
    """Shards the model in place with FSDP2 over the processes of a 1-D device mesh: each block is a
    unit of its own, its weights gathered just before its forward and its backward and freed after;
    the model itself holds the rest: the embeddings, the last LayerNorm and the output layer, whose
    weight is the token embedding's (one parameter, sharded once, so the two stay tied). Each process
    keeps, and the optimizer updates, a shard of every weight.

    Under bf16-mixed the weights are gathered and computed with in bf16 and the gradients reduced in
    fp32, while the shards stay fp32 (FSDP2's MixedPrecisionPolicy); Lightning's autocast, which that
    precision also turns on, keeps the LayerNorms, softmax and loss in fp32 as on one device.
    Otherwise (32-true on a CPU) everything stays in the weights' own dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "bf16-mixed":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def described_before_hyperparameters(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    """GPTModule's arguments from the description alone (checkpoints written before the hyperparameters)."""
    settings = header["settings"]
    if "optim" not in settings or "trainer" not in settings:
        raise CheckpointError(
            f"{path} holds no training settings, so no GPTModule can be rebuilt from it; "
            "load its model with GPT.from_checkpoint"
        )
    max_time = settings["trainer"].get("max_time")
    return {
        "model_config": header["model_config"],
        "optim": settings["optim"],
        "max_steps": settings["trainer"]["max_steps"],
        "val_tokens_per_char": float("nan"),
        "max_time_seconds": time_budget_seconds(max_time) if max_time else None,
    }


def rng_states() -> dict[str, Any]:
    """Every random generator a training step may draw from: dropout (torch), and Python's and
    NumPy's global ones for good measure. Python's state is stored as plain lists (weights-only loading)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
