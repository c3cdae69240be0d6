"""Lightning's and wandb's own ways of using a run work on tinygpt2's runs: GPTModule.load_from_checkpoint
on a checkpoint (old or new), and an offline wandb run that keeps all it needs in its run folder."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import wandb

from checkpoint import META_KEY, load_checkpoint
from model import GPT, GPTConfig
from shell.folders import RunFolder
from tests.common import TINY_OVERRIDES, train_here
from tests.tiny import tiny_config
from training.module import GPTModule

OPTIM = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
    "warmup_steps": 1,
    "schedule": "cosine",
    "min_lr_ratio": 0.1,
    "max_nonfinite_in_a_row": 3,
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_text) -> Path:
    """The newest checkpoint of a tiny real run."""
    run = tmp_path_factory.mktemp("trained") / "run"
    ran = train_here(*TINY_OVERRIDES, f"data.path={small_text}", f"hydra.run.dir={run}", cwd=run.parent)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return RunFolder(run).last


def logits(model: GPT) -> torch.Tensor:
    tokens = torch.arange(24).remainder(model.config.vocab_size).view(2, 12)
    with torch.no_grad():
        return model.eval()(tokens)[0]


def test_load_from_checkpoint_rebuilds_the_module_that_wrote_it(trained):
    module = GPTModule.load_from_checkpoint(trained)
    assert torch.equal(logits(module.model), logits(load_checkpoint(trained).model))
    meta = torch.load(trained, weights_only=True)[META_KEY]
    assert module.tokenizer_json == meta["tokenizer"] == RunFolder(trained.parent.parent).tokenizer_file.read_text()
    assert module.run_config == meta["config"]
    assert module.max_steps == 6 and module.optim == meta["config"]["optim"]
    assert 0 < module.val_tokens_per_char < 1  # a byte-level BPE of 300 tokens: fewer tokens than characters


def test_hyperparameters_are_plain_values_and_leave_the_tokenizer_to_the_description(trained):
    hparams = torch.load(trained, weights_only=True)["hyper_parameters"]  # weights-only loading reads them
    assert hparams["model_config"] == GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=300).to_dict()
    assert set(hparams) == {
        "model_config", "optim", "max_steps", "val_tokens_per_char", "max_time_seconds",
        "accumulation", "gradient_clip_val", "gradient_clip_algorithm",
    }  # fmt: skip
    assert (hparams["accumulation"], hparams["gradient_clip_val"], hparams["gradient_clip_algorithm"]) == (1, 1.0, None)


def test_a_checkpoint_written_before_the_hyperparameters_loads_from_its_description(trained, tmp_path):
    ckpt = torch.load(trained, weights_only=True)
    del ckpt["hyper_parameters"]
    old = tmp_path / "run" / "checkpoints" / "last.ckpt"
    old.parent.mkdir(parents=True)
    torch.save(ckpt, old)
    module = GPTModule.load_from_checkpoint(old.parent.parent)  # a run folder, as load_checkpoint takes
    assert torch.equal(logits(module.model), logits(load_checkpoint(trained).model))
    assert module.max_steps == 6 and module.tokenizer_json == ckpt[META_KEY]["tokenizer"]
    assert math.isnan(module.val_tokens_per_char)  # not recorded then
    assert GPTModule.load_from_checkpoint(old, val_tokens_per_char=0.5).val_tokens_per_char == 0.5


def test_load_from_checkpoint_leaves_the_callers_random_state(trained):
    random.seed(7)
    state = random.getstate()
    GPTModule.load_from_checkpoint(trained)
    assert random.getstate() == state  # only a resumed Trainer takes the run's random state


def test_the_model_config_may_be_a_dict_or_a_gptconfig():
    config = tiny_config()
    as_dict = GPTModule(config.to_dict(), OPTIM, max_steps=10, val_tokens_per_char=0.5)
    assert (
        as_dict.model.config == config == GPTModule(config, OPTIM, max_steps=10, val_tokens_per_char=0.5).model.config
    )


def test_offline_wandb_stages_the_samples_tables_inside_the_run_folder(small_text, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    for variable in ("WANDB_DATA_DIR", "XDG_DATA_HOME"):  # wandb's default: ~/.local/share/wandb
        monkeypatch.delenv(variable, raising=False)
    run = tmp_path / "run"
    ran = train_here(
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "logger=wandb",
        "samples.enabled=true",
        "samples.max_new_tokens=4",
        f"hydra.run.dir={run}",
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    wandb.teardown()  # wandb's service done writing and ended, as it is once the process that started it ends
    staging = run / "wandb" / "data" / "artifacts" / "staging"
    staged = list(staging.iterdir())
    assert any(b'"_type": "table"' in p.read_bytes() for p in staged if p.is_file())
    assert not (home / ".local" / "share" / "wandb").exists()
    (records,) = run.glob("wandb/offline-run-*/run-*.wandb")
    recorded = records.read_bytes()  # what `wandb sync` reads: the staged files by their full paths
    assert recorded.count(b"/artifacts/staging/") == recorded.count(str(staging).encode() + b"/") > 0
