"""What the machine can do, for choosing and splitting the host-update executors.

`HardwareProfile` holds the rates the planner weighs: the link each way, the zero-copy
read+write rate of the DHA kernel, the host DRAM bandwidth and the AdamW update rates of the two
executors. The defaults are the H200 machine's measured figures (../shared/MEASURED.md,
2026-11-29), taken conservatively; `calibrate()` measures the CPU executor on the machine it runs
on. `split_fraction` turns a profile into the `dha_fraction` of the `split` executor.

Bandwidths are in GB/s (1e9 bytes per second); rates in parameters per second.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from jaxtier._src.primitives import host_update as hu

# Bytes of memory traffic per parameter of an AdamW update with an fp32 master, fp32 moments in
# pinned_host and bf16 gradients / params on the device:
#   DHA kernel, over the link: master, m, v read (12) and written (12).
DHA_LINK_BYTES_PER_PARAM = 24
#   CPU executor, host DRAM: master, m, v read and written (24), the staged gradient read and the
#   staged param written (2 + 2), and the copy engines' writes / reads of those stagings (2 + 2).
CPU_DRAM_BYTES_PER_PARAM = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
  """Rates of one GPU and its host, as the executors see them.

  Attributes:
    link_h2d_gbps: copy-engine bandwidth pinned host -> device, GB/s.
    link_d2h_gbps: copy-engine bandwidth device -> pinned host, GB/s.
    dha_rw_gbps: zero-copy bandwidth of a kernel reading and writing pinned host memory at once,
      both directions together, GB/s.
    host_dram_gbps: host memory bandwidth (STREAM triad, all CPU threads), GB/s.
    cpu_adamw_params_per_sec: AdamW update rate of the host CPU executor, params/s.
    dha_adamw_params_per_sec: AdamW update rate of the DHA kernel, params/s.
  """

  link_h2d_gbps: float = 53.0
  link_d2h_gbps: float = 54.0
  dha_rw_gbps: float = 65.0
  host_dram_gbps: float = 80.5
  # The triad bandwidth over CPU_DRAM_BYTES_PER_PARAM (80.5e9 / 32); below torch's fused CPU
  # AdamW (3.62e9 params/s, which stages nothing).
  cpu_adamw_params_per_sec: float = 2.5e9
  # dha_rw_gbps over DHA_LINK_BYTES_PER_PARAM (65e9 / 24 = 2.7e9), rounded down.
  dha_adamw_params_per_sec: float = 2.6e9

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"HardwareProfile: expected {field.name} > 0 (finite), got {value!r}")


DEFAULT_PROFILE = HardwareProfile()


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


def calibrate(*, measure_cpu: bool = True, num_params: int = 1 << 24) -> HardwareProfile:
  """A profile of this machine: the defaults, with the CPU executor's rate measured.

  Only the CPU executor is measured (a run of the CPU handler, about a tenth of a second); the
  link, zero-copy and DRAM figures stay the defaults until a GPU calibration exists.

  Args:
    measure_cpu: measure `cpu_adamw_params_per_sec` here (else keep the default).
    num_params: elements per measuring run.

  Returns:
    The profile.
  """
  if not measure_cpu:
    return DEFAULT_PROFILE
  rate = measure_cpu_adamw(num_params)
  return dataclasses.replace(DEFAULT_PROFILE, cpu_adamw_params_per_sec=rate)


def cache_path() -> str:
  """Where `save` keeps the profile: the user's cache dir, keyed by device kind and versions."""
  import os  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  kind = jax.devices()[0].device_kind.replace(" ", "_").replace("/", "_")
  return os.path.join(base, "jaxtier", f"profile-{kind}-jax{jax.__version__}.json")


def save(profile: HardwareProfile, path: "str | None" = None) -> str:
  """Writes `profile` as JSON (default: `cache_path()`); returns the path."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  path = path or cache_path()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(dataclasses.asdict(profile), f, indent=1)
  return path


def load(path: "str | None" = None) -> HardwareProfile:
  """The profile stored by `save` (default: `cache_path()`), or `DEFAULT_PROFILE` if none.

  Raises:
    ValueError: the file holds unknown fields or non-positive rates.
  """
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  path = path or cache_path()
  if not os.path.exists(path):
    return DEFAULT_PROFILE
  with open(path) as f:
    data = json.load(f)
  names = {f.name for f in dataclasses.fields(HardwareProfile)}
  unknown = sorted(set(data) - names)
  if unknown:
    raise ValueError(f"jaxtier profile {path}: unknown fields {unknown}; delete it and run "
                     "`python -m jaxtier calibrate` again")
  return HardwareProfile(**data)
