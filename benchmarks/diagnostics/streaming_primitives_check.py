"""Streaming primitives on the GPU: fetch bandwidth against jax.device_put, and duplex with send.

Workload (W1's weights, no compute): `--num_layers` slices of `--dim`^2 bf16 in
pinned_host (default 24 x 8192^2 = 3.2 GB).
- fetch: one jit that fetches every slice, double-buffered (slice l + 1 is fetched before slice
  l is read; each slice is read by a tiny reduction so it is used), against
  `jax.device_put` of the whole leaf pinned_host -> device, timed the same way.
- send: every slice of a device array sent into a donated pinned_host buffer, one final d2h
  wait, against `jax.device_put` device -> pinned_host.
- duplex: fetch and send in one jit, interleaved layer by layer; overlap =
  (t_fetch + t_send) / t_duplex (2 = the directions fully overlap, 1 = serialised).
Checks (exact): fetched slices equal the device copy of the leaf; sent slices equal their
sources. Times are medians of `--reps` runs after one warm-up. Prints one table at the end and
writes `--out` (JSON). Needs a GPU; `--cpu_dry_run` runs the logic at toy sizes on the CPU.

  python3 benchmarks/diagnostics/streaming_primitives_check.py --out=/tmp/out/streaming_primitives.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import jax  # before jaxtier's extension (the other order crashed in ml_dtypes)
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtier._src.primitives import stream

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench_util
from bench_util import median_secs  # noqa: E402  (benchmarks/bench_util.py)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--num_layers", type=int, default=24)
  p.add_argument("--dim", type=int, default=8192)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--out", default="streaming_primitives.json", help="JSON result path")
  p.add_argument("--cpu_dry_run", action="store_true", help="toy sizes on the CPU backend")
  return p.parse_args(argv)


def _read(w):  # a tiny use of a slice, so that it is consumed after its wait
  return w[0, :8].astype(jnp.float32).sum()


def fetch_all(W):
  L = W.shape[0]
  (buf,), _ = stream.fetch([W], 0)
  acc = jnp.zeros((), jnp.float32)
  for l in range(L):
    w, = stream.wait([buf], after=[acc])
    if l + 1 < L:
      (buf,), (w,) = stream.fetch([W], l + 1, after=[w])
    acc = acc + _read(w)
  return acc


def send_all(G, D):
  values = [D[l] for l in range(D.shape[0])]
  for l, v in enumerate(values):
    G, = stream.send([G], [v], l)
  return stream.wait([G], after=values, direction="d2h")[0]


def duplex(W, G, D):
  L = W.shape[0]
  (buf,), _ = stream.fetch([W], 0)
  acc = jnp.zeros((), jnp.float32)
  values = []
  for l in range(L):
    w, = stream.wait([buf], after=[acc])
    if l + 1 < L:
      (buf,), (w,) = stream.fetch([W], l + 1, after=[w])
    values.append(D[l])
    G, = stream.send([G], [values[-1]], l)
    acc = acc + _read(w)
  return acc, stream.wait([G], after=values, direction="d2h")[0]


def main(argv):
  args = parse_args(argv)
  if args.cpu_dry_run:
    jax.config.update("jax_platforms", "cpu")
    args.num_layers, args.dim, args.reps = 4, 64, 2
  dev = jax.devices()[0]
  if dev.platform != "gpu" and not args.cpu_dry_run:
    sys.exit(f"needs a GPU (JAX sees {dev}); use --cpu_dry_run for a logic check")
  mesh = Mesh(np.array([dev]), ("x",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
  device = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  L, n = args.num_layers, args.dim
  shape = (L, n, n)
  nbytes = L * n * n * 2
  slice_bytes = n * n * 2

  def gen(seed, sharding):
    return jax.jit(lambda: jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.bfloat16),
                   out_shardings=sharding)()
  W = gen(0, host)
  D = gen(1, device)
  G = [jax.jit(lambda: jnp.zeros(shape, jnp.bfloat16), out_shardings=host)()]
  jax.block_until_ready((W, D, G[0]))

  # Checks first: a wrong copy makes every figure meaningless.
  Wd = jax.device_put(W, device)
  for l in sorted({0, L // 2, L - 1}):
    got = jax.jit(lambda W, l=l: stream.wait(stream.fetch([W], l)[0])[0])(W)
    assert bool(jnp.array_equal(got, Wd[l])), f"fetched slice {l} differs from the leaf"
  f_fetch = jax.jit(fetch_all)
  want = jax.jit(lambda Wd: sum(_read(Wd[l]) for l in range(L)))(Wd)
  np.testing.assert_allclose(float(f_fetch(W)), float(want), rtol=1e-6)
  f_send = jax.jit(send_all, donate_argnums=0, out_shardings=host)
  G[0] = f_send(G[0], D)
  assert bool(jnp.array_equal(jax.device_put(G[0], device), D)), "sent slices differ"
  f_duplex = jax.jit(duplex, donate_argnums=1, out_shardings=(device, host))
  acc, G[0] = f_duplex(W, G[0], D)
  np.testing.assert_allclose(float(acc), float(want), rtol=1e-6)
  del Wd

  def run_send():
    G[0] = f_send(G[0], D)
    G[0].block_until_ready()

  def run_duplex():
    acc, G[0] = f_duplex(W, G[0], D)
    jax.block_until_ready((acc, G[0]))

  t = {
      "device_put_h2d": median_secs(lambda: jax.device_put(W, device).block_until_ready(), args.reps)[0],
      "device_put_d2h": median_secs(lambda: jax.device_put(D, host).block_until_ready(), args.reps)[0],
      "fetch": median_secs(lambda: f_fetch(W).block_until_ready(), args.reps)[0],
      "send": median_secs(run_send, args.reps)[0],
      "duplex": median_secs(run_duplex, args.reps)[0],
  }
  gbps = {k: nbytes / v / 1e9 for k, v in t.items()}
  gbps["duplex"] = 2 * nbytes / t["duplex"] / 1e9  # both directions counted
  ratio = {
      "fetch": gbps["fetch"] / gbps["device_put_h2d"],
      "send": gbps["send"] / gbps["device_put_d2h"],
      "duplex": gbps["duplex"] / (gbps["device_put_h2d"] + gbps["device_put_d2h"]),
  }
  overlap = (t["fetch"] + t["send"]) / t["duplex"]
  result = {
      "workload": f"{L} x {n}^2 bf16 slices in pinned_host ({nbytes / 1e9:.2f} GB), no compute",
      "command": " ".join([sys.executable] + sys.argv),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "device": str(dev.device_kind), "jax": jax.__version__, "python": platform.python_version(),
      "slice_bytes": slice_bytes, "bytes_per_direction": nbytes, "reps": args.reps,
      "secs": t, "gb_per_s": gbps,
      "ratio": {**ratio, "_baseline": "fetch/send vs jax.device_put the same direction; duplex "
                                     "vs the sum of both device_put rates"},
      "duplex_overlap": overlap, "checks": "fetched and sent slices exact", "cpu_dry_run":
      bool(args.cpu_dry_run),
  }
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\n{result['workload']}; {result['device']}, jax {jax.__version__}")
  print(f"{'path':<16}{'ms':>10}{'GB/s':>10}{'ratio':>8}")
  for k in ("device_put_h2d", "fetch", "device_put_d2h", "send", "duplex"):
    r = f"{ratio[k]:8.3f}" if k in ratio else f"{'':>8}"
    print(f"{k:<16}{t[k] * 1e3:10.2f}{gbps[k]:10.2f}{r}")
  print(f"duplex overlap (t_fetch + t_send) / t_duplex = {overlap:.2f}; wrote {args.out}")


if __name__ == "__main__":
  main(sys.argv[1:])
