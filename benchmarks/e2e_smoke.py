"""End-to-end smoke run on the GPU machine: train the example decoder with and without offload.

Runs the example decoder (`--config`, default `1b`) for `--steps` steps four ways, each in its
own process so that peak device memory is its own: fp32 params with `--offload=none` and
`auto` (AdamW moments in pinned_host, updated in place by the DHA kernel), and bf16 params
with `none` and `auto` (auto adds fp32 master copies on the host). Checks that the loss traces
match within bf16 tolerance (1e-2 relative: the decoder computes in bf16) and writes
`$OUT/w3/<config>_b<batch>_<card>.json` (bench_util's result schema: `figures` each variant's
step time, tokens/s, peak HBM and bytes by memory kind; `baseline` the device-resident run of each dtype;
`ratio` each offloaded run's step time and peak HBM over its baseline's; beside them `runs`,
each variant's whole record with its loss trace, and `checks`, the loss comparisons), then
prints a table. `--variants` picks others: `stream` puts the layers' params in `host_stream`;
`:host_cpu` / `:host_split` fix every AdamW moment on that executor, `:host_split@F` with the
DHA kernel taking the share F of each split update's elements (0 < F < 1). Each variant's
figures include its process's peak host RSS (`host_rss_peak_bytes`: VmHWM, what the kernel
counted resident; the CUDA driver's pinned pages may not be among it: see `pinned_host_bytes`).

  python benchmarks/e2e_smoke.py --config=1b --steps=30 --batch_size=8 --seq_len=1024
"""

from __future__ import annotations

import json
import os
import re
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
_RESULT = flags.DEFINE_string(
    "result", "w3/{config}_b{batch_size}_{card}.json",
    "The JSON's file name under --out; {config}, {batch_size} and {card} are filled in.")
_STACK_EVERY = flags.DEFINE_integer(
    "stack_every", 0, "If > 0, each child dumps its Python stacks every this many seconds "
    "(faulthandler), to show where a slow variant spends its time.")
_VARIANTS = flags.DEFINE_list(
    "variants", ["fp32:none", "fp32:auto", "bf16:none", "bf16:auto"],
    "dtype:offload[:serial][:host_cpu|:host_split[@F]][:grid@S] variants; dtype fp32/bf16, "
    "offload in "
    "none/auto/stream (stream: the layers' params host_stream); ':serial' runs every host "
    "update after the backward pass (--nooverlap_update); ':host_cpu' / ':host_split' put every "
    "moment on that executor, the split at the profile's DHA share, or with '@F' at the share "
    "F (0 < F < 1) of the elements for the DHA kernel; ':grid@S' runs layer calls' DHA "
    "kernel on the share S (0 < S <= 1) of the GPU's blocks (the profile's dha_layer_grid).")

DTYPES = ("fp32", "bf16")
OFFLOADS = ("none", "auto", "stream")
EXECUTORS = ("host_cpu", "host_split")


def _layered_updates(made: list) -> "int | None":
  """How many fused updates the offloaded step runs layer by layer (None: no offload)."""
  try:
    return len(made[-1]._programs.split.overlap.updates)  # pylint: disable=protected-access
  except (IndexError, AttributeError):
    return None


def _plan_figure(made: list, name: str) -> "float | None":
  """The offloaded step's plan's figure `name` (None: no offload, or the plan has none)."""
  return getattr(getattr(made[-1], "plan", None), name, None) if made else None


def _number(text: str) -> float:
  """`text` as a float, NaN where it is not one (so that every range check refuses it)."""
  try:
    return float(text)
  except ValueError:
    return float("nan")


def parse_variant(variant: str) -> dict:
  """The parts of a `--variants` entry
  'dtype:offload[:serial][:host_cpu|:host_split[@F]][:grid@S]'.

  Returns:
    {"dtype", "offload", "serial": bool, "executor": None or one of EXECUTORS,
     "dha_share": None or F (only with host_split), "dha_grid": None or S}.

  Raises:
    ValueError: an unknown dtype, offload or suffix, two executors, an executor with offload
      'none' (nothing is offloaded there), a share that is not a number in (0, 1), or a grid
      share that is not a number in (0, 1].
  """
  parts = variant.split(":")
  if len(parts) < 2:
    raise ValueError(f"variant {variant!r}: expected dtype:offload[:...], e.g. fp32:auto")
  dtype, offload, *rest = parts
  if dtype not in DTYPES:
    raise ValueError(f"variant {variant!r}: expected dtype in {DTYPES}, got {dtype!r}")
  if offload not in OFFLOADS:
    raise ValueError(f"variant {variant!r}: expected offload in {OFFLOADS}, got {offload!r}")
  spec = {"dtype": dtype, "offload": offload, "serial": False, "executor": None,
          "dha_share": None, "dha_grid": None}
  for part in rest:
    name, at, share = part.partition("@")
    if part == "serial":
      spec["serial"] = True
    elif name == "grid" and at:
      g = _number(share)
      if not 0.0 < g <= 1.0:
        raise ValueError(f"variant {variant!r}: expected grid@S with 0 < S <= 1 (the share of "
                         f"the GPU's blocks for a layer call's DHA kernel), got {share!r}")
      spec["dha_grid"] = g
    elif name in EXECUTORS and (not at or name == "host_split"):
      if spec["executor"] is not None:
        raise ValueError(f"variant {variant!r}: expected one executor, got "
                         f"{spec['executor']!r} and {name!r}")
      spec["executor"] = name
      if at:
        f = _number(share)
        if not 0.0 < f < 1.0:
          raise ValueError(f"variant {variant!r}: expected host_split@F with 0 < F < 1 (the "
                           f"DHA kernel's share of the elements), got {share!r}; the whole "
                           "update on one executor is :host_cpu (or offload auto: host_dha)")
        spec["dha_share"] = f
    else:
      raise ValueError(f"variant {variant!r}: unknown part {part!r}; expected 'serial', "
                       "'host_cpu', 'host_split', 'host_split@F' or 'grid@S'")
  if spec["executor"] and offload == "none":
    raise ValueError(f"variant {variant!r}: {spec['executor']} with offload 'none' (nothing "
                     "is on the host there)")
  return spec


def split_share_profile(base, share: float):
  """`base` (a `jaxtier.HardwareProfile`) with the CPU executor's AdamW rate set so that
  `jaxtier.split_fraction` of it is `share`: a host_split placed by the policy runs at the
  profile's share (the planner's own choice for layered updates applies to the leaves it
  places, not to these). The plan's predictions for that run use that rate."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  cpu = base.dha_adamw_params_per_sec * (1.0 - share) / share
  return dataclasses.replace(
      base, cpu_adamw_params_per_sec=cpu,
      source=f"{base.source}; e2e_smoke: CPU AdamW rate {cpu:.4g}/s so that the split's DHA "
             f"share is {share:g}")


def _fix_profile(share: "float | None", grid: "float | None") -> None:
  """Makes the planner of this (child) process read a profile whose split share is `share`
  and whose layer calls' kernel takes the share `grid` of the GPU's blocks (each where given):
  this machine's stored profile (or the defaults) adjusted (`split_share_profile`), saved
  under a fresh XDG_CACHE_HOME (where `jaxtier.load_profile` looks)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  prof = jaxtier.load_profile(warn=False)
  if share is not None:
    prof = split_share_profile(prof, share)
  if grid is not None:
    prof = dataclasses.replace(prof, dha_layer_grid=grid,
                               source=f"{prof.source}; e2e_smoke: dha_layer_grid {grid:g}")
  os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="e2e_smoke_profile_")
  path = jaxtier.save_profile(prof)
  print(f"profile {path}: the split's DHA share {jaxtier.split_fraction(prof):.3f} (CPU AdamW "
        f"{prof.cpu_adamw_params_per_sec:.4g} params/s, DHA {prof.dha_adamw_params_per_sec:.4g});"
        f" layer calls' kernel on {prof.dha_layer_grid:g} of the blocks", flush=True)


def child(variant: str) -> None:
  import dataclasses  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxtier.examples import llama, train  # pylint: disable=g-import-not-at-top
  if _STACK_EVERY.value > 0:
    import faulthandler  # pylint: disable=g-import-not-at-top
    faulthandler.dump_traceback_later(_STACK_EVERY.value, repeat=True)
  spec = parse_variant(variant)
  # 'auto' here names the run with AdamW moments in pinned_host: since the cost-model planner,
  # policy 'auto' keeps a state that fits on the device, so ask for the rule by name.
  offload = "optimizer_state_on_host" if spec["offload"] == "auto" else spec["offload"]
  if spec["dha_share"] is not None or spec["dha_grid"] is not None:
    _fix_profile(spec["dha_share"], spec["dha_grid"])
  if spec["executor"]:
    # Every moment on one executor (a policy dict: the trainer's flags name modes); a split
    # placed so runs at the profile's DHA share (the planner's own choice weighs others), or
    # at the variant's '@F' through a profile of that share.
    offload_step = train._offload_step  # pylint: disable=protected-access
    moments = r"opt_state.*\]\['(mu|nu)'\]"

    def policy_of(base):
      if not callable(base):  # a mode's name: the moments' executor replaces it
        return {moments: spec["executor"]}
      # offload 'stream': the layers stream as before, the moments take the executor.
      return lambda path, leaf: (spec["executor"] if re.search(moments, path)
                                 else base(path, leaf))
    train._offload_step = lambda step, **kw: offload_step(  # pylint: disable=protected-access
        step, **{**kw, "policy": policy_of(kw.get("policy"))})
  made = []  # the offloaded step, to read its schedule after the run
  make_step = train._offload_step  # pylint: disable=protected-access

  def keep(step, **kw):
    made.append(make_step(step, **kw))
    return made[-1]
  train._offload_step = keep  # pylint: disable=protected-access
  config = llama.CONFIGS[_CONFIG.value]
  if spec["dtype"] == "bf16":
    config = dataclasses.replace(config, param_dtype=jnp.bfloat16)
  r = train.run(config_name=_CONFIG.value, config=config, steps=_STEPS.value,
                batch_size=_BATCH.value, seq_len=_SEQ.value, offload=offload, log_every=1,
                progress=False, overlap_update=not spec["serial"])
  stats = jax.devices()[0].memory_stats() or {}
  times = np.asarray(r["step_times"][1:])
  out = dict(variant=variant, losses=r["losses"], step_secs_median=float(np.median(times)),
             step_secs_p90=float(np.percentile(times, 90)), first_step_secs=r["compile_secs"],
             tokens_per_sec=r["tokens_per_sec"], num_params=r["num_params"],
             state_bytes=r["state_bytes"], plan_bytes=r["plan_bytes"],
             peak_hbm_bytes=int(stats.get("peak_bytes_in_use", -1)),
             hbm_limit_bytes=int(stats.get("bytes_limit", -1)),
             host_rss_peak_bytes=bench_util.host_rss_peak_bytes(),
             dha_share=spec["dha_share"], layered_updates=_layered_updates(made),
             predicted_step_secs=_plan_figure(made, "predicted_step_secs"),
             compiled_peak_hbm_bytes=_plan_figure(made, "compiler_peak_hbm_bytes"))
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
                      pinned_host_bytes=r["plan_bytes"]["pinned_host"],
                      host_rss_peak_bytes=r.get("host_rss_peak_bytes"))
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
  # The planner's figures against the run's (W5's bars: 10% step time, 5% peak HBM).
  for v, r in runs.items():
    if "error" in r:
      continue
    if r.get("predicted_step_secs"):
      ratio[f"{v} step time predicted / measured"] = (r["predicted_step_secs"]
                                                      / r["step_secs_median"])
    if r.get("compiled_peak_hbm_bytes") and r["peak_hbm_bytes"] > 0:
      ratio[f"{v} peak HBM compiled / measured"] = (r["compiled_peak_hbm_bytes"]
                                                    / r["peak_hbm_bytes"])
  return figures, baseline, ratio


def table(runs) -> str:
  """The printed summary: one row per variant (GiB = 2**30 bytes; host RSS: the variant's
  process's peak resident set; '-' where not measured)."""
  width = max([12, *(len(v) for v in runs)])
  lines = [f"\n{'variant':<{width}} {'ms/step':>9} {'tok/s':>10} {'peak HBM GiB':>13} "
           f"{'pinned GiB':>11} {'host RSS GiB':>13} {'loss0':>8} {'lossN':>8}"]
  for v, r in runs.items():
    if "error" in r:
      lines.append(f"{v:<{width}} ERROR")
      continue
    rss = r.get("host_rss_peak_bytes")
    rss = f"{rss / 2**30:>13.2f}" if rss else f"{'-':>13}"
    lines.append(
        f"{v:<{width}} {r['step_secs_median'] * 1e3:>9.1f} {r['tokens_per_sec']:>10,.0f} "
        f"{r['peak_hbm_bytes'] / 2**30:>13.2f} {r['plan_bytes']['pinned_host'] / 2**30:>11.2f} "
        f"{rss} {r['losses'][0]:>8.4f} {r['losses'][-1]:>8.4f}")
  return "\n".join(lines)


def main(argv):
  del argv
  if _CHILD.value:
    child(_CHILD.value)
    return
  for variant in _VARIANTS.value:  # every variant checked before the first one runs
    try:
      parse_variant(variant)
    except ValueError as e:
      raise app.UsageError(f"--variants: {e}") from None
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
  bench_util.write_result(result, _OUT.value, bench_util.result_name(
      _RESULT.value, result, config=_CONFIG.value, batch_size=_BATCH.value))
  print(table(runs))
  for k, v in checks.items():
    print(f"{k}: {v}")


if __name__ == "__main__":
  app.run(main)
