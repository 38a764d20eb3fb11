"""The placement registry: one frozen record per `Placement`, the one home of what it means.

A record says where a leaf under the placement lives (its memory kind), who updates it in
place (its executor), how many pinned host bytes it holds, which leaves may take it
(`PlacementRecord.refusal`), what the cost model charges for it (`param_traffic`,
`param_buffer_bytes`, `dha_share`) and how the lowering treats it (`Schedule`). Policy, cut,
problem, solver, cost model and lowering read these records; adding a placement kind means
adding a record here (and its member to `vocab.Placement`).

Units: bytes per device.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any, Callable, Mapping

from jaxtier._src.analysis import layer_stacks, lookups
from jaxtier._src.analysis.inventory import Inventory, LeafInfo
from jaxtier._src.vocab import Executor, MemoryKind, Placement, Role


class Schedule(enum.StrEnum):
  """How the lowering treats a leaf under a placement (`lowering/`)."""

  RESIDENT = "resident"  # a device buffer the compiled step reads and donates
  # pinned_host, read only by its fused host update, which writes it where it lives
  UPDATED_IN_PLACE = "updated_in_place"
  # pinned_host; XLA's memory-kind transfers copy it in for the step and its new value out
  COPIED = "copied"
  # pinned_host; a stack of layers the streaming calls prefetch one layer ahead of its use
  # (`lowering/streaming.py`), updated in place by its fused host update
  STREAMED = "streamed"
  # pinned_host; an embedding table whose rows the DHA gather reads in place
  # (`lowering/lookups.py`), updated in place by its fused host update
  GATHERED = "gathered"

  @property
  def fused_update(self) -> bool:
    """Whether a fused host update updates the leaf where it lives."""
    return self in (Schedule.UPDATED_IN_PLACE, Schedule.STREAMED, Schedule.GATHERED)

  @property
  def served(self) -> bool:
    """Whether a custom call serves the leaf to the step's compute (its fused call's executor
    is then its call's other leaves')."""
    return self in (Schedule.STREAMED, Schedule.GATHERED)


class RefusalKind(enum.StrEnum):
  """Why a leaf may not take a placement."""

  NOT_A_STACK = "not_a_stack"  # host_stream: not a stack of layers read by a layer loop
  NOT_A_TABLE = "not_a_table"  # host_dha parameter: not an embedding table read by rows
  NOT_FLOAT = "not_float"  # on the host: only floating-point leaves


@dataclasses.dataclass(frozen=True)
class Refusal:
  """A leaf refused a placement (`PlacementRecord.refusal`).

  Attributes:
    placement: the placement refused.
    kind: why, as a kind.
    why: the analysis's sentence saying why ('' for `NOT_FLOAT`).
  """

  placement: Placement
  kind: RefusalKind
  why: str = ""


@dataclasses.dataclass(frozen=True)
class StageTraffic:
  """What a parameter under a placement moves over the link per step, bytes per device.

  Attributes:
    fetch_bytes: layers prefetched by the copy engines (fetched forward and backward).
    grad_bytes: its gradient sent down layer by layer.
    dha_read_bytes: bytes the DHA kernel reads in place.
    dha_write_bytes: gradient bytes written to pinned_host in place.
  """

  fetch_bytes: int = 0
  grad_bytes: int = 0
  dha_read_bytes: int = 0
  dha_write_bytes: int = 0


_NO_TRAFFIC = StageTraffic()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementRecord:
  """What one placement means to the planner, the cost model and the lowering.

  Attributes:
    placement: the placement.
    memory_kind: where a leaf under it lives between steps.
    executor: who updates a leaf under it in place (the fused host update's executor), or
      None (on the device, copied by XLA, or streamed: a stream's call takes its executor
      from its other leaves).
    schedule: how the lowering treats a leaf under it that is not a parameter.
    param_schedule: how the lowering treats a parameter under it.
    param_option: whether the solver may choose it for a parameter.
    param_pinned_per_byte: pinned bytes per byte of a parameter under it (a table read in
      place: 2, the table and the buffer its gradient rows are scatter-added into).
    grad_buffers: pinned buffers of the parameter's gradient as sent (a stream: 2, the buffer
      the backward writes each layer's gradient into and the compiled step's pinned_host output
      of it, which the update program reads; H200, 8b: one 7 GiB streamed leaf, 49 GiB
      pinned_host live against 35 GiB of state).
    dha_share: the share of an update's elements the DHA kernel takes under this executor
      (1: all, 0: none, None: the split's, `profile.split_fraction` unless given); None
      without an executor.
    check: the placement's own eligibility test `(inventory, leaf, stream_blocked) ->
      Refusal | None`, before the memory kind's (see `refusal`).
    traffic: the cost hook of a parameter under it: `(ParamItem) -> StageTraffic`.
    buffers: device bytes a parameter under it holds while its stage runs (double buffers
      or gathered rows): `(ParamItem) -> int`.
  """

  placement: Placement
  memory_kind: MemoryKind
  executor: "Executor | None"
  schedule: Schedule
  param_schedule: Schedule
  param_option: bool = False
  param_pinned_per_byte: int = 1
  grad_buffers: int = 0
  dha_share: "float | None" = None
  check: "Callable[[Inventory, LeafInfo, str], Refusal | None] | None" = None
  traffic: Callable[[Any], StageTraffic] = lambda p: _NO_TRAFFIC
  buffers: Callable[[Any], int] = lambda p: 0

  @property
  def on_host(self) -> bool:
    """Whether a leaf under it lives in pinned_host."""
    return self.memory_kind is MemoryKind.PINNED_HOST

  @property
  def fused_update(self) -> bool:
    """Whether a fused host update updates a leaf under it where it lives (either role)."""
    return self.schedule.fused_update

  def schedule_of(self, role: str) -> Schedule:
    """How the lowering treats a leaf of `role` (`vocab.Role`) under it."""
    return self.param_schedule if role == Role.PARAM else self.schedule

  def pinned_bytes(self, nbytes: int, *, role: str, sent_grad_nbytes: int = 0) -> int:
    """Pinned host bytes of a leaf of `nbytes` and `role` under it; a parameter's gradient
    buffers hold `sent_grad_nbytes` each (its gradient as sent: in bf16 where it is a bf16
    value widened)."""
    if not self.on_host:
      return 0
    if role != Role.PARAM:
      return nbytes
    return nbytes * self.param_pinned_per_byte + self.grad_buffers * sent_grad_nbytes

  def refusal(self, inv: Inventory, leaf: LeafInfo, stream_blocked: str = "") -> "Refusal | None":
    """Why `leaf` of `inv` may not take this placement, or None when it may.

    `stream_blocked`: why no leaf may be streamed here ('' when they may). A parameter read in
    place by rows is checked as a table only; every other leaf in pinned_host must be
    floating point.
    """
    if self.check is not None:
      got = self.check(inv, leaf, stream_blocked)
      if got is not None or self.schedule_of(leaf.role) is Schedule.GATHERED:
        return got
    if self.on_host and not leaf.is_float:
      return Refusal(self.placement, RefusalKind.NOT_FLOAT)
    return None


def _stack_check(inv: Inventory, leaf: LeafInfo, stream_blocked: str) -> "Refusal | None":
  why = stream_blocked or layer_stacks.stream_reason(inv.closed_jaxpr.jaxpr, leaf.index)
  return Refusal(Placement.HOST_STREAM, RefusalKind.NOT_A_STACK, why) if why else None


def _table_check(inv: Inventory, leaf: LeafInfo, stream_blocked: str) -> "Refusal | None":
  # A parameter is read in place only as an embedding table (its rows gathered by the DHA
  # kernel, its gradient rows scatter-added on the host); its optimizer state's executor is
  # its fused call's.
  del stream_blocked
  if leaf.role != Role.PARAM:
    return None
  got = lookups.table_lookup(inv.closed_jaxpr.jaxpr, leaf.index)
  if isinstance(got, lookups.NotATable):
    return Refusal(Placement.HOST_DHA, RefusalKind.NOT_A_TABLE, got.why)
  return None


def _executor(placement: Placement, executor: Executor, dha_share: "float | None", *,
              param_schedule: Schedule = Schedule.UPDATED_IN_PLACE,
              **kw: Any) -> PlacementRecord:
  """The record of a placement whose leaves `executor` updates in place in pinned_host."""
  return PlacementRecord(placement=placement, memory_kind=MemoryKind.PINNED_HOST,
                         executor=executor, schedule=Schedule.UPDATED_IN_PLACE,
                         param_schedule=param_schedule, dha_share=dha_share, **kw)


_RECORDS = (
    PlacementRecord(placement=Placement.DEVICE, memory_kind=MemoryKind.DEVICE, executor=None,
                    schedule=Schedule.RESIDENT, param_schedule=Schedule.RESIDENT,
                    param_option=True),
    PlacementRecord(
        placement=Placement.HOST_STREAM, memory_kind=MemoryKind.PINNED_HOST, executor=None,
        schedule=Schedule.STREAMED, param_schedule=Schedule.STREAMED, param_option=True,
        grad_buffers=2, check=_stack_check,
        traffic=lambda p: StageTraffic(fetch_bytes=p.nbytes, grad_bytes=p.stream_grad_nbytes),
        # Double buffers of one layer: its params and its gradient, x 2.
        buffers=lambda p: 2 * (p.nbytes + p.grad_nbytes) // max(1, p.num_layers)),
    _executor(
        Placement.HOST_DHA, Executor.HOST_DHA, 1.0, param_schedule=Schedule.GATHERED,
        param_option=True, param_pinned_per_byte=2, check=_table_check,
        traffic=lambda p: StageTraffic(dha_read_bytes=p.dha_read_nbytes,
                                       dha_write_bytes=p.dha_write_nbytes),
        # A table read in place holds only the rows it gathers and their gradient rows.
        buffers=lambda p: p.dha_read_nbytes + p.dha_write_nbytes),
    _executor(Placement.HOST_CPU, Executor.HOST_CPU, 0.0),
    _executor(Placement.HOST_SPLIT, Executor.SPLIT, None),
    PlacementRecord(placement=Placement.HOST_XLA, memory_kind=MemoryKind.PINNED_HOST,
                    executor=None, schedule=Schedule.COPIED, param_schedule=Schedule.COPIED),
)

# {placement: its record}, in the order the solver weighs a parameter's placements (device,
# then host_stream, then host_dha) and the executors (host_dha, host_cpu, host_split).
REGISTRY: Mapping[Placement, PlacementRecord] = types.MappingProxyType(
    {r.placement: r for r in _RECORDS})
assert set(REGISTRY) == set(Placement), "every Placement has one record"

# The placements whose leaves a fused host update updates where they live, by their executor.
EXECUTOR_PLACEMENTS = tuple(p for p, r in REGISTRY.items() if r.executor is not None)
HOST_PLACEMENTS = tuple(p for p, r in REGISTRY.items() if r.on_host)
# The placements the solver may choose for a parameter, device first.
PARAM_PLACEMENTS = tuple(p for p, r in REGISTRY.items() if r.param_option)


def record(placement: str) -> PlacementRecord:
  """The record of `placement` (a `Placement` or its name).

  Raises:
    ValueError: `placement` names no placement.
  """
  try:
    return REGISTRY[placement]  # (a StrEnum member and its name hash and compare alike)
  except KeyError:
    raise ValueError(f"{placement!r} is not a placement; expected one of "
                     f"{', '.join(Placement)}") from None


_BY_EXECUTOR = types.MappingProxyType(
    {r.executor: p for p, r in REGISTRY.items() if r.executor is not None})


def of_executor(executor: str) -> Placement:
  """The placement whose leaves `executor` (an `Executor` or its name) updates in place.

  Raises:
    ValueError: `executor` names no executor.
  """
  return _BY_EXECUTOR[Executor(executor)]


def schedule_of(placement: str, role: str) -> Schedule:
  """How the lowering treats a leaf of `role` placed `placement`."""
  return record(placement).schedule_of(role)


def streamed(placement: str) -> bool:
  """Whether `placement` streams its leaves layer by layer (`Schedule.STREAMED`)."""
  return record(placement).param_schedule is Schedule.STREAMED


def served(placement: str, role: str) -> bool:
  """Whether a custom call serves a leaf of `role` placed `placement` to the step's compute."""
  return record(placement).schedule_of(role).served
