"""Progress where the output is not a terminal (nohup, a cluster's job log, CI): plain lines, at most one
every LINE_SECONDS while training, one after each validation and one at the last step, never a bar
redrawn with carriage returns; on a terminal, the bar as before (tests/test_progress_bar.py)."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import sys

from shell.progress import LINE_SECONDS, ProgressLines, StepsBar, duration, progress_callback
from tests.common import TINY_OVERRIDES, inject_faults, train_here

# "step 120/1814 | loss 2.410 | 11,200 tok/s | 2m31s left" and "step 500/1814 | val_loss 2.350 | val_bpc 3.390"
TRAINING_LINE = re.compile(r"^step (\d+)/(\d+) \| loss \d+\.\d{3} \| [\d,]+ tok/s \| (\S+ left|took \S+)$")
VALIDATION_LINE = re.compile(r"^step (\d+)/(\d+) \| val_loss \d+\.\d{3} \| val_bpc \d+\.\d{3}$")


class ToStandardOutput(logging.StreamHandler):
    """A handler that writes to sys.stdout as it is at each record: Lightning's own lines (its logger keeps a
    handler of its own, on the stdout it found when imported) in what train_here captures, in their order among
    the run's lines, as they are in a log file of `python train.py > log.txt 2>&1`."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def plain(line: str) -> str:
    """A progress line with its figures left out, to compare with the lines expected."""
    return re.sub(r"[\d,]+ tok/s", "N tok/s", re.sub(r"\d+\.\d{3}", "X", line))


def test_the_bar_goes_to_a_terminal_and_plain_lines_anywhere_else(tmp_path):
    main, child = pty.openpty()
    reading, writing = os.pipe()
    with os.fdopen(child, "w") as terminal, os.fdopen(writing, "w") as pipe, open(tmp_path / "log.txt", "w") as log:
        assert isinstance(progress_callback(1, terminal), StepsBar)
        assert isinstance(progress_callback(1, log), ProgressLines)
        assert isinstance(progress_callback(1, pipe), ProgressLines)
        assert isinstance(progress_callback(1, io.StringIO()), ProgressLines)
    os.close(main)
    os.close(reading)


def test_times_are_said_in_their_largest_units():
    assert [duration(s) for s in (0, 4.6, 59, 60, 151, 3599, 3600, 3720, 86400 + 61)] == [
        "0s", "5s", "59s", "1m00s", "2m31s", "59m59s", "1h00m", "1h02m", "24h01m",
    ]  # fmt: skip


def test_lines_come_at_most_every_interval_besides_each_validation_and_the_last_step(small_text, monkeypatch):
    # a real run, on a clock of its own where each step takes 4 s: a line every 8 steps, counted from
    # the last line written, which a validation's line is too
    assert LINE_SECONDS == 30
    out = io.StringIO()
    lines = ProgressLines(clock=lambda: lines.trainer.global_step * 4.0, out=out)
    monkeypatch.setattr("shell.run.progress_callback", lambda accumulation: lines)
    args = ["trainer.enable_progress_bar=true", "trainer.max_steps=30", "trainer.val_check_interval=10"]
    ran = train_here(*TINY_OVERRIDES, f"data.path={small_text}", *args)
    assert ran.returncode == 0, ran.stderr[-3000:]
    written = out.getvalue().splitlines()
    assert all(TRAINING_LINE.match(line) or VALIDATION_LINE.match(line) for line in written), written
    assert [plain(line) for line in written] == [
        "step 8/30 | loss X | N tok/s | 1m28s left",  # 32 s for 8 steps: 88 s for the 22 left
        "step 10/30 | val_loss X | val_bpc X",
        "step 18/30 | loss X | N tok/s | 48s left",
        "step 20/30 | val_loss X | val_bpc X",
        "step 28/30 | loss X | N tok/s | 8s left",
        "step 30/30 | loss X | N tok/s | took 2m00s",  # the last step, 8 s after the line before
        "step 30/30 | val_loss X | val_bpc X",
    ]


def test_a_run_writing_to_a_log_file_writes_plain_lines_and_no_bar(small_text, monkeypatch):
    """train.py's standard output not a terminal (train_here's is not): what a log file of the run holds."""
    lightning = logging.getLogger("lightning.pytorch")
    monkeypatch.setattr(lightning, "handlers", [*lightning.handlers, ToStandardOutput()])
    args = [*TINY_OVERRIDES, f"data.path={small_text}", "trainer.enable_progress_bar=true", "trainer.max_steps=80"]
    args += ["trainer.val_check_interval=20", "trainer.limit_val_batches=10", "trainer.log_every_n_steps=10"]
    ran = train_here(*args)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output[-3000:]
    assert "\r" not in output and "\x1b[" not in output, output[-3000:]  # no redraws, no cursor moves
    assert "training:" not in output and "Validation" not in output  # neither Lightning's bars nor ours
    assert "logging interval" not in output  # Lightning's advice to log more often, which the run does not need
    lines = output.splitlines()
    assert len(lines) < 40, output  # the run's own lines, a line every 30 s, one per validation
    progress = [line for line in lines if line.startswith("step ")]
    assert all(TRAINING_LINE.match(line) or VALIDATION_LINE.match(line) for line in progress), progress
    validated = [int(VALIDATION_LINE.match(line)[1]) for line in progress if VALIDATION_LINE.match(line)]
    assert validated == [20, 40, 60, 80]
    (last,) = [line for line in progress if TRAINING_LINE.match(line) and "step 80/80 " in line]
    assert " | took " in last
    assert lines.index(last) < lines.index("`Trainer.fit` stopped: `max_steps=80` reached.")


def test_a_run_stopped_early_ends_its_log_with_the_step_it_stopped_at(small_text, monkeypatch):
    inject_faults(monkeypatch, "sigint:5")  # Ctrl-C as step 5 begins, sent to this process
    args = [*TINY_OVERRIDES, f"data.path={small_text}", "trainer.enable_progress_bar=true", "trainer.max_steps=30"]
    ran = train_here(*args)
    assert ran.returncode == 130, ran.stderr[-3000:]  # stopped, with its checkpoint
    progress = [line for line in ran.stdout.splitlines() if line.startswith("step ")]
    assert VALIDATION_LINE.match(progress[0]) and progress[0].startswith("step 3/30 ")
    assert TRAINING_LINE.match(progress[-1]) and progress[-1].startswith("step 5/30 "), progress
    assert progress[-1].endswith(" left")  # 25 steps were left
