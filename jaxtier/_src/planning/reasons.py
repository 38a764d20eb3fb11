"""Why a leaf has its placement: a record of a kind and its fields, rendered as text only for
the plan (`LeafPlan.reason`), and the planner steps' frozen placements (`Placed`).

A leaf's reason is one `Reason` (why it is where it is) with the notes later steps add (who
updates it, how): `render` joins them with '; '.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any, Callable, Mapping

from jaxtier._src.planning import placements
from jaxtier._src.planning.placements import Schedule
from jaxtier._src.units import format_bytes
from jaxtier._src.vocab import Placement, Role

USER_PLACED = "placed by the user's policy"


class Kind(enum.StrEnum):
  """The kinds of reason and note; each renders from its own fields (`_TEXT`)."""

  # The policy's requests.
  STATE_AUTO = "state_auto"  # optimizer state under the automatic placement
  PARAM_AUTO = "param_auto"  # a parameter under the automatic placement
  INVENTORY = "inventory"  # other leaves: the inventory's `why` (why=)
  POLICY_NONE = "policy_none"  # policy 'none'
  USER_PLACED = "user_placed"  # the user's policy placed it
  STATE_NOT_STREAMED = "state_not_streamed"  # optimizer state asked to be streamed (asked=)
  # The cut's fallbacks to host_xla.
  PARAM_NOT_SERVED = "param_not_served"  # a parameter no fused update serves (by_user=, why=)
  NOT_ELEMENTWISE = "not_elementwise"  # the update is not one elementwise pass (why=)
  # The solver's placements (fit=: a FIT_* reason).
  FIT_NO_BUDGET = "fit_no_budget"
  FIT_PEAK = "fit_peak"  # (peak=, budget=) bytes
  FIT_NONE = "fit_none"  # no plan fits the budgets
  STATE_ON_DEVICE = "state_on_device"  # (fit=, host_secs=)
  STATE_RULE_BASED = "state_rule_based"  # no plan fits (executor=, secs=)
  STATE_MOVED = "state_moved"  # moved to fit the budget (executor=, freed=, secs=, bound=)
  STATE_ON_HOST = "state_on_host"  # no device budget (executor=)
  PARAM_ON_DEVICE = "param_on_device"  # (fit=)
  # (placement=, nbytes=, freed=, rows=: bytes gathered per step or None, dha_gbps=,
  # link_gbps=: the profile's DHA matmul and copy engine rates)
  PARAM_ON_HOST = "param_on_host"
  KEPT_ON_DEVICE = "kept_on_device"  # a host_xla fallback kept on the device (fallback=)
  # Notes.
  UPDATED_IN_PLACE_BY = "updated_in_place_by"  # a served leaf's call's executor (executor=)
  SHARES_CALL = "shares_call"  # placed with its fused call's executor (executor=)
  LAYERED = "layered"  # updated layer by layer (executor=, fraction=: DHA share or None)
  FP32_MASTER = "fp32_master"  # updated from an fp32 master copy (dtype=)


@dataclasses.dataclass(frozen=True)
class Reason:
  """Why a leaf has its placement (or a note on how it is served).

  Attributes:
    kind: what kind of reason.
    fields: its fields as (name, value) pairs (bytes, seconds, placement names, the
      analysis's sentences, nested reasons).
    notes: notes later planner steps added, rendered after it, each after '; '.
  """

  kind: Kind
  fields: tuple[tuple[str, Any], ...] = ()
  notes: tuple["Reason", ...] = ()

  def __getitem__(self, name: str) -> Any:
    return dict(self.fields)[name]

  def with_note(self, note: "Reason") -> "Reason":
    """This reason with `note` added last."""
    return dataclasses.replace(self, notes=self.notes + (note,))

  def without(self, kind: Kind) -> "Reason":
    """This reason without its notes of `kind`."""
    return dataclasses.replace(self, notes=tuple(n for n in self.notes if n.kind != kind))


def reason(kind: Kind, **fields: Any) -> Reason:
  """A `Reason` of `kind` with `fields` (no notes)."""
  return Reason(kind, tuple(fields.items()))


def render(r: Reason) -> str:
  """The text of `r` and its notes, as the plan prints it."""
  return _TEXT[r.kind](r) + "".join("; " + render(n) for n in r.notes)


def _not_read_in_place(dha: float, link: float) -> str:
  """Why a streamed (matmul) weight is not read in place by the DHA matmul instead."""
  if dha < link:
    return (f" (the copy engines move it at {link:.1f} GB/s; the DHA matmul would read it in "
            f"place at {dha:.1f}, profile)")
  return (f" (the DHA matmul would read it in place at {dha:.1f} GB/s, above the copy engines' "
          f"{link:.1f}, but only embedding tables are read in place)")


def _param_on_host(r: Reason) -> str:
  schedule = placements.schedule_of(r["placement"], Role.PARAM)
  if schedule is Schedule.STREAMED:
    how = ("prefetched layer by layer ahead of its use"
           + _not_read_in_place(r["dha_gbps"], r["link_gbps"]))
  elif schedule is Schedule.GATHERED and r["rows"] is not None:
    how = (f"an embedding table whose rows the DHA gather reads in place "
           f"({format_bytes(r['rows'])} of rows per step, not the "
           f"{format_bytes(r['nbytes'])} a copy of the table would move; its gradient rows "
           f"are added into a pinned_host buffer, so no table-sized gradient is in HBM)")
  else:
    how = "read in place by the GPU (zero-copy)"
  return (f"parameter: lives in pinned_host, {how}, to fit the device budget "
          f"(frees {format_bytes(r['freed'])} with its gradient); its optimizer state is "
          "updated on the host")


def _param_not_served(r: Reason) -> str:
  by = "by the user's policy " if r["by_user"] else ""
  return (f"a parameter placed {by}is {r['why']}, so no fused host update can serve it: it "
          "lives in pinned_host and XLA copies it in and its new value out (host_xla). A stack "
          "of layers read by a layer loop can be placed 'host_stream' instead")


def _fallback_head(r: Reason) -> str:
  """A host_xla fallback's reason without its last clause (XLA's transfers)."""
  if r.kind is Kind.NOT_ELEMENTWISE:
    return f"update not one elementwise pass ({r['why']})"
  return render(r)


def _state_moved(r: Reason) -> str:
  return (f"optimizer state: moved to pinned_host to fit the device budget "
          f"(frees {format_bytes(r['freed'])} with its call's other "
          f"leaves); its fused update ({r['executor']}) adds {r['secs'] * 1e3:.3g} ms per "
          f"step after the backward pass, bound by {r['bound']}")


_TEXT: Mapping[Kind, Callable[[Reason], str]] = types.MappingProxyType({
    Kind.STATE_AUTO: lambda r: "optimizer state: touched once per step, updated where it lives",
    Kind.PARAM_AUTO: lambda r: "parameter: read by the step's compute",
    Kind.INVENTORY: lambda r: r["why"],
    Kind.POLICY_NONE: lambda r: "policy 'none'",
    Kind.USER_PLACED: lambda r: USER_PLACED,
    Kind.STATE_NOT_STREAMED: lambda r: (
        f"{USER_PLACED} as {r['asked']}: optimizer state is not streamed; it lives in "
        "pinned_host, updated in place by the fused host update"),
    Kind.PARAM_NOT_SERVED: _param_not_served,
    Kind.NOT_ELEMENTWISE: lambda r: (
        f"update not one elementwise pass ({r['why']}): XLA memory-kind transfers"),
    Kind.FIT_NO_BUDGET: lambda r: "no device budget",
    Kind.FIT_PEAK: lambda r: (f"predicted peak {format_bytes(r['peak'])} of the "
                              f"{format_bytes(r['budget'])} device budget"),
    Kind.FIT_NONE: lambda r: (
        "no plan fits the budgets; the rule-based plan keeps it here: see the notes"),
    Kind.STATE_ON_DEVICE: lambda r: (
        f"optimizer state: fits on the device ({render(r['fit'])}); on the host its update "
        f"would add {r['host_secs'] * 1e3:.3g} ms per step"),
    Kind.STATE_RULE_BASED: lambda r: (
        f"optimizer state: no plan fits the budgets, so on the host as the rule-based plan "
        f"has it; updated by {r['executor']} ({r['secs'] * 1e3:.3g} ms per step after the "
        "backward pass)"),
    Kind.STATE_MOVED: _state_moved,
    Kind.STATE_ON_HOST: lambda r: f"optimizer state: on the host, updated by {r['executor']}",
    Kind.PARAM_ON_DEVICE: lambda r: (
        f"parameter: read by the step's compute; stays on the device ({render(r['fit'])})"),
    Kind.PARAM_ON_HOST: _param_on_host,
    Kind.KEPT_ON_DEVICE: lambda r: (
        f"{_fallback_head(r['fallback'])}: served by XLA's transfers it would be on the device "
        "during the step anyway (no peak saved); kept on the device"),
    Kind.UPDATED_IN_PLACE_BY: lambda r: f"updated in place by {r['executor']}",
    Kind.SHARES_CALL: lambda r: (
        f"updated with the leaves it shares a fused call with ({r['executor']})"),
    Kind.LAYERED: lambda r: (
        f"updated layer by layer inside the backward pass, by {r['executor']}"
        + (f" (the DHA kernel's share {r['fraction']:.2f})" if r["fraction"] is not None
           else "")),
    Kind.FP32_MASTER: lambda r: (
        f"its update runs on the host from an fp32 master copy, the new {r['dtype']} value is "
        "sent to the device"),
})
assert set(_TEXT) == set(Kind), "every reason kind renders"


@dataclasses.dataclass(frozen=True)
class Placed:
  """Every leaf's placement and its reason, and the leaves a fused host update updates where
  they live: the value each planner step (request -> cut -> solve -> assign) returns anew.

  Attributes:
    placement: {leaf index: placement}.
    reasons: {leaf index: why}.
    fused: indices of the leaves a fused host update updates (their placement's record's
      `fused_update`).
  """

  placement: Mapping[int, Placement]
  reasons: Mapping[int, Reason]
  fused: frozenset[int]

  @staticmethod
  def of(placement: Mapping[int, str], reasons: Mapping[int, Reason],
         fused: "set[int] | frozenset[int]") -> "Placed":
    """A `Placed` holding read-only copies of `placement`, `reasons` and `fused`."""
    return Placed(types.MappingProxyType(dict(placement)), types.MappingProxyType(dict(reasons)),
                  frozenset(fused))
