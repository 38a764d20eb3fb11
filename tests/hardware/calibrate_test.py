"""Calibration: what `jaxtier.calibrate()` measures on this machine and where it stores it.

On the CPU backend the link and the GPU executors cannot be measured: their H200 figures stay,
and the executors' timing programs still compile and run on the CPU handler.
"""

import jax
import pytest

import jaxtier
from jaxtier._src.hardware import calibrate as calibration
from jaxtier._src.hardware import profile
from jaxtier._src.vocab import Executor


def test_profile_split_fraction_and_calibrate():
  p = profile.HardwareProfile(cpu_adamw_params_per_sec=1e9, dha_adamw_params_per_sec=3e9)
  assert profile.split_fraction(p) == pytest.approx(0.75)
  assert 0 < profile.split_fraction() < 1
  with pytest.raises(ValueError, match="expected link_h2d_gbps > 0"):
    profile.HardwareProfile(link_h2d_gbps=0)
  measured = calibration.calibrate(num_params=1 << 16)
  assert measured.cpu_adamw_params_per_sec > 0
  if jax.default_backend() == "cpu":  # no link to measure: the H200's figure stays
    assert measured.link_h2d_gbps == profile.DEFAULT_PROFILE.link_h2d_gbps
  else:
    assert measured.link_h2d_gbps != profile.DEFAULT_PROFILE.link_h2d_gbps
    assert "gpu and host measured" in measured.source
  assert calibration.calibrate(measure_cpu=False, measure_device=False) == profile.DEFAULT_PROFILE
  if jax.default_backend() == "cpu":  # the compute device is this CPU: its rates replace an H200's
    compute_only = calibration.calibrate(measure_cpu=False)
    assert compute_only.matmul_tflops != profile.DEFAULT_PROFILE.matmul_tflops
    assert compute_only.cpu_adamw_params_per_sec == profile.DEFAULT_PROFILE.cpu_adamw_params_per_sec


def test_measure_gpu_adamw_runs_each_executor():
  # On the GPU it times the executors; here the same programs (memory kinds, aliases, donation)
  # run on the CPU backend's handler: each compiles and runs.
  rates = calibration.measure_gpu_adamw(jax.devices()[0], 1 << 12, reps=1)
  assert set(rates) == {Executor.HOST_DHA, Executor.HOST_CPU}
  assert all(r > 0 for r in rates.values())


def test_measure_dha_compute_times_the_gather_and_the_matmul():
  # On the GPU it times the DHA kernels on pinned_host operands; here the CPU handlers run the
  # same calls on small shapes: each compiles, runs and gives a rate.
  rates = calibration.measure_dha_compute(jax.devices()[0], num_rows=1024, width=64,
                                          num_ids=256, k=128, n=256, m=8, reps=1)
  assert set(rates) == {"dha_gather_gbps", "dha_matmul_gbps"}
  assert all(0 < r < float("inf") for r in rates.values()), rates


def test_public_calibrate_stores_the_profile_where_the_planner_loads_it(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  measured = jaxtier.calibrate(measure_device=False, num_params=1 << 14)
  assert "calibrated" in measured.source
  assert profile.load() == measured  # the default cache path of this device and jax version
  elsewhere = str(tmp_path / "p.json")
  again = jaxtier.calibrate(path=elsewhere, measure_device=False, num_params=1 << 14)
  assert profile.load(elsewhere) == again
  assert jaxtier.calibrate(save=False, measure_cpu=False, measure_device=False) == (
      profile.DEFAULT_PROFILE)
