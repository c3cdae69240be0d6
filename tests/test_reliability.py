"""A run can be killed at any moment and resumed exactly; bad luck never costs work.

Processes are killed for real (SIGKILL, SIGINT, SIGTERM). Fault injection (TINYGPT2_FAILPOINT, see
training/failpoints.py) picks the exact moment where timing alone could not: a given step, halfway
through a checkpoint write, a NaN loss, a full disk.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .common import ROOT, TINY

pytestmark = pytest.mark.slow

STEPS = 10


def args_for(small_text: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        f"data.path={small_text}",
        f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=5",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep=20",
        *extra,
    ]


def train(*args: str, failpoint: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TINYGPT2_FAILPOINT", None)
    if failpoint:
        env["TINYGPT2_FAILPOINT"] = failpoint
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600
    )


def state(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True)["state_dict"]


def optimizer_moments(checkpoint: Path) -> list[torch.Tensor]:
    ckpt = torch.load(checkpoint, weights_only=True)
    return [t for s in ckpt["optimizer_states"][0]["state"].values() for t in (s["exp_avg"], s["exp_avg_sq"])]


def assert_bit_equal(a: Path, b: Path) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{key} differs"
    for ma, mb in zip(optimizer_moments(a), optimizer_moments(b), strict=True):
        assert torch.equal(ma, mb)


def losses(run: Path) -> dict[int, str]:
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("train/loss")]
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return {int(r["step"]): r["train/loss"] for r in rows}


def only_run(runs_root: Path) -> Path:
    runs = [p.parent.parent for p in runs_root.glob("**/.hydra/config.yaml")]
    assert len(runs) == 1, f"expected one run folder, found {runs}"
    return runs[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_text) -> Path:
    """The same run, never interrupted."""
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = train(*args_for(small_text), f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


@pytest.mark.parametrize(
    "failpoint",
    [
        "kill:3",  # right after step 3; the newest checkpoint is step 2
        "kill:8",  # after step 8, before its checkpoint: resumes from step 6
        "kill_save:6",  # halfway through writing the step-6 checkpoint
        "kill_save:10",  # halfway through the final checkpoint
    ],
)
def test_killed_run_resumes_bit_for_bit(failpoint, reference, small_text, tmp_path):
    runs_root = tmp_path / "outputs"
    killed = train(*args_for(small_text), f"runs_root={runs_root}", failpoint=failpoint)
    assert killed.returncode == -signal.SIGKILL
    run = only_run(runs_root)
    assert not (run / "result.json").exists()

    resumed = train(*args_for(small_text), f"runs_root={runs_root}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert only_run(runs_root) == run  # continued in place, no second folder
    assert json.loads((run / "result.json").read_text())["finished"] is True
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert losses(run) == losses(reference)  # the CSV log continues: every step once, same values
    assert not list((run / "checkpoints").glob(".*tmp"))  # the half-written file is gone
    assert (run / ".hydra" / "config.yaml").is_file() and list((run / ".hydra").glob("resume-*"))


def test_sigkill_at_an_arbitrary_moment(reference, small_text, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args_for(small_text), f"hydra.run.dir={run}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step-000004.ckpt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    resumed = train(*args_for(small_text), f"hydra.run.dir={run}", f"resume={run}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_finishes_the_step_checkpoints_and_says_how_to_resume(sig, small_text, tmp_path):
    run = tmp_path / "run"
    extra = ["trainer.max_steps=100000", "trainer.val_check_interval=100000", "checkpoint.every_n_steps=1000"]
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args_for(small_text), *extra, f"hydra.run.dir={run}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while not (run / "metrics.csv").exists() and time.time() < deadline:  # training has started
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert f"stopped by {sig.name}" in out + err and f"resume={run}" in out + err
    result = json.loads((run / "result.json").read_text())
    assert result["finished"] is False
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert 0 < saved["global_step"] < 100000
    # the checkpoint holds a whole step: weights and optimizer moments, nothing half-applied
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())


def test_nonfinite_losses_are_skipped_and_counted(small_text, tmp_path):
    run = tmp_path / "run"
    proc = train(*args_for(small_text), f"hydra.run.dir={run}", failpoint="nan:3-4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 3: the loss or its gradient is not finite" in proc.stdout + proc.stderr
    # steps 3 and 4 changed nothing: the step-4 weights and moments are the step-2 ones
    assert_bit_equal(run / "checkpoints" / "step-000004.ckpt", run / "checkpoints" / "step-000002.ckpt")
    skipped = [
        float(r["train/skipped_steps"])
        for r in csv.DictReader(open(run / "metrics.csv"))
        if r.get("train/skipped_steps")
    ]
    assert skipped[-1] == 2
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == STEPS


def test_too_many_nonfinite_losses_stop_the_run_and_keep_the_last_good_checkpoint(small_text, tmp_path):
    run = tmp_path / "run"
    proc = train(*args_for(small_text), "optim.max_nonfinite_in_a_row=3", f"hydra.run.dir={run}", failpoint="nan:5-10")
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: training diverged: 3 steps in a row (up to step 7)")
    assert "Traceback" not in proc.stderr
    good = run / "checkpoints" / "step-000004.ckpt"
    assert all(torch.isfinite(t).all() for t in state(good).values())
    assert_bit_equal(run / "checkpoints" / "step-000006.ckpt", good)  # the skipped steps changed nothing


def test_nonfinite_losses_are_skipped_with_value_clipping_too(small_text, tmp_path):
    run = tmp_path / "run"
    proc = train(
        *args_for(small_text),
        "trainer.gradient_clip_algorithm=value",
        "trainer.gradient_clip_val=0.5",
        f"hydra.run.dir={run}",
        failpoint="nan:3-4",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_bit_equal(run / "checkpoints" / "step-000004.ckpt", run / "checkpoints" / "step-000002.ckpt")


def test_weights_that_are_no_longer_finite_are_never_checkpointed(small_text, tmp_path):
    run = tmp_path / "run"
    proc = train(*args_for(small_text), f"hydra.run.dir={run}", failpoint="nan_weights:4")  # broken after step 4
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(
        "error: training diverged: at step 5 the weights are no longer finite (transformer.wte.weight)"
    )
    assert "the checkpoints written so far hold the last good weights" in last_line
    saved = sorted((run / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in saved] == ["last.ckpt", "step-000002.ckpt", "step-000004.ckpt"]
    for checkpoint in saved:
        assert all(torch.isfinite(t).all() for t in state(checkpoint).values()), checkpoint


def test_full_disk_while_saving_keeps_the_previous_checkpoint(small_text, tmp_path):
    run = tmp_path / "run"
    proc = train(*args_for(small_text), f"hydra.run.dir={run}", failpoint="enospc:4")
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: no space left on the device while saving")
    assert "intact" in last_line and f"resume={run}" in last_line
    assert "Traceback" not in proc.stderr
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step-000002.ckpt"]
    assert os.readlink(checkpoints / "last.ckpt") == "step-000002.ckpt"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 2

    resumed = train(*args_for(small_text), f"hydra.run.dir={run}", f"resume={run}")  # space is back
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_old_periodic_checkpoints_are_pruned(small_text, tmp_path):
    run = tmp_path / "run"
    proc = train(*args_for(small_text, "checkpoint.keep=2"), f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best.ckpt", "last.ckpt", "step-000008.ckpt", "step-000010.ckpt"]


def test_resuming_from_a_truncated_checkpoint_says_so(reference, small_text, tmp_path):
    broken = tmp_path / "run" / "checkpoints" / "step-000004.ckpt"
    broken.parent.mkdir(parents=True)
    data = (reference / "checkpoints" / "step-000004.ckpt").read_bytes()
    broken.write_bytes(data[: len(data) // 3])
    proc = train(*args_for(small_text), f"hydra.run.dir={broken.parent.parent}", f"resume={broken}")
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"error: cannot resume from {broken}: it is truncated or corrupted")
    assert "Traceback" not in proc.stderr
