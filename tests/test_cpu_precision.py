"""A run that leaves trainer.precision to the machine, on a CPU with bfloat16 instructions, trains in
the precision a short timed probe of its own shape finds faster (shell.machine): kept in the user's
cache, so the next run of the shape on the processor does not probe again, and named in the run's
first line. Machines without bfloat16 instructions, GPUs, and precisions given are not probed."""

from __future__ import annotations

import json

import pytest

import shell.machine
from model import GPTConfig
from shell.machine import BF16_MARGIN, Machine, choose_precision, known_speed, precision_words, probe_key
from tests.common import TINY_OVERRIDES, only_run, train_here

CPU_WITHOUT_BF16 = Machine(cuda=False, bf16=False, triton=False, cpu_bf16=False)
CPU_WITH_BF16 = Machine(cuda=False, bf16=False, triton=False, cpu_bf16=True)
GPU = Machine(cuda=True, bf16=True, triton=True, cpu_bf16=True)
PROBE_FILE = "cpu_precision.json"  # in $TINYGPT2_CACHE


def tiny_config_of(n_layer: int = 1) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, vocab_size=64)


@pytest.fixture
def probe_cache_here(tmp_path, monkeypatch):
    """A cache of the test's own (as $TINYGPT2_CACHE names one), holding no probes yet: its probes' file."""
    monkeypatch.setenv("TINYGPT2_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / PROBE_FILE


def keep_probe(cache, config: GPTConfig, batch_size: int, speed: float) -> None:
    """A probe in the cache file, as an earlier run kept it."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    entry = {"fp32_step_s": 0.03, "bf16_step_s": 0.03 / speed, "bf16_speed": speed}
    cache.write_text(json.dumps({probe_key(config, batch_size): entry}))


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
def test_the_clearly_faster_precision_wins(fp32, bf16, chosen, probe_cache_here, monkeypatch):
    monkeypatch.setattr(shell.machine, "time_both", lambda config, batch_size: (fp32, bf16))  # the steps as timed
    assert choose_precision(None, "cpu", CPU_WITH_BF16, (tiny_config_of(), 4)) == chosen


@pytest.mark.parametrize(("speed", "chosen"), [(BF16_MARGIN, "bf16-mixed"), (BF16_MARGIN * 0.99, "32-true")])
def test_bf16_wins_from_its_margin_on(speed, chosen, probe_cache_here):
    keep_probe(probe_cache_here, tiny_config_of(), 4, speed)
    assert choose_precision(None, "cpu", CPU_WITH_BF16, (tiny_config_of(), 4)) == chosen


def test_what_the_first_line_says_of_a_measurement(probe_cache_here):
    config = tiny_config_of()
    assert precision_words("32-true", True, config, 4) == " (chosen for this machine)"  # nothing measured
    keep_probe(probe_cache_here, config, 4, 0.571)
    said = " (measured: bf16-mixed 0.57x as fast on this CPU for this shape)"
    assert precision_words("32-true", True, config, 4) == said
    assert precision_words("32-true", False, config, 4) == ""  # given on the command line: nothing to say
    assert precision_words("bf16-mixed", True, config, 4) == " (chosen for this machine)"  # not what it measured
    keep_probe(probe_cache_here, config, 4, 2.0)
    assert precision_words("bf16-mixed", True, config, 4).startswith(" (measured: bf16-mixed 2.00x as fast ")


def test_nothing_is_probed_without_bf16_instructions_on_a_gpu_or_with_a_precision_given(probe_cache_here):
    shape = (tiny_config_of(), 4)
    assert choose_precision(None, "cpu", CPU_WITHOUT_BF16, shape) == "32-true"
    assert choose_precision(None, "auto", GPU, shape) == "bf16-mixed"  # a GPU's rule: no CPU probe
    assert choose_precision("32-true", "cpu", CPU_WITH_BF16, shape) == "32-true"
    assert choose_precision("bf16-mixed", "cpu", CPU_WITH_BF16, shape) == "bf16-mixed"
    assert choose_precision(None, "cpu", CPU_WITH_BF16, None) == "32-true"  # shape not settled yet
    assert not probe_cache_here.exists()


def test_the_probe_times_the_shape_once_and_keeps_it(probe_cache_here, monkeypatch):
    """For real, on a tiny shape: both precisions trained and timed, the result kept in the cache file
    under this processor, torch and shape, and found there again rather than measured again."""
    config = tiny_config_of(n_layer=2)
    chosen = choose_precision(None, "cpu", CPU_WITH_BF16, (config, 4))
    [(key, entry)] = json.loads(probe_cache_here.read_text()).items()
    assert key == probe_key(config, 4) and "n_layer=2" in key and "batch_size=4" in key and "torch " in key
    assert entry["fp32_step_s"] > 0 and entry["bf16_step_s"] > 0
    assert chosen == ("bf16-mixed" if entry["bf16_speed"] >= BF16_MARGIN else "32-true")
    assert known_speed(config, 4) == entry["bf16_speed"]  # the same figures: not timed again
    timed = shell.machine.time_both
    monkeypatch.setattr(shell.machine, "time_both", lambda *shape: pytest.fail("timed again"))
    assert choose_precision(None, "cpu", CPU_WITH_BF16, (config, 4)) == chosen
    monkeypatch.setattr(shell.machine, "time_both", timed)
    assert choose_precision(None, "cpu", CPU_WITH_BF16, (config, 8)) in ("32-true", "bf16-mixed")  # a new batch: probed
    assert len(json.loads(probe_cache_here.read_text())) == 2


def test_a_kept_probe_decides_without_timing_again(probe_cache_here, monkeypatch):
    """A probe in the cache file (by an earlier run) decides: here one that found bf16 1.5x as fast."""
    config = tiny_config_of(n_layer=3)
    keep_probe(probe_cache_here, config, 4, 1.5)
    monkeypatch.setattr(shell.machine, "time_both", lambda *shape: pytest.fail("timed again"))
    assert choose_precision(None, "cpu", CPU_WITH_BF16, (config, 4)) == "bf16-mixed"
    assert known_speed(config, 4) == 1.5


def first_line(output: str) -> str:
    [line] = [line for line in output.splitlines() if " - model: " in line]
    return line


@pytest.mark.slow  # (two runs, with a probe of their shape and a token cache of their own)
def test_the_default_run_trains_in_the_precision_measured_faster_and_says_so(tmp_path, small_text, monkeypatch):
    # a CPU said to have AVX-512 BF16 beside its real flags, so that train.py probes here as it would on such a
    # CPU: the probe itself runs as it is, and on a CPU without the instructions finds bfloat16 slower
    real = shell.machine.cpu_flags
    monkeypatch.setattr(shell.machine, "cpu_flags", lambda: real() | {"avx512_bf16"})
    monkeypatch.setenv("TINYGPT2_CACHE", str(tmp_path / "cache"))
    tiny = [o for o in TINY_OVERRIDES if not o.startswith("trainer.precision=")]  # left to the machine
    first = train_here(*tiny, "trainer.max_steps=3", f"data.path={small_text}", "tokenizer.dropout=0")
    assert first.returncode == 0, first.stderr[-2000:]
    said = first.stdout + first.stderr
    assert "timing a few training steps of this model in 32-true and bf16-mixed on this CPU" in said
    [entry] = json.loads((tmp_path / "cache" / PROBE_FILE).read_text()).values()
    precision = "bf16-mixed" if entry["bf16_speed"] >= BF16_MARGIN else "32-true"
    words = f"measured: bf16-mixed {entry['bf16_speed']:.2f}x as fast on this CPU for this shape"
    assert f"precision {precision} ({words})" in first_line(said)
    run = only_run(tmp_path / "outputs")
    assert f"precision: {precision}" in (run / "config.yaml").read_text()

    # the run continued: the same processor and shape, so the kept probe decides, without timing again
    again = train_here(f"resume={run}", "trainer.max_steps=5")
    assert again.returncode == 0, again.stderr[-2000:]
    said = again.stdout + again.stderr
    assert "timing a few training steps" not in said and "chosen for this machine" not in said
    assert f"precision {precision} ({words})" in first_line(said)
