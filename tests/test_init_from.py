"""`train.py init_from=PATH`: fine-tuning from a Hugging Face folder or a tinygpt2 checkpoint, keeping
its tokenizer and shape, and refusing model settings that contradict it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

import export
from checkpoint import CheckpointError, load_checkpoint
from model import ConfigError
from shell.init_from import kept_tokenizer, model_keys_in, start_from
from tests.common import TINY_OVERRIDES, compose_config, refused, train_here
from tests.tiny import train_tiny_gpt, write_checkpoint

# the tiny run settings, minus the model shape and tokenizer: those come from init_from
RUN = [*(o for o in TINY_OVERRIDES if not o.startswith(("model.", "tokenizer."))), "samples.enabled=false"]


def started_from(*overrides: str):
    """What init_from gives a run started with these overrides (the model settings they name are asked for)."""
    cfg = compose_config(*overrides)
    return start_from(cfg, model_keys_in(overrides, cfg.model))


def same_tokenizer(a: str, b: str) -> bool:
    return Tokenizer.from_str(a).to_str() == Tokenizer.from_str(b).to_str()


def trained_into(run, *overrides: str) -> dict:
    """python train.py OVERRIDES hydra.run.dir=run, in this process: what its result.json records."""
    ran = train_here(*overrides, f"hydra.run.dir={run}")
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads((run / "result.json").read_text())


def test_fine_tuning_from_a_folder_saved_by_transformers(transformers_folder, tiny_gpt, small_text, tmp_path):
    result = trained_into(tmp_path / "run", *RUN, f"data.path={small_text}", f"init_from={transformers_folder}")
    assert result["metrics"]["val/loss"] < 4.5  # a fresh model of this size starts near ln(300) = 5.7

    tuned = load_checkpoint(tmp_path / "run")
    assert tuned.model.config == tiny_gpt.config  # the folder's shape, not the nano preset
    assert same_tokenizer(tuned.tokenizer_json, (transformers_folder / "tokenizer.json").read_text())
    assert tuned.config["init_from"] == str(transformers_folder)
    assert tuned.config["tokenizer"] == {"kind": "pretrained", "path": str(transformers_folder)}  # what it used
    start, end = tiny_gpt.transformer.wte.weight, tuned.model.transformer.wte.weight
    assert not torch.equal(start, end) and (start - end).abs().max() < 0.05  # trained, from those weights

    exported = tmp_path / "hf"
    assert export.main(["--ckpt", str(tmp_path / "run"), "--out", str(exported)]) == 0
    card = (exported / "README.md").read_text(encoding="utf-8")
    assert (
        f"Fine-tuned with tinygpt2 from {transformers_folder.name} on {small_text.name}" in card
    )  # no paths of this machine
    assert f"(the tokenizer of {transformers_folder.name};" in card


def test_fine_tuning_from_a_checkpoint_with_a_shorter_context(tiny_run, tiny_gpt, small_text, tmp_path):
    overrides = [*RUN, f"data.path={small_text}", f"init_from={tiny_run}", "model.block_size=16", "model.dropout=0.1"]
    trained_into(tmp_path / "run", *overrides)
    tuned = load_checkpoint(tmp_path / "run")
    assert tuned.model.config.block_size == 16 and tuned.model.config.dropout == 0.1
    assert tuned.model.config.n_head == tiny_gpt.config.n_head
    assert tuned.model.transformer.wpe.weight.shape == (16, 32)


def test_model_settings_that_contradict_the_checkpoint_are_refused(tiny_run, small_text):
    with pytest.raises(ConfigError, match=r"model.n_layer=3 contradicts init_from=.*whose n_layer is 2"):
        started_from(*RUN, f"data.path={small_text}", f"init_from={tiny_run}", "model.n_layer=3")
    with pytest.raises(ConfigError, match="model.block_size=64 is more than the 32 positions"):
        started_from(f"init_from={tiny_run}", "model.block_size=64")
    with pytest.raises(ConfigError, match="contradicts"):
        started_from(f"init_from={tiny_run}", "model=baby")  # a preset names every setting
    started = started_from(f"init_from={tiny_run}")  # the nano preset, not asked for: no conflict
    assert started.config.n_layer == 2 and started.config.vocab_size == 300


def test_which_model_settings_the_command_line_names():
    model = {"n_layer": 4, "n_head": 4, "dropout": 0.0}
    assert model_keys_in(["model.n_layer=3", "+model.dropout=0.1", "seed=1", "data.path=x"], model) == {
        "n_layer",
        "dropout",
    }
    assert model_keys_in(["model=baby"], model) == set(model)
    assert model_keys_in(["init_from=/models/model.ckpt"], model) == set()


def test_train_py_refuses_a_contradicting_override_in_one_line(transformers_folder, small_text, tmp_path):
    args = [
        *RUN,
        f"data.path={small_text}",
        f"init_from={transformers_folder}",
        "model.n_head=2",
        f"hydra.run.dir={tmp_path / 'r'}",
    ]
    line = refused(*args)  # (and the run folder made for it taken back)
    assert line.startswith("model.n_head=2 contradicts init_from=") and "whose n_head is 4" in line


def test_a_fine_tune_whose_context_differs_from_the_preset_resolves_its_batch_with_that_context(
    tiny_tokenizer, tiny_text, small_text, tmp_path
):
    """The global batch follows the model shape init_from gives, not the preset's, so the run can be
    continued: 8 sequences of the checkpoint's 64 tokens, where the nano preset has 32."""
    import yaml

    wide = write_checkpoint(
        tmp_path / "wide.ckpt", train_tiny_gpt(tiny_tokenizer, tiny_text, steps=1, block_size=64), tiny_tokenizer
    )
    run = tmp_path / "run"
    trained_into(run, *RUN, f"data.path={small_text}", f"init_from={wide}", "checkpoint.every_n_steps=2")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["block_size"] == 64 and saved["tokens_per_step"] == 8 * 64
    continued = train_here(f"resume={run}", "trainer.max_steps=8")
    assert continued.returncode == 0, continued.stderr[-2000:]
    assert json.loads((run / "result.json").read_text())["step"] == 8


def test_tokenizer_settings_that_contradict_the_checkpoint_are_refused(tiny_run, tmp_path):
    """The run keeps the tokenizer its weights learned with: a tokenizer setting that would build another
    is refused rather than recorded and ignored; tokenizer=pretrained with that same vocabulary is kept."""
    start = started_from(f"init_from={tiny_run}")
    bpe = {"kind": "bpe", "vocab_size": 1024, "max_train_chars": 10_000_000}
    assert kept_tokenizer(bpe, start, []) == {"kind": "pretrained", "path": str(start.source)}
    with pytest.raises(ConfigError, match=r"^tokenizer.vocab_size=512 cannot apply with init_from=.*\(300 tokens\)"):
        kept_tokenizer({**bpe, "vocab_size": 512}, start, ["tokenizer.vocab_size=512"])
    with pytest.raises(ConfigError, match=r"^tokenizer=char cannot apply"):
        kept_tokenizer({"kind": "char"}, start, ["tokenizer=char"])
    same = tmp_path / "same.json"
    same.write_text(start.tokenizer.to_str())
    pretrained = {"kind": "pretrained", "path": str(same)}
    assert kept_tokenizer(pretrained, start, ["tokenizer.kind", "tokenizer.path"]) == pretrained
    other = tmp_path / "other.json"
    other.write_text(Tokenizer.from_str(start.tokenizer.to_str()).to_str().replace('"<|endoftext|>"', '"<|end|>"'))
    with pytest.raises(ConfigError, match=r"tokenizer.path=.*other.json holds another vocabulary"):
        kept_tokenizer({"kind": "pretrained", "path": str(other)}, start, ["tokenizer.path"])


def test_train_py_refuses_a_tokenizer_override_with_init_from_in_one_line(tiny_run, small_text):
    line = refused(*RUN, f"data.path={small_text}", f"init_from={tiny_run}", "tokenizer=char")
    assert line.startswith("tokenizer.kind=char cannot apply with init_from=") and "leave the tokenizer" in line


def test_train_py_refuses_a_folder_whose_weights_do_not_fit_its_config_json_before_any_run_folder(
    transformers_folder, small_text, tmp_path
):
    """A config.json naming a longer context than its weight file has rows for: refused in one line
    naming the tensor and both shapes, where Lightning's setup ended in load_state_dict's traceback
    with config.yaml, tokenizer.json and train.log left in a run folder."""
    folder = tmp_path / "longer context"
    shutil.copytree(transformers_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_positions": 64, "n_ctx": 64}))
    assert refused(*RUN, f"data.path={small_text}", f"init_from='{folder}'") == (
        f"weights in {folder} do not fit the model it describes: size mismatch for "
        "transformer.wpe.weight: (32, 32) in the checkpoint, (64, 32) in the model"
    )  # (and no run folder)


def test_train_py_init_from_a_hub_name_says_where_its_weights_are_or_how_to_get_them(
    transformers_folder, tmp_path, monkeypatch
):
    """init_from downloads nothing: `gpt2` with an empty Hugging Face cache says it was never downloaded
    and how to get it; with a copy in the cache (as transformers keeps one), names that folder."""
    import huggingface_hub

    hub = tmp_path.parent / f"{tmp_path.name}-hf_home" / "hub"  # (the cache this process's Hugging Face reads)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    line = refused(*RUN, "init_from=gpt2")
    assert "If gpt2 is a Hugging Face Hub model: init_from reads only local files, and it was never downloaded" in line
    assert "--local-dir hf/gpt2), then pass init_from=hf/gpt2" in line
    cached = hub / "models--gpt2"
    shutil.copytree(transformers_folder, cached / "snapshots" / "0123abc")
    (cached / "refs").mkdir()
    (cached / "refs" / "main").write_text("0123abc")
    assert refused(*RUN, "init_from=gpt2") == (
        "init_from=gpt2 does not exist here, but the Hugging Face cache holds a copy of gpt2: "
        f"pass init_from={cached / 'snapshots' / '0123abc'}"
    )  # (and no run folder)


def test_weights_that_are_not_finite_are_refused_before_a_run_trains_on_them(transformers_folder, tmp_path):
    folder = tmp_path / "nan"
    shutil.copytree(transformers_folder, folder)
    state = load_file(folder / "model.safetensors")
    state["transformer.h.1.ln_2.weight"][0] = float("nan")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"nan holds weights that are not finite numbers \(.*h.1.ln_2.weight\)"):
        started_from(f"init_from={folder}")


def test_a_tokenizer_without_end_of_text_trains_without_the_samples_it_cannot_start(
    transformers_folder, small_text, tmp_path
):
    """data=text gives no sample prompts, so samples would start from <|endoftext|>: a folder whose
    tokenizer lacks it trains all the same (prompts the user never gave never stop a run), without text
    samples, and one line says why and what gives them."""
    folder = tmp_path / "no-eot"
    shutil.copytree(transformers_folder, folder)
    tokenizer = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(tokenizer.replace('"<|endoftext|>"', '"<|end|>"'))
    ran = train_here(*RUN[:-1], "data=text", f"data.path={small_text}", f"init_from={folder}")
    assert ran.returncode == 0, ran.stderr[-2000:]
    said = [line for line in (ran.stdout + ran.stderr).splitlines() if "no text samples in this run" in line]
    assert len(said) == 1 and said[0].endswith(
        "no text samples in this run: its tokenizer has no <|endoftext|> to start them from; give prompts to "
        "start them from (samples.prompts='[ROMEO:]')"
    )
    (run,) = tmp_path.glob("outputs/*/*/checkpoints")
    assert not (run.parent / "samples.md").exists()
