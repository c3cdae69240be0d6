"""Experiment trackers from the `logger` config group: each key under `logger` is one tracker."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import re
import secrets
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from data.writes import write_atomically
from shell.checks import wandb_mode
from shell.run_folder import RunFolder

log = logging.getLogger(__name__)


# wandb's folder of a run's part, in <run>/wandb: offline-run-20261121_094602-<id>, or run-... online
WANDB_PART = re.compile(r"(?:offline-)?run-(\d{8}_\d{6})-([\w-]+)", re.ASCII)
WANDB_ID = re.compile(r"[\w-]+", re.ASCII)  # wandb refuses an empty id and one holding any of :;,#?/'


def wandb_run_id(folder: RunFolder) -> str:
    """The run's wandb id, made once and kept in the run folder, so a resumed run logs to the same wandb
    run. Should .wandb_id be lost or hold no id (a stop as it was written, an edit), the id is that of the
    wandb runs the folder holds: a run resumed then is still one wandb run, not a new one."""
    id_file = folder.wandb_id_file
    kept = id_file.read_bytes().decode("ascii", "replace").strip() if id_file.is_file() else ""
    if WANDB_ID.fullmatch(kept):
        return kept
    parts = [WANDB_PART.fullmatch(path.name) for path in (folder.path / "wandb").glob("*run-*")]
    parts = [part for part in parts if part]
    if parts:  # the newest part's id (by the time in the folder's name)
        run_id = max(parts, key=lambda part: part.group(1)).group(2)
        what = f"holds {kept!r}" if kept else "is empty" if id_file.is_file() else "is missing"
        log.warning("%s %s, not the run's wandb id: it goes on logging to wandb run %s", id_file, what, run_id)
    else:
        run_id = secrets.token_hex(4)  # wandb ids: short, lowercase, unique within a project
    write_atomically(id_file, run_id)
    return run_id


def make_wandb(cfg: dict[str, Any], folder: RunFolder) -> Logger:
    from lightning.pytorch.loggers import WandbLogger

    mode = wandb_mode(cfg["mode"])
    # wandb stages logged tables (the samples) under WANDB_DATA_DIR, ~/.local/share/wandb by default,
    # and an offline run's sync reads them there: inside the run folder, a copied run syncs too
    os.environ["WANDB_DATA_DIR"] = str(folder.wandb_data)
    logger = WandbLogger(
        save_dir=str(folder.path),
        id=wandb_run_id(folder),
        project=cfg["project"],
        name=cfg.get("name") or folder.path.name,
        group=cfg.get("group"),
        tags=list(cfg.get("tags") or []),
        mode=mode,
        # console output goes to the run's output.log (its Logs tab), offline as online
        settings={"silent": True} if mode == "offline" else None,
        # best.ckpt as a `model` artifact when the run ends; its copy is staged under WANDB_DATA_DIR
        log_model=bool(cfg.get("log_model", False)),
    )
    # WandbLogger always passes `anonymous`, which wandb >= 0.19 warns about even when unset
    logger._wandb_init.pop("anonymous", None)
    return logger


class RunMetricsWriter(ExperimentWriter):
    """Lightning's CSV writer for a run's metrics.csv, whose records a stop at any moment leaves whole:
    the file is rewritten (for a resume, or a new column) beside itself and renamed into place, where
    Lightning truncated it first. A resumed run continues the file: rows logged at or after `resume_step`
    (after the checkpoint being resumed) are dropped, the rest kept, as is the header."""

    def __init__(self, log_dir: str, resume_step: int):
        self.resume_step = resume_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        text = text[: text.rfind("\n") + 1]  # without a last row cut short (killed as it was written)
        reader = csv.DictReader(io.StringIO(text, newline=""))
        self.metrics_keys = list(reader.fieldnames or [])
        if not self.metrics_keys:  # not even a whole header: the file starts again
            path.unlink()
            return
        self.write_all(self.metrics_keys, [row for row in reader if logged_step(row) < self.resume_step])

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with open(self.metrics_file_path, newline="", encoding="utf-8") as file:
            rows = list(csv.DictReader(file))
        self.write_all(fieldnames, rows)

    def write_all(self, fieldnames: list[str], rows: list[dict[str, str]]) -> None:
        path = Path(self.metrics_file_path)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with open(partial, "w", newline="", encoding="utf-8") as file:
                writer = csv.DictWriter(file, fieldnames=fieldnames, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)


def logged_step(row: dict[str, str]) -> float:
    """The step a metrics.csv row was logged at; nan for a row that names none (no record of a step)."""
    try:
        return float(row.get("step") or "nan")
    except ValueError:
        return math.nan


class RunCSVLogger(CSVLogger):
    """Lightning's CSV logger writing the run folder's metrics.csv, through RunMetricsWriter; a new run
    (resume_step 0) starts the file afresh."""

    def __init__(self, save_dir: str, resume_step: int = 0):
        super().__init__(save_dir=save_dir, name="", version="")
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = RunMetricsWriter(self.log_dir, self.resume_step)
        return self._experiment


# The HParams tab's metrics: each run shows the last value its validations logged
HPARAMS_METRICS = ("val/loss", "val/bpc")


class SettingsTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, whose log_hyperparams fills the HParams tab: one column per
    setting, and HPARAMS_METRICS. TensorBoard reads a metric's value from the run's scalars of that
    name, so the summary names the metrics and gives no values: Lightning's log_hyperparams(params,
    metrics) would also log its values as the first points of the val/loss and val/bpc curves."""

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any], metrics: Any = None, step: int | None = None) -> None:
        """metrics: the metrics' names (a dict's keys; any values are ignored), HPARAMS_METRICS if not given."""
        from torch.utils.tensorboard.summary import hparams

        super().log_hyperparams(params)  # kept for hparams.yaml; with no metrics Lightning writes no summary
        writer = self.experiment.file_writer
        for summary in hparams(flat_settings(params), dict.fromkeys(metrics or HPARAMS_METRICS, 0.0)):
            writer.add_summary(summary, step)


def flat_settings(values: dict[str, Any], prefix: str = "") -> dict[str, int | float | str]:
    """One entry per setting, named as on the command line (model.n_layer); numbers stay numbers, the
    rest is written as in config.yaml's flow style (true, null, [0.9, 0.99])."""
    flat: dict[str, int | float | str] = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            flat.update(flat_settings(value, key + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[key] = value
        else:
            flat[key] = value if isinstance(value, str) else json.dumps(value)
    return flat


def build_loggers(logger_cfg: dict[str, Any] | None, folder: RunFolder, resume_step: int | None = None) -> list[Logger]:
    """One Lightning logger per key of the `logger` group (wandb, tensorboard, csv); none for logger=none.

    resume_step: the step of the checkpoint a resumed run starts from; the CSV and TensorBoard logs
    continue from there (what was logged after it is dropped), and wandb continues the same run.
    """
    loggers: list[Logger] = []
    for name, cfg in (logger_cfg or {}).items():
        cfg = cfg or {}
        if name == "csv":  # writes folder.metrics_file
            loggers.append(RunCSVLogger(str(folder.path), resume_step or 0))
        elif name == "wandb":
            loggers.append(make_wandb(cfg, folder))
        elif name == "tensorboard":
            # a session start in every event file, the first too: TensorBoard takes a later one for a restart,
            # and drops what was logged at or after its step, only once it has read an earlier one
            loggers.append(
                SettingsTensorBoardLogger(
                    save_dir=str(folder.path),
                    name=folder.tensorboard.name,
                    version="",
                    default_hp_metric=False,
                    purge_step=resume_step or 0,
                )
            )
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
