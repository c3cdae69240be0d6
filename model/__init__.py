"""The GPT-2 model: needs only torch."""

from model.config import ConfigError, GPTConfig
from model.gpt import GPT

__all__ = ["GPT", "GPTConfig", "ConfigError"]
