"""The cut: the fused host updates around the host leaves, each compiled to an op program."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import jaxpr_graph, op_program_compiler
from jaxtier._src.analysis.inventory import Inventory
from jaxtier._src.hardware import profile
from jaxtier._src.planning import placements
from jaxtier._src.planning.placements import Schedule, schedule_of
from jaxtier._src.planning.reasons import Kind, Placed, reason, render
from jaxtier._src.primitives.host_update import ProgramTooLarge
from jaxtier._src.vocab import Placement, Role

log = logging.getLogger("jaxtier")


@dataclasses.dataclass(frozen=True)
class Cut:
  """The cut of one placement of the leaves.

  Attributes:
    placed: the placements after the cut: its fallbacks to host_xla, its executors.
    compiled: the fused host updates, each compiled to an op program
      (`program_compiler.CompiledComponent`).
    masters: indices of the bf16/f16 params that get fp32 masters.
  """

  placed: Placed
  compiled: tuple[Any, ...]
  masters: frozenset[int]


def cut_updates(inv: Inventory, placed: Placed, hardware: "profile.HardwareProfile",
                host_exec: str, user_placed: "set[int] | frozenset[int]" = frozenset()) -> Cut:
  """Cuts the host updates around `placed.fused` and compiles each into an op program.

  A component that cannot run as one op program falls back to `host_xla` (the returned
  placements say so, with the reason): only its parameters where it has any (a parameter
  with an executor is read by the forward pass, which ties in every host leaf it reaches),
  else all its leaves; re-cut until stable. `host_stream` leaves are in `placed.fused`
  (their update is a fused host update) but their reads by layer loops do not taint; their
  call's executor is its other leaves' (else `host_exec`), and each leaf of a call takes its
  executor. `user_placed`: the leaves whose placement the user's policy asked for (their
  executor wins a fused call).

  Returns:
    The `Cut`: new placements, the compiled components and the fp32-master params.
  """
  jaxpr, consts = inv.closed_jaxpr.jaxpr, list(inv.closed_jaxpr.consts)
  placement, reasons = dict(placed.placement), dict(placed.reasons)
  executor_leaves = set(placed.fused)
  while True:
    streamed = {i for i in executor_leaves
                if schedule_of(placement[i], inv.leaves[i].role) is Schedule.STREAMED}
    gathered = gathered_tables(inv, placement, executor_leaves)
    served = streamed | gathered
    comps = jaxpr_graph.components(jaxpr, executor_leaves, streamed, gathered)
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
          cc = op_program_compiler.compile_component(
              jaxpr, consts, comp, frozenset(comp_masters), frozenset(executor_leaves))
          # One executor per fused call: the one the user's policy asked for most (else the
          # automatic choice); ties go to the first in name order.
          execs = [i for i in comp.seeds if i not in served]
          chosen = [placement[i] for i in execs if i in user_placed] or [
              placement[i] for i in execs] or [host_exec]
          executor = max(sorted(set(chosen)), key=chosen.count)
          for i in comp.seeds:
            if i in served:
              # (A re-cut names the executor it chose in place of the last one.)
              reasons[i] = reasons[i].without(Kind.UPDATED_IN_PLACE_BY).with_note(
                  reason(Kind.UPDATED_IN_PLACE_BY, executor=executor))
            elif placement[i] != executor:
              reasons[i] = reasons[i].with_note(reason(Kind.SHARES_CALL, executor=executor))
              placement[i] = executor
          compiled.append(dataclasses.replace(
              cc, executor=placements.record(executor).executor,
              dha_fraction=profile.split_fraction(hardware)))
        except (op_program_compiler.Unsupported, ProgramTooLarge) as e:
          why = str(e)
      if why or not comp.elementwise:
        # The usual cause: a parameter placed with an executor is read by the forward pass
        # too, which ties every host leaf it reaches into one non-elementwise cut. Only such
        # parameters fall back (each with its own reason); the other leaves are cut again
        # without them, so that no leaf's request changes another's placement.
        params = [i for i in comp.seeds if inv.leaves[i].role == Role.PARAM
                  and i not in served]
        for i in params or comp.seeds:
          executor_leaves.discard(i)
          placement[i] = Placement.HOST_XLA
          if params:
            reasons[i] = reason(Kind.PARAM_NOT_SERVED, by_user=i in user_placed,
                                why=inv.leaves[i].why)
          else:
            reasons[i] = reason(Kind.NOT_ELEMENTWISE, why=why)
        # One line per reason, with the leaves it names: warned where the user placed them; for
        # the planner's own candidates the solver decides next (most stay on the device), so
        # only logged.
        for user, level in ((True, log.warning), (False, log.info)):
          by_reason: dict[str, list[str]] = {}
          for i in params or comp.seeds:
            if (i in user_placed) == user:
              by_reason.setdefault(render(reasons[i]), []).append(inv.leaves[i].path)
          for text, paths in by_reason.items():
            named = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3
                                            else "")
            level("jaxtier: %s fall%s back to host_xla: %s",
                  f"{len(paths)} leaves ({named})" if len(paths) > 1 else f"leaf {named}",
                  "" if len(paths) > 1 else "s", text)
        demoted = True
      else:
        masters |= comp_masters
    if not demoted:
      return Cut(Placed.of(placement, reasons, executor_leaves), tuple(compiled),
                 frozenset(masters))


def gathered_tables(inv: Inventory, placement: Mapping[int, str],
                    leaves: "set[int] | None" = None) -> set[int]:
  """The parameters placed `host_dha` (among `leaves`): embedding tables whose rows the DHA
  gather reads in place (`analysis/lookups.py`; the policy refuses other such parameters)."""
  return {i for i, p in placement.items()
          if schedule_of(p, inv.leaves[i].role) is Schedule.GATHERED
          and (leaves is None or i in leaves)}


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
