"""Train a GPT-2 model: python train.py [model=nano] [data=shakespeare] [trainer.max_steps=N] ...

Before Hydra starts, the whole command line is checked and the run's folder chosen: a new one, made
at once so that two runs started together never share one, or the run that resume= continues, taken
with its saved settings and locked. A command that cannot run is refused in one line and leaves
nothing behind. Hydra then composes the config and runs `main` in that folder; `main` trains and
returns the final val/bpc, which Hydra's sweepers (`-m`, `hparams_search=optuna`) minimise.
"""

from __future__ import annotations

import gc
import signal

# Start-up makes some 700k objects that live as long as the process (torch, Lightning, Hydra). The
# cyclic collector would sweep them over and over as they are made, and once more at exit: about 2.5 s
# of a run on two cores. In a process of its own it stays off until main() freezes them, and is on for
# everything after (imported, as by the tests, nothing changes). Ctrl-C while the libraries load ends the
# process at once: nothing has been made yet.
if __name__ == "__main__":
    gc.disable()
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import itertools
import logging
import math
import os
import re
import shlex
import shutil
import sys
from datetime import datetime
from pathlib import Path
from typing import NamedTuple, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from data.sources import check_files
from generation.checkpoint import CheckpointError, read_header
from training.checks import ABSENT, SettingError, check_writable, lookup
from training.command_line import SEARCH_GROUPS, CommandLineError, Composer, as_trainer_argument, parse_overrides
from training.config_groups import named_settings
from training.ctrl_c import WATCH, unblock_ctrl_c
from training.errors import USER_ERRORS, ProcessLost, RunWriteError, TrainingDiverged
from training.run_folder import (
    SWEEP_RECORD,
    SWEEPS_ROOT,
    Claim,
    RunFolder,
    RunFolderError,
    adopt,
    claim,
    claim_new_folder,
    claim_sweep,
    folder_of,
    is_sweep,
    launcher_folder,
    launcher_restarted,
    process_rank,
    resumable_runs,
    run_where_started,
    script,
    sweep_continue_command,
    take_back_claims,
)
from training.settings import check, continue_settings, matches
from training.sweep import (
    OBJECTIVE,
    end_stopped_trials,
    how_to_add_trials,
    how_to_continue_sweep,
    is_search,
    result_record,
    summarize,
)

log = logging.getLogger("train")


# ---- bad places for a run, in one line -----------------------------------------------------------------


def check_places(settings: dict[str, str]) -> None:
    """A run folder (hydra.run.dir, or one under runs_root) or sweep folder that cannot be written."""
    for key in ("hydra.run.dir", "runs_root", "hydra.sweep.dir"):
        if key in settings and not settings[key].strip():
            raise RunFolderError(f"{key} is empty; give a folder, e.g. {key}=outputs")
        if key in settings:
            try:
                check_writable(key, settings[key])
            except SettingError as err:
                raise RunFolderError(str(err)) from None


# ---- choosing where a run goes --------------------------------------------------------------------------


INFORMATION_FLAGS = (
    "--cfg",
    "-c",
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--resolve",
    "--package",
    "-p",
    "--shell-completion",
    "-sc",
    "--version",
)  # Hydra shows something; nothing is trained
ONE_RUN_FLAGS = ("--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")  # Hydra refuses them with -m
CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun")


def information_overrides(args: list[str]) -> list[str]:
    """The overrides of a command line with information flags: not the words those flags take
    (--cfg job, -p model, --info defaults, -sc install=bash)."""
    takes_word = {"--cfg", "-c", "--package", "-p", "--shell-completion", "-sc", *CONFIG_FLAGS}
    info_words = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
    overrides, previous = [], None
    for arg in args:
        flag_word = previous in takes_word or (previous in ("--info", "-i") and arg in info_words)
        if not arg.startswith("-") and not flag_word:
            overrides.append(arg)
        previous = arg
    return overrides


def flag_word(args: list[str], names: tuple[str, ...]) -> str | None:
    """The word a flag of a command line takes (--cfg job, --cfg=job), or None without the flag."""
    for arg, following in zip(args, [*args[1:], None], strict=True):
        name, equals, word = arg.partition("=")
        if name in names:
            return word if equals else following
    return None


class Launch:
    """One command line, checked, with the folder it runs in: what train.py gives Hydra. Which folder
    and which checkpoint follow from the command line, the environment and what is on disk, so every
    process of a launch (torchrun, srun) finds the same; the first claims and locks the folder."""

    def __init__(self, args: list[str], claim_folders: bool = True):
        self.claim_folders = claim_folders
        self.args = [as_trainer_argument(a) for a in args]
        self.flags = [a for a in self.args if a.startswith("-")]
        self.overrides = [a for a in self.args if not a.startswith("-")]
        self.user = [o for o in self.overrides if not o.lstrip("+~").startswith("hydra.")]
        self.hydra_overrides = [o for o in self.overrides if o.lstrip("+~").startswith("hydra.")]
        self.hydra = {
            k: v.strip("'\"") for k, v in (o.lstrip("+").split("=", 1) for o in self.hydra_overrides if "=" in o)
        }
        self.multirun = any(f in ("-m", "--multirun") for f in self.flags)
        self.first = process_rank() == 0  # of the processes of a multi-process launch
        self.shown: str | None = None  # what to print instead of running: what an information flag shows
        # that Hydra cannot (continued_config), or that a requeued sweep had finished

    def hydra_args(self) -> list[str]:
        """Check the command line and choose its folder; the arguments to give Hydra."""
        flags = {flag.split("=")[0] for flag in self.flags}
        if flags & set(INFORMATION_FLAGS):
            shown = next((f for f in self.flags if f.split("=")[0] in ONE_RUN_FLAGS), None)
            if shown and self.multirun:
                raise CommandLineError(
                    f"{shown} shows what one run would use and -m starts a sweep of several: leave -m out to see "
                    "one of its jobs (python train.py --cfg job optim.lr=1e-3 ...)"
                )
            overrides = information_overrides(self.args)
            if overrides and not self.multirun:  # a misspelled key or group: one line, not Hydra's several
                with Composer() as composer:
                    composer.compose(overrides)
                    self.shown = self.continued_config(composer, overrides)
            return self.args
        if flags & set(CONFIG_FLAGS):
            raise CommandLineError(
                "train.py composes configs/train.yaml: put your own config files in configs/ (e.g. "
                "configs/experiment/mine.yaml) and choose them with experiment=mine"
            )
        check_places({k: v for k, v in (o.split("=", 1) for o in self.overrides if "=" in o)})
        with Composer() as composer:
            if self.multirun:
                return self.sweep(composer) if self.first else self.sweep_of_launch(composer)
            if any(o.lstrip("+") == "resume=" for o in self.user):  # an unset shell variable: not a new run
                raise CommandLineError(
                    "resume= is empty: give the run to continue (resume=outputs/DATE/TIME), or leave resume= out "
                    "to start a new run"
                )
            if any(o.lstrip("+").split("=")[0] in SEARCH_GROUPS for o in self.user):
                raise CommandLineError(
                    "hparams_search is a search over many runs: add -m (python train.py -m hparams_search=optuna ...)"
                )
            requested = composer.compose(self.user + self.hydra_overrides, with_hydra=True)
            requested.pop("hydra")
            named = named_settings(self.user, requested, composer.defaults)
        folder, checkpoint, restarting = self.choose(requested, named)
        if checkpoint is not None:
            return self.resumed(folder, checkpoint, requested, named)
        return self.new_run(folder, requested, restarting)

    def continued_config(self, composer: Composer, overrides: list[str]) -> str | None:
        """--cfg job (or all) with resume=RUN: the settings that run would continue with, which Hydra's
        own --cfg cannot show (it composes configs/ as for a new run); None for any other command line."""
        word = flag_word(self.args, ("--cfg", "-c"))
        if word not in ("job", "all") or not any(o.lstrip("+").split("=")[0] == "resume" for o in overrides):
            return None
        user = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
        requested = composer.compose(overrides, with_hydra=True)
        requested.pop("hydra")
        if not requested.get("resume"):
            return None
        named = named_settings(user, requested, composer.defaults)
        folder, checkpoint, _ = self.choose(requested, named)
        if checkpoint is None:  # resume=auto with no run of these settings: a new run, as Hydra shows it
            return None
        values = continue_settings(checkpoint, requested, named).values
        package = flag_word(self.args, ("--package", "-p"))
        if package:
            found = lookup(values, package)
            if found is ABSENT:
                raise CommandLineError(f"--package {package}: the run's settings have no {package}")
            values = found
        if not isinstance(values, dict):  # one setting: its value alone, as Hydra shows one
            return f"{values}\n"
        package_line = f"# @package {package}\n" if package else ""
        return f"# the settings {folder.path} continues with, from {checkpoint.name}\n{package_line}{OmegaConf.to_yaml(values)}"

    def choose(self, requested: dict, named: list[str]) -> tuple[RunFolder | None, Path | None, bool]:
        """(the run folder, or None for a new one named by the time; the checkpoint to continue from, or
        None for a new run; whether a scheduler restarts a job that stopped before its first checkpoint)."""
        resume, explicit = requested.get("resume"), self.hydra.get("hydra.run.dir")
        given = RunFolder(explicit) if explicit else launcher_folder(requested["runs_root"])
        if resume and resume != "auto":
            folder = folder_of(resume)
            if explicit and RunFolder(explicit).path != folder.path:
                raise RunFolderError(
                    f"hydra.run.dir={explicit} is not the run resume= continues ({folder.path}); leave hydra.run.dir out"
                )
            return folder, folder.checkpoint_named(resume), False
        if resume == "auto" and given is None:
            for folder in resumable_runs(requested["runs_root"]):
                try:
                    saved = read_header(folder.checkpoint_to_resume())["settings"]
                except CheckpointError:
                    continue
                if saved and matches(requested, saved, named):
                    owner = folder.held_by()
                    if owner and self.first:
                        raise RunFolderError(
                            f"resume=auto: the run with these settings, {folder.path}, is being trained by "
                            f"{owner}; wait for it to end (or stop it), then run this again"
                        )
                    return folder, folder.checkpoint_to_resume().resolve(), False
            return None, None, False
        restarted = given is not None and not explicit and launcher_restarted()
        if given is not None and (resume == "auto" or restarted):  # a folder of its own: continue it, if it can be
            checkpoint = given.checkpoint_to_resume()
            if checkpoint is not None:
                if restarted and self.first:
                    print(f"this job was restarted by its scheduler: continuing {given.path}", file=sys.stderr)
                return given, checkpoint.resolve(), False
        return given, None, restarted

    def new_run(self, folder: RunFolder | None, requested: dict, restarting: bool) -> list[str]:
        check(requested)
        args = [a for a in self.args if a.lstrip("+").split("=")[0] not in ("resume", "hydra.run.dir")]
        if folder is not None:
            chosen_by = (
                "hydra.run.dir" if self.hydra.get("hydra.run.dir") else f"run folder of this job ({folder.path.name})"
            )
            if self.first:
                folder.check_new(chosen_by, restarting=restarting)
            if self.first and self.claim_folders:
                claim(folder, new=True)
                if restarting and folder.clear_start():
                    print(
                        f"this job was restarted by its scheduler: {folder.path} stopped before its first "
                        "checkpoint, so it starts again",
                        file=sys.stderr,
                    )
        elif not self.first:
            raise RunFolderError(
                "processes started by a launcher need one run folder: pass hydra.run.dir=DIR (or torchrun --rdzv-id=NAME)"
            )
        elif self.claim_folders:
            folder = adopt(claim_new_folder(requested["runs_root"])).folder
        else:
            return args
        return [*args, f"hydra.run.dir={folder.path}"]

    def resumed(self, folder: RunFolder, checkpoint: Path, requested: dict, named: list[str]) -> list[str]:
        """Continue the run at folder from checkpoint: its settings, with what the command line may
        change (checked now), the folder locked, Hydra's record of this command kept apart."""
        continue_settings(checkpoint, requested, named)
        if self.first:
            folder.check_continuable()
        if self.first and self.claim_folders:
            claim(folder, new=False)
        kept = [
            a
            for a in self.args
            if a.lstrip("+").split("=")[0] not in ("resume", "hydra.run.dir", "hydra.output_subdir")
        ]
        record = RunFolder.resume_record(datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
        return [*kept, f"resume={checkpoint}", f"hydra.run.dir={folder.path}", f"hydra.output_subdir={record}"]

    # ---- sweeps

    def sweep(self, composer: Composer) -> list[str]:
        """-m: every value of every swept setting is checked (of the command line, and the choices of a
        search such as hparams_search=optuna), then the sweep gets one new folder, unless
        hydra.sweep.dir names one; -m resume=SWEEP continues a sweep in its own."""
        continued = self.continued_or_requeued(composer)
        if continued is not None:
            return continued
        seed = continued_study_seed(self.check_sweep(composer))
        args = self.sweep_folder()
        return [a for a in args if a.partition("=")[0] != "hydra.sweeper.sampler.seed"] + seed if seed else args

    def continued_or_requeued(self, composer: Composer) -> list[str] | None:
        """-m continuing a sweep, in any process of a launch: the one resume= names, or the one a launch
        its scheduler restarted had begun (continued_sweep's arguments); None for a new sweep."""
        resume = [o.partition("=")[2] for o in self.user if "=" in o and o.lstrip("+").partition("=")[0] == "resume"]
        if resume and resume[-1] in ("", "null"):  # an unset shell variable: not a new sweep of the defaults
            raise CommandLineError(
                f"resume={resume[-1]} with -m names no sweep to continue: give its folder (python train.py -m "
                "resume=multirun/DATE/TIME), or leave resume= out to start a new sweep"
            )
        if resume:
            return self.continued_sweep(composer, resume[-1])
        requeued = self.requeued_sweep()
        return None if requeued is None else self.continued_sweep(composer, str(requeued), requeued=True)

    def requeued_sweep(self) -> Path | None:
        """The folder of the sweep that this launch, restarted by its scheduler (a requeued SLURM job,
        workers torchrun started again), began before; None for any other launch."""
        shared = launcher_folder(SWEEPS_ROOT)
        if shared is None or self.hydra.get("hydra.sweep.dir") or not launcher_restarted():
            return None
        return shared.path if (shared.path / SWEEP_RECORD).is_file() else None

    def check_sweep(self, composer: Composer) -> dict:
        """Checks every job's settings before the first starts; returns the sweeper's settings."""
        parsed, hydra_parsed = parse_overrides(self.user), parse_overrides(self.hydra_overrides)
        for override in hydra_parsed:
            if override.is_sweep_override():
                key, values = override.key_or_group, override.input_line.split("=", 1)[1]
                instead = key.removeprefix("hydra.sweeper.params.")
                raise CommandLineError(
                    f"{override.input_line}: Hydra's own settings cannot be swept"
                    + (f"; give the search range as {instead}={values}" if instead != key else "")
                )
        fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
        composed = composer.compose(
            fixed + [o.input_line for o in hydra_parsed if not o.is_sweep_override()], with_hydra=True
        )
        searched = composed["hydra"]
        sweeper = searched.get("sweeper") or {}
        for count in ("n_trials", "n_jobs"):  # n_jobs: how many trials the sampler proposes at a time
            if isinstance(sweeper.get(count), int) and sweeper[count] < 1:
                raise CommandLineError(f"hydra.sweeper.{count} must be at least 1, got {sweeper[count]}")
        space = {
            **(sweeper.get("params") or {}),
            **{  # the search space, with what the command line adds to it
                o.key_or_group.removeprefix("hydra.sweeper.params."): o.input_line.split("=", 1)[1]
                for o in hydra_parsed
                if o.key_or_group.startswith("hydra.sweeper.params.")
            },
        }
        given = {o.key_or_group for o in parsed}
        missing = next((key for key in space if key not in given and lookup(composed, key) is ABSENT), None)
        if missing is not None:  # a setting of the search space that a chosen group has not (tokenizer=char)
            raise CommandLineError(search_lacks(missing, composed, self.user))
        search = [f"{key}={values}" for key, values in space.items() if key not in given]
        combinations = sweep_combinations(self.user + search)
        data_settings = []
        for combination in combinations:
            values, _ = check(composer.compose(combination))
            if values["data"] not in data_settings:  # each data setting's files looked up once
                data_settings.append(values["data"])
                check_files(values["data"])
        searching = "optuna" in str(sweeper.get("_target_", "")).lower()
        direction = sweeper.get("direction", "minimize")
        if searching and str(getattr(direction, "name", direction)) != "minimize":
            raise CommandLineError(
                f"hydra.sweeper.direction must be minimize, got {getattr(direction, 'name', direction)}: each trial "
                f"returns its final {OBJECTIVE}, which is better lower; leave it out"
            )
        for line, key, values in interval_sweeps(self.user + search):
            if not searching:
                raise CommandLineError(
                    f"{line} is a range to search, which only a search samples: add hparams_search=optuna, "
                    f"or list the values to try ({key}=a,b,c)"
                )
            for value in values:
                try:
                    check(composer.compose([*combinations[0], f"{key}={value}"]))
                except (*USER_ERRORS, CommandLineError) as err:
                    whole = "whole number" in str(err)
                    raise CommandLineError(
                        f"{line}: the search would draw values such as {value:g}, refused: {err}"
                        + ("; search a whole-number setting with range(...) or choice(...)" if whole else "")
                    ) from None
        check_storage(sweeper.get("storage"))
        several = searching or any(o.is_sweep_override() for o in parsed)
        subdir = self.hydra.get("hydra.sweep.subdir")
        if several and subdir is not None and "${" not in subdir:
            raise CommandLineError(
                f"hydra.sweep.subdir={subdir} names the same folder for every job of the sweep; leave it out "
                "(each job gets a numbered folder) or make it differ, e.g. 'hydra.sweep.subdir=${hydra.job.num}'"
            )
        return sweeper

    def sweep_folder(self) -> list[str]:
        if self.hydra.get("hydra.sweep.dir"):
            folder = Path(self.hydra["hydra.sweep.dir"]).expanduser()
            owner = RunFolder(folder).held_by() if folder.is_dir() else None
            if owner:
                raise RunFolderError(
                    f"hydra.sweep.dir={folder} is the folder of a sweep under way ({owner}); choose a new or "
                    "empty folder"
                )
            if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
                raise RunFolderError(
                    f"hydra.sweep.dir={folder} is not empty; a sweep writes numbered run folders and a "
                    "summary there, so choose a new or empty folder"
                )
            if self.claim_folders:
                claim_sweep(Claim.make(RunFolder(folder)))
            return self.args
        if not self.claim_folders:
            return self.args
        shared = launcher_folder(SWEEPS_ROOT)  # torchrun, SLURM: every process derives the same folder
        if shared is not None:  # the launch's other processes may already be starting their jobs in it
            check_launch_sweep(shared.path)
            return [*self.args, f"hydra.sweep.dir={shared.path}"]
        return [*self.args, f"hydra.sweep.dir={claim_sweep(claim_new_folder(SWEEPS_ROOT)).folder.path}"]

    def continued_sweep(self, composer: Composer, given: str, requeued: bool = False) -> list[str]:
        """-m resume=SWEEP: the sweep's own command line again (from the folder it was started in), into
        its folder, checked as it was: jobs that finished are kept as they are, a stopped one continues
        from its checkpoint, one stopped before its first checkpoint starts again, and those that never
        ran run (run_job asks each job's folder which: RunFolder.continuation). `requeued`: the sweep's
        own command, which a scheduler started again (requeued_sweep)."""
        if given == "auto":
            raise CommandLineError("resume=auto continues one run: run it without -m (python train.py resume=auto ...)")
        others = [o for o in self.overrides if o.lstrip("+").partition("=")[0] != "resume"]
        if others and not requeued:
            raise CommandLineError(
                f"-m resume={given} continues the sweep with its own command line; leave out {others[0]} (a "
                "job of it continues with settings of its own as python train.py resume=SWEEP/N ...)"
            )
        folder = RunFolder(given).path
        if requeued and is_search(folder) and (folder / SEARCH_RESULT).is_file():  # stopped as it ended
            self.shown = (
                f"this job was restarted by its scheduler, and its search had ended: {folder / SEARCH_RESULT}\n"
            )
            return self.args
        try:
            started = sweep_record(folder, given, requeued)
        except CommandLineError as err:
            if not requeued:
                raise
            raise RunFolderError(
                f"this job was restarted by its scheduler, and its sweep cannot continue: {err}"
            ) from None
        if requeued and self.user != started.task:
            raise RunFolderError(
                f"this job was restarted by its scheduler with another command line than its sweep, {folder}, was "
                f"started with; continue that sweep as it was with {sweep_continue_command(folder)}"
            )
        owner = RunFolder(folder).held_by()
        if owner and self.first:  # (the other processes of a launch find it held by the first)
            raise RunFolder(folder).under_way(owner)
        if requeued and self.first:
            print(f"this job was restarted by its scheduler: continuing the sweep {folder}", file=sys.stderr)
        if not Path(started.cwd).is_dir():
            raise RunFolderError(
                f"the sweep {folder} was started in {started.cwd}, which is gone, and what its command line names "
                f"there cannot be found; restore that folder, or continue its stopped jobs alone with "
                f"{continue_command(folder / 'N')}"
            )
        if self.claim_folders:
            run_where_started(started.cwd)  # its relative paths (data.path=input.txt) name what they named
        recorded = [
            o
            for o in started.hydra
            if o.lstrip("+").partition("=")[0] not in ("hydra.sweep.dir", "hydra.mode", "hydra.output_subdir")
        ]
        args = [
            *self.flags,
            *started.task,
            *recorded,
            f"hydra.sweep.dir={folder}",
            f"hydra.output_subdir=${{{JOB_RECORD}:}}",
        ]
        again = Launch(args, claim_folders=self.claim_folders)
        try:
            again.check_sweep(composer)
        except (*USER_ERRORS, CommandLineError) as err:
            raise CommandLineError(f"the sweep {folder} cannot continue as it was started: {err}") from None
        numbered = "hydra.sweep.subdir" not in again.hydra and not any("glob(" in o for o in again.user)
        wanted = len(sweep_combinations(again.user, limit=math.inf))
        if numbered:
            jobs = [RunFolder(folder / str(n)) for n in range(wanted)]
        else:  # folders named by hydra.sweep.subdir: the runs found under the sweep, when there are as many
            found = [RunFolder(p.parent) for p in sorted(folder.rglob("config.yaml")) if p.parent.name != ".hydra"]
            found = [job for job in found if job.holds_run()]
            jobs = found if len(found) == wanted and not any("glob(" in o for o in again.user) else []
        if jobs and all(job.is_finished() for job in jobs) and requeued:  # stopped as it ended
            summarize(folder)
            summary = folder / "summary.csv"
            self.shown = (
                f"this job was restarted by its scheduler, and every job of its sweep had finished: {summary}\n"
            )
            return self.args
        if jobs and all(job.is_finished() for job in jobs):
            raise CommandLineError(
                f"every job of the sweep {folder} finished (its summary: {folder / 'summary.csv'}); to train "
                f"one further, continue it alone: {continue_command(folder / 'N')} trainer.max_steps=..."
            )
        if self.claim_folders:
            if self.first:
                claim_sweep(Claim.existing(RunFolder(folder)))  # another continue started at the same moment: refused
            os.environ[CONTINUED_SWEEP] = str(folder)
        return args

    def sweep_of_launch(self, composer: Composer) -> list[str]:
        """-m in a process the first of a launch did not start: torchrun's and SLURM's derive the sweep
        folder the first chose, or continue the sweep it continues; Lightning's own launcher hands it
        over on the command line."""
        continued = self.continued_or_requeued(composer)
        if continued is not None:
            return continued
        shared = launcher_folder(SWEEPS_ROOT)
        if shared is None or self.hydra.get("hydra.sweep.dir"):
            return self.args
        return [*self.args, f"hydra.sweep.dir={shared.path}"]


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


SEARCH_RESULT = "optimization_results.yaml"  # the best trial, which Optuna's sweeper writes as the search ends
CONTINUED_SWEEP = "TINYGPT2_CONTINUED_SWEEP"  # the sweep folder a -m resume= launch continues
JOB_RECORD = "tinygpt2_job_record"
_JOB_RECORDS: dict[str, str | None] = {}


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


def search_lacks(key: str, composed: dict, user: list[str]) -> str:
    """Why a search cannot run: its space names a setting the groups chosen do not have."""
    search = next((o.lstrip("+") for o in user if o.lstrip("+").split("=")[0] in SEARCH_GROUPS), "the search")
    group = key.split(".")[0]
    kind = lookup(composed, f"{group}.kind")
    chosen = f"{group}={kind}" if isinstance(kind, str) else "the settings chosen"
    name = search.split("=", 1)[-1]
    return (
        f"{search} searches {key}, which {chosen} does not have; search with a space of your own: a copy of "
        f"configs/hparams_search/{name}.yaml without {key}, as configs/hparams_search/mine.yaml, then "
        "hparams_search=mine"
    )


def interval_sweeps(overrides: list[str]) -> list[tuple[str, str, list[float]]]:
    """(override, key, values to check) for each interval(...) of a search: its two ends and a value
    between them that is not a whole number (the search draws such values)."""
    found = []
    for override in parse_overrides(overrides):
        if override.is_sweep_override() and override.is_interval_sweep():
            interval = override.value()
            low, high = float(interval.start), float(interval.end)
            inside = math.sqrt(low * high) if "log" in interval.tags and low > 0 else low + (high - low) * 0.382
            found.append((override.input_line, override.get_key_element(), [low, high, float(f"{inside:.4g}")]))
    return found


def check_launch_sweep(folder: Path) -> None:
    """The sweep folder a torchrun or SLURM launch names for itself must not hold an earlier sweep: only
    what the launch's processes write as they start (Hydra's multirun.yaml, job folders with no run)."""
    if not folder.exists():
        return
    for item in folder.iterdir():
        if item.name == SWEEP_RECORD or (item.is_dir() and item.name.isdigit() and not RunFolder(item).holds_run()):
            continue
        raise RunFolderError(
            f"{folder} already holds a sweep ({item.name}); start the launch with a new rendezvous id, or pass "
            "hydra.sweep.dir=DIR"
        )


def check_storage(storage) -> None:
    """The storage of a search's study, before the sweep folder is made: a database URL whose driver is
    installed; for SQLite, a database file, or a new one in a folder that can be written (a database on a
    server is reached at the first trial)."""
    if storage is None:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    given = f"hydra.sweeper.storage={storage}"
    try:
        url = make_url(str(storage))
        url.get_dialect().dbapi()
    except ArgumentError:
        raise CommandLineError(
            f"{given} is not a database URL; give one such as sqlite:///search.db (a SQLite file in this folder)"
        ) from None
    except (NoSuchModuleError, ImportError) as err:
        raise CommandLineError(f"{given}: {err}; install the database's driver, or use sqlite:///search.db") from None
    if url.get_backend_name() != "sqlite":
        return
    if url.host or not url.database:
        raise CommandLineError(f"{given} names no file; a SQLite file is named with three slashes: sqlite:///search.db")
    path = Path(url.database)
    if path.is_dir():
        raise CommandLineError(
            f"{given}: {path} is a folder, not a database file; name a file in it, e.g. {path / 'search.db'}"
        )
    if path.exists():
        try:
            with open(path, "rb") as file:
                header = file.read(16)
        except OSError as err:
            raise CommandLineError(
                f"{given}: cannot read {path} ({err.strerror}); give a file you can read and write"
            ) from None
        if header and header != b"SQLite format 3\x00":
            raise CommandLineError(
                f"{given}: {path} is not a SQLite database; give the file of an earlier search, or a new name"
            )
        if not os.access(path, os.W_OK):
            raise CommandLineError(
                f"{given}: {path} cannot be written, and each trial is written to it; give a file you can write"
            )
    elif not path.parent.is_dir():
        raise CommandLineError(f"{given}: the folder {path.parent} does not exist; make it, or give another path")
    elif not os.access(path.parent, os.W_OK):
        raise CommandLineError(f"{given}: the folder {path.parent} cannot be written; give another path")


def continued_study_seed(sweeper: dict) -> list[str]:
    """A search that adds trials to a stored study seeds its sampler past the trials the study holds:
    with the seed the study began with, it proposed the same settings again, trial for trial."""
    storage, seed = sweeper.get("storage"), (sweeper.get("sampler") or {}).get("seed")
    if not isinstance(storage, str) or not isinstance(seed, int):
        return []
    if storage.startswith("sqlite:///") and not Path(storage.removeprefix("sqlite:///")).expanduser().is_file():
        return []  # no study yet, and reading would make the file
    import optuna

    try:
        studies = optuna.get_all_study_summaries(storage)
    except Exception:  # a database out of reach: the sweeper says so as it starts
        return []
    held = sum(s.n_trials for s in studies if s.study_name == sweeper.get("study_name"))
    return [f"hydra.sweeper.sampler.seed={seed + held}"] if held else []


def sweep_combinations(overrides: list[str], limit: float = 64) -> list[list[str]]:
    """Override lists that together cover every value of each swept setting: all combinations when
    there are at most `limit`, else each value beside the others' first. Ranges that cannot be
    listed (Optuna's interval, a glob of choices) keep their defaults here and are checked in each job."""
    fixed, swept = [], []
    for override in parse_overrides(overrides):
        if not override.is_sweep_override():
            fixed.append(override.input_line)
        elif override.is_discrete_sweep():
            try:
                values = list(override.sweep_string_iterator())
            except Exception as err:
                if "glob(" in override.input_line:  # glob(...) lists config files only inside Hydra's run
                    continue
                raise CommandLineError(
                    f"cannot read {override.input_line} ({str(err).splitlines()[0]}); list the values to sweep "
                    "as key=a,b,c, or one range as key=range(start,stop)"
                ) from None
            swept.append([f"{override.get_key_element()}={value}" for value in values])
    if math.prod(len(values) for values in swept) <= limit:
        return [fixed + list(choice) for choice in itertools.product(*swept)]
    return [
        fixed + [values[0] for values in swept[:i]] + [value] + [values[0] for values in swept[i + 1 :]]
        for i, values in enumerate(swept)
        for value in values
    ]


def check_command_line(args: list[str]) -> str | None:
    """The one-line reason a command line is refused, or None; makes and locks nothing."""
    try:
        Launch(args, claim_folders=False).hydra_args()
    except (*USER_ERRORS, CommandLineError) as err:
        return str(err)
    return None


# ---- the run --------------------------------------------------------------------------------------------


def quoted(text: str) -> str:
    """text as one shell word, in double quotes as the README writes prompts (single where they would not do)."""
    return shlex.quote(text) if re.search(r'["$`\\!\n]', text) else f'"{text}"'


def prompt_option(prompt: str) -> str:
    """--prompt and its value as a shell types them; joined by = where the value starts with -, which
    argparse would otherwise read as an option of its own."""
    return f"--prompt={quoted(prompt)}" if prompt.startswith("-") else f"--prompt {quoted(prompt)}"


def stopped_by_ctrl_c(run_dir: Path | None = None, resume_record: Path | None = None) -> NoReturn:
    """Ctrl-C (or SIGTERM) outside the training loop's own graceful stop (start-up, data preparation, a
    second Ctrl-C): what this process made is taken back, unless the run has a checkpoint to continue
    from; one line says which. Exits with 128 + the signal's number, as the shell reports a process the
    signal ended. `run_dir`: the run's folder, once Hydra runs it."""
    report_ctrl_c(run_dir, resume_record)
    sys.exit(128 + (_STOPPED_BY[-1] if _STOPPED_BY else signal.SIGINT))


def report_ctrl_c(run_dir: Path | None = None, resume_record: Path | None = None) -> None:
    """stopped_by_ctrl_c's work but for the exit. The processes a launch's first started say nothing:
    they made nothing, and the first says how the launch stopped."""
    if process_rank() != 0:
        return
    WATCH.end_children()  # those a ddp launch started, still in a job of its sweep: they would wait for this one
    kept = take_back_claims()
    if resume_record is not None:
        shutil.rmtree(resume_record, ignore_errors=True)  # a resume that never started leaves its run as it was
    if run_dir is not None and RunFolder(run_dir).has_checkpoint():
        kept.append(RunFolder(run_dir))
    runs = [folder for folder in kept if folder.has_checkpoint()]
    sweeps = [folder.sweep() for folder in runs if folder.sweep()] or [
        folder.path for folder in kept if is_sweep(folder.path)
    ]
    if runs:
        print(f"\nstopped; continue with: {runs[0].continue_command()}", file=sys.stderr)
    if sweeps:  # a stop between two jobs of a sweep too
        print(("" if runs else "\nstopped; ") + how_to_continue_sweep(sweeps[0]), file=sys.stderr)
    elif not runs:
        said = (
            "before training began; nothing was written"
            if run_dir is None
            else "before the run's first checkpoint; nothing was kept"
        )
        print(f"\nstopped {said}", file=sys.stderr)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and `kill`'s or a scheduler's stop: taken alike
_HELD_CTRL_C: list[int] = []  # a stop signal received while they were held
_STOPPED_BY: list[int] = []  # the stop signal that raised KeyboardInterrupt


def hold_ctrl_c() -> None:
    """From here until release_ctrl_c, Ctrl-C (and SIGTERM) is held: Hydra composes each job's config in
    OmegaConf state changes that a KeyboardInterrupt would leave half done (Hydra then prints a
    traceback), and the command line's checks import libraries that one would break."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, held_ctrl_c)
    unblock_ctrl_c()  # a process a ddp launch started has it blocked from its start (block_for_children)


def held_ctrl_c(signum, frame) -> None:
    """A Ctrl-C while held is kept for release_ctrl_c. Pressed again before that (a check that waits on
    a slow disk), the process ends at once, as while its libraries load."""
    if _HELD_CTRL_C:
        signal.signal(signum, signal.SIG_DFL)
        if process_rank() == 0:
            twice = "Ctrl-C twice" if signum == signal.SIGINT else f"{signal.Signals(signum).name} after a stop"
            os.write(2, f"\nstopped at once ({twice})\n".encode())  # (not print: the handler may run inside one)
            WATCH.end_children()
        os.kill(os.getpid(), signum)
    _HELD_CTRL_C.append(signum)


def interrupt(signum, frame) -> NoReturn:
    """Ctrl-C, or SIGTERM, outside the training loop (which stops at the end of a step, GracefulStop): a
    KeyboardInterrupt, which takes back what the run made as for Ctrl-C."""
    _STOPPED_BY.append(signum)
    raise KeyboardInterrupt


def release_ctrl_c() -> None:
    """Ctrl-C and SIGTERM are handled again (KeyboardInterrupt); one received while held is raised now."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, interrupt)
    if _HELD_CTRL_C:
        _STOPPED_BY.append(_HELD_CTRL_C[-1])
        _HELD_CTRL_C.clear()
        raise KeyboardInterrupt


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    release_ctrl_c()  # a Ctrl-C held while Hydra composed this job: raised before the job begins
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    resuming = cfg.get("resume") and str(hydra_cfg.output_subdir).startswith(RunFolder.resume_record(""))
    where = (run_dir, run_dir / hydra_cfg.output_subdir if resuming else None)
    WATCH.arm(lambda: report_ctrl_c(*where))  # (Ctrl-C while the processes of a ddp launch start)
    try:
        return run_job(cfg)
    except KeyboardInterrupt:
        stopped_by_ctrl_c(*where)
    finally:
        hold_ctrl_c()  # Hydra's code again, until the next job (or the end)


def to_log_file(message: str) -> None:
    """A line for the run's train.log alone, at error level (the console has it from sys.exit)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def without_trailing_newline(record: logging.LogRecord) -> bool:
    record.msg = str(record.msg).rstrip("\n")  # a formatted warning ends in one
    return True


def log_libraries_to_file() -> None:
    """The run's train.log (Hydra's file handler) gets what Lightning logs through handlers of its own,
    and Python's warnings, besides the console, which shows them as before."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not logging.getLogger("py.warnings").handlers:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("py.warnings").addHandler(console)
        logging.getLogger("py.warnings").addFilter(without_trailing_newline)
        logging.getLogger("py.warnings").propagate = False
    for name in ("lightning.pytorch", "lightning.fabric", "py.warnings"):
        library = logging.getLogger(name)
        for handler in [h for h in library.handlers if isinstance(h, logging.FileHandler)]:
            library.removeHandler(handler)  # the previous job's, in a sweep
        for handler in files:
            library.addHandler(handler)
    logging.captureWarnings(True)


def quiet_console_of_other_processes() -> None:
    """The processes of a launch beside the first write their log lines to train.log alone, and only
    their errors to the console they share with it, where each line would show once per process."""
    if process_rank() == 0:
        return
    for logger in (logging.getLogger(), logging.getLogger("py.warnings")):
        for handler in logger.handlers:
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(max(handler.level, logging.ERROR))


def continue_command(run: Path) -> str:
    return RunFolder(run).continue_command()


def continue_job(cfg: DictConfig, folder: RunFolder) -> float | None:
    """A job of a sweep being continued (python train.py -m resume=SWEEP), before it trains: one that
    finished is kept as it is (its objective returned), a stopped one continues from its checkpoint, and
    what one that stopped before its first checkpoint wrote goes; None where it trains."""
    from training.run import describe_metrics

    state = folder.continuation()
    if state == "finished":
        metrics = folder.read_result().get("metrics", {})
        record = log.makeRecord(
            log.name, logging.INFO, __file__, 0, "job %s finished before (%s); kept as it is",
            (folder.path.name, describe_metrics(metrics)), None,
        )  # fmt: skip
        for handler in logging.getLogger().handlers:  # on the console alone: the job's train.log stays as it ended
            if not isinstance(handler, logging.FileHandler) and log.isEnabledFor(logging.INFO):
                if record.levelno >= handler.level:
                    handler.handle(record)
        return metrics.get(OBJECTIVE, math.inf)
    if state == "resume":
        with open_dict(cfg):
            cfg.resume = str(folder.checkpoint_to_resume())
    elif state == "again" and process_rank() == 0:
        try:
            folder.clear_start()
        except RunFolderError as err:  # files of someone's own in it: left as they are, and the sweep goes on
            log.error("error: %s", err)
            return math.inf
    return None


def run_job(cfg: DictConfig) -> float | None:
    """main's work: train the run Hydra composed, and say how it ended."""
    from training.run import describe_metrics, train  # Lightning: loaded once the command line is known to be good

    if not gc.isenabled():  # the first job of the process: start-up is over (see gc.disable above)
        gc.freeze()
        gc.enable()
    log_libraries_to_file()
    quiet_console_of_other_processes()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun and os.environ.get(CONTINUED_SWEEP) == str(RunFolder(hydra_cfg.sweep.dir).path):
        kept = continue_job(cfg, RunFolder(run_dir))
        if kept is not None:
            return kept
    requested = OmegaConf.to_container(cfg, resolve=True)
    with_defaults = hydra.compose("train", overrides=[])
    named = named_settings(
        [o for o in overrides if not o.startswith("hydra.")],
        requested,
        OmegaConf.to_container(with_defaults, resolve=True),
    )
    try:
        result = train(cfg, run_dir, named=named, overrides=overrides)
    except USER_ERRORS as err:
        if requested.get("resume") and str(hydra_cfg.output_subdir).startswith(RunFolder.resume_record("")):
            shutil.rmtree(
                run_dir / hydra_cfg.output_subdir, ignore_errors=True
            )  # a refused resume leaves its run as it was
        if not multirun or isinstance(err, RunWriteError):  # a full disk stops a sweep too
            if isinstance(err, ProcessLost) or (isinstance(err, TrainingDiverged) and process_rank() == 0):
                to_log_file(f"error: {err}")  # the run's own log says how it ended
            if process_rank() != 0 and isinstance(err, TrainingDiverged | ProcessLost):
                sys.exit(1)  # every process meets a divergence alike, and another's end is the first's to tell
            sys.exit(f"error: {err}")
        log.error("error: %s", err)  # one job of a sweep: recorded, and the sweep goes on
        if isinstance(err, RunFolderError) or requested.get("resume"):  # a folder this job could not have, or
            return math.inf  # a stopped job of a sweep that could not continue: whatever is there stays
        folder = RunFolder(run_dir)
        if not folder.result_file.is_file():  # (a job that diverged has recorded how)
            run_dir.mkdir(parents=True, exist_ok=True)
            folder.write_result(result_record(folder, overrides, requested, {}, False, str(err)))
        return math.inf
    if process_rank() != 0:
        return result.metrics.get("val/bpc")
    if not result.finished:
        log.warning(
            "stopped by %s at step %d; checkpoint saved. Continue with: %s",
            result.stopped_by,
            result.step,
            RunFolder(run_dir).continue_command(),
        )
        if multirun:
            summarize(Path(hydra_cfg.sweep.dir))
            log.warning("the sweep stops here; %s", how_to_continue_sweep(Path(hydra_cfg.sweep.dir)))
            sys.exit(0)
        return None
    log.info("done: %s", describe_metrics(result.metrics))
    log.info("run folder: %s", result.run_dir)
    if result.fallback:
        log.warning(
            "%s: this model learned the offline pydoc corpus (Python's help texts), not Tiny Shakespeare; "
            "set data.path=/path/to/input.txt to train on it",
            result.fallback,
        )
    prompt = f" {prompt_option(result.prompt)}" if result.prompt else ""
    log.info("sample from it: python %s --ckpt %s%s", script("generate.py"), shlex.quote(str(result.run_dir)), prompt)
    return result.metrics.get("val/bpc")


if __name__ == "__main__":
    # From here Ctrl-C is handled (see the top). The checks import more libraries as they need them, and
    # a KeyboardInterrupt inside a C extension's import breaks it (an ImportError, then a fatal error at
    # exit): held until the command line is checked, a Ctrl-C then takes back the folder it claimed.
    hold_ctrl_c()
    try:
        launch = Launch(sys.argv[1:])
        hydra_args = launch.hydra_args()
        release_ctrl_c()
    except (*USER_ERRORS, CommandLineError) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        stopped_by_ctrl_c()
    if launch.shown is not None:
        print(launch.shown, end="")
        sys.exit(0)
    sys.argv = [sys.argv[0], *hydra_args]
    try:
        hold_ctrl_c()
        main()
        release_ctrl_c()
    except KeyboardInterrupt:  # while Hydra composed, before a job began (or after the last)
        stopped_by_ctrl_c()
    finally:
        end_stopped_trials()  # a search stopped part way: its trial under way is failed, not left running
