"""Tokenizers: byte-level BPE, characters, pretrained ones from disk; pieces that keep the ids."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.decoders import DecodeStream

from data.datamodule import TextDataModule
from data.tokenizer import EOT, UNK, is_safe_cut, load_pretrained, safe_pieces, splits_safely, train_bpe, train_char
from tests.common import TINY_OVERRIDES, bpe_config, data_config, refused, train_here

SAMPLE = "ROMEO: Thou art — déjà vu 🙂 \n\n  odd   spacing\tand\r\nends"


@pytest.fixture(scope="module")
def shakespeare_bpe(full_text) -> Tokenizer:
    return train_bpe([full_text.read_text(encoding="utf-8")], vocab_size=500)


def round_trips(tokenizer: Tokenizer, text: str) -> bool:
    """Through tokenizer.json (as checkpoints carry it), both at once and a token at a time (as generate.py decodes)."""
    rebuilt = Tokenizer.from_str(tokenizer.to_str())
    ids = rebuilt.encode(text, add_special_tokens=False).ids
    stream = DecodeStream(skip_special_tokens=True)
    streamed = "".join(piece for i in ids if (piece := stream.step(rebuilt, i)) is not None)
    return rebuilt.decode(ids) == text and streamed == text


def test_byte_level_bpe_round_trips_any_text(small_text):
    tokenizer = train_bpe([small_text.read_text()], vocab_size=400)
    assert tokenizer.get_vocab_size() == 400 and tokenizer.token_to_id(EOT) is not None
    assert round_trips(tokenizer, SAMPLE)


def test_char_tokenizer_has_one_token_per_character(shakespeare):
    text = shakespeare.read_text(encoding="utf-8")
    tokenizer = train_char([text])
    chars = sorted(set(text))
    assert tokenizer.get_vocab_size() == len(chars) + 2 == 67  # Tiny Shakespeare's 65, then <|endoftext|> and <|unk|>
    assert tokenizer.encode("First").ids == [chars.index(c) for c in "First"] == [18, 47, 56, 57, 58]  # as nanoGPT's
    assert round_trips(tokenizer, text[:5000])  # no spaces between characters
    assert tokenizer.decode(tokenizer.encode("a😀b").ids) == "ab" and tokenizer.encode("😀").tokens == [UNK]
    assert tokenizer.encode(f"a{EOT}b").tokens == ["a", EOT, "b"]


def test_pretrained_tokenizer_from_a_hugging_face_folder(tmp_path, shakespeare_bpe):
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "hf_tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=shakespeare_bpe, eos_token=EOT).save_pretrained(folder)
    loaded = load_pretrained(folder)
    assert loaded.encode(SAMPLE).ids == shakespeare_bpe.encode(SAMPLE).ids and round_trips(loaded, SAMPLE)
    assert load_pretrained(folder / "tokenizer.json").to_str() == loaded.to_str()

    original = tmp_path / "gpt2_style"  # GPT-2's original files: vocab.json and merges.txt
    original.mkdir()
    shakespeare_bpe.model.save(str(original))
    from_files = load_pretrained(original)
    assert from_files.encode(SAMPLE).ids == shakespeare_bpe.encode(SAMPLE).ids and round_trips(from_files, SAMPLE)
    assert from_files.token_to_id(EOT) == shakespeare_bpe.token_to_id(EOT)


def test_pretrained_tokenizer_gets_an_end_of_text_token_and_no_truncation(tmp_path):
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the cat sat on a mat".split())}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.enable_truncation(max_length=3)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    loaded = load_pretrained(path)
    assert loaded.token_to_id(EOT) == len(vocab) and loaded.get_vocab_size() == len(vocab) + 1
    assert len(loaded.encode("the cat sat on a mat").ids) == 6


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path, small_text):
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    words = small_text.read_text().split()
    for word in words:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "big.json"))
    cfg = OmegaConf.create({"kind": "pretrained", "path": str(tmp_path / "big.json")})
    dm = TextDataModule(data_config(tmp_path / "cache", path=str(small_text)), cfg, 32, 0, 1)
    ids = dm.prepare().ids("train")
    assert ids.dtype == np.uint32 and dm.vocab_size > 2**16
    assert ids.max() >= 70_000 and dm.tokenizer.id_to_token(int(ids[0])) == words[0]


def test_pieces_at_safe_places_give_the_ids_of_the_whole(full_text, shakespeare_bpe):
    text = full_text.read_text(encoding="utf-8")
    whole = shakespeare_bpe.encode(text).ids
    for size in (200, 5000):
        pieces = safe_pieces(text, size)
        assert "".join(pieces) == text and len(pieces) > len(text) // (2 * size)
        assert [i for e in shakespeare_bpe.encode_batch_fast(pieces) for i in e.ids] == whole
    char = train_char([text])
    pieces = safe_pieces(text[:20_000], 300)
    assert [i for e in char.encode_batch(pieces) for i in e.ids] == char.encode(text[:20_000]).ids


def test_every_safe_place_is_safe_in_awkward_text(shakespeare_bpe):
    """Whitespace runs, punctuation, contractions, digits and non-Latin letters around the cuts."""
    rng = random.Random(0)
    alphabet = list("ab xy\n\n  \t.,'5s日é😀\r-")
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(5, 40)))
        whole = shakespeare_bpe.encode(text).ids
        for p in range(len(text)):
            if is_safe_cut(text, p):
                assert shakespeare_bpe.encode(text[:p]).ids + shakespeare_bpe.encode(text[p:]).ids == whole, (text, p)


def test_only_tokenizers_known_to_keep_their_ids_are_split(shakespeare_bpe):
    assert splits_safely(shakespeare_bpe) and splits_safely(train_char(["abc"]))
    prefixed = Tokenizer.from_str(shakespeare_bpe.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    normalized = Tokenizer.from_str(shakespeare_bpe.to_str())
    normalized.normalizer = normalizers.Lowercase()
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer, metaspace.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    assert not any(splits_safely(t) for t in (prefixed, normalized, metaspace))
    spec = json.loads(shakespeare_bpe.to_str())
    assert spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["normalizer"] is None


@pytest.mark.parametrize("kind", ["char", "pretrained"])
def test_each_tokenizer_prepares_text_that_decodes_back(tmp_path, small_text, shakespeare_bpe, kind):
    path = tmp_path / "tokenizer.json"
    shakespeare_bpe.save(str(path))
    cfg = OmegaConf.create({"kind": kind, "path": str(path)})
    dm = TextDataModule(
        data_config(tmp_path / "cache", path=str(small_text), shard_chars=10_000, num_proc=2), cfg, 32, 0, 1
    )
    cache = dm.prepare()
    text = small_text.read_text()
    n_train = int(len(text) * 0.9)
    assert dm.tokenizer.decode(cache.ids("train").tolist()) == text[:n_train]
    seen = set(text[:n_train])  # the char tokenizer's alphabet: a character it never saw is <|unk|>, decoded as nothing
    val = text[n_train:] if kind == "pretrained" else "".join(c for c in text[n_train:] if c in seen)
    assert dm.tokenizer.decode(cache.ids("val").tolist()) == val
    if kind == "pretrained":
        assert dm.vocab_size == 500 and np.array_equal(cache.ids("train"), shakespeare_bpe.encode(text[:n_train]).ids)
    else:
        assert dm.vocab_size == len(set(text[:n_train])) + 2 and len(cache.ids("train")) == n_train


def test_bpe_learns_from_a_bounded_sample(tmp_path, small_text, monkeypatch):
    import data.tokenizer

    seen = []
    real = data.tokenizer.train_bpe
    monkeypatch.setattr(data.tokenizer, "train_bpe", lambda texts, size: real(seen.extend(texts) or seen, size))
    dm = TextDataModule(
        data_config(tmp_path / "cache", path=str(small_text)), bpe_config(max_train_chars=8_000), 32, 0, 1
    )
    dm.prepare()
    assert 7_000 <= sum(map(len, seen)) <= 8_000
    text = small_text.read_text()
    assert seen[0] in text[:10_000] and seen[-1] in text[40_000:54_000]  # windows from the start to the end


def test_a_tokenizer_that_loses_much_of_the_text_is_named_with_its_share(tmp_path, small_text):
    """A word-level tokenizer that lacks most words turns them into its unknown token, which the model
    learns as one symbol: the warning says how many, in which split; a tokenizer that covers the text
    (byte-level BPE, which has no unknown token) and one that lacks almost nothing say nothing."""
    from data.prepare import unknown_tokens

    words = small_text.read_text().split()
    common = {w: i + 1 for i, w in enumerate(dict.fromkeys(words[:40]))}
    for name, vocab in (
        ("few", {"[UNK]": 0, **common}),
        ("all", {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(words))}}),
    ):
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(tmp_path / f"{name}.json"))
    data = data_config(tmp_path / "cache", path=str(small_text))
    few = TextDataModule(data, OmegaConf.create({"kind": "pretrained", "path": str(tmp_path / "few.json")}), 32, 0, 1)
    ids = few.prepare().ids("val")
    unk = int(np.count_nonzero(ids == 0))
    said = unknown_tokens(few.prepare())
    assert said.startswith(f"{small_text}: ") and f"{unk:,} of the {len(ids):,} validation tokens" in said
    assert "unknown token [UNK]" in said and "tokenizer=bpe covers any text" in said
    every = TextDataModule(data, OmegaConf.create({"kind": "pretrained", "path": str(tmp_path / "all.json")}), 32, 0, 1)
    assert unknown_tokens(every.prepare()) is None  # every word of the text has a token
    bpe = TextDataModule(data, bpe_config(), 32, 0, 1)
    assert unknown_tokens(bpe.prepare()) is None


def test_train_py_says_how_much_of_the_text_a_tokenizer_loses(tmp_path, small_text):
    """The user's path: train.py with a word-level tokenizer of a few words warns in one line, and trains."""

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(small_text.read_text().split()[:40]))}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "words.json"))
    settings = [o for o in TINY_OVERRIDES if not o.startswith("tokenizer.")]
    ran = train_here(*settings, f"data.path={small_text}", "tokenizer=pretrained", "tokenizer.path=words.json")
    assert ran.returncode == 0, ran.stderr[-2000:]
    warned = [line for line in (ran.stdout + ran.stderr).splitlines() if "unknown token [UNK]" in line]
    assert len(warned) == 1 and "[WARNING]" in warned[0] and "validation tokens (" in warned[0]


def test_a_vocabulary_larger_than_the_text_has_merges_for_is_said_in_a_warning(caplog):
    text = "hello world, hello there. " * 50
    with caplog.at_level(logging.WARNING, logger="data.tokenizer"):
        tokenizer = train_bpe([text], 1000)
    assert tokenizer.get_vocab_size() < 1000
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage() == (
        f"tokenizer.vocab_size=1000 is more than this text has merges for: the tokenizer has "
        f"{tokenizer.get_vocab_size()} tokens, and the model that many; give a smaller tokenizer.vocab_size, or more text"
    )


def test_a_tokenizer_with_an_added_token_that_spans_a_space_is_not_cut_into_pieces(small_text):
    """An added token matches before the BPE's rules, so "good morrow" can straddle a space that is a
    safe place to cut for the BPE: such a tokenizer encodes documents whole (tokens added without a
    space, or special ones, change nothing)."""
    tokenizer = train_bpe([small_text.read_text(encoding="utf-8")], 300)
    tokenizer.add_tokens(["morrow"])
    tokenizer.add_special_tokens(["<|pad| here|>"])
    assert splits_safely(tokenizer)
    tokenizer.add_tokens(["good morrow"])
    assert not splits_safely(tokenizer)
    text = "I bid you good morrow, sir. " * 5000
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    pieced = [i for piece in safe_pieces(text, 65_536) for i in tokenizer.encode(piece, add_special_tokens=False).ids]
    assert whole != pieced  # what encoding it in pieces would have got wrong


def test_train_py_says_a_tokenizer_made_no_tokens_of_the_text_rather_than_that_the_text_is_short(tmp_path, small_text):
    """A tokenizer.json whose vocabulary covers none of the text (here: a BPE with no tokens) is named
    as the cause in one line; the text was said to be too short to leave any training text."""

    Tokenizer(models.BPE()).save(str(tmp_path / "empty.json"))
    settings = [o for o in TINY_OVERRIDES if not o.startswith("tokenizer.")]
    cache = tmp_path / "cache"
    line = refused(
        *settings,
        f"data.path={small_text}",
        f"data.cache_dir={cache}",
        "tokenizer=pretrained",
        "tokenizer.path=empty.json",
    )
    chars = round(len(small_text.read_text(encoding="utf-8")) * 0.9)
    assert line.startswith(
        f"the tokenizer made no tokens of the {chars:,} training characters of {small_text}: its vocabulary "
        "covers none of the text"
    )  # (and refused(): no run folder, no cache entry)
