"""BPE-dropout's encodings are made of a small training split only (data.prepare.DROPOUT_MAX_TRAIN_CHARS),
unless tokenizer.dropout_any_size: on a large corpus they tokenized the text eight times for no gain."""

from __future__ import annotations

import logging

import numpy as np

import data.prepare
from data.prepare import corpus_key, prepare_corpus
from tests.common import TINY_OVERRIDES, bpe_config, data_config, refused


def test_a_training_split_past_the_size_gets_none_and_is_told_how_to_have_them(
    tmp_path, small_text, monkeypatch, caplog
):
    monkeypatch.setattr(data.prepare, "DROPOUT_MAX_TRAIN_CHARS", 50_000)  # small_text trains on 54,000
    data_cfg = data_config(tmp_path, path=str(small_text))
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        skipped = prepare_corpus(data_cfg, bpe_config(dropout=0.1, dropout_copies=2))
    said = [r.getMessage() for r in caplog.records if "BPE-dropout" in r.getMessage()]
    assert said == [
        "tokenizer.dropout=0.1: no BPE-dropout encodings of the 54,000 training characters; they pay only on a text "
        "below 50,000 characters, which a run passes over many times (bench/LOG.md); tokenizer.dropout_any_size=true "
        "makes them at any size"
    ]
    assert "train_copies" not in skipped.meta and "dropout" not in skipped.meta
    assert sorted(p.name for p in skipped.folder.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    plain = prepare_corpus(data_cfg, bpe_config())
    assert np.array_equal(skipped.ids("train"), plain.ids("train"))

    forced = prepare_corpus(data_cfg, bpe_config(dropout=0.1, dropout_copies=2, dropout_any_size=True))
    assert forced.meta["dropout"] == 0.1 and len(forced.meta["train_copies"]) == 2
    assert len(forced.train_encodings()) == 3


def test_the_size_rule_leaves_the_cache_key_as_it_was(tmp_path, small_text):
    """Entries made before the rule are found: below the size it changes nothing, so only the setting
    that lifts it is in the key."""
    data_cfg = data_config(tmp_path, path=str(small_text))
    before = corpus_key(data_cfg, bpe_config(dropout=0.1, dropout_copies=7))[1]
    assert corpus_key(data_cfg, bpe_config(dropout=0.1, dropout_copies=7, dropout_any_size=False))[1] == before
    assert corpus_key(data_cfg, bpe_config(dropout=0.1, dropout_copies=7, dropout_any_size=True))[1] != before
    plain = corpus_key(data_cfg, bpe_config())[1]
    assert corpus_key(data_cfg, bpe_config(dropout=0.0, dropout_any_size=True))[1] == plain


def test_the_setting_takes_true_or_false_only(small_text, tmp_path):
    cache = tmp_path / "cache"
    args = [*TINY_OVERRIDES, f"data.path={small_text}", f"data.cache_dir={cache}", "tokenizer.dropout_any_size=maybe"]
    assert refused(*args) == "tokenizer.dropout_any_size must be true or false, got 'maybe'"  # (and no cache)
