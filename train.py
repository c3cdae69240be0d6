"""Train a GPT-2 model: python train.py [model=nano] [data=shakespeare] [trainer.max_steps=N] ...

Hydra composes configs/train.yaml with its groups; the run folder is Hydra's output folder.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from data import DataError
from model import ConfigError, GPTConfig
from model.checkpoint import CheckpointError
from training.checkpointing import CheckpointSaveError, find_resumable, run_folder_of
from training.module import TrainingDiverged
from training.run import SettingError, check_settings, describe_metrics, point_latest, train
from training.sweep import write_result

log = logging.getLogger("train")

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
USER_ERRORS = (ConfigError, DataError, CheckpointError, SettingError, CheckpointSaveError, TrainingDiverged)


# ---- where a run lives -------------------------------------------------------------------------------


def run_stamp() -> str:
    """The name of a new run folder, the same in every process of a multi-process launch.

    Lightning's own DDP launcher hands its run folder to the processes it starts; processes started
    by SLURM or torchrun each compose the config, so they need a name they all agree on.
    """
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun-{run_id[:8]}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("processes started by a launcher need one run folder: pass hydra.run.dir=DIR (or torchrun --rdzv-id=NAME)")
    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def run_folder(resume, runs_root, *, _root_) -> str:
    """hydra.run.dir: a new folder, or the folder of the run that resume= continues."""
    if resume in (None, ""):
        return f"{runs_root}/{run_stamp()}"
    if resume == "auto":
        job = OmegaConf.masked_copy(_root_, [k for k in _root_ if k != "hydra"])
        config = OmegaConf.to_container(job, resolve=True)
        found = find_resumable(Path(runs_root), config)
        return str(found) if found else f"{runs_root}/{run_stamp()}"
    return str(run_folder_of(resume))


def hydra_subdir(run_dir: str) -> str:
    """Hydra's record of the command line: .hydra for a new run; a resumed run keeps its original
    record and adds .hydra/resume-<time>."""
    if (Path(run_dir) / ".hydra" / "config.yaml").is_file():
        return f".hydra/resume-{datetime.now():%Y-%m-%d_%H-%M-%S}"
    return ".hydra"


OmegaConf.register_new_resolver("run_stamp", run_stamp, replace=True)
OmegaConf.register_new_resolver("run_folder", run_folder, replace=True)
OmegaConf.register_new_resolver("hydra_subdir", hydra_subdir, replace=True)


# ---- bad command lines: one line each, before Hydra starts --------------------------------------------


def unwritable(folder: Path) -> str | None:
    """Why a run folder could not be made at `folder`, or None when it can."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as err:
        return f"cannot write in {existing} ({err.strerror})"
    return None


def output_folder_problem(args: list[str]) -> str | None:
    """A run folder (hydra.run.dir, or one under runs_root) that cannot be written, in one line."""
    settings = dict(a.split("=", 1) for a in args if "=" in a)
    for key in ("hydra.run.dir", "runs_root", "hydra.sweep.dir"):
        if key in settings:
            problem = unwritable(Path(settings[key]).expanduser().absolute())
            if problem:
                return f"{key}={settings[key]}: {problem}; choose a folder you can write to"
    return None


def check_command_line(args: list[str]) -> str | None:
    """Compose the config the way Hydra will and turn a bad override into one line; None when fine.

    Command lines with Hydra flags (-m, --cfg, --help, ...) are left to Hydra.
    """
    problem = output_folder_problem(args)
    if problem or any(a.startswith("-") for a in args):
        return problem
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    overrides = [a for a in args if not a.startswith("hydra.")]
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
    except MissingConfigException as err:
        lines = str(err).splitlines()
        options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
        missing = re.search(r"Could not find '([^']+)/([^']+)'", lines[0])
        if missing:
            group, choice = missing.groups()
            return f"{group}={choice} is not a choice; choose one of: {', '.join(options)}"
        return lines[0]
    except OverrideParseException as err:
        return f"cannot read the command line ({str(err).splitlines()[0]}); write overrides as key=value"
    except HydraException as err:
        cause = err.__cause__
        if cause is not None and "not in struct" in str(cause):
            key = str(err).split("'")[1]
            return f"unknown setting '{key}'; check the spelling (python train.py --cfg job lists every setting)"
        return str(err).splitlines()[0]
    try:
        check_settings(cfg)
        model = OmegaConf.to_container(cfg.model, resolve=True)
        GPTConfig.from_dict({**model, "vocab_size": model.get("vocab_size") or 50257})
        resume = cfg.get("resume")
        if resume and resume != "auto":
            run_folder_of(resume)
        init_from = cfg.get("init_from")
        if init_from and not Path(init_from).expanduser().exists():
            raise CheckpointError(f"init_from={init_from} does not exist; pass a .ckpt file, a run folder or a Hugging Face folder")
    except USER_ERRORS as err:
        return str(err)
    return None


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    main_process = rank_zero_only.rank == 0
    if main_process and not cfg.get("resume") and (run_dir / "checkpoints").exists():
        sys.exit(f"error: {run_dir} already holds a run; pick a new hydra.run.dir (runs are never overwritten), or continue it with resume={run_dir}")
    try:
        result = train(cfg, run_dir)
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")
    if not main_process:
        return
    write_result(run_dir, list(hydra_cfg.overrides.task), OmegaConf.to_container(cfg, resolve=True), result.metrics, result.finished)
    if cfg.get("latest_link") and result.last_checkpoint:
        point_latest(Path(cfg.latest_link), run_dir)
    if not result.finished:
        log.warning("stopped by %s at step %d; checkpoint saved. Continue with: python train.py resume=%s",
                    result.stopped_by, result.step, run_dir)
        return
    log.info("done: %s", describe_metrics(result.metrics))
    log.info("run folder: %s", result.run_dir)
    log.info('sample from it: python generate.py --ckpt %s --prompt "ROMEO:"', result.run_dir)


if __name__ == "__main__":
    problem = check_command_line(sys.argv[1:])
    if problem:
        sys.exit(f"error: {problem}")
    main()
