"""Hydra's records of a sweep, as continuing it reads and writes them: how the sweep was started
(`sweep_record`, from its multirun.yaml: its overrides and the folder it was started in), and where each
job of a continued sweep keeps its record of this command (`job_record`, the resolver behind
hydra.output_subdir): Hydra's .hydra where the job starts, a resume's record beside it where it continues
from a checkpoint, none where it had finished."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from shell.command_line import CommandLineError
from shell.run_folder import SWEEP_RECORD, RunFolder, RunFolderError, folder_of
from shell.sweep import how_to_add_trials, is_search

JOB_RECORD = "tinygpt2_job_record"
_JOB_RECORDS: dict[str, str | None] = {}


class SweepRecord(NamedTuple):
    task: list[str]  # the command line's overrides, as given
    hydra: list[str]  # the hydra.* ones, and those Hydra adds (hydra.mode=MULTIRUN)
    cwd: str  # where it was started


def sweep_record(folder: Path, given: str, requeued: bool = False) -> SweepRecord:
    """Hydra's settings of the sweep at folder as it was started (its multirun.yaml), for continuing it
    (`given`: the resume= that named it, or, `requeued`, the folder a scheduler's restart found)."""
    what = f"the sweep folder {given}" if requeued else f"resume={given}"
    record = folder / SWEEP_RECORD
    if not record.is_file():
        try:
            folder_of(folder)
        except RunFolderError:  # no run either
            where = "does not exist" if not folder.exists() else "is not a sweep's folder"
            raise CommandLineError(
                f"{what} {where}; with -m, resume= continues a sweep: give its folder (multirun/DATE/TIME, "
                "the one holding multirun.yaml and the jobs' numbered folders)"
            ) from None
        raise CommandLineError(f"{what} is a run, not a sweep: continue it without -m ({continue_command(folder)})")
    try:
        started = OmegaConf.to_container(OmegaConf.load(record).hydra, resolve=False)  # as the command line gave them
        overrides, cwd = started["overrides"], started["runtime"]["cwd"]
        task, hydra_given = overrides["task"], overrides["hydra"]
        lists = isinstance(task, list) and isinstance(hydra_given, list) and isinstance(cwd, str)
        if not lists or not all(isinstance(o, str) and ("=" in o or o.startswith("~")) for o in [*task, *hydra_given]):
            raise ValueError("its overrides are not lists of key=value")
    except Exception as err:
        problem = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CommandLineError(
            f"{what}: {record} cannot be read as a sweep's record ({problem}); continue its stopped jobs "
            f"alone with {continue_command(folder / 'N')}"
        ) from None
    if is_search(folder):
        raise CommandLineError(
            f"{what} is a search, which is not continued in its folder: {how_to_add_trials(folder)}; a stopped "
            f"trial continues alone with {continue_command(folder / 'N')}"
        )
    return SweepRecord(task, hydra_given, str(cwd))


def job_record() -> str | None:
    """hydra.output_subdir of a job of a continued sweep: Hydra's record of the command where the job
    starts, a resume's record beside the first where it continues, none where it had finished (decided
    once per job, before the job changes its folder)."""
    folder = RunFolder(HydraConfig.get().runtime.output_dir)
    if str(folder.path) not in _JOB_RECORDS:
        state = folder.continuation()
        stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        _JOB_RECORDS[str(folder.path)] = {"finished": None, "resume": RunFolder.resume_record(stamp)}.get(
            state, ".hydra"
        )
    return _JOB_RECORDS[str(folder.path)]


OmegaConf.register_new_resolver(JOB_RECORD, job_record, replace=True)


def continue_command(run: Path) -> str:
    return RunFolder(run).continue_command()
