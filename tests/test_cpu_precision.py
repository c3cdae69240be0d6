"""A run that leaves trainer.precision to the machine, on a CPU with bfloat16 instructions, trains in
the precision a short timed probe of its own shape finds faster (shell.cpu_precision): kept in the
user's cache, so the next run of the shape on the processor does not probe again, and named in the
run's first line. Machines without bfloat16 instructions, GPUs, and precisions given are not probed."""

from __future__ import annotations

import json
import os

import pytest

from model import GPTConfig
from shell import cpu_precision
from shell.cpu_precision import BF16_MARGIN, Measured, bf16_speed, faster_precision, probe_cache, probe_key
from shell.settings import Machine, choose_precision
from tests.common import TINY_OVERRIDES, only_run, run_script

CPU_WITHOUT_BF16 = Machine(cuda=False, bf16=False, triton=False, cpu_bf16=False)
CPU_WITH_BF16 = Machine(cuda=False, bf16=False, triton=False, cpu_bf16=True)
GPU = Machine(cuda=True, bf16=True, triton=True, cpu_bf16=True)


def tiny_config_of(n_layer: int = 1) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, vocab_size=64)


@pytest.fixture
def probe_cache_here(tmp_path, monkeypatch):
    """A cache of the test's own (as $TINYGPT2_CACHE names one), holding no probes yet."""
    monkeypatch.setenv("TINYGPT2_CACHE", str(tmp_path / "cache"))
    return probe_cache()


@pytest.mark.parametrize(
    ("fp32", "bf16", "chosen"),
    [
        ([0.10, 0.10, 0.10], [0.05, 0.05, 0.05], "bf16-mixed"),  # twice as fast
        ([0.12, 0.12, 0.12], [0.10, 0.10, 0.10], "bf16-mixed"),  # 1.2x: clearly
        ([0.105, 0.105, 0.105], [0.10, 0.10, 0.10], "32-true"),  # a little faster: not clearly
        ([0.10, 0.10, 0.10], [0.175, 0.175, 0.175], "32-true"),  # slower (0.57x, the Xeon)
        ([0.10, 0.10, 0.90], [0.20, 0.20, 0.20], "32-true"),  # one fp32 step slowed by other work: outvoted
        ([0.10, 0.10, 0.10], [0.05, 0.05, 0.90], "bf16-mixed"),  # one bf16 step slowed: outvoted
    ],
)
def test_the_clearly_faster_precision_wins(fp32, bf16, chosen):
    assert faster_precision(bf16_speed(fp32, bf16)) == chosen
    assert faster_precision(BF16_MARGIN) == "bf16-mixed" and faster_precision(BF16_MARGIN * 0.99) == "32-true"


def test_what_the_first_line_says_of_a_measurement():
    assert Measured(0.1, 0.175, 0.571).words() == "measured: bf16-mixed 0.57x as fast on this CPU for this shape"
    assert Measured(0.1, 0.175, 0.571).precision == "32-true" and Measured(0.1, 0.05, 2.0).precision == "bf16-mixed"


def test_nothing_is_probed_without_bf16_instructions_on_a_gpu_or_with_a_precision_given(probe_cache_here):
    shape = (tiny_config_of(), 4)
    assert choose_precision(None, "cpu", CPU_WITHOUT_BF16, shape) == "32-true"
    assert choose_precision(None, "auto", GPU, shape) == "bf16-mixed"  # a GPU's rule: no CPU probe
    assert choose_precision("32-true", "cpu", CPU_WITH_BF16, shape) == "32-true"
    assert choose_precision("bf16-mixed", "cpu", CPU_WITH_BF16, shape) == "bf16-mixed"
    assert choose_precision(None, "cpu", CPU_WITH_BF16, None) == "32-true"  # shape not settled yet
    assert not probe_cache_here.exists()


@pytest.mark.slow  # (its first AdamW, as a run's, takes seconds to set up)
def test_the_probe_times_the_shape_once_and_keeps_it(probe_cache_here):
    """For real, on a tiny shape: both precisions trained and timed, the result kept in the cache file
    under this processor, torch and shape, and found there again rather than measured again."""
    config = tiny_config_of(n_layer=2)
    chosen = choose_precision(None, "cpu", CPU_WITH_BF16, (config, 4))
    [(key, entry)] = json.loads(probe_cache_here.read_text()).items()
    assert key == probe_key(config, 4) and "n_layer=2" in key and "batch_size=4" in key and "torch " in key
    found = Measured(**entry)
    assert found.fp32_step_s > 0 and found.bf16_step_s > 0 and chosen == found.precision
    assert cpu_precision.measured(config, 4) == found  # the same figures: not timed again
    assert choose_precision(None, "cpu", CPU_WITH_BF16, (config, 8)) in ("32-true", "bf16-mixed")  # a new batch: probed
    assert len(json.loads(probe_cache_here.read_text())) == 2


def test_a_kept_probe_decides_without_timing_again(probe_cache_here):
    """A probe in the cache file (by an earlier run) decides: here one that found bf16 1.5x as fast."""
    config = tiny_config_of(n_layer=3)
    probe_cache_here.parent.mkdir(parents=True)
    kept = Measured(fp32_step_s=0.03, bf16_step_s=0.02, bf16_speed=1.5)
    probe_cache_here.write_text(json.dumps({probe_key(config, 4): kept._asdict()}))
    assert choose_precision(None, "cpu", CPU_WITH_BF16, (config, 4)) == "bf16-mixed"
    assert cpu_precision.known(config, 4) == kept


# The sitecustomize.py of a CPU said to have AVX-512 BF16 (shell.flops.cpu_flags names it beside the real
# flags), so that train.py probes here as it would on such a CPU: the probe itself runs as it is, and
# on a CPU without the instructions finds bfloat16 slower, as on the Xeon.
SAYS_AVX512_BF16 = """\
import importlib.abc
import importlib.util
import sys


class WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "shell.flops":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def run_and_wrap(module):
            run(module)
            real = module.cpu_flags
            module.cpu_flags = lambda: real() | {"avx512_bf16"}

        spec.loader.exec_module = run_and_wrap
        return spec


sys.meta_path.insert(0, WrapOnImport())
"""


def first_line(output: str) -> str:
    [line] = [line for line in output.splitlines() if " - model: " in line]
    return line


@pytest.mark.slow
def test_the_default_run_trains_in_the_precision_measured_faster_and_says_so(tmp_path, small_text):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SAYS_AVX512_BF16)
    env = {**os.environ, "PYTHONPATH": str(hook), "TINYGPT2_CACHE": str(tmp_path / "cache")}
    args = [*TINY_OVERRIDES, "trainer.max_steps=3", f"data.path={small_text}", "tokenizer.dropout=0"]
    first = run_script("train.py", *args, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    said = first.stdout + first.stderr
    assert "timing a few training steps of this model in 32-true and bf16-mixed on this CPU" in said
    [entry] = json.loads((tmp_path / "cache" / "cpu_precision.json").read_text()).values()
    measured = Measured(**entry)
    assert f"precision {measured.precision} ({measured.words()})" in first_line(said)
    run = only_run(tmp_path / "outputs")
    assert f"precision: {measured.precision}" in (run / "config.yaml").read_text()

    # the run continued: the same processor and shape, so the kept probe decides, without timing again
    again = run_script("train.py", f"resume={run}", "trainer.max_steps=5", env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    said = again.stdout + again.stderr
    assert "timing a few training steps" not in said and "was chosen for the machine" not in said
    assert f"precision {measured.precision} ({measured.words()})" in first_line(said)
