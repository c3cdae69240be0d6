"""trainer.strategy=fsdp: FSDP2 shards each block, on CPU processes too (gloo)."""

from __future__ import annotations

import json
import signal

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import generate
from checkpoint import load_checkpoint
from model import GPT
from shell.checks import SettingError
from shell.settings import check
from tests.common import TINY_OVERRIDES, compose_config, run_script, train_here
from tests.tiny import tiny_config
from training.module import shard


@pytest.fixture
def mesh(tmp_path):
    """A process group of this process alone (gloo) and its 1-D mesh: enough to shard a model for real."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_sharded_gpt_stays_tied_and_gives_the_plain_models_weights_and_loss(mesh):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    plain, sharded = GPT(tiny_config()), GPT(tiny_config())
    sharded.load_state_dict(plain.state_dict())
    shard(sharded, mesh, "32-true")
    assert sharded.lm_head.weight is sharded.transformer.wte.weight
    whole = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert whole.keys() == plain.state_dict().keys()
    assert all(torch.equal(whole[key], value) for key, value in plain.state_dict().items())
    idx = torch.randint(0, plain.config.vocab_size, (2, plain.config.block_size))
    assert torch.equal(sharded(idx, idx)[1], plain(idx, idx)[1])


def test_bf16_mixed_computes_with_bf16_weights_and_keeps_fp32_shards(mesh):
    model = GPT(tiny_config())
    shard(model, mesh, "bf16-mixed")
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(
        lambda layer, args, out: seen.append((layer.weight.dtype, out.dtype))
    )
    idx = torch.randint(0, model.config.vocab_size, (2, model.config.block_size))
    model(idx, idx)[1].backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_fsdp_takes_every_device_writes_no_samples_and_refuses_muon():
    fsdp = ["trainer.strategy=fsdp", "trainer.devices=2", "trainer.accelerator=cpu"]
    values = OmegaConf.to_container(compose_config(*fsdp), resolve=True)
    checked, world_size = check(values, {"optim": "adamw"})
    assert world_size == 2 and checked["samples"]["enabled"] is False
    with pytest.raises(SettingError, match="optim=muon does not work with trainer.strategy=fsdp"):
        check(OmegaConf.to_container(compose_config(*fsdp, "optim=muon"), resolve=True), {"optim": "muon"})


@pytest.mark.slow
def test_fsdp_on_two_processes_killed_and_resumed_matches_one_process(small_text, tmp_path, capsys):
    # 11 sequences a batch: Tiny Shakespeare's 133 validation windows split 67/66, 7 and 6 batches, and the
    # process with fewer must still take part in every forward of the sharded model
    common = [
        *(o for o in TINY_OVERRIDES if not o.startswith("data.batch_size=")),
        "data.batch_size=11",
        f"data.path={small_text}",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=null",
        "tokens_per_step=704",
        "checkpoint.every_n_steps=2",
    ]
    single, fsdp = tmp_path / "single", tmp_path / "fsdp"
    one = train_here(*common, f"hydra.run.dir={single}")  # (in this process: one process needs none of its own)
    assert one.returncode == 0, one.stderr[-2000:]
    killed = run_script(
        "train.py",
        *common,
        "trainer.strategy=fsdp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        f"hydra.run.dir={fsdp}",
        failpoint="kill:5",
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    said = killed.stdout + killed.stderr
    assert "704 tokens per step = 11 sequences x 32 tokens x 2 device(s) x 1 accumulation" in said
    assert said.count("trainer.strategy=fsdp: no text samples") == 1  # by the first process, not by each
    resumed = run_script("train.py", f"resume={fsdp}")  # from step 4, on two processes as it started
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    final = {run: json.loads((run / "result.json").read_text())["metrics"] for run in (single, fsdp)}
    assert final[fsdp]["val/loss"] == pytest.approx(final[single]["val/loss"], rel=1e-3)
    last = {run: torch.load(run / "checkpoints" / "last.ckpt", weights_only=True) for run in (single, fsdp)}
    weights = {run: last[run]["state_dict"] for run in (single, fsdp)}
    assert weights[fsdp].keys() == weights[single].keys()
    for key, value in weights[single].items():  # whole, plain tensors, as one process saves them
        torch.testing.assert_close(weights[fsdp][key], value, rtol=1e-4, atol=1e-5)
    assert weights[fsdp]["model.lm_head.weight"] is weights[fsdp]["model.transformer.wte.weight"]
    # the optimizer state numbered as one process numbers it, so either run continues on any devices
    moments = {run: last[run]["optimizer_states"][0]["state"] for run in (single, fsdp)}
    for i, state in moments[single].items():
        torch.testing.assert_close(moments[fsdp][i]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-6)

    idx = torch.arange(16).view(1, 16)
    torch.testing.assert_close(
        load_checkpoint(fsdp).model(idx)[0], load_checkpoint(single).model(idx)[0], rtol=1e-4, atol=1e-4
    )
    assert generate.main(["--ckpt", str(fsdp), "--prompt", "ROMEO:", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
