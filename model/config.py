"""The one description of a model's shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

ATTENTION_KERNELS = ("sdpa", "explicit")


class ConfigError(ValueError):
    """A model setting that cannot work; the message says which and how to fix it."""


def shown(value: Any) -> str:
    """A value as it is written in a config: 'text', true, null, 0.1."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return repr(value)


@dataclass
class GPTConfig:
    """Shape of a GPT-2 model. Field names follow the GPT-2 checkpoints.

    `attention` picks the kernel: "sdpa" (torch's fused scaled_dot_product_attention) or
    "explicit" (the scores/mask/softmax/dropout steps written out). Both give the same numbers.
    """

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50257
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{name} must be a whole number of at least 1, got {shown(value)}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head}); "
                f"pick n_embd as a multiple of n_head, e.g. n_embd={self.n_head * max(1, round(self.n_embd / self.n_head))}"
            )
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ConfigError(f"model.dropout must be a number in [0, 1), got {shown(self.dropout)}")
        if not isinstance(self.bias, bool):
            raise ConfigError(f"model.bias must be true or false, got {shown(self.bias)}")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(
                f"model.attention must be one of {', '.join(ATTENTION_KERNELS)}, got {shown(self.attention)}"
            )

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def flops_per_token(self, training: bool = True) -> float:
        """Matmul FLOPs per token: 6 per weight for a training step (2 forward, 4 backward) plus the
        attention products (PaLM's estimate: 12 * n_layer * n_embd * block_size). Embedding lookups
        cost nothing; the tied lm_head is a real matmul and counts."""
        C, L = self.n_embd, self.n_layer
        weights = L * 12 * C * C + C * self.vocab_size  # per block: c_attn 3C^2, c_proj C^2, c_fc 4C^2, c_proj 4C^2
        attention = 2 * 2 * L * C * self.block_size  # q @ k^T and att @ v: C * T multiply-adds each
        forward = 2 * weights + attention
        return 3 * forward if training else forward

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Build from a mapping, naming any key that is not a model setting."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model setting(s) {unknown}; known ones are {sorted(known)}")
        return cls(**values)
