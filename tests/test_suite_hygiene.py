"""The test suite itself: it writes only in temporary folders (never the checkout's outputs/, its
`latest` link, or the user's cache), finds Tiny Shakespeare where train.py finds it, running
without it on the corpus train.py falls back to, and shares its helpers through common.py, tiny.py
and conftest.py alone."""

from __future__ import annotations

import ast
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from data.sources import describe
from tests import conftest
from tests.common import (
    NO_DOWNLOAD,
    PUT_SHAKESPEARE,
    ROOT,
    SHAKESPEARE_CHARS,
    USER_CACHE,
    compose_config,
    find_tiny_shakespeare,
    snapshot,
)


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
        assert len(text) == SHAKESPEARE_CHARS and text.startswith(topics[min(topics)])
    else:
        assert full_text == find_tiny_shakespeare()


# A test of each way the suite once wrote into the user's files: train.py's debug preset (outputs/latest
# in the checkout), a module fixture training before any test's own setup (a token cache entry and
# the CPU's peak FLOPs in ~/.cache/tinygpt2), and generate.py run from the checkout. (Each runs train.py's
# and generate.py's command lines in the pytest process now: train_here, generate.main.)
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
    before = {place: snapshot(place) for place in (home, *(checkout / name for name in conftest.RUN_FOLDERS))}

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINYGPT2_", "HF_", "WANDB_", "PYTEST_", "CI"))}
    env.update(HOME=str(home))  # the user's cache is the default, ~/.cache/tinygpt2
    env.pop("MPLCONFIGDIR", None)
    if find_tiny_shakespeare() is not None:
        env["TINYSHAKESPEARE"] = str(find_tiny_shakespeare())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-m",
            "slow or not slow",
            *REPRESENTATIVE,
        ],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and f"{len(REPRESENTATIVE)} passed" in proc.stdout, report

    after = {place: snapshot(place) for place in before}
    assert after == before
    assert os.readlink(checkout / "outputs" / "latest") == str(users_run)


# ---- helpers are shared through common.py, tiny.py and conftest.py ---------------------------------------

TESTS = Path(__file__).parent
SHARED = ("common.py", "tiny.py", "conftest.py")
TEST_MODULES = sorted(TESTS.glob("test_*.py"))


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported_test_modules(tree: ast.Module) -> list[str]:
    """The test modules (test_*.py) a module imports, relatively or through the tests package."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level and not module:  # from . import name
                found += [alias.name for alias in node.names if alias.name.startswith("test_")]
            elif (node.level and module.startswith("test_")) or module.startswith("tests.test_"):
                found.append(module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith(("test_", "tests.test_"))]
    return found


def is_fixture(node: ast.AST) -> bool:
    return any("fixture" in ast.unparse(decorator) for decorator in getattr(node, "decorator_list", []))


def module_names(tree: ast.Module) -> dict[str, ast.AST]:
    """What a module defines at its top level, but its tests and the names pytest itself reads."""
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update((target.id, node) for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return {
        name: node
        for name, node in names.items()
        if not name.startswith(("test_", "Test", "pytest_")) and name not in ("pytestmark", "pytest_plugins")
    }


def test_no_test_module_imports_another():
    imports = {path.name: imported_test_modules(parsed(path)) for path in TESTS.glob("*.py")}
    assert {name: found for name, found in imports.items() if found} == {}


def test_a_helper_is_defined_once_and_no_test_module_redefines_a_shared_name():
    """A helper function or class lives in one module; a name common.py, tiny.py or conftest.py
    defines (a constant, a helper, a fixture) means that everywhere. Settings and fixtures of a
    module's own (its STEPS, its uninterrupted reference run) may share a name with another's."""
    shared = {name: path for path in SHARED for name in module_names(parsed(TESTS / path))}
    helpers = collections.defaultdict(list)
    shadowing = []
    for path in [*(TESTS / name for name in SHARED), *TEST_MODULES]:
        for name, node in module_names(parsed(path)).items():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not is_fixture(node):
                helpers[name].append(path.name)
            if path.name not in SHARED and name in shared:
                shadowing.append(f"{path.name} defines {name}, which {shared[name]} defines")
    assert {name: where for name, where in helpers.items() if len(where) > 1} == {}
    assert shadowing == []
