"""The token cache: reuse, invalidation, sharded multi-process tokenizing, resuming, one preparer at a time."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import datasets
import numpy as np
import pytest
from omegaconf import OmegaConf

import data.cache
import data.prepare
from data import DataError
from data.cache import find_cache
from data.datamodule import TextDataModule
from data.tokenizer import EOT
from tests.common import (
    CHAR_TOKENIZER,
    ROOT,
    TINY_OVERRIDES,
    bpe_config,
    compose_config,
    data_config,
    inject_faults,
    one_error_line,
    refused,
    runs_under,
    script_command,
    script_environment,
    snapshot,
    train_here,
)


def datamodule(cache_dir, path, tokenizer=None, progress=None, **data):
    cfg = data_config(cache_dir, path=str(path), **data)
    return TextDataModule(cfg, tokenizer or bpe_config(), 32, seed=3, num_batches=50, progress=progress)


def entries(cache_dir):
    tokens = cache_dir / "tokens"
    return sorted(p.name for p in tokens.iterdir() if not p.name.startswith(".")) if tokens.is_dir() else []


def test_second_preparation_reuses_the_cache(tmp_path, small_text, monkeypatch):
    first = datamodule(tmp_path, small_text).prepare()
    assert (first.folder / "meta.json").is_file() and entries(tmp_path) == [first.folder.name]
    calls = []
    monkeypatch.setattr(data.prepare, "build_tokenizer", lambda *a: calls.append(a))
    monkeypatch.setattr(data.prepare, "encode_corpus", lambda *a, **k: calls.append(a))
    second = datamodule(tmp_path, small_text).prepare()
    assert calls == [] and second.folder == first.folder
    assert np.array_equal(second.ids("train"), first.ids("train"))


def test_changed_text_or_tokenizer_gets_a_new_cache_entry(tmp_path, small_text):
    copy = tmp_path / "copy.txt"
    copy.write_text(small_text.read_text())
    base = datamodule(tmp_path, copy).prepare().folder
    assert datamodule(tmp_path, copy, bpe_config(vocab_size=320)).prepare().folder != base
    assert datamodule(tmp_path, copy, val_fraction=0.2).prepare().folder != base
    copy.write_text(small_text.read_text() + " one more line")  # the same file, changed
    changed = datamodule(tmp_path, copy)
    assert changed.prepare().folder != base
    assert changed.tokenizer.decode(changed.cache.ids("val").tolist()).endswith(" one more line")


def test_processes_and_shard_sizes_do_not_change_the_ids(tmp_path, documents):
    one = datamodule(tmp_path / "a", documents, num_proc=1).prepare()
    many = datamodule(tmp_path / "b", documents, num_proc=2, shard_chars=30_000).prepare()
    assert np.array_equal(one.ids("train"), many.ids("train")) and np.array_equal(one.ids("val"), many.ids("val"))
    assert one.meta == many.meta
    # and they are the documents, each encoded whole, joined by end-of-text
    tokenizer = datamodule(tmp_path / "a", documents).tokenizer
    texts = [p.read_text() for p in sorted(documents.iterdir())]
    n_train_docs = int(sum(map(len, texts)) * 0.9) // 25_000
    expected = []
    for i, text in enumerate(texts[:n_train_docs]):
        expected += ([tokenizer.token_to_id(EOT)] if i else []) + tokenizer.encode(text).ids
    assert one.ids("train")[: len(expected)].tolist() == expected


def test_num_proc_above_the_cores_starts_one_process_per_core(tmp_path, documents, caplog):
    """A data.num_proc of thousands would start thousands of processes, each holding shards in memory."""
    cores = data.prepare.usable_cores()
    seen = []
    with caplog.at_level("INFO"):
        datamodule(
            tmp_path, documents, progress=lambda _: seen.append(len(multiprocessing.active_children())),
            num_proc=cores + 3, shard_chars=100_000,
        ).prepare()  # fmt: skip
    assert seen and max(seen) <= cores
    assert f"data.num_proc={cores + 3}: tokenizing with {cores} processes, one per CPU core" in caplog.text


def test_a_file_written_while_it_is_tokenized_is_refused_and_nothing_is_kept(tmp_path, small_text):
    """Its tokens are of no one version of the file: kept under the key of the first, they would be
    found by a run on that version."""
    text = tmp_path / "growing.txt"
    text.write_text(small_text.read_text(encoding="utf-8"), encoding="utf-8")

    def append(_record) -> None:
        with open(text, "a", encoding="utf-8") as log:
            log.write("another line, written as the file is read\n")

    with pytest.raises(
        DataError, match=f"^{text} changed while it was tokenized; run again once it is no longer being written$"
    ):
        datamodule(tmp_path / "cache", text, progress=append, num_proc=1, shard_chars=20_000).prepare()
    assert entries(tmp_path / "cache") == []


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory, full_text):
    """The same text as 600 JSON Lines records."""
    path = tmp_path_factory.mktemp("jsonl") / "speeches.jsonl"
    text = full_text.read_text(encoding="utf-8")
    datasets.Dataset.from_dict({"text": [text[i * 1000 : (i + 1) * 1000] for i in range(600)]}).to_json(
        path, lines=True
    )
    return path


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_an_interrupted_preparation_resumes_where_it_stopped(tmp_path, documents, jsonl_corpus, kind):
    corpus = documents if kind == "txt" else jsonl_corpus
    clean = datamodule(tmp_path / "clean", corpus, num_proc=1).prepare()

    def stop_after_three(record):
        if record["index"] == 2:
            raise KeyboardInterrupt  # as Ctrl-C would, between shards

    with pytest.raises(KeyboardInterrupt):
        datamodule(tmp_path / "c", corpus, progress=stop_after_three, num_proc=2, shard_chars=40_000).prepare()
    tokens = tmp_path / "c" / "tokens"
    (staging,) = tokens.glob("*.partial")
    assert find_cache(tmp_path / "c", staging.name.removesuffix(".partial")) is None  # not mistaken for an entry
    assert sorted(p.name for p in (staging / "shards").glob("*.json")) == ["000000.json", "000001.json", "000002.json"]

    encoded = []
    resumed = datamodule(tmp_path / "c", corpus, progress=encoded.append, num_proc=2, shard_chars=40_000).prepare()
    assert [r["index"] for r in encoded] == list(range(3, 3 + len(encoded))) and len(encoded) >= 5  # 0-2 were kept
    assert not staging.exists() and sorted(os.listdir(resumed.folder)) == [
        "meta.json",
        "tokenizer.json",
        "train.bin",
        "val.bin",
    ]
    assert np.array_equal(resumed.ids("train"), clean.ids("train")) and np.array_equal(
        resumed.ids("val"), clean.ids("val")
    )


@pytest.mark.parametrize("how", ["record cannot be read", "shard file missing", "tokenizer"])
def test_a_partial_entry_damaged_between_runs_is_said_and_redone_from_the_damage(tmp_path, documents, how, caplog):
    """A partial entry with a shard's record or files broken (a stray edit, a copy gone wrong) ended in a
    JSONDecodeError or FileNotFoundError traceback on every later run; an unreadable
    tokenizer.json in an Exception from `tokenizers`."""

    def stop_after_three(record):
        if record["index"] == 2:
            raise KeyboardInterrupt  # as Ctrl-C would, between shards

    with pytest.raises(KeyboardInterrupt):
        datamodule(tmp_path, documents, progress=stop_after_three, num_proc=1, shard_chars=40_000).prepare()
    (staging,) = (tmp_path / "tokens").glob("*.partial")
    damaged = {
        "record cannot be read": staging / "shards" / "000001.json",
        "shard file missing": staging / "shards" / "000001.val.bin",
        "tokenizer": staging / "tokenizer.json",
    }[how]
    damaged.unlink() if how == "shard file missing" else damaged.write_text("{oops")
    encoded = []
    resumed = datamodule(tmp_path, documents, progress=encoded.append, num_proc=1, shard_chars=40_000).prepare()
    assert encoded[0]["index"] == (0 if how == "tokenizer" else 1)
    assert str(staging / ("tokenizer.json" if how == "tokenizer" else "shards/000001.json")) in caplog.text
    clean = datamodule(tmp_path / "clean", documents, num_proc=1).prepare()
    assert np.array_equal(resumed.ids("train"), clean.ids("train")) and np.array_equal(
        resumed.ids("val"), clean.ids("val")
    )


KILLABLE = """
import sys
sys.path.insert(0, {root!r})
from omegaconf import OmegaConf
from tests.common import data_config
from data.datamodule import TextDataModule
cfg = data_config({cache!r}, path={path!r}, num_proc=2, shard_chars=20_000)
TextDataModule(cfg, OmegaConf.create({char!r}), 32, 0, 1).prepare()
"""


@pytest.mark.slow
def test_a_killed_preparation_resumes_and_a_half_written_shard_is_redone(tmp_path, documents):
    script = KILLABLE.format(root=str(ROOT), cache=str(tmp_path / "cache"), path=str(documents), char=CHAR_TOKENIZER)
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stderr=subprocess.PIPE)
    shards = tmp_path / "cache" / "tokens"
    deadline = time.monotonic() + 120
    while not any(shards.glob("*.partial/shards/000002.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)  # the preparing process and its workers, mid-way
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert entries(tmp_path / "cache") == [next(shards.glob("*.partial")).name]
    done = sorted((next(shards.glob("*.partial")) / "shards").glob("*.json"))
    assert 3 <= len(done) < 24  # the documents make 24 shards

    (staging,) = shards.glob("*.partial")
    next_bin = staging / "shards" / f"{len(done):06d}.train.bin"
    next_bin.write_bytes(b"\x01\x02\x03")  # a shard cut off part way, without its record

    encoded = []
    char = OmegaConf.create(CHAR_TOKENIZER)
    resumed = datamodule(tmp_path / "cache", documents, char, encoded.append, num_proc=2, shard_chars=20_000).prepare()
    assert encoded[0]["index"] == len(done)
    clean = datamodule(tmp_path / "clean", documents, char, num_proc=1).prepare()
    assert np.array_equal(resumed.ids("train"), clean.ids("train")) and np.array_equal(
        resumed.ids("val"), clean.ids("val")
    )


def test_a_staging_folder_whose_build_finished_is_completed_not_redone(tmp_path, small_text, monkeypatch):
    first = datamodule(tmp_path, small_text).prepare()
    staging = first.folder.with_name(first.folder.name + ".partial")
    first.folder.rename(staging)  # as if stopped between writing meta.json and the rename
    monkeypatch.setattr(data.prepare, "encode_corpus", lambda *a, **k: pytest.fail("tokenized again"))
    again = datamodule(tmp_path, small_text).prepare()
    assert again.folder == first.folder and not staging.exists()


def prepare_in_process(cache_dir, path, results):
    built = []
    cache = datamodule(cache_dir, path, progress=built.append, shard_chars=100_000).prepare()
    results.put((os.getpid(), bool(built), cache.folder.name, int(cache.ids("train").sum())))


def test_only_one_process_prepares_the_others_wait_and_read(tmp_path, documents):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    procs = [context.Process(target=prepare_in_process, args=(tmp_path, documents, results)) for _ in range(3)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    assert sum(built for _, built, _, _ in outcomes) == 1  # one tokenized, two found its result
    assert len({(folder, total) for _, _, folder, total in outcomes}) == 1
    assert entries(tmp_path) == [outcomes[0][2]]
    assert os.listdir(tmp_path / "tokens" / ".locks") == []  # each lock's file went with its last holder
    meta = json.loads((tmp_path / "tokens" / outcomes[0][2] / "meta.json").read_text())
    assert meta["train_tokens"] > 0


def prepare_and_say(cache_dir, path, said):
    """prepare() in a forked process, passing on each line it logs."""
    handler = logging.Handler()
    handler.emit = lambda record: said.put(record.getMessage())
    logging.getLogger("data").addHandler(handler)
    logging.getLogger("data").setLevel(logging.INFO)
    datamodule(cache_dir, path).prepare()
    said.put(None)


def test_a_process_that_waited_for_another_says_it_used_that_ones_tokens(tmp_path, small_text):
    """It logged "tokenizing ... once" and then a count of tokens and seconds, as if it had made them."""
    made = datamodule(tmp_path / "elsewhere", small_text).prepare().folder
    tokens = tmp_path / "tokens"
    (tokens / ".locks").mkdir(parents=True)
    lock = data.cache.entry_lock(tokens, made.name)
    lock.acquire()  # as the process that prepares these tokens holds it
    context = multiprocessing.get_context("fork")
    said = context.Queue()
    waiter = context.Process(target=prepare_and_say, args=(tmp_path, small_text, said))
    waiter.start()
    lines = [said.get(timeout=60)]
    assert lines[0].startswith("another process is preparing these tokens; waiting for it")
    shutil.copytree(made, tokens / made.name)  # the other process's entry, whole
    data.cache.let_go(lock)
    lines += iter(lambda: said.get(timeout=60), None)
    waiter.join()
    assert lines[1:] == [f"using the tokens of {small_text} that another process prepared, from {tokens / made.name}"]


# ---- the cache's own folders --------------------------------------------------------------------------


@pytest.mark.parametrize("place", ["tokens", "tokens/.locks", "tokens/{key}", "tokens/{key}.partial"])
def test_a_file_where_the_cache_keeps_a_folder_is_named_and_left_alone(place, tmp_path, small_text):
    _, key = data.prepare.corpus_key(data_config(tmp_path, path=str(small_text)), bpe_config())
    blocker = tmp_path / place.format(key=key)
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a folder")
    with pytest.raises(DataError) as refused:
        datamodule(tmp_path, small_text).prepare()
    assert str(refused.value) == (
        f"the token cache cannot use {blocker}: it is a file where the cache keeps a folder; remove it, "
        "or set data.cache_dir to another folder"
    )
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("place", ["tokens", "tokens/{key}", "tokens/{key}.partial"])
def test_a_link_to_nothing_where_the_cache_keeps_a_folder_is_named_before_any_work(place, tmp_path, small_text):
    """A link to a folder since moved ended, after the whole text was tokenized, in a traceback."""
    _, key = data.prepare.corpus_key(data_config(tmp_path, path=str(small_text)), bpe_config())
    link = tmp_path / place.format(key=key)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(tmp_path / "moved")
    with pytest.raises(DataError) as refused:
        datamodule(tmp_path, small_text).prepare()
    assert str(refused.value) == (
        f"the token cache cannot use {link}: it is a link to {tmp_path / 'moved'}, which does not exist; "
        "remove the link, or set data.cache_dir to another folder"
    )
    assert link.is_symlink() and not (tmp_path / "moved").exists()


@pytest.mark.parametrize(
    "place, found",
    [("{key}.partial/shards", "file"), ("{key}.partial/meta.json", "folder"), (".locks/{key}.lock", "folder")],
)
def test_the_wrong_kind_of_thing_where_a_preparation_writes_is_named_and_left_alone(place, found, tmp_path, small_text):
    """A file where an entry in progress keeps a folder, or a folder where it writes a file, ended in a
    FileExistsError or IsADirectoryError traceback; once it is removed, the next run goes on."""
    _, key = data.prepare.corpus_key(data_config(tmp_path, path=str(small_text)), bpe_config())
    blocker = tmp_path / "tokens" / place.format(key=key)
    blocker.parent.mkdir(parents=True)
    blocker.mkdir() if found == "folder" else blocker.write_text("not a folder")
    with pytest.raises(DataError) as refused:
        datamodule(tmp_path, small_text).prepare()
    kept = "file" if found == "folder" else "folder"
    assert str(refused.value) == (
        f"the token cache cannot use {blocker}: it is a {found} where the cache keeps a {kept}; remove it, "
        "or set data.cache_dir to another folder"
    )
    assert blocker.is_dir() == (found == "folder")
    blocker.rmdir() if found == "folder" else blocker.unlink()
    assert datamodule(tmp_path, small_text).prepare().meta["train_tokens"] > 0


def test_train_py_with_a_file_in_the_place_of_the_cache_folder_says_so_in_one_line(tmp_path, small_text):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tokens").write_text("not a folder")
    line = refused(*TINY_OVERRIDES, f"data.path={small_text}", env={"TINYGPT2_CACHE": str(tmp_path / "cache")})
    assert line.startswith(f"the token cache cannot use {tmp_path / 'cache' / 'tokens'}:")  # (and no run folder)


def as_a_user(command: list[str]) -> list[str]:
    """command, run so that file permissions bind it: root writes anywhere unless it gives up the
    capability to (setpriv); skipped where neither is possible."""
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to run without root's right to write anywhere")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", *command]


def prepared_entry(cache, small_text):
    """The cache entry of the tiny runs on small_text, prepared in cache."""
    cfg = compose_config(*TINY_OVERRIDES, f"data.path={small_text}", f"data.cache_dir={cache}")
    return TextDataModule(cfg.data, cfg.tokenizer, cfg.model.block_size, cfg.seed, num_batches=1).prepare().folder


@contextlib.contextmanager
def read_only(folder):
    """folder and everything in it read-only while the block runs, and unchanged by it (asserted)."""
    subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
    before = snapshot(folder)
    try:
        yield
        assert snapshot(folder) == before
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(folder)], check=True)


def train_as_a_user(tmp_path, cache, *overrides: str) -> subprocess.CompletedProcess:
    """train.py run from tmp_path with the token cache at cache, bound by file permissions (as_a_user)."""
    return subprocess.run(
        as_a_user(script_command(("train.py", *overrides), tmp_path)),
        cwd=tmp_path,
        env={**script_environment(None, None), "TINYGPT2_CACHE": str(cache)},
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
def test_a_read_only_cache_serves_its_finished_entries_and_refuses_a_missing_one_in_one_line(tmp_path, small_text):
    """A cache prepared once and shared read-only was refused as a whole, though a run whose entry it
    holds writes nothing in it."""
    cache = tmp_path / "cache"
    prepared_entry(cache, small_text)
    run = [*TINY_OVERRIDES, f"data.path={small_text}"]
    with read_only(cache):
        served = train_as_a_user(tmp_path, cache, *run)
        assert served.returncode == 0, served.stderr[-2000:]
        assert "using cached tokens" in served.stdout + served.stderr
        turned_away = train_as_a_user(tmp_path, cache, *run, "tokenizer.vocab_size=320")
    assert turned_away.returncode == 1
    assert one_error_line(turned_away.stderr).startswith(
        "error: the token cache has no entry for this data and tokenizer, and cannot be written to make one: "
    )
    assert len(runs_under(tmp_path / "outputs")) == 1  # the served run's; none for the refused one


@pytest.mark.slow
def test_a_damaged_entry_in_a_read_only_cache_is_refused_with_the_command_to_delete_it(tmp_path, small_text):
    cache = tmp_path / "cache"
    entry = prepared_entry(cache, small_text)
    damage(entry, "truncated val.bin")
    with read_only(cache):
        turned_away = train_as_a_user(tmp_path, cache, *TINY_OVERRIDES, f"data.path={small_text}")
    assert turned_away.returncode == 1
    assert one_error_line(turned_away.stderr).startswith(
        f"error: the token cache's entry {entry} is damaged and cannot be made again here: "
    )
    assert f"delete it (rm -r {entry})" in turned_away.stderr
    assert not (tmp_path / "outputs").exists()


# ---- an entry is checked before it is used ---------------------------------------------------------------


def damage(entry, how: str) -> str:
    """Break one file of a cache entry the way a full disk, a stray edit or a copy gone wrong would;
    returns the name of the file that the warning must name."""
    if how in ("truncated train.bin", "truncated val.bin"):
        file = entry / how.split()[1]
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif how == "truncated tokenizer.json":
        file = entry / "tokenizer.json"
        file.write_text(file.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    elif how == "cut-down tokenizer.json":  # still a valid tokenizer, but not the entry's
        spec = json.loads((entry / "tokenizer.json").read_text(encoding="utf-8"))
        spec["model"]["merges"] = spec["model"]["merges"][:10]
        (entry / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    elif how == "tokenizer.json edited, its hash removed from meta.json":  # nothing left to check it against
        spec = json.loads((entry / "tokenizer.json").read_text(encoding="utf-8"))
        spec["model"]["merges"] = spec["model"]["merges"][::-1]
        (entry / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
        meta = json.loads((entry / "meta.json").read_text())
        (entry / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "tokenizer_sha256"}))
    elif how == "wrong dtype in meta.json":
        meta = json.loads((entry / "meta.json").read_text())
        (entry / "meta.json").write_text(json.dumps({**meta, "dtype": "float32"}))
    elif how == "vocab_size edited in meta.json":  # the model would be made too small for the token ids
        meta = json.loads((entry / "meta.json").read_text())
        (entry / "meta.json").write_text(json.dumps({**meta, "vocab_size": 100}))
    elif how == "unreadable meta.json":
        (entry / "meta.json").write_text('{"dtype": "uint16", "train_tok')
    elif how == "missing train.bin":
        (entry / "train.bin").unlink()
    return how.split()[-1]


DAMAGES = [
    "truncated train.bin",
    "truncated val.bin",
    "truncated tokenizer.json",
    "cut-down tokenizer.json",
    "tokenizer.json edited, its hash removed from meta.json",
    "wrong dtype in meta.json",
    "vocab_size edited in meta.json",
    "unreadable meta.json",
    "missing train.bin",
]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_entry_is_named_in_one_line_and_built_again(how, tmp_path, small_text, caplog):
    first = datamodule(tmp_path, small_text).prepare()
    good = {name: (first.folder / name).read_bytes() for name in ("train.bin", "val.bin", "tokenizer.json")}
    file = damage(first.folder, how)
    with caplog.at_level("WARNING"):
        again = datamodule(tmp_path, small_text).prepare()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"the token cache entry {first.folder} is damaged: {file} ")
    assert warnings[0].endswith("; preparing it again")
    assert again.folder == first.folder and again.made_now
    assert {name: (again.folder / name).read_bytes() for name in good} == good  # the same tokens, whole
    assert entries(tmp_path) == [first.folder.name]


def test_an_entry_is_checked_without_reading_its_token_files(tmp_path, small_text, monkeypatch):
    """The check is cheap: sizes and a hash of the tokenizer, not a pass over the tokens."""
    first = datamodule(tmp_path, small_text).prepare()
    real_open = open
    opened = []
    monkeypatch.setattr("builtins.open", lambda file, *a, **k: (opened.append(str(file)), real_open(file, *a, **k))[1])
    assert data.cache.open_cache(first.folder) is not None
    assert not [f for f in opened if f.endswith(".bin")]


def test_train_py_rebuilds_a_truncated_entry_and_trains_on_all_of_it(tmp_path, small_text):
    """As a user meets it: the cache entry a run made is cut short, and the next run says so and
    trains on the whole text, with the same number of tokens as the first."""
    env = {"TINYGPT2_CACHE": str(tmp_path / "cache")}
    first = train_here(*TINY_OVERRIDES, f"data.path={small_text}", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    (entry,) = (tmp_path / "cache" / "tokens").glob("*/train.bin")
    entry.write_bytes(entry.read_bytes()[:1000])
    second = train_here(*TINY_OVERRIDES, f"data.path={small_text}", env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    damaged = [line for line in (second.stdout + second.stderr).splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and f"entry {entry.parent} is damaged: train.bin holds 1,000 bytes" in damaged[0]
    counted = [re.search(r"([\d,]+) training and", out.stdout + out.stderr).group(1) for out in (first, second)]
    assert counted[0] == counted[1]


@pytest.mark.slow
def test_a_file_size_limit_while_writing_the_cache_is_one_line_and_the_run_starts_with_room(tmp_path, full_text):
    """ulimit -f (a shared machine's limit) fails the cache's write as a full disk does: one line with
    its fix, no traceback, no run folder; with the limit raised the same command trains."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # below the text's 2 MB of token ids

    env = {"TINYGPT2_CACHE": str(tmp_path / "cache")}
    args = [
        "train.py",
        *TINY_OVERRIDES,
        f"data.path={full_text}",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / args[0]), *args[1:]],
        cwd=tmp_path, env={**script_environment(None, None), **env}, capture_output=True, text=True, timeout=600,
        preexec_fn=limit,
    )  # fmt: skip
    assert proc.returncode == 1
    line = one_error_line(proc.stderr)
    assert line.startswith("error: a file reached the size limit: writing the token cache at ")
    assert line.endswith("Raise the file-size limit (ulimit -f), or set data.cache_dir to a disk with room")
    assert not (tmp_path / "outputs").exists()
    again = train_here(*args[1:], env=env)  # the limit raised (this process has none): the same command trains
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_full_disk_while_writing_the_cache_is_one_line_and_the_work_is_kept(tmp_path, small_text, monkeypatch):
    env = {"TINYGPT2_CACHE": str(tmp_path / "cache")}
    inject_faults(monkeypatch, "cache_enospc:1")
    proc = train_here(*TINY_OVERRIDES, f"data.path={small_text}", env=env)
    monkeypatch.delenv("TINYGPT2_FAILPOINT")
    assert proc.returncode == 1
    line = one_error_line(proc.stderr)
    (staging,) = (tmp_path / "cache" / "tokens").glob("*.partial")
    assert line.startswith(
        f"error: the disk is full: writing the token cache at {staging / 'train.bin'} failed; "
        f"the partial entry {staging} ("
    )
    assert "MB) is kept" in line and line.endswith("or set data.cache_dir to a disk with room")
    assert not (tmp_path / "outputs").exists()
    # space again: the next run goes on from the kept shards
    again = train_here(*TINY_OVERRIDES, f"data.path={small_text}", env=env)
    assert again.returncode == 0 and "resuming: " in again.stdout + again.stderr
    assert not staging.exists()
