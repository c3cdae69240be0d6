"""Training speed: train.py's path (Lightning, our data module, every callback) against a bare PyTorch
loop over the same model, data and optimizer, the two taking turns step by step in one process.

    python bench/train.py            # nanoGPT's CPU recipe shape and the baby shape, eager and compiled (12-15 min)
    python bench/train.py --quick    # fewer steps, one run per shape, no compiled runs

The run is `python train.py` with those command-line overrides, run in this process as the script runs
it (its command line read, Hydra, the settings checked, the data prepared, Lightning's fit, the report).
One more callback, the last, runs a step of the bare loop after each of train.py's steps, so the two
see the machine in the same state: on a shared machine the speed moves by 10-20% from minute to
minute, far more than the 3% this measures, and runs taken one after the other compare that noise.
train.py's step time is everything between two bare steps.

Reports tokens per second of each over the steps after a warm-up, their ratio (target >= 0.97),
model FLOPs utilisation against the CPU peak train.py's train/mfu uses (the fastest rate seen on this
machine, at the run's precision: shell.machine.device_peak_flops), and compile=true against eager.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import training.fit  # noqa: E402
from bench import common  # noqa: E402
from data.datamodule import TextDataModule  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from shell.machine import device_peak_flops  # noqa: E402
from training.optim import lr_factor, make_adamw  # noqa: E402

SHAPES = {
    # nanoGPT's CPU recipe: 4 layers, 4 heads, 128 wide, context 64, batch 12, characters
    "nanogpt-cpu": dict(
        model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
        batch_size=12,
        tokenizer="char",
        steps=300,
        warmup=30,
    ),
    # nanoGPT's "baby GPT" shape (6/6/384, context 256), a CPU-sized batch: about a second a step
    # here, so few steps, and few to reach the steady state
    "baby": dict(
        model=dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
        batch_size=8,
        tokenizer="char",
        steps=60,
        warmup=10,
    ),
}


def overrides(shape: dict, steps: int, compile_model: bool) -> list[str]:
    """train.py's command line for the shape: no dropout (the bare loop has none), one validation batch
    and one checkpoint at the end, the CSV logger, the progress bar on as a user has it."""
    m = shape["model"]
    return [
        f"model.n_layer={m['n_layer']}",
        f"model.n_head={m['n_head']}",
        f"model.n_embd={m['n_embd']}",
        f"model.block_size={m['block_size']}",
        "model.dropout=0.0",
        f"tokenizer={shape['tokenizer']}",
        f"data.path={common.shakespeare()}",
        f"data.batch_size={shape['batch_size']}",
        f"trainer.max_steps={steps}",
        f"optim.warmup_steps={min(10, steps - 1)}",  # the learning rate's; below any number of steps measured
        f"trainer.val_check_interval={steps}",
        "trainer.limit_val_batches=1",
        f"checkpoint.every_n_steps={steps}",
        "logger=csv",
        "samples.enabled=false",
        "latest_link=null",
        f"compile={str(compile_model).lower()}",
    ]


def compose_config(shape: dict, steps: int, compile_model: bool):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=overrides(shape, steps, compile_model))


class BareLoop(L.Callback):
    """A plain PyTorch training loop over the same model shape, batches, AdamW parameter groups,
    schedule and clipping as the run's, one step of it after each of the run's steps.

    bare_seconds[k] is its k-th step; run_seconds[k] is the time from the end of its (k-1)-th step to
    the start of its k-th: one step of the run with everything Lightning and the callbacks do around it.
    """

    def __init__(self, cfg, datamodule: TextDataModule):
        torch.manual_seed(cfg.seed)
        self.model = GPT(GPTConfig(**{**cfg.model, "vocab_size": datamodule.vocab_size})).train()
        o, steps = cfg.optim, cfg.trainer.max_steps
        self.optimizer = make_adamw(self.model, o.lr, o.weight_decay, tuple(o.betas))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, o.warmup_steps, steps, o.min_lr_ratio, o.schedule)
        )
        self.clip = cfg.trainer.gradient_clip_val
        self.batches = iter(datamodule.train_dataloader())
        self.bare_seconds: list[float] = []
        self.run_seconds: list[float] = []
        self.ended: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        start = time.perf_counter()
        if self.ended is not None:
            self.run_seconds.append(start - self.ended)
        inputs, targets = next(self.batches)
        _, loss = self.model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        self.ended = time.perf_counter()
        self.bare_seconds.append(self.ended - start)


def train_py(args: list[str], last_callback: L.Callback) -> None:
    """`python train.py ARGS` in this process, as train.py runs it (shell.command_line.run around its Hydra
    entry point), with one more callback after the run's own. A Ctrl-C or SIGTERM in the training loop stops
    the run with its checkpoint (exit 130 or 143), and the benchmark with it; a refused run ends it too."""
    import train
    from shell import command_line

    fit = training.fit.fit

    def fit_with_it(settings, folder, start=None, extras=None):
        extras = extras or training.fit.Extras()
        extras.callbacks.append(last_callback)
        return fit(settings, folder, start, extras)

    argv, handlers = sys.argv, {signum: signal.getsignal(signum) for signum in common.STOPS}
    training.fit.fit, sys.argv = fit_with_it, ["train.py", *args]
    try:
        command_line.run(train.main)
    except SystemExit as ended:
        if ended.code == 128 + signal.SIGTERM:
            raise common.Terminated from None
        if ended.code == 128 + signal.SIGINT:
            raise KeyboardInterrupt from None
        if ended.code not in (None, 0):
            raise
    finally:
        training.fit.fit, sys.argv = fit, argv
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def measure(shape: dict, steps: int, compile_model: bool) -> tuple[float, float, GPTConfig, float]:
    """Tokens/s of the run and of the bare loop over the steps after the warm-up, the model's shape, and the
    CPU peak FLOP/s the run's train/mfu was measured against (at its precision)."""
    cfg = compose_config(shape, steps, compile_model)
    datamodule = TextDataModule(cfg.data, cfg.tokenizer, cfg.model.block_size, cfg.seed, steps)
    datamodule.prepare()  # (cached: the run reads the same tokens)
    bare = BareLoop(cfg, datamodule)
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "output.txt", "w") as output:
        with contextlib.redirect_stdout(output):  # its log and progress lines go there, as to a log file
            train_py([*overrides(shape, steps, compile_model), f"hydra.run.dir={Path(tmp) / 'run'}"], bare)
        precision = json.loads((Path(tmp) / "run" / "result.json").read_text())["config"]["trainer"]["precision"]
    warmup = shape["warmup"]
    # run step k (k >= 1) is timed between bare steps k-1 and k; pair it with bare step k
    run, bare_steps = bare.run_seconds[warmup:], bare.bare_seconds[warmup + 1 :]
    tokens = shape["batch_size"] * shape["model"]["block_size"]
    peak = device_peak_flops(torch.device("cpu"), precision)
    return tokens * len(run) / sum(run), tokens * len(bare_steps) / sum(bare_steps), bare.model.config, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="two thirds of the steps, one run per shape, no compiled runs"
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per run for every shape")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=None, help="eager runs per shape (default 2, 1 with --quick)")
    args = parser.parse_args()
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit(f"error: --repeats must be at least 1, got {args.repeats}")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
    steps_of = {}
    for name in args.shapes:
        shape = SHAPES[name]
        steps_of[name] = (
            args.steps if args.steps is not None else shape["steps"] * 2 // 3 if args.quick else shape["steps"]
        )
        if steps_of[name] < shape["warmup"] + 10:
            raise SystemExit(
                f"error: --steps {steps_of[name]} leaves fewer than 10 steps after the {shape['warmup']} warm-up steps of "
                f"{name}; use --steps {shape['warmup'] + 10} or more"
            )
    common.shakespeare()  # found (or downloaded) before the first run, or said in one line
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # "GPU available: False", ...
    peak = device_peak_flops(torch.device("cpu"), "32-true")  # train.py's train/mfu peak: the fastest rate seen here
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU peak for MFU (the fastest fp32 rate seen on this machine; a bf16 run's, the fastest bf16 rate): {peak / 1e9:.0f} GFLOP/s"
    )
    print("train.py's steps and the bare loop's alternate one by one in each run; tokens/s over the steps after")
    print("the warm-up. compiled: train.py with compile=true, its bare loop eager as always; vs eager compares")
    print("train.py compiled against train.py eager through the ratios to their bare loops\n")
    print(f"{'shape':<12} {'steps':>5} {'run':>3} {'bare loop':>10} {'train.py':>10} {'ratio':>6} {'MFU':>6}")
    for name in args.shapes:
        shape = SHAPES[name]
        steps = steps_of[name]
        ratios = []
        for run in range(1, repeats + 1):
            ours, bare, config, peak = measure(shape, steps, compile_model=False)
            ratios.append(ours / bare)
            mfu = ours * config.flops_per_token() / peak
            print(
                f"{name:<12} {steps:>5} {run:>3} {bare:>10.0f} {ours:>10.0f} {ours / bare:>6.3f} {mfu:>6.1%}",
                flush=True,
            )
        if not args.quick:
            ours, bare, _, _ = measure(shape, steps, compile_model=True)
            eager = statistics.median(ratios)
            print(
                f"{name:<12} {steps:>5} {'compiled':>14} {ours:>10.0f} {ours / bare:>6.3f}   "
                f"vs eager {ours / bare / eager:.2f}x",
                flush=True,
            )
    print("\ntarget: train.py / bare loop >= 0.97 (what Lightning and the data module add costs at most 3%)")


if __name__ == "__main__":
    common.run_benchmark(main)
