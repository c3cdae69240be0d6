"""The benchmark scripts, each run as `python bench/NAME.py` (see README.md here)."""
