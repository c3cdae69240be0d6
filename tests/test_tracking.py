"""What a run shows while it runs and leaves behind: loggers, metrics, samples, the loss curve."""

from __future__ import annotations

import csv

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from training.loggers import wandb_credentials_present, wandb_mode
from training.run import train

from .common import TINY, compose_config

METRICS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/tokens_per_sec",
    "train/tokens_seen",
    "train/mfu",
    "val/loss",
    "val/perplexity",
    "val/bpc",
}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, small_text):
    """One tiny run with every logger on."""
    run = tmp_path_factory.mktemp("tracked") / "run"
    cfg = compose_config(
        *TINY, f"data.path={small_text}", "logger=[wandb,tensorboard,csv]", "trainer.max_steps=8", "trainer.val_check_interval=4",
        "samples.max_new_tokens=12", "samples.prompts=[ROMEO:,'']",
    )
    return train(cfg, run), run


def test_tensorboard_holds_every_metric_and_the_samples(tracked_run):
    _, run = tracked_run
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert METRICS <= set(events.Tags()["scalars"])
    val_steps = [e.step for e in events.Scalars("val/loss")]
    assert val_steps == [3, 7]  # after steps 4 and 8
    assert len(events.Scalars("train/loss")) == 8
    assert all(0 < e.value < 1 for e in events.Scalars("train/mfu"))
    seen = [e.value for e in events.Scalars("train/tokens_seen")]
    assert seen[-1] == 8 * 8 * 32  # steps x sequences x tokens
    assert {"samples/0/text_summary", "samples/1/text_summary"} <= set(events.Tags()["tensors"])


def test_csv_holds_every_metric(tracked_run):
    _, run = tracked_run
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    logged = {key for row in rows for key, value in row.items() if value}
    assert METRICS <= logged


def test_wandb_logs_offline_with_the_config_and_sample_tables(tracked_run):
    _, run = tracked_run
    (offline,) = (run / "wandb").glob("offline-run-*")
    records = next(offline.glob("run-*.wandb")).read_bytes()
    assert b"tokens_per_step" in records and b"n_layer" in records  # the whole resolved config
    assert list((offline / "files" / "media" / "table").glob("samples_*.table.json"))


def test_samples_are_written_after_every_validation(tracked_run):
    _, run = tracked_run
    text = (run / "samples.md").read_text()
    assert text.count("## step") == 4  # 2 validations x 2 prompts
    assert "prompt 'ROMEO:'" in text and "prompt ''" in text
    assert "```\nROMEO:" in text


def test_loss_curve_is_drawn_at_the_end(tracked_run):
    _, run = tracked_run
    png = (run / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_wandb_never_prompts(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert not wandb_credentials_present() and wandb_mode("auto") == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_credentials_present() and wandb_mode("auto") == "online"
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode("auto") == "offline"  # the user's own setting wins
    assert wandb_mode("disabled") == "disabled"
    with pytest.raises(ValueError, match="mode"):
        wandb_mode("sometimes")
