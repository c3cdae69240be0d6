"""Sweeps (`python train.py -m optim.lr=1e-3,3e-3`, or a search: `-m hparams_search=optuna`): one run
folder per job under one sweep folder, and a summary at its root.

Each run writes `result.json` (its overrides, settings and final metrics) into its own folder; as each
job ends, `summarize` gathers them into `summary.csv` and `summary.json` beside them, naming the best
job by the objective (`val/bpc`, what `python train.py` returns to Hydra's sweepers).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from data.writes import write_atomically
from shell.run_folder import SWEEP_RECORD, RunFolder, process_rank, sweep_continue_command

log = logging.getLogger(__name__)

OBJECTIVE = "val/bpc"  # lower is better; comparable across tokenizers
METRICS = ("val/bpc", "val/loss", "val/perplexity", "train/loss")


def result_record(
    folder: RunFolder,
    overrides: list[str],
    settings: dict[str, Any],
    metrics: dict[str, float],
    finished: bool,
    error: str | None = None,
) -> dict[str, Any]:
    """What result.json holds: what the run was asked, what it reached, whether it ran to its end."""
    record = {
        "run_dir": str(folder.path),
        "finished": finished,
        "overrides": overrides,
        "metrics": metrics,
        "config": settings,
    }
    if error:
        record["error"] = error
    return record


def summarize(sweep_dir: Path) -> dict[str, Any] | None:
    """Collect every job's result under sweep_dir into summary.json and summary.csv; None when no job
    has a result yet."""
    jobs = (
        sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir()), key=job_order) if Path(sweep_dir).is_dir() else []
    )
    results = [r for r in (RunFolder(p).read_result() for p in jobs) if r]
    if not results:
        return None
    best = best_result(results)
    summary = {
        "objective": OBJECTIVE,
        "best": {
            "run": Path(best["run_dir"]).name,
            "overrides": best["overrides"],
            OBJECTIVE: best["metrics"][OBJECTIVE],
        }
        if best
        else None,
        "runs": results,
    }
    write_atomically(Path(sweep_dir) / "summary.json", json.dumps(summary, indent=2))
    swept = swept_settings(results, Path(sweep_dir))
    metric_names = [m for m in METRICS if any(m in r["metrics"] for r in results)]
    changed = any(changed_on_resume(r) for r in results)
    rows = [["run", *swept, *metric_names, "finished", "best", *(["resumed with"] if changed else [])]]
    for r in results:
        settings = overrides_as_dict(r)
        rows.append(
            [
                Path(r["run_dir"]).name,
                *(settings.get(k, "") for k in swept),
                *(r["metrics"].get(m, "") for m in metric_names),
                r.get("error") or str(r["finished"]).lower(),
                "*" if r is best else "",
                *([" ".join(changed_on_resume(r))] if changed else []),
            ]
        )
    tmp = Path(sweep_dir) / ".summary.csv.tmp"
    with open(tmp, "w", newline="") as out:
        csv.writer(out).writerows(rows)
    tmp.replace(Path(sweep_dir) / "summary.csv")
    return summary


def best_result(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The finished job with the lowest objective."""
    scored = [r for r in results if r["finished"] and math.isfinite(r["metrics"].get(OBJECTIVE, math.inf))]
    return min(scored, key=lambda r: r["metrics"][OBJECTIVE]) if scored else None


def overrides_as_dict(result: dict[str, Any]) -> dict[str, str]:
    """A job's settings from its command line as it ended: those it started with, and those a
    continuation (python train.py resume=SWEEP/N key=value) changed."""
    given = [*result["overrides"], *changed_on_resume(result)]
    return dict(o.lstrip("+").split("=", 1) for o in given if "=" in o)


def changed_on_resume(result: dict[str, Any]) -> list[str]:
    """The settings a job's continuation changed: those it gave besides resume= that its start had not
    (none for a job not continued, or continued with the sweep's own command line)."""
    started = {o.lstrip("+") for o in result["overrides"]}
    return [
        o
        for o in result.get("resumed_with") or []
        if "=" in o
        and o.lstrip("+") not in started
        and o.lstrip("+~").partition("=")[0] != "resume"
        and not o.lstrip("+~").startswith("hydra.")
    ]


def swept_settings(results: list[dict[str, Any]], sweep_dir: Path | None = None) -> list[str]:
    """What the sweep varies: the settings its command line sweeps and its sweeper searches (from
    Hydra's record, multirun.yaml), and any override whose value differs between jobs."""
    per_run = [overrides_as_dict(r) for r in results]
    keys = dict.fromkeys(k for settings in per_run for k in settings)
    varied = [k for k in keys if len({settings.get(k) for settings in per_run}) > 1]
    return list(dict.fromkeys([*declared_sweep(sweep_dir), *varied])) if sweep_dir else varied


def declared_sweep(sweep_dir: Path) -> list[str]:
    try:
        hydra = OmegaConf.load(Path(sweep_dir) / SWEEP_RECORD).hydra
        task = list(hydra.overrides.task)
        searched = list((OmegaConf.select(hydra, "sweeper.params") or {}).keys())
    except Exception:  # no record, or one of another shape: the values alone tell
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(task)
    swept = [o.key_or_group for o in parsed if o.is_sweep_override()]
    fixed = {o.key_or_group for o in parsed if not o.is_sweep_override()}  # given a value, it leaves the search
    return [*swept, *(str(key) for key in searched if str(key) not in fixed)]


def is_search(sweep_dir: Path) -> bool:
    """Whether the sweep at sweep_dir is a search (an Optuna sweeper), whose trials are drawn, not listed."""
    try:
        target = OmegaConf.select(OmegaConf.load(Path(sweep_dir) / SWEEP_RECORD), "hydra.sweeper._target_")
    except Exception:
        return False
    return "optuna" in str(target).lower()


def how_to_continue_sweep(sweep: Path) -> str:
    if is_search(sweep):
        return f"the search's trials so far are in {sweep / 'summary.csv'}; {how_to_add_trials(sweep)}"
    return f"continue the sweep, this job and the rest, with: {sweep_continue_command(sweep)}"


def how_to_add_trials(search: Path) -> str:
    """How a later search continues the study of the search at `search`: only one kept in a storage can be."""
    storage = OmegaConf.select(OmegaConf.load(search / SWEEP_RECORD), "hydra.sweeper.storage")
    if storage:
        return f"run it again with the same hydra.sweeper.storage ({storage}) to add trials to its study"
    return (
        "its study was kept in memory (hydra.sweeper.storage=null) and ended with it; run it again with "
        "hydra.sweeper.storage=sqlite:///search.db to keep a study that a later search continues"
    )


SEARCH_OF_TRIAL = "tinygpt2_search"  # a trial's user attribute: the folder of the search that launched it


def fail_abandoned_trials(storage: str, study_name: str) -> list[str]:
    """The trials of the stored study that a search left running as it was killed (with no chance to
    end them, as its sweeper does at a stop) are told to Optuna as failed; without this they stayed
    running for ever. A trial counts as abandoned where the folder of its search is here and held by no
    process. Returns a line for each."""
    import optuna
    from optuna.trial import TrialState

    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    except Exception:  # no such study yet (KeyError), or a database gone out of reach: the sweeper says so
        return []
    failed = []
    for trial in running:
        search = trial.user_attrs.get(SEARCH_OF_TRIAL)
        if not isinstance(search, str) or not Path(search).is_dir() or RunFolder(search).held_by():
            continue  # another process's search under way, or one this machine cannot see
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except Exception:  # ended meanwhile by another search that found it so
            continue
        failed.append(
            f"trial {trial.number} of the study {study_name} was left running by a search that was killed "
            f"({search}); it is marked failed"
        )
    return failed


def job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), path.name) if path.name.isdigit() else (1 << 30, path.name)


class SweepSummary(Callback):
    """Hydra callback: after each job of a multirun, brings the summary at the sweep root up to date
    (so a sweep stopped part way has one); at the end, logs the table and the best job. In a launch of
    several processes (torchrun, SLURM), the first writes and logs it for all."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Hydra's record of the sweep, multirun.yaml, which the summary reads to know what is swept: its
        basic sweeper writes it, the search's does not (written here for both, the same file)."""
        if process_rank() != 0:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(config, sweep_dir / SWEEP_RECORD)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN and process_rank() == 0:
            summarize(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if process_rank() != 0:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        summary = summarize(sweep_dir)
        if summary is None:
            log.warning("no run of the sweep in %s finished; no summary written", sweep_dir)
            sys.exit(1)  # as a single run that fails: a script's next command does not go on
        log.info("sweep summary: %s", sweep_dir / "summary.csv")
        swept = swept_settings(summary["runs"], sweep_dir)
        described = {  # each job's swept settings, as it ended
            Path(r["run_dir"]).name: " ".join(f"{k}={settings[k]}" for k in swept if k in settings)
            for r in summary["runs"]
            for settings in [overrides_as_dict(r)]
        }
        for r in summary["runs"]:
            settings = described[Path(r["run_dir"]).name] or "(defaults)"
            metrics = ", ".join(f"{m} {r['metrics'][m]:.4f}" for m in METRICS if m in r["metrics"]) or r.get(
                "error", ""
            )
            log.info("  %s  %s  %s", Path(r["run_dir"]).name, settings, metrics)
        if not any(r["finished"] for r in summary["runs"]):
            log.error("no job of the sweep finished (their errors are above and in %s)", sweep_dir / "summary.csv")
            sys.exit(1)
        if summary["best"]:
            best = summary["best"]
            log.info(
                "best: %s (%s), %s %.4f",
                best["run"],
                described[best["run"]] or "defaults",
                OBJECTIVE,
                best[OBJECTIVE],
            )
