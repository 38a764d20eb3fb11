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
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src import jaxpr_graph
from jaxtier._src import profile
from jaxtier._src import program_compiler
from jaxtier._src import streaming
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

log = logging.getLogger("jaxtier")
USER_PLACED = "placed by the user's policy"

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
  """

  leaves: tuple[LeafPlan, ...]
  platform: str
  device_bytes: int
  pinned_bytes: int
  device_budget: "int | None"
  host_budget: "int | None"
  num_host_updates: int

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
    return console.export_text()


def _budget(b: "int | None") -> str:
  return "" if b is None else f" of {format_bytes(b)}"


def _requested(inv: Inventory, policy: Policy, host_exec: str) -> dict[int, tuple[str, str]]:
  """Placement asked by the policy for each leaf, with its reason."""
  out: dict[int, tuple[str, str]] = {}
  for leaf in inv.leaves:
    auto = ((host_exec, "optimizer state: touched once per step, updated where it lives")
            if leaf.role == OPTIMIZER_STATE else (DEVICE, leaf.why if leaf.role != PARAM
                                                  else "parameter: read by the step's compute"))
    if policy == "auto":
      out[leaf.index] = auto
    elif policy == "none":
      out[leaf.index] = (DEVICE, "policy 'none'")
    elif callable(policy):
      asked = policy(leaf.path, leaf)
      out[leaf.index] = auto if asked is None else (asked, USER_PLACED)
    elif isinstance(policy, Mapping):
      hit = next((p for pat, p in policy.items() if re.search(pat, leaf.path)), None)
      out[leaf.index] = auto if hit is None else (hit, USER_PLACED)
    else:
      raise PlanError(f"jaxtier.offload: expected policy 'auto', 'none', a callable "
                      f"(path, leaf) -> placement or a {{regex: placement}} dict, got {policy!r}")
  if isinstance(policy, Mapping):
    for pat in policy:
      if not any(re.search(pat, leaf.path) for leaf in inv.leaves):
        log.warning("jaxtier.offload: policy pattern %r matches no state leaf (paths look like "
                    "%s)", pat, inv.leaves[0].path if inv.leaves else "none")
  for i, (placement, _) in out.items():
    leaf = inv.leaves[i]
    if placement not in PLACEMENTS:
      raise PlanError(f"jaxtier.offload: leaf {leaf.path}: unknown placement {placement!r}; "
                      f"expected one of {', '.join(PLACEMENTS)}")
    if placement == HOST_STREAM:
      why = streaming.stream_reason(inv.closed_jaxpr.jaxpr, i)
      if why:
        raise PlanError(
            f"jaxtier.offload: leaf {leaf.path} ({leaf.dtype}{list(leaf.shape)}) cannot be "
            f"placed 'host_stream': {why}. Streaming serves a stack of layers read by a layer "
            "loop (`jax.lax.scan`, `nnx.scan`) one slice per iteration; place this leaf "
            "'host_xla' (copied whole for the step) or keep it on the device.")
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
              hardware: "profile.HardwareProfile | None" = None) -> tuple[Plan, list[Any]]:
  """Plans every leaf of `inv` and checks the budgets.

  Args:
    inv: the inventory of the traced step.
    platform: 'cpu' or 'gpu' (selects the executor: host_cpu or host_dha).
    policy: 'auto', 'none', a callable `(path, LeafInfo) -> placement | None`, or a
      `{regex: placement}` mapping matched against leaf paths (None/no match: auto).
    device_budget: bytes of device memory the state may take per device (None: no limit).
    host_budget: bytes of pinned host memory the plan may pin per device (None: no limit).
    pinnable_bytes: what the host can pin at most per device (None: do not check); see
      `pinnable_bytes()`.
    hardware: rates for the `host_split` share (None: `profile.DEFAULT_PROFILE`).

  Returns:
    (plan, compiled components): the second is what the lowering runs.

  Raises:
    PlanError: an unknown placement, a non-float leaf placed on the host, or a state whose
      device bytes exceed `device_budget`.
    AdmissionError: pinned bytes over `host_budget` or over `pinnable_bytes`.
  """
  host_exec = HOST_DHA if platform == "gpu" else HOST_CPU
  req = _requested(inv, policy, host_exec)
  jaxpr, consts = inv.closed_jaxpr.jaxpr, list(inv.closed_jaxpr.consts)
  # host_stream leaves are read by the layer loops through the streaming calls and updated
  # in place by a fused host update, like the executor placements.
  streamed = {i for i, (p, _) in req.items() if p == HOST_STREAM}
  executor_leaves = {i for i, (p, _) in req.items() if p in EXECUTOR_PLACEMENTS} | streamed
  reasons = {i: r for i, (_, r) in req.items()}
  placement = {i: p for i, (p, _) in req.items()}
  compiled: list[Any] = []
  masters: set[int] = set()
  while True:  # Drop leaves whose component cannot run as one op program; re-cut until stable.
    comps = jaxpr_graph.components(jaxpr, executor_leaves, streamed & executor_leaves)
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
              dha_fraction=profile.split_fraction(hardware or profile.DEFAULT_PROFILE)))
        except (program_compiler.Unsupported, ProgramTooLarge) as e:
          why = str(e)
      if why or not comp.elementwise:
        for i in comp.seeds:
          executor_leaves.discard(i)
          placement[i] = HOST_XLA
          reasons[i] = f"update not one elementwise pass ({why}): XLA memory-kind transfers"
          log.warning("jaxtier: leaf %s falls back to host_xla: %s", inv.leaves[i].path,
                      reasons[i])
        demoted = True
      else:
        masters |= comp_masters
    if not demoted:
      break
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
              len(compiled))
  try:
    _admit(plan, pinnable_bytes)
  except PlanError as e:
    e.plan = plan
    raise
  return plan, compiled


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


def _admit(plan: Plan, pinnable_bytes: "int | None") -> None:
  host = [l for l in plan.leaves if l.memory_kind == "pinned_host" or l.master_nbytes]
  host_bytes = lambda l: (l.nbytes if l.memory_kind == "pinned_host" else 0) + l.master_nbytes
  for limit, what, fix in (
      (plan.host_budget, "the host budget", "raise host_budget, or keep more leaves on the "
       "device (policy)"),
      (pinnable_bytes, "each local device's share of what this host can pin now", "free host "
       "memory, keep more leaves on the device (policy), or shard replicated host leaves over "
       "the mesh")):
    if limit is not None and plan.pinned_bytes > limit:
      raise AdmissionError(
          f"jaxtier: plan refused before allocating anything: it needs "
          f"{format_bytes(plan.pinned_bytes)} ({plan.pinned_bytes} bytes) of pinned host memory "
          f"per device, "
          f"over {what} of {format_bytes(limit)} ({limit} bytes). Largest host leaves: "
          f"{_largest(host, host_bytes)}. Fix: {fix}.")
  if plan.device_budget is not None and plan.device_bytes > plan.device_budget:
    dev = [l for l in plan.leaves if l.memory_kind == "device"]
    raise PlanError(
        f"jaxtier: the state needs {format_bytes(plan.device_bytes)} ({plan.device_bytes} bytes) "
        f"of device memory after offloading, over the device budget of "
        f"{format_bytes(plan.device_budget)} ({plan.device_budget} bytes). Largest device "
        f"leaves: {_largest(dev, lambda l: l.nbytes)}. Fix: raise device_budget, or place "
        f"more leaves on the host with a policy (e.g. policy={{{_prefix_regex(dev)!r}: "
        "'host_xla'}).")


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
