"""Data: sources and formats, the train/validation split, document separators, and the windows."""

from __future__ import annotations

import functools
import http.server
import json
import logging
import threading

import datasets
import numpy as np
import pytest
import torch

from data import DataError
from data.corpus import Corpus, Part, windows
from data.datamodule import ContiguousWindows, RandomWindows, TextDataModule
from data.files import expand_paths
from data.sources import describe
from data.tokenizer import EOT, train_bpe
from tests.common import SHAKESPEARE_CHARS, bpe_config, data_config, hub_folder, stories


def prepared(tmp_path, block_size=8, tokenizer=None, **data):
    dm = TextDataModule(
        data_config(tmp_path / "cache", **data), tokenizer or bpe_config(), block_size, seed=3, num_batches=50
    )
    dm.prepare()
    return dm


def documents_of(dm, split="train"):
    """The documents of a split, as the token ids give them back."""
    tokenizer, ids = dm.tokenizer, dm.cache.ids(split).tolist()
    eot = tokenizer.token_to_id(EOT)
    docs, current = [], []
    for token in ids + [eot]:
        if token == eot:
            docs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return docs


def reference_split(docs, val_fraction):
    """The last val_fraction of the characters validate; the document on the boundary is cut in two."""
    boundary = int(sum(map(len, docs)) * (1.0 - val_fraction))
    train, val, seen = [], [], 0
    for doc in docs:
        if seen + len(doc) <= boundary:
            train.append(doc)
        elif seen >= boundary:
            val.append(doc)
        else:
            train.append(doc[: boundary - seen])
            val.append(doc[boundary - seen :])
        seen += len(doc)
    return train, val


def in_memory_part(texts, split="tail", **fields):
    return Part(
        lambda: datasets.Dataset.from_dict({"text": texts, **fields}).to_iterable_dataset(), split, where="memory"
    )


def walk_items(corpus):
    return [item[:3] for items in corpus.walk() for item in items]


# ---- the split --------------------------------------------------------------------------------------


def test_character_split_is_ninety_ten_like_char_rnn(tmp_path, shakespeare):
    dm = prepared(tmp_path, source="shakespeare", path=str(shakespeare))
    text = shakespeare.read_text(encoding="utf-8")
    assert len(text) == SHAKESPEARE_CHARS
    n_train = int(len(text) * 0.9)
    assert dm.tokenizer.decode(dm.cache.ids("train").tolist()) == text[:n_train]
    assert dm.tokenizer.decode(dm.cache.ids("val").tolist()) == text[n_train:]
    meta = dm.cache.meta
    assert meta["train_chars"] == n_train and meta["val_chars"] == len(text) - n_train
    assert dm.val_tokens_per_char == len(dm.cache.ids("val")) / (len(text) - n_train)
    assert dm.cache.ids("train").dtype == np.uint16 and dm.source == str(shakespeare)


def test_split_cuts_only_the_document_on_the_boundary():
    corpus = Corpus([in_memory_part(["aaaa", "bbbb", "cc"])], 0.2)  # 10 characters: 8 train, 2 validate
    assert walk_items(corpus) == [("train", "aaaa", False), ("train", "bbbb", True), ("val", "cc", False)]
    corpus = Corpus([in_memory_part(["aaaaa", "bbbbb"])], 0.3)  # the boundary is inside the second
    assert walk_items(corpus) == [("train", "aaaaa", False), ("train", "bb", True), ("val", "bbb", False)]


def test_a_document_read_in_pieces_is_one_document():
    part = in_memory_part(["aa", "bb", "cc", "dd"], continues=[False, True, False, True])
    expected = [
        ("train", "aa", False),
        ("train", "bb", False),
        ("train", "c", True),
        ("val", "c", False),
        ("val", "dd", False),
    ]
    assert walk_items(Corpus([part], 0.375)) == expected  # 8 characters, 5 train


def test_a_stream_validates_every_tenth_document():
    part = in_memory_part([f"doc {i}" for i in range(30)], split="every")
    items = walk_items(Corpus([part], 0.1))
    assert [text for split, text, _ in items if split == "val"] == ["doc 9", "doc 19", "doc 29"]
    assert [sep for split, _, sep in items if split == "val"] == [False, True, True]


def test_the_tokenizer_sample_is_spread_over_the_whole_corpus():
    texts = ["a" * 500, "b" * 500, "c" * 500, "d" * 500]
    sample = "".join(windows(iter(texts), total=2000, budget=200))
    assert 180 <= len(sample) <= 200 and set(sample) == {"a", "b", "c", "d"}


# ---- sources and formats ----------------------------------------------------------------------------


def test_text_source_reads_a_folder_and_a_glob(tmp_path, caplog):
    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("first book " * 20)
    (folder / "sub" / "b.txt").write_text("second book " * 20)
    (folder / "notes.md").write_text("not one of the formats")
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "c.txt").write_text("a hidden file")
    with caplog.at_level(logging.INFO, logger="data.files"):
        assert [p.rsplit("/", 1)[-1] for p in expand_paths(str(folder))[0]] == ["a.txt", "b.txt"]
    assert f"data.path {folder}: reading 2 txt files, leaving out 1 .md file" in caplog.messages  # said, not silent
    assert len(expand_paths(str(folder / "*.txt"))[0]) == 1
    dm = prepared(tmp_path, path=str(folder))
    train, val = reference_split(["first book " * 20, "second book " * 20], 0.1)
    assert documents_of(dm, "train") == train and documents_of(dm, "val") == val and len(train) == 2


def test_documents_are_separated_by_end_of_text(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"document number {i}. " * 40)
    dm = prepared(tmp_path, path=str(folder), val_fraction=0.05)
    assert dm.cache.ids("train").tolist().count(dm.tokenizer.token_to_id(EOT)) == 2
    train, val = reference_split([f"document number {i}. " * 40 for i in range(3)], 0.05)
    assert documents_of(dm, "train") == train and documents_of(dm, "val") == val


def test_one_document_per_line(tmp_path):
    lines = [f"line {i} of the file" for i in range(200)]
    path = tmp_path / "lines.txt"
    path.write_bytes(("\r\n".join(lines[:100]) + "\n\n\n" + "\n".join(lines[100:]) + "\n").encode())
    dm = prepared(tmp_path, path=str(path), one_document_per="line", val_fraction=0.25)
    text = "\n".join(lines)  # blank lines are no documents, and \r is gone
    boundary = int(len(text) * 0.75)  # inside line 151, which becomes two documents
    assert documents_of(dm, "train") == text[:boundary].split("\n")
    assert documents_of(dm, "val") == text[boundary:].split("\n")
    assert dm.cache.meta["train_chars"] + dm.cache.meta["val_chars"] == sum(map(len, lines))


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_tables_give_one_document_per_row(tmp_path, fmt):
    stories = [f"Once upon a time, story {i} began, and it went on for a while." * 3 for i in range(40)]
    table = datasets.Dataset.from_dict({"id": list(range(40)), "story": stories})
    path = tmp_path / f"stories.{fmt}"
    if fmt == "jsonl":
        table.to_json(path, lines=True)
    elif fmt == "json":
        path.write_text(json.dumps([{"id": i, "story": s} for i, s in enumerate(stories)]))
    elif fmt == "csv":
        table.to_csv(path, index=False)
    else:
        table.to_parquet(path)
    dm = prepared(tmp_path, path=str(path), text_column="story", val_fraction=0.15)
    train, val = reference_split(stories, 0.15)
    assert documents_of(dm, "train") == train and documents_of(dm, "val") == val
    assert dm.cache.meta["train_chars"] + dm.cache.meta["val_chars"] == sum(map(len, stories))


def test_a_csv_text_column_is_read_as_written(tmp_path):
    """pandas types a CSV column by the rows of each chunk it reads: a chunk (of 10,000 rows) whose texts
    were all numbers came as ints, and the whole file was refused as holding no text."""
    texts = [f"row {i} says something" for i in range(10_000)] + [str(i) for i in range(10_000)] + ["007", "1e3"]
    path = tmp_path / "answers.csv"
    datasets.Dataset.from_dict({"text": texts}).to_csv(path, index=False)
    dm = prepared(tmp_path, path=str(path), val_fraction=0.1)
    train, val = reference_split(texts, 0.1)
    assert documents_of(dm, "train") == train and documents_of(dm, "val") == val


def test_validation_files_replace_the_fraction(tmp_path, small_text):
    val = tmp_path / "held_out.txt"
    val.write_text("A held-out play, in a file of its own.\n" * 30)
    dm = prepared(tmp_path, path=str(small_text), val_path=str(val))
    assert dm.tokenizer.decode(dm.cache.ids("train").tolist()) == small_text.read_text()
    assert dm.tokenizer.decode(dm.cache.ids("val").tolist()) == val.read_text()


def test_validation_files_that_are_training_files_are_named(tmp_path, small_text, caplog):
    """Validating on text the model trains on measures memorising: said in one warning line."""
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        describe(data_config(tmp_path / "cache", path=str(small_text), val_path=str(small_text)))
    assert [r.getMessage() for r in caplog.records] == [
        f"data.val_path and data.path share 1 file(s) ({small_text.resolve()}): the model is validated on text it "
        "trains on, which measures memorising, not learning; give data.val_path files of their own"
    ]
    caplog.clear()
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("A held-out play.\n" * 30)
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        describe(data_config(tmp_path / "cache", path=str(small_text), val_path=str(held_out)))
    assert not caplog.records


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_dataset_validates_on_its_validation_split(tmp_path, streaming):
    folder = hub_folder(tmp_path, {"train": 60, "validation": 60})
    dm = prepared(tmp_path, source="hub", name=str(folder), split="train", val_split="auto", streaming=streaming)
    assert documents_of(dm, "train") == stories(60, "train")
    assert documents_of(dm, "val") == stories(60, "validation")


def test_hub_dataset_without_a_validation_split_uses_the_fraction(tmp_path):
    folder = hub_folder(tmp_path, {"train": 100})
    whole = prepared(tmp_path, source="hub", name=str(folder), val_split="auto", streaming=False)
    texts = stories(100)
    assert (documents_of(whole, "train"), documents_of(whole, "val")) == reference_split(texts, 0.1)
    streamed = prepared(tmp_path, source="hub", name=str(folder), val_split="auto", streaming=True)
    assert documents_of(streamed, "val") == texts[9::10]


def test_hub_datasets_saved_with_save_to_disk(tmp_path):
    """A DatasetDict's folder validates on its validation split; one Dataset's folder (which load_dataset
    cannot read) on its last data.val_fraction; with a split named, the one-split folder is refused."""
    import datasets

    splits = {split: datasets.Dataset.from_dict({"text": stories(60, split)}) for split in ("train", "validation")}
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "saved_dict")
    dm = prepared(tmp_path, source="hub", name=str(tmp_path / "saved_dict"), split="train", val_split="auto")
    assert documents_of(dm, "train") == stories(60, "train") and documents_of(dm, "val") == stories(60, "validation")

    splits["train"].save_to_disk(tmp_path / "saved_one")
    dm = prepared(tmp_path, source="hub", name=str(tmp_path / "saved_one"), split="train", val_split="auto")
    assert (documents_of(dm, "train"), documents_of(dm, "val")) == reference_split(stories(60, "train"), 0.1)
    with pytest.raises(DataError, match=r"saved_one is one dataset saved with save_to_disk, without splits; leave"):
        prepared(tmp_path, source="hub", name=str(tmp_path / "saved_one"), split="test", val_split="auto")


def test_pydoc_corpus(tmp_path):
    dm = prepared(tmp_path, source="pydoc")
    assert dm.source == "pydoc_data.topics" and dm.cache.meta["train_chars"] > 400_000


def test_shakespeare_falls_back_to_pydoc_offline_marked_as_a_stand_in(tmp_path, caplog):
    """The run that uses it says so (tests/test_offline_fallback.py); finding the text says nothing."""
    cfg = data_config(tmp_path / "cache", source="shakespeare")  # no path, nothing cached, no copy, dead URL
    with caplog.at_level(logging.WARNING):
        source = describe(cfg)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "Tiny Shakespeare is not available" in source.fallback and "\n" not in source.fallback
    assert source.label.startswith("pydoc")
    assert source.open(None).size(0) > 400_000  # a real corpus, not a stub


def test_shakespeare_is_found_in_a_local_copy(tmp_path, full_text):
    source = describe(data_config(tmp_path / "cache", source="shakespeare", local_copies=[str(full_text)]))
    assert source.label == str(full_text)


def test_shakespeare_is_downloaded_once_then_read_from_the_cache(tmp_path, small_text):
    """The download path, against a real HTTP server on this machine."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(small_text.parent))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/{small_text.name}"
        cfg = data_config(tmp_path / "cache", source="shakespeare", url=url)
        downloaded = describe(cfg)
    finally:
        server.shutdown()
    cached = tmp_path / "cache" / "sources" / "tinyshakespeare" / "input.txt"
    assert downloaded.label == str(cached) and cached.read_text() == small_text.read_text()
    again = describe(cfg)  # the server is gone: the cache must serve
    assert again.label == str(cached) and again.identity == downloaded.identity


def test_a_download_the_cache_cannot_keep_is_refused_in_one_line_and_nothing_is_left(tmp_path, small_text):
    """A cache that cannot be written (here a file where it keeps the folder of sources; a read-only one
    is refused the same way) ended in an OSError traceback once the text was downloaded."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "sources").write_text("not a folder")
    cfg = data_config(tmp_path / "cache", source="shakespeare", url=str(small_text))  # a local "download"
    with pytest.raises(DataError) as refused:
        describe(cfg)
    assert str(refused.value).startswith(
        f"Tiny Shakespeare was downloaded but cannot be kept in the cache: {tmp_path / 'cache' / 'sources' / 'tinyshakespeare'} ("
    )
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["sources"]


# ---- windows ----------------------------------------------------------------------------------------


def test_random_windows_are_shifted_by_one_and_repeatable():
    ids = np.arange(1000, dtype=np.uint16)
    windows_ = RandomWindows(ids, block_size=16, batch_size=4, seed=5, num_batches=10)
    x, y = windows_[3]
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one
    assert torch.equal(windows_[3][0], RandomWindows(ids, 16, 4, seed=5, num_batches=10)[3][0])
    assert not torch.equal(windows_[3][0], windows_[4][0])


def test_validation_windows_cover_the_split_once():
    ids = np.arange(101, dtype=np.uint16)
    windows_ = ContiguousWindows(ids, block_size=10)
    assert len(windows_) == 10
    targets = torch.cat([windows_[i][1] for i in range(len(windows_))])
    assert torch.equal(targets, torch.arange(1, 101))


def test_a_given_tokenizer_is_used_as_it_is(tmp_path, small_text, monkeypatch):
    import data.prepare

    given = train_bpe(["a completely different corpus, " * 50], vocab_size=280)
    calls = []
    monkeypatch.setattr(data.prepare, "build_tokenizer", lambda *a: calls.append(a))
    dm = TextDataModule(data_config(tmp_path / "cache", path=str(small_text)), bpe_config(), 32, 0, 1, tokenizer=given)
    assert dm.vocab_size == 280 and dm.tokenizer_json == given.to_str() and calls == []
