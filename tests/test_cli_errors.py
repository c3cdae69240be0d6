"""Bad input to generate.py and export.py: one `error:` line that says what to change, exit status 1,
no traceback, nothing generated, written or overwritten."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import export
import generate

from .common import damaged_copy, one_error_line, run_script
from .tiny import train_tiny_gpt, write_checkpoint


@pytest.fixture(scope="module")
def no_start_token_run(tmp_path_factory, tiny_text) -> Path:
    """A checkpoint whose tokenizer has no <|endoftext|>: an empty prompt has nothing to start from."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([tiny_text], trainer)
    gpt = train_tiny_gpt(tokenizer, tiny_text, steps=1)
    return write_checkpoint(tmp_path_factory.mktemp("no_eot") / "model.ckpt", gpt, tokenizer)


# ---- generate.py ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        (["--max-new-tokens", "-5"], "--max-new-tokens must be at least 1"),
        (["--temperature", "-0.5"], "--temperature must be 0 (greedy) or more, got -0.5"),
        (["--temperature", "nan"], "--temperature must be 0 (greedy) or more"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--top-k", "0"], "--top-k must be at least 1"),
        (["--num-samples", "0"], "--num-samples must be at least 1"),
        (["--stop", ""], "--stop needs a non-empty string"),
        (["--device", "nonsense"], "--device nonsense is not a device"),
        (["--attention-png", "picture.jpg"], "the picture is a PNG"),
    ],
)
def test_generate_py_refuses_bad_settings(args, message, tiny_run, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = generate.main(["--ckpt", str(tiny_run), "--prompt", "ROMEO:", *args])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert message in one_error_line(err)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_generate_py_device_cuda_without_a_gpu(tiny_run, capsys):
    code = generate.main(["--ckpt", str(tiny_run), "--device", "cuda"])
    _, err = capsys.readouterr()
    assert code == 1 and "--device cuda: this machine has no CUDA GPU; use --device cpu" in one_error_line(err)


def test_generate_py_empty_prompt_without_a_start_token(no_start_token_run, capsys):
    code = generate.main(["--ckpt", str(no_start_token_run), "--prompt", "", "--max-new-tokens", "5"])
    out, err = capsys.readouterr()
    assert code == 1 and "prompt is empty" in one_error_line(err) and "give a non-empty prompt" in err
    assert generate.main(["--ckpt", str(no_start_token_run), "--prompt", "ROMEO:", "--max-new-tokens", "5"]) == 0


def test_generate_py_attention_png_in_a_folder_that_cannot_be_written(tiny_run, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    for target in (blocker / "attention.png", tmp_path):
        code = generate.main(["--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--attention-png", str(target)])
        out, err = capsys.readouterr()
        assert code == 1 and out == "" and "--attention-png" in one_error_line(err)
    assert blocker.read_text() == "keep me"


@pytest.mark.parametrize("how", ["truncated", "corrupted", "empty", "text"])
def test_generate_py_damaged_checkpoint(how, tiny_run, tmp_path, capsys):
    damaged = damaged_copy(tiny_run / "checkpoints" / "last.ckpt", tmp_path, how)
    code = generate.main(["--ckpt", str(damaged), "--prompt", "ROMEO:"])
    out, err = capsys.readouterr()
    line = one_error_line(err)
    assert code == 1 and out == "" and str(damaged) in line
    assert "truncated or corrupted" in line


def test_generate_py_missing_checkpoint(tmp_path, capsys, monkeypatch):
    code = generate.main(["--ckpt", str(tmp_path / "nowhere"), "--prompt", "ROMEO:"])
    _, err = capsys.readouterr()
    assert code == 1 and "does not exist" in one_error_line(err)
    monkeypatch.chdir(tmp_path)  # no outputs/latest here
    code = generate.main(["--prompt", "ROMEO:"])
    _, err = capsys.readouterr()
    assert code == 1 and "python train.py" in one_error_line(err)
    (tmp_path / "empty_run").mkdir()
    code = generate.main(["--ckpt", str(tmp_path / "empty_run")])
    _, err = capsys.readouterr()
    assert code == 1 and "no checkpoint in" in one_error_line(err)


def test_generate_py_as_a_program_prints_no_traceback(tiny_run, tmp_path):
    damaged = damaged_copy(tiny_run / "checkpoints" / "last.ckpt", tmp_path, "truncated")
    for args in (["--ckpt", str(damaged)], ["--ckpt", str(tiny_run), "--top-p", "2"]):
        proc = run_script("generate.py", *args, timeout=300)
        assert proc.returncode == 1 and proc.stdout == ""
        one_error_line(proc.stderr)


# ---- export.py -----------------------------------------------------------------------------------------


def test_export_py_damaged_or_missing_checkpoint(tiny_run, tmp_path, capsys):
    for ckpt in (damaged_copy(tiny_run / "checkpoints" / "last.ckpt", tmp_path, "truncated"), tmp_path / "nowhere"):
        code = export.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "out")])
        _, err = capsys.readouterr()
        assert code == 1 and str(ckpt) in one_error_line(err)
        assert not (tmp_path / "out").exists()


def test_export_py_output_folder_that_cannot_be_written(tiny_run, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    code = export.main(["--ckpt", str(tiny_run), "--out", str(blocker / "hf")])
    _, err = capsys.readouterr()
    assert code == 1 and "is a file, not a folder" in one_error_line(err)
    code = export.main(["--ckpt", str(tiny_run), "--out", str(blocker)])
    _, err = capsys.readouterr()
    assert code == 1 and "is a file" in one_error_line(err)
    assert blocker.read_text() == "keep me"


def test_export_py_never_replaces_what_it_should_not(tiny_run, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    for extra in ([], ["--force"]):  # not empty; and --force only replaces model folders
        code = export.main(["--ckpt", str(tiny_run), "--out", str(notes), *extra])
        _, err = capsys.readouterr()
        assert code == 1 and str(notes) in one_error_line(err)
    assert [p.name for p in notes.iterdir()] == ["todo.txt"] and (notes / "todo.txt").read_text() == "mine"

    run_copy = tmp_path / "run"
    shutil.copytree(tiny_run, run_copy)
    code = export.main(["--ckpt", str(run_copy), "--out", str(run_copy), "--force"])
    _, err = capsys.readouterr()
    assert code == 1 and "holds the checkpoint being exported" in one_error_line(err)
    assert (run_copy / "checkpoints" / "last.ckpt").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "run"]  # no half-written folder anywhere
