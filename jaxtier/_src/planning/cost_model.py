"""The planner's cost model: what each placement costs, and the step time it implies.

Pure functions of byte counts, FLOP counts and a `HardwareProfile`, so that every formula can be
tested with synthetic inputs. It models what jaxtier runs today:

- the step's compute (forward, backward, rematerialisation) runs on the device; its time is
  FLOPs over the achieved matmul rate plus the memory-bound bytes over HBM bandwidth
  (`compute_secs`);
- each fused host update runs when its schedule (`Plan.schedule`, `update_schedule.decide`)
  says: after the backward pass, one custom call after another, its seconds added to the step
  (`update_cost`); layer by layer inside the backward pass, overlapped with it (what shows is
  its tail and the DHA kernel's slowing of the compute); or, for an embedding table read in
  place, row by row on the host CPUs while the step computes (`predict`);
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
from typing import Any, Iterable, Mapping

from jaxtier._src.analysis.step_costs import bytes_per_sec
from jaxtier._src.hardware.profile import HardwareProfile, split_fraction
from jaxtier._src.planning import placements
from jaxtier._src.vocab import Role

# Forward share of a layer's compute without rematerialisation: backward = 2 x forward.
FORWARD_SHARE = 1.0 / 3.0


KEEP, REMAT, OFFLOAD = "keep", "remat", "offload"
ACTIVATION_POLICIES = (KEEP, REMAT, OFFLOAD)


# ---- the step's compute -----------------------------------------------------------------------


# ---- placement costs --------------------------------------------------------------------------

def placed_pinned_bytes(placement: str, nbytes: int, sent_grad_nbytes: int) -> int:
  """Pinned host bytes of a parameter of `nbytes` placed `placement` off the device (the
  registry's `PlacementRecord.pinned_bytes`); its gradient buffers hold `sent_grad_nbytes`
  each (its gradient as sent: in bf16 where it is a bf16 value widened)."""
  return placements.record(placement).pinned_bytes(nbytes, role=Role.PARAM,
                                                   sent_grad_nbytes=sent_grad_nbytes)


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


# Host-DRAM bytes per byte staged for the CPU executor: the CPU's read (or write) of the staging
# buffer, plus half a byte for the copy engine's side of it. The split's host-DRAM bound counts
# its CPU share's staged bytes so.
STAGING_DRAM_FACTOR = 1.5


# The CPU executor's time, in bytes at `profile.cpu_update_gbps()` per byte it moves: its host
# operands, read and written in place (CPU_IN_PLACE_FACTOR), and its staged device operands and
# results (CPU_STAGED_FACTOR: the CPU's pass over the staging buffer plus the copy engine's side
# of it). Fitted to the H200's runs that isolate each (1b decoder, batch 8, layered host_cpu
# updates, the update's time read off the step as measured less the predicted step's other
# phases; `benchmarks/results/w3/`, `w5/planner_h200.json`):
# - layers streamed, no staging (26 B per param in place): 302 ms measured for the 1b's 1.03e9
#   params and 75.7 ms for W5's 0.28e9, 0.29 and 0.27 ns per param, where 26 B at the rate
#   predicts 0.32: their mean is 0.88 of a byte at the rate;
# - moments on the host, fp32 params on the device (16 B in place, 10 B staged: the bf16
#   gradient and the param down, the new param up): 398 ms, 0.387 ns per param, so a staged byte
#   counts 1.76.
# The rate itself is the calibration's (`calibrate`: an AdamW pass with its transfers, turned into
# bytes by `CPU_DRAM_BYTES_PER_PARAM`).
CPU_IN_PLACE_FACTOR = 0.88
CPU_STAGED_FACTOR = 1.76


def update_cost(executor: str, traffic: UpdateTraffic, profile: HardwareProfile, *,
                platform: str = "gpu", dha_fraction: "float | None" = None,
                grid: float = 1.0) -> Cost:
  """Seconds and bytes of one fused host-update call, run after the backward pass.

  GPU platform:
  - `host_dha`: the kernel reads the host operands and writes the host results over the link,
    zero-copy; device operands are read from HBM (free here).
      secs = max(R / dha_read, W / dha_write, (R + W) / link_duplex, kernel)
    with R, W = host read / write bytes, N the call's elements, and the kernel's own time on
    the share `grid` of the GPU's blocks (`HardwareProfile.dha_update_secs`: N at its
    per-element rate or R + W at its link rate, whichever is slower, both lower on a small
    grid; without N, (R + W) / dha_rw). Link: R host->device, W device->host.
  - `host_cpu`: the gradients (device_in, D_in) go down and the new params (device_out, D_out)
    up through pinned staging buffers, pipelined with the CPU's pass over
      M = a (R + W) + s (D_in + D_out) bytes
    (the host operands in place, a = CPU_IN_PLACE_FACTOR, and each staging buffer written by a
    copy engine and read by the CPU, or the reverse, s = CPU_STAGED_FACTOR) at
    `profile.cpu_update_gbps()`:
      secs = max(M / cpu_rate, D_in / link_d2h, D_out / link_h2d).
  - `host_split`: the kernel takes a share f of the elements (`dha_fraction`, default
    `profile.split_fraction`), the CPU the rest, at once; both draw on host DRAM, the CPU's
    share M' = R + W + STAGING_DRAM_FACTOR * (D_in + D_out) bytes of it:
      secs = max(f * t_dha, (1 - f) * t_cpu, (f * (R + W) + (1 - f) * M') / host_dram).
  CPU platform: pinned_host is host memory and there is no link; every executor is the CPU
  handler: secs = (R + W + D_in + D_out) / cpu_rate.

  Args:
    executor: 'host_dha', 'host_cpu' or 'host_split'.
    traffic: the call's bytes.
    profile: the rates.
    platform: 'gpu' or 'cpu'.
    dha_fraction: the split's DHA share (None: from the profile).
    grid: the share of the GPU's resident blocks the DHA kernel runs on, in (0, 1] (a layer
      call's: `profile.dha_layer_grid`).

  Returns:
    The `Cost` (its secs add to the step where the update runs after the backward pass).
  """

  r, w = float(traffic.host_read_bytes), float(traffic.host_write_bytes)
  d_in, d_out = float(traffic.device_in_bytes), float(traffic.device_out_bytes)
  cpu_rate = bytes_per_sec(profile.cpu_update_gbps())
  if platform != "gpu":
    secs = (r + w + d_in + d_out) / cpu_rate
    return Cost(secs=secs, cpu_secs=secs, bound="host_cpu" if secs else "")

  def dha() -> Cost:
    kernel = (profile.dha_update_secs(traffic.elements, r + w, grid) if traffic.elements
              else (r + w) / bytes_per_sec(profile.dha_rw_gbps))
    secs = max(r / bytes_per_sec(profile.dha_read_gbps), w / bytes_per_sec(profile.dha_write_gbps),
               (r + w) / bytes_per_sec(profile.link_duplex_gbps), kernel)
    return Cost(secs=secs, h2d_bytes=r, d2h_bytes=w, dha_secs=secs, bound="dha")

  def cpu() -> Cost:
    m = CPU_IN_PLACE_FACTOR * (r + w) + CPU_STAGED_FACTOR * (d_in + d_out)
    parts = {"host_cpu": m / cpu_rate, "link_d2h": d_in / bytes_per_sec(profile.link_d2h_gbps),
             "link_h2d": d_out / bytes_per_sec(profile.link_h2d_gbps)}
    bound = max(parts, key=parts.get)
    return Cost(secs=parts[bound], h2d_bytes=d_out, d2h_bytes=d_in, cpu_secs=m / cpu_rate,
                bound=bound)

  rec = placements.REGISTRY.get(executor)
  if rec is None or rec.executor is None:
    *most, last = placements.EXECUTOR_PLACEMENTS
    raise ValueError(f"update_cost: expected executor {', '.join(most)} or {last}, got "
                     f"{executor!r}")
  if rec.dha_share == 1.0:
    return dha()
  if rec.dha_share == 0.0:
    return cpu()
  # The split: the DHA kernel takes a share f of the elements, the CPU the rest, at once.
  f = split_fraction(profile) if dha_fraction is None else float(dha_fraction)
  a, b = dha(), cpu()
  dram = (f * (r + w) + (1 - f) * (r + w + STAGING_DRAM_FACTOR *
                                   (d_in + d_out))) / bytes_per_sec(profile.host_dram_gbps)
  parts = {"dha": f * a.secs, b.bound: (1 - f) * b.secs, "host_dram": dram}
  bound = max(parts, key=parts.get)
  return Cost(secs=parts[bound], h2d_bytes=f * a.h2d_bytes + (1 - f) * b.h2d_bytes,
              d2h_bytes=f * a.d2h_bytes + (1 - f) * b.d2h_bytes, cpu_secs=(1 - f) * b.cpu_secs,
              dha_secs=f * a.dha_secs, bound=bound)


def xla_copy_cost(nbytes: int, profile: HardwareProfile, *, platform: str = "gpu") -> Cost:
  """A `host_xla` leaf: copied to the device before its use and back after the step, serially.

  secs = nbytes / link_h2d + nbytes / link_d2h (XLA's memory-kind transfers are not overlapped
  with the step's compute in general: in W1 they reached 0.635 of the overlapped bound,
  benchmarks/results/w1/streaming_h200.json).
  On the CPU platform the copies are host memory copies at host_dram bandwidth (read + write).
  """
  if platform != "gpu":
    secs = 2 * 2 * nbytes / bytes_per_sec(profile.host_dram_gbps)
    return Cost(secs=secs, bound="host_dram" if secs else "")
  h2d, d2h = nbytes / bytes_per_sec(profile.link_h2d_gbps), nbytes / bytes_per_sec(
      profile.link_d2h_gbps)
  return Cost(secs=h2d + d2h, h2d_bytes=nbytes, d2h_bytes=nbytes,
              bound="link_h2d" if h2d >= d2h else "link_d2h")


def stream_stage(*, compute_secs: float, num_layers: int, fetch_bytes: float,
                 grad_bytes: float, dha_read_bytes: float = 0.0, dha_write_bytes: float = 0.0,
                 act_offload_bytes: float = 0.0, profile: HardwareProfile,
                 forward_share: float = FORWARD_SHARE) -> Cost:
  """One stage of layers (a stack of `num_layers` layers, or one layer), forward + backward.

  Per layer: c = compute_secs / num_layers, forward c_f = forward_share * c, backward
  c_b = c - c_f; streamed bytes per layer s = fetch_bytes / num_layers, their gradient
  g = grad_bytes / num_layers; zero-copy (host_dha params: embedding tables, their gathered
  rows) r = dha_read_bytes / num_layers, w = dha_write_bytes / num_layers; offloaded
  activations a = act_offload_bytes / num_layers.
    forward  t_f = max(c_f, s / h2d + r / dha_gather, a / d2h)
    backward t_b = max(c_b, s / h2d' + r / dha_gather + a / h2d', g / d2h' + w / dha_write)
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
  h2d, d2h = bytes_per_sec(profile.link_h2d_gbps), bytes_per_sec(profile.link_d2h_gbps)
  both_back = (s + a) > 0 and g > 0
  h2d_b = bytes_per_sec(profile.link_duplex_gbps) / 2 if both_back else h2d
  d2h_b = bytes_per_sec(profile.link_duplex_gbps) / 2 if both_back else d2h
  gather = bytes_per_sec(profile.dha_gather_gbps)
  fwd = {"compute": c_f, "link_h2d": s / h2d + r / gather,
         "link_d2h": a / d2h}
  bwd = {"compute": c_b,
         "link_h2d": s / h2d_b + r / gather + a / h2d_b,
         "link_d2h": g / d2h_b + w / bytes_per_sec(profile.dha_write_gbps)}
  t_f, t_b = max(fwd.values()), max(bwd.values())
  exposed = s / h2d
  secs = n * (t_f + t_b) + exposed
  link_secs = n * (max(fwd["link_h2d"], fwd["link_d2h"]) + max(bwd["link_h2d"], bwd["link_d2h"]))
  if n * (c_f + c_b) >= link_secs:
    bound = "compute"
  else:
    bound = "link_h2d" if n * (fwd["link_h2d"] + bwd["link_h2d"]) >= n * (
        fwd["link_d2h"] + bwd["link_d2h"]) else "link_d2h"
  dha = n * (2 * r / gather + w / bytes_per_sec(profile.dha_write_gbps))
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


# The backward pass's share of the layer stages' time when it is not measured (two matmuls per
# forward one; a layer rematerialised in the backward pass makes it about 3/4).
BACKWARD_SHARE = 2.0 / 3.0
# Seconds of compute lost per second of a layered update's DHA kernel running beside it, on
# the share g of the GPU's blocks: DHA_CONTENTION + DHA_CONTENTION_PER_GRID * g
# (`dha_contention`). H200, W3 1b batch 8, AdamW moments in pinned_host, the split at 0.8
# (w3/1b_b8_osh_grid_h200.json; 171.2 ms device-only): 315.6 ms per step on a quarter of
# the blocks and 352.3 on the whole grid, where the update without the kernel's slowing would
# show 115.7 ms over the device step: 0.25 and 0.57 of the 114 ms backward it overlaps.
DHA_CONTENTION = 0.14
DHA_CONTENTION_PER_GRID = 0.43


def dha_contention(grid: float) -> float:
  """Seconds of compute lost per second of DHA kernel beside it, on the share `grid` of the
  GPU's blocks (`DHA_CONTENTION`)."""
  return DHA_CONTENTION + DHA_CONTENTION_PER_GRID * grid


def predict(*, layers: Cost, layer_compute_secs: float, other_compute_secs: float,
            updates: Iterable[Cost], xla_copies: Iterable[Cost], peak_hbm_bytes: int,
            pinned_bytes: int, profile: HardwareProfile,
            overlapped: Iterable[tuple[Cost, int]] = (),
            rows: Iterable[tuple[Cost, float]] = (),
            backward_share: float = BACKWARD_SHARE, sent_lag_layers: int = 0) -> Prediction:
  """Step time as the sum of the step's serial phases, each bounded by its slowest resource.

    step = t_layers + t_other + t_exposed + t_rows + sum(t_update) + sum(t_xla)
  - t_layers: the layer stages (forward + backward, streams overlapped: `stream_stage`), of
    which `layer_compute_secs` is their compute alone;
  - t_other: compute outside the layer stages (embedding, head, loss), seconds;
  - t_exposed: what the updates run layer by layer inside the backward pass (`overlapped`:
    (cost, L) each) add: they start once the first layer's gradient exists and run one after
    another, so with b the backward's share of t_layers (`backward_share`: measured from the
    timed scan bodies where the planner has them, else BACKWARD_SHARE), U their total and
    k = 1 + `sent_lag_layers`, max(k U / L, U + k b / L - b), the last k layers' updates at
    least (k = 2 where a streamed scan sends the gradients to pinned_host: XLA schedules the
    send of iteration t's gradient, its wait and the call after iteration t + 1's compute;
    `benchmarks/diagnostics/layer_call_order.py`), plus
    dha_contention(g) * min(D, b) for the DHA kernel's busy seconds D on the share g of the
    GPU's blocks (`profile.dha_layer_grid`: the kernel runs beside the compute on the GPU's
    SMs and HBM, and slows it);
  - t_rows: the updates of tables read in place, row by row on the host CPUs (`rows`: (cost,
    f) each, f the fraction of rows the step's ids name at most): the other rows' share
    (1 - f) runs while the step computes, so what it adds is f * cost, plus what of the rest
    the forward+backward does not cover once the layered updates have had the host CPUs;
  - t_update: each fused host update after the backward pass (`update_cost`);
  - t_xla: each `host_xla` leaf's copies (`xla_copy_cost`).
  The critical path is the resource that bounds the most seconds of the step.
  """
  updates, xla_copies, overlapped = list(updates), list(xla_copies), list(overlapped)
  rows = list(rows)
  up = sum(updates + [c for c, _ in rows], ZERO)
  serial = sum(updates, ZERO)
  xla = sum(xla_copies, ZERO)
  segments = [("forward+backward", layers.secs + other_compute_secs,
               layers.bound if layers.bound and layers.bound != "compute" else "compute")]
  if overlapped:
    total = sum(c.secs for c, _ in overlapped)
    num_layers = max(n for _, n in overlapped)
    backward = backward_share * layers.secs
    kernel = sum(c.dha_secs for c, _ in overlapped)
    k = min(num_layers, 1 + max(0, int(sent_lag_layers)))
    exposed = (max(k * total / num_layers, total + k * backward / num_layers - backward)
               + dha_contention(profile.dha_layer_grid) * min(kernel, backward))
    segments.append(("layered host update (exposed)", exposed,
                     _dominant([c for c, _ in overlapped])))
    up_all = up + sum((c for c, _ in overlapped), ZERO)
  else:
    up_all = up
  if rows:
    # The host's time during the forward+backward that the layered updates leave free.
    free = max(0.0, segments[0][1] - sum(c.secs for c, _ in overlapped))
    hidden = sum(c.secs * (1.0 - f) for c, f in rows)
    exposed = sum(c.secs * f for c, f in rows) + max(0.0, hidden - free)
    segments.append(("table rows update (exposed)", exposed, _dominant([c for c, _ in rows])))
  if serial.secs:
    segments.append(("host update", serial.secs, _dominant(updates)))
  if xla.secs:
    segments.append(("host_xla copies", xla.secs, _dominant(xla_copies)))
  step = sum(s[1] for s in segments)
  by_bound: dict[str, float] = {}
  for _, secs, bound in segments:
    by_bound[bound] = by_bound.get(bound, 0.0) + secs
  critical = max(by_bound, key=by_bound.get) if by_bound else "compute"
  everything = layers + up_all + xla
  compute = layer_compute_secs + other_compute_secs
  resource = {"compute": compute,
              "link_h2d": everything.h2d_bytes / bytes_per_sec(profile.link_h2d_gbps),
              "link_d2h": everything.d2h_bytes / bytes_per_sec(profile.link_d2h_gbps),
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


def safe_div(a: float, b: float) -> float:
  return a / b if b else (math.inf if a else 0.0)
