"""Train a GPT-2 model: python train.py [model=nano] [data=shakespeare] [trainer.max_steps=N] ...

Before Hydra starts, the shell checks the whole command line and chooses the run's folder: a new one, or
the run that resume= continues (shell.launch); a command that cannot run is refused in one line and leaves
nothing behind. Hydra then composes configs/ and calls `main` in that folder, once per job of a sweep. The
shell resolves the run's settings (shell.settings), and the core trains: training/fit.py builds the model,
the data and Lightning's Trainer and fits them; training/module.py holds the training step; model/gpt.py
the GPT. `main` returns the final val/bpc, which Hydra's sweepers (-m, hparams_search=optuna) minimise.
"""

from __future__ import annotations

if __name__ == "__main__":
    from shell.startup import start_up

    start_up(lean_lightning=True)  # before the imports: Ctrl-C stops at once, no garbage collection yet

import hydra
from omegaconf import DictConfig

from shell.job import job, launch


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return job(cfg)  # train the run Hydra composed, in its folder, and say how it ended


if __name__ == "__main__":
    launch(main)
