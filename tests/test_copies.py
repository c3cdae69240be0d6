"""The copy index (data/copies.py): the spans of a generated text found in the training text, where
they are, and an index that is checked, rebuilt when damaged or stale, and built by one process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from data.cache import text_hash
from data.copies import DEPTH, open_copy_index, source_of_entry
from data.datamodule import TextDataModule
from data.tokenizer import EOT, train_char
from tests.common import ROOT, TINY_OVERRIDES, compose_config

ALPHABET = "abcdefghijklmnopqrstuvwxyz"  # a char tokenizer: ids 0-25, then <|endoftext|> 26 and <|unk|> 27


def write_entry(cache: Path, train, key: str = "entry") -> Path:
    """A token cache entry whose train.bin holds these ids (of a char tokenizer over ALPHABET), as
    data.cache writes one; returns the cache folder."""
    tokenizer = train_char([ALPHABET]).to_str()
    folder = cache / "tokens" / key
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    np.asarray(train, dtype=np.uint16).tofile(folder / "train.bin")
    np.zeros(4, dtype=np.uint16).tofile(folder / "val.bin")
    meta = {
        "dtype": "uint16",
        "train_tokens": len(train),
        "val_tokens": 4,
        "vocab_size": len(ALPHABET) + 2,
        "tokenizer_sha256": text_hash(tokenizer),
        "source": "made by the test",
    }
    (folder / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return cache


def spans(cache: Path, ids, min_tokens: int = 8, key: str = "entry") -> list[tuple[int, int, int, int]]:
    found = open_copy_index(cache, key).find(list(ids), min_tokens)
    return [(c.start, c.end, c.occurrences, c.train_position) for c in found]


def brute_force(train: list[int], ids: list[int], min_tokens: int) -> list[tuple[int, int, int]]:
    """(start, end, occurrences) of the maximal spans, by comparing every start with every position."""

    def longest(i: int) -> int:
        best = 0
        for p in range(len(train)):
            k = 0
            while i + k < len(ids) and p + k < len(train) and train[p + k] == ids[i + k]:
                k += 1
            best = max(best, k)
        return best

    found, reach = [], 0
    for i in range(len(ids)):
        end = i + longest(i)
        if end > max(reach, i) and end - i >= min_tokens:
            span = ids[i:end]
            count = sum(train[p : p + len(span)] == span for p in range(len(train) - len(span) + 1))
            found.append((i, end, count))
        reach = max(reach, end)
    return found


def noise(rng: np.random.Generator, count: int, low: int = 0, high: int = 13) -> list[int]:
    return rng.integers(low, high, count).tolist()


# ---- what is found -----------------------------------------------------------------------------------


def test_a_copied_span_is_found_with_its_place_in_the_generated_text_and_the_training_text(tmp_path):
    rng = np.random.default_rng(0)
    copied = noise(rng, 20, 13, 26)  # letters the noise around it never has
    train = noise(rng, 500) + copied + noise(rng, 300)
    cache = write_entry(tmp_path, train)
    ids = noise(rng, 30) + copied + noise(rng, 30)
    assert spans(cache, ids) == [(30, 50, 1, 500)]


def test_a_span_one_token_shorter_than_min_tokens_is_not_reported_and_one_of_min_tokens_is(tmp_path):
    rng = np.random.default_rng(1)
    copied = noise(rng, 8, 13, 26)
    cache = write_entry(tmp_path, noise(rng, 200) + copied + noise(rng, 200))
    ids = noise(rng, 10) + copied + noise(rng, 10)
    assert spans(cache, ids, min_tokens=9) == []
    assert spans(cache, ids, min_tokens=8) == [(10, 18, 1, 200)]
    assert spans(cache, ids[:17], min_tokens=8) == []  # seven of them


def test_spans_at_the_very_start_and_the_very_end_of_the_training_text(tmp_path):
    rng = np.random.default_rng(2)
    head, tail = noise(rng, 12, 13, 26), noise(rng, 12, 13, 26)
    train = head + noise(rng, 400) + tail
    cache = write_entry(tmp_path, train)
    ids = tail + noise(rng, 5) + head  # the end first, then the start
    assert spans(cache, ids) == [(0, 12, 1, len(train) - 12), (17, 29, 1, 0)]


def test_a_generation_wholly_in_the_training_text_is_one_span(tmp_path):
    rng = np.random.default_rng(3)
    train = noise(rng, 2000, 0, 26)
    cache = write_entry(tmp_path, train)
    assert spans(cache, train[700:1000]) == [(0, 300, 1, 700)]  # far past DEPTH
    assert spans(cache, train) == [(0, 2000, 1, 0)]


def test_nothing_found_and_min_tokens_longer_than_the_generation(tmp_path):
    rng = np.random.default_rng(4)
    cache = write_entry(tmp_path, noise(rng, 300))
    assert spans(cache, noise(rng, 50, 13, 26), min_tokens=1) == []
    assert spans(cache, noise(rng, 5), min_tokens=6) == []
    assert spans(cache, [], min_tokens=1) == []
    assert spans(cache, [-1, 99, 10**9], min_tokens=1) == []  # ids the vocabulary does not have
    with pytest.raises(ValueError, match="min_tokens must be 1 or more"):
        open_copy_index(cache, "entry").find([1, 2], 0)


@pytest.mark.parametrize("length", [10, DEPTH + 40])  # sorted by the index, and read on from train.bin
def test_a_span_that_occurs_many_times_is_counted_and_its_earliest_occurrence_given(tmp_path, length):
    rng = np.random.default_rng(5)
    copied = noise(rng, length, 13, 26)
    train = noise(rng, 50)
    for _ in range(37):
        train += copied + noise(rng, int(rng.integers(1, 20)))
    cache = write_entry(tmp_path, train)
    unseen = [27, 27, 27]  # <|unk|>: never in this train.bin
    assert spans(cache, unseen + copied + unseen) == [(3, 3 + length, 37, 50)]


def test_overlapping_maximal_spans_are_each_reported_and_none_inside_another(tmp_path):
    rng = np.random.default_rng(6)
    a, b, c = noise(rng, 10, 13, 26), noise(rng, 10, 13, 26), noise(rng, 10, 13, 26)
    train = noise(rng, 100) + a + b + noise(rng, 100) + b + c + noise(rng, 100)
    cache = write_entry(tmp_path, train)
    # a+b occurs, b+c occurs, a+b+c does not: two maximal spans overlapping on b
    assert spans(cache, a + b + c) == [(0, 20, 1, 100), (10, 30, 1, 220)]


@pytest.mark.parametrize("seed", range(24))
def test_the_same_spans_as_a_brute_force_search_on_random_data(tmp_path, seed):
    rng = np.random.default_rng(100 + seed)
    vocab = int(rng.integers(2, 5))  # a small alphabet: matches of every length happen
    train = noise(rng, int(rng.integers(50, 400)), 0, vocab)
    if seed % 3 == 0:  # long repeats, past DEPTH
        block = noise(rng, DEPTH + 30, 0, vocab)
        train += block + train[:50] + block + block[:70]
    ids = noise(rng, int(rng.integers(1, 150)), 0, vocab)
    if seed % 2 == 0:
        start = int(rng.integers(0, len(train) - 100))
        ids = ids[: len(ids) // 2] + train[start : start + 100] + ids[len(ids) // 2 :]
    cache = write_entry(tmp_path, train)
    index = open_copy_index(cache, "entry")
    for min_tokens in (1, 3, 8):
        found = [(c.start, c.end, c.occurrences) for c in index.find(ids, min_tokens)]
        assert found == brute_force(train, ids, min_tokens), min_tokens
        for c in index.find(ids, min_tokens):
            assert train[c.train_position : c.train_position + c.end - c.start] == ids[c.start : c.end]


# ---- where in the text ------------------------------------------------------------------------------

DOCUMENTS = [
    "Première scène — « Où est le café ? »\nROMEO: Ünïcödé wörds, ñ and 日本語 here.\n",
    "Second file 🙂 with an emoji.\nJULIET: a line that names Zoë and Chloë.\n",
    "Third file: naïve façades, smörgåsbord.\nNURSE: the end of it all, ∑ and ∞.\n",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, str, list[str], Any]:
    """A token cache entry prepared as train.py prepares one (byte-level BPE) from three files of text
    that is not all ASCII; the cache, the entry's key, the training split's documents as read here, and
    the run's settings."""
    folder = tmp_path_factory.mktemp("documents")
    rng = np.random.default_rng(7)
    words = "the of and to a in that is was he for it with as his on be at by I".split()
    texts = []
    for number, head in enumerate(DOCUMENTS):
        lines = [" ".join(rng.choice(words, 12)) + f" {number}-{k} é🙂" for k in range(150)]
        texts.append(head + "\n".join(lines) + "\n")
        (folder / f"part-{number}.txt").write_text(texts[-1], encoding="utf-8")
    cache = tmp_path_factory.mktemp("cache")
    cfg = compose_config(*TINY_OVERRIDES, "data=text", f"data.path={folder}", f"data.cache_dir={cache}")
    entry = TextDataModule(cfg.data, cfg.tokenizer, cfg.model.block_size, cfg.seed, num_batches=1).prepare()
    boundary = int(sum(map(len, texts)) * (1 - cfg.data.val_fraction))  # the tail validates
    train, before = [], 0
    for text in texts:
        train.append(text[: max(0, boundary - before)])
        before += len(text)
    return cache, entry.key, [t for t in train if t], cfg


def test_every_position_is_located_at_its_character_line_and_document(prepared):
    """Against the tokenizer's own offsets of each document encoded here, including tokens that begin
    inside a character (a byte of 'é' or of an emoji): the character that holds their first byte."""
    cache, key, documents, _ = prepared
    index = open_copy_index(cache, key)
    tokenizer = Tokenizer.from_str((cache / "tokens" / key / "tokenizer.json").read_text(encoding="utf-8"))
    expected, ids, chars_before = [], [], 0
    for number, text in enumerate(documents):
        encoding = tokenizer.encode(text, add_special_tokens=False)
        if number:
            ids.append(tokenizer.token_to_id(EOT))
            expected.append(None)  # the separator itself
        ids += encoding.ids
        whole = "".join(documents)
        for start, _ in encoding.offsets:
            offset = chars_before + start
            expected.append((offset, whole[:offset].count("\n") + 1, number))
        chars_before += len(text)
    assert np.array_equal(np.asarray(index.tokens), ids)  # the entry holds what this test encoded
    assert any(index.table[t, 3] for t in ids)  # some tokens do begin inside a character
    for position, where in enumerate(expected):
        if where is not None:
            assert index.locate(position) == where, position


def test_a_copied_line_is_reported_where_the_text_holds_it(prepared):
    cache, key, documents, _ = prepared
    index = open_copy_index(cache, key)
    tokenizer = Tokenizer.from_str((cache / "tokens" / key / "tokenizer.json").read_text(encoding="utf-8"))
    line = "JULIET: a line that names Zoë and Chloë.\n"
    ids = tokenizer.encode("zq xv " + line + "zq vx", add_special_tokens=False).ids
    (copy,) = [c for c in index.find(ids, min_tokens=8)]
    piece = tokenizer.decode(ids[copy.start : copy.end])
    whole = "".join(documents)
    assert whole[copy.char_offset :].startswith(piece) and line.strip() in piece
    assert copy.line == whole[: copy.char_offset].count("\n") + 1 == len(documents[0].splitlines()) + 2
    assert copy.document == 1 and copy.line_in_document == 2
    assert copy.file is None  # no run settings given: no file named
    assert json.loads(json.dumps(vars(copy))) == vars(copy)  # what the studio sends the page


def test_the_run_s_files_name_the_file_and_line_a_span_is_in(prepared):
    cache, key, documents, cfg = prepared
    tokenizer = Tokenizer.from_str((cache / "tokens" / key / "tokenizer.json").read_text(encoding="utf-8"))
    index = open_copy_index(cache, key, source_of_entry(cfg.data, cfg.tokenizer, key))
    line = documents[2].splitlines()[40]
    (copy,) = index.find(tokenizer.encode(f"zq {line}\nzq", add_special_tokens=False).ids, min_tokens=8)
    assert Path(copy.file) == Path(cfg.data.path) / "part-2.txt"
    assert (copy.document_in_file, copy.documents_in_file, copy.document) == (0, 1, 2)
    assert copy.line_in_document == 41  # the line's number in part-2.txt
    assert json.loads((index.folder / "files.json").read_text(encoding="utf-8"))["files"][2][1] == 1
    again = open_copy_index(cache, key, source_of_entry(cfg.data, cfg.tokenizer, key))  # files.json is read back
    assert again.files == index.files


def table_corpus(folder: Path, rows: dict[str, list]):
    """A run's settings and its prepared entry, from .jsonl files of these rows (and a validation file)."""
    (folder / "train").mkdir()
    for name, texts in rows.items():
        (folder / "train" / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    (folder / "val.jsonl").write_text(json.dumps({"text": "the validation text, " * 20}) + "\n", encoding="utf-8")
    cfg = compose_config(
        *TINY_OVERRIDES,
        "data=text",
        f"data.path={folder / 'train'}",
        f"data.val_path={folder / 'val.jsonl'}",
        f"data.cache_dir={folder / 'cache'}",
    )
    return cfg, TextDataModule(cfg.data, cfg.tokenizer, cfg.model.block_size, cfg.seed, num_batches=1).prepare()


def test_rows_of_several_table_files_are_named_by_file_and_row_skipping_empty_ones(tmp_path):
    rows = {
        "a.jsonl": ["first file, row one", "", "first file, row three"],
        "a2.jsonl": [],  # an empty file: no rows
        "b.jsonl": [f"row {k} of the second file: " + "the king and the queen " * 3 for k in range(4)],
    }
    cfg, entry = table_corpus(tmp_path, rows)
    index = open_copy_index(cfg.data.cache_dir, entry.key, source_of_entry(cfg.data, cfg.tokenizer, entry.key))
    tokenizer = Tokenizer.from_str(entry.tokenizer_json)
    (copy,) = index.find(tokenizer.encode(rows["b.jsonl"][2], add_special_tokens=False).ids, min_tokens=8)
    assert (Path(copy.file).name, copy.document_in_file, copy.documents_in_file) == ("b.jsonl", 2, 4)
    assert copy.document == 4 and copy.line_in_document == 1


def test_a_file_that_cannot_be_read_alone_leaves_spans_placed_by_document_in_one_warning(tmp_path, caplog):
    rows = {"a.jsonl": ["the king and the queen went out " * 9], "b.jsonl": [4200, 4300]}  # numbers: read as text
    cfg, entry = table_corpus(tmp_path, rows)  # with a.jsonl's columns; alone, b.jsonl's are numbers
    with caplog.at_level(logging.WARNING, logger="data.copies"):
        index = open_copy_index(cfg.data.cache_dir, entry.key, source_of_entry(cfg.data, cfg.tokenizer, entry.key))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "data.copies"]
    assert len(warnings) == 1 and "spans are placed by document" in warnings[0]
    ids = Tokenizer.from_str(entry.tokenizer_json).encode(rows["a.jsonl"][0], add_special_tokens=False).ids
    (copy,) = index.find(ids, min_tokens=8)
    assert copy.file is None and copy.document == 0


@pytest.mark.parametrize("saved", ["another entry", "counts as text", "another file", "not json"])
def test_a_files_json_that_is_not_this_entry_s_is_counted_again(prepared, saved):
    cache, key, _, cfg = prepared
    source = source_of_entry(cfg.data, cfg.tokenizer, key)
    index = open_copy_index(cache, key, source)
    path, right = index.folder / "files.json", [(f, 1) for f in source.train_files]
    wrong = {
        "another entry": {"entry": "other", "files": [[f, 1] for f in source.train_files]},
        "counts as text": {"entry": key, "files": [[f, "1"] for f in source.train_files]},
        "another file": {"entry": key, "files": [[f + "x", 1] for f in source.train_files]},
    }.get(saved)
    path.write_text("{" if saved == "not json" else json.dumps(wrong), encoding="utf-8")
    assert open_copy_index(cache, key, source).files == right
    assert [tuple(f) for f in json.loads(path.read_text(encoding="utf-8"))["files"]] == right


def test_files_changed_since_they_were_tokenized_name_no_file(prepared, tmp_path):
    cache, key, _, cfg = prepared
    moved = compose_config(*TINY_OVERRIDES, "data=text", f"data.path={tmp_path}", f"data.cache_dir={cache}")
    (tmp_path / "other.txt").write_text("other text\n", encoding="utf-8")
    assert source_of_entry(moved.data, moved.tokenizer, key) is None
    assert source_of_entry(cfg.data, cfg.tokenizer, key) is not None


# ---- a damaged, stale or missing index; two builders -------------------------------------------------


def built(tmp_path: Path, count: int = 5000) -> tuple[Path, Path, list[int]]:
    rng = np.random.default_rng(8)
    train = noise(rng, count, 0, 26)
    cache = write_entry(tmp_path, train)
    open_copy_index(cache, "entry")
    return cache, cache / "tokens" / "entry.copies", train


def reversed_half(path: Path) -> None:
    positions = np.fromfile(path, dtype=np.uint32)
    positions[: len(positions) // 2] = positions[: len(positions) // 2][::-1].copy()
    positions.tofile(path)


DAMAGES = {
    "cut short": lambda folder: os.truncate(folder / "suffixes.bin", (folder / "suffixes.bin").stat().st_size - 8),
    "edited": lambda folder: reversed_half(folder / "suffixes.bin"),
    "marks edited": lambda folder: (folder / "marks.bin").write_bytes(bytes((folder / "marks.bin").stat().st_size)),
    "meta missing": lambda folder: (folder / "meta.json").unlink(),
    "meta not json": lambda folder: (folder / "meta.json").write_text("{", encoding="utf-8"),
    "starts cut short": lambda folder: os.truncate(folder / "starts.bin", 0),
    "starts moved": lambda folder: np.full(1, 7, dtype=np.uint32).tofile(folder / "starts.bin"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_index_is_named_in_one_warning_and_built_again(tmp_path, caplog, damage):
    cache, folder, train = built(tmp_path)
    DAMAGES[damage](folder)
    with caplog.at_level(logging.WARNING, logger="data.copies"):
        index = open_copy_index(cache, "entry")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"the copy index {folder} is damaged or out of date" in warnings[0]
    assert [(c.start, c.end, c.train_position) for c in index.find(train[100:140])] == [(0, 40, 100)]


def test_an_index_of_an_entry_prepared_again_is_stale_and_built_again(tmp_path, caplog):
    cache, folder, _ = built(tmp_path)
    rng = np.random.default_rng(9)
    again = noise(rng, 3000, 0, 26)
    write_entry(cache, again)  # the entry rebuilt, with another number of training tokens
    with caplog.at_level(logging.WARNING, logger="data.copies"):
        index = open_copy_index(cache, "entry")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "meta.json has train_tokens 5000 where the entry now has 3000" in warnings[0]
    assert [(c.start, c.end, c.train_position) for c in index.find(again[10:30])] == [(0, 20, 10)]


def test_an_index_damaged_after_it_was_opened_does_not_answer_but_is_built_again(tmp_path, caplog):
    cache, folder, train = built(tmp_path)
    index = open_copy_index(cache, "entry")
    positions = np.fromfile(folder / "suffixes.bin", dtype=np.uint32)
    positions[::-1].tofile(folder / "suffixes.bin")  # the order reversed (the opened index maps the file: it sees this)
    with caplog.at_level(logging.WARNING, logger="data.copies"):
        found = index.find(train[2000:2030], min_tokens=8)
    assert [(c.start, c.end, c.train_position) for c in found] == [(0, 30, 2000)]
    assert "building it again" in caplog.text


def test_two_processes_build_one_index_the_other_waits_and_reads(tmp_path):
    rng = np.random.default_rng(10)
    train = noise(rng, 2_000_000, 0, 4)  # about a second to build
    cache = write_entry(tmp_path, train)
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
        "from data.copies import open_copy_index; "
        f"print(len(open_copy_index(sys.argv[1], 'entry').find({train[5000:5100]})))"
    )
    command = [sys.executable, "-c", script, str(cache)]
    procs = [
        subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results
    assert [out.strip() for out, _ in results] == ["1", "1"]
    logs = "".join(err for _, err in results)
    assert logs.count("building the copy index of") == 1, logs
    assert not (cache / "tokens" / "entry.copies.partial").exists()
    assert not list((cache / "tokens" / ".locks").iterdir())


def test_a_read_only_cache_gets_its_index_in_a_temporary_folder_of_the_users(tmp_path):
    rng = np.random.default_rng(11)
    train = noise(rng, 3000, 0, 26)
    cache = write_entry(tmp_path / "cache", train)
    temp = tmp_path / "temp"
    temp.mkdir()
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
        "from data.copies import open_copy_index; "
        f"index = open_copy_index(sys.argv[1], 'entry'); print(index.folder, len(index.find({train[100:150]})))"
    )
    command = [sys.executable, "-c", script, str(cache)]
    if os.geteuid() == 0:  # root may write anywhere: run without that right, as a user would
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", *command]
    subprocess.run(["chmod", "-R", "a-w", str(cache)], check=True)
    try:
        done = subprocess.run(
            command, cwd=ROOT, env={**os.environ, "TMPDIR": str(temp)}, capture_output=True, text=True
        )
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(cache)], check=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(temp / f"tinygpt2-{os.getuid()}-copies" / "entry.copies"), "1"]
    assert f"the token cache {cache / 'tokens'} cannot be written: the copy index goes in" in done.stderr
    assert sorted(p.name for p in (cache / "tokens").iterdir()) == ["entry"]
