"""Embedding tables read in place: the DHA gather in the forward, a host scatter-add for the
gradient.

A parameter placed `host_dha` is an embedding table (`analysis/lookups.py`): it stays in
`pinned_host` for the whole step. Lowered here:

    rows = dha.gather(table, ids)              # the forward's row gather: N rows cross the link
    G    = dha.scatter_add(G, ids, d_rows)     # the backward's scatter-add into zeros

`G` is a persistent pinned_host buffer of the table's shape (a scratch buffer of the streaming
schedule, donated and returned by the compute program); the fused host update reads the
gradient there, as it reads a streamed leaf's. Neither the table nor a table-sized gradient is
ever in HBM: the device holds the N gathered rows and their N gradient rows. The zeros the
traced scatter starts from are not made.

A gradient that the compute program itself reads (not only the update) stays the traced dense
scatter on the device: `schedule` says so in its notes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import lookups as lookups_lib
from jaxtier._src.lowering import streaming
from jaxtier._src.planning.plan import Plan
from jaxtier._src.planning.placements import Schedule, schedule_of


@dataclasses.dataclass(frozen=True)
class LookupSchedule:
  """The lookups the lowering serves in place.

  Attributes:
    gathers: top-level equation index of a row gather -> the table's state-leaf index.
    scatters: equation index of a gradient's scatter-add -> its scratch buffer's index (in
      the streaming schedule's scratch, after the streamed gradients' buffers).
    skip: equations not bound (the zeros the scatters start from).
    scratch: the gradient buffers, in order.
    sent_vars: the gradient's jaxpr var -> scratch index (the update reads it there).
    notes: why a table's gradient stays on the device, where it does.
  """

  gathers: dict[int, int]
  scatters: dict[int, int]
  skip: frozenset[int]
  scratch: tuple[streaming.Scratch, ...]
  sent_vars: dict[Any, int]
  notes: tuple[str, ...] = ()


EMPTY = LookupSchedule({}, {}, frozenset(), (), {})


def schedule(jaxpr: Any, plan: Plan, host_eqns: "set[int]", first_scratch: int) -> LookupSchedule:
  """The lookup schedule of the tables `plan` places `host_dha`.

  Args:
    jaxpr: the traced step's top-level jaxpr (state leaves first among its invars).
    plan: the plan (its `host_dha` parameters are tables, as the policy and the solver check).
    host_eqns: the equations the fused host updates run.
    first_scratch: the index the first gradient buffer gets among the scratch buffers.

  Raises:
    ValueError: a `host_dha` parameter that is not an embedding table (a plan not made by the
      planner).
  """
  tables = [l for l in plan.leaves if schedule_of(l.placement, l.role) is Schedule.GATHERED]
  if not tables:
    return EMPTY
  uses: dict[Any, list[int]] = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jc.Var):
        uses.setdefault(v, []).append(k)
  gathers, scatters, skip, scratch, sent, notes = {}, {}, set(), [], {}, []
  for leaf in tables:
    got = lookups_lib.table_lookup(jaxpr, leaf.index)
    if isinstance(got, lookups_lib.NotATable):
      raise ValueError(f"leaf {leaf.path} is placed host_dha but is not an embedding table the "
                       f"DHA gather can serve: {got.why}")
    gathers[got.gather] = leaf.index
    grad = jaxpr.eqns[got.scatter].outvars[0]
    if not set(uses.get(grad, ())) <= host_eqns:
      notes.append(f"{leaf.path}: its gradient is read by the compute, not only by its fused "
                   "host update, so it is scatter-added on the device (a table-sized buffer "
                   "in HBM) and then sent to the update")
      continue
    s = first_scratch + len(scratch)
    scatters[got.scatter] = s
    skip.add(got.zeros)
    scratch.append(streaming.Scratch(shape=tuple(grad.aval.shape), dtype=grad.aval.dtype,
                                     leaf=leaf.index))
    sent[grad] = s
  # The zeros are skipped only where nothing else reads them.
  skip = {k for k in skip if all(u in scatters for u in uses.get(jaxpr.eqns[k].outvars[0], ()))}
  return LookupSchedule(gathers, scatters, frozenset(skip), tuple(scratch), sent, tuple(notes))
