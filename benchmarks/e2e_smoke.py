"""End-to-end smoke run on the GPU machine: train the example decoder with and without offload.

Runs the example decoder (`--config`, default `1b`) for `--steps` steps four ways, each in its
own process so that peak device memory is its own: fp32 params with `--offload=none` and
`auto` (AdamW moments in pinned_host, updated in place by the DHA kernel), and bf16 params
with `none` and `auto` (auto adds fp32 master copies on the host). Checks that the loss traces
match within bf16 tolerance (1e-2 relative: the decoder computes in bf16) and writes
`$OUT/w3_end_to_end.json` (bench_util's result schema: `figures` each variant's step time,
tokens/s, peak HBM and bytes by memory kind; `baseline` the device-resident run of each dtype;
`ratio` each offloaded run's step time and peak HBM over its baseline's; beside them `runs`,
each variant's whole record with its loss trace, and `checks`, the loss comparisons), then
prints a table. `--variants` picks others: `stream` puts the layers' params in `host_stream`.

  python benchmarks/e2e_smoke.py --config=1b --steps=30 --batch_size=8 --seq_len=1024
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

import bench_util  # (sibling module)
import jaxtier  # noqa: F401  (jax first, then the extension)
from jaxtier.examples import train as _train  # noqa: F401  (defines --config, --steps, ...)

flags.FLAGS.set_default("config", "1b")
flags.FLAGS.set_default("steps", 30)
flags.FLAGS.set_default("batch_size", 8)
flags.FLAGS.set_default("seq_len", 1024)
_CONFIG = flags.FLAGS["config"]
_STEPS = flags.FLAGS["steps"]
_BATCH = flags.FLAGS["batch_size"]
_SEQ = flags.FLAGS["seq_len"]
_CHILD = flags.DEFINE_string("child", "", "Internal: run one variant ('fp32:none', ...).")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "/tmp"), "Where the JSON goes.")
_RESULT = flags.DEFINE_string("result", "w3_end_to_end.json", "The JSON's file name.")
_STACK_EVERY = flags.DEFINE_integer(
    "stack_every", 0, "If > 0, each child dumps its Python stacks every this many seconds "
    "(faulthandler), to show where a slow variant spends its time.")
_VARIANTS = flags.DEFINE_list(
    "variants", ["fp32:none", "fp32:auto", "bf16:none", "bf16:auto"],
    "dtype:offload[:serial][:host_cpu|:host_split] variants; offload in none/auto/stream "
    "(stream: the layers' params host_stream); ':serial' runs every host update after the "
    "backward pass (--nooverlap_update); ':host_cpu' / ':host_split' put every moment on that "
    "executor (the split at the profile's DHA share).")


def child(variant: str) -> None:
  import dataclasses  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxtier.examples import llama, train  # pylint: disable=g-import-not-at-top
  if _STACK_EVERY.value > 0:
    import faulthandler  # pylint: disable=g-import-not-at-top
    faulthandler.dump_traceback_later(_STACK_EVERY.value, repeat=True)
  dtype, offload, *rest = variant.split(":")
  # 'auto' here names the run with AdamW moments in pinned_host: since the cost-model planner,
  # policy 'auto' keeps a state that fits on the device, so ask for the rule by name.
  offload = "optimizer_state_on_host" if offload == "auto" else offload
  fixed = [e for e in ("host_cpu", "host_split") if e in rest]
  if fixed:
    # Every moment on one executor (a policy dict: the trainer's flags name modes); a split
    # placed so keeps the profile's DHA share (the planner's own choice weighs others).
    offload_step = train._offload_step  # pylint: disable=protected-access
    train._offload_step = lambda step, **kw: offload_step(  # pylint: disable=protected-access
        step, **{**kw, "policy": {r"opt_state.*\]\['(mu|nu)'\]": fixed[0]}})
  config = llama.CONFIGS[_CONFIG.value]
  if dtype == "bf16":
    config = dataclasses.replace(config, param_dtype=jnp.bfloat16)
  r = train.run(config_name=_CONFIG.value, config=config, steps=_STEPS.value,
                batch_size=_BATCH.value, seq_len=_SEQ.value, offload=offload, log_every=1,
                progress=False, overlap_update="serial" not in rest)
  stats = jax.devices()[0].memory_stats() or {}
  times = np.asarray(r["step_times"][1:])
  out = dict(variant=variant, losses=r["losses"], step_secs_median=float(np.median(times)),
             step_secs_p90=float(np.percentile(times, 90)), first_step_secs=r["compile_secs"],
             tokens_per_sec=r["tokens_per_sec"], num_params=r["num_params"],
             state_bytes=r["state_bytes"], plan_bytes=r["plan_bytes"],
             peak_hbm_bytes=int(stats.get("peak_bytes_in_use", -1)),
             hbm_limit_bytes=int(stats.get("bytes_limit", -1)))
  print("RESULT " + json.dumps(out), flush=True)


def summarize(runs):
  """(figures, baseline, ratio) of the result schema from the variants' records."""
  figures, baseline, ratio = {}, {}, {}
  for v, r in runs.items():
    if "error" in r:
      figures[v] = {"error": f"the run failed: runs['{v}']['error']"}
      continue
    figures[v] = dict(step_secs_median=r["step_secs_median"], tokens_per_sec=r["tokens_per_sec"],
                      peak_hbm_bytes=r["peak_hbm_bytes"], device_bytes=r["plan_bytes"]["device"],
                      pinned_host_bytes=r["plan_bytes"]["pinned_host"])
    if v.endswith(":none"):
      baseline[v] = {"step_secs_median": r["step_secs_median"],
                     "peak_hbm_bytes": r["peak_hbm_bytes"],
                     "is": "device-resident (offload none): the baseline of its dtype's runs"}
  for v, f in figures.items():
    dtype, mode = v.split(":")[:2]
    b = baseline.get(f"{dtype}:none")
    if mode == "none" or b is None or "error" in f:
      continue
    ratio[f"{v} / {dtype}:none step time"] = f["step_secs_median"] / b["step_secs_median"]
    if f["peak_hbm_bytes"] > 0 and b["peak_hbm_bytes"] > 0:  # -1: no memory stats (CPU)
      ratio[f"{v} / {dtype}:none peak HBM"] = f["peak_hbm_bytes"] / b["peak_hbm_bytes"]
  return figures, baseline, ratio


def main(argv):
  del argv
  if _CHILD.value:
    child(_CHILD.value)
    return
  import jax  # pylint: disable=g-import-not-at-top
  runs = {}
  for variant in _VARIANTS.value:
    cmd = [sys.executable, __file__, f"--child={variant}", f"--config={_CONFIG.value}",
           f"--steps={_STEPS.value}", f"--batch_size={_BATCH.value}", f"--seq_len={_SEQ.value}",
           f"--stack_every={_STACK_EVERY.value}"]
    # The child's output is echoed as it comes, timestamped, so that a run stopped by a time
    # limit still shows how far each variant got (plan, first step, each step).
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for raw in p.stdout:
      lines.append(raw.rstrip("\n"))
      if not raw.startswith(("I1", "W1", "RESULT ")) or "jaxtier" in raw or "ompil" in raw:
        print(f"[{time.strftime('%H:%M:%S')} {variant}] {lines[-1]}", flush=True)
    p.wait()
    line = [l for l in lines if l.startswith("RESULT ")]
    if p.returncode or not line:
      runs[variant] = dict(error="\n".join(lines)[-2000:])
      continue
    runs[variant] = json.loads(line[0][len("RESULT "):])
    print(variant, "done", runs[variant]["step_secs_median"], flush=True)

  def rel(a, b):
    import numpy as np  # pylint: disable=g-import-not-at-top
    a, b = np.asarray(runs[a]["losses"]), np.asarray(runs[b]["losses"])
    return float(np.max(np.abs(a - b) / np.abs(b)))
  checks = {}
  # The decoder computes in bf16 whatever its param dtype, so an ulp of difference in an update
  # shows at bf16 level after a few steps (fp32 'none' runs repeat exactly; bf16 ones vary by
  # ~0.3% run to run on their own): bf16 tolerance, 1e-2 relative, for both.
  for dtype, mode, tol in ((d, m, 1e-2) for d in ("fp32", "bf16") for m in ("auto", "stream")):
    a, b = f"{dtype}:{mode}", f"{dtype}:none"
    if "losses" in runs.get(a, {}) and "losses" in runs.get(b, {}):
      d = rel(a, b)
      checks[f"{dtype}_{mode}_vs_none_max_rel_loss_diff"] = d
      checks[f"{dtype}_{mode}_within_tolerance_{tol}"] = d <= tol
  figures, baseline, ratio = summarize(runs)
  result = bench_util.result_record(
      workload=f"e2e smoke: example decoder {_CONFIG.value}, batch {_BATCH.value} x seq "
               f"{_SEQ.value}, {_STEPS.value} steps, AdamW",
      command=("python benchmarks/e2e_smoke.py " + " ".join(
          f"--{k}={v}" for k, v in (("config", _CONFIG.value), ("steps", _STEPS.value),
                                    ("batch_size", _BATCH.value), ("seq_len", _SEQ.value),
                                    ("variants", ",".join(_VARIANTS.value))))),
      device=bench_util.device_name(jax.devices()[0]), versions=bench_util.versions(jaxtier),
      figures=figures, baseline=baseline, ratio=ratio, runs=runs, checks=checks)
  bench_util.write_result(result, _OUT.value, _RESULT.value)
  print(f"\n{'variant':<12} {'ms/step':>9} {'tok/s':>10} {'peak HBM GiB':>13} "
        f"{'pinned GiB':>11} {'loss0':>8} {'lossN':>8}")
  for v, r in runs.items():
    if "error" in r:
      print(f"{v:<12} ERROR")
      continue
    print(f"{v:<12} {r['step_secs_median'] * 1e3:>9.1f} {r['tokens_per_sec']:>10,.0f} "
          f"{r['peak_hbm_bytes'] / 2**30:>13.2f} {r['plan_bytes']['pinned_host'] / 2**30:>11.2f} "
          f"{r['losses'][0]:>8.4f} {r['losses'][-1]:>8.4f}")
  for k, v in checks.items():
    print(f"{k}: {v}")


if __name__ == "__main__":
  app.run(main)
