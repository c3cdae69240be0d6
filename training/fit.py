"""One training run: its parts built from the run's settings (each from the settings and nothing else),
then Lightning's Trainer fits the module to the data. `fit` is what `python train.py` runs once the shell
has checked the command line, chosen the run folder and resolved the settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from omegaconf import OmegaConf

import checkpoint
from data.datamodule import TextDataModule, batches_for, tokens_per_char
from training.callbacks import LossCurve, TextSamples, Throughput, ValidateAtEnd
from training.checkpoints import AtomicCheckpointIO, BestCheckpoint, PeriodicCheckpoints
from training.module import GPTModule
from training.run_settings import RunSettings, choose_strategy, sample_prompts


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
        strategy=choose_strategy(settings.trainer["strategy"], settings.world_size),
        precision=settings.trainer["precision"],
        logger=extras.loggers or False,
        callbacks=callbacks,
        use_distributed_sampler=False,  # the data module shards batches itself (data.datamodule.StepSampler)
        plugins=[AtomicCheckpointIO(), *extras.plugins],
        enable_checkpointing=False,  # the run's own callbacks write its checkpoints (training.checkpoints)
        default_root_dir=str(folder),
    )
