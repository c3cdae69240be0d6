"""A sweep's command line (`python train.py -m ...`), checked before its folder is made and its first
job starts, so that a sweep that cannot run is refused in one line rather than failing job after job:
Hydra's own settings are not swept, every value of every swept setting (and each choice a search such as
hparams_search=optuna would draw, at the ends of its ranges and between them) makes settings that pass
shell.settings.check, the data each names is there, and a search's storage can hold its study.
`sweep_combinations` lists the override lists that cover every swept value."""

from __future__ import annotations

import importlib.metadata
import itertools
import math
import os
from pathlib import Path

from data.sources import check_files
from shell.checks import ABSENT, lookup
from shell.command_line import SEARCH_GROUPS, CommandLineError, Composer, parse_overrides
from shell.errors import USER_ERRORS
from shell.run_folder import SWEEP_RECORD, RunFolder, RunFolderError
from shell.settings import check
from shell.sweep import OBJECTIVE


def refuse_swept_hydra_settings(hydra_parsed: list) -> None:
    """hydra.*=a,b (a sweep of Hydra's own settings) is refused; hydra.sweeper.params.* with how to give
    it as a search range instead."""
    for override in hydra_parsed:
        if override.is_sweep_override():
            key, values = override.key_or_group, override.input_line.split("=", 1)[1]
            instead = key.removeprefix("hydra.sweeper.params.")
            raise CommandLineError(
                f"{override.input_line}: Hydra's own settings cannot be swept"
                + (f"; give the search range as {instead}={values}" if instead != key else "")
            )


def check_search_sweeper(sweeper: dict) -> None:
    """A search runs on the project's sweeper (hydra_plugins/tinygpt2_optuna) with Optuna 4 or later.
    The hydra-optuna-sweeper plugin, which earlier versions installed and which needs Optuna 2, names its
    sweeper alike; where both are installed, Hydra may choose either."""
    if "hydra_optuna_sweeper" in str(sweeper.get("_target_")):
        raise CommandLineError(
            "the hydra-optuna-sweeper plugin, installed here, takes the place of this project's Optuna search "
            "(and needs Optuna 2); remove it: pip uninstall hydra-optuna-sweeper"
        )
    try:
        version = importlib.metadata.version("optuna")
    except importlib.metadata.PackageNotFoundError:
        raise CommandLineError("a search needs Optuna; install it with: pip install -e '.[optuna]'") from None
    if int(version.split(".")[0]) < 4:
        raise CommandLineError(
            f"a search needs Optuna 4 or later, and {version} is installed; upgrade it with: pip install -e '.[optuna]'"
        )


def check_trial_counts(sweeper: dict) -> None:
    for count in ("n_trials", "n_jobs"):  # n_jobs: how many trials the sampler proposes at a time
        if isinstance(sweeper.get(count), int) and sweeper[count] < 1:
            raise CommandLineError(f"hydra.sweeper.{count} must be at least 1, got {sweeper[count]}")


def searched_settings(sweeper: dict, parsed: list, hydra_parsed: list, composed: dict, user: list[str]) -> list[str]:
    """The search space's settings the command line does not give, as key=values overrides; refused
    where the groups chosen lack one."""
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
        raise CommandLineError(search_lacks(missing, composed, user))
    return [f"{key}={values}" for key, values in space.items() if key not in given]


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


def check_jobs(composer: Composer, combinations: list[list[str]]) -> None:
    """Each combination's settings checked, and the files of each of their data settings looked up."""
    data_settings = []
    for combination in combinations:
        values, _ = check(composer.compose(combination))
        if values["data"] not in data_settings:  # each data setting's files looked up once
            data_settings.append(values["data"])
            check_files(values["data"])


def check_direction(sweeper: dict, searching: bool) -> None:
    direction = sweeper.get("direction", "minimize")
    if searching and str(getattr(direction, "name", direction)) != "minimize":
        raise CommandLineError(
            f"hydra.sweeper.direction must be minimize, got {getattr(direction, 'name', direction)}: each trial "
            f"returns its final {OBJECTIVE}, which is better lower; leave it out"
        )


def check_intervals(composer: Composer, overrides: list[str], combinations: list[list[str]], searching: bool) -> None:
    """interval(...) ranges: only a search samples them, and the values it would draw (interval_sweeps)
    make settings that pass, beside the first of `combinations` (sweep_combinations)."""
    for line, key, values in interval_sweeps(overrides):
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


def check_subdir(subdir: str | None, several: bool) -> None:
    """hydra.sweep.subdir, for a sweep of several jobs, must name a folder of each."""
    if several and subdir is not None and "${" not in subdir:
        raise CommandLineError(
            f"hydra.sweep.subdir={subdir} names the same folder for every job of the sweep; leave it out "
            "(each job gets a numbered folder) or make it differ, e.g. 'hydra.sweep.subdir=${hydra.job.num}'"
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
    installed; for SQLite, a database file, or a new one in a folder that can be written (the database is
    opened once every check has passed: sweep_launch.open_study_storage)."""
    if storage is None:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    given = f"hydra.sweeper.storage={storage}"
    try:
        url = make_url(str(storage))
        url.get_dialect().import_dbapi()
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
    check_sqlite_file(given, Path(url.database))


def check_sqlite_file(given: str, path: Path) -> None:
    """A SQLite storage's file: a database that can be read and written, or a new one in a folder that can
    be written. `given`: the storage setting, as the command line gave it."""
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
            if not values:  # Hydra would launch no job, and end saying nothing
                raise CommandLineError(
                    f"{override.input_line} gives no values to sweep (range(start,stop) counts up from start to "
                    "below stop, e.g. range(1,4) is 1, 2, 3); list the values as key=a,b,c, or give a range that "
                    "holds some"
                )
            swept.append([f"{override.get_key_element()}={value}" for value in values])
    if math.prod(len(values) for values in swept) <= limit:
        return [fixed + list(choice) for choice in itertools.product(*swept)]
    return [
        fixed + [values[0] for values in swept[:i]] + [value] + [values[0] for values in swept[i + 1 :]]
        for i, values in enumerate(swept)
        for value in values
    ]
