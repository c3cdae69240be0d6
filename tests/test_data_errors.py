"""Bad input: one line that names the file or setting and says how to fix it, and no cache left behind."""

from __future__ import annotations

import json
import os

import datasets
import huggingface_hub
import pytest
from omegaconf import OmegaConf

from data import DataError
from data.datamodule import TextDataModule
from tests.common import TINY_OVERRIDES, bpe_config, data_config, hub_folder, one_error_line, refused, train_here


def refused_preparation(tmp_path, tokenizer=None, block_size=32, tokenized=False, **data) -> str:
    """Prepare with these settings; return the DataError's message, after checking it is one line and
    that the cache holds nothing half-made (nor anything at all, not even a lock file or the cache folder
    itself, unless the error came after tokenizing)."""
    dm = TextDataModule(data_config(tmp_path / "cache", **data), tokenizer or bpe_config(), block_size, 0, 1)
    with pytest.raises(DataError) as caught:
        dm.prepare()
    message = str(caught.value)
    assert "\n" not in message
    tokens = tmp_path / "cache" / "tokens"
    if tokenized:  # a whole entry, usable with a smaller block_size; nothing else (no lock file left in .locks)
        left = [p for p in tokens.iterdir() if p.name != ".locks"]
        assert len(left) == 1 and (left[0] / "meta.json").is_file() and os.listdir(tokens / ".locks") == []
    else:
        assert not (tmp_path / "cache").exists()
    return message


def test_missing_path(tmp_path):
    message = refused_preparation(tmp_path, path=str(tmp_path / "missing.txt"))
    assert message == f"data.path {tmp_path / 'missing.txt'} does not exist; give a file, a folder or a glob"


def test_glob_that_matches_nothing(tmp_path):
    assert "matches no files; check the pattern" in refused_preparation(tmp_path, path=str(tmp_path / "nothing-*.txt"))


def test_no_path_at_all(tmp_path):
    assert refused_preparation(tmp_path, path=None).startswith("data=text needs data.path")


def test_empty_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert (
        refused_preparation(tmp_path, path=str(empty))
        == f"data.path file {empty} is empty; give a file with text in it"
    )


@pytest.mark.parametrize("encoding, name", [("utf-16", "UTF-16"), ("utf-16-be", "UTF-16"), ("utf-32", "UTF-32")])
@pytest.mark.parametrize("errors", ["strict", "replace"])
def test_a_file_saved_as_utf16_or_utf32_is_named_so_whatever_data_errors_says(tmp_path, encoding, name, errors):
    """Read as UTF-8 with data.errors=replace (what the not-UTF-8 message offers), such a file would
    train on every other byte zero."""
    wide = tmp_path / "wide.txt"
    mark = "\ufeff" if encoding == "utf-16-be" else ""  # (Python's utf-16 and utf-32 write the mark themselves)
    wide.write_bytes((mark + "First Citizen:\nBefore we proceed any further, hear me speak.\n").encode(encoding))
    message = refused_preparation(tmp_path, path=str(wide), errors=errors)
    assert message == (
        f"{wide} is {name} text (it starts with a {name} byte-order mark), not UTF-8; convert it to UTF-8: "
        f"iconv -f {name} -t UTF-8 {wide} > {tmp_path / 'wide-utf8.txt'}"
    )


@pytest.mark.parametrize("encoding, name", [("utf-16-le", "UTF-16LE"), ("utf-16-be", "UTF-16BE")])
def test_a_file_saved_as_utf16_without_a_byte_order_mark_is_named_so(tmp_path, encoding, name):
    """Such a file is valid UTF-8 (NUL is a character), so it trained on every other character a NUL."""
    wide = tmp_path / "wide.txt"
    wide.write_bytes("First Citizen:\nBefore we proceed any further, hear me speak.\n".encode(encoding))
    at = 1 if name == "UTF-16LE" else 0
    assert refused_preparation(tmp_path, path=str(wide), errors="replace") == (
        f"{wide} holds NUL bytes (the first at byte {at}): it looks like {name} text without a byte-order mark, "
        f"not UTF-8; convert it to UTF-8: iconv -f {name} -t UTF-8 {wide} > {tmp_path / 'wide-utf8.txt'}"
    )


@pytest.mark.parametrize("errors", ["strict", "replace"])
def test_a_binary_file_is_refused_whatever_data_errors_says(tmp_path, small_text, errors):
    """A program or an image among the text (here a PNG's first bytes, named .txt) trained as text with
    data.errors=replace, or with no bad byte at all when its bytes happen to be valid UTF-8."""
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text(small_text.read_text(encoding="utf-8"), encoding="utf-8")
    image = books / "b.txt"
    image.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x01\x00" + bytes(range(256)) * 4)
    assert refused_preparation(tmp_path, path=str(books), errors=errors) == (
        f"{image} holds NUL bytes (the first at byte 8), so it is not text; move it out of data.path"
    )


def test_a_table_given_as_tiny_shakespeare_points_to_data_text(tmp_path):
    """data=shakespeare reads its data.path as plain text; its settings have no text column."""
    table = tmp_path / "dump.jsonl"
    table.write_text('{"content": "First Citizen: hear me speak."}\n')
    message = refused_preparation(tmp_path, source="shakespeare", path=str(table))
    assert message == (
        f"data.path={table} is json and data=shakespeare reads plain text; for your own files use data=text "
        f"data.path={table} (data.text_column names the column that holds the text)"
    )


def test_a_text_too_short_to_leave_training_text_says_so(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a")
    assert refused_preparation(tmp_path, path=str(one)) == (
        f"{one} holds no training text: it is too short to leave any once its validation share "
        "(data.val_fraction) is taken; give a longer text"
    )


def test_files_that_hold_only_blank_lines(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n\n")
    assert refused_preparation(tmp_path, path=str(blank), one_document_per="line") == f"{blank} holds no text"


@pytest.mark.parametrize("suffix", ["txt", "jsonl", "csv"])
def test_a_file_that_is_not_utf8_is_named_with_the_place(tmp_path, small_text, suffix):
    good = small_text.read_text()[:3000]
    body = good[:2000] + "caf\xe9" + good[2000:]  # Latin-1 é: one byte that UTF-8 never starts with
    path = tmp_path / f"latin1.{suffix}"
    if suffix == "txt":
        path.write_bytes(body.encode("latin-1", "replace"))
    elif suffix == "jsonl":
        path.write_bytes(
            b'{"text": "' + body.replace("\n", " ").replace('"', "'").encode("latin-1", "replace") + b'"}\n'
        )
    else:
        path.write_bytes(b'text\n"' + body.replace('"', "'").encode("latin-1", "replace") + b'"\n')
    message = refused_preparation(tmp_path, path=str(path))
    assert message.startswith(f"{path} is not UTF-8 text: byte ") and "is 0xe9" in message
    assert "data.errors=replace" in message
    if suffix == "txt":
        line = good[:2000].count("\n") + 1
        assert f"byte {len(good[:2000].encode()) + 3} (line {line})" in message  # after "caf"
    dm = TextDataModule(data_config(tmp_path / "cache", path=str(path), errors="replace"), bpe_config(), 32, 0, 1)
    text = dm.tokenizer.decode(dm.prepare().ids("train").tolist())
    assert "caf\ufffd" in text


def test_a_bad_byte_past_the_first_block_is_placed_exactly(tmp_path):
    good = ("é" * 10 + "abc\n").encode()  # 24 bytes a line; two-byte characters straddle the 1 MiB blocks
    at = 24 * 62_500  # the start of line 62501, past the first block
    path = tmp_path / "big.txt"
    path.write_bytes(good * 62_500 + b"\xff" + good * 20_000)
    assert f"byte {at} (line 62501) is 0xff" in refused_preparation(tmp_path, path=str(path))


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_text_column_that_does_not_exist_lists_the_ones_that_do(tmp_path, fmt):
    table = datasets.Dataset.from_dict({"title": ["a", "b"] * 50, "body": ["some text here " * 10] * 100})
    path = tmp_path / f"table.{fmt}"
    {
        "jsonl": lambda: table.to_json(path, lines=True),
        "csv": lambda: table.to_csv(path),
        "parquet": lambda: table.to_parquet(path),
    }[fmt]()
    message = refused_preparation(tmp_path, path=str(path))  # text_column defaults to "text"
    assert message == (
        f"data.text_column='text' is not a column of {path}; its columns are title, body; "
        "set data.text_column to the one that holds the text"
    )


def test_a_jsonl_file_with_one_bad_row_is_named_by_its_line_once(tmp_path, capfd, caplog):
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(f'{{"text": "line {i}"}}\n' for i in range(2000)) + "\n{not json\n")
    message = refused_preparation(tmp_path, path=str(path))
    assert message.startswith(f"{path}, line 2002, is not JSON (")  # as an editor counts, the blank line too
    assert message.endswith("fix that line, or remove it")
    _, err = capfd.readouterr()
    assert "Failed to load JSON" not in err + caplog.text  # said once, by the error, not logged before it


def test_a_file_that_is_not_what_its_extension_says(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n{"text": not json\n')
    assert refused_preparation(tmp_path, path=str(path)).startswith(f"{path}, line 2, is not JSON (")
    fake = tmp_path / "fake.parquet"
    fake.write_text("plain text, not parquet")
    assert refused_preparation(tmp_path, path=str(fake)).startswith(
        f"{fake} cannot be read as parquet: Parquet magic bytes not found"
    )


def test_a_text_column_of_numbers(tmp_path):
    path = tmp_path / "numbers.jsonl"
    datasets.Dataset.from_dict({"text": list(range(100))}).to_json(path, lines=True)
    assert (
        refused_preparation(tmp_path, path=str(path))
        == f"data.text_column='text' of {path} holds an int value (0), not text; set data.text_column to the column "
        "that holds the text, or, if this is it, write that value as a string"
    )


def test_one_value_that_is_not_text_among_many_is_shown(tmp_path):
    path = tmp_path / "one_number.jsonl"
    rows = [json.dumps({"text": f"line {i} of the text"}) for i in range(500)] + [json.dumps({"text": [1, 2]})]
    path.write_text("\n".join(rows) + "\n")
    assert "holds a list value ([1, 2]), not text;" in refused_preparation(tmp_path, path=str(path))


def test_validation_part_shorter_than_a_window(tmp_path, small_text):
    message = refused_preparation(tmp_path, path=str(small_text), block_size=20_000, tokenized=True)
    assert message.startswith("the val split has ") and "fewer than block_size + 1 = 20001" in message
    assert "a larger data.val_fraction" in message and "model.block_size" in message


def test_training_part_shorter_than_a_window(tmp_path):
    path = tmp_path / "ten.txt"
    path.write_text("0123456789")
    message = refused_preparation(tmp_path, tokenizer=bpe_config(vocab_size=260), path=str(path), tokenized=True)
    assert message.startswith("the train split has ") and "a smaller data.val_fraction" in message  # not larger


def test_a_validation_file_shorter_than_a_window_asks_for_a_longer_one(tmp_path, small_text):
    """With data.val_path the validation split is that file: data.val_fraction would change nothing."""
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.\n")
    message = refused_preparation(tmp_path, path=str(small_text), val_path=str(short), tokenized=True)
    assert message.startswith("the val split has ") and message.endswith(
        "; use a longer data.val_path text, or a smaller model.block_size"
    )


@pytest.mark.parametrize("train_suffix, val_suffix", [("txt", "jsonl"), ("jsonl", "txt")])
def test_a_validation_file_of_another_format_than_the_training_files(tmp_path, train_suffix, val_suffix):
    """A .jsonl data.val_path beside .txt training files was read as plain text: the model was validated
    on the JSON itself, braces, keys and escapes."""
    rows = "".join(f'{{"text": "line {i} of a story"}}\n' for i in range(200))
    train, val = tmp_path / f"train.{train_suffix}", tmp_path / f"val.{val_suffix}"
    train.write_text(rows)
    val.write_text(rows)
    kinds = {"txt": "txt", "jsonl": "json"}
    assert refused_preparation(tmp_path, path=str(train), val_path=str(val)) == (
        f"data.val_path {val} is {kinds[val_suffix]} and data.path {train} is {kinds[train_suffix]}; give "
        f"validation files of the training files' format, {kinds[train_suffix]}"
    )


def test_vocabulary_too_small_for_the_byte_alphabet(tmp_path, small_text):
    message = refused_preparation(tmp_path, bpe_config(vocab_size=200), path=str(small_text))
    assert message == (
        "tokenizer.vocab_size=200 is too small: byte-level BPE needs 256 byte tokens plus <|endoftext|>, so at least 257"
    )


def test_hub_dataset_while_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = refused_preparation(
        tmp_path, source="hub", name="roneneldan/TinyStories", split="train", val_split="auto"
    )
    assert message.startswith("data.name=roneneldan/TinyStories: the Hugging Face Hub cannot be reached (offline?)")
    assert "local dataset folder" in message and "data=text data.path=" in message


def test_hub_dataset_with_no_hub_to_reach_is_refused_at_once_in_one_line(tmp_path, monkeypatch):
    """As a user without a network runs it: the Hub is tried once, not five times with a line for each."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for module in (huggingface_hub.constants, datasets.config):  # what the run sets, put back after the test
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", module.HF_HUB_OFFLINE)
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "TINYGPT2_CACHE": str(tmp_path / "cache")}
    ran = train_here(*TINY_OVERRIDES, "data=hub", "data.name=roneneldan/TinyStories", env=env)
    assert ran.returncode == 1
    assert one_error_line(ran.stderr).startswith(
        "error: data.name=roneneldan/TinyStories: the Hugging Face Hub cannot be reached (offline?)"
    )
    assert "Retry" not in ran.stderr + ran.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run folder, no token cache


@pytest.mark.parametrize("name", ["./tiny_stories", "~/no/such/dataset", "/no/such/folder"])
def test_hub_local_folder_that_does_not_exist(name, tmp_path):
    """A local dataset folder given by its path, missing: said so, not taken for a Hub name offline."""
    message = refused_preparation(tmp_path, source="hub", name=name, split="train", val_split="auto")
    assert (
        message
        == f"data.name={name}: no such folder; give the folder of a local dataset, or a Hub dataset as owner/name"
    )


def test_hub_dataset_named_by_a_file_points_to_data_text(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("some text of my own")
    message = refused_preparation(tmp_path, source="hub", name=str(notes), split="train", val_split="auto")
    assert message == (
        f"data.name={notes} is a file, and data=hub reads a dataset (a Hub name, or a local dataset's folder); for "
        f"files of your own use data=text data.path={notes}"
    )


def test_hub_split_that_does_not_exist(tmp_path):
    folder = hub_folder(tmp_path, {"train": 30})
    message = refused_preparation(tmp_path, source="hub", name=str(folder), split="train", val_split="validation")
    assert message.startswith(f"data.val_split=validation is not a split of {folder}; it has train")


def test_a_folder_of_files_of_no_known_format_says_what_it_holds_and_how_to_read_them(tmp_path):
    notes = tmp_path / "notes"
    (notes / "2026").mkdir(parents=True)
    text = "Notes of mine, a line or two of them.\n" * 10
    for name in ("2026/a.md", "2026/b.md", "c.md", "make.py"):
        (notes / name).write_text(text)
    message = refused_preparation(tmp_path, path=str(notes))
    assert message == (
        f"data.path folder {notes} holds no files of .txt, .jsonl, .json, .csv or .parquet (it holds 3 .md files, "
        f"1 .py file; give those with a glob, e.g. data.path='{notes}/**/*.md')"
    )
    dm = TextDataModule(data_config(tmp_path / "cache", path=f"{notes}/**/*.md"), bpe_config(), 8, 0, 1)
    assert dm.prepare().meta["train_chars"] + dm.prepare().meta["val_chars"] == 3 * len(text)  # the glob, as suggested


def test_mixed_formats_in_a_folder(tmp_path):
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("text " * 100)
    (tmp_path / "books" / "meta.json").write_text('{"text": "x"}')
    message = refused_preparation(tmp_path, path=str(tmp_path / "books"))
    assert (
        message
        == f"data.path {tmp_path / 'books'} mixes formats (1 txt, 1 json); choose one with data.format=txt|json|csv|parquet"
    )
    dm = TextDataModule(
        data_config(tmp_path / "cache", path=str(tmp_path / "books"), format="txt"), bpe_config(), 8, 0, 1
    )
    assert dm.prepare().meta["train_chars"] == 450


def test_a_pretrained_tokenizer_file_that_cannot_be_read_says_what_to_give(tmp_path, small_text):
    bad = tmp_path / "bad.json"
    bad.write_text('{"bad": 1')
    cfg = OmegaConf.create({"kind": "pretrained", "path": str(bad)})
    message = refused_preparation(tmp_path, tokenizer=cfg, path=str(small_text))
    assert message.startswith(f"tokenizer.path {bad} is not a tokenizer.json that `tokenizers` can read (")
    assert message.endswith(
        "); give a tokenizer.json that a tokenizers Tokenizer saved (tokenizer.save), or a Hugging Face tokenizer folder"
    )


def test_pretrained_gpt2_files_that_cannot_be_read(tmp_path, small_text):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "vocab.json").write_text('{"a": 0}')
    (folder / "merges.txt").write_text("#version\nnot a merge line at all\n")
    cfg = OmegaConf.create({"kind": "pretrained", "path": str(folder)})
    message = refused_preparation(tmp_path, tokenizer=cfg, path=str(small_text))
    assert message.startswith(f"tokenizer.path {folder}: vocab.json or merges.txt cannot be read")


def test_pretrained_tokenizer_that_cannot_encode_the_text(tmp_path, small_text):
    """A word-level tokenizer with no unknown token fails on the first word it lacks: one line, and no
    half-made cache entry (the partial folder goes too)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"the": 0, "a": 1}))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    cfg = OmegaConf.create({"kind": "pretrained", "path": str(tmp_path / "words.json")})
    message = refused_preparation(tmp_path, tokenizer=cfg, path=str(small_text))
    assert message.startswith("the tokenizer cannot encode this text (WordLevel error: Missing [UNK] token")


def test_pretrained_tokenizer_that_is_missing(tmp_path, small_text):
    cfg = OmegaConf.create({"kind": "pretrained", "path": str(tmp_path / "nope")})
    message = refused_preparation(tmp_path, cfg, path=str(small_text))
    assert (
        message
        == f"tokenizer.path {tmp_path / 'nope'} does not exist; give a tokenizer.json or a Hugging Face tokenizer folder"
    )


def test_train_py_prints_one_error_line_for_bad_data(tmp_path):
    missing = tmp_path / "missing.txt"
    line = refused(*TINY_OVERRIDES, "data=text", f"data.path={missing}", f"hydra.run.dir={tmp_path / 'r'}")
    assert line == f"data.path {missing} does not exist; give a file, a folder or a glob"  # (and no run folder)


def renumbered_tokenizer(tmp_path, small_text, change) -> str:
    """A byte-level BPE trained on the text, saved, its vocabulary edited by change(vocab) in the JSON."""
    import json

    from data.tokenizer import train_bpe

    saved = json.loads(train_bpe([small_text.read_text(encoding="utf-8")], 300).to_str())
    change(saved["model"]["vocab"])
    file = tmp_path / "edited.json"
    file.write_text(json.dumps(saved))
    return str(file)


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda vocab: vocab.update({"Ġthe": 5000}), "its 300 tokens have ids up to 5,000, not 0 to 299"),
        (lambda vocab: vocab.update({"Ġthe": 70000}), "its 300 tokens have ids up to 70,000, not 0 to 299"),
        (lambda vocab: vocab.update({"Ġthe": vocab["a"]}), "some of its tokens share an id (1 more tokens than ids)"),
    ],
    ids=["an-id-past-the-end", "an-id-past-uint16", "two-tokens-one-id"],
)
def test_a_pretrained_tokenizer_numbered_other_than_0_to_n_is_refused_before_tokenizing(
    change, problem, tmp_path, small_text
):
    """Such a vocabulary loads in `tokenizers`, then fails later, mid-training (an id past the model's
    rows), mid-tokenizing (an id past uint16) or in the worker processes (a saved copy that does not
    read back), each time with a traceback and a partial cache entry the next run stumbles on again."""
    path = renumbered_tokenizer(tmp_path, small_text, change)
    cfg = OmegaConf.create({"kind": "pretrained", "path": path})
    message = refused_preparation(tmp_path, tokenizer=cfg, path=str(small_text))
    assert message == (
        f"tokenizer.path {path}: {problem}; a model needs one token for each id from 0 up, so give a tokenizer whose "
        "vocabulary is numbered so (as tokenizers and transformers save them)"
    )


def test_a_path_that_is_no_file_says_what_it_is(tmp_path):
    """A pipe, a link that loops, a link to nothing: each said as what it is, not as missing."""
    pipe, loop, dangling = tmp_path / "pipe.txt", tmp_path / "loop.txt", tmp_path / "gone.txt"
    os.mkfifo(pipe)
    loop.symlink_to(tmp_path / "loop2.txt")
    (tmp_path / "loop2.txt").symlink_to(loop)
    dangling.symlink_to(tmp_path / "deleted.txt")
    assert refused_preparation(tmp_path, path=str(pipe)).startswith(
        f"data.path {pipe} is not a regular file (a pipe, a device or a socket"
    )
    assert refused_preparation(tmp_path, path=str(loop)) == (
        f"data.path {loop} is a symbolic link that leads round in a loop; give a file, a folder or a glob"
    )
    assert refused_preparation(tmp_path, path=str(dangling)) == (
        f"data.path {dangling} is a symbolic link to {tmp_path / 'deleted.txt'}, which does not exist; give a file, "
        "a folder or a glob"
    )


def unreadable(folder, how: str):
    """A file in folder that cannot be read: one without read permission (which root reads all the
    same, so skipped for root), or one whose reading fails (Linux's /proc/self/mem at offset 0: EIO)."""
    file = folder / "b.txt"
    if how == "no-permission":
        file.write_text("some text\n")
        file.chmod(0)
        if os.access(file, os.R_OK):
            pytest.skip("this user reads files without read permission (root)")
    else:
        if not os.path.exists("/proc/self/mem"):
            pytest.skip("needs Linux's /proc/self/mem")
        file.symlink_to("/proc/self/mem")
    return file


@pytest.mark.parametrize("how", ["no-permission", "read-fails"])
def test_a_file_that_cannot_be_read_is_named_before_anything_is_made(tmp_path, small_text, how):
    """A file of a folder that cannot be read (chmod 000) ended in an OSError traceback."""
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text(small_text.read_text(encoding="utf-8"), encoding="utf-8")
    bad = unreadable(books, how)
    line = refused(*TINY_OVERRIDES, "data=text", f"data.path={books}", env={"TINYGPT2_CACHE": str(tmp_path / "cache")})
    assert line.startswith(f"data.path file {bad} cannot be read (")
    assert line.endswith(", or move it out of data.path")
    if how == "no-permission":
        assert f"make it readable (chmod a+r {bad})" in line
    # (and refused(): no run folder, no cache)
