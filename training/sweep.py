"""Sweeps (`python train.py -m optim.lr=1e-3,3e-3`): one folder per run, a summary at the root.

Each run writes `result.json` (its overrides, resolved config and final metrics) into its own folder;
when the sweep ends, `SweepSummary` gathers them into `summary.csv` and `summary.json` beside them.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
METRICS = ("val/loss", "val/bpc", "val/perplexity", "train/loss")


def write_result(run_dir: Path, overrides: list[str], config: dict[str, Any], metrics: dict[str, float]) -> None:
    result = {"run_dir": str(run_dir), "overrides": overrides, "metrics": metrics, "config": config}
    (Path(run_dir) / RESULT_FILE).write_text(json.dumps(result, indent=2))


def summarize(sweep_dir: Path) -> list[dict[str, Any]]:
    """Collect every run's result under sweep_dir into summary.json and summary.csv; returns the rows."""
    results = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob(f"*/{RESULT_FILE}"), key=run_order)]
    if not results:
        return []
    (sweep_dir / "summary.json").write_text(json.dumps(results, indent=2))
    swept = swept_settings(results)
    metric_names = [m for m in METRICS if any(m in r["metrics"] for r in results)]
    with open(sweep_dir / "summary.csv", "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["run", *swept, *metric_names])
        for r in results:
            settings = overrides_as_dict(r)
            writer.writerow(
                [Path(r["run_dir"]).name, *(settings.get(k, "") for k in swept), *(r["metrics"].get(m, "") for m in metric_names)]
            )
    return results


def overrides_as_dict(result: dict[str, Any]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in result["overrides"] if "=" in o)


def swept_settings(results: list[dict[str, Any]]) -> list[str]:
    """The override keys whose values differ between runs (what the sweep varied)."""
    per_run = [overrides_as_dict(r) for r in results]
    keys = dict.fromkeys(k for settings in per_run for k in settings)
    return [k for k in keys if len({settings.get(k) for settings in per_run}) > 1]


def run_order(path: Path) -> tuple[int, str]:
    name = path.parent.name
    return (int(name), name) if name.isdigit() else (1 << 30, name)


class SweepSummary(Callback):
    """Hydra callback: after a multirun, writes the summary at the sweep root and logs a table."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = summarize(sweep_dir)
        if not results:
            log.warning("no run of the sweep in %s finished; no summary written", sweep_dir)
            return
        log.info("sweep summary: %s", sweep_dir / "summary.csv")
        swept = swept_settings(results)
        for r in results:
            settings = " ".join(o for o in r["overrides"] if o.partition("=")[0] in swept) or "(defaults)"
            metrics = ", ".join(f"{m} {r['metrics'][m]:.4f}" for m in METRICS if m in r["metrics"])
            log.info("  %s  %s  %s", Path(r["run_dir"]).name, settings, metrics)
