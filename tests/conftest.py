"""Shared test setup: the real Tiny Shakespeare beside the checkout, tiny models, private caches."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# datasets reads its cache location when first imported, so it is set before any test imports it
_HF_CACHE = tempfile.mkdtemp(prefix="tinygpt2-tests-hf-")
atexit.register(shutil.rmtree, _HF_CACHE, ignore_errors=True)
os.environ["HF_DATASETS_CACHE"] = _HF_CACHE

from .common import SHAKESPEARE
from .tiny import tiny_gpt, tiny_run, tiny_text, tiny_tokenizer, transformers_folder  # noqa: F401  (shared fixtures)


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.fail(f"Tiny Shakespeare not found at {SHAKESPEARE}; set TINYSHAKESPEARE=/path/to/tinyshakespeare.txt")
    return SHAKESPEARE


@pytest.fixture(scope="session")
def small_text(tmp_path_factory, shakespeare) -> Path:
    """The first 60,000 characters of Tiny Shakespeare: real text, quick to tokenize."""
    path = tmp_path_factory.mktemp("text") / "shakespeare_head.txt"
    path.write_text(shakespeare.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def private_caches(tmp_path_factory, monkeypatch):
    """Token cache and wandb inside the test session's temporary folder, never in the user's home."""
    cache = tmp_path_factory.getbasetemp() / "cache"
    monkeypatch.setenv("TINYGPT2_CACHE", str(cache / "tinygpt2"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
