"""Token ids on disk: a corpus is tokenized once, then every later run memory-maps the result.

An entry is a folder under <cache_dir>/tokens named by a fingerprint of the source (what identifies
its text: files' paths, sizes and modification times, or a dataset's name and revision) and of the
tokenizer settings:

    tokens/<key>/tokenizer.json   the tokenizer
                 train.bin        token ids, flat (uint16 when the vocabulary fits, else uint32)
                 val.bin
                 meta.json        counts, dtype, source
                 train.drop1.bin  with tokenizer.dropout, the training split encoded again with BPE-dropout
                 ...              (tokenizer.dropout_copies of them; meta.json's train_copies counts them)

An entry is built in tokens/<key>.partial/ and renamed into place when complete, so a folder with the
entry's name is always whole. A preparation that stops part way leaves the .partial folder, with its
finished shards, for the next run to go on from. One process at a time builds an entry (a file lock in
tokens/.locks, removed by its holder as the last thing it does, so none is left lying about); others
wait for it and then read. A preparation refused for its input leaves nothing in the cache, not even
the folders it made to hold the entry. Finished entries are only read, so a cache that cannot be
written (a teacher's, shared read-only) serves them; only a missing entry needs it writable.

An entry is checked whenever it is opened, cheaply (no token file is read): the token files' sizes
against the counts and dtype in meta.json, tokenizer.json against the hash recorded when it was made,
and its number of tokens against meta.json's vocab_size, which the model is made as large as. An
entry that fails (cut short, edited, a file missing) is named in one warning line and built again;
nothing trains on it. A disk that fills while an entry is written ends in one line saying
where; the staging folder stays only if the next run can go on from it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock, Timeout

from data.errors import DataError
from data.writes import RefusedWrite, refused_write

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
ENTRY_FILES = ("tokenizer.json", "train.bin", "val.bin", "meta.json")
TOKEN_DTYPES = ("uint16", "uint32")


class DamagedEntry(Exception):
    """A cache entry whose files do not match what its meta.json says."""

    def __init__(self, file: Path, why: str):
        self.file = file
        super().__init__(f"the token cache entry {file.parent} is damaged: {file.name} {why}")


def fingerprint(source: dict[str, Any], tokenizer: dict[str, Any]) -> str:
    spec = {"format": FORMAT_VERSION, "source": source, "tokenizer": tokenizer}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:20]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def copy_name(number: int) -> str:
    """The file of the training split's BPE-dropout encoding `number` (1, 2, ...)."""
    return f"train.drop{number}.bin"


def entry_files(meta: dict[str, Any]) -> list[str]:
    """The files of an entry whose meta.json says this."""
    copies = meta.get("train_copies") or []
    return [*ENTRY_FILES, *(copy_name(n) for n in range(1, len(copies) + 1))]


@dataclass
class TokenCache:
    folder: Path
    meta: dict[str, Any]
    made_now: bool = False  # built by this process, rather than found
    fallback: str | None = None  # why this text stands in for the one asked for (data.sources.Source.fallback)
    made_folders: list[Path] = field(default_factory=list)  # the cache's folders made to hold it, if made_now

    @property
    def key(self) -> str:
        return self.folder.name

    @property
    def tokenizer_json(self) -> str:
        return (self.folder / "tokenizer.json").read_text(encoding="utf-8")

    def ids(self, split: str) -> np.ndarray:
        return self.token_file(f"{split}.bin", self.meta[f"{split}_tokens"])

    def train_encodings(self) -> list[np.ndarray]:
        """The training split as the tokenizer encodes it, then its BPE-dropout encodings, if any."""
        copies = self.meta.get("train_copies") or []
        return [self.ids("train"), *(self.token_file(copy_name(n), c) for n, c in enumerate(copies, 1))]

    def token_file(self, name: str, count: int) -> np.ndarray:
        if count == 0:  # a zero-length file cannot be memory-mapped
            return np.zeros(0, dtype=np.dtype(self.meta["dtype"]))
        return np.memmap(self.folder / name, dtype=np.dtype(self.meta["dtype"]), mode="r")


def open_cache(folder: Path) -> TokenCache | None:
    """The entry in folder, checked (DamagedEntry if it fails); None where there is no entry."""
    if not folder.is_dir():
        return None
    meta_file = folder / "meta.json"
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DamagedEntry(meta_file, "is missing") from None
    except (OSError, ValueError) as err:
        raise DamagedEntry(meta_file, f"cannot be read ({type(err).__name__})") from None
    check_entry(folder, meta)
    return TokenCache(folder, meta)


def check_entry(folder: Path, meta: Any) -> None:
    """Sizes of the token files against meta.json's counts and dtype; tokenizer.json against its hash."""
    meta_file = folder / "meta.json"
    if not isinstance(meta, dict) or meta.get("dtype") not in TOKEN_DTYPES:
        raise DamagedEntry(meta_file, f"names no token dtype ({' or '.join(TOKEN_DTYPES)})")
    itemsize = np.dtype(meta["dtype"]).itemsize
    copies = meta.get("train_copies", [])
    if not isinstance(copies, list):
        raise DamagedEntry(meta_file, "has train_copies that is not a list of counts")
    counted = [(meta.get(f"{split}_tokens"), folder / f"{split}.bin", f"{split} tokens") for split in ("train", "val")]
    counted += [(c, folder / copy_name(n), f"tokens in {copy_name(n)}") for n, c in enumerate(copies, 1)]
    for count, file, what in counted:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise DamagedEntry(meta_file, f"has no count of {what}")
        if not file.is_file():
            raise DamagedEntry(file, "is missing")
        if file.stat().st_size != count * itemsize:
            raise DamagedEntry(
                file,
                f"holds {file.stat().st_size:,} bytes where {count:,} {meta['dtype']} tokens take {count * itemsize:,}",
            )
    tokenizer_file = folder / "tokenizer.json"
    try:
        text = tokenizer_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DamagedEntry(tokenizer_file, "is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DamagedEntry(tokenizer_file, f"cannot be read ({type(err).__name__})") from None
    if not isinstance(meta.get("tokenizer_sha256"), str):  # every entry records it: without it, nothing is checked
        raise DamagedEntry(meta_file, "records no hash of tokenizer.json")
    if text_hash(text) != meta["tokenizer_sha256"]:
        raise DamagedEntry(tokenizer_file, "is not the tokenizer the entry was made with (its hash differs)")
    # the model is made as large as meta.json's vocab_size: a smaller one would fail on the first token above it
    check_tokenizer_text(tokenizer_file, text, meta.get("vocab_size"))


def check_tokenizer_text(file: Path, text: str, vocab_size: Any) -> None:
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_str(text).get_vocab_size()
    except Exception:  # the library's own error for JSON it cannot read
        raise DamagedEntry(file, "is not a tokenizer that `tokenizers` can read") from None
    if size != vocab_size:
        raise DamagedEntry(file.with_name("meta.json"), f"records {vocab_size} tokens where {file.name} has {size}")


def find_cache(root: str | os.PathLike, key: str) -> TokenCache | None:
    """The entry for key, if there is one that passes its check; a damaged one is reported (and
    built again by build_cache)."""
    try:
        return open_cache(Path(root).expanduser() / "tokens" / key)
    except DamagedEntry as err:
        log.warning("%s; preparing it again", err)
        return None


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
    check_folders(tokens, key)
    made = missing_folders(tokens / ".locks")
    lock = lock_entry(tokens, key, made)
    try:
        if (done := entry_under_lock(entry)) is not None:
            return done
        fill_staging(staging, build)
        staging.rename(entry)
    finally:
        let_go(lock)
        if not staging.exists() and not entry.exists():  # refused: the folders made for it go too
            remove_if_empty(made)
    return open_built(entry, made)


def lock_entry(tokens: Path, key: str, made: list[Path]) -> FileLock:
    """The entry's lock, held (after waiting for another process that holds it). A cache that cannot be
    written to is said, with its fix, and the folders `made` for the lock go again."""
    entry, staging = tokens / key, tokens / f"{key}.partial"
    lock = entry_lock(tokens, key)
    try:
        hold(lock, f"another process is preparing these tokens; waiting for it ({staging})")
    except OSError as err:  # a folder of the cache made by another user, or on a read-only disk
        remove_if_empty(made)
        if (blocker := wrong_kind_at(err, tokens)) is not None:
            raise wrong_kind(blocker) from None
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise unwritable(entry, err) from None
    return lock


def unwritable(entry: Path, err: OSError) -> DataError:
    """The error for an entry that is needed and cannot be written: it is missing, or damaged."""
    if entry.exists():  # damaged (find_cache said so), and it cannot be made again here
        return DataError(
            f"the token cache's entry {entry} is damaged and cannot be made again here: {err.filename} "
            f"({err.strerror}); delete it (rm -r {shlex.quote(str(entry))}) as a user who may, or set "
            "data.cache_dir to a folder you can write to"
        )
    return DataError(
        f"the token cache has no entry for this data and tokenizer, and cannot be written to make one: "
        f"{err.filename} ({err.strerror}); make {Path(err.filename).parent} writable, or set data.cache_dir "
        "to a folder you can write to"
    )


def entry_under_lock(entry: Path) -> TokenCache | None:
    """The entry, if it is there by now (another process made it while this one waited for the lock).
    A damaged one (reported by find_cache) goes now, under the lock."""
    try:
        return open_cache(entry)
    except DamagedEntry:
        shutil.rmtree(entry)
        return None


def fill_staging(staging: Path, build: Callable[[Path], dict[str, Any]]) -> None:
    """The entry's files in staging: built now, unless a stopped run finished them (its meta.json is
    written last); then the build's work files go, so that staging holds the entry and nothing else."""
    staging.mkdir(exist_ok=True)
    if not (staging / "meta.json").is_file():
        run_build(staging, build)
    keep = entry_files(json.loads((staging / "meta.json").read_text(encoding="utf-8")))
    for leftover in staging.iterdir():
        if leftover.name not in keep:
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()


def run_build(staging: Path, build: Callable[[Path], dict[str, Any]]) -> None:
    """build(staging), then meta.json with the hash of the tokenizer it wrote. Refused input removes
    staging; a disk that filled, or something in the way, is said in one line."""
    try:
        meta = build(staging)
        meta["tokenizer_sha256"] = text_hash((staging / "tokenizer.json").read_text(encoding="utf-8"))
        write_json(staging / "meta.json", meta)
    except DataError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except OSError as err:
        if (blocker := wrong_kind_at(err, staging)) is not None:  # the rest is kept to go on from
            raise wrong_kind(blocker) from None
        if (refused := refused_write(err)) is None:
            raise
        raise disk_full(staging, refused) from None


def open_built(entry: Path, made: list[Path]) -> TokenCache:
    """The entry just renamed into place, checked as every entry is when opened."""
    try:
        built = open_cache(entry)
    except DamagedEntry as err:  # just written and already wrong: the disk or something else is at fault
        raise DataError(f"{err}, right after it was written; check the disk, then run again") from None
    built.made_now = True
    built.made_folders = made
    return built


def check_folders(tokens: Path, key: str) -> None:
    """The places that the cache keeps folders in must hold folders, if anything: a file in one (a
    copy gone wrong, a stray `touch`) is named, for the user to remove, rather than found part way."""
    for folder in (tokens, tokens / ".locks", tokens / key, tokens / f"{key}.partial"):
        if folder.is_symlink() and not folder.exists():  # a link to a folder moved or deleted
            raise DataError(
                f"the token cache cannot use {folder}: it is a link to {os.readlink(folder)}, which does not "
                "exist; remove the link, or set data.cache_dir to another folder"
            )
        if folder.exists() and not folder.is_dir():
            raise wrong_kind(folder)


def wrong_kind(path: Path) -> DataError:
    """The error for a file where the cache keeps a folder, or a folder where it keeps a file."""
    found, kept = ("folder", "file") if path.is_dir() else ("file", "folder")
    return DataError(
        f"the token cache cannot use {path}: it is a {found} where the cache keeps a {kept}; remove it, "
        "or set data.cache_dir to another folder"
    )


def wrong_kind_at(err: OSError, inside: Path) -> Path | None:
    """The path below `inside` that err failed on for being of the wrong kind: a folder where a file is
    written or renamed to (a stray `mkdir`), a file where a folder is made (a stray `touch`); else None."""
    if err.errno not in (errno.EEXIST, errno.EISDIR):
        return None
    path = Path(err.filename2 or err.filename or "")  # a rename's target is its second name
    return path if inside in path.parents else None


def entry_lock(tokens: Path, key: str) -> FileLock:
    return FileLock(str(tokens / ".locks" / f"{key}.lock"))  # its folder is made when it is acquired


def hold(lock: FileLock, waiting: str) -> None:
    """Acquire the lock, saying `waiting` once if another process holds it. A refused preparation
    removes the folder of locks it made; one that is waiting then makes it again."""
    timeout = 0
    while True:
        try:
            lock.acquire(timeout=timeout)
            return
        except Timeout:
            log.info(waiting)
            timeout = -1
        except FileNotFoundError:
            continue


def let_go(lock: FileLock) -> None:
    """Release the lock, removing its file first. Safe as the holder's last act: a process that opened
    the file before it went and locks it after finds it unlinked and tries again (filelock >= 3.21),
    on a new file of the same name."""
    Path(lock.lock_file).unlink(missing_ok=True)
    lock.release()


def missing_folders(folder: Path) -> list[Path]:
    """folder and those of its parents that do not exist yet, outermost first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.insert(0, folder)
        folder = folder.parent
    return missing


def remove_if_empty(folders: list[Path]) -> None:
    """Remove these folders, innermost first, while they are empty (another process may have put
    something in one meanwhile: it stays, and so do those around it)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def disk_full(staging: Path, err: RefusedWrite) -> DataError:
    """The error for a disk that filled (or became read-only, or a file that reached the size limit)
    while staging was written: it stays if it holds finished work (the tokenizer, written whole or not
    at all, and any finished shards: the next run goes on from them), else it goes."""
    where = err.filename or staging
    if (staging / "tokenizer.json").is_file():
        size = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file())
        kept = (
            f"the partial entry {staging} ({size / 2**20:.1f} MB) is kept: the next run goes on from it once it "
            "can be written (delete it to get the space back)"
        )
    else:
        shutil.rmtree(staging, ignore_errors=True)
        kept = "nothing of it is kept"
    fix = err.fix[0].upper() + err.fix[1:]
    return DataError(
        f"{err}: writing the token cache at {where} failed; {kept}. {fix}, or set data.cache_dir to a disk with room"
    )


def discard(cache: TokenCache) -> None:
    """Remove an entry this process made for a run that was then refused (under the entry's lock)."""
    tokens = cache.folder.parent
    lock = entry_lock(tokens, cache.key)
    hold(lock, f"another process is preparing these tokens; waiting for it ({cache.folder})")
    try:
        shutil.rmtree(cache.folder, ignore_errors=True)
    finally:
        let_go(lock)
    remove_if_empty(cache.made_folders)
