"""explain.py: the attention walk-through on a trained model, its numbers checked against the model's own."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata

import pytest
import torch

import explain
from checkpoint import load_checkpoint
from data.tokenizer import train_char
from tests.common import ROOT, one_error_line, run_script
from tests.tiny import untrained_gpt, write_checkpoint


def explained(capsys, *args) -> tuple[dict, str]:
    """explain.py --json run in this process: the parsed document and what went to stderr."""
    code = explain.main(["--json", *map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err


def refused_explanation(capsys, *args) -> str:
    """explain.py run in this process with these arguments: the one error line it answers with."""
    code = explain.main([*map(str, args)])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    return one_error_line(err)


def steps_by_name(document: dict) -> dict[str, dict]:
    return {step["name"]: step for step in document["steps"]}


def test_explain_py_prints_the_steps_when_run_as_a_user_runs_it(tiny_run, tmp_path):
    proc = run_script("explain.py", "--ckpt", str(tiny_run), "--prompt", "ROMEO:", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    out = proc.stdout
    T, C, nh, hs = 6, 32, 4, 8  # "ROMEO:" is six tokens for the tiny BPE
    for code, shape in [
        ("idx", (1, T)),
        ("x = wte(idx) + wpe(arange(T))", (1, T, C)),
        ("qkv = c_attn(ln_1(x))", (1, T, 3 * C)),
        ("q.view(B, T, nh, hs).transpose(1, 2)", (1, nh, T, hs)),
        ("q @ k.transpose(-2, -1) / sqrt(hs)", (1, nh, T, T)),
        ("y.transpose(1, 2).contiguous().view(B, T, C)", (1, T, C)),
        ("x + out", (1, T, C)),
    ]:
        assert f"{code} " in out and f" {shape}\n" in out, code
    assert "✓" in out and "·" in out and "sum = 1.000000" in out
    for check in (
        "max |step by step - block.attn(block.ln_1(x))|",
        "max |per-head - combined|",
        "per-head 3,168 = combined c_attn 3,168",
        "max |cached step - full forward at the last position|",
    ):
        assert check in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_json_is_the_only_output_and_its_shapes_follow_the_config(tiny_run):
    proc = run_script("explain.py", "--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--json", timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    document = json.loads(proc.stdout)
    c = document["config"]
    C, nh, T = c["n_embd"], c["n_head"], document["tokens"]
    hs = C // nh
    shapes = {name: step["shape"] for name, step in steps_by_name(document).items()}
    assert (c["n_layer"], nh, C, T) == (2, 4, 32, 6)
    assert shapes["idx"] == [1, T] and shapes["wpe"] == [T, C]
    assert shapes["x"] == shapes["ln_1"] == shapes["split"] == shapes["merge"] == shapes["residual"] == [1, T, C]
    assert shapes["c_attn"] == [1, T, 3 * C]
    assert shapes["q"] == shapes["k"] == shapes["v"] == shapes["att_v"] == [1, nh, T, hs]
    assert shapes["scores"] == shapes["mask"] == shapes["softmax"] == [1, nh, T, T]
    assert all(step["meaning"] for step in document["steps"])


@pytest.mark.parametrize("layer, head", [(0, 0), (1, 3)])
def test_the_walk_gives_the_models_own_numbers(tiny_run, tiny_gpt, tiny_tokenizer, capsys, layer, head):
    document, _ = explained(capsys, "--ckpt", tiny_run, "--prompt", "ROMEO: my lord", "--layer", layer, "--head", head)
    assert (document["layer"], document["head"]) == (layer, head)
    assert document["layer_max_diff"] < 1e-5  # step by step == block.attn(block.ln_1(x))
    softmax = steps_by_name(document)["softmax"]
    assert softmax["row_sum"] == pytest.approx(1.0, abs=1e-6) and sum(softmax["row"]) == pytest.approx(1.0, abs=1e-6)
    ids = steps_by_name(document)["idx"]["values"]
    assert ids == tiny_tokenizer.encode("ROMEO: my lord").ids
    weights = tiny_gpt.attention_weights(torch.tensor([ids]))[layer][0, head, -1]  # the model's own attention
    assert torch.allclose(torch.tensor(softmax["row"]), weights, atol=1e-6)


def test_per_head_projections_equal_the_combined_c_attn(tiny_run, capsys):
    document, _ = explained(capsys, "--ckpt", tiny_run, "--prompt", "ROMEO:", "--layer", 1)
    C, nh = document["config"]["n_embd"], document["config"]["n_head"]
    assert document["per_head_max_diff"] < 1e-5
    assert document["per_head_params"] == document["combined_params"] == 3 * C * C + 3 * C
    assert document["per_head_linears"] == 3 * nh


def test_each_per_head_linear_is_its_heads_slice_of_c_attn(tiny_gpt):
    attn = tiny_gpt.transformer.h[0].attn
    x = torch.randn(2, 5, attn.n_embd)
    B, T, C = x.shape
    with torch.no_grad():
        combined = [t.view(B, T, attn.n_head, -1) for t in attn.c_attn(x).split(C, dim=2)]  # q, k, v per head
        for heads, part in zip(explain.per_head_linears(attn), combined, strict=True):
            assert len(heads) == attn.n_head
            for h, linear in enumerate(heads):
                assert (linear.in_features, linear.out_features) == (C, C // attn.n_head)
                assert torch.allclose(linear(x), part[:, :, h], atol=1e-6)


def test_the_kv_cache_step_equals_the_full_forward_and_the_cache_is_freed(tiny_run, capsys):
    document, _ = explained(capsys, "--ckpt", tiny_run, "--prompt", "ROMEO:", "--layer", 1)
    kv, T, c = document["kv_cache"], document["tokens"], document["config"]
    hs = c["n_embd"] // c["n_head"]
    assert kv["prefill_tokens"] == T - 1
    assert kv["q_shape"] == [1, c["n_head"], 1, hs]
    assert kv["k_shape"] == kv["v_shape"] == [1, c["n_head"], T, hs]
    assert kv["scores_shape"] == [1, c["n_head"], 1, T] and kv["output_shape"] == [1, 1, c["n_embd"]]
    assert kv["cache_buffer_shape"] == [1, c["n_head"], c["block_size"], hs]
    assert kv["max_diff"] < 1e-5

    model = load_checkpoint(tiny_run).model
    idx = torch.tensor([steps_by_name(document)["idx"]["values"]])
    explain.kv_cache_view(model, idx, 1, explain.walk_layer(model, idx, 1, 0, ["t"] * T)["out"])
    assert model.cache_length() == 0 and all(block.attn.kv_cache is None for block in model.transformer.h)


def test_an_empty_prompt_starts_from_endoftext(tiny_run, tiny_tokenizer, capsys):
    document, _ = explained(capsys, "--ckpt", tiny_run, "--prompt", "")
    assert steps_by_name(document)["idx"]["values"] == [tiny_tokenizer.token_to_id("<|endoftext|>")]
    assert document["tokens"] == 1 and "skipped" in document["kv_cache"]
    assert document["layer_max_diff"] < 1e-5 and steps_by_name(document)["softmax"]["row"] == [1.0]


def test_a_prompt_longer_than_the_context_is_cropped_to_its_last_tokens(tiny_run, tiny_tokenizer, capsys):
    prompt = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."
    ids = tiny_tokenizer.encode(prompt).ids
    document, err = explained(capsys, "--ckpt", tiny_run, "--prompt", prompt)
    block_size = document["config"]["block_size"]
    assert len(ids) > block_size and document["prompt_tokens"] == len(ids) and document["tokens"] == block_size
    assert steps_by_name(document)["idx"]["values"] == ids[-block_size:]
    assert f"explaining its last {block_size}" in err
    assert document["kv_cache"]["max_diff"] < 1e-5


def test_a_character_split_over_tokens_is_shown_as_its_bytes(tiny_run, tmp_path):
    """Byte-level BPE cuts "é" into two tokens, each one byte of it: they are shown as those bytes, not as
    the characters that stand for them in the vocabulary ("Ã", "©"), which the prompt never held."""
    proc = run_script("explain.py", "--ckpt", str(tiny_run), "--prompt", "café", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tokens = proc.stdout.split("T = 5 tokens\n")[1].splitlines()
    assert [token.split("=")[0] for token in tokens[0].split()] == ["c", "a", "f", "\\xc3", "\\xa9"]
    assert "a byte by its number" in tokens[1]
    assert "Ã" not in proc.stdout and "©" not in proc.stdout


def test_the_mask_grid_lines_up_wide_characters_and_accents(tmp_path):
    """A char tokenizer's tokens may be wide (日, 👋: two columns of a terminal) or an accent alone (U+0301,
    none): the grid pads each label to its columns, so that every mark stands under its token."""
    tokenizer = train_char(["日本語 👋 cafe\u0301 abc"])
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints" / "last.ckpt", untrained_gpt(vocab_size=tokenizer.get_vocab_size()), tokenizer)
    proc = run_script("explain.py", "--ckpt", str(run), "--prompt", "日本👋e\u0301a", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    top = next(i for i, line in enumerate(lines) if line.endswith("set to -inf):")) + 1
    grid = [line[4:] for line in lines[top : top + 7]]  # the labels, then a row per token
    columns = [8 + 7 * j for j in range(6)]
    assert word_columns(grid[0]) == columns, grid
    assert all(word_columns(row) == [0, *columns] for row in grid[1:]), grid
    assert "◌\u0301" in grid[0]  # the accent on a dotted circle, not on the space before it


def word_columns(line: str) -> list[int]:
    """The terminal column where each word of line starts."""
    starts, column, before = [], 0, " "
    for c in line:
        if c != " " and before == " ":
            starts.append(column)
        column += 0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) == "W" else 1
        before = c
    return starts


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--layer", "2"], "error: --layer 2 is out of range: this model has 2 layers, so use 0 to 1"),
        (["--layer", "-1"], "error: --layer -1 is out of range: this model has 2 layers, so use 0 to 1"),
        (["--head", "4"], "error: --head 4 is out of range: this model has 4 heads per layer, so use 0 to 3"),
    ],
)
def test_a_layer_or_head_out_of_range_is_refused_with_the_valid_range(tiny_run, capsys, args, expected):
    assert refused_explanation(capsys, "--ckpt", tiny_run, "--prompt", "ROMEO:", *args) == expected


def test_a_missing_run_or_checkpoint_is_refused(tmp_path, capsys, monkeypatch):
    assert "does not exist" in refused_explanation(capsys, "--ckpt", tmp_path / "nowhere")
    (tmp_path / "empty_run").mkdir()
    assert "no checkpoint in" in refused_explanation(capsys, "--ckpt", tmp_path / "empty_run")
    proc = run_script("explain.py", "--prompt", "ROMEO:", cwd=tmp_path, timeout=300)  # no outputs/latest here
    assert proc.returncode == 1 and proc.stdout == ""
    assert one_error_line(proc.stderr) == (
        "error: no run found at outputs/latest; train one with `python train.py` or pass --ckpt RUN_FOLDER"
    )


def test_explain_py_refuses_a_prompt_that_is_not_utf8_in_one_line(tiny_run):
    proc = subprocess.run(
        [sys.executable, "explain.py", "--ckpt", str(tiny_run), "--prompt", b"ab\xff"],
        cwd=ROOT,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1 and proc.stdout == b""
    line = one_error_line(proc.stderr.decode())
    assert "not valid UTF-8" in line and "0xff" in line


def test_an_out_of_range_layer_prints_no_traceback_as_a_program(tiny_run):
    proc = run_script("explain.py", "--ckpt", str(tiny_run), "--layer", "9", "--json", timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "0 to 1" in one_error_line(proc.stderr)
