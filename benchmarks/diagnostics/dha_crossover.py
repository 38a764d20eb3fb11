"""DHA compute vs streaming vs device-only: where reading a host leaf in place stops paying (H200).

Matmul, the W1 layer shape: w [K, N] = 8192 x 8192 bf16 (128 MiB) in pinned_host, x [M, K] bf16
on the device, M in 1, 8, 32, 128, 512, 2048 tokens. Three ways to get y = x @ w:
  dha     `dha.matmul(x, w)`: the kernel reads w over PCIe in place (once for M <= 512; a larger
          M is cut into chunks of 512 rows, each reading w again);
  stream  `x @ jax.device_put(w, Device)` inside jit: XLA copies w to HBM (copy engine), then
          cuBLAS;
  device  `x @ w` with w already in HBM (no link traffic: the compute-only bound).
plus `copy`: the host-to-device copy of w alone (the link bound that both link paths face).
Effective GB/s = K * N * 2 bytes / time for every variant.

Embedding gather: table [V, D] = 262144 x 4096 bf16 (2 GiB) in pinned_host, ids counts 1k, 16k,
128k (uniform over the table, on the device):
  dha     `dha.gather(table, ids)`: reads ids * D * 2 bytes over PCIe;
  stream  `jnp.take(jax.device_put(table, Device), ids, axis=0)` inside jit: the whole table
          crosses the link each call.
Effective GB/s: bytes each variant moves over the link / time.

Timing: each variant is jitted and warmed up (compilation excluded); a measurement runs the call
back to back enough times to last >= 20 ms and blocks on the last result
(jax.block_until_ready); the figure is the median of `--reps` measurements. Each dha result is
checked against the device-only (matmul) or streaming (gather) result.

The crossover is the smallest M (id count) at which streaming is faster than DHA (null if none).
Writes JSON to `--out` (a .json path, or a directory that gets dha_crossover_<card>.json) and
prints a table last. Runtime on the H200: well under 90 s (most of it compilation).

  python3 benchmarks/diagnostics/dha_crossover.py --out=$OUT        # on the H200, after `pip install .`
  python3 benchmarks/diagnostics/dha_crossover.py --cpu_dry_run     # logic check on a CPU-only machine
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench_util
import bench_util  # noqa: E402  (benchmarks/bench_util.py)
from bench_util import log  # noqa: E402
import jax  # before jaxtier's extension (the other order crashed in ml_dtypes)
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from jaxtier.experimental import dha

RESULT: dict = {}


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--k", type=int, default=8192)
  p.add_argument("--n", type=int, default=8192)
  p.add_argument("--ms", default="1,8,32,128,512,2048", help="token counts M")
  p.add_argument("--vocab", type=int, default=262144)
  p.add_argument("--dim", type=int, default=4096)
  p.add_argument("--id_counts", default="1024,16384,131072")
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--min_measure_secs", type=float, default=0.02)
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  p.add_argument("--cpu_dry_run", action="store_true",
                 help="run the logic on the CPU backend at toy sizes (no figures worth keeping)")
  args = p.parse_args(argv)
  if args.cpu_dry_run:
    args.k, args.n, args.ms = 256, 192, "1,8,600"
    args.vocab, args.dim, args.id_counts = 4096, 64, "16,1024"
    args.reps, args.min_measure_secs = 3, 0.002
  args.ms = [int(v) for v in args.ms.split(",")]
  args.id_counts = [int(v) for v in args.id_counts.split(",")]
  return args


def write_json(out: str) -> str:
  name = f"dha_crossover_{RESULT.get('card', 'unknown')}.json"
  path = out if out.endswith(".json") else os.path.join(out, name)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(RESULT, f, indent=1, default=float)
  log(f"wrote {path}")
  return path


def median_secs(fn, reps: int, min_secs: float) -> float:
  """Median seconds per call of `fn()` (returns arrays; not blocked) after a warm-up."""
  jax.block_until_ready(fn())  # compile + warm up
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  one = max(time.perf_counter() - t0, 1e-6)
  inner = max(1, math.ceil(min_secs / one))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner)
  return float(np.median(times))


def matmul_section(args, device, host, dev):
  k, n = args.k, args.n
  w_bytes = k * n * 2
  key = jax.random.key(0)
  w_dev = jax.device_put(jax.random.normal(key, (k, n), jnp.bfloat16) * 0.02, dev)
  w_host = jax.device_put(w_dev, host)
  jax.block_until_ready(w_host)
  assert w_host.sharding.memory_kind == "pinned_host"

  copy = jax.jit(lambda w: jax.device_put(w, jax.memory.Space.Device),
                 in_shardings=(host,), out_shardings=dev)
  copy_secs = median_secs(lambda: copy(w_host), args.reps, args.min_measure_secs)
  RESULT["matmul"] = {"k": k, "n": n, "dtype": "bfloat16", "w_bytes": w_bytes,
                      "copy_secs": copy_secs, "copy_gbps": w_bytes / copy_secs / 1e9, "rows": []}
  log(f"copy of w host->device: {copy_secs * 1e3:.3f} ms, {w_bytes / copy_secs / 1e9:.1f} GB/s")

  f_dha = jax.jit(dha.matmul, in_shardings=(dev, host))
  f_stream = jax.jit(lambda x, w: x @ jax.device_put(w, jax.memory.Space.Device),
                     in_shardings=(dev, host))
  f_dev = jax.jit(lambda x, w: x @ w, in_shardings=(dev, dev))
  for m in args.ms:
    x = jax.device_put(jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16), dev)
    y_dha = np.asarray(f_dha(x, w_host), np.float32)
    y_dev = np.asarray(f_dev(x, w_dev), np.float32)
    rel = float(np.max(np.abs(y_dha - y_dev)) / max(np.max(np.abs(y_dev)), 1e-30))
    row = {"m": m, "max_rel_diff_dha_vs_device": rel,
           "dha_w_reads": math.ceil(m / 512)}
    for name, fn in (("dha", lambda: f_dha(x, w_host)), ("stream", lambda: f_stream(x, w_host)),
                     ("device", lambda: f_dev(x, w_dev))):
      secs = median_secs(fn, args.reps, args.min_measure_secs)
      row[f"{name}_secs"] = secs
      row[f"{name}_gbps"] = w_bytes / secs / 1e9
    row["stream_over_dha"] = row["stream_secs"] / row["dha_secs"]  # > 1: DHA is faster
    row["dha_vs_copy"] = copy_secs / row["dha_secs"]  # 1.0: DHA runs at the copy engine's rate
    RESULT["matmul"]["rows"].append(row)
    log(f"M={m}: dha {row['dha_secs'] * 1e3:.3f} ms ({row['dha_gbps']:.1f} GB/s), stream "
        f"{row['stream_secs'] * 1e3:.3f} ms, device {row['device_secs'] * 1e3:.3f} ms, "
        f"max rel diff {rel:.2e}")
  faster = [r["m"] for r in RESULT["matmul"]["rows"] if r["stream_secs"] < r["dha_secs"]]
  RESULT["matmul"]["crossover_m"] = min(faster) if faster else None
  del w_dev, w_host


def gather_section(args, device, host, dev):
  v, d = args.vocab, args.dim
  table_bytes = v * d * 2
  t_dev = jax.jit(lambda key: (jax.random.normal(key, (v, d), jnp.float32) * 0.02
                               ).astype(jnp.bfloat16), out_shardings=dev)(jax.random.key(1))
  table = jax.device_put(t_dev, host)
  jax.block_until_ready(table)
  del t_dev
  assert table.sharding.memory_kind == "pinned_host"
  RESULT["gather"] = {"vocab": v, "dim": d, "dtype": "bfloat16", "table_bytes": table_bytes,
                      "rows": []}
  f_dha = jax.jit(dha.gather, in_shardings=(host, dev))
  f_stream = jax.jit(
      lambda t, i: jnp.take(jax.device_put(t, jax.memory.Space.Device), i, axis=0),
      in_shardings=(host, dev))
  for count in args.id_counts:
    ids = jax.device_put(
        jax.random.randint(jax.random.key(count), (count,), 0, v, jnp.int32), dev)
    same = bool(np.array_equal(np.asarray(f_dha(table, ids)), np.asarray(f_stream(table, ids))))
    row = {"ids": count, "dha_equals_stream": same, "dha_bytes": count * d * 2,
           "stream_bytes": table_bytes}
    for name, fn, nbytes in (("dha", lambda: f_dha(table, ids), count * d * 2),
                             ("stream", lambda: f_stream(table, ids), table_bytes)):
      secs = median_secs(fn, args.reps, args.min_measure_secs)
      row[f"{name}_secs"] = secs
      row[f"{name}_gbps"] = nbytes / secs / 1e9
    row["stream_over_dha"] = row["stream_secs"] / row["dha_secs"]
    RESULT["gather"]["rows"].append(row)
    log(f"ids={count}: dha {row['dha_secs'] * 1e3:.3f} ms ({row['dha_gbps']:.1f} GB/s), stream "
        f"{row['stream_secs'] * 1e3:.3f} ms ({row['stream_gbps']:.1f} GB/s), equal {same}")
  faster = [r["ids"] for r in RESULT["gather"]["rows"] if r["stream_secs"] < r["dha_secs"]]
  RESULT["gather"]["crossover_ids"] = min(faster) if faster else None


def print_table():
  mm = RESULT.get("matmul")
  if mm:
    print(f"\nmatmul {mm['k']}x{mm['n']} bf16 w in pinned_host; copy alone "
          f"{mm['copy_secs'] * 1e3:.2f} ms ({mm['copy_gbps']:.1f} GB/s)")
    print(f"{'M':>6} {'dha ms':>9} {'GB/s':>6} {'stream ms':>10} {'GB/s':>6} {'device ms':>10} "
          f"{'stream/dha':>10}")
    for r in mm["rows"]:
      print(f"{r['m']:>6} {r['dha_secs'] * 1e3:>9.3f} {r['dha_gbps']:>6.1f} "
            f"{r['stream_secs'] * 1e3:>10.3f} {r['stream_gbps']:>6.1f} "
            f"{r['device_secs'] * 1e3:>10.3f} {r['stream_over_dha']:>10.2f}")
    print(f"crossover M (streaming faster from): {mm.get('crossover_m')}")
  g = RESULT.get("gather")
  if g:
    print(f"\ngather {g['vocab']}x{g['dim']} bf16 table in pinned_host")
    print(f"{'ids':>8} {'dha ms':>9} {'GB/s':>6} {'stream ms':>10} {'GB/s':>6} {'stream/dha':>10}")
    for r in g["rows"]:
      print(f"{r['ids']:>8} {r['dha_secs'] * 1e3:>9.3f} {r['dha_gbps']:>6.1f} "
            f"{r['stream_secs'] * 1e3:>10.3f} {r['stream_gbps']:>6.1f} "
            f"{r['stream_over_dha']:>10.2f}")
    print(f"crossover ids (streaming faster from): {g.get('crossover_ids')}")


def main(argv):
  args = parse_args(argv)
  t_start = time.perf_counter()
  if args.cpu_dry_run:
    jax.config.update("jax_platforms", "cpu")
  device = jax.devices()[0]
  mesh = Mesh([device], ("d",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  RESULT.update(command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=bench_util.git_commit(),
                card=bench_util.card(f"{device.platform}:{getattr(device, 'device_kind', '?')}"),
                device=f"{device.platform}:{getattr(device, 'device_kind', '?')}",
                versions=bench_util.versions(), cpu_dry_run=args.cpu_dry_run)
  section = "matmul"
  try:
    matmul_section(args, device, host, dev)
    section = "gather"
    gather_section(args, device, host, dev)
  except Exception as e:  # pylint: disable=broad-except
    RESULT["error"] = {"section": section, "type": type(e).__name__, "message": str(e)[:4000],
                       "traceback": traceback.format_exc()[-8000:]}
    traceback.print_exc()
  RESULT["wall_secs"] = time.perf_counter() - t_start
  write_json(args.out)
  print_table()
  return 1 if "error" in RESULT else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
