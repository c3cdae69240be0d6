"""The peak train/mfu is measured against (shell.machine): a GPU's from Lightning's table at the run's precision, a
CPU's the fastest rate seen on it (a matmul timed the first time, kept in $TINYGPT2_CACHE/cpu_peak_flops.json, and
raised by any faster training since), so that the utilisation never exceeds 1."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch

import shell.machine
from shell.machine import cpu_key, device_peak_flops, matmul_rate, remember_rate
from tests.common import TINY_OVERRIDES, train_here
from training.callbacks import Throughput

CPU = torch.device("cpu")
PEAKS = "cpu_peak_flops.json"  # in $TINYGPT2_CACHE


@pytest.fixture
def peaks_here(tmp_path, monkeypatch):
    """A cache of the test's own (as $TINYGPT2_CACHE names one), holding no rates yet: its rates' file."""
    monkeypatch.setenv("TINYGPT2_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / PEAKS


def rates_kept(peaks) -> dict:
    return json.loads(peaks.read_text())


def store(peaks, rates: dict) -> None:
    peaks.parent.mkdir(parents=True, exist_ok=True)
    peaks.write_text(json.dumps(rates))


def test_a_matmul_rate_is_a_rate_this_cpu_reaches():
    fp32 = matmul_rate(False, size=256, seconds=0.1)
    assert 1e6 < fp32 < 1e14  # FLOP/s: more than a megaflop, less than a hundred teraflops


def test_the_first_run_on_a_machine_measures_a_matmul_and_keeps_it(peaks_here, monkeypatch):
    peak = device_peak_flops(CPU, "32-true")
    assert peak > 0 and rates_kept(peaks_here) == {cpu_key(False): peak}
    monkeypatch.setattr(shell.machine, "matmul_rate", lambda *args, **kwargs: pytest.fail("measured again"))
    assert device_peak_flops(CPU, "32-true") == peak  # a stored figure is not measured again


def test_the_fastest_rate_seen_is_the_peak_however_low(peaks_here, monkeypatch):
    """A figure seen on a busy machine stays the peak until a faster rate is seen (train/mfu then raises it):
    there is no theoretical rate to put below it."""
    monkeypatch.setattr(shell.machine, "matmul_rate", lambda *args, **kwargs: pytest.fail("measured again"))
    store(peaks_here, {cpu_key(False): 1e9})
    assert device_peak_flops(CPU, "32-true") == 1e9


def test_only_a_faster_rate_replaces_the_one_kept_and_other_entries_stay(peaks_here):
    store(peaks_here, {"peak": 1.0, "other|8|8|2.4": 5e10, "bad": "x"})
    assert remember_rate(CPU, "32-true", 2e10) == 2e10
    assert remember_rate(CPU, "32-true", 1e10) == 2e10
    assert rates_kept(peaks_here) == {"peak": 1.0, "other|8|8|2.4": 5e10, "bad": "x", cpu_key(False): 2e10}


@pytest.mark.parametrize("damage", ["[1, 2]", "not json", "", '{"KEY": "fast"}', '{"KEY": -5}'])
def test_a_damaged_file_of_rates_is_measured_again_and_written_whole(damage, peaks_here, monkeypatch):
    peaks_here.parent.mkdir(parents=True)
    peaks_here.write_text(damage.replace("KEY", cpu_key(False)))
    monkeypatch.setattr(shell.machine, "matmul_rate", lambda bf16, *args, **kwargs: 7e9)
    assert device_peak_flops(CPU, "32-true") == 7e9
    assert rates_kept(peaks_here)[cpu_key(False)] == 7e9
    assert remember_rate(CPU, "32-true", 8e9) == 8e9 and rates_kept(peaks_here)[cpu_key(False)] == 8e9


def test_a_cache_that_cannot_be_written_only_loses_its_figures(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TINYGPT2_CACHE", str(tmp_path / "file" / "cache"))  # under a file: never a folder
    monkeypatch.setattr(shell.machine, "matmul_rate", lambda bf16, *args, **kwargs: 7e9)
    assert device_peak_flops(CPU, "32-true") == 7e9 and remember_rate(CPU, "32-true", 8e9) == 8e9


def test_mfu_never_exceeds_one_a_faster_rate_raises_the_peak_and_a_cpu_remembers_it(peaks_here):
    meter = Throughput(tokens_per_step=1024, world_size=1, precision="32-true", on_faster=remember_rate)
    meter.device, meter.peak = CPU, 1e9
    assert meter.utilisation(5e8) == 0.5
    assert meter.utilisation(4e9) == 1.0 and meter.peak == 4e9
    assert meter.utilisation(2e9) == 0.5
    assert rates_kept(peaks_here) == {cpu_key(False): 4e9}

    gpu = Throughput(tokens_per_step=1024, world_size=1, precision="bf16-mixed", on_faster=remember_rate)
    gpu.device, gpu.peak = torch.device("cuda", 0), 1e12
    assert gpu.utilisation(2e12) == 1.0 and gpu.peak == 2e12
    assert rates_kept(peaks_here) == {cpu_key(False): 4e9}  # a GPU's rate is no CPU's


def test_a_bf16_run_has_a_cpu_peak_of_its_own(peaks_here, monkeypatch):
    """bfloat16 matmuls run at another rate than float32 (faster with AVX-512 BF16 or AMX, slower without): the
    fastest rates seen are kept apart, and a bf16 run's rate does not raise the fp32 peak."""
    store(peaks_here, {cpu_key(False): 1e16})
    meter = Throughput(tokens_per_step=1024, world_size=1, precision="bf16-mixed", on_faster=remember_rate)
    meter.device, meter.peak = CPU, 1e9
    assert meter.utilisation(4e9) == 1.0
    assert rates_kept(peaks_here) == {cpu_key(False): 1e16, cpu_key(True): 4e9}
    monkeypatch.setattr(shell.machine, "matmul_rate", lambda *args, **kwargs: pytest.fail("measured again"))
    assert device_peak_flops(CPU, "bf16-mixed") == 4e9 and device_peak_flops(CPU, "32-true") == 1e16


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16), ("16-mixed", torch.float16), ("32-true", None)],
)
def test_a_gpus_peak_is_lightnings_figure_at_the_precision_it_trains_in(precision, dtype, peaks_here, monkeypatch):
    asked = []
    monkeypatch.setattr(
        "lightning.fabric.utilities.throughput.get_available_flops",
        lambda device, dtype: asked.append((device, dtype)) or 1e15,
    )
    gpu = torch.device("cuda", 0)
    assert device_peak_flops(gpu, precision) == 1e15 and asked == [(gpu, dtype or torch.float32)]
    assert remember_rate(gpu, precision, 2e15) == 2e15 and not peaks_here.exists()  # nothing kept of a GPU


def test_a_run_logs_its_mfu_never_above_one_and_raises_a_peak_set_too_low(small_text, peaks_here, monkeypatch):
    """A real run in this process, its CPU's peak kept far below what it reaches: every train/mfu logged is at
    most 1, and the fastest rate it reached is kept."""
    tokens = os.environ["TINYGPT2_CACHE"]  # (the session's: its tokens of the text are reused)
    store(peaks_here, {cpu_key(False): 1.0})
    run = peaks_here.parent.parent / "run"
    args = [*TINY_OVERRIDES, f"data.path={small_text}", f"data.cache_dir={tokens}", f"hydra.run.dir={run}"]
    monkeypatch.setenv("TINYGPT2_CACHE", str(peaks_here.parent))
    ran = train_here(*args)
    assert ran.returncode == 0, ran.stderr[-3000:]
    mfu = [float(row["train/mfu"]) for row in csv.DictReader(open(run / "metrics.csv")) if row["train/mfu"]]
    assert mfu and all(0 < value <= 1 for value in mfu), mfu
    assert rates_kept(peaks_here)[cpu_key(False)] > 1e6  # the rate the run reached, remembered
