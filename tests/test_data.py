"""Data: sources, the character split, the tokenizer, the token cache and the windows."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import data.datamodule as datamodule_module
from data import DataError
from data.datamodule import ContiguousWindows, RandomWindows, TextDataModule
from data.sources import expand_text_paths, load_splits, split_by_characters
from data.tokenizer import EOT, train_bpe


def data_cfg(tmp_path, **values):
    base = dict(
        source="text",
        path=None,
        url="file:///nonexistent/input.txt",
        local_copies=[],
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.1,
        batch_size=4,
        num_workers=0,
    )
    return OmegaConf.create({**base, **values})


def test_character_split_is_ninety_ten_like_char_rnn(tmp_path, shakespeare):
    splits = load_splits(data_cfg(tmp_path, source="shakespeare", path=str(shakespeare)))
    text = shakespeare.read_text(encoding="utf-8")
    assert len(text) == 1_115_394
    n_train = int(len(text) * 0.9)
    assert splits.train == [text[:n_train]] and splits.val == [text[n_train:]]
    assert splits.val_chars == len(text) - n_train


def test_split_cuts_only_the_document_on_the_boundary():
    train, val = split_by_characters(["aaaa", "bbbb", "cc"], 0.2)  # 10 chars: 8 train, 2 val
    assert train == ["aaaa", "bbbb"] and val == ["cc"]
    train, val = split_by_characters(["aaaaa", "bbbbb"], 0.3)  # boundary inside the second
    assert train == ["aaaaa", "bb"] and val == ["bbb"]


def test_text_source_reads_a_folder_and_a_glob(tmp_path):
    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("first book " * 20)
    (folder / "sub" / "b.txt").write_text("second book " * 20)
    (folder / "notes.md").write_text("not a .txt file")
    assert [p.rsplit("/", 1)[-1] for p in expand_text_paths(str(folder))] == ["a.txt", "b.txt"]
    assert len(expand_text_paths(str(folder / "*.txt"))) == 1
    splits = load_splits(data_cfg(tmp_path, path=str(folder)))
    assert "".join(splits.train + splits.val) == ("first book " * 20) + ("second book " * 20)


@pytest.mark.parametrize(
    "path, message",
    [("missing.txt", "does not exist"), ("nothing-*.txt", "matches no files")],
)
def test_bad_text_paths_say_what_is_wrong(tmp_path, path, message):
    with pytest.raises(DataError, match=message):
        load_splits(data_cfg(tmp_path, path=str(tmp_path / path)))


def test_shakespeare_falls_back_to_pydoc_offline_with_one_warning(tmp_path, caplog):
    cfg = data_cfg(tmp_path, source="shakespeare")  # no path, nothing cached, no local copy, dead URL
    with caplog.at_level(logging.WARNING):
        splits = load_splits(cfg)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "pydoc" in warnings[0].getMessage() and "\n" not in warnings[0].getMessage()
    assert splits.source.startswith("pydoc")
    assert sum(map(len, splits.train)) > 100_000  # a real corpus, not a stub


def test_shakespeare_is_found_in_a_local_copy(tmp_path, shakespeare):
    splits = load_splits(data_cfg(tmp_path, source="shakespeare", local_copies=[str(shakespeare)]))
    assert splits.source == str(shakespeare)


def test_byte_level_bpe_round_trips_any_text(small_text):
    tokenizer = train_bpe([small_text.read_text()], vocab_size=400)
    assert tokenizer.get_vocab_size() == 400 and tokenizer.token_to_id(EOT) is not None
    sample = "ROMEO: Thou art — déjà vu 🙂 \n\n  odd   spacing"
    assert tokenizer.decode(tokenizer.encode(sample).ids) == sample


def test_too_small_vocabulary_is_refused():
    with pytest.raises(DataError, match="at least 257"):
        train_bpe(["some text"], vocab_size=200)


def make_datamodule(tmp_path, path, block_size=32, vocab_size=300, **data):
    cfg = data_cfg(tmp_path, path=str(path), **data)
    return TextDataModule(cfg, OmegaConf.create({"kind": "bpe", "vocab_size": vocab_size}), block_size, seed=3, num_batches=50)


def test_second_preparation_reuses_the_cache(tmp_path, small_text, monkeypatch):
    first = make_datamodule(tmp_path, small_text).prepare()
    assert (first.folder / "meta.json").is_file()
    calls = []
    monkeypatch.setattr(datamodule_module, "build_tokenizer", lambda *a: calls.append(a))
    second = make_datamodule(tmp_path, small_text).prepare()
    assert calls == [] and second.folder == first.folder
    assert np.array_equal(second.ids("train"), first.ids("train"))


def test_changed_text_or_tokenizer_gets_a_new_cache_entry(tmp_path, small_text):
    base = make_datamodule(tmp_path, small_text).prepare().folder
    assert make_datamodule(tmp_path, small_text, vocab_size=320).prepare().folder != base
    small_text_copy = tmp_path / "changed.txt"
    small_text_copy.write_text(small_text.read_text() + " one more line")
    assert make_datamodule(tmp_path, small_text_copy).prepare().folder != base


def test_cached_ids_decode_back_to_the_text(tmp_path, small_text):
    dm = make_datamodule(tmp_path, small_text)
    cache = dm.prepare()
    text = small_text.read_text()
    n_train = int(len(text) * 0.9)
    assert dm.tokenizer.decode(cache.ids("train").tolist()) == text[:n_train]
    assert dm.tokenizer.decode(cache.ids("val").tolist()) == text[n_train:]
    assert cache.ids("train").dtype == np.uint16
    assert dm.val_tokens_per_char == pytest.approx(len(cache.ids("val")) / (len(text) - n_train))


def test_documents_are_separated_by_end_of_text(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"document number {i}. " * 40)
    dm = make_datamodule(tmp_path, folder, block_size=8, val_fraction=0.05)
    ids = dm.prepare().ids("train").tolist()
    assert ids.count(dm.tokenizer.token_to_id(EOT)) == 2


def test_random_windows_are_shifted_by_one_and_repeatable():
    ids = np.arange(1000, dtype=np.uint16)
    windows = RandomWindows(ids, block_size=16, batch_size=4, seed=5, num_batches=10)
    x, y = windows[3]
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one
    assert torch.equal(windows[3][0], RandomWindows(ids, 16, 4, seed=5, num_batches=10)[3][0])
    assert not torch.equal(windows[3][0], windows[4][0])


def test_validation_windows_cover_the_split_once():
    ids = np.arange(101, dtype=np.uint16)
    windows = ContiguousWindows(ids, block_size=10)
    assert len(windows) == 10
    targets = torch.cat([windows[i][1] for i in range(len(windows))])
    assert torch.equal(targets, torch.arange(1, 101))


def test_validation_split_shorter_than_a_window_is_refused(tmp_path, small_text):
    with pytest.raises(DataError, match="val split has .* fewer than block_size"):
        make_datamodule(tmp_path, small_text, block_size=20_000).prepare()


def test_shakespeare_is_downloaded_once_then_read_from_the_cache(tmp_path, small_text):
    """The download path, against a real HTTP server on this machine."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(small_text.parent))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/{small_text.name}"
        cfg = data_cfg(tmp_path, source="shakespeare", url=url)
        downloaded = load_splits(cfg)
    finally:
        server.shutdown()
    assert downloaded.source == url
    cached = tmp_path / "cache" / "sources" / "tinyshakespeare" / "input.txt"
    assert cached.read_text() == small_text.read_text()
    again = load_splits(cfg)  # the server is gone: the cache must serve
    assert again.source == str(cached) and again.train == downloaded.train


def test_a_given_tokenizer_is_used_as_it_is(tmp_path, small_text, monkeypatch):
    given = train_bpe(["a completely different corpus, " * 50], vocab_size=280)
    calls = []
    monkeypatch.setattr(datamodule_module, "build_tokenizer", lambda *a: calls.append(a))
    dm = TextDataModule(
        data_cfg(tmp_path, path=str(small_text)), OmegaConf.create({"kind": "bpe", "vocab_size": 300}), 32, 0, 1, tokenizer=given
    )
    assert dm.vocab_size == 280 and dm.tokenizer_json == given.to_str() and calls == []
