"""Training speed at 32-bit against bf16 autocast (trainer.precision=bf16-mixed) on this machine's CPU.

    python bench/precision.py                     # the nano default's shape and the baby shape
    python bench/precision.py --shapes baby --steps 40
    python bench/precision.py --widths 64 96 128 192   # the default's layers, context and batch at these widths

Two copies of a model of each shape, one trained in float32 and one under bfloat16 autocast, take turns
a step at a time on the same batches of random tokens, so both see the same moments of a shared machine;
the ratio of their summed step times (after a warm-up) is the figure. A CPU with AMX tiles (Intel
Xeon from Sapphire Rapids on: the `amx_bf16` flag) multiplies bfloat16 matrices in them, one with
AVX-512 BF16 (`avx512_bf16`: AMD EPYC from Zen 4 on) in dot-product instructions; one without either
converts to and from bfloat16 around float32 arithmetic, and autocast only costs. `--widths` finds the
width from which a CPU's bf16 pays. train.py decides for its own run the same way, in short: on a CPU
with bfloat16 instructions it times a few steps of the run's shape in each precision the first time it
sees the processor and shape (shell/machine.py), and trains in the faster.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from shell.machine import cpu_flags  # noqa: E402
from training.optim import make_adamw  # noqa: E402

SHAPES = {  # (layers, heads, width, context, batch)
    "nano": (4, 6, 192, 32, 32),  # python train.py's model and batch
    "baby": (6, 6, 384, 256, 8),  # experiment=shakespeare_baby's model, a CPU-sized batch
}
VOCAB = 1024


class Trainee:
    """A model, its AdamW and the step, in float32 or under bfloat16 autocast."""

    def __init__(self, shape: tuple[int, ...], bf16: bool):
        n_layer, n_head, n_embd, block_size, _ = shape
        torch.manual_seed(0)
        config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=VOCAB)
        self.model = GPT(config).train()
        self.optimizer = make_adamw(self.model, 1e-3, 0.1, (0.9, 0.99))
        self.bf16 = bf16
        self.seconds: list[float] = []
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            _, loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.seconds.append(time.perf_counter() - start)
        self.losses.append(loss.item())


def measure(shape: tuple[int, ...], steps: int, warmup: int) -> dict:
    *_, block_size, batch = shape
    fp32, bf16 = Trainee(shape, bf16=False), Trainee(shape, bf16=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(warmup + steps):
        tokens = torch.randint(0, VOCAB, (batch, block_size + 1), generator=generator)
        for trainee in (fp32, bf16):
            trainee.step(tokens[:, :-1], tokens[:, 1:])
    tokens = batch * block_size * steps
    return {
        "fp32": tokens / sum(fp32.seconds[warmup:]),
        "bf16": tokens / sum(bf16.seconds[warmup:]),
        "loss_gap": abs(fp32.losses[-1] - bf16.losses[-1]),  # the two learn the same (random) data alike
    }


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def width(text: str) -> int:
    value = positive(text)
    if value % 32:
        raise argparse.ArgumentTypeError(f"must be a multiple of 32 (heads of 32), got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument(
        "--widths", nargs="+", type=width, help="instead of --shapes: the nano shape at these widths (heads of 32)"
    )
    parser.add_argument("--steps", type=positive, default=30, help="measured steps per shape (default 30)")
    parser.add_argument("--warmup", type=positive, default=5, help="steps before measuring (default 5)")
    args = parser.parse_args()
    flags = cpu_flags()
    amx = "amx_bf16" in flags
    native = "avx512_bf16" in flags
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; AMX bf16: {'yes' if amx else 'no'}, "
        f"AVX-512 bf16: {'yes' if native else 'no'}"
    )
    print("| shape | fp32 | bf16 autocast | bf16 / fp32 | last-loss gap |")
    print("|---|---|---|---|---|")
    n_layer, _, _, block_size, batch = SHAPES["nano"]
    shapes = (
        {f"{w} wide": (n_layer, w // 32, w, block_size, batch) for w in args.widths}
        if args.widths
        else {name: SHAPES[name] for name in args.shapes}
    )
    for name, shape in shapes.items():
        result = measure(shape, args.steps, args.warmup)
        label = "{}: {}/{}/{}, context {}, batch {}".format(name, *shape)
        print(
            f"| {label} | {result['fp32']:,.0f} tok/s | {result['bf16']:,.0f} tok/s | "
            f"{result['bf16'] / result['fp32']:.2f} | {result['loss_gap']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    common.run_benchmark(main)
