"""Where text comes from: a user's files, a Hugging Face Hub dataset, Tiny Shakespeare, or the offline
pydoc corpus. All are read through HF `datasets`, as streams (data.corpus).

`describe(cfg)` is cheap: it finds the text and says what identifies it (file sizes and times,
dataset names), which is what the token cache is keyed by. Reading waits until `Source.open`, which
a run whose tokens are cached never calls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from data.cache import missing_folders, remove_if_empty
from data.corpus import Corpus, Part
from data.errors import DataError
from data.files import (
    check_no_nul_characters,
    expand_paths,
    file_stats,
    find_not_utf8,
    line_documents,
    read_text,
    text_rows,
)
from data.shards import PIECE_CHARS

if TYPE_CHECKING:
    import datasets

# `datasets` is imported where text is read or a Hub dataset is looked up, not here: a run whose
# tokens are cached never reads text, and need not wait for that slow import.

log = logging.getLogger(__name__)
# datasets' file readers log each failure to read a file (twice: their own handler, then the root's) before
# raising it; the error is then said once, in one line that names the file (explain_file_error)
logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# How the pydoc corpus is named in logs and in a run's saved settings (prepared_data.source), chosen
# (data=pydoc) and standing in for Tiny Shakespeare; checkpoint.trained_offline reads it back
PYDOC_LABEL = "pydoc_data.topics"
OFFLINE_LABEL = f"{PYDOC_LABEL} (offline fallback)"
VALIDATION_SPLITS = ("validation", "valid", "val", "dev")  # what data.val_split=auto looks for


@dataclass
class Source:
    label: str  # where the text comes from, for logs
    identity: dict  # what the text is, for the cache key
    open: Callable[[int | None], Corpus]  # piece_chars -> the corpus (long plain-text documents in pieces)
    fallback: str | None = None  # why the text asked for is not to be had, when this one stands in for it
    train_files: list[str] = field(default_factory=list)  # local files of the training text, in reading order
    count_documents: Callable[[str], int] | None = None  # the documents one of them holds (reads it)


def changed_file(source: Source) -> str | None:
    """The first of the source's files whose size or modification time is no longer the one in its
    identity (or that is gone): the file was written after the source was described."""
    for part in ("train", "val", "files"):  # the lists of file_stats in an identity
        for path, size, mtime_ns in source.identity.get(part) or []:
            try:
                now = os.stat(path)
            except OSError:
                return path
            if (now.st_size, now.st_mtime_ns) != (size, mtime_ns):
                return path
    return None


def no_path() -> DataError:
    return DataError("data=text needs data.path: a file, a folder or a glob of .txt, .jsonl, .csv or .parquet files")


def describe(cfg) -> Source:
    """The source data.source names (its choices are SOURCES', at the end of this module)."""
    return SOURCES[cfg.source](cfg)


def text_source(cfg) -> Source:
    if not cfg.get("path"):
        raise no_path()
    return files_source(cfg, cfg.path)


def check_files(cfg) -> None:
    """That the files data.path and data.val_path name are there, without reading them: what a sweep
    checks of every job before the first starts (a job's run finds the rest)."""
    if cfg.get("source") not in ("text", "shakespeare"):
        return
    if cfg.get("source") == "text" and not cfg.get("path"):
        raise no_path()
    if cfg.get("source") == "shakespeare" and cfg.get("path"):
        check_plain_text(cfg)
    fmt = cfg.get("format", "auto")
    for setting in ("path", "val_path"):
        if cfg.get(setting):
            expand_paths(cfg[setting], f"data.{setting}", fmt)


# ---- local files -------------------------------------------------------------------------------------


def files_source(cfg, path: str) -> Source:
    files, fmt = expand_paths(path, "data.path", cfg.get("format", "auto"))
    val_files = None
    if cfg.get("val_path"):
        val_files, val_fmt = expand_paths(cfg.val_path, "data.val_path", cfg.get("format", "auto"))
        if val_fmt != fmt:  # read as the training files' format, a table would validate as its raw text
            raise DataError(
                f"data.val_path {cfg.val_path} is {val_fmt} and data.path {path} is {fmt}; give validation "
                f"files of the training files' format, {fmt}"
            )
    shared = sorted(set(map(os.path.realpath, files)) & set(map(os.path.realpath, val_files or [])))
    if shared:
        log.warning(
            "data.val_path and data.path share %d file(s) (%s): the model is validated on text it trains on, "
            "which measures memorising, not learning; give data.val_path files of their own",
            len(shared),
            shared[0] if len(shared) == 1 else f"{shared[0]}, ...",
        )
    reading = reading_settings(cfg, fmt)
    identity = {"kind": "files", "format": fmt, **reading, "train": file_stats(files)}
    if val_files:
        identity["val"] = file_stats(val_files)
    else:
        identity["val_fraction"] = cfg.val_fraction
    label = files[0] if len(files) == 1 else str(path)

    def open_corpus(piece_chars: int | None) -> Corpus:
        parts = [file_part(files, fmt, reading, piece_chars, "train" if val_files else "tail", label)]
        if val_files:
            parts.append(file_part(val_files, fmt, reading, piece_chars, "val", str(cfg.val_path)))
        return Corpus(parts, cfg.val_fraction)

    return Source(
        label,
        identity,
        open_corpus,
        train_files=[os.path.abspath(f) for f in files],
        count_documents=functools.partial(count_documents, fmt=fmt, reading=reading),
    )


def count_documents(file: str, fmt: str, reading: dict) -> int:
    """The documents of one training file, as reading the corpus splits them (the copy index names
    the file a copied span comes from with these counts)."""
    if fmt == "txt" and reading["one_document_per"] == "line":  # each non-empty line
        return sum(row["text"].count("\n") + 1 for row in line_documents(file, reading["errors"]))
    if fmt == "txt":  # the file, unless it holds no text
        return int(any(read_text(file, reading["errors"])))
    with open(file, "rb") as head:
        if not head.read(4096).strip() and os.path.getsize(file) <= 4096:
            return 0  # no rows: nothing for the table reader to read
    part = file_part([file], fmt, reading, PIECE_CHARS, "train", file)
    documents = 0
    for rows, _ in part.batches():
        for text, continues in rows:
            if part.is_text(text):
                documents += sum(1 for line in text.split("\n") if line) if part.lines else not continues
    return documents


def reading_settings(cfg, fmt: str) -> dict:
    """The settings that change what text a format's files give."""
    errors = cfg.get("errors", "strict")  # one of TEXT_ERRORS
    if fmt == "txt":
        return {"errors": errors, "one_document_per": cfg.get("one_document_per", "file")}  # DOCUMENT_UNITS
    return {"errors": errors, "text_column": cfg.get("text_column", "text")}


def file_part(files: list[str], fmt: str, reading: dict, piece_chars: int | None, split: str, where: str) -> Part:
    import datasets

    if fmt == "txt":
        text_row = datasets.Features({"text": datasets.Value("string"), "continues": datasets.Value("bool")})
        kwargs = {
            "files": files,
            "one_document_per": reading["one_document_per"],
            "errors": reading["errors"],
            "piece_chars": piece_chars,
        }
        return Part(
            rows=lambda: datasets.IterableDataset.from_generator(text_rows, features=text_row, gen_kwargs=kwargs),
            split=split,
            where=where,
            lines=reading["one_document_per"] == "line",
            batch_rows=1,  # rows are long pieces of files: a shard may end after any one
        )
    options = {}
    if reading["errors"] != "strict" and fmt in ("json", "csv"):  # parquet holds UTF-8 by definition
        # the json builder re-decodes (with encoding_errors) only for an encoding not spelled "utf-8"
        options = (
            {"encoding": "utf8", "encoding_errors": reading["errors"]}
            if fmt == "json"
            else {"encoding_errors": reading["errors"]}
        )
    if fmt == "csv" and reading["errors"] == "strict":
        # the text as written, where pandas types a chunk of "42"s as numbers (not with data.errors=replace:
        # pandas ignores encoding_errors for a column with a converter)
        options["converters"] = {reading["text_column"]: str}
    return Part(
        rows=lambda: datasets.load_dataset(fmt, data_files=files, split="train", streaming=True, **options),
        split=split,
        column=reading["text_column"],
        where=where,
        explain=lambda err: explain_file_error(err, files, fmt, where),
        check=(lambda texts: check_no_nul_characters(texts, files)) if fmt == "csv" else None,
    )


def explain_file_error(err: Exception, files: list[str], fmt: str, where: str) -> Exception:
    """A failure inside the datasets readers, as one line that names the file."""
    chain, cause = [], err
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    about_utf8 = any(isinstance(e, UnicodeDecodeError) or "utf8" in str(e).lower().replace("-", "") for e in chain)
    if about_utf8 and (bad := find_not_utf8(files)) is not None:
        return bad
    if fmt == "json" and (bad := find_bad_json_line(files)) is not None:
        return bad
    # the reader's own failure names the row (pyarrow: "... in row 2000"); a fallback reader's, tried
    # after it, is innermost and names a position that means nothing to the user
    named = next((e for e in chain if re.search(r"\bin row \d+", str(e))), chain[-1])
    lines = str(named).strip().splitlines()
    reason = lines[0].rstrip(".") if lines else type(named).__name__
    return DataError(f"{where} cannot be read as {fmt}: {reason}; check the file or set data.format")


def find_bad_json_line(files: list[str]) -> DataError | None:
    """The first line of JSON Lines files that is not a JSON value, named by file and line (counted
    from 1, as an editor does); None when every line reads (a file that is one JSON document)."""
    import json

    for file in files:
        with open(file, encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except ValueError as err:
                    if number == 1:
                        break  # perhaps one JSON document over many lines: the reader's own words tell
                    return DataError(f"{file}, line {number}, is not JSON ({err}); fix that line, or remove it")
    return None


# ---- Hugging Face Hub ----------------------------------------------------------------------------------


def hub_source(cfg) -> Source:
    name = cfg.get("name")
    if not name:
        raise DataError(
            "data=hub needs data.name: a dataset on the Hugging Face Hub (owner/name) or a local dataset folder"
        )
    keys = ("name", "config", "split", "val_split", "revision", "text_column", "streaming")
    settings = {key: cfg.get(key) for key in keys}
    identity = {"kind": "hub", **settings, "val_fraction": cfg.val_fraction}
    folder = Path(str(name)).expanduser()
    looks_local = str(name).startswith((".", "/", "~")) or str(name).count("/") > 1  # a Hub name is owner/name
    if looks_local and folder.is_file():
        raise DataError(
            f"data.name={name} is a file, and data=hub reads a dataset (a Hub name, or a local dataset's folder); "
            f"for files of your own use data=text data.path={name}"
        )
    if looks_local and not folder.is_dir():
        raise DataError(
            f"data.name={name}: no such folder; give the folder of a local dataset, or a Hub dataset as owner/name"
        )
    if folder.is_dir():  # a local copy: its files say whether it changed
        files = (
            p
            for p in folder.rglob("*")
            if p.is_file() and not any(x.startswith(".") for x in p.relative_to(folder).parts)
        )
        identity["files"] = file_stats(sorted(map(str, files)))
    split = cfg.get("split") or "train"

    def open_corpus(piece_chars: int | None) -> Corpus:
        if not folder.is_dir():
            go_offline_if_unreachable()
        val_split = resolve_val_split(cfg, split)
        rule = "train" if val_split else ("every" if cfg.get("streaming") else "tail")
        parts = [hub_part(cfg, split, rule)]
        if val_split:
            parts.append(hub_part(cfg, val_split, "val"))
        return Corpus(parts, cfg.val_fraction)

    return Source(str(name), identity, open_corpus)


def go_offline_if_unreachable(timeout: float = 5.0) -> None:
    """With no network, huggingface_hub retries each request several times, waiting longer each time
    and logging every try; one quick connection to the Hub decides instead, and without it the datasets
    cache alone is read (HF_HUB_OFFLINE), which holds the dataset or fails at once."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
        return
    except OSError as err:
        log.info(
            "the Hugging Face Hub (%s) cannot be reached (%s): reading the local datasets cache only",
            endpoint.hostname,
            err,
        )
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub and datasets are imported; if they are already:
    for module, name in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE")):
        if module in sys.modules:
            setattr(sys.modules[module], name, True)


def saved_by_datasets(name: str) -> bool:
    """Whether data.name is one Dataset written by `Dataset.save_to_disk`: a folder that load_dataset
    cannot read (a DatasetDict's folder of splits it reads as any other)."""
    folder = Path(str(name)).expanduser()
    return (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()


def hub_part(cfg, split: str, rule: str) -> Part:
    streaming = bool(cfg.get("streaming"))

    def rows() -> datasets.IterableDataset:
        import datasets

        with hub_errors(cfg.name):
            if saved_by_datasets(cfg.name):
                return datasets.load_from_disk(str(Path(str(cfg.name)).expanduser())).to_iterable_dataset()
            ds = datasets.load_dataset(
                cfg.name, cfg.get("config"), split=split, revision=cfg.get("revision"), streaming=streaming
            )
        return ds if streaming else ds.to_iterable_dataset()

    return Part(
        rows=rows,
        split=rule,
        column=cfg.get("text_column", "text"),
        where=f"{cfg.name} ({split})",
        streaming=streaming,
        explain=lambda err: hub_error(err, cfg.name),
    )


def resolve_val_split(cfg, train_split: str) -> str | None:
    """The split to validate on: data.val_split, or with `auto` the dataset's validation split if it
    has one; None means the data.val_fraction of the training split."""
    wanted = cfg.get("val_split", "auto")
    if saved_by_datasets(cfg.name):  # one Dataset, no splits: validation is its last data.val_fraction
        if train_split != "train" or wanted not in (None, "", "none", "null", "auto"):
            raise DataError(
                f"data.name={cfg.name} is one dataset saved with save_to_disk, without splits; leave data.split "
                "and data.val_split out (the last data.val_fraction of it validates)"
            )
        return None
    if wanted in (None, "", "none", "null"):
        return None
    import datasets

    with hub_errors(cfg.name):
        names = datasets.get_dataset_split_names(cfg.name, cfg.get("config"), revision=cfg.get("revision"))
    if train_split.split("[")[0] not in names:
        raise DataError(f"data.split={train_split} is not a split of {cfg.name}; it has {', '.join(names)}")
    if wanted == "auto":
        return next((s for s in VALIDATION_SPLITS if s in names and s != train_split), None)
    if wanted.split("[")[0] not in names:
        raise DataError(
            f"data.val_split={wanted} is not a split of {cfg.name}; it has {', '.join(names)} "
            "(or set data.val_split=null to validate on the last data.val_fraction of the training split)"
        )
    return wanted


@contextmanager
def hub_errors(name: str) -> Iterator[None]:
    """Turns the ways loading a Hub dataset fails into one-line DataErrors."""
    try:
        yield
    except DataError:
        raise
    except Exception as err:
        explained = hub_error(err, name)
        if explained is err:
            raise
        raise explained from None


def hub_error(err: Exception, name: str) -> Exception:
    import datasets

    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, ConnectionError) or "offline" in message.lower():
        return DataError(
            f"data.name={name}: the Hugging Face Hub cannot be reached (offline?) and the dataset is not in "
            "the local datasets cache; download it where there is a network and point data.name at the local "
            "dataset folder, or use data=text data.path=<its files>"
        )
    if isinstance(err, datasets.exceptions.DatasetNotFoundError):
        return DataError(
            f"data.name={name} is neither a dataset on the Hugging Face Hub nor a local folder; check the name"
        )
    if isinstance(err, (FileNotFoundError, ValueError)):
        return DataError(f"data.name={name}: {message}")
    return err


# ---- Tiny Shakespeare and the offline pydoc corpus ----------------------------------------------------


def shakespeare_source(cfg) -> Source:
    """Tiny Shakespeare from data.path, else the cache, else a local copy, else a download (then cached);
    with none of those, the offline pydoc corpus, marked as a stand-in (the run sizes itself to it and
    says so: shell.settings)."""
    if cfg.get("path"):
        check_plain_text(cfg)
        return files_source(cfg, cfg.path)
    url = cfg.get("url") or SHAKESPEARE_URL
    try:
        found = find_shakespeare(cfg.cache_dir, cfg.get("local_copies") or [], url, quietly=False)
    except DataError:
        raise
    except (OSError, ValueError) as err:  # no network, a proxy, a moved URL, a link too slow: "not available now"
        source = pydoc_source(cfg, label=OFFLINE_LABEL)
        why = getattr(err, "reason", None) or err
        source.fallback = (
            f"Tiny Shakespeare is not available (no local copy, and the download from {url} failed: {why})"
        )
        return source
    return files_source(cfg, found)


def check_plain_text(cfg) -> None:
    """data=shakespeare reads data.path as plain text; a table's text column is data=text's to read."""
    fmt = expand_paths(cfg["path"], "data.path", "auto")[1]
    if fmt != "txt":
        raise DataError(
            f"data.path={cfg['path']} is {fmt} and data=shakespeare reads plain text; for your own files use "
            f"data=text data.path={cfg['path']} (data.text_column names the column that holds the text)"
        )


def find_shakespeare(cache_dir: str, local_copies: list[str], url: str, quietly: bool = True) -> str | None:
    """Tiny Shakespeare's file: the cached one, a local copy, or downloaded now into the cache; None where the
    download fails (`quietly`), else the download's error."""
    cached = Path(cache_dir).expanduser() / "sources" / "tinyshakespeare" / "input.txt"
    for candidate in [cached, *(Path(p).expanduser() for p in local_copies)]:
        if candidate.is_file():
            return str(candidate)
    try:
        text = download(url)
    except (OSError, ValueError):
        if quietly:
            return None
        raise
    made, partial = missing_folders(cached.parent), cached.with_suffix(".partial")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(text, encoding="utf-8")
        partial.replace(cached)  # a file at the cached path is always complete
    except OSError as err:  # a read-only cache (which serves finished token entries), a full disk
        if partial.is_file():
            partial.unlink()
        remove_if_empty(made)
        raise DataError(
            f"Tiny Shakespeare was downloaded but cannot be kept in the cache: {err.filename} ({err.strerror}); "
            "make the cache writable (or free space), set data.cache_dir to a folder you can write to, or give "
            "a copy with data.path"
        ) from None
    return str(cached)


DOWNLOAD_TIMEOUT = 60.0  # seconds a slow link may keep the download waiting at any one moment


def download(url: str) -> str:
    """The text at url (http, https or file://; a plain path is read as one), whole."""
    if "://" not in url:
        return Path(url).read_text(encoding="utf-8")
    from urllib.request import urlopen

    with urlopen(url, timeout=DOWNLOAD_TIMEOUT) as response:
        return response.read().decode("utf-8")


def pydoc_source(cfg, label: str = PYDOC_LABEL) -> Source:
    """Python's own help topics, one document each: an English corpus that ships with every Python."""
    from pydoc_data.topics import topics

    texts = [topics[key] for key in sorted(topics)]
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    identity = {"kind": "pydoc", "sha256": digest, "val_fraction": cfg.val_fraction}

    def rows() -> datasets.IterableDataset:
        import datasets

        return datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset()

    def open_corpus(piece_chars: int | None) -> Corpus:
        return Corpus([Part(rows, "tail", where=label)], cfg.val_fraction)

    return Source(label, identity, open_corpus)


# data.source's choices, and how each reads its text
SOURCES = {"shakespeare": shakespeare_source, "text": text_source, "hub": hub_source, "pydoc": pydoc_source}
# data.errors: what a byte that is not UTF-8 does (Python's decoding errors); data.one_document_per: a
# plain-text file is one document, or each non-empty line is one
TEXT_ERRORS = ("strict", "replace", "ignore")
DOCUMENT_UNITS = ("file", "line")
