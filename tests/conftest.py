"""Shared test setup: a session that writes only in temporary folders, the text the tests read, tiny models."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Libraries that read where their caches are when first imported (datasets, huggingface_hub,
# matplotlib) are pointed at folders of this process's own before any test imports them.
_LIBRARY_CACHES = Path(tempfile.mkdtemp(prefix="tinygpt2-tests-"))
atexit.register(shutil.rmtree, _LIBRARY_CACHES, ignore_errors=True)
os.environ["HF_HOME"] = str(_LIBRARY_CACHES / "huggingface")
os.environ["HF_DATASETS_CACHE"] = str(_LIBRARY_CACHES / "huggingface" / "datasets")
os.environ["MPLCONFIGDIR"] = str(_LIBRARY_CACHES / "matplotlib")
# One torch thread per process, here and in every script a test runs. The suite runs two tests at a
# time on two cores (pytest -n 2), each often with a train.py of its own; with torch's default of a
# thread per core, the cores are oversubscribed, and the threads of a tiny model's many small kernels
# then wait on each other: a run that takes 10 s alone took 80 s beside another test. One thread is
# also what such small models train fastest on.
os.environ["OMP_NUM_THREADS"] = "1"

from tests.common import (  # noqa: E402  (after the environment above)
    NEEDS_SHAKESPEARE,
    PUT_SHAKESPEARE,
    ROOT,
    SHAKESPEARE_CHARS,
    USER_CACHE,
    find_tiny_shakespeare,
    snapshot,
    write_documents,
)
from tests.tiny import tiny_gpt, tiny_run, tiny_text, tiny_tokenizer, transformers_folder  # noqa: E402, F401  (shared fixtures)

# Where the scripts write given relative paths (runs_root, latest_link, Hydra's sweep folder, and
# Lightning's and wandb's own defaults), in the checkout and in the folder pytest was started in
STARTED_IN = Path.cwd().resolve()
RUN_FOLDERS = ("outputs", "multirun", "lightning_logs", "wandb")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def pytest_report_header(config) -> str:
    found = find_tiny_shakespeare()
    if found is not None and found.is_file():
        return f"text: Tiny Shakespeare, {found}"
    return f"text: pydoc_data.topics, as train.py without Tiny Shakespeare, whose own tests skip; {PUT_SHAKESPEARE}"


@pytest.fixture(scope="session", autouse=True)
def private_session(tmp_path_factory):
    """The session starts in a temporary folder, with the token cache and wandb's folders inside it:
    nothing it runs writes into the checkout or the user's home. Session-wide, so that fixtures of
    every scope (made before any test's own folder) are inside it too."""
    base = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINYGPT2_CACHE", str(base / "cache" / "tinygpt2"))
        for variable in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # runs log into their run folder
            patch.setenv(variable, str(base / "cache" / "wandb"))
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.delenv("WANDB_API_KEY", raising=False)
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(base / "cache" / "torchinductor"))
        patch.setenv("TRITON_CACHE_DIR", str(base / "cache" / "triton"))
        patch.chdir(tmp_path_factory.mktemp("session"))
        yield


@pytest.fixture(autouse=True)
def in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Every test runs in its own temporary folder, as a user runs the scripts in a folder of theirs:
    outputs/, outputs/latest and multirun/ land there (run_script starts its scripts there too)."""
    monkeypatch.chdir(tmp_path)


def users_places() -> list[Path]:
    """Where a user's own runs and caches live: the run folders of the checkout (and of the folder
    pytest was started in), and the user's token cache."""
    return [start / name for start in sorted({ROOT, STARTED_IN}) for name in RUN_FOLDERS] + [USER_CACHE]


@pytest.fixture(scope="session", autouse=True)
def users_files_untouched():
    """After the session, the checkout's outputs/ (and outputs/latest) and the user's cache are as
    they were before it. With pytest-xdist each worker checks, over the time it ran."""
    before = {place: snapshot(place) for place in users_places()}
    yield
    changed = [str(place) for place, seen in before.items() if snapshot(place) != seen]
    assert not changed, (
        f"{', '.join(changed)} changed while the tests ran: a test wrote where the user's own runs and caches "
        "live (or a train.py of the user's ran meanwhile)"
    )


# ---- the text the tests read --------------------------------------------------------------------------


def shakespeare_or_skip() -> Path:
    """Tiny Shakespeare, or the test is skipped; in CI, where the data must be there, it fails."""
    found = find_tiny_shakespeare()
    if found is not None and not found.is_file():
        pytest.fail(f"TINYSHAKESPEARE={found} is not a file; point it at Tiny Shakespeare's input.txt")
    if found is None:
        if in_ci():
            pytest.fail(f"Tiny Shakespeare not found, and CI runs every test on it: {PUT_SHAKESPEARE}")
        pytest.skip(NEEDS_SHAKESPEARE)
    return found


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """Tiny Shakespeare itself, for the tests of its own figures (its length, its 65 characters)."""
    return shakespeare_or_skip()


@pytest.fixture(scope="session")
def full_text(tmp_path_factory) -> Path:
    """The text the tests train and tokenize: Tiny Shakespeare when this machine has it; else the
    offline corpus train.py itself falls back to (Python's pydoc topics, data.sources.pydoc_source),
    written to a file and repeated to Tiny Shakespeare's length, so that fixtures cutting it into
    parts get as many. Only the tests of Tiny Shakespeare's own figures are skipped without it."""
    if find_tiny_shakespeare() is not None or in_ci():
        return shakespeare_or_skip()
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics)) + "\n\n"
    path = tmp_path_factory.mktemp("text") / "pydoc_topics.txt"
    path.write_text((text * (SHAKESPEARE_CHARS // len(text) + 1))[:SHAKESPEARE_CHARS], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def small_text(tmp_path_factory, full_text) -> Path:
    """The first 60,000 characters of the text: real text, quick to tokenize."""
    path = tmp_path_factory.mktemp("text") / f"{full_text.stem}_head.txt"
    path.write_text(full_text.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def documents(tmp_path_factory, full_text) -> Path:
    """A folder of 24 documents, the text's first 600,000 characters in parts of 25,000: a corpus that
    tokenizes in many shards."""
    return write_documents(tmp_path_factory.mktemp("documents"), full_text.read_text(encoding="utf-8"), 24)


@pytest.fixture
def held_elsewhere():
    """(hold, let_go): hold(folder) has another process hold the folder's lock, as the train.py training a run or
    a sweep there holds it (a child of this one, which takes RunFolder(folder).lock() and waits), and returns
    its pid; let_go() ends it. Every holder ends with the test."""
    import multiprocessing

    from shell.folders import RunFolder

    context = multiprocessing.get_context("fork")
    holders = []

    def keep(folder: Path, ready, done) -> None:
        RunFolder(folder).lock()
        ready.set()
        done.wait(600)

    def hold(folder: Path) -> int:
        ready, done = context.Event(), context.Event()
        holder = context.Process(target=keep, args=(folder, ready, done), daemon=True)
        holder.start()
        holders.append((holder, done))
        assert ready.wait(60), "the lock was not taken"
        return holder.pid

    def let_go() -> None:
        for holder, done in holders:
            done.set()
            holder.join(60)

    yield hold, let_go
    let_go()
