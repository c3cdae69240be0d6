"""The test suite itself: it writes only in temporary folders (never the checkout's outputs/, its
`latest` link, or the user's cache), and finds Tiny Shakespeare where train.py finds it, running
without it on the corpus train.py falls back to."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from data.sources import describe

from . import conftest
from .common import NO_DOWNLOAD, PUT_SHAKESPEARE, ROOT, USER_CACHE, compose_config, find_tiny_shakespeare


def test_a_test_runs_in_its_own_folder_with_private_caches(tmp_path, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    assert Path.cwd() == tmp_path  # where runs_root=outputs and latest_link=outputs/latest land
    assert Path(os.environ["TINYGPT2_CACHE"]).is_relative_to(base)
    assert compose_config().data.cache_dir == os.environ["TINYGPT2_CACHE"] != str(USER_CACHE)
    for variable in ("HF_HOME", "HF_DATASETS_CACHE", "MPLCONFIGDIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        folder = Path(os.environ[variable])
        assert folder.is_relative_to(base) or folder.is_relative_to(tempfile.gettempdir()), variable


def test_the_tests_find_tiny_shakespeare_where_train_py_finds_it(monkeypatch):
    if os.environ.get("TINYSHAKESPEARE"):
        pytest.skip("TINYSHAKESPEARE names the copy, as data.path would")
    monkeypatch.chdir(ROOT)  # as `python train.py` in the checkout, with the user's cache
    source = describe(compose_config(f"data.cache_dir={USER_CACHE}", f"data.url={NO_DOWNLOAD}").data)
    found = find_tiny_shakespeare()
    if found is None:
        assert source.label.startswith("pydoc_data.topics")
    else:
        assert Path(source.label).resolve() == found.resolve()


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_without_tiny_shakespeare_its_own_tests_are_skipped_except_in_ci(ci, outcome, monkeypatch):
    monkeypatch.setattr(conftest, "find_tiny_shakespeare", lambda: None)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match=re.escape(PUT_SHAKESPEARE)):
        conftest.shakespeare_or_skip()


def test_without_tiny_shakespeare_the_text_is_the_offline_fallback(full_text):
    from pydoc_data.topics import topics

    text = full_text.read_text(encoding="utf-8")
    if find_tiny_shakespeare() is None:
        assert len(text) == conftest.SHAKESPEARE_CHARS and text.startswith(topics[min(topics)])
    else:
        assert full_text == find_tiny_shakespeare()


# A test of each way the suite once wrote into the user's files: train.py's debug preset (outputs/latest
# in the checkout), a module fixture training before any test's own setup (a token cache entry and
# the CPU's peak FLOPs in ~/.cache/tinygpt2), and generate.py run from the checkout.
REPRESENTATIVE = [
    "tests/test_scale.py::test_debug_preset_runs_with_everything_on",
    "tests/test_tracking.py::test_csv_holds_every_metric",
    "tests/test_train.py::test_a_composed_config_trains_and_writes_a_checkpoint_that_generates",
]
COPIED_OUT = (
    ".git",
    *conftest.RUN_FOLDERS,
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    "*.egg-info",
    ".benchmarks",
    ".venv",
    "build",
)


@pytest.mark.slow
def test_tests_that_train_leave_the_checkouts_outputs_and_the_users_cache_as_they_were(tmp_path):
    """In a copy of the checkout whose outputs/latest names a run of the user's, and a home whose cache
    holds an entry: after the tests, both are exactly as they were, and nothing else is in the home."""
    checkout = tmp_path / "tinygpt2"
    shutil.copytree(ROOT, checkout, symlinks=True, ignore=shutil.ignore_patterns(*COPIED_OUT))
    users_run = checkout / "outputs" / "2026-01-01" / "09-00-00"
    (users_run / "checkpoints").mkdir(parents=True)
    (users_run / "checkpoints" / "last.ckpt").write_bytes(b"the user's model")
    (checkout / "outputs" / "latest").symlink_to(users_run)
    home = tmp_path / "home"
    entry = home / ".cache" / "tinygpt2" / "tokens" / "0123456789abcdef0123"
    entry.mkdir(parents=True)
    (entry / "meta.json").write_text("{}")
    (home / ".cache" / "tinygpt2" / "cpu_peak_flops.json").write_text('{"peak": 1.0}')
    before = {place: conftest.snapshot(place) for place in (home, *(checkout / name for name in conftest.RUN_FOLDERS))}

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINYGPT2_", "HF_", "WANDB_", "PYTEST_", "CI"))}
    env.update(HOME=str(home))  # the user's cache is the default, ~/.cache/tinygpt2
    env.pop("MPLCONFIGDIR", None)
    if find_tiny_shakespeare() is not None:
        env["TINYSHAKESPEARE"] = str(find_tiny_shakespeare())
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *REPRESENTATIVE],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and f"{len(REPRESENTATIVE)} passed" in proc.stdout, report

    after = {place: conftest.snapshot(place) for place in before}
    assert after == before
    assert os.readlink(checkout / "outputs" / "latest") == str(users_run)
