"""Policies: what a user asks for each leaf (a name, a callable, or {regex: placement})."""

from __future__ import annotations

import re
import types
from typing import Any, Callable, Mapping, NamedTuple
import warnings

from jaxtier._src.analysis.inventory import Inventory, LeafInfo
from jaxtier._src.errors import PlanError
from jaxtier._src.planning import placements
from jaxtier._src.planning.placements import Schedule
from jaxtier._src.planning.reasons import Kind, Reason, reason
# The text of a user-placed leaf's reason, which the pipeline and the tests match.
from jaxtier._src.planning.reasons import USER_PLACED  # pylint: disable=unused-import
from jaxtier._src.vocab import NamedPolicy, Placement, Role, is_named


Policy = str | Callable[[str, LeafInfo], "str | None"] | Mapping[str, str]


class Request(NamedTuple):
  """What the policy asks for one leaf: its placement, why, and whether the user asked."""

  placement: Placement
  reason: Reason
  user_placed: bool = False


def check_policy_form(policy: Any, api: str) -> None:
  """Raises PlanError unless `policy` is a named policy, a callable or a mapping."""
  if is_named(policy):
    return
  if callable(policy) or isinstance(policy, Mapping):
    return
  raise PlanError(f"{api}: expected policy 'auto', 'none', "
                  f"'{NamedPolicy.OPTIMIZER_STATE_ON_HOST}', a callable (path, leaf) -> "
                  f"placement or a {{regex: placement}} dict, got {policy!r}")


def requested(inv: Inventory, policy: Policy, host_exec: str, stream_blocked: str = ""
               ) -> Mapping[int, Request]:
  """Placement asked by the policy for each leaf, with its reason (`stream_blocked`: why no
  leaf may be streamed here, '' when they may): {leaf index: request}, read-only.

  Raises:
    PlanError: an unknown placement, a policy pattern that is no regular expression, a
      policy callable that raised, or a placement the leaf may not take (its record's
      `refusal`).
  """
  out: dict[int, Request] = {}
  pattern_of: dict[int, str] = {}  # the pattern that placed each leaf (a dict policy)
  if isinstance(policy, Mapping):
    for pat in policy:
      try:
        re.compile(pat)
      except (re.error, TypeError) as e:
        raise PlanError(f"jaxtier.offload: policy pattern {pat!r} is not a regular expression "
                        f"({e}); patterns are searched in leaf paths like "
                        f"{inv.leaves[0].path if inv.leaves else '[0]'!s} (escape brackets: "
                        "r\"\\['w1'\\]\")") from e
  for leaf in inv.leaves:
    auto = (Request(host_exec, reason(Kind.STATE_AUTO))
            if leaf.role == Role.OPTIMIZER_STATE else Request(
                Placement.DEVICE, reason(Kind.INVENTORY, why=leaf.why) if leaf.role != Role.PARAM
                else reason(Kind.PARAM_AUTO)))
    if is_named(policy, NamedPolicy.AUTO, NamedPolicy.OPTIMIZER_STATE_ON_HOST):
      out[leaf.index] = auto
    elif is_named(policy, NamedPolicy.NONE):
      out[leaf.index] = Request(Placement.DEVICE, reason(Kind.POLICY_NONE))
    elif callable(policy):
      try:
        asked = policy(leaf.path, leaf)
      except Exception as e:  # pylint: disable=broad-except  (re-raised with the leaf named)
        raise PlanError(f"jaxtier.offload: the policy callable raised for leaf {leaf.path} "
                        f"({leaf.dtype}{list(leaf.shape)}): {e!r}; it is called as "
                        "policy(path: str, leaf) and returns a placement name or None") from e
      out[leaf.index] = auto if asked is None else Request(asked, reason(Kind.USER_PLACED), True)
    elif isinstance(policy, Mapping):
      pat = next((pat for pat in policy if re.search(pat, leaf.path)), None)
      out[leaf.index] = auto if pat is None else Request(policy[pat], reason(Kind.USER_PLACED),
                                                         True)
      if pat is not None:
        pattern_of[leaf.index] = pat
    else:
      check_policy_form(policy, "jaxtier.offload")
  if (is_named(policy, NamedPolicy.OPTIMIZER_STATE_ON_HOST)
      and not any(leaf.role == Role.OPTIMIZER_STATE for leaf in inv.leaves)):
    floats = [leaf for leaf in inv.leaves if leaf.role != Role.OTHER]
    shown = "; ".join(f"{leaf.path}: {leaf.role.value}, {leaf.why}" for leaf in floats[:3])
    warnings.warn(
        f"jaxtier.offload: policy {policy!r} places nothing in pinned_host: no state leaf has "
        "the role optimizer_state (read only elementwise by the step's update, and feeding "
        "its own new value). "
        f"{len(floats)} leaves are params or others" + (f", e.g. {shown}" if shown else "")
        + ". plan.table() gives every leaf's role and why", stacklevel=4)
  if isinstance(policy, Mapping):
    for pat in policy:
      if not any(re.search(pat, leaf.path) for leaf in inv.leaves):
        warnings.warn(f"jaxtier.offload: policy pattern {pat!r} matches no state leaf (paths "
                      f"look like {inv.leaves[0].path if inv.leaves else 'none'}); the leaves it "
                      "was meant for get the automatic placement", stacklevel=4)
  skipped = []
  floating_patterns = {pattern_of[l.index] for l in inv.leaves
                       if l.index in pattern_of and l.role != Role.OTHER}
  for i, request in out.items():
    leaf = inv.leaves[i]
    placement = request.placement
    if placement not in tuple(Placement):
      raise PlanError(f"jaxtier.offload: leaf {leaf.path}: unknown placement {placement!r}; "
                      f"expected one of {', '.join(Placement)}")
    placement = Placement(placement)
    out[i] = request = request._replace(placement=placement)
    rec = placements.record(placement)
    if placements.streamed(placement) and leaf.role == Role.OPTIMIZER_STATE:
      # A pattern for the layers' params also matches their optimizer state, whose paths
      # mirror them: that state is not read by the layer loop; it lives on the host, updated
      # in place by the fused host update, as a streamed param's optimizer state must.
      placement = host_exec
      rec = placements.record(placement)
      # (Not `user_placed`: the solver may still decide where its update runs.)
      out[i] = Request(placement, reason(Kind.STATE_NOT_STREAMED, asked=request.placement))
    refused = rec.refusal(inv, leaf, stream_blocked)
    if (refused is not None and refused.kind is placements.RefusalKind.NOT_FLOAT
        and pattern_of.get(i) in floating_patterns):
      # A pattern over a module's leaves also matches its RNG keys and counters, which no
      # placement off the device can hold: they keep the automatic placement (named below). A
      # pattern that matches only such leaves meant them: refused.
      skipped.append(leaf.path)
      out[i] = Request(Placement.DEVICE, reason(Kind.INVENTORY, why=leaf.why))
      continue
    if refused is not None:
      raise PlanError(_refused(refused, leaf, isinstance(policy, Mapping)))
    if (rec.schedule_of(leaf.role) is Schedule.UPDATED_IN_PLACE
        and host_exec == Placement.HOST_CPU):
      # On the CPU backend every executor is the CPU handler.
      out[i] = out[i]._replace(placement=Placement.HOST_CPU)
  if skipped:
    warnings.warn(
        f"jaxtier.offload: the policy's patterns match {len(skipped)} leaves that are not "
        f"floating point ({', '.join(skipped[:4])}{' and more' if len(skipped) > 4 else ''}): "
        "RNG keys and counters stay on the device; the pattern places the others",
        stacklevel=4)
  return types.MappingProxyType(out)


def _refused(refused: placements.Refusal, leaf: LeafInfo, by_pattern: bool) -> str:
  """The PlanError message of a leaf the policy placed where the registry refuses it."""
  named = f"jaxtier.offload: leaf {leaf.path} ({leaf.dtype}{list(leaf.shape)})"
  if refused.kind is placements.RefusalKind.NOT_FLOAT:
    return (f"{named} would be placed {refused.placement}, but only floating-point leaves can "
            "live on the host (the fused host update computes in floating point, and step "
            "counters are tiny). Keep it on the device: return None or 'device' for it from the "
            "policy.")
  if refused.kind is placements.RefusalKind.NOT_A_TABLE:
    return (f"{named} cannot be placed '{refused.placement}': {refused.why}. A parameter is "
            "read in place (zero-copy) as an embedding table: its rows gathered by "
            "`jnp.take(table, ids, axis=0)` once per step and its gradient read only by the "
            "optimizer's update; place this leaf 'host_stream' (a stack of layers), 'host_xla' "
            "(copied whole for the step) or keep it on the device.")
  return (f"{named} cannot be placed '{refused.placement}': {refused.why}. Streaming serves a "
          "stack of layers read by a layer loop (`jax.lax.scan`, `nnx.scan`) one slice per "
          "iteration; place this leaf 'host_xla' (copied whole for the step) or keep it on the "
          "device" + (" (a policy pattern matched it: anchor the pattern to the params, e.g. "
                      r"r'^\[0\]\['layers'\]')" if by_pattern else "") + ".")
