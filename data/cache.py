"""Token ids on disk: tokenize a corpus once, then every later run memory-maps the result.

A cache entry is a folder named by a fingerprint of the text and the tokenizer settings:

    tokens/<fingerprint>/tokenizer.json   the trained tokenizer
                         train.bin        token ids, flat (uint16 when the vocabulary fits, else uint32)
                         val.bin
                         meta.json        counts and dtype; written last

An entry is built in a temporary folder and renamed into place when complete, so a folder with that
name is always whole; a run killed while tokenizing leaves only a temporary folder behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

FORMAT_VERSION = 1
ENCODE_BATCH = 64  # documents per encode_batch call


def fingerprint(texts: dict[str, list[str]], settings: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **settings}, sort_keys=True).encode())
    for split in sorted(texts):
        digest.update(split.encode())
        for doc in texts[split]:
            digest.update(hashlib.sha256(doc.encode("utf-8", "surrogatepass")).digest())
    return digest.hexdigest()[:20]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_tokens(path: Path, tokenizer: Tokenizer, documents: list[str], dtype: np.dtype, separator: int | None) -> int:
    """Encode documents in batches and append their ids to path as they come; returns the count.

    Documents are joined by the separator token (end of text), so no window mistakes the end of one
    for the middle of another.
    """
    count = 0
    with open(path, "wb") as out:
        for start in range(0, len(documents), ENCODE_BATCH):
            encodings = tokenizer.encode_batch(documents[start : start + ENCODE_BATCH], add_special_tokens=False)
            for i, enc in enumerate(encodings):
                ids = enc.ids
                if separator is not None and start + i > 0:
                    ids = [separator, *ids]
                np.asarray(ids, dtype=dtype).tofile(out)
                count += len(ids)
    return count


@dataclass
class TokenCache:
    folder: Path
    meta: dict[str, Any]

    @property
    def tokenizer_json(self) -> str:
        return (self.folder / "tokenizer.json").read_text(encoding="utf-8")

    def ids(self, split: str) -> np.memmap:
        return np.memmap(self.folder / f"{split}.bin", dtype=np.dtype(self.meta["dtype"]), mode="r")


def open_cache(folder: Path) -> TokenCache | None:
    meta_file = folder / "meta.json"
    if not meta_file.is_file():
        return None
    return TokenCache(folder, json.loads(meta_file.read_text()))


def build_cache(
    root: str | os.PathLike, key: str, tokenizer: Tokenizer, splits: dict[str, list[str]], separator: int | None
) -> TokenCache:
    """Tokenize every split into a new entry under root/tokens/key (or return it if it is there)."""
    folder = Path(root).expanduser() / "tokens" / key
    if (done := open_cache(folder)) is not None:
        return done
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=folder.parent))
    try:
        dtype = token_dtype(tokenizer.get_vocab_size())
        meta: dict[str, Any] = {"format": FORMAT_VERSION, "dtype": dtype.name, "vocab_size": tokenizer.get_vocab_size()}
        for split, documents in splits.items():
            meta[f"{split}_tokens"] = write_tokens(staging / f"{split}.bin", tokenizer, documents, dtype, separator)
            meta[f"{split}_chars"] = sum(len(d) for d in documents)
        (staging / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
        (staging / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            staging.rename(folder)
        except OSError:  # another process finished the same entry first; theirs is as good as ours
            if open_cache(folder) is None:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return open_cache(folder)


def find_cache(root: str | os.PathLike, key: str) -> TokenCache | None:
    return open_cache(Path(root).expanduser() / "tokens" / key)
