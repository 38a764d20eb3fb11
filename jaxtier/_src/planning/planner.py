"""The planner: a placement per state leaf, the bytes it implies, and admission control.

This first planner places by rule (issue: the cost-model planner comes later): under policy
'auto', every `optimizer_state` leaf goes to `pinned_host` and is updated there by the fused host
update, with an fp32 master copy for each bf16/f16 param whose update that serves; everything
else stays on the device. A user policy may place any floating leaf on the host explicitly. A
host leaf whose uses are not one elementwise pass is served by XLA's own memory-kind transfers
(`host_xla`), and the plan says why.

Placements (DESIGN.md's vocabulary):
- `device`: stays in HBM.
- `host_dha`: lives in pinned_host; a GPU kernel reads and writes it in place (direct host access).
- `host_cpu`: lives in pinned_host; host CPU threads compute its update (on the CPU backend, the
  CPU handler; this is the executor there). On a GPU, the CUDA handler drives them, staging
  gradients down and new params up through pinned buffers.
- `host_split`: lives in pinned_host; the DHA kernel and the host CPUs each update a share of
  its elements at once (the share from the hardware profile's rates: `profile.split_fraction`).
- `host_xla`: lives in pinned_host; XLA copies it to the device for the step and back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import warnings
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src import cost_model
from jaxtier._src import jax_compat as jc
from jaxtier._src import jaxpr_graph
from jaxtier._src import profile
from jaxtier._src import program_compiler
from jaxtier._src import streaming
from jaxtier._src import solver
from jaxtier._src.inventory import Inventory, LeafInfo, OPTIMIZER_STATE, PARAM
from jaxtier._src.primitives.host_update import ProgramTooLarge

DEVICE = "device"
HOST_DHA = "host_dha"
HOST_CPU = "host_cpu"
HOST_SPLIT = "host_split"
HOST_XLA = "host_xla"
HOST_STREAM = "host_stream"
PLACEMENTS = (DEVICE, HOST_DHA, HOST_CPU, HOST_SPLIT, HOST_XLA, HOST_STREAM)
HOST_PLACEMENTS = (HOST_DHA, HOST_CPU, HOST_SPLIT, HOST_XLA, HOST_STREAM)
EXECUTOR_PLACEMENTS = (HOST_DHA, HOST_CPU, HOST_SPLIT)

# The rule-based plan as a named policy: every optimizer-state leaf to the host, the rest on the
# device (what 'auto' does when the budgets force it).
OPTIMIZER_STATE_ON_HOST = "optimizer_state_on_host"
# Share of the device's memory a default budget leaves free (fragmentation, workspace).
DEVICE_MARGIN = 0.05

log = logging.getLogger("jaxtier")
USER_PLACED = "placed by the user's policy"
# What `pinnable_bytes` is, in a refusal, when it was measured on this host.
HERE_PINNABLE = "each local device's share of what this host can pin now"

Policy = str | Callable[[str, LeafInfo], "str | None"] | Mapping[str, str]


class PlanError(ValueError):
  """The state cannot be placed as asked (a budget, a leaf's dtype, an unknown placement).

  When a complete plan was refused (over a budget), `plan` holds it; else None.
  """

  plan: "Plan | None" = None


class AdmissionError(PlanError):
  """The plan needs more pinned host memory than the budget or the host allows.

  Raised before anything is allocated; the caller's state is untouched. `plan` holds the
  refused plan (for printing).
  """

  plan: "Plan | None" = None


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: "int | float | str | None", name: str) -> "int | None":
  """Bytes from an int/float (bytes) or a string like '80GB', '16GiB', '512MiB'; None = no limit.

  Raises:
    PlanError: not a size, or a size <= 0.
  """
  if value is None:
    return None
  if isinstance(value, str):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
      raise PlanError(f"{name}: expected a size like 80GB, 16GiB or a number of bytes, got "
                      f"{value!r}")
    nbytes = float(m.group(1)) * _UNITS[m.group(2).lower()]
  elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    nbytes = float(value)
  else:
    raise PlanError(f"{name}: expected bytes (int) or a size string, got {type(value).__name__}")
  if not nbytes > 0:
    raise PlanError(f"{name}: expected a size > 0 bytes, got {value!r}; pass None for no limit")
  return int(nbytes)


def format_bytes(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafPlan:
  """Where one leaf lives and why.

  Attributes:
    path: pytree path of the leaf in the state.
    shape, dtype, nbytes: the leaf (bytes per device).
    role: `param`, `optimizer_state` or `other`.
    placement: one of PLACEMENTS.
    memory_kind: 'device' or 'pinned_host'.
    master_nbytes: bytes of the fp32 master copy in pinned_host (0 when none).
    reason: why this placement.
  """

  index: int
  path: str
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  role: str
  placement: str
  memory_kind: str
  master_nbytes: int
  reason: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """The placement of every state leaf, with its byte totals (all per device).

  Attributes:
    leaves: one `LeafPlan` per state leaf.
    platform: 'cpu' or 'gpu'.
    device_bytes: state bytes held in device memory (HBM).
    pinned_bytes: state bytes held in pinned host memory, masters included.
    device_budget, host_budget: the limits planned against (None: no limit), bytes.
    num_host_updates: fused host-update custom calls per step.
    predicted_step_secs: the cost model's step time, seconds (None: not predicted).
    critical_path: the resource that bounds most of the step ('compute', 'link_h2d',
      'link_d2h', 'dha', 'host_cpu', 'host_dram').
    predicted_peak_hbm_bytes: predicted peak device memory per device: device state +
      transient buffers (gradients, activations, workspace) + stream buffers, bytes.
    resource_secs: busy seconds per step of each resource ('compute', 'link_h2d',
      'link_d2h', 'dha', 'host_cpu').
    segments: the step's serial phases: (name, seconds, bounding resource).
    activation_policy: the activation policy the prediction assumes.
    planned_device_budget: the device budget the solver planned against (the given one, or on
      a GPU without one, what the device has less a margin), bytes.
    notes: where the figures come from (profile, transient bytes), and warnings.
    compiler_peak_hbm_bytes: the compiled step's peak device memory from its
      `memory_analysis()` (set after compiling; None before, or where the backend reports none).
    measured_step_secs: the median wall time of the offloaded step's calls 2 to
      1 + MEASURED_STEPS, seconds, each synchronised (set once measured; None before).
  """

  leaves: tuple[LeafPlan, ...]
  platform: str
  device_bytes: int
  pinned_bytes: int
  device_budget: "int | None"
  host_budget: "int | None"
  num_host_updates: int
  predicted_step_secs: "float | None" = None
  critical_path: str = ""
  predicted_peak_hbm_bytes: "int | None" = None
  resource_secs: dict = dataclasses.field(default_factory=dict)
  segments: tuple = ()
  activation_policy: str = "as traced (not modelled)"
  planned_device_budget: "int | None" = None
  notes: tuple[str, ...] = ()
  compiler_peak_hbm_bytes: "int | None" = None
  measured_step_secs: "float | None" = None

  def bytes_by_memory_kind(self) -> dict[str, int]:
    """{'device': bytes, 'pinned_host': bytes} of the state, masters included."""
    return {"device": self.device_bytes, "pinned_host": self.pinned_bytes}

  def placements(self) -> dict[str, str]:
    """{leaf path: placement}."""
    return {leaf.path: leaf.placement for leaf in self.leaves}

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  def __str__(self) -> str:
    from rich.console import Console  # pylint: disable=g-import-not-at-top
    from rich.table import Table  # pylint: disable=g-import-not-at-top

    table = Table(title=f"jaxtier plan ({self.platform}): device {format_bytes(self.device_bytes)}"
                  f"{_budget(self.device_budget)}, pinned_host {format_bytes(self.pinned_bytes)}"
                  f"{_budget(self.host_budget)}, {self.num_host_updates} fused host updates/step")
    for col in ("leaf", "shape", "dtype", "bytes", "role", "placement", "reason"):
      table.add_column(col, overflow="fold")
    for leaf in self.leaves:
      size = format_bytes(leaf.nbytes)
      if leaf.master_nbytes:
        size += f" (+{format_bytes(leaf.master_nbytes)} fp32 master on host)"
      table.add_row(leaf.path, str(list(leaf.shape)), leaf.dtype, size, leaf.role, leaf.placement,
                    leaf.reason)
    console = Console(width=160, record=True, file=open(os.devnull, "w"))
    console.print(table)
    for line in self.prediction_lines():
      console.print(line, highlight=False, markup=False)
    return console.export_text()

  def prediction_lines(self) -> list[str]:
    """The predictions and notes, as printable lines."""
    lines = []
    if self.predicted_step_secs is not None:
      lines.append(f"predicted step: {self.predicted_step_secs * 1e3:.4g} ms, critical path: "
                   f"{self.critical_path}")
      lines.append("  phases: " + "; ".join(f"{name} {secs * 1e3:.4g} ms ({bound})"
                                           for name, secs, bound in self.segments))
      lines.append("  busy: " + ", ".join(f"{k} {v * 1e3:.4g} ms"
                                          for k, v in self.resource_secs.items() if v))
    if self.measured_step_secs is not None:
      ratio = ("" if not self.predicted_step_secs else
               f" (predicted / measured {self.predicted_step_secs / self.measured_step_secs:.2f})")
      lines.append(f"measured step: {self.measured_step_secs * 1e3:.4g} ms{ratio}")
    if self.predicted_peak_hbm_bytes is not None:
      budget = self.planned_device_budget
      lines.append(f"predicted peak HBM: {format_bytes(self.predicted_peak_hbm_bytes)} per device"
                   f"{'' if budget is None else f' of {format_bytes(budget)} planned'}"
                   + ("" if self.compiler_peak_hbm_bytes is None else
                      f"; compiler: {format_bytes(self.compiler_peak_hbm_bytes)}"))
    lines.append(f"pinned host: {format_bytes(self.pinned_bytes)} per device"
                 f"{_budget(self.host_budget)}")
    lines.append(f"activations: {self.activation_policy}")
    lines.extend(f"note: {n}" for n in self.notes)
    return lines


def _budget(b: "int | None") -> str:
  return "" if b is None else f" of {format_bytes(b)}"


def check_policy_form(policy: Any, api: str) -> None:
  """Raises PlanError unless `policy` is a named policy, a callable or a mapping."""
  if isinstance(policy, str) and policy in ("auto", "none", OPTIMIZER_STATE_ON_HOST):
    return
  if callable(policy) or isinstance(policy, Mapping):
    return
  raise PlanError(f"{api}: expected policy 'auto', 'none', '{OPTIMIZER_STATE_ON_HOST}', a "
                  f"callable (path, leaf) -> placement or a {{regex: placement}} dict, got "
                  f"{policy!r}")


def _requested(inv: Inventory, policy: Policy, host_exec: str, stream_blocked: str = ""
               ) -> dict[int, tuple[str, str]]:
  """Placement asked by the policy for each leaf, with its reason (`stream_blocked`: why no
  leaf may be streamed here, '' when they may)."""
  out: dict[int, tuple[str, str]] = {}
  if isinstance(policy, Mapping):
    for pat in policy:
      try:
        re.compile(pat)
      except (re.error, TypeError) as e:
        raise PlanError(f"jaxtier.offload: policy pattern {pat!r} is not a regular expression "
                        f"({e}); patterns are searched in leaf paths like "
                        f"{inv.leaves[0].path if inv.leaves else '[0]'!s} (escape brackets: "
                        "r\"\\['w1'\\]\")") from e
  for leaf in inv.leaves:
    auto = ((host_exec, "optimizer state: touched once per step, updated where it lives")
            if leaf.role == OPTIMIZER_STATE else (DEVICE, leaf.why if leaf.role != PARAM
                                                  else "parameter: read by the step's compute"))
    if policy in ("auto", OPTIMIZER_STATE_ON_HOST):
      out[leaf.index] = auto
    elif policy == "none":
      out[leaf.index] = (DEVICE, "policy 'none'")
    elif callable(policy):
      try:
        asked = policy(leaf.path, leaf)
      except Exception as e:  # pylint: disable=broad-except  (re-raised with the leaf named)
        raise PlanError(f"jaxtier.offload: the policy callable raised for leaf {leaf.path} "
                        f"({leaf.dtype}{list(leaf.shape)}): {e!r}; it is called as "
                        "policy(path: str, leaf) and returns a placement name or None") from e
      out[leaf.index] = auto if asked is None else (asked, USER_PLACED)
    elif isinstance(policy, Mapping):
      hit = next((p for pat, p in policy.items() if re.search(pat, leaf.path)), None)
      out[leaf.index] = auto if hit is None else (hit, USER_PLACED)
    else:
      check_policy_form(policy, "jaxtier.offload")
  if isinstance(policy, Mapping):
    for pat in policy:
      if not any(re.search(pat, leaf.path) for leaf in inv.leaves):
        warnings.warn(f"jaxtier.offload: policy pattern {pat!r} matches no state leaf (paths "
                      f"look like {inv.leaves[0].path if inv.leaves else 'none'}); the leaves it "
                      "was meant for get the automatic placement", stacklevel=4)
  for i, (placement, _) in out.items():
    leaf = inv.leaves[i]
    if placement not in PLACEMENTS:
      raise PlanError(f"jaxtier.offload: leaf {leaf.path}: unknown placement {placement!r}; "
                      f"expected one of {', '.join(PLACEMENTS)}")
    if placement == HOST_STREAM and leaf.role == OPTIMIZER_STATE:
      # A pattern for the layers' params also matches their optimizer state, whose paths
      # mirror them: that state is not read by the layer loop; it lives on the host, updated
      # in place by the fused host update, as a streamed param's optimizer state must.
      placement = host_exec
      out[i] = (placement, f"{USER_PLACED} as host_stream: optimizer state is not streamed; "
                "it lives in pinned_host, updated in place by the fused host update")
    if placement == HOST_STREAM:
      why = stream_blocked or streaming.stream_reason(inv.closed_jaxpr.jaxpr, i)
      if why:
        raise PlanError(
            f"jaxtier.offload: leaf {leaf.path} ({leaf.dtype}{list(leaf.shape)}) cannot be "
            f"placed 'host_stream': {why}. Streaming serves a stack of layers read by a layer "
            "loop (`jax.lax.scan`, `nnx.scan`) one slice per iteration; place this leaf "
            "'host_xla' (copied whole for the step) or keep it on the device"
            + (" (a policy pattern matched it: anchor the pattern to the params, e.g. "
               r"r'^\[0\]\['layers'\]')" if isinstance(policy, Mapping) else "") + ".")
    if placement in HOST_PLACEMENTS and not leaf.is_float:
      raise PlanError(
          f"jaxtier.offload: leaf {leaf.path} ({leaf.dtype}{list(leaf.shape)}) would be placed "
          f"{placement}, but only floating-point leaves can live on the host (the fused host "
          "update computes in floating point, and step counters are tiny). Keep it on the "
          "device: return None or 'device' for it from the policy.")
    if placement in EXECUTOR_PLACEMENTS and host_exec == HOST_CPU:
      out[i] = (HOST_CPU, out[i][1])  # on the CPU backend every executor is the CPU handler.
  return out


def make_plan(inv: Inventory, *, platform: str, policy: Policy = "auto",
              device_budget: "int | None" = None, host_budget: "int | None" = None,
              pinnable_bytes: "int | None" = None,
              hardware: "profile.HardwareProfile | None" = None,
              step_costs: "cost_model.StepCosts | None" = None,
              streamable: "frozenset[int] | set[int]" = frozenset(),
              dha_readable: "frozenset[int] | set[int]" = frozenset(),
              activations: "cost_model.ActivationModel | None" = None,
              resident_bytes: int = 0, pinnable_what: str = HERE_PINNABLE,
              stream_blocked: str = "") -> tuple[Plan, list[Any]]:
  """Plans every leaf of `inv` and checks the budgets.

  Under policy 'auto' (and for the leaves a callable / mapping policy leaves to 'auto') the
  solver (`solver.solve`) places optimizer state, parameters and the activation policy to
  minimise the predicted step time under the budgets; with no device budget and a state that
  fits (always, on the CPU backend), everything stays on the device. When nothing fits, every
  candidate optimizer-state leaf goes to the host (the rule of policy
  'optimizer_state_on_host') and the budget check below reports what is left over.

  Args:
    inv: the inventory of the traced step.
    platform: 'cpu' or 'gpu' (selects the executor: host_cpu or host_dha).
    policy: 'auto', 'none', a callable `(path, LeafInfo) -> placement | None`, or a
      `{regex: placement}` mapping matched against leaf paths (None/no match: auto).
    device_budget: bytes of device memory the step may use at its peak, per device (state and
      transient buffers). None: no limit on the CPU backend; on a GPU, what the device has
      (`default_device_budget`). The state's own device bytes over it are an error.
    host_budget: bytes of pinned host memory the plan may pin per device (None: no limit).
    pinnable_bytes: what the host can pin at most per device (None: do not check); see
      `pinnable_bytes()`.
    hardware: the rates and capacities (None: `profile.DEFAULT_PROFILE`).
    step_costs: FLOPs and transient bytes of the device-only step (None: FLOPs counted over the
      jaxpr, transient bytes estimated as the gradients).
    streamable: parameter leaves the lowering can stream (`host_stream`).
    dha_readable: parameter leaves a zero-copy read kernel can serve (`host_dha`).
    activations: the model's activation options (None: the traced policy, not modelled).
    resident_bytes: bytes of the state already allocated in this host's memory (the CPU
      backend's arrays), taken off what a plan without a device budget needs there.
    pinnable_what: where `pinnable_bytes` comes from, for the refusal's message (default: this
      host's free memory).
    stream_blocked: why no leaf may be placed `host_stream` here ('' when they may): a policy
      asking for it is refused with this reason.

  Returns:
    (plan, compiled components): the second is what the lowering runs.

  Raises:
    PlanError: an unknown placement, a non-float leaf placed on the host, or a state whose
      device bytes exceed `device_budget` (with every candidate leaf on the host).
    AdmissionError: pinned bytes over `host_budget` or over `pinnable_bytes`.
  """
  host_exec = HOST_DHA if platform == "gpu" else HOST_CPU
  hardware = hardware or profile.DEFAULT_PROFILE
  req = _requested(inv, policy, host_exec, stream_blocked)
  jaxpr, consts = inv.closed_jaxpr.jaxpr, list(inv.closed_jaxpr.consts)
  # host_stream leaves are read by the layer loops through the streaming calls and updated
  # in place by a fused host update, like the executor placements.
  streamed = {i for i, (p, _) in req.items() if p == HOST_STREAM}
  executor_leaves = {i for i, (p, _) in req.items() if p in EXECUTOR_PLACEMENTS} | streamed
  reasons = {i: r for i, (_, r) in req.items()}
  placement = {i: p for i, (p, _) in req.items()}
  user_fixed = {i for i, r in reasons.items() if r == USER_PLACED}
  compiled, masters = _cut(inv, placement, reasons, executor_leaves, hardware, host_exec)
  solve = policy not in ("none", OPTIMIZER_STATE_ON_HOST) and len(user_fixed) < len(inv.leaves)
  costs = step_costs or cost_model.StepCosts(
      flops=0.0, elementwise_bytes=0.0, transient_bytes=0,
      transient_source="estimate: the gradients only (no compiled step)")
  if step_costs is None:
    costs = dataclasses.replace(costs, **dict(zip(
        ("flops", "elementwise_bytes"), cost_model.jaxpr_costs(inv.closed_jaxpr))))
  solver_budget = device_budget
  notes = [f"hardware profile: {hardware.source}",
           f"transient device bytes (gradients, activations, workspace): "
           f"{costs.transient_source}",
           costs.compute_source(hardware)]
  if (device_budget is not None and platform == "gpu"
      and device_budget > hardware.hbm_bytes):
    notes.append(f"device budget {format_bytes(device_budget)} is above this GPU's memory "
                 f"({format_bytes(hardware.hbm_bytes)}, profile: {hardware.source}): the plan "
                 "may fit the budget and still not fit the device")
  if solver_budget is None and platform == "gpu":
    solver_budget, why = default_device_budget(hardware)
    notes.append(f"device budget: none given; planned against {format_bytes(solver_budget)} "
                 f"({why})")
  host_limit = min((b for b in (host_budget, pinnable_bytes) if b is not None), default=None)

  def problem_for(placed):
    return solver.build_problem(
        leaves=inv.leaves, jaxpr=jaxpr, compiled=compiled, master_nbytes={
            i: inv.leaves[i].nbytes * 4 // jnp.dtype(inv.leaves[i].dtype).itemsize
            for i in masters}, placement=placed, user_fixed=user_fixed, param_role=PARAM,
        step_costs=costs, streamable=frozenset(streamable) - user_fixed,
        dha_readable=frozenset(dha_readable) - user_fixed if platform == "gpu" else frozenset(),
        activations=activations, device_budget=solver_budget, host_budget=host_limit,
        profile=hardware, platform=platform)

  act_policy = None
  if solve:
    problem = problem_for(placement)
    sol = solver.solve(problem)
    _apply(sol, problem, inv, placement, reasons, executor_leaves, user_fixed, solver_budget)
    compiled, masters = _cut(inv, placement, reasons, executor_leaves, hardware, host_exec)
    if not sol.fits:
      notes.append(_not_fitting(sol, solver_budget, host_limit, problem,
                                placed=(inv, placement, user_fixed)))
    act_policy = sol.activation_policy
  # The prediction of the plan as it stands (every placement fixed).
  final = problem_for(placement)
  # A call's placement: its leaves' executor (a call of only host_stream leaves: the cut's).
  final_updates = {u: next((placement[i] for i in item.seeds if placement[i] != HOST_STREAM),
                           {"split": HOST_SPLIT}.get(cc.executor, cc.executor))
                   for u, (item, cc) in enumerate(zip(final.updates, compiled))}
  final_params = {p.index: placement[p.index] for p in final.params}
  pred = solver.evaluate_fixed(final, final_params, final_updates, act_policy).prediction
  if (solver_budget is not None and pred.peak_hbm_bytes > solver_budget
      and not any(n.startswith("DOES NOT FIT") for n in notes)):
    # The placements the user fixed (or the cut's fallbacks) leave the plan over the budget
    # although the solver's own search fitted: say so as loudly as an infeasible search.
    msg = (f"DOES NOT FIT: predicted peak device memory {format_bytes(pred.peak_hbm_bytes)} "
           f"exceeds the device budget of {format_bytes(solver_budget)} with the placements "
           "as given (the policy's fixed placements included)")
    log.warning("jaxtier: %s", msg)
    notes.append(msg)
  if solver_budget is None and platform == "cpu" and jax.default_backend() == "cpu":
    # No device budget on the CPU backend, but its device and pinned_host memory are both this
    # host's RAM: a plan that needs more than is available is said not to fit.
    # The state's arrays that already exist are in that RAM: not available, but not needed
    # again either.
    available = _mem_available_bytes()
    need = pred.peak_hbm_bytes + pred.pinned_bytes - resident_bytes
    if available is not None and need > available:
      msg = (f"DOES NOT FIT: on the CPU backend device and pinned_host memory are this host's "
             f"RAM: the plan needs {format_bytes(need)} more (peak "
             f"{format_bytes(pred.peak_hbm_bytes)} + pinned {format_bytes(pred.pinned_bytes)}"
             f"{f' - the state already allocated, {format_bytes(resident_bytes)}' if resident_bytes else ''}"
             f"), over the {format_bytes(available)} available now (no device budget was given); "
             "plan for the GPU with --platform=gpu (python -m jaxtier plan) or platform='gpu' "
             "(jaxtier.plan)")
      log.warning("jaxtier: %s", msg)
      notes.append(msg)
  if activations is not None:
    chosen = act_policy or activations.traced
    act_label = f"{chosen} (jax.checkpoint_policies.{activations.checkpoint_policy[chosen]})"
    if chosen != activations.traced:
      act_label += f"; the traced step uses {activations.traced}: apply it in the model"
  else:
    act_label = "as traced (not modelled)"
  leaves = []
  device_bytes = pinned_bytes = 0
  for leaf in inv.leaves:
    p = placement[leaf.index]
    kind = "pinned_host" if p in HOST_PLACEMENTS else "device"
    master = leaf.index in masters
    master_nbytes = leaf.nbytes * 4 // jnp.dtype(leaf.dtype).itemsize if master else 0
    reason = reasons[leaf.index]
    if master:
      reason = (f"{reason}; its update runs on the host from an fp32 master copy, the new "
                f"{leaf.dtype} value is sent to the device")
    leaves.append(LeafPlan(index=leaf.index, path=leaf.path, shape=leaf.shape, dtype=leaf.dtype,
                           nbytes=leaf.nbytes, role=leaf.role, placement=p, memory_kind=kind,
                           master_nbytes=master_nbytes, reason=reason))
    if kind == "device":
      device_bytes += leaf.nbytes
    else:
      pinned_bytes += leaf.nbytes
    pinned_bytes += master_nbytes
  plan = Plan(tuple(leaves), platform, device_bytes, pinned_bytes, device_budget, host_budget,
              len(compiled), predicted_step_secs=pred.step_secs,
              critical_path=pred.critical_path, predicted_peak_hbm_bytes=pred.peak_hbm_bytes,
              resource_secs=dict(pred.resource_secs), segments=tuple(pred.segments),
              activation_policy=act_label, planned_device_budget=solver_budget,
              notes=tuple(notes))
  try:
    _admit(plan, pinnable_bytes, pinnable_what)
  except PlanError as e:
    e.plan = plan
    raise
  return plan, compiled


def _cut(inv: Inventory, placement: dict[int, str], reasons: dict[int, str],
         executor_leaves: set[int], hardware: "profile.HardwareProfile", host_exec: str
         ) -> tuple[list[Any], set[int]]:
  """Cuts the host updates around `executor_leaves` and compiles each into an op program.

  A component that cannot run as one op program falls back to `host_xla` (placement, reason and
  `executor_leaves` are updated in place); re-cut until stable. `host_stream` leaves are in
  `executor_leaves` (their update is a fused host update) but their reads by layer loops do
  not taint; their call's executor is its other leaves' (else `host_exec`).

  Returns:
    (compiled components, indices of the bf16/f16 params that get fp32 masters).
  """
  jaxpr, consts = inv.closed_jaxpr.jaxpr, list(inv.closed_jaxpr.consts)
  while True:
    streamed = {i for i in executor_leaves if placement[i] == HOST_STREAM}
    comps = jaxpr_graph.components(jaxpr, executor_leaves, streamed)
    demoted = False
    compiled, masters = [], set()
    for comp in comps:
      if not comp.eqns:  # only read where it lives (streamed, or returned as is): no update
        continue
      why = comp.why
      comp_masters: set[int] = set()
      if comp.elementwise:
        comp_masters = _masters_for(jaxpr, comp, inv)
        try:
          cc = program_compiler.compile_component(
              jaxpr, consts, comp, frozenset(comp_masters), frozenset(executor_leaves))
          # One executor per fused call: the one the user's policy asked for most (else the
          # automatic choice); ties go to the first in name order.
          execs = [i for i in comp.seeds if placement[i] != HOST_STREAM]
          chosen = [placement[i] for i in execs if reasons[i] == USER_PLACED] or [
              placement[i] for i in execs] or [host_exec]
          executor = max(sorted(set(chosen)), key=chosen.count)
          for i in comp.seeds:
            if placement[i] == HOST_STREAM:
              if f"updated in place by {executor}" not in reasons[i]:
                reasons[i] += f"; updated in place by {executor}"
            elif placement[i] != executor:
              reasons[i] += f"; updated with the leaves it shares a fused call with ({executor})"
              placement[i] = executor
          compiled.append(dataclasses.replace(
              cc, executor={HOST_SPLIT: "split"}.get(executor, executor),
              dha_fraction=profile.split_fraction(hardware)))
        except (program_compiler.Unsupported, ProgramTooLarge) as e:
          why = str(e)
      if why or not comp.elementwise:
        params = [i for i in comp.seeds if inv.leaves[i].role == PARAM]
        for i in comp.seeds:
          user_placed = reasons[i] == USER_PLACED
          executor_leaves.discard(i)
          placement[i] = HOST_XLA
          if params:
            # The usual cause: a parameter placed with an executor is read by the forward
            # pass too, which ties every host leaf of the step into one non-elementwise cut.
            reasons[i] = (
                f"update not one elementwise pass: the host parameter "
                f"{inv.leaves[params[0]].path} is {inv.leaves[params[0]].why}, so its reads "
                f"and update are one computation ({why}): XLA memory-kind transfers. A stack of "
                "layers read by a layer loop can be placed 'host_stream' instead")
          else:
            reasons[i] = f"update not one elementwise pass ({why}): XLA memory-kind transfers"
          # Warned where the user placed the leaf; for the planner's own candidates the
          # solver decides next (most stay on the device), so only logged.
          (log.warning if user_placed else log.info)(
              "jaxtier: leaf %s falls back to host_xla: %s", inv.leaves[i].path, reasons[i])
        demoted = True
      else:
        masters |= comp_masters
    if not demoted:
      return compiled, masters


def default_device_budget(hardware: "profile.HardwareProfile") -> tuple[int, str]:
  """(bytes, why) of the device budget planned against when none is given, on a GPU.

  What JAX's allocator may use on this machine's GPU (`memory_stats()['bytes_limit']`), or
  the profile's `hbm_bytes` when planning for a GPU that is not here, less DEVICE_MARGIN for
  fragmentation and compiler workspace the model does not see.
  """
  limit, where = hardware.hbm_bytes, f"the profile's HBM ({hardware.device_kind})"
  if jax.default_backend() == "gpu":
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
      limit, where = int(stats["bytes_limit"]), "what JAX's allocator may use on this GPU"
  return int(limit * (1 - DEVICE_MARGIN)), f"{where} less {DEVICE_MARGIN:.0%}"


def _apply(sol: "solver.Solution", problem: "solver.Problem", inv: Inventory,
           placement: dict[int, str], reasons: dict[int, str], executor_leaves: set[int],
           user_fixed: set[int], budget: "int | None") -> None:
  """Writes the solver's choices into `placement`, `reasons` and `executor_leaves`."""
  pred = sol.prediction
  fit = ("no device budget" if budget is None else
         f"predicted peak {format_bytes(pred.peak_hbm_bytes)} of the "
         f"{format_bytes(budget)} device budget")
  if not sol.fits:
    fit = "no plan fits the budgets; the rule-based plan keeps it here: see the notes"
  for u, item in enumerate(problem.updates):
    if item.fixed:
      continue
    where = sol.updates[u]
    cost = item.costs.get(where)
    for i in item.seeds:
      if where == DEVICE:
        placement[i] = DEVICE
        executor_leaves.discard(i)
        reasons[i] = (f"optimizer state: fits on the device ({fit}); on the host its update "
                      f"would add {item.best()[1].secs * 1e3:.3g} ms per step")
      elif not sol.fits:
        placement[i] = where
        executor_leaves.add(i)
        reasons[i] = (f"optimizer state: no plan fits the budgets, so on the host as the "
                      f"rule-based plan has it; updated by {where} "
                      f"({cost.secs * 1e3:.3g} ms per step after the backward pass)")
      else:
        placement[i] = where
        executor_leaves.add(i)
        reasons[i] = (f"optimizer state: moved to pinned_host to fit the device budget "
                      f"(frees {format_bytes(item.device_nbytes)} with its call's other "
                      f"leaves); its fused update ({where}) adds {cost.secs * 1e3:.3g} ms per "
                      f"step after the backward pass, bound by {cost.bound}" if budget is not None
                      else f"optimizer state: on the host, updated by {where}")
  for p in problem.params:
    where = sol.params.get(p.index, DEVICE)
    placement[p.index] = where
    if where == DEVICE:
      reasons[p.index] = (f"parameter: read by the step's compute; stays on the device "
                          f"({fit})")
    else:
      executor_leaves.add(p.index)  # its update runs where it lives, in a fused host update
      how = ("prefetched layer by layer ahead of its use" if where == HOST_STREAM else
             "read in place by the GPU (zero-copy)")
      reasons[p.index] = (f"parameter: lives in pinned_host, {how}, to fit the device budget "
                          f"(frees {format_bytes(p.nbytes + p.grad_nbytes)} with its "
                          f"gradient); its optimizer state is updated on the host")
  # Leaves served by XLA's transfers are on the device during the step anyway: they stay there
  # unless nothing fits (then every candidate goes to the host, as the rule-based plan did).
  for leaf in inv.leaves:
    i = leaf.index
    if placement[i] == HOST_XLA and i not in user_fixed and sol.fits:
      placement[i] = DEVICE
      reasons[i] = (f"{reasons[i].split(': XLA')[0]}: served by XLA's transfers it would be on "
                    "the device during the step anyway (no peak saved); kept on the device")


# The DOES NOT FIT note's clause for a host limit that binds before the device budget;
# `_admit` quotes it from the plan's notes in its refusal.
_HOST_LIMIT_CLAUSE = "moving every leaf it may move to the host would pin"


def _not_fitting(sol: "solver.Solution", budget: "int | None", host_limit: "int | None",
                 problem: "solver.Problem | None" = None,
                 placed: "tuple[Inventory, Mapping[int, str], set[int]] | None" = None) -> str:
  """The DOES NOT FIT note: what the plan made is, and which budget it misses by how much.

  `placed`: (inventory, final placement per leaf index, leaves the user's policy placed), to
  describe the plan actually made (else: the rule-based plan's rule).
  """
  pred = sol.prediction
  parts = []
  if problem is not None and host_limit is not None:
    # What the host would have to pin for the least device memory the planner can reach:
    # every movable optimizer-state call and every parameter it may stream or read zero-copy.
    most = problem.fixed_pinned_bytes + sum(it.pinned_nbytes for it in problem.updates) + sum(
        p.nbytes for p in problem.params if set(p.options) - {solver.DEVICE})
    if most > host_limit:
      parts.append(f"{_HOST_LIMIT_CLAUSE} {format_bytes(most)}, over the host limit of "
                   f"{format_bytes(host_limit)}")
  if budget is not None and pred.peak_hbm_bytes > budget:
    parts.append(f"predicted peak device memory {format_bytes(pred.peak_hbm_bytes)} exceeds the "
                 f"device budget of {format_bytes(budget)}")
  if host_limit is not None and pred.pinned_bytes > host_limit:
    parts.append(f"pinned bytes {format_bytes(pred.pinned_bytes)} exceed the host limit of "
                 f"{format_bytes(host_limit)}")
  what = "the rule-based plan (every optimizer-state leaf on the host)"
  if placed is not None:
    inv, where, by_user = placed
    groups: dict[tuple[str, str, bool], int] = {}
    for leaf in inv.leaves:
      if where[leaf.index] in HOST_PLACEMENTS:
        key = (leaf.role, where[leaf.index], leaf.index in by_user)
        groups[key] = groups.get(key, 0) + 1
    names = {OPTIMIZER_STATE: "optimizer-state leaves", PARAM: "parameters"}
    host = [f"{n} {names.get(role, 'other leaves')} ({p}{', placed by the policy' if user else ''})"
            for (role, p, user), n in sorted(groups.items())]
    what = ("its fallback plan: " + (", ".join(host) + " in pinned_host, the rest on the device"
                                     if host else "every leaf on the device"))
  msg = (f"DOES NOT FIT: no placement the planner can make fits the budgets; this is {what}: "
         + "; ".join(parts or ["over a budget"]))
  log.warning("jaxtier: %s", msg)
  return msg


def _masters_for(jaxpr: Any, comp: jaxpr_graph.Component, inv: Inventory) -> set[int]:
  """bf16/f16 params read by `comp` whose new value `comp` computes: they get fp32 masters."""
  read = set()
  for k in comp.eqns:
    read.update(v for v in jaxpr.eqns[k].invars if not isinstance(v, jc.Literal))
  out = set()
  for leaf in inv.leaves:
    if leaf.dtype in ("bfloat16", "float16") and leaf.index not in comp.seeds and (
        jaxpr.invars[leaf.index] in read and leaf.index in comp.outputs):
      out.add(leaf.index)
  return out


def _largest(leaves: list[LeafPlan], key: Callable[[LeafPlan], int], k: int = 5) -> str:
  top = sorted(leaves, key=key, reverse=True)[:k]
  return "; ".join(f"{leaf.path} {format_bytes(key(leaf))}" for leaf in top if key(leaf))


def _prefix_regex(leaves: list[LeafPlan]) -> str:
  """A policy regex matching the first path component of the largest of `leaves`."""
  top = max(leaves, key=lambda l: l.nbytes).path
  m = re.match(r"(\[[^\]]*\]|\.[A-Za-z_]\w*)", top)
  return "^" + re.escape(m.group(1) if m else top)


def _admit(plan: Plan, pinnable_bytes: "int | None", pinnable_what: str = HERE_PINNABLE
           ) -> None:
  host = [l for l in plan.leaves if l.memory_kind == "pinned_host" or l.master_nbytes]
  host_bytes = lambda l: (l.nbytes if l.memory_kind == "pinned_host" else 0) + l.master_nbytes
  for limit, what, fix in (
      (plan.host_budget, "the host budget", "raise host_budget, or keep more leaves on the "
       "device (policy)"),
      (pinnable_bytes, pinnable_what, "free host "
       "memory, keep more leaves on the device (policy), or shard replicated host leaves over "
       "the mesh" + ("; on a GPU, XLA's pinned pool is capped by "
                     "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 by default): raise it "
                     "if the host has the memory" if plan.platform == "gpu" else ""))):
    if limit is not None and plan.pinned_bytes > limit:
      raise AdmissionError(
          f"jaxtier: plan refused before allocating anything: it needs "
          f"{format_bytes(plan.pinned_bytes)} ({plan.pinned_bytes} bytes) of pinned host memory "
          f"per device, "
          f"over {what} of {format_bytes(limit)} ({limit} bytes). Largest host leaves: "
          f"{_largest(host, host_bytes)}. Fix: {fix}.")
  if plan.device_budget is not None and plan.device_bytes > plan.device_budget:
    dev = [l for l in plan.leaves if l.memory_kind == "device"]
    # Where offloading more would pin more than the host may, the notes say so: the binding
    # limit is then the host's, and a policy alone cannot help.
    host_note = next((m.group(0) for n in plan.notes
                      for m in [re.search(re.escape(_HOST_LIMIT_CLAUSE) + "[^;]*", n)] if m),
                     None)
    raise PlanError(
        f"jaxtier: the state needs {format_bytes(plan.device_bytes)} ({plan.device_bytes} bytes) "
        f"of device memory after offloading, over the device budget of "
        f"{format_bytes(plan.device_budget)} ({plan.device_budget} bytes). Largest device "
        f"leaves: {_largest(dev, lambda l: l.nbytes)}. Fix: raise device_budget, or place "
        f"more leaves on the host with a policy (e.g. policy={{{_prefix_regex(dev)!r}: "
        "'host_xla'})." + ("" if host_note is None else
                          f" But the host limit binds first: {host_note} (the smaller of "
                          "host_budget and what the host can pin; on a GPU "
                          "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB raises XLA's pinned pool, if the "
                          "host has the memory)"))


def pinnable_bytes(platform: str, num_local_devices: int = 1) -> "int | None":
  """Bytes each of this process's devices can still pin: its share of MemAvailable.

  Plans count bytes per device, and every device of this process keeps its shards of the host
  leaves in this host's memory: a replicated host leaf on 8 local GPUs is pinned 8 times, an
  FSDP-sharded one once in 8 pieces. So the host's MemAvailable is split evenly over
  `num_local_devices` (the state's mesh devices that this process addresses). On GPU, each
  device's share is also capped by XLA's pinned pool, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 GiB
  by default; ../shared/MEASURED.md); XLA's GPU client makes one such pool per device for
  pinned_host buffers (read in XLA's allocator setup, not measured with several GPUs). Other
  processes on the same host (one process per GPU) are not seen: each assumes the host's free
  memory is its own.

  Args:
    platform: 'cpu' or 'gpu'.
    num_local_devices: devices of this process sharing the host's memory (>= 1).

  Returns:
    Bytes per device, or None where /proc/meminfo is unavailable.
  """
  available = _mem_available_bytes()
  if available is None:
    return None
  share = available // max(1, num_local_devices)
  if platform == "gpu":
    cap = float(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64")) * 2**30
    return int(min(share, cap))
  return share


def _mem_available_bytes() -> "int | None":
  """The host's MemAvailable from /proc/meminfo, bytes (None where it cannot be read)."""
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    return None
