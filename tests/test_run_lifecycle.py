"""A run's life as a user lives it: started with overrides, stopped, continued with the command the
program printed, extended, swept, searched, requeued, and kept from a second process or a folder of
someone else's files. train.py runs in a subprocess from a fresh folder, as a shell would run it."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from shell.checks import SettingError
from shell.launch import Launch, check_command_line
from shell.run import train as train_run
from shell.run_folder import RunFolder, RunFolderError, claim_new_folder
from shell.settings import check_continuation, contradiction, edits_of_the_record
from shell.sweep import how_to_continue_sweep
from tests.common import (
    ROOT,
    TINY_OVERRIDES,
    assert_bit_equal,
    compose_config,
    one_error_line,
    run_printed,
    run_script,
    runs_under,
    sample_steps,
    snapshot,
    start_script,
    train_losses,
    validations,
)

pytestmark = pytest.mark.slow


# A run of a real (tiny) size: model, optimizer, length and logger all differ from the defaults.
STEPS = 12


def run_args(small_text: Path, *extra: str) -> list[str]:
    return [
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "optim.lr=2e-3",
        f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=4",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep=20",
        *extra,
    ]


SLURM = {  # a one-task SLURM job, for the requeue tests
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "tinygpt2",
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NODELIST": "localhost",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=600)
    return out or "", err or ""


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_text) -> Path:
    """The run, never interrupted."""
    cwd = tmp_path_factory.mktemp("reference")
    proc = run_script("train.py", *run_args(small_text), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = runs_under(cwd / "outputs")
    return run


def stopped_run(small_text: Path, cwd: Path, failpoint: str = "kill:7", *extra: str, root: Path | None = None) -> Path:
    """The run, killed part way (after step 7: its newest checkpoint is step 6), under root (default:
    outputs in cwd)."""
    root = root or cwd / "outputs"
    before = runs_under(root)
    proc = start_script("train.py", *run_args(small_text, *extra, f"runs_root={root}"), cwd=cwd, failpoint=failpoint)
    finish(proc)
    assert proc.returncode == -signal.SIGKILL
    (run,) = set(runs_under(root)) - set(before)
    return run


# ---- resume exactly as printed ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["-ROMEO:", 'it\'s "$HOME"!'])
def test_the_printed_sample_command_works_for_a_prompt_a_shell_or_argparse_would_misread(prompt, small_text, tmp_path):
    """The line train.py ends with samples from its first sample prompt: one that starts with - (an
    option to argparse) or holds quotes and $ (the shell's) is written so that pasting it gives
    generate.py that prompt."""
    proc = run_script("train.py", *run_args(small_text, f"samples.prompts=[{prompt!r}]"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [sample] = [
        line.split("sample from it: ", 1)[1]
        for line in (proc.stdout + proc.stderr).splitlines()
        if "sample from it: " in line
    ]
    sampled = run_printed(sample + " --max-new-tokens 4 --seed 1", tmp_path)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert sampled.stdout.startswith(prompt)


def test_the_printed_resume_command_continues_the_run_bit_for_bit(small_text, tmp_path):
    steps = 400  # long enough to be interrupted early on any machine
    args = run_args(
        small_text, f"trainer.max_steps={steps}", "trainer.val_check_interval=100", "checkpoint.every_n_steps=20"
    )
    reference = run_script("train.py", *args, "runs_root=reference", cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-2000:]

    proc = start_script("train.py", *args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not list(tmp_path.glob("outputs/*/*/checkpoints/step-000020.ckpt")) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130, err[-2000:]  # stopped, not finished
    (run,) = runs_under(tmp_path / "outputs")
    settings_before, tokenizer_before = (run / "config.yaml").read_bytes(), (run / "tokenizer.json").read_bytes()
    printed = [line.split("Continue with: ", 1)[1] for line in (out + err).splitlines() if "Continue with: " in line]
    # started from a folder of the user's (python /path/to/train.py), so the command names it by its path
    assert len(printed) == 1 and printed[0] == f"python {ROOT / 'train.py'} resume={run}"

    resumed = run_printed(printed[0], tmp_path)  # as printed, from the same folder, with nothing else given
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    [sample] = [
        line.split("sample from it: ", 1)[1]
        for line in (resumed.stdout + resumed.stderr).splitlines()
        if "sample from it: " in line
    ]
    assert sample.startswith(f"python {ROOT / 'generate.py'} --ckpt {run}")
    sampled = run_printed(sample + " --max-new-tokens 8", tmp_path)
    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr[-2000:]
    assert runs_under(tmp_path / "outputs") == [run]  # continued in place
    (done,) = runs_under(tmp_path / "reference")
    assert_bit_equal(run / "checkpoints" / "last.ckpt", done / "checkpoints" / "last.ckpt")
    assert train_losses(run) == train_losses(done)
    # no validation of its own at the stop: the history is the uninterrupted run's
    assert validations(run) == validations(done) and sample_steps(run) == sample_steps(done)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == steps
    result = json.loads((run / "result.json").read_text())
    assert (
        result["finished"] and result["config"]["optim"]["lr"] == 2e-3 and list(result["config"]["logger"]) == ["csv"]
    )
    assert not list(run.glob("wandb"))  # the run's own logger, not the default one
    assert (run / "config.yaml").read_bytes() == settings_before and (
        run / "tokenizer.json"
    ).read_bytes() == tokenizer_before


def test_a_contradicting_setting_beside_resume_is_refused(small_text, tmp_path):
    run = stopped_run(small_text, tmp_path)
    before = snapshot(run)
    proc = run_script("train.py", f"resume={run}", "model.n_layer=4", cwd=tmp_path)
    assert proc.returncode == 1
    assert one_error_line(proc.stderr) == (
        f"error: model.n_layer=4 contradicts the run being resumed ({run}), whose model.n_layer is 2; leave it out "
        "to continue the run as it was, or start a new run without resume= (README: Interrupted runs, and resuming)"
    )
    assert snapshot(run) == before  # not a byte changed, no .hydra/resume-* record

    contradicting = {
        "logger=wandb": "logger=wandb contradicts the run being resumed",
        "logger=[wandb,csv]": "logger=[wandb,csv] contradicts",
        "logger=none": f"logger=none contradicts the run being resumed ({run}), whose logger is csv;",
        "optim.lr=1e-2": "optim.lr=0.01 contradicts",
        "seed=7": "seed=7 contradicts",
        "model=nano": "model=nano (which sets model.n_embd=192) contradicts",  # the choice typed, and what it sets
        "optim=muon": "optim=muon (which sets optim.",
        "data=text": "data=text (which sets data.",  # not data.errors='strict', which the user never typed
        # a setting typed beside its group's choice is named itself, not blamed on the choice
        "data=pydoc data.batch_size=16": "data.batch_size=16 contradicts the run being resumed",
        "optim=adamw optim.lr=0.5": "optim.lr=0.5 contradicts the run being resumed",
        "experiment=shakespeare_char_cpu": "contradicts the run being resumed",
        "experiment=shakespeare_75s": "contradicts the run being resumed",  # even where it sets the defaults
        "tokenizer.vocab_size=400": "tokenizer.vocab_size=400 contradicts",
        "data=pydoc": f"data=pydoc (which sets data.batch_size=32) contradicts the run being resumed ({run}), whose "
        "data.batch_size is 8;",  # the choice's own batch, where the run was given 8
        "tokens_per_step=512": "tokens_per_step=512 contradicts",
        "trainer.max_steps=5": "the run is already at step 6, past trainer.max_steps=5; give a larger trainer.max_steps",
        # the limits a continued run is compared against, of another type: named, where they were a TypeError
        "trainer.max_steps=abc": "trainer.max_steps must be a whole number, got 'abc'",
        "trainer.max_steps=null": "trainer.max_steps must be a whole number, got null",
        "trainer.max_time=abc": "trainer.max_time must be dd:hh:mm:ss (e.g. 00:00:01:15 for 75 seconds), got 'abc'",
        "trainer.strategy=ddp trainer.devices=2 trainer.accelerator=cpu": "this run's global batch, tokens_per_step=256, "
        "cannot be shared by 2 devices: each takes data.batch_size x model.block_size = 8 x 32 = 256 tokens at least",
    }
    for overrides, message in contradicting.items():
        assert message in check_command_line([f"resume={run}", *overrides.split()]), overrides
    # of a run's list of loggers, one left out: refused too, not trained on without it
    listed = stopped_run(small_text, tmp_path, "kill:7", "logger=[tensorboard,csv]", root=tmp_path / "listed")
    assert check_command_line([f"resume={listed}", "logger=csv"]).startswith(
        f"logger=csv contradicts the run being resumed ({listed}), whose logger is [tensorboard,csv]"
    )
    # a setting of a tracker the run has, given alone: checked against the run's own list of trackers,
    # not the default one (which was refused as if logger=[wandb,csv] had been given)
    tracked = stopped_run(small_text, tmp_path, "kill:7", "logger=[wandb,tensorboard,csv]", root=tmp_path / "tracked")
    assert check_command_line([f"resume={tracked}", "logger.wandb.project=tinygpt2"]) is None
    # where wandb logs may change: the advice of a wandb that cannot reach its server, to log offline, is taken
    assert check_command_line([f"resume={tracked}", "logger.wandb.mode=offline"]) is None
    proc = run_script("train.py", f"resume={tracked}", "logger.wandb.project=other", cwd=tmp_path)
    assert one_error_line(proc.stderr).startswith(
        f"error: logger.wandb.project='other' contradicts the run being resumed ({tracked}), whose "
        "logger.wandb.project is 'tinygpt2'; leave it out"
    )
    # the same trackers, one of their settings changed: that setting is named, not the choice
    saved, requested = (
        {"logger": {"wandb": {"name": "orig"}, "csv": {}}},
        {"logger": {"csv": {}, "wandb": {"name": "b"}}},
    )
    assert contradiction("logger.wandb.name", "b", "orig", saved, requested, run).startswith(
        f"logger.wandb.name='b' contradicts the run being resumed ({run}), whose logger.wandb.name is 'orig';"
    )
    assert check_command_line([f"resume={run / 'checkpoints'}"]) is None  # the checkpoints folder names the run too
    assert "holds no run" in check_command_line([f"resume={tmp_path}"])
    assert check_command_line([f"resume={run / 'config.yaml'}"]) == (
        f"resume={run / 'config.yaml'} is a file of a run, not a checkpoint; give the run folder: resume={run}"
    )
    allowed = [
        ["trainer.max_steps=40", "checkpoint.keep=3", "checkpoint.every_n_steps=5", "samples.enabled=false"],
        [
            "trainer.devices=1",
            "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=true",
            "trainer.log_every_n_steps=5",
        ],
        run_args(small_text),
    ]  # every original setting repeated
    for overrides in allowed:
        assert check_command_line([f"resume={run}", *overrides]) is None, overrides
    assert snapshot(run) == before


def test_a_file_of_the_run_replaced_by_a_folder_or_back_is_named_before_anything_changes(small_text, tmp_path):
    """Each ended in a traceback once the run had been reopened (its result.json rewritten, a resume record
    added), or as it trained on."""
    run = stopped_run(small_text, tmp_path, "kill:7", "logger=[tensorboard,csv]")
    shutil.rmtree(run / "tensorboard")
    (run / "tensorboard").touch()
    before = snapshot(run)
    proc = run_script("train.py", f"resume={run}", cwd=tmp_path)
    assert proc.returncode == 1
    printed = f"python {ROOT / 'train.py'} resume={run}"
    assert one_error_line(proc.stderr) == (
        f"error: {run / 'tensorboard'} is a file, where the run keeps its tensorboard folder; move it out of the run "
        f"folder (the run makes a new one), then continue with: {printed}"
    )
    assert snapshot(run) == before
    for name in ("metrics.csv", "samples.md", "train.log", "checkpoints/best.ckpt"):
        replaced = run / name
        moved = replaced.rename(tmp_path / "aside")
        replaced.mkdir()
        said = check_command_line([f"resume={run}"])
        assert said.startswith(f"{replaced} is a folder, where the run keeps its {replaced.name} file;"), said
        replaced.rmdir()
        moved.rename(replaced)
    (run / "tensorboard").unlink()  # as the message says
    assert run_printed(printed, tmp_path).returncode == 0
    assert (run / "tensorboard").is_dir() and json.loads((run / "result.json").read_text())["finished"]


def test_a_resumed_run_may_run_longer_and_keeps_its_first_settings_file(small_text, tmp_path):
    run = stopped_run(small_text, tmp_path)
    settings = (run / "config.yaml").read_bytes()
    proc = run_script("train.py", f"resume={run}", "trainer.max_steps=16", "checkpoint.every_n_steps=4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 16 and last["tinygpt2"]["config"]["trainer"]["max_steps"] == 16
    assert (run / "config.yaml").read_bytes() == settings  # the settings it started with, never rewritten
    assert yaml.safe_load(settings)["trainer"]["max_steps"] == STEPS
    again = check_command_line([f"resume={run}"])  # its newest checkpoint knows it was extended
    assert (
        again
        == "the run is finished: it reached trainer.max_steps=16; give a larger trainer.max_steps to train it further"
    )


NOT_READ = "config.yaml is a record of how the run began and is not read on resume"


def warnings_in(proc: subprocess.CompletedProcess) -> list[str]:
    """The warning lines a run logged, without their time and logger."""
    return [line.split(" - ", 1)[-1] for line in (proc.stdout + proc.stderr).splitlines() if "[WARNING]" in line]


def test_a_hand_edited_config_yaml_is_named_on_resume_and_the_run_keeps_its_own_settings(small_text, tmp_path):
    run = stopped_run(small_text, tmp_path)  # newest checkpoint: step 6
    text = (run / "config.yaml").read_text()
    edited = text.replace("lr: 0.002", "lr: 0.001").replace(f"max_steps: {STEPS}", "max_steps: 14")
    assert edited.count("0.001") == text.count("0.001") + 1 and "max_steps: 14" in edited
    (run / "config.yaml").write_text(edited)
    proc = run_script("train.py", f"resume={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # trainer.max_steps may change on resume, and so is not named: an earlier resume may have changed it
    assert warnings_in(proc) == [
        f"{run / 'config.yaml'} differs from the run being resumed (optim.lr is 0.001 there and 0.002 in the run): "
        f"{NOT_READ}, and these settings cannot change on resume, so the run continues with its own; to train with "
        f"them, start a new run with them on the command line (init_from={run / 'checkpoints' / 'step-000006.ckpt'} "
        "starts it from this run's weights)"
    ]
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == STEPS and last["tinygpt2"]["config"]["optim"]["lr"] == 2e-3
    assert (run / "config.yaml").read_text() == edited  # still as the user left it


def test_resumes_that_change_settings_are_not_taken_for_edits_and_a_broken_config_yaml_stops_no_resume(
    small_text, tmp_path
):
    run = stopped_run(small_text, tmp_path)
    for steps in (14, 16):  # the second resume continues a checkpoint whose max_steps config.yaml does not hold
        proc = run_script("train.py", f"resume={run}", f"trainer.max_steps={steps}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not [line for line in warnings_in(proc) if "config.yaml" in line]
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text + "optim: [0.1\n")
    proc = run_script("train.py", f"resume={run}", "trainer.max_steps=18", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert warnings_in(proc) == [
        f"{run / 'config.yaml'} is not valid YAML (expected ',' or ']', but got '<stream end>' at line "
        f"{len(text.splitlines()) + 2}); {NOT_READ}: the run continues with its checkpoint's settings"
    ]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 18


def test_an_edit_of_config_yaml_is_told_from_what_a_resume_sets_itself(tmp_path):
    saved = {
        "model": {"n_layer": 2, "dropout": 0.0},
        "optim": {"lr": 0.002},
        "trainer": {"max_steps": 12, "accumulate_grad_batches": 1, "precision": "32-true"},
        "compile": False,
        "seed": 1337,
        "resume": None,
        "runs_root": "/runs",
    }
    bookkeeping = {"prepared_data": {"cache_key": "abc", "source": "text"}, "chosen_for_the_machine": ["compile"]}
    folder, checkpoint = RunFolder(tmp_path), tmp_path / "checkpoints" / "step-000006.ckpt"
    written = {**saved, **bookkeeping, "trainer": {**saved["trainer"], "max_steps": 20, "accumulate_grad_batches": 4}}
    written |= {"compile": True, "resume": str(checkpoint), "runs_root": "/elsewhere"}  # all set by a resume
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(written, sort_keys=False))
    assert edits_of_the_record(folder, saved, checkpoint) is None
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(written, sort_keys=False).replace("0.002", "2e-3"))
    assert edits_of_the_record(folder, saved, checkpoint) is None  # the same number
    written |= {"model": {"n_layer": 2, "extra": 3}, "optim": {"lr": 0.001}, "seed": 1}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(written, sort_keys=False))
    assert edits_of_the_record(folder, saved, checkpoint).startswith(
        f"{tmp_path / 'config.yaml'} differs from the run being resumed (model.extra is 3 there and not set in the "
        "run; model.dropout is not set there and 0.0 in the run; optim.lr is 0.001 there and 0.002 in the run; "
        f"and 1 more): {NOT_READ}, and these settings cannot change on resume"
    )
    (tmp_path / "config.yaml").write_text("- a list\n")
    assert edits_of_the_record(folder, saved, checkpoint) == (
        f"{tmp_path / 'config.yaml'} holds no settings (not a mapping of names to values); {NOT_READ}: the run "
        "continues with its checkpoint's settings"
    )
    (tmp_path / "config.yaml").unlink()
    assert edits_of_the_record(folder, saved, checkpoint) is None  # nothing to compare


def test_cfg_job_beside_resume_shows_the_settings_the_run_continues_with(small_text, tmp_path):
    run = stopped_run(small_text, tmp_path)
    before = snapshot(tmp_path)
    proc = run_script("train.py", "--cfg", "job", f"resume={run}", "trainer.max_steps=16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"# the settings {run} continues with, from step-000006.ckpt\n")
    shown = yaml.safe_load(proc.stdout)
    assert shown["model"]["n_embd"] == 32 and shown["optim"]["lr"] == 2e-3  # the run's, not configs/' defaults
    assert shown["data"]["path"] == str(small_text) and shown["trainer"]["max_steps"] == 16
    one = run_script("train.py", "--cfg", "job", f"resume={run}", "-p", "model.n_layer", cwd=tmp_path)
    assert one.stdout == "2\n", one.stderr[-2000:]
    refused = run_script("train.py", "--cfg", "job", f"resume={run}", "model.n_layer=3", cwd=tmp_path)
    assert refused.returncode != 0
    assert one_error_line(refused.stderr).startswith("error: model.n_layer=3 contradicts the run being resumed")
    assert snapshot(tmp_path) == before  # shown, nothing written: no lock, no record of a resume


def test_a_run_that_ended_at_its_time_limit_is_finished_until_given_a_longer_one(small_text, tmp_path):
    args = run_args(
        small_text, "trainer.max_steps=-1", "trainer.max_time=00:00:00:03", "trainer.val_check_interval=1000"
    )
    proc = run_script("train.py", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = runs_under(tmp_path / "outputs")[0]
    before = snapshot(run)
    again = run_script("train.py", f"resume={run}", cwd=tmp_path)  # as written, it would stop at once
    assert again.returncode != 0
    assert one_error_line(again.stderr) == (
        "error: the run is finished: it trained for its trainer.max_time=00:00:00:03; give a longer "
        "trainer.max_time to train it further"
    )
    assert snapshot(run) == before  # nothing written to the run
    assert check_command_line([f"resume={run}", "trainer.max_time=00:00:00:02"]) is not None  # shorter still
    assert check_command_line([f"resume={run}", "trainer.max_time=00:00:00:05"]) is None
    earlier = sorted((run / "checkpoints").glob("step-*.ckpt"))[0]  # back to an earlier step: time is left from there
    assert check_command_line([f"resume={earlier}"]) is None


def test_a_run_with_both_limits_is_finished_by_the_one_it_reached():
    was = {"max_steps": 16, "max_time": "00:00:01:00"}
    longer = {"trainer": {**was, "max_steps": 20}}
    check_continuation(longer, 16, True, was)  # ended at its last step: more steps train it further
    with pytest.raises(SettingError, match=r"trained for its trainer.max_time=00:00:01:00; give a longer"):
        check_continuation(longer, 10, True, was)  # ended by its time at step 10: more steps alone would stop at once
    check_continuation({"trainer": {**was, "max_time": {"minutes": 2}}}, 10, True, was)
    check_continuation(longer, 10, False, was)  # stopped before its end (Ctrl-C): continues as it is


def test_a_run_killed_after_best_ckpt_and_before_any_step_file_resumes_from_it(small_text, reference, tmp_path):
    args = run_args(small_text, "checkpoint.every_n_steps=1000")  # no step file before the end; best.ckpt at step 4
    proc = start_script("train.py", *args, cwd=tmp_path, failpoint="kill:6")
    finish(proc)
    (run,) = runs_under(tmp_path / "outputs")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.ckpt"]
    resumed = run_script("train.py", *args, "resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert runs_under(tmp_path / "outputs") == [run]
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert train_losses(run) == train_losses(reference)


def test_a_run_started_on_a_gpu_continues_on_a_cpu_with_the_cpus_choices(small_text, tmp_path):
    # the precision given on the command line, compile left to the machine
    run = stopped_run(small_text, tmp_path, "kill:7", "trainer.precision=bf16-mixed")  # newest checkpoint: step 6
    assert yaml.safe_load((run / "config.yaml").read_text())["chosen_for_the_machine"] == ["compile"]
    for checkpoint in (run / "checkpoints").glob("step-*.ckpt"):  # what the same command saves on a CUDA GPU
        state = torch.load(checkpoint, weights_only=True)
        state["tinygpt2"]["config"]["compile"] = True
        torch.save(state, checkpoint)
    proc = run_script("train.py", f"resume={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line.split(" - ", 1)[-1] for line in (proc.stdout + proc.stderr).splitlines() if "was chosen for" in line]
    assert said == [
        "compile=true was chosen for the machine this run started on; on this one it continues with compile=false "
        "(give compile=true to keep the other)"
    ]
    settings = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["tinygpt2"]["config"]
    assert settings["compile"] is False and settings["trainer"]["precision"] == "bf16-mixed"  # given: kept
    assert settings["chosen_for_the_machine"] == ["compile"]  # and chosen again on the next machine


def test_a_newest_checkpoint_cut_short_is_passed_over_with_a_warning(small_text, reference, tmp_path):
    run = stopped_run(small_text, tmp_path)  # step files 2, 4, 6 and best.ckpt (step 4)
    newest = run / "checkpoints" / "step-000006.ckpt"
    with open(newest, "r+b") as file:  # a copy that stopped part way
        file.truncate(newest.stat().st_size // 2)
    resumed = run_script("train.py", f"resume={run}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = resumed.stdout + resumed.stderr
    assert f"{newest} cannot be read (cut short or damaged); passed over" in said
    assert f"continuing from {run / 'checkpoints' / 'step-000004.ckpt'}, the newest checkpoint that can be read" in said
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert train_losses(run) == train_losses(reference)


def test_resume_auto_continues_the_run_with_these_settings_from_any_folder(small_text, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    slow = stopped_run(small_text, tmp_path, "kill:7", "optim.lr=1e-3", root=runs)
    fast = stopped_run(small_text, tmp_path, "kill:7", "optim.lr=3e-3", root=runs)
    (runs / "latest").symlink_to(slow)  # as an earlier command would have left it: a link, not a run of its own
    asked = [*run_args(small_text, "optim.lr=3e-3"), f"runs_root={runs}", f"latest_link={runs}/latest", "resume=auto"]
    monkeypatch.chdir(tmp_path)
    new = Launch([*asked, "optim.lr=5e-3"], claim_folders=False).hydra_args()
    assert not [a for a in new if a.startswith("resume=")]  # other settings: nothing to continue, a new run
    monkeypatch.undo()

    elsewhere = tmp_path / "elsewhere"  # relative defaults (data.local_copies) name other files here
    elsewhere.mkdir()
    proc = run_script("train.py", *asked, cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert runs_under(runs) == sorted([slow, fast])
    result = json.loads((fast / "result.json").read_text())
    assert result["finished"] and result["run_dir"] == str(fast) and not (slow / "result.json").exists()
    assert not (elsewhere / "outputs").exists()


def test_a_run_killed_before_its_first_checkpoint_names_the_command_that_starts_it_again(small_text, tmp_path):
    run = stopped_run(small_text, tmp_path, "kill:2", "samples.prompts=[ROMEO:,'a b']")  # a value the shell must quote
    proc = run_script("train.py", f"resume={run}", cwd=tmp_path)
    assert proc.returncode == 1
    line = one_error_line(proc.stderr)
    assert line.startswith(f"error: {run} has no checkpoint to resume from"), line
    again = run_printed(line.split("start it again as a new run: ", 1)[1], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    (new,) = set(runs_under(tmp_path / "outputs")) - {run}
    assert yaml.safe_load((new / "config.yaml").read_text())["samples"]["prompts"] == ["ROMEO:", "a b"]


@pytest.mark.parametrize("killed", ["at its first step", "while it prepared its data"])
def test_the_start_again_command_of_a_run_given_relative_paths_works_from_another_folder(killed, small_text, tmp_path):
    started = tmp_path / "my project"
    (started / "texts").mkdir(parents=True)
    shutil.copy(small_text, started / "texts" / "input.txt")
    args = [a for a in run_args(small_text) if not a.startswith("data.path=")]
    proc = start_script("train.py", *args, "data.path=texts/input.txt", cwd=started, failpoint="kill:1")
    finish(proc)
    assert proc.returncode == -signal.SIGKILL
    (run,) = runs_under(started / "outputs")
    if killed == "while it prepared its data":  # the folder as such a kill leaves it: Hydra's record and the log
        for entry in run.iterdir():
            if entry.name not in RunFolder.STARTING_FILES:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    line = one_error_line(run_script("train.py", f"resume={run}", cwd=elsewhere).stderr)
    again = run_printed(line.split("start it again as a new run: ", 1)[1], elsewhere)
    assert again.returncode == 0, again.stderr[-2000:]
    (new,) = runs_under(elsewhere / "outputs")
    assert yaml.safe_load((new / "config.yaml").read_text())["data"]["path"] == str(started / "texts" / "input.txt")


def test_a_fine_tune_resumes_after_the_checkpoint_it_started_from_is_gone(small_text, reference, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(reference, source)  # any run with a checkpoint to start from
    tuned = tmp_path / "tuned"
    args = [*(a for a in run_args(small_text) if not a.startswith(("model.", "tokenizer."))), f"init_from={source}"]
    finish(start_script("train.py", *args, f"hydra.run.dir={tuned}", cwd=tmp_path, failpoint="kill:7"))
    source.rename(tmp_path / "moved")
    proc = run_script("train.py", f"resume={tuned}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert torch.load(tuned / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == STEPS


# ---- sweeps and searches ------------------------------------------------------------------------------


def test_a_sweep_stopped_by_ctrl_c_and_its_job_continued_as_printed(small_text, tmp_path):
    args = ["-m", *run_args(small_text, "trainer.max_steps=400", "checkpoint.every_n_steps=20"), "optim.lr=1e-3,3e-3"]
    proc = start_script("train.py", *args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not list(tmp_path.glob("multirun/*/*/0/checkpoints/step-000020.ckpt")) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130, err[-2000:]  # a stopped sweep is not a finished one
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert not (sweep / "1").exists()  # the sweep stopped with the job under way
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["run"], r["optim.lr"], r["finished"], r["best"]) for r in rows] == [("0", "0.001", "false", "")]

    printed = [line.split("Continue with: ", 1)[1] for line in (out + err).splitlines() if "Continue with: " in line]
    assert printed == [f"python {ROOT / 'train.py'} resume={sweep / '0'}"]
    whole = [line.split("the rest, with: ", 1)[1] for line in (out + err).splitlines() if "the rest, with: " in line]
    assert whole == [f"python {ROOT / 'train.py'} -m resume={sweep}"]
    resumed = run_printed(printed[0] + " trainer.max_steps=60", tmp_path)  # continued with a shorter schedule
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))  # brought up to date by the continued job
    assert [(r["run"], r["optim.lr"], r["finished"], r["best"], r["resumed with"]) for r in rows] == [
        ("0", "0.001", "true", "*", "trainer.max_steps=60")
    ]
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert "optim.lr=0.001" in result["overrides"] and "trainer.max_steps=60" not in result["overrides"]
    assert any(o.startswith("resume=") for o in result["resumed_with"])

    job = snapshot(sweep / "0")
    rest = run_printed(whole[0], tmp_path)
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert "job 0 finished before" in rest.stdout + rest.stderr
    assert snapshot(sweep / "0") == job  # a finished job is kept as it is, its train.log too
    rows = list(csv.DictReader(open(sweep / "summary.csv")))  # the job that never ran has run
    assert [(r["run"], r["optim.lr"], r["trainer.max_steps"], r["finished"], r["resumed with"]) for r in rows] == [
        ("0", "0.001", "60", "true", "trainer.max_steps=60"),
        ("1", "0.003", "400", "true", ""),
    ]
    said = rest.stdout + rest.stderr
    assert (
        "  0  optim.lr=0.001 trainer.max_steps=60  val/bpc" in said
        and "best: 1 (optim.lr=0.003 trainer.max_steps=400)" in said
    ), said


def test_a_killed_sweep_continues_in_its_folder_each_job_from_where_it_stood(small_text, reference, tmp_path):
    """-m resume=SWEEP: a job that finished is kept, the killed one continues from its checkpoint (ending
    bit for bit as a run never stopped), the one that never ran runs; then the sweep is finished."""
    lengths = "trainer.max_steps=6,12,14"  # job 0 finishes before step 7, job 1 is killed after it, job 2 waits
    finish(start_script("train.py", "-m", *run_args(small_text), lengths, cwd=tmp_path, failpoint="kill:7"))
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    kept = snapshot(sweep / "0")

    elsewhere = tmp_path / "elsewhere"  # continued from another folder, it runs where it was started
    elsewhere.mkdir()
    proc = run_script("train.py", "-m", f"resume={sweep}", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert snapshot(sweep / "0") == kept
    assert_bit_equal(sweep / "1" / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert [p.name for p in (sweep / "1" / ".hydra").glob("resume-*")] and not list(
        (sweep / "2" / ".hydra").glob("resume-*")
    )
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["run"], r["trainer.max_steps"], r["finished"]) for r in rows] == [
        ("0", "6", "true"), ("1", "12", "true"), ("2", "14", "true"),
    ]  # fmt: skip
    assert not any(elsewhere.iterdir())

    assert check_command_line(["-m", f"resume={sweep}"]).startswith(f"every job of the sweep {sweep} finished")
    assert check_command_line(["-m", f"resume={sweep}", "optim.lr=1"]).startswith(
        f"-m resume={sweep} continues the sweep with its own command line; leave out optim.lr=1"
    )
    assert check_command_line(["-m", f"resume={sweep / '1'}"]).startswith(
        f"resume={sweep / '1'} is a run, not a sweep: continue it without -m"
    )
    record = (sweep / "multirun.yaml").read_text()
    (sweep / "multirun.yaml").write_text(record.replace(f"cwd: {tmp_path}\n", f"cwd: {tmp_path / 'gone'}\n"))
    assert check_command_line(["-m", f"resume={sweep}"]).startswith(
        f"the sweep {sweep} was started in {tmp_path / 'gone'}, which is gone"
    )
    (sweep / "multirun.yaml").write_text("hydra:\n  overrides: [")  # a record cut short
    assert check_command_line(["-m", f"resume={sweep}"]).startswith(
        f"resume={sweep}: {sweep / 'multirun.yaml'} cannot be read"
    )


@pytest.mark.slow
def test_a_requeued_slurm_sweep_continues_in_its_folder(small_text, reference, tmp_path):
    """A SLURM job running a sweep, killed and requeued, runs its command again: the sweep continues
    as -m resume=SWEEP would continue it, where a new launch of the same job id is refused."""
    args = ["-m", *run_args(small_text), "trainer.max_steps=6,12,14"]
    first = start_script("train.py", *args, cwd=tmp_path, failpoint="kill:7", env={**os.environ, **SLURM})
    finish(first)
    sweep = tmp_path / "multirun" / "slurm-4242"
    assert first.returncode == -signal.SIGKILL
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    kept = snapshot(sweep / "0")

    again = run_script("train.py", *args, cwd=tmp_path, env={**os.environ, **SLURM})  # not a requeue
    assert again.returncode == 1 and "already holds a sweep" in one_error_line(again.stderr)

    requeue = {**os.environ, **SLURM, "SLURM_RESTART_COUNT": "1"}
    requeued = run_script("train.py", *args, cwd=tmp_path, env=requeue)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"this job was restarted by its scheduler: continuing the sweep {sweep}" in requeued.stderr
    assert snapshot(sweep / "0") == kept
    assert_bit_equal(sweep / "1" / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["run"], r["finished"]) for r in rows] == [("0", "true"), ("1", "true"), ("2", "true")]
    assert "resumed with" not in rows[0]  # continued with the sweep's own settings, none changed

    ended = snapshot(sweep, itself=False)
    again = run_script("train.py", *args, cwd=tmp_path, env={**requeue, "SLURM_RESTART_COUNT": "2"})
    assert again.returncode == 0, again.stderr[-2000:]  # requeued once more as it ended: nothing to do
    assert "every job of its sweep had finished" in again.stdout
    assert {k: v for k, v in snapshot(sweep, itself=False).items() if "summary" not in k} == {
        k: v for k, v in ended.items() if "summary" not in k
    }  # (the summary is written again)

    edited = run_script("train.py", *args[:-1], "trainer.max_steps=6,12", cwd=tmp_path, env=requeue)
    assert edited.returncode == 1
    assert one_error_line(edited.stderr) == (
        f"error: this job was restarted by its scheduler with another command line than its sweep, {sweep}, was "
        f"started with; continue that sweep as it was with python {ROOT / 'train.py'} -m resume={sweep}"
    )


def test_ctrl_c_as_the_next_job_of_a_sweep_starts_prints_how_to_continue_the_sweep(small_text, tmp_path):
    args = ["-m", *run_args(small_text, "checkpoint.every_n_steps=100"), "trainer.max_steps=6,400"]
    with open(tmp_path / "out.txt", "w") as out:
        proc = start_script("train.py", *args, cwd=tmp_path, stdout=out, stderr=subprocess.PIPE)
        try:
            deadline = time.time() + 300
            while "#1 : " not in (tmp_path / "out.txt").read_text() and time.time() < deadline:
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)  # job 0 finished, job 1 starting
            _, err = proc.communicate(timeout=300)
        finally:
            proc.kill()
    said = (tmp_path / "out.txt").read_text() + err
    assert "Traceback" not in said, said[-2000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    command = f"python {ROOT / 'train.py'} -m resume={sweep}"
    assert f"continue the sweep, this job and the rest, with: {command}" in said, said[-2000:]
    continued = run_printed(command, tmp_path)
    assert continued.returncode == 0, continued.stderr[-2000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["run"], r["finished"]) for r in rows] == [("0", "true"), ("1", "true")]


def test_ctrl_c_at_the_last_step_of_a_job_stops_the_sweep_after_that_job(small_text, tmp_path):
    """A Ctrl-C that the training loop takes at a job's last step ends that job as it would have ended
    anyway, and the sweep stops before its next job (it went on with every other job, and exited 0)."""
    args = ["-m", *TINY_OVERRIDES, f"data.path={small_text}", "trainer.max_steps=3", "optim.lr=1e-3,2e-3"]
    proc = run_script("train.py", *args, cwd=tmp_path, failpoint="sigint:3")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 130 and "Traceback" not in said, said[-2000:]
    assert "SIGINT came as the job ended; the sweep stops before its next job" in said, said[-2000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["run"], r["finished"]) for r in rows] == [("0", "true")]
    command = f"python {ROOT / 'train.py'} -m resume={sweep}"
    assert f"continue the sweep, this job and the rest, with: {command}" in said, said[-2000:]
    continued = run_printed(command, tmp_path)
    assert continued.returncode == 0, continued.stderr[-2000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["run"], r["finished"]) for r in rows] == [("0", "true"), ("1", "true")]


def test_a_job_stopped_before_its_first_checkpoint_holding_a_users_file_is_left_as_it_is(small_text, tmp_path):
    first = start_script(
        "train.py", *run_args(small_text), cwd=tmp_path, failpoint="kill:2", env={**os.environ, **SLURM}
    )
    finish(first)
    run = tmp_path / "outputs" / "slurm-4242"
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)
    requeued = run_script(
        "train.py", *run_args(small_text), cwd=tmp_path, env={**os.environ, **SLURM, "SLURM_RESTART_COUNT": "1"}
    )
    assert requeued.returncode == 1
    assert one_error_line(requeued.stderr) == (
        f"error: {run} stopped before its first checkpoint, and holds files that are not a run's (notes.txt); "
        "move them out of it, then run this again to start it there anew"
    )
    assert {k: v for k, v in snapshot(run).items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")
    }


def test_ctrl_c_before_a_sweep_job_has_a_checkpoint_takes_the_sweep_back(small_text, tmp_path):
    """Ctrl-C at moments from the imports to a job's first steps leaves no sweep folder (nor Hydra's job
    folder) without a run in it, so the same command runs again; a stop once training runs keeps the job."""
    args = [
        "-m",
        *run_args(small_text, "trainer.max_steps=100000", "checkpoint.every_n_steps=1000"),
        "optim.lr=1e-3,2e-3",
    ]
    for delay in (1.5, 3.0, 4.0, 5.0, 6.0, 8.0):
        sweep = tmp_path / f"sweep-{delay}"
        env = {**os.environ, "TINYGPT2_CACHE": str(tmp_path / f"cache-{delay}")}  # each start tokenizes anew
        proc = start_script(
            "train.py",
            *args,
            f"hydra.sweep.dir={sweep}",
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=300)
        finally:  # a sweep that missed its Ctrl-C would train on after the test failed
            proc.kill()
        assert "Traceback" not in err and proc.returncode in (0, 130, -signal.SIGINT), (delay, err[-2000:])
        if sweep.exists():  # stopped in training: the job is kept, with its checkpoint
            assert proc.returncode == 130 and any((sweep / "0" / "checkpoints").glob("*.ckpt")), (delay, err[-2000:])
        elif proc.returncode == 130:  # (-SIGINT: stopped during the imports, before anything was made)
            assert err.rstrip().splitlines()[-1].startswith("stopped before"), err[-500:]
    assert not (tmp_path / "multirun").exists()


# Imported first (sitecustomize) by a train.py under test: Ctrl-C as the checks of its command line
# import Lightning. A KeyboardInterrupt raised inside the import stands for one raised inside a C
# extension's initialisation, which turns it into an ImportError ("initialization failed").
CTRL_C_IN_AN_IMPORT = """
import os, signal, sys, time

class CtrlCAsLightningLoads:
    def find_spec(self, name, path=None, target=None):
        if name != "lightning":
            return None
        sys.meta_path.remove(self)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        except KeyboardInterrupt:
            raise ImportError("initialization failed") from None
        return None

sys.meta_path.insert(0, CtrlCAsLightningLoads())
"""


def test_ctrl_c_twice_while_the_checks_run_stops_at_once(small_text, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    twice = CTRL_C_IN_AN_IMPORT.replace(
        "os.kill(os.getpid(), signal.SIGINT)", "os.kill(os.getpid(), signal.SIGINT); " * 2
    )
    (hook / "sitecustomize.py").write_text(twice)
    result = run_script("train.py", *run_args(small_text), cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(hook)})
    assert result.returncode == -signal.SIGINT, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == "stopped at once (Ctrl-C twice)"
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_ctrl_c_while_the_checks_import_a_library_stops_cleanly(small_text, tmp_path, sweep):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CTRL_C_IN_AN_IMPORT)
    args = ["-m", *run_args(small_text), "optim.lr=1e-3,2e-3"] if sweep else run_args(small_text)
    result = run_script("train.py", *args, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(hook)})
    assert result.returncode == 130, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == "stopped before training began; nothing was written"
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


# Imported first (sitecustomize) by a train.py under test: Ctrl-C as the job's code has Hydra read its
# first config file, the moment a KeyboardInterrupt inside Hydra's reading turned into its own error.
CTRL_C_AS_A_JOB_READS_A_CONFIG = """
import os, pathlib, signal, sys

opened = pathlib.Path.open

def ctrl_c_once_in_a_job(self, *args, **kwargs):
    if self.suffix == ".yaml" and not os.environ.get("CTRL_C_SENT"):
        frame = sys._getframe(1)  # inside Hydra's main (train.py's main as Hydra runs it), composing a job
        while frame is not None and frame.f_code.co_name != "decorated_main":
            frame = frame.f_back
        if frame is not None:
            os.environ["CTRL_C_SENT"] = "1"
            os.kill(os.getpid(), signal.SIGINT)
    return opened(self, *args, **kwargs)

pathlib.Path.open = ctrl_c_once_in_a_job
"""


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_ctrl_c_as_hydra_reads_a_config_for_the_job_stops_cleanly(small_text, tmp_path, sweep):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CTRL_C_AS_A_JOB_READS_A_CONFIG)
    args = ["-m", *run_args(small_text), "optim.lr=1e-3,2e-3"] if sweep else run_args(small_text)
    result = run_script("train.py", *args, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(hook)})
    assert result.returncode == 130, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.rstrip().splitlines()[-1] == "stopped before training began; nothing was written"
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_a_second_sweep_into_the_folder_of_one_under_way_is_refused(small_text, tmp_path):
    sweep = tmp_path / "shared"
    args = ["-m", *run_args(small_text), f"hydra.sweep.dir={sweep}"]
    long = ["trainer.max_steps=100000", "checkpoint.every_n_steps=1000"]  # under way until stopped below
    first = start_script(
        "train.py", *args, *long, "optim.lr=1e-3,2e-3", cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.time() + 300
        while not (sweep / "0" / "metrics.csv").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)  # the first job trains
        second = run_script("train.py", *args, "optim.lr=5e-3,6e-3", cwd=tmp_path)
        continued = run_script("train.py", "-m", f"resume={sweep}", cwd=tmp_path)
        first.send_signal(signal.SIGINT)
        out, err = finish(first)
    finally:
        first.kill()
    assert second.returncode == 1
    assert one_error_line(second.stderr).startswith(
        f"error: hydra.sweep.dir={sweep} is the folder of a sweep under way"
    )
    assert continued.returncode == 1  # nor continued while it runs, whatever the command line
    assert one_error_line(continued.stderr).startswith(f"error: the sweep {sweep} is under way (process {first.pid} ")
    assert first.returncode == 130, err[-2000:]  # stopped with a checkpoint, as a sweep's Ctrl-C does
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [r["optim.lr"] for r in rows] == ["0.001"]  # the first sweep's own job, nothing of the second's


def test_an_optuna_search_records_every_trial_and_the_best(small_text, tmp_path):
    proc = run_script(
        "train.py",
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.storage=sqlite:///search.db",  # as configs/hparams_search/optuna.yaml offers
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "trainer.max_time=null",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import optuna  # the study is kept, to be continued by a later sweep

    (study,) = optuna.get_all_study_summaries(storage=f"sqlite:///{tmp_path / 'search.db'}")
    assert study.n_trials == 2
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    summary = json.loads((sweep / "summary.json").read_text())
    bpcs = [r["metrics"]["val/bpc"] for r in summary["runs"]]
    assert len(bpcs) == 2 and summary["best"]["val/bpc"] == min(bpcs)
    assert len(list(csv.DictReader(open(sweep / "summary.csv")))) == 2
    assert check_command_line(["-m", f"resume={sweep}"]).startswith(
        f"resume={sweep} is a search, which is not continued in its folder: run it again with the same"
    )
    assert how_to_continue_sweep(sweep).startswith("the search's trials so far are in")  # said at a stop
    optuna = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert optuna["best_value"] == pytest.approx(min(bpcs))  # what main() returned is what Optuna minimised
    trial_lrs = {r["config"]["optim"]["lr"] for r in summary["runs"]}
    assert len(trial_lrs) == 2  # the search varied the learning rate
    searched = yaml.safe_load((ROOT / "configs" / "hparams_search" / "optuna.yaml").read_text())
    searched = set(searched["hydra"]["sweeper"]["params"])
    fixed = {o.split("=")[0] for o in TINY_OVERRIDES}  # given on the command line, they leave the search
    columns = set(next(csv.reader(open(sweep / "summary.csv"))))
    assert searched - fixed <= columns and not (searched & fixed) & columns  # each searched setting, varied or not


def test_an_optuna_search_run_again_with_its_storage_tries_new_settings(small_text, tmp_path):
    """The second sweep adds trials to the stored study; its sampler, seeded as the first's, proposed
    the first sweep's settings again, trial for trial."""
    import optuna

    search = ["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.storage=sqlite:///search.db"]
    for _ in range(2):
        proc = run_script("train.py", *search, *TINY_OVERRIDES, f"data.path={small_text}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    study = optuna.load_study(study_name="tinygpt2", storage=f"sqlite:///{tmp_path / 'search.db'}")
    tried = [tuple(sorted(trial.params.items())) for trial in study.trials]
    assert len(tried) == 4 and len(set(tried)) == 4


@pytest.mark.slow
def test_a_search_stopped_by_ctrl_c_leaves_no_trial_running_in_its_stored_study(small_text, tmp_path):
    """The trial Ctrl-C stops is failed in the study, as Optuna's optimize() fails one; left running, it
    stayed so in every later search that continues the study."""
    import optuna

    search = ["-m", "hparams_search=optuna", "hydra.sweeper.storage=sqlite:///search.db", *TINY_OVERRIDES]
    search += [f"data.path={small_text}", "trainer.max_time=null", "optim.warmup_steps=0"]
    stopped = run_script("train.py", *search, "hydra.sweeper.n_trials=2", cwd=tmp_path, failpoint="sigint:3")
    assert stopped.returncode == 130 and "the sweep stops here" in stopped.stdout + stopped.stderr, stopped.stderr[
        -2000:
    ]
    later = run_script("train.py", *search, "hydra.sweeper.n_trials=1", cwd=tmp_path)
    assert later.returncode == 0, later.stderr[-2000:]
    study = optuna.load_study(study_name="tinygpt2", storage=f"sqlite:///{tmp_path / 'search.db'}")
    assert [trial.state.name for trial in study.trials] == ["FAIL", "COMPLETE"]


def test_a_trial_a_killed_search_left_running_is_failed_by_the_next_search_on_its_study(small_text, tmp_path):
    """A kill gives a search no chance to end its trial under way, which the stored study held as running
    for ever; the next search on the study marks it failed, and says so."""
    import optuna

    search = ["-m", "hparams_search=optuna", "hydra.sweeper.storage=sqlite:///search.db", *TINY_OVERRIDES]
    search += [f"data.path={small_text}", "trainer.max_time=null", "optim.warmup_steps=0"]
    finish(start_script("train.py", *search, "hydra.sweeper.n_trials=2", cwd=tmp_path, failpoint="kill:2"))
    (killed,) = (tmp_path / "multirun").glob("*/*")
    later = run_script("train.py", *search, "hydra.sweeper.n_trials=1", cwd=tmp_path)
    assert later.returncode == 0, later.stderr[-2000:]
    assert (
        f"trial 0 of the study tinygpt2 was left running by a search that was killed ({killed}); it is marked failed"
        in later.stderr
    ), later.stderr[-2000:]
    study = optuna.load_study(study_name="tinygpt2", storage=f"sqlite:///{tmp_path / 'search.db'}")
    assert [trial.state.name for trial in study.trials] == ["FAIL", "COMPLETE"]


# Imported first (sitecustomize) by each train.py of a test that starts two searches on one new storage:
# each waits (up to 5 s) for the other as Optuna begins to read the database's schema version, and again
# as it finds none and stamps one, so that both find it unstamped, as two searches started together can.
STORAGES_STAMPED_TOGETHER = """
import importlib.abc, importlib.util, os, sys, time
from pathlib import Path

def wait_for_the_other(where):
    arrived = Path(os.environ["ARRIVED"]) / where
    arrived.mkdir(exist_ok=True)
    (arrived / str(os.getpid())).touch()
    deadline = time.time() + 5
    while len(list(arrived.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.001)

def waiting(where, method):
    def waited(*args, **kwargs):
        wait_for_the_other(where)
        return method(*args, **kwargs)
    return waited

class StampedTogether(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "optuna.storages._rdb.storage":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            manager = module._VersionManager
            manager._init_alembic = waiting("read", manager._init_alembic)
            manager._set_alembic_revision = waiting("stamp", manager._set_alembic_revision)

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, StampedTogether())
"""


def test_two_searches_started_together_on_a_new_storage_both_run(small_text, tmp_path):
    """Each made the new database's tables as its sweeper opened it; the second failed with a traceback
    (UNIQUE constraint failed: alembic_version), leaving its sweep folder."""
    import optuna

    hook, arrived = tmp_path / "hook", tmp_path / "arrived"
    hook.mkdir()
    arrived.mkdir()
    (hook / "sitecustomize.py").write_text(STORAGES_STAMPED_TOGETHER)
    env = {**os.environ, "PYTHONPATH": str(hook), "ARRIVED": str(arrived)}
    search = ["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=1", "hydra.sweeper.storage=sqlite:///search.db"]
    search += [*TINY_OVERRIDES, f"data.path={small_text}", "trainer.max_time=null", "trainer.max_steps=2"]
    search += ["optim.warmup_steps=0"]
    started = [
        start_script("train.py", *search, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for proc in started:
        _, err = finish(proc)
        assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    sweeps = list(tmp_path.glob("multirun/*/*"))
    assert len(sweeps) == 2 and all((sweep / "summary.csv").is_file() for sweep in sweeps)
    study = optuna.load_study(study_name="tinygpt2", storage=f"sqlite:///{tmp_path / 'search.db'}")
    assert [trial.state.name for trial in study.trials] == ["COMPLETE", "COMPLETE"]


def test_a_search_with_its_study_in_memory_is_not_told_to_reuse_a_storage_it_has_not(small_text, tmp_path):
    """The default search keeps its study in memory: what it says at a stop (and to resume=) names the
    storage that keeps one, not "the same hydra.sweeper.storage", which was null."""
    search = ["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=1"]
    proc = run_script("train.py", *search, *TINY_OVERRIDES, f"data.path={small_text}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    refused = run_script("train.py", "-m", f"resume={sweep}", cwd=tmp_path)
    assert refused.returncode == 1
    assert one_error_line(refused.stderr).startswith(
        f"error: resume={sweep} is a search, which is not continued in its folder: its study was kept in memory "
        "(hydra.sweeper.storage=null) and ended with it; run it again with hydra.sweeper.storage=sqlite:///search.db"
    )
    assert "its study was kept in memory" in how_to_continue_sweep(sweep)  # said at a Ctrl-C


def test_a_requeued_slurm_search_ends_if_it_had_ended_and_is_refused_in_one_line_if_not(small_text, tmp_path):
    """A SLURM job running an Optuna search, requeued: the search is not continued in its folder
    (its storage continues it), so a search killed part way is refused in one line, and one that had
    ended when the job was requeued exits 0, as a finished sweep does."""
    args = ["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=1", *TINY_OVERRIDES, f"data.path={small_text}"]
    args += ["trainer.max_time=null", "optim.warmup_steps=0"]
    killed_job = {**os.environ, **SLURM, "SLURM_JOB_ID": "4343"}
    killed = run_script("train.py", *args, cwd=tmp_path, env=killed_job, failpoint="kill:3")
    assert killed.returncode == -signal.SIGKILL
    requeued = run_script("train.py", *args, cwd=tmp_path, env={**killed_job, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 1 and "Traceback" not in requeued.stderr
    sweep = tmp_path / "multirun" / "slurm-4343"
    assert one_error_line(requeued.stderr).startswith(
        f"error: this job was restarted by its scheduler, and its sweep cannot continue: the sweep folder {sweep} "
        "is a search, which is not continued in its folder"
    )

    ended_job = {**os.environ, **SLURM}
    ended = run_script("train.py", *args, cwd=tmp_path, env=ended_job)
    assert ended.returncode == 0, ended.stderr[-2000:]
    sweep = tmp_path / "multirun" / "slurm-4242"
    before = snapshot(sweep, itself=False)
    requeued = run_script("train.py", *args, cwd=tmp_path, env={**ended_job, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr[-2000:]
    assert requeued.stdout == (
        f"this job was restarted by its scheduler, and its search had ended: {sweep / 'optimization_results.yaml'}\n"
    )
    assert snapshot(sweep, itself=False) == before


# ---- any Lightning Trainer argument ------------------------------------------------------------------------


def test_trainer_takes_any_lightning_argument(small_text, tmp_path):
    proc = run_script(
        "train.py",
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "trainer.max_steps=3",
        "optim.warmup_steps=1",
        "trainer.deterministic=true",
        "trainer.profiler=simple",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = runs_under(tmp_path / "outputs")
    trainer = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["tinygpt2"]["config"]["trainer"]
    assert trainer["deterministic"] is True and trainer["profiler"] == "simple"
    assert "FIT Profiler Report" in proc.stdout + proc.stderr


# ---- one run, one folder, one process -----------------------------------------------------------------------


def test_two_runs_started_in_the_same_second_get_two_folders(monkeypatch, small_text, tmp_path):
    import shell.run_folder as run_folder

    class Frozen:
        @staticmethod
        def now():
            from datetime import datetime

            return datetime(2026, 11, 22, 9, 46, 2)

    monkeypatch.setattr(run_folder, "datetime", Frozen)
    first, second = claim_new_folder(tmp_path / "outputs"), claim_new_folder(tmp_path / "outputs")
    assert first.folder.path.name == "09-46-02" and second.folder.path.name == "09-46-02-2"
    monkeypatch.undo()

    both = [
        start_script("train.py", *run_args(small_text), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for proc in both:
        _, err = finish(proc)
        assert proc.returncode == 0, err[-2000:]
    runs = runs_under(tmp_path / "outputs")
    assert len(runs) == 2
    for run in runs:  # each holds one whole run: its own steps, logged once each
        assert sorted(train_losses(run)) == list(range(STEPS))


def test_a_second_process_on_a_running_run_is_refused(small_text, tmp_path):
    run = tmp_path / "run"
    args = run_args(
        small_text, "trainer.max_steps=1000000", "trainer.val_check_interval=1000000", "checkpoint.every_n_steps=50"
    )
    proc = start_script(
        "train.py", *args, f"hydra.run.dir={run}", cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 300
        while not (run / "checkpoints" / "step-000050.ckpt").exists() and time.time() < deadline:
            time.sleep(0.05)
        second = run_script("train.py", f"resume={run}", cwd=tmp_path)
        assert second.returncode == 1
        assert f"being trained by process {proc.pid} on " in one_error_line(second.stderr)
        assert f"being trained by process {proc.pid} on " in check_command_line([*args, f"hydra.run.dir={run}"])
    finally:
        proc.send_signal(signal.SIGINT)
        finish(proc)
    assert proc.returncode == 130
    RunFolder(run).lock()  # free again once the process has ended
    RunFolder(run).unlock()


def test_a_folder_of_the_users_own_files_is_refused_and_left_as_it_was(small_text, tmp_path):
    mine = tmp_path / "project"
    (mine / "src").mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "src" / "main.py").write_text("print('mine')")
    (mine / "config.yaml").write_text("mine: true\n")
    before = snapshot(mine, itself=False)  # the refusal takes the folder's lock and gives it back: its time changes
    proc = run_script("train.py", *run_args(small_text), f"hydra.run.dir={mine}", cwd=tmp_path)
    assert proc.returncode == 1
    assert "holds files that are not a run's (config.yaml, notes.txt, src)" in one_error_line(proc.stderr)
    with pytest.raises(RunFolderError, match="holds files that are not a run's"):  # the Python API too
        train_run(compose_config(*run_args(small_text)), mine)
    assert snapshot(mine, itself=False) == before and (mine / "config.yaml").read_text() == "mine: true\n"


def test_the_output_folder_of_another_hydra_program_is_refused_and_left_as_it_was(small_text, tmp_path):
    """A folder holding only Hydra's record and a log, as any Hydra program leaves them: not this run's."""
    theirs = tmp_path / "their_app"
    (theirs / ".hydra").mkdir(parents=True)
    (theirs / ".hydra" / "config.yaml").write_text("their: own\n")
    (theirs / "train.log").write_text("their log\n")
    before = snapshot(theirs, itself=False)
    proc = run_script("train.py", *run_args(small_text), f"hydra.run.dir={theirs}", cwd=tmp_path)
    assert proc.returncode == 1
    assert "holds files that are not a run's (.hydra, train.log)" in one_error_line(proc.stderr)
    assert snapshot(theirs, itself=False) == before


@pytest.mark.parametrize(
    "record",
    [
        "runs_root: outputs\ntokens_per_step: null\n",  # a start of this run killed before it saved anything
        "model:\n  n_layer: 2\n  n_head",  # being written by another process of the launch (torchrun)
        "",  # made, not yet written
        None,  # .hydra made, its files not yet
    ],
)
def test_hydra_record_of_this_project_in_a_new_run_folder_is_taken_as_its_own(record, tmp_path):
    """Before Hydra starts, a folder holding only Hydra's record and log is refused only where the record
    is another program's: torchrun's other ranks write theirs into the shared folder as the first checks."""
    folder = tmp_path / "run"
    (folder / ".hydra").mkdir(parents=True)
    if record is not None:
        (folder / ".hydra" / "config.yaml").write_text(record)
    (folder / "train.log").write_text("")
    RunFolder(folder).check_new("hydra.run.dir", in_hydra=False)
    (folder / ".hydra" / "config.yaml").write_text("db:\n  driver: mysql\n")  # another Hydra program's
    with pytest.raises(RunFolderError, match=r"holds files that are not a run's \(\.hydra, train\.log\)"):
        RunFolder(folder).check_new("hydra.run.dir", in_hydra=False)
    RunFolder(folder).check_new("run_dir")  # once Hydra has started this run, its record is the run's own


def test_a_slurm_job_requeued_before_its_first_checkpoint_starts_again(small_text, reference, tmp_path):
    first = start_script(
        "train.py", *run_args(small_text), cwd=tmp_path, failpoint="kill:2", env={**os.environ, **SLURM}
    )
    finish(first)
    run = tmp_path / "outputs" / "slurm-4242"
    assert (
        first.returncode == -signal.SIGKILL and (run / "config.yaml").is_file() and not (run / "checkpoints").exists()
    )
    requeued = run_script(
        "train.py", *run_args(small_text), cwd=tmp_path, env={**os.environ, **SLURM, "SLURM_RESTART_COUNT": "1"}
    )
    assert requeued.returncode == 0, requeued.stderr[-2000:]
    assert "stopped before its first checkpoint, so it starts again" in requeued.stderr
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert [int(r["step"]) for r in csv.DictReader(open(run / "metrics.csv")) if r.get("train/loss")] == sorted(
        {int(r["step"]) for r in csv.DictReader(open(run / "metrics.csv")) if r.get("train/loss")}
    )  # the first start's rows went with it: each step once


def test_a_requeued_slurm_job_continues_its_run(small_text, reference, tmp_path, monkeypatch):
    slurm = SLURM
    first = start_script(
        "train.py", *run_args(small_text), cwd=tmp_path, failpoint="kill:7", env={**os.environ, **slurm}
    )
    finish(first)
    run = tmp_path / "outputs" / "slurm-4242"
    assert first.returncode == -signal.SIGKILL and (run / "checkpoints" / "step-000006.ckpt").is_file()

    with monkeypatch.context() as patched:
        patched.chdir(tmp_path)
        for key, value in slurm.items():
            patched.setenv(key, value)
        assert "already holds a run" in check_command_line(run_args(small_text))  # not a requeue: refused
        patched.setenv("SLURM_PROCID", "1")  # a requeue: every task of the job decides alike, here the second
        patched.setenv("SLURM_RESTART_COUNT", "1")
        args = Launch(run_args(small_text), claim_folders=False).hydra_args()
    assert f"resume={run / 'checkpoints' / 'step-000006.ckpt'}" in args and f"hydra.run.dir={run}" in args

    requeued = run_script(
        "train.py", *run_args(small_text), cwd=tmp_path, env={**os.environ, **slurm, "SLURM_RESTART_COUNT": "1"}
    )
    assert requeued.returncode == 0, requeued.stderr[-2000:]
    assert "restarted by its scheduler: continuing" in requeued.stdout + requeued.stderr
    assert json.loads((run / "result.json").read_text())["finished"]
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert not list(run.rglob("hpc_ckpt*"))  # Lightning's own requeue is off


@pytest.mark.slow
def test_a_finished_sweep_with_named_job_folders_is_finished_too(small_text, tmp_path):
    """With hydra.sweep.subdir naming each job's folder, -m resume= of a sweep whose every job finished
    is refused as a numbered one is, rather than starting a sweep that trains nothing."""
    subdir = "hydra.sweep.subdir=lr${optim.lr}"
    proc = run_script("train.py", "-m", *run_args(small_text), "optim.lr=1e-3,2e-3", subdir, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "lr0.001",
        "lr0.002",
    ]
    assert check_command_line(["-m", f"resume={sweep}"]).startswith(f"every job of the sweep {sweep} finished")
