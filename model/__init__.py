"""The GPT-2 model: needs only torch."""

from .config import ConfigError, GPTConfig
from .gpt import GPT

__all__ = ["GPT", "GPTConfig", "ConfigError"]
