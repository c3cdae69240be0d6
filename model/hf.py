"""Between our GPT and Hugging Face `GPT2LMHeadModel`: weight names and layouts, and the config.

The weight names are the same; the difference is that HF's `Conv1D` stores a linear layer's weight
as (in, out) where `nn.Linear` stores (out, in), so those four matrices per block are transposed.
Needs only torch: `transformers` itself is imported by the callers that use it.
"""

from __future__ import annotations

from typing import Any

import torch

from model.config import ConfigError, GPTConfig

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers older checkpoints carry
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # the same function: GPT-2's tanh approximation


def is_conv1d(key: str) -> bool:
    return key.endswith(CONV1D_SUFFIXES)


def from_hf_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel state dict as ours (keys may lack the `transformer.` prefix, as in the
    original OpenAI-converted `gpt2` files)."""
    ours = {}
    for key, value in hf_state.items():
        if key.endswith(HF_BUFFERS):
            continue
        if not key.startswith(("transformer.", "lm_head.")):
            key = f"transformer.{key}"
        ours[key] = value.t().contiguous() if is_conv1d(key) else value
    if "lm_head.weight" not in ours:
        ours["lm_head.weight"] = ours["transformer.wte.weight"]  # tied
    elif not torch.equal(ours["lm_head.weight"], ours["transformer.wte.weight"]):
        raise ConfigError("the output layer (lm_head) is not tied to the token embedding (wte); tinygpt2 ties them")
    return ours


def to_hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict in GPT2LMHeadModel's layout, ready for a safetensors file.

    `lm_head.weight` is left out: it is `wte`, and transformers ties the two on loading. A model
    without biases gets zero biases, which compute exactly what no bias computes, because GPT-2's
    format has a bias in every linear layer and LayerNorm.
    """
    hf = {
        k: (v.t().contiguous() if is_conv1d(k) else v.contiguous()) for k, v in state.items() if k != "lm_head.weight"
    }
    if not config.bias:
        for key, value in state.items():
            if key.endswith(
                (".ln_1.weight", ".ln_2.weight", "ln_f.weight", ".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
            ):
                bias_key = key[: -len("weight")] + "bias"
                hf.setdefault(bias_key, torch.zeros(value.size(0), dtype=value.dtype))
    return hf


def config_from_hf(hf_config) -> GPTConfig:
    """Our GPTConfig from a transformers GPT2Config (or its dict), refusing GPT-2 variants that
    our model does not compute."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    model_type = get("model_type")
    if model_type is None and any(get(key) is None for key in ("n_layer", "n_head", "n_embd")):
        raise ConfigError(
            "it names no model_type, nor a GPT-2 shape (n_layer, n_head, n_embd): it is not a GPT-2 config"
        )
    model_type = model_type or "gpt2"  # a GPT-2 config saved before model_type was written
    if model_type != "gpt2":
        raise ConfigError(f"model_type is {model_type!r}; only GPT-2 models (model_type 'gpt2') can be loaded")
    n_embd = get("n_embd")
    epsilon = number("layer_norm_epsilon", get("layer_norm_epsilon", 1e-5))
    differences = {
        "activation_function": (get("activation_function", "gelu_new") in TANH_GELUS, "gelu_new"),
        "n_inner": (get("n_inner") in (None, 4 * (n_embd or 0)), "null (4 * n_embd)"),
        "layer_norm_epsilon": (abs(epsilon - 1e-5) < 1e-12, "1e-05"),
        "scale_attn_weights": (get("scale_attn_weights", True) is True, "true"),
        "scale_attn_by_inverse_layer_idx": (not get("scale_attn_by_inverse_layer_idx", False), "false"),
        "add_cross_attention": (not get("add_cross_attention", False), "false"),
        "tie_word_embeddings": (get("tie_word_embeddings", True) is True, "true"),
    }
    for name, (supported, expected) in differences.items():
        if not supported:
            raise ConfigError(f"{name} is {get(name)!r}; tinygpt2 computes GPT-2 as released ({name}: {expected})")
    return GPTConfig(
        n_layer=get("n_layer"),
        n_head=get("n_head"),
        n_embd=n_embd,
        block_size=get("n_positions") or get("n_ctx"),
        vocab_size=get("vocab_size"),
        dropout=number("resid_pdrop", get("resid_pdrop", 0.0) or 0.0),
        bias=True,
    )


def number(name: str, value: Any) -> float:
    """A config.json field that must be a JSON number (not a string, a list or true/false)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} is {value!r}, not a number; give it a number in config.json")
    return float(value)


def hf_config_dict(config: GPTConfig, eot_id: int | None = None) -> dict[str, Any]:
    """The GPT2Config fields that describe our model (for `GPT2Config(**...)` or config.json)."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_inner": None,
        "vocab_size": config.vocab_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
    }
