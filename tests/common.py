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
