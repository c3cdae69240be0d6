"""The benchmark scripts in bench/ as a user runs them: what they refuse, and how they end when stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
import torch

from tests.common import (
    TINY_OVERRIDES,
    one_error_line,
    run_script,
    script_environment,
    start_script,
    stop_at,
    train_here,
    validations,
)


def plays(path, speeches: int = 2000):
    """A text shaped like Tiny Shakespeare (speeches of named speakers, blank lines between), ~100 KB."""
    path.write_text(
        "\n\n".join(f"SPEAKER{i % 7}:\nWhat light through yonder window {i} breaks?" for i in range(speeches))
    )
    return path


def test_a_benchmark_stopped_by_ctrl_c_says_so_in_one_line_and_removes_its_temporary_folder(tmp_path):
    # the Ctrl-C lands as the first preparation has just been started (bench.common.started gives its
    # handlers back), whatever the machine's speed: the benchmark passes it on to the preparation's own
    # process group and waits for it, then removes its folder
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**stop_at(tmp_path / "hook", "bench.common:restore", signal.SIGINT), "TMPDIR": str(scratch)}
    proc = start_script(
        "bench/prepare.py",
        "--mb=1",
        f"--shakespeare={plays(tmp_path / 'plays.txt')}",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    corpus = re.search(r"under (\S+)/corpus", proc.stdout.readline()).group(1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "stopped by Ctrl-C"
    assert "Traceback" not in err
    assert not os.path.exists(corpus)
    assert list(scratch.iterdir()) == []


@pytest.mark.slow
def test_bench_train_stopped_in_the_training_loop_ends_in_one_line(tmp_path):
    """The training loop takes Ctrl-C as a stop of the run (a checkpoint, then its end), which the
    benchmark must not time as a finished run: it divided by the steps it had not measured."""
    env = {**script_environment(None, "sigint:3"), "TINYSHAKESPEARE": str(plays(tmp_path / "plays.txt"))}
    proc = run_script("bench/train.py", "--quick", "--shapes", "nanogpt-cpu", "--steps", "40", env=env)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "stopped by Ctrl-C"
    assert "Traceback" not in proc.stderr
    assert "nanogpt-cpu" not in proc.stdout  # no row of figures


@pytest.mark.slow
def test_quality_refuses_a_run_that_a_signal_stopped_before_its_end(tmp_path):
    """A signal sent to train.py alone stops it early, with its checkpoint, and exit status 130: it has no
    final validation."""
    tiny = "model.n_layer=1 model.n_head=2 model.n_embd=32 tokenizer.vocab_size=300"
    env = script_environment(None, "sigint:2")
    proc = run_script("bench/quality.py", "--budget=75s", "--text=pydoc", "--seconds=20", "--runs", tiny, env=env)
    assert proc.returncode == 1, proc.stderr
    assert (
        proc.stderr.strip()
        == f"error: train.py {tiny} was stopped before its end (a signal sent to it); it has no figures"
    )


@pytest.mark.slow
def test_bench_train_without_tiny_shakespeare_says_so_in_one_line(tmp_path):
    env = {**script_environment(None, None), "TINYSHAKESPEARE": str(tmp_path / "missing.txt")}
    proc = run_script("bench/train.py", "--quick", env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: Tiny Shakespeare not found at {tmp_path / 'missing.txt'}; set TINYSHAKESPEARE=/path/to/input.txt"
    )


@pytest.mark.parametrize(
    "script, args, said",
    [
        ("bench/train.py", ["--repeats", "0"], "error: --repeats must be at least 1, got 0"),
        ("bench/quality.py", ["--repeats", "0"], "error: --seconds and --repeats must be at least 1, got 75 and 0"),
        ("bench/prepare.py", ["--mb", "0"], "error: --mb must be at least 1, got 0"),
        ("bench/precision.py", ["--steps", "0"], "precision.py: error: argument --steps: must be 1 or more, got 0"),
        (
            "bench/precision.py",
            ["--widths", "100"],
            "precision.py: error: argument --widths: must be a multiple of 32 (heads of 32), got 100",
        ),
    ],
)
def test_a_benchmark_refuses_a_bad_count_in_one_line(script, args, said):
    proc = run_script(script, *args)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == said
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_prepare_ends_on_the_preparations_own_line_when_the_disk_fills_part_way(tmp_path):
    """The disk filling during the preparation (after the check of room up front) ended in a DataError
    traceback from the child process, then a second line from the benchmark."""
    text = plays(tmp_path.parent / f"{tmp_path.name}-plays.txt")  # outside TMPDIR, which must end empty
    env = {**script_environment(None, "cache_enospc:1"), "TMPDIR": str(tmp_path)}
    proc = run_script("bench/prepare.py", "--mb", "1", f"--shakespeare={text}", env=env, timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: the disk is full: writing the token cache at ")
    assert list(tmp_path.iterdir()) == []


def test_prepare_refuses_a_corpus_the_disk_has_no_room_for_before_writing_it(tmp_path):
    """--mb 100000 wrote editions until the disk was full, then ended in an OSError traceback. (The
    timeout stops a version that writes: the refusal comes in the time Python takes to start.)"""
    env = {**script_environment(None, None), "TMPDIR": str(tmp_path)}
    proc = run_script("bench/prepare.py", "--mb", str(10**12), env=env, timeout=60)
    assert proc.returncode == 1
    assert re.fullmatch(
        rf"error: --mb {10**12} needs about 3,000,000,000\.0 GB free in {re.escape(str(tmp_path))} \(the corpus and "
        r"its token ids, twice while they are joined\) and it has [\d,.]+ GB; use a smaller --mb, or set TMPDIR "
        r"to a folder on a disk with room",
        proc.stderr.strip(),
    )
    assert list(tmp_path.iterdir()) == []


def test_prepare_refuses_a_text_with_no_speeches_in_one_line(tmp_path):
    """An empty file (or one with no speeches) gave editions of nothing: empty files, written until
    stopped. (The timeout stops a version that loops.)"""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    env = {**script_environment(None, None), "TMPDIR": str(tmp_path)}
    proc = run_script("bench/prepare.py", "--mb=1", f"--shakespeare={empty}", env=env, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: --shakespeare {empty} holds no speeches in UTF-8 text (a speaker's name and a colon on a line, "
        "the speech below it, a blank line between); give Tiny Shakespeare's input.txt"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["empty.txt"]


@pytest.mark.slow
def test_precision_benchmark_prints_its_table():
    proc = run_script("bench/precision.py", "--shapes", "nano", "--steps", "2", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr
    header, columns, rule, row = proc.stdout.strip().splitlines()
    assert header.startswith(f"torch {torch.__version__}") and "AMX bf16: " in header
    assert columns == "| shape | fp32 | bf16 autocast | bf16 / fp32 | last-loss gap |"
    assert row.startswith("| nano: 4/6/192, context 32, batch 32 | ")


def test_precision_benchmark_measures_the_default_shape_at_the_widths_given():
    proc = run_script("bench/precision.py", "--widths", "32", "64", "--steps", "1", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.strip().splitlines()[3:]
    assert [row.split(" | ")[0] for row in rows] == [
        "| 32 wide: 4/1/32, context 32, batch 32",
        "| 64 wide: 4/2/64, context 32, batch 32",
    ]


@pytest.mark.slow
def test_context_use_scores_the_newest_run_as_its_validation_did_and_position_by_position(tmp_path):
    """`python bench/context_use.py` after `python train.py`, from the same folder: the run it reads is
    outputs/latest, its "all" row is the loss the run's validation logged for the checkpoint it reads
    (the best), and windows a whole context apart score every token as that validation did."""
    tiny = [a for a in TINY_OVERRIDES if a not in ("latest_link=null", "trainer.limit_val_batches=4")]
    trained = train_here(*tiny, f"data.path={plays(tmp_path / 'plays.txt')}")  # (in this process, as train.py runs)
    assert trained.returncode == 0, trained.stderr
    proc = run_script("bench/context_use.py")
    assert proc.returncode == 0, proc.stderr
    rows = dict(line.split(None, 1) for line in proc.stdout.splitlines()[2:-1])
    assert list(rows)[:5] == ["0", "1", "2", "3", "4-7"] and list(rows)[-2:] == ["16-31", "all"]
    best = min(float(loss) for loss in validations(tmp_path / "outputs" / "latest").values())
    assert float(rows["all"].split()[0]) == pytest.approx(best, rel=1e-5)
    strided = float(re.search(r"val loss (\S+),", proc.stdout.splitlines()[-1]).group(1))
    assert strided < float(rows["0"].split()[0])  # the first position, predicted from nothing, is the worst
    whole = run_script("bench/context_use.py", "--ckpt", "outputs/latest", "--stride", "32")
    assert float(re.search(r"val loss (\S+),", whole.stdout.splitlines()[-1]).group(1)) == pytest.approx(
        float(rows["all"].split()[0]), rel=1e-6
    )
    refused = run_script("bench/context_use.py", "--stride", "0")
    assert refused.returncode == 1
    assert refused.stderr.strip() == "error: --stride must be between 1 and the context, 32 tokens; got 0"
    missing = run_script("bench/context_use.py", "--ckpt", "nowhere")
    assert missing.returncode == 1
    assert one_error_line(missing.stderr).startswith("error: checkpoint nowhere does not exist")
    (tmp_path / "plays.txt").unlink()  # the run's text is gone: its tokens are not read unchecked
    gone = run_script("bench/context_use.py")
    assert gone.returncode == 1
    assert str(tmp_path / "plays.txt") in one_error_line(gone.stderr)


def test_context_use_refuses_a_hugging_face_folder_in_one_line(transformers_folder):
    proc = run_script("bench/context_use.py", "--ckpt", str(transformers_folder))
    assert proc.returncode == 1
    assert one_error_line(proc.stderr) == (
        f"error: {transformers_folder} carries no run settings: it names no validation split to score"
    )
