"""Experiment trackers from the `logger` config group: each key under `logger` is one tracker."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

WANDB_MODES = ("auto", "online", "offline", "disabled")


def wandb_credentials_present() -> bool:
    """True when wandb could log in without asking: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    netrc_file = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(netrc_file).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(requested: str) -> str:
    """`auto`: WANDB_MODE if the user set it, else online with credentials, else offline; never a prompt."""
    if requested not in WANDB_MODES:
        raise ValueError(f"logger.wandb.mode must be one of {WANDB_MODES}, got {requested!r}")
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    return "online" if wandb_credentials_present() else "offline"


def make_wandb(cfg: dict[str, Any], run_dir: Path) -> Logger:
    from lightning.pytorch.loggers import WandbLogger

    mode = wandb_mode(cfg.get("mode", "auto"))
    logger = WandbLogger(
        save_dir=str(run_dir),
        project=cfg.get("project", "tinygpt2"),
        name=cfg.get("name") or run_dir.name,
        group=cfg.get("group"),
        tags=list(cfg.get("tags") or []),
        mode=mode,
        settings={"silent": True, "console": "off"} if mode == "offline" else None,
    )
    # WandbLogger always passes `anonymous`, which wandb >= 0.19 warns about even when unset
    logger._wandb_init.pop("anonymous", None)
    return logger


def build_loggers(logger_cfg: dict[str, Any] | None, run_dir: Path) -> list[Logger]:
    """One Lightning logger per key of the `logger` group (wandb, tensorboard, csv); none for logger=none."""
    loggers: list[Logger] = []
    for name, cfg in (logger_cfg or {}).items():
        cfg = cfg or {}
        if name == "csv":
            loggers.append(CSVLogger(save_dir=str(run_dir), name="", version=""))
        elif name == "wandb":
            loggers.append(make_wandb(cfg, run_dir))
        elif name == "tensorboard":
            loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False))
        else:
            raise ValueError(f"unknown logger {name!r}; use wandb, tensorboard, csv or none")
    return loggers


def finish_loggers(loggers: list[Logger]) -> None:
    """Close the wandb run so its files are complete now, not only when the process exits (a sweep
    runs several trainings in one process)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger._experiment.finish()
