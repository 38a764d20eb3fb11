"""benchmarks/multigpu_bench.py --smoke: the multi-GPU benchmark's logic on 8 forced CPU devices.

Keeps the script (written for the nvidia-h200-x2 machine) from rotting: each run is a
subprocess, as the device count must be set before JAX starts.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                      "benchmarks", "multigpu_bench.py"))


def _bench(tmp_path, *flags):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.pop("NCCL_NVLS_ENABLE", None)
  p = subprocess.run([sys.executable, SCRIPT, "--smoke", f"--out={tmp_path}", *flags],
                     capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
  written = sorted((tmp_path / "multigpu").glob("*gpu_cpu.json"))  # named by devices and card
  assert len(written) == 1, written
  with open(written[0]) as f:
    data = json.load(f)
  assert written[0].name == f"{data['num_devices']}gpu_cpu.json" and data["card"] == "cpu"
  return data, p.stdout


@pytest.fixture(scope="module")
def dp8(tmp_path_factory):
  return _bench(tmp_path_factory.mktemp("dp8"))


@pytest.mark.slow
def test_fetch_on_eight_devices(dp8):
  r, stdout = dp8
  assert r["env"]["NCCL_NVLS_ENABLE"] == "0" and r["num_devices"] == 8 and "error" not in r
  f = r["fetch"]
  assert set(f["variants"]) == {"single-path", "single-path, 1 device", "multi-path",
                                "multi-path, sharded"}
  assert f["leaf_memory_kind"] == "pinned_host"
  assert f["whole_leaf_equal"] and f["sums_equal"]
  # Whole leaf [4, 64, 64] split along axis 1: each device reads [4, 8, 64] and gathers once;
  # the single path reads the whole leaf and gathers nothing.
  assert f["hlo_multi"]["all_gathers"] == 1
  assert [shape for _, shape, _ in f["hlo_multi"]["host_reads"]] == [[4, 8, 64]]
  assert f["hlo_single"]["all_gathers"] == 0
  assert [shape for _, shape, _ in f["hlo_single"]["host_reads"]] == [[4, 64, 64]]
  for name in ("multi-path", "multi-path, sharded"):
    multi = f["variants"][name]
    assert multi["host_bytes_per_device_per_layer"] * 8 == f["layer_bytes"] == 64 * 64 * 2
    assert multi["nvlink_bytes_received_per_device_per_layer"] == f["layer_bytes"] * 7 // 8
  assert f["speedup_multi_over_single"] > 0 and f["speedup_sharded_over_single"] > 0
  assert f["speedup_ideal"] == 8
  # The table comes last.
  assert "scaling efficiency" in stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_e2e_data_parallel_on_eight_devices_and_one(dp8):
  e = dp8[0]["e2e"]
  assert e["n"]["num_devices"] == 8 and e["one"]["num_devices"] == 1
  for r in (e["n"], e["one"]):
    assert r["finite"] and len(r["losses"]) == 3 and "pinned_host" in r["memory_kinds"]
  assert e["n"]["batch_size"] == 8 * e["one"]["batch_size"]
  # Replicated: each device pins the whole optimizer state.
  assert e["n"]["pinned_bytes_per_device"] == e["one"]["pinned_bytes_per_device"] > 0
  assert e["scaling_efficiency"] > 0


@pytest.mark.slow
def test_zero1_shards_host_state_and_trains_like_dp(dp8, tmp_path):
  r, _ = _bench(tmp_path, "--e2e_sharding=zero1", "--skip_fetch")
  e, dp = r["e2e"], dp8[0]["e2e"]
  assert "fetch" not in r
  assert e["n"]["pinned_bytes_per_device"] * 8 == e["one"]["pinned_bytes_per_device"]
  # Same data, same math: the sharded optimizer state trains as the replicated one.
  np.testing.assert_allclose(e["n"]["losses"], dp["n"]["losses"], rtol=1e-5)


def test_one_device_says_multi_path_needs_two(tmp_path):
  r, stdout = _bench(tmp_path, "--num_devices=1", "--skip_e2e")
  assert "multi-path fetch needs >= 2 GPUs" in stdout
  f = r["fetch"]
  assert f["num_devices"] == 1 and f["multi_path"].startswith("skipped")
  assert set(f["variants"]) == {"single-path", "single-path, 1 device"} and f["sums_equal"]
