"""Where the benchmarks in bench/ find Tiny Shakespeare: where `python train.py` in the checkout finds it
(the token cache's copy, a local copy, a download), not at one fixed path beside the checkout."""

from __future__ import annotations

import os
import re
import signal
import subprocess

from tests.common import run_script, start_script, stop_at


def test_prepare_builds_its_corpus_from_the_copy_train_py_would_read(tmp_path):
    """A fresh clone has no ../shared/data; train.py reads the copy it downloaded into the token cache,
    and so must the benchmark (stopped by a Ctrl-C as its first preparation starts: the line that names
    its source is all this test needs)."""
    cached = tmp_path / "cache" / "sources" / "tinyshakespeare" / "input.txt"
    cached.parent.mkdir(parents=True)
    cached.write_text(
        "\n\n".join(f"SPEAKER{i % 7}:\nWhat light through yonder window {i} breaks?" for i in range(2000))
    )
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = stop_at(tmp_path / "hook", "bench.common:started", signal.SIGINT)
    env = {**env, "TINYGPT2_CACHE": str(tmp_path / "cache"), "TMPDIR": str(scratch)}
    env.pop("TINYSHAKESPEARE", None)
    proc = start_script(
        "bench/prepare.py", "--mb=1", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    out, err = proc.communicate(timeout=120)
    assert re.fullmatch(r"corpus: 1\.\d MB in \d+ files under \S+/corpus, from " + re.escape(str(cached)), out.strip())
    assert proc.returncode == 130, err
    assert err.strip() == "stopped by Ctrl-C"
    assert list(scratch.iterdir()) == []


def test_a_tinyshakespeare_that_names_no_file_is_said_in_one_line(tmp_path):
    env = {**os.environ, "TINYSHAKESPEARE": str(tmp_path / "missing.txt")}
    proc = run_script("bench/prepare.py", "--mb=1", env=env, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: Tiny Shakespeare not found at {tmp_path / 'missing.txt'}; set TINYSHAKESPEARE=/path/to/input.txt"
    )
