"""The planner's cost model: what each placement costs, and the step time it implies.

Pure functions of byte counts, FLOP counts and a `HardwareProfile`, so that every formula can be
tested with synthetic inputs. It models what jaxtier runs today:

- the step's compute (forward, backward, rematerialisation) runs on the device; its time is
  FLOPs over the achieved matmul rate plus the memory-bound bytes over HBM bandwidth
  (`compute_secs`);
- the fused host update runs AFTER the backward pass, one custom call after another, not
  overlapped with compute: its seconds add to the step (`update_cost`);
- a `host_stream` parameter is fetched twice (forward and backward) and its gradient sent
  down once, layer by layer, overlapped with compute (double buffering: the link can run one
  layer ahead): a layer takes the longer of its compute and its transfers (`stream_stage`);
- a `host_xla` leaf is copied to the device before the step and back after it, serially
  (`xla_copy_cost`), and is on the device during the step;
- activations are kept, rematerialised (+1 forward) or offloaded (both link directions)
  (`activation_costs`).

Units: seconds (`*_secs`), bytes (`*_bytes`), FLOP, GB/s = 1e9 bytes/s (profile rates).
All byte counts are per device (one shard).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.profile import HardwareProfile
from jaxtier._src.profile import format_rate

# Of the bytes that elementwise ops and reductions produce or consume (counted per jaxpr
# equation), the share that reaches HBM once XLA has fused chains of them into kernels. An
# assumption (a fused chain writes its result once and reads its inputs once; about every second
# intermediate survives fusion), to be fitted against measured step times (W5).
ELEMENTWISE_HBM_FRACTION = 0.5
# Forward share of a layer's compute without rematerialisation: backward = 2 x forward.
FORWARD_SHARE = 1.0 / 3.0
# Arrays smaller than this (elements) are ignored by the memory-bound byte count (scalars,
# per-row statistics).
_MIN_ELEMENTS = 1 << 12

DEVICE, HOST_DHA, HOST_CPU, HOST_SPLIT, HOST_XLA, HOST_STREAM = (
    "device", "host_dha", "host_cpu", "host_split", "host_xla", "host_stream")

KEEP, REMAT, OFFLOAD = "keep", "remat", "offload"
ACTIVATION_POLICIES = (KEEP, REMAT, OFFLOAD)


def _gb(rate_gbps: float) -> float:
  return rate_gbps * 1e9


# ---- the step's compute -----------------------------------------------------------------------

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
  """

  flops: float
  elementwise_bytes: float
  transient_bytes: int
  transient_source: str
  num_devices: int = 1
  timed: "TimedScans | None" = None
  update_credit: float = 0.0

  def compute_secs(self, profile: HardwareProfile) -> float:
    """Seconds of compute per step: timed scan bodies x their lengths, plus the analytic
    `compute_secs` of everything else (the whole step when nothing was timed)."""
    if self.timed is None:
      return compute_secs(self.flops, self.elementwise_bytes, profile)
    return self.timed.secs + compute_secs(max(0.0, self.flops - self.timed.flops),
                                          max(0.0, self.elementwise_bytes
                                              - self.timed.elementwise_bytes), profile)

  def compute_source(self, profile: HardwareProfile) -> str:
    """How `compute_secs` was found, for the plan's notes."""
    analytic = (f"matmul FLOPs at {format_rate(profile.matmul_tflops)} TFLOP/s plus "
                f"elementwise bytes at {format_rate(profile.hbm_gbps)} GB/s HBM (profile)")
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
  """

  secs: float
  flops: float
  elementwise_bytes: float
  count: int
  iterations: int


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
      ELEMENTWISE_HBM_FRACTION * elementwise_bytes / _gb(profile.hbm_gbps))


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


def _call_body(eqn: Any) -> Any:
  """The body of a call-like equation (`jax_compat.inner_jaxpr`, or jax.checkpoint's: named
  'remat2' in jax 0.10), else None."""
  inner = jc.inner_jaxpr(eqn)
  if inner is None and eqn.primitive.name in ("remat2", "checkpoint", "remat"):
    inner = eqn.params.get("jaxpr")
  return inner


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
    inner = _call_body(eqn)
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


def stacked_layers(jaxpr: Any, num_state: int) -> dict[int, tuple[int, int]]:
  """State leaves sliced per iteration by a top-level `scan`: {leaf index: (scan id, length)}.

  A leaf passed as a scanned-over operand (`xs`) of a scan is a stack of `length` layers (what
  Flax's `nnx.scan` / `nn.scan` make). Conversions and copies between the leaf and the scan are
  looked through. The scan id is the equation's index in the top-level jaxpr (one stage per
  scan).
  """
  j, _ = jc.open_jaxpr(jaxpr)
  origin = {v: i for i, v in enumerate(j.invars[:num_state])}
  out: dict[int, tuple[int, int]] = {}
  for k, eqn in enumerate(j.eqns):
    name = eqn.primitive.name
    if name in ("convert_element_type", "copy", "copy_p", "reduce_precision") and (
        eqn.invars[0] in origin if isinstance(eqn.invars[0], jc.Var) else False):
      origin[eqn.outvars[0]] = origin[eqn.invars[0]]
      continue
    if name != "scan":
      continue
    first_xs = sum(jc.scan_counts(eqn))
    for v in eqn.invars[first_xs:]:
      if isinstance(v, jc.Var) and v in origin and origin[v] not in out:
        out[origin[v]] = (k, int(eqn.params["length"]))
  return out


# ---- placement costs --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Cost:
  """What one choice adds to a step, per device.

  Attributes:
    secs: seconds added to the step's critical path.
    h2d_bytes: bytes moved host -> device over the link per step (copy engines or zero-copy).
    d2h_bytes: bytes moved device -> host per step.
    cpu_secs: host CPU busy seconds per step.
    dha_secs: seconds the zero-copy (DHA) path is busy per step.
    bound: the resource that sets `secs` ('link_h2d', 'link_d2h', 'dha', 'host_cpu',
      'host_dram', 'compute' or '' when secs is 0).
  """

  secs: float = 0.0
  h2d_bytes: float = 0.0
  d2h_bytes: float = 0.0
  cpu_secs: float = 0.0
  dha_secs: float = 0.0
  bound: str = ""

  def __add__(self, other: "Cost") -> "Cost":
    bound = self.bound if self.secs >= other.secs else other.bound
    return Cost(secs=self.secs + other.secs, h2d_bytes=self.h2d_bytes + other.h2d_bytes,
                d2h_bytes=self.d2h_bytes + other.d2h_bytes, cpu_secs=self.cpu_secs + other.cpu_secs,
                dha_secs=self.dha_secs + other.dha_secs, bound=bound)


ZERO = Cost()


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateTraffic:
  """The bytes one fused host-update call moves, per device and step.

  Attributes:
    host_read_bytes: host-resident operands read (optimizer state, fp32 masters).
    host_write_bytes: host-resident results written in place.
    device_in_bytes: device operands read (gradients, device params, scalars).
    device_out_bytes: results written to the device (new params).
    elements: elements the call updates (the length of its index range; 0: unknown, then
      the DHA kernel is costed by bytes alone).
  """

  host_read_bytes: int
  host_write_bytes: int
  device_in_bytes: int
  device_out_bytes: int
  elements: int = 0


def update_cost(executor: str, traffic: UpdateTraffic, profile: HardwareProfile, *,
                platform: str = "gpu", dha_fraction: "float | None" = None) -> Cost:
  """Seconds and bytes of one fused host-update call, run after the backward pass.

  GPU platform:
  - `host_dha`: the kernel reads the host operands and writes the host results over the link,
    zero-copy; device operands are read from HBM (free here).
      secs = max(R / dha_read, W / dha_write, (R + W) / link_duplex, N * t + (R + W) / u)
    with R, W = host read / write bytes, N the call's elements, and the kernel's own time
    N * t + (R + W) / u (`HardwareProfile.dha_update_secs`: a per-element cost plus bytes at
    the marginal rate u, fitted to H200 runs at 16, 24 and 28 bytes per element; without N,
    (R + W) / dha_rw). Link: R host->device, W device->host.
  - `host_cpu`: the gradients (device_in, D_in) go down and the new params (device_out, D_out)
    up through pinned staging buffers, pipelined with the CPU's pass; the CPU streams
      M = R + W + 2 * (D_in + D_out) bytes of host DRAM
    (the host operands, plus each staging buffer written by a copy engine and read by the CPU,
    or the reverse) at `profile.cpu_update_gbps()`:
      secs = max(M / cpu_rate, D_in / link_d2h, D_out / link_h2d).
  - `host_split`: the kernel takes a share f of the elements (`dha_fraction`, default
    `profile.split_fraction`), the CPU the rest, at once; both draw on host DRAM:
      secs = max(f * t_dha, (1 - f) * t_cpu, (f * (R + W) + (1 - f) * M) / host_dram).
  CPU platform: pinned_host is host memory and there is no link; every executor is the CPU
  handler: secs = (R + W + D_in + D_out) / cpu_rate.

  Args:
    executor: 'host_dha', 'host_cpu' or 'host_split'.
    traffic: the call's bytes.
    profile: the rates.
    platform: 'gpu' or 'cpu'.
    dha_fraction: the split's DHA share (None: from the profile).

  Returns:
    The `Cost` (secs add to the step: the update is not overlapped with compute).
  """
  from jaxtier._src import profile as profile_lib  # pylint: disable=g-import-not-at-top
  r, w = float(traffic.host_read_bytes), float(traffic.host_write_bytes)
  d_in, d_out = float(traffic.device_in_bytes), float(traffic.device_out_bytes)
  cpu_rate = _gb(profile.cpu_update_gbps())
  if platform != "gpu":
    secs = (r + w + d_in + d_out) / cpu_rate
    return Cost(secs=secs, cpu_secs=secs, bound="host_cpu" if secs else "")

  def dha() -> Cost:
    kernel = (profile.dha_update_secs(traffic.elements, r + w) if traffic.elements
              else (r + w) / _gb(profile.dha_rw_gbps))
    secs = max(r / _gb(profile.dha_read_gbps), w / _gb(profile.dha_write_gbps),
               (r + w) / _gb(profile.link_duplex_gbps), kernel)
    return Cost(secs=secs, h2d_bytes=r, d2h_bytes=w, dha_secs=secs, bound="dha")

  def cpu() -> Cost:
    m = r + w + 2 * (d_in + d_out)
    parts = {"host_cpu": m / cpu_rate, "link_d2h": d_in / _gb(profile.link_d2h_gbps),
             "link_h2d": d_out / _gb(profile.link_h2d_gbps)}
    bound = max(parts, key=parts.get)
    return Cost(secs=parts[bound], h2d_bytes=d_out, d2h_bytes=d_in, cpu_secs=m / cpu_rate,
                bound=bound)

  if executor == HOST_DHA:
    return dha()
  if executor == HOST_CPU:
    return cpu()
  if executor == HOST_SPLIT:
    f = profile_lib.split_fraction(profile) if dha_fraction is None else float(dha_fraction)
    a, b = dha(), cpu()
    dram = (f * (r + w) + (1 - f) * (r + w + 2 * (d_in + d_out))) / _gb(profile.host_dram_gbps)
    parts = {"dha": f * a.secs, b.bound: (1 - f) * b.secs, "host_dram": dram}
    bound = max(parts, key=parts.get)
    return Cost(secs=parts[bound], h2d_bytes=f * a.h2d_bytes + (1 - f) * b.h2d_bytes,
                d2h_bytes=f * a.d2h_bytes + (1 - f) * b.d2h_bytes, cpu_secs=(1 - f) * b.cpu_secs,
                dha_secs=f * a.dha_secs, bound=bound)
  raise ValueError(f"update_cost: expected executor host_dha, host_cpu or host_split, got "
                   f"{executor!r}")


def xla_copy_cost(nbytes: int, profile: HardwareProfile, *, platform: str = "gpu") -> Cost:
  """A `host_xla` leaf: copied to the device before its use and back after the step, serially.

  secs = nbytes / link_h2d + nbytes / link_d2h (XLA's memory-kind transfers are not overlapped
  with the step's compute in general: MEASURED.md's scan reached 0.64 of the overlapped ideal).
  On the CPU platform the copies are host memory copies at host_dram bandwidth (read + write).
  """
  if platform != "gpu":
    secs = 2 * 2 * nbytes / _gb(profile.host_dram_gbps)
    return Cost(secs=secs, bound="host_dram" if secs else "")
  h2d, d2h = nbytes / _gb(profile.link_h2d_gbps), nbytes / _gb(profile.link_d2h_gbps)
  return Cost(secs=h2d + d2h, h2d_bytes=nbytes, d2h_bytes=nbytes,
              bound="link_h2d" if h2d >= d2h else "link_d2h")


def stream_stage(*, compute_secs: float, num_layers: int, fetch_bytes: float,
                 grad_bytes: float, dha_read_bytes: float = 0.0, dha_write_bytes: float = 0.0,
                 act_offload_bytes: float = 0.0, profile: HardwareProfile,
                 forward_share: float = FORWARD_SHARE) -> Cost:
  """One stage of layers (a stack of `num_layers` layers, or one layer), forward + backward.

  Per layer: c = compute_secs / num_layers, forward c_f = forward_share * c, backward
  c_b = c - c_f; streamed bytes per layer s = fetch_bytes / num_layers, their gradient
  g = grad_bytes / num_layers; zero-copy (host_dha params) r = dha_read_bytes / num_layers,
  w = dha_write_bytes / num_layers; offloaded activations a = act_offload_bytes / num_layers.
    forward  t_f = max(c_f, s / h2d + r / dha_read, a / d2h)
    backward t_b = max(c_b, s / h2d' + r / dha_read + a / h2d', g / d2h' + w / dha_write)
  where h2d' and d2h' are the duplex rates (link_duplex / 2 each) when both directions carry
  bytes in the backward pass, else the one-way rates. Stage:
    secs = num_layers * (t_f + t_b) + s / h2d
  (the first layer's fetch is exposed once: the copy of layer l+1 overlaps the compute of
  layer l, double buffering). With nothing streamed this is the stage's compute.

  Returns:
    The `Cost`: secs is the stage's time (compute included), bound the resource that sets it.
  """
  n = max(1, int(num_layers))
  c = compute_secs / n
  c_f = forward_share * c
  c_b = c - c_f
  s, g = fetch_bytes / n, grad_bytes / n
  r, w, a = dha_read_bytes / n, dha_write_bytes / n, act_offload_bytes / n
  h2d, d2h = _gb(profile.link_h2d_gbps), _gb(profile.link_d2h_gbps)
  both_back = (s + a) > 0 and g > 0
  h2d_b = _gb(profile.link_duplex_gbps) / 2 if both_back else h2d
  d2h_b = _gb(profile.link_duplex_gbps) / 2 if both_back else d2h
  fwd = {"compute": c_f, "link_h2d": s / h2d + r / _gb(profile.dha_read_gbps),
         "link_d2h": a / d2h}
  bwd = {"compute": c_b, "link_h2d": s / h2d_b + r / _gb(profile.dha_read_gbps) + a / h2d_b,
         "link_d2h": g / d2h_b + w / _gb(profile.dha_write_gbps)}
  t_f, t_b = max(fwd.values()), max(bwd.values())
  exposed = s / h2d
  secs = n * (t_f + t_b) + exposed
  link_secs = n * (max(fwd["link_h2d"], fwd["link_d2h"]) + max(bwd["link_h2d"], bwd["link_d2h"]))
  if n * (c_f + c_b) >= link_secs:
    bound = "compute"
  else:
    bound = "link_h2d" if n * (fwd["link_h2d"] + bwd["link_h2d"]) >= n * (
        fwd["link_d2h"] + bwd["link_d2h"]) else "link_d2h"
  dha = n * (r / _gb(profile.dha_read_gbps) + r / _gb(profile.dha_read_gbps) +
             w / _gb(profile.dha_write_gbps))
  return Cost(secs=secs, h2d_bytes=n * (2 * s + 2 * r + a), d2h_bytes=n * (g + w + a),
              dha_secs=dha, bound=bound)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationOption:
  """One activation policy of a model, per device, totals over its layers.

  Attributes:
    held_bytes: device bytes of the residuals the backward pass reads that stay on the device.
    recompute_flops: FLOP the backward pass spends recomputing what was not saved.
    offload_bytes: residual bytes sent to pinned_host in the forward pass and fetched back in
      the backward pass.
    checkpoint_policy: the `jax.checkpoint_policies` name that implements it.
  """

  held_bytes: int
  recompute_flops: float = 0.0
  offload_bytes: int = 0
  checkpoint_policy: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationModel:
  """A model's activation policies, and the one its traced step uses.

  Attributes:
    options: {policy name: ActivationOption}, e.g. 'keep', 'remat', 'offload'.
    traced: the policy the traced step uses: the transient bytes and FLOPs measured from the
      step include it, and the other options are costed against it.
  """

  options: Mapping[str, ActivationOption]
  traced: str

  def __post_init__(self):
    if self.traced not in self.options:
      raise ValueError(f"ActivationModel: expected traced in {sorted(self.options)}, got "
                       f"{self.traced!r}")

  @classmethod
  def simple(cls, *, keep_bytes: int, remat_bytes: int, forward_flops: float,
             traced: str = KEEP) -> "ActivationModel":
    """keep (K bytes held), remat (R held, one forward of F FLOP recomputed) and offload (R
    held, K - R bytes each way over the link, nothing recomputed)."""
    return cls(traced=traced, options={
        KEEP: ActivationOption(held_bytes=keep_bytes, checkpoint_policy="everything_saveable"),
        REMAT: ActivationOption(held_bytes=remat_bytes, recompute_flops=forward_flops,
                                checkpoint_policy="nothing_saveable"),
        OFFLOAD: ActivationOption(held_bytes=remat_bytes,
                                  offload_bytes=max(0, keep_bytes - remat_bytes),
                                  checkpoint_policy="save_and_offload_only_these_names")})

  @property
  def checkpoint_policy(self) -> dict[str, str]:
    return {k: o.checkpoint_policy for k, o in self.options.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationChoice:
  """One activation policy's effect relative to the traced step.

  Attributes:
    policy: its name.
    device_delta_bytes: change of the step's peak device bytes against the traced policy.
    extra_flops: FLOP added (positive) or saved (negative) against the traced policy.
    offload_bytes: activation bytes sent to the host in the forward pass and fetched back in
      the backward pass.
  """

  policy: str
  device_delta_bytes: int
  extra_flops: float
  offload_bytes: int


def activation_choices(model: ActivationModel) -> dict[str, ActivationChoice]:
  """Each policy of `model` against the traced one.

    device_delta = held(policy) - held(traced)             bytes
    extra_flops = recompute(policy) - recompute(traced)    FLOP
    offload_bytes = offload(policy)                        bytes each way per step
  """
  t = model.options[model.traced]
  return {name: ActivationChoice(
      policy=name, device_delta_bytes=int(o.held_bytes - t.held_bytes),
      extra_flops=float(o.recompute_flops - t.recompute_flops),
      offload_bytes=int(o.offload_bytes)) for name, o in model.options.items()}


# ---- the prediction -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
  """A plan's predicted step, per device.

  Attributes:
    step_secs: predicted step time, seconds.
    critical_path: the resource on the critical path for most of the step ('compute',
      'link_h2d', 'link_d2h', 'dha', 'host_cpu', 'host_dram').
    segments: the step's serial phases: (name, seconds, the resource that bounds it).
    resource_secs: busy seconds per resource: 'compute', 'link_h2d', 'link_d2h', 'dha',
      'host_cpu'.
    peak_hbm_bytes: predicted peak device memory: device-resident state + transient bytes
      (gradients, activations, workspace) + stream buffers.
    pinned_bytes: pinned host bytes of the state (fp32 masters included).
  """

  step_secs: float
  critical_path: str
  segments: tuple[tuple[str, float, str], ...]
  resource_secs: Mapping[str, float]
  peak_hbm_bytes: int
  pinned_bytes: int

  def to_dict(self) -> dict[str, Any]:
    return {"step_secs": self.step_secs, "critical_path": self.critical_path,
            "segments": [list(s) for s in self.segments],
            "resource_secs": dict(self.resource_secs), "peak_hbm_bytes": self.peak_hbm_bytes,
            "pinned_bytes": self.pinned_bytes}


def predict(*, layers: Cost, layer_compute_secs: float, other_compute_secs: float,
            updates: Iterable[Cost], xla_copies: Iterable[Cost], peak_hbm_bytes: int,
            pinned_bytes: int, profile: HardwareProfile) -> Prediction:
  """Step time as the sum of the step's serial phases, each bounded by its slowest resource.

    step = t_layers + t_other + sum(t_update) + sum(t_xla)
  - t_layers: the layer stages (forward + backward, streams overlapped: `stream_stage`), of
    which `layer_compute_secs` is their compute alone;
  - t_other: compute outside the layer stages (embedding, head, loss), seconds;
  - t_update: each fused host update, after the backward pass (`update_cost`);
  - t_xla: each `host_xla` leaf's copies (`xla_copy_cost`).
  The critical path is the resource that bounds the most seconds of the step.
  """
  updates, xla_copies = list(updates), list(xla_copies)
  up = sum(updates, ZERO)
  xla = sum(xla_copies, ZERO)
  segments = [("forward+backward", layers.secs + other_compute_secs,
               layers.bound if layers.bound and layers.bound != "compute" else "compute")]
  if up.secs:
    segments.append(("host update", up.secs, _dominant(updates)))
  if xla.secs:
    segments.append(("host_xla copies", xla.secs, _dominant(xla_copies)))
  step = sum(s[1] for s in segments)
  by_bound: dict[str, float] = {}
  for _, secs, bound in segments:
    by_bound[bound] = by_bound.get(bound, 0.0) + secs
  critical = max(by_bound, key=by_bound.get) if by_bound else "compute"
  everything = layers + up + xla
  compute = layer_compute_secs + other_compute_secs
  resource = {"compute": compute,
              "link_h2d": everything.h2d_bytes / _gb(profile.link_h2d_gbps),
              "link_d2h": everything.d2h_bytes / _gb(profile.link_d2h_gbps),
              "dha": everything.dha_secs, "host_cpu": everything.cpu_secs}
  return Prediction(step_secs=step, critical_path=critical, segments=tuple(segments),
                    resource_secs=resource, peak_hbm_bytes=int(peak_hbm_bytes),
                    pinned_bytes=int(pinned_bytes))


def _dominant(costs: list[Cost]) -> str:
  by: dict[str, float] = {}
  for c in costs:
    if c.secs:
      by[c.bound or "compute"] = by.get(c.bound or "compute", 0.0) + c.secs
  return max(by, key=by.get) if by else ""


# ---- the compiler's figures ---------------------------------------------------------------------

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
  """

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  peak_bytes: int
  host_argument_bytes: int
  xla_peak_bytes: int = 0

  def describe(self) -> str:
    """One line of the figures, in bytes."""
    return (f"argument {self.argument_bytes} (host, as XLA reports it: "
            f"{self.host_argument_bytes}), output {self.output_bytes}, alias "
            f"{self.alias_bytes}, temp {self.temp_bytes}, XLA peak {self.xla_peak_bytes}: peak "
            f"{self.peak_bytes} bytes")


def memory_figures(compiled: Any) -> "MemoryFigures | None":
  """`MemoryFigures` of a `jax.stages.Compiled` (or Lowered: compiled here), None if the backend
  reports nothing (some backends return None or all zeros)."""
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
                       xla_peak_bytes=get("peak_memory_in_bytes"))


def safe_div(a: float, b: float) -> float:
  return a / b if b else (math.inf if a else 0.0)


_COMPILED_FIGURES: dict[Any, "MemoryFigures | None"] = {}


_TIMED_BODIES: dict[Any, float] = {}


def time_scan_bodies(closed_jaxpr: Any, *, reps: int = 5,
                     max_input_bytes: int = 1 << 30) -> "TimedScans | None":
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
      would be allocated on the device).

  Returns:
    The timed scans, or None when the step has none, or timing failed (any exception: an
    estimate never fails a plan).
  """
  import time  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax import extend as jex  # pylint: disable=g-import-not-at-top

  scans = []

  def walk(j):
    jj, _ = jc.open_jaxpr(j)
    for eqn in jj.eqns:
      if eqn.primitive.name == "scan":
        if eqn.params["length"] >= 2:
          scans.append(eqn)
        continue
      inner = _call_body(eqn)
      if inner is not None:
        walk(inner)

  try:
    walk(closed_jaxpr)
    if not scans:
      return None
    total = flops = ew = 0.0
    iterations = 0
    for eqn in scans:
      body, length = eqn.params["jaxpr"], int(eqn.params["length"])
      avals = [v.aval for v in jc.open_jaxpr(body)[0].invars]
      if sum(_nbytes(a) for a in avals) > max_input_bytes:
        return None
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
      f, b = jaxpr_costs(body, float(length))
      flops, ew, iterations = flops + f, ew + b, iterations + length
    return TimedScans(secs=total, flops=flops, elementwise_bytes=ew, count=len(scans),
                      iterations=iterations)
  except Exception:  # pylint: disable=broad-except  (an estimate: never fail the plan)
    return None


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
    compile_step: compile for the transient bytes (else report 0 and say so).
    time_scans: time the step's scan bodies on this device (`time_scan_bodies`); only
      meaningful when `platform` is this machine's backend.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax import extend as jex  # pylint: disable=g-import-not-at-top

  mesh = jc.common_mesh((list(state), list(args)))
  num_devices = mesh.size if mesh is not None else 1
  flops, ew = jaxpr_costs(closed_jaxpr)
  timed = time_scan_bodies(closed_jaxpr) if time_scans and num_devices == 1 else None
  base = dict(flops=flops / num_devices, elementwise_bytes=ew / num_devices,
              num_devices=num_devices, timed=timed)
  if not compile_step:
    return StepCosts(transient_bytes=0, transient_source="estimate: the gradients only "
                     "(device-only step not compiled)", **base)
  here = jax.default_backend()
  key = None
  try:
    def spec(x, kind):
      sharding = jc.named_sharding(x, kind, mesh) if mesh is not None else None
      # A Python scalar argument has no dtype: JAX's own for it (x64 off: float32, int32).
      dtype = x.dtype if hasattr(x, "dtype") else jax.numpy.asarray(x).dtype
      return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)
    avals = [spec(x, "device") for x in state] + [
        spec(x, getattr(getattr(x, "sharding", None), "memory_kind", None) or "device")
        for x in args]
    # The same step planned again (jaxtier.plan, then offload) is compiled once.
    key = (str(closed_jaxpr), tuple(map(str, avals)), tuple(
        str(getattr(a, "sharding", None)) for a in avals))
    if key in _COMPILED_FIGURES:
      fig = _COMPILED_FIGURES[key]
    else:
      fn = jex.core.jaxpr_as_fun(closed_jaxpr)
      compiled = jax.jit(fn, donate_argnums=tuple(range(len(state)))).lower(*avals).compile()
      fig = memory_figures(compiled)
      if len(_COMPILED_FIGURES) > 16:
        _COMPILED_FIGURES.clear()
      _COMPILED_FIGURES[key] = fig
  except Exception as e:  # pylint: disable=broad-except  (an estimate: never fail the plan)
    return StepCosts(transient_bytes=0, transient_source=f"estimate: the gradients only "
                     f"(compiling the device-only step failed: {type(e).__name__})", **base)
  if fig is None:
    return StepCosts(transient_bytes=0, transient_source="estimate: the gradients only (the "
                     f"{here} backend reports no memory analysis)", **base)
  where = "" if platform == here else f"; compiled for {here}, planning for {platform}: approximate"
  return StepCosts(transient_bytes=max(0, fig.peak_bytes - int(state_device_bytes)),
                   transient_source=f"the compiled device-only step's memory_analysis (peak "
                   f"{fig.peak_bytes} bytes less the state's {int(state_device_bytes)}){where}",
                   **base)


def verify(plan: Any, compiled: Any, *, device_argument_bytes: "int | None" = None,
           host_argument_bytes: "int | None" = None) -> "tuple[bool, MemoryFigures | None]":
  """Checks a compiled planned step against the plan's device budget.

  Reads `compiled.memory_analysis()` (a `jax.stages.Compiled`, or a `Lowered`, compiled here):
  per device, peak = argument + output - alias + temp bytes in device memory. Backends differ
  in whether `argument_size_in_bytes` counts pinned_host arguments (the CPU backend does and
  reports no host figures; on the H200 with jax 0.11.2, W5 measured the device peak 0.57 GiB
  under the figure, about the program's pinned_host arguments): when the argument figure
  reaches the device and host arguments together, the host arguments are taken out of the
  peak (their aliased outputs cancel in output - alias).

  Args:
    plan: the `Plan` (its `planned_device_budget`, else `device_budget`, is the limit).
    compiled: the planned step, compiled or lowered.
    device_argument_bytes, host_argument_bytes: the program's argument bytes per device in
      device memory and in pinned_host; None: unknown (then the plan's `pinned_bytes` are the
      host arguments, taken out when the backend reports no host figures).

  Returns:
    (ok, figures): ok is False only when the backend reports figures and their peak exceeds
    the budget; figures is None when the backend reports none (nothing to check).
  """
  fig = memory_figures(compiled)
  if fig is not None:
    if host_argument_bytes is None or device_argument_bytes is None:
      host = int(getattr(plan, "pinned_bytes", 0) or 0)
      counted = not fig.host_argument_bytes
    else:
      host = int(host_argument_bytes)
      # 1% slack for padding and small arguments (scalars, the batch).
      counted = fig.argument_bytes >= 0.99 * (device_argument_bytes + host)
    if host and counted:
      fig = dataclasses.replace(fig, argument_bytes=max(0, fig.argument_bytes - host),
                                peak_bytes=max(0, fig.peak_bytes - host),
                                host_argument_bytes=host)
  budget = getattr(plan, "planned_device_budget", None) or getattr(plan, "device_budget", None)
  if fig is None or budget is None:
    return True, fig
  return fig.peak_bytes <= budget, fig
