"""The command-line parser of generate.py, explain.py and export.py: argparse's, with its errors in one
line (argparse prints its usage block first)."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        hint = f"python {self.prog} --help lists the options"
        if "expected one argument" in message:  # --stop at the end, or --stop -x: a value that starts with -
            flag = message.split()[1].rstrip(":")
            hint = f"give it a value; one that starts with - is written with =, e.g. {flag}=-x; {hint}"
        self.exit(2, f"error: {message} ({hint})\n")
