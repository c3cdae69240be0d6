"""Train a GPT-2 model: python train.py [model=nano] [data=shakespeare] [trainer.max_steps=N] ...

Hydra composes configs/ once per job (each job of a sweep: -m) and gives the job its run folder, which the
shell chooses before Hydra makes it (shell.job.RunFolders: a new one, or the run resume= continues). The job
is four plain calls: its folder, its settings (shell.settings: every setting checked, the data prepared), train
(shell.run: the core's training/fit.py, which builds the model, the data and Lightning's Trainer, with the
shell's loggers, progress bar and stop on a signal around it), and report how it ended. It returns the final
val/bpc, which Hydra's sweepers (-m, hparams_search=optuna) minimise.
"""

from __future__ import annotations

if __name__ == "__main__":
    from shell.startup import start_up

    start_up()  # before the imports: Ctrl-C stops at once, no garbage collection yet

from pathlib import Path

import hydra
from omegaconf import DictConfig

from shell import command_line
from shell.job import Job, settle
from shell.run import report, train


@hydra.main(version_base="1.3", config_path=str(Path(__file__).parent / "configs"), config_name="train")
def main(cfg: DictConfig) -> float | None:
    job = Job.of(cfg)  # the run folder Hydra gave this job, and the checkpoint it continues from
    with job.ending():  # refused: one `error:` line, what the job made taken back; stopped: exit 130 or 143
        settings, start = settle(cfg, job)  # every setting checked and worked out, the data prepared
        result = train(settings, job, start)  # the core trains (training/fit.py); result.json records how it ended
        return report(result, job)  # done, with how to sample from it; or stopped, with how to continue it


if __name__ == "__main__":
    command_line.run(main)  # Hydra runs `main`; an error of the command line is said in one line
