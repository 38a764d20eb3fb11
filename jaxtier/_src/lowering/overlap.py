"""Per-layer host updates inside the backward pass, overlapped with the GPU's compute.

A fused host update of a leaf stacked over layers (`[L, ...]`, the params of an `nnx.scan` or
linen `scan` and their optimizer state) reads that leaf's gradient as the `ys` output of the
backward scan. Lowered here, the scan is unrolled and layer t's update is issued as soon as
iteration t has made its gradient slice: one `host_update_layer` call over elements
[t * n, (t + 1) * n) of every stacked operand, writing the new params, moments and masters in
place while iterations t - 1 ... 0 are differentiated. A `join` at the end of the program hands
the written buffers back (XLA's stream waits there for the host work) and keeps every value the
calls read alive until then.

Why in the backward pass rather than across the step boundary: the state the step returns is
final (a caller reading it, or a checkpoint, sees the serial step's values), and the forward
of the next step needs no per-layer wait. The cost is the exposed tail (the last layer's update,
and the leaves outside the stack, which stay in the serial update program).

Which components run so, and how each is cut, the plan records (`Plan.schedule`, decided
by `analysis/update_schedule.py`, which the planner costs); `schedule` builds that record and
raises `ScheduleError` where this lowering cannot (a mesh, or a schedule of tables or scratch
buffers other than the plan's). A gradient that a streamed scan sends to a pinned_host
scratch buffer is read there: the call reads the landed window.

The writes are unseen by XLA: each call names iteration t's outputs as order-only operands
(every read of slice t, in the forward or the backward, comes before), and the written buffers
are read afterwards only through the join's results.

The speculative lowering (`schedule(..., speculate=True)`) also runs the guarded components
(a clipped step's: `analysis/update_schedule.py`) layer by layer, reading their late predicates
as guessed; its caller (`rewrite.py`) points every written buffer at a spare one, so that the
state is only read. Otherwise the guarded components are serial.

An embedding table read in place (`host_dha`, `lowering/dha_tables.py`) is updated row by row
instead (`TableRows`): its gradient is zero on every row the step's ids do not name, and those
rows' update (AdamW's moment decay, weight decay) needs nothing the step computes. One
`host_update_rows` call over those rows is issued right after the forward's row gather and runs
on the host CPUs while the GPU computes the rest of the step; a second one updates the rows the
ids name once their gradient rows are in the pinned_host buffer, and zeroes them there, so that
the scatter-add of the next step adds into zeros without zeroing the whole buffer. Both read
every operand the serial update reads, at the same values: the same numbers. The join hands
back the table, its state and the gradient buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jaxtier._src.analysis import jaxpr_graph
from jaxtier._src.analysis import update_schedule
from jaxtier._src.analysis.op_program_compiler import CompiledComponent
from jaxtier._src.lowering import dha_tables
from jaxtier._src.lowering import streaming
from jaxtier._src.primitives.base import ffi_disabled
from jaxtier._src.planning.placements import Schedule, schedule_of
from jaxtier._src.vocab import MemoryKind


@dataclasses.dataclass(frozen=True)
class LayeredUpdate:
  """One component run layer by layer inside scan `scan`.

  Attributes:
    component: index into the plan's components.
    scan: index of the top-level scan equation.
    length: L, the scan's length and every vector operand's leading dimension.
    count: n, elements per layer.
    grads: per operand position of the component: the `ys` position (in the scan's outvars) of
      the gradient it reads, for the operands that are a gradient.
    targets: per result: the operand position it is written into; an operand position past
      the component's operands names `extra[k]`.
    extra: state leaves (device) appended as operands, written by results that read no old
      value of their leaf (a bf16 param made from its master).
    hoist: equations after the scan that compute its other operands (the learning rate, the
      step count: they depend on nothing the scan makes), run before the scan instead.
    buffers: per result, the buffer its target is: ('leaf', state leaf index) or
      ('master', the param leaf index of an fp32 master).
    sent: operand position -> scratch index, for the gradients a streamed scan sends to a
      pinned_host scratch buffer: the call reads layer t's window there in place, issued once
      the window has landed (`streaming.run_scan`'s `on_landed`), not when it is computed.
    narrow: operand position -> the dtype its gradient slice is passed in, for the gradients
      on the device that are exactly a bf16 value widened (`jaxpr_graph.narrow_source_dtype`):
      the slice the call reads, copies down (host_cpu) and keeps alive until the join is half
      the fp32 one; the update widens it as it loads it.
    guards: the operand positions of the late predicates the calls read as guessed
      (`update_schedule.UpdateSchedule.guards`; only in a speculative lowering).
    unread: the late scalar operands the guessed calls do not read, passed as 1.0.
  """

  component: int
  scan: int
  length: int
  count: int
  grads: dict[int, int]
  targets: tuple[int, ...]
  extra: tuple[int, ...] = ()
  hoist: tuple[int, ...] = ()
  buffers: tuple[tuple[str, int], ...] = ()
  sent: dict[int, int] = dataclasses.field(default_factory=dict)
  rows: "TableRows | None" = None
  narrow: dict[int, Any] = dataclasses.field(default_factory=dict)
  guards: tuple[int, ...] = ()
  unread: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class TableRows:
  """How a `LayeredUpdate` of a table read in place runs row by row (its `scan` is then the
  gather's equation: the hoisted equations run before it; `length` is V, `count` D).

  Attributes:
    gather: the forward's row gather (the early call is issued after it, with its ids).
    scatter: the gradient's scatter-add (the late call is issued after it).
    grad: the operand position of the gradient (zero in the early call; the pinned_host
      buffer in the late one, which zeroes its rows).
    scratch: the gradient buffer's scratch index.
    table: the table's state-leaf index.
  """

  gather: int
  scatter: int
  grad: int
  scratch: int
  table: int


@dataclasses.dataclass(frozen=True)
class OverlapSchedule:
  """The components updated layer by layer, and why the others are not.

  Attributes:
    updates: the layered components.
    host_leaves: pinned_host state leaves they write (donated to the compute program).
    masters: param leaves whose fp32 masters they write (donated to the compute program).
    device_leaves: device state leaves they write in place.
    serial: component index -> why it stays in the serial update program.
  """

  updates: tuple[LayeredUpdate, ...] = ()
  host_leaves: tuple[int, ...] = ()
  masters: tuple[int, ...] = ()
  device_leaves: tuple[int, ...] = ()
  serial: "dict[int, update_schedule.Refusal]" = dataclasses.field(default_factory=dict)

  def by_scan(self, k: int) -> list[LayeredUpdate]:
    return [u for u in self.updates if u.scan == k and u.rows is None]

  @property
  def scans(self) -> set[int]:
    """The layer loops with layered updates."""
    return {u.scan for u in self.updates if u.rows is None}

  @property
  def tables(self) -> list[LayeredUpdate]:
    """The updates of tables read in place, run row by row."""
    return [u for u in self.updates if u.rows is not None]

  def order(self, num_eqns: int) -> list[int]:
    """The top-level equations in the order the lowering runs them: each layered scan after
    the equations hoisted before it, the rest as traced."""
    hoist: dict[int, set[int]] = {}
    for u in self.updates:
      hoist.setdefault(u.scan, set()).update(u.hoist)
    moved = set().union(*hoist.values()) if hoist else set()
    out: list[int] = []
    for k in range(num_eqns):
      if k in moved:
        continue
      out.extend(e for e in sorted(hoist.get(k, ())) if e not in out)
      out.append(k)
    return out

  @property
  def components(self) -> set[int]:
    return {u.component for u in self.updates}

  @property
  def guarded(self) -> bool:
    """Whether any update runs on guessed predicates (a speculative lowering)."""
    return any(u.guards for u in self.updates)


EMPTY = OverlapSchedule()


class ScheduleError(ValueError):
  """The lowering cannot build the update schedule the plan records (`Plan.schedule`): the
  plan was made for another state (a mesh), other options (`overlap_update`, the
  `JAXTIER_DISABLE_FFI` switch), or not by the planner."""


def schedules(jaxpr: Any, plan: Any, shardings: "Sequence[Any] | None" = None,
              enabled: bool = True, speculate: bool = False
              ) -> tuple[streaming.StreamSchedule, OverlapSchedule, dha_tables.LookupSchedule]:
  """The streaming schedule of `plan`'s host_stream leaves (`streaming.schedule`), the tables
  read in place (`dha_tables.schedule`; their gradient buffers follow the streamed gradients'
  among the scratch buffers, and the returned streaming schedule lists both), and given them
  the overlapped host updates the plan records (`schedule`): what the lowering of `plan` runs.

  Raises:
    ScheduleError: as `schedule`.
  """
  host_eqns = {k for cc in plan.components for k in cc.component.eqns}
  stream = streaming.schedule(
      jaxpr, [l.index for l in plan.leaves
              if schedule_of(l.placement, l.role) is Schedule.STREAMED], host_eqns)
  lookup = dha_tables.schedule(jaxpr, plan, host_eqns, len(stream.scratch))
  stream = dataclasses.replace(stream, scratch=stream.scratch + lookup.scratch,
                               sent_vars={**stream.sent_vars, **lookup.sent_vars})
  return stream, schedule(jaxpr, plan, stream, shardings, enabled, lookup, speculate), lookup


def schedule(jaxpr: Any, plan: Any, stream: streaming.StreamSchedule,
             shardings: "Sequence[Any] | None" = None, enabled: bool = True,
             lookup: "dha_tables.LookupSchedule" = dha_tables.EMPTY,
             speculate: bool = False) -> OverlapSchedule:
  """The components of `plan` run layer by layer in the backward pass or row by row, as
  `plan.schedule` records (module doc).

  Args:
    jaxpr: the traced step's top-level jaxpr (state leaves first among its invars).
    plan: the plan: its components, its leaves (memory kind per state leaf) and its schedule.
    stream: the streaming schedule (a streamed leaf's gradient goes to a scratch buffer).
    shardings: one `NamedSharding` per state leaf, or None.
    enabled: `OffloadOptions.overlap_update`: False where the plan runs none during the step.
    lookup: the tables read in place (their gradient buffers).
    speculate: run the guarded components layered, on guessed predicates (the speculative
      lowering); False: they are serial (reason: they wait for every gradient).

  Returns:
    The schedule; `serial` gives each other component's reason (an `update_schedule.Refusal`).

  Raises:
    ScheduleError: the plan records no schedule of its components, or one this lowering
      cannot build: a layered or row update under `overlap_update=False` or
      `JAXTIER_DISABLE_FFI`, of a leaf sharded over a mesh, or of a table whose gradient the
      lookup schedule does not send to a pinned_host buffer.
  """
  compiled = plan.components
  if not compiled:
    return EMPTY
  records = plan.schedule if speculate else update_schedule.unguessed(plan.schedule)
  if [s.component for s in records] != list(range(len(compiled))):
    raise ScheduleError(f"the plan records the schedule of {len(records)} host updates, not of "
                        f"its {len(compiled)} (a plan made by `jaxtier.plan` records it)")
  updates: list[LayeredUpdate] = []
  serial: dict[int, update_schedule.Refusal] = {}
  for rec in records:
    if rec.mode == update_schedule.Mode.SERIAL:
      serial[rec.component] = rec.reason
      continue
    cc = compiled[rec.component]
    what = (f"the plan runs the host update of {plan.leaves[cc.component.seeds[0]].path} "
            f"{rec.mode} during the step, but")
    if not enabled:
      raise ScheduleError(f"{what} overlap_update is off: plan with the same options")
    if ffi_disabled():
      raise ScheduleError(f"{what} JAXTIER_DISABLE_FFI is set (no custom call runs): plan "
                          "with the same setting")
    leaf = rec.table if rec.mode == update_schedule.Mode.ROWS else cc.component.seeds[0]
    sh = shardings[leaf] if shardings is not None else None
    if sh is not None and getattr(sh, "mesh", None) is not None and sh.mesh.size > 1:
      raise ScheduleError(f"{what} {plan.leaves[leaf].path} is sharded over a mesh of "
                          f"{sh.mesh.size} devices: plan for the state as it is sharded")
    if rec.mode == update_schedule.Mode.ROWS:
      updates.append(_table_update(rec, cc, lookup, what))
    else:
      updates.append(_layer_update(rec, cc, jaxpr, stream))
  host, masters, device = set(), set(), set()
  for u in updates:
    for kind, i in u.buffers:
      if kind == "master":
        masters.add(i)
      elif plan.leaves[i].memory_kind == MemoryKind.PINNED_HOST:
        host.add(i)
      else:
        device.add(i)
  return OverlapSchedule(tuple(updates), tuple(sorted(host)), tuple(sorted(masters)),
                         tuple(sorted(device)), serial)


def _layer_update(rec: update_schedule.UpdateSchedule, cc: CompiledComponent, jaxpr: Any,
                  stream: streaming.StreamSchedule) -> LayeredUpdate:
  """The `LayeredUpdate` of a layered record: its gradients read where a streamed scan sends
  them, or passed in bf16 where they are a bf16 value widened."""
  grads = dict(rec.grads)
  sent = {p: stream.sent_vars[cc.operands[p].var] for p in grads
          if cc.operands[p].var in stream.sent_vars}
  scan = jaxpr.eqns[rec.loop]
  return LayeredUpdate(rec.component, rec.loop, rec.length, rec.count, grads, rec.targets,
                       rec.extra, hoist=rec.hoist, buffers=rec.buffers, sent=sent,
                       narrow={p: d for p, j in grads.items() if p not in sent
                               and (d := jaxpr_graph.scan_ys_narrow_dtype(scan, j))
                               is not None},
                       guards=rec.guards, unread=rec.unread)


def _table_update(rec: update_schedule.UpdateSchedule, cc: CompiledComponent,
                  lookup: "dha_tables.LookupSchedule", what: str) -> LayeredUpdate:
  """The `LayeredUpdate` of a row-by-row record, its gradient in the lookup schedule's
  pinned_host buffer.

  Raises:
    ScheduleError: the lookup schedule does not gather the table at the record's gather or
      does not send its gradient to a buffer at the record's scatter.
  """
  s = lookup.sent_vars.get(cc.operands[rec.grad].var)
  if (s is None or lookup.gathers.get(rec.loop) != rec.table
      or lookup.scatters.get(rec.scatter) != s):
    raise ScheduleError(f"{what} the table's gather and gradient scatter are not lowered as "
                        "the plan's schedule says (the plan was made for another step)")
  return LayeredUpdate(rec.component, rec.loop, rec.length, rec.count, {}, rec.targets,
                       rec.extra, hoist=rec.hoist, buffers=rec.buffers,
                       rows=TableRows(rec.loop, rec.scatter, rec.grad, s, rec.table))
