"""Optimisation settings: schedules, parameter groups, the global batch, precision, MFU figures."""

from __future__ import annotations

import math

import pytest
import torch

from model import GPTConfig
from shell.checks import SettingError, problems_together
from shell.machine import Machine, choose_precision
from shell.settings import global_batch
from tests.tiny import untrained_gpt
from training.optim import lr_factor, make_adamw, parameter_groups


def test_warmup_is_linear_up_to_the_peak():
    assert [lr_factor(s, 4, 100, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedules_after_warmup(schedule):
    factors = [lr_factor(s, 10, 110, 0.1, schedule) for s in range(10, 111)]
    if schedule == "constant":
        assert all(f == 1.0 for f in factors)
        return
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors, factors[1:], strict=False))  # never goes up
    midpoint = factors[50]
    assert midpoint == pytest.approx(0.55)  # both schedules pass halfway at half time
    quarter = factors[25]
    expected = 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi * 0.25)) if schedule == "cosine" else 0.75)
    assert quarter == pytest.approx(expected)
    assert lr_factor(500, 10, 110, 0.1, schedule) == pytest.approx(0.1)  # stays at the floor


def test_time_budget_schedule_decays_over_the_time_not_the_steps(monkeypatch):
    import training.optim as optim

    clock = [100.0]
    monkeypatch.setattr(optim.time, "monotonic", lambda: clock[0])
    factor = optim.TimeBudgetSchedule(seconds=60, warmup_steps=2, min_lr_ratio=0.1, schedule="linear")
    assert [factor(0), factor(1)] == [0.5, 1.0]  # warmup counts steps
    clock[0] += 30  # half the budget spent, at whatever step
    assert factor(7) == pytest.approx(0.55)
    clock[0] += 60  # past the budget: the floor
    assert factor(8) == pytest.approx(0.1)


def test_the_schedules_the_settings_accept_are_the_ones_the_optimizer_has():
    from shell.checks import SPEC
    from training.optim import OPTIMIZERS, SCHEDULES

    assert tuple(SCHEDULES) == ("cosine", "linear", "constant") and tuple(OPTIMIZERS) == ("adamw", "muon")
    assert [SPEC["optim.schedule"]("optim.schedule", name) for name in SCHEDULES] == [None] * 3
    assert [SPEC["optim.name"]("optim.name", name) for name in OPTIMIZERS] == [None] * 2
    assert SPEC["optim.schedule"]("optim.schedule", "step") == (
        "optim.schedule must be one of cosine, linear, constant, got 'step'"
    )
    with pytest.raises(KeyError):  # what the settings refuse in one line (tests/test_bad_input.py) is no schedule
        lr_factor(20, 0, 10, 0.1, "step")


def test_biases_and_layernorms_are_not_decayed():
    gpt = untrained_gpt()
    decay, no_decay = parameter_groups(gpt, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in gpt.named_parameters()}
    assert all(names[id(p)].endswith("weight") and p.dim() == 2 for p in decay["params"])
    assert {names[id(p)].rsplit(".", 1)[-1] for p in no_decay["params"]} == {"bias", "weight"}  # biases, LN gains
    assert all(p.dim() == 1 for p in no_decay["params"])
    counted = sum(p.numel() for group in (decay, no_decay) for p in group["params"])
    assert counted == gpt.num_parameters()  # the tied lm_head/wte is one parameter, in one group
    optimizer = make_adamw(gpt, 1e-3, 0.1, [0.9, 0.95])  # betas as the yaml gives them
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert [list(map(id, g["params"])) for g in optimizer.param_groups] == [
        list(map(id, group["params"])) for group in (decay, no_decay)
    ]


def cfg(tokens_per_step=None, batch_size=8, block_size=32, accumulate=None):
    return {
        "tokens_per_step": tokens_per_step,
        "data": {"batch_size": batch_size},
        "model": {"block_size": block_size},
        "trainer": {"accumulate_grad_batches": accumulate},
    }


def accumulation(values, world_size):
    return global_batch(values, world_size)[1]


def test_global_batch_in_tokens_sets_accumulation_for_any_device_count():
    assert global_batch(cfg(tokens_per_step=2048), world_size=1) == (2048, 8)
    assert accumulation(cfg(tokens_per_step=2048), world_size=2) == 4
    assert accumulation(cfg(tokens_per_step=2048), world_size=8) == 1
    assert global_batch(cfg(), world_size=4) == (4 * 8 * 32, 1)  # null: one micro-batch per device
    assert global_batch(cfg(accumulate=3), world_size=1) == (3 * 8 * 32, 3)


@pytest.mark.parametrize("tokens, world, message", [(1000, 1, "not a multiple"), (256, 2, "not a multiple")])
def test_a_global_batch_that_does_not_divide_is_refused(tokens, world, message):
    with pytest.raises(SettingError, match=message):
        accumulation(cfg(tokens_per_step=tokens), world_size=world)


def test_global_batch_and_accumulation_together_are_refused():
    values = {**cfg(tokens_per_step=512, accumulate=2), "optim": {"name": "adamw"}, "tokenizer": {"kind": "char"}}
    values["trainer"]["max_steps"] = 10
    assert "set either tokens_per_step or trainer.accumulate_grad_batches, not both" in problems_together(values)


@pytest.mark.parametrize(
    "machine, accelerator, chosen",
    [
        (Machine(cuda=False, bf16=False, triton=False), "auto", "32-true"),  # no GPU
        (Machine(cuda=True, bf16=True, triton=True), "auto", "bf16-mixed"),  # an A100
        (Machine(cuda=True, bf16=False, triton=True), "auto", "32-true"),  # a V100
        (Machine(cuda=True, bf16=True, triton=True), "gpu", "bf16-mixed"),
        (Machine(cuda=True, bf16=True, triton=True), "cpu", "32-true"),  # a GPU machine told to train on its CPU
        # a CPU with bf16 instructions: a probe of the run's shape decides (tests/test_cpu_precision.py); without
        # a shape, 32-true; a GPU's rule is no CPU's
        (Machine(cuda=False, bf16=False, triton=False, cpu_bf16=True), "auto", "32-true"),
        (Machine(cuda=True, bf16=False, triton=True, cpu_bf16=True), "auto", "32-true"),  # a V100 is no CPU
    ],
)
def test_precision_left_unset_is_bf16_mixed_on_a_gpu_that_has_it(machine, accelerator, chosen):
    """bf16 on GPUs that have it; 32-bit on CPUs until a probe of the run's shape finds bf16 faster."""
    assert choose_precision(None, accelerator, machine, None) == chosen
    on_gpu = machine.cuda and accelerator != "cpu"
    assert choose_precision("bf16-mixed", accelerator, machine, None) == "bf16-mixed"  # a precision asked for wins
    assert choose_precision(32, accelerator, machine, None) == "32"  # a number, as the yaml gives it: Lightning's
    if on_gpu and chosen == "bf16-mixed":
        assert choose_precision("16-mixed", accelerator, machine, None) == "16-mixed"


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="float16 is trained on Apple GPUs")
def test_float16_is_refused_where_the_run_trains_on_a_cpu():
    """Lightning would train in bf16 instead, while the run's saved settings said 16-mixed."""
    for machine, accelerator in (
        (Machine(cuda=False, bf16=False, triton=False), "auto"),
        (Machine(True, True, True), "cpu"),
    ):
        with pytest.raises(SettingError, match="trainer.precision=16-mixed needs a CUDA GPU"):
            choose_precision("16-mixed", accelerator, machine, None)


def test_the_machine_the_choices_read_is_this_one():
    machine = Machine.this()
    assert machine.cuda == torch.cuda.is_available() and (machine.bf16 <= machine.cuda)
    assert Machine.this() == machine


def test_flops_per_token_match_the_known_gpt2_figure():
    # GPT-2 small with nanoGPT's padded vocabulary: 6N + 12 L C T = 0.855 GFLOPs per token
    gpt2 = GPTConfig(vocab_size=50304)
    assert gpt2.flops_per_token() == 6 * (12 * 12 * 768**2 + 768 * 50304) + 12 * 12 * 768 * 1024
    assert gpt2.flops_per_token() / 1e9 == pytest.approx(0.8547, abs=1e-3)
    assert gpt2.flops_per_token(training=False) == gpt2.flops_per_token() / 3


def test_time_budget_schedule_follows_the_time_it_is_given_across_a_resume():
    import training.optim as optim

    spent = [0.0]
    factor = optim.TimeBudgetSchedule(
        seconds=60, warmup_steps=0, min_lr_ratio=0.0, schedule="linear", elapsed=lambda: spent[0]
    )
    assert factor(0) == 1.0
    spent[0] = 45.0  # a resumed run's Timer starts from the time its checkpoint saved
    assert factor(1) == pytest.approx(0.25)
