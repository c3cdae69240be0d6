"""A run tidies after itself: wandb's copies of the samples stay in the run folder, never in the system's
temporary folder, even when the run is killed; best.ckpt and a step file holding the same state are one
file on disk, and deleting old step files leaves best.ckpt whole."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import wandb

from checkpoint import checkpoint_step, load_checkpoint, step_file
from tests.common import TINY_OVERRIDES, inject_faults, run_script, train_here


def wandb_args(small_text: Path) -> list[str]:
    return [*TINY_OVERRIDES, f"data.path={small_text}", "logger=wandb", "hydra.run.dir=run"]


def test_a_wandb_run_leaves_nothing_in_the_temporary_folder(small_text, tmp_path, monkeypatch):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # (read once a process: as a new process reads it)
    monkeypatch.setenv("WANDB_MODE", "offline")
    ran = train_here(*wandb_args(small_text))
    assert ran.returncode == 0, ran.stderr[-3000:]
    wandb.teardown()  # wandb's service done writing and ended, as it is once the process that started it ends
    assert list((tmp_path / "run").glob("wandb/*/files/media/table/samples_*.table.json"))  # the samples were logged
    assert [path for path in temporary.rglob("*") if not path.is_dir()] == []


@pytest.mark.slow
def test_a_killed_wandb_run_leaves_no_copy_of_its_samples_in_the_temporary_folder(small_text, tmp_path):
    # killed after the validation of step 3 logged its samples: no clean-up at exit runs (a process of its own,
    # and a temporary folder wandb's own processes read as they start)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "WANDB_MODE": "offline"}
    proc = run_script("train.py", *wandb_args(small_text), cwd=tmp_path, env=env, failpoint="kill:5")
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
        ran = train_here(*args)
        assert ran.returncode == 0, ran.stderr[-3000:]
        best, last = run / "checkpoints" / "best.ckpt", step_file(run / "checkpoints", 6)
        assert checkpoint_step(best) == 6  # (the loss of a run this short falls at every validation)
        assert os.stat(best).st_ino == os.stat(last).st_ino and os.stat(best).st_nlink == 2, every
        assert sorted(p.name for p in (run / "checkpoints").glob(".*")) == []  # no file of a write left
    ran = train_here(f"resume={run}", "trainer.max_steps=9")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert checkpoint_step(run / "checkpoints" / "last.ckpt") == 9
    assert os.stat(run / "checkpoints" / "best.ckpt").st_ino == os.stat(step_file(run / "checkpoints", 9)).st_ino


def test_deleting_old_step_files_leaves_best_ckpt_whole(small_text, tmp_path, monkeypatch):
    # steps 3 to 5 skipped (their loss not a number): the weights of steps 4 and 5 are step 2's, whose
    # validation stays the best; keep=1 deletes step 2's file, which best.ckpt was, when step 4's is written
    run = tmp_path / "run"
    args = [*TINY_OVERRIDES, f"data.path={small_text}", f"hydra.run.dir={run}", "trainer.max_steps=5"]
    args += ["trainer.val_check_interval=2", "checkpoint.every_n_steps=2", "checkpoint.keep=1"]
    with monkeypatch.context() as faults:
        inject_faults(faults, "nan:3-5")
        ran = train_here(*args)
    assert ran.returncode == 0, ran.stderr[-3000:]
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.glob("step-*.ckpt")) == ["step-000005.ckpt"]
    assert checkpoint_step(folder / "best.ckpt") == 2 and os.stat(folder / "best.ckpt").st_nlink == 1
    assert load_checkpoint(folder / "best.ckpt").model is not None  # whole, and readable
    ran = train_here(f"resume={folder / 'best.ckpt'}", "trainer.max_steps=6")
    assert ran.returncode == 0, ran.stderr[-3000:]
