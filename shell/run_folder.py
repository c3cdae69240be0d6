"""A run folder: every file of a run by name, the lock that keeps one process per run, the choice of a
new folder, and finding the runs that can be continued. No other module spells these names (but for
the checkpoint names checkpoint reads run folders by, which it defines: it needs no training code).

    <run>/config.yaml            the settings the run started with (never rewritten)
         tokenizer.json          its tokenizer
         checkpoints/step-NNNNNN.ckpt, last.ckpt (a link to the newest step file), best.ckpt
         checkpoints/superseded/ those after the checkpoint a resume= went back to
         result.json             the final metrics, written when the run ends or stops
         metrics.csv, hparams.yaml, loss.png, samples.md, tensorboard/, wandb/, .wandb_id
         wandb/data/             wandb's data folder (artifacts staged for an offline run's sync)
         .hydra/, train.log      Hydra's record of the command line, and the log
         .lock                   held by the process training the run
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import socket
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

import checkpoint
from checkpoint import BEST_NAME, CHECKPOINTS_DIR, LAST_NAME, CheckpointError, checkpoint_step
from data.writes import write_atomically
from shell.checks import PATH_KEYS

log = logging.getLogger(__name__)


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked; the message says why and what to do."""


LOG_NAME = "train.log"  # the run's log, written by Hydra's file handler
HYDRA_FILES = (".hydra", LOG_NAME)  # Hydra's record of the command line, and the log
SETTINGS_MARK = checkpoint.PREPARED  # a key of the saved settings that marks config.yaml as a run's
OWN_CONFIG_KEYS = ("runs_root", "tokens_per_step")  # top-level settings of configs/train.yaml: Hydra's record of ours
SWEEPS_ROOT = "multirun"  # where sweeps go, a folder each
SWEEP_RECORD = "multirun.yaml"  # Hydra's record of a sweep's command line, at the root of its folder


class SettingsLoader(yaml.SafeLoader):
    """YAML read as config.yaml is written and read back (OmegaConf, Hydra's command line): 1e-3 is a
    number, where YAML 1.1 reads a string unless it has a dot (1.0e-3)."""


SettingsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def is_sweep(folder: str | os.PathLike) -> bool:
    return (Path(folder) / SWEEP_RECORD).is_file()


@dataclass
class RunFolder:
    path: Path

    def __post_init__(self) -> None:
        self.path = Path(os.path.abspath(os.path.expanduser(self.path)))  # one spelling for every lookup

    # ---- names -------------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    def step_checkpoint(self, step: int) -> Path:
        return checkpoint.step_file(self.checkpoints, step)

    @property
    def log(self) -> Path:
        return self.path / LOG_NAME

    @property
    def last(self) -> Path:
        return self.checkpoints / LAST_NAME

    @property
    def best(self) -> Path:
        return self.checkpoints / BEST_NAME

    def step_checkpoints(self) -> list[Path]:
        """The periodic checkpoints, oldest first."""
        return checkpoint.step_files(self.checkpoints)

    settings_file = property(lambda self: self.path / "config.yaml")
    tokenizer_file = property(lambda self: self.path / "tokenizer.json")
    result_file = property(lambda self: self.path / "result.json")
    loss_curve = property(lambda self: self.path / "loss.png")
    samples_file = property(lambda self: self.path / "samples.md")
    tensorboard = property(lambda self: self.path / "tensorboard")
    wandb_id_file = property(lambda self: self.path / ".wandb_id")
    wandb_data = property(lambda self: self.path / "wandb" / "data")
    lock_file = property(lambda self: self.path / ".lock")

    @staticmethod
    def resume_record(stamp: str) -> str:
        """Where Hydra keeps its record of a resume's command line, inside the run folder."""
        return f".hydra/resume-{stamp}"

    STARTING_FILES = (".lock", *HYDRA_FILES)  # what a starting run holds before it checks its folder
    RUN_FILES = (  # what a run writes beside them (the loggers' files too)
        "config.yaml", "tokenizer.json", CHECKPOINTS_DIR, "result.json", "metrics.csv", "hparams.yaml",
        "loss.png", "samples.md", "tensorboard", "wandb", ".wandb_id",
    )  # fmt: skip

    # what a continued run goes on writing, by name: True for a folder, False for a file
    KEPT = {
        ".lock": False, ".hydra": True, LOG_NAME: False, CHECKPOINTS_DIR: True, f"{CHECKPOINTS_DIR}/{LAST_NAME}": False,
        f"{CHECKPOINTS_DIR}/{BEST_NAME}": False, "result.json": False, "metrics.csv": False, "hparams.yaml": False,
        "loss.png": False, "samples.md": False, "tensorboard": True, "wandb": True, ".wandb_id": False,
    }  # fmt: skip

    # ---- what the folder holds ---------------------------------------------------------------------

    def holds_run(self) -> bool:
        """Whether a run has started here: a checkpoint, or the settings and tokenizer a run saves first."""
        return self.has_checkpoint() or self.started()

    def started(self) -> bool:
        """A run saved its settings and tokenizer here (it may have stopped before its first checkpoint)."""
        if not (self.settings_file.is_file() and self.tokenizer_file.is_file()):
            return False
        try:
            return f"\n{SETTINGS_MARK}:" in "\n" + self.settings_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return False

    def has_checkpoint(self) -> bool:
        return any(self.checkpoints.glob("*.ckpt"))

    def continue_command(self) -> str:
        """The command that continues this run, quoted so that it can be pasted as it is printed."""
        return f"python {script('train.py')} {shlex.quote(typed_override('resume', self.path))}"

    def other_files(self, ours: tuple[str, ...] = STARTING_FILES) -> list[str]:
        """Names in the folder beyond `ours`: by default, what a run holds as it starts."""
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if p.name not in ours)

    def check_new(self, chosen_by: str = "hydra.run.dir", restarting: bool = False, in_hydra: bool = True) -> None:
        """Refuse a folder a new run must not write into: one that holds a run, or anybody's files.
        `chosen_by`: the setting that named the folder, for the message. `restarting`: the folder is a
        scheduler's job's own, restarted before its first checkpoint: that start may be taken over.
        `in_hydra`: Hydra has started this run, and its record and log in the folder are this run's;
        before it starts they may also be another process's of the same launch (torchrun's ranks start
        Hydra together), or of a start of this run that was killed, but not another Hydra program's."""
        if self.path.exists() and not self.path.is_dir():
            raise RunFolderError(f"{chosen_by}={self.path}: that is a file, not a folder; choose a folder for the run")
        owner = self.held_by()
        if owner:
            raise RunFolderError(f"{self.path} is a run being trained by {owner}; pick a new {chosen_by}")
        if self.holds_run() and self.has_checkpoint():
            further = (
                "train it further with resume={} trainer.max_steps=N"
                if self.is_finished()
                else "continue it with resume={}"
            )
            raise RunFolderError(
                f"{self.path} already holds a run; pick a new {chosen_by} (runs are never overwritten), "
                f"or {further.format(self.path)}"
            )
        if self.started() and not restarting:
            raise RunFolderError(
                f"{self.path} holds a run that stopped before its first checkpoint, so it cannot be continued; "
                f"delete the folder to start it again there, or pick a new {chosen_by}"
            )
        theirs = not in_hydra and self.hydra_record_of_another_program()
        other = [] if restarting else self.other_files((".lock",) if theirs else self.STARTING_FILES)
        if other:
            listed = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
            raise RunFolderError(
                f"{chosen_by}={self.path} holds files that are not a run's ({listed}); a run writes config.yaml, "
                "metrics.csv, checkpoints/ and more there, so choose a new or empty folder"
            )

    def hydra_record_of_another_program(self) -> bool:
        """Whether .hydra/config.yaml is another Hydra program's: a whole mapping (written to its last
        newline) without this project's top-level settings. One not there yet, empty or being written is
        not taken for another's: the first process of a launch may be writing it."""
        try:
            text = (self.path / ".hydra" / "config.yaml").read_text(encoding="utf-8")
            config = yaml.safe_load(text) if text.endswith("\n") else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return False
        return isinstance(config, dict) and bool(config) and not any(key in config for key in OWN_CONFIG_KEYS)

    def check_continuable(self) -> None:
        """Before a run is continued, and before anything in its folder changes: the folder, and each file
        of it the run goes on writing, must be what the run made (a folder, or a file) and readable and
        writable by this user, where the run would stop on it with a traceback, part of it changed."""
        for path, is_folder in [(self.path, True), *((self.path / name, kind) for name, kind in self.KEPT.items())]:
            if not (path.exists() or path.is_symlink()):
                continue  # (a file the run has not written, or a link to a checkpoint moved aside: made anew)
            if path.is_dir() != is_folder:
                found, kept = ("a file", "folder") if is_folder else ("a folder", "file")
                raise RunFolderError(
                    f"{path} is {found}, where the run keeps its {path.name} {kept}; move it out of the run "
                    f"folder (the run makes a new one), then continue with: {self.continue_command()}"
                )
            if not os.access(path, os.R_OK | os.W_OK | (os.X_OK if is_folder else 0)):
                mode = "u+rwx" if is_folder else "u+rw"
                raise RunFolderError(
                    f"{path} cannot be read and written by this user, and the run goes on writing it; make it so "
                    f"(chmod {mode} {shlex.quote(str(path))}), then continue with: {self.continue_command()}"
                )

    def continuation(self) -> str:
        """What continuing what is in this folder means: "finished" (nothing is left to do), "resume"
        (from its newest checkpoint), "again" (a start that stopped before its first checkpoint, or was
        refused: clear_start, then start anew) or "new" (no run is here)."""
        if self.is_finished():
            return "finished"
        if self.has_checkpoint():
            return "resume"
        return "again" if self.started() or self.result_file.is_file() else "new"

    def clear_start(self) -> list[str]:
        """Remove what a run that stopped before its first checkpoint wrote (as a Ctrl-C at that point
        takes it back), for it to start again here: a scheduler's requeue, a sweep continued. Hydra's
        record and the log stay. A folder that holds files no run writes is refused, with nothing
        removed. Returns what went."""
        if any(self.checkpoints.rglob("*.ckpt")):
            raise RunFolderError(f"{self.path} holds checkpoints: continue it with resume={self.path}")
        others = [name for name in self.other_files() if name not in self.RUN_FILES]
        if others:
            listed = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise RunFolderError(
                f"{self.path} stopped before its first checkpoint, and holds files that are not a run's ({listed}); "
                "move them out of it, then run this again to start it there anew"
            )
        removed = []
        for name in self.RUN_FILES:
            path = self.path / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
            else:
                continue
            removed.append(name)
        return removed

    def is_finished(self) -> bool:
        return bool(self.read_result().get("finished"))

    def reopen(self) -> None:
        """A finished run that trains further: its result.json says it is not finished (its metrics are
        still those of the earlier end), so that a stop before the new end, even a kill, leaves a run that
        resume= continues and resume=auto finds."""
        result = self.read_result()
        if result.get("finished"):
            self.write_result({**result, "finished": False})

    def read_result(self) -> dict[str, Any]:
        try:
            return json.loads(self.result_file.read_text())
        except (OSError, ValueError):
            return {}

    def write_result(self, result: dict[str, Any]) -> None:
        write_atomically(self.result_file, json.dumps(result, indent=2))

    def read_settings(self) -> dict[str, Any] | None:
        """What config.yaml holds now (a record of how the run began, which a resume does not read, but a
        hand may have edited), or None where there is none; RunFolderError, saying why, where it cannot be
        read or holds no settings."""
        try:
            text = self.settings_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except UnicodeDecodeError:
            raise RunFolderError(f"{self.settings_file} is not UTF-8 text") from None
        except OSError as err:
            raise RunFolderError(f"{self.settings_file} cannot be read ({err.strerror or err})") from None
        try:
            settings = yaml.load(text, Loader=SettingsLoader)
        except yaml.MarkedYAMLError as err:
            where = f" at line {err.problem_mark.line + 1}" if err.problem_mark else ""
            raise RunFolderError(
                f"{self.settings_file} is not valid YAML ({err.problem or err.context}{where})"
            ) from None
        except yaml.YAMLError as err:
            raise RunFolderError(f"{self.settings_file} is not valid YAML ({err})") from None
        if not isinstance(settings, dict):
            raise RunFolderError(f"{self.settings_file} holds no settings (not a mapping of names to values)")
        return settings

    def first_overrides(self) -> list[str] | None:
        """The command line the run was started with (Hydra's record of it), if it was started by train.py."""
        try:
            overrides = yaml.safe_load((self.path / ".hydra" / "overrides.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return None
        return [str(o) for o in overrides] if isinstance(overrides, list) else None

    def sweep(self) -> Path | None:
        """The sweep folder this run is a job of, if it is one (Hydra writes multirun.yaml at its root)."""
        return self.path.parent if is_sweep(self.path.parent) else None

    # ---- checkpoints to continue from --------------------------------------------------------------

    def checkpoint_to_resume(self) -> Path | None:
        """The newest readable checkpoint holding the whole training state: the newest step file, or
        best.ckpt when it was written later (a run killed after a validation but before its next step
        file). A file that cannot be read (cut short, damaged) is passed over with a warning naming it;
        when none can be read, the newest is returned, and reading it says what is wrong."""
        candidates = [*self.step_checkpoints(), *([self.best] if self.best.is_file() else [])]
        readable = []
        for path in candidates:
            step = step_of(path)
            if step < 0:
                log.warning("%s cannot be read (cut short or damaged); passed over", path)
            else:
                readable.append((step, path is self.best, path))  # on a tie, the step file
        if not readable:
            return candidates[-1] if candidates else None
        chosen = max(readable, key=lambda found: (found[0], not found[1]))[2]
        if len(readable) < len(candidates):
            log.warning("continuing from %s, the newest checkpoint that can be read", chosen)
        return chosen

    def set_aside_after(self, step: int) -> list[Path]:
        """A run resumed from an earlier checkpoint than its newest abandons what came after it: those
        checkpoints (step files, and best.ckpt if it is later) are moved to checkpoints/superseded/, kept
        but never resumed from by mistake. Returns where they went."""
        later = [p for p in self.step_checkpoints() if step_of(p) > step]
        if self.best.is_file() and step_of(self.best) > step:
            later.append(self.best)
        if not later:
            return []
        aside = self.checkpoints / "superseded"
        aside.mkdir(exist_ok=True)
        moved = []
        for path in later:
            target = aside / path.name
            for n in itertools.count(2):
                if not target.exists():
                    break
                target = aside / f"{path.stem}-{n}{path.suffix}"
            moved.append(path.rename(target))
        if self.last.is_symlink() and not self.last.exists():  # it named a file moved aside
            self.last.unlink()
        return moved

    def checkpoint_named(self, resume: str | os.PathLike) -> Path:
        """The checkpoint resume= names in this run: the file given, else the one to resume from."""
        named = Path(resume).expanduser()
        if folder_of(named).path.resolve() != self.path.resolve():
            raise RunFolderError(f"resume={resume} is not a run in {self.path}; continue a run in its own folder")
        checkpoint = named if named.is_file() else self.checkpoint_to_resume()
        if checkpoint is None:
            raise CheckpointError(
                f"{self.path} has no checkpoint to resume from (checkpoints/step-*.ckpt or best.ckpt): it stopped "
                f"before its first checkpoint, so start it again as a new run{self.start_again()}"
            )
        return checkpoint.resolve()

    def start_again(self) -> str:
        """How to start again a run that stopped before its first checkpoint, as a clause: the sweep's
        continue command for a job of a sweep, else the command line it was started with."""
        if self.sweep():
            return f" (its sweep continues it: {sweep_continue_command(self.sweep())})"
        overrides = self.first_overrides()
        if overrides is None:
            return ""
        return f": python {script('train.py')} {shlex.join(map(self.from_anywhere, overrides))}".rstrip()

    def new_run_command(self, *changes: str) -> str | None:
        """The command line this run was started with, to start it as a new run: with `changes`
        (key=value) in place of its own values, without its hydra.run.dir (which holds this run) or a
        resume=; None where Hydra's record of it is missing."""
        overrides = self.first_overrides()
        if overrides is None:
            return None
        replaced = {"hydra.run.dir", "resume", *(change.partition("=")[0] for change in changes)}
        kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in replaced]
        return f"python {script('train.py')} {shlex.join([*map(self.from_anywhere, kept), *changes])}"

    def from_anywhere(self, override: str) -> str:
        """An override of the run's command line as it reads from any folder: a path setting given
        relative to the folder the run was started in (data.path=input.txt) made absolute there."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        key = override.partition("=")[0]
        started_in = self.started_in()
        if key.lstrip("+~") not in PATH_KEYS or started_in is None:
            return override
        try:
            given = OverridesParser.create().parse_override(override).value()
        except Exception:  # (Hydra's grammar error: the override is repeated as it was)
            return override
        paths = given if isinstance(given, list) else [given]
        if not all(isinstance(path, str) for path in paths):
            return override  # (null)
        written = []
        for path in (os.path.join(started_in, os.path.expanduser(path)) for path in paths):
            written.append(
                path if re.fullmatch(r"[\w./-]+", path, re.ASCII) else hydra_quoted(path, interpolations=True)
            )
        return f"{key}=[{','.join(written)}]" if isinstance(given, list) else f"{key}={written[0]}"

    def started_in(self) -> str | None:
        """The folder the run was started in (Hydra's record of it), where its relative paths lead."""
        try:
            record = yaml.safe_load((self.path / ".hydra" / "hydra.yaml").read_text(encoding="utf-8"))
            return str(record["hydra"]["runtime"]["cwd"])
        except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
            return None

    # ---- the lock ----------------------------------------------------------------------------------

    def lock(self) -> None:
        """Hold the run's lock for the rest of this process (taken again in the same process, it is
        the same lock). Another process holding it: RunFolderError naming that process."""
        key = str(self.path)
        if key in _HELD:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no flock (Windows): the lock is advisory only
            pass
        except OSError as err:
            owner = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise self.under_way(owner) from None
            raise
        os.ftruncate(fd, 0)
        os.write(
            fd, f"process {os.getpid()} on {socket.gethostname()}, since {datetime.now():%Y-%m-%d %H:%M:%S}".encode()
        )
        _HELD[key] = fd

    def under_way(self, owner: str) -> RunFolderError:
        """The refusal of a run or sweep that `owner`, another process, holds."""
        if is_sweep(self.path):
            return RunFolderError(
                f"the sweep {self.path} is under way ({owner}); wait for it to end (or stop it), then continue it "
                f"with {sweep_continue_command(self.path)}"
            )
        return RunFolderError(
            f"run {self.path} is being trained by {owner}; wait for it to end (or stop it), then continue with "
            f"resume={self.path}"
        )

    def held_by(self) -> str | None:
        """The process holding another process's lock on this run, or None (this process's own: None)."""
        if str(self.path) in _HELD or not self.lock_file.is_file():
            return None
        fd = os.open(self.lock_file, os.O_RDONLY)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except ImportError:
            return None
        except OSError:
            return os.read(fd, 4096).decode(errors="replace").strip() or "another process"
        finally:
            os.close(fd)

    def unlock(self) -> None:
        fd = _HELD.pop(str(self.path), None)
        if fd is not None:
            os.close(fd)

    # ---- the newest run ----------------------------------------------------------------------------

    def point_latest(self, link: Path) -> None:
        """Make `link` (e.g. outputs/latest) a symlink to this run, replacing the old one atomically."""
        link = Path(link)
        if link.exists() and not link.is_symlink():  # made since the run's settings were checked: kept
            log.warning("%s is not a link (it was made while the run trained), so it is left as it is", link)
            return
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".{link.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.path.resolve(), target_is_directory=True)
        os.replace(tmp, link)


_HELD: dict[str, int] = {}  # run folder -> the descriptor holding its lock in this process
_CLAIMS: dict[str, Claim] = {}  # run folder -> what this process made there


def take_back_claims() -> list[RunFolder]:
    """Ctrl-C before a run began: every folder this process claimed is taken back, but for those that
    hold a checkpoint (or a sweep whose jobs hold runs), which are only unlocked and returned."""
    kept = []
    for taken in reversed(list(_CLAIMS.values())):  # a sweep's job before the sweep
        taken.take_back()
        if taken.keeps():
            kept.append(taken.folder)
    return kept


def claim(folder: RunFolder, new: bool) -> Claim:
    """Take a run folder for this process: lock it, and for a new run make it (or note what an existing,
    empty one held), so that a refused start can take back what it made. Claimed again in the same
    process (train.py claims before Hydra starts, then trains), it is the same claim."""
    key = str(folder.path)
    if key not in _CLAIMS:
        made = Claim.make(folder) if new else Claim.existing(folder)
        try:
            folder.lock()
        except RunFolderError:
            made.remove_empty_folders()  # the folder is the lock holder's now: only empty ones go
            raise
        _CLAIMS[key] = made
    else:
        folder.lock()
    return _CLAIMS[key]


def adopt(made: Claim) -> Claim:
    """Register a claim made elsewhere (a new folder from claim_new_folder) as this process's, locked."""
    made.folder.lock()
    _CLAIMS[str(made.folder.path)] = made
    return made


def claim_sweep(made: Claim) -> Claim:
    """Register a sweep folder (new, or one that was empty) as this process's, locked, so that a second
    sweep pointed at it is refused and a stop before any of its jobs holds a run takes it back."""
    return adopt(SweepClaim(made.folder, made.made, made.before))


def step_of(checkpoint: Path) -> int:
    try:
        return checkpoint_step(checkpoint)
    except CheckpointError:
        return -1  # a damaged file is never the newest; reading it later says what is wrong


# ---- where a run goes --------------------------------------------------------------------------------


def folder_of(path: str | os.PathLike) -> RunFolder:
    """The run a resume= path names: the folder itself, or the run holding a checkpoint (links, such
    as outputs/latest, followed: the run is named by its own folder)."""
    path = Path(path).expanduser()
    if path.is_dir() and path.name == CHECKPOINTS_DIR:
        path = path.parent
    if path.is_dir():
        folder = RunFolder(path.resolve())
        if not folder.holds_run() and folder.first_overrides() is not None:
            raise RunFolderError(
                f"resume={path}: the run started here stopped before it saved its settings (while it prepared its "
                f"data), so there is nothing to continue; start it again as a new run{folder.start_again()}"
            )
        if not folder.holds_run():
            raise RunFolderError(
                f"resume={path}: this folder holds no run (no config.yaml, no checkpoints/); give a run "
                "folder, a checkpoint in one, or resume=auto"
            )
        return folder
    if path.is_file() and path.parent.name == CHECKPOINTS_DIR:
        return RunFolder(path.parent.parent.resolve())
    if path.is_file() and path.parent.joinpath(CHECKPOINTS_DIR).is_dir():  # a file of a run: its config.yaml, ...
        raise RunFolderError(
            f"resume={path} is a file of a run, not a checkpoint; give the run folder: resume={path.parent}"
        )
    if path.is_file():
        raise RunFolderError(
            f"resume={path}: a checkpoint outside a run folder cannot be resumed; use init_from={path}"
        )
    if path.is_symlink():  # outputs/latest, its run deleted since
        raise RunFolderError(
            f"resume={path} links to {os.readlink(path)}, which no longer exists; give a run folder that does, a "
            "checkpoint in one, or resume=auto"
        )
    raise RunFolderError(f"resume={path} does not exist; give a run folder, a checkpoint in one, or resume=auto")


PROJECT = Path(__file__).resolve().parents[1]  # the checkout: train.py, generate.py, ...
TYPED_IN: Path | None = None  # where the command was typed, when it runs elsewhere (run_where_started)


def run_where_started(folder: str | os.PathLike) -> None:
    """Run the rest of this command in folder (a continued sweep, where it was started), the commands it
    prints still naming the scripts as they can be typed where it was typed."""
    global TYPED_IN
    TYPED_IN = TYPED_IN or Path.cwd()
    os.chdir(folder)


def script(name: str) -> str:
    """One of the project's scripts as a command to paste here names it: by its name in the project's
    own folder, else by its full path (a run started from elsewhere, as python /path/to/train.py)."""
    return name if (TYPED_IN or Path.cwd()).resolve() == PROJECT else shlex.quote(str(PROJECT / name))


def sweep_continue_command(sweep: str | os.PathLike) -> str:
    """The command that continues a sweep stopped part way, quoted to be pasted as it is printed."""
    return f"python {script('train.py')} -m {shlex.quote(typed_override('resume', RunFolder(sweep).path))}"


# ---- folders on Hydra's command line -----------------------------------------------------------------

# Settings that name a folder (or the run to continue), whose value train.py takes whole as typed: a
# path with letters beyond ASCII, a comma, =, spaces, quotes or brackets, which Hydra's grammar reads
# otherwise or not at all. These are never swept.
WHOLE_PATH_KEYS = ("runs_root", "latest_link", "hydra.run.dir", "hydra.sweep.dir", "resume")


def hydra_quoted(value: str, interpolations: bool = False) -> str:
    """value as a quoted string of Hydra's override grammar, which Hydra reads back as value: each ' and
    the backslashes before it escaped, as are backslashes at its end; ${ kept as OmegaConf's
    interpolation (`interpolations`), or else escaped, as are the backslashes before it."""
    if not interpolations:
        value = re.sub(r"(\\*)\$\{", lambda found: found[1] * 2 + "\\${", value)
    value = re.sub(r"(\\*)'", lambda found: found[1] * 2 + "\\'", value)
    return "'" + value + "\\" * (len(value) - len(value.rstrip("\\"))) + "'"


def hydra_reading(override: str) -> Any:
    """An override as Hydra's grammar reads it (its Override); the grammar's exception where it cannot."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override)


def given_value(override: str) -> str:
    """The value of key=value as Hydra reads it where that is one string (quotes and escapes read),
    else the text after the first = (a number, a list, a sweep, or what the grammar cannot read)."""
    try:
        value = hydra_reading(override).value()
    except Exception:  # Hydra's grammar error
        value = None
    return value if isinstance(value, str) else override.partition("=")[2]


def hydra_override(key: str, value: str | os.PathLike) -> str:
    """key=value for Hydra itself (hydra.run.dir=, resume=, ... that train.py writes): plain where Hydra
    reads it as exactly value, quoted where not (a letter beyond ASCII, a comma, ${, a space at its end...)."""
    value = str(value)
    try:
        plain = "${" not in value and "\\" not in value and hydra_reading(f"{key}={value}").value() == value
    except Exception:  # Hydra's grammar error
        plain = False
    return f"{key}={value}" if plain else f"{key}={hydra_quoted(value)}"


def whole_path(override: str) -> str:
    """An override of a folder setting (WHOLE_PATH_KEYS) as typed, made what Hydra reads as the one path
    it names: its value quoted, where Hydra's grammar reads several values (a comma), or cannot read it
    (letters beyond ASCII, =, quotes, brackets). Interpolations (${now:...}) stay; a value that starts
    with ~ is left for the refusal that says to write $HOME. resume= is read whole only where that path
    exists (resume=a,b names several runs, refused as such). Other overrides are returned as they are."""
    key, equals, value = override.partition("=")
    if not equals or key.lstrip("+") not in WHOLE_PATH_KEYS or value.startswith("~"):
        return override
    try:
        parsed = hydra_reading(override)
        one = not parsed.is_sweep_override() and not isinstance(parsed.value(), list | dict)
    except Exception:  # Hydra's grammar error
        return f"{key}={hydra_quoted(value, interpolations=True)}"
    if one or (key.lstrip("+") == "resume" and not os.path.lexists(os.path.expanduser(value))):
        return override
    return f"{key}={hydra_quoted(value, interpolations=True)}"


def check_hydra_folder(path: str | os.PathLike) -> None:
    """A run or sweep folder Hydra can be given: Hydra reads its own record of the folder again as a
    setting, where ${ is a reference to another, so a path with ${ in it is refused before anything is made."""
    if "${" in str(path):
        raise RunFolderError(
            f"{path} has ${{ in its path, which Hydra reads as a reference to a setting; rename that folder, or "
            "run in another (runs_root=DIR, hydra.run.dir=DIR, or from another folder)"
        )


def typed_override(key: str, path: str | os.PathLike) -> str:
    """key=path as one types it to train.py (before the shell's quotes): plain where train.py reads it
    back as path (whole_path, or Hydra's grammar), Hydra's quoted form where not (${, a backslash
    Hydra would read as an escape, a space at either end)."""
    path, plain = str(path), f"{key}={path}"
    if "${" not in path and whole_path(plain) != plain:  # taken whole: exactly path
        return plain
    return hydra_override(key, path)


def launcher_run_name(environ=os.environ) -> str | None:
    """The run folder's name that every process of one multi-process launch agrees on, or None.

    Processes started by SLURM or torchrun each compose the config, so they need a name they all
    derive alike; Lightning's own launcher hands its folder to the processes it starts.
    """
    if environ.get("SLURM_JOB_ID") and environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        if environ.get("SLURM_ARRAY_JOB_ID"):
            return f"slurm-{environ['SLURM_ARRAY_JOB_ID']}_{environ.get('SLURM_ARRAY_TASK_ID', '0')}"
        return f"slurm-{environ['SLURM_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return "torchrun-" + re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    return None


def launcher_folder(runs_root: str | os.PathLike, environ=os.environ) -> RunFolder | None:
    """The run folder a SLURM job or a torchrun launch names for itself under runs_root, or None."""
    name = launcher_run_name(environ)
    return RunFolder(Path(runs_root) / name) if name else None


def process_rank(environ=os.environ) -> int:
    """This process's rank in a multi-process launch (0 alone), read as Lightning reads it."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):  # LOCAL_RANK before SLURM's
        if environ.get(key) is not None:
            return int(environ[key])
    return 0


def launcher_restarted(environ=os.environ) -> bool:
    """Whether this launch is a scheduler's restart of an earlier one: a requeued SLURM job, or
    workers torchrun started again."""
    return int(environ.get("SLURM_RESTART_COUNT") or 0) > 0 or int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0


def claim_new_folder(root: str | os.PathLike) -> Claim:
    """Make a new run folder under root, named by the time (YYYY-MM-DD/HH-MM-SS), with -2, -3, ...
    appended when another run took that name first. Each name is taken by an atomic mkdir, so two runs
    started at the same moment get two folders."""
    base = Path(root).expanduser() / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    made = [p for p in [base.parent, *base.parent.parents] if not p.exists()][::-1]
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return Claim(RunFolder(candidate), [*made, candidate])
    raise RunFolderError(f"cannot find a free run folder name next to {base}")


def resumable_runs(root: str | os.PathLike) -> list[RunFolder]:
    """Unfinished runs under root (named by time, or by their launcher) that have a checkpoint, the most
    recently checkpointed first (links such as root/latest are not runs of their own)."""
    found = []
    for settings in [*Path(root).expanduser().glob("*/config.yaml"), *Path(root).expanduser().glob("*/*/config.yaml")]:
        if settings.parent.is_symlink() or settings.parent.parent.is_symlink():
            continue
        folder = RunFolder(settings.parent)
        checkpoint = folder.checkpoint_to_resume() if folder.started() else None
        if checkpoint is None or folder.is_finished():
            continue
        found.append((checkpoint.stat().st_mtime, folder))
    return [folder for _, folder in sorted(found, key=lambda item: item[0], reverse=True)]


@dataclass
class Claim:
    """What one invocation made in a run folder, so that a refused start can take it back."""

    folder: RunFolder
    made: list[Path] = field(default_factory=list)  # folders this invocation made, the run folder last
    before: set[str] = field(default_factory=set)  # what the folder held before, when it was not made

    @classmethod
    def make(cls, folder: RunFolder) -> Claim:
        """Make the folder (and missing parents), remembering which were made here."""
        if folder.path.exists():
            if not folder.path.is_dir():
                raise RunFolderError(f"{folder.path} is a file, not a folder; choose a folder for the run")
            return cls.existing(folder)
        made = [p for p in [folder.path, *folder.path.parents] if not p.exists()][::-1]
        folder.path.mkdir(parents=True, exist_ok=True)
        return cls(folder, made)

    @classmethod
    def existing(cls, folder: RunFolder) -> Claim:
        return cls(folder, [], {p.name for p in folder.path.iterdir()} if folder.path.is_dir() else set())

    def release(self) -> None:
        """The run is over for this process: unlock it and forget the claim."""
        self.folder.unlock()
        _CLAIMS.pop(str(self.folder.path), None)

    def take_back(self) -> None:
        """Remove what this invocation made: the folders it made (parents only while empty, as another
        run may have started in them meanwhile), else the files it added to an existing folder. A
        folder that holds a run is never removed."""
        self.release()
        if self.keeps():
            return
        if self.made:
            shutil.rmtree(self.folder.path, ignore_errors=True)
            self.remove_empty_folders()
            return
        for entry in self.folder.path.iterdir() if self.folder.path.is_dir() else []:
            if entry.name not in self.before:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)

    def keeps(self) -> bool:
        return self.folder.has_checkpoint()

    def remove_empty_folders(self) -> None:
        for folder in reversed(self.made):
            try:
                folder.rmdir()
            except FileNotFoundError:
                continue
            except OSError:  # not empty: another run started in it meanwhile
                break


class SweepClaim(Claim):
    """A sweep folder: kept once any of its jobs holds a run or a result; until then, taking it back
    takes the jobs' folders too (Hydra's record of the job and its log, made before the job's own claim)."""

    def keeps(self) -> bool:
        jobs = [RunFolder(p) for p in self.folder.path.iterdir() if p.is_dir()] if self.folder.path.is_dir() else []
        return any(job.holds_run() or job.result_file.is_file() for job in jobs)
