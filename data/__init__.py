"""Text sources, tokenizers and the token cache; the Lightning data module lives in data.datamodule."""

from data.errors import DataError

__all__ = ["DataError"]
