"""The memory a training step needs, told before a CPU run starts: the estimate must stay below what a
real step takes (a run refused for it could not have trained), and not far below (or it refuses nothing)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from model import GPT, GPTConfig
from shell.memory import check_fits, free_memory, parameter_count, step_memory, tight_fit
from tests.common import TINY_OVERRIDES, refused


def saved_for_backward(model: GPT, batch: int) -> tuple[int, int]:
    """The bytes a forward pass keeps for the backward pass (parameters aside), counted by torch's own
    saved-tensor hook, each storage once: (by the blocks and embeddings, by the loss over the logits)."""
    config = model.config
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=torch.Generator().manual_seed(0))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    logits: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
            if tensor.dim() and tensor.size(-1) == config.vocab_size:
                logits.add(storage.data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x, x)
    by_logits = sum(seen[p] for p in logits)
    return sum(seen.values()) - by_logits, by_logits


@pytest.mark.parametrize(
    "shape",
    [
        dict(n_layer=4, n_head=4, n_embd=128, block_size=32, vocab_size=1024),  # the default run's model
        dict(n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=65, attention="explicit"),
        dict(n_layer=2, n_head=2, n_embd=256, block_size=64, vocab_size=4096),
    ],
)
def test_the_estimate_of_the_activations_is_what_the_model_keeps_for_its_backward_pass(shape):
    """Measured on the model itself (deterministic, unlike a process's memory on a busy machine): what its
    blocks keep for the backward pass is at least the estimate's share for them and not far above it;
    the loss keeps one float per vocabulary entry and token (its log-softmax), of the estimate's three
    (with the logits and their gradient, alive with it when the backward pass starts)."""
    config, batch = GPTConfig(**shape), 16
    blocks, by_logits = saved_for_backward(GPT(config), batch)
    tokens = batch * config.block_size
    logits_share = 4 * 3 * config.vocab_size * tokens
    estimated_blocks = step_memory(config, batch).activations - logits_share
    assert estimated_blocks <= blocks < 1.5 * estimated_blocks
    assert by_logits == logits_share // 3


def test_the_parameter_count_is_the_models():
    for shape in (dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300), dict()):
        config = GPTConfig(**shape)
        assert parameter_count(config) == GPT(config).num_parameters()


def test_free_memory_is_what_the_kernel_says_or_a_cgroup_limit_below_it(tmp_path):
    meminfo = "MemTotal:       24000000 kB\nMemAvailable:   10000000 kB\nSwapFree:        2000000 kB\n"
    assert free_memory(meminfo, cgroup=tmp_path / "none") == 12000000 * 1024
    (tmp_path / "memory.max").write_text("4294967296\n")
    (tmp_path / "memory.current").write_text("1073741824\n")
    assert free_memory(meminfo, cgroup=tmp_path) == 3 * 2**30
    (tmp_path / "memory.max").write_text("max\n")  # no limit
    assert free_memory(meminfo, cgroup=tmp_path) == 12000000 * 1024
    assert free_memory("MemTotal: 1 kB\n", cgroup=tmp_path) is None  # a kernel too old to say


def test_what_does_not_fit_is_said_with_its_parts_and_the_way_out():
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=32, vocab_size=1024)
    assert check_fits(config, 32, "32-true", "adamw", 1, 2**30) is None
    assert check_fits(config, 32, "32-true", "adamw", 1, None) is None  # cannot be told: not refused
    message = check_fits(config, 100_000, "32-true", "adamw", 2, 8 * 2**30)
    assert message.startswith("a training step of this model at data.batch_size=100000 needs at least ")
    assert "each (" in message and "for 2 processes; use a smaller data.batch_size" in message
    # bf16 halves the activations: a batch that does not fit in 32 bits may in 16
    fits16 = step_memory(config, 20_000, "bf16-mixed").total
    assert check_fits(config, 20_000, "bf16-mixed", "adamw", 1, fits16) is None
    assert check_fits(config, 20_000, "32-true", "adamw", 1, fits16) is not None
    # 64-bit doubles the weights and the activations; bf16-true halves both
    assert step_memory(config, 64, "64-true") == tuple(2 * n for n in step_memory(config, 64))
    assert step_memory(config, 64, "bf16-true") == tuple(n // 2 for n in step_memory(config, 64))
    # what fits by the estimate and not by the most a step was measured above it: a warning
    need = step_memory(config, 20_000).total
    assert tight_fit(config, 20_000, "32-true", "adamw", 1, int(need * 1.2)).startswith(
        "a training step of this model at data.batch_size=20000 needs at least"
    )
    assert tight_fit(config, 20_000, "32-true", "adamw", 1, need * 2) is None
    big = GPTConfig(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50257)
    assert check_fits(big, 1, "32-true", "adamw", 1, 8 * 2**30).endswith("; choose a smaller model")


def test_train_py_refuses_a_batch_this_machine_cannot_hold_in_one_line_and_makes_nothing(small_text, tmp_path):
    """Rather than being killed part way into its first step with no word of why, and leaving a run
    folder: a micro-batch far beyond the machine's memory is refused before the run is made."""
    free = free_memory()
    if free is None:
        pytest.skip("this system does not say how much memory is free")
    batch = 4 * free // (4 * 32 * (2 * 14 * 32 + 3 * 300)) + 1  # four times what fits, in the tiny model
    args = [*TINY_OVERRIDES, f"data.path={small_text}", f"data.batch_size={batch}"]
    line = refused(*args, env={"TINYGPT2_CACHE": str(tmp_path / "cache")})  # (no run folder, no cache entry)
    assert line.startswith(f"a training step of this model at data.batch_size={batch} needs at least ")


def test_many_processes_are_counted_with_what_each_holds_before_its_model():
    """64 processes of a tiny model fit by their training steps alone, but not once each process's
    Python, torch and Lightning are counted: refused, where the launch waited minutes on a full machine."""
    tiny = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=300)
    assert step_memory(tiny, 8).total * 64 < 8 * 2**30
    message = check_fits(tiny, 8, "32-true", "adamw", 64, 8 * 2**30)
    assert message.startswith("64 processes (trainer.devices) take at least 300 MiB each before their model")
    assert message.endswith("more than the 8.0 GiB this machine has free; start fewer")
    assert check_fits(tiny, 8, "32-true", "adamw", 2, 8 * 2**30) is None


def test_more_processes_than_cores_are_warned_of(caplog):
    from shell.settings import check_memory

    values = {
        "trainer": {"accelerator": "cpu", "num_nodes": 1, "precision": "32-true"},
        "data": {"batch_size": 8},
        "optim": {"name": "adamw"},
    }
    tiny = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=300)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # a share of the machine (taskset, a container): the cores it may use
    cores = 1
    try:
        with caplog.at_level(logging.WARNING, logger="shell.settings"):
            check_memory(values, tiny, cores)
            assert not caplog.records
            check_memory(values, tiny, cores + 1)
    finally:
        os.sched_setaffinity(0, allowed)
    assert [r.getMessage() for r in caplog.records] == [
        f"trainer.devices={cores + 1} starts {cores + 1} training processes on this machine's {cores} CPU cores: "
        f"they take turns on the cores, so the run goes slower than with trainer.devices={cores}"
    ]
