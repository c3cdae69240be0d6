"""How much of its context a trained model uses: its mean validation loss at each position of the
window, and its bits per character when every token is scored with at least half a window before it.

    python bench/context_use.py                          # the newest run (outputs/latest)
    python bench/context_use.py --ckpt outputs/2026-11-28/05-08-57
    python bench/context_use.py --stride 8               # score the last 8 positions of windows 8 tokens apart

Validation during training cuts the validation split into windows of block_size tokens that do not
overlap, so the first token of each is predicted from nothing and the last from block_size - 1 tokens;
val/bpc is the mean over all of them. This script reads the run's own prepared validation tokens (the
token cache), scores the same windows position by position, then windows `stride` tokens apart of which
only the last `stride` positions count: each token once (but for the split's first block_size -
stride and its last few), with at least block_size - stride tokens before it. Where the loss stops
falling with the position, more context gives the model nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from checkpoint import CheckpointError, first_line, given_or_newest, load_checkpoint  # noqa: E402
from data.errors import DataError  # noqa: E402
from data.prepare import tokens_per_char  # noqa: E402
from shell.settings import prepare  # noqa: E402

BATCH = 256  # windows scored at once


def window_losses(model, ids: torch.Tensor, starts: list[int], size: int) -> torch.Tensor:
    """(windows, size) cross-entropy of each target of the windows of `size` tokens at `starts`."""
    rows = []
    with torch.inference_mode():
        for i in range(0, len(starts), BATCH):
            windows = torch.stack([ids[s : s + size + 1] for s in starts[i : i + BATCH]])
            logits, _ = model(windows[:, :-1])
            rows.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none"))
    return torch.cat(rows)


def spans(size: int) -> list[tuple[int, int]]:
    """Positions grouped for the table: 0, 1, 2, 3, then 4-7, 8-15, ... up to size - 1."""
    out, start = [], 0
    while start < size:
        end = start if start < 4 else min(size - 1, 2 * start - 1)
        out.append((start, end))
        start = end + 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", help="a run folder or .ckpt file of a training run (default: outputs/latest)")
    parser.add_argument("--stride", type=int, help="tokens between scored windows (default: half the context)")
    args = parser.parse_args()
    try:
        loaded = load_checkpoint(given_or_newest(args.ckpt))
        if not loaded.config:
            raise CheckpointError(f"{loaded.path} carries no run settings: it names no validation split to score")
        size = loaded.model.config.block_size
        stride = max(1, size // 2) if args.stride is None else args.stride
        if not 1 <= stride <= size:  # refused before the data is prepared, which may write a cache entry
            raise SystemExit(f"error: --stride must be between 1 and the context, {size} tokens; got {stride}")
        cache = prepare(loaded.config, loaded.tokenizer)
    except (CheckpointError, DataError, OSError) as err:
        raise SystemExit(f"error: {first_line(err)}") from None
    ids = torch.from_numpy(cache.ids("val").astype("int64"))
    if len(ids) <= size:
        raise SystemExit(f"error: the validation split has {len(ids)} tokens, not more than one window of {size}")
    bits = tokens_per_char(cache) / math.log(2)  # nats per token -> bits per character

    whole = window_losses(loaded.model, ids, list(range(0, (len(ids) - 1) // size * size, size)), size)
    print(f"{loaded.path}: context {size} tokens, {whole.numel():,} validation tokens")
    print(f"{'position':>10}  {'val loss':>8}  {'bpc':>6}")
    for first, last in spans(size):
        nats = whole[:, first : last + 1].mean().item()
        label = str(first) if first == last else f"{first}-{last}"
        print(f"{label:>10}  {nats:8.4f}  {nats * bits:6.3f}")
    print(f"{'all':>10}  {whole.mean().item():8.4f}  {whole.mean().item() * bits:6.3f}   (as validation scores)")
    strided = window_losses(loaded.model, ids, list(range(0, len(ids) - size, stride)), size)[:, size - stride :]
    print(
        f"every token after {size - stride}+ tokens of context (stride {stride}): "
        f"val loss {strided.mean().item():.4f}, {strided.mean().item() * bits:.3f} bpc"
    )


if __name__ == "__main__":
    common.run_benchmark(main)
