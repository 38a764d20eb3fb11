"""W1: streaming host-resident layer weights, against the device, the link and XLA alone.

Workload: 24 stacked 8192 x 8192 bf16 weights (3.2 GB) in pinned_host,
batch 16,384, `h = tanh(h @ W[l])` in `lax.scan`. All variants in one process, one run:

- device:       W on the device (compute only).
- transfer:     the weights host -> device once (`jax.device_put`), no compute.
- xla native:   W in pinned_host, `jax.device_put(W[l], device)` inside the scan body.
- jaxtier:      W placed `host_stream` through `jaxtier.offload` (forward: a step that only
                evaluates; forward+backward: the compute program of an SGD train step, which
                sends each layer's gradient to pinned_host as it is made; the update program,
                the in-place SGD on the host, is timed apart).
Forward efficiency = max(device, transfer) / measured; forward+backward efficiency = device
fwd+bwd (gradients kept on the device) / measured. HBM temp from `memory_analysis()`.

Writes `--out`/w1/streaming_<card>.json (e.g. w1/streaming_h200.json) in bench_util's result
schema: `figures` per variant (ms, every rep's ms, HBM temp bytes, ...), `bound` the forward
bound max(device fwd, transfer), `baseline` the device-only fwd+bwd, `ratio` the efficiencies
above (and XLA native's); beside them `targets` (the ratios' targets) and `layer_bytes`.

  python benchmarks/streaming_bench.py --out=/tmp/out            # H200
  python benchmarks/streaming_bench.py --smoke                   # tiny shapes, any backend
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxtier

import bench_util  # noqa: E402  (sibling module)
from bench_util import median_secs  # noqa: E402  (sibling module)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=24)
  p.add_argument("--dim", type=int, default=8192)
  p.add_argument("--batch", type=int, default=16384)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check)")
  p.add_argument("--skip_xla_native_grad", action="store_true")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  a = p.parse_args(argv)
  if a.smoke:
    a.layers, a.dim, a.batch, a.reps = 4, 64, 32, 2
  return a


def temp_bytes(compiled):
  ma = compiled.memory_analysis()
  return None if ma is None else int(ma.temp_size_in_bytes)


def loss_fn(W, x):
  def body(h, w):
    return jnp.tanh(h @ w), None
  h, _ = jax.lax.scan(body, x, W)
  return jnp.mean(h.astype(jnp.float32))


def xla_native_loss(W, x):
  def body(h, w):
    return jnp.tanh(h @ jax.device_put(w, jax.memory.Space.Device)), None
  h, _ = jax.lax.scan(body, x, W)
  return jnp.mean(h.astype(jnp.float32))


TARGETS = {"jaxtier_fwd_vs_ideal": 0.95, "jaxtier_fwdbwd_vs_device": 0.92}


def summarize(figures):
  """(bound, baseline, ratio) of the result schema from the variants' figures."""
  f = figures
  compute_fwd, transfer = f["device fwd"]["ms"], f["transfer h2d (device_put)"]["ms"]
  ideal = max(compute_fwd, transfer)
  bound = {"fwd": {"ms": ideal, "is": "max('device fwd', 'transfer h2d (device_put)'): the "
                                      "slower of the compute and the link"}}
  baseline = {"fwd+bwd": {"ms": f["device fwd+bwd"]["ms"],
                          "is": "'device fwd+bwd': the weights and gradients on the device"}}
  ratios = {
      "jaxtier_fwd_vs_ideal": ideal / f["jaxtier fwd"]["ms"],
      "xla_native_fwd_vs_ideal": ideal / f["xla native fwd"]["ms"],
      "jaxtier_fwdbwd_vs_device": f["device fwd+bwd"]["ms"] / f[
          "jaxtier fwd+bwd (grads to host)"]["ms"],
  }
  if "ms" in f.get("xla native fwd+bwd", {}):
    ratios["xla_native_fwdbwd_vs_device"] = f["device fwd+bwd"]["ms"] / f[
        "xla native fwd+bwd"]["ms"]
  return bound, baseline, ratios


def main(argv):
  a = parse_args(argv)
  dev = jax.devices()[0]
  mesh = jax.sharding.Mesh(np.array([dev]), ("d",))
  P = jax.sharding.PartitionSpec
  on_dev = jax.sharding.NamedSharding(mesh, P(), memory_kind="device")
  on_host = jax.sharding.NamedSharding(mesh, P(), memory_kind="pinned_host")
  L, d, B = a.layers, a.dim, a.batch
  key = jax.random.PRNGKey(0)
  W_dev = jax.jit(lambda k: (jax.random.normal(k, (L, d, d), jnp.float32) / np.sqrt(d)
                             ).astype(jnp.bfloat16), out_shardings=on_dev)(key)
  x = jax.jit(lambda k: jax.random.normal(k, (B, d), jnp.float32).astype(jnp.bfloat16),
              out_shardings=on_dev)(jax.random.PRNGKey(1))
  W_host = jax.device_put(W_dev, on_host)
  w_bytes = L * d * d * 2
  layer_bytes = d * d * 2
  flops_fwd = 2 * B * d * d * L
  fig = {}

  def record(name, secs, times, **extra):
    fig[name] = dict(ms=secs * 1e3, ms_all=[t * 1e3 for t in times], **extra)
    print(f"  {name:<34} {secs * 1e3:9.2f} ms", flush=True)

  # --- device only ---------------------------------------------------------------------------
  fwd = jax.jit(loss_fn)
  c = fwd.lower(W_dev, x).compile()
  s, t = median_secs(lambda: c(W_dev, x), a.reps)
  record("device fwd", s, t, temp_bytes=temp_bytes(c), tflops=flops_fwd / s / 1e12)
  vg = jax.jit(jax.value_and_grad(loss_fn))
  c = vg.lower(W_dev, x).compile()
  s, t = median_secs(lambda: c(W_dev, x), a.reps)
  record("device fwd+bwd", s, t, temp_bytes=temp_bytes(c), tflops=3 * flops_fwd / s / 1e12)
  ref_loss, ref_grad = c(W_dev, x)
  ref_grad = np.asarray(ref_grad.astype(jnp.float32))
  del W_dev

  # --- transfer only -------------------------------------------------------------------------
  s, t = median_secs(lambda: jax.device_put(W_host, on_dev), a.reps)
  record("transfer h2d (device_put)", s, t, gbps=w_bytes / s / 1e9)

  # --- XLA native ----------------------------------------------------------------------------
  nat = jax.jit(xla_native_loss, in_shardings=(on_host, on_dev))
  c = nat.lower(W_host, x).compile()
  s, t = median_secs(lambda: c(W_host, x), a.reps)
  record("xla native fwd", s, t, temp_bytes=temp_bytes(c))
  if not a.skip_xla_native_grad:
    try:
      natg = jax.jit(jax.value_and_grad(xla_native_loss), in_shardings=(on_host, on_dev))
      c = natg.lower(W_host, x).compile()
      s, t = median_secs(lambda: c(W_host, x), a.reps)
      record("xla native fwd+bwd", s, t, temp_bytes=temp_bytes(c))
    except Exception as e:  # noqa: BLE001 - report, do not stop the other variants
      fig["xla native fwd+bwd"] = dict(error=f"{type(e).__name__}: {e}"[:400])
      print("  xla native fwd+bwd failed:", fig["xla native fwd+bwd"]["error"][:200])

  # --- jaxtier: forward only (an evaluation step) ----------------------------------------------
  policy = {r"^\['W'\]$": "host_stream"}

  def eval_step(state, x):
    return state, {"loss": loss_fn(state["W"], x)}
  ev = jaxtier.offload(eval_step, policy=policy)
  st = ev.place({"W": W_host}, x)
  c = ev.lower(st, x).compile()
  s, t = median_secs(lambda: ev(st, x)[1]["loss"], a.reps)
  got_loss = float(ev(st, x)[1]["loss"])
  record("jaxtier fwd", s, t, temp_bytes=temp_bytes(c),
         loss_rel_diff=abs(got_loss - float(ref_loss)) / abs(float(ref_loss)))

  # --- jaxtier: forward + backward, gradients sent to pinned_host ----------------------------
  tx = optax.sgd(1e-3)

  def train_step(state, x):
    l, g = jax.value_and_grad(loss_fn)(state["W"], x)
    u, o = tx.update(g, state["opt"], state["W"])
    return {"W": optax.apply_updates(state["W"], u), "opt": o}, {"loss": l}
  # Serial update: the compute program is the forward and backward alone (layered, it would
  # run the update too).
  tr = jaxtier.offload(train_step, policy=policy, overlap_update=False)
  st = tr.place({"W": jax.device_put(W_host, on_host), "opt": tx.init(W_host)}, x)
  c = tr.lower(st, x).compile()
  # The compute program alone (internal handles): fwd + bwd + gradients to the host.
  leaves = jax.tree.leaves(st)
  runner = tr._runner
  runner.ensure_scratch()

  def compute_only():
    # No masters: the serial update keeps none in the compute program.
    inputs = tr._programs.split.compute_inputs(leaves, [x], runner.scratch, {})
    runner.scratch = list(tr._programs.compute(inputs).scratch)
    return runner.scratch
  s, t = median_secs(compute_only, a.reps)
  grad = np.asarray(runner.scratch[0].astype(jnp.float32))
  denom = np.maximum(np.abs(ref_grad), 1e-3 * np.max(np.abs(ref_grad)))
  record("jaxtier fwd+bwd (grads to host)", s, t, temp_bytes=temp_bytes(c),
         grad_max_rel_diff=float(np.max(np.abs(grad - ref_grad) / denom)),
         weights_bound_bytes=3 * layer_bytes)
  holder = {"state": st}

  def full_step():
    holder["state"], m = tr(holder["state"], x)
    return m["loss"]
  s, t = median_secs(full_step, a.reps)
  record("jaxtier full SGD step (fwd+bwd+host update)", s, t)

  bound, baseline, ratios = summarize(fig)
  rec = bench_util.result_record(
      workload=f"W1: {L} x {d}x{d} bf16 weights ({w_bytes / 1e9:.2f} GB) in pinned_host, batch "
               f"{B}, h = tanh(h @ W[l])",
      command="python benchmarks/streaming_bench.py " + " ".join(argv),
      device=bench_util.device_name(dev), versions=bench_util.versions(optax, jaxtier),
      figures=fig, bound=bound, baseline=baseline, ratio=ratios, targets=TARGETS,
      layer_bytes=layer_bytes)
  bench_util.write_result(rec, a.out, bench_util.result_name("w1/streaming_{card}.json", rec))
  print(f"\n{'variant':<44} {'ms':>9} {'HBM temp GiB':>13}")
  for name, r in fig.items():
    if "ms" not in r:
      print(f"{name:<44} {'ERROR':>9}")
      continue
    tb = r.get("temp_bytes")
    print(f"{name:<44} {r['ms']:>9.2f} {'' if tb is None else f'{tb / 2**30:.2f}':>13}")
  for k, v in ratios.items():
    print(f"{k}: {v:.3f}")


if __name__ == "__main__":
  main(sys.argv[1:])
