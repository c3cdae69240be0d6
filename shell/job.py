"""A job of train.py (the one run, or each run of a sweep): the run folder Hydra gives it, chosen before Hydra
makes it (`RunFolders`, a Hydra callback: a new folder, or the run resume= continues), what it continues
from (`Job`), and how it ends when it cannot train: refused in one line, what it made taken back; or stopped,
with 130 or 143. (Hydra writes a line of its own to stderr for a job that raises, so a refusal ends the job
in `Job.ending`, not in a callback.)"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from shell.checks import SettingError, check_writable, plain
from shell.errors import USER_ERRORS, ProcessLost, RunFolderError, RunWriteError, TrainingDiverged
from shell.folders import (
    RunFolder,
    check_readable_by_hydra,
    folder_of,
    launcher_name,
    launcher_restarted,
    new_folder,
    process_rank,
    resumable_runs,
)
from shell.init_from import Start
from shell.settings import RunFinished, matches, named_settings, settle_new, settle_resumed
from shell.startup import started
from shell.stops import Stopped, hold_stops, stops_raised
from shell.sweeps import how_to_continue, result_record, summarize
from training.run_settings import RunSettings

log = logging.getLogger("train")


class RunFolders(Callback):
    """Hydra's callback that chooses a run's folder before Hydra makes it and writes its record there: the run
    resume= names, the newest unfinished run with these settings (resume=auto), the folder hydra.run.dir or a
    torchrun or SLURM launch names (checked: new, or empty), else a new one under runs_root named by the time,
    with -2, -3, ... where another run took that name. The first process of a launch holds its lock."""

    def __init__(self) -> None:
        self.lock: BinaryIO | None = None  # the run's lock, held while Hydra runs the job (closed with it)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.runtime.choices.get("hparams_search"):
            sys.exit(
                "error: hparams_search is a search over many runs: add -m (python train.py -m hparams_search=optuna ...)"
            )
        hold_stops()  # until the job can take the folder back (Job.ending)
        try:
            folder, made, resuming = choose_folder(config)
            if process_rank() == 0:
                if resuming:
                    folder.check_files()
                self.lock = os.fdopen(folder.lock(made), "rb")
        except USER_ERRORS as err:  # (Hydra turns a callback's exception into a warning, and goes on)
            sys.exit(f"error: {err}")
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.run.dir = str(folder.path)
            if resuming and process_rank() == 0:  # Hydra's record of this command beside the run's first
                stamp = f".hydra/resume-{datetime.now():%Y-%m-%d_%H-%M-%S}"
                names = (stamp if n == 1 else f"{stamp}-{n}" for n in itertools.count(1))  # (one a second or more)
                config.hydra.output_subdir = next(name for name in names if not (folder.path / name).exists())


def choose_folder(config: DictConfig) -> tuple[RunFolder, Path | None, bool]:
    """(the run folder, the outermost folder made for it or None, whether the run continues from a checkpoint
    there), from the command line, the environment and what is on disk, so that every process of a launch
    finds the same; only the first checks and says what it finds."""
    resume, first = config.get("resume"), process_rank() == 0
    if resume == "" or resume is not None and not isinstance(resume, str):
        raise SettingError("resume= is empty: give the run to continue (resume=outputs/DATE/TIME), or leave resume= out "
                           "to start a new run")  # fmt: skip
    explicit = any(o.lstrip("+").startswith("hydra.run.dir=") for o in config.hydra.overrides.hydra)
    if resume and resume != "auto":
        folder = folder_of(resume)
        if explicit and RunFolder(config.hydra.run.dir).path != folder.path:
            raise RunFolderError(f"hydra.run.dir={config.hydra.run.dir} is not the run resume= continues ({folder.path}); "
                                 "leave hydra.run.dir out")  # fmt: skip
        if first and (owner := folder.held_by()):
            raise folder.under_way(owner)
        return folder, None, True
    root, name = str(config.get("runs_root") or ""), launcher_name()
    for key, place in (("runs_root", root), *((("hydra.run.dir", str(config.hydra.run.dir)),) if explicit else ())):
        if not place.strip():
            raise RunFolderError(f"{key} is empty; give a folder, e.g. {key}=outputs")
        check_readable_by_hydra(place, "runs_root=DIR, hydra.run.dir=DIR")
        check_writable(key, place)
    folder = RunFolder(config.hydra.run.dir) if explicit else RunFolder(Path(root) / name) if name else None
    if folder is None and resume == "auto":
        folder = newest_matching_run(config, first)
    if folder is None:
        folder, made = new_folder(root)
        if resume == "auto":
            print(f"resume=auto: no unfinished run under {RunFolder(root).path} has these settings; starting a new run in "
                  f"{folder.path}")  # fmt: skip
        return folder, made, False
    restarted = launcher_restarted() and not explicit
    if folder.has_checkpoint() and (resume == "auto" or restarted) and not folder.held_by():
        if restarted and first:
            print(f"this job was restarted by its scheduler: continuing {folder.path}", file=sys.stderr)
        return folder, None, True
    if first:
        check_named_folder(folder, explicit, restarted, resume == "auto")
    return folder, next((p for p in [*reversed(folder.path.parents), folder.path] if not p.exists()), None), False


def check_named_folder(folder: RunFolder, explicit: bool, restarted: bool, auto: bool) -> None:
    """A new run's folder that hydra.run.dir or a launcher named: new, empty, or a start a restart clears."""
    chosen_by = "hydra.run.dir" if explicit else f"run folder of this job ({folder.path.name})"
    was_started = folder.started()
    folder.check_new(chosen_by, restarted=restarted)
    if restarted and was_started:
        print(f"this job was restarted by its scheduler: {folder.path} stopped before its first checkpoint, so it "
              "starts again", file=sys.stderr)  # fmt: skip
    if auto:
        print(f"resume=auto: {folder.path} holds no checkpoint to continue from; starting a new run there")


def newest_matching_run(config: DictConfig, first: bool) -> RunFolder | None:
    """resume=auto: the newest unfinished run under runs_root whose settings are the ones asked for; None where
    there is none. One that another process trains is refused."""
    requested = plain(config)
    named = named_settings(config.hydra.overrides.task, requested)
    for folder in resumable_runs(requested["runs_root"]):
        try:
            saved = read_settings_of(folder)
        except Exception:  # an unreadable checkpoint: not this one
            continue
        if saved and matches(requested, saved, named):
            if first and (owner := folder.held_by()):
                raise RunFolderError(f"resume=auto: the run with these settings, {folder.path}, is being trained by "
                                     f"{owner}; wait for it to end (or stop it), then run this again")  # fmt: skip
            return folder
    return None


def read_settings_of(folder: RunFolder) -> dict[str, Any]:
    from checkpoint import read_header

    return read_header(folder.checkpoint_to_resume())["settings"]


def settle(cfg: DictConfig, job: Job) -> tuple[RunSettings, Start | None]:
    """The job's settings, checked and made final (shell.settings), and what a new run from init_from starts from."""
    requested = plain(cfg)
    named = named_settings(job.overrides, requested)
    if job.sweep is not None and job.resume == "auto" and job.folder.is_finished():  # a sweep continued
        raise RunFinished("it finished before")
    if job.checkpoint is not None:
        return settle_resumed(job.checkpoint, requested, named, job.overrides), None
    return settle_new(requested, named, job.choices)


# ---- the job -----------------------------------------------------------------------------------------------


def log_to_the_run() -> None:
    """The run's train.log (Hydra's file handler) gets what Lightning logs through its own handlers, and Python's
    warnings; the processes of a launch beside the first keep their console to errors, which the first would
    otherwise show once a process."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in ("lightning.pytorch", "lightning.fabric", "py.warnings"):
        library = logging.getLogger(name)
        for handler in [h for h in library.handlers if isinstance(h, logging.FileHandler)]:
            library.removeHandler(handler)  # the job before's, in a sweep
        for handler in files if not library.propagate else []:  # (propagated, the root's handlers have it)
            library.addHandler(handler)
    logging.captureWarnings(True)
    if process_rank() != 0:
        for handler in logging.getLogger().handlers:
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.ERROR)


@dataclass
class Job:
    folder: RunFolder  # the run's, as Hydra gave it
    overrides: list[str]  # the command line's settings, as Hydra's record has them
    choices: dict[str, Any]  # the config group chosen for each group
    resume: str | None  # resume= as given
    record: str | None  # Hydra's record of this command in the run folder, for a resume (.hydra/resume-<time>)
    sweep: Path | None  # the sweep folder, for a job of a sweep
    lock: int | None = None  # a job of a sweep's own lock, held while it trains

    @classmethod
    def of(cls, cfg: DictConfig) -> Job:
        """This job, as Hydra runs it."""
        started()  # the first job of the process: start-up is over (shell.startup)
        log_to_the_run()
        hydra = HydraConfig.get()
        sweep = Path(hydra.sweep.dir).absolute() if hydra.mode == RunMode.MULTIRUN else None
        record = hydra.output_subdir if str(hydra.output_subdir).startswith(".hydra/resume-") else None
        choices = OmegaConf.to_container(hydra.runtime.choices)
        return cls(
            RunFolder(hydra.runtime.output_dir), list(hydra.overrides.task), choices, cfg.get("resume"), record, sweep
        )

    @functools.cached_property
    def checkpoint(self) -> Path | None:
        """The checkpoint the run continues from; None: a new run."""
        if self.resume and self.resume != "auto":
            return self.folder.checkpoint_named(self.resume)
        return self.folder.checkpoint_to_resume() if self.resume == "auto" or launcher_restarted() else None

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """What the job runs: a stop signal or an error of the user's input that ends it before it trains is said
        in one line, and what it made is taken back; a job of a sweep records its error and the sweep goes on."""
        try:
            with stops_raised():
                if self.sweep is not None and process_rank() == 0:
                    self.lock = self.folder.lock(made=self.folder.path)
                    if self.resume == "auto" and not self.folder.has_checkpoint() and self.folder.started():
                        self.folder.clear_start()  # a job of a continued sweep stopped before its first checkpoint
                yield
        except Stopped as stop:
            sys.exit(self.stopped(stop))
        except RunFinished as finished:
            if self.checkpoint is None or self.sweep is None:
                sys.exit(self.refused(finished))
            said = ", ".join(
                f"{k} {v:.4f}"
                for k, v in self.folder.read_result().get("metrics", {}).items()
                if k in ("val/loss", "val/bpc", "train/loss")
            )
            log.info("job %s finished before (%s); kept as it is", self.folder.path.name, said)
        except USER_ERRORS as err:
            if self.sweep is None or isinstance(err, RunWriteError):  # a full disk stops a sweep too
                sys.exit(self.refused(err))
            log.error("error: %s", err)  # one job of a sweep: recorded, and the sweep goes on
            if not self.folder.result_file.is_file() and process_rank() == 0:
                self.folder.write_result(result_record(self.folder, self.overrides, {}, {}, False, str(err)))
        finally:
            if self.lock is not None:
                os.close(self.lock)

    def refused(self, err: Exception) -> int | str:
        """A job that cannot train: what it made taken back (a run with a checkpoint is kept, and its log says
        how it ended); the exit status, or the line to exit with."""
        if process_rank() != 0:  # what they all meet, or the first's end, the first says for all
            return 1 if isinstance(err, TrainingDiverged | ProcessLost) else f"error: {err}"
        self.folder.take_back(self.record)
        if self.folder.has_checkpoint():
            for handler in (h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)):
                handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, f"error: {err}", (), None))
        return f"error: {err}"

    def stopped(self, stop: Stopped) -> int:
        """A stop before the run could train, or a second Ctrl-C: a run with a checkpoint is told how to continue;
        otherwise what this job made is taken back (a sweep's too, while none of its jobs holds a run)."""
        if process_rank() != 0:
            return stop.status
        self.folder.take_back(self.record)
        ways = [f"continue with: {self.folder.continue_command()}"] if self.folder.has_checkpoint() else []
        if self.sweep is not None:
            if any(
                RunFolder(p).holds_run() or (p / "result.json").is_file() for p in self.sweep.iterdir() if p.is_dir()
            ):
                ways.append(how_to_continue(self.sweep))
            else:
                RunFolder(self.sweep).take_back()
        said = "; ".join(ways) if ways else " before the run's first checkpoint; nothing was kept"
        print(f"\nstopped{'; ' if ways else ''}{said.lstrip() if ways else said}", file=sys.stderr)
        return stop.status

    def stop_sweep(self, signum: int) -> None:
        """A job of a sweep stopped by a signal ends the sweep: its summary, and how to continue it."""
        if self.sweep is not None:
            summarize(self.sweep)
            log.warning("the sweep stops here; %s", how_to_continue(self.sweep))
