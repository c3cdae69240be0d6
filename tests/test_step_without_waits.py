"""A training step that never makes the host wait for the device: nothing is read back from a tensor
but on logging steps, and a non-finite step is skipped by a decision made on the device. Watched here
on a CPU, where a read-back is what would be a wait on a GPU."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.overrides import TorchFunctionMode

from shell.checks import plain
from shell.machine import Machine, choose_compile
from shell.settings import check
from tests.common import ROOT, TINY_OVERRIDES, checkpoint_weights, inject_faults, one_error_line, train_here

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
    callbacks (this one runs after them: `watched`)."""

    def __init__(self):
        self.by_step: dict[int, list[str]] = {}
        self.watching: ReadBacks | None = None

    def on_train_batch_start(self, trainer, *args) -> None:
        self.watching = ReadBacks()
        self.watching.__enter__()

    def on_train_batch_end(self, trainer, *args) -> None:
        self.watching.__exit__(None, None, None)
        self.by_step[trainer.global_step] = self.watching.seen


@pytest.fixture
def watched(monkeypatch) -> WatchSteps:
    """A WatchSteps put last among the callbacks of every Trainer made in this test, as tests/faults puts its own."""
    from lightning.pytorch.trainer.trainer import Trainer

    watch, original = WatchSteps(), Trainer.__init__

    @functools.wraps(original)  # (its signature is what the settings check trainer.* against)
    def __init__(self, *args, callbacks=None, **kwargs):
        callbacks = [callbacks] if callbacks is not None and not isinstance(callbacks, list) else callbacks or []
        original(self, *args, callbacks=[*callbacks, watch], **kwargs)

    monkeypatch.setattr(Trainer, "__init__", __init__)
    return watch


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
    small_text, tmp_path, monkeypatch, watched
):
    inject_faults(monkeypatch, "nan:5-8")
    run = tmp_path / "run"
    ran = train_here(*overrides(small_text), f"hydra.run.dir={run}")
    assert ran.returncode == 0, ran.stderr[-3000:]

    assert sorted(watched.by_step) == list(range(1, 13))
    allowed = {5, 10, 12} | {4, 8, 12}  # logging steps, and steps that save a checkpoint
    reading = {step for step, seen in watched.by_step.items() if seen}
    assert reading <= allowed, {step: watched.by_step[step] for step in reading - allowed}
    # non-finite steps are found on the device and told of when the counts are next read
    assert "step 5: the loss or its gradient is not finite; this update is skipped" in ran.stdout
    assert "steps 6-8: 3 of their updates skipped, as the loss or its gradient was not finite" in ran.stdout
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
    settings = overrides(small_text, "optim.max_nonfinite_in_a_row=3", "checkpoint.every_n_steps=100")
    ran = train_here(*settings, f"hydra.run.dir={tmp_path / 'run'}")
    assert ran.returncode == 1
    assert one_error_line(ran.stderr).startswith("error: training diverged: 3 steps in a row (up to step 5)")


def test_muons_skipped_steps_change_nothing_either(small_text, tmp_path, monkeypatch):
    # Muon takes no device-side flag: its steps are skipped by dropping the gradients
    inject_faults(monkeypatch, "nan:5-8")
    run = tmp_path / "run"
    ran = train_here(*overrides(small_text, "optim=muon", "trainer.max_steps=8"), f"hydra.run.dir={run}")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert_unchanged(run / "checkpoints" / "step-000008.ckpt", run / "checkpoints" / "step-000004.ckpt")


def test_compile_is_chosen_by_device_unless_named():
    here, gpu = Machine.this(), Machine(cuda=True, bf16=True, triton=True)
    assert choose_compile(None, "cpu", here) is False
    assert choose_compile(None, "auto", Machine(cuda=False, bf16=False, triton=True)) is False  # a CPU's run
    assert choose_compile(True, "cpu", here) is True and choose_compile(False, "auto", gpu) is False
    assert choose_compile(None, "auto", gpu) is True and choose_compile(None, "cpu", gpu) is False
    assert choose_compile(None, "auto", gpu._replace(triton=False)) is False  # nothing to generate kernels with
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", [*TINY_OVERRIDES, "trainer.accelerator=cpu"], return_hydra_config=True)
    values, _ = check(plain(cfg), dict(cfg.hydra.runtime.choices))  # what a run checks first
    assert values["compile"] is False  # what the run's config.yaml and checkpoints record
