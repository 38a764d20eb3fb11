"""When each fused host update runs: after the backward pass, layer by layer inside it, or row
by row during the step.

`decide` is the one place this is decided. The planner costs what it returns, the Plan records
it (`Plan.schedule`), and the lowering (`lowering/overlap.py`) builds it.

- `serial`: the update runs in the update program, after the compute program.
- `layered`: a leaf stacked over layers (`[L, ...]`, the params of an `nnx.scan` or linen
  `scan` and their optimizer state) is updated one layer at a time inside the backward pass:
  layer t's update is issued as soon as the backward scan's iteration t has made its gradient
  slice, and writes the new values in place while the GPU differentiates layers t - 1 ... 0;
  the slice is freed `RELEASE_LAG` layers later.
- `rows`: an embedding table read in place (`host_dha`, `lowering/dha_tables.py`) is updated row
  by row on the host CPUs: the rows the step's ids do not name (zero gradient) while the step
  computes, the named ones once their gradient rows have landed in pinned_host.

A component is `layered` when:
- its gradients are `ys` outputs of one top-level scan of length L >= 2, its other vector
  operands and its results are `[L, ...]` with N = L * n elements, and its scalar operands (the
  learning rate, the bias corrections) depend on nothing that scan computes. A scalar computed
  from every gradient (a global-norm clip, a non-finite check) must wait for the whole backward
  pass: such a component stays serial, so that the layered ones compute what the serial step
  does;
- each result is a state leaf's new value (or its fp32 master), returned by the step only as
  that leaf; a host leaf it reads, and a device leaf it writes in place, is read elsewhere only
  as `xs` by the layer loop and by loops it depends on (every read of layer t's slice comes
  before iteration t's call);
- the equations that make its other operands can run before the scan (none is another host
  update's, none depends on the scan);
- its first leaf is not on a mesh of more than one device.
A table's update is `rows` under the same rules, its one gradient being the table's
scatter-added one, its other vector operands host leaves shaped like the table, read by nothing
but the update and the forward's row gather. Under `JAXTIER_DISABLE_FFI` (no custom calls run)
or `overlap_update=False`, every update is serial.

Guarded (speculative) layered updates. `optax.clip_by_global_norm` passes each gradient through
`select(norm < max, g, g / norm * max)`, and `optax.apply_if_finite` (its `cond` made selects by
`analysis/conditions.py`) `select(finite, new, old)`: the late scalars a component reads are a
predicate (bool or integer) and values only the unchosen case reads. A component is guarded
when every late scalar it reads is either such a predicate (a `Guard`) or is read by its op
program only through a select that a predicate's value leaves unchosen (`free_under`), for at
least one assignment of the predicates (`Guard.values`: the assignments under which no result
reads a late value other than the predicates). The layered calls then run with the predicates
set to a guessed assignment: when the backward pass has made the real predicates and they equal
the guess, every result is the serial step's, bit for bit (a select returns its chosen case
unchanged). The runtime keeps the guessed step's writes apart from the state (`lowering/
overlap.py`'s spare buffers) until it has compared them, and runs the serial schedule when they
differ (`runtime/runner.py`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Collection, Sequence

import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import layer_stacks
from jaxtier._src.analysis import lookups as lookups_lib
from jaxtier._src.primitives.base import ffi_disabled
from jaxtier._src.primitives.host_update import Op


# A layered update's gradient slices are released this many iterations of the backward scan
# after their layer's calls (`lowering/rewrite.py`, `host_update.release`): the device holds
# about RELEASE_LAG + 1 layers of those gradients at once, not all L. On a GPU the release
# makes XLA's stream wait for the calls' reads; with 2 the host still has a layer queued while
# it waits (docs/design.md, "Free a layer's gradient once its update has read it"). None: every
# slice stays alive until the join.
RELEASE_LAG: "int | None" = 2


def held_gradient_share(num_layers: int) -> float:
  """The share of a layer loop's gradients the device holds at once when their updates run
  layered over its `num_layers` layers (1.0 for 0 layers: a serial update reads them whole)."""
  if num_layers <= 0 or RELEASE_LAG is None:
    return 1.0
  return min(1.0, (RELEASE_LAG + 1) / num_layers)


class Mode(enum.StrEnum):
  """When a fused host update runs (module doc)."""

  SERIAL = "serial"
  LAYERED = "layered"
  ROWS = "rows"


class Why(enum.StrEnum):
  """The kinds of reason an update stays serial (`Refusal.kind`)."""

  OVERLAP_OFF = "overlap_off"
  FFI_DISABLED = "ffi_disabled"
  ON_MESH = "on_mesh"
  NO_RESULTS = "no_results"
  NO_LAYER_LOOP = "no_layer_loop"
  SEVERAL_LOOPS = "several_loops"
  LAYERS_DO_NOT_SPLIT = "layers_do_not_split"
  WAITS_FOR_EVERY_GRADIENT = "waits_for_every_gradient"
  OPERAND_NOT_STACKED = "operand_not_stacked"
  OPERAND_AFTER_LOOP = "operand_after_loop"
  RESULT_NOT_STACKED = "result_not_stacked"
  HOST_LEAF_READ_OUTSIDE = "host_leaf_read_outside"
  RETURNED_TWICE = "returned_twice"
  NOT_OVER_DEVICE_LEAF = "not_over_device_leaf"
  OLD_VALUE_READ_OUTSIDE = "old_value_read_outside"
  MASTER_RETURNED = "master_returned"
  NOT_ONE_STATE_LEAF = "not_one_state_leaf"
  ONE_BUFFER_TWICE = "one_buffer_twice"
  OPERAND_OF_OTHER_UPDATE = "operand_of_other_update"
  SCALAR_FROM_COMPUTE = "scalar_from_compute"
  SEVERAL_TABLE_GRADIENTS = "several_table_gradients"
  VECTOR_OPERAND_ON_DEVICE = "vector_operand_on_device"
  NOT_TABLE_SHAPED = "not_table_shaped"
  NOT_OVER_HOST_LEAF = "not_over_host_leaf"
  NO_ROOM_FOR_SPARES = "no_room_for_spares"


_TEXT = {
    Why.OVERLAP_OFF: "overlap_update is off",
    Why.FFI_DISABLED: "JAXTIER_DISABLE_FFI is set",
    Why.ON_MESH: "sharded over a mesh",
    Why.NO_RESULTS: "no results",
    Why.NO_LAYER_LOOP: ("the gradient is not a layer loop's output alone (the leaf is no stack "
                        "of layers, or it is read outside the loop too)"),
    Why.SEVERAL_LOOPS: "the update reads the outputs of several layer loops",
    Why.LAYERS_DO_NOT_SPLIT: "{elements} elements do not split into {layers} layers",
    Why.WAITS_FOR_EVERY_GRADIENT: ("the update waits for a value computed from every gradient "
                                   "(a global-norm clip or a non-finite check)"),
    Why.OPERAND_NOT_STACKED: "operand {operand} is not stacked over the {layers} layers",
    Why.OPERAND_AFTER_LOOP: "operand {operand} is computed after the layer loop",
    Why.RESULT_NOT_STACKED: "a result is not stacked over the layers",
    Why.HOST_LEAF_READ_OUTSIDE: "host leaf {leaf} is read outside its update",
    Why.RETURNED_TWICE: "the step returns {leaf}'s new value more than once",
    Why.NOT_OVER_DEVICE_LEAF: "the new value of {leaf} is not written over that device leaf",
    Why.OLD_VALUE_READ_OUTSIDE: ("{leaf}'s old value is read outside the layer loops (for "
                                 "example cast or scaled before the scan)"),
    Why.MASTER_RETURNED: "a master's new value is returned",
    Why.NOT_ONE_STATE_LEAF: "a result is not one state leaf's new value",
    Why.ONE_BUFFER_TWICE: "two results write one buffer",
    Why.OPERAND_OF_OTHER_UPDATE: "an operand is computed by another host update",
    Why.SCALAR_FROM_COMPUTE: ("a scalar operand depends on the step's compute (a global-norm "
                              "clip or a non-finite check)"),
    Why.SEVERAL_TABLE_GRADIENTS: "it reads more than one table's gradient",
    Why.VECTOR_OPERAND_ON_DEVICE: "a vector operand of the table's update is on the device",
    Why.NOT_TABLE_SHAPED: "host leaf {leaf} is not shaped like the table",
    Why.NOT_OVER_HOST_LEAF: "the new value of {leaf} is not written over that host leaf",
    Why.NO_ROOM_FOR_SPARES: ("the update waits for a value computed from every gradient (a "
                             "global-norm clip or a non-finite check), and the spare buffers "
                             "of a guess do not fit the pinned memory left"),
}


@dataclasses.dataclass(frozen=True)
class Refusal:
  """Why an update cannot run during the step: a kind and the facts it names.

  Attributes:
    kind: which rule refused it.
    leaf: the state leaf's path the rule names ('' when none).
    operand: the operand position the rule names (-1 when none).
    elements, layers: the element count and the layer count the rule names (0 when none).
  """

  kind: Why
  leaf: str = ""
  operand: int = -1
  elements: int = 0
  layers: int = 0

  def __str__(self) -> str:
    return _TEXT[self.kind].format(leaf=self.leaf, operand=self.operand,
                                   elements=self.elements, layers=self.layers)


@dataclasses.dataclass(frozen=True)
class UpdateSchedule:
  """When one fused host update runs, and how it is cut (`Plan.schedule`, one per component).

  Attributes:
    component: index into the plan's components.
    mode: serial, layered or rows.
    reason: why it is serial (None when it is not).
    loop: layered: the top-level layer loop's equation index; rows: the forward's row gather's.
    length: L, the loop's length (every vector operand's leading dimension); rows: the
      table's rows.
    count: elements per layer (rows: per row).
    grads: layered: (operand position, the `ys` position in the loop's outvars) of each
      gradient it reads.
    targets: per result, the operand position it is written into; a position past the
      component's operands names `extra[k]`.
    extra: device state leaves appended as operands, written by results that read no old
      value of their leaf (a bf16 param made from its fp32 master).
    hoist: equations after `loop` that make its other operands (the learning rate, the step
      count), run before it instead.
    buffers: per result, the buffer its target is: ('leaf', state leaf index) or ('master',
      the param leaf index of an fp32 master).
    table: rows: the table's state leaf index (-1 otherwise).
    grad: rows: the operand position of the table's gradient (-1 otherwise).
    scatter: rows: the backward's scatter-add equation index (-1 otherwise).
    guards: layered: the operand positions of the late predicates the update speculates on
      (module doc), in order; () when it reads no late scalar.
    guesses: the assignments of `guards` (one value per guard, as the op program reads them:
      1.0 true, 0.0 false) under which no result reads `unread` (each one the calls may run
      with).
    unread: layered: the late scalar operands the guessed calls do not read (the clip's norm);
      they are passed as 1.0.
  """

  component: int
  mode: Mode
  reason: "Refusal | None" = None
  loop: int = -1
  length: int = 0
  count: int = 0
  grads: tuple[tuple[int, int], ...] = ()
  targets: tuple[int, ...] = ()
  extra: tuple[int, ...] = ()
  hoist: tuple[int, ...] = ()
  buffers: tuple[tuple[str, int], ...] = ()
  table: int = -1
  grad: int = -1
  scatter: int = -1
  guards: tuple[int, ...] = ()
  guesses: tuple[tuple[float, ...], ...] = ()
  unread: tuple[int, ...] = ()

  @property
  def guarded(self) -> bool:
    """Whether the layered calls speculate on late predicates (module doc)."""
    return bool(self.guards)

  @property
  def written_leaves(self) -> tuple[int, ...]:
    """The state leaves (not masters) its results write, in result order."""
    return tuple(i for kind, i in self.buffers if kind == "leaf")


def serial(component: int, reason: Refusal) -> UpdateSchedule:
  """A serial `UpdateSchedule` of `component` for `reason`."""
  return UpdateSchedule(component, Mode.SERIAL, reason)


def unguessed(schedule: Sequence[UpdateSchedule], keep: Collection[int] = ()
              ) -> tuple[UpdateSchedule, ...]:
  """`schedule` as a step with no guess runs it: each guarded update serial (it waits for
  every gradient), the others as they are. With `keep` (component indices), a step that guesses
  for those guarded updates alone: the others serial, for want of room for their spares."""
  keep = frozenset(keep)
  return tuple(s if not s.guarded or s.component in keep else
               serial(s.component, Refusal(Why.NO_ROOM_FOR_SPARES if keep else
                                           Why.WAITS_FOR_EVERY_GRADIENT))
               for s in schedule)


def layer_loop(loops: layer_stacks.LayerLoops, cc: Any
               ) -> "tuple[int, dict[int, int]] | Refusal":
  """(the layer loop's equation index, {operand position: its gradient's outvar position in
  that scan}) of component `cc`, or why it has none: its gradients are `ys` outputs of one
  top-level scan of length L >= 2, its other vector operands and its results are `[L, ...]`
  with N = L * n elements, and its scalar operands depend on nothing that scan computes."""
  jaxpr = loops.jaxpr
  if not cc.results:
    return Refusal(Why.NO_RESULTS)
  n_total = int(np.prod(cc.results[0].shape))
  grads: dict[int, int] = {}
  scans = set()
  for pos, spec in enumerate(cc.operands):
    if spec.kind == "value" and spec.var in loops.scan_out:
      k, out_pos = loops.scan_out[spec.var]
      scans.add(k)
      grads[pos] = out_pos
  if len(scans) != 1:
    return Refusal(Why.NO_LAYER_LOOP if not scans else Why.SEVERAL_LOOPS)
  (k,) = scans
  length = int(jaxpr.eqns[k].params["length"])
  if length < 2 or n_total % length:
    return Refusal(Why.LAYERS_DO_NOT_SPLIT, elements=n_total, layers=length)
  late = loops.tainted(k)
  for pos, spec in enumerate(cc.operands):
    if spec.kind == "const" or pos in grads:
      continue
    aval = spec.var.aval if spec.kind == "value" else jaxpr.invars[spec.index].aval
    shape = tuple(aval.shape)
    if int(np.prod(shape)) == 1:
      continue
    if int(np.prod(shape)) != n_total or not shape or shape[0] != length:
      return Refusal(Why.OPERAND_NOT_STACKED, operand=pos, layers=length)
    if spec.kind == "value" and spec.var in late:
      return Refusal(Why.OPERAND_AFTER_LOOP, operand=pos)
  for r in cc.results:
    if int(np.prod(r.shape)) != n_total or not r.shape or r.shape[0] != length:
      return Refusal(Why.RESULT_NOT_STACKED)
  if late_scalars(loops, cc, k) and guard_of(loops, cc, k) is None:
    return Refusal(Why.WAITS_FOR_EVERY_GRADIENT)
  return k, grads


def late_scalars(loops: layer_stacks.LayerLoops, cc: Any, k: int) -> tuple[int, ...]:
  """The operand positions of component `cc`'s scalars that depend on what the top-level
  equation k (its layer loop) computes: known only once the backward pass has run."""
  late = loops.tainted(k)
  return tuple(p for p, spec in enumerate(cc.operands)
               if spec.kind == "value" and spec.var in late
               and int(np.prod(spec.var.aval.shape)) == 1)


@dataclasses.dataclass(frozen=True)
class GuardOf:
  """How a component reading late scalars speculates (`UpdateSchedule.guards` and the rest)."""

  guards: tuple[int, ...]
  guesses: tuple[tuple[float, ...], ...]
  unread: tuple[int, ...]


# Guards a component may speculate on at most (each assignment of them is checked).
MAX_GUARDS = 3


def guard_of(loops: layer_stacks.LayerLoops, cc: Any, k: int) -> "GuardOf | None":
  """The guards of component `cc` whose layer loop is equation k (module doc), or None where
  it has none: a late scalar that is no predicate is read under every assignment of the
  predicates, or it reads more than `MAX_GUARDS` predicates."""
  late = late_scalars(loops, cc, k)
  guards = tuple(p for p in late
                 if np.dtype(cc.operands[p].var.aval.dtype) == np.bool_
                 or np.issubdtype(np.dtype(cc.operands[p].var.aval.dtype), np.integer))
  unread = tuple(p for p in late if p not in guards)
  if not guards or len(guards) > MAX_GUARDS:
    return None
  guesses = []
  for bits in range(2 ** len(guards) - 1, -1, -1):  # all true first
    guess = tuple(float((bits >> g) & 1) for g in range(len(guards)))
    if not reads(cc.program, dict(zip(guards, guess)), set(unread)):
      guesses.append(guess)
  return GuardOf(guards, tuple(guesses), unread) if guesses else None


def specialize(program: Any, fixed: dict[int, float]) -> Any:
  """Op `program` with the operands of `fixed` holding the values given: the values those
  decide are followed through the program (loads, constants, copies, logic, comparisons and
  arithmetic, in float32 as the executors compute them), each select whose condition they
  decide copies the case it picks, and every instruction no result needs is dropped (the
  unchosen case: a clip's `g / norm * max`). Each result is the same value, bit for bit, as
  `program` computes with those operand values; the program reads fewer operands and runs
  fewer passes (`reads` says which it still reads).
  """
  consts = list(np.asarray(program.consts, np.float32))
  known: dict[int, np.float32] = {}  # register -> its value, where `fixed` decides it
  out = []
  for op, dst, a, b, c in np.asarray(program.code).tolist():
    if op == Op.STORE:
      out.append([op, dst, a, b, c])
      continue
    if op == Op.LOAD and a in fixed:
      consts.append(np.float32(fixed[a]))
      out.append([Op.CONST, dst, len(consts) - 1, 0, 0])
      known[dst] = consts[-1]
      continue
    if op == Op.SELECT and a in known:
      pick = c if known[a] != 0 else b
      value = known.get(pick)
      if pick != dst:
        out.append([Op.COPY, dst, pick, 0, 0])
    else:
      value = _value(op, a, b, c, known, consts)
      out.append([op, dst, a, b, c])
    if value is None:
      known.pop(dst, None)
    else:
      known[dst] = value
  # Liveness, backwards: an instruction stays where a result (STORE) needs its register.
  live: set[int] = set()
  kept = []
  for op, dst, a, b, c in reversed(out):
    if op != Op.STORE:
      if dst not in live:
        continue
      live.discard(dst)
    live.update(_inputs(op, a, b, c) if op != Op.STORE else (a,))
    kept.append([op, dst, a, b, c])
  kept.reverse()
  return dataclasses.replace(program, code=np.asarray(kept, np.int32),
                             consts=np.asarray(consts, np.float32))


def reads(program: Any, fixed: dict[int, float], watched: "set[int]") -> bool:
  """Whether a result of op `program` depends on an operand of `watched` when the operands of
  `fixed` hold the values given: whether `specialize(program, fixed)` still loads one (a
  select whose condition those values decide depends only on the case it picks; a value they
  do not decide depends on all it reads)."""
  return any(op == Op.LOAD and a in watched
             for op, _, a, _, _ in specialize(program, fixed).code.tolist())


def _inputs(op: int, a: int, b: int, c: int) -> tuple[int, ...]:
  """The registers op-program instruction (op, dst, a, b, c) reads (STORE aside)."""
  if op in (Op.LOAD, Op.CONST):
    return ()
  if op in (Op.SELECT, Op.CLAMP):
    return (a, b, c)
  if op in (Op.COPY, Op.NOT) or 10 <= op < 40:
    return (a,)
  return (a, b)


_COMPARE = {Op.GT: np.greater, Op.GE: np.greater_equal, Op.LT: np.less, Op.LE: np.less_equal,
            Op.EQ: np.equal, Op.NE: np.not_equal}
_ARITH = {Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.MAX: np.maximum,
          Op.MIN: np.minimum}


def _value(op: int, a: int, b: int, c: int, known: dict[int, np.float32],
           consts: list) -> "np.float32 | None":
  """The value instruction (op, _, a, b, c) computes where `known` decides its inputs (None
  where it does not, or for an op not followed)."""
  if op == Op.CONST:
    return np.float32(consts[a])
  ins = _inputs(op, a, b, c)
  if op == Op.LOAD or not all(r in known for r in ins):
    return None
  x = [known[r] for r in ins]
  if op == Op.COPY:
    return x[0]
  if op == Op.NOT:
    return np.float32(x[0] == 0)
  if op == Op.AND:
    return np.float32(x[0] != 0 and x[1] != 0)
  if op == Op.OR:
    return np.float32(x[0] != 0 or x[1] != 0)
  if op in _COMPARE:
    return np.float32(_COMPARE[op](x[0], x[1]))
  if op in _ARITH:
    return np.float32(_ARITH[op](x[0], x[1]))
  return None


def in_place_gradients(jaxpr: Any, tables: Collection[int], host_eqns: Collection[int]
                       ) -> dict[Any, tuple[int, Any]]:
  """{gradient var: (table leaf, its `lookups.TableLookup`)} of the tables read in place whose
  gradient is read by the fused host updates alone (`host_eqns`: their equations), so that it
  is scatter-added into a pinned_host buffer (`lowering/dha_tables.py`). A table that is not an
  embedding table the DHA gather serves is left out (its lowering refuses it)."""
  uses: dict[Any, set[int]] = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jc.Var):
        uses.setdefault(v, set()).add(k)
  out = {}
  for t in sorted(tables):
    got = lookups_lib.table_lookup(jaxpr, t)
    if isinstance(got, lookups_lib.TableLookup):
      grad = jaxpr.eqns[got.scatter].outvars[0]
      if uses.get(grad, set()) <= set(host_eqns):
        out[grad] = (t, got)
  return out


def decide(jaxpr: Any, components: Sequence[Any], leaves: Sequence[Any], *,
           pinned: Collection[int], tables: Collection[int] = (),
           meshed: Collection[int] = (), overlap_update: bool = True
           ) -> tuple[UpdateSchedule, ...]:
  """When each of `components` runs, with the reason where it is serial (module doc).

  Args:
    jaxpr: the traced step's top-level jaxpr (state leaves first among its invars and outvars).
    components: the fused host updates (`op_program_compiler.CompiledComponent`s).
    leaves: one record per state leaf with `path`, `shape` (global) and `dtype`.
    pinned: indices of the state leaves in pinned_host memory.
    tables: indices of the parameters read in place (`host_dha`: embedding tables).
    meshed: indices of the state leaves on a mesh of more than one device.
    overlap_update: False keeps every update serial (`OffloadOptions.overlap_update`).

  Returns:
    One `UpdateSchedule` per component, in order.
  """
  if not overlap_update or ffi_disabled():
    why = Refusal(Why.OVERLAP_OFF if not overlap_update else Why.FFI_DISABLED)
    return tuple(serial(c, why) for c in range(len(components)))
  return _Decider(jaxpr, components, leaves, frozenset(pinned), frozenset(tables),
                  frozenset(meshed)).decide()


class _Decider:
  """The rules of `decide` over one traced step."""

  def __init__(self, jaxpr: Any, components: Sequence[Any], leaves: Sequence[Any],
               pinned: frozenset[int], tables: frozenset[int], meshed: frozenset[int]):
    self.jaxpr, self.components, self.leaves = jaxpr, components, leaves
    self.pinned, self.meshed = pinned, meshed
    self.n_state = len(leaves)
    self.loops = layer_stacks.LayerLoops(jaxpr)
    self.out_count: dict[Any, int] = {}
    for v in jaxpr.outvars:
      if isinstance(v, jc.Var):
        self.out_count[v] = self.out_count.get(v, 0) + 1
    self.in_components = {k for cc in components for k in cc.component.eqns}
    self.table_grads = in_place_gradients(jaxpr, tables, self.in_components)

  def decide(self) -> tuple[UpdateSchedule, ...]:
    out = []
    for c, cc in enumerate(self.components):
      if any(spec.kind == "value" and spec.var in self.table_grads for spec in cc.operands):
        got = self._rows(c, cc)
      else:
        got = self._layered(c, cc)
      if isinstance(got, UpdateSchedule):
        late = set(got.guards) | set(got.unread)
        early = [spec.var for p, spec in enumerate(cc.operands)
                 if spec.kind == "value" and p not in dict(got.grads) and p != got.grad
                 and p not in late]
        hoist = self._hoisted(got.loop, early)
        got = (hoist if isinstance(hoist, Refusal)
               else dataclasses.replace(got, hoist=hoist))
      out.append(serial(c, got) if isinstance(got, Refusal) else got)
    return tuple(out)

  def _path(self, i: int) -> str:
    return self.leaves[i].path

  def _scan_only(self, var: Any, own: set[int], k: int) -> bool:
    """Read only by the component, by layer loop k as `xs`, and by loops as `xs` that k
    depends on (the forward scan): every such read comes before k's iterations' calls."""
    jaxpr = self.jaxpr
    for j in self.loops.uses.get(var, []):
      if j in own:
        continue
      eqn = jaxpr.eqns[j]
      if eqn.primitive.name != "scan":
        return False
      xs = set(range(sum(jc.scan_counts(eqn)), len(eqn.invars)))
      if any(x is var and p not in xs for p, x in enumerate(eqn.invars)):
        return False
      if j != k and not (j < k and any(isinstance(x, jc.Var) and x in self.loops.tainted(j)
                                       for x in jaxpr.eqns[k].invars)):
        return False
    return True

  def _hoisted(self, k: int, values: list[Any]) -> "tuple[int, ...] | Refusal":
    """Equations after equation k that make `values`, or why they cannot run before it."""
    jaxpr, producer = self.jaxpr, self.loops.producer
    need, stack = set(), [producer[v] for v in values if producer.get(v, -1) > k]
    made_at_k = set(jaxpr.eqns[k].outvars)
    while stack:
      e = stack.pop()
      if e in need:
        continue
      if e in self.in_components:
        return Refusal(Why.OPERAND_OF_OTHER_UPDATE)
      if any(isinstance(x, jc.Var) and x in made_at_k for x in jaxpr.eqns[e].invars):
        return Refusal(Why.SCALAR_FROM_COMPUTE)
      need.add(e)
      stack.extend(producer[x] for x in jaxpr.eqns[e].invars
                   if isinstance(x, jc.Var) and producer.get(x, -1) > k)
    return tuple(sorted(need))

  def _layered(self, c: int, cc: Any) -> "UpdateSchedule | Refusal":
    """The layered form of component `c`, or why it has none."""
    jaxpr, leaves = self.jaxpr, self.leaves
    if cc.component.seeds[0] in self.meshed:
      return Refusal(Why.ON_MESH)
    got = layer_loop(self.loops, cc)
    if isinstance(got, Refusal):
      return got
    k, grads = got
    length = int(jaxpr.eqns[k].params["length"])
    count = int(np.prod(cc.results[0].shape)) // length
    own = set(cc.component.eqns)
    for spec in cc.operands:
      if spec.kind == "host" and not self._scan_only(jaxpr.invars[spec.index], own, k):
        return Refusal(Why.HOST_LEAF_READ_OUTSIDE, leaf=self._path(spec.index))

    def over_device_leaf(r: Any, j: int) -> "int | None | Refusal":
      if self.out_count.get(jaxpr.outvars[j], 0) != 1:
        return Refusal(Why.RETURNED_TWICE, leaf=self._path(j))
      leaf = leaves[j]
      if (j in self.pinned or tuple(leaf.shape) != tuple(r.shape)
          or np.dtype(leaf.dtype) != np.dtype(r.dtype)):
        return Refusal(Why.NOT_OVER_DEVICE_LEAF, leaf=self._path(j))
      old = jaxpr.invars[j]
      if old in jaxpr.outvars or not self._scan_only(old, own, k):
        return Refusal(Why.OLD_VALUE_READ_OUTSIDE, leaf=self._path(j))
      at = [p for p, spec in enumerate(cc.operands) if spec.kind == "value" and spec.var is old]
      return at[0] if at else None

    got = self._targets(cc, over_device_leaf)
    if isinstance(got, Refusal):
      return got
    targets, extra = got
    guard = guard_of(self.loops, cc, k) if late_scalars(self.loops, cc, k) else None
    return UpdateSchedule(c, Mode.LAYERED, loop=k, length=length, count=count,
                          grads=tuple(sorted(grads.items())), targets=tuple(targets),
                          extra=tuple(extra), buffers=self._buffers(cc, targets, extra),
                          guards=guard.guards if guard else (),
                          guesses=guard.guesses if guard else (),
                          unread=guard.unread if guard else ())

  def _rows(self, c: int, cc: Any) -> "UpdateSchedule | Refusal":
    """The row-by-row form of the update of a table read in place, or why it has none."""
    jaxpr, leaves = self.jaxpr, self.leaves
    grads = [p for p, spec in enumerate(cc.operands)
             if spec.kind == "value" and spec.var in self.table_grads]
    if len(grads) != 1:
      return Refusal(Why.SEVERAL_TABLE_GRADIENTS)
    grad = grads[0]
    table, lookup = self.table_grads[cc.operands[grad].var]
    gather = lookup.gather
    if table in self.meshed:
      return Refusal(Why.ON_MESH)
    shape = tuple(leaves[table].shape)
    size = int(np.prod(shape))
    own = set(cc.component.eqns)
    uses = self.loops.uses
    for p, spec in enumerate(cc.operands):
      if p == grad or spec.kind == "const":
        continue
      if spec.kind == "value" and int(np.prod(spec.var.aval.shape)) != 1:
        return Refusal(Why.VECTOR_OPERAND_ON_DEVICE)
      if spec.kind == "host":
        if int(np.prod(leaves[spec.index].shape)) != size:
          return Refusal(Why.NOT_TABLE_SHAPED, leaf=self._path(spec.index))
        readers = set(uses.get(jaxpr.invars[spec.index], ())) - own
        if readers - ({gather} if spec.index == table else set()):
          return Refusal(Why.HOST_LEAF_READ_OUTSIDE, leaf=self._path(spec.index))

    def over_host_leaf(r: Any, j: int) -> "None | Refusal":
      leaf = leaves[j]
      if (self.out_count.get(jaxpr.outvars[j], 0) != 1 or j not in self.pinned
          or int(np.prod(leaf.shape)) != size or np.dtype(leaf.dtype) != np.dtype(r.dtype)):
        return Refusal(Why.NOT_OVER_HOST_LEAF, leaf=self._path(j))
      if set(uses.get(jaxpr.invars[j], ())) - own - ({gather} if j == table else set()):
        return Refusal(Why.HOST_LEAF_READ_OUTSIDE, leaf=self._path(j))
      return None

    got = self._targets(cc, over_host_leaf)
    if isinstance(got, Refusal):
      return got
    targets, extra = got
    return UpdateSchedule(c, Mode.ROWS, loop=gather, length=shape[0], count=size // shape[0],
                          targets=tuple(targets), extra=tuple(extra),
                          buffers=self._buffers(cc, targets, extra), table=table, grad=grad,
                          scatter=lookup.scatter)

  def _targets(self, cc: Any, over_leaf: Callable[[Any, int], "int | None | Refusal"]
               ) -> "tuple[list[int], list[int]] | Refusal":
    """(per result the operand position it is written into, the extra state leaves appended
    as operands), or why the results cannot be written in place. A result that is state leaf
    j's new value without overwriting an operand goes where `over_leaf(result, j)` says: an
    operand position, None for a new extra operand (leaf j itself), or why it cannot."""
    targets: list[int] = []
    extra: list[int] = []
    for r in cc.results:
      got = self._result_target(r, cc)
      if isinstance(got, Refusal):
        return got
      kind, j = got
      at = j if kind == "operand" else over_leaf(r, j)
      if isinstance(at, Refusal):
        return at
      if at is None:
        at = len(cc.operands) + len(extra)
        extra.append(j)
      targets.append(at)
    if len(set(targets)) != len(targets):
      return Refusal(Why.ONE_BUFFER_TWICE)
    return targets, extra

  def _result_target(self, r: Any, cc: Any) -> "tuple[str, int] | Refusal":
    """Where result `r` goes: ('operand', its position) when it overwrites a host leaf or a
    master in place, ('leaf', j) when it is state leaf j's new value otherwise, or why it can
    be neither."""
    if r.alias >= 0 and cc.operands[r.alias].kind in ("host", "master"):
      spec = cc.operands[r.alias]
      if spec.kind == "host" and tuple(r.outputs) != (spec.index,):
        return Refusal(Why.RETURNED_TWICE, leaf=self._path(spec.index))
      if spec.kind == "master" and r.outputs:
        return Refusal(Why.MASTER_RETURNED)
      return "operand", r.alias
    if len(r.outputs) != 1 or r.outputs[0] >= self.n_state:
      return Refusal(Why.NOT_ONE_STATE_LEAF)
    return "leaf", r.outputs[0]

  def _buffers(self, cc: Any, targets: Sequence[int], extra: Sequence[int]
               ) -> tuple[tuple[str, int], ...]:
    """Per target, the buffer it is (`UpdateSchedule.buffers`)."""
    buffers = []
    for t in targets:
      spec = cc.operands[t] if t < len(cc.operands) else None
      buffers.append(("leaf", extra[t - len(cc.operands)]) if spec is None
                     else ("master", spec.index) if spec.kind == "master"
                     else ("leaf", spec.index) if spec.kind == "host"
                     else ("leaf", self.jaxpr.invars.index(spec.var)))
    return tuple(buffers)


def host_leaves_written(schedule: Sequence[UpdateSchedule], pinned: Collection[int],
                        modes: Collection[Mode] = (Mode.LAYERED, Mode.ROWS)) -> tuple[int, ...]:
  """The pinned_host state leaves that the updates of `schedule` in `modes` write, sorted."""
  return tuple(sorted({i for s in schedule if s.mode in modes for i in s.written_leaves
                       if i in pinned}))

