"""Training end to end: composed Hydra configs, real Lightning runs, checkpoints, generate.py."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import generate as generate_py
from checkpoint import load_checkpoint
from generation import generate
from model import GPT, GPTConfig
from shell.checks import check_values
from shell.settings import global_batch
from tests.common import (
    ROOT,
    TINY_OVERRIDES,
    compose_config,
    one_error_line,
    refused,
    snapshot,
    train_here,
    validations,
)


def trained_here(*args: str) -> dict:
    """`python train.py ARGS` run in this process, which must end well: the result.json of its run."""
    ran = train_here(*args)
    assert ran.returncode == 0, ran.stderr[-3000:]
    (run,) = re.findall(r"run folder: (.+)$", ran.stdout, re.MULTILINE)
    return json.loads((Path(run) / "result.json").read_text())


@pytest.mark.parametrize(
    "preset, released",
    [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)],
)
def test_each_gpt2_preset_with_gpt2s_vocabulary_has_the_released_parameter_count(preset, released):
    """configs/model/<preset>.yaml maps onto GPTConfig field for field and gives the released shape."""
    model = OmegaConf.to_container(compose_config(f"model={preset}", "model.vocab_size=50257").model)
    with torch.device("meta"):  # the shape without the memory for its weights
        gpt = GPT(GPTConfig.from_dict(model))
    assert gpt.num_parameters() == released


EXPERIMENTS = sorted(path.stem for path in (ROOT / "configs" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_each_experiment_composes_into_settings_that_pass_the_checks(experiment):
    """configs/experiment/<experiment>.yaml composes into settings train.py accepts (no misspelt or
    out-of-range setting), with a global batch that the devices it names can share."""
    cfg = compose_config(f"experiment={experiment}")
    if cfg.tokenizer.kind == "pretrained" and not cfg.tokenizer.get("path"):  # the user names their copy
        cfg = compose_config(f"experiment={experiment}", "tokenizer.path=/models/gpt2")
    values = check_values(OmegaConf.to_container(cfg, resolve=True))
    devices = values["trainer"].get("devices")
    global_batch(values, devices if isinstance(devices, int) else 1)


def test_whole_numbers_written_as_floats_become_ints_for_the_model_too():
    """model.n_embd=1.28e2 is 128, as seed=1e3 is 1000: the settings keep ints, so the saved config and
    the model built from it hold 128, not 128.0."""
    cfg = compose_config("model.n_embd=1.28e2", "model.n_head=4", "model.n_layer=2.0", "seed=1e3")
    values = check_values(OmegaConf.to_container(cfg, resolve=True))
    assert (values["model"]["n_embd"], values["model"]["n_layer"], values["seed"]) == (128, 2, 1000)
    assert all(type(v) is int for v in (values["model"]["n_embd"], values["model"]["n_layer"], values["seed"]))


def test_a_composed_config_trains_and_writes_a_checkpoint_that_generates(small_text, tmp_path, capsys):
    run = tmp_path / "run"
    result = trained_here(
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "trainer.max_steps=30",
        "trainer.val_check_interval=10",
        f"hydra.run.dir={run}",
    )

    for name in ("checkpoints/last.ckpt", "checkpoints/best.ckpt", "tokenizer.json", "config.yaml", "metrics.csv"):
        assert (run / name).is_file(), name
    metrics = result["metrics"]
    assert result["finished"] and metrics["val/loss"] < math.log(300)  # better than uniform over the vocabulary
    saved = load_checkpoint(run).config  # the config travels with the weights
    assert saved["model"]["n_layer"] == 2

    rows = list(csv.DictReader(open(run / "metrics.csv")))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"train/loss", "val/loss", "val/bpc", "val/perplexity", "train/lr", "train/tokens_per_sec"} <= logged
    val_rows = [row for row in rows if row.get("val/loss")]
    assert [int(row["step"]) for row in val_rows][-1] == 29  # validated at the last step (the 30th)

    model = load_checkpoint(run).model
    assert not model.training
    out = generate(model, torch.zeros(1, 1, dtype=torch.long), 10, temperature=0)
    assert out.shape == (1, 11)

    capsys.readouterr()
    args = ["--ckpt", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1"]
    assert generate_py.main(args) == 0  # generate.py's command line, in this process
    first = capsys.readouterr()
    assert first.out.startswith("ROMEO:") and len(first.out) > len("ROMEO:") + 10
    assert generate_py.main(args) == 0
    assert capsys.readouterr().out == first.out  # same seed, same text
    assert "tokens/s" in first.err


def test_bits_per_character_follow_from_the_loss(small_text, tmp_path):
    overrides = [*TINY_OVERRIDES, f"data.path={small_text}"]
    result = trained_here(*overrides, f"hydra.run.dir={tmp_path / 'run'}")
    from data.datamodule import TextDataModule  # the same data the run used

    cfg = compose_config(*overrides)
    dm = TextDataModule(cfg.data, cfg.tokenizer, cfg.model.block_size, cfg.seed, 1)
    expected = result["metrics"]["val/loss"] * dm.val_tokens_per_char / math.log(2)
    assert result["metrics"]["val/bpc"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "override, message",
    [("trainer.max_steps=0", "max_steps"), ("optim.lr=0", "optim.lr"), ("data.batch_size=0", "batch_size")],
)
def test_bad_settings_are_refused_before_training(override, message, small_text):
    assert message in refused(*TINY_OVERRIDES, f"data.path={small_text}", override)


def test_train_py_command_line_end_to_end(small_text, tmp_path):
    run = tmp_path / "outputs" / "run1"
    latest = tmp_path / "outputs" / "latest"
    args = [
        *TINY_OVERRIDES,
        "data=text",
        f"data.path={small_text}",
        f"hydra.run.dir={run}",
        f"latest_link={latest}",
        "logger=[wandb,csv]",
    ]
    ran = train_here(*args)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "metrics.csv").is_file()
    assert any((run / "wandb").glob("offline-run-*")), "wandb should log offline without credentials"
    assert latest.resolve() == run.resolve()

    kept = snapshot(run / "checkpoints")
    again = train_here(*args)  # the same folder again: refused, nothing overwritten
    assert again.returncode == 1 and "already holds a run" in one_error_line(again.stderr)
    assert snapshot(run / "checkpoints") == kept and (run / "checkpoints" / "last.ckpt").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("steps, warmup", [(1, 0), (20, 2)])
def test_the_short_runs_everyone_types_first_run_to_the_end(steps, warmup, full_text, tmp_path):
    """`python train.py trainer.max_steps=20` on the default config: a short run is what was asked for,
    so its warmup (50 steps) is shortened to fit, with one info line, and the run ends as any other."""
    ran = train_here(f"trainer.max_steps={steps}", f"data.path={full_text}", "logger=csv")
    assert ran.returncode == 0, ran.stderr[-2000:]
    said = f"optim.warmup_steps=50 is not shorter than the run's {steps} step{'' if steps == 1 else 's'}: "
    assert f"{said}warming up over {warmup} instead" in ran.stdout  # Hydra's log lines go to stdout
    (result_file,) = tmp_path.glob("outputs/*/*/result.json")
    result = json.loads(result_file.read_text())
    assert result["finished"] and result["config"]["optim"]["warmup_steps"] == warmup
    assert math.isfinite(result["metrics"]["val/bpc"]) and result["config"]["trainer"]["max_steps"] == steps


def test_train_py_reports_bad_input_in_one_line(small_text, tmp_path):
    line = refused(
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "model.n_head=4",
        "model.n_embd=30",
        f"hydra.run.dir={tmp_path / 'r'}",
    )
    assert line.startswith("model.n_embd (30) must be divisible by model.n_head (4)")


def test_validation_every_n_steps_counts_optimizer_steps_under_gradient_accumulation(small_text, tmp_path):
    """tokens_per_step of two micro-batches: trainer.val_check_interval=3 validates after steps 3 and 6,
    not after every third micro-batch (Lightning's own count)."""
    run = tmp_path / "run"
    overrides = [*TINY_OVERRIDES, f"data.path={small_text}", "tokens_per_step=512", "trainer.val_check_interval=3"]
    trained_here(*overrides, f"hydra.run.dir={run}")
    assert list(validations(run)) == [2, 5]  # after steps 3 and 6, as Lightning numbers them
    # training values once a step, after it (step N is row N - 1); the first micro-batch of step 1,
    # which only accumulates, logs nothing
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    trained = [(int(r["step"]), float(r["train/tokens_seen"])) for r in rows if r["train/tokens_seen"]]
    assert trained == [(step - 1, step * 512.0) for step in range(1, 7)]


def test_a_run_that_its_time_limit_ends_logs_its_last_step(small_text, tmp_path):
    """The step a time limit ends is known to be the last only once it is done: its training values are
    logged and recorded all the same (tokens seen, loss), not those of the last logging step before."""
    run = tmp_path / "run"
    overrides = [
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "trainer.max_steps=-1",
        "trainer.max_time=00:00:00:02",
        "trainer.log_every_n_steps=1000",
        "trainer.val_check_interval=1000",
        f"hydra.run.dir={run}",
    ]
    recorded = trained_here(*overrides)["metrics"]
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    trained = [(int(r["step"]), float(r["train/tokens_seen"])) for r in rows if r["train/tokens_seen"]]
    steps = trained[-1][0] + 1  # the step the time limit ended
    assert steps > 1 and steps % 1000 != 0 and steps == load_checkpoint(run).step
    assert trained[-1] == (steps - 1, steps * 256.0)
    assert recorded["train/tokens_seen"] == steps * 256.0 and math.isfinite(recorded["train/loss"])


EXPERIMENTS = {  # each README recipe, cut short: what is added to it, and the shape it must train
    "shakespeare_75s": (["trainer.max_time=00:00:00:03"], (2, 4, 128, 32)),
    "shakespeare_char_cpu": (["trainer.max_steps=3", "trainer.limit_val_batches=2"], (4, 4, 128, 64)),
    "shakespeare_baby": (["trainer.max_steps=2", "trainer.limit_val_batches=1", "data.batch_size=4"], (6, 6, 384, 256)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_each_experiment_of_the_readme_trains_as_written(name, full_text, tmp_path):
    """`python train.py experiment=NAME` with only its length cut (and no warm-up, for so few steps),
    on the whole text as a user's run reads it: the recipe composes, trains its own shape, validates
    and writes its run folder."""
    cut, shape = EXPERIMENTS[name]
    args = [f"experiment={name}", f"data.path={full_text}", *cut, "optim.warmup_steps=0", "logger=csv"]
    result = trained_here(*args, "trainer.enable_progress_bar=false")
    model = result["config"]["model"]
    assert (model["n_layer"], model["n_head"], model["n_embd"], model["block_size"]) == shape
    assert result["finished"] and math.isfinite(result["metrics"]["val/bpc"])
    assert (Path(result["run_dir"]) / "checkpoints" / "last.ckpt").is_file()


def test_a_sample_prompt_the_user_never_gave_is_left_out_rather_than_stopping_the_run(small_text, tmp_path):
    """data=shakespeare's own prompts (ROMEO:, JULIET:) on a text of the user's whose characters lack a
    J, under tokenizer=char: the run trains, its samples continue ROMEO: alone, one line says why."""
    text = tmp_path / "no_j.txt"
    text.write_text(small_text.read_text(encoding="utf-8").replace("J", "j"), encoding="utf-8")
    tiny = [a for a in TINY_OVERRIDES if not a.startswith("tokenizer.")]
    ran = train_here(*tiny, f"data.path={text}", "tokenizer=char", "logger=csv")
    assert ran.returncode == 0, ran.stderr[-2000:]
    said = [line for line in ran.stdout.splitlines() if "leave out 'JULIET:'" in line]
    assert len(said) == 1 and "data.sample_prompts: the text samples leave out 'JULIET:'" in said[0]
    (samples,) = tmp_path.glob("outputs/*/*/samples.md")
    assert "prompt 'ROMEO:'" in samples.read_text() and "JULIET" not in samples.read_text()
