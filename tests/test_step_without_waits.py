"""A training step that never makes the host wait for the device: nothing is read back from a tensor
but on logging steps, and a non-finite step is skipped by a decision made on the device. Watched here
on a CPU, where a read-back is what would be a wait on a GPU."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from torch.overrides import TorchFunctionMode

from shell.errors import TrainingDiverged
from shell.run import train
from shell.settings import Machine, check, choose_compile
from tests.common import TINY_OVERRIDES, checkpoint_weights, compose_config, inject_faults

# Tensor methods that hand a tensor's values to Python: on a GPU, each waits for the device.
READ_BACKS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.Tensor.numpy,
}


class ReadBacks(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READ_BACKS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class WatchSteps(L.Callback):
    """The read-backs of each optimizer step, from the start of its batch to the end of the run's own
    callbacks (extra callbacks run after them)."""

    def __init__(self):
        self.by_step: dict[int, list[str]] = {}
        self.watching: ReadBacks | None = None

    def on_train_batch_start(self, trainer, *args) -> None:
        self.watching = ReadBacks()
        self.watching.__enter__()

    def on_train_batch_end(self, trainer, *args) -> None:
        self.watching.__exit__(None, None, None)
        self.by_step[trainer.global_step] = self.watching.seen


def overrides(small_text, *extra: str) -> list[str]:
    return [
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=5",
        "trainer.val_check_interval=100",
        "checkpoint.every_n_steps=4",
        "checkpoint.keep=20",
        *extra,
    ]


def optimizer_tensors(checkpoint: Path) -> list[torch.Tensor]:
    """Every tensor of a checkpoint's optimizer state (moments, momenta, step counts), in order."""
    found = []

    def walk(value):
        if torch.is_tensor(value):
            found.append(value)
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key])
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(torch.load(checkpoint, weights_only=True)["optimizer_states"])
    return found


def assert_unchanged(after: Path, before: Path) -> None:
    """Two checkpoints with the same weights and optimizer state, step counts included."""
    weights = checkpoint_weights(after), checkpoint_weights(before)
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[1])
    state = optimizer_tensors(after), optimizer_tensors(before)
    assert len(state[0]) == len(state[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*state, strict=True))


def test_only_logging_and_checkpoint_steps_read_values_back_and_skipped_steps_change_nothing(
    small_text, tmp_path, monkeypatch, caplog
):
    inject_faults(monkeypatch, "nan:5-8")
    watch = WatchSteps()
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        train(compose_config(*overrides(small_text)), run, extra_callbacks=[watch])

    assert sorted(watch.by_step) == list(range(1, 13))
    allowed = {5, 10, 12} | {4, 8, 12}  # logging steps, and steps that save a checkpoint
    reading = {step for step, seen in watch.by_step.items() if seen}
    assert reading <= allowed, {step: watch.by_step[step] for step in reading - allowed}
    # non-finite steps are found on the device and told of when the counts are next read
    assert "step 5: the loss or its gradient is not finite; this update is skipped" in caplog.text
    assert "steps 6-8: 3 of their updates skipped, as the loss or its gradient was not finite" in caplog.text
    # and skipped there too: steps 5 to 8 left the weights, the moments and the step counts alone
    checkpoints = run / "checkpoints"
    assert_unchanged(checkpoints / "step-000008.ckpt", checkpoints / "step-000004.ckpt")
    assert torch.load(checkpoints / "step-000008.ckpt", weights_only=True)["nonfinite"] == {
        "skipped": 4,
        "in_a_row": 4,
    }
    later = checkpoint_weights(checkpoints / "step-000012.ckpt")["model.lm_head.weight"]
    assert torch.isfinite(later).all()
    assert not torch.equal(later, checkpoint_weights(checkpoints / "step-000008.ckpt")["model.lm_head.weight"])


def test_a_run_of_non_finite_steps_between_two_reads_still_stops_the_run(small_text, tmp_path, monkeypatch):
    # steps 2-4 are not finite and step 5 is again: the run of three is over by the read at step 5
    inject_faults(monkeypatch, "nan:2-4")
    run = tmp_path / "run"
    settings = overrides(small_text, "optim.max_nonfinite_in_a_row=3", "checkpoint.every_n_steps=100")
    with pytest.raises(TrainingDiverged, match=r"^training diverged: 3 steps in a row \(up to step 5\)"):
        train(compose_config(*settings), run)


def test_muons_skipped_steps_change_nothing_either(small_text, tmp_path, monkeypatch):
    # Muon takes no device-side flag: its steps are skipped by dropping the gradients
    inject_faults(monkeypatch, "nan:5-8")
    run = tmp_path / "run"
    train(compose_config(*overrides(small_text, "optim=muon", "trainer.max_steps=8")), run)
    assert_unchanged(run / "checkpoints" / "step-000008.ckpt", run / "checkpoints" / "step-000004.ckpt")


def test_compile_is_chosen_by_device_unless_named():
    assert choose_compile(None, "cpu") is False
    assert choose_compile(True, "cpu") is True and choose_compile(False, "auto") is False
    assert choose_compile(None, "auto") is choose_compile(None, "auto", Machine.this())
    gpu = Machine(cuda=True, bf16=True, triton=True)
    assert choose_compile(None, "auto", gpu) is True and choose_compile(None, "cpu", gpu) is False
    assert choose_compile(None, "auto", gpu._replace(triton=False)) is False  # nothing to generate kernels with
    values, _ = check(OmegaConf.to_container(compose_config(*TINY_OVERRIDES, "trainer.accelerator=cpu"), resolve=True))
    assert values["compile"] is False  # what the run's config.yaml and checkpoints record
