"""The GPT-2 model: attention maths, initialisation, parity with transformers, the KV cache."""

from __future__ import annotations

import ast
import gc
import math

import pytest
import torch
from torch import nn

from generation import generate, stream
from generation.step import StaticStep
from model import GPT, ConfigError, GPTConfig
from model.gpt import CausalSelfAttention
from model.hf import from_hf_state_dict, hf_config_dict
from tests.common import ROOT
from tests.tiny import TINY_VOCAB, tiny_config, untrained_gpt

# ---- the combined c_attn projection ----------------------------------------------------------------


def test_attention_with_the_combined_c_attn_equals_attention_with_separate_per_head_linears():
    """c_attn holds the per-head projections side by side, [q heads | k heads | v heads]: laid out that
    way, the attention's own forward gives what each head computes from linears of its own."""
    config = tiny_config()
    C, nh, hs = config.n_embd, config.n_head, config.head_size
    torch.manual_seed(0)
    separate = {name: [nn.Linear(C, hs) for _ in range(nh)] for name in "qkv"}
    attn = CausalSelfAttention(config).eval()
    with torch.no_grad():
        attn.c_attn.weight.copy_(torch.cat([lin.weight for name in "qkv" for lin in separate[name]], dim=0))
        attn.c_attn.bias.copy_(torch.cat([lin.bias for name in "qkv" for lin in separate[name]], dim=0))

    x = torch.randn(2, 5, C)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    heads = []
    with torch.no_grad():
        for h in range(nh):
            q, k, v = (separate[name][h](x) for name in "qkv")  # (B, T, hs) each
            scores = (q @ k.transpose(-2, -1) / math.sqrt(hs)).masked_fill(~causal, float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ v)
        expected = attn.c_proj(torch.cat(heads, dim=-1))  # the heads side by side, then the output projection
        torch.testing.assert_close(attn(x), expected, rtol=0, atol=1e-5)


# ---- attention kernels and causality -----------------------------------------------------------------


@pytest.mark.parametrize("train_mode", [False, True])
def test_explicit_attention_equals_fused(train_mode):
    fused = untrained_gpt(attention="sdpa")
    explicit = untrained_gpt(attention="explicit")
    explicit.load_state_dict(fused.state_dict())
    fused.train(train_mode), explicit.train(train_mode)  # dropout is 0: train mode must agree too
    idx = torch.randint(0, TINY_VOCAB, (3, fused.config.block_size))
    torch.testing.assert_close(fused(idx)[0], explicit(idx)[0], rtol=1e-5, atol=1e-5)


def test_explicit_path_returns_attention_weights():
    gpt = untrained_gpt()
    idx = torch.randint(0, TINY_VOCAB, (2, 7))
    maps = gpt.attention_weights(idx)
    assert len(maps) == 2 and maps[0].shape == (2, 4, 7, 7)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 4, 7))
    assert torch.all(maps[-1].triu(diagonal=1) == 0)  # nothing attends to the future


def test_future_tokens_never_change_earlier_logits():
    gpt = untrained_gpt()
    idx = torch.randint(0, TINY_VOCAB, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 7) % TINY_VOCAB
    a, b = gpt(idx)[0], gpt(changed)[0]
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=0)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_loss_is_cross_entropy_and_none_without_targets():
    gpt = untrained_gpt()
    idx = torch.randint(0, TINY_VOCAB, (2, 10))
    logits, loss = gpt(idx)
    assert logits.shape == (2, 10, TINY_VOCAB) and loss is None
    targets = torch.randint(0, TINY_VOCAB, (2, 10))
    _, loss = gpt(idx, targets)
    expected = nn.functional.cross_entropy(logits.reshape(-1, TINY_VOCAB), targets.reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_longer_than_block_size_is_refused():
    gpt = untrained_gpt()
    with pytest.raises(ValueError, match="block_size"):
        gpt(torch.zeros(1, gpt.config.block_size + 1, dtype=torch.long))


# ---- initialisation and size -------------------------------------------------------------------------


def test_gpt2_initialisation():
    torch.manual_seed(0)
    config = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=64, vocab_size=2000)
    gpt = GPT(config)
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    assert abs(gpt.transformer.wte.weight.std().item() - 0.02) < 0.001
    assert abs(gpt.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.001
    residual_std = 0.02 / math.sqrt(2 * config.n_layer)
    for block in gpt.transformer.h:
        assert abs(block.attn.c_proj.weight.std().item() - residual_std) < 0.0005
        assert abs(block.mlp.c_proj.weight.std().item() - residual_std) < 0.0005
    for name, param in gpt.named_parameters():
        if name.endswith(".bias"):
            assert torch.all(param == 0), name
        if ".ln_" in name and name.endswith(".weight"):
            assert torch.all(param == 1), name


def test_gpt2_small_has_the_released_parameter_count():
    gpt = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257))
    assert gpt.num_parameters() == 124_439_808


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(n_embd=30, n_head=4), "divisible"),
        (dict(block_size=0), "block_size"),
        (dict(dropout=1.0), "dropout"),
        (dict(attention="flash"), "attention"),
    ],
)
def test_config_checks_itself(bad, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**bad)


def test_config_from_dict_names_unknown_keys():
    with pytest.raises(ConfigError, match="n_embed"):
        GPTConfig.from_dict({**tiny_config().to_dict(), "n_embed": 32})


# ---- parity with Hugging Face transformers ----------------------------------------------------------


def test_logits_equal_transformers_gpt2():
    transformers = pytest.importorskip("transformers")
    config = tiny_config()
    hf_config = transformers.GPT2Config(**{k: v for k, v in hf_config_dict(config).items() if k != "architectures"})
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    ours = GPT(config).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()))
    idx = torch.randint(0, config.vocab_size, (2, config.block_size))
    with torch.no_grad():
        expected = hf(idx).logits
    torch.testing.assert_close(ours(idx)[0], expected, rtol=0, atol=1e-5)


# ---- generation with the KV cache -------------------------------------------------------------------


def test_cached_greedy_equals_uncached_greedy_within_block_size():
    gpt = untrained_gpt()
    idx = torch.randint(0, TINY_VOCAB, (3, 4))
    cached = generate(gpt, idx, 12, temperature=0, use_cache=True)
    uncached = generate(gpt, idx, 12, temperature=0, use_cache=False)
    assert cached.shape == (3, 16)
    assert torch.equal(cached[:, :4], idx)
    assert torch.equal(cached, uncached)


def test_generation_slides_past_block_size_and_both_paths_agree():
    gpt = untrained_gpt()
    idx = torch.randint(0, TINY_VOCAB, (2, 5))
    new = 2 * gpt.config.block_size  # the window slides more than once
    cached = generate(gpt, idx, new, temperature=0, use_cache=True)
    uncached = generate(gpt, idx, new, temperature=0, use_cache=False)
    assert cached.shape == (2, 5 + new)
    assert torch.equal(cached, uncached)


def test_lm_head_only_sees_the_last_position_while_generating():
    gpt = untrained_gpt()
    seen = []
    gpt.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(tuple(inputs[0].shape)))
    new = 2 * gpt.config.block_size  # past the window: the prompt is filled in again as it slides
    generate(gpt, torch.randint(0, TINY_VOCAB, (2, 6)), new, temperature=1.0)
    assert len(seen) == new
    assert all(shape == (2, gpt.config.n_embd) for shape in seen)  # (B, C): one position per row, prefills included


def test_prefill_runs_the_prompt_once_then_one_token_per_step():
    gpt = untrained_gpt()
    calls = []
    trunk = gpt.trunk

    def record_trunk(idx, start_pos=0):
        calls.append((idx.shape[1], start_pos))
        return trunk(idx, start_pos)

    gpt.trunk = record_trunk
    generate(gpt, torch.randint(0, TINY_VOCAB, (1, 6)), 5)
    assert calls == [(6, 0), (1, 6), (1, 7), (1, 8), (1, 9)]  # the 6 prompt tokens, then one token a step


def test_cache_is_empty_outside_generation():
    gpt = untrained_gpt()
    generate(gpt, torch.randint(0, TINY_VOCAB, (1, 3)), 4)
    assert all(block.attn.kv_cache is None for block in gpt.transformer.h)


def test_generated_tokens_can_train_the_model():
    """Decoding runs in inference mode; what generate returns must still be usable by autograd."""
    gpt = untrained_gpt()
    out = generate(gpt, torch.randint(0, TINY_VOCAB, (2, 3)), 6)
    assert not out.is_inference()
    gpt.train()
    _, loss = gpt(out[:, :-1], out[:, 1:])
    loss.backward()
    assert gpt.transformer.wte.weight.grad is not None


def test_same_generator_seed_same_tokens():
    gpt = untrained_gpt()
    idx = torch.randint(0, TINY_VOCAB, (1, 3))
    runs = [generate(gpt, idx, 10, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_generate_refuses_bad_arguments():
    gpt = untrained_gpt()
    idx = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(gpt, idx, 0)
    with pytest.raises(ValueError, match="temperature"):
        generate(gpt, idx, 3, temperature=-1)


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
def test_one_decoding_step_equals_the_full_forward(kernel):
    gpt = untrained_gpt(attention=kernel)
    idx = torch.randint(0, TINY_VOCAB, (3, 9))
    with torch.no_grad():
        expected = gpt(idx)[0][:, -1]
        gpt.set_kv_cache(3)
        gpt.last_logits(idx[:, :-1])  # prefill the first 8
        got = gpt.last_logits(idx[:, -1:], start_pos=8)  # the ninth against the cache
        gpt.clear_kv_cache()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
def test_static_step_for_cuda_graphs_equals_the_full_forward(kernel):
    """The step a CUDA graph records (fixed buffers, the position as a 0-d tensor, the whole cache read
    under a mask) computes what the blocks do, at every position."""
    gpt = untrained_gpt(attention=kernel)
    idx = torch.randint(0, TINY_VOCAB, (2, 12))
    with torch.no_grad():
        full = gpt(idx)[0]
        step = StaticStep(gpt, gpt.set_kv_cache(2))
        gpt.last_logits(idx[:, :4])  # prefill the first 4
        for pos in range(4, 12):
            torch.testing.assert_close(step(idx[:, pos : pos + 1], pos), full[:, pos], rtol=1e-5, atol=1e-5)
        assert gpt.cache_length() == 12
        gpt.clear_kv_cache()


def test_a_stream_on_a_graph_step_gives_the_tokens_of_the_uncached_forward(monkeypatch):
    """The decoding loop run on the static step (as on a GPU, where it is replayed as a graph), sliding
    window included, decodes greedily what the full forward does."""
    import generation.decode as decode
    import generation.step as step

    gpt = untrained_gpt()
    monkeypatch.setattr(decode, "use_cuda_graph", lambda model: True)
    monkeypatch.setattr(step, "CudaGraphStep", StaticStep)  # the same step, without the recording
    idx = torch.randint(0, TINY_VOCAB, (2, 5))
    new = 2 * gpt.config.block_size  # the window slides
    uncached = generate(gpt, idx, new, temperature=0, use_cache=False)
    assert torch.equal(generate(gpt, idx, new, temperature=0), uncached)
    kept = step._graph_steps[gpt][1]
    assert torch.equal(generate(gpt, idx, new, temperature=0), uncached)
    assert step._graph_steps[gpt][1] is kept  # the kept step, reused
    del gpt, kept
    gc.collect()
    assert len(step._graph_steps) == 0  # and it does not keep the model alive


def test_packed_linears_give_the_same_tokens_and_are_put_back(monkeypatch):
    """A large model on a CPU decodes with oneDNN-packed copies of its Linear layers: the same greedy
    tokens, and the model's own layers back once the stream ends."""
    import generation.step as step

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    gpt = untrained_gpt()
    idx = torch.randint(0, TINY_VOCAB, (2, 5))
    plain = generate(gpt, idx, 2 * gpt.config.block_size, temperature=0)  # prefills after a slide too
    monkeypatch.setattr(step, "PACK_ABOVE_BYTES", 0)  # pack even this tiny model
    linears = {name: module for name, module in gpt.named_modules() if isinstance(module, nn.Linear)}
    tokens = stream(gpt, idx, 2 * gpt.config.block_size, temperature=0)
    first = next(tokens)
    assert not any(isinstance(module, nn.Linear) for module in gpt.modules())  # all swapped while decoding
    packed = torch.cat([idx, first[:, None], *(token[:, None] for token in tokens)], dim=1)
    assert torch.equal(packed, plain)
    assert all(gpt.get_submodule(name) is linear for name, linear in linears.items())


def test_the_model_package_needs_only_torch():
    """model/ is the network: importing it loads no file reading, decoding or training code."""
    import subprocess
    import sys

    code = (
        "import sys, model, model.gpt, model.cache, model.hf, model.config; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'generation', 'data', 'training', 'tokenizers', "
        "'lightning', 'hydra', 'safetensors'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_the_model_package_imports_nothing_of_the_project():
    """model/ imports torch and its own modules only, not even for type checking: nothing else of
    ours can make the network's code depend on it."""
    ours = {path.stem for path in ROOT.glob("*.py")} | {path.parent.name for path in ROOT.glob("*/__init__.py")}
    for path in sorted((ROOT / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else ["model"]
            else:
                continue
            outside = [n for n in names if n.split(".")[0] in ours - {"model"}]
            assert not outside, f"{path.name} imports {outside}"
