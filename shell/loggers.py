"""The run's trackers, one per key of the `logger` group: metrics.csv, wandb, TensorBoard. A resumed run goes on
with the same files and the same wandb run, from the step of its checkpoint (what was logged after it dropped)."""

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

import yaml
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from data.writes import write_atomically
from shell.checks import wandb_mode
from shell.errors import TrackerError
from shell.folders import RunFolder, process_rank

log = logging.getLogger(__name__)

WANDB_PART = re.compile(r"(?:offline-)?run-(\d{8}_\d{6})-([\w-]+)", re.ASCII)  # <run>/wandb/offline-run-<time>-<id>
WANDB_ID = re.compile(r"[\w-]+", re.ASCII)  # wandb refuses an empty id and one holding any of :;,#?/'


def build_loggers(names: dict[str, Any], folder: RunFolder, resume_step: int) -> list[Logger]:
    """One Lightning logger per tracker chosen (none for logger=none)."""
    made = {"csv": lambda cfg: RunCSVLogger(folder.path, resume_step), "wandb": lambda cfg: make_wandb(cfg, folder)}
    made["tensorboard"] = lambda cfg: SettingsTensorBoardLogger(
        save_dir=str(folder.path), name="tensorboard", version="", default_hp_metric=False, purge_step=resume_step
    )  # a session start in every event file: TensorBoard then drops what was logged at or after a resume's step
    return [made[name](cfg or {}) for name, cfg in (names or {}).items()]


def start_loggers(loggers: list[Logger], saved: dict[str, Any]) -> None:
    """Each tracker records the run's settings."""
    for logger in loggers:
        logger.log_hyperparams(saved)


def finish_loggers() -> None:
    """Close the wandb run so its files are complete now, not only at exit (a sweep trains several)."""
    import sys

    if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].finish()


class RunCSVLogger(Logger):
    """metrics.csv in the run folder, one row per call (`step` and every value logged, in columns sorted by
    name), and hparams.yaml. Rows are appended; a new column rewrites the file beside itself, renamed into
    place, so that a stop leaves at most a last row cut short, which a resumed run drops with the rows logged
    at or after its checkpoint's step."""

    def __init__(self, folder: Path, resume_step: int = 0):
        super().__init__()
        self.file = Path(folder) / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = []
        self.written = 0  # rows on disk
        if resume_step and self.file.is_file():
            text = self.file.read_text(encoding="utf-8", errors="replace")
            text = text[: text.rfind("\n") + 1]  # without a last row cut short
            self.rows = [row for row in csv.DictReader(io.StringIO(text, newline="")) if logged_step(row) < resume_step]
        if self.file.is_file():
            self.rewrite()

    name = property(lambda self: "csv")
    version = property(lambda self: "")
    root_dir = property(lambda self: str(self.file.parent))

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        write_atomically(self.file.with_name("hparams.yaml"), yaml.safe_dump(params, sort_keys=False))

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({"step": step, **metrics})

    @rank_zero_only
    def save(self) -> None:
        if {key for row in self.rows[self.written :] for key in row} - set(self.columns):
            self.rewrite()
        with open(self.file, "a", newline="", encoding="utf-8") as out:
            csv.DictWriter(out, fieldnames=self.columns, extrasaction="ignore").writerows(self.rows[self.written :])
        self.written = len(self.rows)

    def rewrite(self) -> None:
        self.columns = ["step", *sorted({key for row in self.rows for key in row} - {"step"})]
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(self.rows)
        write_atomically(self.file, text.getvalue())
        self.written = len(self.rows)


def logged_step(row: dict[str, str]) -> float:
    """The step a metrics.csv row was logged at; nan for a row that names none."""
    try:
        return float(row.get("step") or "nan")
    except ValueError:
        return math.nan


class SettingsTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, whose HParams tab shows one column per setting and the last val/loss and
    val/bpc (TensorBoard reads them from the run's scalars of those names: no values are given here, which
    Lightning's own would log as the curves' first points)."""

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any], metrics: Any = None, step: int | None = None) -> None:
        from torch.utils.tensorboard.summary import hparams

        super().log_hyperparams(params)  # its hparams.yaml
        for summary in hparams(flat_settings(params), dict.fromkeys(metrics or ("val/loss", "val/bpc"), 0.0)):
            self.experiment.file_writer.add_summary(summary, step)


def flat_settings(values: dict[str, Any], prefix: str = "") -> dict[str, int | float | str]:
    """One entry per setting, named as on the command line (model.n_layer); numbers stay numbers, the rest is
    written as config.yaml's flow style writes it (true, null, [0.9, 0.99])."""
    flat: dict[str, int | float | str] = {}
    for name, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(flat_settings(value, f"{prefix}{name}."))
        else:
            plain = isinstance(value, str) or (isinstance(value, int | float) and not isinstance(value, bool))
            flat[f"{prefix}{name}"] = value if plain else json.dumps(value)
    return flat


def make_wandb(cfg: dict[str, Any], folder: RunFolder) -> Logger:
    """Lightning's WandbLogger on a wandb run this process starts (the first of a launch): the run folder's own
    wandb id, so that a resumed run logs to the same wandb run. A run that cannot start (online, with no
    network) stops the run before it trains, in one line."""
    from lightning.pytorch.loggers import WandbLogger

    if process_rank() != 0:
        return WandbLogger()  # (Lightning's logger starts none in the other processes)
    import wandb

    mode = wandb_mode(cfg["mode"])
    # wandb stages logged tables (the samples) under WANDB_DATA_DIR, where an offline run's sync reads them:
    # inside the run folder, a copied run syncs too
    os.environ["WANDB_DATA_DIR"] = str(folder.path / "wandb" / "data")
    try:
        run = wandb.init(
            dir=str(folder.path),
            id=wandb_run_id(folder),
            resume="allow",
            project=cfg["project"],
            name=cfg.get("name") or folder.path.name,
            group=cfg.get("group"),
            tags=list(cfg.get("tags") or []),
            mode=mode,
            settings=wandb.Settings(silent=True) if mode == "offline" else None,  # its output.log holds the console
        )
    except Exception as err:
        raise TrackerError(
            f"wandb could not start the run's log ({str(err).splitlines()[0][:300]}); check the network and your wandb "
            "login, or log offline with logger.wandb.mode=offline (upload later with `wandb sync`)"
        ) from None
    return WandbLogger(experiment=run, save_dir=str(folder.path))


def log_best_model(folder: RunFolder) -> None:
    """logger.wandb.log_model: best.ckpt as the wandb run's `model` artifact, model-<run id>, as model.ckpt (the
    best checkpoint is the run's own callback, which Lightning's WandbLogger does not hear of)."""
    import wandb

    if wandb.run is not None and folder.best.is_file():
        artifact = wandb.Artifact(f"model-{wandb.run.id}", type="model")
        artifact.add_file(str(folder.best.resolve()), name="model.ckpt")
        wandb.run.log_artifact(artifact, aliases=["best", "latest"])


def wandb_run_id(folder: RunFolder) -> str:
    """The run's wandb id, made once and kept in the run folder, so a resumed run logs to the same wandb run;
    should .wandb_id be lost or hold no id, the id of the wandb runs the folder holds."""
    kept = (
        folder.wandb_id_file.read_bytes().decode("ascii", "replace").strip() if folder.wandb_id_file.is_file() else ""
    )
    if WANDB_ID.fullmatch(kept):
        return kept
    parts = [part for path in (folder.path / "wandb").glob("*run-*") if (part := WANDB_PART.fullmatch(path.name))]
    if parts:  # the newest part's
        run_id = max(parts, key=lambda part: part.group(1)).group(2)
        what = f"holds {kept!r}" if kept else "is empty" if folder.wandb_id_file.is_file() else "is missing"
        log.warning(
            "%s %s, not the run's wandb id: it goes on logging to wandb run %s", folder.wandb_id_file, what, run_id
        )
    else:
        run_id = secrets.token_hex(4)  # wandb ids: short, lowercase, unique within a project
    write_atomically(folder.wandb_id_file, run_id)
    return run_id
