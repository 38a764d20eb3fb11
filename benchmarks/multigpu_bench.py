"""Multi-GPU: multi-path fetch of a replicated host leaf, and offloaded data-parallel training.

For the `nvidia-h200-x2` machine (2 H200s joined by NVLink, each on its own PCIe link); runs on
any number of GPUs (1: the multi-path parts are skipped, with a note) and, with `--smoke`, on 8
forced CPU devices at toy sizes (a logic check, no figures worth keeping).

Sections (each figure a median of `--reps` runs after a warm-up; N = GPUs in the mesh):
1. link: `jax.device_put` of one layer, pinned_host -> device, on GPU 0 alone.
2. W1 fetch: W1's leaf, `--layers` x `--dim`^2 bf16 (24 x 8192^2 = 3.2 GB), in
   pinned_host, replicated over the mesh of all N GPUs (each GPU's copy in host memory). Per
   layer, inside a `lax.scan` over the layers:
   - single-path (`multipath.fetch_single_path`): each GPU copies the whole layer from host;
   - single-path on GPU 0 alone (mesh of 1): is each GPU's link as fast when all N copy at once?
   - multi-path (`multipath.fetch_replicated`): each GPU copies 1/N of the layer from host, then
     an all-gather over NVLink (`jax.lax.all_gather` inside `shard_map`);
   - multi-path from the leaf stored sharded (`multipath.fetch_sharded`): the same traffic, but
     each GPU's host memory holds only its 1/N (no per-GPU read offset for XLA to handle);
   and the all-gather alone (a device-resident layer sharded N ways) for reference. Reported
   per GPU: seconds per layer, GB/s delivered (layer bytes / time) and GB/s over the host link;
   the ratio single / multi (N would be ideal, NVLink permitting). The whole leaf is also
   fetched once both ways: the values must be equal, and the compiled HLO's reads of the host
   parameter (per GPU) are recorded.
3. e2e: the example decoder (`--config`, default 1b) trained with `jaxtier.offload` ('auto':
   AdamW moments in pinned_host) on the mesh of N GPUs vs GPU 0 alone, data-parallel: params
   and optimizer state replicated (`--e2e_sharding=dp`; or `zero1`: optimizer state sharded
   over the GPUs, params replicated), `--batch_per_device` sequences per GPU (weak scaling).
   Reported: step time, tokens/s, scaling efficiency = tokens/s(N) / (N * tokens/s(1)).

NCCL's NVLink multicast (NVLS) is turned off before JAX starts (NCCL_NVLS_ENABLE=0): the device
tool's KINDS.md asks for it on these machines.

Writes `--out`/multigpu/<n>gpu_<card>.json (default $OUT or /tmp), prints a table last. Fails
fast: the first error stops the run with its section named; the JSON then holds what was measured and the error.

  python3 benchmarks/multigpu_bench.py                       # on nvidia-h200-x2, after pip install .
  python3 benchmarks/multigpu_bench.py --smoke               # 8 CPU devices, toy sizes
  python3 benchmarks/multigpu_bench.py --smoke --num_devices=1
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before JAX (and NCCL) start: no NVLink multicast.
if "--smoke" in sys.argv[1:]:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import bench_util  # noqa: E402  (sibling module)
from bench_util import log, median_secs  # noqa: E402
import jax  # noqa: E402  (before jaxtier's extension: the other order crashed in ml_dtypes)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
import numpy as np  # noqa: E402

import jaxtier  # noqa: E402
from jaxtier.experimental import multipath

FLAGS = None
RESULT: dict = {}


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=24)
  p.add_argument("--dim", type=int, default=8192)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--num_devices", type=int, default=0, help="use the first k devices (0: all)")
  p.add_argument("--config", default="1b", help="decoder config (jaxtier.examples.llama)")
  p.add_argument("--batch_per_device", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=1024)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--e2e_sharding", choices=("dp", "zero1"), default="dp")
  p.add_argument("--skip_fetch", action="store_true")
  p.add_argument("--skip_e2e", action="store_true")
  p.add_argument("--smoke", action="store_true",
                 help="8 forced CPU devices, toy sizes: checks the logic, not the speed")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  args = p.parse_args(argv)
  if args.smoke:
    args.layers, args.dim, args.reps = 4, 64, 2
    args.config, args.batch_per_device, args.seq_len, args.steps = "tiny", 2, 16, 3
  return args


# ---- helpers --------------------------------------------------------------------------------------

def write_json():
  """Writes RESULT as `multigpu/<n>gpu_<card>.json` under --out (e.g. multigpu/2gpu_h200.json)."""
  card = bench_util.card(RESULT.get("device", ""))
  RESULT.setdefault("card", card)
  bench_util.write_json(RESULT, FLAGS.out, f"multigpu/{RESULT.get('num_devices', 0)}gpu_{card}.json")


def Section(name):  # noqa: N802  (used as `with Section(...)`)
  return bench_util.Section(name, result=RESULT, on_error=write_json)


def host_replicated(mesh, shape, dtype, seed=0):
  """A [*shape] leaf in pinned_host, replicated over `mesh`, made on the devices (no host RAM
  copy of the whole leaf in this process)."""
  def make():
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)
  return jax.jit(make, out_shardings=NamedSharding(mesh, P(), memory_kind="pinned_host"))()


# ---- W1 fetch -------------------------------------------------------------------------------------

def per_layer_fetch(fetch, num_layers):
  """jit(w -> sum over layers of sum(fetch(w, l))): fetches every layer once, inside a scan.

  The sum reads each fetched layer whole on the device (so the fetch cannot be narrowed) and
  costs ~0.1 ms per 128 MiB layer of HBM traffic against ~2.5 ms of link time.
  """
  def run(w):
    def body(acc, i):
      return acc + jnp.sum(fetch(w, i), dtype=jnp.float32), None
    return jax.lax.scan(body, jnp.zeros((), jnp.float32), jnp.arange(num_layers))[0]
  return jax.jit(run)


def fetch_section(devices):
  n = len(devices)
  mesh = Mesh(np.array(devices), ("d",))
  mesh1 = Mesh(np.array(devices[:1]), ("d",))
  shape = (FLAGS.layers, FLAGS.dim, FLAGS.dim)
  layer_bytes = FLAGS.dim * FLAGS.dim * 2
  out = dict(num_devices=n, leaf_shape=list(shape), dtype="bfloat16", layer_bytes=layer_bytes,
             leaf_bytes=layer_bytes * FLAGS.layers, variants={})

  with Section("W1 leaf: bf16 in pinned_host, replicated over the mesh"):
    w = host_replicated(mesh, shape, jnp.bfloat16)
    w1 = host_replicated(mesh1, shape, jnp.bfloat16)
    out["leaf_memory_kind"] = w.sharding.memory_kind

  with Section("link: jax.device_put of one layer to GPU 0"):
    one = jax.jit(lambda x: x[0], out_shardings=NamedSharding(mesh1, P(),
                                                              memory_kind="pinned_host"))(w1)
    dev = NamedSharding(mesh1, P(), memory_kind="device")
    secs, _ = median_secs(lambda: jax.device_put(one, dev), FLAGS.reps)
    out["link_h2d_gbps_gpu0"] = layer_bytes / secs / 1e9
    del one

  def record(name, fn, arg, host_bytes_per_device, **extra):
    secs, all_secs = median_secs(lambda: fn(arg), FLAGS.reps)
    per_layer = secs / FLAGS.layers
    out["variants"][name] = dict(
        secs_per_layer=per_layer, all_secs=all_secs,
        delivered_gbps_per_device=layer_bytes / per_layer / 1e9,
        host_link_gbps_per_device=host_bytes_per_device / per_layer / 1e9,
        host_bytes_per_device_per_layer=host_bytes_per_device, **extra)
    log(f"   {name}: {per_layer * 1e3:.3f} ms/layer, "
        f"{layer_bytes / per_layer / 1e9:.1f} GB/s delivered per device")
    return float(fn(arg))

  with Section("single-path fetch, all devices at once"):
    s_all = record("single-path", per_layer_fetch(
        lambda x, i: multipath.fetch_single_path(x, mesh, index=i), FLAGS.layers), w,
        layer_bytes)
  with Section("single-path fetch, device 0 alone"):
    s_one = record("single-path, 1 device", per_layer_fetch(
        lambda x, i: multipath.fetch_single_path(x, mesh1, index=i), FLAGS.layers), w1,
        layer_bytes)
  out["sums_equal"] = bool(np.isclose(s_all, s_one, rtol=1e-6))

  if n < 2:
    out["multi_path"] = "skipped: multi-path needs >= 2 GPUs (one link each)"
    print("multi-path fetch needs >= 2 GPUs: with 1 GPU there is one host link; skipped",
          flush=True)
    del w, w1
    return out
  if FLAGS.dim % n:
    raise ValueError(f"--dim={FLAGS.dim} must divide by the {n} devices")

  with Section("multi-path fetch: 1/N per device + all-gather"):
    s_multi = record("multi-path", per_layer_fetch(
        lambda x, i: multipath.fetch_replicated(x, mesh, "d", index=i), FLAGS.layers), w,
        layer_bytes // n,
        nvlink_bytes_received_per_device_per_layer=layer_bytes * (n - 1) // n)
    out["sums_equal"] = out["sums_equal"] and bool(np.isclose(s_multi, s_all, rtol=1e-6))

  with Section("multi-path fetch from a leaf stored sharded (1/N per device in host memory)"):
    ws = jax.jit(lambda x: x, out_shardings=NamedSharding(
        mesh, multipath.sharded_host_spec("d", 0, indexed=True), memory_kind="pinned_host"))(w)
    s_sharded = record("multi-path, sharded", per_layer_fetch(
        lambda x, i: multipath.fetch_sharded(x, mesh, "d", index=i), FLAGS.layers), ws,
        layer_bytes // n,
        nvlink_bytes_received_per_device_per_layer=layer_bytes * (n - 1) // n)
    out["sums_equal"] = out["sums_equal"] and bool(np.isclose(s_sharded, s_all, rtol=1e-6))
    del ws

  with Section("all-gather alone (device-resident layer sharded N ways)"):
    sharded = jax.jit(lambda: jnp.ones(shape, jnp.bfloat16),
                      out_shardings=NamedSharding(mesh, P(None, "d", None)))()
    gather = jax.jit(jax.shard_map(
        lambda x: jax.lax.all_gather(x, "d", axis=1, tiled=True), mesh=mesh,
        in_specs=P(None, "d", None), out_specs=P(), check_vma=False))
    secs, all_secs = median_secs(lambda: gather(sharded), FLAGS.reps)
    per_layer = secs / FLAGS.layers
    out["all_gather_alone"] = dict(
        secs_per_layer=per_layer, all_secs=all_secs,
        received_gbps_per_device=layer_bytes * (n - 1) / n / per_layer / 1e9)
    del sharded

  with Section("whole leaf both ways: equal values, HLO host reads"):
    single = jax.jit(lambda x: multipath.fetch_single_path(x, mesh))
    multi = jax.jit(lambda x: multipath.fetch_replicated(x, mesh, "d", split_axis=1))
    a, b = single(w), multi(w)
    out["whole_leaf_equal"] = bool(jax.jit(lambda a, b: jnp.array_equal(a, b))(a, b))
    del a, b
    for name, f in (("single", single), ("multi", multi)):
      hlo = f.lower(w).compile().as_text()
      out[f"hlo_{name}"] = dict(
          all_gathers=multipath.count_all_gathers(hlo),
          host_reads=[[op, list(s), nbytes] for _, op, s, nbytes in
                      multipath.host_read_shapes(hlo)])
  v = out["variants"]
  out["speedup_multi_over_single"] = (v["single-path"]["secs_per_layer"] /
                                      v["multi-path"]["secs_per_layer"])
  out["speedup_sharded_over_single"] = (v["single-path"]["secs_per_layer"] /
                                        v["multi-path, sharded"]["secs_per_layer"])
  out["speedup_ideal"] = n
  del w, w1
  gc.collect()
  return out


# ---- e2e ------------------------------------------------------------------------------------------

def _zero1_spec(path, leaf, n):
  """P with 'd' on the first axis of an optimizer-state leaf that divides by n; else P()."""
  name = jax.tree_util.keystr(path)
  if "opt_state" not in name or not getattr(leaf, "ndim", 0):
    return P()
  for axis, size in enumerate(leaf.shape):
    if size % n == 0:
      return P(*([None] * axis + ["d"]))
  return P()


def e2e_run(devices, sharding_mode):
  from jaxtier.examples import data as data_lib  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import train  # pylint: disable=g-import-not-at-top
  n = len(devices)
  mesh = Mesh(np.array(devices), ("d",))
  _, state, train_step = train.make_train_state(FLAGS.config, train.OptimizerConfig(
      learning_rate=3e-4, total_steps=max(FLAGS.steps, 2)))
  if sharding_mode == "zero1":
    state = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.device_put(x, NamedSharding(mesh, _zero1_spec(p, x, n))), state)
  else:
    state = jax.device_put(state, NamedSharding(mesh, P()))
  batch_size = FLAGS.batch_per_device * n
  tokens = data_lib.load_corpus(None)
  batches = data_lib.batches(tokens, batch_size, FLAGS.seq_len, seed=0)
  put = lambda b: jax.device_put(jnp.asarray(b), NamedSharding(mesh, P("d")))
  step = jaxtier.offload(train_step, policy="optimizer_state_on_host")
  batch = put(next(batches))
  t0 = time.perf_counter()
  state = step.place(state, batch)
  jax.block_until_ready(state)
  place_secs = time.perf_counter() - t0
  losses, times = [], []
  for i in range(FLAGS.steps):
    t = time.perf_counter()
    state, m = step(state, batch)
    losses.append(float(m["loss"]))  # syncs
    times.append(time.perf_counter() - t)
    batch = put(next(batches))
  timed = times[1:] or times
  secs = float(np.median(timed))
  host_kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state)})
  stats = [d.memory_stats() or {} for d in devices]
  out = dict(num_devices=n, sharding=sharding_mode, batch_size=batch_size,
             seq_len=FLAGS.seq_len, losses=losses, step_secs_median=secs, step_secs=times,
             first_step_secs=times[0], place_secs=place_secs,
             tokens_per_sec=batch_size * FLAGS.seq_len / secs,
             pinned_bytes_per_device=step.plan.pinned_bytes,
             memory_kinds=host_kinds, finite=bool(np.all(np.isfinite(losses))),
             peak_bytes_per_device=[int(s.get("peak_bytes_in_use", -1)) for s in stats])
  del state, step
  gc.collect()
  return out


def e2e_section(devices):
  n = len(devices)
  out = {"config": FLAGS.config, "sharding": FLAGS.e2e_sharding,
         "batch_per_device": FLAGS.batch_per_device, "seq_len": FLAGS.seq_len}
  with Section(f"e2e: {FLAGS.config} decoder, jaxtier.offload, {n} device(s), "
               f"{FLAGS.e2e_sharding}"):
    out["n"] = e2e_run(devices, FLAGS.e2e_sharding)
    log(f"   {out['n']['step_secs_median'] * 1e3:.1f} ms/step, "
        f"{out['n']['tokens_per_sec']:,.0f} tokens/s")
  if n > 1:
    with Section(f"e2e: {FLAGS.config} decoder, jaxtier.offload, 1 device"):
      out["one"] = e2e_run(devices[:1], FLAGS.e2e_sharding)
      log(f"   {out['one']['step_secs_median'] * 1e3:.1f} ms/step, "
          f"{out['one']['tokens_per_sec']:,.0f} tokens/s")
    out["scaling_efficiency"] = out["n"]["tokens_per_sec"] / (n * out["one"]["tokens_per_sec"])
  return out


# ---- report ---------------------------------------------------------------------------------------

def print_table():
  print(f"\nMulti-GPU: {RESULT.get('num_devices')} x {RESULT.get('device')}")
  f = RESULT.get("fetch")
  if f:
    print_fetch(f)
  e = RESULT.get("e2e")
  if e:
    print_e2e(e)


def print_fetch(f):
  print(f"W1 leaf {f['leaf_shape']} bf16 in pinned_host, replicated over "
        f"{f['num_devices']} device(s); per layer {f['layer_bytes'] / 2**20:.1f} MiB")
  if "link_h2d_gbps_gpu0" in f:
    print(f"link (device_put, GPU 0 alone): {f['link_h2d_gbps_gpu0']:.1f} GB/s")
  print(f"{'fetch':<24}{'ms/layer':>10}{'delivered GB/s/dev':>20}{'host link GB/s/dev':>20}")
  for name, v in f.get("variants", {}).items():
    print(f"{name:<24}{v['secs_per_layer'] * 1e3:>10.3f}{v['delivered_gbps_per_device']:>20.1f}"
          f"{v['host_link_gbps_per_device']:>20.1f}")
  ag = f.get("all_gather_alone")
  if ag:
    print(f"{'all-gather alone':<24}{ag['secs_per_layer'] * 1e3:>10.3f}"
          f"{'':>20}{'':>20}  ({ag['received_gbps_per_device']:.1f} GB/s received per device)")
  if "speedup_multi_over_single" in f:
    print(f"speedup over single-path: multi-path {f['speedup_multi_over_single']:.2f}x, "
          f"from sharded storage {f['speedup_sharded_over_single']:.2f}x "
          f"(ideal {f['speedup_ideal']}x); values equal: {f.get('whole_leaf_equal')}, "
          f"layer sums equal: {f.get('sums_equal')}")
  elif "multi_path" in f:
    print(f"multi-path: {f['multi_path']}")


def print_e2e(e):
  print(f"\ne2e {e['config']} decoder, jaxtier.offload(optimizer_state_on_host), {e['sharding']}, "
        f"per device batch {e['batch_per_device']} x {e['seq_len']}")
  print(f"{'devices':<10}{'ms/step':>10}{'tokens/s':>14}{'pinned/dev MiB':>16}{'last loss':>11}")
  for key in ("n", "one"):
    r = e.get(key)
    if r:
      print(f"{r['num_devices']:<10}{r['step_secs_median'] * 1e3:>10.1f}"
            f"{r['tokens_per_sec']:>14,.0f}{r['pinned_bytes_per_device'] / 2**20:>16.1f}"
            f"{r['losses'][-1]:>11.4f}")
  if "scaling_efficiency" in e:
    print(f"scaling efficiency tokens/s(N) / (N x tokens/s(1)): {e['scaling_efficiency']:.2f}")


def main(argv):
  global FLAGS
  FLAGS = parse_args(argv)
  RESULT.update(command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=bench_util.git_commit(), versions=bench_util.versions(),
                smoke=FLAGS.smoke,
                env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "XLA_FLAGS",
                                                    "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")})
  with Section("backend"):
    backend = jax.default_backend()
    if backend != "gpu" and not FLAGS.smoke:
      raise RuntimeError(f"JAX backend is {backend!r}; this benchmark needs GPUs "
                         "(use --smoke for a logic check on CPU)")
    devices = jax.devices()
    if FLAGS.num_devices:
      devices = devices[:FLAGS.num_devices]
    RESULT["device"] = f"{devices[0].platform}:{getattr(devices[0], 'device_kind', '?')}"
    RESULT["num_devices"] = len(devices)
    log(f"{len(devices)} x {RESULT['device']}")
  if not FLAGS.skip_fetch:
    RESULT["fetch"] = fetch_section(devices)
    write_json()
  if not FLAGS.skip_e2e:
    RESULT["e2e"] = e2e_section(devices)
  write_json()
  print_table()


if __name__ == "__main__":
  main(sys.argv[1:])
