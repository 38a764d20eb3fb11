"""What the device-only step costs: FLOPs, memory-bound and transient bytes, timed scan bodies
or, on the CPU backend, the timed step."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import figures_cache
from jaxtier._src.hardware import host as host_lib
from jaxtier._src.hardware.profile import HardwareProfile
from jaxtier._src.units import format_rate

log = logging.getLogger("jaxtier")

# Of the bytes that elementwise ops and reductions produce or consume (counted per jaxpr
# equation), the share that reaches HBM once XLA has fused chains of them into kernels. An
# assumption (a fused chain writes its result once and reads its inputs once; about every second
# intermediate survives fusion), to be fitted against measured step times (W5).
ELEMENTWISE_HBM_FRACTION = 0.5


# Arrays smaller than this (elements) are ignored by the memory-bound byte count (scalars,
# per-row statistics).
_MIN_ELEMENTS = 1 << 12


def bytes_per_sec(rate_gbps: float) -> float:
  return rate_gbps * 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCosts:
  """What the device-only step costs, per device.

  Attributes:
    flops: FLOP per step per device of its matmuls and convolutions (forward, backward and
      any rematerialisation, loops counted as many times as they run).
    elementwise_bytes: bytes per step per device that elementwise ops and reductions produce or
      read, before fusion (see ELEMENTWISE_HBM_FRACTION).
    transient_bytes: device bytes at the step's peak beyond its state: gradients, saved
      activations, workspace.
    transient_source: how `transient_bytes` was found (for the plan's notes).
    num_devices: devices the step runs on (FLOPs and bytes are divided by it).
    timed: the step's top-level scans whose bodies were timed on this device
      (`time_scan_bodies`), or None: then all compute is the analytic `compute_secs`.
    update_credit: device bytes of `transient_bytes` freed per byte of optimizer state whose
      update leaves the device (its update's temporaries: the device-only step holds them at
      its peak, a step whose update runs on the host does not). 0 until a compiled plan
      measures it (`OffloadedStep` refines its plan with it: docs/design.md).
    step_secs: seconds of the device-only step as run and timed on this machine's CPU backend
      (`time_step`), or None: then `timed` and the analytic `compute_secs` give the compute.
    step_time_key: the `figures_cache` key under which `step_secs` is kept for later
      processes (`check_step_time` removes it where a run contradicts it), or None where the
      step was not timed.
  """

  flops: float
  elementwise_bytes: float
  transient_bytes: int
  transient_source: str
  num_devices: int = 1
  timed: "TimedScans | None" = None
  update_credit: float = 0.0
  step_secs: "float | None" = None
  step_time_key: "str | None" = None

  def compute_secs(self, profile: HardwareProfile) -> float:
    """Seconds of compute per step: the device-only step's as timed (`step_secs`), else timed
    scan bodies x their lengths plus the analytic `compute_secs` of everything else (the whole
    step when nothing was timed)."""
    if self.step_secs is not None:
      return self.step_secs
    if self.timed is None:
      return compute_secs(self.flops, self.elementwise_bytes, profile)
    return self.timed.secs + compute_secs(max(0.0, self.flops - self.timed.flops),
                                          max(0.0, self.elementwise_bytes
                                              - self.timed.elementwise_bytes), profile)

  def compute_source(self, profile: HardwareProfile) -> str:
    """How `compute_secs` was found, for the plan's notes."""
    analytic = (f"matmul FLOPs at {format_rate(profile.matmul_tflops)} TFLOP/s plus "
                f"elementwise bytes at {format_rate(profile.hbm_gbps)} GB/s HBM (profile)")
    if self.step_secs is not None:
      return (f"compute: the device-only step run on this device, {self.step_secs * 1e3:.4g} ms "
              f"(analytic: {analytic}, "
              f"{compute_secs(self.flops, self.elementwise_bytes, profile) * 1e3:.4g} ms)")
    if self.timed is None:
      return f"compute: {analytic}"
    t = self.timed
    return (f"compute: {t.count} scan bod{'y' if t.count == 1 else 'ies'} timed on this "
            f"device ({t.secs * 1e3:.2f} ms per step for {t.iterations} iterations; analytic "
            f"{compute_secs(t.flops, t.elementwise_bytes, profile) * 1e3:.2f} ms), the rest: "
            f"{analytic}")


@dataclasses.dataclass(frozen=True)
class TimedScans:
  """Top-level scans of a step whose bodies were run and timed (`time_scan_bodies`).

  Attributes:
    secs: measured seconds per step of those scans (body time x length, summed).
    flops, elementwise_bytes: their analytic counts (`jaxpr_costs`), which `secs` replaces.
    count: how many scans; iterations: their lengths summed.
    backward_share: the backward pass's share of `secs`, when the timed scans pair up as a
      differentiated step's are (an even count, the first half the forward loops in the order
      traced, the second their transposes): their seconds over all; None otherwise.
  """

  secs: float
  flops: float
  elementwise_bytes: float
  count: int
  iterations: int
  backward_share: "float | None" = None


def compute_secs(flops: float, elementwise_bytes: float, profile: HardwareProfile) -> float:
  """Device time of the step's compute, seconds.

  = flops / (matmul_tflops * 1e12) + ELEMENTWISE_HBM_FRACTION * elementwise_bytes /
  (hbm_gbps * 1e9): the matmuls at the achieved GEMM rate, then the memory-bound work at HBM
  bandwidth (a roofline sum: the two rarely overlap inside one kernel).

  Args:
    flops: FLOP (per device).
    elementwise_bytes: bytes of elementwise / reduction traffic before fusion (per device).
    profile: the rates.
  """
  return flops / (profile.matmul_tflops * 1e12) + (
      ELEMENTWISE_HBM_FRACTION * elementwise_bytes / bytes_per_sec(profile.hbm_gbps))


def _nbytes(aval: Any) -> int:
  shape = getattr(aval, "shape", ())
  dtype = getattr(aval, "dtype", None)
  try:
    size = np.dtype(dtype).itemsize
  except TypeError:
    size = int(getattr(dtype, "itemsize", 4) or 4)
  return int(np.prod(shape, dtype=np.int64)) * size


def _size(aval: Any) -> int:
  return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def dot_flops(eqn: Any) -> float:
  """FLOP of one `dot_general` / `conv_general_dilated` equation: 2 x multiply-adds.

  dot_general: 2 * (output elements) * (product of the contracting dimensions).
  conv_general_dilated: 2 * (output elements) * (kernel elements / output features).
  """
  name = eqn.primitive.name
  out = _size(eqn.outvars[0].aval)
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    k = int(np.prod([lhs[d] for d in lhs_contract], dtype=np.int64)) if lhs_contract else 1
    return 2.0 * out * k
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval
    dn = eqn.params.get("dimension_numbers")
    out_features = rhs.shape[dn.rhs_spec[0]] if dn is not None else rhs.shape[0]
    return 2.0 * out * _size(rhs) / max(1, out_features)
  return 0.0


_LAYOUT = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
                     "convert_element_type", "copy", "copy_p", "slice", "dynamic_slice",
                     "concatenate", "pad", "iota", "select_and_scatter_add", "rev",
                     "optimization_barrier", "stop_gradient", "device_put"})


def jaxpr_costs(jaxpr: Any, multiplier: float = 1.0) -> tuple[float, float]:
  """(matmul FLOP, elementwise bytes) of one run of `jaxpr` (open or closed).

  Walks nested jaxprs: a `scan` body counts `length` times, a `while` body once (its trip count
  is unknown: an underestimate, said in the plan through `StepCosts`), a `cond` its most
  expensive branch, calls (jit, remat, custom_jvp/vjp) their body. Elementwise bytes: the
  output bytes of each other equation producing at least 4096 elements, and the input bytes of
  reductions; layout-only ops (reshape, broadcast, transpose, convert, slices) are free (fused).

  XLA's own `cost_analysis()` counts a while/scan body once, whatever its trip count (seen with
  jax 0.10.2 on CPU); hence this count over the jaxpr.
  """
  j, _ = jc.open_jaxpr(jaxpr)
  flops = 0.0
  ew = 0.0
  for eqn in j.eqns:
    name = eqn.primitive.name
    if name in ("dot_general", "conv_general_dilated"):
      flops += multiplier * dot_flops(eqn)
      continue
    if name == "scan":
      f, b = jaxpr_costs(eqn.params["jaxpr"], multiplier * eqn.params["length"])
      flops, ew = flops + f, ew + b
      continue
    if name == "while":
      f, b = jaxpr_costs(eqn.params["body_jaxpr"], multiplier)
      flops, ew = flops + f, ew + b
      continue
    if name == "cond":
      best = max((jaxpr_costs(br, multiplier) for br in eqn.params["branches"]),
                 key=lambda t: t[0] + t[1], default=(0.0, 0.0))
      flops, ew = flops + best[0], ew + best[1]
      continue
    inner = jc.call_body(eqn)
    if inner is not None:
      f, b = jaxpr_costs(inner, multiplier)
      flops, ew = flops + f, ew + b
      continue
    if name in _LAYOUT:
      continue
    if name.startswith("reduce_") or name in ("argmax", "argmin", "cumsum", "cumlogsumexp",
                                              "cummax", "cumprod"):
      ew += multiplier * sum(_nbytes(v.aval) for v in eqn.invars
                             if not isinstance(v, jc.Literal) and _size(v.aval) >= _MIN_ELEMENTS)
      continue
    ew += multiplier * sum(_nbytes(v.aval) for v in eqn.outvars
                           if _size(v.aval) >= _MIN_ELEMENTS)
  return flops, ew


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryFigures:
  """The compiler's device memory figures for a compiled step, per device, bytes.

  Attributes:
    argument_bytes, output_bytes, alias_bytes, temp_bytes: from `memory_analysis()` (device
      memory space only).
    peak_bytes: argument + output - alias + temp (what the step needs at once), or XLA's own
      `peak_memory_in_bytes` when it reports a larger one and no host figures (with host
      figures, XLA's peak counts host buffers as well).
    host_argument_bytes: arguments in host memory (pinned_host), where reported.
    xla_peak_bytes: XLA's own `peak_memory_in_bytes` (0 where not reported).
    host_output_bytes, host_alias_bytes, host_temp_bytes: the host memory space's outputs,
      outputs aliased to (donated) inputs, and temporaries, where reported (0 elsewhere, e.g.
      the CPU backend).
  """

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  peak_bytes: int
  host_argument_bytes: int
  xla_peak_bytes: int = 0
  host_output_bytes: int = 0
  host_alias_bytes: int = 0
  host_temp_bytes: int = 0

  @property
  def host_extra_bytes(self) -> int:
    """Pinned host bytes the program allocates beyond its arguments: host outputs not aliased
    to an input, and host temporaries."""
    return max(0, self.host_output_bytes - self.host_alias_bytes) + self.host_temp_bytes

  def describe(self) -> str:
    """One line of the figures, in bytes."""
    return (f"argument {self.argument_bytes} (host, as XLA reports it: "
            f"{self.host_argument_bytes}), output {self.output_bytes}, alias "
            f"{self.alias_bytes}, temp {self.temp_bytes}; XLA's own peak {self.xla_peak_bytes}"
            f"{' (host buffers included)' if self.host_argument_bytes else ''}; device peak "
            f"taken: {self.peak_bytes} bytes; pinned_host output {self.host_output_bytes}, alias "
            f"{self.host_alias_bytes}, temp {self.host_temp_bytes}")


def memory_figures(compiled: Any) -> "MemoryFigures | None":
  """`MemoryFigures` of a `jax.stages.Compiled` (or Lowered: compiled here), None if the backend
  reports nothing (some backends return None or all zeros). `MemoryFigures` (read from
  `figures_cache`) are returned as they are."""
  if isinstance(compiled, MemoryFigures):
    return compiled
  if hasattr(compiled, "compile") and not hasattr(compiled, "memory_analysis"):
    compiled = compiled.compile()
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  (not implemented on some backends)
    return None
  if m is None:
    return None
  if isinstance(m, (list, tuple)):  # one per device program in some versions
    m = m[0] if m else None
    if m is None:
      return None
  get = lambda name: int(getattr(m, name, 0) or 0)
  arg, out, alias, temp = (get("argument_size_in_bytes"), get("output_size_in_bytes"),
                           get("alias_size_in_bytes"), get("temp_size_in_bytes"))
  if not (arg or out or temp):
    return None
  # XLA's own peak, where larger, unless the backend reports host figures: then it counts
  # host buffers too (H200, jax 0.11.2, W5's optimizer_offload case: XLA peak 6.90 GB, device
  # figures 6.18 GB, measured 6.28 GB).
  host_arg = get("host_argument_size_in_bytes")
  peak = arg + out - alias + temp
  if not host_arg:
    peak = max(peak, get("peak_memory_in_bytes"))
  return MemoryFigures(argument_bytes=arg, output_bytes=out, alias_bytes=alias, temp_bytes=temp,
                       peak_bytes=peak, host_argument_bytes=host_arg,
                       xla_peak_bytes=get("peak_memory_in_bytes"),
                       host_output_bytes=get("host_output_size_in_bytes"),
                       host_alias_bytes=get("host_alias_size_in_bytes"),
                       host_temp_bytes=get("host_temp_size_in_bytes"))


_COMPILED_FIGURES: dict[Any, "MemoryFigures | None"] = {}


_TIMED_BODIES: dict[Any, float] = {}


def time_scan_bodies(closed_jaxpr: Any, *, reps: int = 5,
                     max_input_bytes: int = 4 << 30,
                     max_body_flops: "float | None" = None) -> "TimedScans | None":
  """Runs the body of each top-level `scan` of the step once per rep on zeros and times it.

  The layers of a model are most of its compute and the analytic rate (`compute_secs`: one
  GEMM rate, one HBM rate) misses how well this device runs *these* shapes (attention's
  batched matmuls, small GEMMs, fusions). MemFerry profiles each layer's compute for the same
  reason. A body is run with zero inputs of its avals (consts, carry, one slice of each xs):
  its run time does not depend on the values. Median of `reps` runs after one warm-up (which
  compiles); each body is timed once per process (cached by its jaxpr and avals).

  Scans nested in calls (`jit`, `remat`, custom_vjp) are looked for through them; scans inside
  scan bodies are part of their body's time. Scans shorter than 2 iterations are left to the
  analytic count.

  Args:
    closed_jaxpr: the traced step.
    reps: timed runs per body.
    max_input_bytes: a body whose inputs take more bytes than this is not timed (its zeros
      would be allocated on the device): it is left to the analytic count, the others timed.
    max_body_flops: likewise a body of more FLOPs per iteration than this (None: no limit;
      on the CPU backend a 1b layer at batch 8 x 1024 runs for minutes).

  Returns:
    The timed scans, or None when the step has none, or timing failed (any exception: an
    estimate never fails a plan).
  """
  import time  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  from jax import extend as jex  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  scans = []

  def walk(j):
    jj, _ = jc.open_jaxpr(j)
    for eqn in jj.eqns:
      if eqn.primitive.name == "scan":
        if eqn.params["length"] >= 2:
          scans.append(eqn)
        continue
      inner = jc.call_body(eqn)
      if inner is not None:
        walk(inner)

  try:
    walk(closed_jaxpr)
    if not scans:
      return None
    total = flops = ew = 0.0
    iterations = timed = 0
    per_scan = []
    for eqn in scans:
      body, length = eqn.params["jaxpr"], int(eqn.params["length"])
      avals = [v.aval for v in jc.open_jaxpr(body)[0].invars]
      if sum(_nbytes(a) for a in avals) > max_input_bytes:
        continue
      if max_body_flops is not None and jaxpr_costs(body, 1.0)[0] > max_body_flops:
        continue
      key = (str(body), tuple(map(str, avals)))
      if key not in _TIMED_BODIES:
        fn = jax.jit(jex.core.jaxpr_as_fun(body))
        args = [jnp.zeros(a.shape, a.dtype) for a in avals]
        jax.block_until_ready(fn(*args))  # compile + warm up
        times = []
        for _ in range(reps):
          t0 = time.perf_counter()
          jax.block_until_ready(fn(*args))
          times.append(time.perf_counter() - t0)
        del args
        _TIMED_BODIES[key] = float(np.median(times))
      total += _TIMED_BODIES[key] * length
      per_scan.append(_TIMED_BODIES[key] * length)
      f, b = jaxpr_costs(body, float(length))
      flops, ew, iterations, timed = flops + f, ew + b, iterations + length, timed + 1
    if not timed:
      return None
    share = None
    if timed == len(scans) and timed % 2 == 0 and total > 0:
      share = sum(per_scan[timed // 2:]) / total
    return TimedScans(secs=total, flops=flops, elementwise_bytes=ew, count=timed,
                      iterations=iterations, backward_share=share)
  except Exception:  # pylint: disable=broad-except  (an estimate: never fail the plan)
    return None


def _has_while(jaxpr: Any) -> bool:
  """Whether `jaxpr` (open or closed) runs a `while` loop anywhere, nested jaxprs included."""
  j, _ = jc.open_jaxpr(jaxpr)
  for eqn in j.eqns:
    if eqn.primitive.name == "while":
      return True
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
          if _has_while(sub):
            return True
  return False


# The device-only step's inputs (state and arguments) above which `time_step` does not run it,
# bytes; the share of the host's available memory its peak may take; and the seconds of its
# first run above which that run is the time taken (no more runs).
TIME_STEP_MAX_INPUT_BYTES = 1 << 30
TIME_STEP_MAX_MEMORY_SHARE = 0.5
TIME_STEP_MAX_RUN_SECS = 2.0
# FLOPs of one iteration of a scan body above which the CPU backend does not time it (about a
# second at 50 GFLOP/s): the analytic count stands in.
CPU_MAX_BODY_FLOPS = 5e10


def time_step(compiled: Any, avals: Sequence[Any], closed_jaxpr: Any, *,
              peak_bytes: "int | None" = None, reps: int = 3,
              max_input_bytes: int = TIME_STEP_MAX_INPUT_BYTES,
              max_run_secs: float = TIME_STEP_MAX_RUN_SECS) -> "float | None":
  """Runs the compiled device-only step on zero inputs and times it: the fastest of `reps`
  runs after one warm-up (other work on a shared machine only ever adds to a run's time).

  On the CPU backend the step's compute is XLA's own on this CPU, which one GEMM rate and one
  memory rate (`compute_secs`) miss by several times: a small model's matmuls run far below a
  1024^3 GEMM's rate, and every op and loop iteration has its own overhead. The step is run as
  compiled (its state donated: new zeros for each run, made outside the timing); its run time
  does not depend on the values.

  Args:
    compiled: the device-only step, compiled (`jax.stages.Compiled`).
    avals: its inputs (`jax.ShapeDtypeStruct`s, with their shardings where set).
    closed_jaxpr: the traced step: a step that runs a `while` loop is not run (on zeros its
      trip count may not be the real one's, or unbounded).
    peak_bytes: the compiled step's peak (`MemoryFigures.peak_bytes`): not run where it is
      over TIME_STEP_MAX_MEMORY_SHARE of the host's available memory.
    reps: timed runs after the warm-up.
    max_input_bytes: not run where the inputs take more (they are allocated for each run).
    max_run_secs: where the warm-up took longer, it is the time returned (no more runs).

  Returns:
    Seconds per step, or None where it was not run (too large, a `while` loop) or running it
    failed (an estimate never fails a plan).
  """
  import time  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  if sum(_nbytes(a) for a in avals) > max_input_bytes or _has_while(closed_jaxpr):
    return None
  available = host_lib.available_bytes()
  if peak_bytes and available is not None and peak_bytes > TIME_STEP_MAX_MEMORY_SHARE * available:
    return None

  def zeros():
    out = []
    for a in avals:
      z = jnp.zeros(a.shape, a.dtype)
      out.append(jax.device_put(z, a.sharding) if getattr(a, "sharding", None) else z)
    return jax.block_until_ready(out)

  try:
    times = []
    for i in range(reps + 1):
      inputs = zeros()
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*inputs))
      times.append(time.perf_counter() - t0)
      del inputs
      if i == 0 and times[0] > max_run_secs:
        return times[0]
    return float(min(times[1:]))
  except Exception:  # pylint: disable=broad-except  (an estimate: never fail the plan)
    return None


_TIMED_STEPS: dict[Any, "float | None"] = {}
# Whether a key's figures were read from `figures_cache` rather than compiled here.
_FROM_DISK: dict[Any, bool] = {}
# The `figures_cache` key of each timed step's time (`StepCosts.step_time_key`).
_TIME_KEYS: dict[Any, str] = {}

# How far a run's measured step may be from the plan's prediction, as a factor either way,
# before `check_step_time` takes the device-only step's kept time for stale.
RETIME_FACTOR = 1.5


def check_step_time(time_key: "str | None", predicted_secs: "float | None",
                    measured_secs: "float | None") -> bool:
  """Drops the kept time of a device-only step (`StepCosts.step_time_key`) where a run of its
  plan measured `measured_secs` per step and the plan predicted `predicted_secs` (both
  seconds), more than RETIME_FACTOR apart either way: the step is then timed again when it is
  next planned, in this process or a later one. A time taken while other work loaded the
  machine, or in a lull, would otherwise be every later plan's. Returns whether it was dropped.
  """
  if not time_key or not predicted_secs or not measured_secs:
    return False
  ratio = predicted_secs / measured_secs
  if 1 / RETIME_FACTOR <= ratio <= RETIME_FACTOR:
    return False
  for key in [k for k, v in _TIME_KEYS.items() if v == time_key]:
    _TIMED_STEPS.pop(key, None)
    del _TIME_KEYS[key]
  figures_cache.remove(time_key)
  log.info("jaxtier: the step ran in %.4g ms, its plan predicted %.4g ms (%.3g of it): the "
           "device-only step's kept time is dropped, to be timed again when next planned",
           measured_secs * 1e3, predicted_secs * 1e3, ratio)
  return True


@dataclasses.dataclass(frozen=True)
class _StepTime:
  """`time_step`'s result as `figures_cache` keeps it: nanoseconds, -1 for None (not timed)."""

  nanos: int

  @classmethod
  def of(cls, secs: "float | None") -> "_StepTime":
    return cls(nanos=-1 if secs is None else int(round(secs * 1e9)))

  @property
  def seconds(self) -> "float | None":
    return None if self.nanos < 0 else self.nanos / 1e9


# XLA options for a compile whose executable is never run, only read for its memory figures
# (`figures_compile_options`), by backend. On the CPU, LLVM's code generation is most of a
# compile and buffer assignment is done before it: at optimization level 0 and with XLA's
# older elemental emitters in place of its fusion emitters, the device-only step of the
# planning-cost benchmark's cases (benchmarks/planning_cost.py) compiled in 0.2 to 0.7 of the
# time, to the same argument, output and alias bytes and temporary bytes within 256 bytes.
FIGURES_COMPILE_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False},
}


def figures_compile_options(backend: str) -> dict[str, Any]:
  """The `compiler_options` of a compile read only for its memory figures on `backend`
  ({} where none: a GPU compiles as it will run, its figures resting on its autotuned
  kernels), less those the installed XLA refused (`jax_compat.compile_with_options`)."""
  return jc.known_compile_options(FIGURES_COMPILE_OPTIONS.get(backend, {}))


def measure_step(closed_jaxpr: Any, state: Sequence[Any], args: Sequence[Any], *,
                 platform: str, state_device_bytes: int, compile_step: bool = True,
                 time_scans: bool = False) -> StepCosts:
  """`StepCosts` of the device-only step (every state leaf on the device), per device.

  FLOPs and elementwise bytes are counted over the jaxpr (`jaxpr_costs`), divided by the
  devices of the state's mesh. Transient bytes come from compiling the device-only step for
  this machine's backend, state donated as `jaxtier.offload` donates it:
    transient = memory_analysis peak - state_device_bytes.
  When compiling fails or the backend reports no figures, transient bytes are 0 here (the
  solver then counts the gradients) and `transient_source` says so.

  Args:
    closed_jaxpr: the traced step (its first invars are the flattened state leaves).
    state, args: the flattened state leaves and other arguments (arrays or ShapeDtypeStructs;
      shardings are kept, memory kind set to 'device').
    platform: the platform being planned for ('cpu' / 'gpu'); when it is not this machine's
      backend the figures are this backend's, an approximation (said in `transient_source`).
    state_device_bytes: the state's bytes per device when all of it is on the device.
    compile_step: compile for the transient bytes (else report 0 and say so); with
      `figures_compile_options` where the step is not timed (its executable is not run).
    time_scans: time the step's compute on this device; only meaningful when `platform` is
      this machine's backend. On the CPU backend the compiled device-only step itself is run
      (`time_step`: `step_secs`); where it is not (not compiled, too large, a `while` loop),
      and on a GPU, the step's scan bodies are (`time_scan_bodies`).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax import extend as jex  # pylint: disable=g-import-not-at-top

  mesh = jc.common_mesh((list(state), list(args)))
  num_devices = mesh.size if mesh is not None else 1
  flops, ew = jaxpr_costs(closed_jaxpr)
  here = jax.default_backend()
  # A plan for the CPU on a machine with a GPU is compiled for the CPU backend, which JAX
  # always has: its figures are the CPU's, as on a machine without a GPU.
  device = None
  if platform == "cpu" != here and mesh is None:
    try:
      device = jax.devices("cpu")[0]
      here = "cpu"
    except RuntimeError:
      pass
  time_whole = (time_scans and num_devices == 1 and compile_step and device is None
                and platform == here == "cpu")
  step_secs = None

  def costs(**kwargs) -> StepCosts:
    timed = (time_scan_bodies(closed_jaxpr,
                              max_body_flops=CPU_MAX_BODY_FLOPS if here == "cpu" else None)
             if time_scans and num_devices == 1 and step_secs is None else None)
    return StepCosts(flops=flops / num_devices, elementwise_bytes=ew / num_devices,
                     num_devices=num_devices, timed=timed, step_secs=step_secs,
                     step_time_key=_TIME_KEYS.get(key) if step_secs is not None else None,
                     **kwargs)

  if not compile_step:
    return costs(transient_bytes=0, transient_source="estimate: the gradients only "
                 "(device-only step not compiled)")
  key = None
  try:
    def spec(x, kind):
      sharding = (jc.named_sharding(x, kind, mesh) if mesh is not None else
                  None if device is None else jax.sharding.SingleDeviceSharding(device))
      # A Python scalar argument has no dtype: JAX's own for it (x64 off: float32, int32).
      dtype = x.dtype if hasattr(x, "dtype") else jax.numpy.asarray(x).dtype
      return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)
    avals = [spec(x, "device") for x in state] + [
        spec(x, jc.memory_kind_of(x) or "device")
        for x in args]
    # The same step planned again (jaxtier.plan, then offload) is compiled (and run) once.
    key = (str(closed_jaxpr), tuple(map(str, avals)), tuple(
        str(getattr(a, "sharding", None)) for a in avals))
    if key in _COMPILED_FIGURES and (not time_whole or key in _TIMED_STEPS):
      fig = _COMPILED_FIGURES[key]
    else:
      fn = jex.core.jaxpr_as_fun(closed_jaxpr)
      # Compiled to run only where it is timed; else only its memory figures are read. An
      # earlier process's figures (and time, where timed) are read from disk where there
      # (`figures_cache`), keyed by the jaxpr and the arguments' types and shardings (the same
      # text in every process for the same step), so that a step found there is not even
      # lowered.
      options = {} if time_whole else figures_compile_options(here)
      digest = figures_cache.key("\n".join((key[0], *key[1], *key[2])), backend=here,
                                 options=options, extra=("device-only step",))
      fig = figures_cache.load(digest, MemoryFigures)
      if time_whole:
        timed_digest = figures_cache.key(digest, backend=here, extra=("timed on this machine",))
        timed = figures_cache.load(timed_digest, _StepTime)
      from_disk = fig is not None and (not time_whole or timed is not None)
      if not from_disk:
        lowered = jax.jit(fn, donate_argnums=tuple(range(len(state)))).lower(*avals)
        compiled = jc.compile_with_options(lowered, options)
        fig = memory_figures(compiled)
        figures_cache.store(digest, fig)
      if len(_COMPILED_FIGURES) > 16:
        _COMPILED_FIGURES.clear()
        _TIMED_STEPS.clear()
        _FROM_DISK.clear()
        _TIME_KEYS.clear()
      _COMPILED_FIGURES[key] = fig
      _FROM_DISK[key] = from_disk
      if time_whole and from_disk:
        _TIMED_STEPS[key] = timed.seconds
      elif time_whole:
        _TIMED_STEPS[key] = time_step(compiled, avals, closed_jaxpr,
                                      peak_bytes=fig.peak_bytes if fig else None)
        figures_cache.store(timed_digest, _StepTime.of(_TIMED_STEPS[key]))
        del compiled
      if time_whole:
        _TIME_KEYS[key] = timed_digest
    if time_whole:
      step_secs = _TIMED_STEPS[key]
  except Exception as e:  # pylint: disable=broad-except  (an estimate: never fail the plan)
    return costs(transient_bytes=0, transient_source=f"estimate: the gradients only "
                 f"(compiling the device-only step failed: {type(e).__name__})")
  if fig is None:
    return costs(transient_bytes=0, transient_source="estimate: the gradients only (the "
                 f"{here} backend reports no memory analysis)")
  where = "" if platform == here else f"; compiled for {here}, planning for {platform}: approximate"
  if _FROM_DISK.get(key):
    where += (f"; read from the figures cache ({figures_cache.directory()})"
              f"{' with its time on this machine' if time_whole else ''}, not compiled again")
  return costs(transient_bytes=max(0, fig.peak_bytes - int(state_device_bytes)),
               transient_source=f"the compiled device-only step's memory_analysis (peak "
               f"{fig.peak_bytes} bytes less the state's {int(state_device_bytes)}){where}")
