"""Training speed: the real train.py path (Lightning, our data module, every callback) against a bare
PyTorch loop over the same model, data and optimizer, run one after the other in the same run.

    python bench/train.py            # nanoGPT's CPU recipe shape and the baby shape, eager and compiled (~12 min)
    python bench/train.py --quick    # half the steps, no compiled runs

Reports steady-state tokens per second (the median over the steps after a warm-up), their ratio
(target >= 0.97), and model FLOPs utilisation against a matmul peak measured here.
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
WARMUP = 30  # steps left out of the steady state
WINDOW = 20  # train.py's tokens_per_sec: the rate over its last 20 steps

SHAPES = {
    # nanoGPT's CPU recipe: 4 layers, 4 heads, 128 wide, context 64, batch 12, characters
    "nanogpt-cpu": dict(
        model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64), batch_size=12, tokenizer="char", steps=300
    ),
    # nanoGPT's "baby GPT" shape (6/6/384, context 256), a CPU-sized batch: about a second a step here
    "baby": dict(model=dict(n_layer=6, n_head=6, n_embd=384, block_size=256), batch_size=8, tokenizer="char", steps=100),
}


def overrides(shape: dict, steps: int, compile_model: bool) -> list[str]:
    m = shape["model"]
    return [
        f"model.n_layer={m['n_layer']}", f"model.n_head={m['n_head']}", f"model.n_embd={m['n_embd']}",
        f"model.block_size={m['block_size']}", "model.dropout=0.0", f"tokenizer={shape['tokenizer']}",
        f"data.path={SHAKESPEARE}", f"data.batch_size={shape['batch_size']}",
        f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false", f"checkpoint.every_n_steps={steps}",
        "optim.lr=2e-3", "optim.warmup_steps=100",  # as the bare loop's
        "logger=csv", "samples.enabled=false", "latest_link=null", f"compile={str(compile_model).lower()}",
    ]


def lightning_rate(shape: dict, steps: int, compile_model: bool) -> float:
    """Median tokens/s of train.py, from its own per-step log, after the warm-up steps."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        proc = subprocess.run(
            [sys.executable, "train.py", *overrides(shape, steps, compile_model), f"hydra.run.dir={run}"],
            cwd=ROOT, capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"train.py failed:\n{proc.stderr[-3000:]}")
        rows = list(csv.DictReader(open(run / "metrics.csv")))
    # each logged rate covers the 20 steps before it: count those that start after the warm-up, as below
    rates = [
        float(r["train/tokens_per_sec"])
        for r in rows
        if r.get("train/tokens_per_sec") and int(r["step"]) >= WARMUP + WINDOW - 1
    ]
    return statistics.median(rates)


def bare_rate(shape: dict, steps: int, datamodule: TextDataModule, vocab_size: int) -> float:
    """Median tokens/s of a plain loop: same model, batches, AdamW groups, schedule and clipping."""
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
    rates = [WINDOW * tokens / (times[i] - times[i - WINDOW]) for i in range(WARMUP + WINDOW, len(times))]
    return statistics.median(rates)


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
    parser.add_argument("--repeats", type=int, default=2, help="runs of the bare loop and of train.py, alternating")
    args = parser.parse_args()
    repeats = args.repeats
    peak = measure_cpu_peak_flops()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; fp32 matmul peak measured: {peak / 1e9:.0f} GFLOP/s")
    print(f"median tokens/s after {WARMUP} warm-up steps; bare loop and train.py alternate, {repeats} runs each;")
    print("compiled: one train.py run with compile=true (its compile time is in the warm-up, not in the rate)\n")
    print(f"{'shape':<12} {'steps':>5} {'bare loop':>10} {'train.py':>10} {'ratio':>6} {'MFU':>6} {'compiled':>9} {'vs eager':>8}")
    for name in args.shapes:
        shape = SHAPES[name]
        steps = args.steps or (shape["steps"] // 2 if args.quick else shape["steps"])
        dm = data_for(shape, steps)
        bare, lit = [], []
        for _ in range(repeats):  # interleaved
            bare.append(bare_rate(shape, steps, dm, dm.vocab_size))
            lit.append(lightning_rate(shape, steps, compile_model=False))
        b, l = statistics.median(bare), statistics.median(lit)
        config = GPTConfig(**shape["model"], vocab_size=dm.vocab_size)
        mfu = l * flops_per_token(config) / peak
        compiled = ""
        if not args.quick:
            c = lightning_rate(shape, steps, compile_model=True)
            compiled = f"{c:>9.0f} {c / l:>7.2f}x"
        print(f"{name:<12} {steps:>5} {b:>10.0f} {l:>10.0f} {l / b:>6.3f} {mfu:>6.1%} {compiled}", flush=True)
    print("\ntarget: train.py / bare loop >= 0.97 (what Lightning and the data module add costs at most 3%)")


if __name__ == "__main__":
    main()
