"""The one error a user's data or settings can cause."""


class DataError(ValueError):
    """Data that cannot be used; the message names the file or setting and how to fix it."""
