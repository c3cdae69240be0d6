"""optim=muon: Muon for the blocks' weight matrices, AdamW for the rest, one optimizer to Lightning,
resumable bit for bit like AdamW."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from model import GPT
from tests.common import TINY_OVERRIDES, assert_same, only_run, refused, run_script, train_here
from tests.tiny import TINY_VOCAB, tiny_config
from training.optim import NEWTON_SCHULZ, Muon, MuonAdamW, block_matrices, orthogonalize

TORCH_MUON = pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="compares with torch.optim.Muon, which torch 2.9 and newer have"
)


def muon_of(model: GPT) -> MuonAdamW:
    return MuonAdamW(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), momentum=0.95)


def test_each_parameter_has_one_optimizer_and_the_hidden_matrices_have_muon():
    model = GPT(tiny_config())
    optimizer = muon_of(model)
    muon = {id(p) for g in optimizer.muon.param_groups for p in g["params"]}
    adamw = {id(p) for g in optimizer.adamw.param_groups for p in g["params"]}
    assert not muon & adamw and muon | adamw == {id(p) for p in model.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[i] for i in muon) == sorted(
        f"transformer.h.{i}.{part}.weight"
        for i in range(model.config.n_layer)
        for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert all(p is not model.transformer.wte.weight for p in block_matrices(model))  # tied to the output layer
    # the schedule sees every group: setting lr on the combined groups sets the inner optimizers'
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    assert all(g["lr"] == 0.5 for opt in (optimizer.muon, optimizer.adamw) for g in opt.param_groups)


def test_the_optimizer_lightning_hands_the_training_step_sees_every_group_and_zeroes_every_gradient():
    """Lightning's wrapper subclasses the optimizer's class: the groups must not be looked up in the
    wrapper's own attributes, or zero_grad leaves the gradients to add up over the steps."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = GPT(tiny_config())
    optimizer = muon_of(model)
    wrapped = LightningOptimizer(optimizer)
    assert [id(g) for g in wrapped.param_groups] == [id(g) for g in optimizer.param_groups] != []
    idx = torch.randint(0, TINY_VOCAB, (2, model.config.block_size))
    model(idx, idx)[1].backward()
    wrapped.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def test_a_step_moves_every_parameter_and_the_state_round_trips():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    optimizer = muon_of(model)
    before = [p.detach().clone() for p in model.parameters()]
    idx = torch.randint(0, TINY_VOCAB, (2, model.config.block_size))

    def closure():
        optimizer.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert torch.isfinite(loss)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    again = muon_of(model)
    again.load_state_dict(optimizer.state_dict())
    mine, theirs = optimizer.state_dict(), again.state_dict()
    for part in ("muon", "adamw"):
        for key, values in mine[part]["state"].items():
            for name, value in values.items():
                assert torch.equal(value, theirs[part]["state"][key][name]), (part, name)
    assert len(optimizer.state) == sum(1 for _ in model.parameters())


def test_an_adamw_state_is_refused_by_muon():
    model = GPT(tiny_config())
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="not optim=muon's"):
        muon_of(model).load_state_dict(adamw.state_dict())


@TORCH_MUON
def test_the_steps_are_torch_muons_computed_in_float32_on_a_cpu():
    torch.manual_seed(0)
    shapes = [(48, 16), (16, 64), (16, 16)]  # tall, wide, square
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    mine, torchs = Muon(ours, **settings), torch.optim.Muon(theirs, **settings)
    for _ in range(4):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        mine.step()
        torchs.step()
    for a, b in zip(ours, theirs, strict=True):
        moved = (a.detach() - b.detach()).abs().max().item()
        assert 0 < moved < 2e-3  # torch's bfloat16 rounding, not another algorithm
    # the state is torch.optim.Muon's own: either loads the other's
    torchs.load_state_dict(mine.state_dict())
    assert torch.equal(torchs.state[theirs[0]]["momentum_buffer"], mine.state[ours[0]]["momentum_buffer"])
    # float32 on a CPU: as close to a float64 orthogonalisation as float32 allows
    matrix = torch.randn(48, 16)
    coefficients, steps, eps = NEWTON_SCHULZ, 5, 1e-7
    exact = orthogonalize(matrix.double(), coefficients, steps, eps)
    assert orthogonalize(matrix, coefficients, steps, eps).dtype == torch.float32
    assert torch.allclose(orthogonalize(matrix, coefficients, steps, eps).double(), exact, atol=1e-5)


def final_state(run: Path) -> dict:
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    return {"weights": checkpoint["state_dict"], "optimizer": checkpoint["optimizer_states"][0]}


@pytest.mark.slow
def test_a_killed_muon_run_resumes_bit_for_bit_with_the_command_it_is_told(small_text, tmp_path):
    args = [
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "optim=muon",
        "optim.warmup_steps=2",
        "trainer.max_steps=10",
        "trainer.val_check_interval=5",
        "checkpoint.every_n_steps=2",
    ]
    reference = train_here(*args, "runs_root=reference")
    assert reference.returncode == 0, reference.stderr[-2000:]
    ref_run = only_run(tmp_path / "reference")

    killed = run_script("train.py", *args, cwd=tmp_path, failpoint="kill:7")  # (a process: a SIGKILL ends it)
    assert killed.returncode == -signal.SIGKILL
    run = only_run(tmp_path / "outputs")
    resumed = train_here(f"resume={run}")  # only the run: its settings are its own
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same(final_state(run), final_state(ref_run))
    assert set(final_state(run)["optimizer"]) == {"muon", "adamw"}


def test_muon_chosen_by_name_alone_is_refused_with_the_group_to_use():
    assert refused(*TINY_OVERRIDES, "optim.name=muon") == (
        "optim.name=muon needs optim.momentum; choose the group instead: optim=muon"
    )  # (and, refused, it leaves nothing)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            ["optim.momentum=0.9"],  # the default optimizer, AdamW, has no such setting
            "unknown setting 'optim.momentum': optim=adamw has no such setting, optim=muon has; "
            "choose optim=muon to use it, or leave it out",
        ),
        (
            ["+optim.momentum=0.9"],  # added to AdamW's settings, where it would be ignored
            "optim.momentum is Muon's setting, and AdamW has none (its momentum is optim.betas): for AdamW "
            "choose the group optim=adamw and leave optim.momentum out; for Muon choose optim=muon",
        ),
        (
            ["optim=muon", "optim.name=adamw"],  # the group's momentum stays behind
            "optim.momentum is Muon's setting, and AdamW has none (its momentum is optim.betas): for AdamW "
            "choose the group optim=adamw and leave optim.momentum out; for Muon choose optim=muon",
        ),
    ],
)
def test_muons_momentum_given_to_adamw_is_refused_with_what_to_do(overrides, said):
    assert refused(*TINY_OVERRIDES, *overrides) == said
