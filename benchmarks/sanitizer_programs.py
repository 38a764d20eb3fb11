"""Minimal programs for compute-sanitizer, one per CUDA handler family of jaxtier.

`benchmarks/sanitizer.sh` runs each under `compute-sanitizer` (memcheck, racecheck, synccheck,
initcheck); each also runs alone, on a GPU or on the CPU backend (the CPU handlers). Every
program runs each custom call of its family at least twice, on real data, and checks the
results against numpy, so a sanitizer run also shows that the calls computed the right thing.
Shapes are tiny (a few thousand to a few hundred thousand elements) and the XLA work around the
calls is elementwise (no dot, so neither cuBLAS nor autotuning runs), except in `offload`.

Families (`--family`):
- `dha` (xla_ffi/src/dha_kernels.cu): `jaxtier_dha_gather_ffi` on pinned_host tables whose
  rows take the 16-, 4- and 2-byte load paths, out-of-range ids, the unrolled row loop and the
  grid-stride loop over ids; `jaxtier_dha_matmul_ffi` (x @ w[index] and x @ w[index]^T,
  f32 and bf16, stacked pinned_host w) over every M tile of the kernel (M = 5 .. 600, the last
  in two 512-row chunks), w rows that allow 16-byte loads and rows that do not, with the
  split reduction (partial sums + DhaReduceKernel, as sized for this GPU) and without it
  (a second program traced as if no GPU were seen); `jaxtier_dha_scatter_add_ffi` into donated
  pinned_host buffers (f32 and bf16, rows of either dtype, ids of rank 1 and 2 with repeats and
  out-of-range ids, no ids at all, rows larger than a staging slot) staged in 2 to 78 chunks
  (JAXTIER_DHA_SCATTER_CHUNK_BYTES=8 KiB), each round writing the previous round's buffers in
  place; bitwise against numpy.
- `stream` (stream_kernels.cu): `jaxtier_stream_fetch_ffi` (two leaves at once, double
  buffered, with `after` pass-throughs), `jaxtier_stream_wait_ffi` (h2d and d2h) and
  `jaxtier_stream_send_ffi` (two donated pinned_host leaves, every layer) in one jitted
  3-layer loop; the fetched slices, the sent slices and the result are checked.
- `host_update` (host_update_kernels.cu, op_program.h, host_update.cc): `jaxtier_host_update_ffi`
  with an AdamW program (+ a device param) for each executor: host_dha, host_cpu and split
  with the state in pinned_host, host_cpu and split with every buffer on the device (staged
  aliased pairs; f16 gradient); the staging runs in 3-5 chunks over the 3 streams
  (JAXTIER_HOST_CPU_CHUNK_BYTES=1 MiB). Then `jaxtier_host_update_layer_ffi` + `jaxtier_
  host_update_join_ffi` over 3 layers of a stacked AdamW state (master and nu in pinned_host,
  mu and the bf16 param on the device), for host_cpu, split and host_dha. Exact (bitwise)
  against numpy fp32.
- `offload` (end to end, not a handler family of its own): `jaxtier.offload` of a 2-layer
  `nnx.scan` model trained 2 steps with AdamW, (a) `optimizer_state_on_host` with the update
  overlapped layer by layer (host_update_layer + join, fused host_update for the head), (b) the
  stacked layers `host_stream` (fetch / wait / send + fused host_update); against the same
  steps under plain `jax.jit` on the device (tolerance: a different program's roundings).

Environment set here before JAX starts (each only if not already set): XLA_FLAGS gains
--xla_gpu_autotune_level=0; XLA_PYTHON_CLIENT_PREALLOCATE=false;
XLA_PYTHON_CLIENT_ALLOCATOR=platform (each device buffer its own cudaMalloc, so that memcheck
sees its bounds instead of one pool); JAXTIER_CPU_THREADS=4; JAXTIER_HOST_CPU_CHUNK_BYTES=1 MiB;
JAXTIER_DHA_SCATTER_CHUNK_BYTES=8 KiB; JAXTIER_TIME_SCANS=0 (offload's planner runs no timing
programs).

Prints one `CHECK ... ok|FAILED` line per check, a `COVERAGE` line (the jaxtier custom calls in
the compiled programs and how many times they ran) and one final line
`SANITIZER_PROGRAM family=... backend=... result=PASS|FAIL ...`; exits 1 on any failure (and when
JAXTIER_REQUIRE_GPU=1 but JAX runs on no GPU).

  python3 benchmarks/sanitizer_programs.py --family=host_update
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import sys
import time
import traceback

FAMILIES = ("dha", "stream", "host_update", "offload")


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--family", required=True, choices=FAMILIES)
  p.add_argument("--rounds", type=int, default=2,
                 help="runs of each compiled program, each on new data (at least 2)")
  p.add_argument("--platform", default="", choices=("", "cpu", "gpu"),
                 help="JAX_PLATFORMS for this run (default: JAX's choice)")
  return p.parse_args(argv)


def set_environment(platform: str) -> None:
  """XLA and jaxtier settings that keep a sanitized run small (before JAX is imported)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_autotune_level" not in flags:
    flags = (flags + " --xla_gpu_autotune_level=0").strip()
  os.environ["XLA_FLAGS"] = flags
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
  if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "":
    del os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"]  # "": XLA's default (the BFC pool)
  os.environ.setdefault("JAXTIER_CPU_THREADS", "4")
  # 1 MiB (the layer calls' minimum): the host_cpu staging runs in several chunks here.
  os.environ.setdefault("JAXTIER_HOST_CPU_CHUNK_BYTES", str(1 << 20))
  # 8 KiB staging slots: the dha scatter-adds run in several chunks here.
  os.environ.setdefault("JAXTIER_DHA_SCATTER_CHUNK_BYTES", str(8 << 10))
  os.environ.setdefault("JAXTIER_TIME_SCANS", "0")  # offload: the planner times no scan bodies
  if platform:
    os.environ["JAX_PLATFORMS"] = platform


# ------------------------------------------------------------------------------------------------
# Bookkeeping
# ------------------------------------------------------------------------------------------------

_TARGET_RE = re.compile(r'custom_call_target="(jaxtier_[a-z_]+)"')


class Ctx:
  """Checks, failures and coverage of one run."""

  def __init__(self, family, rounds):
    self.family = family
    self.rounds = rounds
    self.checks = 0
    self.failures = []
    self.static = collections.Counter()  # target -> calls in the compiled programs
    self.executed = collections.Counter()  # target -> calls run

  def check(self, name, fn):
    """Runs fn() (which raises on a mismatch, or returns a detail string)."""
    self.checks += 1
    try:
      detail = fn()
    except Exception as e:  # pylint: disable=broad-except
      self.failures.append(name)
      print(f"CHECK {name}: FAILED: {type(e).__name__}: {e}", flush=True)
      traceback.print_exc()
      return False
    print(f"CHECK {name}: ok" + (f" ({detail})" if detail else ""), flush=True)
    return True

  def compiled(self, jitted, *args):
    """(jitted.lower(*args).compile(), its jaxtier custom calls), the calls counted."""
    compiled = jitted.lower(*args).compile()
    return compiled, self.count_hlo(compiled.as_text())

  def count_hlo(self, text):
    found = collections.Counter(_TARGET_RE.findall(text))
    self.static.update(found)
    return found

  def ran(self, found, times=1):
    for target, n in found.items():
      self.executed[target] += n * times


def _expect(ok, detail):
  if not ok:
    raise AssertionError(detail)
  return detail


def _read(x):
  """`x` as numpy, read through a device copy: a numpy view of a pinned_host buffer would be an
  external reference to a buffer the next round donates."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  if getattr(x.sharding, "memory_kind", None) == "pinned_host":
    x = jax.device_put(x, x.sharding.with_memory_kind("device"))
  return np.asarray(x)


def _bits_equal(got, want, what):
  import numpy as np  # pylint: disable=g-import-not-at-top
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape or got.dtype != want.dtype:
    raise AssertionError(f"{what}: got {got.shape} {got.dtype}, want {want.shape} {want.dtype}")
  bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
  diff = np.flatnonzero(got.view(bits) != want.view(bits))
  if diff.size:
    raise AssertionError(f"{what}: {diff.size} of {got.size} elements differ, first at "
                         f"{diff[:5]}: {got.reshape(-1)[diff[:5]]} vs {want.reshape(-1)[diff[:5]]}")


# ------------------------------------------------------------------------------------------------
# dha: gather and matmul on pinned_host operands
# ------------------------------------------------------------------------------------------------

# (dtype, V, D, ids shape): rows of 128 B (16-byte loads), 132 B (4-byte), 134 B (2-byte),
# 2080 B (16-byte, the unrolled loop and its tail), and more ids than the grid has warps on an
# H200 (132 SMs * 16 blocks * 8 warps = 16896: the grid-stride loop).
GATHERS = (("bfloat16", 300, 64, (5, 41)), ("float32", 300, 33, (205,)),
           ("bfloat16", 300, 67, (3, 7)), ("float16", 64, 1040, (37,)),
           ("float32", 50, 8, (17_000,)))
# Stacked weights [2, K, N]: N = 72 allows 16-byte loads of w's rows (f32 and bf16), N = 130
# does not.
W_SHAPES = {"a": (2, 160, 72), "b": (2, 97, 130)}
# (w, M): every M tile of DispatchTile (<= 8, 16, 32, 64, 128, 256, then 512-row chunks).
MATMULS = tuple(("a", m) for m in (5, 12, 33, 100, 200, 600)) + (("b", 33), ("b", 600))
# (buffer dtype, rows dtype, V, D, ids shape). With 8 KiB slots (7,936 bytes of ids and rows):
# 30 ids a chunk -> 7 chunks; 113 -> 2; 15 -> 34; 3 -> 13; 220 -> 78 (more ids than one slot
# holds many times over); a bf16 row of 10,000 bytes, larger than a slot (which grows to one id
# and one row: 9 chunks); no ids (the buffer is only zeroed).
SCATTERS = (("float32", "float32", 300, 64, (5, 41)), ("float32", "bfloat16", 300, 33, (205,)),
            ("bfloat16", "float32", 1000, 130, (3, 170)),
            ("bfloat16", "bfloat16", 64, 1040, (37,)), ("float32", "float32", 50, 8, (17_000,)),
            ("float32", "bfloat16", 16, 5000, (9,)), ("bfloat16", "float32", 20, 4, (0,)))


def run_dha(ctx):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from jaxtier._src.primitives import dha  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  mesh = Mesh([device], ("d",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  rng = np.random.default_rng(0)

  def cast(a, dtype):
    return np.asarray(jnp.asarray(a, dtype))  # numpy array of the jnp dtype (ml_dtypes)

  tables = [cast(rng.normal(size=(v, d)), dt) for dt, v, d, _ in GATHERS]
  combos = [(dt, tr) for dt in ("float32", "bfloat16") for tr in (False, True)]
  weights = {(name, dt): cast(rng.normal(size=shape), dt)
             for name, shape in W_SHAPES.items() for dt in ("float32", "bfloat16")}
  wkeys = sorted(weights)
  cases = [(wname, m, dt, tr) for wname, m in MATMULS for dt, tr in combos]

  def program(tables, ids, xs, ws):
    rows = [dha.gather(t, i) for t, i in zip(tables, ids)]
    w_of = dict(zip(wkeys, ws))
    ys = []
    for (wname, _, dt, tr), x in zip(cases, xs):
      op = dha.matmul_t if tr else dha.matmul
      ys.append(op(x, w_of[(wname, dt)], index=1))
    return rows, ys

  shardings = ([host] * len(tables), [dev] * len(GATHERS), [dev] * len(cases), [host] * len(wkeys))
  jitted = jax.jit(program, in_shardings=shardings)

  def inputs(seed):
    r = np.random.default_rng(100 + seed)
    ids = []
    for _, v, _, shape in GATHERS:
      i = r.integers(-8, v + 8, size=shape).astype(np.int32)  # some out of range
      flat = i.reshape(-1)
      flat[:4] = [-1, v, v - 1, 0][:flat.size]
      ids.append(i)
    xs = []
    for wname, m, dt, tr in cases:
      _, k, n = W_SHAPES[wname]
      xs.append(cast(r.normal(size=(m, n if tr else k)), dt))
    return ids, xs

  def put(arrays, sharding):
    return [jax.device_put(a, sharding) for a in arrays]

  dev_tables = put(tables, host)
  dev_ws = put([weights[k] for k in wkeys], host)

  def check_round(outs, ids, xs, label):
    rows, ys = outs
    for (dt, v, d, shape), table, i, got in zip(GATHERS, tables, ids, rows):
      valid = (i >= 0) & (i < v)
      want = np.where(valid[..., None], table[np.where(valid, i, 0)], np.zeros((), table.dtype))
      _bits_equal(np.asarray(got), want, f"{label} gather {dt} [{v}, {d}] ids {shape}")
    worst = 0.0
    for (wname, m, dt, tr), x, got in zip(cases, xs, ys):
      layer = np.asarray(weights[(wname, dt)], np.float64)[1]
      b = layer.T if tr else layer
      xf = np.asarray(x, np.float64)
      want = xf @ b
      bound = 1e-5 * (np.abs(xf) @ np.abs(b)) + 1e-30
      if dt == "bfloat16":
        bound = bound + 2.0 ** -8 * np.abs(want)  # y rounded once to bf16
      err = np.abs(np.asarray(np.asarray(got, np.float32), np.float64) - want)
      if got.shape != want.shape or not np.all(err <= bound):
        raise AssertionError(f"{label} matmul{'_t' if tr else ''} {dt} w {W_SHAPES[wname]} "
                             f"M={m}: max err {err.max()} over the bound")
      worst = max(worst, float(np.max(err / bound)))
    return f"{len(rows)} gathers exact, {len(ys)} matmuls within the fp32 bound (worst {worst:.3f})"

  # Program 1: the split reduction as sized for this GPU. Program 2: traced as if no GPU were
  # seen (no split: the kernel writes y directly).
  programs = []
  ids0, xs0 = inputs(0)
  args0 = (dev_tables, put(ids0, dev), put(xs0, dev), dev_ws)
  programs.append(("split as sized",) + ctx.compiled(jitted, *args0))
  real_num_sms = dha._num_sms  # pylint: disable=protected-access
  dha._num_sms = lambda: 0  # pylint: disable=protected-access
  try:
    jitted_nosplit = jax.jit(lambda *a: program(*a), in_shardings=shardings)
    programs.append(("unsplit",) + ctx.compiled(jitted_nosplit, *args0))
  finally:
    dha._num_sms = real_num_sms  # pylint: disable=protected-access
  splits = []
  for wname, m, dt, tr in cases:
    _, k, n = W_SHAPES[wname]
    splits.append(dha.matmul_partial_shape(m, n if tr else k, k if tr else n, dt,
                                           real_num_sms())[0])
  print(f"dha: {len(GATHERS)} gathers + {len(cases)} matmuls per program; SMs seen: "
        f"{real_num_sms()}; reduction splits in the first program: {sorted(set(splits))} "
        "(0: unsplit)", flush=True)
  for name, compiled, found in programs:
    # Which matmul calls got partial sums (an f32[S, M, O] second result: the split reduction).
    lines = [l for l in compiled.as_text().splitlines()
             if 'custom_call_target="jaxtier_dha_matmul_ffi"' in l]
    split = sum(1 for l in lines if re.search(r"f32\[\d+,\d+,\d+\]", l.split("custom-call(")[0]))
    print(f"dha {name}: {split} of {len(lines)} matmul calls with the split reduction", flush=True)
    if jax.default_backend() == "gpu":
      want_split = name != "unsplit"
      ctx.check(f"dha {name}: split reductions as intended",
                lambda split=split, want_split=want_split: _expect(
                    (split > 0) == want_split, f"{split} split matmul calls"))
    for r in range(ctx.rounds):
      ids, xs = inputs(r) if r else (ids0, xs0)
      outs = jax.block_until_ready(compiled(dev_tables, put(ids, dev), put(xs, dev), dev_ws))
      ctx.ran(found)
      ctx.check(f"dha {name} round {r}", lambda: check_round(outs, ids, xs, f"{name} r{r}"))

  run_dha_scatter_add(ctx, dha, host, dev, cast)


def run_dha_scatter_add(ctx, dha, host, dev, cast):
  """scatter_add into donated pinned_host buffers, each round into the previous round's."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  def program(buffers, ids, rows):
    return [dha.scatter_add(b, i, r) for b, i, r in zip(buffers, ids, rows)]

  k = len(SCATTERS)
  jitted = jax.jit(program, donate_argnums=0, in_shardings=([host] * k, [dev] * k, [dev] * k),
                   out_shardings=[host] * k)

  def inputs(seed):
    r = np.random.default_rng(200 + seed)
    ids, rows = [], []
    for _, rdt, v, d, shape in SCATTERS:
      i = r.integers(-8, v + 8, size=shape).astype(np.int32)  # some out of range
      flat = i.reshape(-1)
      flat[::5] = 1  # row 1 in most chunks: its fp32 sum runs across them
      flat[:6] = [-1, v, v - 1, 0, 1, 1][:flat.size]
      ids.append(i)
      rows.append(cast(r.normal(size=shape + (d,)), rdt))
    return ids, rows

  def want(v, d, bdt, i, rows):
    i = i.reshape(-1)
    valid = (i >= 0) & (i < v)
    acc = np.zeros((v, d), np.float32)
    np.add.at(acc, i[valid], np.asarray(rows, np.float32).reshape(-1, d)[valid])
    return cast(acc, bdt)

  buffers = [jax.device_put(jnp.full((v, d), 7.0, bdt), host) for bdt, _, v, d, _ in SCATTERS]
  compiled = found = None
  for r in range(ctx.rounds):
    ids, rows = inputs(r)
    args = (buffers, [jax.device_put(i, dev) for i in ids], [jax.device_put(x, dev) for x in rows])
    if compiled is None:
      compiled, found = ctx.compiled(jitted, *args)
    pointers = [b.unsafe_buffer_pointer() for b in buffers]
    buffers = jax.block_until_ready(compiled(*args))
    ctx.ran(found)

    def check(outs=buffers, ids=ids, rows=rows, pointers=pointers, r=r):
      for (bdt, rdt, v, d, shape), out, i, x, p in zip(SCATTERS, outs, ids, rows, pointers):
        what = f"r{r} scatter_add {bdt} [{v}, {d}] rows {rdt} ids {shape}"
        if out.sharding.memory_kind != "pinned_host" or out.unsafe_buffer_pointer() != p:
          raise AssertionError(f"{what}: not written in place in pinned_host "
                               f"({out.sharding.memory_kind})")
        _bits_equal(_read(out), want(v, d, bdt, i, x), what)
      return f"{k} scatter-adds in place, bitwise equal to numpy"
    ctx.check(f"dha scatter_add round {r}", check)


# ------------------------------------------------------------------------------------------------
# stream: fetch / wait / send in a double-buffered layer loop
# ------------------------------------------------------------------------------------------------

STREAM_LAYERS, STREAM_ROWS, STREAM_COLS, STREAM_V = 3, 64, 48, 100


def run_stream(ctx):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from jaxtier._src.primitives import stream  # pylint: disable=g-import-not-at-top

  L, R, C, V = STREAM_LAYERS, STREAM_ROWS, STREAM_COLS, STREAM_V
  device = jax.devices()[0]
  mesh = Mesh([device], ("d",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  rng = np.random.default_rng(1)
  W = (rng.normal(size=(L, R, C)) * 0.5).astype(np.float32)
  Vb = np.asarray(jnp.asarray(rng.normal(size=(L, V)), jnp.bfloat16))

  def program(W, Vs, G, H, x):
    """Layer l: h = tanh(h * W[l] + V[l][:C]); sends h into G[l] and 2 V[l] (bf16) into H[l]."""
    (bw, bv), _ = stream.fetch([W, Vs], 0)
    h = x
    fetched, hs, sent = [], [], []
    for l in range(L):
      w, v = stream.wait([bw, bv], after=[h])
      if l + 1 < L:
        (bw, bv), (w, v) = stream.fetch([W, Vs], l + 1, after=[w, v])
      fetched += [w, v]
      h = jnp.tanh(h * w + v[:C].astype(jnp.float32)[None, :])
      gv = (v.astype(jnp.float32) * 2.0).astype(jnp.bfloat16)
      G, H = stream.send([G, H], [h, gv], l)
      hs.append(h)
      sent += [h, gv]
    G, H = stream.wait([G, H], after=sent, direction="d2h")
    return h, G, H, fetched, hs

  out_sh = (dev, host, host, [dev] * (2 * L), [dev] * L)
  jitted = jax.jit(program, donate_argnums=(2, 3), in_shardings=(host, host, host, host, dev),
                   out_shardings=out_sh)
  Wh, Vh = jax.device_put(W, host), jax.device_put(Vb, host)
  G = jax.device_put(np.zeros((L, R, C), np.float32), host)
  H = jax.device_put(np.zeros((L, V), Vb.dtype), host)
  x0 = rng.normal(size=(R, C)).astype(np.float32)
  compiled, found = ctx.compiled(jitted, Wh, Vh, G, H, jax.device_put(x0, dev))

  for r in range(ctx.rounds):
    x = x0 if r == 0 else np.random.default_rng(50 + r).normal(size=(R, C)).astype(np.float32)
    h, G, H, fetched, hs = jax.block_until_ready(
        compiled(Wh, Vh, G, H, jax.device_put(x, dev)))  # G, H donated: the previous results
    ctx.ran(found)

    def check(h=h, G=G, H=H, fetched=fetched, hs=hs, x=x):
      for l in range(L):
        _bits_equal(np.asarray(fetched[2 * l]), W[l], f"fetched W[{l}]")
        _bits_equal(np.asarray(fetched[2 * l + 1]), Vb[l], f"fetched V[{l}]")
      if G.sharding.memory_kind != "pinned_host" or H.sharding.memory_kind != "pinned_host":
        raise AssertionError(f"sent leaves in {G.sharding.memory_kind}, {H.sharding.memory_kind}")
      # Read through device copies: a numpy view of a pinned_host buffer is an external
      # reference, and G, H are donated to the next round.
      g, hh = _read(G), _read(H)
      want_h = x
      for l in range(L):
        _bits_equal(g[l], np.asarray(hs[l]), f"sent G[{l}] vs the layer's h")
        _bits_equal(hh[l], np.asarray(Vb[l].astype(np.float32) * 2, Vb.dtype), f"sent H[{l}]")
        want_h = np.tanh(want_h * W[l] + Vb[l][:C].astype(np.float32)[None, :])
        # XLA's tanh is not numpy's to the last bit (on a GPU an approximation): a tolerance.
        np.testing.assert_allclose(np.asarray(hs[l]), want_h, rtol=1e-4, atol=1e-5,
                                   err_msg=f"h after layer {l}")
      _bits_equal(np.asarray(h), np.asarray(hs[-1]), "result")
      return f"{2 * L} fetched slices and {2 * L} sent slices exact, h within 1e-4 of numpy"
    ctx.check(f"stream round {r}", check)


# ------------------------------------------------------------------------------------------------
# host_update: the fused update (each executor), the layer calls and the join
# ------------------------------------------------------------------------------------------------

FUSED_N = 200_000  # 3 (pinned state) or 5 (all on the device) staging chunks of 1 MiB
# (executor, dha_fraction, state memory kind, gradient dtype)
FUSED = (("host_dha", 0.5, "pinned_host", "bfloat16"), ("host_cpu", 0.5, "pinned_host", "bfloat16"),
         ("split", 0.37, "pinned_host", "bfloat16"), ("host_cpu", 0.5, "device", "float16"),
         ("split", 0.37, "device", "float16"))
LAYERS, LAYER_COUNT = 3, 250_000  # host_cpu: 3 chunks per layer call; split: 2
LAYERED = (("host_cpu", 0.5), ("split", 0.37), ("host_dha", 0.5))
B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 1e-4


def _adamw_numpy(master, mu, nu, g, lr, bc1, bc2):
  """One step of programs.adamw_program in numpy fp32, one IEEE rounding per operation."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  f32 = np.float32
  with np.errstate(all="ignore"):
    mu = f32(1 - B1) * g + f32(B1) * mu
    nu = f32(1 - B2) * (g * g) + f32(B2) * nu
    u = (mu / bc1) / (np.sqrt(nu / bc2) + f32(EPS))
    u = (u + f32(WD) * master) * -lr
    return master + u, mu, nu, u


def _scalars(t):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return [np.asarray([v], np.float32) for v in (1e-3 * t, 1 - B1 ** t, 1 - B2 ** t)]


def run_host_update(ctx):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from jaxtier._src.primitives import host_update as hu  # pylint: disable=g-import-not-at-top
  from jaxtier._src.primitives import op_programs  # pylint: disable=g-import-not-at-top

  Op = hu.Op
  device = jax.devices()[0]
  mesh = Mesh([device], ("d",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  f32 = np.float32
  base = op_programs.adamw_program(b1=B1, b2=B2, eps=EPS, weight_decay=WD)

  # ---- the fused update: AdamW + a device fp32 param given the same update (result 4) -----
  code = base.code.tolist()
  assert code[29] == [Op.ADD, 0, 0, 13, 0] and code[30][0] == Op.STORE  # u * -lr is in r13
  extra = [[Op.LOAD, 14, 7, 0, 0], [Op.ADD, 14, 14, 13, 0], [Op.STORE, 4, 14, 0, 0]]
  fused = hu.Program(code=np.asarray(code + extra, np.int32), consts=base.consts,
                     num_regs=base.num_regs, num_operands=8, num_results=5)
  aliases = [0, 1, 2, -1, -1]
  n = FUSED_N

  def fused_state(seed):
    r = np.random.default_rng(seed)
    master = r.normal(size=n).astype(f32)
    mu = (r.normal(size=n) * 1e-3).astype(f32)
    nu = (np.abs(r.normal(size=n)) * 1e-6).astype(f32)
    nu[:4] = [0.0, 1e-40, 3e-39, 1.0]  # zero and fp32 subnormals
    pdev = r.normal(size=n).astype(f32)
    return master, mu, nu, pdev

  for executor, fraction, kind, gdtype in FUSED:
    label = f"host_update {executor} (dha_fraction {fraction}) state {kind}, grad {gdtype}"
    state_sh = host if kind == "pinned_host" else dev
    shapes = [jax.ShapeDtypeStruct((n,), jnp.float32)] * 3 + [
        jax.ShapeDtypeStruct((n,), jnp.bfloat16), jax.ShapeDtypeStruct((n,), jnp.float32)]

    def step(master, mu, nu, pdev, grad, lr, bc1, bc2, executor=executor, fraction=fraction,
             shapes=shapes):
      return tuple(hu.host_update(fused, [master, mu, nu, grad, lr, bc1, bc2, pdev], shapes,
                                  aliases, executor=executor, dha_fraction=fraction))

    in_sh = (state_sh,) * 3 + (dev,) * 5
    out_sh = (state_sh,) * 3 + (dev, dev)
    jitted = jax.jit(step, donate_argnums=(0, 1, 2), in_shardings=in_sh, out_shardings=out_sh)
    master, mu, nu, pdev = fused_state(1)
    want = [master, mu, nu, pdev]
    arrays = [jax.device_put(a, state_sh) for a in (master, mu, nu)] + [jax.device_put(pdev, dev)]
    compiled = None
    for t in range(1, ctx.rounds + 1):
      g = np.asarray(jnp.asarray(np.random.default_rng(10 + t).normal(size=n) * 0.1, gdtype))
      scalars = _scalars(t)
      args = arrays + [jax.device_put(g, dev)] + [jax.device_put(s, dev) for s in scalars]
      if compiled is None:
        compiled, found = ctx.compiled(jitted, *args)
      outs = jax.block_until_ready(compiled(*args))
      ctx.ran(found)
      m_, mu_, nu_, u = _adamw_numpy(want[0], want[1], want[2], g.astype(f32), scalars[0][0],
                                     scalars[1][0], scalars[2][0])
      want = [m_, mu_, nu_, want[3] + u]
      arrays = [outs[0], outs[1], outs[2], outs[4]]

      def check(outs=outs, want=list(want), kind=kind):
        got = [_read(o) for o in outs]
        for k, what in enumerate(("master", "mu", "nu")):
          if outs[k].sharding.memory_kind != kind:
            raise AssertionError(f"{what} came back in {outs[k].sharding.memory_kind}")
          _bits_equal(got[k], want[k], what)
        _bits_equal(got[3], want[0].astype(jnp.bfloat16), "bf16 param")
        _bits_equal(got[4], want[3], "device param")
        return f"{n} elements, 5 results bitwise equal to numpy"
      ctx.check(f"{label} step {t}", check)

  # ---- the layer calls and the join ------------------------------------------------------
  # Operands: master [L, C] (pinned_host), mu [L * C] (device), nu [L, C] (pinned_host), the
  # layer's gradient [C] (device, f32), lr, 1 - b1^t, 1 - b2^t (device scalars), the bf16
  # param [L, C] (device; written from the new master, never read). Results go to operands
  # 0, 1, 2, 7.
  layer_prog = hu.Program(code=base.code, consts=base.consts, num_regs=base.num_regs,
                          num_operands=8, num_results=4)
  L, C = LAYERS, LAYER_COUNT

  for executor, fraction in LAYERED:
    label = f"host_update_layer+join {executor} (dha_fraction {fraction})"

    def step(master, mu, nu, param, grads, lr, bc1, bc2, executor=executor, fraction=fraction):
      tokens, slices = [], []
      for t in reversed(range(L)):  # as the backward pass does
        g_t = grads[t]
        tokens.append(hu.host_update_layer(
            layer_prog, [master, mu, nu, g_t, lr, bc1, bc2, param], [0, 1, 2, 7],
            offset=t * C, count=C, executor=executor, dha_fraction=fraction))
        slices.append(g_t)
      # Every device value the layer calls read stays alive until the join; one join per
      # buffer, as the lowering does (a join of several gives its results one memory space).
      after = tokens + slices + [lr, bc1, bc2]
      return tuple(hu.join([a], after=after)[0] for a in (master, mu, nu, param))

    in_sh = (host, dev, host, dev, dev, dev, dev, dev)
    out_sh = (host, dev, host, dev)
    jitted = jax.jit(step, donate_argnums=(0, 1, 2, 3), in_shardings=in_sh, out_shardings=out_sh)
    r = np.random.default_rng(3)
    master = r.normal(size=(L, C)).astype(f32)
    mu = (r.normal(size=(L, C)) * 1e-3).astype(f32)
    nu = (np.abs(r.normal(size=(L, C))) * 1e-6).astype(f32)
    nu[:, :3] = [0.0, 1e-40, 3e-39]
    param = np.asarray(jnp.asarray(master, jnp.bfloat16))
    want = [master, mu, nu]
    arrays = [jax.device_put(master, host), jax.device_put(mu.reshape(-1), dev),
              jax.device_put(nu, host), jax.device_put(param, dev)]
    compiled = None
    for t in range(1, ctx.rounds + 1):
      grads = (np.random.default_rng(20 + t).normal(size=(L, C)) * 0.1).astype(f32)
      scalars = _scalars(t)
      args = arrays + [jax.device_put(grads, dev)] + [jax.device_put(s, dev) for s in scalars]
      if compiled is None:
        compiled, found = ctx.compiled(jitted, *args)
      outs = jax.block_until_ready(compiled(*args))
      ctx.ran(found)
      m_, mu_, nu_, _ = _adamw_numpy(want[0], want[1], want[2], grads, scalars[0][0],
                                     scalars[1][0], scalars[2][0])
      want = [m_, mu_, nu_]
      arrays = list(outs)

      def check(outs=outs, want=list(want)):
        kinds = [o.sharding.memory_kind for o in outs]
        if kinds != ["pinned_host", "device", "pinned_host", "device"]:
          raise AssertionError(f"results in {kinds}")
        got = [_read(o) for o in outs]
        _bits_equal(got[0], want[0], "master")
        _bits_equal(got[1], want[1].reshape(-1), "mu")
        _bits_equal(got[2], want[2], "nu")
        _bits_equal(got[3], want[0].astype(jnp.bfloat16), "bf16 param")
        return f"{L} layer calls of {C} elements, 4 targets bitwise equal to numpy"
      ctx.check(f"{label} step {t}", check)


# ------------------------------------------------------------------------------------------------
# offload: jaxtier.offload end to end (a tiny scanned model)
# ------------------------------------------------------------------------------------------------

def run_offload(ctx):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jaxtier  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_default_matmul_precision", "highest")
  layers, width, head, batch = 2, 32, 4, 8

  class Block(nnx.Module):

    def __init__(self, rngs):
      self.w = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.w(x))

  class Stack(nnx.Module):

    def __init__(self, rngs):
      @nnx.split_rngs(splits=layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(rngs)
      self.blocks = make(rngs)
      self.head = nnx.Linear(width, head, rngs=rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def run(h, block):
        return block(h)
      return self.head(run(x, self.blocks))

  def model():
    return nnx.split(Stack(nnx.Rngs(0)))

  graphdef, _ = model()
  tx = optax.adamw(1e-2, weight_decay=0.1)

  def step(state, batch_):
    x, y = batch_

    def loss(p):
      return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)
    value, g = jax.value_and_grad(loss)(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": value}

  r = np.random.default_rng(5)
  batches = [(jnp.asarray(r.normal(size=(batch, width)), jnp.float32),
              jnp.asarray(r.normal(size=(batch, head)), jnp.float32))
             for _ in range(ctx.rounds)]

  def fresh_state():
    _, params = model()
    return {"params": params, "opt": tx.init(params)}

  ref = jax.jit(step)
  state = fresh_state()
  ref_losses = []
  for b in batches:
    state, m = ref(state, b)
    ref_losses.append(float(m["loss"]))
  ref_params = [np.asarray(x) for x in jax.tree.leaves(state["params"])]
  print(f"offload: reference losses {ref_losses}", flush=True)

  variants = (("optimizer_state_on_host, overlapped", "optimizer_state_on_host"),
              ("blocks host_stream", {r"\['params'\]\['blocks'\]": "host_stream"}))
  for name, policy in variants:
    off = jaxtier.offload(step, policy=policy, overlap_update=True)
    state = off.place(fresh_state(), batches[0])
    found = collections.Counter()
    for lower in (off.lower, off.lower_update):
      try:
        found += ctx.count_hlo(lower(state, batches[0]).compile().as_text())
      except Exception as e:  # pylint: disable=broad-except  (coverage only)
        print(f"offload {name}: {lower.__name__} not counted ({type(e).__name__}: {e})")
    print(f"offload {name}: jaxtier calls in its programs: {dict(found)}", flush=True)
    losses = []
    for b in batches:
      state, m = off(state, b)
      losses.append(float(m["loss"]))
      ctx.ran(found)
    params = [np.asarray(x) for x in jax.tree.leaves(state["params"])]

    def check(losses=losses, params=params):
      np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
      for k, (a, b) in enumerate(zip(params, ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * float(np.max(np.abs(b)) or 1),
                                   err_msg=f"param leaf {k}")
      return f"losses {losses}, params within 1e-3 of jax.jit's"
    ctx.check(f"offload {name}", check)


# ------------------------------------------------------------------------------------------------

def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.rounds < 2:
    raise SystemExit("--rounds must be at least 2 (each custom call runs twice)")
  set_environment(args.platform)
  t0 = time.time()
  import jax  # pylint: disable=g-import-not-at-top  (after the environment is set)
  from jaxtier._src.primitives import base as ffi  # pylint: disable=g-import-not-at-top

  backend = jax.default_backend()
  ctx = Ctx(args.family, args.rounds)
  print(f"sanitizer_programs: family={args.family} backend={backend} devices={jax.devices()} "
        f"jax={jax.__version__} XLA_FLAGS={os.environ.get('XLA_FLAGS')!r} "
        f"allocator={os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR', 'default')}", flush=True)
  fatal = None
  if os.environ.get("JAXTIER_REQUIRE_GPU") == "1" and backend != "gpu":
    fatal = f"JAXTIER_REQUIRE_GPU=1 but JAX runs on {backend}"
  elif ffi.ffi_disabled():
    fatal = "JAXTIER_DISABLE_FFI is set: no custom call would run"
  elif backend == "gpu" and not ffi.has_cuda():
    fatal = "jaxtier's extension was built without its CUDA handlers"
  if fatal is None:
    try:
      {"dha": run_dha, "stream": run_stream, "host_update": run_host_update,
       "offload": run_offload}[args.family](ctx)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      fatal = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    # Free the executables now, while CUDA is up: their FFI states' deleters (streams, events,
    # pinned staging) then run under the sanitizer too, not after the runtime's teardown.
    try:
      jax.clear_caches()
      gc.collect()
      jax.effects_barrier()
    except Exception as e:  # pylint: disable=broad-except
      print(f"cleanup: {type(e).__name__}: {e}", flush=True)
  static = ", ".join(f"{k} x{v}" for k, v in sorted(ctx.static.items()) if v)
  ran = ", ".join(f"{k} x{v}" for k, v in sorted(ctx.executed.items()) if v)
  print(f"COVERAGE family={args.family}: in the compiled programs: {static or 'none'}; "
        f"calls run: {ran or 'none'}", flush=True)
  ok = fatal is None and not ctx.failures and ctx.checks > 0 and sum(ctx.executed.values()) > 0
  why = fatal or (f"failed: {', '.join(ctx.failures)}" if ctx.failures else
                  "no check ran" if not ok else "")
  print(f"SANITIZER_PROGRAM family={args.family} backend={backend} "
        f"result={'PASS' if ok else 'FAIL'} checks={ctx.checks - len(ctx.failures)}/{ctx.checks} "
        f"secs={time.time() - t0:.1f}" + (f" reason={why}" if why else ""), flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
