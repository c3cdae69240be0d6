"""Where a run goes, chosen before Hydra starts: `Launch` reads one command line, checks it (the whole
of it, so that a command that cannot run is refused in one line and leaves nothing behind) and chooses
the folder it runs in: a new one, made at once so that two runs started together never share one, or the
run that resume= continues, taken with its saved settings and locked. Which folder and which checkpoint
follow from the command line, the environment and what is on disk, so every process of a launch
(torchrun, srun) finds the same; the first claims the folder. Sweeps (-m) are shell.sweep_launch's."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from shell import resume
from shell.checks import ABSENT, SettingError, check_writable, lookup
from shell.command_line import SEARCH_GROUPS, CommandLineError, Composer, as_trainer_argument
from shell.config_groups import group_choices, named_settings
from shell.errors import USER_ERRORS
from shell.run_folder import (
    RunFolder,
    RunFolderError,
    adopt,
    check_hydra_folder,
    claim,
    claim_new_folder,
    given_value,
    hydra_override,
    process_rank,
    whole_path,
)
from shell.settings import check, continue_settings, matches
from shell.sweep_launch import SweepLaunch


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


class Launch(SweepLaunch):
    """One command line, checked, with the folder it runs in: what train.py gives Hydra. Which folder
    and which checkpoint follow from the command line, the environment and what is on disk, so every
    process of a launch (torchrun, srun) finds the same; the first claims and locks the folder."""

    def __init__(self, args: list[str], claim_folders: bool = True):
        self.claim_folders = claim_folders
        self.args = [whole_path(as_trainer_argument(a)) for a in args]  # runs_root=/tmp/ü日: one folder
        self.flags = [a for a in self.args if a.startswith("-")]
        self.overrides = [a for a in self.args if not a.startswith("-")]
        self.user = [o for o in self.overrides if not o.lstrip("+~").startswith("hydra.")]
        self.hydra_overrides = [o for o in self.overrides if o.lstrip("+~").startswith("hydra.")]
        self.hydra = {o.lstrip("+").split("=", 1)[0]: given_value(o) for o in self.hydra_overrides if "=" in o}
        self.multirun = any(f in ("-m", "--multirun") for f in self.flags)
        self.first = process_rank() == 0  # of the processes of a multi-process launch
        self.defaults: dict | None = None  # the config with no overrides, composed once
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
        check_places({o.split("=", 1)[0]: given_value(o) for o in self.overrides if "=" in o})
        with Composer() as composer:
            self.defaults = composer.defaults  # what each job's named settings are told from
            if self.multirun:
                return self.sweep(composer) if self.first else self.sweep_of_launch(composer)
            if "" in resume.given(self.user):  # an unset shell variable: not a new run
                raise CommandLineError(
                    "resume= is empty: give the run to continue (resume=outputs/DATE/TIME), or leave resume= out "
                    "to start a new run"
                )
            if any(o.lstrip("+").split("=")[0] in SEARCH_GROUPS for o in self.user):
                raise CommandLineError(
                    "hparams_search is a search over many runs: add -m (python train.py -m hparams_search=optuna ...)"
                )
            requested = composer.compose(self.user + self.hydra_overrides, with_hydra=True)
            hydra_settings = requested.pop("hydra")
            if self.hydra.get("hydra.run.dir"):  # the folder it names now (outputs/${now:%H-%M}: this minute's)
                self.hydra["hydra.run.dir"] = str(hydra_settings["run"]["dir"])
            named = named_settings(self.user, requested, composer.defaults)
        folder, checkpoint, restarting = self.choose(requested, named)
        if checkpoint is not None:
            return self.resumed(folder, checkpoint, requested, named)
        return self.new_run(folder, requested, restarting)

    def continued_config(self, composer: Composer, overrides: list[str]) -> str | None:
        """--cfg job (or all) with resume=RUN: the settings that run would continue with, which Hydra's
        own --cfg cannot show (it composes configs/ as for a new run); None for any other command line."""
        word = flag_word(self.args, ("--cfg", "-c"))
        if word not in ("job", "all") or not any(resume.is_resume(o) for o in overrides):
            return None
        user = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
        requested = composer.compose(overrides, with_hydra=True)
        requested.pop("hydra")
        if not resume.asked(requested):
            return None
        named = named_settings(user, requested, composer.defaults)
        folder, checkpoint, _ = self.choose(requested, named)
        if checkpoint is None:  # resume=auto with no run of these settings: a new run, as Hydra shows it
            return None
        values = continue_settings(checkpoint, requested, named, group_choices(user)).values
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
        """The run folder (None: a new one named by the time), the checkpoint it continues from (None: a
        new run), and whether a scheduler restarts a job that stopped before its first checkpoint."""
        return resume.choose(
            requested, self.hydra.get("hydra.run.dir"), self.first, lambda want, saved: matches(want, saved, named)
        )

    def new_run(self, folder: RunFolder | None, requested: dict, restarting: bool) -> list[str]:
        check(requested)
        check_hydra_folder(folder.path if folder is not None else RunFolder(requested["runs_root"]).path)
        args = resume.without(self.args, "hydra.run.dir")
        chosen_by = None  # the setting that named the folder: none for a new one under runs_root
        if folder is not None:
            chosen_by = (
                "hydra.run.dir" if self.hydra.get("hydra.run.dir") else f"run folder of this job ({folder.path.name})"
            )
            if self.first:
                folder.check_new(chosen_by, restarting=restarting, in_hydra=False)
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
        if resume.asked(requested) == "auto" and self.first:
            print(resume.nothing_to_continue(requested, folder, own_folder=chosen_by is not None))
        return [*args, hydra_override("hydra.run.dir", folder.path)]

    def resumed(self, folder: RunFolder, checkpoint: Path, requested: dict, named: list[str]) -> list[str]:
        """Continue the run at folder from checkpoint: its settings, with what the command line may
        change (checked now), the folder locked, Hydra's record of this command kept apart."""
        continue_settings(checkpoint, requested, named, group_choices(self.user))
        check_hydra_folder(folder.path)
        if self.first:
            folder.check_continuable()
        if self.first and self.claim_folders:
            claim(folder, new=False)
        kept = resume.without(self.args, "hydra.run.dir", "hydra.output_subdir")
        record = RunFolder.resume_record(datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
        return [
            *kept,
            hydra_override(resume.KEY, checkpoint),
            hydra_override("hydra.run.dir", folder.path),
            hydra_override("hydra.output_subdir", record),
        ]


def check_command_line(args: list[str]) -> str | None:
    """The one-line reason a command line is refused, or None; makes and locks nothing."""
    try:
        Launch(args, claim_folders=False).hydra_args()
    except (*USER_ERRORS, CommandLineError) as err:
        return str(err)
    return None
