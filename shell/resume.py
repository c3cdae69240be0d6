"""What `resume=` asks for, read here and nowhere else: a run folder or a checkpoint in one (continue
that run), `auto` (the newest unfinished run with the settings asked for, else a new run), or, with -m, a
sweep folder (shell.sweep_launch continues it). The other modules ask this one what it names; the
resumed run's settings are shell.settings', its folder's files shell.run_folder's."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from checkpoint import CheckpointError, read_header
from shell.run_folder import (
    RunFolder,
    RunFolderError,
    folder_of,
    given_value,
    launcher_folder,
    launcher_restarted,
    resumable_runs,
)

KEY = "resume"


def asked(values: Mapping[str, Any]) -> str | None:
    """What a composed config's resume= names (a path, or "auto"); None for a new run."""
    return values.get(KEY) or None


def is_resume(override: str) -> bool:
    """Whether a command-line override sets resume= (resume=..., +resume=...)."""
    return override.lstrip("+").partition("=")[0] == KEY


def given(overrides: Iterable[str]) -> list[str]:
    """The values the resume= overrides of a command line give, as Hydra reads them, in order ("" where
    one is empty)."""
    return [given_value(o) for o in overrides if "=" in o and is_resume(o)]


def without(args: Iterable[str], *keys: str) -> list[str]:
    """A command line without its resume= (and the other keys named)."""
    return [a for a in args if a.lstrip("+").split("=")[0] not in (KEY, *keys)]


def continue_from(cfg: DictConfig, checkpoint: Path) -> None:
    """Make a composed job's config continue from checkpoint (a stopped job of a sweep continued)."""
    with open_dict(cfg):
        cfg[KEY] = str(checkpoint)


def resumes_a_run(values: Mapping[str, Any], output_subdir: str) -> bool:
    """Whether a job Hydra runs continues a run: its resume= set, and its record in a resume-* folder."""
    return bool(asked(values)) and str(output_subdir).startswith(RunFolder.resume_record(""))


def checkpoint_in(values: Mapping[str, Any], folder: RunFolder) -> Path | None:
    """The checkpoint a run in `folder` continues from; None for a new run (auto, with nothing to continue)."""
    resume = asked(values)
    if resume is None:
        return None
    if resume == "auto":
        return folder.checkpoint_to_resume()
    return folder.checkpoint_named(resume)


def choose(requested: dict, explicit: str | None, first: bool, matches) -> tuple[RunFolder | None, Path | None, bool]:
    """Where a command line runs: (the run folder, or None for a new one named by the time; the checkpoint
    it continues from, or None for a new run; whether a scheduler restarts a job that stopped before its
    first checkpoint). `explicit`: hydra.run.dir as given; `first`: the first process of a launch, which
    says what it finds; `matches(requested, saved)`: whether a run's saved settings are those asked for."""
    resume = asked(requested)
    here = RunFolder(explicit) if explicit else launcher_folder(requested["runs_root"])
    if resume and resume != "auto":
        folder = folder_of(resume)
        if explicit and RunFolder(explicit).path != folder.path:
            raise RunFolderError(
                f"hydra.run.dir={explicit} is not the run resume= continues ({folder.path}); leave hydra.run.dir out"
            )
        return folder, folder.checkpoint_named(resume), False
    if resume == "auto" and here is None:
        return newest_matching_run(requested, first, matches)
    restarted = here is not None and not explicit and launcher_restarted()
    if here is not None and (resume == "auto" or restarted):  # a folder of its own: continue it, if it can be
        checkpoint = here.checkpoint_to_resume()
        if checkpoint is not None:
            if restarted and first:
                print(f"this job was restarted by its scheduler: continuing {here.path}", file=sys.stderr)
            return here, checkpoint.resolve(), False
    return here, None, restarted


def nothing_to_continue(requested: dict, folder: RunFolder, own_folder: bool) -> str:
    """resume=auto's one line where it found no run to continue: what it looked for, and the new run it
    starts. `own_folder`: the folder was named (hydra.run.dir, a launcher's job), not searched for."""
    if own_folder:
        return f"resume=auto: {folder.path} holds no checkpoint to continue from; starting a new run there"
    root = RunFolder(requested["runs_root"]).path
    return f"resume=auto: no unfinished run under {root} has these settings; starting a new run in {folder.path}"


def newest_matching_run(requested: dict, first: bool, matches) -> tuple[RunFolder | None, Path | None, bool]:
    """resume=auto: the newest unfinished run under runs_root whose settings are the ones asked for (and
    that no other process trains); (None, None, False), a new run, where there is none."""
    for folder in resumable_runs(requested["runs_root"]):
        try:
            saved = read_header(folder.checkpoint_to_resume())["settings"]
        except CheckpointError:
            continue
        if saved and matches(requested, saved):
            owner = folder.held_by()
            if owner and first:
                raise RunFolderError(
                    f"resume=auto: the run with these settings, {folder.path}, is being trained by "
                    f"{owner}; wait for it to end (or stop it), then run this again"
                )
            return folder, folder.checkpoint_to_resume().resolve(), False
    return None, None, False
