"""`train(cfg, run_dir)`: one training run from a composed config. Hydra stays in train.py."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from data.datamodule import TextDataModule, batches_for
from model import GPTConfig

from model.checkpoint import CheckpointError

from .checkpointing import AtomicCheckpointIO, GracefulStop, PeriodicCheckpoints, resume_checkpoint
from .callbacks import LossCurve, ProgressBar, TextSamples, Throughput, ValidateAtEnd
from .init_from import start_from
from .loggers import build_loggers, finish_loggers
from .module import GPTModule

log = logging.getLogger(__name__)

# trainer settings that are ours, not Lightning Trainer arguments
OWN_TRAINER_KEYS = ("precision",)


class SettingError(ValueError):
    """A training setting that cannot work; the message names it and says how to fix it."""


@dataclass
class RunResult:
    run_dir: Path
    best_checkpoint: Path | None
    last_checkpoint: Path | None
    metrics: dict[str, float] = field(default_factory=dict)
    step: int = 0
    finished: bool = True  # False when a signal stopped the run early
    stopped_by: str | None = None


def setting(cfg: DictConfig, key: str, kind: type, minimum: float | None = None, allow_none: bool = False):
    """The value of a numeric setting, checked: of the right kind and not below minimum."""
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return None
    wanted = "a whole number" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise SettingError(f"{key} must be {wanted}, got {value!r}")
    if minimum is not None and value < minimum:
        raise SettingError(f"{key} must be at least {minimum}, got {value}")
    return kind(value)


def check_settings(cfg: DictConfig) -> None:
    """Settings that Lightning or torch would only reject deep inside a run, or never."""
    max_steps = setting(cfg, "trainer.max_steps", int)
    if max_steps == 0 or max_steps < -1:
        raise SettingError(f"trainer.max_steps must be at least 1 (or -1 with trainer.max_time), got {max_steps}")
    if max_steps == -1 and not cfg.trainer.get("max_time"):
        raise SettingError("trainer.max_steps=-1 needs a time limit: set trainer.max_time=00:00:05:00 (dd:hh:mm:ss)")
    lr = setting(cfg, "optim.lr", float)
    if not lr > 0:
        raise SettingError(f"optim.lr must be above 0, got {lr}")
    setting(cfg, "optim.weight_decay", float, 0)
    setting(cfg, "optim.warmup_steps", int, 0)
    setting(cfg, "optim.min_lr_ratio", float, 0)
    setting(cfg, "data.batch_size", int, 1)
    setting(cfg, "seed", int)
    setting(cfg, "tokens_per_step", int, 1, allow_none=True)
    setting(cfg, "checkpoint.every_n_steps", int, 1)
    setting(cfg, "checkpoint.keep", int, 1)
    setting(cfg, "trainer.val_check_interval", float, 0, allow_none=True)
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise SettingError(f"trainer.accelerator={accelerator}: this machine has no CUDA GPU; use trainer.accelerator=cpu or auto")
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise SettingError("trainer.accelerator=mps: MPS is not available here; use trainer.accelerator=cpu or auto")


def choose_precision(requested: str | None) -> str:
    """bf16 mixed precision on GPUs that support it, full 32-bit elsewhere; an explicit choice wins."""
    if requested:
        return str(requested)
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def model_config(cfg: DictConfig, tokenizer_vocab: int) -> GPTConfig:
    """The model preset, with vocab_size taken from the tokenizer unless the preset fixes it."""
    values = OmegaConf.to_container(cfg.model, resolve=True)
    if values.get("vocab_size") is None:
        values["vocab_size"] = tokenizer_vocab
    elif values["vocab_size"] < tokenizer_vocab:
        raise SettingError(
            f"model.vocab_size={values['vocab_size']} is smaller than the tokenizer's {tokenizer_vocab} tokens; "
            "leave model.vocab_size unset (null) to take the tokenizer's"
        )
    return GPTConfig.from_dict(values)


def point_latest(link: Path, run_dir: Path) -> None:
    """Make `link` (e.g. outputs/latest) a symlink to run_dir, replacing the old one atomically."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.resolve(), target_is_directory=True)
    os.replace(tmp, link)


def quiet_known_warnings() -> None:
    """Silence warnings that are advice for other setups, not problems of this one."""
    for message in (
        r".*does not have many workers.*",  # num_workers=0 is the fast choice on a small CPU
        r".*GPU available but not used.*",
        r"Experiment logs directory .* exists and is not empty.*",  # the CSV log shares the run folder
        r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",  # inside Lightning, with newer torch
    ):
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(drop_advertisements)


def drop_advertisements(record: logging.LogRecord) -> bool:
    return "litlogger" not in record.getMessage()


def time_budget_seconds(max_time) -> float | None:
    """trainer.max_time ("dd:hh:mm:ss", or a dict of days/hours/minutes/seconds) in seconds."""
    if not max_time:
        return None
    if isinstance(max_time, dict):
        return timedelta(**max_time).total_seconds()
    try:
        days, hours, minutes, seconds = (int(part) for part in str(max_time).split(":"))
    except ValueError:
        raise SettingError(f"trainer.max_time must be dd:hh:mm:ss (e.g. 00:00:01:15 for 75 seconds), got {max_time!r}") from None
    return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds).total_seconds()


def accumulation(cfg: DictConfig, world_size: int) -> int:
    """Micro-batches per optimizer step, from tokens_per_step (the global batch, in tokens), so the
    global batch stays the same when the number of devices changes."""
    micro = cfg.data.batch_size * cfg.model.block_size * world_size
    tokens = cfg.get("tokens_per_step")
    set_by_hand = cfg.trainer.get("accumulate_grad_batches") or 1
    if tokens is None:
        return set_by_hand
    if set_by_hand != 1:
        raise SettingError("set either tokens_per_step or trainer.accumulate_grad_batches, not both")
    if tokens < micro or tokens % micro:
        raise SettingError(
            f"tokens_per_step={tokens} is not a multiple of data.batch_size x model.block_size x devices = "
            f"{cfg.data.batch_size} x {cfg.model.block_size} x {world_size} = {micro}; use e.g. {max(1, round(tokens / micro)) * micro}"
        )
    return tokens // micro


def choose_strategy(name: Any):
    """`fsdp` shards every transformer block and saves one full checkpoint; other names go to Lightning."""
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from model.gpt import Block

        return FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    return name


def train(cfg: DictConfig, run_dir: str | os.PathLike, extra_callbacks: Sequence[L.Callback] = ()) -> RunResult:
    """Train as `python train.py` does, from a composed config, into run_dir. `extra_callbacks`: more
    Lightning callbacks, added after the run's own (Lightning still moves checkpoint callbacks last)."""
    check_settings(cfg)
    quiet_known_warnings()
    run_dir = Path(run_dir)
    main_process = rank_zero_only.rank == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")

    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    precision = choose_precision(trainer_cfg.pop("precision", None))
    strategy = choose_strategy(trainer_cfg.pop("strategy", "auto"))
    trainer_cfg.pop("accumulate_grad_batches", None)  # set below, from tokens_per_step
    start = start_from(cfg)  # init_from: the shape, weights and tokenizer to start from, or None
    if start:
        cfg = OmegaConf.merge(cfg, {"model": start.config.to_dict()})  # its shape is the run's shape
    datamodule = TextDataModule(
        cfg.data, cfg.tokenizer, cfg.model.block_size, cfg.seed, batches_for(trainer_cfg["max_steps"], 1),
        tokenizer=start.tokenizer if start else None,
    )
    datamodule.prepare()
    gpt_config = model_config(cfg, datamodule.vocab_size)

    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["model"] = gpt_config.to_dict()
    if main_process:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        (run_dir / "tokenizer.json").write_text(datamodule.tokenizer_json, encoding="utf-8")

    module = GPTModule(
        gpt_config,
        OmegaConf.to_container(cfg.optim, resolve=True),
        max_steps=trainer_cfg["max_steps"],
        val_tokens_per_char=datamodule.val_tokens_per_char,
        tokenizer_json=datamodule.tokenizer_json,
        run_config=resolved,
        max_time_seconds=time_budget_seconds(trainer_cfg.get("max_time")),
    )
    if start:
        module.model.load_state_dict(start.state)
        log.info("starting from the weights of %s", start.source)
    if cfg.get("compile"):
        module.model.compile()  # compiles in place: the state dict keeps its plain names

    resume_from = resume_point(cfg, run_dir)
    resume_step = checkpoint_step(resume_from) if resume_from else None
    logger_cfg = cfg.get("logger")  # None with logger=none
    loggers = build_loggers(OmegaConf.to_container(logger_cfg, resolve=True) if logger_cfg else {}, run_dir, resume_step)
    for logger in loggers:
        logger.log_hyperparams(resolved)
    best = ModelCheckpoint(
        dirpath=run_dir / "checkpoints",
        filename="best",
        monitor="val/loss",
        mode="min",
        save_top_k=1,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    checkpoint_cfg = cfg.get("checkpoint") or {}
    periodic = PeriodicCheckpoints(run_dir / "checkpoints", checkpoint_cfg.get("every_n_steps", 250), checkpoint_cfg.get("keep", 2))
    graceful = GracefulStop(periodic)
    micro_batch_tokens = cfg.data.batch_size * cfg.model.block_size
    callbacks = [
        best,
        periodic,
        graceful,
        Throughput(micro_batch_tokens),
        LossCurve(run_dir, micro_batch_tokens),
        ValidateAtEnd(),
        *([ProgressBar()] if trainer_cfg.get("enable_progress_bar", True) else []),
    ]
    samples = cfg.get("samples") or {}
    if samples.get("enabled", True):
        prompts = samples.get("prompts") or cfg.data.get("sample_prompts") or [""]
        settings = {k: samples[k] for k in ("max_new_tokens", "temperature", "top_k", "seed") if k in samples}
        callbacks.append(TextSamples(run_dir, datamodule.tokenizer_json, list(prompts), **settings))
    callbacks.extend(extra_callbacks)
    try:
        trainer = L.Trainer(
            **trainer_cfg,
            strategy=strategy,
            precision=precision,
            logger=loggers or False,
            callbacks=callbacks,
            use_distributed_sampler=False,  # the data module shards batches itself, see StepSampler
            plugins=[AtomicCheckpointIO()],
            enable_checkpointing=True,
            default_root_dir=str(run_dir),
        )
    except (MisconfigurationException, ValueError, TypeError) as err:  # Lightning's own checks of trainer.*
        raise SettingError(f"trainer settings: {str(err).splitlines()[0]}") from None
    trainer.accumulate_grad_batches = accumulation(cfg, trainer.world_size)
    log.info(
        "model: %s parameters (%d layers, %d heads, %d wide, context %d, vocab %d); data: %s; "
        "%d tokens per step = %d sequences x %d tokens x %d device(s) x %d accumulation",
        f"{module.model.num_parameters():,}",
        gpt_config.n_layer,
        gpt_config.n_head,
        gpt_config.n_embd,
        gpt_config.block_size,
        gpt_config.vocab_size,
        datamodule.source,
        micro_batch_tokens * trainer.world_size * trainer.accumulate_grad_batches,
        cfg.data.batch_size,
        cfg.model.block_size,
        trainer.world_size,
        trainer.accumulate_grad_batches,
    )
    if resume_from:
        log.info("resuming %s from %s (step %d)", run_dir, resume_from, resume_step)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from else None, weights_only=True)
    finally:
        finish_loggers(loggers)

    last = run_dir / "checkpoints" / "last.ckpt"
    metrics = dict(module.latest_train_values)
    metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1})
    return RunResult(
        run_dir=run_dir,
        best_checkpoint=Path(best.best_model_path) if best.best_model_path else None,
        last_checkpoint=last if last.is_file() else None,
        metrics=metrics,
        step=trainer.global_step,
        finished=graceful.stopped_at is None,
        stopped_by=graceful.requested if graceful.stopped_at is not None else None,
    )


def resume_point(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The checkpoint a `resume=` run continues from; None for a new run (or resume=auto with no
    unfinished run to continue)."""
    resume = cfg.get("resume")
    if not resume:
        return None
    if resume != "auto" and Path(resume).expanduser().is_file():
        return Path(resume).expanduser()
    if resume == "auto" and not any((run_dir / "checkpoints").glob("*.ckpt")):
        return None
    return resume_checkpoint(run_dir)


def checkpoint_step(path: Path) -> int:
    """The global step a checkpoint was saved at, read without loading its tensors into memory."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise CheckpointError(f"cannot resume from {path}: it is truncated or corrupted ({str(err).splitlines()[0]}); "
                              f"pass an earlier checkpoint of the run, e.g. resume=<run>/checkpoints/step-NNNNNN.ckpt") from None
    return int(ckpt.get("global_step", 0))


def describe_metrics(metrics: dict[str, Any]) -> str:
    keys = ("val/loss", "val/bpc", "train/loss")
    return ", ".join(f"{k} {metrics[k]:.4f}" for k in keys if k in metrics)
