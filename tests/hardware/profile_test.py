"""The hardware profile: its rates and validation, its storage (save, load, stale files ignored)
and the defaults used where no profile was stored or the platform is absent."""

import dataclasses
import json
import logging
import os
import subprocess
import sys

import types

import jax
from planning._toy import P, STEP, mlp_state, toy_batch
import pytest

import jaxtier
from jaxtier._src.hardware import calibrate as calibration
from jaxtier._src.hardware import machine
from jaxtier._src.hardware import profile


def test_profile_rates_and_validation():
  assert P.cpu_update_gbps() == pytest.approx(30.0)  # 1e9 params/s x 30 B/param
  assert profile.split_fraction(P) == pytest.approx(0.75)
  with pytest.raises(ValueError, match="expected dha_read_gbps > 0"):
    profile.HardwareProfile(dha_read_gbps=-1.0)
  with pytest.raises(ValueError, match=r"expected dha_layer_grid in \(0, 1\], got 1.5"):
    profile.HardwareProfile(dha_layer_grid=1.5)
  with pytest.raises(ValueError, match="expected dha_layer_grid > 0"):
    profile.HardwareProfile(dha_layer_grid=0.0)
  with pytest.raises(ValueError, match="expected device_kind to be a string"):
    profile.HardwareProfile(device_kind=3)
  d = profile.DEFAULT_PROFILE
  assert d.is_default and d.link_duplex_gbps < d.link_h2d_gbps + d.link_d2h_gbps
  assert d.pinnable_bytes == 64 * 2**30 and d.hbm_bytes < 144 * 2**30


def test_load_profile_for_an_absent_platform_is_the_default(tmp_path):
  if jax.default_backend() == "gpu":
    pytest.skip("this machine has a GPU")
  assert machine.load(platform="gpu") == profile.DEFAULT_PROFILE
  p = calibration.calibrate(num_params=1 << 14)
  assert p.device_kind == jax.devices()[0].device_kind and "calibrated" in p.source
  assert p.host_dram_gbps > 0 and p.cpu_threads >= 1
  assert p.link_h2d_gbps == profile.DEFAULT_PROFILE.link_h2d_gbps  # not measured here
  assert machine.load(profile.save(p, str(tmp_path / "p.json"))) == p


def test_stale_stored_profile_is_ignored_with_one_warning(tmp_path, monkeypatch, caplog):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  path = profile.cache_path()
  os.makedirs(os.path.dirname(path))
  # What an older build stored: no format version, and an H200's matmul rate for this machine.
  old = dataclasses.replace(profile.DEFAULT_PROFILE, cpu_adamw_params_per_sec=1.5e9,
                            device_kind=jax.devices()[0].device_kind,
                            source="calibrated on cpu (host measured, 2026-11-01)")
  with open(path, "w") as f:
    json.dump(dataclasses.asdict(old), f)
  # Without a profile this jaxtier reads: the defaults, or on a GPU its card's built-in one.
  fallback = machine.builtin_here()[0]
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert machine.load() is fallback
    assert machine.load() is fallback
  stale = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
  assert len(stale) == 1, stale  # once per path
  assert f"ignoring {path}: written by an older jaxtier" in stale[0]
  assert "python -m jaxtier calibrate" in stale[0]
  # An older version number is stale too; the current one loads.
  with open(path, "w") as f:
    json.dump({"format_version": profile.PROFILE_FORMAT_VERSION - 1,
               **dataclasses.asdict(old)}, f)
  assert machine.load() is fallback
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert machine.load(profile.save(old)) == old
  assert not caplog.records
  with open(path) as f:
    assert json.load(f)["format_version"] == profile.PROFILE_FORMAT_VERSION


@pytest.mark.slow
def test_profile_save_load_roundtrip_and_calibrate_cli(tmp_path):
  p = profile.HardwareProfile(cpu_adamw_params_per_sec=1.5e9)
  path = profile.save(p, str(tmp_path / "p.json"))
  assert machine.load(path) == p
  assert machine.load(str(tmp_path / "missing.json")) == machine.builtin_here()[0]
  (tmp_path / "bad.json").write_text(json.dumps(
      {"format_version": profile.PROFILE_FORMAT_VERSION, "warp_factor": 9}))
  with pytest.raises(ValueError, match=r"unknown fields \['warp_factor'\]"):
    machine.load(str(tmp_path / "bad.json"))
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
  out = subprocess.run([sys.executable, "-m", "jaxtier", "calibrate"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "saved to" in out.stdout
  saved = machine.load(out.stdout.strip().splitlines()[-1].split("saved to ", 1)[1])
  assert saved.cpu_adamw_params_per_sec > 1e7  # measured here, not the default
  assert saved.cpu_adamw_params_per_sec != profile.DEFAULT_PROFILE.cpu_adamw_params_per_sec
  if jax.default_backend() == "cpu":
    assert "no GPU here" in out.stdout
    # The CPU backend's compute device is this CPU: its rates, far below an H200's.
    assert 1e-4 < saved.matmul_tflops < profile.DEFAULT_PROFILE.matmul_tflops / 10
    assert 0.1 < saved.hbm_gbps < profile.DEFAULT_PROFILE.hbm_gbps
  else:  # the GPU's own figures
    assert "no GPU here" not in out.stdout
    assert saved.link_h2d_gbps != profile.DEFAULT_PROFILE.link_h2d_gbps
    assert saved.matmul_tflops > 10


def test_a_profile_file_that_is_not_json_is_ignored_with_a_warning(tmp_path, caplog):
  path = tmp_path / "profile.json"
  path.write_text("{garbage")
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert machine.load(str(path)) is machine.builtin_here()[0]
  assert f"ignoring {path}: not a profile" in caplog.text
  assert "python -m jaxtier calibrate" in caplog.text


def test_the_pinned_pool_that_fits_is_named_only_where_the_pool_binds_and_the_host_has_room(
    monkeypatch):
  from jaxtier._src.hardware import host  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
  monkeypatch.setattr(host, "available_bytes", lambda: 120 * 2**30)
  # over 64 GiB, room for it: the pool at the room there is, 0.9 of what is available
  assert host.pinned_pool_that_fits(int(94.55 * 2**30)) == 108
  assert host.pinned_pool_that_fits(int(107.5 * 2**30)) == 108
  assert host.pinned_pool_that_fits(60 * 2**30) is None  # the default pool holds it
  assert host.pinned_pool_that_fits(110 * 2**30) is None  # over 0.9 of what is available
  assert host.pinned_pool_that_fits(int(94.55 * 2**30), num_local_devices=2) is None
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")
  assert host.pinned_pool_that_fits(int(94.55 * 2**30)) is None  # the raised pool holds it


def test_a_preallocated_pool_is_what_the_gpu_can_pin_whatever_is_left_available(monkeypatch):
  # Pinned when JAX starts, XLA's pool is no longer in MemAvailable: the pool is the limit.
  from jaxtier._src.hardware import host  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "108")
  monkeypatch.setattr(host, "available_bytes", lambda: 16 * 2**30)
  monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", raising=False)
  assert host.pinnable_bytes("gpu") == 16 * 2**30
  assert host.pinned_pool_room_bytes() == int(0.9 * 16 * 2**30)
  for value in ("true", "1", "TRUE"):
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", value)
    assert host.pinnable_bytes("gpu") == 108 * 2**30
    assert host.pinned_pool_room_bytes() == 108 * 2**30
    assert host.pinned_pool_that_fits(100 * 2**30) is None  # the pool holds it
  assert host.pinnable_bytes("cpu") == 16 * 2**30  # the CPU backend has no pool
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "false")
  assert host.pinnable_bytes("gpu") == 16 * 2**30


def test_the_mem_fraction_that_fits_is_named_only_where_the_fraction_binds_and_the_gpu_has_room(
    monkeypatch):
  from jaxtier._src.hardware import host  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  # An H200 as JAX starts on it: 0.75 of 135.3 GiB free at start-up.
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: int(0.75 * 135.3 * 2**30))
  assert host.mem_fraction_that_fits(90 * 2**30, margin=0.05) is None  # holds it already
  # 115 GiB / (0.95 * 135.3 GiB) = 0.895: rounded up to 0.90, plus 0.02
  assert host.mem_fraction_that_fits(115 * 2**30, margin=0.05) == "0.92"
  # 0.94 needed: plus 0.02 would pass 0.95, the most named
  assert host.mem_fraction_that_fits(120.5 * 2**30, margin=0.05) == "0.95"
  assert host.mem_fraction_that_fits(125 * 2**30, margin=0.05) is None  # over 0.95 of the GPU
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: int(0.5 * 135.3 * 2**30))
  assert host.mem_fraction_that_fits(70 * 2**30, margin=0.05) == "0.57"
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: None)  # no GPU here
  assert host.mem_fraction_that_fits(115 * 2**30, margin=0.05) is None


@pytest.fixture
def auto(tmp_path, monkeypatch):
  """Auto-calibration on (the test session turns it off), an empty profile cache, and a fresh
  process's memory of what it calibrated and warned about; the quick calibrations `load` runs
  are counted, each at its smallest sizes (a fraction of a second). Returns the count."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  monkeypatch.setenv(machine.AUTO_CALIBRATE_ENV, "1")
  monkeypatch.setattr(machine, "_AUTO_CALIBRATED", {})
  monkeypatch.setattr(machine, "_WARNED", set())
  calls = []
  quick = calibration.quick_calibrate

  def counted(budget_secs=calibration.QUICK_BUDGET_SECS):
    calls.append(budget_secs)
    return quick(1e-3)
  monkeypatch.setattr(calibration, "quick_calibrate", counted)
  return calls


def _labelled(plan) -> bool:
  """Whether `plan` says its times are the H200 defaults', not this machine's."""
  return (plan.rates_of == "the default profile's H200 rates, not this machine's"
          and "times: uncalibrated H200 default rates: python -m jaxtier calibrate"
          in plan.summary(120))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend calibrates itself")
def test_load_without_a_profile_calibrates_once_and_stores_it(auto, monkeypatch, caplog):
  path = profile.cache_path()
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    first = machine.load()
    assert machine.load() == first  # this process: not measured again
  assert auto == [calibration.QUICK_BUDGET_SECS]
  assert first.source.startswith("calibrated on cpu (quick") and not first.is_default
  said = [r.getMessage() for r in caplog.records]
  assert len(said) == 1 and "no hardware profile for cpu: measured this machine in" in said[0]
  assert f"stored at {path}" in said[0] and "JAXTIER_AUTO_CALIBRATE=0 turns this off" in said[0]
  # The next process reads the file: no measurement, no warning.
  monkeypatch.setattr(machine, "_AUTO_CALIBRATED", {})
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert machine.load() == first == machine.load(path)
  assert auto == [calibration.QUICK_BUDGET_SECS] and not caplog.records
  # A plan with it predicts with this machine's rates: no label.
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch())
  assert not plan.rates_of and "uncalibrated" not in plan.summary(120)
  assert f"hardware profile: {first.source}" in plan.notes
  # Neither a GPU planned for here nor a path given is measured.
  assert machine.load(platform="gpu") is profile.DEFAULT_PROFILE
  folder = os.path.dirname(path)
  assert machine.load(os.path.join(folder, "other.json")) is profile.DEFAULT_PROFILE
  assert auto == [calibration.QUICK_BUDGET_SECS]
  assert os.listdir(folder) == [os.path.basename(path)]  # (and no partial file left)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend calibrates itself")
def test_a_stale_profile_is_measured_again(auto, caplog):
  path = profile.cache_path()
  os.makedirs(os.path.dirname(path))
  with open(path, "w") as f:
    json.dump(dataclasses.asdict(profile.DEFAULT_PROFILE), f)  # no format_version
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    measured = machine.load()
  assert len(auto) == 1 and measured.source.startswith("calibrated on cpu (quick")
  assert machine.load(path) == measured  # stored over the stale one
  assert "written by an older jaxtier" not in caplog.text


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend calibrates itself")
def test_auto_calibration_turned_off_gives_the_labelled_defaults(auto, monkeypatch, caplog):
  for off in ("0", "false", "OFF"):
    monkeypatch.setenv(machine.AUTO_CALIBRATE_ENV, off)
    with caplog.at_level(logging.WARNING, logger="jaxtier"):
      assert machine.load() is profile.DEFAULT_PROFILE
  assert not auto and not os.path.exists(profile.cache_path()) and not caplog.records
  assert _labelled(jaxtier.plan(STEP, mlp_state(), toy_batch()))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend calibrates itself")
def test_a_failing_measurement_falls_back_to_the_labelled_defaults(auto, monkeypatch, caplog):
  failed = []

  def fails(*args, **kwargs):
    failed.append(args)
    raise RuntimeError("no CPU handler")
  monkeypatch.setattr(calibration, "measure_cpu_adamw", fails)
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert machine.load() is profile.DEFAULT_PROFILE
    plan = jaxtier.plan(STEP, mlp_state(), toy_batch())
  assert len(auto) == 1 and len(failed) == 1  # tried once in this process, not per load
  assert not os.path.exists(profile.cache_path())
  said = [r.getMessage() for r in caplog.records]
  assert len(said) == 1, said
  assert ("measuring this machine failed (RuntimeError: no CPU handler); planning with the "
          "defaults, so the plan's times are not this machine's") in said[0]
  assert _labelled(plan)


def _gpu_here(monkeypatch, kind):
  """This machine as JAX would see it on a GPU of `kind` (the cache path is keyed by it)."""
  device = types.SimpleNamespace(device_kind=kind, platform="gpu")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *a, **k: [device])


def test_only_a_gpu_without_a_built_in_profile_calibrates_itself(auto, monkeypatch):
  measured = dataclasses.replace(profile.DEFAULT_PROFILE, matmul_tflops=180.0,
                                 device_kind="NVIDIA L40S", source="calibrated on NVIDIA L40S")
  monkeypatch.setattr(calibration, "quick_calibrate", lambda: (
      auto.append("gpu"), calibration.QuickCalibration(measured, {}, 2.0))[1])
  _gpu_here(monkeypatch, "NVIDIA H100 80GB HBM3")
  assert machine.load(warn=False) is profile.BUILTIN_PROFILES["H100"] and not auto
  _gpu_here(monkeypatch, "NVIDIA L40S")
  assert machine.load() == measured and auto == ["gpu"]
  assert machine.load(profile.cache_path()) == measured  # stored
