"""Defects found in the shell and the data readers that are mended now, each tried as a user meets it:
resume=auto of a run whose warmup was shortened, a full disk before the first checkpoint, a run whose every
checkpoint is refused as unsafe, a Hugging Face folder whose tokenizer.json links to another model's, a
normalizer that rewrites only the later part of a text, and a download that fails or is slow."""

from __future__ import annotations

import http.server
import json
import shlex
import shutil
import threading
import time

import pytest
import torch
from tokenizers import normalizers

import export
import generate
from checkpoint import CheckpointError, load_checkpoint
from data.tokenizer import train_bpe
from tests.common import TINY_OVERRIDES, data_config, inject_faults, only_run, refused, train_here

CUT = [*TINY_OVERRIDES, "trainer.max_steps=10", "checkpoint.every_n_steps=5", "optim.warmup_steps=100"]


def test_resume_auto_finds_a_run_whose_warmup_was_shortened_to_fit(tmp_path, monkeypatch, small_text):
    """trainer.max_steps=10 is below optim.warmup_steps=100: the run warms up over 1 step, and saves that. The
    same command with resume=auto must find it, not start from scratch as a run of other settings."""
    args = (*CUT, f"data.path={small_text}", f"runs_root={tmp_path / 'runs'}")
    inject_faults(monkeypatch, "sigterm:7")
    stopped = train_here(*args)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert "warming up over 1 instead" in stopped.stdout
    monkeypatch.delenv("TINYGPT2_FAILPOINT")
    run = only_run(tmp_path / "runs")

    again = train_here(*args, "resume=auto")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "no unfinished run" not in again.stdout + again.stderr
    assert only_run(tmp_path / "runs") == run  # continued in its folder, not started anew
    assert "Restoring states from the checkpoint" not in again.stdout or "step-000007.ckpt" in again.stdout
    assert (run / "checkpoints" / "step-000010.ckpt").is_file()
    assert json.loads((run / "result.json").read_text())["finished"]


def test_a_full_disk_before_the_first_checkpoint_takes_the_folder_back_and_its_command_starts_again(
    tmp_path, monkeypatch, small_text
):
    """The restart command printed keeps the user's hydra.run.dir, and works: nothing is left to refuse it."""
    folder = tmp_path / "my runs" / "first"
    args = (*CUT, f"data.path={small_text}", f"hydra.run.dir={folder}")
    inject_faults(monkeypatch, "enospc:3")
    failed = train_here(*args)
    assert failed.returncode == 1
    line = failed.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the disk is full: writing ") and "the run has no checkpoint yet" in line, line
    assert not folder.exists() and not folder.parent.exists()  # both made by the run, both taken back
    words = shlex.split(line[line.index("python ") :])
    assert f"hydra.run.dir='{folder}'" in words  # (quoted for Hydra: the path holds a space)
    monkeypatch.delenv("TINYGPT2_FAILPOINT")

    again = train_here(*words[2:])  # the command as printed: python .../train.py ARGS
    assert again.returncode == 0, again.stderr[-2000:]
    assert (folder / "checkpoints" / "last.ckpt").is_file()


class CodeInPickle:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_run_whose_every_checkpoint_is_unsafe_is_refused_for_that_not_passed_over(tmp_path, small_text):
    run_args = (*TINY_OVERRIDES, f"data.path={small_text}", f"runs_root={tmp_path / 'runs'}")
    assert train_here(*run_args).returncode == 0
    run = only_run(tmp_path / "runs")
    marker = tmp_path / "payload_ran"
    files = [path for path in run.glob("checkpoints/*.ckpt") if not path.is_symlink()]
    states = [torch.load(path, weights_only=True) for path in files]  # (last.ckpt may share a file)
    for path, state in zip(files, states, strict=True):
        path.unlink()
        torch.save({**state, "extra": CodeInPickle(marker)}, path)

    ran = train_here(f"resume={run}", "trainer.max_steps=8")
    assert ran.returncode == 1
    lines = [line for line in (ran.stdout + ran.stderr).splitlines() if line.strip()]
    assert not [line for line in lines if "passed over" in line or "cut short" in line], lines
    assert "refused to load" in ran.stderr.strip().splitlines()[-1]
    assert not marker.exists()


@pytest.fixture
def exported(tiny_run, tmp_path):
    out = tmp_path / "model"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 0
    return out


def test_a_hugging_face_folder_whose_tokenizer_links_out_of_it_is_refused(exported, tmp_path, capsys):
    other = tmp_path / "elsewhere" / "tokenizer.json"
    other.parent.mkdir()
    train_bpe(["a quite different text, another model's tokenizer " * 50], 280).save(str(other))
    (exported / "tokenizer.json").unlink()
    (exported / "tokenizer.json").symlink_to(other)

    with pytest.raises(CheckpointError, match="outside .*; a model's files are read only from its own folder"):
        load_checkpoint(exported)
    assert generate.main(["--ckpt", str(exported), "--prompt", "ROMEO:"]) == 1
    assert "read only from its own folder" in capsys.readouterr().err
    assert export.main(["--ckpt", str(exported), "--out", str(tmp_path / "again")]) == 1
    assert not (tmp_path / "again").exists()
    assert "read only from its own folder" in refused(*TINY_OVERRIDES, f"init_from={exported}", cwd=tmp_path)


def test_a_normalizer_that_rewrites_only_the_later_part_of_the_text_is_refused(tmp_path, full_text):
    """The first 200,000 characters are lowercase already: only the rest shows the Lowercase normalizer."""
    text = full_text.read_text(encoding="utf-8")
    data = tmp_path / "play.txt"
    data.write_text(text[:200_000].lower() + text[200_000:300_000], encoding="utf-8")
    tokenizer = train_bpe([text[:300_000].lower()], 300)
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.save(str(tmp_path / "uncased.json"))

    line = refused(
        *(o for o in TINY_OVERRIDES if not o.startswith("tokenizer.")),
        f"data.path={data}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "tokenizer=pretrained",
        f"tokenizer.path={tmp_path / 'uncased.json'}",
        cwd=tmp_path,
    )
    assert line.startswith(f"tokenizer.path {tmp_path / 'uncased.json'}: its normalizer (Lowercase) rewrites the text")


class SlowText(http.server.BaseHTTPRequestHandler):
    """Tiny Shakespeare's stand-in, sent after a pause (a loaded machine, a slow link), or 404 at /missing."""

    body = b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 2000

    def do_GET(self):
        if self.path == "/missing":
            self.send_error(404)
            return
        time.sleep(3)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        for start in range(0, len(self.body), 4096):
            self.wfile.write(self.body[start : start + 4096])
            time.sleep(0.05)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowText)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_slow_download_is_waited_for_and_a_failed_one_says_why(tmp_path, server):
    from data.sources import OFFLINE_LABEL, shakespeare_source

    def source(url, cache):
        return shakespeare_source(data_config(tmp_path / cache, source="shakespeare", url=url))

    slow = source(f"{server}/input.txt", "a")
    assert not slow.fallback and slow.label != OFFLINE_LABEL
    cached = tmp_path / "a" / "sources" / "tinyshakespeare" / "input.txt"
    assert cached.read_bytes() == SlowText.body

    missing = source(f"{server}/missing", "b")
    assert missing.label == OFFLINE_LABEL
    assert missing.fallback == (
        f"Tiny Shakespeare is not available (no local copy, and the download from {server}/missing failed: Not Found)"
    )
    assert not (tmp_path / "b" / "sources").exists()


@pytest.mark.parametrize("name", ["metrics.csv", "tensorboard", "train.log"])
def test_a_resume_whose_run_files_were_replaced_is_refused_in_one_line(tmp_path, small_text, name):
    """A file of the run replaced by a folder (or a folder by a file) is named before the run changes."""
    assert train_here(*TINY_OVERRIDES, "logger=[csv,tensorboard]", f"data.path={small_text}").returncode == 0
    run = only_run(tmp_path / "outputs")
    target = run / name
    if target.is_dir():
        shutil.rmtree(target)
        target.write_text("not a folder\n")
    else:
        target.unlink()
        target.mkdir()
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    kind = "file" if name == "tensorboard" else "folder"
    assert refused(f"resume={run}", "trainer.max_steps=8") == (
        f"cannot continue {run}: {target} is a {kind}, where the run keeps its own {name}; restore it, or move it "
        "aside, then run this again"
    )
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
