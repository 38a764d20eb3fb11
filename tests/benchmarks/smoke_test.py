"""The GPU benchmark scripts' logic, at toy sizes on the CPU, so that they do not rot in CI.

Each script has a mode for this (`--smoke` / `--cpu_dry_run`); its figures mean nothing here.
The scripts run in a subprocess from the repository's `benchmarks/` folder and its
`diagnostics/` (they import `benchmarks/bench_util.py`), against the installed jaxtier. Every one is a subprocess of seconds to a minute on a 2-core CPU:
the module is in the slow set (`-m slow`).
"""

import json
import os
import subprocess
import sys
import tarfile

import pytest

pytestmark = pytest.mark.slow

BENCH = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                     "benchmarks"))

CASES = {
    "streaming_bench.py": (["--smoke"], "w1/streaming_cpu.json"),
    "diagnostics/streaming_primitives_check.py": (["--cpu_dry_run"], "streaming_primitives.json"),
    "diagnostics/dha_crossover.py": (["--cpu_dry_run"], "dha_crossover_cpu.json"),
    "host_update_bench.py": (["--cpu_dry_run", "--skip_torch"], "w2/host_update_cpu.json"),
    "planner_bench.py": (["--cpu_dry_run", "--skip_cli"], "w5/planner_cpu.json"),
    "diagnostics/host_cpu_microbench.py": (["--smoke"], "host_cpu_microbench.json"),
    "e2e_smoke.py": (["--config=tiny", "--steps=3", "--batch_size=2", "--seq_len=32",
                      "--variants=fp32:none,fp32:stream,fp32:auto:host_split@0.9"],
                     "w3/tiny_b2_cpu.json"),
}


@pytest.mark.parametrize("script", sorted(CASES))
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
  if script not in ("diagnostics/streaming_primitives_check.py",
                    "diagnostics/host_cpu_microbench.py"):  # the rest name their card and commit
    assert data["card"] == "cpu" and data["date"] and data["commit"] and data["command"], data
  for name, run in data.get("runs", {}).items():  # e2e_smoke: one entry per variant
    assert "error" not in run, (name, run["error"])
  if script == "e2e_smoke.py":
    for name, fig in data["figures"].items():
      assert fig["host_rss_peak_bytes"] > 0, name
    assert data["runs"]["fp32:auto:host_split@0.9"]["dha_share"] == 0.9
    assert data["runs"]["fp32:none"]["dha_share"] is None
    assert "host RSS GiB" in p.stdout
    assert "the split's DHA share 0.900" in p.stdout
  for name, case in data.get("cases", {}).items():  # planner_bench: one entry per case
    assert "error" not in case, (name, case["error"])


def _run_bench(args, tmp_path, **kw):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                        timeout=120, cwd=kw.get("cwd", str(tmp_path)))


# e2e_smoke's variant grammar, its split-share profile and its table, checked in one interpreter
# (importing the script defines its absl flags and sets the trainer's flag defaults, which this
# test process should not see).
_E2E_UNITS = r"""
import json
import e2e_smoke as e, jaxtier
p = e.parse_variant
assert p("fp32:none") == dict(dtype="fp32", offload="none", serial=False, executor=None,
                              dha_share=None, dha_grid=None)
assert p("bf16:auto:serial") == dict(dtype="bf16", offload="auto", serial=True, executor=None,
                                     dha_share=None, dha_grid=None)
assert p("fp32:auto:grid@0.25")["dha_grid"] == 0.25
assert p("fp32:auto:host_split@0.8:grid@1")["dha_grid"] == 1.0
assert p("fp32:auto:host_cpu")["executor"] == "host_cpu"
s = p("fp32:auto:serial:host_split@0.9")
assert (s["executor"], s["dha_share"], s["serial"]) == ("host_split", 0.9, True), s
assert p("fp32:auto:host_split")["dha_share"] is None
bad = {}
for v in ("fp32", "fp16:auto", "fp32:fast", "fp32:auto:host_split@1", "fp32:auto:host_split@0",
          "fp32:auto:host_split@x", "fp32:auto:host_cpu@0.5", "fp32:auto:host_cpu:host_split",
          "fp32:none:host_split@0.9", "fp32:auto:overlap", "fp32:auto:grid@0",
          "fp32:auto:grid@1.5", "fp32:auto:grid"):
  try:
    p(v)
  except ValueError as err:
    bad[v] = str(err)
prof = e.split_share_profile(jaxtier.DEFAULT_PROFILE, 0.9)
run = dict(step_secs_median=0.5, tokens_per_sec=1000.0, peak_hbm_bytes=2**30,
           plan_bytes={"pinned_host": 2**31}, losses=[5.0, 4.0])
print("RESULT " + json.dumps(dict(
    bad=bad, share=jaxtier.split_fraction(prof),
    dha_rate=[prof.dha_adamw_params_per_sec, jaxtier.DEFAULT_PROFILE.dha_adamw_params_per_sec],
    table=e.table({"fp32:auto:host_split@0.9": dict(run, host_rss_peak_bytes=3 * 2**30),
                   "fp32:none": dict(run, host_rss_peak_bytes=None),
                   "bf16:none": {"error": "x"}}))))
"""


def test_e2e_smoke_variants_share_profile_and_table(tmp_path):
  p = _run_bench(["-c", _E2E_UNITS], tmp_path, cwd=BENCH)
  assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
  out = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
  assert len(out["bad"]) == 13, out["bad"]  # every malformed variant refused
  assert "0 < F < 1" in out["bad"]["fp32:auto:host_split@1"]
  assert "0 < S <= 1" in out["bad"]["fp32:auto:grid@1.5"]
  assert "offload 'none'" in out["bad"]["fp32:none:host_split@0.9"]
  assert abs(out["share"] - 0.9) < 1e-12
  assert out["dha_rate"][0] == out["dha_rate"][1]  # only the CPU executor's rate moves
  lines = out["table"].strip().splitlines()
  assert "host RSS GiB" in lines[0]
  assert lines[1].split()[5] == "3.00"  # GiB = 2**30 bytes
  assert lines[2].split()[5] == "-"  # not measured
  assert lines[3].split()[1] == "ERROR"


def test_e2e_smoke_refuses_a_bad_variant_before_running_any(tmp_path):
  p = _run_bench([os.path.join(BENCH, "e2e_smoke.py"), f"--out={tmp_path}",
                  "--variants=fp32:none,fp32:auto:host_split@1.5"], tmp_path)
  assert p.returncode != 0
  assert "host_split@F with 0 < F < 1" in p.stderr, p.stderr[-3000:]
  assert "[" not in p.stdout  # no variant's output: none ran
  assert not (tmp_path / "w3").exists()  # no result file


def test_e2e_smoke_child_records_host_rss(tmp_path):
  p = _run_bench([os.path.join(BENCH, "e2e_smoke.py"), "--child=fp32:none", "--config=tiny",
                  "--steps=2", "--batch_size=2", "--seq_len=16"], tmp_path)
  assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
  run = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
  # A process that imported jax and trained holds tens of MiB at least, and under 64 GiB here.
  assert 32 * 2**20 < run["host_rss_peak_bytes"] < 64 * 2**30, run["host_rss_peak_bytes"]


def test_host_rss_peak_bytes_reads_vmhwm_else_getrusage(monkeypatch):
  import builtins
  import importlib.util
  spec = importlib.util.spec_from_file_location("bench_util", os.path.join(BENCH, "bench_util.py"))
  bench_util = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench_util)
  peak = bench_util.host_rss_peak_bytes()
  assert peak > 0
  real_open = builtins.open

  def no_proc(path, *args, **kwargs):
    if str(path).startswith("/proc/"):
      raise OSError("no /proc here")
    return real_open(path, *args, **kwargs)
  monkeypatch.setattr(builtins, "open", no_proc)
  fallback = bench_util.host_rss_peak_bytes()
  assert fallback > 0
  if os.path.exists("/proc/self/status"):  # both are this process's peak, in bytes
    assert abs(fallback - peak) <= max(peak // 10, 16 * 2**20), (fallback, peak)


def test_layer_call_order_reads_the_schedule():
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                                  "diagnostics"))
  import layer_call_order  # pylint: disable=g-import-not-at-top
  hlo = "\n".join([
      "HloModule m", "", "ENTRY %main (a: f32[4]) -> f32[4] {",
      '  %d = f32[4] custom-call(%a), custom_call_target="__cublas$lt$matmul"',
      "  %f1 = f32[4] fusion(%d), kind=kLoop", "  %f2 = f32[4] fusion(%f1), kind=kLoop",
      '  %s = f32[4] custom-call(%f2), custom_call_target="jaxtier_stream_send_ffi"',
      '  %w = f32[4] custom-call(%s), custom_call_target="jaxtier_stream_wait_ffi"',
      '  %l = u8[] custom-call(%w), custom_call_target="jaxtier_host_update_layer_ffi"',
      "  %f3 = f32[4] fusion(%w), kind=kLoop",
      '  ROOT %j = f32[4] custom-call(%f3, %l), custom_call_target="jaxtier_host_update_join_ffi"',
      "}"])
  assert layer_call_order.order(hlo) == "m(2)SwL.J"


# DeepSpeed's run.sh as w7_clipped calls it: CONFIG BATCH SEQ STEPS WARMUP, MODES, EXTRA_ARGS, OUT;
# it writes the JSON its bench writes ($OUT/<mode>_<config>.json).
_W7_FAKE_DEEPSPEED = r"""#!/usr/bin/env bash
mkdir -p "$OUT"
echo "modes $MODES, extra $EXTRA_ARGS"
printf '{"mode": "%s", "config": "%s", "median_step_s": 0.5, "tokens_per_s": 512.0, %s}' \
    "$MODES" "$1" '"error": null' > "$OUT/zero2_offload_$1.json"
"""


def test_w7_clipped_chooses_its_norms_from_the_probe_and_records_each_run(tmp_path):
  # tiny on the CPU, 12 steps (11 timed): the probe's norms choose a max norm over which 1 of
  # the 11 timed steps is (under 10%) and one under them all; each clipped run's own share.
  fake = tmp_path / "run.sh"
  fake.write_text(_W7_FAKE_DEEPSPEED)
  fake.chmod(0o755)
  env = dict(os.environ, JAX_PLATFORMS="cpu", BENCH_COMMIT="abc1234 (given)")
  env.pop("XLA_FLAGS", None)
  p = subprocess.run(
      [sys.executable, os.path.join(BENCH, "w7_clipped.py"), f"--out={tmp_path}",
       "--groups=tiny_b4_s64:unclipped+probe+clip_rare+clip_always+deepspeed_clipped+"
       "clip_rare_retry",
       "--steps=tiny=12", f"--work_dir={tmp_path / 'runs'}", "--deepspeed_groups=tiny_b4_s64",
       f"--deepspeed_script={fake}", "--budget_secs=600"],
      capture_output=True, text=True, env=env, timeout=700, cwd=str(tmp_path))
  assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
  data = json.loads((tmp_path / "w7" / "w7_clipped_tiny_b4_s64_part_cpu.json").read_text())
  assert data["card"] == "cpu" and data["commit"] == "abc1234 (given)" and data["date"]
  assert "--groups=tiny_b4_s64:" in data["command"]
  runs, norms = data["runs"]["tiny_b4_s64"], data["norms"]["tiny_b4_s64"]
  # Run again only where clip_rare clipped none of its timed steps (or 10% or more), at a norm
  # chosen from its own.
  retry = runs.pop("clip_rare_retry")
  if 0 < runs["clip_rare"]["clipped_fraction"] < 0.1:
    assert retry["skipped"].startswith("clip_rare clipped 0.0909 of its timed steps"), retry
  else:
    assert retry["clip_norm"] == pytest.approx(norms["retry"]["clip_rare"], rel=1e-8), retry
    assert norms["retry"]["timed_norms"] == runs["clip_rare"]["grad_norms"][1:]
  for name, run in runs.items():
    assert "error" not in run and "skipped" not in run, (name, run)
    assert run["tokens_per_sec"] > 0 and run["step_secs_median"] > 0, name
  probe, un = runs["probe"], runs["unclipped"]
  assert un["clip_norm"] is None and un["clipped_fraction"] is None and un["grad_norms"] == []
  assert probe["clipped_fraction"] == 0.0 and len(probe["grad_norms"]) == 12
  # The probe's clip never scales: its steps are the unclipped run's.
  assert probe["losses"] == pytest.approx(un["losses"], rel=1e-6)
  timed = probe["grad_norms"][1:]
  assert norms["timed_norms"] == timed and norms["steps_over_rare"] == 1
  assert sorted(timed)[-2] < norms["clip_rare"] < max(timed)
  assert norms["clip_always"] == pytest.approx(0.5 * min(timed))
  for v in ("clip_rare", "clip_always"):
    run = runs[v]
    assert run["clip_norm"] == pytest.approx(norms[v], rel=1e-8)
    over = sum(g > run["clip_norm"] for g in run["grad_norms"][1:])
    assert run["clipped_fraction"] == over / 11, v
  assert runs["clip_always"]["clipped_fraction"] == 1.0
  assert un["schedule"] in ("layered", "serial") and "schedule" in data["figures"][
      "tiny_b4_s64 clip_rare"]
  ds = runs["deepspeed_clipped"]
  assert ds["tokens_per_sec"] == 4 * 64 / 0.5 and "EXTRA_ARGS='--clip 1.0'" in ds["command"]
  assert ds["command"].endswith("tiny 4 64 8 2")
  ratio = data["ratio"]
  for key in ("clip_rare tokens/s over unclipped", "clip_always tokens/s over unclipped",
              "clip_rare tokens/s over deepspeed_clipped", "clip_always step over clip_rare step"):
    assert ratio[f"tiny_b4_s64 {key}"] > 0, key
  assert data["mfu"]["peak_flops"] is None and un["mfu"] is None  # no rate kept for a CPU
  with tarfile.open(tmp_path / "w7" / "w7_logs_cpu.tar.gz") as tar:
    assert {f"tiny_b4_s64_{v}.log" for v in runs} <= set(tar.getnames())
  assert "tiny_b4_s64 clip_always" in p.stdout


def test_w7_clipped_skips_with_the_reason_what_its_budget_cannot_run(tmp_path):
  # No seconds to spend and no DeepSpeed: every run is skipped, each with why, and the JSON is
  # written all the same; --norms stands in for the probe.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("BENCH_COMMIT", None)
  p = subprocess.run(
      [sys.executable, os.path.join(BENCH, "w7_clipped.py"), f"--out={tmp_path}",
       "--groups=tiny_b4_s64,1b_b8:unclipped+deepspeed_clipped", "--norms=tiny_b4_s64=2:0.5",
       f"--work_dir={tmp_path / 'runs'}", f"--deepspeed_script={tmp_path / 'none.sh'}",
       "--budget_secs=0"],
      capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
  assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
  data = json.loads((tmp_path / "w7" / "w7_clipped_tiny_b4_s64_1b_b8_part_cpu.json").read_text())
  tiny, big = data["runs"]["tiny_b4_s64"], data["runs"]["1b_b8"]
  assert tiny["probe"]["skipped"] == "the max norms were given (--norms)"
  assert "s left of --budget_secs=0" in tiny["clip_rare"]["skipped"]
  assert "DeepSpeed runs only for --deepspeed_groups=1b_b8" in tiny["deepspeed_clipped"]["skipped"]
  assert "DeepSpeed is not carried" in big["deepspeed_clipped"]["skipped"]
  assert data["norms"]["tiny_b4_s64"] == {"clip_rare": 2.0, "clip_always": 0.5,
                                          "how": "given (--norms)"}
  assert data["ratio"] == {} and data["commit"] and data["commit_source"] == "git"


_W7_UNITS = r"""
import w7_clipped as w
n = w.choose_norms([9.0] + [1.0] * 18 + [2.0, 4.0], 0.5)  # 20 timed: between 2 and 4
assert n["clip_rare"] == 8 ** 0.5 and n["steps_over_rare"] == 1 and n["clip_always"] == 0.5, n
assert n["first_step_norm"] == 9.0 and n["timed_steps"] == 20
# 30 timed steps: up to 2 over it (under 10%), where the gap is widest: under the two largest.
n = w.choose_norms([9.0] + [1.0] * 28 + [3.0, 3.2], 0.5)
assert n["steps_over_rare"] == 2 and abs(n["clip_rare"] - 3 ** 0.5) < 1e-12, n
for bad in ([1.0], [1.0, float("nan"), 2.0], [1.0, 0.0, 2.0]):
  try:
    w.choose_norms(bad, 0.5)
  except ValueError:
    pass
  else:
    raise AssertionError(bad)
g = w.parse_group
assert g("1b_b8") == dict(name="1b_b8", config="1b", batch_size=8, seq_len=1024)
assert g("8b_b16")["seq_len"] == 2048 and g("tiny_b4_s64")["seq_len"] == 64
sel = w.parse_selection(["1b_b8:clip_always+unclipped", "8b_b16"])
assert sel[0][1] == ["unclipped", "clip_always"] and sel[1][1] == list(w.VARIANTS)
assert w.parse_norms(["1b_b8=2.5:0.25"]) == {"1b_b8": (2.5, 0.25)}
for call, arg in ((g, "huge_b8"), (g, "1b"), (w.parse_selection, ["1b_b8:fast"]),
                  (w.parse_norms, ["1b_b8=2"]), (w.parse_norms, ["1b_b8=0:1"])):
  try:
    call(arg)
  except ValueError:
    pass
  else:
    raise AssertionError(arg)
assert w.model_flops_per_token("1b", 1024) == 6 * 1_028_737_024 + 12 * 20 * 2048 * 1024
print("OK")
"""


def test_w7_clipped_chooses_norms_and_reads_its_selection():
  p = _run_bench(["-c", _W7_UNITS], None, cwd=BENCH)
  assert p.returncode == 0 and p.stdout.strip().endswith("OK"), (p.stdout[-3000:],
                                                                  p.stderr[-5000:])
