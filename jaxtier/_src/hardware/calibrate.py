"""What the machine can do: the rates and capacities the planner's cost model weighs.

`HardwareProfile` holds, for one GPU and its host: the link each way and in duplex, zero-copy
(direct host access) read / write / read+write rates, host DRAM bandwidth, the update rate of
each host-update executor, achieved bf16 matmul throughput and HBM bandwidth, HBM capacity and
the pinned host memory the host can give. The defaults are the H200 machine's measured figures
(benchmarks/results/calibrate/h200_af23580.log and w2/host_update_h200.json there), taken
conservatively; `calibrate()` measures what the machine it runs on has (on a GPU: everything;
without one: the host side only, the GPU figures stay the defaults and it says so).
`save`/`load` keep one profile per device kind and jax version in the user's cache directory.
`split_fraction` turns a profile into the `dha_fraction` of the `split` executor.

Units: bandwidths in GB/s (1e9 bytes per second), rates in parameters per second, matmul
throughput in TFLOP/s (1e12 FLOP per second), capacities in bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

import numpy as np

from jaxtier._src.hardware import host as host_lib
from jaxtier._src.hardware.profile import DEFAULT_PROFILE, HardwareProfile, builtin_profile
from jaxtier._src.primitives import host_update as hu
from jaxtier._src.primitives.op_programs import (
  ADAMW_ALIASES,
  _copy_program,
  _write_program,
  adamw_program,
)
from jaxtier._src.vocab import Executor

log = logging.getLogger("jaxtier")




def measure_cpu_adamw(num_params: int = 1 << 24, *, reps: int = 3) -> float:
  """AdamW rate of the host CPU executor on this machine (the CPU handler), params/s.

  Runs `adamw_program` on the CPU backend over `num_params` fp32 elements (master, moments and
  gradient in host memory, the new param in bf16): no link traffic, so this is the executor's
  compute and DRAM rate alone.

  Args:
    num_params: elements to update per run (default 16M: about 0.3 GB of traffic).
    reps: timed runs after one warm-up; the median is returned.

  Returns:
    Parameters per second.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  cpu = jax.devices("cpu")[0]
  prog = adamw_program()
  n = int(num_params)
  shapes = [jax.ShapeDtypeStruct((n,), jnp.float32)] * 3 + [
      jax.ShapeDtypeStruct((n,), jnp.bfloat16)]

  def step(master, mu, nu, g, lr, bc1, bc2):
    return tuple(hu.host_update(prog, [master, mu, nu, g, lr, bc1, bc2], shapes,
                                list(ADAMW_ALIASES), executor=Executor.HOST_CPU))

  f = jax.jit(step, donate_argnums=(0, 1, 2))
  with jax.default_device(cpu):
    state = [jnp.full((n,), 0.5, jnp.float32), jnp.zeros((n,), jnp.float32),
             jnp.zeros((n,), jnp.float32)]
    g = jnp.full((n,), 0.01, jnp.float32)
    scalars = [jnp.full((1,), v, jnp.float32) for v in (1e-3, 0.1, 0.001)]
    times = []
    for _ in range(reps + 1):
      t0 = time.perf_counter()
      out = f(*state, g, *scalars)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - t0)
      state = list(out[:3])
  return n / float(np.median(times[1:]))


def measure_host_dram_gbps(num_elements: int = 1 << 24, *, threads: "int | None" = None,
                           reps: int = 3) -> float:
  """Host DRAM bandwidth of a STREAM-like triad `a = b + s * c` on `threads` threads, GB/s.

  numpy releases the GIL inside its loops, so each thread streams its own slice of the arrays.
  Counts 3 arrays x 8 bytes (float64) per element (write-allocate traffic not counted), as
  STREAM does. The triad is done in two in-place passes (`a = c * s; a += b`), which moves 5
  arrays; the figure counts the 3 of a fused triad, so it is a lower bound on the DRAM rate.

  Args:
    num_elements: elements per array (default 16Mi: 3 x 128 MiB).
    threads: threads (default: os.cpu_count()).
    reps: timed runs after one warm-up; the best is returned (STREAM reports the best).

  Returns:
    GB/s.
  """
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  threads = max(1, threads or os.cpu_count() or 1)
  n = int(num_elements)
  a, b, c = np.empty(n), np.ones(n), np.full(n, 2.0)
  bounds = np.linspace(0, n, threads + 1).astype(np.int64)

  def part(k):
    lo, hi = bounds[k], bounds[k + 1]
    np.multiply(c[lo:hi], 3.0, out=a[lo:hi])
    np.add(a[lo:hi], b[lo:hi], out=a[lo:hi])

  times = []
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for _ in range(reps + 1):
      t0 = time.perf_counter()
      list(pool.map(part, range(threads)))
      times.append(time.perf_counter() - t0)
  return 24 * n / min(times[1:]) / 1e9


def _median_secs(fn, reps: int) -> float:
  """Median seconds of `fn()` (which blocks) over `reps` runs after one warm-up."""
  fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def measure_gpu(device: Any, *, nbytes: int = 1 << 30, reps: int = 5,
                update_params: int = 1 << 26) -> dict[str, Any]:
  """The GPU-side figures of a `HardwareProfile`, measured on `device`.

  - link each way: `jax.device_put` of `nbytes` between pinned_host and device; duplex: one
    jitted step moving `nbytes` each way at once (XLA schedules the two copies concurrently),
    both directions counted;
  - zero-copy: the host_update custom call (DHA kernel) with a copy program: read (pinned_host
    operand -> device result), write (device operand -> aliased, donated pinned_host result),
    read + write (a pinned_host leaf copied onto itself in place; both directions counted);
  - the DHA gather's and the DHA matmul's rates (`measure_dha_compute`);
  - AdamW update rate of each executor (`adamw_program`, `update_params` fp32 params: master,
    mu, nu in pinned_host, bf16 gradient on the device, new bf16 param to the device);
  - bf16 matmul 8192^3 (TFLOP/s); HBM bandwidth (x + 1 over `nbytes`, read + write counted);
  - `memory_stats()['bytes_limit']` of the device.

  Args:
    device: a GPU `jax.Device`.
    nbytes: bytes per transfer / zero-copy run (default 1 GiB).
    reps: timed runs after a warm-up; medians are used.
    update_params: parameters per AdamW executor run (default 64Mi: 768 MiB of fp32 state).

  Returns:
    {field name: value} for the fields measured.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.asarray([device]), ("d",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  n = nbytes // 4
  out: dict[str, Any] = {}
  fill = jax.jit(lambda: jnp.ones((n,), jnp.float32), out_shardings=dev)
  x_dev = fill()
  x_host = jax.device_put(x_dev, host)
  jax.block_until_ready((x_dev, x_host))

  t = _median_secs(lambda: jax.device_put(x_host, dev).block_until_ready(), reps)
  out["link_h2d_gbps"] = nbytes / t / 1e9
  t = _median_secs(lambda: jax.device_put(x_dev, host).block_until_ready(), reps)
  out["link_d2h_gbps"] = nbytes / t / 1e9
  to_dev, to_host = jax.memory.Space.Device, jax.memory.Space.Host
  duplex = jax.jit(lambda a, b: (jax.device_put(a, to_dev), jax.device_put(b, to_host)),
                   in_shardings=(host, dev), out_shardings=(dev, host))
  t = _median_secs(lambda: jax.block_until_ready(duplex(x_host, x_dev)), reps)
  out["link_duplex_gbps"] = 2 * nbytes / t / 1e9

  copy, write = _copy_program(), _write_program()
  shape = [jax.ShapeDtypeStruct((n,), jnp.float32)]
  read_fn = jax.jit(lambda a: hu.host_update(copy, [a], shape, [-1])[0],
                    in_shardings=host, out_shardings=dev)
  t = _median_secs(lambda: read_fn(x_host).block_until_ready(), reps)
  out["dha_read_gbps"] = nbytes / t / 1e9
  write_fn = jax.jit(lambda a, b: hu.host_update(write, [a, b], shape, [0])[0],
                     in_shardings=(host, dev), out_shardings=host, donate_argnums=0)
  state = {"h": jax.device_put(x_dev, host)}

  def run_write():
    state["h"] = write_fn(state["h"], x_dev)
    state["h"].block_until_ready()
  out["dha_write_gbps"] = nbytes / _median_secs(run_write, reps) / 1e9
  rw_fn = jax.jit(lambda a: hu.host_update(copy, [a], shape, [0])[0],
                  in_shardings=host, out_shardings=host, donate_argnums=0)

  def run_rw():
    state["h"] = rw_fn(state["h"])
    state["h"].block_until_ready()
  out["dha_rw_gbps"] = 2 * nbytes / _median_secs(run_rw, reps) / 1e9
  del state, x_host

  hbm_fn = jax.jit(lambda a: a + 1.0)
  t = _median_secs(lambda: hbm_fn(x_dev).block_until_ready(), reps)
  out["hbm_gbps"] = 2 * nbytes / t / 1e9
  del x_dev

  a = jax.jit(lambda: jnp.ones((8192, 8192), jnp.bfloat16), out_shardings=dev)()
  mm = jax.jit(lambda a: a @ a)
  t = _median_secs(lambda: mm(a).block_until_ready(), max(reps, 10))
  out["matmul_tflops"] = 2 * 8192**3 / t / 1e12
  del a

  out.update(measure_dha_compute(device, reps=reps))
  rates = measure_gpu_adamw(device, update_params, reps=reps)
  out["dha_adamw_params_per_sec"] = rates[Executor.HOST_DHA]
  out["cpu_adamw_params_per_sec"] = rates[Executor.HOST_CPU]
  stats = device.memory_stats() or {}
  if stats.get("bytes_limit"):
    # Stored as at XLA's default fraction, whatever this process runs under (`hbm_bytes`).
    out["hbm_bytes"] = int(stats["bytes_limit"] * host_lib.XLA_MEM_FRACTION_DEFAULT
                           / host_lib.xla_mem_fraction())
  return out


def measure_dha_compute(device: Any, *, num_rows: int = 65536, width: int = 2048,
                        num_ids: int = 8192, k: int = 8192, n: int = 8192, m: int = 128,
                        reps: int = 5) -> dict[str, float]:
  """The DHA gather's and matmul's rates on `device`, GB/s of host bytes read.

  - gather: `num_ids` random rows of a pinned_host fp32 table [num_rows, width] (default 8,192
    rows of 8 KiB from a 512 MiB table, an embedding lookup's shape), bytes of rows per second;
  - matmul: x [m, k] @ w [k, n], bf16, w in pinned_host (default 128 MiB, the crossover run's
    layer) read in place by the DHA kernel at m = 128 rows (below 512 the kernel reads w once),
    bytes of w per second.
  Uniform random ids: a real text's ids repeat (W6's Zipf ids gathered at 47 GB/s where
  uniform ones reach 37 on the H200), so this is the rate's floor.
  Where the matmul's rate is below the copy engines', streaming a matmul weight beats reading
  it in place; the gather of a batch's rows beats copying the table by table bytes over row
  bytes times the two rates' ratio (`benchmarks/diagnostics/dha_crossover.py` sweeps both).

  Returns:
    {'dha_gather_gbps': ..., 'dha_matmul_gbps': ...}.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import SingleDeviceSharding  # pylint: disable=g-import-not-at-top

  from jaxtier._src.primitives import dha  # pylint: disable=g-import-not-at-top
  host = SingleDeviceSharding(device, memory_kind="pinned_host")
  on_dev = SingleDeviceSharding(device, memory_kind="device")
  table = jax.device_put(jnp.ones((num_rows, width), jnp.float32), host)
  ids = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(0, num_rows, num_ids),
                                   jnp.int32), on_dev)
  gather = jax.jit(dha.gather)
  t = _median_secs(lambda: jax.block_until_ready(gather(table, ids)), max(reps, 10))
  out = {"dha_gather_gbps": num_ids * width * 4 / t / 1e9}
  del table
  w = jax.device_put(jnp.ones((k, n), jnp.bfloat16), host)
  x = jax.device_put(jnp.ones((m, k), jnp.bfloat16), on_dev)
  mm = jax.jit(dha.matmul)
  t = _median_secs(lambda: jax.block_until_ready(mm(x, w)), max(reps, 10))
  out["dha_matmul_gbps"] = k * n * 2 / t / 1e9
  return out


def measure_cpu_compute(*, n: int = 1024, nbytes: int = 1 << 27,
                        reps: int = 5) -> dict[str, float]:
  """The compute figures of a machine whose compute device is its CPU (the CPU backend).

  `matmul_tflops`: an f32 n x n x n matmul (2 n^3 FLOP; the CPU backend computes what the
  example decoder computes in f32), TFLOP/s (`measure_cpu_matmul`). `hbm_gbps`: `a + 1` over
  `nbytes` of f32, read and write counted, GB/s: the memory the CPU backend's "device" arrays
  live in (`measure_cpu_memory`). With them a plan for the CPU backend predicts this machine's
  step times, not an H200's.
  """
  return {"matmul_tflops": measure_cpu_matmul(n, reps=reps),
          "hbm_gbps": measure_cpu_memory(nbytes, reps=reps)}


def measure_cpu_matmul(n: int = 1024, *, reps: int = 5) -> float:
  """TFLOP/s of an f32 [n, n] @ [n, n] matmul (2 n^3 FLOP) on the CPU backend: median of
  `reps` runs after one warm-up (which compiles)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  cpu = jax.devices("cpu")[0]
  a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
  mm = jax.jit(lambda a: a @ a)
  return 2 * n**3 / _median_secs(lambda: mm(a).block_until_ready(), reps) / 1e12


def measure_cpu_memory(nbytes: int = 1 << 27, *, reps: int = 5) -> float:
  """GB/s of `a + 1` over `nbytes` of f32 on the CPU backend, the bytes read and written
  counted: median of `reps` runs after one warm-up. Each run writes a new output, as a step's
  temporaries are, so the rate includes the first touch of its pages."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  cpu = jax.devices("cpu")[0]
  x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), cpu)
  add = jax.jit(lambda a: a + 1.0)
  return 2 * (nbytes // 4 * 4) / _median_secs(lambda: add(x).block_until_ready(), reps) / 1e9


def measure_gpu_adamw(device: Any, num_params: int, *, reps: int = 3) -> dict[str, float]:
  """AdamW rate of the host_dha and host_cpu executors on `device`, params/s each.

  fp32 master, mu and nu in pinned_host (donated, updated in place), a bf16 gradient on the
  device, the new bf16 param written to the device: the traffic of a real step.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.asarray([device]), ("d",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  n = int(num_params)
  prog = adamw_program()
  shapes = [jax.ShapeDtypeStruct((n,), jnp.float32)] * 3 + [
      jax.ShapeDtypeStruct((n,), jnp.bfloat16)]
  init = jax.jit(lambda: (jnp.full((n,), 0.5, jnp.float32), jnp.zeros((n,), jnp.float32),
                          jnp.zeros((n,), jnp.float32)), out_shardings=(host, host, host))
  g = jax.jit(lambda: jnp.full((n,), 0.01, jnp.bfloat16), out_shardings=dev)()
  scalars = [jax.device_put(jnp.full((1,), v, jnp.float32), dev) for v in (1e-3, 0.1, 0.001)]
  rates = {}
  for executor in (Executor.HOST_DHA, Executor.HOST_CPU):
    def step(master, mu, nu, g, lr, bc1, bc2, executor=executor):
      return tuple(hu.host_update(prog, [master, mu, nu, g, lr, bc1, bc2], shapes,
                                  list(ADAMW_ALIASES), executor=executor))
    f = jax.jit(step, donate_argnums=(0, 1, 2),
                in_shardings=(host, host, host, dev, dev, dev, dev),
                out_shardings=(host, host, host, dev))
    state = {"s": list(init())}

    def run():
      out = f(*state["s"], g, *scalars)
      jax.block_until_ready(out)
      state["s"] = list(out[:3])
    rates[executor] = n / _median_secs(run, reps)
    del state
  return rates


def _versions() -> dict[str, str]:
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  out = {"jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", "?")}
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    out["jaxtier"] = metadata.version("jaxtier")
  except Exception:  # pylint: disable=broad-except
    pass
  return out


def calibrate(*, measure_cpu: bool = True, num_params: int = 1 << 24,
              measure_device: bool = True, warn: bool = True) -> HardwareProfile:
  """Measures this machine and returns its `HardwareProfile` (store it with `save`).

  On a GPU: the link each way and in duplex, zero-copy read / write / read+write, the AdamW rate
  of both executors, bf16 matmul, HBM bandwidth and capacity (`measure_gpu`, about 10 s). On
  every machine: host DRAM bandwidth, the CPU executor's AdamW rate on the CPU backend, the
  pinnable host memory and the thread count. Without a GPU the link, zero-copy and GPU executor
  figures stay the H200 defaults, with a warning, and the matmul and memory rates are this CPU's
  (`measure_cpu_compute`: the CPU backend computes on it).

  Args:
    measure_cpu: measure the host side (DRAM bandwidth, CPU executor; else keep the defaults).
    num_params: elements per CPU executor run.
    measure_device: measure the compute device (the GPU side on a GPU, `measure_cpu_compute`
      on the CPU backend; else keep the defaults).
    warn: log the warning that, without a GPU, the GPU figures stay the defaults (the CLI
      prints its own).

  Returns:
    The profile; `source` says what was measured.
  """
  import jax  # pylint: disable=g-import-not-at-top


  backend = jax.default_backend()
  fields: dict[str, Any] = {}
  measured = []
  if backend == "gpu" and measure_device:
    fields.update(measure_gpu(jax.devices("gpu")[0]))
    measured.append("gpu")
  elif backend != "gpu":
    if warn:
      log.warning("jaxtier.calibrate: no GPU here: the link, zero-copy and GPU executor figures "
                  "stay the H200 defaults (docs/design.md); the host side, and this CPU's "
                  "matmul and memory rates as the compute device's, are measured")
    if measure_device:
      fields.update(measure_cpu_compute())
      measured.append("cpu compute")
  if measure_cpu:
    fields["host_dram_gbps"] = measure_host_dram_gbps()
    if backend != "gpu":
      fields["cpu_adamw_params_per_sec"] = measure_cpu_adamw(num_params)
    fields["cpu_threads"] = os.cpu_count() or DEFAULT_PROFILE.cpu_threads
    pinnable = host_lib.pinnable_bytes(backend)
    if pinnable:
      fields["pinnable_bytes"] = int(pinnable)
    measured.append("host")
  if not measured:
    return DEFAULT_PROFILE
  kind = jax.devices()[0].device_kind
  # What is not measured (on a GPU: the DHA update kernel's rates, the gather, NVLink) stays
  # the card's built-in figure (`profile.builtin_profile`; the H200's for an unknown card).
  base = builtin_profile(kind) if backend == "gpu" else DEFAULT_PROFILE
  return dataclasses.replace(
      base, **fields, device_kind=kind, versions=_versions(),
      source=f"calibrated on {kind} ({' and '.join(measured)} measured"
      f"{'' if 'gpu' in measured else '; link and GPU executor figures are the H200 defaults'}, "
      f"{time.strftime('%Y-%m-%d')})")




# ---- the quick calibration `machine.load` runs where this machine has no stored profile ----


# Wall seconds a quick calibration may take (`quick_calibrate`): its sizes are chosen to stay
# within it. On 2 CPU cores the largest sizes take 2.3-2.6 s of CPU time in all (3.7-6.4 s of
# wall time with the cores shared by other work).
QUICK_BUDGET_SECS = 10.0
# Timed runs of each quick measurement, after one warm-up.
QUICK_REPS = 3


@dataclasses.dataclass(frozen=True)
class Sweep:
  """One figure of a quick calibration, measured at the largest of `sizes` that its time allows.

  Attributes:
    field: the `HardwareProfile` field measured.
    sizes: the sizes it may run at, smallest first (the unit is `measure`'s: elements, bytes,
      a matrix's side).
    measure: size -> the figure, in the field's unit (runs 1 + QUICK_REPS times).
    run_secs: (size, figure) -> seconds of one run at that size (how the figure was found).
    work: size -> work of one run at that size, in any unit (its ratio between two sizes is
      the ratio of their run times).
  """

  field: str
  sizes: tuple[int, ...]
  measure: Callable[[int], float]
  run_secs: Callable[[int, float], float]
  work: Callable[[int], float]


def cpu_sweeps() -> tuple[Sweep, ...]:
  """What a plan for the CPU backend reads of a profile, as quick measurements: the step's
  compute on this CPU (`matmul_tflops`, `hbm_gbps`: `step_costs.compute_secs`), the CPU
  executor's AdamW rate (`cpu_adamw_params_per_sec`: `cost_model.update_cost`) and the host's
  DRAM bandwidth (`host_dram_gbps`: `cost_model.xla_copy_cost`). The largest sizes are those
  `calibrate` measures at, or half of them."""
  reps = QUICK_REPS
  return (
      Sweep("matmul_tflops", (128, 256, 512, 1024), lambda n: measure_cpu_matmul(n, reps=reps),
            lambda n, tflops: 2 * n**3 / (tflops * 1e12), lambda n: float(n)**3),
      Sweep("hbm_gbps", (1 << 20, 1 << 22, 1 << 24, 1 << 26),
            lambda nbytes: measure_cpu_memory(nbytes, reps=reps),
            lambda nbytes, gbps: 2 * nbytes / (gbps * 1e9), float),
      Sweep("cpu_adamw_params_per_sec", (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 23),
            lambda n: measure_cpu_adamw(n, reps=reps), lambda n, rate: n / rate, float),
      Sweep("host_dram_gbps", (1 << 18, 1 << 20, 1 << 22, 1 << 23),
            lambda n: measure_host_dram_gbps(n, reps=reps),
            lambda n, gbps: 24 * n / (gbps * 1e9), float),
  )


def sized_measure(sweep: Sweep, deadline: float, *,
                  clock: Callable[[], float] = time.perf_counter) -> tuple[int, float]:
  """Measures `sweep` at its sizes in turn, smallest first, stopping where the next would end
  past `deadline` (a `clock()` time, seconds).

  The next size's time is predicted from the last: its timed runs scaled by the ratio of the
  two sizes' work, plus what the last spent beyond its runs (compiling, allocating). The
  smallest size is always measured.

  Returns:
    (the largest size measured, the figure measured at it).
  """
  runs = 1 + QUICK_REPS
  size, value = sweep.sizes[0], 0.0
  for i, size in enumerate(sweep.sizes):
    start = clock()
    value = float(sweep.measure(size))
    spent = clock() - start
    if i + 1 == len(sweep.sizes):
      break
    timed = runs * sweep.run_secs(size, value)
    nxt = sweep.sizes[i + 1]
    predicted = max(0.0, spent - timed) + timed * sweep.work(nxt) / sweep.work(size)
    if clock() + predicted > deadline:
      break
  return size, value


@dataclasses.dataclass(frozen=True)
class QuickCalibration:
  """What `quick_calibrate` measured.

  Attributes:
    profile: the profile (`source` begins "calibrated", and says it was a quick one).
    sizes: {field: the size its figure was measured at} (the unit is its `Sweep`'s).
    secs: wall seconds it took.
  """

  profile: HardwareProfile
  sizes: dict[str, int]
  secs: float


def quick_calibrate(budget_secs: float = QUICK_BUDGET_SECS, *,
                    clock: Callable[[], float] = time.perf_counter) -> QuickCalibration:
  """Measures what a plan on this machine reads of its profile, within `budget_secs`.

  On the CPU backend: `cpu_sweeps` (this CPU's matmul and memory rates as the compute device's,
  the CPU executor's AdamW rate, the host's DRAM bandwidth), each at the largest of its sizes
  that its share of the time left allows (`sized_measure`: each gets an equal share of what
  the ones before it left), plus the thread count and the pinnable memory. The link,
  zero-copy and GPU executor figures stay the H200 defaults (no GPU to measure). On a GPU
  (one whose card has no built-in profile): `measure_gpu` at a quarter of `calibrate`'s
  transfer size, a quarter of its AdamW size and fewer runs (sizes not chosen by the budget),
  then the host's DRAM bandwidth in what is left of it.

  Args:
    budget_secs: wall seconds it may take, > 0 (default QUICK_BUDGET_SECS). On the CPU backend
      the smallest size of each figure is measured whatever the budget (a fraction of a second
      in all).
    clock: the clock the budget is counted on.

  Returns:
    A `QuickCalibration`: the profile, the sizes chosen, the seconds taken.

  Raises:
    ValueError: `budget_secs` is not a positive number.
    Whatever a measurement raises (`machine.load` falls back to the defaults then).
  """
  import jax  # pylint: disable=g-import-not-at-top

  if isinstance(budget_secs, bool) or not isinstance(budget_secs, (int, float)) or not (
      budget_secs > 0):
    raise ValueError(f"quick_calibrate: expected budget_secs > 0 (seconds), got {budget_secs!r}")
  start = clock()
  deadline = start + float(budget_secs)
  backend = jax.default_backend()
  kind = jax.devices()[0].device_kind
  fields: dict[str, Any] = {}
  sizes: dict[str, int] = {}
  if backend == "gpu":
    nbytes = 1 << 28
    fields.update(measure_gpu(jax.devices("gpu")[0], nbytes=nbytes, reps=QUICK_REPS,
                              update_params=1 << 24))
    sizes.update(transfer_bytes=nbytes)
    sweeps = tuple(s for s in cpu_sweeps() if s.field == "host_dram_gbps")
    measured = "gpu and host"
  else:
    sweeps = cpu_sweeps()
    measured = "cpu compute and host"
  for i, sweep in enumerate(sweeps):
    share = (deadline - clock()) / (len(sweeps) - i)
    sizes[sweep.field], fields[sweep.field] = sized_measure(sweep, clock() + share, clock=clock)
  fields["cpu_threads"] = os.cpu_count() or DEFAULT_PROFILE.cpu_threads
  pinnable = host_lib.pinnable_bytes(backend)
  if pinnable:
    fields["pinnable_bytes"] = int(pinnable)
  base = builtin_profile(kind) if backend == "gpu" else DEFAULT_PROFILE
  defaults = "" if backend == "gpu" else "; link and GPU executor figures are the H200 defaults"
  prof = dataclasses.replace(
      base, **fields, device_kind=kind, versions=_versions(),
      source=f"calibrated on {kind} (quick, at first use: {measured} measured{defaults}, "
      f"{time.strftime('%Y-%m-%d')})")
  return QuickCalibration(prof, sizes, clock() - start)
