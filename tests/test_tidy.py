"""A run tidies after itself: wandb's copies of the samples stay in the run folder, never in the system's
temporary folder, even when the run is killed; best.ckpt and a step file holding the same state are one
file on disk, and deleting old step files leaves best.ckpt whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpoint import checkpoint_step, load_checkpoint, step_file
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


def test_best_ckpt_and_the_last_steps_file_are_one_file_and_the_run_continues_from_it(small_text, tmp_path):
    # every_n_steps=3: step 6's file is written after its validation, then best.ckpt (the step's file
    # becomes best.ckpt's); every_n_steps=250: best.ckpt first, then step 6's file at the end (best.ckpt
    # becomes the step's file)
    for every in (3, 250):
        run = tmp_path / f"every{every}"
        args = [*TINY_OVERRIDES, f"data.path={small_text}", f"hydra.run.dir={run}", f"checkpoint.every_n_steps={every}"]
        proc = run_script("train.py", *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        best, last = run / "checkpoints" / "best.ckpt", step_file(run / "checkpoints", 6)
        assert checkpoint_step(best) == 6  # (the loss of a run this short falls at every validation)
        assert os.stat(best).st_ino == os.stat(last).st_ino and os.stat(best).st_nlink == 2, every
        assert sorted(p.name for p in (run / "checkpoints").glob(".*")) == []  # no file of a write left
    proc = run_script("train.py", f"resume={run}", "trainer.max_steps=9", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkpoint_step(run / "checkpoints" / "last.ckpt") == 9
    assert os.stat(run / "checkpoints" / "best.ckpt").st_ino == os.stat(step_file(run / "checkpoints", 9)).st_ino


def test_deleting_old_step_files_leaves_best_ckpt_whole(small_text, tmp_path):
    # steps 3 to 5 skipped (their loss not a number): the weights of steps 4 and 5 are step 2's, whose
    # validation stays the best; keep=1 deletes step 2's file, which best.ckpt was, when step 4's is written
    run = tmp_path / "run"
    args = [*TINY_OVERRIDES, f"data.path={small_text}", f"hydra.run.dir={run}", "trainer.max_steps=5"]
    args += ["trainer.val_check_interval=2", "checkpoint.every_n_steps=2", "checkpoint.keep=1"]
    proc = run_script("train.py", *args, cwd=tmp_path, failpoint="nan:3-5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.glob("step-*.ckpt")) == ["step-000005.ckpt"]
    assert checkpoint_step(folder / "best.ckpt") == 2 and os.stat(folder / "best.ckpt").st_nlink == 1
    assert load_checkpoint(folder / "best.ckpt").model is not None  # whole, and readable
    proc = run_script("train.py", f"resume={folder / 'best.ckpt'}", "trainer.max_steps=6", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
