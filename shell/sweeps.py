"""Sweeps (`python train.py -m optim.lr=1e-3,3e-3`) and searches (`-m hparams_search=optuna`): one sweep folder of
run folders, and `summary.csv` / `summary.json` at its root naming the best job by `val/bpc` (what train.py
returns to Hydra's sweepers). `Sweeps`, a Hydra callback, gives the sweep its folder once every value of every
swept setting passes the checks, continues a stopped sweep in its folder (-m resume=SWEEP, or a requeued SLURM
job), and writes the summary as each job ends."""

from __future__ import annotations

import contextlib
import copy
import csv
import fcntl
import importlib.metadata
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, BinaryIO

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from data.sources import check_files
from data.writes import write_atomically
from shell.checks import CONFIG_DIR, SettingError, check_values, plain, put, settings_of, stray
from shell.command_line import hydra_reading, typed_override, whole_path
from shell.errors import USER_ERRORS, RunFolderError
from shell.folders import (
    SWEEP_RECORD,
    RunFolder,
    check_readable_by_hydra,
    folder_of,
    launcher_name,
    launcher_restarted,
    new_folder,
    process_rank,
    sweep_continue_command,
)
from shell.stops import hold_stops

log = logging.getLogger(__name__)

OBJECTIVE = "val/bpc"  # lower is better; comparable across tokenizers
METRICS = ("val/bpc", "val/loss", "val/perplexity", "train/loss")
SEARCH_RESULT = "optimization_results.yaml"  # the best trial, which a search writes as it ends
SEARCH_OF_TRIAL = "tinygpt2_search"  # a trial's user attribute: the folder of the search that launched it


class Sweeps(Callback):
    """The sweep's folder, checks and summary; in a launch of several processes the first decides for all."""

    def __init__(self) -> None:
        self.lock: BinaryIO | None = None  # the sweep folder's, held while Hydra runs the sweep (closed with it)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        hold_stops()  # until the first job can take the sweep's folder back (Job.ending)
        try:
            self.start(config)
        except USER_ERRORS as err:  # (Hydra turns a callback's exception into a warning, and goes on)
            sys.exit(f"error: {err}")

    def start(self, config: DictConfig) -> None:
        typed = [hydra_reading(o) for o in config.hydra.overrides.task if o.lstrip("+").startswith("resume=")]
        given = [o.input_line.partition("=")[2] if o.is_sweep_override() else str(o.value()) for o in typed]
        shared = launcher_name()
        requeued = shared and launcher_restarted() and (Path("multirun") / shared / SWEEP_RECORD).is_file()
        made = None
        if given or requeued:
            folder = continue_sweep(config, given[-1] if given else f"multirun/{shared}", bool(requeued))
        else:
            check_sweep(config)
            if process_rank() == 0 and "optuna" in str(config.hydra.sweeper.get("_target_", "")).lower():
                open_study_storage(config.hydra.sweeper)
            folder, made = sweep_folder(config, shared)
        if process_rank() == 0:
            self.lock = os.fdopen(folder.lock(made), "rb")
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.sweep.dir = str(folder.path)
            config.hydra.overrides.hydra.append(whole_path(typed_override("hydra.sweep.dir", folder.path)))
        if process_rank() == 0:
            OmegaConf.save(config, folder.path / SWEEP_RECORD)  # (Optuna's sweeper writes none)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if process_rank() == 0:
            summarize(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        summary = summarize(sweep_dir) if process_rank() == 0 else {"runs": [{"finished": True}]}
        if summary is None or not any(r["finished"] for r in summary["runs"]):
            log.error("no job of the sweep finished (their errors are above and in %s)", sweep_dir / "summary.csv")
            sys.exit(1)  # as a single run that fails: a script's next command does not go on
        if process_rank() != 0:
            return
        log.info("sweep summary: %s", sweep_dir / "summary.csv")
        swept = swept_settings(summary["runs"], sweep_dir)
        said = {
            Path(r["run_dir"]).name: " ".join(f"{k}={given(r)[k]}" for k in swept if k in given(r))
            for r in summary["runs"]
        }
        for r in summary["runs"]:
            figures = ", ".join(f"{m} {r['metrics'][m]:.4f}" for m in METRICS if m in r["metrics"]) or r.get(
                "error", ""
            )
            log.info("  %s  %s  %s", Path(r["run_dir"]).name, said[Path(r["run_dir"]).name] or "(defaults)", figures)
        if best := summary["best"]:
            log.info("best: %s (%s), %s %.4f", best["run"], said[best["run"]] or "defaults", OBJECTIVE, best[OBJECTIVE])


def sweep_folder(config: DictConfig, shared: str | None) -> tuple[RunFolder, Path | None]:
    """The sweep's folder, and the outermost folder made for it: the one hydra.sweep.dir names (new or empty),
    the one a torchrun or SLURM launch names for itself, or a new one under multirun/ named by the time."""
    named = any(o.lstrip("+").startswith("hydra.sweep.dir=") for o in config.hydra.overrides.hydra)
    folder = RunFolder(config.hydra.sweep.dir if named else Path("multirun") / (shared or ""))
    check_readable_by_hydra(folder.path, "hydra.sweep.dir=DIR")
    if not named and not shared:
        return new_folder("multirun")
    if process_rank() != 0:  # the first process of the launch checks and makes it
        return folder, None
    if owner := folder.held_by():
        raise RunFolderError(f"hydra.sweep.dir={folder.path} is the folder of a sweep under way ({owner}); choose a new "
                             "or empty folder")  # fmt: skip
    starting = {SWEEP_RECORD, *(p.name for p in folder.path.glob("[0-9]*") if not RunFolder(p).holds_run())}
    if folder.path.exists() and (
        not folder.path.is_dir() or set(os.listdir(folder.path)) - {".lock"} - (starting if shared else set())
    ):
        raise RunFolderError(f"hydra.sweep.dir={folder.path} {'already holds a sweep' if shared else 'is not empty'}; a "
                             "sweep writes numbered run folders and a summary there, so choose a new or empty folder")  # fmt: skip
    made = next((p for p in [*reversed(folder.path.parents), folder.path] if not p.exists()), None)
    folder.path.mkdir(parents=True, exist_ok=True)
    return folder, made


def check_sweep(config: DictConfig) -> None:
    """Every value of every swept setting (and the ends and middle of a search's ranges) checked beside the first
    value of the others before the first job starts, with the files of the data; one line a problem."""
    sweeper = OmegaConf.to_container(config.hydra.sweeper, resolve=True)
    searching = "optuna" in str(sweeper.get("_target_", "")).lower()
    space = search_space(config, sweeper, searching)
    given = [hydra_reading(o) for o in config.hydra.overrides.task]
    space = {k: v for k, v in space.items() if k not in {o.key_or_group for o in given}}
    choices = OmegaConf.to_container(config.hydra.runtime.choices)
    for key in (k for k in (sweeper.get("params") or {}) if k in space and stray(k, choices)):
        search, group = choices.get("hparams_search"), key.split(".")[0]
        raise SettingError(f"hparams_search={search} searches {key}, which {group}={choices[group]} does not have; search "
                           f"with a space of your own: a copy of configs/hparams_search/{search}.yaml without {key}")  # fmt: skip
    overrides = [*given, *(hydra_reading(f"{k}={v}") for k, v in space.items())]
    swept = [(o, swept_values(o, searching)) for o in overrides if o.is_sweep_override()]
    base = plain(config)
    for override, values in swept:
        base, choices = with_value(base, choices, override.key_or_group, values[0]) if values else (base, choices)
    check_values(base, choices)
    check_files(OmegaConf.create(base["data"]))
    problems = []
    for override, values in swept:
        for value in values:
            try:
                check_values(*with_value(base, choices, override.key_or_group, value))
            except SettingError as err:
                drawn = (
                    f": the search would draw values such as {value:g}, refused" if override.is_interval_sweep() else ""
                )
                problems.append(f"{override.input_line}{drawn}: {err}")
                break  # (one line for each swept setting)
    if problems:
        raise SettingError.several(problems)
    if searching:
        check_search(sweeper)


def search_space(config: DictConfig, sweeper: dict[str, Any], searching: bool) -> dict[str, str]:
    """What a search searches (its params, and hydra.sweeper.params.KEY=... given), once Hydra's own settings on
    the command line are seen to sweep nothing and the sweep's subfolders to be one a job."""
    space = dict(sweeper.get("params") or {}) if searching else {}
    for override in OmegaConf.to_container(config.hydra.overrides, resolve=False)["hydra"]:  # as typed: ${...}
        key = (parsed := hydra_reading(override)).key_or_group
        if key == "hydra.sweep.subdir" and "${" not in override:  # (${hydra.job.num}, ${optim.lr}: a folder a job)
            raise SettingError(f"{override} would put every job of the sweep in one folder; leave it out (each job's "
                               "folder is its number), or make it hold ${hydra.job.num} or a swept setting")  # fmt: skip
        if parsed.is_sweep_override():
            instead = (
                f"; give the search range as {key.removeprefix('hydra.sweeper.params.')}={override.split('=', 1)[1]}"
            )
            raise SettingError(
                f"{override}: Hydra's own settings cannot be swept" + (instead if "params." in key else "")
            )
        if key.startswith("hydra.sweeper.params."):
            space[key.removeprefix("hydra.sweeper.params.")] = override.split("=", 1)[1]
    return space


def with_value(values: dict, choices: dict, key: str, value: Any) -> tuple[dict, dict]:
    """The settings, and the group choices, with key (a setting, or a group) given value."""
    values = copy.deepcopy(values)
    if key in values and (CONFIG_DIR / key).is_dir():
        values[key] = settings_of(key, str(value))
        return values, {**choices, key: str(value)}
    put(values, key, value)
    return values, choices


def swept_values(override: Any, searching: bool) -> list[Any]:
    """The values a swept override gives; of a search's interval, its ends and a value between them."""
    if override.is_interval_sweep():
        if not searching:
            raise SettingError(f"{override.input_line} is a range to search, which only a search samples: add "
                               f"hparams_search=optuna, or list the values to try ({override.key_or_group}=a,b,c)")  # fmt: skip
        interval = override.value()
        low, high = float(interval.start), float(interval.end)
        inside = math.sqrt(low * high) if "log" in interval.tags and low > 0 else low + (high - low) * 0.382
        return [low, high, float(f"{inside:.4g}")]
    if "glob(" in override.input_line:
        return []  # config files are listed only inside Hydra's run: checked in each job
    values = list(override.sweep_iterator())
    if any(hasattr(v, "tags") for v in values):  # a=range(1,3),x
        raise SettingError(f"{override.input_line}: a range() or choice() inside a list of values is not unfolded; "
                           f"list each value, as {override.key_or_group}=a,b,c")  # fmt: skip
    if not values:  # Hydra would launch no job, and end saying nothing
        raise SettingError(f"{override.input_line} gives no values to sweep (range(start,stop) counts up from start to "
                           "below stop, e.g. range(1,4) is 1, 2, 3); list the values as key=a,b,c, or give a range that "
                           "holds some")  # fmt: skip
    return values


# ---- a search ----------------------------------------------------------------------------------------------


def check_search(sweeper: dict[str, Any]) -> None:
    """A search runs on the project's sweeper with Optuna 4 or later, minimises, and draws at least one trial."""
    if "hydra_optuna_sweeper" in str(sweeper.get("_target_")):
        raise SettingError("the hydra-optuna-sweeper plugin, installed here, takes the place of this project's Optuna "
                           "search (and needs Optuna 2); remove it: pip uninstall hydra-optuna-sweeper")  # fmt: skip
    if int(importlib.metadata.version("optuna").split(".")[0]) < 4:
        raise SettingError("a search needs Optuna 4 or later; upgrade it with: pip install -e '.[optuna]'")
    if (direction := str(sweeper.get("direction", "minimize"))).rsplit(".", 1)[-1].lower() != "minimize":
        raise SettingError(f"hydra.sweeper.direction must be minimize, got {direction}: each trial returns its final "
                           f"{OBJECTIVE}, which is better lower; leave it out")  # fmt: skip
    for count in ("n_trials", "n_jobs"):
        if isinstance(sweeper.get(count), int) and sweeper[count] < 1:
            raise SettingError(f"hydra.sweeper.{count} must be at least 1, got {sweeper[count]}")


def open_study_storage(sweeper: DictConfig) -> None:
    """A search's storage opened before its sweep starts, so that it holds Optuna's tables before the sweeper opens
    it (two searches on one new SQLite file take turns under a lock on its folder: each made the tables, and the
    second failed); the trials a killed search left running are told to the study as failed."""
    if not isinstance(storage := sweeper.get("storage"), str):
        return  # in memory
    import optuna
    from optuna.trial import TrialState

    held = None
    try:
        if storage.startswith("sqlite:///"):
            held = os.open(Path(storage.removeprefix("sqlite:///")).expanduser().absolute().parent, os.O_RDONLY)
            fcntl.flock(held, fcntl.LOCK_EX)
        optuna.storages.RDBStorage(storage).engine.dispose()
    except Exception as err:
        raise SettingError(f"hydra.sweeper.storage={storage} cannot be opened ({(str(err).strip().splitlines() or [type(err).__name__])[0]}); "
                           "give a database URL that can be reached and written, such as sqlite:///search.db") from None  # fmt: skip
    finally:
        if held is not None:
            os.close(held)
    with contextlib.suppress(Exception):  # no such study yet, or a database gone: the sweeper says so
        study = optuna.load_study(study_name=str(sweeper.get("study_name")), storage=storage)
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            search = trial.user_attrs.get(SEARCH_OF_TRIAL)
            if isinstance(search, str) and Path(search).is_dir() and not RunFolder(search).held_by():
                study.tell(trial.number, state=TrialState.FAIL)  # left running by a search that was killed
                print(f"trial {trial.number} of the study {study.study_name} was left running by a search that was "
                      f"killed ({search}); it is marked failed", file=sys.stderr)  # fmt: skip


def is_search(sweep_dir: Path) -> bool:
    record = OmegaConf.load(Path(sweep_dir) / SWEEP_RECORD) if (Path(sweep_dir) / SWEEP_RECORD).is_file() else {}
    return "optuna" in str(OmegaConf.select(record, "hydra.sweeper._target_", default="")).lower()


def how_to_continue(sweep: Path) -> str:
    if not is_search(sweep):
        return f"continue the sweep, this job and the rest, with: {sweep_continue_command(sweep)}"
    return f"the search's trials so far are in {sweep / 'summary.csv'}; {how_to_add_trials(sweep)}"


def how_to_add_trials(search: Path) -> str:
    """How a later search continues a search's study: only one kept in a storage can be."""
    if storage := OmegaConf.select(OmegaConf.load(search / SWEEP_RECORD), "hydra.sweeper.storage"):
        return f"run it again with the same hydra.sweeper.storage ({storage}) to add trials to its study"
    return ("its study was kept in memory (hydra.sweeper.storage=null) and ended with it; run it again with "
            "hydra.sweeper.storage=sqlite:///search.db to keep a study that a later search continues")  # fmt: skip


# ---- a sweep continued -------------------------------------------------------------------------------------


def continue_sweep(config: DictConfig, given: str, requeued: bool) -> RunFolder:
    """-m resume=SWEEP (or a launch its scheduler restarted): the sweep's own command line again, from the folder
    it was started in, into its folder, each job with resume=auto: one that finished is kept, a stopped one
    continues from its checkpoint, one stopped before its first checkpoint starts again, the others run."""
    what = f"the sweep folder {given}" if requeued else f"resume={given}"
    others = [o for o in config.hydra.overrides.task if not o.lstrip("+").startswith("resume=")]
    if given in ("", "null", "None", "auto"):
        raise SettingError("resume=auto continues one run: run it without -m (python train.py resume=auto ...)" if given else
                           "resume= with -m names no sweep to continue: give its folder (python train.py -m "
                           "resume=multirun/DATE/TIME), or leave resume= out to start a new sweep")  # fmt: skip
    if others and not requeued:
        raise SettingError(f"-m resume={given} continues the sweep with its own command line; leave out {others[0]} (a "
                           "job of it continues with settings of its own as python train.py resume=SWEEP/N ...)")  # fmt: skip
    folder, alone = RunFolder(given), RunFolder(Path(given) / "N").continue_command()
    if not (folder.path / SWEEP_RECORD).is_file():
        try:
            run = folder_of(folder.path)
        except RunFolderError:
            where = "does not exist" if not folder.path.exists() else "is not a sweep's folder"
            raise SettingError(f"{what} {where}; with -m, resume= continues a sweep: give its folder (multirun/DATE/TIME, "
                               "the one holding multirun.yaml and the jobs' numbered folders)") from None  # fmt: skip
        raise SettingError(f"{what} is a run, not a sweep: continue it without -m ({run.continue_command()})") from None
    task, hydra_given, cwd = sweep_record(folder, what, alone)
    if is_search(folder.path):
        if requeued and (folder.path / SEARCH_RESULT).is_file():  # stopped as it ended
            print(f"this job was restarted by its scheduler, and its search had ended: {folder.path / SEARCH_RESULT}")
            sys.exit(0)
        why = "this job was restarted by its scheduler, and its sweep cannot continue: " if requeued else ""
        raise SettingError(f"{why}{what} is a search, which is not continued in its folder: "
                           f"{how_to_add_trials(folder.path)}; a stopped trial continues alone with {alone}")  # fmt: skip
    if (owner := folder.held_by()) and process_rank() == 0:
        raise folder.under_way(owner)
    if not Path(cwd).is_dir():
        raise SettingError(f"the sweep {folder.path} was started in {cwd}, which is gone, and what its command line names "
                           f"there cannot be found; restore that folder, or continue its stopped jobs alone with {alone}")  # fmt: skip
    if requeued and process_rank() == 0:
        print(f"this job was restarted by its scheduler: continuing the sweep {folder.path}", file=sys.stderr)
    os.chdir(cwd)  # its relative paths (data.path=input.txt) name what they named
    kept = [o for o in hydra_given if o.lstrip("+").partition("=")[0] not in ("hydra.sweep.dir", "hydra.mode")]
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.overrides.task = [*(o for o in task if not o.lstrip("+").startswith("resume=")), "resume=auto"]
        config.hydra.overrides.hydra = [*kept, "hydra.mode=MULTIRUN"]
    return folder


def sweep_record(folder: RunFolder, what: str, alone: str) -> tuple[list[str], list[str], str]:
    """A sweep's command line as Hydra recorded it: its settings, Hydra's own, and the folder it started in."""
    try:
        started = OmegaConf.to_container(OmegaConf.load(folder.path / SWEEP_RECORD).hydra, resolve=False)
        task, hydra_given, cwd = started["overrides"]["task"], started["overrides"]["hydra"], started["runtime"]["cwd"]
        if not all(isinstance(o, str) for o in [*task, *hydra_given, cwd]):
            raise ValueError("its overrides are not lists of key=value")
    except Exception as err:
        raise SettingError(f"{what}: {folder.path / SWEEP_RECORD} cannot be read as a sweep's record "
                           f"({(str(err).strip().splitlines() or [type(err).__name__])[0]}); continue its stopped jobs "
                           f"alone with {alone}") from None  # fmt: skip
    return task, hydra_given, cwd


# ---- the summary -------------------------------------------------------------------------------------------


def result_record(
    folder: RunFolder, overrides: list[str], settings: dict, metrics: dict, finished: bool, error: str = ""
) -> dict:
    """What result.json holds: what the run was asked, what it reached, whether it ran to its end."""
    record = {
        "run_dir": str(folder.path),
        "finished": finished,
        "overrides": overrides,
        "metrics": metrics,
        "config": settings,
    }
    return {**record, "error": error} if error else record


def summarize(sweep_dir: Path) -> dict[str, Any] | None:
    """Every job's result under sweep_dir gathered into summary.json and summary.csv; None when none has one yet."""
    jobs = (
        sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir()), key=job_order) if Path(sweep_dir).is_dir() else []
    )
    if not (results := [r for r in (RunFolder(p).read_result() for p in jobs) if r]):
        return None
    scored = [r for r in results if r["finished"] and math.isfinite(r["metrics"].get(OBJECTIVE, math.inf))]
    best = min(scored, key=lambda r: r["metrics"][OBJECTIVE]) if scored else None
    shown = (
        {"run": Path(best["run_dir"]).name, "overrides": best["overrides"], OBJECTIVE: best["metrics"][OBJECTIVE]}
        if best
        else None
    )
    summary = {"objective": OBJECTIVE, "best": shown, "runs": results}
    write_atomically(Path(sweep_dir) / "summary.json", json.dumps(summary, indent=2))
    swept = swept_settings(results, Path(sweep_dir))
    names = [m for m in METRICS if any(m in r["metrics"] for r in results)]
    resumed = [" ".join(o for o in r.get("resumed_with", []) if o not in r["overrides"] and "resume=" not in o)
               for r in results]  # fmt: skip
    rows = [["run", *swept, *names, "finished", "best", *(["resumed with"] if any(resumed) else [])]]
    for r, changed in zip(results, resumed, strict=True):
        settings, figures = given(r), [r["metrics"].get(m, "") for m in names]
        ended = r.get("error") or str(r["finished"]).lower()
        rows.append([Path(r["run_dir"]).name, *(settings.get(k, "") for k in swept), *figures, ended,
                     "*" if r is best else "", *([changed] if any(resumed) else [])])  # fmt: skip
    tmp = Path(sweep_dir) / ".summary.csv.tmp"
    with open(tmp, "w", newline="") as out:
        csv.writer(out).writerows(rows)
    tmp.replace(Path(sweep_dir) / "summary.csv")
    return summary


def given(result: dict[str, Any]) -> dict[str, str]:
    """A job's settings as its command line gave them, and as a resume of it alone changed them."""
    said = [*result["overrides"], *result.get("resumed_with", [])]
    return dict(o.lstrip("+").split("=", 1) for o in said if "=" in o and not o.lstrip("+").startswith("resume="))


def swept_settings(results: list[dict[str, Any]], sweep_dir: Path) -> list[str]:
    """What the sweep varies: the settings its command line sweeps and its search searches (Hydra's record,
    multirun.yaml), and any setting whose value differs between jobs."""
    per_run = [given(r) for r in results]
    varied = [k for k in dict.fromkeys(k for s in per_run for k in s) if len({s.get(k) for s in per_run}) > 1]
    try:
        hydra = OmegaConf.load(Path(sweep_dir) / SWEEP_RECORD).hydra
        parsed = [hydra_reading(o) for o in hydra.overrides.task]
        searched = [str(k) for k in (OmegaConf.select(hydra, "sweeper.params") or {})]
    except Exception:  # no record, or one of another shape: the values alone tell
        return varied
    fixed = {o.key_or_group for o in parsed if not o.is_sweep_override()}  # given a value, it leaves the search
    declared = [o.key_or_group for o in parsed if o.is_sweep_override()] + [k for k in searched if k not in fixed]
    return list(dict.fromkeys([*declared, *varied]))


def job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), path.name) if path.name.isdigit() else (1 << 30, path.name)
