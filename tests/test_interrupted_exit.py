"""A run that a signal stopped is not a finished one: Ctrl-C (SIGINT) or SIGTERM while it trains writes a
checkpoint and prints the command that continues it, and train.py exits 130 or 143, so that
`train.py && export.py`, a scheduler or CI never takes a stopped run (or sweep) for a finished one. A stop
comes within a micro-batch, even inside a step of hundreds (gradient accumulation), and the continued run
ends as an uninterrupted one would, bit for bit. A global batch of absurdly many micro-batches is refused.

The signals are real: sent from outside (as `kill` or a terminal sends them), or by the process to itself
at a given step (TINYGPT2_FAILPOINT, tests/faults/failpoints.py)."""

from __future__ import annotations

import csv
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shell.checks import SettingError
from shell.settings import global_batch
from tests.common import (
    ROOT,
    TINY_OVERRIDES,
    assert_bit_equal,
    one_error_line,
    run_printed,
    run_script,
    script_environment,
    start_script,
    train_losses,
    validations,
)

# Four micro-batches a step (8 sequences x 32 tokens each), with dropout, which draws from the random
# generators in every micro-batch: a stop inside a step must leave them as the step began.
ACCUMULATED = ("tokens_per_step=1024", "model.dropout=0.1")


def stop_args(small_text: Path, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, f"data.path={small_text}", *extra]  # 6 steps, validated after steps 3 and 6


@pytest.fixture(scope="module")
def references(small_text, tmp_path_factory):
    """The finished run of each setting, trained once without a stop."""
    made: dict[tuple[str, ...], Path] = {}

    def reference(*extra: str) -> Path:
        if extra not in made:
            run = tmp_path_factory.mktemp("reference") / "run"
            done = run_script("train.py", *stop_args(small_text, *extra), f"hydra.run.dir={run}")
            assert done.returncode == 0, done.stderr[-2000:]
            made[extra] = run
        return made[extra]

    return reference


def assert_same_run(run: Path, reference: Path) -> None:
    assert json.loads((run / "result.json").read_text())["finished"] is True
    assert train_losses(run) == train_losses(reference)  # every step logged once, with the same loss
    assert validations(run) == validations(reference)
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")


@pytest.mark.slow
@pytest.mark.parametrize(
    "failpoint, extra, status, continues_from",
    [
        ("sigint:4", (), 130, 4),  # Ctrl-C as step 4 begins: step 4 is finished, then the run stops
        ("sigterm:4", (), 143, 4),
        ("sigterm:4", ACCUMULATED, 143, 3),  # after the first of step 4's micro-batches: step 4 is dropped
        ("sigterm:1", ACCUMULATED, 143, 0),  # inside the first step: the run continues from its start
    ],
)
def test_a_run_stopped_while_training_exits_with_the_signals_status_and_continues_as_printed(
    failpoint, extra, status, continues_from, references, small_text, tmp_path
):
    run = tmp_path / "run"
    stopped = run_script("train.py", *stop_args(small_text, *extra), f"hydra.run.dir={run}", failpoint=failpoint)
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == status and "Traceback" not in said, said[-2000:]
    name = signal.Signals(status - 128).name
    printed = f"python {ROOT / 'train.py'} resume={run}"
    assert f"stopped by {name} at step {continues_from}; checkpoint saved. Continue with: {printed}" in said
    if extra:
        dropped = f"{name}: the step under way is dropped after 1 of its 4 micro-batches; the run continues from"
        assert f"{dropped} step {continues_from}" in said, said[-2000:]
    assert json.loads((run / "result.json").read_text())["finished"] is False

    resumed = run_printed(printed, tmp_path)  # as printed, with nothing else given
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_run(run, references(*extra))


@pytest.mark.slow
def test_a_ddp_run_stopped_inside_a_step_exits_143_and_continues_bit_for_bit(references, small_text, tmp_path):
    """Two processes of two micro-batches a step each, every one sent SIGTERM as step 4 begins (a scheduler
    signals them all): they agree to stop after the same micro-batch, and the run continues from step 3."""
    ddp = ("trainer.strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu")
    extra = (*ddp, *ACCUMULATED)
    run = tmp_path / "run"
    stopped = run_script("train.py", *stop_args(small_text, *extra), f"hydra.run.dir={run}", failpoint="sigterm:4")
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 143 and "Traceback" not in said, said[-2000:]
    assert (
        "SIGTERM: the step under way is dropped after 1 of its 2 micro-batches; the run continues from step 3" in said
    )
    resumed = run_script("train.py", f"resume={run}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_run(run, references(*extra))


@pytest.mark.slow
def test_a_stopped_run_does_not_go_on_to_the_next_command_of_a_script(small_text, tmp_path):
    """`python train.py ... && echo finished`, as a script or a CI job chains the next step after it."""
    run = tmp_path / "run"
    command = shlex.join([sys.executable, str(ROOT / "train.py"), *stop_args(small_text), f"hydra.run.dir={run}"])
    stopped = subprocess.run(
        ["bash", "-c", f"{command} && echo finished"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=script_environment(None, "sigterm:3"),
    )
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert "finished" not in stopped.stdout.splitlines()
    resume = shlex.join([sys.executable, str(ROOT / "train.py"), f"resume={run}"])
    resumed = subprocess.run(
        ["bash", "-c", f"{resume} && echo finished"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0 and resumed.stdout.splitlines()[-1] == "finished", resumed.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_sweep_stopped_while_a_job_trains_exits_with_the_signals_status(sig, small_text, tmp_path):
    args = ["-m", *stop_args(small_text), "optim.lr=1e-3,2e-3"]
    stopped = run_script("train.py", *args, cwd=tmp_path, failpoint=f"{sig.name.lower()}:3")
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + sig and "Traceback" not in said, said[-2000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert f"the sweep stops here; continue the sweep, this job and the rest, with: python {ROOT / 'train.py'}" in said
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(row["run"], row["finished"]) for row in rows] == [("0", "false")]


@pytest.mark.slow
def test_sigterm_inside_a_step_of_hundreds_of_micro_batches_stops_within_seconds(references, small_text, tmp_path):
    """256 micro-batches a step (one 32-token sequence each): SIGTERM sent from outside once the first step
    is logged stops the run after the micro-batch under way, not at the step's end (a step of a million
    micro-batches ignored SIGTERM for as long as it took), and the run continues from step 1 as if never
    stopped."""
    extra = ("data.batch_size=1", "tokens_per_step=8192", "model.dropout=0.1", "trainer.max_steps=2")
    run = tmp_path / "run"
    proc = start_script(
        "train.py",
        *stop_args(small_text, *extra),
        f"hydra.run.dir={run}",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 300
        while not (run / "metrics.csv").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)  # the first step is logged: step 2's micro-batches are under way
        proc.send_signal(signal.SIGTERM)
        sent = time.time()
        out, err = proc.communicate(timeout=300)
        took = time.time() - sent
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-2000:]
    dropped = re.search(r"SIGTERM: the step under way is dropped after (\d+) of its 256 micro-batches", out + err)
    assert dropped and int(dropped[1]) < 256 and "the run continues from step 1" in out + err, (out + err)[-2000:]
    assert took < 30, f"{took:.1f} s from SIGTERM to the end of the process"  # (a busy machine: seconds)
    printed = re.search(r"Continue with: (python \S+ resume=\S+)", out + err)[1]
    resumed = run_printed(printed, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_run(run, references(*extra))


def test_a_global_batch_of_absurdly_many_micro_batches_is_refused_in_one_line(small_text, tmp_path):
    runs_root = tmp_path / "outputs"
    proc = run_script(
        "train.py",
        f"data.path={small_text}",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "tokens_per_step=1073741824",
        f"runs_root={runs_root}",
    )
    assert proc.returncode == 1 and one_error_line(proc.stderr) == (
        "error: tokens_per_step=1073741824 is 1,048,576 micro-batches of data.batch_size x model.block_size x "
        "devices = 32 x 32 x 1 = 1,024 tokens per optimizer step, more than the 65,536 any sensible run takes (a "
        "step would seem to hang); use tokens_per_step=67108864 or less (the global batch in tokens), or a "
        "larger data.batch_size"
    )
    assert not runs_root.exists()


def test_the_limit_holds_for_a_given_accumulation_and_lets_the_largest_sensible_batch_through():
    values = {"data": {"batch_size": 32}, "model": {"block_size": 32}, "trainer": {"accumulate_grad_batches": 100000}}
    with pytest.raises(SettingError) as refused:
        global_batch(values, world_size=1)
    assert str(refused.value) == (
        "trainer.accumulate_grad_batches=100000 is 100,000 micro-batches of data.batch_size x model.block_size x "
        "devices = 32 x 32 x 1 = 1,024 tokens per optimizer step, more than the 65,536 any sensible run takes (a "
        "step would seem to hang); use trainer.accumulate_grad_batches=65536 or less, or a larger data.batch_size"
    )
    # GPT-3's global batch (3.2M tokens) in micro-batches of one 64-token sequence, on one device
    largest = {"data": {"batch_size": 1}, "model": {"block_size": 64}, "trainer": {}, "tokens_per_step": 3_200_000}
    assert global_batch(largest, world_size=1) == (3_200_000, 50_000)
