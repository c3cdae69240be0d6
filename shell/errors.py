"""The errors a user's command line, settings, data or files can cause: each says, in one line, what
was wrong and what to do, and train.py prints it without a traceback. Kept free of Lightning, so a
command line is refused without loading it."""

from __future__ import annotations

from checkpoint import CheckpointError
from data import DataError
from model import ConfigError
from shell.checks import SettingError
from shell.run_folder import RunFolderError


class RunWriteError(RuntimeError):
    """A run's file (a checkpoint, a log, a tracker's, a picture) could not be written while it trained:
    a full disk, a read-only one, a file-size limit. The message says what is left and how to go on."""


class TrackerError(RuntimeError):
    """A tracker (wandb) could not start the run's log; nothing was trained."""


class ProcessLost(RuntimeError):
    """Another process of a multi-process run ended (killed, or stopped by an error of its own) or
    stopped answering while this one trained. The message says what is left and how to go on."""


class TrainingDiverged(RuntimeError):
    """Training cannot go on: too many non-finite losses in a row, or weights no longer finite. The
    message says what happened; `instead` is a remedy other than a lower learning rate (shell.run
    adds what is left of the run and the command that starts it again)."""

    def __init__(self, message: str, instead: str = "") -> None:
        super().__init__(message)
        self.instead = instead


USER_ERRORS = (
    ConfigError,
    DataError,
    CheckpointError,
    SettingError,
    RunFolderError,
    RunWriteError,
    TrackerError,
    TrainingDiverged,
    ProcessLost,
)
