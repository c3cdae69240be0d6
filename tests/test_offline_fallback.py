"""With no Tiny Shakespeare to be had (no copy, no network), the default run trains on the offline pydoc
corpus: sized to it, and saying so when it starts and when it ends."""

from __future__ import annotations

import pytest
import yaml

from shell.checks import plain
from shell.settings import FALLBACK_PASSES, FALLBACK_PASSES_BPE_DROPOUT, settle_new
from tests.common import NO_DOWNLOAD, ROOT, TINY_MODEL_OVERRIDES, compose_config, only_run, train_here

OFFLINE = ["data.local_copies=[]", f"data.url={NO_DOWNLOAD}"]  # as on a machine with neither
# a global batch large enough that the corpus is a few hundred steps, as with the default model
BATCH = ["data.batch_size=64", "model.block_size=64", "logger=csv", "latest_link=null", "trainer.precision=32-true"]


def resolved(*overrides: str, named=(), data=OFFLINE):
    """The settings a new run settles for these overrides (the data prepared), as train.py settles them."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", [*TINY_MODEL_OVERRIDES, *data, *BATCH, *overrides], return_hydra_config=True)
    settings, _ = settle_new(plain(cfg), list(named), dict(cfg.hydra.runtime.choices))
    return settings


@pytest.mark.parametrize(
    ("dropout", "passes"),
    [("0.1", FALLBACK_PASSES_BPE_DROPOUT), ("0.0", FALLBACK_PASSES)],
    ids=["bpe_dropout", "without"],
)
def test_the_fallback_is_cut_to_a_few_passes_and_samples_from_endoftext(caplog, dropout, passes):
    settings = resolved(f"tokenizer.dropout={dropout}")
    train_tokens = settings.tokens.meta["train_tokens"]
    steps = settings.max_steps
    default = compose_config().trainer.max_steps
    assert steps < default and steps == -(-passes * train_tokens // (64 * 64))
    assert settings.values["samples"]["prompts"] == [""]  # not ROMEO: for Python's help texts
    [warning] = [r.getMessage() for r in caplog.records if "offline pydoc corpus" in r.getMessage()]
    assert f"for {steps:,} steps ({passes} passes" in warning and f"rather than {default:,}" in warning
    assert "data.path=" in warning
    assert settings.saved()["trainer"]["max_steps"] == steps  # what config.yaml records, and a resume keeps


def test_a_length_given_on_the_command_line_is_kept(caplog):
    settings = resolved("trainer.max_steps=80", named=["trainer.max_steps"])
    assert settings.max_steps == 80
    [warning] = [r.getMessage() for r in caplog.records if "offline pydoc corpus" in r.getMessage()]
    assert "trainer.max_steps=80 as given" in warning


def test_a_chosen_corpus_is_never_cut(caplog):
    settings = resolved(data=["data=pydoc"])
    assert settings.max_steps == compose_config().trainer.max_steps and not settings.tokens.fallback
    assert not [r for r in caplog.records if "offline pydoc corpus" in r.getMessage()]


@pytest.mark.slow
def test_the_default_command_offline_says_what_it_trained_on_at_start_and_end(tmp_path):
    ran = train_here(*TINY_MODEL_OVERRIDES, *OFFLINE, *BATCH)
    assert ran.returncode == 0, ran.stderr[-2000:]
    lines = (ran.stdout + ran.stderr).splitlines()
    [start] = [line for line in lines if "training on the offline pydoc corpus" in line]
    [end] = [line for line in lines if "this model learned the offline pydoc corpus" in line]
    [suggestion] = [line for line in lines if "sample from it:" in line]
    assert "--prompt" not in suggestion  # no ROMEO: for a model of Python's help texts
    run = only_run(tmp_path / "outputs")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (
        f"for {saved['trainer']['max_steps']:,} steps" in start
        and saved["trainer"]["max_steps"] < compose_config().trainer.max_steps
    )
    assert str(run) in suggestion
