"""Every row of the README's "Bad input" table has a test here (or names the test that covers it
elsewhere); the last test reads the table and checks that no row is left without one."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import generate
import train
from data.tokenizer import train_char

from .common import ROOT, TINY
from .test_cli_errors import damaged_copy, one_error_line
from .tiny import write_checkpoint


def refused(*args: str) -> str:
    """train.py's one-line answer to a command line, checked the way train.py checks it."""
    problem = train.check_command_line(list(args))
    assert problem is not None, f"{args} was accepted"
    assert "\n" not in problem
    return problem


def test_unknown_setting():
    assert refused("trainer.max_step=10") == (
        "unknown setting 'trainer.max_step'; check the spelling (python train.py --cfg job lists every setting)"
    )


def test_unknown_choice():
    assert refused("model=huge").startswith("model=huge is not a choice; choose one of: baby, gpt2, ")


def test_value_of_the_wrong_kind():
    assert refused("optim.lr=fast") == "optim.lr must be a number, got 'fast'"


def test_n_embd_not_divisible_by_n_head():
    assert refused("model.n_embd=100", "model.n_head=3").startswith(
        "model.n_embd (100) must be divisible by model.n_head (3)"
    )


def test_block_size_below_one():
    assert refused("model.block_size=0") == "model.block_size must be a whole number of at least 1, got 0"


def test_block_size_above_what_the_checkpoint_has(tiny_run, small_text, tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", *[a for a in TINY if not a.startswith("model.")], f"data.path={small_text}",
         f"init_from={tiny_run}", "model.block_size=4096",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode != 0
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: model.block_size=4096 is more than the 32 positions init_from=")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("steps", ["0", "-5"])
def test_max_steps_not_positive(steps):
    assert refused(f"trainer.max_steps={steps}").startswith(f"trainer.max_steps must be at least 1 (or -1 with trainer.max_time), got {steps}")


@pytest.mark.parametrize("lr", ["0", "-0.001"])
def test_learning_rate_not_positive(lr):
    assert refused(f"optim.lr={lr}") == f"optim.lr must be above 0, got {float(lr)}"


def test_global_batch_that_does_not_divide():
    # checked when the number of devices is known, inside the run
    from omegaconf import OmegaConf

    from training.run import SettingError, accumulation

    cfg = OmegaConf.create({"tokens_per_step": 1000, "data": {"batch_size": 32}, "model": {"block_size": 32}})
    cfg.trainer = {}
    expected = r"tokens_per_step=1000 is not a multiple of .* = 32 x 32 x 1 = 1024; use e.g. 1024"
    with pytest.raises(SettingError, match=expected):
        accumulation(cfg, world_size=1)


def test_missing_checkpoint_to_resume(tmp_path):
    assert refused(f"resume={tmp_path / 'nope'}") == (
        f"resume={tmp_path / 'nope'} does not exist; give a run folder, a checkpoint in one, or resume=auto"
    )


def test_missing_checkpoint_to_start_from(tmp_path):
    assert refused(f"init_from={tmp_path / 'nope'}") == (
        f"init_from={tmp_path / 'nope'} does not exist; pass a .ckpt file, a run folder or a Hugging Face folder"
    )


# truncated or corrupted checkpoint to resume: tests/test_reliability.py::test_resuming_from_a_truncated_checkpoint_says_so
# shape of init_from contradicted: tests/test_init_from.py


def test_run_folder_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    assert refused(f"hydra.run.dir={blocker}/run") == (
        f"hydra.run.dir={blocker}/run: {blocker} is a file, not a folder; choose a folder you can write to"
    )


def test_gpu_asked_for_without_a_gpu():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert refused("trainer.accelerator=gpu") == (
        "trainer.accelerator=gpu: this machine has no CUDA GPU; use trainer.accelerator=cpu or auto"
    )


def test_train_py_prints_one_line_and_exits_non_zero(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "trainer.max_step=10", f"runs_root={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert one_error_line(proc.stderr).startswith("error: unknown setting 'trainer.max_step'")
    assert not any(tmp_path.iterdir())  # refused before any run folder was made


# ---- generate.py ----------------------------------------------------------------------------------------


def test_prompt_with_characters_the_char_tokenizer_never_saw(tiny_text, tmp_path, capsys):
    from .tiny import train_tiny_gpt

    tokenizer = train_char([tiny_text])
    ckpt = write_checkpoint(tmp_path / "char.ckpt", train_tiny_gpt(tokenizer, tiny_text, steps=1), tokenizer)
    assert generate.main(["--ckpt", str(ckpt), "--prompt", "ROMEO: café ☕ café", "--max-new-tokens", "5"]) == 1
    out, err = capsys.readouterr()
    assert one_error_line(err) == (
        "error: the prompt has characters this model's tokenizer never saw in training: 'é', '☕'; "
        "leave them out or replace them"
    )
    assert out == ""


def test_damaged_checkpoint_to_generate_from(tiny_run, tmp_path, capsys):
    broken = damaged_copy(tiny_run / "checkpoints" / "last.ckpt", tmp_path, "truncated")
    assert generate.main(["--ckpt", str(broken), "--prompt", "x"]) == 1
    assert "truncated or corrupted" in one_error_line(capsys.readouterr().err)


# The generate.py and export.py rows are tested in tests/test_cli_errors.py, one test per row:
COVERED_ELSEWHERE = {
    "`--max-new-tokens 0`": "test_cli_errors.py::test_generate_py_refuses_bad_settings",
    "`--temperature -1`": "test_cli_errors.py::test_generate_py_refuses_bad_settings",
    "`--top-p 0` or `--top-p 1.5`": "test_cli_errors.py::test_generate_py_refuses_bad_settings",
    "`--top-k 0`": "test_cli_errors.py::test_generate_py_refuses_bad_settings",
    "an empty prompt, tokenizer without `<\\|endoftext\\|>`": "test_cli_errors.py::test_generate_py_empty_prompt_without_a_start_token",
    "`--attention-png` where nothing can be written": "test_cli_errors.py::test_generate_py_attention_png_in_a_folder_that_cannot_be_written",
    "`export.py --out` where nothing can be written": "test_cli_errors.py::test_export_py_output_folder_that_cannot_be_written",
    "`--device cuda` without a GPU": "test_cli_errors.py::test_generate_py_device_cuda_without_a_gpu",
    "a missing checkpoint (`--ckpt`)": "test_cli_errors.py::test_generate_py_missing_checkpoint",
    "a checkpoint carrying pickled code": "test_hf.py (malicious checkpoint)",
    "a truncated or corrupted checkpoint (`resume=`)": "test_reliability.py::test_resuming_from_a_truncated_checkpoint_says_so",
    "`init_from=` with a contradicting shape (`model.n_layer=6`)": "test_init_from.py",
}

TESTED_HERE = {
    "an unknown setting (`trainer.max_step=10`)": test_unknown_setting,
    "an unknown choice (`model=huge`)": test_unknown_choice,
    "a value of the wrong kind (`optim.lr=fast`)": test_value_of_the_wrong_kind,
    "`model.n_embd` not divisible by `model.n_head`": test_n_embd_not_divisible_by_n_head,
    "`model.block_size=0`": test_block_size_below_one,
    "`model.block_size` above what `init_from=` has": test_block_size_above_what_the_checkpoint_has,
    "`trainer.max_steps=0` (or below)": test_max_steps_not_positive,
    "`optim.lr=0` (or below)": test_learning_rate_not_positive,
    "`tokens_per_step` that does not divide": test_global_batch_that_does_not_divide,
    "a missing run to resume": test_missing_checkpoint_to_resume,
    "a missing checkpoint to start from (`init_from=`)": test_missing_checkpoint_to_start_from,
    "a run folder that cannot be written": test_run_folder_that_cannot_be_written,
    "`trainer.accelerator=gpu` without a GPU": test_gpu_asked_for_without_a_gpu,
    "a prompt with characters a char tokenizer never saw": test_prompt_with_characters_the_char_tokenizer_never_saw,
    "a truncated or corrupted checkpoint (`--ckpt`)": test_damaged_checkpoint_to_generate_from,
}


def test_every_row_of_the_readme_table_has_a_test():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Bad input", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| input")]
    labels = [re.match(r"\| (.+?) \| ", row).group(1) for row in rows if not set(row) <= set("|- ")]
    assert len(labels) >= 20
    missing = [label for label in labels if label not in TESTED_HERE and label not in COVERED_ELSEWHERE]
    assert not missing, f"README rows without a test: {missing}"
