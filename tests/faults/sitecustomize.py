"""Imported by Python at the start of every process the tests start with this folder on PYTHONPATH: with
TINYGPT2_FAILPOINT set, the faults of failpoints.py are installed (the worker processes of a ddp run and
of the token cache inherit both)."""

import os

if os.environ.get("TINYGPT2_FAILPOINT"):
    import failpoints

    failpoints.install()
