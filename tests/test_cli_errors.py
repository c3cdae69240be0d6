"""Bad input to generate.py and export.py: one `error:` line that says what to change, exit status 1,
no traceback, nothing generated, written or overwritten."""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import explain
import export
import generate
from checkpoint import DamagedCheckpoint, read_header, read_weights
from shell.programs import STOPS, Terminated, stops_raised
from tests.common import ROOT, damaged_copy, flipped_copy, one_error_line, run_script, snapshot, start_script, stop_at
from tests.tiny import train_tiny_gpt, write_checkpoint


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
        (["--max-new-tokens", "0"], "--max-new-tokens must be from 1 to 1,000,000, got 0"),
        (["--max-new-tokens", "-5"], "--max-new-tokens must be from 1"),
        (["--max-new-tokens", "1000000000000"], "--max-new-tokens must be from 1 to 1,000,000"),
        (["--max-new-tokens", "1e100"], "--max-new-tokens must be from 1 to 1,000,000, got 1e+100"),
        (["--temperature", "-0.5"], "--temperature must be 0 (greedy) or a positive number, got -0.5"),
        (["--temperature", "nan"], "--temperature must be 0 (greedy) or a positive number"),
        (["--temperature", "inf"], "--temperature must be 0 (greedy) or a positive number, got inf"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--top-k", "0"], "--top-k must be at least 1"),
        (["--num-samples", "0"], "--num-samples must be from 1 to 1024"),
        (["--num-samples", "100000000000"], "--num-samples must be from 1 to 1024"),
        (["--seed", "-1"], "--seed must be from 0 to"),
        (["--seed", str(2**64)], "--seed must be from 0 to"),
        (["--stop", ""], "--stop needs a non-empty string"),
        (
            ["--stop", "END\udcff"],
            "a --stop string is not valid UTF-8: byte(s) 0xff at character 4; give it as UTF-8 text",
        ),
        (["--device", "nonsense"], "--device nonsense is not a device"),
        (["--device", "meta"], "--device meta is not a device generate.py runs on"),
        (["--device", "xpu"], "--device xpu is not a device generate.py runs on"),
        (["--attention-png", "picture.jpg"], "the picture is a PNG"),
        (["--attention-png", "new/folders/a.png", "--top-p", "2"], "--top-p must be in (0, 1]"),  # no folder made
    ],
)
def test_generate_py_refuses_bad_settings(args, message, tiny_run, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = generate.main(["--ckpt", str(tiny_run), "--prompt", "ROMEO:", *args])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert message in one_error_line(err)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    "program, args, message",
    [
        ("generate.py", ["--max_new_tokens", "3"], "error: unrecognized arguments: --max_new_tokens 3 (python "),
        ("generate.py", ["--stop", "-x"], "one that starts with - is written with =, e.g. --stop=-x"),
        ("explain.py", ["--layer", "1.5"], "error: argument --layer: must be a whole number, got '1.5'"),
        ("export.py", ["--out"], "error: argument --out: expected one argument"),
        # a value of the wrong kind, in the same words whatever the option's kind
        (
            "generate.py",
            ["--max-new-tokens", "abc"],
            "error: argument --max-new-tokens: must be a whole number, got 'abc'",
        ),
        ("generate.py", ["--temperature", "abc"], "error: argument --temperature: must be a number, got 'abc'"),
        ("generate.py", ["--top-p", "most"], "error: argument --top-p: must be a number, got 'most'"),
        ("explain.py", ["--layer", "abc"], "error: argument --layer: must be a whole number, got 'abc'"),
        ("explain.py", ["--head", "first"], "error: argument --head: must be a whole number, got 'first'"),
        # an empty path (an unset variable) is not the current folder
        ("generate.py", ["--attention-png", ""], "error: argument --attention-png: needs a path, got ''"),
        ("explain.py", ["--ckpt", ""], "error: argument --ckpt: needs a path, got ''"),
        ("export.py", ["--out", ""], "error: argument --out: needs a path, got ''"),
    ],
)
def test_an_option_that_cannot_be_read_is_refused_in_one_line(program, args, message, tiny_run, tmp_path):
    proc = run_script(program, "--ckpt", str(tiny_run), *args, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in one_error_line(proc.stderr) and "--help lists the options" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_weights_that_are_not_finite_are_refused_in_one_line(tiny_run, tmp_path, capsys):
    saved = torch.load(tiny_run / "checkpoints" / "last.ckpt", weights_only=True)
    for tensor in saved["state_dict"].values():
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
    torch.save(saved, tmp_path / "nan.ckpt")
    for program in (generate, explain):
        assert program.main(["--ckpt", str(tmp_path / "nan.ckpt"), "--prompt", "RO"]) == 1
        assert one_error_line(capsys.readouterr().err).startswith(
            f"error: {tmp_path / 'nan.ckpt'} holds weights that are not finite numbers ("
        )


def test_weights_of_another_shape_name_the_tensor(tiny_run, tmp_path, capsys):
    saved = torch.load(tiny_run / "checkpoints" / "last.ckpt", weights_only=True)
    name = next(n for n in saved["state_dict"] if n.endswith("wte.weight"))
    saved["state_dict"][name] = saved["state_dict"][name][:10].clone()
    torch.save(saved, tmp_path / "shape.ckpt")
    assert generate.main(["--ckpt", str(tmp_path / "shape.ckpt"), "--prompt", "RO"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: weights in {tmp_path / 'shape.ckpt'} do not fit the model it describes: ")
    assert "size mismatch for transformer.wte.weight" in line, line


def test_generate_py_counts_as_train_py_takes_them(tiny_run, capsys):
    """1e3 and 2_0 are whole numbers, as in train.py's settings; 1.5 is refused by argparse in one line."""
    assert (
        generate.main(["--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "2e1", "--seed", "1_0"]) == 0
    )
    assert "ROMEO:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        generate.main(["--ckpt", str(tiny_run), "--max-new-tokens", "1.5"])
    assert stop.value.code == 2
    assert "argument --max-new-tokens: must be a whole number, got '1.5'" in capsys.readouterr().err


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
    not_a_picture = tmp_path / "notes.png"
    not_a_picture.write_text("my notes, in a file with the wrong name")
    for target in (blocker / "attention.png", tmp_path, not_a_picture):
        code = generate.main(["--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--attention-png", str(target)])
        out, err = capsys.readouterr()
        assert code == 1 and out == "" and "--attention-png" in one_error_line(err)
    assert blocker.read_text() == "keep me"
    assert not_a_picture.read_text() == "my notes, in a file with the wrong name"


@pytest.mark.parametrize("how", ["truncated", "corrupted", "empty", "text"])
def test_generate_py_damaged_checkpoint(how, tiny_run, tmp_path, capsys):
    damaged = damaged_copy(tiny_run / "checkpoints" / "last.ckpt", tmp_path, how)
    code = generate.main(["--ckpt", str(damaged), "--prompt", "ROMEO:"])
    out, err = capsys.readouterr()
    line = one_error_line(err)
    assert code == 1 and out == "" and str(damaged) in line
    assert "truncated or corrupted" in line


def test_generate_py_checkpoint_that_is_a_device(capsys):
    code = generate.main(["--ckpt", "/dev/null", "--prompt", "ROMEO:"])
    _, err = capsys.readouterr()
    assert code == 1 and one_error_line(err) == (
        "error: checkpoint /dev/null is not a file or a folder; pass a .ckpt file, a run folder or a Hugging Face folder"
    )


def test_a_file_inside_a_hugging_face_folder_or_a_folder_of_them_points_at_one(transformers_folder, capsys):
    weights = transformers_folder / "model.safetensors"
    proc = run_script("generate.py", "--ckpt", str(weights), "--prompt", "ROMEO:")
    assert proc.returncode == 1 and proc.stdout == ""
    assert one_error_line(proc.stderr) == (
        f"error: {weights} is one file of the Hugging Face model folder {transformers_folder}; "
        f"pass the folder itself: {transformers_folder}"
    )
    config = transformers_folder / "config.json"
    for main in (explain.main, export.main):
        assert main(["--ckpt", str(config), "--prompt" if main is explain.main else "--out", "x"]) == 1
        assert f"pass the folder itself: {transformers_folder}" in one_error_line(capsys.readouterr().err)
    assert generate.main(["--ckpt", str(transformers_folder.parent), "--prompt", "ROMEO:"]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"error: {transformers_folder.parent} holds Hugging Face model folders, not one model: name one of them, "
        f"e.g. {transformers_folder}"
    )


def test_generate_py_missing_checkpoint(tmp_path, capsys, monkeypatch):
    code = generate.main(["--ckpt", str(tmp_path / "nowhere"), "--prompt", "ROMEO:"])
    _, err = capsys.readouterr()
    assert code == 1 and "does not exist" in one_error_line(err)
    monkeypatch.chdir(tmp_path)  # no outputs/latest here
    code = generate.main(["--prompt", "ROMEO:"])
    _, err = capsys.readouterr()
    assert code == 1 and "python train.py" in one_error_line(err)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "latest").symlink_to(tmp_path / "outputs" / "a-run-since-removed")
    code = generate.main(["--prompt", "ROMEO:"])
    _, err = capsys.readouterr()
    assert code == 1 and "a-run-since-removed, which no longer exists" in one_error_line(err)
    (tmp_path / "empty_run").mkdir()
    code = generate.main(["--ckpt", str(tmp_path / "empty_run")])
    _, err = capsys.readouterr()
    assert code == 1 and "no checkpoint in" in one_error_line(err)


@pytest.mark.slow
def test_a_run_folder_with_only_step_files_names_the_newest_to_pass(tiny_run, tmp_path):
    """A run copied without its links (`rsync -r`) has its step files but no last.ckpt or best.ckpt."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(tiny_run / "checkpoints" / "last.ckpt", run / "checkpoints" / "step-000003.ckpt")
    shutil.copy(tiny_run / "checkpoints" / "last.ckpt", run / "checkpoints" / "step-000006.ckpt")
    os.utime(run / "checkpoints" / "step-000003.ckpt", (1, 1))
    newest = run / "checkpoints" / "step-000006.ckpt"
    for command in (("generate.py", "--ckpt", "run"), ("export.py", "--ckpt", "run", "--out", "hf")):
        done = run_script(*command, cwd=tmp_path)
        assert done.returncode == 1 and f"the newest, {newest.relative_to(tmp_path)}" in one_error_line(done.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    done = run_script("export.py", "--ckpt", str(newest), "--out", "hf", cwd=tmp_path)  # as the line says
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("program", [generate, explain, export])
def test_no_run_to_read_is_said_alike_by_all_three(program, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no outputs/latest here
    args = ["--out", "hf"] if program is export else []
    assert program.main(args) == 1
    assert one_error_line(capsys.readouterr().err) == (
        "error: no run found at outputs/latest; train one with `python train.py` or pass --ckpt RUN_FOLDER"
    )
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "latest").symlink_to(tmp_path / "outputs" / "a-run-since-removed")
    assert program.main(args) == 1
    assert "a-run-since-removed, which no longer exists" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


def test_a_run_whose_last_checkpoint_link_is_broken_says_so(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    last = run / "checkpoints" / "last.ckpt"
    kept = last.rename(run / "checkpoints" / "step-000003.ckpt")
    last.symlink_to("step-000006.ckpt")  # as training links it, to a step file since removed
    assert generate.main(["--ckpt", str(run), "--prompt", "RO"]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"error: {last} is a broken link: it points at step-000006.ckpt, which no longer exists; name another "
        f"checkpoint of the run instead, e.g. {kept}"
    )
    kept.unlink()
    assert explain.main(["--ckpt", str(run)]) == 1
    assert one_error_line(capsys.readouterr().err).endswith(
        "which no longer exists, and the run holds no other checkpoint; use another run"
    )


def test_bytes_damaged_inside_a_tensor_are_caught_by_the_checksums(tiny_run, tmp_path, capsys):
    damaged = flipped_copy(tiny_run / "checkpoints" / "last.ckpt", tmp_path / "damaged.ckpt", "/data/0")
    assert torch.load(damaged, weights_only=True)["state_dict"]  # torch itself reads it, with other numbers
    expected = (
        f"error: cannot read checkpoint {damaged} (last/data/0 does not match its checksum): it is truncated or "
        "corrupted; use an earlier or a fresh copy"
    )
    for program, args in ((generate, ["--prompt", "RO"]), (explain, []), (export, ["--out", str(tmp_path / "hf")])):
        assert program.main(["--ckpt", str(damaged), *args]) == 1, program.__name__
        out, err = capsys.readouterr()
        assert out == "" and one_error_line(err) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.ckpt"]


def test_a_header_read_checks_the_header_and_leaves_the_tensors_on_disk(tiny_run, tmp_path):
    saved = torch.load(tiny_run / "checkpoints" / "last.ckpt", weights_only=True)
    torch.save({**saved, "global_step": 6}, tmp_path / "step.ckpt")  # a training checkpoint's header
    in_tensor = flipped_copy(tmp_path / "step.ckpt", tmp_path / "tensor.ckpt", "/data/0")
    assert read_header(in_tensor)["step"] == 6  # tensors are not read, so not checked: cheap
    with pytest.raises(DamagedCheckpoint, match="data/0 does not match its checksum"):
        read_weights(in_tensor)
    in_header = flipped_copy(tmp_path / "step.ckpt", tmp_path / "header.ckpt", "/data.pkl")
    with pytest.raises(DamagedCheckpoint, match="data.pkl does not match its checksum"):
        read_header(in_header)


def test_a_folder_of_runs_given_as_the_checkpoint_names_the_newest_run(tiny_run, tmp_path, capsys):
    runs_root = tmp_path / "outputs"
    for day, older in (("2026-01-01", True), ("2026-01-02", False)):  # outputs/<day>/<time>, as train.py makes them
        run = runs_root / day / "10-00-00"
        shutil.copytree(tiny_run, run, symlinks=True)
        if older:
            os.utime(run, (1e9, 1e9))
    for given in (runs_root, runs_root / "2026-01-02"):
        code = generate.main(["--ckpt", str(given), "--prompt", "ROMEO:"])
        _, err = capsys.readouterr()
        assert code == 1 and one_error_line(err) == (
            f"error: {given} holds runs, not one run: name one of them, e.g. the newest, {runs_root / '2026-01-02' / '10-00-00'}"
        )


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
        assert "--force" not in one_error_line(err) or extra  # not offered where it would be refused
    assert [p.name for p in notes.iterdir()] == ["todo.txt"] and (notes / "todo.txt").read_text() == "mine"

    run_copy = tmp_path / "run"
    shutil.copytree(tiny_run, run_copy)
    code = export.main(["--ckpt", str(run_copy), "--out", str(run_copy), "--force"])
    _, err = capsys.readouterr()
    assert code == 1 and "holds the checkpoint being exported" in one_error_line(err)
    assert (run_copy / "checkpoints" / "last.ckpt").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "run"]  # no half-written folder anywhere


def test_export_py_writes_into_an_empty_working_folder_and_through_a_link(tiny_run, tmp_path, monkeypatch, capsys):
    here = tmp_path / "here"  # `export.py --out .` from an empty folder: the folder itself is filled
    here.mkdir()
    monkeypatch.chdir(here)
    assert export.main(["--ckpt", str(tiny_run), "--out", "."]) == 0
    assert (here / "config.json").is_file() and Path.cwd().samefile(here)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]  # no staging folder left beside it

    target = tmp_path / "models"  # a link to a folder: the export lands in that folder, the link stays
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    assert export.main(["--ckpt", str(tiny_run), "--out", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and (target / "model.safetensors").is_file()
    capsys.readouterr()


def test_export_py_out_through_a_loop_of_links_is_refused_in_one_line(tiny_run, tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    for out in ("a", "a/hf"):
        done = run_script("export.py", "--ckpt", str(tiny_run), "--out", out, cwd=tmp_path)
        assert done.returncode == 1 and "loop of symbolic links" in one_error_line(done.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_export_py_force_in_the_working_folder_replaces_the_files_and_keeps_the_folder(
    tiny_run, tmp_path, monkeypatch, capsys
):
    """`--out . --force` over an earlier export: the shell's working folder (or a mount point, which
    cannot be renamed either) stays the same folder, and holds the new export's files only."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert export.main(["--ckpt", str(tiny_run), "--out", "."]) == 0
    (here / "generation_config.json").write_text("{}")  # the earlier one's, to see it replaced
    inode = here.stat().st_ino
    assert export.main(["--ckpt", str(tiny_run), "--out", ".", "--force"]) == 0
    assert Path.cwd().samefile(here) and here.stat().st_ino == inode and os.path.exists(os.getcwd())
    assert sorted(p.name for p in here.iterdir()) == sorted(export.FILES)  # no work folders left in it
    assert (here / "generation_config.json").read_text() != "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]
    capsys.readouterr()


def test_export_py_out_with_dot_dot_is_the_folder_it_names(tiny_run, tmp_path, capsys):
    """--out e/x/.. is e: checked as e (empty, so filled), and no folder x is made on the way."""
    (tmp_path / "e").mkdir()
    assert export.main(["--ckpt", str(tiny_run), "--out", str(tmp_path / "e" / "x" / "..")]) == 0
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == sorted(export.FILES)
    capsys.readouterr()


def test_a_replacement_that_fails_part_way_puts_the_earlier_export_back(tiny_run, tmp_path, capsys):
    """The old files are moved aside, then the new ones in: a failure on the way (here, a new entry
    whose place is held by a folder that is not the old export's) leaves the earlier export as it was."""
    out = tmp_path / "hf"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    staging = out / f".export.partial-{os.getpid()}"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    (staging / ".export.replaced-1").write_text("")  # a file, to go where a folder of that name is
    (out / ".export.replaced-1").mkdir()  # another export's work, left as it is: the rename fails
    (out / ".export.replaced-1" / "x").write_text("x")
    with pytest.raises(OSError):
        export.install(staging, out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in staging.iterdir()) == [".export.replaced-1", "config.json"]
    assert not (out / f".export.replaced-{os.getpid()}").exists()
    capsys.readouterr()


def test_export_py_refused_leaves_no_folder_it_made(tiny_run, tmp_path, capsys):
    broken = tmp_path / "hf"  # a tokenizer the library cannot read: refused after the checks of --out
    export.main(["--ckpt", str(tiny_run), "--out", str(broken)])
    (broken / "tokenizer.json").write_text("{}")
    code = export.main(["--ckpt", str(broken), "--out", str(tmp_path / "new" / "deeper" / "out")])
    _, err = capsys.readouterr()
    assert code == 1 and "tokenizer" in one_error_line(err)
    assert not (tmp_path / "new").exists()


# ---- a Hugging Face folder whose tokenizer does not fit, in all three programs ------------------------------


@pytest.fixture(scope="module")
def exported_folder(tiny_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "hf"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("how", ["not a tokenizer", "cut short", "a token more than the model has"])
def test_a_hugging_face_folder_with_a_bad_tokenizer_is_refused_in_one_line(how, exported_folder, tmp_path, capsys):
    folder = tmp_path / "hf"
    shutil.copytree(exported_folder, folder)
    tokenizer_file = folder / "tokenizer.json"
    if how == "not a tokenizer":
        tokenizer_file.write_text("{}")
    elif how == "cut short":
        tokenizer_file.write_text(tokenizer_file.read_text()[:500])
    else:  # transformers saves a tokenizer with added tokens beside a model that has no rows for them
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tokenizer.add_tokens(["<|user|>"])
        tokenizer.save(str(tokenizer_file))
    expected = "do not belong together" if how.startswith("a token") else "cannot be read"
    for program, args in (
        (generate, ["--prompt", "<|user|> hi"]),
        (explain, ["--prompt", "<|user|> hi"]),
        (export, ["--out", str(tmp_path / "out")]),
    ):
        code = program.main(["--ckpt", str(folder), *args])
        out, err = capsys.readouterr()
        assert code == 1 and expected in one_error_line(err), program.__name__
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ---- the programs as a user runs them: a pipe that closes, Ctrl-C at any moment ---------------------------


# What each program is given to write something: a long sample, a walk-through as JSON, a folder.
PROGRAM_ARGS = {
    "generate.py": ["--prompt", "ROMEO:", "--max-new-tokens", "100000"],
    "explain.py": ["--prompt", "ROMEO:", "--json"],
    "export.py": ["--out", "hf"],
}


@pytest.mark.parametrize("program, args", [*PROGRAM_ARGS.items(), ("explain.py", ["--prompt", "ROMEO:"])])
def test_into_a_pipe_that_closes_early_each_program_ends_quietly(program, args, tiny_run, tmp_path):
    """As `| head -1` does: read a line, then stop reading (or, as `| true`, read nothing)."""
    proc = start_script(
        program, "--ckpt", str(tiny_run), *args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    if program == "generate.py":
        proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141 and "Traceback" not in err and "Error" not in err, err
    if program == "export.py":  # the folder was written before its report found no reader
        assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(export.FILES)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device that is always full")
@pytest.mark.parametrize("program", list(PROGRAM_ARGS))
def test_output_to_a_full_device_is_one_error_line(program, tiny_run, tmp_path):
    with open("/dev/full", "w") as full:  # the first write fails: generate.py's 100,000 tokens are never sampled
        proc = start_script(
            program, "--ckpt", str(tiny_run), *PROGRAM_ARGS[program], cwd=tmp_path, stdout=full, stderr=subprocess.PIPE
        )
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    line = one_error_line(err)
    assert line.startswith(
        "error: cannot write the output to stdout (/dev/full): No space left on device; free some space or send "
        "the output elsewhere"
    ), line
    if program == "export.py":  # the folder was written whole before its report could not be
        assert line.endswith(f"({tmp_path / 'hf'} is written)")
        assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(export.FILES)


@pytest.mark.parametrize("program", list(PROGRAM_ARGS))
def test_output_with_stdout_closed_is_one_error_line(program, tiny_run, tmp_path):
    """As `>&-` starts a program: Python has no sys.stdout at all, so nothing can be printed."""
    proc = start_script(
        program,
        "--ckpt",
        str(tiny_run),
        *PROGRAM_ARGS[program],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(1),
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    line = one_error_line(err)
    assert line.startswith("error: cannot write the output: stdout is closed; send the output elsewhere (> FILE)")
    if program == "export.py":  # the folder was written whole before its report could not be
        assert line.endswith(f"({tmp_path / 'hf'} is written)")


@pytest.mark.parametrize(
    "program, args",
    [("generate.py", ["--prompt", "café", "--max-new-tokens", "100000"]), ("explain.py", ["--prompt", "ROMEO:"])],
)
def test_output_in_an_encoding_without_its_characters_is_one_error_line(program, args, tiny_run, tmp_path):
    """PYTHONIOENCODING=ascii (or a Latin-1 locale): é, or explain.py's ✓, cannot be written in it."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    proc = run_script(program, "--ckpt", str(tiny_run), *args, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 1
    line = one_error_line(proc.stderr)
    assert line.startswith("error: cannot write the output to stdout") and "its encoding, ascii, has no '\\" in line
    assert line.endswith("; set PYTHONIOENCODING=utf-8, or use a UTF-8 locale")


def run_on_a_full_disk(*args: str, cwd: Path, size: int) -> subprocess.CompletedProcess:
    """A script run as run_script runs it, on a disk that takes no file over `size` bytes, as a full one
    takes none (RLIMIT_FSIZE; SIGXFSZ ignored, so that a write past it fails with EFBIG, not killing it)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    proc = start_script(*args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_export_to_a_full_disk_leaves_nothing_and_keeps_an_earlier_export(tiny_run, tmp_path):
    earlier = tmp_path / "hf"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(earlier)]) == 0
    before = snapshot(earlier, itself=False)
    assert (earlier / "model.safetensors").stat().st_size > 20_000  # so that writing it fails
    for out, extra in ((earlier, ["--force"]), (tmp_path / "new" / "hf", [])):
        proc = run_on_a_full_disk(
            "export.py", "--ckpt", str(tiny_run), "--out", str(out), *extra, cwd=tmp_path, size=20_000
        )
        assert proc.returncode == 1 and proc.stdout == ""
        assert one_error_line(proc.stderr) == (
            f"error: cannot write --out {out}: File too large; raise the file-size limit (ulimit -f) or choose another place; nothing was written"
        )
    # its files as they were (the folder's own time changes: the export was staged in it, then removed)
    assert snapshot(earlier, itself=False) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no unfinished folder, no folder made for it


@pytest.mark.slow
def test_attention_png_on_a_full_disk_leaves_nothing(tiny_run, tmp_path, capsys):
    png = tmp_path / "attention.png"
    args = ["--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "5", "--attention-png"]
    assert generate.main([*args, str(png)]) == 0  # also fills matplotlib's font cache, before the disk is full
    capsys.readouterr()
    drawn = png.read_bytes()
    assert len(drawn) > 8_000  # so that writing it again fails
    for target in (tmp_path / "b.png", tmp_path / "new" / "a.png"):
        proc = run_on_a_full_disk("generate.py", *args, str(target), cwd=tmp_path, size=8_000)
        assert proc.returncode == 1 and proc.stdout.startswith("ROMEO:")  # the sample was printed before
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: cannot write --attention-png {target}: File too large; raise the file-size limit (ulimit -f) or choose another place (nothing was written)"
        )
    assert png.read_bytes() == drawn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention.png"]  # no partial file, no folder made


@pytest.mark.slow
def test_export_stopped_or_killed_while_it_writes_leaves_nothing_behind(tiny_run, tmp_path, capsys):
    """SIGTERM while the folder is being written aside: it stops with nothing left, not even the folders
    --out needed; an unfinished folder that a SIGKILL left is removed by the next export to that place."""
    proc = start_script(
        "export.py",
        "--ckpt",
        str(tiny_run),
        "--out",
        "x/y/hf",
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while (
        not list((tmp_path / "x" / "y").glob(".hf.partial-*")) and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "stopped; nothing was written"
    assert "Traceback" not in err
    assert not (tmp_path / "x").exists()

    out = tmp_path / "hf"
    dead = 2**22 + 1  # above Linux's default pid_max: no process has it
    left = tmp_path / f".hf.partial-{dead}"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half")
    mine = tmp_path / ".other.partial-123"  # another --out's: not this export's to remove
    mine.mkdir()
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 0
    assert not left.exists() and mine.exists() and sorted(p.name for p in out.iterdir()) == sorted(export.FILES)


def writer_of(fifo: Path) -> int | None:
    """A descriptor writing into the named pipe; None while no process has it open to read."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ENXIO:
            return None
        raise


def until_read(fifo: Path, proc: subprocess.Popen) -> int:
    """A descriptor writing into the named pipe, once `proc` opens it to read (and waits there)."""
    deadline = time.monotonic() + 240
    while (pipe := writer_of(fifo)) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipe is not None, proc.communicate()
    return pipe


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.slow
def test_a_stop_while_the_folder_is_put_in_place_waits_for_it_and_says_it_is_written(tiny_run, tmp_path, capsys):
    """SIGTERM while an export replaces an earlier one: the stop waits until the new folder is in place,
    whichever of the process's threads the signal reaches. The earlier export's README.md is a named pipe,
    so that reading it, as the last check before the folder is replaced does, waits for this test."""
    out = tmp_path / "hf"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 0
    capsys.readouterr()
    card = (out / "README.md").read_text()
    (out / "README.md").unlink()
    os.mkfifo(out / "README.md")
    proc = start_script(
        "export.py", "--ckpt", str(tiny_run), "--out", str(out), "--force",
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    fifo = out / "README.md"
    pipe = until_read(fifo, proc)  # the check before any work
    os.write(pipe, card.encode())
    os.close(pipe)
    while (probe := writer_of(fifo)) is not None:  # until that read is over
        os.close(probe)
        time.sleep(0.01)
    pipe = until_read(fifo, proc)  # the check again, before the folder is replaced, with stops held
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # time for a handler to run, were the stop not held
    os.write(pipe, card.encode())
    os.close(pipe)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"stopped; {out} is written"
    assert sorted(p.name for p in out.iterdir()) == sorted(export.FILES) and (out / "README.md").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # the replaced folder is gone, no staging left


@pytest.mark.parametrize("program", ["generate.py", "explain.py", "export.py"])
def test_ctrl_c_at_any_moment_gives_no_traceback(program, tiny_run, tmp_path):
    """Ctrl-C while the program imports its libraries, or once it works: it stops, in one line at most."""
    args = {"generate.py": ["--max-new-tokens", "100000"], "explain.py": [], "export.py": ["--out", "x/y/hf"]}
    for delay in (0.3, 3.0):
        proc = start_script(
            program,
            "--ckpt",
            str(tiny_run),
            *args[program],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode in (0, 130, -signal.SIGINT), (delay, err)  # 0: it had finished before
        assert "Traceback" not in err, (delay, err)
        if proc.returncode != 0:
            assert not (tmp_path / "x").exists()  # an export stopped leaves no folder
        if program == "export.py" and proc.returncode == 130:
            assert err.strip().splitlines()[-1] == "stopped; nothing was written"
        shutil.rmtree(tmp_path / "x", ignore_errors=True)


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux's pipe sizes")
def test_sigterm_while_the_attention_png_is_written_leaves_nothing(tiny_run, tmp_path):
    """`kill` while the picture is written stops generate.py as Ctrl-C does (143, no traceback), and
    takes back the file it began. That file is a named pipe whose reader takes one page and no more, so
    that writing the picture (tens of kB) waits there for this test."""
    args = ["--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--attention-png", "a.png"]
    proc = start_script("generate.py", *args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    partial = tmp_path / f".a.png.{proc.pid}.partial"  # the name the picture is written under first
    os.mkfifo(partial)
    reader = os.open(partial, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)
        deadline = time.monotonic() + 240
        while not available(reader) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until the picture's first bytes are in: the rest wait for a reader
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(reader)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert out.startswith("ROMEO:")
    assert list(tmp_path.iterdir()) == []


def available(fd: int) -> int:
    """Bytes waiting to be read from a pipe."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


def read_until(fd: int, text: bytes, timeout: float = 120) -> bytes:
    """What a terminal shows, read from its other end until `text` appears (or the program is gone)."""
    import select

    shown, deadline = b"", time.time() + timeout
    while text not in shown:
        assert time.time() < deadline, shown
        if select.select([fd], [], [], 1.0)[0]:
            try:
                shown += os.read(fd, 65536)
            except OSError:  # no program has the terminal open any more
                break
    return shown


def wait_for_text(file: Path, count: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not file.exists() or file.stat().st_size < count:
        assert time.time() < deadline
        time.sleep(0.05)


def test_ctrl_c_at_a_terminal_stops_the_sample_and_asks_for_the_next(no_start_token_run, tmp_path):
    """Typed prompts: Ctrl-C ends the sample being written (its line ends in the output, so the next
    answer starts a line of its own) and asks for the next prompt; Ctrl-D quits, ending the prompt's
    line. The model knows no <|endoftext|>, so a sample ends only when stopped."""
    import pty

    main, terminal = pty.openpty()
    out = tmp_path / "out.txt"
    args = ["--ckpt", str(no_start_token_run), "--interactive", "--max-new-tokens", "1000000"]
    with out.open("w") as stdout:
        proc = start_script("generate.py", *args, cwd=tmp_path, stdin=terminal, stdout=stdout, stderr=terminal)
    os.close(terminal)
    try:
        read_until(main, b"> ")
        for prompt in ("ROMEO:", "JULIET:"):
            written = out.stat().st_size
            os.write(main, prompt.encode() + b"\n")
            wait_for_text(out, written + len(prompt) + 20)  # the prompt and some of its sample
            proc.send_signal(signal.SIGINT)  # what the terminal sends on Ctrl-C
            read_until(main, b"[stopped]\r\n> ")
        os.write(main, b"\x04")
        assert proc.wait(timeout=120) == 0
        assert read_until(main, b"\n").endswith(b"\r\n")  # Ctrl-D ends the "> " line
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert text.startswith("ROMEO:") and "\nJULIET:" in text and text.endswith("\n")


def test_ctrl_c_with_prompts_from_a_file_ends_the_run(no_start_token_run, tmp_path):
    """`--interactive < prompts.txt`: no one is there to type the next prompt, so Ctrl-C ends the run
    (130), as it ends a one-off run, instead of going on to the next line of the file."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\nJULIET:\nKING:\n")
    args = ["--ckpt", str(no_start_token_run), "--interactive", "--max-new-tokens", "1000000"]
    with prompts.open() as stdin:
        proc = start_script(
            "generate.py", *args, cwd=tmp_path, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    proc.stdout.read(len("ROMEO:") + 20)  # sampling for the first line
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "[stopped]" not in err and "Traceback" not in err, err
    assert "JULIET:" not in out and out.endswith("\n")


def test_asking_for_more_than_memory_holds_is_one_line_with_what_to_ask_instead(tiny_run, tmp_path):
    """1,024 samples of a million tokens each want 8 GiB of token ids at once: in a process whose
    address space is capped at 6 GiB (as a container's, or a machine without overcommit, caps it),
    the allocation fails, and generate.py says so in one line."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    args = ["--ckpt", str(tiny_run), "--prompt", "A", "--max-new-tokens", "1000000", "--num-samples", "1024"]
    proc = start_script(
        "generate.py", *args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=cap
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and out == ""
    line = one_error_line(err)
    assert line.startswith("error: out of memory (7.6 GiB at once): ask for fewer --num-samples or --max-new-tokens")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_after_the_work_is_done_changes_neither_status_nor_stderr(signum):
    """generate.py, explain.py and export.py end through exit_quietly: a Ctrl-C or SIGTERM that lands while
    the interpreter shuts down (torch runs exit handlers of its own) is not shown as a traceback of theirs,
    nor does it turn the status of a finished run (an export in place) into a stopped one's."""
    code = (
        "import atexit, os, signal\n"
        "from shell.programs import exit_quietly\n"
        f"atexit.register(lambda: os.kill(os.getpid(), {int(signum)}))\n"
        "exit_quietly(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (3, "")
    for script in ("generate.py", "explain.py", "export.py"):
        assert (ROOT / script).read_text().endswith('if __name__ == "__main__":\n    exit_quietly(main())\n')


STOPPED_ARGS = {"generate.py": ["--attention-png", "a/b.png"], "explain.py": [], "export.py": ["--out", "x/y/hf"]}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize(
    "program, moment",
    [
        *((program, "argparse:ArgumentParser.parse_known_args") for program in STOPPED_ARGS),
        *((program, "checkpoint:load_checkpoint") for program in STOPPED_ARGS),
    ],
)
def test_a_stop_as_the_arguments_are_read_or_the_model_loads_ends_in_one_line(
    program, moment, signum, tiny_run, tmp_path
):
    """Ctrl-C (130) or SIGTERM (143) that lands once the imports are over, as argparse reads the command
    line or as the checkpoint loads: each program ends as a stop at work ends it, without a traceback,
    having printed and made nothing (export.py says so). The stop is sent at that named moment
    (stop_at), not after a delay."""
    env = stop_at(tmp_path / "hook", moment, signum)
    work = tmp_path / "work"
    work.mkdir()
    proc = run_script(program, "--ckpt", str(tiny_run), *STOPPED_ARGS[program], cwd=work, env=env, timeout=300)
    assert proc.returncode == 128 + signum and "Traceback" not in proc.stderr, proc.stderr
    said = "stopped; nothing was written" if program == "export.py" else ""
    assert proc.stdout == "" and proc.stderr.strip() == said
    assert list(work.iterdir()) == []


def test_stops_raised_gives_the_handlers_back_and_lets_a_stop_that_lands_as_it_ends_go():
    """While held, SIGINT raises KeyboardInterrupt and SIGTERM Terminated; after, the handlers that were
    there are back, and a stop whose handler runs only then (the work is over) raises nothing."""
    before = {signum: signal.getsignal(signum) for signum in STOPS}
    with stops_raised():
        held = {signum: signal.getsignal(signum) for signum in STOPS}
        with pytest.raises(KeyboardInterrupt):
            held[signal.SIGINT](signal.SIGINT, None)
        with pytest.raises(Terminated):
            held[signal.SIGTERM](signal.SIGTERM, None)
    assert {signum: signal.getsignal(signum) for signum in STOPS} == before
    for signum, handler in held.items():
        assert handler(signum, None) is None


def test_a_folder_of_another_project_with_a_config_json_is_said_not_to_be_a_gpt2(tmp_path, capsys):
    """A config.json that is no model's (a project's settings) is named as not a GPT-2 config, rather
    than read as a GPT-2 with no layers."""
    project = tmp_path / "webapp"
    project.mkdir()
    (project / "config.json").write_text('{"port": 8080, "debug": true}')
    assert generate.main(["--ckpt", str(project), "--prompt", "a"]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"error: {project} is not a GPT-2 model tinygpt2 can load: it names no model_type, nor a GPT-2 shape "
        "(n_layer, n_head, n_embd): it is not a GPT-2 config"
    )


def test_a_damaged_checkpoint_of_a_run_names_another_checkpoint_of_it(tiny_run, tmp_path, capsys):
    """--ckpt RUN reads best.ckpt: damaged, the line names the run's newest other checkpoint to use."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    last = run / "checkpoints" / "last.ckpt"
    best = flipped_copy(last, run / "checkpoints" / "best.ckpt", "/data/0")
    assert generate.main(["--ckpt", str(run), "--prompt", "RO"]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"error: cannot read checkpoint {best} (last/data/0 does not match its checksum): it is truncated or corrupted; "
        f"use another checkpoint of its run, e.g. {last}"
    )
