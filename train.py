"""Train a GPT-2 model: python train.py [model=nano] [data=shakespeare] [trainer.max_steps=N] ...

Hydra composes configs/train.yaml with its groups; the run folder is Hydra's output folder.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from data import DataError
from model import ConfigError
from model.checkpoint import CheckpointError
from training.run import SettingError, describe_metrics, point_latest, train
from training.sweep import write_result

log = logging.getLogger("train")

USER_ERRORS = (ConfigError, DataError, CheckpointError, SettingError)


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


OmegaConf.register_new_resolver("run_stamp", run_stamp, replace=True)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    main_process = rank_zero_only.rank == 0
    if main_process and (run_dir / "checkpoints").exists():
        sys.exit(f"error: {run_dir} already holds a run; pick a new hydra.run.dir (runs are never overwritten)")
    try:
        result = train(cfg, run_dir)
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")
    if not main_process:
        return
    write_result(run_dir, list(hydra_cfg.overrides.task), OmegaConf.to_container(cfg, resolve=True), result.metrics)
    if cfg.get("latest_link") and result.last_checkpoint:
        point_latest(Path(cfg.latest_link), run_dir)
    log.info("done: %s", describe_metrics(result.metrics))
    log.info("run folder: %s", result.run_dir)
    log.info('sample from it: python generate.py --ckpt %s --prompt "ROMEO:"', result.run_dir)


if __name__ == "__main__":
    main()
