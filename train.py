"""Train a GPT-2 model: python train.py [model=nano] [data=shakespeare] [trainer.max_steps=N] ...

Hydra composes configs/train.yaml with its groups; the run folder is Hydra's output folder.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data import DataError
from model import ConfigError
from model.checkpoint import CheckpointError
from training.run import SettingError, describe_metrics, point_latest, train

log = logging.getLogger("train")

USER_ERRORS = (ConfigError, DataError, CheckpointError, SettingError)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if (run_dir / "checkpoints").exists():
        sys.exit(f"error: {run_dir} already holds a run; pick a new hydra.run.dir (runs are never overwritten)")
    try:
        result = train(cfg, run_dir)
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")
    if cfg.get("latest_link") and result.last_checkpoint:
        point_latest(Path(cfg.latest_link), run_dir)
    log.info("done: %s", describe_metrics(result.metrics))
    log.info("run folder: %s", result.run_dir)
    log.info('sample from it: python generate.py --ckpt %s --prompt "ROMEO:"', result.run_dir)


if __name__ == "__main__":
    main()
