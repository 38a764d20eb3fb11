"""The GPU benchmark scripts' logic, at toy sizes on the CPU, so that they do not rot in CI.

Each script has a mode for this (`--smoke` / `--cpu_dry_run`); its figures mean nothing here.
The scripts run in a subprocess from the repository's `benchmarks/` folder and its
`diagnostics/` (they import `benchmarks/bench_util.py`), against the installed jaxtier.
"""

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                     "benchmarks"))

CASES = {
    "streaming_bench.py": (["--smoke"], "w1_streaming.json"),
    "diagnostics/streaming_primitives_check.py": (["--cpu_dry_run"], "streaming_primitives.json"),
    "diagnostics/dha_crossover.py": (["--cpu_dry_run"], "dha_crossover.json"),
    "host_update_bench.py": (["--cpu_dry_run", "--skip_torch"], "w2_host_update.json"),
    "planner_bench.py": (["--cpu_dry_run", "--skip_cli"], "w5_planner.json"),
    "diagnostics/host_cpu_microbench.py": (["--smoke"], "host_cpu_microbench.json"),
    "e2e_smoke.py": (["--config=tiny", "--steps=3", "--batch_size=2", "--seq_len=32",
                      "--variants=fp32:none,fp32:stream"], "w3_end_to_end.json"),
}


# The two slowest (tens of seconds on a 2-core CPU: several subprocesses each) are marked slow.
SLOW = ("planner_bench.py", "e2e_smoke.py")


@pytest.mark.parametrize("script", [
    pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in sorted(CASES)])
def test_benchmark_runs_at_toy_sizes(script, tmp_path):
  args, result = CASES[script]
  out = (str(tmp_path / result) if script == "diagnostics/streaming_primitives_check.py"
         else str(tmp_path))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  p = subprocess.run([sys.executable, os.path.join(BENCH, script), *args, f"--out={out}"],
                     capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
  assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
  with open(tmp_path / result) as f:
    data = json.load(f)
  assert "error" not in data, data.get("error")
  for name, run in data.get("runs", {}).items():  # e2e_smoke: one entry per variant
    assert "error" not in run, (name, run["error"])
  for name, case in data.get("cases", {}).items():  # planner_bench: one entry per case
    assert "error" not in case, (name, case["error"])
