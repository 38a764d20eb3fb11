r"""MaxText's own trainer, unchanged, under `python -m jaxtier run`, on the CPU.

Runs `python -m maxtext.trainers.pre_train.train src/maxtext/configs/base.yml <tiny decoder>` (2
layers, d_model 64, synthetic data, AdamW, MaxText's default bf16 activations and
param_scan_axis=1) each in a process of its own, and reads each step's loss from MaxText's
metrics file:

  alone                     MaxText's trainer as MaxText runs it
  optimizer_state_on_host   under `python -m jaxtier run --policy=optimizer_state_on_host`
  auto_budget               under `python -m jaxtier run --policy=auto --device_budget=2MB`,
                            a budget under the all-device step's compiled peak (2.66 MiB)
  reference_update          as optimizer_state_on_host with JAXTIER_DISABLE_FFI=1: the host
                            update runs as its pure-JAX reference, compiled by XLA
  alone_f32, optimizer_state_on_host_f32
                            alone and offloaded with dtype=float32 (activations in fp32)

Each run under jaxtier writes its plan (`--plan_json`): the record counts its optimizer-state
leaves (AdamW's mu and nu) in pinned_host. The ratio is the largest relative difference of a
step's loss from MaxText alone of the same dtype.

Needs Python >= 3.12 with MaxText and jaxtier installed (README, "Try it on MaxText").

Usage:
  python benchmarks/maxtext_run.py --steps=10  # -> benchmarks/results/maxtext/maxtext_tiny_cpu.*
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # pylint: disable=g-import-not-at-top,wrong-import-position

TRAIN = "maxtext.trainers.pre_train.train"
# MaxText's base config as its documentation names it (a pip-installed MaxText finds it in its
# package).
BASE_YML = "src/maxtext/configs/base.yml"
# The tiny decoder and a CPU run without checkpoints, downloads or services.
TINY = ("hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=synthetic",
        "enable_checkpointing=false", "enable_goodput_recording=false", "monitor_goodput=false",
        "enable_tensorboard=false", "per_device_batch_size=1", "max_target_length=64",
        "vocab_size=256", "base_num_decoder_layers=2", "base_emb_dim=64", "base_mlp_dim=128",
        "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=32", "attention=dot_product",
        "learning_rate=1e-3", "log_period=1", "run_name=tiny")
# name: (jaxtier run flags (None: alone), extra MaxText arguments, extra environment, the run
# it is compared with)
RUNS = {
    "alone": (None, (), {}, None),
    "optimizer_state_on_host": (("--policy=optimizer_state_on_host",), (), {}, "alone"),
    "auto_budget": (("--policy=auto", "--device_budget=2MB"), (), {}, "alone"),
    "reference_update": (("--policy=optimizer_state_on_host",), (),
                         {"JAXTIER_DISABLE_FFI": "1"}, "alone"),
    "alone_f32": (None, ("dtype=float32",), {}, None),
    "optimizer_state_on_host_f32": (("--policy=optimizer_state_on_host",), ("dtype=float32",),
                                    {}, "alone_f32"),
}
WRAPPED = re.compile(r"^jaxtier run: .*$", re.M)
STEP_LINE = re.compile(r"completed step: .*$", re.M)


def run_one(name: str, steps: int, work: str, timeout: int) -> dict:
  """Runs `name` of RUNS in its own process; returns its losses, the launcher's lines, its
  plan (for a run under jaxtier) and the command as written in the record."""
  flags, extra, env_extra, _ = RUNS[name]
  metrics = os.path.join(work, f"{name}.jsonl")
  plan_json = os.path.join(work, f"{name}_plan.json")
  maxtext_args = [*TINY, f"steps={steps}", f"base_output_directory={work}/out",
                  f"metrics_file={metrics}", *extra]
  launcher = [] if flags is None else ["-m", "jaxtier", "run", *flags,
                                       f"--plan_json={plan_json}", "--"]
  argv = [sys.executable, *launcher, "-m", TRAIN, BASE_YML, *maxtext_args]
  env = dict(os.environ, JAX_PLATFORMS="cpu", **env_extra)
  bench_util.log(f"== {name}")
  out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout,
                       check=False, cwd=work)
  text = out.stdout + out.stderr
  shown = " ".join(f"{k}={v}" for k, v in env_extra.items())
  command = " ".join([shown, "python", *launcher, "-m", TRAIN, BASE_YML, *maxtext_args]).strip()
  command = command.replace(work, "<tmp>")
  rec = {"command": command, "returncode": out.returncode,
         # (A line wrapped to the terminal's width, its indented lines joined to it.)
         "jaxtier": [line.replace(work, "<tmp>")
                     for line in WRAPPED.findall(re.sub(r"\n  (?=\S)", " ", text))],
         "steps": STEP_LINE.findall(text)}
  if out.returncode != 0:
    rec["error"] = text[-4000:].replace(work, "<tmp>")
    bench_util.log(f"   {name} failed: {text[-2000:]}")
    return rec
  with open(metrics, encoding="utf-8") as f:
    rec["losses"] = [json.loads(line)["learning/loss"] for line in f if line.strip()]
  if flags is not None and os.path.exists(plan_json):
    with open(plan_json, encoding="utf-8") as f:
      (function, plan), = json.load(f).items()
    state = [l for l in plan["leaves"] if l["role"] == "optimizer_state"]
    rec["wrapped"] = function
    rec["pinned_host_bytes"] = plan["pinned_bytes"]
    rec["device_bytes"] = plan["device_bytes"]
    rec["optimizer_state_leaves"] = len(state)
    rec["optimizer_state_leaves_in_pinned_host"] = sum(
        l["memory_kind"] == "pinned_host" for l in state)
    rec["moments_on_the_device"] = [l["path"] for l in state if l["memory_kind"] != "pinned_host"
                                    and re.search(r"\['(mu|nu)'\]", l["path"])]
  bench_util.log(f"   losses {rec['losses']}; {' '.join(rec['jaxtier'])}")
  return rec


def max_rel_diff(got: list[float], want: list[float]) -> float:
  """The largest |got - want| / |want| over the steps (inf where the lengths differ)."""
  if len(got) != len(want) or not want:
    return float("inf")
  return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated, from: "
                      + ", ".join(RUNS))
  parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "results"))
  args = parser.parse_args()
  if importlib.util.find_spec("maxtext") is None:
    sys.exit("maxtext_run.py: MaxText is not installed in this Python (README: 'Try it on "
             "MaxText')")
  names = [n for n in args.runs.split(",") if n]
  unknown = [n for n in names if n not in RUNS]
  if unknown:
    sys.exit(f"maxtext_run.py: unknown runs {unknown}; known: {', '.join(RUNS)}")
  runs = {}
  with tempfile.TemporaryDirectory(prefix="maxtext_run_") as work:
    for name in names:
      runs[name] = run_one(name, args.steps, work, args.timeout)
  losses = {n: r["losses"] for n, r in runs.items() if "losses" in r}
  ratio, baseline = {}, {}
  for name, (_, _, _, against) in RUNS.items():
    if name in losses and against in losses:
      ratio[f"max relative loss difference, {name} / {against}"] = max_rel_diff(
          losses[name], losses[against])
  for name in ("alone", "alone_f32"):
    if name in losses:
      baseline[f"{name} losses"] = {"value": losses[name], "is": "MaxText's trainer alone "
                                    f"(runs.{name}.command)"}
  import jax  # pylint: disable=g-import-not-at-top
  versions = bench_util.versions()
  versions["maxtext"] = importlib.metadata.version("maxtext")
  versions["flax"] = importlib.metadata.version("flax")
  versions["optax"] = importlib.metadata.version("optax")
  rec = bench_util.result_record(
      workload="MaxText's own trainer (maxtext.trainers.pre_train.train), unchanged, a tiny "
      "decoder (2 layers, d_model 64, AdamW, synthetic data) on the CPU, alone and under "
      "`python -m jaxtier run` with its optimizer state in pinned_host",
      command=" ".join(["python", "benchmarks/maxtext_run.py", *sys.argv[1:]]),
      device=bench_util.device_name(jax.devices("cpu")[0]), versions=versions,
      figures={"losses": losses,
               "optimizer_state_leaves_in_pinned_host": {
                   n: f"{r['optimizer_state_leaves_in_pinned_host']} of "
                      f"{r['optimizer_state_leaves']}"
                   for n, r in runs.items() if "optimizer_state_leaves" in r}},
      baseline=baseline, ratio=ratio, steps=args.steps,
      runs={n: {k: v for k, v in r.items() if k != "steps"} for n, r in runs.items()})
  name = bench_util.result_name("maxtext/maxtext_tiny_{card}.json", rec)
  bench_util.write_result(rec, args.out, name)
  log_path = os.path.join(args.out, name.replace(".json", ".log"))
  with open(log_path, "w", encoding="utf-8") as f:
    f.write(f"card {rec['card']}, commit {rec['commit']}, {rec['date']}: {rec['command']}\n")
    for n, r in runs.items():
      f.write(f"\n== {n}: {r['command']}\n")
      f.write("".join(f"{line}\n" for line in r["jaxtier"] + r["steps"]))
      if "error" in r:
        f.write(r["error"] + "\n")
    f.write("\n" + json.dumps(ratio, indent=1) + "\n")
  bench_util.log(f"wrote {log_path}")
  if any("error" in r for r in runs.values()):
    sys.exit(1)


if __name__ == "__main__":
  main()
