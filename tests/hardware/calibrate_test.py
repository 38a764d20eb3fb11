"""Calibration: what `jaxtier.calibrate()` measures on this machine and where it stores it.

On the CPU backend the link and the GPU executors cannot be measured: their H200 figures stay,
and the executors' timing programs still compile and run on the CPU handler.
"""

import jax
import pytest

import jaxtier
from jaxtier._src.hardware import calibrate as calibration
from jaxtier._src.hardware import machine
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
  assert machine.load() == measured  # the default cache path of this device and jax version
  elsewhere = str(tmp_path / "p.json")
  again = jaxtier.calibrate(path=elsewhere, measure_device=False, num_params=1 << 14)
  assert machine.load(elsewhere) == again
  assert jaxtier.calibrate(save=False, measure_cpu=False, measure_device=False) == (
      profile.DEFAULT_PROFILE)


class _Clock:
  """A clock that moves only when a fake measurement says it took time."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _fake_sweep(field, clock):
  """A sweep over sizes 1, 4, 16, 64, 256 whose run at size s takes s ms, and each measurement
  50 ms more (compiling): 1 + QUICK_REPS runs, so 0.054, 0.066, 0.114, 0.306 and 1.074 s."""
  def measure(s):
    clock.now += 0.05 + (1 + calibration.QUICK_REPS) * s * 1e-3
    return 1e3  # units per second: one run at s takes s / 1e3 s
  return calibration.Sweep(field, (1, 4, 16, 64, 256), measure, lambda s, rate: s / rate, float)


def test_sized_measure_stops_before_the_size_that_would_pass_the_deadline():
  clock = _Clock()
  # 0.054 + 0.066 + 0.114 = 0.234 s to 16; 64 would end at 0.54, 256 at 1.614.
  assert calibration.sized_measure(_fake_sweep("x", clock), 0.6, clock=clock) == (64, 1e3)
  assert clock.now == pytest.approx(0.54)
  clock.now = 0.0
  assert calibration.sized_measure(_fake_sweep("x", clock), 0.5, clock=clock) == (16, 1e3)
  assert clock.now == pytest.approx(0.234)
  # The smallest size is measured whatever the deadline; none past the largest.
  clock.now = 0.0
  assert calibration.sized_measure(_fake_sweep("x", clock), 0.0, clock=clock)[0] == 1
  assert calibration.sized_measure(_fake_sweep("x", clock), 1e9, clock=clock)[0] == 256


def test_quick_calibrate_shares_its_budget_and_stays_within_it(monkeypatch):
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's sweeps")
  clock = _Clock()
  monkeypatch.setattr(calibration, "cpu_sweeps", lambda: tuple(
      _fake_sweep(field, clock) for field in ("matmul_tflops", "hbm_gbps")))
  # The first gets half of the 1 s and stops at 16 (0.234 s; 64 would end at 0.54); the second
  # what is left, and stops at 64 (at 0.774; 256 would end at 1.848).
  quick = calibration.quick_calibrate(1.0, clock=clock)
  assert quick.sizes == {"matmul_tflops": 16, "hbm_gbps": 64}
  assert quick.secs == pytest.approx(0.774) and clock.now <= 1.0
  assert quick.profile.matmul_tflops == quick.profile.hbm_gbps == 1e3
  with pytest.raises(ValueError, match=r"expected budget_secs > 0 \(seconds\), got 0"):
    calibration.quick_calibrate(0)


def test_quick_calibrate_measures_what_a_cpu_plan_reads_at_the_sizes_its_budget_allows():
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's sweeps")
  sweeps = calibration.cpu_sweeps()
  # A budget below what the smallest sizes take: each figure at its smallest size.
  quick = calibration.quick_calibrate(1e-3)
  assert quick.sizes == {s.field: s.sizes[0] for s in sweeps}
  p = quick.profile
  assert p.source.startswith("calibrated on cpu (quick") and not p.is_default
  assert p.device_kind == jax.devices()[0].device_kind and p.cpu_threads >= 1
  for s in sweeps:  # measured here: this CPU's, not the H200 defaults
    assert 0 < getattr(p, s.field) != getattr(profile.DEFAULT_PROFILE, s.field), s.field
  # (A CPU's matmul rate is far below an H200's.)
  assert p.matmul_tflops < profile.DEFAULT_PROFILE.matmul_tflops / 10
  assert p.link_h2d_gbps == profile.DEFAULT_PROFILE.link_h2d_gbps  # no link here
