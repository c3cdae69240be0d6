"""Training speed: the real train.py path (Lightning, our data module, every callback) against a bare
PyTorch loop over the same model, data and optimizer, run one after the other in the same run.

    python bench/train.py            # nanoGPT's CPU recipe shape and the baby shape, eager and compiled (~20 min)
    python bench/train.py --quick    # half the steps, no compiled runs

Both sides are timed over the same 20-step windows (ending every 10 steps after a warm-up), train.py
from its own train/tokens_per_sec log. Reports tokens per second (the best window and the median
window over all runs), the ratio train.py / bare loop (target >= 0.97), and model FLOPs utilisation
against a matmul peak measured here.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.datamodule import TextDataModule  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from training.flops import flops_per_token, measure_cpu_peak_flops  # noqa: E402
from training.optim import lr_factor, make_adamw  # noqa: E402

SHAKESPEARE = Path(os.environ.get("TINYSHAKESPEARE", ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
WINDOW = 20  # train.py's tokens_per_sec: the rate over its last 20 steps
EVERY = 10  # ... logged every trainer.log_every_n_steps steps

SHAPES = {
    # nanoGPT's CPU recipe: 4 layers, 4 heads, 128 wide, context 64, batch 12, characters
    "nanogpt-cpu": dict(
        model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64), batch_size=12, tokenizer="char",
        steps=300, warmup=30,
    ),
    # nanoGPT's "baby GPT" shape (6/6/384, context 256), a CPU-sized batch: about a second a step here
    # (steps to steady state: a few at this size, where a step is long)
    "baby": dict(
        model=dict(n_layer=6, n_head=6, n_embd=384, block_size=256), batch_size=8, tokenizer="char",
        steps=100, warmup=10,
    ),
}


def overrides(shape: dict, steps: int, compile_model: bool) -> list[str]:
    m = shape["model"]
    return [
        f"model.n_layer={m['n_layer']}", f"model.n_head={m['n_head']}", f"model.n_embd={m['n_embd']}",
        f"model.block_size={m['block_size']}", "model.dropout=0.0", f"tokenizer={shape['tokenizer']}",
        f"data.path={SHAKESPEARE}", f"data.batch_size={shape['batch_size']}",
        f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=1",
        f"checkpoint.every_n_steps={steps}",
        "optim.lr=2e-3", "optim.warmup_steps=100",  # as the bare loop's
        "logger=csv", "samples.enabled=false", "latest_link=null", f"compile={str(compile_model).lower()}",
    ]


def lightning_rates(shape: dict, steps: int, compile_model: bool) -> list[float]:
    """train.py's tokens/s over each 20-step window after the warm-up, from its own log."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        proc = subprocess.run(
            [sys.executable, "train.py", *overrides(shape, steps, compile_model), f"hydra.run.dir={run}"],
            cwd=ROOT, capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"train.py failed:\n{proc.stderr[-3000:]}")
        rows = list(csv.DictReader(open(run / "metrics.csv")))
    # the row logged at step s (0-based) covers steps s-18 .. s+1 (1-based), timed from the end of step s-19
    return [
        float(r["train/tokens_per_sec"])
        for r in rows
        if r.get("train/tokens_per_sec") and int(r["step"]) + 1 - WINDOW >= shape["warmup"]
    ]


def bare_rates(shape: dict, steps: int, datamodule: TextDataModule, vocab_size: int) -> list[float]:
    """Tokens/s of a plain loop (same model, batches, AdamW groups, schedule and clipping) over the
    same windows as train.py's."""
    torch.manual_seed(1337)
    model = GPT(GPTConfig(**shape["model"], vocab_size=vocab_size, dropout=0.0)).train()
    optimizer = make_adamw(model, 2e-3, 0.1, (0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, 100, steps, 0.1))
    loader = iter(datamodule.train_dataloader())
    tokens = shape["batch_size"] * shape["model"]["block_size"]
    times = [time.perf_counter()]
    for _ in range(steps):
        inputs, targets = next(loader)
        _, loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        times.append(time.perf_counter())
    # times[i]: the end of step i; windows end every EVERY steps, as train.py logs
    ends = range(EVERY, steps + 1, EVERY)
    return [WINDOW * tokens / (times[i] - times[i - WINDOW]) for i in ends if i - WINDOW >= shape["warmup"]]


def data_for(shape: dict, steps: int) -> TextDataModule:
    from omegaconf import OmegaConf
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=overrides(shape, steps, False))
    dm = TextDataModule(cfg.data, cfg.tokenizer, cfg.model.block_size, cfg.seed, steps)
    dm.prepare()
    OmegaConf.resolve(cfg)
    return dm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half the steps; no compiled runs")
    parser.add_argument("--steps", type=int, default=None, help="steps per run for every shape")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3, help="runs of the bare loop and of train.py, alternating")
    args = parser.parse_args()
    peak = measure_cpu_peak_flops()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; fp32 matmul peak measured: {peak / 1e9:.0f} GFLOP/s")
    print(f"tokens/s over {WINDOW}-step windows ending every {EVERY} steps after the warm-up, the same windows on both")
    print(f"sides; the bare loop and train.py alternate, {args.repeats} runs each. best: the fastest window of all runs")
    print("(outside load only ever slows a window); median: of all windows. compiled: one train.py run with")
    print("compile=true (its compile time falls in the warm-up)\n")
    print(f"{'shape':<12} {'steps':>5} {'windows':>7} | {'best: bare':>10} {'train.py':>9} {'ratio':>6} "
          f"| {'median: bare':>12} {'train.py':>9} {'ratio':>6} | {'MFU':>6} | {'compiled':>8} {'vs eager':>8}")
    for name in args.shapes:
        shape = SHAPES[name]
        steps = args.steps or (shape["steps"] // 2 if args.quick else shape["steps"])
        if steps < shape["warmup"] + WINDOW + EVERY - 1:
            raise SystemExit(f"--steps {steps} leaves no {WINDOW}-step window after the {shape['warmup']} warm-up steps "
                             f"of {name}; use --steps {shape['warmup'] + WINDOW + EVERY} or more")
        dm = data_for(shape, steps)
        bare, lit = [], []
        for _ in range(args.repeats):  # interleaved
            bare.append(bare_rates(shape, steps, dm, dm.vocab_size))
            lit.append(lightning_rates(shape, steps, compile_model=False))
        all_bare, all_lit = [r for run in bare for r in run], [r for run in lit for r in run]
        b_best, l_best = max(all_bare), max(all_lit)
        b_med, l_med = statistics.median(all_bare), statistics.median(all_lit)
        mfu = l_best * flops_per_token(GPTConfig(**shape["model"], vocab_size=dm.vocab_size)) / peak
        compiled = ""
        if not args.quick:
            c = max(lightning_rates(shape, steps, compile_model=True))
            compiled = f"{c:>8.0f} {c / l_best:>7.2f}x"
        print(f"{name:<12} {steps:>5} {len(all_lit):>7} | {b_best:>10.0f} {l_best:>9.0f} {l_best / b_best:>6.3f} "
              f"| {b_med:>12.0f} {l_med:>9.0f} {l_med / b_med:>6.3f} | {mfu:>6.1%} | {compiled}", flush=True)
        for side, runs in (("bare loop", bare), ("train.py", lit)):
            print(f"{'':<12} {side} runs, median window: " + "  ".join(f"{statistics.median(r):.0f}" for r in runs))
    print("\ntarget: train.py / bare loop >= 0.97 (what Lightning and the data module add costs at most 3%)")


if __name__ == "__main__":
    main()
