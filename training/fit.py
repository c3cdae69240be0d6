"""One training run: its parts built from the run's settings (each from the settings and nothing else),
then Lightning's Trainer fits the module to the data. `fit` is what `python train.py` runs once the shell
has checked the command line, chosen the run folder and resolved the settings."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import OmegaConf

import checkpoint
from data.cache import TokenCache
from data.datamodule import TextDataModule, batches_for, tokens_per_char
from model import GPTConfig
from training.callbacks import LossCurve, TextSamples, Throughput, ValidateAtEnd
from training.checkpoints import AtomicCheckpointIO, BestCheckpoint, PeriodicCheckpoints
from training.module import GPTModule

# Trainer settings the module or the settings resolve, rather than lightning.Trainer taking them as they are
NOT_TRAINER_ARGUMENTS = (
    "strategy",
    "precision",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
)


@dataclass
class RunSettings:
    """A run's settings, final: every value checked and worked out (shell.settings makes them)."""

    values: dict[str, Any]  # every setting, as config.yaml holds them
    model: GPTConfig
    tokens: TokenCache  # the prepared corpus: tokenizer and token ids
    world_size: int  # processes training together
    accumulation: int  # micro-batches per optimizer step and process
    resume_from: Path | None = None  # the checkpoint a continued run starts from
    resume_step: int | None = None  # and its step
    machine_chosen: tuple[str, ...] = ()  # settings left to the machine by the command line

    @property
    def trainer(self) -> dict[str, Any]:
        return self.values["trainer"]

    @property
    def max_steps(self) -> int:
        return self.trainer["max_steps"]

    @property
    def max_time_seconds(self) -> float | None:
        limit = self.trainer.get("max_time")  # dd:hh:mm:ss, or days/hours/minutes/seconds
        if not limit:
            return None
        if isinstance(limit, dict):
            return timedelta(**limit).total_seconds()
        days, hours, minutes, seconds = (int(part) for part in str(limit).split(":"))
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds).total_seconds()

    @property
    def tokens_per_step(self) -> int:
        return self.values["tokens_per_step"]

    def trainer_arguments(self) -> dict[str, Any]:
        """lightning.Trainer's arguments: trainer.*, with validation counted in optimizer steps and batches
        of the whole validation, where Lightning counts micro-batches and each process's batches."""
        arguments = {k: v for k, v in self.trainer.items() if k not in NOT_TRAINER_ARGUMENTS}
        every = arguments.get("val_check_interval")
        if isinstance(every, int) and not isinstance(every, bool):
            arguments["val_check_interval"] = every * self.accumulation
        limit = arguments.get("limit_val_batches")
        if isinstance(limit, int) and not isinstance(limit, bool) and self.world_size > 1:
            arguments["limit_val_batches"] = -(-limit // self.world_size)  # each process scores every N-th window
        return arguments

    def saved(self) -> dict[str, Any]:
        """What config.yaml and each checkpoint hold: the settings, and which token cache entry they read."""
        prepared = {"cache_key": self.tokens.key, "source": self.tokens.meta.get("source")}
        if made := self.tokens.meta.get("encodings_made"):
            prepared["encodings_made"] = made
        return {
            **copy.deepcopy(self.values),
            checkpoint.PREPARED: prepared,
            checkpoint.MACHINE_CHOSEN: list(self.machine_chosen),
        }


@dataclass
class Extras:
    """What the shell adds to a run: its loggers, callbacks (the progress bar, the stop on a signal) and
    Trainer plugins; how to find a device's peak FLOP/s and hear of a faster one (for MFU); and what to do
    once everything is built, just before fitting."""

    loggers: list = field(default_factory=list)
    callbacks: list = field(default_factory=list)
    plugins: list = field(default_factory=list)
    peak_flops: Callable[[torch.device, str], float | None] | None = None
    on_faster: Callable[[torch.device, str, float], None] | None = None
    before_fit: Callable[[L.Trainer, GPTModule], None] | None = None


@dataclass
class Fitted:
    trainer: L.Trainer
    module: GPTModule
    best: BestCheckpoint
    checkpoints: PeriodicCheckpoints


def fit(settings: RunSettings, folder: Path, start: dict[str, torch.Tensor] | None = None, extras=None) -> Fitted:
    """Train the run into `folder` (continuing from settings.resume_from, if set); `start`: the weights
    a new run starts from (init_from), else GPT-2's initialisation."""
    extras = extras or Extras()
    L.seed_everything(settings.values["seed"], workers=True, verbose=False)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    module = build_module(settings, start)
    data = build_data(settings)
    best = BestCheckpoint(Path(folder) / checkpoint.CHECKPOINTS_DIR)
    periodic = build_periodic_checkpoints(settings, Path(folder))
    callbacks = [best, *build_callbacks(settings, Path(folder), extras), periodic, *extras.callbacks]
    trainer = build_trainer(settings, Path(folder), extras, callbacks)
    if extras.before_fit:
        extras.before_fit(trainer, module)
    trainer.fit(module, datamodule=data, ckpt_path=settings.resume_from, weights_only=True)
    if settings.resume_step == settings.max_steps and module.validated_step != settings.max_steps:
        trainer.validate(module, datamodule=data, verbose=False)  # stopped after its last step, before its validation
    return Fitted(trainer, module, best, periodic)


def build_module(settings: RunSettings, start: dict[str, torch.Tensor] | None) -> GPTModule:
    trainer = settings.trainer
    module = GPTModule(
        settings.model,
        settings.values["optim"],
        max_steps=settings.max_steps,
        val_tokens_per_char=tokens_per_char(settings.tokens),
        tokenizer_json=settings.tokens.tokenizer_json,
        run_config=settings.saved(),
        max_time_seconds=settings.max_time_seconds,
        accumulation=settings.accumulation,
        gradient_clip_val=trainer.get("gradient_clip_val"),
        gradient_clip_algorithm=trainer.get("gradient_clip_algorithm"),
    )
    if start is not None:
        module.model.load_state_dict(start)
    if settings.values["compile"]:
        module.model.compile()  # in place: the state dict keeps its plain names
    return module


def build_data(settings: RunSettings) -> TextDataModule:
    values = settings.values
    return TextDataModule(
        OmegaConf.create(values["data"]),
        OmegaConf.create(values["tokenizer"]),
        settings.model.block_size,
        values["seed"],
        batches_for(settings.max_steps, settings.accumulation),
        cache=settings.tokens,
        accumulation=settings.accumulation,
        world_size=settings.world_size,
    )


def build_periodic_checkpoints(settings: RunSettings, folder: Path) -> PeriodicCheckpoints:
    every = settings.values["checkpoint"]
    validate = settings.trainer.get("val_check_interval")
    validate_every = validate if isinstance(validate, int) and not isinstance(validate, bool) else None
    return PeriodicCheckpoints(
        folder / checkpoint.CHECKPOINTS_DIR, every["every_n_steps"], every["keep"], validate_every
    )


def build_callbacks(settings: RunSettings, folder: Path, extras: Extras) -> list[L.Callback]:
    """Speed and MFU, the loss curve, the last validation, and the text samples."""
    precision = settings.trainer["precision"]
    callbacks = [
        Throughput(settings.tokens_per_step, settings.world_size, precision, extras.peak_flops, extras.on_faster),
        LossCurve(folder / "loss.png", settings.tokens_per_step),
        ValidateAtEnd(),
    ]
    samples = settings.values["samples"]
    if samples["enabled"]:
        callbacks.append(
            TextSamples(
                folder / "samples.md",
                settings.tokens.tokenizer_json,
                sample_prompts(settings.values),
                samples["max_new_tokens"],
                samples["temperature"],
                samples["top_k"],
                samples["seed"],
                settings.resume_step,
            )
        )
    return callbacks


def build_trainer(settings: RunSettings, folder: Path, extras: Extras, callbacks: list) -> L.Trainer:
    return L.Trainer(
        **settings.trainer_arguments(),
        strategy=choose_strategy(settings.trainer["strategy"]),
        precision=settings.trainer["precision"],
        logger=extras.loggers or False,
        callbacks=callbacks,
        use_distributed_sampler=False,  # the data module shards batches itself (data.datamodule.StepSampler)
        plugins=[AtomicCheckpointIO(), *extras.plugins],
        enable_checkpointing=True,
        default_root_dir=str(folder),
    )


def choose_strategy(name: Any):
    """`fsdp`: FSDP2 through Lightning's ModelParallelStrategy (training.fsdp); other names go to
    Lightning as they are."""
    if name == "fsdp":
        from training.fsdp import FSDP2Strategy

        return FSDP2Strategy()
    return name


def sample_prompts(values: dict[str, Any]) -> list[str]:
    """The prompts the run's text samples continue: samples.prompts, else the data's own, else one empty."""
    return list(values["samples"]["prompts"] or values["data"].get("sample_prompts") or [""])
