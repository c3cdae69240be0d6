"""A run tidies after itself: wandb's copies of the samples stay in the run folder, never in the system's
temporary folder, even when the run is killed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.common import TINY_OVERRIDES, run_script

pytestmark = pytest.mark.slow


def files_under(folder: Path) -> list[Path]:
    """Every file in folder and the folders in it, and every folder that holds a file."""
    return sorted(path for path in folder.rglob("*") if not path.is_dir() or any(path.iterdir()))


def run_with_temporary_folder(small_text: Path, tmp_path: Path, failpoint: str | None = None):
    """train.py with wandb offline, and TMPDIR a folder of its own: the process, and that folder."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "WANDB_MODE": "offline"}
    env.pop("TINYGPT2_FAILPOINT", None)
    args = [*TINY_OVERRIDES, f"data.path={small_text}", "logger=wandb", "hydra.run.dir=run"]
    proc = run_script("train.py", *args, cwd=tmp_path, env=env, failpoint=failpoint)
    return proc, temporary


def test_a_wandb_run_leaves_nothing_in_the_temporary_folder(small_text, tmp_path):
    proc, temporary = run_with_temporary_folder(small_text, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "run").glob("wandb/*/files/media/table/samples_*.table.json"))  # the samples were logged
    assert files_under(temporary) == []


def test_a_killed_wandb_run_leaves_no_copy_of_its_samples_in_the_temporary_folder(small_text, tmp_path):
    # killed after the validation of step 3 logged its samples: no clean-up at exit runs
    proc, temporary = run_with_temporary_folder(small_text, tmp_path, failpoint="kill:5")
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert list((tmp_path / "run").glob("wandb/*/tmp/*/samples.table.json"))  # wandb's copy, in the run's folder
    assert not [path for path in temporary.rglob("*") if path.is_file()]  # (wandb's own empty folders may stay)
