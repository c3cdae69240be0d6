"""Paths and settings the tests share."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]

# The default data settings (data.cache_dir, data.local_copies), as train.py composes them
SHAKESPEARE_DEFAULTS = OmegaConf.load(ROOT / "configs" / "data" / "shakespeare.yaml")
# The user's own cache ($TINYGPT2_CACHE or ~/.cache/tinygpt2), read when the tests start, before
# conftest.py points TINYGPT2_CACHE at a folder of the session's own
USER_CACHE = Path(SHAKESPEARE_DEFAULTS.cache_dir).expanduser()
# A data.url that fails at once: the tests never download
NO_DOWNLOAD = "file:///nonexistent/input.txt"
PUT_SHAKESPEARE = "put it at ../shared/data/tinyshakespeare.txt beside the checkout, or set TINYSHAKESPEARE=/path/to/it"
NEEDS_SHAKESPEARE = f"needs Tiny Shakespeare: {PUT_SHAKESPEARE}"


@functools.cache
def find_tiny_shakespeare() -> Path | None:
    """Tiny Shakespeare found as `python train.py` run in the checkout finds it (data.sources):
    $TINYSHAKESPEARE in the place of data.path, then the user's cache, then data.local_copies; but
    never downloaded. None when this machine has no copy."""
    if os.environ.get("TINYSHAKESPEARE"):
        return Path(os.environ["TINYSHAKESPEARE"]).expanduser()
    from data.sources import find_shakespeare

    copies = [os.path.normpath(ROOT / Path(copy).expanduser()) for copy in SHAKESPEARE_DEFAULTS.local_copies]
    found = find_shakespeare(str(USER_CACHE), copies, NO_DOWNLOAD)
    return Path(found) if found else None


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
    base = dict(
        source="text",
        path=None,
        url=NO_DOWNLOAD,
        local_copies=[],
        cache_dir=str(cache_dir),
        val_fraction=0.1,
        batch_size=4,
        num_workers=0,
    )
    return OmegaConf.create({**base, **values})


def write_documents(folder: Path, text: str, count: int, chars: int = 25_000) -> Path:
    """folder holding `count` text files, the consecutive `chars`-character parts of text."""
    for i in range(count):
        (folder / f"part{i:02d}.txt").write_text(text[i * chars : (i + 1) * chars], encoding="utf-8")
    return folder


def bpe_config(vocab_size: int = 300, **values):
    return OmegaConf.create({"kind": "bpe", "vocab_size": vocab_size, "max_train_chars": 10_000_000, **values})


def compose_config(*overrides: str):
    """configs/train.yaml composed with these overrides, as Hydra composes it for python train.py."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def run_script(*args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None):
    """A script of the project (train.py, generate.py, ...) run as a user runs it, in a subprocess, in
    the current folder unless told: a test's own temporary folder (conftest.py), so that relative
    paths such as outputs/ and outputs/latest land there, never in the checkout. From another folder
    than the project's, the script is named by its full path."""
    import subprocess
    import sys

    cwd = Path(cwd or Path.cwd())
    script = args[0] if cwd.resolve() == ROOT else str(ROOT / args[0])
    return subprocess.run(
        [sys.executable, script, *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def one_error_line(err: str) -> str:
    """The one `error:` line a refused command prints on stderr, and nothing else (no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def damaged_copy(source: Path, folder: Path, how: str) -> Path:
    """A copy of a checkpoint cut in half, overwritten at its start, emptied, or replaced by text."""
    target = folder / f"{how}.ckpt"
    data = source.read_bytes()
    if how == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif how == "corrupted":
        target.write_bytes(b"\x00garbage" * 16 + data[128:])
    elif how == "empty":
        target.write_bytes(b"")
    else:
        target.write_text("this is not a checkpoint\n")
    return target
