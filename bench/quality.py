"""Quality for time: the validation bits per character a run reaches on a text, in the two budgets the
project promises, beside a peer measured in the same run.

    python bench/quality.py                                   # both budgets, each run once
    python bench/quality.py --budget 75s --repeats 3          # experiment=shakespeare_75s and nanoGPT's CPU recipe, 75 s each
    python bench/quality.py --budget default --repeats 3      # the default `python train.py`, whole process, and the previous default
    python bench/quality.py --budget default --text pydoc     # the same on a second text: Python's help texts
    python bench/quality.py --budget 75s --runs experiment=shakespeare_75s 'experiment=shakespeare_75s model.n_layer=3'

75s: each run is the real `python train.py` with trainer.max_time=75 s (the learning rate decays over
the time budget) and one validation over the whole validation split at the end. default: each run is
`python train.py` as a user runs it (its own length, validations and checkpoints), timed whole
process, start-up included. Targets: <= 2.20 bpc in 75 s (mean of 3); the default run <= 2.12 bpc
within 6 minutes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

# The default run before its vocabulary grew to 1280 tokens (bench/LOG.md, "A tenth round"), written
# out, so that the current default is measured beside it on any text.
PREVIOUS_DEFAULT = (
    "model.n_layer=4 model.n_head=6 model.n_embd=192 model.block_size=32 model.dropout=0.0 tokenizer.vocab_size=1024 "
    "tokenizer.dropout=0.1 tokenizer.dropout_copies=7 data.batch_size=32 optim=adamw optim.lr=1.5e-3 "
    "optim.weight_decay=0.2 optim.warmup_steps=50 optim.min_lr_ratio=0.0 trainer.max_steps=4500 "
    "trainer.val_check_interval=500"
)

BUDGETS = {
    "75s": {
        "experiment=shakespeare_75s": "our best configuration for 75 s (configs/experiment/shakespeare_75s.yaml)",
        "experiment=shakespeare_char_cpu": "nanoGPT's CPU recipe: 4/4/128, context 64, batch 12, characters",
    },
    "default": {
        "default": "python train.py as it is",
        PREVIOUS_DEFAULT: "the previous default",
    },
}
TARGETS = {"75s": "<= 2.20 bpc in 75 s of training (mean of 3)", "default": "<= 2.12 bpc within 360 s whole process"}
# Only where the run reports to and what it shows: neither changes what it learns.
QUIET = ["logger=csv", "trainer.enable_progress_bar=false", "latest_link=null"]


def data_overrides(text: str) -> list[str]:
    return ["data=pydoc"] if text == "pydoc" else [f"data.path={common.shakespeare()}"]


def run(overrides: str, budget: str, text: str, seconds: int) -> dict:
    """Train once; returns the final metrics and the whole process's wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [] if overrides == "default" else overrides.split()
        args += [*data_overrides(text), *QUIET, f"hydra.run.dir={tmp}/run"]
        if budget == "75s":
            stamp = f"00:00:{seconds // 60:02d}:{seconds % 60:02d}"
            args += [
                "trainer.max_steps=-1",
                f"trainer.max_time={stamp}",
                "trainer.val_check_interval=1000000",
                "trainer.limit_val_batches=null",
                "checkpoint.every_n_steps=1000000",
                "samples.enabled=false",
            ]
        started = time.perf_counter()
        proc = common.run([sys.executable, "train.py", *args], cwd=ROOT)
        wall = time.perf_counter() - started
        common.refuse_stopped(proc, f"train.py {overrides}")
        if proc.returncode != 0:
            raise SystemExit(f"error: train.py {overrides} failed:\n{proc.stderr[-3000:]}")
        metrics = common.finished_metrics(Path(tmp) / "run", f"train.py {overrides}")
    return {
        "bpc": metrics["val/bpc"],
        "loss": metrics["val/loss"],
        "tokens": metrics.get("train/tokens_seen", 0),
        "wall": wall,
    }


def label(overrides: str) -> str:
    return "previous default" if overrides == PREVIOUS_DEFAULT else overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget",
        choices=["75s", "default", "both"],
        default="both",
        help="75s: 75 s of training per run; default: the default run, whole process (default: both)",
    )
    parser.add_argument(
        "--text",
        choices=["shakespeare", "pydoc"],
        default="shakespeare",
        help="Tiny Shakespeare (TINYSHAKESPEARE=path, else found as train.py finds it) or Python's help texts",
    )
    parser.add_argument("--seconds", type=int, default=75, help="training time per run of the 75s budget (default 75)")
    parser.add_argument("--runs", nargs="+", default=None, help="override strings, one run each ('default': none)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (the machine's load moves the figures)")
    args = parser.parse_args()
    if args.seconds < 1 or args.repeats < 1:
        raise SystemExit(f"error: --seconds and --repeats must be at least 1, got {args.seconds} and {args.repeats}")
    if args.text == "shakespeare":
        common.shakespeare()  # found (or downloaded) before the first run, or said in one line
    for n, budget in enumerate(["75s", "default"] if args.budget == "both" else [args.budget]):
        runs = args.runs or list(BUDGETS[budget])
        what = f"{args.seconds} s of training per run" if budget == "75s" else "the whole process of each run"
        if n:
            print()
        print(f"{args.text}, budget {budget}: {what}, then the whole validation split")
        print(f"{'run':<60} {'val bpc':>8} {'val loss':>9} {'tokens':>11} {'wall s':>7}")
        for overrides in runs:
            results = []
            for _ in range(args.repeats):
                r = run(overrides, budget, args.text, args.seconds)
                results.append(r)
                print(
                    f"{label(overrides)[:60]:<60} {r['bpc']:>8.3f} {r['loss']:>9.3f} {r['tokens']:>11,.0f} {r['wall']:>7.0f}",
                    flush=True,
                )
            if args.repeats > 1:
                mean = {key: sum(r[key] for r in results) / len(results) for key in results[0]}
                spread = max(r["bpc"] for r in results) - min(r["bpc"] for r in results)
                row = f"  mean of {args.repeats} (bpc spread {spread:.3f})"
                print(
                    f"{row:<60} {mean['bpc']:>8.3f} {mean['loss']:>9.3f} {mean['tokens']:>11,.0f} {mean['wall']:>7.0f}"
                )
        if args.text == "shakespeare":
            print(f"target: {TARGETS[budget]}")
    print("\nval loss is in nats per token of each run's own tokenizer; bpc compares across them")


if __name__ == "__main__":
    common.run_benchmark(main)
