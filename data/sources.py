"""Where text comes from: Tiny Shakespeare, a user's own files, or an offline fallback corpus.

Every source is read with HF `datasets` and ends as a list of documents (strings), split into a
training part and a validation part.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import datasets

log = logging.getLogger(__name__)

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


class DataError(ValueError):
    """Data that cannot be used; the message names the file or setting and how to fix it."""


@dataclass
class TextSplits:
    train: list[str]
    val: list[str]
    source: str  # where the text came from, for logs and the run folder

    @property
    def val_chars(self) -> int:
        return sum(len(doc) for doc in self.val)


def split_by_characters(documents: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """First (1 - val_fraction) of all characters train, the rest validate; the document that
    straddles the boundary is cut in two, so a single-file corpus splits as char-rnn and nanoGPT do."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    total = sum(len(doc) for doc in documents)
    boundary = int(total * (1.0 - val_fraction))
    train, val, seen = [], [], 0
    for doc in documents:
        if seen + len(doc) <= boundary:
            train.append(doc)
        elif seen >= boundary:
            val.append(doc)
        else:
            cut = boundary - seen
            train.append(doc[:cut])
            val.append(doc[cut:])
        seen += len(doc)
    return [d for d in train if d], [d for d in val if d]


def read_documents(files: list[str]) -> list[str]:
    """Each file is one document, read through the datasets `text` builder."""
    try:
        ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
    except UnicodeDecodeError as err:
        raise DataError(f"a file in {files[:3]} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    return [text for text in ds["text"] if text]


def expand_text_paths(path: str) -> list[str]:
    """A file, a folder (every .txt below it) or a glob, as a sorted list of files."""
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"data.path folder {path} holds no .txt files")
        return files
    if os.path.isfile(path):
        return [path]
    if glob.has_magic(path):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"data.path glob {path!r} matches no files; check the pattern")
        return files
    raise DataError(f"data.path {path} does not exist; give a .txt file, a folder of them, or a glob")


def pydoc_documents() -> list[str]:
    """Python's own help topics: an English corpus that ships with every Python."""
    from pydoc_data.topics import topics

    ds = datasets.Dataset.from_dict({"text": [topics[key] for key in sorted(topics)]})
    return list(ds["text"])


def find_shakespeare(path: str | None, cache_dir: str, local_copies: list[str], url: str) -> tuple[list[str], str]:
    """Tiny Shakespeare from data.path, else a local copy, else a download (then cached);
    with none of those, the offline pydoc corpus, with one warning line."""
    if path:
        files = expand_text_paths(path)
        return read_documents(files), files[0] if len(files) == 1 else path
    cached = Path(cache_dir).expanduser() / "sources" / "tinyshakespeare" / "input.txt"
    for candidate in [cached, *(Path(p).expanduser() for p in local_copies or [])]:
        if candidate.is_file():
            return read_documents([str(candidate)]), str(candidate)
    try:
        documents = [t for t in datasets.load_dataset("text", data_files=url, sample_by="document", split="train")["text"] if t]
    except Exception as err:  # no network, a proxy, a moved URL: all mean "not available now"
        log.debug("download of %s failed: %s", url, err)
        log.warning(
            "Tiny Shakespeare is not available (no local copy, download failed): training on the offline "
            "pydoc corpus instead; set data.path=/path/to/input.txt to use a local copy"
        )
        return pydoc_documents(), "pydoc_data.topics (offline fallback)"
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    partial.write_text("".join(documents), encoding="utf-8")
    partial.replace(cached)  # a file at the cached path is always complete
    return documents, url


def load_splits(cfg) -> TextSplits:
    """The configured source as training and validation documents."""
    source = cfg.source
    if source == "shakespeare":
        documents, where = find_shakespeare(cfg.get("path"), cfg.cache_dir, cfg.get("local_copies") or [], cfg.url)
    elif source == "text":
        if not cfg.get("path"):
            raise DataError("data=text needs data.path: a .txt file, a folder of them, or a glob")
        files = expand_text_paths(cfg.path)
        documents, where = read_documents(files), cfg.path
    elif source == "pydoc":
        documents, where = pydoc_documents(), "pydoc_data.topics"
    else:
        raise DataError(f"unknown data.source {source!r}; use shakespeare, text or pydoc")
    if not any(documents):
        raise DataError(f"{where} holds no text")
    train, val = split_by_characters(documents, cfg.val_fraction)
    return TextSplits(train, val, where)
