"""MaxText's own trainer, unchanged, under `python -m jaxtier run` (skipped where MaxText, which
needs Python >= 3.12, is not installed: README, "Try it on MaxText").

A tiny decoder (2 layers, d_model 64, AdamW, synthetic data, MaxText's default
param_scan_axis=1) trains 5 steps on the CPU, each run in a process of its own: MaxText alone,
and under `python -m jaxtier run` with every optimizer-state leaf in pinned_host and under
`auto` with a device budget below the all-device step's compiled peak (2.74 MiB). Activations
are fp32 (`dtype=float32`): the losses agree to float32 rounding of the fused host update.
(With MaxText's default bf16 activations the same rounding grows to 7e-4 of the loss in 10
steps: `benchmarks/results/maxtext/`.)
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

maxtext = pytest.importorskip("maxtext")
TRAIN = "maxtext.trainers.pre_train.train"
if importlib.util.find_spec(TRAIN) is None:
  pytest.skip(f"this MaxText ({getattr(maxtext, '__version__', '?')}) has no {TRAIN}",
              allow_module_level=True)

BASE_YML = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
TINY = ("hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=synthetic",
        "enable_checkpointing=false", "enable_goodput_recording=false", "monitor_goodput=false",
        "enable_tensorboard=false", "per_device_batch_size=1", "max_target_length=64",
        "vocab_size=256", "base_num_decoder_layers=2", "base_emb_dim=64", "base_mlp_dim=128",
        "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=32", "attention=dot_product",
        "learning_rate=1e-3", "log_period=1", "run_name=tiny", "steps=5", "dtype=float32")
WRAPPED = re.compile(r"^jaxtier run: wrapped (\S+): (.*)$", re.M)
MOMENT = re.compile(r"\['(mu|nu)'\]")


def _train(tmp_path, *launcher_flags):
  """MaxText's trainer on TINY (under `python -m jaxtier run *launcher_flags` where given, its
  plan written to plan.json): (its losses by step, its stderr)."""
  metrics = tmp_path / "metrics.jsonl"
  launcher = ["-m", "jaxtier", "run", *launcher_flags, f"--plan_json={tmp_path / 'plan.json'}",
              "--"] if launcher_flags else []
  env = dict(os.environ, JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path / "cache"))
  out = subprocess.run(
      [sys.executable, *launcher, "-m", TRAIN, BASE_YML, *TINY,
       f"base_output_directory={tmp_path / 'out'}", f"metrics_file={metrics}"],
      capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900, check=False)
  assert out.returncode == 0, out.stderr[-4000:]
  losses = [json.loads(line)["learning/loss"] for line in metrics.read_text().splitlines()]
  return losses, out.stderr


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
  losses, _ = _train(tmp_path_factory.mktemp("alone"))
  assert len(losses) == 5 and losses[-1] < losses[0], losses  # it learns
  return losses


@pytest.mark.parametrize("flags", [("--policy=optimizer_state_on_host",),
                                   ("--policy=auto", "--device_budget=2.1MB")],
                         ids=["optimizer_state_on_host", "auto_budget"])
def test_maxtext_trains_as_alone_with_its_adamw_moments_in_pinned_host(tmp_path, alone, flags):
  losses, err = _train(tmp_path, *flags)
  # (The line is wrapped to the terminal's width: its indented lines joined to it.)
  wrapped = dict(WRAPPED.findall(re.sub(r"\n  (?=\S)", " ", err)))
  assert list(wrapped) == [f"{TRAIN}:train_step"], err[-4000:]
  assert "(optimizer_state)" in wrapped[f"{TRAIN}:train_step"], wrapped
  assert "warning" not in "".join(l for l in err.splitlines() if l.startswith("jaxtier run")), err
  np.testing.assert_allclose(losses, alone, rtol=1e-5)
  # The plan, leaf by leaf: AdamW's mu and nu of every param are optimizer state; what is in
  # pinned_host is only that.
  (plan,) = json.loads((tmp_path / "plan.json").read_text()).values()
  leaves = plan["leaves"]
  params = [l for l in leaves if l["role"] == "param"]
  moments = [l for l in leaves if MOMENT.search(l["path"])]
  assert len(moments) == 2 * len(params) > 0, [l["path"] for l in leaves]
  assert {l["role"] for l in moments} == {"optimizer_state"}
  pinned = [l for l in leaves if l["memory_kind"] == "pinned_host"]
  assert pinned and {l["role"] for l in pinned} == {"optimizer_state"}, pinned
  assert sum(l["nbytes"] for l in pinned) == plan["pinned_bytes"]
  if flags == ("--policy=optimizer_state_on_host",):
    assert all(l["memory_kind"] == "pinned_host" for l in moments), [
        l["path"] for l in moments if l["memory_kind"] != "pinned_host"]
