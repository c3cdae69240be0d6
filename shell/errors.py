"""The errors a user's command line, settings, data or files can cause: each says in one line what was
wrong and what to do, and train.py prints it without a traceback."""

from __future__ import annotations

from checkpoint import CheckpointError
from data import DataError
from model import ConfigError
from shell.checks import SettingError
from training.guard import TrainingDiverged


class RunFolderError(ValueError):
    """A run or sweep folder that cannot be used as asked."""


class RunWriteError(RuntimeError):
    """A file of the run could not be written while it trained (a full disk, a file-size limit)."""


class TrackerError(RuntimeError):
    """A tracker (wandb) could not start the run's log; nothing was trained."""


class ProcessLost(RuntimeError):
    """Another process of a multi-process run ended or stopped answering while this one trained."""


USER_ERRORS = (ConfigError, DataError, CheckpointError, SettingError, RunFolderError, RunWriteError, TrackerError)
USER_ERRORS += (TrainingDiverged, ProcessLost)
