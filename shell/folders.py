"""A run folder: every file of a run by name, the lock that keeps one process per run, the runs that can be
continued, and the commands that continue a run or start it again. No other module spells these names.

    <run>/config.yaml            the settings the run started with (a record: never rewritten, nor read)
         tokenizer.json          its tokenizer
         checkpoints/step-NNNNNN.ckpt, last.ckpt (a link to the newest step file), best.ckpt
         checkpoints/superseded/ those after the checkpoint a resume= went back to
         result.json             the final metrics, written when the run ends or stops
         metrics.csv, hparams.yaml, loss.png, samples.md, tensorboard/, wandb/, .wandb_id
         .hydra/, train.log      Hydra's record of the command line (.hydra/resume-<time>/ for each resume), the log
         .lock                   held by the process training the run
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import socket
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

import checkpoint
from checkpoint import BEST_NAME, CHECKPOINTS_DIR, LAST_NAME, CheckpointError, DamagedCheckpoint, checkpoint_step
from data.writes import write_atomically
from shell.checks import PATH_KEYS
from shell.command_line import hydra_quoted, hydra_reading, typed_override
from shell.errors import RunFolderError

log = logging.getLogger(__name__)

PROJECT = Path(__file__).resolve().parents[1]  # the checkout: train.py, generate.py, ...
LOG_NAME = "train.log"  # the run's log, written by Hydra's file handler
SWEEP_RECORD = "multirun.yaml"  # Hydra's record of a sweep's command line, at the root of its folder
RUN_FILES = ("config.yaml", "tokenizer.json", CHECKPOINTS_DIR, "result.json", "metrics.csv", "hparams.yaml")
RUN_FILES += ("loss.png", "samples.md", "tensorboard", "wandb", ".wandb_id")


@dataclass
class RunFolder:
    path: Path

    def __post_init__(self) -> None:
        self.path = Path(os.path.abspath(os.path.expanduser(self.path)))  # one spelling for every lookup

    checkpoints = property(lambda self: self.path / CHECKPOINTS_DIR)
    last = property(lambda self: self.checkpoints / LAST_NAME)
    best = property(lambda self: self.checkpoints / BEST_NAME)
    log = property(lambda self: self.path / LOG_NAME)
    settings_file = property(lambda self: self.path / "config.yaml")
    tokenizer_file = property(lambda self: self.path / "tokenizer.json")
    result_file = property(lambda self: self.path / "result.json")
    lock_file = property(lambda self: self.path / ".lock")
    wandb_id_file = property(lambda self: self.path / ".wandb_id")

    def step_checkpoints(self) -> list[Path]:
        return checkpoint.step_files(self.checkpoints)

    def has_checkpoint(self) -> bool:
        return any(self.checkpoints.glob("*.ckpt"))

    def started(self) -> bool:
        """A run saved its settings and tokenizer here (it may have stopped before its first checkpoint)."""
        try:
            text = self.settings_file.read_text(encoding="utf-8") if self.tokenizer_file.is_file() else ""
        except (OSError, UnicodeDecodeError):
            return False
        return f"\n{checkpoint.PREPARED}:" in "\n" + text

    def holds_run(self) -> bool:
        return self.has_checkpoint() or self.started()

    def read_result(self) -> dict[str, Any]:
        try:
            result = json.loads(self.result_file.read_text())
        except (OSError, ValueError):
            return {}
        return result if isinstance(result, dict) else {}

    def write_result(self, result: dict[str, Any]) -> None:
        write_atomically(self.result_file, json.dumps(result, indent=2))

    def is_finished(self) -> bool:
        return bool(self.read_result().get("finished"))

    def reopen(self) -> None:
        """A finished run that trains further is unfinished until its new end is recorded (so that a kill before
        then leaves a run resume=auto finds)."""
        if (result := self.read_result()).get("finished"):
            self.write_result({**result, "finished": False})

    def sweep(self) -> Path | None:
        """The sweep folder this run is a job of, if it is one."""
        return self.path.parent if (self.path.parent / SWEEP_RECORD).is_file() else None

    # ---- Hydra's record, and the commands printed --------------------------------------------------------

    def first_overrides(self) -> list[str] | None:
        """The command line's settings the run was started with (Hydra's record of them)."""
        try:
            overrides = yaml.safe_load((self.path / ".hydra" / "overrides.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return None
        return [str(o) for o in overrides] if isinstance(overrides, list) else None

    def hydra_record(self, *keys: str) -> Any:
        """A value of Hydra's record of the run's start (.hydra/hydra.yaml), or None."""
        try:
            record = yaml.safe_load((self.path / ".hydra" / "hydra.yaml").read_text())["hydra"]
            for key in keys:
                record = record[key]
            return record
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            return None

    def hydra_record_of_ours(self) -> bool:
        """Whether .hydra/config.yaml, if any, is this project's (a killed start, or another process of the
        launch), not another Hydra program's."""
        try:
            record = yaml.safe_load((self.path / ".hydra" / "config.yaml").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return True  # none, or one being written
        return not isinstance(record, dict) or not record or "runs_root" in record

    def continue_command(self) -> str:
        """The command that continues this run, quoted to be pasted as it is printed."""
        return f"python {script('train.py')} {shlex.quote(typed_override('resume', self.path))}"

    def start_command(self, *changes: str) -> str | None:
        """The command line the run was started with, to start it again (in its own folder where that holds no
        checkpoint), with `changes` (key=value) in place of its own; None without Hydra's record of it."""
        if (overrides := self.first_overrides()) is None:
            return None
        replaced = {"resume", *(change.partition("=")[0] for change in changes)}
        replaced |= {"hydra.run.dir"} if self.has_checkpoint() else set()  # a folder holding a run takes no other
        hydras = [o for o in self.hydra_record("overrides", "hydra") or [] if not o.startswith("hydra.mode=")]
        kept = [
            self.from_anywhere(o) for o in [*hydras, *overrides] if o.partition("=")[0].lstrip("+~") not in replaced
        ]
        return f"python {script('train.py')} {shlex.join([*kept, *changes])}".rstrip()

    def from_anywhere(self, override: str) -> str:
        """An override as it reads from any folder: a path given relative to where the run was started made
        absolute there."""
        key, started_in = override.partition("=")[0], self.hydra_record("runtime", "cwd")
        if key.lstrip("+~") not in (*PATH_KEYS, "hydra.run.dir") or started_in is None:
            return override
        try:
            given = hydra_reading(override).value()
        except Exception:  # (Hydra's grammar error: repeated as it was)
            return override
        paths = given if isinstance(given, list) else [given]
        if not all(isinstance(path, str) for path in paths):
            return override  # (null)
        written = [os.path.join(started_in, os.path.expanduser(p)) for p in paths]
        written = [
            p if re.fullmatch(r"[\w./-]+", p, re.ASCII) else hydra_quoted(p, interpolations=True) for p in written
        ]
        return f"{key}=[{','.join(written)}]" if isinstance(given, list) else f"{key}={written[0]}"

    # ---- checkpoints to continue from --------------------------------------------------------------------

    def checkpoint_to_resume(self) -> Path | None:
        """The newest readable checkpoint of the whole training state: the newest step file, or best.ckpt where it
        was written later (a run killed after a validation). One cut short is passed over, saying so; where none
        can be read, the newest, which reading says what is wrong with."""
        candidates = [*self.step_checkpoints(), *([self.best] if self.best.is_file() else [])]
        readable = []
        for path in candidates:
            if (step := step_of(path)) < 0:
                log.warning("%s cannot be read (cut short or damaged); passed over", path)
            else:
                readable.append((step, path != self.best, path))  # on a tie, the step file
        if not readable:
            return candidates[-1] if candidates else None
        if len(readable) < len(candidates):
            log.warning("continuing from %s, the newest checkpoint that can be read", max(readable)[2])
        return max(readable)[2]

    def checkpoint_named(self, resume: str) -> Path:
        """The checkpoint resume= names in this run: the file given, else the one to resume from."""
        named = Path(resume).expanduser()
        if (checkpoint_file := named if named.is_file() else self.checkpoint_to_resume()) is None:
            again = self.start_command()
            raise CheckpointError(
                f"{self.path} has no checkpoint to resume from (checkpoints/step-*.ckpt or best.ckpt): it stopped "
                f"before its first checkpoint, so start it again as a new run{f': {again}' if again else ''}"
            )
        return checkpoint_file.resolve()

    def check_files(self) -> None:
        """The files a resumed run goes on writing, each a file or folder as the run writes it, that this user can
        read and write; else one line, before anything in the run changes."""
        for name in (*RUN_FILES[2:], LOG_NAME, f"{CHECKPOINTS_DIR}/{BEST_NAME}", f"{CHECKPOINTS_DIR}/{LAST_NAME}"):
            path, folder = self.path / name, name in (CHECKPOINTS_DIR, "tensorboard", "wandb")
            if not path.exists():
                continue
            if path.is_dir() != folder:
                problem = f"is a {'file' if folder else 'folder'}"
            elif not os.access(path, os.R_OK | os.W_OK | (os.X_OK if folder else 0)):
                problem = "cannot be read and written by this user"
            else:
                continue
            raise RunFolderError(f"cannot continue {self.path}: {path} {problem}, where the run keeps its own {path.name}; "
                                 "restore it, or move it aside, then run this again")  # fmt: skip

    def set_aside_after(self, step: int) -> list[Path]:
        """A run resumed from an earlier checkpoint than its newest abandons those after it: they move to
        checkpoints/superseded/, kept but never resumed from by mistake."""
        moved, aside = [], self.checkpoints / "superseded"
        for path in [p for p in [*self.step_checkpoints(), self.best] if p.is_file() and step_of(p) > step]:
            aside.mkdir(exist_ok=True)
            target = aside / path.name
            for n in itertools.count(2):  # beside those an earlier resume set aside
                if not target.exists():
                    break
                target = aside / f"{path.stem}-{n}{path.suffix}"
            moved.append(path.rename(target))
        if self.last.is_symlink() and not self.last.exists():  # it named a file moved aside
            self.last.unlink()
        return moved

    # ---- the lock, and what a run that did not start leaves ----------------------------------------------

    def lock(self, made: Path | None = None) -> int:
        """Hold the run's lock while this process lives (the descriptor returned); RunFolderError naming the
        process that holds it. `made`: the outermost folder made for the run, for take_back."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.read(fd, 4096).decode(errors="replace").splitlines()
            os.close(fd)
            raise self.under_way(owner[0] if owner else "another process") from None
        os.ftruncate(fd, 0)
        since = f"process {os.getpid()} on {socket.gethostname()}, since {datetime.now():%Y-%m-%d %H:%M:%S}\n"
        os.write(fd, (since + (f"made {made}\n" if made else "")).encode())
        return fd

    def held_by(self) -> str | None:
        """The other process holding this run's lock, in words, or None."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except OSError:
            owner = (os.read(fd, 4096).decode(errors="replace").splitlines() or ["another process"])[0]
            return None if owner.startswith(f"process {os.getpid()} on ") else owner
        finally:
            os.close(fd)

    def under_way(self, owner: str) -> RunFolderError:
        if self.sweep() is None and (self.path / SWEEP_RECORD).is_file():
            return RunFolderError(f"the sweep {self.path} is under way ({owner}); wait for it to end (or stop it), then "
                                  f"continue it with {sweep_continue_command(self.path)}")  # fmt: skip
        return RunFolderError(f"run {self.path} is being trained by {owner}; wait for it to end (or stop it), then "
                              f"continue with resume={self.path}")  # fmt: skip

    def take_back(self, record: str | None = None) -> None:
        """Undo what this process made for a run that did not get to its first checkpoint: the folders it made
        (its lock says which), or what it wrote into a folder given empty; of a resume, only Hydra's `record` of
        the command. A folder that holds a checkpoint is never removed."""
        if record is not None or self.has_checkpoint():
            if record:
                shutil.rmtree(self.path / record, ignore_errors=True)
            return
        made = next((line[5:] for line in read_lines(self.lock_file) if line.startswith("made ")), None)
        if made is None:  # a folder that was given empty: what is in it now, this run wrote
            for entry in self.path.iterdir() if self.path.is_dir() else []:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
            return
        shutil.rmtree(self.path, ignore_errors=True)
        for folder in (p for p in self.path.parents if p.is_relative_to(made)):
            try:
                folder.rmdir()
            except OSError:  # not empty: another run started in it meanwhile
                break

    def check_new(self, chosen_by: str = "hydra.run.dir", restarted: bool = False) -> None:
        """Refuse a folder a new run must not write into: one that holds a run, or anybody's files.
        `restarted`: a scheduler restarted the job before its first checkpoint, whose start is cleared."""
        if self.path.exists() and not self.path.is_dir():
            raise RunFolderError(f"{chosen_by}={self.path}: that is a file, not a folder; choose a folder for the run")
        if owner := self.held_by():
            raise RunFolderError(f"{self.path} is a run being trained by {owner}; pick a new {chosen_by}")
        if self.has_checkpoint():
            further = (
                "train it further with resume={} trainer.max_steps=N"
                if self.is_finished()
                else "continue it with resume={}"
            )
            raise RunFolderError(f"{self.path} already holds a run; pick a new {chosen_by} (runs are never overwritten), "
                                 f"or {further.format(self.path)}")  # fmt: skip
        if restarted:
            self.clear_start()
        elif self.started():
            raise RunFolderError(f"{self.path} holds a run that stopped before its first checkpoint, so it cannot be "
                                 f"continued; delete the folder to start it again there, or pick a new {chosen_by}")  # fmt: skip
        if other := self.others((".lock", LOG_NAME, *([".hydra"] if self.hydra_record_of_ours() else []))):
            raise RunFolderError(f"{chosen_by}={self.path} holds files that are not a run's ({other}); a run writes "
                                 "config.yaml, metrics.csv, checkpoints/ and more there, so choose a new or empty folder")  # fmt: skip

    def clear_start(self) -> None:
        """Remove what a run that stopped before its first checkpoint wrote, for it to start again here (a
        scheduler's restart, a sweep continued); a folder holding files no run writes is refused."""
        if other := self.others((*RUN_FILES, ".lock", ".hydra", LOG_NAME)):
            raise RunFolderError(f"{self.path} stopped before its first checkpoint, and holds files that are not a run's "
                                 f"({other}); move them out of it, then run this again to start it there anew")  # fmt: skip
        for path in (self.path / name for name in RUN_FILES):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)

    def others(self, ours: tuple[str, ...]) -> str:
        """The first few names in the folder beyond `ours`, listed ("" where there are none)."""
        found = sorted(p.name for p in self.path.iterdir() if p.name not in ours) if self.path.is_dir() else []
        return ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")

    def point_latest(self, link: Path) -> None:
        """Make `link` (outputs/latest) a link to this run, replacing the old one atomically."""
        if (link := Path(link)).exists() and not link.is_symlink():  # made since the run's settings were checked
            log.warning("%s is not a link (it was made while the run trained), so it is left as it is", link)
            return
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".{link.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.path, target_is_directory=True)
        os.replace(tmp, link)


def read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def step_of(path: Path) -> int:
    """A checkpoint's step; -1 for one cut short or damaged (never the newest). One refused for what it holds
    (pickled code) is refused here."""
    try:
        return checkpoint_step(path)
    except DamagedCheckpoint:
        return -1


# ---- where runs are --------------------------------------------------------------------------------------


def folder_of(path: str | os.PathLike) -> RunFolder:
    """The run a resume= path names: the folder itself, or the run holding a checkpoint (links followed)."""
    if (path := Path(path).expanduser()).is_dir() and path.name == CHECKPOINTS_DIR:
        path = path.parent
    if path.is_dir():
        if (folder := RunFolder(path.resolve())).holds_run():
            return folder
        if again := folder.start_command():
            raise RunFolderError(f"resume={path}: the run started here stopped before it saved its settings (while it "
                                 f"prepared its data), so there is nothing to continue; start it again as a new run: {again}")  # fmt: skip
        raise RunFolderError(f"resume={path}: this folder holds no run (no config.yaml, no checkpoints/); give a run "
                             "folder, a checkpoint in one, or resume=auto")  # fmt: skip
    if path.is_file() and path.parent.name == CHECKPOINTS_DIR:
        return RunFolder(path.parent.parent.resolve())
    if path.is_file() and (path.parent / CHECKPOINTS_DIR).is_dir():  # a file of a run: its config.yaml, ...
        raise RunFolderError(
            f"resume={path} is a file of a run, not a checkpoint; give the run folder: resume={path.parent}"
        )
    if path.is_file():
        raise RunFolderError(
            f"resume={path}: a checkpoint outside a run folder cannot be resumed; use init_from={path}"
        )
    if path.is_symlink():  # outputs/latest, its run deleted since
        raise RunFolderError(f"resume={path} links to {os.readlink(path)}, which no longer exists; give a run folder "
                             "that does, a checkpoint in one, or resume=auto")  # fmt: skip
    raise RunFolderError(f"resume={path} does not exist; give a run folder, a checkpoint in one, or resume=auto")


def check_readable_by_hydra(path: str | os.PathLike, keys: str) -> None:
    """A folder Hydra is given must not hold ${ in its path: Hydra reads it again as a reference to a setting.
    `keys`: the settings that name another, for the refusal to say."""
    if "${" in str(where := Path(path).absolute()):
        raise RunFolderError(f"{where} has ${{ in its path, which Hydra reads as a reference to a setting; rename that "
                             f"folder, or run in another ({keys}, or from another folder)")  # fmt: skip


def new_folder(root: str | os.PathLike) -> tuple[RunFolder, Path]:
    """A new run folder under root named by the time (YYYY-MM-DD/HH-MM-SS, then -2, -3, ... where another run
    took the name first: each is taken by an atomic mkdir), and the outermost folder made for it."""
    base = Path(root).expanduser().absolute() / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    made = next((p for p in [*reversed(base.parents), base] if not p.exists()), base)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        try:
            (candidate := base if n == 1 else base.with_name(f"{base.name}-{n}")).mkdir()
        except FileExistsError:
            continue
        return RunFolder(candidate), made if made != base else candidate
    raise RunFolderError(f"cannot find a free run folder name next to {base}")


def resumable_runs(root: str | os.PathLike) -> list[RunFolder]:
    """Unfinished runs with a checkpoint under root (named by time, or by their launcher), the most recently
    checkpointed first; links such as root/latest are not runs of their own."""
    found = []
    for settings in [*Path(root).expanduser().glob("*/config.yaml"), *Path(root).expanduser().glob("*/*/config.yaml")]:
        folder = RunFolder(settings.parent)
        if settings.parent.is_symlink() or settings.parent.parent.is_symlink() or folder.is_finished():
            continue
        try:
            newest = folder.checkpoint_to_resume() if folder.started() else None
        except CheckpointError:  # one refused for what it holds: not a run to continue unasked
            continue
        found += [(newest.stat().st_mtime, folder)] if newest else []
    return [folder for _, folder in sorted(found, key=lambda item: item[0], reverse=True)]


def script(name: str) -> str:
    """One of the project's scripts as a command names it: by its name in the project's folder, else by its path."""
    return name if Path.cwd().resolve() == PROJECT else shlex.quote(str(PROJECT / name))


def sweep_continue_command(sweep: str | os.PathLike) -> str:
    return f"python {script('train.py')} -m {shlex.quote(typed_override('resume', RunFolder(sweep).path))}"


def process_rank(environ=os.environ) -> int:
    """This process's rank in a multi-process launch (0 alone), read as Lightning reads it."""
    return next(
        (int(environ[k]) for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK") if environ.get(k)), 0
    )


def launcher_name(environ=os.environ) -> str | None:
    """The folder name every process of one torchrun or SLURM launch agrees on (each composes the config)."""
    if environ.get("SLURM_JOB_ID") and environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        if environ.get("SLURM_ARRAY_JOB_ID"):
            return f"slurm-{environ['SLURM_ARRAY_JOB_ID']}_{environ.get('SLURM_ARRAY_TASK_ID', '0')}"
        return f"slurm-{environ['SLURM_JOB_ID']}"
    if (run_id := environ.get("TORCHELASTIC_RUN_ID", "none")) != "none":
        return "torchrun-" + re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    return None


def launcher_restarted(environ=os.environ) -> bool:
    """Whether a scheduler restarted this launch (a requeued SLURM job, torchrun's workers started again)."""
    return any(int(environ.get(key) or 0) > 0 for key in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))
