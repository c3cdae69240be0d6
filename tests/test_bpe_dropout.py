"""BPE-dropout (tokenizer.dropout): the training split encoded again with merges skipped at random, the
encodings kept in the token cache entry, each training window drawn from one of them."""

from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer

import data.prepare
from data import DataError
from data.cache import find_cache
from data.datamodule import RandomWindows, TextDataModule
from data.prepare import corpus_key, prepare_corpus
from tests.common import (
    ROOT,
    TINY_OVERRIDES,
    assert_bit_equal,
    bpe_config,
    data_config,
    inject_faults,
    one_error_line,
    refused,
    runs_under,
    train_here,
    train_losses,
)
from tests.faults import failpoints


def dropout_entry(cache_dir, path, dropout=0.1, copies=3, **data):
    tokenizer = bpe_config(dropout=dropout, dropout_copies=copies)
    return prepare_corpus(data_config(cache_dir, path=str(path), **data), tokenizer)


def decoded(tokenizer: Tokenizer, ids: np.ndarray) -> str:
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def test_the_entry_holds_the_training_split_encoded_again_with_merges_skipped(tmp_path, small_text):
    cache = dropout_entry(tmp_path / "with", small_text, copies=3)
    plain = dropout_entry(tmp_path / "without", small_text, dropout=0.0)
    meta = cache.meta
    assert meta["dropout"] == 0.1 and len(meta["train_copies"]) == 3
    assert sorted(p.name for p in cache.folder.iterdir()) == sorted(
        ["meta.json", "tokenizer.json", "train.bin", "val.bin", "train.drop1.bin", "train.drop2.bin", "train.drop3.bin"]
    )  # the work files of the encodings are gone
    # the tokenizer, validation and the plain encoding are those of the same settings without dropout
    assert cache.tokenizer_json == plain.tokenizer_json
    assert json.loads(cache.tokenizer_json)["model"]["dropout"] is None  # generation encodes as always
    assert np.array_equal(cache.ids("val"), plain.ids("val"))
    encodings = cache.train_encodings()
    assert np.array_equal(encodings[0], plain.ids("train")) and len(encodings) == 4
    tokenizer = Tokenizer.from_str(cache.tokenizer_json)
    text = decoded(tokenizer, encodings[0])
    for ids, count in zip(encodings[1:], meta["train_copies"], strict=True):
        assert len(ids) == count
        assert decoded(tokenizer, ids) == text  # the same text, in other splits:
        assert len(ids) > len(encodings[0]) * 1.02  # skipped merges leave more, shorter tokens
    assert len({bytes(ids) for ids in encodings}) == 4  # each encoding its own


def test_off_it_leaves_the_cache_key_as_it_was(tmp_path, small_text):
    """An entry made before the setting existed is found: with dropout 0 the key ignores its settings."""
    data_cfg = data_config(tmp_path, path=str(small_text))
    (_, before) = corpus_key(data_cfg, bpe_config())
    assert corpus_key(data_cfg, bpe_config(dropout=0.0, dropout_copies=5))[1] == before
    assert corpus_key(data_cfg, bpe_config(dropout=0.1, dropout_copies=5))[1] != before
    assert (
        corpus_key(data_cfg, bpe_config(dropout=0.1, dropout_copies=6))[1]
        != corpus_key(data_cfg, bpe_config(dropout=0.1, dropout_copies=5))[1]
    )


def test_a_corpus_of_many_shards_across_processes(tmp_path, documents):
    cache = dropout_entry(tmp_path, documents, copies=2, shard_chars=100_000, num_proc=2)
    tokenizer = Tokenizer.from_str(cache.tokenizer_json)
    base, *copies = cache.train_encodings()
    for ids in copies:
        assert decoded(tokenizer, ids) == decoded(tokenizer, base)


def test_a_later_run_reads_the_same_encodings(tmp_path, small_text, caplog):
    first = dropout_entry(tmp_path, small_text)
    caplog.clear()  # (the first preparation's lines, where a train.py run before left the root logger at INFO)
    with caplog.at_level(logging.INFO):
        again = dropout_entry(tmp_path, small_text)
    assert not again.made_now and again.folder == first.folder
    assert "BPE-dropout" not in caplog.text  # found, not encoded again
    for a, b in zip(first.train_encodings(), again.train_encodings(), strict=True):
        assert np.array_equal(a, b)


def test_a_damaged_encoding_is_said_and_made_again(tmp_path, small_text, caplog):
    cache = dropout_entry(tmp_path, small_text, copies=2)
    damaged = cache.folder / "train.drop2.bin"
    damaged.write_bytes(damaged.read_bytes()[:-2])  # one token short
    with caplog.at_level(logging.WARNING):
        assert find_cache(tmp_path, cache.key) is None
    assert "train.drop2.bin holds" in caplog.text
    again = dropout_entry(tmp_path, small_text, copies=2)
    assert again.made_now and len(again.train_encodings()[2]) == again.meta["train_copies"][1]


def test_a_stopped_preparation_goes_on_with_the_encodings_it_finished(tmp_path, small_text, monkeypatch, caplog):
    inject_faults(monkeypatch, "cache_enospc:1")  # the joining fails, after every encoding
    with pytest.raises(DataError, match="is kept"):
        dropout_entry(tmp_path, small_text, copies=2)
    monkeypatch.delenv("TINYGPT2_FAILPOINT")
    encoded = []
    real = data.prepare.encode_corpus
    monkeypatch.setattr(data.prepare, "encode_corpus", lambda *a, **k: encoded.append(a[3]) or real(*a, **k))
    with caplog.at_level(logging.INFO):
        cache = dropout_entry(tmp_path, small_text, copies=2)
    assert caplog.text.count("resuming: 1 shards already tokenized") == 3  # the split, then both encodings
    assert len(cache.train_encodings()) == 3 and len(encoded) == 3


def test_a_tokenizer_without_merges_is_refused_and_leaves_nothing(tmp_path, small_text):
    from tokenizers import models

    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    word_level.save(str(tmp_path / "words.json"))
    cache_dir = tmp_path / "cache"
    tokenizer = OmegaConf.create(
        {"kind": "pretrained", "path": str(tmp_path / "words.json"), "dropout": 0.1, "dropout_copies": 2}
    )
    with pytest.raises(
        DataError, match=r"tokenizer.dropout=0.1 skips BPE merges, and this tokenizer's model is WordLevel"
    ):
        prepare_corpus(data_config(cache_dir, path=str(small_text)), tokenizer)
    assert not cache_dir.exists()


# ---- the windows ---------------------------------------------------------------------------------------


def test_each_window_comes_whole_from_one_encoding_drawn_for_it():
    encodings = [np.arange(1000, dtype=np.uint16) + 10_000 * n for n in range(4)]
    windows = RandomWindows(encodings, block_size=8, batch_size=16, seed=5, num_batches=200)
    seen = set()
    for index in range(200):
        x, y = windows[index]
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in torch.cat([x, y[:, -1:]], dim=1):
            n = int(row[0]) // 10_000
            assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 9))  # consecutive, within one encoding
            assert int(row[-1]) < 10_000 * n + 1000
            seen.add(n)
        again = RandomWindows(encodings, block_size=8, batch_size=16, seed=5, num_batches=200)[index]
        assert torch.equal(again[0], x)  # a pure function of the seed and the batch index
    assert seen == {0, 1, 2, 3}


def test_one_encoding_draws_the_windows_it_always_drew():
    """Without BPE-dropout a run sees the batches it saw before the setting existed."""
    ids = np.arange(5000, dtype=np.uint16)
    x, _ = RandomWindows(ids, block_size=16, batch_size=4, seed=1337, num_batches=10)[3]
    starts = np.random.default_rng((1337, 3)).integers(0, 5000 - 16, size=4)
    assert x[:, 0].tolist() == starts.tolist()


def test_the_data_module_serves_every_encoding(tmp_path, small_text):
    cfg = data_config(tmp_path, path=str(small_text))
    module = TextDataModule(cfg, bpe_config(dropout=0.1, dropout_copies=2), 32, seed=3, num_batches=40)
    module.prepare()
    loader = module.train_dataloader()
    assert loader.dataset.encodings is not None and len(loader.dataset.encodings) == 3


# ---- the user's path -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_interrupted_run_resumed_as_printed_trains_on_the_same_encodings(small_text, tmp_path, monkeypatch):
    """The encodings are random in a way no seed fixes: a resumed run must find those it started with,
    and so end bit for bit as the run never stopped."""
    args = [
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "tokenizer.dropout=0.1",
        "tokenizer.dropout_copies=3",
        "trainer.max_steps=300",
        "trainer.val_check_interval=100",
        "checkpoint.every_n_steps=20",
    ]
    reference = train_here(*args, "runs_root=reference")
    assert reference.returncode == 0, reference.stderr[-2000:]
    log = reference.stdout + reference.stderr
    assert "with 3 BPE-dropout encodings of its training split (dropout 0.1)" in log
    assert "BPE-dropout 0.1: the training split encoded 3 more times" in log

    monkeypatch.setattr(failpoints, "FIRED", set())  # (a Ctrl-C of this process's own)
    inject_faults(monkeypatch, "sigint:25")
    stopped = train_here(*args)
    monkeypatch.delenv(failpoints.ENV)
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    said = stopped.stdout + stopped.stderr
    assert "BPE-dropout 0.1: the training split encoded" not in said  # the reference's entry, found
    (run,) = runs_under(tmp_path / "outputs")
    [printed] = [line.split("Continue with: ", 1)[1] for line in said.splitlines() if "Continue with: " in line]
    python, script, *words = shlex.split(printed)  # the command as a shell passes it on
    assert python == "python" and Path(script) == ROOT / "train.py"
    resumed = train_here(*words)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    (done,) = runs_under(tmp_path / "reference")
    assert_bit_equal(run / "checkpoints" / "last.ckpt", done / "checkpoints" / "last.ckpt")
    assert train_losses(run) == train_losses(done)
    # a cache of its own makes other encodings, which the run is told of as it goes on with them
    config = (run / "config.yaml").read_text()
    assert "encodings_made: " in config
    other = train_here(f"resume={run}", "trainer.max_steps=310", f"data.cache_dir={tmp_path / 'other'}")
    assert other.returncode == 0, other.stderr[-2000:]
    assert "BPE-dropout encodings of the training split in the token cache" in other.stdout + other.stderr
    assert "were made again since this run started" in other.stdout + other.stderr
    # (refused: the run's train.log says so, and its checkpoints stay as they are)
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    contradicting = train_here(f"resume={run}", "tokenizer.dropout=0.2")
    assert contradicting.returncode == 1
    assert "tokenizer.dropout=0.2 contradicts the run being resumed" in one_error_line(contradicting.stderr)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints


@pytest.mark.parametrize(
    "args, line",
    [
        (["tokenizer.dropout=1"], "tokenizer.dropout must be below 1, got 1"),
        (["tokenizer.dropout=nan"], "tokenizer.dropout must be a finite number, got nan"),
        (["tokenizer.dropout=lots"], "tokenizer.dropout must be a number, got 'lots'"),
        (["tokenizer.dropout_copies=0"], "tokenizer.dropout_copies must be"),
        (["tokenizer.dropout_copies=1.5"], "tokenizer.dropout_copies must be a whole number, got 1.5"),
        (  # a char tokenizer has no merges to skip
            ["tokenizer=char", "tokenizer.dropout=0.1"],
            "unknown setting 'tokenizer.dropout': tokenizer=char has no such setting",
        ),
    ],
)
def test_bad_values_are_refused_in_one_line_before_anything_is_made(args, line, small_text, tmp_path):
    cache = tmp_path / "cache"
    tiny = [o for o in TINY_OVERRIDES if "tokenizer=char" not in args or not o.startswith("tokenizer.")]
    assert refused(*tiny, f"data.path={small_text}", f"data.cache_dir={cache}", *args).startswith(line)
    # (refused(): no cache, no run folder)


def test_encodings_of_a_large_corpus_say_what_they_cost(tmp_path, small_text, monkeypatch, caplog):
    monkeypatch.setattr(data.prepare, "LARGE_COPIES", 10_000)  # bytes: the small text's two encodings pass it
    with caplog.at_level(logging.WARNING):
        dropout_entry(tmp_path, small_text, copies=2)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert re.fullmatch(
        r"tokenizer.dropout=0.1: its 2 BPE-dropout encodings of the training split take about 0.000\d+ GB more in the "
        r"token cache; a corpus this large is rarely overfitted, and tokenizer.dropout=0 makes none",
        warning,
    )
