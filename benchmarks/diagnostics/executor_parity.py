"""The example decoder's losses with its layer stacks' AdamW moments on the host, per executor.

For each host executor (host_dha, host_split, host_cpu) and each schedule (the layered update
inside the backward pass, `overlap_update=True`, and the serial one after it), trains the tiny
decoder (4 layers, fp32) a few steps through `jaxtier.offload` and prints each step's loss
against `jax.jit`'s from the same state, with the largest relative difference and the first
step where it passes `--rtol`. The moments of the other leaves stay on the device, as a
planner's mixed plan keeps them. Then the same for the plan `jaxtier.offload` makes under a
device budget halfway between the all-device and the optimizer-on-host plans' peaks.

  python3 benchmarks/diagnostics/executor_parity.py [--steps=4] [--rtol=1e-5] [--out=DIR]
"""

import dataclasses
import json
import os
import sys

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxtier
from jaxtier.examples import llama, train


LAYER_MOMENTS = r"\['opt_state'\]\[0\]\['(mu|nu)'\]\['layers'\]"


def _losses(step_fn, state, batch, steps):
  out = []
  for _ in range(steps):
    state, metrics = step_fn(state, batch)
    out.append(float(metrics["loss"]))
  return out


def tiny_setup():
  """(the 4-layer tiny config, one batch of its tokens, `fresh()` -> (state, step_fn)): the
  model these diagnostics train, matmuls in full fp32."""
  jax.config.update("jax_default_matmul_precision", "highest")
  config = dataclasses.replace(llama.CONFIGS["tiny"], num_layers=4)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, config.max_seq_len + 1)),
                      jnp.int32)

  def fresh():
    _, state, step_fn = train.make_train_state(config, 1e-3)
    return state, step_fn
  return config, batch, fresh


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=4, help="steps per run")
  parser.add_argument("--rtol", type=float, default=1e-5,
                      help="relative difference a loss may have from jit's")
  parser.add_argument("--out", help="folder for executor_parity.json (default: print only)")
  args = parser.parse_args()
  config, batch, fresh = tiny_setup()
  state, step_fn = fresh()
  ref = _losses(jax.jit(step_fn), state, batch, args.steps)
  print(f"jax.jit: {ref}")
  rows = []

  def check(name, **options):
    state, step_fn = fresh()
    step = jaxtier.offload(step_fn, **options)
    placed = step.place(state, batch)
    got = _losses(step, placed, batch, args.steps)
    rel = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
    bad = next((i + 1 for i, d in enumerate(rel) if d > args.rtol), None)
    kinds = sorted({l.placement for l in step.plan.leaves})
    layered = sum(s.mode.name == "LAYERED" for s in step.plan.schedule)
    print(f"{name}: max rel {max(rel):.2e}, first step over {args.rtol}: {bad}; placements "
          f"{kinds}, {layered} layered updates; losses {got}", flush=True)
    rows.append({"run": name, "losses": got, "max_rel": max(rel), "first_over": bad,
                 "placements": kinds, "layered": layered})

  executors = ("host_dha", "host_split", "host_cpu") if jax.default_backend() == "gpu" else (
      "host_cpu",)
  for executor in executors:
    for overlap in (True, False):
      check(f"{executor} {'layered' if overlap else 'serial'}",
            policy={LAYER_MOMENTS: executor}, overlap_update=overlap)
  full = jaxtier.plan(step_fn, state, batch, policy="none")
  rule = jaxtier.plan(step_fn, state, batch, policy="optimizer_state_on_host")
  budget = (full.predicted_peak_hbm_bytes + rule.predicted_peak_hbm_bytes) // 2
  for overlap in (True, False):  # the budget is the plan's aim; its verdict is not checked here
    check(f"auto at {budget} B {'layered' if overlap else 'serial'}", device_budget=budget,
          allow_over_budget=True, overlap_update=overlap)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "executor_parity.json"), "w") as f:
      json.dump({"card": os.environ.get("BENCH_CARD"), "commit": os.environ.get("BENCH_COMMIT"),
                 "command": " ".join(sys.argv), "jit": ref, "runs": rows}, f, indent=1)


if __name__ == "__main__":
  main()
