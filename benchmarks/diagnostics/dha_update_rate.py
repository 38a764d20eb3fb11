"""The DHA update kernel's rate by where its operands live: is it the link, or the kernel?

Runs one AdamW update (`adamw_program` cut to its master, mu and nu results, each written in
place, with a bf16 gradient on the device) as one layer call (`host_update_layer`, executor
`host_dha`, then `join`) over `--elements` elements, its state placed three ways:
- `hbm`: master, mu and nu in device memory (no link traffic: the kernel's own rate);
- `moments_host`: mu and nu in pinned_host, the master on the device (16 B per element over the
  link, the plan of "optimizer state on host");
- `state_host`: master, mu and nu in pinned_host (24 B per element over the link).
Beside them the copy program in place on a pinned_host buffer (8 B per element: the link's
read + write rate as this kernel reaches it) and on the device.

Each case runs once per share of the device's blocks in `--grids` (`host_update_layer`'s
`dha_grid`: the share a layer call's kernel takes, the profile's `dha_layer_grid`). Prints, and
writes `$OUT/dha_update_rate_<card>.json` (or under `--out`): per case and share the median
seconds, elements/s and GB/s over the link.

  python3 benchmarks/diagnostics/dha_update_rate.py --elements=268435456 --reps=5
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from jaxtier._src.primitives import host_update as hu
from jaxtier._src.primitives import op_programs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench_util
import bench_util  # noqa: E402  (benchmarks/bench_util.py)

_ELEMENTS = flags.DEFINE_integer("elements", 1 << 28, "Elements per case (fp32: 4 B each).")
_REPS = flags.DEFINE_integer("reps", 5, "Timed calls per case, after one warm-up.")
_CASES = flags.DEFINE_list("cases", ["hbm", "moments_host", "state_host", "copy_host",
                                     "copy_hbm"], "Cases to run.")
_GRIDS = flags.DEFINE_list("grids", ["1"], "Shares of the device's blocks (dha_grid).")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "."), "Folder for the JSON.")

# Bytes per element that cross the link in each case (reads + writes of pinned_host).
LINK_BYTES = {"hbm": 0, "moments_host": 16, "state_host": 24, "copy_host": 8, "copy_hbm": 0}


def run_case(case: str, n: int, reps: int, grid: float) -> dict:
  dev0 = jax.devices()[0]
  mesh = jax.sharding.Mesh(np.asarray([dev0]), ("d",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  if case.startswith("copy"):
    kind = host if case == "copy_host" else dev
    prog = op_programs._copy_program()  # pylint: disable=protected-access

    def step(x):
      token = hu.host_update_layer(prog, [x], [0], offset=0, count=n,
                                   executor=hu.Executor.HOST_DHA, dha_grid=grid)
      return tuple(hu.join([x], after=[token]))
    f = jax.jit(step, donate_argnums=0, in_shardings=(kind,), out_shardings=(kind,))
    state = {"s": [jax.jit(lambda: jnp.ones((n,), jnp.float32), out_shardings=kind)()]}

    def run():
      state["s"] = list(f(*state["s"]))
      jax.block_until_ready(state["s"])
  else:
    master_kind = dev if case in ("hbm", "moments_host") else host
    moment_kind = dev if case == "hbm" else host
    kinds = (master_kind, moment_kind, moment_kind)
    prog, _ = hu.restrict(op_programs.adamw_program(), [0, 1, 2])

    def step(master, mu, nu, g, lr, bc1, bc2):
      state = [master, mu, nu]
      token = hu.host_update_layer(prog, [*state, g, lr, bc1, bc2], [0, 1, 2], offset=0,
                                   count=n, executor=hu.Executor.HOST_DHA, dha_grid=grid)
      # One join per memory kind: a call's results all take its host results' memory space.
      out = list(state)
      for kind in ("device", "pinned_host"):
        idx = [i for i in range(3) if kinds[i].memory_kind == kind]
        for i, x in zip(idx, hu.join([state[i] for i in idx], after=[token, g, lr, bc1, bc2])):
          out[i] = x
      return tuple(out)
    f = jax.jit(step, donate_argnums=(0, 1, 2), in_shardings=(*kinds, dev, dev, dev, dev),
                out_shardings=kinds)
    init = jax.jit(lambda: (jnp.full((n,), 0.5, jnp.float32), jnp.zeros((n,), jnp.float32),
                            jnp.zeros((n,), jnp.float32)), out_shardings=kinds)
    g = jax.jit(lambda: jnp.full((n,), 0.01, jnp.bfloat16), out_shardings=dev)()
    scalars = [jax.device_put(jnp.full((1,), v, jnp.float32), dev) for v in (1e-3, 0.1, 0.001)]
    state = {"s": list(init())}

    def run():
      state["s"] = list(f(*state["s"], g, *scalars))
      jax.block_until_ready(state["s"])
  secs, _ = bench_util.median_secs(run, reps)
  return {"secs": secs, "elements_per_sec": n / secs,
          "link_gbps": LINK_BYTES[case] * n / secs / 1e9, "link_bytes_per_element": LINK_BYTES[case]}


def main(argv):
  del argv
  dev = jax.devices()[0]
  card = bench_util.card(f"{dev.platform}:{getattr(dev, 'device_kind', '?')}")
  res = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
         "date": bench_util.utc_now(), "commit": bench_util.git_commit(), "card": card,
         "elements": _ELEMENTS.value, "device": str(dev.device_kind), "cases": {}}
  for case in _CASES.value:
    if case not in LINK_BYTES:
      raise app.UsageError(f"--cases: unknown case {case!r}; expected some of {list(LINK_BYTES)}")
    for grid in _GRIDS.value:
      r = run_case(case, _ELEMENTS.value, _REPS.value, float(grid))
      res["cases"][f"{case}@{grid}"] = r
      print(f"{case:<13} grid {grid:<6} {r['secs'] * 1e3:9.2f} ms  "
            f"{r['elements_per_sec'] / 1e9:6.3f} G elem/s  {r['link_gbps']:6.1f} GB/s over the link",
            flush=True)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, f"dha_update_rate_{card}.json"), "w") as fh:
    json.dump(res, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
