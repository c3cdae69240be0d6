"""Tokenizing a corpus in shards, across processes, writing as it goes.

The corpus is read in order and cut into shards of about `shard_chars` characters. Worker processes
encode a shard each (with `encode_batch_fast`) and append its ids to their own files; the reading
process keeps only a few shards in flight, so memory stays flat however large the corpus is. A shard
is finished when its record (counts, and where reading stands after it) is written, in order, so a
stopped preparation goes on after its last record. The shards are then joined into train.bin and
val.bin.

    <staging>/shards/000012.train.bin   ids of shard 12's training text
                    000012.val.bin
                    000012.json         its record; written last

Each file appears whole, by a rename, so a resumed run never reads a shard cut off part way. Workers
end with the process that started them, even one killed outright, so none outlives it to write into
a staging folder that a resumed run has taken over.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from data.cache import write_json
from data.corpus import Corpus, Item
from data.errors import DataError
from data.tokenizer import EOT, safe_pieces

log = logging.getLogger(__name__)

SHARD_CHARS = 4_000_000
ENCODE_CHARS = 1_000_000  # characters per encode_batch_fast call: bounds the Encoding objects alive at once
PIECE_CHARS = 65_536  # long documents are encoded in pieces about this long, cut where ids do not change
SPLITS = ("train", "val")
COUNTS = ("train_tokens", "train_chars", "val_tokens", "val_chars")


@dataclass
class Shard:
    index: int
    items: list[Item]
    position: dict  # where reading stands after this shard


class ShardEncoder:
    """Encodes one shard's items into <folder>/<index>.<split>.bin; returns the counts."""

    def __init__(
        self, tokenizer_json: str, folder: Path, dtype: str, can_split: bool, splits: tuple[str, ...] = SPLITS
    ):
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.folder, self.dtype, self.can_split = Path(folder), np.dtype(dtype), can_split
        self.splits = splits  # those to encode: the others' text is passed over
        eot = self.tokenizer.token_to_id(EOT)  # a given tokenizer may lack it: documents then simply follow on
        self.separator = np.array([eot] if eot is not None else [], dtype=self.dtype)

    def __call__(self, index: int, items: list[Item]) -> dict[str, int]:
        counts = dict.fromkeys(COUNTS, 0)
        paths = {split: self.folder / f"{index:06d}.{split}.bin" for split in self.splits}
        # written under this process's own names, then renamed: a shard file is whole or absent
        temps = {split: path.with_name(f".{path.name}.{os.getpid()}.tmp") for split, path in paths.items()}
        try:
            self.write(items, temps, counts)
        except BaseException:  # a full disk, a refused text, a stop: no part of a shard stays to fill the disk
            for temp in temps.values():
                temp.unlink(missing_ok=True)
            raise
        for split in self.splits:
            os.replace(temps[split], paths[split])
        return counts

    def write(self, items: list[Item], temps: dict[str, Path], counts: dict[str, int]) -> None:
        with contextlib.ExitStack() as stack:
            files = {split: stack.enter_context(open(temps[split], "wb")) for split in self.splits}
            for batch in self.batches(self.documents(items)):
                try:
                    encodings = self.tokenizer.encode_batch_fast(
                        [text for _, text, _ in batch], add_special_tokens=False
                    )
                except Exception as err:  # a given tokenizer that cannot take some text (no unknown token, ...)
                    raise DataError(
                        f"the tokenizer cannot encode this text ({str(err).splitlines()[0]}); a tokenizer given "
                        "with tokenizer.path must take any text (a byte-level BPE does, or one with an unknown token)"
                    ) from None
                chunks: dict[str, list[np.ndarray]] = {split: [] for split in self.splits}
                for (split, text, separator), encoding in zip(batch, encodings, strict=True):
                    if separator:
                        chunks[split].append(self.separator)
                    chunks[split].append(np.array(encoding.ids, dtype=self.dtype))
                    counts[f"{split}_chars"] += len(text)
                for split, arrays in chunks.items():
                    if arrays:
                        ids = np.concatenate(arrays)
                        files[split].write(ids.tobytes())  # (numpy's tofile reports a full disk with no errno)
                        counts[f"{split}_tokens"] += len(ids)

    def documents(self, items: list[Item]) -> Iterator[tuple[str, str, bool]]:
        """(split, text, separator_before) for each document or piece of one."""
        for split, text, separator, lines in items:
            if split not in self.splits:
                continue
            if lines:
                for line in text.split("\n"):
                    if line:
                        yield split, line, separator
                        separator = True
            elif self.can_split and len(text) > 2 * PIECE_CHARS:
                for piece in safe_pieces(text, PIECE_CHARS):
                    yield split, piece, separator
                    separator = False
            else:
                yield split, text, separator

    @staticmethod
    def batches(documents: Iterator[tuple[str, str, bool]]) -> Iterator[list[tuple[str, str, bool]]]:
        batch, size = [], 0
        for doc in documents:
            batch.append(doc)
            size += len(doc[1])
            if size >= ENCODE_CHARS:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


def read_records(folder: Path, dtype: str, splits: tuple[str, ...] = SPLITS) -> list[dict]:
    """The records of finished shards 0, 1, 2, ... up to the first one missing or not whole (a record
    that cannot be read, a shard file missing or of another size than its count: a stray edit, a copy
    gone wrong), which is said; that shard and those after it are tokenized again."""
    records = []
    while (path := folder / f"{len(records):06d}.json").is_file():
        if (record := finished_shard(path, np.dtype(dtype).itemsize, splits)) is None:
            log.warning("%s or its token files are not whole; tokenizing again from that shard on", path)
            break
        records.append(record)
    return records


def finished_shard(record_file: Path, itemsize: int, splits: tuple[str, ...] = SPLITS) -> dict | None:
    """A shard's record, if it can be read and its token files hold the tokens it counts; else None."""
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or "position" not in record:
        return None
    if not all(isinstance(record.get(key), int) and record[key] >= 0 for key in COUNTS):
        return None
    for split in splits:
        tokens = record_file.with_name(f"{record_file.stem}.{split}.bin")
        if not tokens.is_file() or tokens.stat().st_size != record[f"{split}_tokens"] * itemsize:
            return None
    return record


def cut_shards(corpus: Corpus, first: int, position: dict | None, shard_chars: int) -> Iterator[Shard]:
    walk = corpus.walk(copy.deepcopy(position))
    items, size, index = [], 0, first
    for batch in walk:
        items += batch
        size += sum(len(item[1]) for item in batch)
        if size >= shard_chars:
            yield Shard(index, items, copy.deepcopy(walk.position))
            items, size, index = [], 0, index + 1
    if items:
        yield Shard(index, items, copy.deepcopy(walk.position))


def encode_corpus(
    corpus: Corpus,
    tokenizer: Tokenizer,
    can_split: bool,
    folder: Path,
    dtype: str,
    num_proc: int,
    shard_chars: int = SHARD_CHARS,
    progress: Callable[[dict], None] | None = None,
    splits: tuple[str, ...] = SPLITS,
) -> dict[str, int]:
    """Tokenize the corpus (those of its splits named) into shard files under folder, going on after the
    shards already recorded there; returns the total counts."""
    folder.mkdir(parents=True, exist_ok=True)
    records = read_records(folder, dtype, splits)
    if records:
        log.info("resuming: %d shards already tokenized", len(records))
    shards = cut_shards(corpus, len(records), records[-1]["position"] if records else None, shard_chars)
    args = (tokenizer.to_str(), folder, dtype, can_split, splits)

    def finish(shard: Shard, counts: dict[str, int]) -> None:
        record = {"index": shard.index, **counts, "position": shard.position}
        write_json(folder / f"{shard.index:06d}.json", record)
        records.append(record)
        if progress is not None:
            progress(record)

    head = list(itertools.islice(shards, 2))
    if num_proc <= 1 or len(head) < 2:  # one shard (or one process): encode here, on all cores
        encode_here(itertools.chain(head, shards), args, finish)
    else:
        encode_in_workers(itertools.chain(head, shards), num_proc, args, finish)
    return {key: sum(r[key] for r in records) for key in COUNTS}


def encode_here(shards: Iterator[Shard], args: tuple, finish: Callable[[Shard, dict[str, int]], None]) -> None:
    """Each shard encoded in this process, one after another."""
    encode = ShardEncoder(*args)
    for shard in shards:
        finish(shard, encode(shard.index, shard.items))


def encode_in_workers(
    shards: Iterator[Shard], num_proc: int, args: tuple, finish: Callable[[Shard, dict[str, int]], None]
) -> None:
    """Each shard encoded by a worker process, and finished in order: as soon as it and those before it
    are done. About two shards per worker are in flight, no more, which bounds the memory they hold."""
    with WorkerPool(num_proc, args) as pool:
        pending: deque[tuple[Shard, Future]] = deque()
        for shard in shards:
            pending.append((shard, pool.submit(encode_in_worker, shard.index, shard.items)))
            while len(pending) > 2 * num_proc or (pending and pending[0][1].done()):
                done, future = pending.popleft()
                finish(done, future.result())
        while pending:
            done, future = pending.popleft()
            finish(done, future.result())


def join_shards(folder: Path, count: int, target: Path, names: dict[str, str] | None = None) -> None:
    """Concatenate the shards' files, in order, into target/train.bin and target/val.bin (or, given
    names, each split named there into the file it names)."""
    for split, name in (names or {split: f"{split}.bin" for split in SPLITS}).items():
        with open(target / name, "wb") as out:
            for index in range(count):
                with open(folder / f"{index:06d}.{split}.bin", "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 24)


# ---- worker processes ------------------------------------------------------------------------------

_encoder: ShardEncoder | None = None
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WATCH_SECONDS = 1.0


def start_worker(parent: int, *args) -> None:
    global _encoder
    end_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the reading process's to handle
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _encoder = ShardEncoder(*args)


def end_with_parent(parent: int) -> None:
    """Make this worker die with the process `parent` that started it, however that ends: killed
    outright, it cannot shut its pool down, and a worker left behind would wait for work forever.

    On Linux the kernel sends SIGKILL when the parent goes (prctl's parent-death signal, strictly when
    the thread that forked this worker ends: the one that made the pool, which keeps it until shutdown);
    elsewhere a thread looks every WATCH_SECONDS. A parent that died before either was in place is
    noticed now, since this worker then has another parent already."""
    if not (sys.platform.startswith("linux") and set_death_signal(signal.SIGKILL)):
        threading.Thread(target=watch_parent, args=(parent,), name="watch-parent", daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


def set_death_signal(sig: int) -> bool:
    """The signal this process gets when its parent dies (Linux); False where that cannot be set."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_SECONDS)
    os._exit(1)


def encode_in_worker(index: int, items: list[Item]) -> dict[str, int]:
    return _encoder(index, items)


class WorkerPool:
    """A process pool whose workers each encode on one thread. Forked where that is safe to do (Linux),
    so workers start at once; `tokenizers` is told before the fork, so it neither warns nor deadlocks."""

    def __init__(self, num_proc: int, args: tuple):
        method = "fork" if sys.platform.startswith("linux") else "spawn"
        previous = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            context = multiprocessing.get_context(method)
            self.pool = ProcessPoolExecutor(
                num_proc, mp_context=context, initializer=start_worker, initargs=(os.getpid(), *args)
            )
            self.pool.submit(int).result()  # with fork, every worker starts now, while the setting above holds
        finally:
            if previous is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = previous

    def __enter__(self) -> ProcessPoolExecutor:
        return self.pool

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
