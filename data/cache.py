"""Token ids on disk: a corpus is tokenized once, then every later run memory-maps the result.

An entry is a folder under <cache_dir>/tokens named by a fingerprint of the source (what identifies
its text: files' paths, sizes and modification times, or a dataset's name and revision) and of the
tokenizer settings:

    tokens/<key>/tokenizer.json   the tokenizer
                 train.bin        token ids, flat (uint16 when the vocabulary fits, else uint32)
                 val.bin
                 meta.json        counts, dtype, source

An entry is built in tokens/<key>.partial/ and renamed into place when complete, so a folder with the
entry's name is always whole. A preparation that stops part way leaves the .partial folder, with its
finished shards, for the next run to go on from. One process at a time builds an entry (a file lock);
others wait for it and then read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock, Timeout

from .errors import DataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2


def fingerprint(source: dict[str, Any], tokenizer: dict[str, Any]) -> str:
    spec = {"format": FORMAT_VERSION, "source": source, "tokenizer": tokenizer}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:20]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclass
class TokenCache:
    folder: Path
    meta: dict[str, Any]
    made_now: bool = False  # built by this process, rather than found

    @property
    def key(self) -> str:
        return self.folder.name

    @property
    def tokenizer_json(self) -> str:
        return (self.folder / "tokenizer.json").read_text(encoding="utf-8")

    def ids(self, split: str) -> np.ndarray:
        if self.meta[f"{split}_tokens"] == 0:  # a zero-length file cannot be memory-mapped
            return np.zeros(0, dtype=np.dtype(self.meta["dtype"]))
        return np.memmap(self.folder / f"{split}.bin", dtype=np.dtype(self.meta["dtype"]), mode="r")


def open_cache(folder: Path) -> TokenCache | None:
    meta_file = folder / "meta.json"
    if not meta_file.is_file():
        return None
    return TokenCache(folder, json.loads(meta_file.read_text()))


def find_cache(root: str | os.PathLike, key: str) -> TokenCache | None:
    return open_cache(Path(root).expanduser() / "tokens" / key)


def write_json(path: Path, value: Any) -> None:
    """Whole or not at all: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def build_cache(root: str | os.PathLike, key: str, build: Callable[[Path], dict[str, Any]]) -> TokenCache:
    """The entry for key, built by `build(staging)` unless it exists (or another process builds it meanwhile).

    build fills the staging folder with tokenizer.json, train.bin and val.bin and returns the meta.
    A DataError means the input cannot work: the staging folder goes, so nothing half-made is left.
    Any other stop (a crash, Ctrl-C, a kill) keeps it, for the next run to resume.
    """
    tokens = Path(root).expanduser() / "tokens"
    entry, staging = tokens / key, tokens / f"{key}.partial"
    (tokens / ".locks").mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(tokens / ".locks" / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is preparing these tokens; waiting for it (%s)", staging)
        lock.acquire()
    try:
        if (done := open_cache(entry)) is not None:
            return done
        staging.mkdir(exist_ok=True)
        if not (staging / "meta.json").is_file():
            try:
                meta = build(staging)
            except DataError:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            write_json(staging / "meta.json", meta)
        for leftover in staging.iterdir():  # work files of the build; the entry keeps only its own
            if leftover.name not in ("tokenizer.json", "train.bin", "val.bin", "meta.json"):
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        if entry.exists():  # left by something other than this code; never whole, or open_cache would say so
            shutil.rmtree(entry)
        staging.rename(entry)
    finally:
        lock.release()
    made = open_cache(entry)
    made.made_now = True
    return made


def discard(cache: TokenCache) -> None:
    """Remove an entry this process made for a run that was then refused (under the entry's lock)."""
    tokens = cache.folder.parent
    with FileLock(str(tokens / ".locks" / f"{cache.key}.lock")):
        shutil.rmtree(cache.folder, ignore_errors=True)
