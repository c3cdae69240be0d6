"""A run can be killed at any moment and resumed exactly; bad luck never costs work.

Processes are killed for real (SIGKILL, SIGINT, SIGTERM). Fault injection from outside the program
(TINYGPT2_FAILPOINT, see tests/faults/failpoints.py) picks the exact moment where timing alone could not:
a given step, halfway through a checkpoint write, a NaN loss, a full disk.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from tests.common import (
    ROOT,
    TINY_OVERRIDES,
    assert_bit_equal,
    checkpoint_weights,
    compose_config,
    flipped_copy,
    only_run,
    run_printed,
    run_script,
    sample_steps,
    start_script,
    train_losses,
    validations,
)
from training.checkpoints import BestCheckpoint

pytestmark = pytest.mark.slow

STEPS = 10


def args_for(small_text: Path, *extra: str) -> list[str]:
    return [
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=5",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep=20",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_text) -> Path:
    """The same run, never interrupted."""
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = run_script("train.py", *args_for(small_text), f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


@pytest.mark.parametrize(
    "failpoint",
    [
        "kill:3",  # right after step 3; the newest checkpoint is step 2
        "kill:8",  # after step 8, before its checkpoint: resumes from step 6
        "kill_save:6",  # halfway through writing the step-6 checkpoint
        "kill_save:10",  # halfway through the final checkpoint
        "kill_end:10",  # after the final checkpoint, before the run's end is recorded: only its end is left
        "kill_val:10",  # as the final validation begins: it and the run's end are left
    ],
)
def test_killed_run_resumes_bit_for_bit(failpoint, reference, small_text, tmp_path):
    runs_root = tmp_path / "outputs"
    killed = run_script("train.py", *args_for(small_text), f"runs_root={runs_root}", failpoint=failpoint)
    assert killed.returncode == -signal.SIGKILL
    run = only_run(runs_root)
    assert not (run / "result.json").exists()

    resumed = run_script("train.py", *args_for(small_text), f"runs_root={runs_root}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert only_run(runs_root) == run  # continued in place, no second folder
    result = json.loads((run / "result.json").read_text())
    assert result["finished"] is True
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    timings = ("train/tokens_per_sec", "train/mfu")  # the machine's, not the run's

    def metrics(folder: Path) -> dict:
        values = json.loads((folder / "result.json").read_text())["metrics"]
        return {name: value for name, value in values.items() if name not in timings}

    assert "train/loss" in result["metrics"]
    assert metrics(run) == metrics(reference)  # the last training values too, where resume= only ended the run
    assert train_losses(run) == train_losses(reference)  # the CSV log continues: every step once, same values
    assert validations(run) == validations(reference)  # each validation once, at the step it follows
    assert sample_steps(run) == sample_steps(reference)
    assert not list((run / "checkpoints").glob(".*tmp"))  # the half-written file is gone
    assert (run / ".hydra" / "config.yaml").is_file() and list((run / ".hydra").glob("resume-*"))


def loss_curve(checkpoint: Path) -> dict:
    """The loss curve's history a checkpoint carries (what loss.png is drawn from after a resume)."""
    state = torch.load(checkpoint, weights_only=False)["callbacks"]
    (curve,) = [value for key, value in state.items() if key.startswith("LossCurve")]
    return curve


@pytest.mark.parametrize("failpoint", ["kill_val:5", "kill:6"])  # during the step-5 validation; after step 6
def test_a_checkpoint_at_a_validation_step_holds_that_validation(failpoint, reference, small_text, tmp_path):
    """A step checkpoint on a step that validates is written after the validation: a run killed during
    it resumes from the step before (and validates at step 5 again), one killed after resumes from it; either way
    each validation is logged once and the loss curve has every point, as an uninterrupted run's."""
    runs_root = tmp_path / "outputs"
    every_step = args_for(small_text, "checkpoint.every_n_steps=1")
    killed = run_script("train.py", *every_step, f"runs_root={runs_root}", failpoint=failpoint)
    assert killed.returncode == -signal.SIGKILL
    run = only_run(runs_root)
    assert (run / "checkpoints" / "step-000005.ckpt").is_file() == (failpoint == "kill:6")
    resumed = run_script("train.py", *every_step, f"runs_root={runs_root}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert validations(run) == validations(reference) and sample_steps(run) == sample_steps(reference)
    assert train_losses(run) == train_losses(reference)
    assert loss_curve(run / "checkpoints" / "last.ckpt") == loss_curve(reference / "checkpoints" / "last.ckpt")
    assert len(loss_curve(run / "checkpoints" / "step-000005.ckpt")["val"]) == 1  # written after its validation


def test_a_finished_run_trained_further_and_killed_at_its_new_end_is_finished_by_resume(small_text, tmp_path):
    """A finished run given more steps is unfinished again until its new end is recorded: killed after
    its new last checkpoint, resume= and resume=auto still find it and end it."""
    runs_root = tmp_path / "outputs"
    first = run_script("train.py", *args_for(small_text), f"runs_root={runs_root}")
    assert first.returncode == 0, first.stderr[-2000:]
    run = only_run(runs_root)
    further = run_script(
        "train.py", f"resume={run}", f"trainer.max_steps={STEPS + 4}", failpoint=f"kill_end:{STEPS + 4}"
    )
    assert further.returncode == -signal.SIGKILL, further.stderr[-2000:]
    assert json.loads((run / "result.json").read_text())["finished"] is False
    same = [a for a in args_for(small_text) if not a.startswith("trainer.max_steps=")]  # the run's own limit
    ended = run_script("train.py", *same, f"runs_root={runs_root}", "resume=auto")
    assert ended.returncode == 0, ended.stderr[-2000:]
    assert "stopped before it ended; ending it now" in ended.stderr + ended.stdout
    result = json.loads((run / "result.json").read_text())
    assert result["finished"] is True and result["config"]["trainer"]["max_steps"] == STEPS + 4
    # each validation logged once, at the step it follows (Lightning's numbering: step - 1), the samples beside it
    assert list(validations(run)) == [4, 9, STEPS + 3] and sample_steps(run) == [4, 4, 9, 9, STEPS + 3, STEPS + 3]
    again = run_script("train.py", f"resume={run}")
    assert again.returncode != 0 and f"reached trainer.max_steps={STEPS + 4}" in again.stderr


def test_a_run_ended_and_trained_further_twice_logs_each_validation_at_the_step_it_follows(small_text, tmp_path):
    """Ends that fall between validations (6 and 12, validating every 5): each end validates, and every
    validation is logged at the step it follows, minus one (Lightning's numbering), across the resumes."""
    run = tmp_path / "run"
    first = run_script("train.py", *args_for(small_text, "trainer.max_steps=6"), f"hydra.run.dir={run}")
    assert first.returncode == 0, first.stderr[-2000:]
    for steps in (12, 18):
        further = run_script("train.py", f"resume={run}", f"trainer.max_steps={steps}")
        assert further.returncode == 0, further.stderr[-2000:]
    after = [5, 6, 10, 12, 15, 18]  # the steps validated after
    assert list(validations(run)) == [step - 1 for step in after]
    assert sample_steps(run) == [step - 1 for step in after for _ in range(2)]  # two prompts each


@pytest.mark.parametrize("step", [5, 7, STEPS])  # a validation step, another, the last
def test_ctrl_c_at_a_step_adds_no_validation_and_the_printed_resume_ends_the_run_as_never_stopped(
    step, reference, small_text, tmp_path
):
    run = tmp_path / "run"
    stopped = run_script("train.py", *args_for(small_text), f"hydra.run.dir={run}", failpoint=f"sigint:{step}")
    assert stopped.returncode == (130 if step < STEPS else 0), stopped.stderr[-2000:]  # stopped, or finished
    if step < STEPS:
        assert f"stopped by SIGINT at step {step}" in stopped.stdout + stopped.stderr
        resumed = run_script("train.py", f"resume={run}")
        assert resumed.returncode == 0, resumed.stderr[-2000:]
    # at the last step the run ends there anyway: it records its end, with nothing to continue
    assert json.loads((run / "result.json").read_text())["finished"] is True
    assert validations(run) == validations(reference) and sample_steps(run) == sample_steps(reference)
    assert train_losses(run) == train_losses(reference)
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")


def test_resuming_from_an_earlier_checkpoint_sets_the_later_ones_aside(small_text, tmp_path):
    """resume= at an earlier checkpoint starts a new history from there; a later resume= of the run must
    continue that one, not the checkpoints the first history left."""
    run = tmp_path / "run"
    killed = run_script("train.py", *args_for(small_text), f"hydra.run.dir={run}", failpoint="kill:8")
    assert killed.returncode == -signal.SIGKILL  # step files 2, 4 and 6 are written
    earlier = run / "checkpoints" / "step-000002.ckpt"
    longer = run_script("train.py", f"resume={earlier}", "trainer.max_steps=20", failpoint="kill:5")
    assert longer.returncode == -signal.SIGKILL, longer.stderr[-2000:]
    assert "moved to" in longer.stderr + longer.stdout
    aside = run / "checkpoints" / "superseded"
    assert (aside / "step-000006.ckpt").is_file() and (aside / "step-000004.ckpt").is_file()
    resumed = run_script("train.py", f"resume={run}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step-000004.ckpt (step 4)" in resumed.stderr + resumed.stdout  # the new history's newest
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 20


def test_ctrl_c_twice_while_a_checkpoint_is_written_leaves_no_part_of_it(reference, small_text, tmp_path):
    run = tmp_path / "run"
    stopped = run_script("train.py", *args_for(small_text), f"hydra.run.dir={run}", failpoint="ctrl_c_save:4")
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    printed = f"python {ROOT / 'train.py'} resume={run}"
    assert stopped.stderr.rstrip().splitlines()[-1] == f"stopped; continue with: {printed}"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step-000002.ckpt"]  # no .tmp
    resumed = run_printed(printed, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")


def test_sigkill_at_an_arbitrary_moment(reference, small_text, tmp_path):
    run = tmp_path / "run"
    proc = start_script(
        "train.py", *args_for(small_text), f"hydra.run.dir={run}", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step-000004.ckpt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    resumed = run_script("train.py", *args_for(small_text), f"hydra.run.dir={run}", f"resume={run}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")


def test_ctrl_c_before_training_begins_stops_in_one_line_and_leaves_nothing(small_text, tmp_path):
    """Ctrl-C at moments from the imports to the first steps: no traceback, and no run folder without a
    checkpoint left behind (a stop once training runs is the graceful one, with its checkpoint)."""
    runs_root = tmp_path / "outputs"
    args = [
        *args_for(small_text),
        "trainer.max_steps=100000",
        "checkpoint.every_n_steps=1000",
        f"runs_root={runs_root}",
    ]
    for delay in (0.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0):
        env = {**os.environ, "TINYGPT2_CACHE": str(tmp_path / f"cache-{delay}")}  # each start tokenizes anew
        proc = start_script("train.py", *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=300)
        finally:  # a run that missed its Ctrl-C would train on, its 100,000 steps, after the test failed
            proc.kill()
        assert "Traceback" not in err, (delay, err[-2000:])
        assert proc.returncode in (130, -signal.SIGINT), (delay, err[-2000:])  # stopped, never finished
        if proc.returncode == 130:  # a stop before training says so on stderr; once training runs, its log line
            last_said = err.rstrip().splitlines()[-1]  # (on stdout, as Hydra logs) gives the continue command
            last_logged = (out.rstrip().splitlines() or [""])[-1]
            assert last_said in ("stopped before training began; nothing was written",
                                 "stopped before the run's first checkpoint; nothing was kept") or (
                "checkpoint saved. Continue with: " in last_logged), (delay, err[-500:], out[-500:])  # fmt: skip
        left = [p for p in runs_root.glob("*/*") if p.is_dir() and not p.parent.is_symlink()]  # not outputs/latest/
        assert all(any((run / "checkpoints").glob("*.ckpt")) for run in left), (delay, left)


def test_sigterm_while_the_data_is_prepared_takes_the_new_run_back_as_ctrl_c_does(full_text, tmp_path):
    """`kill PID` (a scheduler's stop) before training: the run is taken back in one line, as for Ctrl-C,
    where it ended the process with nothing said and the new run folder left behind."""
    runs_root = tmp_path / "outputs"
    env = {**os.environ, "TINYGPT2_CACHE": str(tmp_path / "cache")}  # the tokenizer is trained anew
    args = [*TINY_OVERRIDES, f"data.path={full_text}", "tokenizer.vocab_size=1024", f"runs_root={runs_root}"]
    proc = start_script("train.py", *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stdout:
            if "tokenizer: learning" in line:  # the run folder is made, and the data is being prepared
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err
    assert err.rstrip().splitlines()[-1] == "stopped before the run's first checkpoint; nothing was kept", err[-500:]
    assert not [p for p in runs_root.rglob("*") if p.is_dir()], list(runs_root.rglob("*"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_finishes_the_step_checkpoints_and_says_how_to_resume(sig, small_text, tmp_path):
    run = tmp_path / "run"
    extra = ["trainer.max_steps=100000", "trainer.val_check_interval=100000", "checkpoint.every_n_steps=1000"]
    proc = start_script(
        "train.py",
        *args_for(small_text),
        *extra,
        f"hydra.run.dir={run}",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 300
    while not (run / "metrics.csv").exists() and time.time() < deadline:  # training has started
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert f"stopped by {sig.name}" in out + err and f"resume={run}" in out + err
    result = json.loads((run / "result.json").read_text())
    assert result["finished"] is False
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert 0 < saved["global_step"] < 100000
    # the checkpoint holds a whole step: weights and optimizer moments, nothing half-applied
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())


def test_nonfinite_losses_are_skipped_and_counted(small_text, tmp_path):
    run = tmp_path / "run"
    proc = run_script("train.py", *args_for(small_text), f"hydra.run.dir={run}", failpoint="nan:3-4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 3: the loss or its gradient is not finite" in proc.stdout + proc.stderr
    # steps 3 and 4 changed nothing: the step-4 weights and moments are the step-2 ones
    assert_bit_equal(run / "checkpoints" / "step-000004.ckpt", run / "checkpoints" / "step-000002.ckpt")
    skipped = [
        float(r["train/skipped_steps"])
        for r in csv.DictReader((run / "metrics.csv").open())
        if r.get("train/skipped_steps")
    ]
    assert skipped[-1] == 2
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == STEPS


def test_too_many_nonfinite_losses_stop_the_run_and_keep_the_last_good_checkpoint(small_text, tmp_path):
    run = tmp_path / "run"
    proc = run_script(
        "train.py",
        *args_for(small_text),
        "optim.max_nonfinite_in_a_row=3",
        f"hydra.run.dir={run}",
        failpoint="nan:5-10",
    )
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: training diverged: 3 steps in a row (up to step 7) had a non-finite loss; ")
    assert f"; the last good weights are in {run / 'checkpoints' / 'step-000006.ckpt'}. " in last_line
    assert last_line.endswith(" (or raise optim.max_nonfinite_in_a_row to wait longer)")
    assert "Traceback" not in proc.stderr
    good = run / "checkpoints" / "step-000004.ckpt"
    assert all(torch.isfinite(t).all() for t in checkpoint_weights(good).values())
    assert_bit_equal(run / "checkpoints" / "step-000006.ckpt", good)  # the skipped steps changed nothing
    # the run's own record says how it ended, as a finished run's does
    assert (run / "train.log").read_text().rstrip().splitlines()[-1].endswith(last_line)
    result = json.loads((run / "result.json").read_text())
    assert result["finished"] is False and last_line == f"error: {result['error']}"

    # the command it prints starts the run again, in a folder of its own, at half the learning rate
    command = last_line.split("Start it again with a lower learning rate: ")[1].removesuffix(
        " (or raise optim.max_nonfinite_in_a_row to wait longer)"
    )
    half = compose_config().optim.lr / 2  # of the default learning rate, which the run trained at
    assert command.endswith(f" optim.lr={half}") and "hydra.run.dir" not in command
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    again = run_printed(command, fresh)
    assert again.returncode == 0, again.stderr[-2000:]
    (started,) = (fresh / "outputs").glob("*/*/config.yaml")
    assert yaml.safe_load(started.read_text())["optim"]["lr"] == half


def test_a_run_that_diverges_before_its_first_checkpoint_says_there_is_none(small_text, tmp_path):
    run = tmp_path / "run"
    extra = ("optim.max_nonfinite_in_a_row=3", "checkpoint.every_n_steps=50", f"hydra.run.dir={run}")
    proc = run_script("train.py", *args_for(small_text, *extra), failpoint="nan:1-10")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: training diverged: ") and "steps in a row" in last_line
    assert f"; no checkpoint was written before it (the run's log: {run / 'train.log'}). Start it again" in last_line
    assert (run / "train.log").is_file() and not list(run.rglob("*.ckpt"))


def test_nonfinite_losses_are_skipped_with_value_clipping_too(small_text, tmp_path):
    run = tmp_path / "run"
    proc = run_script(
        "train.py",
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
    proc = run_script(
        "train.py", *args_for(small_text), f"hydra.run.dir={run}", failpoint="nan_weights:4"
    )  # broken after step 4
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(
        "error: training diverged: at step 5 the weights are no longer finite (transformer.wte.weight)"
    )
    assert f"; the last good weights are in {run / 'checkpoints' / 'step-000004.ckpt'}. Start it again" in last_line
    assert last_line.endswith(" (or clip the gradients harder than trainer.gradient_clip_val=1.0)")
    saved = sorted((run / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in saved] == ["last.ckpt", "step-000002.ckpt", "step-000004.ckpt"]
    for checkpoint in saved:
        assert all(torch.isfinite(t).all() for t in checkpoint_weights(checkpoint).values()), checkpoint


def test_full_disk_while_saving_keeps_the_previous_checkpoint(small_text, tmp_path):
    run = tmp_path / "run"
    proc = run_script("train.py", *args_for(small_text), f"hydra.run.dir={run}", failpoint="enospc:4")
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    checkpoints = run / "checkpoints"
    assert last_line == (
        f"error: the disk is full: writing {checkpoints / 'step-000004.ckpt'} failed while training; the checkpoints "
        f"in {checkpoints} are as they were last written. Free some space, then continue with "
        f"`python {ROOT / 'train.py'} resume={run}`"
    )
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step-000002.ckpt"]
    assert os.readlink(checkpoints / "last.ckpt") == "step-000002.ckpt"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 2

    resumed = run_printed(last_line.split("`")[1], tmp_path)  # space is back: the command it printed, as printed
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == STEPS


def test_old_periodic_checkpoints_are_pruned(small_text, tmp_path):
    run = tmp_path / "run"
    proc = run_script("train.py", *args_for(small_text, "checkpoint.keep=2"), f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best.ckpt", "last.ckpt", "step-000008.ckpt", "step-000010.ckpt"]


@pytest.mark.parametrize("damage", ["truncated", "bytes flipped in a tensor"])
def test_resuming_from_a_truncated_checkpoint_says_so(damage, reference, small_text, tmp_path):
    broken = tmp_path / "run" / "checkpoints" / "step-000004.ckpt"
    broken.parent.mkdir(parents=True)
    saved = reference / "checkpoints" / "step-000004.ckpt"
    if damage == "truncated":
        broken.write_bytes(saved.read_bytes()[: saved.stat().st_size // 3])
    else:  # which torch.load reads without complaint, as other numbers
        flipped_copy(saved, broken, "/data/0")
    proc = run_script("train.py", *args_for(small_text), f"hydra.run.dir={broken.parent.parent}", f"resume={broken}")
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"error: cannot resume from {broken}: it is truncated or corrupted")
    assert "Traceback" not in proc.stderr


def test_a_sweep_records_its_diverged_jobs_and_goes_on_and_fails_when_none_finished(small_text, tmp_path):
    sweep = tmp_path / "sweep"
    extra = ("optim.max_nonfinite_in_a_row=3", "checkpoint.every_n_steps=50", f"hydra.sweep.dir={sweep}")
    proc = run_script("train.py", "-m", *args_for(small_text, *extra), "optim.lr=1e-3,2e-3", failpoint="nan:1-10")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr  # a script's `&& next step` stops here
    assert "no job of the sweep finished" in proc.stdout + proc.stderr
    rows = list(csv.DictReader(open(sweep / "summary.csv")))  # both jobs ran, each recorded with its error
    assert [(r["optim.lr"], r["best"]) for r in rows] == [("0.001", ""), ("0.002", "")]
    assert all(r["finished"].startswith("training diverged: 3 steps in a row") for r in rows)


def test_a_file_of_the_run_that_cannot_be_written_while_training_ends_in_one_line_that_says_how_to_go_on(
    small_text, tmp_path
):
    """A disk that fills (here: a file-size limit, which fails a write as a full disk does) while the run
    trains, writing a checkpoint or a tracker's file: one line naming what failed and the command that
    goes on (not a tracker's traceback), and that command, run with room, ends the run."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))  # the tokens fit, a checkpoint does not

    run = tmp_path / "run"
    env = {**os.environ, "TINYGPT2_CACHE": str(tmp_path / "cache")}
    args = ["train.py", *args_for(small_text), f"hydra.run.dir={run}"]
    proc = start_script(*args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]  # (after Lightning's lines of the run's start)
    assert line.startswith("error: a file reached the size limit: writing ") and " failed while training; " in line
    command = line.split("Raise the file-size limit (ulimit -f), then start it again: ", 1)[1]
    assert command.startswith(f"python {ROOT / 'train.py'} ")  # no checkpoint was written: the run starts again
    words = shlex.split(command)
    again = subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    (result,) = [r for r in tmp_path.rglob("result.json") if json.loads(r.read_text())["finished"]]  # a new run


def test_best_checkpoint_state_saved_in_a_moved_run_folder_is_kept_and_moved_with_it(reference, tmp_path):
    """A run folder copied or moved, then resumed: Lightning forgot the best score saved under the old
    folder, so the first validation after replaced best.ckpt whatever it scored."""
    saved = torch.load(reference / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]
    moved_to = tmp_path / "moved" / "checkpoints"
    best = BestCheckpoint(moved_to)
    state = saved[best.state_key]  # the key a run saved, before and after best.ckpt had its own class
    assert state["dirpath"] == str(reference / "checkpoints")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Lightning's "The dirpath has changed" warning is gone too
        best.load_state_dict(state)
    assert best.best_model_score == state["best_model_score"] and best.best_model_score is not None
    assert best.best_model_path == str(moved_to / "best.ckpt")
    assert best.best_k_models == {str(moved_to / "best.ckpt"): state["best_model_score"]}
