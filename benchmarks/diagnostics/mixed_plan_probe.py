"""Which link of the mixed plan's GPU loss mismatch breaks: one verdict line per probe.

`executor_parity.py`'s mixed plan (the tiny decoder under a device budget: layer stacks placed
host_stream, the moments of those and of other stacks placed host_cpu, all updated layer by
layer in the backward pass) is off jax.jit's loss from step 1 on an H100, while every executor
alone, and the same budget's serial plan, are not. At step 1 the learning rate is 0, so every
layered update writes back the bits it read (AdamW: p + (-0) * finite = p): the params after
step 1 equal those before it, and step 2's loss equals step 1's, unless a write is not what
the op program computes or the forward reads something other than the state. The probes:

  placed    the placed params equal a fresh state's, bit for bit (else placing them is wrong).
  identity  the params step 1 returns equal the placed params, bit for bit. Else a layered write
            is wrong (a staged copy-up, a window, a scalar the call read).
  repeat    step 1 from a second, identical placed state gives the same loss. Else the forward
            reads something that varies from run to run (a fetched window read before its copy
            landed, or a buffer written while XLA still reads it).
  settled   step 1 once the placed state is ready and the device idle gives jit's loss. If only
            this one matches, the first fetch read a pinned leaf before its placement landed.
  hlo       the compiled compute program passes `lowering/hlo.py`'s guard for the fetch, send,
            layer and join calls, and each fetched slice reaches only its wait. Else XLA moved
            or copied a buffer that a custom call reads or writes behind its back.
  serial    the same placements with overlap_update=False match jit.
  stream_only / device_only  the same placements with only the streamed stacks' updates layered
            (the other stacks' moments on the device), or with the stacks on the device (their
            moments' updates still layered): which half of the mix is needed.

Losses are compared with jax.jit's at `--rtol`; a probe prints OK or BAD and its figures, and
`--out` gets them as JSON.

  python3 benchmarks/diagnostics/mixed_plan_probe.py [--steps=3] [--rtol=1e-5] [--out=DIR]
"""

import argparse
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtier
from jaxtier._src.lowering import hlo as hlo_lib
from jaxtier._src.primitives import host_update as hu
from jaxtier._src.primitives import stream

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import executor_parity  # pylint: disable=g-import-not-at-top,wrong-import-position


def _host(x):
  """A NumPy copy of `x` that keeps no view of its buffer (a view of a pinned_host leaf would
  block its donation)."""
  sharding = getattr(x, "sharding", None)
  if getattr(sharding, "memory_kind", "device") not in (None, "device"):
    x = jax.device_put(x, sharding.with_memory_kind("device"))
  return np.array(np.asarray(x), copy=True)


def _losses(step_fn, state, batch, steps):
  out = []
  for _ in range(steps):
    state, metrics = step_fn(state, batch)
    out.append(float(metrics["loss"]))
  return state, out


def _fetch_result_users(hlo_text: str) -> list[str]:
  """Instructions of the entry computation that read a fetch's slices other than a wait."""
  defs = dict(hlo_lib.entry_instructions(hlo_text))
  fetches = {n for n, rhs in defs.items() if f'custom_call_target="{stream.FETCH_TARGET}"' in rhs}
  num = {}
  for n in fetches:
    m = re.search(r"num_leaves\s*=\s*(\d+)", defs[n])
    num[n] = int(m.group(1)) if m else None
  slices = set()
  for n, rhs in defs.items():
    m = re.search(r"get-tuple-element\(%?([\w.\-]+)\), index=(\d+)", rhs)
    if m and m.group(1) in fetches and (num[m.group(1)] is None
                                        or int(m.group(2)) < num[m.group(1)]):
      slices.add(n)
  bad = []
  for n, rhs in defs.items():
    if f'custom_call_target="{stream.WAIT_TARGET}"' in rhs:
      continue
    used = set(hlo_lib.operands_of(rhs)) & slices
    if used:
      bad.append(f"{n} reads fetched slice(s) {sorted(used)}: {rhs[:160]}")
  return bad


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--rtol", type=float, default=1e-5)
  parser.add_argument("--out", help="folder for mixed_plan_probe.json (default: print only)")
  args = parser.parse_args()
  config, batch, fresh = executor_parity.tiny_setup()
  state, step_fn = fresh()
  _, ref = _losses(jax.jit(step_fn), state, batch, args.steps)
  full = jaxtier.plan(step_fn, state, batch, policy="none")
  rule = jaxtier.plan(step_fn, state, batch, policy="optimizer_state_on_host")
  budget = (full.predicted_peak_hbm_bytes + rule.predicted_peak_hbm_bytes) // 2
  print(f"jax.jit: {ref}; budget {budget} B", flush=True)
  result = {"card": os.environ.get("BENCH_CARD"), "commit": os.environ.get("BENCH_COMMIT"),
            "command": " ".join(sys.argv), "jit": ref, "budget": budget, "probes": {}}

  def off(losses):
    return max(abs(g - r) / abs(r) for g, r in zip(losses, ref))

  def report(name, ok, **figures):
    print(f"{name}: {'OK' if ok else 'BAD'} {figures}", flush=True)
    result["probes"][name] = {"ok": bool(ok), **figures}

  def offload(**options):
    state, step_fn = fresh()
    step = jaxtier.offload(step_fn, **options)
    return step, step.place(state, batch), state

  # The mixed plan, as executor_parity.py makes it.
  mixed = dict(device_budget=budget, allow_over_budget=True)
  step, placed, state0 = offload(**mixed)
  plan = step.plan
  placement = {l.path: str(l.placement.value) for l in plan.leaves}
  layered = sum(s.mode.name == "LAYERED" for s in plan.schedule)
  print(f"mixed plan: {sorted(set(placement.values()))}, {layered} layered updates", flush=True)
  result["placements"] = placement
  params = {p: i for i, p in enumerate(placement) if p.startswith("[0]")}
  before = [_host(x) for x in jax.tree_util.tree_leaves(placed)]
  given = [_host(x) for x in jax.tree_util.tree_leaves(fresh()[0])]
  moved = [p for p, i in params.items() if not np.array_equal(before[i], given[i])]
  report("placed", not moved, differ=moved)
  placed, first = _losses(step, placed, batch, 1)
  after = [_host(x) for x in jax.tree_util.tree_leaves(placed)]
  changed = {p: float(np.max(np.abs(after[i].astype(np.float64) - before[i])))
             for p, i in params.items() if not np.array_equal(after[i], before[i])}
  report("identity", not changed, changed=changed)
  placed, rest = _losses(step, placed, batch, args.steps - 1)
  losses = first + rest
  report("mixed", off(losses) <= args.rtol, losses=losses, max_rel=off(losses))

  # The same plan again from an identical state: the same step-1 loss, bit for bit.
  step_b, placed_b, _ = offload(**mixed)
  _, again = _losses(step_b, placed_b, batch, 1)
  report("repeat", again[0] == first[0], step1=[first[0], again[0]])

  # Step 1 once the placement has landed and the device is idle.
  step_c, placed_c, _ = offload(**mixed)
  jax.block_until_ready(placed_c)
  jax.effects_barrier()
  time.sleep(0.5)
  _, settled = _losses(step_c, placed_c, batch, 1)
  report("settled", abs(settled[0] - ref[0]) <= args.rtol * abs(ref[0]), step1=settled[0])

  # The compiled compute program.
  text = step.lower(state0, batch).compile().as_text()
  guards = {t: hlo_lib.hlo_violations(text, target=t)
            for t in (stream.FETCH_TARGET, stream.SEND_TARGET, hu.LAYER_TARGET, hu.JOIN_TARGET)}
  guards = {t: v for t, v in guards.items() if v and not v[0].startswith("no custom call")}
  users = _fetch_result_users(text)
  report("hlo", not guards and not users, guards=guards, fetch_slice_users=users[:8])
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mixed_plan_compute.hlo.txt"), "w") as f:
      f.write(text)

  # The same placements under other schedules.
  def pinned(change=None):
    want = dict(placement)
    for path, kind in want.items():
      if change is not None:
        want[path] = change(path, kind)
    return lambda path, leaf: want.get(path)

  streamed = {p for p, k in placement.items() if k == "host_stream"}
  stacks_of = {p.replace("[0]", "", 1) for p in streamed}

  def of_streamed_stack(path):
    return any(path.endswith(s) for s in stacks_of)

  variants = {
      "serial": (pinned(), False),
      "stream_only": (pinned(lambda p, k: k if k != "host_cpu" or of_streamed_stack(p)
                             else "device"), True),
      "device_only": (pinned(lambda p, k: "device" if k == "host_stream" else k), True),
  }
  for name, (policy, overlap) in variants.items():
    try:
      s, p, _ = offload(policy=policy, overlap_update=overlap, allow_over_budget=True)
      _, got = _losses(s, p, batch, args.steps)
      n = sum(x.mode.name == "LAYERED" for x in s.plan.schedule)
      kinds = sorted({str(l.placement.value) for l in s.plan.leaves})
      report(name, off(got) <= args.rtol, losses=got, max_rel=off(got), layered=n,
             placements=kinds)
    except Exception as e:  # pylint: disable=broad-except  (a variant the planner refuses)
      report(name, False, error=repr(e)[:300])
  if args.out:
    with open(os.path.join(args.out, "mixed_plan_probe.json"), "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
