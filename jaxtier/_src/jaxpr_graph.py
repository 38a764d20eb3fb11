"""Dataflow over a traced step's jaxpr: which equations a host-resident leaf reaches.

Taint flows forward from chosen input variables (the host-placed state leaves). The tainted
equations split into connected components; a component is *elementwise* when every tainted
equation maps arrays of one element count N (or broadcast scalars) elementwise, so that it can
run as one pass over the host buffers (`jaxtier/_src/primitives/host_update.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import numpy as np

from jaxtier._src import jax_compat as jc

# lax primitives that act elementwise on equally-shaped operands (0-d operands broadcast).
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "abs", "sqrt", "rsqrt", "exp", "exp2", "log", "tanh",
    "logistic", "sign", "floor", "ceil", "log1p", "expm1", "sin", "cos", "not", "erf", "round",
    "is_finite", "max", "min", "pow", "atan2", "gt", "ge", "lt", "le", "eq", "ne", "and", "or",
    "rem", "select_n", "clamp", "integer_pow", "square", "convert_element_type", "copy",
    "copy_p", "reduce_precision", "stop_gradient", "optimization_barrier",
})
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


def taint_forward(jaxpr: Any, seeds: Iterable[int]) -> tuple[set[int], set[Any]]:
  """Indices of equations reachable from invars `seeds`, and the set of tainted Vars."""
  tainted: set[Any] = {jaxpr.invars[i] for i in seeds}
  eqns: set[int] = set()
  for k, eqn in enumerate(jaxpr.eqns):
    if any(isinstance(v, jc.Var) and v in tainted for v in eqn.invars):
      eqns.add(k)
      tainted.update(v for v in eqn.outvars if not isinstance(v, jc.DropVar))
  return eqns, tainted


def check_elementwise(jaxpr: Any, tainted_in: list[bool], n: int) -> str:
  """Empty string if every equation tainted by `tainted_in` is elementwise over N elements.

  Otherwise a short reason naming the first offending primitive. Recurses into call-like
  equations (pjit, custom_jvp/vjp).
  """
  tainted = {v for v, t in zip(jaxpr.invars, tainted_in) if t}
  for eqn in jaxpr.eqns:
    hit = [isinstance(v, jc.Var) and v in tainted for v in eqn.invars]
    if not any(hit):
      continue
    outs = [v for v in eqn.outvars if not isinstance(v, jc.DropVar)]
    tainted.update(outs)
    name = eqn.primitive.name
    inner = jc.inner_jaxpr(eqn)
    if inner is not None:
      inner_jaxpr, _ = jc.open_jaxpr(inner)
      offset = len(eqn.invars) - len(inner_jaxpr.invars)
      why = check_elementwise(inner_jaxpr, hit[offset:], n) if offset >= 0 else f"{name} layout"
      if why:
        return why
      continue
    if name not in ELEMENTWISE and name not in FLAT_IDENTITY:
      return f"`{name}` is not elementwise"
    for v, is_t in zip(eqn.invars, hit):
      s = size_of(v.aval)
      if is_t and s != n:
        return f"`{name}` mixes {s} and {n} elements"
      if not is_t and s not in (n, 1):
        return f"`{name}` reads an operand of {s} elements, not {n} or 1"
      if is_t and not _is_float_or_bool(v.aval):
        return f"`{name}` computes in {v.aval.dtype}"
    for v in outs:
      if size_of(v.aval) != n:
        return f"`{name}` produces {size_of(v.aval)} elements, not {n}"
      if not _is_float_or_bool(v.aval):
        return f"`{name}` produces {v.aval.dtype}"
    if name == "select_n" and len(eqn.invars) != 3:
      return "`select_n` with more than two cases"
    if name == "convert_element_type" and not _is_float_or_bool(eqn.outvars[0].aval):
      return f"conversion to {eqn.outvars[0].aval.dtype}"
  return ""


def components(jaxpr: Any, seeds: Iterable[int]) -> list[Component]:
  """Splits the equations tainted by invars `seeds` into connected components.

  Two tainted equations are connected when one reads a tainted value the other writes, or both
  read the same host leaf. Each component is checked with `check_elementwise`.
  """
  seeds = sorted(set(seeds))
  eqn_ids, tainted = taint_forward(jaxpr, seeds)
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
    if len(sizes) != 1:
      comp.elementwise, comp.why = False, f"host leaves of different sizes {sorted(sizes)} interact"
      continue
    sub_in = [i in comp.seeds for i in range(len(jaxpr.invars))]
    # Check only this component's equations: build a view restricted to them.
    view = _SubJaxpr(jaxpr, comp.eqns)
    why = check_elementwise(view, sub_in, comp.size)
    comp.elementwise, comp.why = (not why), why
  return result


def _absorb(jaxpr: Any, comps: list[Component], tainted_eqns: set[int]) -> None:
  """Pulls untainted elementwise equations that only feed a component into it.

  Example: AdamW's weight decay `0.1 * param` and the `convert(param, f32)` of
  `apply_updates` are computed from a device param and used only by the host update. Run inside
  the op program, they read the param's fp32 master copy (when it has one) and cost the device
  nothing. An equation is absorbed when it is elementwise, every use of its outputs is in the
  component, none is a step output, and each input is a literal, a scalar, a step input, or a
  value the component already computes.
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
  top_in = set(jaxpr.invars)
  for comp in comps:
    member = set(comp.eqns)
    changed = True
    while changed:
      changed = False
      for k in sorted(member):
        for v in jaxpr.eqns[k].invars:
          d = def_of.get(v) if isinstance(v, jc.Var) else None
          if d is None or d in member or d in tainted_eqns:
            continue
          eqn = jaxpr.eqns[d]
          name = eqn.primitive.name
          if name not in ELEMENTWISE and name not in FLAT_IDENTITY:
            continue
          if any(w in outs or any(u not in member for u in uses.get(w, ())) for w in eqn.outvars):
            continue
          if any(size_of(w.aval) not in (comp.size, 1) or not _is_float_or_bool(w.aval)
                 for w in eqn.outvars):
            continue
          if all(isinstance(a, jc.Literal) or a in top_in or size_of(a.aval) == 1
                 or def_of.get(a) in member for a in eqn.invars):
            member.add(d)
            changed = True
    comp.eqns = sorted(member)


class _SubJaxpr:
  """A jaxpr restricted to some of its equations (for `check_elementwise`)."""

  def __init__(self, jaxpr: Any, eqn_ids: list[int]):
    self.invars = jaxpr.invars
    self.eqns = [jaxpr.eqns[k] for k in eqn_ids]
