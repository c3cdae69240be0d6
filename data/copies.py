"""What a model copied: the spans of a generated text that occur word for word in its training text.

A token cache entry (data.cache) gets a copy index, built once from its train.bin and kept beside it:

    tokens/<key>/               the entry (train.bin, tokenizer.json, meta.json, ...)
    tokens/<key>.copies/        its copy index
        suffixes.bin            every position of train.bin, sorted by the first DEPTH tokens that start
                                there (a suffix array cut at DEPTH); uint32 (n,)
        marks.bin               (chars, newlines, separators) before every MARK_EVERY-th token; int64 (n_marks, 3)
        starts.bin              where each document begins (0, and after each separator); uint32 (documents,)
        files.json              the run's training files, each with its number of documents (made the first
                                time a run's data settings are given, from its files; absent otherwise)
        meta.json               what it was built from (written last)

Beside the entry, not in it: an entry is finished when it is renamed into place and only read after,
and a copy index is made later, by the first lookup, so it must not change the entry; the entry's key
still names it. It is built in `<key>.copies.partial` and renamed into place, whole or not at all, by one
process at a time (a lock in tokens/.locks, as for the entry; others wait and read). A cache that
cannot be written (a shared, read-only one) gets its index in a folder of this user's under the
system's temporary folder instead (TEMP_INDEXES), said in one line.

Opening checks it cheaply: meta.json against the entry (its key, its number of tokens and their dtype,
DEPTH, the format, a hash of a few blocks of train.bin and of its tokenizer), the files' sizes, and a
spot check (SPOT_CHECKS random neighbours in the suffix array really are in order; a few marks really
are the sums of the tokens between them). A damaged or stale index is named in one warning and built
again. A lookup also checks what it answers (the span is in train.bin where it says) and, should it not
be, rebuilds and looks again: a damaged index never answers.

Finding: for every start i of the generated ids, a binary search (all starts at once, vectorized) finds
where ids[i:i+DEPTH] would go among the sorted suffixes; its neighbours there share the longest prefix
with it. A match of DEPTH tokens goes on among the suffixes that share those DEPTH tokens, by reading
train.bin after them. Where a span occurs in the training text comes from the marks and the
MARK_EVERY-or-fewer tokens after one, with each token's text measured once from the tokenizer; the
file it is in, from the document it is in and files.json.

Building takes about 42 bytes of memory per token of train.bin at its peak, and about 1.2 s per million
tokens on two shared cores (bench/copies.py measures both: bench/README.md); 100M tokens take 4.1 GiB
and two minutes. The index takes 4 bytes a token on disk.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.cache import DamagedEntry, entry_lock, hold, let_go, open_cache, write_json
from data.errors import DataError
from data.tokenizer import EOT

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: starts.bin, the documents' first positions
DEPTH = 64  # suffixes are sorted by at most this many tokens; longer matches are read from train.bin
MARK_EVERY = 1024  # tokens between the stored (chars, newlines, separators) counts
MAX_TOKENS = 2**32 - 2  # positions and ranks are uint32; a rank pair, (n + 1) ** 2 at most, fits a uint64
SPOT_CHECKS = 64  # neighbouring suffixes compared when an index is opened
SAMPLE_BLOCKS, BLOCK_BYTES = 16, 4096  # train.bin is fingerprinted by this many blocks of it
NOTHING = -1  # past the end of train.bin: before every token, as a shorter suffix sorts first
NO_TOKEN = -2  # an id that is no token of the vocabulary: it matches nothing
TEMP_INDEXES = Path(tempfile.gettempdir()) / f"tinygpt2-{os.getuid()}-copies"  # for a cache that cannot be written


class DamagedIndex(Exception):
    """A copy index whose files do not match what its meta.json or its entry say."""

    def __init__(self, folder: Path, why: str):
        super().__init__(f"the copy index {folder} is damaged or out of date: {why}")


@dataclass
class Copy:
    start: int  # first token of the span in the generated ids
    end: int  # one past its last token
    occurrences: int  # how many times it occurs in train.bin
    train_position: int  # token position in train.bin of its earliest occurrence
    char_offset: int  # that occurrence's character offset in the training split's text (separators take none)
    line: int  # its line there, from 1
    document: int | None  # its document (<|endoftext|> separators before it), from 0; None without separators
    line_in_document: int | None = None  # its line in that document, from 1 (in the file, for a file of one document)
    file: str | None = None  # the training file that holds it, where the run's files are known
    document_in_file: int | None = None  # its document among that file's, from 0
    documents_in_file: int | None = None  # how many documents that file holds (None: not counted)


# ---- opening ---------------------------------------------------------------------------------------


def open_copy_index(cache_dir: str | os.PathLike, cache_key: str, source=None) -> CopyIndex:
    """The copy index of a token cache entry: opened, or built first (minutes for a large corpus).
    `source` (data.sources.Source, from source_of_entry): the entry's text, whose files then name
    where each span is."""
    index = find_or_build(Path(cache_dir).expanduser() / "tokens", cache_key)
    if source is not None and source.train_files:
        index.attach_files(source)
    return index


def find_or_build(tokens: Path, cache_key: str) -> CopyIndex:
    entry = open_entry(tokens, cache_key)
    beside = tokens / f"{cache_key}.copies"
    if (found := open_index(beside, entry)) is not None:
        return found
    root = tokens if os.access(tokens, os.W_OK) else TEMP_INDEXES
    if root is TEMP_INDEXES:
        log.info("the token cache %s cannot be written: the copy index goes in %s", tokens, root)
        if (found := open_index(root / beside.name, entry)) is not None:
            return found
    return build_index(root, cache_key, entry)


def source_of_entry(data_cfg, tokenizer_cfg, cache_key: str):
    """The source of a run's text (data.sources.Source) if its files are still the ones the entry
    was tokenized from (their key is the entry's); None otherwise, or for a text that is not local
    files (a Hub dataset, Tiny Shakespeare from the cache: nothing is looked up or downloaded)."""
    from data.prepare import corpus_key

    if data_cfg.get("source") not in ("text", "shakespeare") or not data_cfg.get("path"):
        return None
    try:
        source, key = corpus_key(data_cfg, tokenizer_cfg)
    except (DataError, OSError):  # the files are gone or renamed
        return None
    return source if key == cache_key else None


def open_entry(tokens: Path, key: str):
    """The entry indexed, checked as every entry is when opened."""
    try:
        entry = open_cache(tokens / key)
    except DamagedEntry as err:
        raise DataError(f"{err}; run train.py with the same data to prepare it again") from None
    if entry is None:
        raise DataError(f"the token cache has no entry {key} in {tokens}: it was deleted, or is in another cache_dir")
    return entry


def open_index(folder: Path, entry, quiet: bool = False) -> CopyIndex | None:
    """The index in folder, checked; None where there is none, or it is damaged (said unless quiet)."""
    if not folder.exists():
        return None
    try:
        return CopyIndex(folder, entry)
    except DamagedIndex as err:
        if not quiet:
            log.warning("%s; building it again", err)
        return None


def build_index(root: Path, key: str, entry, damaged: bool = False) -> CopyIndex:
    """Build the index in root/<key>.copies.partial and rename it into place, under its lock (unless
    another process built it while this one waited; `damaged`: the one there now is no good)."""
    folder, staging = root / f"{key}.copies", root / f"{key}.copies.partial"
    lock = entry_lock(root, f"{key}.copies")
    hold(lock, f"another process is building the copy index; waiting for it ({staging})")
    try:
        if not damaged and (done := open_index(folder, entry, quiet=True)) is not None:
            return done
        log.info("building the copy index of %s (once: later lookups reuse it) in %s", entry.folder, folder)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            write_index(staging, entry)
        except BaseException:  # a full disk, a refusal, a stop: nothing half-made stays
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    finally:
        let_go(lock)
    return CopyIndex(folder, entry)


def expected_meta(entry) -> dict[str, Any]:
    """What an index's meta.json must say to be the index of this entry as it is now."""
    train = entry.folder / "train.bin"
    return {
        "format": FORMAT_VERSION,
        "entry": entry.key,
        "train_tokens": entry.meta["train_tokens"],
        "dtype": entry.meta["dtype"],
        "train_bytes": train.stat().st_size,
        "train_sample_sha256": sample_hash(train),
        "tokenizer_sha256": entry.meta["tokenizer_sha256"],
        "depth": DEPTH,
        "mark_every": MARK_EVERY,
    }


def sample_hash(path: Path) -> str:
    """A hash of SAMPLE_BLOCKS blocks spread over the file, its last one included: cheap, and changed by
    any other preparation of the entry."""
    size, digest = path.stat().st_size, hashlib.sha256()
    with open(path, "rb") as file:
        for k in range(SAMPLE_BLOCKS):
            file.seek(max(0, (size - BLOCK_BYTES) * k // (SAMPLE_BLOCKS - 1)))
            digest.update(file.read(BLOCK_BYTES))
    return digest.hexdigest()


# ---- building --------------------------------------------------------------------------------------


def write_index(folder: Path, entry) -> None:
    """The index's files in folder, meta.json last."""
    train = entry.ids("train")  # (n,) uint16 or uint32, memory-mapped
    if len(train) > MAX_TOKENS:
        raise DataError(f"the copy index takes at most {MAX_TOKENS:,} training tokens; this entry has {len(train):,}")
    table = token_table(entry.tokenizer_json)
    suffixes = sort_suffixes(train, DEPTH, len(table))
    suffixes.tofile(folder / "suffixes.bin")
    del suffixes
    count_marks(train, table).tofile(folder / "marks.bin")
    starts = document_starts(train, table)
    starts.astype(position_dtype(len(train))).tofile(folder / "starts.bin")
    meta = expected_meta(entry) | {
        "positions": position_dtype(len(train)).name,
        "documents": len(starts),
        "source": entry.meta.get("source"),
    }
    write_json(folder / "meta.json", meta)


def position_dtype(n: int) -> np.dtype:
    return np.dtype(np.uint32)  # n <= MAX_TOKENS


def sort_suffixes(tokens: np.ndarray, depth: int, vocab_size: int) -> np.ndarray:
    """(n,) positions of tokens sorted by the first `depth` tokens from each (prefix doubling).

    Ranks first come from a few tokens packed into one uint64; then each round sorts the suffixes not yet
    told apart by (rank of the first h tokens, rank of the h tokens after), doubling h up to depth.
    A suffix's rank is where its group (those equal so far) starts in the order.
    """
    n, width = len(tokens), int(vocab_size).bit_length()  # bits for token + 1 (0: past the end)
    packed = min(depth, 64 // width)
    keys = packed_keys(tokens, packed, width)  # (n,) uint64
    order = np.argsort(keys, kind="stable").astype(position_dtype(n))
    keys = keys[order]
    rank = np.empty(n, dtype=position_dtype(n))
    rank[order] = group_starts(keys)
    del keys
    sorted_by = packed
    while sorted_by < depth and n > 1:
        step = min(sorted_by, depth - sorted_by)  # ranks at i and i + step cover the first sorted_by + step
        if not refine(order, rank, step):
            break  # every suffix told apart already
        sorted_by += step
    return order


def packed_keys(tokens: np.ndarray, count: int, width: int) -> np.ndarray:
    """(n,) uint64: tokens i .. i+count-1, each plus one, `width` bits apiece (0 past the end); made a
    chunk at a time, so that nothing but the keys takes 8 bytes a token."""
    n, chunk = len(tokens), 1 << 22
    keys = np.zeros(n, dtype=np.uint64)
    for begin in range(0, n, chunk):
        ahead = np.asarray(tokens[begin : begin + chunk + count]).astype(np.uint64) + np.uint64(1)
        part = keys[begin : begin + chunk]  # a view: filled in place
        for j in range(count):
            part <<= np.uint64(width)
            taken = ahead[j : j + len(part)]
            part[: len(taken)] |= taken
    return keys


def group_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """(n,) for each place in a sorted array, where its run of equal keys starts."""
    n = len(sorted_keys)
    starts = np.arange(n, dtype=position_dtype(n))
    starts[1:][sorted_keys[1:] == sorted_keys[:-1]] = 0
    return np.maximum.accumulate(starts, out=starts)


def refine(order: np.ndarray, rank: np.ndarray, step: int) -> bool:
    """Sort each group of equal ranks by the rank `step` tokens on, in place; False if none had two."""
    shared = tied_places(order, rank)
    if len(shared) == 0:
        return False
    suffix = order[shared]  # positions still tied
    keys = pair_keys(suffix, rank, step)
    resort = np.argsort(keys, kind="stable")
    keys = keys[resort]
    suffix = suffix[resort]
    del resort
    order[shared] = suffix
    rank[suffix] = shared[group_starts(keys)]
    return True


def tied_places(order: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """(k,) the places in the order whose group has two suffixes or more."""
    start = rank[order]  # (n,) group start of each place
    shared = np.zeros(len(order), dtype=bool)
    shared[1:] = start[1:] == start[:-1]
    del start
    shared[:-1] |= shared[1:]
    return np.flatnonzero(shared).astype(order.dtype)


def pair_keys(suffix: np.ndarray, rank: np.ndarray, step: int) -> np.ndarray:
    """(k,) uint64: rank of each suffix, then rank + 1 of the suffix step tokens on (0 past the end)."""
    n, chunk = len(rank), 1 << 22
    keys = np.empty(len(suffix), dtype=np.uint64)
    for begin in range(0, len(suffix), chunk):
        part = suffix[begin : begin + chunk].astype(np.int64)
        after = part + step
        later = np.where(after < n, rank[np.minimum(after, n - 1)].astype(np.uint64) + np.uint64(1), np.uint64(0))
        keys[begin : begin + chunk] = rank[part].astype(np.uint64) * np.uint64(n + 1) + later
    return keys


def count_marks(tokens: np.ndarray, table: np.ndarray) -> np.ndarray:
    """(n // MARK_EVERY + 1, 3) int64: chars begun, newlines and separators before token k * MARK_EVERY."""
    n, chunk = len(tokens), MARK_EVERY * 1024
    marks = [np.zeros((1, 3), dtype=np.int64)]
    for begin in range(0, n, chunk):
        ids = np.asarray(tokens[begin : begin + chunk])
        counts = table[ids, :3]  # (chunk, 3)
        whole = len(ids) // MARK_EVERY * MARK_EVERY
        marks.append(counts[:whole].reshape(-1, MARK_EVERY, 3).sum(axis=1))
    sums = np.cumsum(np.concatenate(marks), axis=0)
    return sums[: n // MARK_EVERY + 1]


def document_starts(tokens: np.ndarray, table: np.ndarray) -> np.ndarray:
    """(documents,) int64: where each document of tokens begins: 0, and after each separator."""
    separator, chunk = np.flatnonzero(table[:, 2]), MARK_EVERY * 1024
    starts = [np.zeros(1, dtype=np.int64)]
    for begin in range(0, len(tokens), chunk) if len(separator) else []:
        starts.append(np.flatnonzero(np.asarray(tokens[begin : begin + chunk]) == separator[0]) + begin + 1)
    return np.concatenate(starts)


# ---- the text of each token ------------------------------------------------------------------------


def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet read back: the character that stands for each byte in a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    for extra, byte in enumerate(b for b in range(256) if b not in chars):
        chars[byte] = chr(256 + extra)
    return {char: byte for byte, char in chars.items()}


def token_bytes(tokenizer_json: str) -> list[bytes]:
    """Each token's UTF-8 bytes in the text: exact for byte-level BPE and for one token per character;
    for another kind of tokenizer, what decoding the token alone gives. <|endoftext|> separates, and
    has none; another special token (the char tokenizer's <|unk|>) stands for one character."""
    from tokenizers import Tokenizer

    tokenizer, spec = Tokenizer.from_str(tokenizer_json), json.loads(tokenizer_json)
    decoder = json.dumps(spec.get("decoder"))
    bytes_of = byte_of_char()
    special = {t["id"]: t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    texts = []
    for token_id in range(tokenizer.get_vocab_size()):
        piece = tokenizer.id_to_token(token_id) or ""
        if token_id in special:
            texts.append(b"" if special[token_id] == EOT else "\ufffd".encode())
        elif '"ByteLevel"' in decoder:
            texts.append(bytes(bytes_of.get(char, ord("?")) for char in piece))
        elif spec.get("decoder") is None:
            texts.append(piece.encode("utf-8"))
        else:
            texts.append(tokenizer.decode([token_id]).encode("utf-8"))
    return texts


def token_table(tokenizer_json: str) -> np.ndarray:
    """(vocab, 4) int64 per token: characters that begin in it, newlines, 1 for the separator, and 1
    where it begins inside a character (a byte-level token holding the end of one)."""
    from tokenizers import Tokenizer

    texts = token_bytes(tokenizer_json)
    table = np.zeros((len(texts), 4), dtype=np.int64)
    for token_id, text in enumerate(texts):
        continuing = sum(1 for byte in text if byte & 0xC0 == 0x80)  # UTF-8's continuation bytes
        table[token_id] = (len(text) - continuing, text.count(b"\n"), 0, bool(text) and text[0] & 0xC0 == 0x80)
    eot = Tokenizer.from_str(tokenizer_json).token_to_id(EOT)
    if eot is not None:
        table[eot, 2] = 1
    return table


# ---- the index -------------------------------------------------------------------------------------


class CopyIndex:
    """An entry's copy index, memory-mapped and checked; `find` looks a generated text up."""

    def __init__(self, folder: Path, entry):
        self.folder, self.entry = folder, entry
        self.meta = read_meta(folder)
        check_meta(folder, self.meta, expected_meta(entry))
        self.tokens = entry.ids("train")  # (n,) memory-mapped
        self.n = len(self.tokens)
        self.suffixes = mapped(folder / "suffixes.bin", np.dtype(self.meta["positions"]), (self.n,))
        self.marks = mapped(folder / "marks.bin", np.dtype(np.int64), (self.n // MARK_EVERY + 1, 3))
        self.table = token_table(entry.tokenizer_json)
        self.has_separator = bool(self.table[:, 2].any())
        documents = self.meta.get("documents")
        if not isinstance(documents, int) or not 1 <= documents <= self.n + 1:
            raise DamagedIndex(folder, "meta.json names no number of documents")
        self.starts = mapped(folder / "starts.bin", np.dtype(self.meta["positions"]), (documents,))
        self.source = entry.meta.get("source")
        self.files: list[tuple[str, int | None]] = []  # the training files and their documents (attach_files)
        self.firsts: list[int] = []  # (len(files),) the first document of each
        self.spot_check(np.random.default_rng())

    def spot_check(self, rng: np.random.Generator) -> None:
        """Random neighbours in the suffix array are in order; random marks are the sums they say."""
        if self.n > 1:
            picks = rng.integers(0, self.n - 1, size=SPOT_CHECKS)
            first, second = self.suffixes[picks].astype(np.int64), self.suffixes[picks + 1].astype(np.int64)
            if (first >= self.n).any() or (second >= self.n).any() or (first == second).any():
                raise DamagedIndex(self.folder, "suffixes.bin holds positions that are not in train.bin")
            a, b = self.windows(first, DEPTH), self.windows(second, DEPTH)
            if (is_before(b, a, np.full(len(a), DEPTH), upper=False)).any():
                raise DamagedIndex(self.folder, "suffixes.bin is not in order")
        for k in rng.integers(0, len(self.marks) - 1, size=4) if len(self.marks) > 1 else []:
            ids = np.asarray(self.tokens[k * MARK_EVERY : (k + 1) * MARK_EVERY])
            if (self.marks[k + 1] - self.marks[k] != self.table[ids, :3].sum(axis=0)).any():
                raise DamagedIndex(self.folder, "marks.bin does not count the tokens it marks")
        tail = np.asarray(self.tokens[(len(self.marks) - 1) * MARK_EVERY :])
        separators = int(self.marks[-1, 2] + self.table[tail, 2].sum())
        picks = rng.integers(1, len(self.starts), size=4) if len(self.starts) > 1 else []
        if (
            separators != len(self.starts) - 1
            or self.starts[0] != 0
            or any(
                not 0 < self.starts[k] <= self.n or not self.table[int(self.tokens[int(self.starts[k]) - 1]), 2]
                for k in picks
            )
        ):
            raise DamagedIndex(self.folder, "starts.bin does not hold where the documents begin")

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """(len(starts), width) int64: the tokens from each start, NOTHING past the end."""
        where = starts[:, None] + np.arange(width)
        inside = where < self.n
        found = np.asarray(self.tokens[np.minimum(where, self.n - 1)]).astype(np.int64)
        return np.where(inside, found, NOTHING)

    def find(self, ids: Sequence[int], min_tokens: int = 8) -> list[Copy]:
        """Every maximal span of ids of min_tokens tokens or more that occurs in train.bin, by start."""
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be 1 or more, got {min_tokens}")
        try:
            return self.checked(find_spans(self, as_query(ids, len(self.table)), min_tokens), ids)
        except DamagedIndex as err:
            log.warning("%s; building it again", err)
            again = build_index(self.folder.parent, self.entry.key, self.entry, damaged=True)
            self.__dict__.update({**again.__dict__, "files": self.files, "firsts": self.firsts})
            return self.checked(find_spans(self, as_query(ids, len(self.table)), min_tokens), ids)

    def checked(self, found: list[Copy], ids: Sequence[int]) -> list[Copy]:
        """The spans found, each seen in train.bin where the index says it is."""
        for copy in found:
            at = np.asarray(self.tokens[copy.train_position : copy.train_position + copy.end - copy.start])
            if not np.array_equal(at, np.asarray(ids[copy.start : copy.end])):
                raise DamagedIndex(self.folder, f"a span it found is not at train position {copy.train_position}")
        return found

    def locate(self, position: int) -> tuple[int, int, int | None]:
        """(character offset, line from 1, document from 0) of a train.bin position."""
        mark = position // MARK_EVERY
        head = np.asarray(self.tokens[mark * MARK_EVERY : position])
        chars, newlines, separators = self.marks[mark] + self.table[head, :3].sum(axis=0)
        chars -= self.table[int(self.tokens[position]), 3]  # begun inside a character: that character's offset
        return int(chars), int(newlines) + 1, int(separators) if self.has_separator else None

    def in_document(self, position: int, line: int, document: int | None) -> dict[str, Any]:
        """Copy's fields for the place of a train.bin position (on that line, in that document): its
        line in the document, and the file and the document of the file it is in (where attach_files
        named the files)."""
        if document is None:
            return {}
        start, end = (
            int(self.starts[document]),
            int(self.starts[document + 1]) if document + 1 < len(self.starts) else self.n,
        )
        if not start <= position < end:
            raise DamagedIndex(self.folder, f"starts.bin does not hold where document {document} begins")
        place = {"line_in_document": line - self.locate(start)[1] + 1}
        if self.files:
            k = bisect.bisect_right(self.firsts, document) - 1
            path, count = self.files[k]
            place |= {"file": path, "document_in_file": document - self.firsts[k], "documents_in_file": count}
        return place

    def attach_files(self, source) -> None:
        """Name the training file of each document: files.json, made once from the source's files (a
        corpus of several files is read once to count their documents)."""
        path = self.folder / "files.json"
        files = saved_files(path, self.entry.key, source.train_files)
        if files is None:
            try:
                files = count_files(source, len(self.starts))
            except (DataError, OSError) as err:
                log.warning("the training files' documents cannot be counted (%s); spans are placed by document", err)
                return
            with contextlib.suppress(OSError):  # (kept in memory only where the folder cannot be written)
                write_json(path, {"entry": self.entry.key, "files": files})
        counts = [c or 0 for _, c in files]
        if len(files) > 1 and sum(counts) < len(self.starts):
            log.warning(
                "%s does not count the %d training documents; spans are placed by document", path, len(self.starts)
            )
            return
        self.files, self.firsts = files, list(itertools.accumulate(counts, initial=0))[:-1]


def saved_files(path: Path, key: str, train_files: list[str]) -> list[tuple[str, int | None]] | None:
    """files.json's files and counts, if it is this entry's and names these files, each with a count."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        files = [(f, c) for f, c in saved["files"]] if saved.get("entry") == key else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    counted = all(c is None or (type(c) is int and c >= 0) for _, c in files)
    return files if counted and [f for f, _ in files] == train_files else None


def count_files(source, documents: int) -> list[tuple[str, int | None]]:
    """Each training file with its number of documents (None: one file of several, not counted)."""
    if len(source.train_files) == 1:  # nothing to read: every document is in it
        return [(source.train_files[0], 1 if documents == 1 else None)]
    return [(f, source.count_documents(f)) for f in source.train_files]


def read_meta(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DamagedIndex(folder, "meta.json is missing") from None
    except (OSError, ValueError) as err:
        raise DamagedIndex(folder, f"meta.json cannot be read ({type(err).__name__})") from None
    if not isinstance(meta, dict) or meta.get("positions") not in ("uint32", "uint64"):
        raise DamagedIndex(folder, "meta.json names no position dtype")
    return meta


def check_meta(folder: Path, meta: dict[str, Any], expected: dict[str, Any]) -> None:
    for name, value in expected.items():
        if meta.get(name) != value:
            raise DamagedIndex(folder, f"meta.json has {name} {meta.get(name)!r} where the entry now has {value!r}")


def mapped(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The file memory-mapped, after checking that its size is what the shape takes."""
    size = int(np.prod(shape)) * dtype.itemsize
    if not path.is_file():
        raise DamagedIndex(path.parent, f"{path.name} is missing")
    if path.stat().st_size != size:
        raise DamagedIndex(
            path.parent, f"{path.name} holds {path.stat().st_size:,} bytes where it should hold {size:,}"
        )
    return np.zeros(shape, dtype=dtype) if size == 0 else np.memmap(path, dtype=dtype, mode="r", shape=shape)


def as_query(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """(m,) int64 ids; an id outside the vocabulary becomes NO_TOKEN, which matches nothing."""
    query = np.asarray(list(ids), dtype=np.int64)
    return np.where((query >= 0) & (query < vocab_size), query, NO_TOKEN)


# ---- finding ---------------------------------------------------------------------------------------


def find_spans(index: CopyIndex, query: np.ndarray, min_tokens: int) -> list[Copy]:
    """The maximal spans of query (m,) found in train.bin, with min_tokens tokens or more."""
    m = len(query)
    if m < min_tokens or index.n == 0:
        return []
    patterns, lengths = prefixes(query)  # (m, DEPTH), (m,)
    low = bound(index, patterns, lengths, upper=False)
    short = neighbour_match(index, patterns, lengths, low)  # (m,) the longest match, up to DEPTH
    deep = np.flatnonzero((short == DEPTH) & (np.arange(m) + DEPTH < m))  # matches that may go on
    high = dict(zip(deep.tolist(), bound(index, patterns[deep], lengths[deep], upper=True).tolist(), strict=True))
    spans = [s for s in maximal_spans(index, query, short, low, high) if s[1] - s[0] >= min_tokens]
    shallow = [s for s in spans if s[2] is None]
    starts = np.array([s[0] for s in shallow], dtype=np.int64)
    sizes = np.array([s[1] - s[0] for s in shallow], dtype=np.int64)
    firsts = bound(index, patterns[starts], sizes, upper=False)
    lasts = bound(index, patterns[starts], sizes, upper=True)
    counted = {s[0]: index.suffixes[a:b].astype(np.int64) for s, a, b in zip(shallow, firsts, lasts, strict=True)}
    found = []
    for start, end, members in spans:
        members = counted[start] if members is None else members
        position = int(members.min())
        chars, line, document = index.locate(position)
        place = index.in_document(position, line, document)
        found.append(Copy(start, end, len(members), position, chars, line, document, **place))
    return found


def prefixes(query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(m, DEPTH) the DEPTH ids from each start (NOTHING past the end), and (m,) how many are ids."""
    m = len(query)
    padded = np.concatenate([query, np.full(DEPTH, NOTHING, dtype=np.int64)])
    return np.lib.stride_tricks.sliding_window_view(padded, DEPTH)[:m], np.minimum(DEPTH, m - np.arange(m))


def is_before(window: np.ndarray, patterns: np.ndarray, lengths: np.ndarray, upper: bool) -> np.ndarray:
    """(r,) whether each suffix's window (r, w) sorts before its pattern's first `lengths` ids (upper:
    or begins with them)."""
    differ = (window != patterns) & (np.arange(window.shape[1]) < lengths[:, None])
    some = differ.any(axis=1)
    rows, first = np.arange(len(window)), differ.argmax(axis=1)
    less = some & (window[rows, first] < patterns[rows, first])
    return less | ~some if upper else less


def bound(index: CopyIndex, patterns: np.ndarray, lengths: np.ndarray, upper: bool) -> np.ndarray:
    """(r,) for each pattern, the first place in the suffix array whose suffix does not sort before its
    first `lengths` ids (upper: nor begins with them); all r binary searches at once."""
    r, n = len(patterns), index.n
    low, high = np.zeros(r, dtype=np.int64), np.full(r, n, dtype=np.int64)
    while (active := low < high).any():
        middle = (low + high) // 2
        starts = index.suffixes[np.minimum(middle, n - 1)].astype(np.int64)
        right = is_before(index.windows(starts, patterns.shape[1]), patterns, lengths, upper)
        low = np.where(active & right, middle + 1, low)
        high = np.where(active & ~right, middle, high)
    return low


def matching_run(window: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """(r,) how many ids from the left each row of window (r, w) shares with pattern ((w,) or (r, w))."""
    same = window == pattern
    return np.where(same.all(axis=1), window.shape[1], same.argmin(axis=1))


def neighbour_match(index: CopyIndex, patterns: np.ndarray, lengths: np.ndarray, low: np.ndarray) -> np.ndarray:
    """(m,) the longest prefix of each pattern that train.bin holds: the longer of its matches with the
    two suffixes around where it would be sorted in (at either end, the two there). Those two must be
    two, and in order: a lookup reads a damaged index no further."""
    n = index.n
    first = np.clip(low - 1, 0, max(n - 2, 0))
    starts = index.suffixes[first].astype(np.int64), index.suffixes[np.minimum(first + 1, n - 1)].astype(np.int64)
    windows = index.windows(starts[0], DEPTH), index.windows(starts[1], DEPTH)
    unordered = is_before(windows[1], windows[0], np.full(len(low), DEPTH), upper=False) | (starts[0] == starts[1])
    if n > 1 and unordered.any():
        raise DamagedIndex(index.folder, "suffixes.bin is not in order where a lookup read it")
    runs = [np.minimum(matching_run(window, patterns), lengths) for window in windows]
    return np.maximum(*runs)


def maximal_spans(index: CopyIndex, query: np.ndarray, short: np.ndarray, low: np.ndarray, high: dict) -> list:
    """(start, end, members) of each maximal span: where the end of the longest match from a start
    goes past the one from the start before. members: train.bin positions of the whole span, where
    reading them was needed (a span longer than DEPTH), else None."""
    spans, reach = [], 0  # reach: the furthest end so far
    for i in range(len(query)):
        if i in high:
            end, members = deep_match(index, query, i, index.suffixes[low[i] : high[i]], reach)
        else:
            end, members = i + int(short[i]), None
        if end > max(reach, i):
            spans.append((i, end, members))
        reach = max(reach, end)
    return spans


def deep_match(index: CopyIndex, query: np.ndarray, i: int, group: np.ndarray, reach: int) -> tuple[int, Any]:
    """(end, positions) of the longest match from i, given the suffixes sharing its first DEPTH ids;
    (reach, None) where it ends no further than reach (the start before already went as far)."""
    members, known = group.astype(np.int64), reach - i  # the match from i is at least `known` long
    if known > DEPTH:  # only a suffix with the id at `known` can go further: the others go
        if reach >= len(query):
            return reach, None
        after = members + known
        members = members[(after < index.n) & (index.windows(after, 1)[:, 0] == query[reach])]
    length, members = extend(index, query, i, members, DEPTH)
    return (i + length, members) if i + length > reach else (reach, None)


def extend(index: CopyIndex, query: np.ndarray, i: int, members: np.ndarray, length: int) -> tuple[int, np.ndarray]:
    """The longest match of query[i:] among suffixes at `members` that share its first `length` ids,
    and those that match that far."""
    while len(members) and i + length < len(query):
        width = min(32, len(query) - i - length)
        run = matching_run(index.windows(members + length, width), query[i + length : i + length + width])
        best = int(run.max())
        members, length = members[run == best], length + best
        if best < width:
            break
    return length, members
