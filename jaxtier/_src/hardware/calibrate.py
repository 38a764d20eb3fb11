"""What the machine can do: the rates and capacities the planner's cost model weighs.

`HardwareProfile` holds, for one GPU and its host: the link each way and in duplex, zero-copy
(direct host access) read / write / read+write rates, host DRAM bandwidth, the update rate of
each host-update executor, achieved bf16 matmul throughput and HBM bandwidth, HBM capacity and
the pinned host memory the host can give. The defaults are the H200 machine's measured figures
(../shared/MEASURED.md, 2026-11-29, and benchmarks/results/host_update.json), taken
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
import math
import os
import time
from typing import Any

import numpy as np

from jaxtier._src.primitives import host_update as hu

log = logging.getLogger("jaxtier")

# Bytes of memory traffic per parameter of an AdamW update with an fp32 master, fp32 moments in
# pinned_host and bf16 gradients / params on the device:
#   DHA kernel, over the link: master, m, v read (12) and written (12).
DHA_LINK_BYTES_PER_PARAM = 24
#   CPU executor, host DRAM: master, m, v read and written (24), the staged gradient read and the
#   staged param written (2 + 2), and the copy engines' writes / reads of those stagings (2 + 2).
CPU_DRAM_BYTES_PER_PARAM = 32

H200_HBM_BYTES = 143_771 * 2**20  # nvidia-smi total, MEASURED.md
# JAX's GPU allocator takes this fraction of HBM unless XLA_PYTHON_CLIENT_MEM_FRACTION says
# otherwise (its documented default).
JAX_MEM_FRACTION = 0.75

# The format of a stored profile, kept in its JSON as "format_version". A stored profile of an
# older format (or none: before versioning) is ignored by `load`: its figures may come from an
# older calibration (e.g. version 1 stored no CPU compute figures, so a CPU plan used an H200's
# 700 TFLOP/s). Bump it whenever what `calibrate` measures, or how, changes.
PROFILE_FORMAT_VERSION = 2

_STR_FIELDS = ("device_kind", "source")
_DICT_FIELDS = ("versions",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
  """Rates and capacities of one GPU and its host, as jaxtier's mechanisms see them.

  Attributes:
    link_h2d_gbps: copy-engine bandwidth pinned host -> device, one direction alone, GB/s.
    link_d2h_gbps: copy-engine bandwidth device -> pinned host, one direction alone, GB/s.
    link_duplex_gbps: both directions at once (two streams), the two together, GB/s.
    dha_read_gbps: a kernel reading pinned host memory in place (zero-copy), GB/s.
    dha_write_gbps: a kernel writing pinned host memory in place, GB/s.
    dha_rw_gbps: a kernel reading and writing pinned host memory at once, both directions
      together, GB/s (what the fused host update's DHA kernel achieves).
    host_dram_gbps: host memory bandwidth (STREAM triad, all CPU threads), GB/s.
    cpu_adamw_params_per_sec: AdamW update rate of the host CPU executor (fp32 master and
      moments on the host, bf16 gradient and param staged), params/s.
    dha_adamw_params_per_sec: AdamW update rate of the DHA kernel, params/s (fp32 master
      and moments in pinned_host: 24 bytes per param over the link).
    dha_update_gbps: the DHA update kernel's marginal rate per byte of host traffic, GB/s:
      its time per call is elements x t + bytes / this rate (`dha_update_secs`).
    matmul_tflops: achieved bf16 matmul throughput (8192^3 GEMM), TFLOP/s.
    hbm_gbps: achieved HBM bandwidth (device-to-device copy, read + write counted), GB/s.
    hbm_bytes: device memory JAX's allocator may use (`memory_stats()['bytes_limit']`), bytes.
    pinnable_bytes: pinned host memory the host can give (MemAvailable, capped by XLA's pinned
      pool `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`), bytes.
    inter_gpu_gbps: GPU-to-GPU bandwidth (NVLink) one direction, GB/s (not measured with one
      GPU; for multi-path transfers).
    cpu_threads: host CPU threads the CPU executor may use.
    device_kind: `jax.Device.device_kind` the figures were taken on.
    versions: software versions at calibration ({'jax': ..., 'jaxlib': ..., 'jaxtier': ...}).
    source: 'defaults' or 'calibrated' (and where), for the plan's notes.
  """

  link_h2d_gbps: float = 53.0
  link_d2h_gbps: float = 54.0
  # 44.3 GB/s each way measured with both directions busy (MEASURED.md).
  link_duplex_gbps: float = 88.0
  # SM loads from pinned host: 50.4 - 50.8 GB/s (MEASURED.md).
  dha_read_gbps: float = 50.0
  # Not measured alone; taken as the read rate, rounded down.
  dha_write_gbps: float = 48.0
  # MEASURED.md gives ~65 GB/s for a zero-copy read + write probe, but the AdamW DHA kernel
  # reached 2.30e9 params/s x 24 B = 55 GB/s (W2) and the 1b e2e run 52 GB/s: the kernel's rate.
  dha_rw_gbps: float = 52.0
  host_dram_gbps: float = 80.5
  # W2 (host_update.json): host_cpu 2.03e9 params/s, transfers included.
  cpu_adamw_params_per_sec: float = 2.0e9
  # W2 (host_update.json, third session, the current kernel): host_dha 2.739e9 params/s.
  dha_adamw_params_per_sec: float = 2.739e9
  # The DHA update kernel's time per call is not bytes over one rate: on the H200 it moved
  # 16 B/param (moments only) at 53 GB/s, 24 B/param (W2) at 66 GB/s and 28 B/param (a
  # streamed param, its gradient and moments) at 72 GB/s. Per param it costs a fixed
  # t = 0.167 ns plus bytes at 121 GB/s: that fits W2 and the 16 B runs (first and fourth
  # sessions) and predicts the 28 B run within 3% (benchmarks/results/planner.json).
  dha_update_gbps: float = 121.0
  # ~790 TFLOP/s on a bf16 8192^3 GEMM; training steps reach less (smaller and skinnier GEMMs).
  matmul_tflops: float = 700.0
  # ~4,050 GB/s device-to-device copy (read + write counted).
  hbm_gbps: float = 4000.0
  hbm_bytes: int = int(H200_HBM_BYTES * JAX_MEM_FRACTION)
  # XLA's pinned pool cap (64 GiB by default) is below the H200 host's 125 GiB of RAM.
  pinnable_bytes: int = 64 * 2**30
  inter_gpu_gbps: float = 300.0
  cpu_threads: int = 16
  device_kind: str = "NVIDIA H200"
  versions: dict = dataclasses.field(default_factory=lambda: {"jax": "0.11.2"})
  source: str = "defaults (an H200 machine as measured for jaxtier; see docs/design.md)"

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in _STR_FIELDS:
        if not isinstance(value, str):
          raise ValueError(f"HardwareProfile: expected {field.name} to be a string, got "
                           f"{value!r}")
        continue
      if field.name in _DICT_FIELDS:
        if not isinstance(value, dict):
          raise ValueError(f"HardwareProfile: expected {field.name} to be a dict, got {value!r}")
        continue
      if (isinstance(value, bool) or not isinstance(value, (int, float))
          or not math.isfinite(value) or value <= 0):
        raise ValueError(f"HardwareProfile: expected {field.name} > 0 (finite), got {value!r}")

  @property
  def is_default(self) -> bool:
    return self.source.startswith("defaults")

  def rates(self) -> dict[str, float]:
    """The numeric fields, {name: value} (for printing)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name not in _STR_FIELDS + _DICT_FIELDS}

  def dha_update_secs(self, elements: float, host_bytes: float) -> float:
    """Seconds of the DHA update kernel for a call over `elements` elements moving
    `host_bytes` (read + written) of pinned host memory: elements x t + host_bytes / rate.

    t, the per-element time, follows from the measured AdamW rate (24 bytes per param):
    t = 1 / dha_adamw_params_per_sec - 24 / (dha_update_gbps * 1e9) (at least 0). The link's
    caps apply separately (`cost_model.update_cost`).
    """
    per_elem = max(0.0, 1.0 / self.dha_adamw_params_per_sec - 24.0 / (self.dha_update_gbps * 1e9))
    return float(elements) * per_elem + float(host_bytes) / (self.dha_update_gbps * 1e9)

  def cpu_update_gbps(self) -> float:
    """The CPU executor's effective host-DRAM streaming rate, GB/s.

    = cpu_adamw_params_per_sec * CPU_DRAM_BYTES_PER_PARAM / 1e9: the AdamW rate turned into the
    bytes it moves, so that an update of any op program is costed by the bytes it moves.
    """
    return self.cpu_adamw_params_per_sec * CPU_DRAM_BYTES_PER_PARAM / 1e9


DEFAULT_PROFILE = HardwareProfile()


def format_rate(value: float) -> str:
  """`value` to 3 significant digits, for printing rates (GB/s, TFLOP/s, params/s).

  Without an exponent from 1e-3 to below 1e6 (0.000412, 0.438, 80.5, 700, 4000), with one
  elsewhere (2.3e+09).
  """
  if not value or not math.isfinite(value):
    return f"{value:g}"
  magnitude = math.floor(math.log10(abs(value)))
  if -3 <= magnitude < 6:
    digits = max(0, 2 - magnitude)
    return f"{round(value, digits):.{digits}f}"
  return f"{value:.3g}"


def split_fraction(profile: HardwareProfile = DEFAULT_PROFILE) -> float:
  """The `dha_fraction` of the `split` executor: the DHA kernel's share of the elements.

  Both executors finish together when each gets elements in proportion to its rate:
  dha_rate / (dha_rate + cpu_rate).

  Args:
    profile: the machine's rates.

  Returns:
    A fraction in (0, 1).
  """
  dha = profile.dha_adamw_params_per_sec
  cpu = profile.cpu_adamw_params_per_sec
  return dha / (dha + cpu)


def adamw_program(*, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 1e-4) -> hu.Program:
  """The op program of one optax.adamw step on an fp32 master copy (calibration, tests, benchmarks).

  The same fp32 operations in the same order as `optax.adamw` (eps_root = 0) followed by
  `optax.apply_updates`.

  Operands: 0 master [N] f32, 1 mu [N] f32, 2 nu [N] f32, 3 grad [N] (any supported dtype),
  4 learning rate [1] f32, 5 `1 - b1**t` [1] f32, 6 `1 - b2**t` [1] f32.
  Results: 0 new master (alias operand 0), 1 new mu (alias 1), 2 new nu (alias 2), 3 the new
  param [N] rounded to its own dtype (e.g. bf16, for the device).
  Aliases: [0, 1, 2, -1].

  Args:
    b1, b2, eps, weight_decay: as in `optax.adamw`.

  Returns:
    The program (7 operands, 4 results).
  """
  op = hu.Op
  consts = np.asarray([b1, 1 - b1, b2, 1 - b2, eps, weight_decay], np.float32)
  code = [
      (op.LOAD, 0, 0, 0, 0),   # r0 = master
      (op.LOAD, 1, 1, 0, 0),   # r1 = mu
      (op.LOAD, 2, 2, 0, 0),   # r2 = nu
      (op.LOAD, 3, 3, 0, 0),   # r3 = g
      (op.CONST, 4, 0, 0, 0),  # b1
      (op.CONST, 5, 1, 0, 0),  # 1 - b1
      (op.MUL, 6, 5, 3, 0),    # (1 - b1) * g
      (op.MUL, 7, 4, 1, 0),    # b1 * mu
      (op.ADD, 1, 6, 7, 0),    # mu' = (1 - b1) * g + b1 * mu
      (op.MUL, 8, 3, 3, 0),    # g ** 2
      (op.CONST, 4, 2, 0, 0),  # b2
      (op.CONST, 5, 3, 0, 0),  # 1 - b2
      (op.MUL, 6, 5, 8, 0),    # (1 - b2) * g**2
      (op.MUL, 7, 4, 2, 0),    # b2 * nu
      (op.ADD, 2, 6, 7, 0),    # nu' = (1 - b2) * g**2 + b2 * nu
      (op.LOAD, 9, 5, 0, 0),   # 1 - b1**t
      (op.DIV, 10, 1, 9, 0),   # mu_hat
      (op.LOAD, 9, 6, 0, 0),   # 1 - b2**t
      (op.DIV, 11, 2, 9, 0),   # nu_hat
      (op.SQRT, 12, 11, 0, 0),
      (op.CONST, 4, 4, 0, 0),  # eps
      (op.ADD, 12, 12, 4, 0),  # sqrt(nu_hat) + eps
      (op.DIV, 13, 10, 12, 0),  # u = mu_hat / (sqrt(nu_hat) + eps)
      (op.CONST, 4, 5, 0, 0),  # weight decay
      (op.MUL, 14, 4, 0, 0),   # wd * master
      (op.ADD, 13, 13, 14, 0),  # u + wd * master
      (op.LOAD, 9, 4, 0, 0),   # lr
      (op.NEG, 9, 9, 0, 0),    # -lr
      (op.MUL, 13, 13, 9, 0),  # u * -lr
      (op.ADD, 0, 0, 13, 0),   # master' = master + u
      (op.STORE, 0, 0, 0, 0),
      (op.STORE, 1, 1, 0, 0),
      (op.STORE, 2, 2, 0, 0),
      (op.STORE, 3, 0, 0, 0),
  ]
  return hu.Program(code=np.asarray(code, np.int32), consts=consts, num_regs=15,
                    num_operands=7, num_results=4)


ADAMW_ALIASES = (0, 1, 2, -1)


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
                                list(ADAMW_ALIASES), executor=hu.HOST_CPU))

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


def _copy_program() -> hu.Program:
  """result[0][i] = operand[0][i]: one read and one write per element."""
  code = np.asarray([[hu.Op.LOAD, 0, 0, 0, 0], [hu.Op.STORE, 0, 0, 0, 0]], np.int32)
  return hu.Program(code=code, consts=np.zeros(1, np.float32), num_regs=1, num_operands=1,
                    num_results=1)


def _write_program() -> hu.Program:
  """result[0][i] = operand[1][i] (result 0 aliases operand 0, which is not read)."""
  code = np.asarray([[hu.Op.LOAD, 0, 1, 0, 0], [hu.Op.STORE, 0, 0, 0, 0]], np.int32)
  return hu.Program(code=code, consts=np.zeros(1, np.float32), num_regs=1, num_operands=2,
                    num_results=1)


def measure_gpu(device: Any, *, nbytes: int = 1 << 30, reps: int = 5,
                update_params: int = 1 << 26) -> dict[str, Any]:
  """The GPU-side figures of a `HardwareProfile`, measured on `device`.

  - link each way: `jax.device_put` of `nbytes` between pinned_host and device; duplex: one
    jitted step moving `nbytes` each way at once (XLA schedules the two copies concurrently),
    both directions counted;
  - zero-copy: the host_update custom call (DHA kernel) with a copy program: read (pinned_host
    operand -> device result), write (device operand -> aliased, donated pinned_host result),
    read + write (a pinned_host leaf copied onto itself in place; both directions counted);
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

  rates = measure_gpu_adamw(device, update_params, reps=reps)
  out["dha_adamw_params_per_sec"] = rates[hu.HOST_DHA]
  out["cpu_adamw_params_per_sec"] = rates[hu.HOST_CPU]
  stats = device.memory_stats() or {}
  if stats.get("bytes_limit"):
    out["hbm_bytes"] = int(stats["bytes_limit"])
  return out


def measure_cpu_compute(*, n: int = 1024, nbytes: int = 1 << 27,
                        reps: int = 5) -> dict[str, float]:
  """The compute figures of a machine whose compute device is its CPU (the CPU backend).

  `matmul_tflops`: an f32 n x n x n matmul (2 n^3 FLOP; the CPU backend computes what the
  example decoder computes in f32), TFLOP/s. `hbm_gbps`: `a + 1` over `nbytes` of f32, read
  and write counted, GB/s: the memory the CPU backend's "device" arrays live in. With them a
  plan for the CPU backend predicts this machine's step times, not an H200's.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  a = jnp.ones((n, n), jnp.float32)
  mm = jax.jit(lambda a: a @ a)
  t = _median_secs(lambda: mm(a).block_until_ready(), reps)
  out = {"matmul_tflops": 2 * n**3 / t / 1e12}
  x = jnp.ones((nbytes // 4,), jnp.float32)
  add = jax.jit(lambda a: a + 1.0)
  t = _median_secs(lambda: add(x).block_until_ready(), reps)
  out["hbm_gbps"] = 2 * nbytes / t / 1e9
  return out


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
  for executor in (hu.HOST_DHA, hu.HOST_CPU):
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
  from jaxtier._src import planner  # pylint: disable=g-import-not-at-top  (planner imports us)

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
    pinnable = planner.pinnable_bytes(backend)
    if pinnable:
      fields["pinnable_bytes"] = int(pinnable)
    measured.append("host")
  if not measured:
    return DEFAULT_PROFILE
  kind = jax.devices()[0].device_kind
  return dataclasses.replace(
      DEFAULT_PROFILE, **fields, device_kind=kind, versions=_versions(),
      source=f"calibrated on {kind} ({' and '.join(measured)} measured"
      f"{'' if 'gpu' in measured else '; link and GPU executor figures are the H200 defaults'}, "
      f"{time.strftime('%Y-%m-%d')})")


def cache_path(device_kind: "str | None" = None) -> str:
  """Where `save` keeps the profile: the user's cache dir, keyed by device kind and versions."""
  import jax  # pylint: disable=g-import-not-at-top
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  kind = device_kind or jax.devices()[0].device_kind
  kind = kind.replace(" ", "_").replace("/", "_")
  return os.path.join(base, "jaxtier", f"profile-{kind}-jax{jax.__version__}.json")


def save(profile: HardwareProfile, path: "str | None" = None) -> str:
  """Writes `profile` as JSON (default: `cache_path()`), with `PROFILE_FORMAT_VERSION` as
  "format_version"; returns the path."""
  import json  # pylint: disable=g-import-not-at-top
  path = path or cache_path()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"format_version": PROFILE_FORMAT_VERSION, **dataclasses.asdict(profile)}, f,
              indent=1)
  return path


_WARNED: set[str] = set()


def load(path: "str | None" = None, *, platform: "str | None" = None,
         warn: bool = True) -> HardwareProfile:
  """The stored profile for this machine's device, or `DEFAULT_PROFILE`.

  Args:
    path: a profile JSON written by `save` (default: `cache_path()` of this machine's device).
    platform: the platform being planned for ('cpu'/'gpu'); when it is not this machine's
      backend (planning for a GPU on a machine without one), the defaults are returned: a
      stored profile describes this machine's devices, not the absent GPU.
    warn: log a warning (once per path) when the defaults are returned for want of a profile,
      or because the stored one is stale.

  Returns:
    The profile; `DEFAULT_PROFILE` where none is stored, or where the stored one was written in
    an older format (its "format_version" missing or below `PROFILE_FORMAT_VERSION`).

  Raises:
    ValueError: the file holds unknown fields or non-positive rates.
  """
  import json  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  if path is None and platform is not None and platform != jax.default_backend():
    return DEFAULT_PROFILE
  path = path or cache_path()
  if not os.path.exists(path):
    if warn and path not in _WARNED and jax.default_backend() == "gpu":
      _WARNED.add(path)
      log.warning("jaxtier: no hardware profile at %s; planning with the H200 defaults. Run "
                  "`python -m jaxtier calibrate` once on this machine.", path)
    return DEFAULT_PROFILE
  with open(path) as f:
    data = json.load(f)
  version = data.pop("format_version", None) if isinstance(data, dict) else None
  if not isinstance(version, int) or version < PROFILE_FORMAT_VERSION:
    if warn and path not in _WARNED:
      _WARNED.add(path)
      log.warning("jaxtier: ignoring %s: written by an older jaxtier (profile format %s, this "
                  "one reads %d); planning with the defaults. Run `python -m jaxtier calibrate`.",
                  path, version if version is not None else "unversioned",
                  PROFILE_FORMAT_VERSION)
    return DEFAULT_PROFILE
  names = {f.name for f in dataclasses.fields(HardwareProfile)}
  unknown = sorted(set(data) - names)
  if unknown:
    raise ValueError(f"jaxtier profile {path}: unknown fields {unknown}; delete it and run "
                     "`python -m jaxtier calibrate` again")
  return HardwareProfile(**data)
