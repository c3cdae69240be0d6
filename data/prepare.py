"""Preparing a corpus: tokenizer, then token ids, into a staging folder that data.cache renames into place
(prepare_corpus finds or makes the entry; the Lightning data module serves windows from it).

Each step leaves its result in the staging folder (tokenizer.json, then one record per shard), so a
preparation that stops part way goes on where it stopped.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from tokenizers import Tokenizer

from data.cache import FORMAT_VERSION, TokenCache, build_cache, copy_name, find_cache, fingerprint, token_dtype
from data.corpus import Corpus
from data.errors import DataError
from data.files import count, file_stats
from data.shards import PIECE_CHARS, SHARD_CHARS, SPLITS, encode_corpus, join_shards, read_records
from data.sources import Source, changed_file, describe
from data.tokenizer import build_tokenizer, load_pretrained, pretrained_files, splits_safely, with_dropout

log = logging.getLogger(__name__)


DROPOUT_KEYS = ("dropout", "dropout_copies", "dropout_any_size")
LARGE_COPIES = 10**9  # bytes of BPE-dropout encodings beyond which preparing them says what they cost
# BPE-dropout's encodings are made only of a training split below this many characters, unless
# tokenizer.dropout_any_size: they improved validation only where the run passed over the text about
# nine times or more (Tiny Shakespeare's 1.0M training characters, the pydoc text's 0.42M; at 6 and 7.5
# passes they cost), which the default run's 4.6M tokens do up to 1.3-1.6M characters (bench/LOG.md, the
# fourth and ninth rounds and the offline fallback). Above it they tokenized the text eight times for
# no gain (bench/LOG.md, "Data preparation", 2026-11-29: 0.10 of the library's speed on 5 MB).
DROPOUT_MAX_TRAIN_CHARS = 1_500_000


def dropout_of(cfg) -> tuple[float, int]:
    """tokenizer.dropout and the number of BPE-dropout encodings of the training split it asks for
    (0.0 and 0 when it is off or unset)."""
    dropout = float(cfg.get("dropout") or 0.0)
    return (dropout, int(cfg.get("dropout_copies") or 0)) if dropout > 0 else (0.0, 0)


def tokenizer_identity(cfg, given: Tokenizer | None) -> dict[str, Any]:
    """What decides the tokens, for the cache key: the tokenizer's settings (and the files of a
    pretrained one), or the whole of a given one; and BPE-dropout's, when it is on (off, it leaves the
    key as it was before the setting existed, so entries made then are found; so does
    dropout_any_size unset, which changes no entry of a text below DROPOUT_MAX_TRAIN_CHARS)."""
    dropout = dict(zip(DROPOUT_KEYS[:2], dropout_of(cfg), strict=True))
    if dropout["dropout"] and cfg.get("dropout_any_size"):
        dropout["dropout_any_size"] = True
    if given is not None:
        return {"given": given.to_str(), **(dropout if dropout["dropout"] else {})}
    settings = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    for key in DROPOUT_KEYS:
        settings.pop(key, None)
    if dropout["dropout"]:
        settings.update(dropout)
    if settings.get("kind") == "pretrained":
        files = pretrained_files(settings.get("path"))
        if not files:  # nothing there to read: the loader's error says what is wrong with the path
            load_pretrained(settings.get("path"))
        settings["files"] = file_stats(files)
    return settings


def usable_cores() -> int:
    """The CPU cores this process may run on: those its affinity allows (a container's or a scheduler's
    share of the machine, `taskset`), which can be fewer than the machine has (os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_count(num_proc: int | None) -> int:
    """The processes that tokenize: data.num_proc, or one per CPU core, and never more than that. Each
    keeps a core busy and two shards in memory, so more would only start processes by the thousand
    (a typo's data.num_proc=10000) and hold much of the corpus in memory, for no speed."""
    cores = usable_cores()
    if num_proc is not None and num_proc > cores:
        log.info(
            "data.num_proc=%d: tokenizing with %d processes, one per CPU core this process may use", num_proc, cores
        )
    return cores if num_proc is None else min(num_proc, cores)


def prepare_tokens(
    staging: Path,
    source: Source,
    tokenizer_cfg,
    given: Tokenizer | None = None,
    num_proc: int | None = None,
    shard_chars: int | None = None,
    progress: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Build the tokenizer (unless given, or made by an earlier, stopped run) and tokenize the corpus
    into staging/{tokenizer.json, train.bin, val.bin} (and, with tokenizer.dropout, train.drop1.bin,
    ...); returns the meta of the cache entry."""
    tokenizer, corpus = staged_tokenizer(staging, source, tokenizer_cfg, given)
    dropout, copies = dropout_of(tokenizer_cfg)
    dropped = with_dropout(tokenizer, dropout) if copies else None  # refused before any text is encoded
    can_split = splits_safely(tokenizer)
    if corpus is None or not can_split:  # a tokenizer that cannot take documents in pieces reads them whole
        corpus = source.open(PIECE_CHARS if can_split else None)
    vocab_size = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab_size)
    encoding = Encoding(corpus, can_split, dtype, num_proc, shard_chars)
    shards = staging / "shards"
    counts = encoding.run(tokenizer, shards, progress)
    check_training_tokens(counts, source.label)
    meta = {"format": FORMAT_VERSION, "dtype": dtype.name, "vocab_size": vocab_size, "source": source.label, **counts}
    if copies and not dropout_pays(tokenizer_cfg, counts["train_chars"]):
        copies = 0
    if copies:
        meta.update(dropout_encodings(staging, encoding, dropped, dropout, copies, counts["train_tokens"]))
    join_shards(shards, len(read_records(shards, dtype.name)), staging)
    return meta


def staged_tokenizer(
    staging: Path, source: Source, tokenizer_cfg, given: Tokenizer | None
) -> tuple[Tokenizer, Corpus | None]:
    """The tokenizer of staging/tokenizer.json: the one an earlier, stopped run left there, else
    `given`, else one trained now (and then the corpus it was trained from, opened, else None)."""
    corpus = None
    tokenizer = kept_tokenizer(staging)
    if tokenizer is None:
        if given is not None:
            tokenizer = given
        else:
            tokenizer, corpus = train_tokenizer(source, tokenizer_cfg)
        tmp = staging / ".tokenizer.json.tmp"
        tmp.write_text(tokenizer.to_str(), encoding="utf-8")
        os.replace(tmp, staging / "tokenizer.json")
    return tokenizer, corpus


def train_tokenizer(source: Source, tokenizer_cfg) -> tuple[Tokenizer, Corpus]:
    """The tokenizer that tokenizer_cfg describes, built from the training split; and the corpus, opened
    in pieces, for encoding to read again."""
    started = time.perf_counter()
    corpus = source.open(PIECE_CHARS)
    tokenizer = build_tokenizer(tokenizer_cfg, corpus.train_texts)
    log.info(
        "tokenizer: %s, %d tokens (%.1f s)",
        tokenizer_cfg.kind,
        tokenizer.get_vocab_size(),
        time.perf_counter() - started,
    )
    return tokenizer, corpus


@dataclass(frozen=True)
class Encoding:
    """What every encoding of a corpus shares: the tokenizer's ids, and each BPE-dropout encoding."""

    corpus: Corpus
    can_split: bool  # whether long documents may be encoded in pieces (tokenizer.splits_safely)
    dtype: np.dtype
    num_proc: int | None  # data.num_proc
    shard_chars: int | None  # data.shard_chars; None: SHARD_CHARS

    def run(
        self, tokenizer: Tokenizer, folder: Path, progress: Callable[[dict], None] | None = None, splits=SPLITS
    ) -> dict[str, int]:
        """The corpus's splits named encoded by tokenizer into shards under folder; their total counts."""
        workers = worker_count(self.num_proc)
        shard_chars = self.shard_chars or SHARD_CHARS
        return encode_corpus(
            self.corpus,
            tokenizer,
            self.can_split,
            folder,
            self.dtype.name,
            workers,
            shard_chars,
            progress,
            splits=splits,
        )


def check_training_tokens(counts: dict[str, int], label: str) -> None:
    """A corpus must leave some tokens to train on: a tokenizer that covers none of its text, and a
    text too short to leave any once validation's share is taken, are refused."""
    if counts["train_tokens"] == 0 and counts["train_chars"] > 0:
        raise DataError(
            f"the tokenizer made no tokens of the {counts['train_chars']:,} training characters of {label}: "
            "its vocabulary covers none of the text; use a tokenizer that covers it (tokenizer=bpe covers any text)"
        )
    if counts["train_tokens"] == 0:
        raise DataError(
            f"{label} holds no training text: it is too short to leave any once its validation share "
            "(data.val_fraction) is taken; give a longer text"
        )


def dropout_pays(cfg, train_chars: int) -> bool:
    """Whether BPE-dropout's encodings are made of a training split of train_chars characters: below
    DROPOUT_MAX_TRAIN_CHARS, or at any size with tokenizer.dropout_any_size; said when they are not."""
    if train_chars < DROPOUT_MAX_TRAIN_CHARS or cfg.get("dropout_any_size"):
        return True
    log.info(
        "tokenizer.dropout=%s: no BPE-dropout encodings of the %s training characters; they pay only on a text "
        "below %s characters, which a run passes over many times (bench/LOG.md); tokenizer.dropout_any_size=true "
        "makes them at any size",
        cfg.get("dropout"),
        f"{train_chars:,}",
        f"{DROPOUT_MAX_TRAIN_CHARS:,}",
    )
    return False


def dropout_encodings(
    staging: Path, encoding: Encoding, dropped: Tokenizer, dropout: float, copies: int, train_tokens: int
) -> dict[str, Any]:
    """The training split encoded `copies` more times by `dropped` (BPE-dropout), into
    staging/train.drop1.bin, ...; returns what meta.json records of them."""
    if (more := copies * train_tokens * encoding.dtype.itemsize) > LARGE_COPIES:
        log.warning(
            "tokenizer.dropout=%s: its %d BPE-dropout encodings of the training split take about %.3g GB more "
            "in the token cache; a corpus this large is rarely overfitted, and tokenizer.dropout=0 makes none",
            dropout,
            copies,
            more / 1e9,
        )
    made = [encode_copy(n, staging, encoding, dropped) for n in range(1, copies + 1)]
    # names this making of the encodings, which no seed repeats: a run records it, and a resumed run
    # whose entry was made again since (deleted, another machine's cache) is told it trains on others
    recorded = {"dropout": dropout, "train_copies": made, "encodings_made": secrets.token_hex(8)}
    log.info(
        "BPE-dropout %s: the training split encoded %d more times, %s tokens each on average",
        dropout,
        copies,
        f"{round(sum(made) / copies):,}",
    )
    return recorded


def encode_copy(number: int, staging: Path, encoding: Encoding, dropped: Tokenizer) -> int:
    """The training split encoded with BPE-dropout (`dropped`, tokenizer.dropout) into
    staging/train.drop<number>.bin, through shards of its own that a stopped preparation goes on from;
    returns its number of tokens. The encoding's randomness is the tokenizer library's own (it takes no
    seed), so the encodings are made once, with the entry: every run of these settings, and a resumed
    one, trains on the same."""
    folder = staging / "copies" / str(number)
    encoding.run(dropped, folder, splits=("train",))
    records = read_records(folder, encoding.dtype.name, ("train",))
    join_shards(folder, len(records), staging, {"train": copy_name(number)})
    return sum(r["train_tokens"] for r in records)


def kept_tokenizer(staging: Path) -> Tokenizer | None:
    """The tokenizer that an earlier, stopped preparation left in staging, if it can be read. One that
    cannot (a stray edit, a copy gone wrong) is said, and goes with the shards made with it."""
    file = staging / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception:  # the library's own error for JSON it cannot read
        log.warning("%s is not a tokenizer that `tokenizers` can read; preparing these tokens from the start", file)
        shutil.rmtree(staging / "shards", ignore_errors=True)
        file.unlink()
        return None


def prepare_corpus(
    data_cfg, tokenizer_cfg, given: Tokenizer | None = None, progress: Callable[[dict], None] | None = None
) -> TokenCache:
    """The token cache entry of this data and tokenizer: found, or made now (tokenizer, then token ids).
    `given`: a ready tokenizer (e.g. a fine-tuned checkpoint's), used instead of one built from tokenizer_cfg."""
    source, key = corpus_key(data_cfg, tokenizer_cfg, given)
    cache = find_cache(data_cfg.cache_dir, key)
    if cache is not None:
        log.info("using cached tokens of %s from %s", source.label, cache.folder)
        cache.fallback = source.fallback
        return cache
    started = time.perf_counter()
    report = ProgressReport(progress)
    cache = build_cache(
        data_cfg.cache_dir, key, lambda staging: tokenize_once(staging, source, data_cfg, tokenizer_cfg, given, report)
    )
    cache.fallback = source.fallback
    if not cache.made_now:  # another process made it while this one waited
        log.info("using the tokens of %s that another process prepared, from %s", source.label, cache.folder)
        return cache
    meta = cache.meta
    log.info(
        "%s: %s training and %s validation tokens (%.1f s) in %s",
        source.label,
        f"{meta['train_tokens']:,}",
        f"{meta['val_tokens']:,}",
        time.perf_counter() - started,
        cache.folder,
    )
    return cache


def tokenize_once(
    staging: Path, source: Source, data_cfg, tokenizer_cfg, given: Tokenizer | None, report: ProgressReport
) -> dict[str, Any]:
    """build_cache's `build` for a corpus: its tokenizer and token ids in staging; the entry's meta."""
    log.info("tokenizing %s once; later runs with the same data and tokenizer reuse the result", source.label)
    meta = prepare_tokens(
        staging,
        source,
        tokenizer_cfg,
        given,
        num_proc=data_cfg.get("num_proc"),
        shard_chars=data_cfg.get("shard_chars"),  # characters per shard; smaller resumes more finely
        progress=report,
    )
    # the key names the files as they were when reading began; tokens of a file written meanwhile
    # are of no one version of it, and must not be kept under that key
    if (changed := changed_file(source)) is not None:
        raise DataError(f"{changed} changed while it was tokenized; run again once it is no longer being written")
    return meta


def corpus_key(data_cfg, tokenizer_cfg, given: Tokenizer | None = None) -> tuple[Source, str]:
    """The text's source and the key of its token cache entry, found without reading the text. The
    tokenizer first: a tokenizer.path that names nothing is said before a Hub dataset is looked up."""
    tokenizer = tokenizer_identity(tokenizer_cfg, given)
    source = describe(data_cfg)
    return source, fingerprint(source.identity, tokenizer)


class ProgressReport:
    """Called as each shard is finished: passes the record on, and logs how far tokenizing is every 10 s."""

    def __init__(self, progress: Callable[[dict], None] | None):
        self.progress, self.tokenized_chars, self.last_report = progress, 0, time.monotonic()

    def __call__(self, record: dict) -> None:
        if self.progress is not None:
            self.progress(record)
        self.tokenized_chars += record["train_chars"] + record["val_chars"]
        if time.monotonic() - self.last_report >= 10:
            log.info("tokenized %.1f M characters so far", self.tokenized_chars / 1e6)
            self.last_report = time.monotonic()


def check_sizes(cache: TokenCache, block_size: int, data_cfg=None) -> None:
    """Each split must hold at least one window of block_size + 1 tokens. `data_cfg`: the data settings,
    for the fix to name (with data.val_path, data.val_fraction decides nothing)."""
    need = block_size + 1
    val_file = data_cfg is not None and bool(data_cfg.get("val_path"))
    for split in ("train", "val"):
        have = cache.meta[f"{split}_tokens"]
        if have < need:
            if val_file:
                fix = "more text in data.path" if split == "train" else "a longer data.val_path text"
            else:
                share = "a smaller data.val_fraction" if split == "train" else "a larger data.val_fraction"
                fix = f"more text, {share}"
            raise DataError(
                f"the {split} split has {count(have, 'token')}, fewer than block_size + 1 = {need}; use {fix}, "
                "or a smaller model.block_size"
            )


UNKNOWN_SHARE_TO_WARN = 0.001  # of a split's tokens; a stray character now and then is not worth a word


def unknown_tokens(cache: TokenCache) -> str | None:
    """What to tell the user when many tokens are the tokenizer's unknown token (a word-level or char
    tokenizer that lacks what the text holds): each stands for text it lost, so the loss and bits per
    character are lower than the text's own. None when they are few or the tokenizer has none."""
    unk = json.loads(cache.tokenizer_json).get("model", {}).get("unk_token")
    unk_id = Tokenizer.from_str(cache.tokenizer_json).token_to_id(unk) if isinstance(unk, str) else None
    if unk_id is None:
        return None
    shares = {}
    for split in ("train", "val"):
        ids = cache.ids(split)
        count = int(np.count_nonzero(ids == unk_id))
        if len(ids) and count / len(ids) > UNKNOWN_SHARE_TO_WARN:
            shares[split] = (
                f"{count:,} of the {len(ids):,} {'training' if split == 'train' else 'validation'} tokens ({count / len(ids):.1%})"
            )
    if not shares:
        return None
    return (
        f"{cache.meta['source']}: {' and '.join(shares.values())} are the tokenizer's unknown token {unk}: text it has no token for, "
        "each learned as one symbol, so val/loss and val/bpc are lower than the text's own; use a tokenizer "
        "that covers the text (tokenizer=bpe covers any text)"
    )


def tokens_per_char(cache: TokenCache) -> float:
    """Validation tokens per character: converts a mean loss per token into one per character."""
    meta = cache.meta
    return meta["val_tokens"] / max(1, meta["val_chars"])
