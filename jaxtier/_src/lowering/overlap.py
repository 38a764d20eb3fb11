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

Which components qualify (`schedule`; otherwise they stay serial, with the reason):
- every vector operand is `[L, ...]` with N = L * n elements: the gradient (a `ys` output of
  one top-level scan; a streamed scan sends it to a pinned_host scratch buffer, and the call
  reads the landed window there), the leaf and its moments and master; every scalar operand
  (the learning rate, the bias corrections) depends on nothing that scan computes. A scalar
  computed from every gradient (a global-norm clip, a non-finite check) must wait for the whole
  backward pass: such a component stays serial, so that the layered ones compute what the
  serial step does (the unrolled backward scan, compiled apart from the rolled one, may round a
  gradient differently in the last bit);
- each result is a state leaf's new value (or its master), returned by the step only as that
  leaf; a device leaf written in place is read elsewhere only as `xs` by the layer loop and by
  loops it depends on (so every read of layer t's slice comes before iteration t's call);
- the leaf is not sharded over a mesh.

The writes are unseen by XLA: each call names iteration t's outputs as order-only operands
(every read of slice t, in the forward or the backward, comes before), and the written buffers
are read afterwards only through the join's results.

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
from typing import Any, Callable, Sequence

import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import jaxpr_graph
from jaxtier._src.analysis import layer_stacks
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
  serial: dict[int, str] = dataclasses.field(default_factory=dict)

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


EMPTY = OverlapSchedule()


def schedules(jaxpr: Any, plan: Any, shardings: "Sequence[Any] | None" = None,
              enabled: bool = True
              ) -> tuple[streaming.StreamSchedule, OverlapSchedule, dha_tables.LookupSchedule]:
  """The streaming schedule of `plan`'s host_stream leaves (`streaming.schedule`), the tables
  read in place (`dha_tables.schedule`; their gradient buffers follow the streamed gradients'
  among the scratch buffers, and the returned streaming schedule lists both), and given them
  the overlapped host updates (`schedule`): what the lowering of `plan` runs."""
  host_eqns = {k for cc in plan.components for k in cc.component.eqns}
  stream = streaming.schedule(
      jaxpr, [l.index for l in plan.leaves
              if schedule_of(l.placement, l.role) is Schedule.STREAMED], host_eqns)
  lookup = dha_tables.schedule(jaxpr, plan, host_eqns, len(stream.scratch))
  stream = dataclasses.replace(stream, scratch=stream.scratch + lookup.scratch,
                               sent_vars={**stream.sent_vars, **lookup.sent_vars})
  return (stream, schedule(jaxpr, plan.components, plan.leaves, stream, shardings, enabled,
                           lookup), lookup)


def schedule(jaxpr: Any, compiled: Sequence[CompiledComponent], leaves: Sequence[Any],
             stream: streaming.StreamSchedule, shardings: "Sequence[Any] | None" = None,
             enabled: bool = True, lookup: "dha_tables.LookupSchedule" = dha_tables.EMPTY
             ) -> OverlapSchedule:
  """Which components of `compiled` run layer by layer in the backward pass (module doc).

  Args:
    jaxpr: the traced step's top-level jaxpr (state leaves first among its invars).
    compiled: the plan's components.
    leaves: the plan's `LeafPlan`s (memory kind per state leaf).
    stream: the streaming schedule (a streamed leaf's gradient goes to a scratch buffer).
    shardings: one `NamedSharding` per state leaf, or None.
    enabled: False keeps every component serial (`OffloadOptions.overlap_update`).
    lookup: the tables read in place (their updates run row by row where they qualify).

  Returns:
    The schedule; `serial` gives each other component's reason.
  """
  if not compiled:
    return EMPTY
  if not enabled or ffi_disabled():
    why = "overlap_update is off" if not enabled else "JAXTIER_DISABLE_FFI is set"
    return OverlapSchedule(serial={c: why for c in range(len(compiled))})
  n_state = len(leaves)
  loops = layer_stacks.LayerLoops(jaxpr)
  uses, producer = loops.uses, loops.producer
  out_count: dict[Any, int] = {}
  for v in jaxpr.outvars:
    if isinstance(v, jc.Var):
      out_count[v] = out_count.get(v, 0) + 1

  def scan_only(var: Any, own: set[int], k: int) -> bool:
    """Read only by the component, by layer loop k as `xs`, and by loops as `xs` that k
    depends on (the forward scan): every such read comes before k's iterations' calls."""
    for j in uses.get(var, []):
      if j in own:
        continue
      eqn = jaxpr.eqns[j]
      if eqn.primitive.name != "scan":
        return False
      xs = set(range(sum(jc.scan_counts(eqn)), len(eqn.invars)))
      if any(x is var and p not in xs for p, x in enumerate(eqn.invars)):
        return False
      if j != k and not (j < k and any(isinstance(x, jc.Var) and x in loops.tainted(j)
                                       for x in jaxpr.eqns[k].invars)):
        return False
    return True

  in_components = {k for cc in compiled for k in cc.component.eqns}

  def hoisted(k: int, values: list[Any]) -> "tuple[int, ...] | str":
    """Equations after equation k that make `values`, or why they cannot run before it."""
    need, stack = set(), [producer[v] for v in values if producer.get(v, -1) > k]
    made_at_k = set(jaxpr.eqns[k].outvars)
    while stack:
      e = stack.pop()
      if e in need:
        continue
      if e in in_components:
        return "an operand is computed by another host update"
      if any(isinstance(x, jc.Var) and x in made_at_k for x in jaxpr.eqns[e].invars):
        return ("a scalar operand depends on the step's compute (a global-norm clip or a "
                "non-finite check)")
      need.add(e)
      stack.extend(producer[x] for x in jaxpr.eqns[e].invars
                   if isinstance(x, jc.Var) and producer.get(x, -1) > k)
    return tuple(sorted(need))

  updates: list[LayeredUpdate] = []
  serial: dict[int, str] = {}
  table_scratch = {s for s in lookup.sent_vars.values()}
  for c, cc in enumerate(compiled):
    if any(spec.kind == "value" and stream.sent_vars.get(spec.var) in table_scratch
           for spec in cc.operands):
      got = _table_rows(c, cc, jaxpr, leaves, n_state, lookup, shardings, uses, out_count)
    else:
      got = _layered(c, cc, jaxpr, leaves, n_state, stream, shardings, loops, scan_only,
                     out_count)
    if not isinstance(got, str):
      early = [spec.var for p, spec in enumerate(cc.operands)
               if spec.kind == "value" and p not in got.grads
               and (got.rows is None or p != got.rows.grad)]
      hoist = hoisted(got.scan, early)
      got = hoist if isinstance(hoist, str) else dataclasses.replace(got, hoist=hoist)
    if isinstance(got, str):
      serial[c] = got
    else:
      updates.append(got)
  host, masters, device = set(), set(), set()
  for u in updates:
    for kind, i in u.buffers:
      if kind == "master":
        masters.add(i)
      elif leaves[i].memory_kind == MemoryKind.PINNED_HOST:
        host.add(i)
      else:
        device.add(i)
  return OverlapSchedule(tuple(updates), tuple(sorted(host)), tuple(sorted(masters)),
                         tuple(sorted(device)), serial)


def _layered(c: int, cc: CompiledComponent, jaxpr: Any, leaves: Sequence[Any], n_state: int,
             stream: streaming.StreamSchedule, shardings: Any, loops: layer_stacks.LayerLoops,
             scan_only: Any, out_count: dict[Any, int]) -> "LayeredUpdate | str":
  """The layered form of component `c`, or why it has none."""
  seed = cc.component.seeds[0]
  sh = shardings[seed] if shardings is not None else None
  if sh is not None and getattr(sh, "mesh", None) is not None and sh.mesh.size > 1:
    return "sharded over a mesh"
  got = loops.of(cc)
  if isinstance(got, str):
    return got
  k, grads = got
  sent = {p: stream.sent_vars[cc.operands[p].var] for p in grads
          if cc.operands[p].var in stream.sent_vars}
  length = int(jaxpr.eqns[k].params["length"])
  count = int(np.prod(cc.results[0].shape)) // length
  own = set(cc.component.eqns)
  for spec in cc.operands:
    if spec.kind == "host" and not scan_only(jaxpr.invars[spec.index], own, k):
      return f"host leaf {leaves[spec.index].path} is read outside its update"
  def over_device_leaf(r: Any, j: int) -> "int | str | None":
    if out_count.get(jaxpr.outvars[j], 0) != 1:
      return f"the step returns {leaves[j].path}'s new value more than once"
    leaf = leaves[j]
    if (leaf.memory_kind != MemoryKind.DEVICE or tuple(leaf.shape) != tuple(r.shape)
        or np.dtype(leaf.dtype) != np.dtype(r.dtype)):
      return f"the new value of {leaves[j].path} is not written over that device leaf"
    old = jaxpr.invars[j]
    if old in jaxpr.outvars or not scan_only(old, own, k):
      return (f"{leaves[j].path}'s old value is read outside the layer loops (for example "
              "cast or scaled before the scan)")
    at = [p for p, spec in enumerate(cc.operands) if spec.kind == "value" and spec.var is old]
    return at[0] if at else None

  got = _targets(cc, leaves, n_state, over_device_leaf)
  if isinstance(got, str):
    return got
  targets, extra = got
  return LayeredUpdate(c, k, length, count, grads, tuple(targets), tuple(extra),
                       buffers=_buffers(cc, targets, extra, jaxpr), sent=sent,
                       narrow={p: d for p, j in grads.items() if p not in sent
                               and (d := jaxpr_graph.scan_ys_narrow_dtype(jaxpr.eqns[k], j))
                               is not None})


def _targets(cc: CompiledComponent, leaves: Sequence[Any], n_state: int,
             over_leaf: Callable[[Any, int], "int | str | None"]
             ) -> "tuple[list[int], list[int]] | str":
  """(per result the operand position it is written into, the extra state leaves appended as
  operands), or why the results cannot be written in place. A result that is state leaf j's
  new value without overwriting an operand goes where `over_leaf(result, j)` says: an operand
  position, None for a new extra operand (leaf j itself), or a reason it cannot."""
  targets: list[int] = []
  extra: list[int] = []
  for r in cc.results:
    got = _result_target(r, cc, leaves, n_state)
    if isinstance(got, str):
      return got
    kind, j = got
    at = j if kind == "operand" else over_leaf(r, j)
    if isinstance(at, str):
      return at
    if at is None:
      at = len(cc.operands) + len(extra)
      extra.append(j)
    targets.append(at)
  if len(set(targets)) != len(targets):
    return "two results write one buffer"
  return targets, extra


def _result_target(r: Any, cc: CompiledComponent, leaves: Sequence[Any], n_state: int
                   ) -> "tuple[str, int] | str":
  """Where result `r` goes: ('operand', its position) when it overwrites a host leaf or a
  master in place, ('leaf', j) when it is state leaf j's new value otherwise, or why it can
  be neither."""
  if r.alias >= 0 and cc.operands[r.alias].kind in ("host", "master"):
    spec = cc.operands[r.alias]
    if spec.kind == "host" and tuple(r.outputs) != (spec.index,):
      return f"the step returns {leaves[spec.index].path}'s new value more than once"
    if spec.kind == "master" and r.outputs:
      return "a master's new value is returned"
    return "operand", r.alias
  if len(r.outputs) != 1 or r.outputs[0] >= n_state:
    return "a result is not one state leaf's new value"
  return "leaf", r.outputs[0]


def _buffers(cc: CompiledComponent, targets: Sequence[int], extra: Sequence[int], jaxpr: Any
             ) -> tuple[tuple[str, int], ...]:
  """Per target, the buffer it is (`LayeredUpdate.buffers`)."""
  buffers = []
  for t in targets:
    spec = cc.operands[t] if t < len(cc.operands) else None
    buffers.append(("leaf", extra[t - len(cc.operands)]) if spec is None
                   else ("master", spec.index) if spec.kind == "master"
                   else ("leaf", spec.index) if spec.kind == "host"
                   else ("leaf", jaxpr.invars.index(spec.var)))
  return tuple(buffers)


def _table_rows(c: int, cc: CompiledComponent, jaxpr: Any, leaves: Sequence[Any], n_state: int,
                lookup: "dha_tables.LookupSchedule", shardings: Any, uses: dict[Any, list[int]],
                out_count: dict[Any, int]) -> "LayeredUpdate | str":
  """The row-by-row form of the update of a table read in place, or why it has none."""
  if ffi_disabled():
    return "JAXTIER_DISABLE_FFI is set"
  grads = [p for p, spec in enumerate(cc.operands)
           if spec.kind == "value" and spec.var in lookup.sent_vars]
  if len(grads) != 1:
    return "it reads more than one table's gradient"
  grad = grads[0]
  s = lookup.sent_vars[cc.operands[grad].var]
  scatter = next(k for k, v in lookup.scatters.items() if v == s)
  table = lookup.scratch[s - min(lookup.sent_vars.values())].leaf
  gather = next(k for k, i in lookup.gathers.items() if i == table)
  sh = shardings[table] if shardings is not None else None
  if sh is not None and getattr(sh, "mesh", None) is not None and sh.mesh.size > 1:
    return "sharded over a mesh"
  shape = tuple(leaves[table].shape)
  size = int(np.prod(shape))
  own = set(cc.component.eqns)
  for p, spec in enumerate(cc.operands):
    if p == grad or spec.kind == "const":
      continue
    n = int(np.prod(spec.var.aval.shape)) if spec.kind == "value" else None
    if spec.kind == "value" and n != 1:
      return "a vector operand of the table's update is on the device"
    if spec.kind == "host":
      if int(np.prod(leaves[spec.index].shape)) != size:
        return f"host leaf {leaves[spec.index].path} is not shaped like the table"
      readers = set(uses.get(jaxpr.invars[spec.index], ())) - own
      if readers - ({gather} if spec.index == table else set()):
        return f"host leaf {leaves[spec.index].path} is read outside its update"
  def over_host_leaf(r: Any, j: int) -> "str | None":
    leaf = leaves[j]
    if (out_count.get(jaxpr.outvars[j], 0) != 1 or leaf.memory_kind != MemoryKind.PINNED_HOST
        or int(np.prod(leaf.shape)) != size or np.dtype(leaf.dtype) != np.dtype(r.dtype)):
      return f"the new value of {leaf.path} is not written over that host leaf"
    if set(uses.get(jaxpr.invars[j], ())) - own - ({gather} if j == table else set()):
      return f"host leaf {leaf.path} is read outside its update"
    return None

  got = _targets(cc, leaves, n_state, over_host_leaf)
  if isinstance(got, str):
    return got
  targets, extra = got
  return LayeredUpdate(c, gather, shape[0], size // shape[0], {}, tuple(targets), tuple(extra),
                       buffers=_buffers(cc, targets, extra, jaxpr),
                       rows=TableRows(gather, scatter, grad, s, table))
