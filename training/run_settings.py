"""A run's settings as the core takes them: every value checked and worked out by the shell
(shell.settings), and what follows from them for Lightning's Trainer. Kept apart from training.fit so that
the shell can make them without importing Lightning (a command line is refused before it loads)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import checkpoint
from data.cache import TokenCache
from model import GPTConfig

# Trainer settings the module or the settings resolve, rather than lightning.Trainer taking them as they are
NOT_TRAINER_ARGUMENTS = (
    "strategy",
    "precision",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
)


@dataclass
class RunSettings:
    """A run's settings, final: every value checked and worked out (shell.settings makes them)."""

    values: dict[str, Any]  # every setting, as config.yaml holds them
    model: GPTConfig
    tokens: TokenCache  # the prepared corpus: tokenizer and token ids
    world_size: int  # processes training together
    accumulation: int  # micro-batches per optimizer step and process
    resume_from: Path | None = None  # the checkpoint a continued run starts from
    resume_step: int | None = None  # and its step
    machine_chosen: tuple[str, ...] = ()  # settings left to the machine by the command line

    @property
    def trainer(self) -> dict[str, Any]:
        return self.values["trainer"]

    @property
    def max_steps(self) -> int:
        return self.trainer["max_steps"]

    @property
    def max_time_seconds(self) -> float | None:
        limit = self.trainer.get("max_time")  # dd:hh:mm:ss, or days/hours/minutes/seconds
        if not limit:
            return None
        if isinstance(limit, dict):
            return timedelta(**limit).total_seconds()
        days, hours, minutes, seconds = (int(part) for part in str(limit).split(":"))
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds).total_seconds()

    @property
    def tokens_per_step(self) -> int:
        return self.values["tokens_per_step"]

    def trainer_arguments(self) -> dict[str, Any]:
        """lightning.Trainer's arguments: trainer.*, with validation counted in optimizer steps and batches
        of the whole validation, where Lightning counts micro-batches and each process's batches."""
        arguments = {k: v for k, v in self.trainer.items() if k not in NOT_TRAINER_ARGUMENTS}
        every = arguments.get("val_check_interval")
        if isinstance(every, int) and not isinstance(every, bool):
            arguments["val_check_interval"] = every * self.accumulation
        limit = arguments.get("limit_val_batches")
        if isinstance(limit, int) and not isinstance(limit, bool) and self.world_size > 1:
            arguments["limit_val_batches"] = -(-limit // self.world_size)  # each process scores every N-th window
        return arguments

    def saved(self) -> dict[str, Any]:
        """What config.yaml and each checkpoint hold: the settings, and which token cache entry they read."""
        prepared = {"cache_key": self.tokens.key, "source": self.tokens.meta.get("source")}
        if made := self.tokens.meta.get("encodings_made"):
            prepared["encodings_made"] = made
        return {
            **copy.deepcopy(self.values),
            checkpoint.PREPARED: prepared,
            checkpoint.MACHINE_CHOSEN: list(self.machine_chosen),
        }


def choose_strategy(name: Any, world_size: int):
    """`fsdp`: FSDP2 through Lightning's ModelParallelStrategy over `world_size` processes (training.fsdp);
    other names go to Lightning as they are."""
    if name == "fsdp":
        from training.fsdp import FSDP2Strategy

        return FSDP2Strategy(world_size)
    return name


def sample_prompts(values: dict[str, Any]) -> list[str]:
    """The prompts the run's text samples continue: samples.prompts, else the data's own, else one empty."""
    return list(values["samples"]["prompts"] or values["data"].get("sample_prompts") or [""])
