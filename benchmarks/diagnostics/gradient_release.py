"""Device memory and step time with and without releasing layered gradients per layer.

The example decoder at the 1b's widths with --num_layers layers (bf16 compute, fp32 params),
its optimizer state on the host (`optimizer_state_on_host`: the stacked layers' updates run
layer by layer in the backward pass). For each release lag (`analysis/update_schedule.RELEASE_LAG`;
`none`: every gradient slice alive until the join), in a fresh process: the compiled peak of the
step, the measured peak (`memory_stats`), the median step time and the losses. The losses must
be equal for every lag (the release changes when buffers are freed, not what is computed).

  python3 benchmarks/diagnostics/gradient_release.py --num_layers=8 --out=$OUT

Result: $OUT/gradient_release_<card>.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_util  # pylint: disable=g-import-not-at-top,wrong-import-position

def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="1b", help="the example config whose widths are used")
  p.add_argument("--num_layers", type=int, default=8)
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=1024)
  p.add_argument("--steps", type=int, default=6, help="timed steps (after 2 warm-up steps)")
  p.add_argument("--lags", default="none,2", help="release lags to compare")
  p.add_argument("--child", default="", help="internal: run one lag and print its JSON")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  return p.parse_args(argv)


def child(args, lag: str) -> dict:
  """Trains with release lag `lag` (`none` or an int); returns its figures."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import jaxtier  # pylint: disable=g-import-not-at-top
  from jaxtier._src.analysis import update_schedule  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import llama, train  # pylint: disable=g-import-not-at-top

  update_schedule.RELEASE_LAG = None if lag == "none" else int(lag)
  config = dataclasses.replace(llama.CONFIGS[args.config], num_layers=args.num_layers,
                               max_seq_len=args.seq_len, dtype=jnp.bfloat16,
                               param_dtype=jnp.float32)
  with jax.default_device(jax.devices("cpu")[0]):
    _, state, step_fn = train.make_train_state(config, 1e-3)
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  staging = NamedSharding(Mesh(np.asarray(jax.devices()[:1]), ("d",)), PartitionSpec(),
                          memory_kind="pinned_host")
  state = jax.tree.map(lambda x: jax.device_put(x, staging), state)
  rng = np.random.default_rng(0)
  batches = [jax.device_put(rng.integers(0, config.vocab_size,
                                        (args.batch_size, args.seq_len + 1), dtype=np.int32))
             for _ in range(3)]
  step = jaxtier.offload(step_fn, policy="optimizer_state_on_host")
  state = step.place(state, batches[0])
  losses, times = [], []
  for i in range(2 + args.steps):
    t0 = time.perf_counter()
    state, metrics = step(state, batches[i % 3])
    losses.append(float(metrics["loss"]))
    times.append(time.perf_counter() - t0)
  stats = jax.devices()[0].memory_stats() or {}
  layered = sorted(step.plan.leaves[i].path for i in step._programs.split.layered_host)  # pylint: disable=protected-access
  return {"lag": lag, "num_params": llama.param_count(config),
          "compiled_peak_hbm_bytes": step.plan.compiler_peak_hbm_bytes,
          "predicted_peak_hbm_bytes": step.plan.predicted_peak_hbm_bytes,
          "measured_peak_hbm_bytes": stats.get("peak_bytes_in_use"),
          "step_secs_median": float(np.median(times[2:])), "losses": losses,
          "layered_host_leaves": len(layered)}


def main(argv):
  args = parse(argv)
  if args.child:
    print("RESULT " + json.dumps(child(args, args.child)))
    return
  import jax  # pylint: disable=g-import-not-at-top
  runs = []
  for lag in args.lags.split(","):
    bench_util.log(f"lag {lag}")
    p = subprocess.run([sys.executable, __file__, f"--child={lag}",
                        f"--config={args.config}", f"--num_layers={args.num_layers}",
                        f"--batch_size={args.batch_size}",
                        f"--seq_len={args.seq_len}", f"--steps={args.steps}"],
                       capture_output=True, text=True, check=False)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
      runs.append({"lag": lag, "error": (p.stderr or p.stdout)[-3000:]})
      continue
    runs.append(json.loads(lines[-1][len("RESULT "):]))
    bench_util.log(json.dumps({k: v for k, v in runs[-1].items() if k != "losses"}))
  ok = [r for r in runs if "error" not in r]
  base = next((r for r in ok if r["lag"] == "none"), None)
  ratio = {}
  if base is not None:
    for r in ok:
      if r is base:
        continue
      ratio[f"lag_{r['lag']}"] = {
          "compiled_peak_over_none": r["compiled_peak_hbm_bytes"] / base["compiled_peak_hbm_bytes"]
          if r["compiled_peak_hbm_bytes"] and base["compiled_peak_hbm_bytes"] else None,
          "measured_peak_over_none": r["measured_peak_hbm_bytes"] / base["measured_peak_hbm_bytes"]
          if r["measured_peak_hbm_bytes"] and base["measured_peak_hbm_bytes"] else None,
          "step_time_over_none": r["step_secs_median"] / base["step_secs_median"],
          "losses_equal": r["losses"] == base["losses"]}
  device = bench_util.device_name(jax.devices()[0])
  rec = bench_util.result_record(
      workload="gradient_release", command=" ".join(sys.argv), device=device,
      versions=bench_util.versions(), figures={"runs": runs}, ratio=ratio,
      bound={"note": "no bound: a memory comparison between release lags"})
  path = bench_util.write_result(rec, args.out,
                                 f"gradient_release_{bench_util.card(device)}.json")
  print(json.dumps(ratio, indent=1))


if __name__ == "__main__":
  main(sys.argv[1:])
