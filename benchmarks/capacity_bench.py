r"""W4 capacity and the 8b runs: the example trainer as a user runs it, with XLA's defaults.

Each run is `python -m jaxtier train --config=C --offload=O --steps=N` in its own process, with
XLA_PYTHON_CLIENT_MEM_FRACTION and XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB unset (the CLI sets them
where its plan needs them, by running itself again). Per run it records what happened (trained,
refused before allocation with the message, or failed, and whether a raw out-of-memory error
appears in the log), the losses, tokens/s, the model FLOP utilisation, and the peak device and
pinned_host bytes measured against the plan's predicted and compiled figures. The bound is
(the GPU's memory + the host's available memory) / 16 B per param (fp32 params, gradients, m
and v). DeepSpeed's results (`.baselines/deepspeed/run.sh`, written as JSON to
--baseline_dir) are read in as the baseline.

`--runs=auto` (the default) picks the runs from this card's bound: `auto` on each example
config of at least MIN_OF_BOUND of the bound and at most the bound, batch 1, smallest first
(`capacity_runs`), so that one command measures capacity on an H100 or an H200.

Usage (device tool, after benchmarks/prologue.sh built jaxtier):
  python3 benchmarks/capacity_bench.py --steps=10 --out=$OUT \
      --workload=w4_capacity --baseline_dir=$OUT/deepspeed  # -> $OUT/w4/capacity_<card>.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # pylint: disable=g-import-not-at-top,wrong-import-position

# Set by the CLI itself where its plan needs them; a user's defaults have neither.
XLA_SETTINGS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
                "XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "JAXTIER_RERUN")
RAW_OOM = re.compile(r"RESOURCE_EXHAUSTED|Out of memory|out of memory while trying to allocate")
# Bytes per param of fp32 params, gradients, m and v: what the bound counts.
BYTES_PER_PARAM = 16
# The configs `--runs=auto` tries: those between this share of the bound and the bound.
MIN_OF_BOUND = 0.8
# The H200's measured bf16 matmul rate on an 8192^3 GEMM (the 8b device-only MFU's base).
PEAK_FLOPS = 790e12


def model_flops_per_token(config, seq_len: "int | None" = None) -> float:
  """Training FLOPs per token: 6 N for the weights' matmuls plus 12 L d s for attention
  (forward and backward, no recomputation counted: model FLOPs, not hardware FLOPs), at
  sequence length `seq_len` (None: the config's `max_seq_len`)."""
  from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
  n = llama.param_count(config)
  s = config.max_seq_len if seq_len is None else seq_len
  return 6 * n + 12 * config.num_layers * config.d_model * s


def run_one(config_name: str, offload: str, steps: int, out: str, timeout: int,
            batch_size: int | None) -> dict:
  """Runs the CLI once for (config, offload); returns its record."""
  from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
  name = f"{config_name}_{offload}" + (f"_b{batch_size}" if batch_size else "")
  json_out = os.path.join(out, f"{name}.result.json")
  log_path = os.path.join(out, f"{name}.log")
  cmd = [sys.executable, "-m", "jaxtier", "train", f"--config={config_name}",
         f"--offload={offload}", f"--steps={steps}", "--log_every=1", f"--json_out={json_out}"]
  if batch_size:
    cmd.append(f"--batch_size={batch_size}")
  env = {k: v for k, v in os.environ.items() if k not in XLA_SETTINGS}
  bench_util.log(f"{name}: {' '.join(cmd[1:])}")
  t0 = time.perf_counter()
  # The child writes to its log as it runs, so a run cut short (here, or by the device call's
  # limit) keeps what it said.
  with open(log_path, "w") as f:
    try:
      rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                          timeout=timeout).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
  with open(log_path) as f:
    text = f.read()
  wall = time.perf_counter() - t0
  config = llama.CONFIGS[config_name]
  rec = {"config": config_name, "offload": offload, "command": " ".join(cmd[1:]),
         "params": llama.param_count(config), "returncode": rc, "wall_secs": round(wall, 1),
         "raw_out_of_memory": bool(RAW_OOM.search(text)),
         "reruns": re.findall(r"note: the (?:plan|step) fits with ([^,]+?), which XLA reads",
                              text),
         "log": os.path.basename(log_path)}
  refused = re.findall(r"^error: (?:AdmissionError|PlanError|OverBudgetError): (.*)$", text,
                       re.M)
  if refused:
    rec["refused"] = refused[-1]
  if rc == 0 and os.path.exists(json_out):
    with open(json_out) as f:
      res = json.load(f)
    losses = res["losses"]
    tokens = res["tokens_per_sec"]
    mem = res["memory"]
    rec.update(
        trained_steps=len(losses), first_loss=losses[0], last_loss=losses[-1],
        loss_falling=losses[-1] < losses[0], tokens_per_sec=round(tokens, 1),
        step_secs=round(sum(res["step_times"][1:]) / max(1, len(res["step_times"]) - 1), 3),
        mfu=round(tokens * model_flops_per_token(config) / PEAK_FLOPS, 4),
        plan_bytes=res["plan_bytes"], memory=mem)
    measured, compiled = mem.get("peak device (measured)"), mem.get("peak device (compiled)")
    predicted = mem.get("peak device (predicted)")
    if measured:
      rec["peak_device_compiled_over_measured"] = (
          None if compiled is None else round(compiled / measured, 4))
      rec["peak_device_predicted_over_measured"] = (
          None if predicted is None else round(predicted / measured, 4))
    live, planned = mem.get("pinned_host live (measured)"), mem.get("pinned_host (planned)")
    if live and planned:
      rec["pinned_planned_over_measured"] = round(planned / live, 4)
  else:
    tail = [l for l in text.splitlines() if l.strip() and not re.match(r"^[IW]\d{4} ", l)]
    rec["tail"] = tail[-8:]
  bench_util.log(f"{name}: rc {rc} in {wall:.0f} s; " + json.dumps(
      {k: rec.get(k) for k in ("tokens_per_sec", "loss_falling", "refused",
                               "raw_out_of_memory", "reruns")}))
  return rec


def gpu_total_bytes() -> int:
  """The GPU's memory as nvidia-smi reports it (MiB), bytes; 0 where it cannot say."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                          "nounits"], capture_output=True, text=True, timeout=30).stdout
    return int(out.split()[0]) * 2**20
  except (OSError, ValueError, IndexError, subprocess.SubprocessError):
    return 0


def capacity_runs(bound_params: int) -> str:
  """`--runs` for a card whose bound is `bound_params`: 'C:auto:1,...' over the example configs
  (`llama.CONFIGS`) of MIN_OF_BOUND x bound to bound params, smallest first; the largest config
  under MIN_OF_BOUND x bound where none is in that range."""
  from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
  sizes = sorted((llama.param_count(c), name) for name, c in llama.CONFIGS.items())
  picked = [name for n, name in sizes if MIN_OF_BOUND * bound_params <= n <= bound_params]
  if not picked:
    below = [name for n, name in sizes if n < MIN_OF_BOUND * bound_params]
    picked = below[-1:]
  return ",".join(f"{name}:auto:1" for name in picked)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--runs", default="auto",
                 help="config:offload[:batch_size],... in order; auto: by this card's bound "
                      "(capacity_runs)")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--batch_size", type=int, default=None)
  p.add_argument("--timeout", type=int, default=420, help="seconds per run")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
  p.add_argument("--workload", default="w4_capacity")
  p.add_argument("--result", default="w4/capacity_{card}.json",
                 help="the JSON's file name under --out; {card} is filled in")
  p.add_argument("--baseline_dir", default="")
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  import jaxtier  # pylint: disable=g-import-not-at-top  (imports jax; starts no backend)
  hbm, host = gpu_total_bytes(), jaxtier.available_host_bytes() or 0
  bound = (hbm + host) // BYTES_PER_PARAM
  if args.runs == "auto":
    args.runs = capacity_runs(bound)
    bench_util.log(f"bound {bound / 1e9:.2f}e9 params (GPU {hbm / 2**30:.1f} GiB + host "
                   f"{host / 2**30:.1f} GiB, / {BYTES_PER_PARAM} B): runs {args.runs}")
  runs = []
  for spec in args.runs.split(","):
    config_name, offload, batch = (spec.split(":") + ["", ""])[:3]
    runs.append(run_one(config_name, offload or "auto", args.steps, args.out, args.timeout,
                        int(batch) if batch else args.batch_size))
  trained = [r for r in runs if r.get("loss_falling")]
  # Issue 15's MFU rows: each run's MFU over the 8b device-only MFU of the same invocation.
  device_only = next((r for r in trained if r["config"] == "8b" and r["offload"] == "none"),
                     None)
  for r in trained:
    if device_only and r is not device_only:
      r["mfu_over_8b_device_only"] = round(r["mfu"] / device_only["mfu"], 4)
  largest = max(trained, key=lambda r: r["params"], default=None)
  baseline = {}
  for path in sorted(glob.glob(os.path.join(args.baseline_dir, "*.json"))
                     if args.baseline_dir else []):
    with open(path) as f:
      baseline[os.path.basename(path).removesuffix(".json")] = json.load(f)
  import jax  # pylint: disable=g-import-not-at-top
  rec = bench_util.result_record(
      workload=args.workload, command=" ".join(sys.argv), device=bench_util.device_name(),
      versions=bench_util.versions(jax),
      figures={"runs": runs, "largest_trained_params": largest and largest["params"],
               "largest_trained_config": largest and largest["config"]},
      bound={"params": bound, "gpu_bytes": hbm, "host_available_bytes": host,
             "bytes_per_param": BYTES_PER_PARAM},
      baseline=baseline or {"note": "no DeepSpeed results in --baseline_dir"},
      ratio={"largest_trained_over_bound": largest and round(largest["params"] / bound, 4)})
  path = bench_util.write_result(rec, args.out, bench_util.result_name(args.result, rec))
  if any(r["raw_out_of_memory"] for r in runs):
    sys.exit("a run ended in a raw out-of-memory error")


if __name__ == "__main__":
  main()
