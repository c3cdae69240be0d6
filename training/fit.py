"""The parts of a training run, built from its resolved settings (shell.settings.RunSettings) and
nothing else: the Lightning module, the data module, the checkpoint callbacks, the other callbacks and
the Trainer that holds them."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from data.datamodule import TextDataModule, batches_for, tokens_per_char
from shell.init_from import Start
from shell.run_folder import RunFolder
from shell.settings import RunSettings, choose_strategy, sample_prompts
from training.callbacks import LossCurve, ProgressBar, TextSamples, Throughput, ValidateAtEnd
from training.checkpoints import AtomicCheckpointIO, BestCheckpoint, GracefulStop, PeriodicCheckpoints
from training.module import GPTModule

log = logging.getLogger(__name__)


def build_trainer(
    settings: RunSettings,
    folder: RunFolder,
    loggers: list,
    graceful: GracefulStop,
    best: ModelCheckpoint,
    extra_callbacks: Sequence[L.Callback],
) -> L.Trainer:
    return L.Trainer(
        **settings.trainer_arguments(),
        strategy=choose_strategy(settings.trainer["strategy"]),
        precision=settings.trainer["precision"],
        accumulate_grad_batches=settings.accumulation,
        logger=loggers or False,
        # the step checkpoints after the callbacks that add training values to the step they save
        callbacks=[best, *build_callbacks(settings, folder), graceful.checkpoints, graceful, *extra_callbacks],
        use_distributed_sampler=False,  # the data module shards batches itself, see StepSampler
        plugins=[AtomicCheckpointIO(), *cluster_plugins()],
        enable_checkpointing=True,
        default_root_dir=str(folder.path),
    )


def build_module(settings: RunSettings, start: Start | None) -> GPTModule:
    module = GPTModule(
        settings.model,
        settings.values["optim"],
        max_steps=settings.max_steps,
        val_tokens_per_char=tokens_per_char(settings.tokens),
        tokenizer_json=settings.tokenizer_json,
        run_config=settings.saved(),
        max_time_seconds=settings.max_time_seconds,
    )
    if start:
        module.model.load_state_dict(start.state)
        log.info("starting from the weights of %s", start.source)
    if settings.values["compile"]:
        module.model.compile()  # compiles in place: the state dict keeps its plain names
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


def build_checkpointing(settings: RunSettings, folder: RunFolder) -> tuple[GracefulStop, ModelCheckpoint]:
    """Periodic step checkpoints (and the one a signal asks for), and best.ckpt."""
    every = settings.values["checkpoint"]
    validate = settings.values["trainer"].get("val_check_interval")
    validate_every = validate if isinstance(validate, int) and not isinstance(validate, bool) else None
    graceful = GracefulStop(PeriodicCheckpoints(folder, every["every_n_steps"], every["keep"], validate_every))
    best = BestCheckpoint(
        dirpath=folder.checkpoints,
        filename=folder.best.stem,
        monitor="val/loss",
        mode="min",
        save_top_k=1,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    return graceful, best


def build_callbacks(settings: RunSettings, folder: RunFolder) -> list[L.Callback]:
    """Speed, the loss curve, the last validation, the progress bar and the text samples."""
    callbacks = [
        Throughput(settings.tokens_per_step, settings.world_size, settings.trainer["precision"]),
        LossCurve(folder.loss_curve, settings.tokens_per_step),
        ValidateAtEnd(),
    ]
    if settings.trainer["enable_progress_bar"]:
        callbacks.append(ProgressBar(settings.accumulation))
    samples = settings.values["samples"]
    if samples["enabled"]:
        callbacks.append(
            TextSamples(
                folder.samples_file,
                settings.tokenizer_json,
                sample_prompts(settings.values),
                samples["max_new_tokens"],
                samples["temperature"],
                samples["top_k"],
                samples["seed"],
                settings.resume_step,
            )
        )
    return callbacks


def cluster_plugins() -> list[Any]:
    """Under SLURM, Lightning's own requeue (on SIGUSR1, an hpc_ckpt file and `scontrol requeue`) is
    off: a stop checkpoints through GracefulStop (SIGTERM), and the requeued job continues its run
    folder through resume (see train.py)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def quiet_known_warnings() -> None:
    """Silence warnings that are advice for other setups, not problems of this one."""
    for message in (
        r".*does not have many workers.*",  # num_workers=0 is the fast choice on a small CPU
        r".*GPU available but not used.*",
        r"Experiment logs directory .* exists and is not empty.*",  # the CSV log shares the run folder
        r"Checkpoint directory .* exists and is not empty.*",  # a resumed run's own checkpoints
        r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",  # inside Lightning, with newer torch
        r".*resuming from a checkpoint that ended before the epoch ended.*",  # StepSampler restarts the data order
        r"The number of training batches .* is smaller than the logging interval.*",  # a run logs its last step's values
    ):
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(drop_advertisements)


def drop_advertisements(record: logging.LogRecord) -> bool:
    return "litlogger" not in record.getMessage()
