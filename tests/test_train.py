"""Training end to end: composed Hydra configs, real Lightning runs, checkpoints, generate.py."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from generation.checkpoint import load_checkpoint
from model import GPT
from training.checks import SettingError
from training.run import train

from .common import ROOT, TINY, compose_config, run_script


def test_required_overrides_compose(small_text, tmp_path):
    cfg = compose_config(
        "model=nano",
        "data=shakespeare",
        f"data.path={small_text}",
        "trainer.max_steps=7",
        "trainer.val_check_interval=3",
        "optim.lr=0.002",
        "seed=5",
        "logger=csv",
    )
    assert cfg.model.n_layer == 4 and cfg.data.path == str(small_text) and cfg.trainer.max_steps == 7
    assert cfg.optim.lr == 0.002 and cfg.seed == 5 and list(cfg.logger) == ["csv"]
    cfg = compose_config("data=text", f"data.path={small_text}", "logger=wandb")
    assert cfg.data.source == "text" and list(cfg.logger) == ["wandb"]
    assert list(compose_config().logger) == ["wandb", "csv"]  # the default: both
    for preset, layers in [("baby", 6), ("gpt2", 12), ("gpt2-medium", 24), ("gpt2-large", 36), ("gpt2-xl", 48)]:
        assert compose_config(f"model={preset}").model.n_layer == layers


def test_experiments_list_only_what_differs_and_compose():
    cpu = compose_config("experiment=shakespeare_char_cpu")
    assert (cpu.model.n_layer, cpu.model.n_head, cpu.model.n_embd, cpu.model.block_size) == (4, 4, 128, 64)
    assert (cpu.data.batch_size, cpu.trainer.max_steps, cpu.tokenizer.kind, cpu.data.source) == (
        12,
        2000,
        "char",
        "shakespeare",
    )
    baby = compose_config("experiment=shakespeare_baby")
    assert (baby.model.n_layer, baby.model.n_embd, baby.model.block_size, baby.tokenizer.kind) == (6, 384, 256, "char")
    owt = compose_config("experiment=gpt2_owt", "tokenizer.path=/models/gpt2")
    assert (owt.model.n_layer, owt.model.n_embd, owt.data.source, owt.data.name) == (
        12,
        768,
        "hub",
        "Skylion007/openwebtext",
    )
    assert (owt.tokens_per_step, owt.trainer.strategy, owt.tokenizer.kind) == (491520, "ddp", "pretrained")
    for name in ("shakespeare_char_cpu", "shakespeare_baby", "gpt2_owt"):  # only what differs
        lines = (ROOT / "configs" / "experiment" / f"{name}.yaml").read_text().splitlines()
        assert len([line for line in lines if line.strip() and not line.lstrip().startswith("#")]) < 45


@pytest.mark.slow
def test_a_composed_config_trains_and_writes_a_checkpoint_that_generates(small_text, tmp_path):
    cfg = compose_config(*TINY, f"data.path={small_text}", "trainer.max_steps=30", "trainer.val_check_interval=10")
    result = train(cfg, tmp_path / "run")

    run = tmp_path / "run"
    for name in ("checkpoints/last.ckpt", "checkpoints/best.ckpt", "tokenizer.json", "config.yaml", "metrics.csv"):
        assert (run / name).is_file(), name
    metrics = result.metrics
    assert metrics["val/loss"] < math.log(300)  # better than uniform over the vocabulary: it learned
    tokens_per_char = load_checkpoint(run).config  # the config travels with the weights
    assert tokens_per_char["model"]["n_layer"] == 2

    rows = list(csv.DictReader(open(run / "metrics.csv")))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"train/loss", "val/loss", "val/bpc", "val/perplexity", "train/lr", "train/tokens_per_sec"} <= logged
    val_rows = [row for row in rows if row.get("val/loss")]
    assert [int(row["step"]) for row in val_rows][-1] == 29  # validated at the last step (the 30th)

    model = GPT.from_checkpoint(run)
    assert not model.training
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 10, temperature=0)
    assert out.shape == (1, 11)

    proc = run_script("generate.py", "--ckpt", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) > len("ROMEO:") + 10
    again = run_script("generate.py", "--ckpt", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1")
    assert again.stdout == proc.stdout  # same seed, same text
    assert "tokens/s" in proc.stderr


def test_bits_per_character_follow_from_the_loss(small_text, tmp_path):
    cfg = compose_config(*TINY, f"data.path={small_text}")
    result = train(cfg, tmp_path / "run")
    from data.datamodule import TextDataModule  # the same data the run used

    dm = TextDataModule(cfg.data, cfg.tokenizer, cfg.model.block_size, cfg.seed, 1)
    expected = result.metrics["val/loss"] * dm.val_tokens_per_char / math.log(2)
    assert result.metrics["val/bpc"] == pytest.approx(expected, rel=1e-5)


def test_the_progress_bar_redraws_at_most_so_often_and_ends_on_the_last_step(small_text, tmp_path, capfd, monkeypatch):
    from training.callbacks import ProgressBar

    monkeypatch.setattr(ProgressBar, "REDRAW_SECONDS", 1e9)  # only the first and the last step redraw
    cfg = compose_config(*TINY, f"data.path={small_text}", "trainer.enable_progress_bar=true", "trainer.max_steps=12")
    train(cfg, tmp_path / "run")
    drawn = [line for line in capfd.readouterr().out.replace("\r", "\n").splitlines() if line.startswith("training:")]
    counts = [line.split("|")[2].split()[0] for line in drawn]  # "n/total"
    assert counts[-1] == "12/12"
    assert not {f"{n}/12" for n in range(2, 12)} & set(counts), counts  # no redraw between the first and the last


def test_extra_callbacks_run_at_every_step_after_the_runs_own(small_text, tmp_path):
    import lightning as L

    class Steps(L.Callback):
        def __init__(self):
            self.steps, self.order = 0, []

        def on_train_batch_end(self, trainer, *args):
            self.steps += 1
            self.order = [type(c).__name__ for c in trainer.callbacks]

    steps = Steps()
    train(compose_config(*TINY, f"data.path={small_text}"), tmp_path / "run", extra_callbacks=[steps])
    assert steps.steps == 6
    assert steps.order.index("Steps") > steps.order.index("Throughput")


@pytest.mark.parametrize(
    "override, message",
    [("trainer.max_steps=0", "max_steps"), ("optim.lr=0", "optim.lr"), ("data.batch_size=0", "batch_size")],
)
def test_bad_settings_are_refused_before_training(override, message, small_text, tmp_path):
    cfg = compose_config(*TINY, f"data.path={small_text}", override)
    with pytest.raises(SettingError, match=message):
        train(cfg, tmp_path / "run")


@pytest.mark.slow
def test_train_py_command_line_end_to_end(small_text, tmp_path):
    run = tmp_path / "outputs" / "run1"
    latest = tmp_path / "outputs" / "latest"
    args = [
        *TINY,
        "data=text",
        f"data.path={small_text}",
        f"hydra.run.dir={run}",
        f"latest_link={latest}",
        "logger=[wandb,csv]",
    ]
    proc = run_script("train.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "metrics.csv").is_file()
    assert any((run / "wandb").glob("offline-run-*")), "wandb should log offline without credentials"
    assert latest.resolve() == run.resolve()

    again = run_script("train.py", *args)  # the same folder again: refused, nothing overwritten
    assert again.returncode != 0 and "already holds a run" in again.stderr
    assert (run / "checkpoints" / "last.ckpt").stat().st_size > 0


@pytest.mark.slow
def test_train_py_reports_bad_input_in_one_line(small_text, tmp_path):
    proc = run_script(
        "train.py",
        *TINY,
        f"data.path={small_text}",
        "model.n_head=4",
        "model.n_embd=30",
        f"hydra.run.dir={tmp_path / 'r'}",
    )
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: model.n_embd (30) must be divisible by model.n_head (4)")
    assert "Traceback" not in proc.stderr
