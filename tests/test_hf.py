"""Weights to and from Hugging Face: export.py, loading folders written by transformers, greedy
parity with transformers' own generate, and refusing checkpoints that carry pickled code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from subprocess import PIPE

import pytest
import torch
import transformers
from tokenizers import Tokenizer

import export
import generate
from checkpoint import META_KEY, CheckpointError, load_checkpoint
from generation import generate as generate_tokens
from model import GPT
from model.hf import from_hf_state_dict
from tests.common import TINY_OVERRIDES, one_error_line, script_command, script_environment, train_here
from tests.tiny import EOT, train_tiny_gpt, write_checkpoint

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


def shakespeare_ids(tokenizer: Tokenizer, text: str, n: int, offset: int = 1000) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(text[offset : offset + 20 * n]).ids[:n]])


def assert_same_state(a: GPT, b: GPT) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ---- export --------------------------------------------------------------------------------------------


def test_export_round_trip_with_the_parity_check(tiny_run, tiny_gpt, tiny_tokenizer, tiny_text, tmp_path, capsys):
    out = tmp_path / "exported"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    difference = float(re.search(r"largest logit difference (\S+) over", stdout).group(1))
    assert difference <= 1e-4
    assert sorted(p.name for p in out.iterdir()) == sorted(export.FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # nothing left beside it

    # transformers alone reads it: same logits, same tokens
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    idx = shakespeare_ids(tiny_tokenizer, tiny_text, 32)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, tiny_gpt(idx)[0], rtol=0, atol=1e-5)
    sample = tiny_text[5000:6000]
    assert hf_tokenizer(sample)["input_ids"] == tiny_tokenizer.encode(sample).ids
    assert hf_tokenizer.decode(tiny_tokenizer.encode(sample).ids) == sample
    assert hf_tokenizer.eos_token == EOT and hf_tokenizer.eos_token_id == tiny_tokenizer.token_to_id(EOT)

    # and back: the very same weights and tokenizer
    loaded = load_checkpoint(out)
    assert_same_state(loaded.model, tiny_gpt)
    assert loaded.model.config == tiny_gpt.config and not loaded.model.training
    assert Tokenizer.from_str(loaded.tokenizer_json).encode(sample).ids == tiny_tokenizer.encode(sample).ids


def test_the_parity_check_catches_different_numbers(tiny_run, tiny_tokenizer, tiny_text, tmp_path, capsys):
    out = tmp_path / "exported"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 0
    other = train_tiny_gpt(tiny_tokenizer, tiny_text, steps=2, seed=1)
    difference, count = export.compare_logits(out, other, tiny_tokenizer)
    assert count == 32 and difference > 1e-2


def test_export_replaces_an_earlier_export_only_with_force(tiny_run, tmp_path, capsys):
    out = tmp_path / "exported"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 0
    (out / "generation_config.json").write_text("{}")  # as transformers' save_pretrained leaves it
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 1
    assert "--force" in capsys.readouterr().err and (out / "generation_config.json").exists()
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(export.FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]


@pytest.mark.slow
@pytest.mark.parametrize("out_exists", [False, True], ids=["new", "empty"])
def test_two_exports_to_one_folder_at_once_never_replace_each_other(tiny_run, tmp_path, out_exists):
    """Started together, the one that finishes second refuses --out rather than replacing the first's model
    without --force (saying that nothing was written where it found the folder free as it started)."""
    out = tmp_path / "exported"
    if out_exists:
        out.mkdir()
    command = script_command(("export.py", "--ckpt", str(tiny_run), "--out", "exported"), tmp_path)
    procs = [
        subprocess.Popen(command, cwd=tmp_path, env=script_environment(None, None), stdout=PIPE, stderr=PIPE, text=True)
        for _ in range(2)
    ]
    results = sorted((proc.wait(timeout=300), *proc.communicate()) for proc in procs)
    (ok, written, _), (refused, _, error) = results
    assert ok == 0 and written.startswith(f"wrote {out}: ")
    assert refused == 1 and "Traceback" not in error
    # the second found the first's model as it started (a loaded machine), or as it finished
    assert one_error_line(error) in (
        f"error: --out {out} is not empty; choose a new folder, or pass --force to replace the model in it",
        f"error: --out {out} is not empty; choose a new folder, or pass --force to replace the model in it "
        "(it was written while this export ran); nothing was written",
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(export.FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # no staging folder left


def test_force_never_deletes_the_users_files_beside_a_config_json(tiny_run, tmp_path, capsys):
    """A project folder with a config.json of its own is no model folder: --force refuses it, naming a
    file it would lose, and every file stays as it was."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    files = {"config.json": '{"learning_rate": 0.1}', "notes.txt": "mine", "src/main.py": "print('hi')\n"}
    for name, text in files.items():
        (project / name).write_text(text)
    assert export.main(["--ckpt", str(tiny_run), "--out", str(project), "--force"]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"error: --out {project} holds notes.txt, which is not a Hugging Face model's file; --force replaces only a "
        "folder of model files, and would lose it. Choose another folder"
    )
    del files["notes.txt"], files["src/main.py"]
    (project / "notes.txt").unlink()
    shutil.rmtree(project / "src")  # only the config.json left: it still describes no model
    assert export.main(["--ckpt", str(tiny_run), "--out", str(project), "--force"]) == 1
    assert "its config.json describes no model" in one_error_line(capsys.readouterr().err)
    assert {p.name: p.read_text() for p in project.iterdir()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # nothing written beside it


def test_a_model_without_biases_exports_with_zero_biases(tiny_tokenizer, tiny_text, tmp_path, capsys):
    gpt = train_tiny_gpt(tiny_tokenizer, tiny_text, steps=20, bias=False)
    ckpt = write_checkpoint(tmp_path / "nobias.ckpt", gpt, tiny_tokenizer)
    out = tmp_path / "exported"
    assert export.main(["--ckpt", str(ckpt), "--out", str(out)]) == 0
    assert "no biases" in capsys.readouterr().out
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert torch.all(hf.transformer.h[0].attn.c_attn.bias == 0) and torch.all(hf.transformer.ln_f.bias == 0)
    idx = shakespeare_ids(tiny_tokenizer, tiny_text, 32)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, gpt(idx)[0], rtol=0, atol=1e-5)


# ---- folders written by transformers -------------------------------------------------------------------


def test_load_checkpoint_reads_a_folder_saved_by_transformers(transformers_folder, tiny_gpt, tiny_tokenizer, tiny_text):
    gpt = load_checkpoint(transformers_folder).model
    assert not gpt.training and gpt.config.n_layer == 2 and gpt.config.block_size == 32
    hf = transformers.GPT2LMHeadModel.from_pretrained(transformers_folder).eval()
    idx = shakespeare_ids(tiny_tokenizer, tiny_text, 32)
    with torch.no_grad():
        torch.testing.assert_close(gpt(idx)[0], hf(idx).logits, rtol=0, atol=1e-5)
    assert_same_state(gpt, tiny_gpt)


def test_greedy_generation_equals_transformers_generate(transformers_folder, tiny_tokenizer, capsys):
    gpt = load_checkpoint(transformers_folder).model
    hf = transformers.GPT2LMHeadModel.from_pretrained(transformers_folder).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(transformers_folder)
    eot = tiny_tokenizer.token_to_id(EOT)
    generated = set()
    for prompt in ("ROMEO:", "First Citizen:\nWe are", "KING HENRY"):
        idx = torch.tensor([hf_tokenizer(prompt)["input_ids"]])
        new = gpt.config.block_size - idx.size(1)  # transformers stops at the context length
        ours = generate_tokens(gpt, idx, new, temperature=0, stop_tokens=[eot])
        with torch.no_grad():
            theirs = hf.generate(idx, max_new_tokens=new, do_sample=False, pad_token_id=eot)
        assert ours.tolist() == theirs.tolist(), prompt
        generated |= set(ours[0, idx.size(1) :].tolist())

        code = generate.main(
            ["--ckpt", str(transformers_folder), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(new)]
        )
        out = capsys.readouterr().out
        assert code == 0 and out == hf_tokenizer.decode(theirs[0], skip_special_tokens=True) + "\n"
    assert len(generated) > 5  # varied tokens, not one repeated: the comparison has something to compare


def test_gpt2_folders_with_only_vocab_and_merges_and_a_bin_file(
    transformers_folder, tiny_gpt, tiny_tokenizer, tiny_text, tmp_path
):
    """The layout of the original GPT-2 release: pytorch_model.bin with keys lacking `transformer.`,
    causal-mask buffers, and the tokenizer as vocab.json + merges.txt."""
    folder = tmp_path / "gpt2-like"
    folder.mkdir()
    shutil.copy(transformers_folder / "config.json", folder)
    hf = transformers.GPT2LMHeadModel.from_pretrained(transformers_folder)
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    torch.save(state, folder / "pytorch_model.bin")
    tiny_tokenizer.model.save(str(folder))  # vocab.json and merges.txt
    assert {"vocab.json", "merges.txt"} <= {p.name for p in folder.iterdir()} and not (
        folder / "tokenizer.json"
    ).exists()

    loaded = load_checkpoint(folder)
    assert_same_state(loaded.model, tiny_gpt)
    tokenizer = Tokenizer.from_str(loaded.tokenizer_json)
    sample = tiny_text[:3000] + EOT + " café → 🙂"
    assert tokenizer.encode(sample).ids == tiny_tokenizer.encode(sample).ids
    assert tokenizer.decode(tokenizer.encode(sample).ids) == tiny_tokenizer.decode(tiny_tokenizer.encode(sample).ids)
    assert tokenizer.token_to_id(EOT) == tiny_tokenizer.token_to_id(EOT)


def test_sharded_weights_are_read_whole(transformers_folder, tiny_gpt, tmp_path):
    folder = tmp_path / "sharded"
    transformers.GPT2LMHeadModel.from_pretrained(transformers_folder).save_pretrained(folder, max_shard_size="40KB")
    shutil.copy(transformers_folder / "tokenizer.json", folder)
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*.safetensors"))) > 1
    assert_same_state(load_checkpoint(folder).model, tiny_gpt)


def test_folders_tinygpt2_cannot_represent_are_refused(transformers_folder, tmp_path):
    folder = tmp_path / "relu"
    shutil.copytree(transformers_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    with pytest.raises(CheckpointError, match="activation_function is 'relu'"):
        load_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_checkpoint(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_checkpoint(folder)


@pytest.mark.parametrize("field, value", [("layer_norm_epsilon", "1e-5x"), ("resid_pdrop", [0.1])])
def test_a_config_json_number_of_the_wrong_type_is_refused_in_one_line(
    transformers_folder, tmp_path, field, value, capsys
):
    folder = tmp_path / "typo"
    shutil.copytree(transformers_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    for main, args in (
        (export.main, ["--ckpt", str(folder), "--out", "out"]),
        (generate.main, ["--ckpt", str(folder)]),
    ):
        assert main(args) == 1
        assert f"{field} is {value!r}, not a number" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["typo"]


@pytest.mark.parametrize("value", [False, 0, "yes"])
def test_a_config_json_that_does_not_tie_the_output_layer_plainly_is_refused(transformers_folder, tmp_path, value):
    """transformers ties lm_head to wte only for a true tie_word_embeddings: any other value would
    make its model another than ours."""
    folder = tmp_path / "untied"
    shutil.copytree(transformers_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": value}))
    with pytest.raises(CheckpointError, match=f"tie_word_embeddings is {value!r}; tinygpt2 computes GPT-2 as released"):
        load_checkpoint(folder)


def test_untied_output_layers_are_refused():
    state = {"transformer.wte.weight": torch.zeros(4, 2), "lm_head.weight": torch.ones(4, 2)}
    with pytest.raises(ValueError, match="not tied"):
        from_hf_state_dict(state)


# ---- pickled code is never run --------------------------------------------------------------------------


class Payload:
    """Unpickling this calls open(path, "w"): the file appearing means the pickle ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_carrying_a_pickle_payload_is_refused_and_the_payload_never_runs(tiny_run, tmp_path, capsys):
    ckpt = torch.load(tiny_run / "checkpoints" / "last.ckpt", weights_only=True)
    marker = tmp_path / "payload_ran"
    evil = tmp_path / "evil.ckpt"
    torch.save({**ckpt, "extra": Payload(marker)}, evil)
    legacy = tmp_path / "evil_legacy.ckpt"
    torch.save({**ckpt, "extra": Payload(marker)}, legacy, _use_new_zipfile_serialization=False)

    for path in (evil, legacy):
        # the payload is named as the pickle names it: io.open, or _io.open with other Python and torch versions
        with pytest.raises(CheckpointError, match=r"refused to load .*\((\w+\.)*open\)"):
            load_checkpoint(path)
        assert generate.main(["--ckpt", str(path), "--prompt", "ROMEO:"]) == 1
        assert "refused to load" in capsys.readouterr().err
        assert export.main(["--ckpt", str(path), "--out", str(tmp_path / "out")]) == 1
        assert "refused to load" in capsys.readouterr().err
    hf_folder = tmp_path / "evil_hf"
    hf_folder.mkdir()
    (hf_folder / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 1, "n_embd": 4, "n_positions": 4, "vocab_size": 8})
    )
    torch.save({"wte.weight": torch.zeros(8, 4), "extra": Payload(marker)}, hf_folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(hf_folder)
    assert not marker.exists() and not (tmp_path / "out").exists()

    # the same file loaded the unsafe way does run it: the test above could have failed
    control = tmp_path / "control.pkl"
    torch.save({"extra": Payload(tmp_path / "control_ran")}, control)
    torch.load(control, weights_only=False)
    assert (tmp_path / "control_ran").exists()


# ---- an export behaves like a Hugging Face model -------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny-model"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out)]) == 0
    return out


def test_the_readme_snippet_and_a_padded_pipeline_batch_work_on_an_export(exported):
    """The README's transformers lines, as written: generate stays inside the context by itself, and the
    pipeline serves a batch of two prompts of different lengths (padded on the left)."""
    model = transformers.GPT2LMHeadModel.from_pretrained(exported)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tokenizer("ROMEO:", return_tensors="pt").input_ids
    out = model.generate(ids, do_sample=True)
    assert out.shape[1] == model.config.n_positions  # up to the context, not past it

    generate = transformers.pipeline("text-generation", model=str(exported))
    assert generate.tokenizer.pad_token == EOT and generate.tokenizer.padding_side == "left"
    prompts = ["ROMEO:", "JULIET: O Romeo, Romeo, wherefore"]
    options = dict(max_new_tokens=6, do_sample=False, handle_long_generation="hole")  # as docs/hugging-face.md
    batch = generate(prompts, batch_size=2, **options)
    alone = [generate(p, **options)[0]["generated_text"] for p in prompts]
    assert [rows[0]["generated_text"] for rows in batch] == alone  # padding changes nothing
    # a prompt longer than the context leaves room for the new tokens, whatever text the tokenizer learned
    long = "JULIET: " + "O Romeo, Romeo, wherefore art thou Romeo? " * 4
    assert len(tokenizer(long).input_ids) > model.config.n_positions
    (row,) = generate(long, **options)
    assert row["generated_text"].startswith(long)


def test_the_model_card_says_what_the_model_is_and_its_limits(exported, tiny_run, tmp_path):
    card = (exported / "README.md").read_text(encoding="utf-8")
    config = json.loads((exported / "config.json").read_text())
    assert card.startswith("---\nlibrary_name: transformers\n") and "tags: [gpt2, tinygpt2]" in card
    assert f"a context of {config['n_positions']} tokens" in card and "IndexError" in card
    assert "Final validation" not in card  # the fixture's run has no result.json: no scores made up
    assert json.loads((exported / "generation_config.json").read_text())["max_length"] == config["n_positions"]

    # a run of 40 steps that finished: its result.json scores the last weights, and only those
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    text_file = str(tmp_path / "private" / "notes" / "my_text.txt")  # a path of the machine it was trained on
    ckpt[META_KEY]["config"] = {"trainer": {"max_steps": 40}, "data": {"source": "text", "path": text_file}}
    for step in (20, 40):
        torch.save({**ckpt, "global_step": step}, run / "checkpoints" / f"step-{step:06d}.ckpt")
    result = {"finished": True, "metrics": {"val/loss": 3.4347312, "val/bpc": 2.1956188}}
    (run / "result.json").write_text(json.dumps(result))
    cards = {}
    for step in (20, 40):
        out = tmp_path / f"out-{step}"
        assert export.main(["--ckpt", str(run / "checkpoints" / f"step-{step:06d}.ckpt"), "--out", str(out)]) == 0
        cards[step] = (out / "README.md").read_text(encoding="utf-8")
    assert "for 40 steps. Final validation loss 3.4347 nats per token, 2.1956 bits per character." in cards[40]
    assert "for 20 steps (of the run's 40)." in cards[20] and "Final validation" not in cards[20]
    assert "Trained with tinygpt2 on my_text.txt for 40 steps" in cards[40] and str(tmp_path) not in cards[40]
    assert 'model="path/to/out-40"' in cards[40]  # the folder's own name, not that of where it was staged


def test_force_replaces_an_export_with_its_card_but_not_a_readme_of_the_users(exported, tiny_run, tmp_path, capsys):
    again = tmp_path / "again"
    shutil.copytree(exported, again)
    assert export.main(["--ckpt", str(tiny_run), "--out", str(again), "--force"]) == 0
    (again / "README.md").write_text("# My project\n\nNotes I keep.\n")
    assert export.main(["--ckpt", str(tiny_run), "--out", str(again), "--force"]) == 1
    assert "holds README.md, which is not a Hugging Face model's file" in one_error_line(capsys.readouterr().err)
    assert (again / "README.md").read_text() == "# My project\n\nNotes I keep.\n"


def test_push_to_hub_without_a_login_is_refused_before_any_work(tiny_run, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored token either
    out = tmp_path / "model"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out), "--push-to-hub", "me/tiny"]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        "error: --push-to-hub needs a Hugging Face login; run `hf auth login` or set HF_TOKEN"
    )
    assert not out.exists() and not any(p.name.startswith(".model") for p in tmp_path.iterdir())  # no staging


def test_push_to_hub_offline_keeps_the_folder_and_says_how_to_upload_later(tiny_run, tmp_path, monkeypatch, capsys):
    """Up to the upload call, for real: the Hub cannot be reached here, and the export says so in one
    line after writing the folder."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "model"
    assert export.main(["--ckpt", str(tiny_run), "--out", str(out), "--push-to-hub", "me/tiny"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {out} is written, but uploading it to me/tiny failed (")
    assert line.endswith(f"upload it later with `hf upload me/tiny {out}`")
    assert sorted(p.name for p in out.iterdir()) == sorted(export.FILES)


def test_a_char_tokenizer_exports_its_own_unknown_token(tmp_path, small_text, capsys):
    """The char tokenizer maps unseen characters to <|unk|>: transformers is told so, rather than that
    <|endoftext|> is the unknown token (which it never is for this tokenizer)."""
    tiny = [a for a in TINY_OVERRIDES if not a.startswith("tokenizer.")]
    ran = train_here(*tiny, f"data.path={small_text}", "tokenizer=char")
    assert ran.returncode == 0, ran.stderr[-2000:]
    (run,) = tmp_path.glob("outputs/*/*/checkpoints")
    assert export.main(["--ckpt", str(run.parent), "--out", str(tmp_path / "hf")]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.unk_token == "<|unk|>" and tokenizer("☕").input_ids == [tokenizer.unk_token_id]
    capsys.readouterr()
