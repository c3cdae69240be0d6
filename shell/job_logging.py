"""Where a job's log lines go, once Hydra has set up its logging (configs/train.yaml's job_logging: the
console, and the run's train.log): what Lightning logs through handlers of its own and Python's warnings
reach train.log too, the processes of a launch beside the first keep their console to errors, and a
line can go to train.log alone. The logger is train.py's ("train"), whose name its log lines show."""

from __future__ import annotations

import logging
import sys

from shell.run_folder import process_rank

log = logging.getLogger("train")


def to_log_file(message: str) -> None:
    """A line for the run's train.log alone, at error level (the console has it from sys.exit)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def without_trailing_newline(record: logging.LogRecord) -> bool:
    record.msg = str(record.msg).rstrip("\n")  # a formatted warning ends in one
    return True


def log_libraries_to_file() -> None:
    """The run's train.log (Hydra's file handler) gets what Lightning logs through handlers of its own,
    and Python's warnings, besides the console, which shows them as before."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not logging.getLogger("py.warnings").handlers:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("py.warnings").addHandler(console)
        logging.getLogger("py.warnings").addFilter(without_trailing_newline)
        logging.getLogger("py.warnings").propagate = False
    for name in ("lightning.pytorch", "lightning.fabric", "py.warnings"):
        library = logging.getLogger(name)
        for handler in [h for h in library.handlers if isinstance(h, logging.FileHandler)]:
            library.removeHandler(handler)  # the previous job's, in a sweep
        for handler in files:
            library.addHandler(handler)
    logging.captureWarnings(True)


def quiet_console_of_other_processes() -> None:
    """The processes of a launch beside the first write their log lines to train.log alone, and only
    their errors to the console they share with it, where each line would show once per process."""
    if process_rank() == 0:
        return
    for logger in (logging.getLogger(), logging.getLogger("py.warnings")):
        for handler in logger.handlers:
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(max(handler.level, logging.ERROR))
