"""Paths and settings the tests share."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = Path(os.environ.get("TINYSHAKESPEARE", ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))

# Overrides that make any composed config a tiny, quick CPU run.
TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "tokenizer.vocab_size=300",
    "data.batch_size=8",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=4",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "optim.warmup_steps=2",
    "logger=csv",
    "latest_link=null",
]

# Only the model and tokenizer of TINY, for presets that set the rest themselves.
TINY_MODEL = TINY[:5]


def data_config(cache_dir, **values):
    """A data config as the yaml files give it, with the text source and a private cache."""
    from omegaconf import OmegaConf

    base = dict(
        source="text",
        path=None,
        url="file:///nonexistent/input.txt",
        local_copies=[],
        cache_dir=str(cache_dir),
        val_fraction=0.1,
        batch_size=4,
        num_workers=0,
    )
    return OmegaConf.create({**base, **values})


def bpe_config(vocab_size: int = 300, **values):
    from omegaconf import OmegaConf

    return OmegaConf.create({"kind": "bpe", "vocab_size": vocab_size, "max_train_chars": 10_000_000, **values})
