"""Weights between our GPT and Hugging Face `GPT2LMHeadModel`.

The names are the same; the difference is that HF's `Conv1D` stores a linear layer's weight as
(in, out) where `nn.Linear` stores (out, in), so those four matrices per block are transposed.
Needs only torch: `transformers` itself is imported by the callers that use it.
"""

from __future__ import annotations

import torch

from .config import GPTConfig

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers older checkpoints carry


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
    return ours


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict in GPT2LMHeadModel's layout."""
    return {k: (v.t().contiguous() if is_conv1d(k) else v) for k, v in state.items()}


def config_from_hf(hf_config) -> GPTConfig:
    """Our GPTConfig from a transformers GPT2Config (or its dict)."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    return GPTConfig(
        n_layer=get("n_layer"),
        n_head=get("n_head"),
        n_embd=get("n_embd"),
        block_size=get("n_positions"),
        vocab_size=get("vocab_size"),
        dropout=float(get("resid_pdrop", 0.0) or 0.0),
        bias=True,
    )


def hf_config_dict(config: GPTConfig) -> dict:
    """The GPT2Config fields that describe our model (for `GPT2Config(**...)` or config.json)."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "vocab_size": config.vocab_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "tie_word_embeddings": True,
    }
