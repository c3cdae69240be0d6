"""A run stopped in every way a run stops, continued bit for bit: killed (SIGKILL after a step, halfway through a
checkpoint, as it validates, after its end), stopped by Ctrl-C or SIGTERM (exit 130 or 143, the command that
continues it printed and run as printed, inside a step of many micro-batches too, on two DDP processes),
stopped as it starts (as the libraries load, as Hydra composes, as the data is prepared: nothing left), a sweep
stopped, Ctrl-C twice as a checkpoint is written, and a run that diverges or cannot write its files.

A kill, a signal's exit status as a shell sees it, the start of a process and DDP need a process of train.py
(run_script, stop_at, a bash); the rest runs in this process (train_here), the signals sent by tests/faults as
a step begins, and the runs killed are continued here too. Each is compared with one reference run."""

from __future__ import annotations

import csv
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.common import (
    ROOT,
    TINY_OVERRIDES,
    assert_bit_equal,
    checkpoint_weights,
    compose_config,
    only_run,
    paste_into_bash,
    printed_after,
    refused,
    run_script,
    runs_under,
    sample_steps,
    script_environment,
    start_script,
    stop_at,
    train_as_printed,
    train_here,
    train_losses,
    validations,
)

STEPS = 10  # validated after steps 5 and 10, a checkpoint every 2 steps, all kept
# Four micro-batches a step (8 sequences x 32 tokens each), with dropout, which draws from the random
# generators in every micro-batch: a stop inside a step must leave them as the step began.
ACCUMULATED = ("tokens_per_step=1024", "model.dropout=0.1")
# 256 micro-batches a step (one 32-token sequence each), two steps
HUNDREDS = ("data.batch_size=1", "tokens_per_step=8192", "model.dropout=0.1", "trainer.max_steps=2")
DDP = ("trainer.strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu")
JOSE = "josé, a=b"  # the quick start in /home/josé, a=b/...: an accent, a comma and =
TIMINGS = ("train/tokens_per_sec", "train/mfu")  # the machine's, not the run's


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
def references(small_text, tmp_path_factory):
    """references(*extra): the run of args_for(*extra), trained once, never stopped (in this process)."""
    made: dict[tuple[str, ...], Path] = {}

    def reference(*extra: str) -> Path:
        if extra not in made:
            run = tmp_path_factory.mktemp("reference") / "run"
            done = train_here(*args_for(small_text, *extra), f"hydra.run.dir={run}", cwd=run.parent)
            assert done.returncode == 0, done.stderr[-3000:]
            made[extra] = run
        return made[extra]

    return reference


@pytest.fixture(scope="module")
def reference(references) -> Path:
    return references()


def result_json(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


def assert_same_run(run: Path, reference: Path) -> None:
    """The run ended as the reference did: finished, every step and validation logged once with the same values,
    the same samples, the same last values, and the same weights and optimizer state, bit for bit."""
    assert result_json(run)["finished"] is True
    assert train_losses(run) == train_losses(reference)
    assert validations(run) == validations(reference) and sample_steps(run) == sample_steps(reference)
    ours, theirs = ({k: v for k, v in result_json(r)["metrics"].items() if k not in TIMINGS} for r in (run, reference))
    assert "train/loss" in ours and ours == theirs
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")


def loss_curve(checkpoint: Path) -> dict:
    """The loss curve's history a checkpoint carries (what loss.png is drawn from after a resume)."""
    state = torch.load(checkpoint, weights_only=False)["callbacks"]
    (curve,) = [value for key, value in state.items() if key.startswith("LossCurve")]
    return curve


# ---- killed (SIGKILL), then continued ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "failpoint, left",
    [
        ("kill:6", ["best.ckpt", "step-000002.ckpt", "step-000004.ckpt"]),  # after step 6, before its checkpoint
        ("kill_save:6", ["best.ckpt", "step-000002.ckpt", "step-000004.ckpt"]),  # halfway through writing it
        ("kill_val:5", ["step-000002.ckpt", "step-000004.ckpt"]),  # as the validation after step 5 begins
    ],
)
def test_killed_run_resumes_bit_for_bit(failpoint, left, reference, small_text, tmp_path):
    runs_root = tmp_path / "outputs"
    args = [*args_for(small_text), f"runs_root={runs_root}"]
    killed = run_script("train.py", *args, failpoint=failpoint)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run = only_run(runs_root)
    assert not (run / "result.json").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("*.ckpt") if not p.is_symlink()) == left
    resumed = train_here(*args, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    newest = "best.ckpt (step 5)" if "best.ckpt" in left else "step-000004.ckpt (step 4)"
    assert f"resuming from {run / 'checkpoints' / newest}" in resumed.stdout  # kill:6: best.ckpt is the newer
    assert only_run(runs_root) == run  # continued in place, no second folder
    assert_same_run(run, reference)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # the half-written file is gone
    assert (run / ".hydra" / "config.yaml").is_file() and list((run / ".hydra").glob("resume-*"))


@pytest.mark.slow
def test_a_finished_run_trained_further_and_killed_at_its_new_end_is_finished_by_resume(
    reference, small_text, tmp_path
):
    """A finished run given more steps is unfinished again until its new end is recorded: killed after its new
    last checkpoint, before its end was recorded, resume=auto finds it and ends it as the run never killed."""
    runs_root = tmp_path / "outputs"
    run = shutil.copytree(reference, runs_root / "2026-01-01" / "09-00-00", symlinks=True)
    uninterrupted = shutil.copytree(reference, tmp_path / "uninterrupted", symlinks=True)
    assert train_here(f"resume={uninterrupted}", f"trainer.max_steps={STEPS + 4}").returncode == 0
    further = run_script(
        "train.py", f"resume={run}", f"trainer.max_steps={STEPS + 4}", failpoint=f"kill_end:{STEPS + 4}"
    )
    assert further.returncode == -signal.SIGKILL, further.stderr[-3000:]
    assert result_json(run)["finished"] is False
    same = [a for a in args_for(small_text) if not a.startswith("trainer.max_steps=")]  # the run's own limit
    ended = train_here(*same, f"runs_root={runs_root}", "resume=auto")
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert f"the run trained all its {STEPS + 4} steps but stopped before it ended; ending it now" in ended.stdout
    assert result_json(run)["config"]["trainer"]["max_steps"] == STEPS + 4
    # each validation logged once, at the step it follows (Lightning's numbering: step - 1), the samples beside it
    assert list(validations(run)) == [4, 9, STEPS + 3] and sample_steps(run) == [4, 4, 9, 9, STEPS + 3, STEPS + 3]
    assert_same_run(run, uninterrupted)
    (tmp_path / "here").mkdir()
    assert f"reached trainer.max_steps={STEPS + 4}" in refused(f"resume={run}", cwd=tmp_path / "here")


@pytest.mark.slow
def test_a_checkpoint_at_a_validation_step_holds_that_validation(reference):
    """A step checkpoint of a step that validates is written after the validation (a run continued from it
    neither repeats nor lacks it), best.ckpt after the validation it is the best of: each with the loss
    curve of every validation before."""
    checkpoints = reference / "checkpoints"
    assert len(loss_curve(checkpoints / "step-000004.ckpt")["val"]) == 0
    assert len(loss_curve(checkpoints / "best.ckpt")["val"]) in (1, 2)  # of step 5 or of step 10
    assert len(loss_curve(checkpoints / "step-000006.ckpt")["val"]) == 1
    assert len(loss_curve(checkpoints / f"step-{STEPS:06d}.ckpt")["val"]) == 2
    assert loss_curve(checkpoints / "last.ckpt") == loss_curve(checkpoints / f"step-{STEPS:06d}.ckpt")


@pytest.mark.slow
def test_a_killed_sweep_continues_in_its_folder_each_job_from_where_it_stood(reference, small_text, tmp_path):
    """-m resume=SWEEP: the job that finished is kept, the killed one continues from its checkpoint (ending bit
    for bit as a run never killed), the one that never ran runs; a setting beside it is refused."""
    lengths = "trainer.max_steps=6,10,14"  # job 0 finishes before step 7, job 1 is killed after it, job 2 waits
    killed = run_script("train.py", "-m", *args_for(small_text), lengths, failpoint="kill:7")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    assert not (sweep / "1" / "result.json").exists()
    kept = (sweep / "0" / "checkpoints" / "last.ckpt").read_bytes()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert refused("-m", f"resume={sweep}", "optim.lr=1", cwd=elsewhere).startswith(
        f"-m resume={sweep} continues the sweep with its own command line; leave out optim.lr=1"
    )
    continued = train_here("-m", f"resume={sweep}", cwd=elsewhere)
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert (sweep / "0" / "checkpoints" / "last.ckpt").read_bytes() == kept
    assert_bit_equal(sweep / "1" / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert train_losses(sweep / "1") == train_losses(reference)
    with open(sweep / "summary.csv", newline="") as file:
        rows = [(r["run"], r["trainer.max_steps"], r["finished"]) for r in csv.DictReader(file)]
    assert rows == [("0", "6", "true"), ("1", "10", "true"), ("2", "14", "true")]
    assert not any(elsewhere.iterdir())


# ---- stopped by Ctrl-C or SIGTERM while training --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("step", [5, 7, STEPS])  # a validation step, another, the last
def test_ctrl_c_at_a_step_adds_no_validation_and_the_printed_resume_ends_the_run_as_never_stopped(
    step, reference, small_text, tmp_path
):
    run = tmp_path / "run"
    stopped = train_here(*args_for(small_text), f"hydra.run.dir={run}", env={"TINYGPT2_FAILPOINT": f"sigint:{step}"})
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == (130 if step < STEPS else 0), said[-3000:]  # stopped, or finished
    if step < STEPS:
        printed = f"python {ROOT / 'train.py'} resume={run}"
        assert f"stopped by SIGINT at step {step}; checkpoint saved. Continue with: {printed}" in said
        assert result_json(run)["finished"] is False
        resumed = train_as_printed(printed_after("Continue with: ", said), tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    # at the last step the run ends there anyway: it records its end, with nothing to continue
    assert_same_run(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    "failpoint, extra, continues_from",
    [
        ("sigterm:4", (), 4),  # SIGTERM as step 4 begins: step 4 is finished, then the run stops
        ("sigterm:4", ACCUMULATED, 3),  # after the first of step 4's micro-batches: step 4 is dropped
        ("sigterm:1", ACCUMULATED, 0),  # inside the first step: the run continues from its start
    ],
)
def test_a_run_stopped_while_training_exits_with_the_signals_status_and_continues_as_printed(
    failpoint, extra, continues_from, references, small_text, tmp_path
):
    run = tmp_path / "run"
    stopped = train_here(*args_for(small_text, *extra), f"hydra.run.dir={run}", env={"TINYGPT2_FAILPOINT": failpoint})
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 143 and "Traceback" not in said, said[-3000:]
    printed = f"python {ROOT / 'train.py'} resume={run}"
    assert f"stopped by SIGTERM at step {continues_from}; checkpoint saved. Continue with: {printed}" in said
    if extra:
        dropped = "SIGTERM: the step under way is dropped after 1 of its 4 micro-batches; the run continues from"
        assert f"{dropped} step {continues_from}" in said, said[-3000:]
    assert result_json(run)["finished"] is False
    resumed = train_as_printed(printed, tmp_path)  # as printed, with nothing else given
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, references(*extra))


@pytest.mark.slow
def test_sigterm_inside_a_step_of_hundreds_of_micro_batches_stops_within_seconds(references, small_text, tmp_path):
    """256 micro-batches a step: SIGTERM as step 2 begins stops the run after the micro-batch under way, not at
    the step's end (a step of a million micro-batches ignored SIGTERM for as long as it took), and the run
    continues from step 1 as if never stopped."""
    run = tmp_path / "run"
    began = time.time()
    stopped = train_here(*args_for(small_text, *HUNDREDS), f"hydra.run.dir={run}", env={"TINYGPT2_FAILPOINT": "sigterm:2"})  # fmt: skip
    took = time.time() - began
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 143, said[-3000:]
    assert (
        "SIGTERM: the step under way is dropped after 1 of its 256 micro-batches; the run continues from step 1" in said
    )
    assert took < 60, f"{took:.1f} s to stop"  # (a step of 256 micro-batches takes about as long as the start)
    resumed = train_as_printed(re.search(r"Continue with: (python \S+ resume=\S+)", said)[1], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, references(*HUNDREDS))


def test_the_limit_holds_for_a_given_accumulation_and_lets_the_largest_sensible_batch_through():
    from shell.checks import SettingError
    from shell.settings import global_batch

    values = {"data": {"batch_size": 32}, "model": {"block_size": 32}, "trainer": {"accumulate_grad_batches": 100000}}
    with pytest.raises(SettingError) as refused_batch:
        global_batch(values, world_size=1)
    assert str(refused_batch.value) == (
        "trainer.accumulate_grad_batches=100000 is 100,000 micro-batches of data.batch_size x model.block_size x "
        "devices = 32 x 32 x 1 = 1,024 tokens per optimizer step, more than the 65,536 any sensible run takes (a "
        "step would seem to hang); use trainer.accumulate_grad_batches=65536 or less, or a larger data.batch_size"
    )
    # GPT-3's global batch (3.2M tokens) in micro-batches of one 64-token sequence, on one device
    largest = {"data": {"batch_size": 1}, "model": {"block_size": 64}, "trainer": {}, "tokens_per_step": 3_200_000}
    assert global_batch(largest, world_size=1) == (3_200_000, 50_000)


@pytest.mark.slow
def test_a_stopped_run_does_not_go_on_to_the_next_command_of_a_script(reference, small_text, tmp_path):
    """`python train.py ... && echo finished`, as a script or a CI job chains its next step, in the quick start's
    folder (/home/josé, a=b/...): SIGTERM stops the chain (exit 143); the command printed, pasted into bash as
    printed, continues the run to the end the run never stopped would have reached."""
    here = tmp_path / JOSE
    here.mkdir()
    command = shlex.join(["python", str(ROOT / "train.py"), *args_for(small_text)])
    stopped = paste_into_bash(f"{command} && echo finished", here, script_environment(None, "sigterm:3"))
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "finished" not in stopped.stdout.splitlines() and "Traceback" not in stopped.stderr
    (run,) = runs_under(here / "outputs")
    started = {name: (run / name).read_bytes() for name in ("config.yaml", "tokenizer.json")}
    printed = printed_after("Continue with: ", stopped.stdout + stopped.stderr)
    assert shlex.split(printed) == ["python", str(ROOT / "train.py"), f"resume={run}"]
    resumed = paste_into_bash(f"{printed} && echo finished", tmp_path)  # from another folder
    assert resumed.returncode == 0 and resumed.stdout.splitlines()[-1] == "finished", resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert runs_under(here / "outputs") == [run] and sorted(p.name for p in here.iterdir()) == ["outputs"]
    assert_same_run(run, reference)
    assert {name: (run / name).read_bytes() for name in started} == started  # the run's record, never rewritten
    assert list(result_json(run)["config"]["logger"]) == ["csv"] and not (run / "wandb").exists()  # its own logger

    sample = printed_after("sample from it: ", resumed.stdout + resumed.stderr)  # the resumed run's own
    assert shlex.split(sample)[:4] == ["python", str(ROOT / "generate.py"), "--ckpt", str(run)]
    import generate

    assert generate.main([*shlex.split(sample)[2:], "--max-new-tokens", "8"]) == 0


@pytest.mark.slow
def test_ctrl_c_twice_while_a_checkpoint_is_written_leaves_no_part_of_it(reference, small_text, tmp_path):
    run = tmp_path / "run"
    stopped = train_here(*args_for(small_text), f"hydra.run.dir={run}", env={"TINYGPT2_FAILPOINT": "ctrl_c_save:4"})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    printed = f"python {ROOT / 'train.py'} resume={run}"
    assert stopped.stderr.rstrip().splitlines()[-1] == f"stopped; continue with: {printed}"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step-000002.ckpt"]  # no .tmp
    resumed = train_as_printed(printed, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, reference)


@pytest.mark.slow
def test_a_ddp_run_stopped_inside_a_step_exits_143_and_continues_bit_for_bit(small_text, tmp_path):
    """Two processes of two micro-batches a step each, every one sent SIGTERM as step 4 begins (a scheduler
    signals them all): they agree to stop after the same micro-batch, and the run continues from step 3."""
    args = [*TINY_OVERRIDES, f"data.path={small_text}", *DDP, *ACCUMULATED]  # 6 steps, validated after 3 and 6
    reference = tmp_path / "reference"
    done = run_script("train.py", *args, f"hydra.run.dir={reference}")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    stopped = run_script("train.py", *args, f"hydra.run.dir={run}", failpoint="sigterm:4")
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 143 and "Traceback" not in said, said[-3000:]
    assert (
        "SIGTERM: the step under way is dropped after 1 of its 2 micro-batches; the run continues from step 3" in said
    )
    resumed = run_script("train.py", f"resume={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert result_json(run)["finished"] is True
    assert train_losses(run) == train_losses(reference) and validations(run) == validations(reference)
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")


# ---- a sweep stopped ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_sweep_stopped_while_a_job_trains_exits_with_the_signals_status(sig, small_text, tmp_path):
    args = ["-m", *TINY_OVERRIDES, f"data.path={small_text}", "optim.lr=1e-3,2e-3"]
    stopped = train_here(*args, env={"TINYGPT2_FAILPOINT": f"{sig.name.lower()}:2"})
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + sig and "Traceback" not in said, said[-3000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    command = f"python {ROOT / 'train.py'} -m resume={sweep}"
    assert f"the sweep stops here; continue the sweep, this job and the rest, with: {command}" in said
    with open(sweep / "summary.csv", newline="") as file:
        assert [(row["run"], row["finished"]) for row in csv.DictReader(file)] == [("0", "false")]


@pytest.mark.slow
def test_ctrl_c_at_the_last_step_of_a_job_stops_the_sweep_after_that_job(small_text, tmp_path):
    """A Ctrl-C that the training loop takes at a job's last step ends that job as it would have ended anyway,
    and the sweep stops before its next job (it went on with every other job, and exited 0)."""
    args = ["-m", *TINY_OVERRIDES, f"data.path={small_text}", "trainer.max_steps=3", "optim.lr=1e-3,2e-3"]
    stopped = train_here(*args, env={"TINYGPT2_FAILPOINT": "sigint:3"})
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 130 and "Traceback" not in said, said[-3000:]
    assert "SIGINT came as the job ended; the sweep stops before its next job" in said, said[-3000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    with open(sweep / "summary.csv", newline="") as file:
        assert [(row["run"], row["finished"]) for row in csv.DictReader(file)] == [("0", "true")]
    continued = train_as_printed(printed_after("this job and the rest, with: ", said), tmp_path)
    assert continued.returncode == 0, continued.stderr[-3000:]
    with open(sweep / "summary.csv", newline="") as file:
        assert [(row["run"], row["finished"]) for row in csv.DictReader(file)] == [("0", "true"), ("1", "true")]


# ---- stopped as it starts ------------------------------------------------------------------------------------------


def signalled_at(monkeypatch, owner, name: str, signum: int, call: int = 1) -> None:
    """owner.name sends this process signum as it is called for the `call`-th time, then runs as it was."""
    original, calls = getattr(owner, name), []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)


@pytest.mark.slow
def test_ctrl_c_as_the_libraries_load_ends_the_process_at_once(small_text, tmp_path):
    """Nothing has started that could be left half done, and a KeyboardInterrupt inside a C extension's import
    breaks it: the process ends by the signal, saying nothing (a shell says 130)."""
    env = stop_at(tmp_path / "hook", "lightning_utilities.core.imports:RequirementCache.__init__", signal.SIGINT)
    here = tmp_path / "here"
    here.mkdir()
    ran = run_script("train.py", *args_for(small_text), cwd=here, env=env)
    assert ran.returncode == -signal.SIGINT, ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr
    assert not any(here.iterdir())


@pytest.mark.slow
def test_ctrl_c_as_hydra_composes_the_run_stops_before_anything_is_made(small_text, tmp_path):
    env = stop_at(tmp_path / "hook", "hydra.core.override_parser.overrides_parser:OverridesParser.parse_overrides", signal.SIGINT)  # fmt: skip
    here = tmp_path / "here"
    here.mkdir()
    ran = run_script("train.py", *args_for(small_text), cwd=here, env=env)
    assert ran.returncode == 130, ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr
    assert ran.stderr.rstrip().splitlines()[-1] == "stopped before training began; nothing was written"
    assert not any(here.iterdir())


@pytest.mark.slow
def test_ctrl_c_as_the_data_is_prepared_takes_the_new_run_back(small_text, tmp_path):
    env = stop_at(tmp_path / "hook", "data.prepare:prepare_corpus", signal.SIGINT)
    env["TINYGPT2_CACHE"] = str(tmp_path / "cache")  # the data is prepared anew
    here = tmp_path / "here"
    here.mkdir()
    ran = run_script("train.py", *args_for(small_text), cwd=here, env=env)
    assert ran.returncode == 130, ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr
    assert ran.stderr.rstrip().splitlines()[-1] == "stopped before the run's first checkpoint; nothing was kept"
    assert not any(here.iterdir())  # the run folder made for it, and outputs/ made for that, taken back


@pytest.mark.slow
def test_sigterm_while_the_data_is_prepared_takes_the_new_run_back_as_ctrl_c_does(small_text, tmp_path, monkeypatch):
    """`kill PID` (a scheduler's stop) before training: the run is taken back in one line, as for Ctrl-C."""
    import shell.settings

    signalled_at(monkeypatch, shell.settings, "prepare_corpus", signal.SIGTERM)
    ran = train_here(*args_for(small_text))
    assert ran.returncode == 143, ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr
    assert ran.stderr.rstrip().splitlines()[-1] == "stopped before the run's first checkpoint; nothing was kept"
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_ctrl_c_before_a_sweep_job_has_a_checkpoint_takes_the_sweep_back(small_text, tmp_path, monkeypatch):
    """Ctrl-C as the first job prepares its data leaves no sweep folder without a run in it: the same command
    runs again."""
    import shell.settings

    signalled_at(monkeypatch, shell.settings, "prepare_corpus", signal.SIGINT)
    ran = train_here("-m", *args_for(small_text), "optim.lr=1e-3,2e-3")
    assert ran.returncode == 130, ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr
    assert ran.stderr.rstrip().splitlines()[-1] == "stopped before the run's first checkpoint; nothing was kept"
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_ctrl_c_as_the_next_job_of_a_sweep_starts_prints_how_to_continue_the_sweep(small_text, tmp_path, monkeypatch):
    import shell.settings

    signalled_at(monkeypatch, shell.settings, "prepare_corpus", signal.SIGINT, call=2)  # job 0 done, job 1 starting
    ran = train_here("-m", *args_for(small_text), "optim.lr=1e-3,2e-3")
    said = ran.stdout + ran.stderr
    assert ran.returncode == 130 and "Traceback" not in said, said[-3000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    command = f"python {ROOT / 'train.py'} -m resume={sweep}"
    assert f"continue the sweep, this job and the rest, with: {command}" in said, said[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"]  # job 1's folder taken back
    monkeypatch.undo()
    continued = train_as_printed(command, tmp_path)
    assert continued.returncode == 0, continued.stderr[-3000:]
    with open(sweep / "summary.csv", newline="") as file:
        assert [(row["run"], row["finished"]) for row in csv.DictReader(file)] == [("0", "true"), ("1", "true")]


@pytest.mark.slow
def test_ctrl_c_as_a_sweeps_first_job_starts_leaves_no_sweep_folder(small_text, tmp_path, monkeypatch):
    """Ctrl-C after the sweep's folder is made, as Hydra starts its first job: the stop waits for the job, which
    takes the folder back."""
    import shell.job

    signalled_at(monkeypatch, shell.job.Job, "of", signal.SIGINT)
    ran = train_here("-m", *args_for(small_text), "optim.lr=1e-3,2e-3")
    assert ran.returncode == 130, ran.stderr[-3000:]
    assert ran.stderr.rstrip().splitlines()[-1] == "stopped before the run's first checkpoint; nothing was kept"
    assert not any(tmp_path.iterdir()), list(tmp_path.rglob("*"))


# ---- a run that diverges, or cannot write ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("clipping", [(), ("trainer.gradient_clip_algorithm=value", "trainer.gradient_clip_val=0.5")])
def test_nonfinite_losses_are_skipped_and_counted(clipping, small_text, tmp_path):
    run = tmp_path / "run"
    ran = train_here(*args_for(small_text, *clipping), f"hydra.run.dir={run}", env={"TINYGPT2_FAILPOINT": "nan:3-4"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "step 3: the loss or its gradient is not finite" in ran.stdout + ran.stderr
    # steps 3 and 4 changed nothing: the step-4 weights and moments are the step-2 ones
    assert_bit_equal(run / "checkpoints" / "step-000004.ckpt", run / "checkpoints" / "step-000002.ckpt")
    with open(run / "metrics.csv", newline="") as file:
        skipped = [float(r["train/skipped_steps"]) for r in csv.DictReader(file) if r.get("train/skipped_steps")]
    assert skipped[-1] == 2
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == STEPS


@pytest.mark.slow
def test_too_many_nonfinite_losses_stop_the_run_and_keep_the_last_good_checkpoint(small_text, tmp_path):
    run = tmp_path / "run"
    args = [*args_for(small_text, "optim.max_nonfinite_in_a_row=3"), f"hydra.run.dir={run}"]
    ran = train_here(*args, env={"TINYGPT2_FAILPOINT": "nan:5-10"})
    assert ran.returncode == 1 and "Traceback" not in ran.stderr
    last_line = ran.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: training diverged: 3 steps in a row (up to step 7) had a non-finite loss; ")
    assert f"; the last good weights are in {run / 'checkpoints' / 'step-000006.ckpt'}. " in last_line
    assert last_line.endswith(" (or raise optim.max_nonfinite_in_a_row to wait longer)")
    good = run / "checkpoints" / "step-000004.ckpt"
    assert all(torch.isfinite(t).all() for t in checkpoint_weights(good).values())
    assert_bit_equal(run / "checkpoints" / "step-000006.ckpt", good)  # the skipped steps changed nothing
    assert (run / "train.log").read_text().rstrip().splitlines()[-1].endswith(last_line)  # the run's log says so

    # the command it prints starts the run again, in a folder of its own, at half the learning rate
    command = printed_after("Start it again with a lower learning rate: ", last_line).removesuffix(
        " (or raise optim.max_nonfinite_in_a_row to wait longer)"
    )
    half = compose_config().optim.lr / 2  # of the default learning rate, which the run trained at
    assert command.endswith(f" optim.lr={half}") and "hydra.run.dir" not in command
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    again = train_as_printed(command, fresh)
    assert again.returncode == 0, again.stderr[-3000:]
    assert only_run(fresh / "outputs") and result_json(only_run(fresh / "outputs"))["config"]["optim"]["lr"] == half
    # and the run's record says how it ended, as a finished run's does
    assert result_json(run)["finished"] is False and last_line == f"error: {result_json(run)['error']}"


@pytest.mark.slow
def test_a_run_that_diverges_before_its_first_checkpoint_says_there_is_none(small_text, tmp_path):
    """No checkpoint, nothing to keep: the run folder is taken back, and the command that starts the run again
    keeps the folder given (hydra.run.dir), now free."""
    run = tmp_path / "runs" / "first"
    args = [
        *args_for(small_text, "optim.max_nonfinite_in_a_row=3", "checkpoint.every_n_steps=50"),
        f"hydra.run.dir={run}",
    ]
    ran = train_here(*args, env={"TINYGPT2_FAILPOINT": "nan:1-10"})
    assert ran.returncode == 1 and "Traceback" not in ran.stderr
    last_line = ran.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: training diverged: ") and "steps in a row" in last_line
    assert "; no checkpoint was written before it. Start it again with a lower learning rate: " in last_line
    assert not (tmp_path / "runs").exists()  # taken back, with the folder made for it
    command = printed_after("Start it again with a lower learning rate: ", last_line).split(" (or raise ")[0]
    assert f"hydra.run.dir={run}" in shlex.split(command)
    again = train_as_printed(command, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert result_json(run)["finished"]


@pytest.mark.slow
def test_weights_that_are_no_longer_finite_are_never_checkpointed(small_text, tmp_path):
    run = tmp_path / "run"
    ran = train_here(*args_for(small_text), f"hydra.run.dir={run}", env={"TINYGPT2_FAILPOINT": "nan_weights:4"})
    assert ran.returncode == 1 and "Traceback" not in ran.stderr
    last_line = ran.stderr.strip().splitlines()[-1]
    assert last_line.startswith(  # (broken after step 4's checkpoint; found as step 6's is about to be written)
        "error: training diverged: at step 6 the weights are no longer finite (transformer.wte.weight), and no "
        f"checkpoint was written from them; the last good weights are in {run / 'checkpoints' / 'step-000004.ckpt'}. "
        "Start it again"
    )
    assert last_line.endswith(" (or clip the gradients harder than trainer.gradient_clip_val=1.0)")
    saved = sorted((run / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in saved] == ["last.ckpt", "step-000002.ckpt", "step-000004.ckpt"]
    for checkpoint in saved:
        assert all(torch.isfinite(t).all() for t in checkpoint_weights(checkpoint).values()), checkpoint


@pytest.mark.slow
def test_full_disk_while_saving_keeps_the_previous_checkpoint(reference, small_text, tmp_path):
    run = tmp_path / "run"
    ran = train_here(*args_for(small_text), f"hydra.run.dir={run}", env={"TINYGPT2_FAILPOINT": "enospc:4"})
    assert ran.returncode == 1 and "Traceback" not in ran.stderr
    checkpoints = run / "checkpoints"
    last_line = ran.stderr.strip().splitlines()[-1]
    assert last_line == (
        f"error: the disk is full: writing {checkpoints / 'step-000004.ckpt'} failed while training; the checkpoints "
        f"in {checkpoints} are as they were last written. Free some space, then continue with "
        f"`python {ROOT / 'train.py'} resume={run}`"
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step-000002.ckpt"]
    assert os.readlink(checkpoints / "last.ckpt") == "step-000002.ckpt"
    resumed = train_as_printed(last_line.split("`")[1], tmp_path)  # space is back: the command it printed, as printed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, reference)


@pytest.mark.slow
def test_a_file_of_the_run_that_cannot_be_written_while_training_ends_in_one_line_that_says_how_to_go_on(
    small_text, tmp_path
):
    """A disk that fills (here: a file-size limit, which fails a write as a full disk does) while the run trains:
    one line naming what failed and the command that goes on, and that command, run with room, ends the run."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))  # the tokens fit, a checkpoint does not

    env = {**script_environment(None, None), "TINYGPT2_CACHE": str(tmp_path / "cache")}
    proc = start_script(
        "train.py",
        *args_for(small_text),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=limit,
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]  # (after Lightning's lines of the run's start)
    assert line.startswith("error: a file reached the size limit: writing ") and " failed while training; " in line
    command = printed_after("Raise the file-size limit (ulimit -f), then start it again: ", line)
    assert command.startswith(f"python {ROOT / 'train.py'} ")  # no checkpoint was written: the run starts again
    assert not runs_under(tmp_path / "outputs")  # (and the folder of the run that had none is taken back)
    again = train_as_printed(command, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert result_json(only_run(tmp_path / "outputs"))["finished"]
