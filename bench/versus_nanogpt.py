"""Whole process against nanoGPT: `python train.py experiment=shakespeare_char_cpu` beside nanoGPT's own
`train.py` with the CPU command of its README, the same recipe (4 layers, 4 heads, 128 wide, context 64,
batch 12, characters, 2000 steps, lr 1e-3 with 100 warmup steps decaying to 1e-4), on the same text,
taking turns, each timed from start to exit.

    git clone https://github.com/karpathy/nanoGPT /path/to/nanoGPT
    python bench/versus_nanogpt.py --nanogpt /path/to/nanoGPT --repeats 3

nanoGPT's data is written here from the same Tiny Shakespeare file its `prepare.py` downloads: the
characters sorted into its vocabulary, the first 90% for training, as uint16 ids (its
`data/shakespeare_char/` layout), in a scratch copy of its checkout; nanoGPT's tree is not changed.
Our token cache is made first by a one-step run, untimed, as nanoGPT's separate `prepare.py` step
makes its files before its training. Neither run writes a tracker's files: ours logs to CSV,
nanoGPT to its console, as its CPU command does.

The ratio is nanoGPT's time over ours: above 1, ours takes less time. Both estimate the validation loss
from 20 batches every 250 steps (`--eval_iters=20`; the recipe's `trainer.limit_val_batches=20`):
nanoGPT from 20 random batches, and 20 of the training split besides; ours from the first 20 of the
split. Ours also writes checkpoints and text samples as a user's run does, nanoGPT its checkpoints.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

# nanoGPT's README, "I only have a macbook": its CPU command for the character-level Shakespeare recipe.
NANOGPT_CPU = (
    "config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 "
    "--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 "
    "--lr_decay_iters=2000 --dropout=0.0"
).split()
OURS = ["experiment=shakespeare_char_cpu", "logger=csv", "latest_link=null"]


def nanogpt_copy(checkout: Path, text: Path, into: Path) -> Path:
    """A scratch copy of nanoGPT's code with data/shakespeare_char/{train,val}.bin and meta.pkl made
    from `text` as its prepare.py makes them."""
    tree = into / "nanoGPT"
    shutil.copytree(checkout, tree, ignore=shutil.ignore_patterns(".git", "out*", "*.bin", "*.pkl"))
    data = text.read_text(encoding="utf-8")
    chars = sorted(set(data))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in data], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    folder = tree / "data" / "shakespeare_char"
    folder.mkdir(parents=True, exist_ok=True)
    ids[:cut].tofile(folder / "train.bin")
    ids[cut:].tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as out:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": index}, out)
    return tree


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    proc = common.run(command, cwd=cwd, env=env)
    wall = time.perf_counter() - started
    common.refuse_stopped(proc, " ".join(command[1:2]))
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(command[:3])} ... failed in {cwd}:\n{proc.stderr[-3000:]}")
    return wall, proc.stdout + proc.stderr


def run_nanogpt(tree: Path, env: dict[str, str]) -> tuple[float, float]:
    """(seconds, the val loss it printed last)."""
    wall, out = timed([sys.executable, "train.py", *NANOGPT_CPU], tree, env)
    losses = re.findall(r"val loss ([\d.]+)", out)
    return wall, float(losses[-1]) if losses else float("nan")


def run_ours(scratch: Path, n: int, env: dict[str, str], *extra: str) -> tuple[float, float]:
    run = scratch / f"ours-{n}"
    command = [sys.executable, "train.py", *OURS, f"data.path={common.shakespeare()}", f"hydra.run.dir={run}", *extra]
    wall, _ = timed(command, ROOT, env)
    metrics = common.finished_metrics(run, "train.py")
    shutil.rmtree(run)
    return wall, metrics["val/loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of github.com/karpathy/nanoGPT")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, taking turns (default 3)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats must be at least 1, got {args.repeats}")
    if not (args.nanogpt / "train.py").is_file() or not (args.nanogpt / "model.py").is_file():
        raise SystemExit(f"error: --nanogpt {args.nanogpt}: no nanoGPT checkout there (train.py and model.py)")
    common.shakespeare()  # found (or downloaded) before the first run, or said in one line
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        tree = nanogpt_copy(args.nanogpt, common.shakespeare(), scratch)
        env["TINYGPT2_CACHE"] = str(scratch / "cache")  # a cache of this benchmark's own, made next
        print("making our token cache (a one-step run, untimed) ...", flush=True)
        run_ours(scratch, 0, env, "trainer.max_steps=1", "optim.warmup_steps=0")
        print(f"\n{'run':<10} {'nanoGPT s':>10} {'ours s':>8} {'ratio':>7} {'nanoGPT val':>12} {'ours val':>9}")
        ratios = []
        for n in range(1, args.repeats + 1):
            theirs, their_loss = run_nanogpt(tree, env)
            ours, our_loss = run_ours(scratch, n, env)
            ratios.append(theirs / ours)
            print(f"{n:<10} {theirs:>10.1f} {ours:>8.1f} {ratios[-1]:>7.3f} {their_loss:>12.4f} {our_loss:>9.4f}")
        ratios.sort()
        print(f"\nmedian ratio (nanoGPT's time / ours) {ratios[len(ratios) // 2]:.3f}; target >= 1.0")
        print("val loss: nats per character, each from 20 batches (nanoGPT's random, ours the split's first 20)")


if __name__ == "__main__":
    common.run_benchmark(main)
