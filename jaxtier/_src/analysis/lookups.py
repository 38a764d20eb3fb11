"""Embedding lookups: parameter tables read only by row gathers, their gradient by one scatter.

A table `[V, D]` read as `jnp.take(table, ids, axis=0)` (or `table[ids]`) appears in the traced
step as a `gather` of whole rows; `jax.grad` makes its gradient a `scatter-add` of the rows'
cotangents into zeros of the table's shape, with the same indices. Such a table can stay in
`pinned_host` (placement `host_dha`): the lowering gathers its rows with the DHA kernel and
scatter-adds the gradient rows into a pinned_host buffer (`jaxtier/_src/primitives/dha.py`),
so neither the table nor a table-sized gradient is ever in HBM. `table_lookup` says whether a
parameter leaf is such a table, and why not when it is not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import jaxpr_graph

@dataclasses.dataclass(frozen=True)
class TableLookup:
  """How the traced step reads one embedding table and makes its gradient.

  Attributes:
    leaf: the table's state-leaf index.
    gather: index of the row `gather` equation (the forward's read).
    scatter: index of the `scatter-add` equation whose result is the table's gradient.
    zeros: index of the equation making the scatter's zero operand (skipped when lowered).
    num_ids: ids looked up per step (rows gathered), per device.
    row_nbytes: bytes of one row of the table.
  """

  leaf: int
  gather: int
  scatter: int
  zeros: int
  num_ids: int
  row_nbytes: int

  @property
  def rows_nbytes(self) -> int:
    """Bytes of the rows one step gathers (and of their gradient rows, in the table's dtype)."""
    return self.num_ids * self.row_nbytes


@dataclasses.dataclass(frozen=True)
class NotATable:
  """A leaf the DHA gather cannot serve in place (`table_lookup`).

  Attributes:
    why: a sentence saying why.
  """

  why: str


def _is_row_scatter(eqn: Any) -> bool:
  if eqn.primitive.name != "scatter-add" or len(eqn.invars) != 3:
    return False
  table, idx, rows = (v.aval for v in eqn.invars)
  dn = eqn.params["dimension_numbers"]
  return (len(table.shape) == 2 and idx.shape[-1:] == (1,)
          and tuple(dn.update_window_dims) == (len(idx.shape) - 1,)
          and tuple(dn.inserted_window_dims) == (0,)
          and tuple(dn.scatter_dims_to_operand_dims) == (0,)
          and not tuple(getattr(dn, "operand_batching_dims", ()))
          and tuple(rows.shape) == tuple(idx.shape[:-1]) + (table.shape[1],)
          and jaxpr_graph.mode_name(eqn.params.get("mode")) in jaxpr_graph.ROW_GATHER_MODES)


def _is_zeros(eqn: Any) -> bool:
  """A `broadcast_in_dim` of the literal 0."""
  if eqn.primitive.name != "broadcast_in_dim" or len(eqn.invars) != 1:
    return False
  v = eqn.invars[0]
  return isinstance(v, jc.Literal) and np.all(np.asarray(v.val) == 0)


def table_lookup(jaxpr: Any, index: int) -> "TableLookup | NotATable":
  """The lookup of state leaf `index` of the traced step's top-level `jaxpr`, or why there is
  none (`NotATable`).

  A leaf qualifies when it is a 2-d float table whose every top-level read is either one row
  `gather` (the forward) or an elementwise equation over all its elements (its update), and
  whose gradient is one `scatter-add` of rows into zeros with the gather's indices, read only
  elementwise over the table's elements (an optimizer's update; a global-norm clip, which
  reduces the gradient on the device, is not).
  """
  v = jaxpr.invars[index]
  shape = tuple(v.aval.shape)
  if len(shape) != 2:
    return NotATable(
        f"it is {len(shape)}-d; a zero-copy lookup serves a 2-d table [rows, width]")
  n = jaxpr_graph.size_of(v.aval)
  gathers: list[int] = []
  for k, eqn in enumerate(jaxpr.eqns):
    if not any(x is v for x in eqn.invars):
      continue
    if jaxpr_graph.is_row_gather(eqn) and eqn.invars[0] is v and eqn.invars[1] is not v:
      gathers.append(k)
      continue
    if (eqn.primitive.name == "gather" and eqn.invars[0] is v
        and jaxpr_graph.mode_name(eqn.params.get("mode")) not in jaxpr_graph.ROW_GATHER_MODES):
      return NotATable(
          f"its rows are gathered with mode {jaxpr_graph.mode_name(eqn.params.get('mode'))}"
          " (ids clamped into the table), which the DHA gather does not do (an id out of "
          "range reads zeros there): use `jnp.take`'s default mode")
    if not jaxpr_graph.elementwise_over(eqn, n):
      why = (" (control flow whose branches or body read the whole table)"
             if eqn.primitive.name in ("cond", "while") else "")
      return NotATable(
          f"the step reads it with `{eqn.primitive.name}`{why}, not only as rows gathered "
          "by `jnp.take(table, ids, axis=0)` and elementwise by its update")
  if len(gathers) != 1:
    return NotATable(
        "the step reads no rows of it" if not gathers else
        f"the step gathers its rows {len(gathers)} times; one lookup per step is served")
  g = jaxpr.eqns[gathers[0]]
  idx = g.invars[1]
  producer = {o: k for k, e in enumerate(jaxpr.eqns) for o in e.outvars}
  scatters = [k for k, e in enumerate(jaxpr.eqns) if _is_row_scatter(e) and e.invars[1] is idx
              and tuple(e.invars[0].aval.shape) == shape]
  if len(scatters) != 1:
    return NotATable(
        "its gradient is not one scatter-add of the gathered rows (is it differentiated?)")
  s = jaxpr.eqns[scatters[0]]
  z = producer.get(s.invars[0])
  if z is None or not _is_zeros(jaxpr.eqns[z]):
    return NotATable("its gradient's scatter-add does not start from zeros")
  why = _elementwise_uses(jaxpr, s.outvars[0], n)
  if why:
    return NotATable(
        f"its gradient is {why}; a zero-copy lookup's gradient is read only by its update")
  row = shape[1] * np.dtype(v.aval.dtype).itemsize
  return TableLookup(leaf=index, gather=gathers[0], scatter=scatters[0], zeros=z,
                     num_ids=int(np.prod(idx.aval.shape[:-1], dtype=np.int64)),
                     row_nbytes=int(row))


def _elementwise_uses(jaxpr: Any, var: Any, n: int) -> str:
  """Why the values computed from `var` are not elementwise over its n elements ('' if they
  are): a reduction or a non-elementwise equation reads them, or the step returns it."""
  tainted = {var}
  if any(o is var for o in jaxpr.outvars):
    return "returned by the step"
  for eqn in jaxpr.eqns:
    hit = [isinstance(x, jc.Var) and x in tainted for x in eqn.invars]
    if not any(hit):
      continue
    for o in eqn.outvars:
      if jaxpr_graph.size_of(o.aval) != n:
        made = jaxpr_graph.size_of(o.aval)
        return (f"read by `{eqn.primitive.name}`, which makes {made} "
                f"element{'s' if made != 1 else ''} of its {n} (a reduction on the device: a "
                "global-norm clip, a non-finite check, or a factored optimizer as Adafactor)")
    if not jaxpr_graph.elementwise_over(eqn, n):
      return f"read by `{eqn.primitive.name}`"
    tainted.update(o for o in eqn.outvars if not isinstance(o, jc.DropVar))
  return ""


def table_lookups(jaxpr: Any, indices: Any) -> dict[int, TableLookup]:
  """{leaf index: lookup} of the leaves among `indices` that are embedding tables."""
  out = {}
  for i in indices:
    got = table_lookup(jaxpr, i)
    if isinstance(got, TableLookup):
      out[i] = got
  return out
