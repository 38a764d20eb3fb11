"""Dataflow over a traced step's jaxpr: which equations a host-resident leaf reaches.

Taint flows forward from chosen input variables (the host-placed state leaves). The tainted
equations split into connected components; a component is *elementwise* when every tainted
equation maps arrays of one element count N (or broadcast scalars) elementwise, so that it can
run as one pass over the host buffers (`jaxtier/_src/primitives/host_update.py`).

Values inside a component may be floating point, boolean or signed integers of up to 32 bits
(the op program computes in fp32, exact for integers below 2**24); bitwise ops on integers are
not elementwise in that sense. Call-like equations (`pjit`, custom_jvp/vjp calls) are looked
into, and so is `cond`: a static branch index selects that branch, a traced one evaluates every
branch and selects the result per element.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Container, Iterable

import jax.numpy as jnp
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.primitives.host_update import MAX_OPERANDS

# lax primitives that act elementwise on equally-shaped operands (0-d operands broadcast).
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "abs", "sqrt", "rsqrt", "exp", "exp2", "log", "tanh",
    "logistic", "sign", "floor", "ceil", "log1p", "expm1", "sin", "cos", "not", "erf", "round",
    "is_finite", "max", "min", "pow", "atan2", "gt", "ge", "lt", "le", "eq", "ne", "and", "or",
    "rem", "select_n", "clamp", "integer_pow", "square", "convert_element_type", "copy",
    "copy_p", "reduce_precision", "stop_gradient", "optimization_barrier",
})
# Ops whose integer form is bitwise (their boolean form is logical, which the program has).
BITWISE_ON_INT = frozenset({"and", "or", "not"})
# Size-preserving layout ops that are the identity on the row-major flat index.
FLAT_IDENTITY = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim"})


def size_of(aval: Any) -> int:
  return int(np.prod(aval.shape)) if hasattr(aval, "shape") else 1


def _is_float_or_bool(aval: Any) -> bool:
  dtype = np.dtype(aval.dtype) if hasattr(aval, "dtype") else None
  if dtype is None:
    return False
  return dtype == np.bool_ or np.issubdtype(dtype, np.floating) or dtype.name in (
      "bfloat16", "float16")


def _is_int(aval: Any) -> bool:
  """Signed integers of up to 32 bits (exact in the program's fp32 registers below 2**24)."""
  dtype = np.dtype(aval.dtype) if hasattr(aval, "dtype") else None
  return dtype is not None and np.issubdtype(dtype, np.signedinteger) and dtype.itemsize <= 4


def computable(aval: Any) -> bool:
  """True for the dtypes a value inside an op program may have (float, bool, small int)."""
  return _is_float_or_bool(aval) or _is_int(aval)


def bodies(eqn: Any) -> "tuple[list[tuple[Any, list[Any]]], int] | None":
  """The inner jaxprs (open, with consts) of a call-like or `cond` equation, and the offset.

  `eqn.invars[offset:]` bind each body's invars. A `cond` whose branch index is a literal gives
  that branch only; a traced index gives every branch (the caller selects). None for any other
  primitive.
  """
  if eqn.primitive.name == "cond":
    branches = list(eqn.params["branches"])
    index = eqn.invars[0]
    if isinstance(index, jc.Literal):
      k = int(np.clip(int(np.asarray(index.val)), 0, len(branches) - 1))
      branches = [branches[k]]
    return [jc.open_jaxpr(b) for b in branches], 1
  inner = jc.inner_jaxpr(eqn)
  if inner is None:
    return None
  inner_jaxpr, consts = jc.open_jaxpr(inner)
  return [(inner_jaxpr, consts)], len(eqn.invars) - len(inner_jaxpr.invars)


@dataclasses.dataclass
class Component:
  """One connected set of tainted equations of the top-level jaxpr.

  Attributes:
    eqns: indices into `jaxpr.eqns`, in program order.
    seeds: indices of the tainted top-level invars (host leaves) it reads.
    outputs: indices into `jaxpr.outvars` whose value it computes.
    size: the element count N of its arrays.
    elementwise: True when it can run as one op program.
    why: for a non-elementwise component, the first equation that is not (for the plan).
  """

  eqns: list[int]
  seeds: list[int]
  outputs: list[int]
  size: int
  elementwise: bool
  why: str = ""


def scan_xs_positions(eqn: Any) -> range:
  """Positions in a `scan` equation's invars that are its `xs` (sliced per iteration)."""
  start = sum(jc.scan_counts(eqn))
  return range(start, len(eqn.invars))


# Dtypes a gradient may be sent in when it is exactly a widening of one (`narrow_source_dtype`):
# the host update's LOAD widens them back to fp32 (`primitives/host_update.py`).
_NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Nested calls followed, at most.
_MAX_CALL_DEPTH = 16


def narrow_source_dtype(jaxpr: Any, var: Any) -> "jnp.dtype | None":
  """The narrower float dtype of which `var` (a float value of the open `jaxpr`) is exactly a
  widening, or None.

  That is where `var` is made by `convert_element_type` from a bfloat16 or float16 value,
  directly or as an output of a call or jax.checkpoint body (followed into the body). Such a
  value rounds to that dtype and back unchanged: the gradient of an fp32 weight that a layer
  casts to bf16 is the bf16 cotangent widened (the cast's transpose), and so sending it down in
  bf16 loses nothing and moves half the bytes. A sum of such values is not one, and gives None.
  """
  for _ in range(_MAX_CALL_DEPTH):
    if not isinstance(var, jc.Var):
      return None
    eqn = next((e for e in reversed(jaxpr.eqns) if any(o is var for o in e.outvars)), None)
    if eqn is None:
      return None
    if eqn.primitive.name == "convert_element_type":
      src, dst = eqn.invars[0], jnp.dtype(var.aval.dtype)
      if not isinstance(src, jc.Var):
        return None
      narrow = jnp.dtype(src.aval.dtype)
      ok = (narrow in _NARROW and jnp.issubdtype(dst, jnp.floating)
            and narrow.itemsize < dst.itemsize)
      return narrow if ok else None
    inner = jc.call_body(eqn)
    if inner is None:
      return None
    at = next(k for k, o in enumerate(eqn.outvars) if o is var)
    jaxpr = jc.open_jaxpr(inner)[0]
    var = jaxpr.outvars[at]
  return None


def scan_ys_narrow_dtype(eqn: Any, position: int) -> "jnp.dtype | None":
  """`narrow_source_dtype` of output `position` of the `scan` equation `eqn` (a `ys` output:
  one slice per iteration, made by the body)."""
  body = jc.open_jaxpr(eqn.params["jaxpr"])[0]
  return narrow_source_dtype(body, body.outvars[position])


# Gather modes whose in-range rows the DHA gather reproduces (an id outside [0, V) reads a row
# of zeros there, NaN under FILL_OR_DROP: `jnp.take` first wraps ids in [-V, 0)); `clip`
# clamps ids to the table instead, which the kernel does not.
ROW_GATHER_MODES = ("FILL_OR_DROP", "PROMISE_IN_BOUNDS")


def mode_name(mode: Any) -> str:
  return getattr(mode, "name", str(mode))


def is_row_gather(eqn: Any) -> bool:
  """Whether `eqn` is `gather(table [V, D], indices [..., 1])` of whole rows (`jnp.take(table,
  ids, axis=0)`)."""
  if eqn.primitive.name != "gather" or len(eqn.invars) != 2:
    return False
  table, idx = (v.aval for v in eqn.invars)
  dn = eqn.params["dimension_numbers"]
  return (len(table.shape) == 2 and len(idx.shape) >= 1 and idx.shape[-1] == 1
          and tuple(dn.offset_dims) == (len(idx.shape) - 1,)
          and tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
          and not tuple(getattr(dn, "operand_batching_dims", ()))
          and tuple(eqn.params["slice_sizes"]) == (1, table.shape[1])
          and mode_name(eqn.params.get("mode")) in ROW_GATHER_MODES)


def elementwise_over(eqn: Any, n: int) -> bool:
  """Whether `eqn` is elementwise (or a flat-identity layout op) with every output of n
  elements: how an update reads a leaf of n elements."""
  name = eqn.primitive.name
  return ((name in ELEMENTWISE or name in FLAT_IDENTITY)
          and all(size_of(o.aval) == n for o in eqn.outvars))


def streamed_read(eqn: Any, hit: list[bool], streamed_vars: "set[Any]",
                  gathered_vars: "set[Any]" = frozenset()) -> bool:
  """True when `eqn` reads tainted values only as leaves a custom call serves.

  Two reads are served: a streamed leaf sliced by a `scan` (each layer's slice is fetched to
  the device ahead of use: `jaxtier/_src/lowering/streaming.py`), and a `gathered` table's rows
  (read in place by the DHA gather: `analysis/lookups.py`). What such an equation computes
  stays on the device and is not part of a host update.
  """
  if (gathered_vars and is_row_gather(eqn) and hit[0] and not any(hit[1:])
      and eqn.invars[0] in gathered_vars):
    return True
  if eqn.primitive.name != "scan" or not streamed_vars:
    return False
  xs = scan_xs_positions(eqn)
  return all(not h or (p in xs and eqn.invars[p] in streamed_vars) for p, h in enumerate(hit))


# The consumers of each Var of the jaxprs `taint_forward` walked last ({id: (jaxpr, index)}):
# the inventory taints every state leaf of the same jaxpr in turn.
_CONSUMERS: dict[int, tuple[Any, dict[Any, list[int]]]] = {}
_CONSUMERS_KEPT = 4


def consumers(jaxpr: Any) -> dict[Any, list[int]]:
  """{Var: the indices of the equations of `jaxpr` that read it, ascending}, made once per
  jaxpr (the last `_CONSUMERS_KEPT` are kept)."""
  got = _CONSUMERS.get(id(jaxpr))
  if got is not None and got[0] is jaxpr:
    return got[1]
  index: dict[Any, list[int]] = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jc.Var):
        uses = index.setdefault(v, [])
        if not uses or uses[-1] != k:
          uses.append(k)
  if len(_CONSUMERS) >= _CONSUMERS_KEPT:
    _CONSUMERS.pop(next(iter(_CONSUMERS)))
  _CONSUMERS[id(jaxpr)] = (jaxpr, index)
  return index


def taint_forward(jaxpr: Any, seeds: Iterable[int], streamed: Iterable[int] = (),
                  gathered: Iterable[int] = (), skip: Container[int] = ()
                  ) -> tuple[set[int], set[Any]]:
  """Indices of equations reachable from invars `seeds`, and the set of tainted Vars.

  `streamed` (a subset of `seeds`) are leaves placed `host_stream`: a `scan` that reads them
  only as `xs` is not tainted by them; `gathered` (a subset too) are tables placed `host_dha`:
  their row gathers are not tainted (see `streamed_read`). Equations in `skip` are neither
  tainted nor pass taint on.

  Only the equations that read a tainted Var are looked at, in the jaxpr's order (`consumers`):
  a leaf that one optimizer update reads costs that update's equations, not the whole step's.
  """
  tainted: set[Any] = {jaxpr.invars[i] for i in seeds}
  streamed_vars = {jaxpr.invars[i] for i in streamed}
  gathered_vars = {jaxpr.invars[i] for i in gathered}
  readers = consumers(jaxpr)
  eqns: set[int] = set()
  todo = sorted({k for v in tainted for k in readers.get(v, ())})
  queued = set(todo)
  heapq.heapify(todo)
  while todo:
    k = heapq.heappop(todo)
    if k in skip:
      continue
    eqn = jaxpr.eqns[k]
    hit = [isinstance(v, jc.Var) and v in tainted for v in eqn.invars]
    if any(hit) and not streamed_read(eqn, hit, streamed_vars, gathered_vars):
      eqns.add(k)
      for v in eqn.outvars:
        if isinstance(v, jc.DropVar) or v in tainted:
          continue
        tainted.add(v)
        for j in readers.get(v, ()):
          if j not in queued:
            queued.add(j)
            heapq.heappush(todo, j)
  return eqns, tainted


def taint_masks(jaxpr: Any, seeds: Iterable[int], skip: Container[int] = ()
                ) -> tuple[list[int], dict[Any, int]]:
  """`taint_forward` of every seed at once, one walk: (per equation, per Var) a bit mask of the
  `seeds` (bit k: the k-th seed given) that reach it. Equations in `skip` pass nothing on.

  Seed k's `taint_forward(jaxpr, [seed], skip=skip)` is the equations whose mask has bit k
  and the Vars whose mask has it.
  """
  var_masks: dict[Any, int] = {}
  for bit, i in enumerate(seeds):
    v = jaxpr.invars[i]
    var_masks[v] = var_masks.get(v, 0) | (1 << bit)
  eqn_masks = [0] * len(jaxpr.eqns)
  for k, eqn in enumerate(jaxpr.eqns):
    if k in skip:
      continue
    mask = 0
    for v in eqn.invars:
      if isinstance(v, jc.Var):
        mask |= var_masks.get(v, 0)
    if mask:
      eqn_masks[k] = mask
      for v in eqn.outvars:
        if not isinstance(v, jc.DropVar):
          var_masks[v] = var_masks.get(v, 0) | mask
  return eqn_masks, var_masks


def check_elementwise(jaxpr: Any, tainted_in: list[bool], n: int) -> str:
  """Empty string if every equation tainted by `tainted_in` is elementwise over N elements.

  Otherwise a short reason naming the first offending primitive. Recurses into call-like
  equations (pjit, custom_jvp/vjp) and `cond` branches.
  """
  tainted = {v for v, t in zip(jaxpr.invars, tainted_in) if t}
  for eqn in jaxpr.eqns:
    hit = [isinstance(v, jc.Var) and v in tainted for v in eqn.invars]
    if not any(hit):
      continue
    outs = [v for v in eqn.outvars if not isinstance(v, jc.DropVar)]
    tainted.update(outs)
    why = _eqn_why(eqn, hit, n)
    if why:
      return why
  return ""


def _eqn_why(eqn: Any, hit: list[bool], n: int) -> str:
  """Why one equation, reading the values flagged by `hit`, is not elementwise over N ('')."""
  name = eqn.primitive.name
  outs = [v for v in eqn.outvars if not isinstance(v, jc.DropVar)]
  inner = bodies(eqn)
  if inner is not None:
    subs, offset = inner
    if offset < 0:
      return f"{name} layout"
    if name == "cond" and hit[0]:
      return "`cond` branches on a value computed from a host leaf"
    for v in outs:
      if size_of(v.aval) not in (n, 1):
        return f"`{name}` produces {size_of(v.aval)} elements, not {n}"
    for sub, _ in subs:
      why = check_elementwise(sub, hit[offset:], n)
      if why:
        return why
    return ""
  if name not in ELEMENTWISE and name not in FLAT_IDENTITY:
    return f"`{name}` is not elementwise"
  for v, is_t in zip(eqn.invars, hit):
    s = size_of(v.aval)
    if is_t and s != n:
      return f"`{name}` mixes {s} and {n} elements"
    if not is_t and s not in (n, 1):
      return f"`{name}` reads an operand of {s} elements, not {n} or 1"
    if is_t and not computable(v.aval):
      return f"`{name}` computes in {v.aval.dtype}"
    if is_t and name in BITWISE_ON_INT and _is_int(v.aval):
      return f"`{name}` is bitwise on {v.aval.dtype}"
  for v in outs:
    if size_of(v.aval) != n:
      return f"`{name}` produces {size_of(v.aval)} elements, not {n}"
    if not computable(v.aval):
      return f"`{name}` produces {v.aval.dtype}"
  return ""


def first_use_why(jaxpr: Any, index: int, skip: Container[int] = ()) -> str:
  """Why invar `index` is read by an op that is not elementwise over its elements ('' if not).

  Only the leaf's own value is followed (through same-size conversions, reshapes and call
  bodies), not what is computed from it: a moment that is scaled, added to, then reduced is
  read elementwise; a weight that enters a matmul or is broadcast against activations is not.
  The top-level equations in `skip` are not looked at.
  """
  n = size_of(jaxpr.invars[index].aval)
  why, _ = _first_use(jaxpr, [k == index for k in range(len(jaxpr.invars))], n, skip)
  return why


_SAME_VALUE = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision",
                         "stop_gradient", "optimization_barrier", "reshape", "squeeze",
                         "expand_dims", "broadcast_in_dim"})  # (same-size only: checked below)


def _first_use(jaxpr: Any, follow_in: list[bool], n: int, skip: Container[int] = ()
               ) -> tuple[str, list[bool]]:
  """(`first_use_why` of the flagged invars, which outvars are still the followed value)."""
  follow = {v for v, t in zip(jaxpr.invars, follow_in) if t}
  for k, eqn in enumerate(jaxpr.eqns):
    if k in skip:
      continue
    hit = [isinstance(v, jc.Var) and v in follow for v in eqn.invars]
    if not any(hit):
      continue
    inner = bodies(eqn)
    if inner is not None and inner[1] >= 0 and not any(hit[:inner[1]]):
      subs, offset = inner
      for sub, _ in subs:
        why, passed = _first_use(sub, hit[offset:], n)
        if why:
          return why, []
        follow.update(v for v, p in zip(eqn.outvars, passed) if p)
      continue
    if eqn.primitive.name in _SAME_VALUE and all(size_of(v.aval) == n for v in eqn.outvars):
      follow.update(eqn.outvars)
      continue
    why = _eqn_why(eqn, hit, n)
    if why:
      return why, []
  return "", [isinstance(v, jc.Var) and v in follow for v in jaxpr.outvars]


def components(jaxpr: Any, seeds: Iterable[int], streamed: Iterable[int] = (),
               gathered: Iterable[int] = ()) -> list[Component]:
  """Splits the equations tainted by invars `seeds` into connected components.

  Two tainted equations are connected when one reads a tainted value the other writes, or both
  read the same host leaf. Each component is checked with `check_elementwise`. Reads of
  `streamed` leaves by a `scan`'s xs, and the row gathers of `gathered` tables, do not taint
  (`taint_forward`).
  """
  seeds = sorted(set(seeds))
  eqn_ids, tainted = taint_forward(jaxpr, seeds, streamed, gathered)
  parent: dict[Any, Any] = {}

  def find(x):
    while parent.setdefault(x, x) is not x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    return x

  def union(a, b):
    ra, rb = find(a), find(b)
    if ra is not rb:
      parent[ra] = rb

  for k in sorted(eqn_ids):
    eqn = jaxpr.eqns[k]
    members = [v for v in eqn.invars if isinstance(v, jc.Var) and v in tainted]
    members += [v for v in eqn.outvars if not isinstance(v, jc.DropVar)]
    for v in members[1:]:
      union(members[0], v)
  groups: dict[Any, Component] = {}
  for i in seeds:
    root = find(jaxpr.invars[i])
    comp = groups.setdefault(root, Component([], [], [], size_of(jaxpr.invars[i].aval), True))
    comp.seeds.append(i)
  for k in sorted(eqn_ids):
    eqn = jaxpr.eqns[k]
    tv = next(v for v in eqn.invars if isinstance(v, jc.Var) and v in tainted)
    groups[find(tv)].eqns.append(k)
  for j, v in enumerate(jaxpr.outvars):
    if isinstance(v, jc.Var) and v in tainted:
      groups[find(v)].outputs.append(j)
  result = list(groups.values())
  _absorb(jaxpr, result, eqn_ids)
  for comp in result:
    sizes = {size_of(jaxpr.invars[i].aval) for i in comp.seeds}
    # Check only this component's equations: build a view restricted to them.
    view = _SubJaxpr(jaxpr, comp.eqns)
    if len(sizes) != 1:
      first = comp.seeds[0]
      why = check_elementwise(view, [i == first for i in range(len(jaxpr.invars))],
                              size_of(jaxpr.invars[first].aval))
      comp.elementwise = False
      comp.why = f"host leaves of different sizes {sorted(sizes)} interact" + (
          f"; {why}" if why else "")
      continue
    sub_in = [i in comp.seeds for i in range(len(jaxpr.invars))]
    why = check_elementwise(view, sub_in, comp.size)
    comp.elementwise, comp.why = (not why), why
  return result


def _absorb(jaxpr: Any, comps: list[Component], tainted_eqns: set[int]) -> None:
  """Pulls untainted elementwise equations that only feed a component into it.

  Example: AdamW's weight decay `0.1 * param` and the `convert(param, f32)` of
  `apply_updates` are computed from a device param and used only by the host update. Run inside
  the op program, they read the param's fp32 master copy (when it has one) and cost the device
  nothing. Likewise `clip_by_global_norm`'s `select(norm < max, g, g / norm * max)` and Adam's
  `g ** 2`: the program reads the raw gradient once, the norm as a scalar operand.

  A candidate is an elementwise equation (or a call of elementwise ones) outside every
  component, with an output of the component's size, whose every output is used only by the
  component (and by what is absorbed with it) and is not a step output. Candidates are taken
  (with their own candidate producers, or alone) while the number of array operands the
  component reads does not grow and its operands stay within the executors' limit; the
  device computes no fewer values otherwise, and a scalar computed once on the device is not
  recomputed per element.
  """
  uses: dict[Any, list[int]] = {}
  def_of: dict[Any, int] = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jc.Var):
        uses.setdefault(v, []).append(k)
    for v in eqn.outvars:
      def_of[v] = k
  outs = {v for v in jaxpr.outvars if isinstance(v, jc.Var)}
  for comp in comps:
    member = set(comp.eqns)
    ok: dict[int, bool] = {}

    def candidate(d: int, comp=comp) -> bool:
      if d not in ok:
        eqn = jaxpr.eqns[d]
        ok[d] = (d not in tainted_eqns
                 and any(size_of(w.aval) == comp.size for w in eqn.outvars)
                 and all(size_of(w.aval) in (comp.size, 1) and computable(w.aval)
                         and w not in outs for w in eqn.outvars)
                 and not _eqn_why(eqn, [isinstance(v, jc.Var) and size_of(v.aval) == comp.size
                                        for v in eqn.invars], comp.size))
      return ok[d]

    def feeds_only(d: int, into: set[int]) -> bool:
      return all(u in into for w in jaxpr.eqns[d].outvars for u in uses.get(w, ()))

    def producers(eqn_ids: set[int]) -> list[int]:
      found = {def_of[v] for k in eqn_ids for v in jaxpr.eqns[k].invars
               if isinstance(v, jc.Var) and v in def_of}
      return sorted(found - eqn_ids, reverse=True)

    def cost(eqn_ids: set[int]) -> tuple[int, int]:
      """(array operands, all operands) that `eqn_ids` read from outside themselves."""
      inside = {w for k in eqn_ids for w in jaxpr.eqns[k].outvars}
      read = {v for k in eqn_ids for v in jaxpr.eqns[k].invars
              if isinstance(v, jc.Var) and v not in inside}
      arrays = sum(1 for v in read if size_of(v.aval) > 1 or comp.size == 1)
      return arrays, len(read)

    best = cost(member)
    changed = True
    while changed:
      changed = False
      for d in producers(member):
        if d in member or not candidate(d) or not feeds_only(d, member):
          continue
        with_upstream = {d}
        grew = True
        while grew:  # d's own candidate producers that feed only what is taken.
          grew = False
          for u in producers(member | with_upstream):
            if u not in with_upstream and candidate(u) and feeds_only(u, member | with_upstream):
              with_upstream.add(u)
              grew = True
        for take in (with_upstream, {d}):
          arrays, total = cost(member | take)
          if arrays <= best[0] and total <= max(best[1], MAX_OPERANDS):
            member |= take
            best = (arrays, total)
            changed = True
            break
        if changed:
          break
    comp.eqns = sorted(member)


class _SubJaxpr:
  """A jaxpr restricted to some of its equations (for `check_elementwise`)."""

  def __init__(self, jaxpr: Any, eqn_ids: list[int]):
    self.invars = jaxpr.invars
    self.eqns = [jaxpr.eqns[k] for k in eqn_ids]
