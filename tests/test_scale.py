"""Runs at scale, on CPU: DDP across processes, torchrun, sweeps, compile, the debug preset.

A launch of several processes (DDP, torchrun) runs as a user runs it, a process; the one-process runs each is
compared with, the sweep, the compiled model and the debug preset run train.py's command line in this
process (train_here)."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.common import (
    ROOT,
    TINY_MODEL_OVERRIDES,
    TINY_OVERRIDES,
    checkpoint_weights,
    only_run,
    run_script,
    script_environment,
    start_script,
    train_here,
)

pytestmark = pytest.mark.slow

DDP = ["trainer.strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu"]


def final(run):
    return json.loads((run / "result.json").read_text())["metrics"]


def weights(run):
    return checkpoint_weights(run / "checkpoints" / "last.ckpt")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, small_text) -> tuple[list[str], Path, str]:
    """The settings the DDP runs below share, and a run of them on one process (in this process) with the same
    global batch: 512 tokens a step, 2 micro-batches of 8 sequences of 32 tokens. Its folder and its console."""
    common = [*TINY_OVERRIDES, f"data.path={small_text}", "tokens_per_step=512"]
    folder = tmp_path_factory.mktemp("one_process")
    ran = train_here(*common, "hydra.run.dir=single", cwd=folder)
    assert ran.returncode == 0, ran.stderr[-2000:]
    return common, folder / "single", ran.stdout + ran.stderr


def test_ddp_on_two_processes_matches_one_process_with_the_same_global_batch(one_process, tmp_path):
    # as the README shows it: no hydra.run.dir; the processes Lightning starts find the run folder themselves
    common, single, said = one_process
    assert "512 tokens per step = 8 sequences x 32 tokens x 1 device(s) x 2 accumulation" in said
    two = run_script("train.py", *common, *DDP, "runs_root=ddp", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-2000:]
    assert "512 tokens per step = 8 sequences x 32 tokens x 2 device(s) x 1 accumulation" in two.stdout + two.stderr
    ddp = only_run(tmp_path / "ddp")

    # trainer.limit_val_batches=4 of the whole validation: 2 on each process, the same windows
    assert final(ddp)["val/loss"] == pytest.approx(final(single)["val/loss"], rel=1e-5)
    # the step's training loss too: over both micro-batches on one process, over both processes here
    assert final(ddp)["train/loss"] == pytest.approx(final(single)["train/loss"], rel=1e-5)
    for key, value in weights(single).items():
        # float rounding of the all-reduce against accumulation, after 6 AdamW steps: ~1e-6 near zero
        torch.testing.assert_close(weights(ddp)[key], value, rtol=1e-5, atol=1e-5)
    # one run folder, one set of logs, from both processes
    assert [p.name for p in tmp_path.iterdir()] == ["ddp"]
    assert [p.name for p in ddp.glob("*.log")] == ["train.log"]
    log = (ddp / "train.log").read_text()  # Lightning's own lines too, as on the console
    assert "GPU available: " in log and "`Trainer.fit` stopped: `max_steps=6` reached." in log
    assert len(list(csv.DictReader(open(ddp / "metrics.csv")))) > 0


def test_a_ddp_run_stopped_and_continued_on_one_device_matches_one_device_throughout(
    one_process, tmp_path, monkeypatch
):
    """The global batch stays and the accumulation follows the devices: stopped at step 3 on 2 processes
    (1 micro-batch each a step), continued on 1 (2 a step), every step after takes whole steps' batches."""
    common, single, _ = one_process
    stopped = run_script("train.py", *common, *DDP, "hydra.run.dir=moved", cwd=tmp_path, failpoint="sigint:3")
    assert stopped.returncode == 130 and "stopped by SIGINT at step 3" in stopped.stdout + stopped.stderr, (
        stopped.stderr
    )
    from shell.progress import StepsBar

    # the bar a terminal gets (progress_callback chooses it there), drawn here to the captured stdout
    monkeypatch.setattr("shell.run.progress_callback", lambda accumulation: StepsBar(accumulation))
    resumed = train_here(
        f"resume={tmp_path / 'moved'}", "trainer.strategy=auto", "trainer.devices=1", "trainer.enable_progress_bar=true"
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    moved = tmp_path / "moved"
    for key, value in weights(single).items():  # (a step of half the batch would move them by ~1e-2)
        torch.testing.assert_close(weights(moved)[key], value, rtol=1e-5, atol=1e-5)
    assert final(moved)["val/loss"] == pytest.approx(final(single)["val/loss"], rel=1e-5)
    # the bar counts micro-batches, 2 a step now: from step 3's to step 6's, never back (a negative rate)
    counts = [int(n) for n in re.findall(r"training: +\d+%\|[^|]*\| (\d+)/12 ", resumed.stdout)]
    assert counts and counts[0] == 6 and counts[-1] == 12 and counts == sorted(counts), resumed.stdout[-2000:]


def test_muon_under_ddp_matches_one_process_too(small_text, tmp_path):
    # every process orthogonalises the same averaged gradient, so the processes stay in step
    common = [*TINY_OVERRIDES, f"data.path={small_text}", "optim=muon", "optim.warmup_steps=2", "tokens_per_step=512"]
    common.append("trainer.limit_val_batches=null")  # the whole split
    one = train_here(*common, "runs_root=single")
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_script("train.py", *common, *DDP, "runs_root=ddp", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-2000:]
    single, ddp = only_run(tmp_path / "single"), only_run(tmp_path / "ddp")
    assert final(ddp)["val/loss"] == pytest.approx(final(single)["val/loss"], rel=1e-4)
    for key, value in weights(single).items():
        torch.testing.assert_close(weights(ddp)[key], value, rtol=1e-4, atol=1e-4)
    momentum = {
        run: torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]["muon"]["state"]
        for run in (single, ddp)
    }
    assert momentum[single].keys() == momentum[ddp].keys() and len(momentum[single]) == 8  # 2 layers x 4 matrices


def test_sweep_as_the_readme_shows_it_puts_every_job_in_one_folder_and_summarises(small_text, tmp_path):
    ran = train_here("-m", *TINY_OVERRIDES, f"data.path={small_text}", "optim.lr=1e-3,3e-3")
    assert ran.returncode == 0, ran.stderr[-2000:]
    (sweep,) = (tmp_path / "multirun").glob("*/*")  # one sweep folder, though the jobs started seconds apart
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    assert (sweep / "0" / "checkpoints" / "last.ckpt").is_file() and (
        sweep / "1" / "checkpoints" / "last.ckpt"
    ).is_file()
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [float(row["optim.lr"]) for row in rows] == [1e-3, 3e-3]
    assert all(float(row["val/bpc"]) > 0 and row["finished"] == "true" for row in rows)
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["runs"][1]["config"]["optim"]["lr"] == 3e-3
    best = min(summary["runs"], key=lambda r: r["metrics"]["val/bpc"])
    assert summary["best"]["run"] == Path(best["run_dir"]).name and [row["best"] for row in rows].count("*") == 1
    assert "best: " in ran.stdout + ran.stderr
    for job in ("0", "1"):  # each job's log has its own Lightning lines, and only its own
        lines = (sweep / job / "train.log").read_text().splitlines()
        # (as lines: here, where Lightning was imported after pytest's log handlers, each comes twice, alike)
        assert len({line for line in lines if "`Trainer.fit` stopped" in line}) == 1


def test_torchrun_as_the_readme_shows_it_one_run_folder_and_one_sweep_folder(small_text, tmp_path):
    """torchrun --standalone starts the processes: a run goes to outputs/torchrun-<id>, a sweep (-m) to
    multirun/torchrun-<id>, the same for every process, with its summary written once."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    common = [*TINY_OVERRIDES, f"data.path={small_text}", "trainer.strategy=ddp", "trainer.devices=2"]
    for sweep in ([], ["-m", "optim.lr=1e-3,3e-3"]):
        proc = subprocess.run(
            [*torchrun, str(ROOT / "train.py"), *sweep, *common],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env=script_environment(None, None),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "outputs").glob("torchrun-*")
    assert (run / "checkpoints" / "last.ckpt").is_file() and json.loads((run / "result.json").read_text())["finished"]
    (sweep_dir,) = (tmp_path / "multirun").iterdir()  # one folder, not one per process
    assert sweep_dir.name.startswith("torchrun-")
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
    rows = list(csv.DictReader(open(sweep_dir / "summary.csv")))
    assert [float(row["optim.lr"]) for row in rows] == [1e-3, 3e-3] and all(r["finished"] == "true" for r in rows)


def test_compiled_model_saves_plain_weight_names(small_text, tmp_path):
    ran = train_here(
        *TINY_OVERRIDES, f"data.path={small_text}", "compile=true", "trainer.max_steps=3", "hydra.run.dir=c"
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    keys = list(weights(tmp_path / "c"))
    assert "model.transformer.wte.weight" in keys and not any("_orig_mod" in k for k in keys)


def test_debug_preset_runs_with_everything_on(small_text, tmp_path):
    ran = train_here("debug=default", *TINY_MODEL_OVERRIDES, "data.batch_size=8", f"data.path={small_text}",
                     "hydra.run.dir=debug")  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    run = tmp_path / "debug"
    for name in ("checkpoints/last.ckpt", "metrics.csv", "loss.png", "samples.md", "tensorboard"):
        assert (run / name).exists(), name
    assert list((run / "wandb").glob("offline-run-*"))
    assert json.loads((run / "result.json").read_text())["config"]["trainer"]["max_steps"] == 10


def launched_children(pid: int) -> list[int]:
    """The processes of a launch that its first process, pid, started (Lightning gives each a LOCAL_RANK;
    other children, such as a tool the checks run, have none)."""
    found = []
    for listed in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = [int(child) for child in listed.read_text().split()]
        except OSError:
            continue
        for child in children:
            try:
                if b"\0LOCAL_RANK=" in b"\0" + Path(f"/proc/{child}/environ").read_bytes():
                    found.append(child)
            except OSError:
                continue
    return found


@pytest.mark.parametrize(
    "failpoint, said",
    [("enospc:4", "error: the disk is full: writing "), ("nan:2-6", "error: training diverged: ")],
)
def test_an_error_that_stops_a_ddp_run_is_said_once_without_a_traceback(failpoint, said, small_text, tmp_path):
    """A checkpoint the first process cannot write, or a divergence every process meets: the other
    process, its partner gone, ends quietly (its words in train.log), and the command says it once, as it
    says each line of its log."""
    args = ["trainer.strategy=ddp", "trainer.devices=2", "tokens_per_step=512", "trainer.max_steps=8"]
    args += ["checkpoint.every_n_steps=2", "optim.max_nonfinite_in_a_row=3", f"data.path={small_text}"]
    proc = run_script("train.py", *TINY_OVERRIDES, *args, "hydra.run.dir=run", cwd=tmp_path, failpoint=failpoint)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(said), proc.stderr[-3000:]
    # and the other process's log lines go to train.log alone, not to the console a second time: the first
    # process describes the run once, for both, and each says where its tokens come from
    said, log = proc.stdout + proc.stderr, (tmp_path / "run" / "train.log").read_text()
    assert said.count("][train][INFO] - model: ") == 1 and log.count("][train][INFO] - model: ") == 1, said[-3000:]
    assert log.count("][data.prepare][INFO] - ") == said.count("][data.prepare][INFO] - ") + 1, said[-3000:]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the launch's processes in /proc")
def test_a_ddp_run_whose_other_process_is_killed_stops_in_one_line_that_says_how_to_continue(small_text, tmp_path):
    """kill -9 of one of the processes Lightning started (the kernel's out-of-memory killer, say): the
    first ends at its next exchange with it, in one line with the command that continues the run."""
    args = ["trainer.strategy=ddp", "trainer.devices=2", "tokens_per_step=512", *TINY_OVERRIDES]
    args += ["trainer.max_steps=100000", "checkpoint.every_n_steps=2", f"data.path={small_text}", "hydra.run.dir=run"]
    proc = start_script("train.py", *args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while not list((tmp_path / "run" / "checkpoints").glob("step-*.ckpt")) and time.time() < deadline:
            time.sleep(0.1)
        (child,) = launched_children(proc.pid)
        os.kill(child, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    last = err.rstrip().splitlines()[-1]
    assert err.count("error: ") == 1 and last.startswith(
        "error: another process of this run ended (killed, or by an error of its own, printed"
    )
    assert last.endswith(f"Continue with `python {ROOT / 'train.py'} resume={tmp_path / 'run'}`")
