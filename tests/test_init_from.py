"""`train.py init_from=PATH`: fine-tuning from a Hugging Face folder or a tinygpt2 checkpoint, keeping
its tokenizer and shape, and refusing model settings that contradict it."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from tokenizers import Tokenizer

from model import ConfigError
from model.checkpoint import load_checkpoint
from training.init_from import model_keys_in, start_from
from training.run import train

from .common import ROOT, TINY

# the tiny run settings, minus the model shape and tokenizer: those come from init_from
RUN = [*(o for o in TINY if not o.startswith(("model.", "tokenizer."))), "samples.enabled=false"]


@contextmanager
def command_line(*overrides: str):
    """The composed config, with Hydra's record of the command line set as `python train.py` sets it."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        full = compose("train", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(full)
    cfg = full.copy()
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        yield cfg
    finally:
        HydraConfig.instance().cfg = None


def same_tokenizer(a: str, b: str) -> bool:
    return Tokenizer.from_str(a).to_str() == Tokenizer.from_str(b).to_str()


def test_fine_tuning_from_a_folder_saved_by_transformers(transformers_folder, tiny_gpt, small_text, tmp_path):
    with command_line(*RUN, f"data.path={small_text}", f"init_from={transformers_folder}") as cfg:
        result = train(cfg, tmp_path / "run")
    assert result.metrics["val/loss"] < 4.5  # a fresh model of this size starts near ln(300) = 5.7

    tuned = load_checkpoint(tmp_path / "run")
    assert tuned.model.config == tiny_gpt.config  # the folder's shape, not the nano preset
    assert same_tokenizer(tuned.tokenizer_json, (transformers_folder / "tokenizer.json").read_text())
    assert tuned.config["init_from"] == str(transformers_folder)
    start, end = tiny_gpt.transformer.wte.weight, tuned.model.transformer.wte.weight
    assert not torch.equal(start, end) and (start - end).abs().max() < 0.05  # trained, from those weights


def test_fine_tuning_from_a_checkpoint_with_a_shorter_context(tiny_run, tiny_gpt, small_text, tmp_path):
    with command_line(*RUN, f"data.path={small_text}", f"init_from={tiny_run}", "model.block_size=16", "model.dropout=0.1") as cfg:
        train(cfg, tmp_path / "run")
    tuned = load_checkpoint(tmp_path / "run")
    assert tuned.model.config.block_size == 16 and tuned.model.config.dropout == 0.1
    assert tuned.model.config.n_head == tiny_gpt.config.n_head
    assert tuned.model.transformer.wpe.weight.shape == (16, 32)


def test_model_settings_that_contradict_the_checkpoint_are_refused(tiny_run, small_text):
    with command_line(*RUN, f"data.path={small_text}", f"init_from={tiny_run}", "model.n_layer=3") as cfg:
        with pytest.raises(ConfigError, match=r"model.n_layer=3 contradicts init_from=.*whose n_layer is 2"):
            start_from(cfg)
    with command_line(f"init_from={tiny_run}", "model.block_size=64") as cfg:
        with pytest.raises(ConfigError, match="model.block_size=64 is more than the 32 positions"):
            start_from(cfg)
    with command_line(f"init_from={tiny_run}", "model=baby") as cfg:  # a preset names every setting
        with pytest.raises(ConfigError, match="contradicts"):
            start_from(cfg)
    with command_line(f"init_from={tiny_run}") as cfg:  # the nano preset, not asked for: no conflict
        start = start_from(cfg)
    assert start.config.n_layer == 2 and start.config.vocab_size == 300


def test_which_model_settings_the_command_line_names():
    model = {"n_layer": 4, "n_head": 4, "dropout": 0.0}
    assert model_keys_in(["model.n_layer=3", "+model.dropout=0.1", "seed=1", "data.path=x"], model) == {"n_layer", "dropout"}
    assert model_keys_in(["model=baby"], model) == set(model)
    assert model_keys_in(["init_from=/models/model.ckpt"], model) == set()


@pytest.mark.slow
def test_train_py_refuses_a_contradicting_override_in_one_line(transformers_folder, small_text, tmp_path):
    args = [*RUN, f"data.path={small_text}", f"init_from={transformers_folder}", "model.n_head=2", f"hydra.run.dir={tmp_path / 'r'}"]
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: model.n_head=2 contradicts init_from=") and "whose n_head is 4" in last
    assert not (tmp_path / "r" / "checkpoints").exists()
