"""Params/s of the host CPU executor of the fused host update on fp32 AdamW, per thread count.

Runs `jaxtier._src.primitives.host_update` with `op_programs.adamw_program` on the CPU backend (the
CPU handler is the `host_cpu` executor's engine: host_update.cc's BuildCpuPlan + RunCpuPlan)
over `--num_leaves` leaves of `--leaf_elements` fp32 params, fp32 mu / nu / grad, the master,
mu and nu updated in place (donated), and next to it a yardstick: a hand-written fused AdamW
loop in C++ (the same fp32 operations in the same order, no FMA contraction), compiled at run
time with the system `g++ -O3 -march=native -ffp-contract=off` into a throw-away shared library
(never part of jaxtier's extension; skipped when no g++ is found). The yardstick's results are
compared bitwise with the executor's (`bits_equal`).

Each thread count runs in its own subprocess (JAXTIER_CPU_THREADS is read once, when jaxtier's
pool starts); each figure is the median of `--reps` timed steps after one warm-up step.
`--param_dtype` adds the program's fourth result (the new param in that dtype, written to a
fresh buffer) or drops it (`none`: what torch's fused AdamW writes, 28 bytes per param).
`--out_of_place` (on by default) also times the executor writing master, mu and nu to spare
buffers while reading the state, as a guessed (speculative) step does.

  python3 benchmarks/diagnostics/host_cpu_microbench.py --threads=1,2
  python3 benchmarks/diagnostics/host_cpu_microbench.py --smoke --out=/tmp   # toy sizes (CI)

Writes `--out`/host_cpu_microbench.json and prints one line per thread count.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags
import numpy as np

from jaxtier._src.primitives import host_update as hu
from jaxtier._src.primitives import op_programs
from jaxtier._src.vocab import Executor

_LEAF = flags.DEFINE_integer("leaf_elements", 1 << 24, "Params per leaf.")
_LEAVES = flags.DEFINE_integer("num_leaves", 4, "Leaves updated per step (one call each).")
_REPS = flags.DEFINE_integer("reps", 7, "Timed steps per figure (median reported).")
_THREADS = flags.DEFINE_list("threads", ["1", "2"], "Thread counts (JAXTIER_CPU_THREADS).")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", "none", ["none", "bfloat16", "float32"],
                                 "The program's fourth result (new param) dtype; none drops it.")
_REFERENCE = flags.DEFINE_bool("reference", True, "Also time the C++ fused-loop yardstick.")
_OUT_OF_PLACE = flags.DEFINE_bool(
    "out_of_place", True, "Also time the executor writing its results to other buffers than it "
    "reads (spare buffers, as a guessed step's updates write them: docs/design.md) rather than in "
    "place: each written line is then read for ownership first, unless the stores bypass it.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Toy sizes (logic check only; figures mean nothing).")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "/tmp"), "Where the JSON goes.")
_CHILD = flags.DEFINE_integer("child", 0, "Internal: measure with this many threads, print JSON.")

B1, B2, EPS, WD, LR = 0.9, 0.999, 1e-8, 1e-4, 1e-3

# The yardstick: optax.adamw's fp32 operations in profile.adamw_program's order, one pass.
_REFERENCE_SRC = r"""
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>
extern "C" void adamw(float* p, float* m, float* v, const float* g, int64_t n, float lr,
                      float bc1, float bc2, float b1, float omb1, float b2, float omb2, float eps,
                      float wd, int threads) {
  auto body = [=](int64_t lo, int64_t hi) {
    const float neg_lr = -lr;
    for (int64_t i = lo; i < hi; ++i) {
      const float gi = g[i];
      const float mi = omb1 * gi + b1 * m[i];
      const float vi = omb2 * (gi * gi) + b2 * v[i];
      const float u = (mi / bc1) / (std::sqrt(vi / bc2) + eps);
      p[i] = p[i] + (u + wd * p[i]) * neg_lr;
      m[i] = mi;
      v[i] = vi;
    }
  };
  if (threads <= 1) { body(0, n); return; }
  std::vector<std::thread> pool;
  const int64_t step = (n + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const int64_t lo = t * step, hi = lo + step < n ? lo + step : n;
    if (lo < hi) pool.emplace_back(body, lo, hi);
  }
  for (auto& th : pool) th.join();
}
"""


def _log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _state(n: int, salt: int) -> list[np.ndarray]:
  rng = np.random.default_rng(salt)
  master = rng.uniform(-1, 1, n).astype(np.float32)
  mu = rng.uniform(-1e-3, 1e-3, n).astype(np.float32)
  nu = rng.uniform(0, 1e-6, n).astype(np.float32)
  grad = rng.uniform(-0.1, 0.1, n).astype(np.float32)
  return [master, mu, nu, grad]


def _build_reference(tmp: str):
  """The yardstick as a ctypes function, or None without a g++."""
  import ctypes  # pylint: disable=g-import-not-at-top
  cxx = shutil.which("g++") or shutil.which("c++")
  if cxx is None:
    return None
  src, lib = os.path.join(tmp, "adamw_ref.cc"), os.path.join(tmp, "adamw_ref.so")
  with open(src, "w") as f:
    f.write(_REFERENCE_SRC)
  subprocess.run([cxx, "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno",
                  "-fno-trapping-math", "-shared", "-fPIC", "-pthread", src, "-o", lib],
                 check=True)
  fn = ctypes.CDLL(lib).adamw
  f32p = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
  fn.argtypes = [f32p, f32p, f32p, f32p, ctypes.c_int64] + [ctypes.c_float] * 9 + [ctypes.c_int]
  fn.restype = None
  return fn


def _median(fn, reps: int) -> tuple[float, list[float]]:
  fn()  # warm-up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), times


def _measure(threads: int) -> dict:
  """One thread count (this process's JAXTIER_CPU_THREADS): the executor and the yardstick."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top


  n, leaves, reps = _LEAF.value, _LEAVES.value, _REPS.value
  prog = op_programs.adamw_program(b1=B1, b2=B2, eps=EPS, weight_decay=WD)
  aliases = list(op_programs.ADAMW_ALIASES)
  shapes = [jax.ShapeDtypeStruct((n,), jnp.float32)] * 3
  if _PARAM_DTYPE.value == "none":  # drop the fourth STORE: torch's traffic (28 B / param)
    prog = hu.Program(code=prog.code[:-1], consts=prog.consts, num_regs=prog.num_regs,
                      num_operands=prog.num_operands, num_results=3)
    aliases = aliases[:3]
  else:
    shapes.append(jax.ShapeDtypeStruct((n,), jnp.dtype(_PARAM_DTYPE.value)))
  scalars = [np.full((1,), x, np.float32) for x in (LR, 1 - B1, 1 - B2)]  # step 1

  def step(masters, mus, nus, grads, lr, bc1, bc2):
    outs = [hu.host_update(prog, [masters[i], mus[i], nus[i], grads[i], lr, bc1, bc2], shapes,
                           aliases, executor=Executor.HOST_CPU) for i in range(leaves)]
    return tuple([o[k] for o in outs] for k in range(len(shapes)))

  f = jax.jit(step, donate_argnums=(0, 1, 2))
  host = [_state(n, 10 + i) for i in range(leaves)]
  first = [[x.copy() for x in leaf] for leaf in host]  # for the bitwise check
  state = [[jnp.asarray(leaf[k]) for leaf in host] for k in range(4)]
  lr, bc1, bc2 = (jnp.asarray(s) for s in scalars)
  del host

  def run_jaxtier():
    out = f(state[0], state[1], state[2], state[3], lr, bc1, bc2)
    jax.block_until_ready(out)
    state[0], state[1], state[2] = out[0], out[1], out[2]

  # One step from `first` for the bitwise check, then the timed steps.
  run_jaxtier()
  got = [np.asarray(state[k][0]) for k in range(3)]
  secs, times = _median(run_jaxtier, reps)
  result = {"threads": threads, "params": n * leaves,
            "jaxtier_secs": secs, "jaxtier_times": times,
            "jaxtier_params_per_sec": n * leaves / secs}
  if _OUT_OF_PLACE.value:
    # The same program reading the state and writing three other buffers (the spares), which
    # then swap roles with the state, as the runner's guessed steps do.
    spare_prog = hu.Program(code=prog.code, consts=prog.consts, num_regs=prog.num_regs,
                            num_operands=prog.num_operands + 3, num_results=len(shapes))
    spare_aliases = [prog.num_operands + k for k in range(3)] + aliases[3:]

    def spare_step(masters, mus, nus, grads, lr, bc1, bc2, s_masters, s_mus, s_nus):
      outs = [hu.host_update(spare_prog, [masters[i], mus[i], nus[i], grads[i], lr, bc1, bc2,
                                          s_masters[i], s_mus[i], s_nus[i]], shapes,
                             spare_aliases, executor=Executor.HOST_CPU) for i in range(leaves)]
      return tuple([o[k] for o in outs] for k in range(len(shapes)))

    g = jax.jit(spare_step, donate_argnums=(7, 8, 9))
    spares = [[jnp.zeros((n,), jnp.float32) for _ in range(leaves)] for _ in range(3)]

    def run_spares():
      out = g(state[0], state[1], state[2], state[3], lr, bc1, bc2, *spares)
      jax.block_until_ready(out)
      spares[:] = state[:3]
      state[0], state[1], state[2] = out[0], out[1], out[2]

    osecs, otimes = _median(run_spares, reps)
    result.update(out_of_place_secs=osecs, out_of_place_times=otimes,
                  out_of_place_params_per_sec=n * leaves / osecs,
                  out_of_place_of_in_place=secs / osecs)
  del state[:]

  if _REFERENCE.value:
    with tempfile.TemporaryDirectory() as tmp:
      ref = _build_reference(tmp)
      if ref is None:
        result["reference"] = "skipped: no g++"
      else:
        def run_reference():
          for p, m, v, g in first:
            ref(p, m, v, g, n, *(float(s[0]) for s in scalars), B1, 1 - B1, B2, 1 - B2, EPS,
                WD, threads)
        run_reference()  # one step: compare with the executor's first step
        result["bits_equal"] = all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
                                   for a, b in zip(got, first[0][:3]))
        rsecs, rtimes = _median(run_reference, reps)
        result.update(reference_secs=rsecs, reference_times=rtimes,
                      reference_params_per_sec=n * leaves / rsecs)
  return result


def main(argv):
  del argv
  if _SMOKE.value:
    flags.FLAGS.leaf_elements, flags.FLAGS.num_leaves, flags.FLAGS.reps = 1 << 17, 2, 2
  if _CHILD.value:
    import jax  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import  (before jaxtier)
    print("RESULT " + json.dumps(_measure(_CHILD.value)), flush=True)
    return
  result = {"leaf_elements": _LEAF.value, "num_leaves": _LEAVES.value, "reps": _REPS.value,
            "param_dtype": _PARAM_DTYPE.value, "runs": {}}
  for t in _THREADS.value:
    env = dict(os.environ, JAXTIER_CPU_THREADS=str(int(t)), JAX_PLATFORMS="cpu")
    args = [sys.executable, os.path.abspath(__file__), f"--child={int(t)}",
            f"--leaf_elements={_LEAF.value}", f"--num_leaves={_LEAVES.value}",
            f"--reps={_REPS.value}", f"--param_dtype={_PARAM_DTYPE.value}",
            f"--reference={_REFERENCE.value}", f"--out_of_place={_OUT_OF_PLACE.value}"]
    _log(f"threads={t}: {' '.join(args[1:])}")
    p = subprocess.run(args, capture_output=True, text=True, env=env)
    if p.returncode != 0:
      result["error"] = {"threads": t, "stderr": p.stderr[-4000:]}
      print(p.stderr[-4000:], file=sys.stderr)
      break
    run = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    result["runs"][f"threads={int(t)}"] = run
    if run.get("bits_equal") is False:
      result["error"] = {"threads": t, "message": "the executor and the C++ loop differ in bits"}
    line = (f"threads={run['threads']:3d}  jaxtier {run['jaxtier_params_per_sec'] / 1e9:6.3f} "
            f"G params/s ({run['jaxtier_secs'] * 1e3:8.2f} ms)")
    if "out_of_place_params_per_sec" in run:
      line += (f"   out of place {run['out_of_place_params_per_sec'] / 1e9:6.3f} G params/s "
               f"({run['out_of_place_of_in_place']:.2f} of in place)")
    if "reference_params_per_sec" in run:
      line += (f"   fused C++ loop {run['reference_params_per_sec'] / 1e9:6.3f} G params/s "
               f"({run['reference_secs'] * 1e3:8.2f} ms)   ratio "
               f"{run['jaxtier_params_per_sec'] / run['reference_params_per_sec']:.2f}   "
               f"bits_equal={run['bits_equal']}")
    print(line, flush=True)
  os.makedirs(_OUT.value, exist_ok=True)
  path = os.path.join(_OUT.value, "host_cpu_microbench.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  _log(f"wrote {path}")
  if "error" in result:
    print(f"error: {result['error']}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
