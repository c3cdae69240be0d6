"""The errors a user's command line, settings, data or files can cause: each says, in one line, what
was wrong and what to do, and train.py prints it without a traceback. Kept free of Lightning, so a
command line is refused without loading it."""

from __future__ import annotations

from checkpoint import CheckpointError
from data import DataError
from model import ConfigError
from shell.checks import SettingError
from shell.run_folder import RunFolderError
from training.guard import TrainingDiverged  # (shell.run adds what is left of the run, and how to start it again)


class RunWriteError(RuntimeError):
    """A run's file (a checkpoint, a log, a tracker's, a picture) could not be written while it trained:
    a full disk, a read-only one, a file-size limit. The message says what is left and how to go on."""


class TrackerError(RuntimeError):
    """A tracker (wandb) could not start the run's log; nothing was trained."""


class ProcessLost(RuntimeError):
    """Another process of a multi-process run ended (killed, or stopped by an error of its own) or
    stopped answering while this one trained. The message says what is left and how to go on."""


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
