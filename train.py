"""Train a GPT-2 model: python train.py [model=nano] [data=shakespeare] [trainer.max_steps=N] ...

Before Hydra starts, the whole command line is checked and the run's folder chosen: a new one, made
at once so that two runs started together never share one, or the run that resume= continues, taken
with its saved settings and locked. A command that cannot run is refused in one line and leaves
nothing behind. Hydra then composes the config and runs `main` in that folder; `main` trains and
returns the final val/bpc, which Hydra's sweepers (`-m`, `hparams_search=optuna`) minimise.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from model.checkpoint import CheckpointError, DamagedCheckpoint, read_header
from training.checks import trainer_parameters
from training.checkpointing import CheckpointSaveError
from training.run import USER_ERRORS, describe_metrics, train
from training.run_folder import (
    RunFolder,
    RunFolderError,
    adopt,
    claim,
    claim_new_folder,
    folder_of,
    launcher_restarted,
    launcher_run_name,
    resumable_runs,
)
from training.settings import PREPARED, check, check_continuation, continue_values, matches, named_leaves
from training.sweep import result_record, summarize

log = logging.getLogger("train")

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
HYDRA_OWN_FLAGS = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--resolve", "--package", "-p",
                   "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                   "--experimental-rerun", "--version")
SEARCH_GROUPS = ("hparams_search",)  # config groups that make a command a search (-m needed)


class CommandLineError(ValueError):
    """A command line that cannot be read; the message says what to write instead."""


# ---- composing the command line, as Hydra will ------------------------------------------------------


def as_trainer_argument(arg: str) -> str:
    """`trainer.deterministic=true` for any Lightning Trainer argument configs/trainer/default.yaml does
    not list: given to Hydra as ++trainer.deterministic=true (add, or set where an experiment added it),
    so that trainer.* takes them all while a misspelled key stays unknown."""
    key = arg.split("=", 1)[0]
    name = key.split(".", 1)[1] if key.startswith("trainer.") and key.count(".") == 1 else None
    if name and "=" in arg and name not in TRAINER_DEFAULTS and name in trainer_parameters():
        return "++" + arg
    return arg


def trainer_defaults() -> set[str]:
    """The trainer settings configs/trainer/default.yaml lists."""
    return set(OmegaConf.load(CONFIG_DIR / "trainer" / "default.yaml"))


TRAINER_DEFAULTS = trainer_defaults()


class Composer:
    """Hydra's composition of configs/ for a list of overrides, as plain dicts; bad overrides become
    CommandLineError with one line."""

    def __enter__(self) -> Composer:
        from hydra import initialize_config_dir

        self.context = initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3")
        self.context.__enter__()
        self.defaults = self.compose([])
        return self

    def __exit__(self, *exc) -> None:
        self.context.__exit__(*exc)

    def compose(self, overrides: list[str]) -> dict:
        from hydra import compose
        from hydra.errors import HydraException, MissingConfigException, OverrideParseException

        try:
            cfg = compose("train", overrides=overrides)
            return OmegaConf.to_container(cfg, resolve=True)
        except MissingConfigException as err:
            lines = str(err).splitlines()
            options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
            missing = re.search(r"Could not find '([^']+)/([^']+)'", lines[0])
            if missing and missing.group(1) == "hydra/sweeper":
                raise CommandLineError(f"the {missing.group(2)} sweeper is not installed: pip install -e '.[optuna]'") from None
            if missing:
                group, choice = missing.groups()
                raise CommandLineError(f"{group}={choice} is not a choice; choose one of: {', '.join(options)}") from None
            raise CommandLineError(lines[0]) from None
        except OverrideParseException as err:
            raise CommandLineError(f"cannot read the command line ({str(err).splitlines()[0]}); write overrides as key=value") from None
        except HydraException as err:
            cause = err.__cause__
            if cause is not None and "not in struct" in str(cause):
                raise CommandLineError(unknown_setting(str(err).split("'")[1], self.defaults)) from None
            raise CommandLineError(str(err).splitlines()[0]) from None
        except Exception as err:  # an interpolation or resolver that fails on the given values
            raise CommandLineError(f"cannot compose the config: {str(err).splitlines()[0]}") from None


def unknown_setting(key: str, defaults: dict) -> str:
    import difflib

    from training.settings import differing_leaves

    known = differing_leaves(defaults, {}) + [f"trainer.{name}" for name in trainer_parameters()]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown setting '{key}'{hint}; check the spelling (python train.py --cfg job lists every setting)"


# ---- bad places for a run, in one line -----------------------------------------------------------------


def unwritable(folder: Path) -> str | None:
    """Why a folder could not be made at `folder`, or None when it can."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as err:
        return f"cannot write in {existing} ({err.strerror})"
    return None


def check_places(settings: dict[str, str]) -> None:
    """A run folder (hydra.run.dir, or one under runs_root) or sweep folder that cannot be written."""
    for key in ("hydra.run.dir", "runs_root", "hydra.sweep.dir"):
        if key in settings:
            problem = unwritable(Path(settings[key]).expanduser().absolute())
            if problem:
                raise RunFolderError(f"{key}={settings[key]}: {problem}; choose a folder you can write to")


# ---- choosing where a run goes --------------------------------------------------------------------------


class Launch:
    """One command line, checked, with the folder it runs in: what train.py gives Hydra."""

    def __init__(self, args: list[str], claim_folders: bool = True):
        self.claim_folders = claim_folders
        self.args = [as_trainer_argument(a) for a in args]
        self.flags = [a for a in self.args if a.startswith("-")]
        self.overrides = [a for a in self.args if not a.startswith("-")]
        self.user = [o for o in self.overrides if not o.lstrip("+~").startswith("hydra.")]
        self.hydra = dict(o.lstrip("+").split("=", 1) for o in self.overrides if o.lstrip("+~").startswith("hydra.") and "=" in o)
        self.multirun = any(f in ("-m", "--multirun") for f in self.flags)

    def hydra_args(self) -> list[str]:
        """Check the command line and choose its folder; the arguments to give Hydra."""
        if any(flag.split("=")[0] in HYDRA_OWN_FLAGS for flag in self.flags):
            return self.args  # --cfg job, --help, ...: Hydra's own, nothing is trained
        check_places({k: v for k, v in (o.split("=", 1) for o in self.overrides if "=" in o)})
        with Composer() as composer:
            if self.multirun:
                return self.sweep(composer)
            if any(o.split("=")[0].lstrip("+") in SEARCH_GROUPS for o in self.user):
                raise CommandLineError("hparams_search is a search over many runs: add -m (python train.py -m hparams_search=optuna ...)")
            requested = composer.compose(self.user)
            named = named_leaves(self.user, requested, composer.defaults)
            if rank_zero_only.rank != 0:
                return self.args + self.folder_for_other_ranks(requested)
            return self.single(requested, named)

    # ---- one run

    def single(self, requested: dict, named: list[str]) -> list[str]:
        resume = requested.get("resume")
        explicit = self.hydra.get("hydra.run.dir")
        if resume == "auto":
            found = self.auto_resume(requested, named, explicit)
            if found is None:
                return self.new_run(requested, without=["resume"])
            return self.resumed(found, requested, named)
        if resume:
            return self.resumed(Path(resume), requested, named)
        name = launcher_run_name()
        if name and not explicit and launcher_restarted():  # a requeued job continues its own run
            folder = RunFolder(Path(requested["runs_root"]) / name)
            if folder.checkpoint_to_resume() is not None:
                print(f"this job was restarted by its scheduler: continuing {folder.path}", file=sys.stderr)
                return self.resumed(folder.path, requested, named)
        return self.new_run(requested)

    def new_run(self, requested: dict, without: list[str] = ()) -> list[str]:
        check(requested)
        init_from = requested.get("init_from")
        if init_from and not Path(init_from).expanduser().exists():
            raise CheckpointError(f"init_from={init_from} does not exist; pass a .ckpt file, a run folder or a Hugging Face folder")
        args = [a for a in self.args if a.lstrip("+").split("=")[0] not in without]
        explicit, name = self.hydra.get("hydra.run.dir"), launcher_run_name()
        if explicit or name:
            folder = RunFolder(Path(explicit) if explicit else Path(requested["runs_root"]) / name)
            folder.check_new("hydra.run.dir" if explicit else f"run folder of this job ({name})")
            if self.claim_folders:
                claim(folder, new=True)
        elif self.claim_folders:
            folder = adopt(claim_new_folder(requested["runs_root"])).folder
        else:
            return args
        return [a for a in args if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={folder.path}"]

    def resumed(self, target: Path, requested: dict, named: list[str]) -> list[str]:
        """Continue the run at target (a folder, or a checkpoint in one): its checkpoint's settings, with
        what the command line may change; the folder locked; Hydra's record of this command kept apart."""
        folder = folder_of(target)
        explicit = self.hydra.get("hydra.run.dir")
        if explicit and Path(explicit).expanduser().resolve() != folder.path.resolve():
            raise RunFolderError(f"hydra.run.dir={explicit} is not the run resume= continues ({folder.path}); leave hydra.run.dir out")
        checkpoint = folder.checkpoint_named(target)
        header = read_resumable(checkpoint)
        saved = {k: v for k, v in header["settings"].items() if k != PREPARED}
        values = continue_values(saved, requested, named, folder.path)
        check_continuation(values, header["step"])
        check(values)
        if self.claim_folders:
            claim(folder, new=False)
        stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        kept = [a for a in self.args if a.lstrip("+").split("=")[0] not in ("resume", "hydra.run.dir", "hydra.output_subdir")]
        return [*kept, f"resume={checkpoint}", f"hydra.run.dir={folder.path}", f"hydra.output_subdir=.hydra/resume-{stamp}"]

    def auto_resume(self, requested: dict, named: list[str], explicit: str | None) -> Path | None:
        """resume=auto: the run to continue, or None to start one. In a folder given or named by the
        launcher (SLURM, torchrun), the run there; else the newest unfinished run under runs_root with
        the settings this command asks for."""
        name = launcher_run_name()
        if explicit or name:
            folder = RunFolder(Path(explicit) if explicit else Path(requested["runs_root"]) / name)
            return folder.path if folder.checkpoint_to_resume() is not None else None
        for folder in resumable_runs(requested["runs_root"]):
            checkpoint = folder.checkpoint_to_resume()
            try:
                saved = read_header(checkpoint)["settings"]
            except CheckpointError:
                continue
            if saved and matches(requested, saved, named):
                return folder.path
        return None

    def folder_for_other_ranks(self, requested: dict) -> list[str]:
        """A process of a multi-process launch other than the first: the folder all of them derive."""
        if "hydra.run.dir" in self.hydra:
            return []
        name = launcher_run_name()
        if name is None:
            raise RunFolderError("processes started by a launcher need one run folder: pass hydra.run.dir=DIR (or torchrun --rdzv-id=NAME)")
        return [f"hydra.run.dir={Path(requested['runs_root']) / name}"]

    # ---- sweeps

    def sweep(self, composer: Composer) -> list[str]:
        """-m: every combination of the swept values is checked (each value on its own, past 64
        combinations), then the sweep gets one new folder, unless hydra.sweep.dir names one."""
        if any(o.lstrip("+").split("=")[0] == "resume" for o in self.user):
            raise CommandLineError("resume= continues one run: run it without -m (python train.py resume=RUN)")
        for combination in sweep_combinations(self.user):
            check(composer.compose(combination))
        given = self.hydra.get("hydra.sweep.dir")
        if given:
            folder = Path(given).expanduser()
            if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
                raise RunFolderError(f"hydra.sweep.dir={given} is not empty; a sweep writes numbered run folders and a summary there, so choose a new or empty folder")
            return self.args
        if not self.claim_folders:
            return self.args
        folder = claim_new_folder("multirun").folder
        return [*self.args, f"hydra.sweep.dir={folder.path}"]


def sweep_combinations(overrides: list[str], limit: int = 64) -> list[list[str]]:
    """Override lists that together cover every value of each swept setting: all combinations when
    there are at most `limit`, else each value beside the others' first. Ranges that cannot be
    listed (Optuna's interval) keep their defaults here and are checked in each trial."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    fixed, swept = [], []
    for override in OverridesParser.create().parse_overrides(overrides):
        if not override.is_sweep_override():
            fixed.append(override.input_line)
        elif override.is_discrete_sweep():
            key = override.get_key_element()
            swept.append([f"{key}={value}" for value in override.sweep_string_iterator()])
    if math.prod(len(values) for values in swept) <= limit:
        return [fixed + list(choice) for choice in itertools.product(*swept)]
    return [fixed + [values[0] for values in swept[:i]] + [value] + [values[0] for values in swept[i + 1 :]]
            for i, values in enumerate(swept) for value in values]


def read_resumable(checkpoint: Path) -> dict:
    try:
        header = read_header(checkpoint)
    except DamagedCheckpoint as err:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: it is truncated or corrupted{f' ({err.detail})' if err.detail else ''}; "
            "pass an earlier checkpoint of the run, e.g. resume=<run>/checkpoints/step-NNNNNN.ckpt"
        ) from None
    if not header["settings"]:
        raise CheckpointError(f"{checkpoint} carries no run settings, so it cannot be resumed; init_from={checkpoint} starts a new run from its weights")
    return header


def check_command_line(args: list[str]) -> str | None:
    """The one-line reason a command line is refused, or None; makes and locks nothing."""
    try:
        Launch(args, claim_folders=False).hydra_args()
    except (*USER_ERRORS, CommandLineError) as err:
        return str(err)
    return None


# ---- the run --------------------------------------------------------------------------------------------


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    requested = OmegaConf.to_container(cfg, resolve=True)
    with_defaults = hydra.compose("train", overrides=[])
    named = named_leaves([o for o in overrides if not o.startswith("hydra.")], requested, OmegaConf.to_container(with_defaults, resolve=True))
    try:
        result = train(cfg, run_dir, named=named, overrides=overrides)
    except USER_ERRORS as err:
        if requested.get("resume") and hydra_cfg.output_subdir:
            remove_record(run_dir / hydra_cfg.output_subdir)  # a refused resume leaves its run as it was
        if not multirun or isinstance(err, CheckpointSaveError):  # a full disk stops a sweep too
            sys.exit(f"error: {err}")
        log.error("error: %s", err)  # one job of a sweep: recorded, and the sweep goes on
        run_dir.mkdir(parents=True, exist_ok=True)
        RunFolder(run_dir).write_result(result_record(RunFolder(run_dir), overrides, requested, {}, False, str(err)))
        return math.inf
    if rank_zero_only.rank != 0:
        return result.metrics.get("val/bpc")
    if not result.finished:
        log.warning("stopped by %s at step %d; checkpoint saved. Continue with: python train.py resume=%s",
                    result.stopped_by, result.step, run_dir)
        if multirun:
            summarize(Path(hydra_cfg.sweep.dir))
            log.warning("the sweep stops here; the jobs after this one did not run")
            sys.exit(0)
        return None
    log.info("done: %s", describe_metrics(result.metrics))
    log.info("run folder: %s", result.run_dir)
    log.info('sample from it: python generate.py --ckpt %s --prompt "ROMEO:"', result.run_dir)
    return result.metrics.get("val/bpc")


def remove_record(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    try:
        hydra_args = Launch(sys.argv[1:]).hydra_args()
    except (*USER_ERRORS, CommandLineError) as err:
        sys.exit(f"error: {err}")
    sys.argv = [sys.argv[0], *hydra_args]
    main()
