"""Quality for time: the validation bits per character a run reaches on Tiny Shakespeare in a fixed
budget of wall time, ours beside nanoGPT's CPU recipe, in the same run.

    python bench/quality.py                       # experiment=shakespeare_75s and nanoGPT's recipe, 75 s each
    python bench/quality.py --repeats 3           # each three times, and the mean
    python bench/quality.py --seconds 300 --runs default     # the default `python train.py`, 5 minutes
    python bench/quality.py --runs experiment=shakespeare_75s 'model.n_embd=192 optim.lr=3e-3'

Each run is the real `python train.py` with trainer.max_time set (the learning rate decays over the
time budget) and a validation over the whole validation split at the end. Target: <= 2.35 bpc in 75 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = Path(os.environ.get("TINYSHAKESPEARE", ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))

RUNS = {
    "experiment=shakespeare_75s": "our best configuration for 75 s (configs/experiment/shakespeare_75s.yaml)",
    "experiment=shakespeare_char_cpu": "nanoGPT's CPU recipe: 4/4/128, context 64, batch 12, characters",
}


def run(overrides: str, seconds: int) -> dict:
    """Train with these overrides for `seconds` of training time; returns the final metrics."""
    stamp = f"00:00:{seconds // 60:02d}:{seconds % 60:02d}"
    with tempfile.TemporaryDirectory() as tmp:
        args = [] if overrides == "default" else overrides.split()
        args += [
            f"data.path={SHAKESPEARE}", "trainer.max_steps=-1", f"trainer.max_time={stamp}",
            "trainer.val_check_interval=1000000", "trainer.limit_val_batches=null", "checkpoint.every_n_steps=1000000",
            "logger=csv", "trainer.enable_progress_bar=false", "latest_link=null", f"hydra.run.dir={tmp}/run",
        ]
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"train.py {overrides} failed:\n{proc.stderr[-3000:]}")
        result = json.loads((Path(tmp) / "run" / "result.json").read_text())
    metrics = result["metrics"]
    return {"bpc": metrics["val/bpc"], "loss": metrics["val/loss"], "tokens": metrics.get("train/tokens_seen", 0), "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=75, help="training time budget per run (default 75)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help="override strings, one run each ('default': none)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (the machine's load moves the figures)")
    args = parser.parse_args()
    print(f"Tiny Shakespeare, {args.seconds} s of training per run (trainer.max_time), then the whole validation split\n")
    print(f"{'run':<60} {'val bpc':>8} {'val loss':>9} {'tokens':>10} {'wall s':>7}")
    for overrides in args.runs:
        results = []
        for _ in range(args.repeats):
            r = run(overrides, args.seconds)
            results.append(r)
            print(f"{overrides:<60} {r['bpc']:>8.3f} {r['loss']:>9.3f} {r['tokens']:>10,.0f} {r['wall']:>7.0f}", flush=True)
        if args.repeats > 1:
            mean = {key: sum(r[key] for r in results) / len(results) for key in results[0]}
            label = f"  mean of {args.repeats}"
            print(f"{label:<60} {mean['bpc']:>8.3f} {mean['loss']:>9.3f} {mean['tokens']:>10,.0f} {mean['wall']:>7.0f}")
    print("\ntarget: <= 2.35 bpc in 75 s. val loss is in nats per token of each run's own tokenizer; bpc compares across them")


if __name__ == "__main__":
    main()
