"""The planner: a placement per state leaf, the bytes it implies, and its verdict.

`make_plan` asks the policy (`policy.py`) where each leaf should live, cuts the fused host
updates around the host leaves (`cut.py`), and, under policy 'auto' (and for the leaves a
user policy leaves to it), lets the solver (`solver.py`) choose the placements and the
activation policy that minimise the predicted step time within the budgets. The plan it
returns carries the placements with their reasons, the predictions, whether it fits
(its `Verdict`, from `admission.judge`) and the compiled op programs the lowering runs
(`Plan.components`); admission (`admission.py`) refuses it before anything is allocated when
its pinned or device bytes exceed what may be held. The placements are `vocab.Placement`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src.analysis import step_costs as step_costs_lib
from jaxtier._src.analysis.inventory import Inventory
from jaxtier._src.analysis.update_schedule import Mode, Why
from jaxtier._src.hardware import host as host_lib
from jaxtier._src.hardware import profile
from jaxtier._src.hardware.host import HERE_PINNABLE
from jaxtier._src.planning import cost_model, placements, solver
from jaxtier._src.planning import problem as problem_lib
from jaxtier._src.planning.admission import judge, plan_device_budget
from jaxtier._src.planning.cut import cut_updates
from jaxtier._src.planning.plan import (BudgetViolation, DeviceBudget, Finding, LeafPlan, Plan,
                                        Speculation)
from jaxtier._src.planning.policy import Policy, requested
from jaxtier._src.planning.reasons import Kind, Placed, reason, render
from jaxtier._src.units import format_bytes
from jaxtier._src.vocab import NamedPolicy, Placement, Role, is_named

log = logging.getLogger("jaxtier")


def make_plan(inv: Inventory, *, platform: str, policy: Policy = "auto",
              device_budget: "int | DeviceBudget | None" = None, host_budget: "int | None" = None,
              pinnable_bytes: "int | None" = None,
              hardware: "profile.HardwareProfile | None" = None,
              step_costs: "step_costs_lib.StepCosts | None" = None,
              streamable: "frozenset[int] | set[int]" = frozenset(),
              dha_readable: "Mapping[int, int] | None" = None,
              activations: "cost_model.ActivationModel | None" = None,
              resident_bytes: int = 0, pinnable_what: str = HERE_PINNABLE,
              stream_blocked: str = "", overlap_update: bool = True,
              meshed: "frozenset[int] | set[int]" = frozenset()) -> Plan:
  """Plans every leaf of `inv` and checks the budgets.

  Under policy 'auto' (and for the leaves a callable / mapping policy leaves to 'auto') the
  solver (`solver.solve`) places optimizer state, parameters and the activation policy to
  minimise the predicted step time under the budgets; with no device budget and a state that
  fits (always, on the CPU backend), everything stays on the device. When nothing fits, every
  candidate optimizer-state leaf goes to the host (the rule of policy
  'optimizer_state_on_host') and the budget check below reports what is left over.

  Args:
    inv: the inventory of the traced step.
    platform: 'cpu' or 'gpu' (selects the executor: host_cpu or host_dha).
    policy: 'auto', 'none', a callable `(path, LeafInfo) -> placement | None`, or a
      `{regex: placement}` mapping matched against leaf paths (None/no match: auto).
    device_budget: bytes of device memory the step may use at its peak, per device (state and
      transient buffers), or a `DeviceBudget` (a re-plan's). None: no limit on the CPU
      backend; on a GPU, what the device has (`admission.plan_device_budget`). The state's
      own device bytes over the budget given are an error.
    host_budget: bytes of pinned host memory the plan may pin per device (None: no limit).
    pinnable_bytes: what the host can pin at most per device (None: do not check); see
      `pinnable_bytes()`.
    hardware: the rates and capacities (None: `profile.DEFAULT_PROFILE`).
    step_costs: FLOPs and transient bytes of the device-only step (None: FLOPs counted over the
      jaxpr, transient bytes estimated as the gradients).
    streamable: parameter leaves the lowering can stream (`host_stream`).
    dha_readable: {parameter leaf: bytes its zero-copy reads move per step} of the leaves a
      DHA kernel can serve in place (`host_dha`: the embedding tables of
      `analysis/lookups.py`, their gathered rows' bytes); the solver weighs them on a GPU.
    activations: the model's activation options (None: the traced policy, not modelled).
    resident_bytes: bytes of the state already allocated in this host's memory (the CPU
      backend's arrays), taken off what a plan without a device budget needs there.
    pinnable_what: where `pinnable_bytes` comes from, for the refusal's message (default: this
      host's free memory).
    overlap_update: updates may run during the step (layer by layer inside the backward
      pass, or row by row), where `update_schedule.decide` says they do: the plan records
      that (`Plan.schedule`), the prediction costs it and the lowering builds it.
    meshed: state leaves on a mesh of more than one device (their updates run after the
      backward pass).
    stream_blocked: why no leaf may be placed `host_stream` here ('' when they may): a policy
      asking for it is refused with this reason.

  Returns:
    The plan; `plan.components` are the fused host updates the lowering runs.

  Raises:
    PlanError: an unknown placement, a non-float leaf placed on the host (`policy.requested`).
      A plan over a budget is returned, its verdict saying so (`Plan.verdict`):
      `admission.admit` refuses it.
  """
  host_exec = Placement.HOST_DHA if platform == "gpu" else Placement.HOST_CPU
  hardware = hardware or profile.DEFAULT_PROFILE
  req = requested(inv, policy, host_exec, stream_blocked)
  jaxpr = inv.closed_jaxpr.jaxpr
  # The leaves a fused host update updates where they live: the executor placements', and
  # host_stream stacks (read by the layer loops through the streaming calls).
  placed = Placed.of({i: r.placement for i, r in req.items()},
                     {i: r.reason for i, r in req.items()},
                     {i for i, r in req.items() if placements.record(r.placement).fused_update})
  user_fixed = frozenset(i for i, r in req.items() if r.user_placed)
  cut = cut_updates(inv, placed, hardware, host_exec, user_fixed)
  solve = (not is_named(policy, NamedPolicy.NONE, NamedPolicy.OPTIMIZER_STATE_ON_HOST)
           and len(user_fixed) < len(inv.leaves))
  costs = step_costs or step_costs_lib.StepCosts(
      flops=0.0, elementwise_bytes=0.0, transient_bytes=0,
      transient_source="estimate: the gradients only (no compiled step)")
  if step_costs is None:
    costs = dataclasses.replace(costs, **dict(zip(
        ("flops", "elementwise_bytes"), step_costs_lib.jaxpr_costs(inv.closed_jaxpr))))
  notes = [f"hardware profile: {hardware.source}",
           f"transient device bytes (gradients, activations, workspace): "
           f"{costs.transient_source}",
           costs.compute_source(hardware)]
  device_budget, budget_notes = plan_device_budget(device_budget, platform, hardware)
  notes += budget_notes
  usable = device_budget.usable
  host_limit = min((b for b in (host_budget, pinnable_bytes) if b is not None), default=None)
  # What the prediction misses; `admission.judge` makes the plan's verdict of them.
  findings: list[Finding] = []

  def problem_for(placement, layered_dha_fraction=None, speculate=True):
    return problem_lib.build_problem(
        leaves=inv.leaves, jaxpr=jaxpr, compiled=cut.compiled, master_nbytes={
            i: inv.leaves[i].nbytes * 4 // jnp.dtype(inv.leaves[i].dtype).itemsize
            for i in cut.masters}, placement=placement, user_fixed=user_fixed,
        param_role=Role.PARAM,
        step_costs=costs, streamable=frozenset(streamable) - user_fixed,
        dha_readable=({i: b for i, b in dict(dha_readable or {}).items() if i not in user_fixed}
                      if platform == "gpu" else {}),
        tables=dict(dha_readable or {}), activations=activations,
        device_budget=usable, host_budget=host_limit,
        profile=hardware, platform=platform, overlap_update=overlap_update, meshed=meshed,
        layered_dha_fraction=layered_dha_fraction, speculate=speculate)

  act_policy = None
  if solve:
    problem = problem_for(cut.placed.placement)
    sol = solver.solve(problem)
    cut = cut_updates(inv, _apply(sol, problem, inv, cut.placed, user_fixed, usable),
                      hardware, host_exec, user_fixed)
    if not sol.fits:
      findings.append(_not_fitting(sol, usable, host_limit, problem,
                                   placed=(inv, cut.placed.placement, user_fixed)))
    act_policy = sol.activation_policy
  layered_fraction = None
  if platform == "gpu":
    layered = _layered_executor(problem_for, cut.placed, act_policy,
                                served_leaves(inv, cut.placed.placement), user_fixed)
    if layered is not None:
      placed, changed, layered_fraction = layered
      cut = (cut_updates(inv, placed, hardware, host_exec, user_fixed) if changed
             else dataclasses.replace(cut, placed=placed))
  placement, compiled, masters = cut.placed.placement, list(cut.compiled), cut.masters
  # The prediction of the plan as it stands (every placement fixed).
  final = problem_for(placement, layered_fraction)
  # A call's placement: its leaves' executor (a call of only host_stream leaves or tables
  # read in place: the cut's).
  served = served_leaves(inv, placement)
  if layered_fraction is not None:
    # The layered split calls the planner placed run at the share it chose.
    compiled = [dataclasses.replace(cc, dha_fraction=layered_fraction)
                if item.num_layers and item.fixed is None
                and placements.of_executor(cc.executor) == Placement.HOST_SPLIT else cc
                for item, cc in zip(final.updates, compiled)]
  # A layer call's kernel shares the GPU with the compute: it takes the profile's share of it.
  compiled = [dataclasses.replace(cc, dha_grid=hardware.dha_layer_grid) for cc in compiled]
  final_updates = {
      u:
          next((placement[i] for i in item.seeds if i not in served),
               placements.of_executor(cc.executor))
      for u, (item, cc) in enumerate(zip(final.updates, compiled))
  }
  final_params = {p.index: placement[p.index] for p in final.params}
  pred = solver.evaluate_fixed(final, final_params, final_updates, act_policy).prediction
  tail_peak, tail_note = _tail_peak(inv, placement)
  if tail_peak is not None and tail_peak > pred.peak_hbm_bytes:
    pred = dataclasses.replace(pred, peak_hbm_bytes=tail_peak)
  if tail_note:
    notes.append(tail_note)
  if usable is not None and pred.peak_hbm_bytes > usable and not findings:
    # The placements the user fixed (or the cut's fallbacks) leave the plan over the budget
    # although the solver's own search fitted: say so as loudly as an infeasible search.
    findings.append(Finding(
        sentence=f"predicted peak device memory {format_bytes(pred.peak_hbm_bytes)} "
        f"exceeds the device budget of {format_bytes(usable)} with the placements as given "
        "(the policy's fixed placements included)",
        violations=(BudgetViolation(limit="device_budget", need_bytes=pred.peak_hbm_bytes,
                                    limit_bytes=usable),)))
  if usable is None and platform == "cpu" and jax.default_backend() == "cpu":
    # No device budget on the CPU backend, but its device and pinned_host memory are both this
    # host's RAM: a plan that needs more than is available is said not to fit.
    # The state's arrays that already exist are in that RAM: not available, but not needed
    # again either.
    available = host_lib.available_bytes()
    need = pred.peak_hbm_bytes + pred.pinned_bytes - resident_bytes
    if available is not None and need > available:
      allocated = (f" - the state already allocated, {format_bytes(resident_bytes)}"
                   if resident_bytes else "")
      findings.append(Finding(
          sentence=f"on the CPU backend device and pinned_host memory are this host's "
          f"RAM: the plan needs {format_bytes(need)} more (peak "
          f"{format_bytes(pred.peak_hbm_bytes)} + pinned {format_bytes(pred.pinned_bytes)}"
          f"{allocated}), over the {format_bytes(available)} available now (no device budget "
          "was given); plan for the GPU with --platform=gpu (python -m jaxtier plan) or "
          "platform='gpu' (jaxtier.plan)",
          violations=(BudgetViolation(limit="host_memory", need_bytes=need,
                                      limit_bytes=available),)))
  assumed = None
  if activations is not None:
    chosen = act_policy or activations.traced
    act_label = f"{chosen} (jax.checkpoint_policies.{activations.checkpoint_policy[chosen]})"
    if chosen != activations.traced:
      act_label += f"; the traced step uses {activations.traced}: apply it in the model"
      assumed = activations.checkpoint_policy[chosen]
  else:
    act_label = "as traced (not modelled)"
  verdict = judge(findings, device_budget)
  leaves = []
  device_bytes = pinned_bytes = 0
  for leaf in inv.leaves:
    p = placement[leaf.index]
    kind = placements.record(p).memory_kind.value
    master = leaf.index in masters
    master_nbytes = leaf.nbytes * 4 // jnp.dtype(leaf.dtype).itemsize if master else 0
    why = cut.placed.reasons[leaf.index]
    if master:
      why = why.with_note(reason(Kind.FP32_MASTER, dtype=leaf.dtype))
    leaves.append(LeafPlan(index=leaf.index, path=leaf.path, shape=leaf.shape, dtype=leaf.dtype,
                           nbytes=leaf.nbytes, role=leaf.role, placement=p, memory_kind=kind,
                           master_nbytes=master_nbytes, reason=render(why),
                           user_placed=leaf.index in user_fixed))
    if kind == "device":
      device_bytes += leaf.nbytes
    else:
      pinned_bytes += leaf.nbytes
    pinned_bytes += master_nbytes
  speculation, schedule = None, final.schedule
  if any(s.guarded for s in schedule):
    serial = solver.evaluate_fixed(problem_for(placement, layered_fraction, speculate=False),
                                   final_params, final_updates, act_policy).prediction
    speculation = _speculation(final.schedule, leaves, pred.step_secs, serial.step_secs,
                               pinned_bytes, host_limit)
    all_spares = speculation.spare_pinned_bytes  # every guarded update's
    keep = (_spares_that_fit(final.schedule, leaves, pinned_bytes, host_limit)
            if not speculation.enabled else None)
    if keep:
      # A guess for the guarded updates whose spares fit; the others wait for the norm.
      partial = problem_for(placement, layered_fraction, speculate=keep)
      pred = solver.evaluate_fixed(partial, final_params, final_updates,
                                   act_policy).prediction
      schedule = partial.schedule
      speculation = _speculation(schedule, leaves, pred.step_secs, serial.step_secs,
                                 pinned_bytes, host_limit)
    speculation = dataclasses.replace(speculation, all_spare_pinned_bytes=all_spares)
    if not speculation.enabled:
      pred = serial  # the step runs the serial schedule
  plan = Plan(tuple(leaves), platform, device_bytes, pinned_bytes, device_budget, host_budget,
              len(compiled), predicted_step_secs=pred.step_secs,
              critical_path=pred.critical_path, predicted_peak_hbm_bytes=pred.peak_hbm_bytes,
              resource_secs=dict(pred.resource_secs), segments=tuple(pred.segments),
              activation_policy=act_label, assumed_checkpoint_policy=assumed,
              # The findings a re-plan budget overrules are notes after the planner's.
              notes=tuple(notes) + verdict.overruled, verdict=verdict,
              num_planning_notes=len(notes),
              components=tuple(compiled), schedule=schedule,
              rates_of=_rates_of(hardware, platform),
              pinnable_bytes=pinnable_bytes, pinnable_what=pinnable_what,
              hardware_kind=hardware.device_kind, speculation=speculation,
              tail_peak_hbm_bytes=tail_peak)
  return plan


def _tail_peak(inv: Inventory, placement: Mapping[int, Placement]
               ) -> "tuple[int | None, str]":
  """The device memory the metrics computed after the update hold (`Plan.tail_peak_hbm_bytes`),
  bytes per device, and a note naming the pinned_host leaves they copy to the device (''
  where none); (None, '') where the step has no such metrics.

  The estimate: the state's device leaves, the new values of the pinned_host leaves the tail
  reads (copied whole), and the step part's other values it reads (metrics, on the device).
  """
  tail = inv.tail
  if tail is None:
    return None, ""
  n = len(inv.leaves)
  on_host = lambda i: placements.record(placement[i]).memory_kind.value != "device"
  device_state = sum(l.nbytes for l in inv.leaves if not on_host(l.index))
  copied = sorted({k for k in tail.inputs if k < n and on_host(k)})
  outvars = inv.closed_jaxpr.jaxpr.outvars
  others = sum(int(np.prod(outvars[k].aval.shape)) * np.dtype(outvars[k].aval.dtype).itemsize
               for k in tail.inputs if k >= n)
  copy_bytes = sum(inv.leaves[k].nbytes for k in copied)
  peak = device_state + copy_bytes + others
  if not copied:
    return peak, ""
  names = ", ".join(inv.leaves[k].path for k in copied[:3]) + (
      f" and {len(copied) - 3} more" if len(copied) > 3 else "")
  return peak, (f"the metrics computed after the update read {len(copied)} pinned_host "
                f"{'leaf' if len(copied) == 1 else 'leaves'} ({names}): their program copies "
                f"{'it' if len(copied) == 1 else 'them'} to the device whole, "
                f"{format_bytes(copy_bytes)}; peak device memory then "
                f"{format_bytes(peak)} (`Plan.tail_peak_hbm_bytes`)")


def _spare_pinned_bytes(keys: Any, leaves: Sequence[LeafPlan]) -> int:
  """The pinned_host bytes of the spare buffers for `keys` (`UpdateSchedule.buffers`' keys):
  the host leaves' and fp32 masters' (a device leaf's spare is on the device)."""
  return sum(leaves[i].master_nbytes if kind == "master" else leaves[i].nbytes
             for kind, i in keys if kind == "master" or leaves[i].memory_kind != "device")


def _spares_that_fit(schedule: Sequence[Any], leaves: Sequence[LeafPlan], pinned_bytes: int,
                     host_limit: "int | None") -> "frozenset[int] | None":
  """The guarded components whose spare buffers fit what may be pinned beside the state and
  the other layered updates' spares, largest first (first-fit decreasing: the time a guess
  saves grows with the bytes it updates during the backward pass); None where not one fits.
  The others then wait for the norm (`update_schedule.Why.NO_ROOM_FOR_SPARES`)."""
  if host_limit is None:
    return None
  guarded = [s for s in schedule if s.guarded and s.mode != Mode.SERIAL]
  others = {key for s in schedule if s.mode != Mode.SERIAL and not s.guarded
            for key in s.buffers}
  room = host_limit - pinned_bytes - _spare_pinned_bytes(others, leaves)
  needs = {s.component: _spare_pinned_bytes(s.buffers, leaves) for s in guarded}
  keep = []
  for c in sorted(needs, key=lambda c: (-needs[c], c)):
    if needs[c] <= room:
      keep.append(c)
      room -= needs[c]
  return frozenset(keep) or None


def _speculation(schedule: Sequence[Any], leaves: Sequence[LeafPlan], speculative_secs: float,
                 serial_secs: float, pinned_bytes: int, host_limit: "int | None"
                 ) -> Speculation:
  """The plan's `Speculation`: the spare buffers its speculative step needs (a copy of every
  buffer a layered or row update writes; the device leaves, read without being donated),
  whether they fit the host's pinned limit, and the break-even share of wrong guesses."""
  written = {key for s in schedule if s.mode != Mode.SERIAL for key in s.buffers}
  spare_pinned = _spare_pinned_bytes(written, leaves)
  spare_device = sum(l.nbytes for l in leaves if l.memory_kind == "device")
  enabled, why = True, ""
  if host_limit is not None and pinned_bytes + spare_pinned > host_limit:
    enabled = False
    why = (f"its spare buffers ({format_bytes(spare_pinned)}) and the state's pinned bytes "
           f"({format_bytes(pinned_bytes)}) exceed the {format_bytes(host_limit)} that may be "
           "pinned")
  max_miss = max(0.0, (serial_secs - speculative_secs) / serial_secs) if serial_secs else 0.0
  waiting = tuple(s.component for s in schedule
                  if s.reason is not None and s.reason.kind == Why.NO_ROOM_FOR_SPARES)
  return Speculation(tuple(s.component for s in schedule if s.guarded), spare_pinned,
                     spare_device, speculative_secs, serial_secs, max_miss, enabled, why,
                     waiting)


def _rates_of(hardware: profile.HardwareProfile, platform: str) -> str:
  """Whose rates a plan for `platform` predicts with, where they are not this machine's: the
  default profile's (the H200's) or a card's built-in one (`profile.builtin_profile`) on this
  machine's own backend (no stored profile: `calibrate` measures one); '' for a stored
  profile, and for a GPU planned on a machine without one (the built-in profile is the GPU
  planned for)."""
  if not hardware.is_default or platform != jax.default_backend():
    return ""
  card = profile.card_of(hardware.device_kind)
  if hardware == profile.DEFAULT_PROFILE or card is None:
    return "the default profile's H200 rates, not this machine's"
  return f"the built-in {card} profile's rates, not this machine's"


def served_leaves(inv: Inventory, placement: Mapping[int, str]) -> set[int]:
  """Host leaves that a custom call serves to the compute and whose update's executor is their
  fused call's: `host_stream` stacks and the tables read in place (`host_dha` parameters)."""
  return {i for i, p in placement.items() if placements.served(p, inv.leaves[i].role)}


def _layered_executor(problem_for: Callable[..., Any], placed: Placed, act_policy: "str | None",
                      served: set[int], user_fixed: frozenset[int]
                      ) -> "tuple[Placed, bool, float | None] | None":
  """Picks the executor of the updates run layer by layer inside the backward pass (on a GPU):
  host_cpu, or host_split with the DHA kernel's share of the elements in `LAYERED_FRACTIONS`,
  whichever the prediction (`cost_model.predict`: hidden under the backward pass, the split's
  kernel slowing the compute it shares the GPU with) makes fastest, the same for all of them.
  A larger share pays where the update outlasts the backward pass: the kernel then runs on an
  idle GPU (host_dha alone would share the GPU with the compute for the whole update). Leaves
  the user placed keep their executor and share. Returns (the new placements, whether a
  placement changed (then the updates must be cut again), the share or None for host_cpu), or
  None if no update runs layer by layer."""
  placement = placed.placement
  problem = problem_for(placement)
  executors = placements.EXECUTOR_PLACEMENTS
  # A streamed stack's call: its param stays host_stream (the user's placement, which fixes
  # the call's executor only as the cut's choice), its moments take the executor.
  layered = [u for u, item in enumerate(problem.updates)
             if item.num_layers
             and all(i not in user_fixed or placements.streamed(placement[i])
                     for i in item.seeds)
             and all(placements.record(placement[i]).fused_update for i in item.seeds)
             and any(placement[i] in executors for i in item.seeds)]
  if not layered:
    return None
  params = {p.index: placement[p.index] for p in problem.params}
  # (A served leaf is a seed of its call too: the call's executor is its other leaves'.)
  others = {u: next((placement[i] for i in item.seeds if i not in served),
                    Placement.HOST_CPU)
            for u, item in enumerate(problem.updates) if u not in layered
            and any(placements.record(placement[i]).on_host for i in item.seeds)}

  def step_secs(choice: tuple[str, "float | None"]) -> float:
    executor, fraction = choice
    updates = dict(others) | {u: executor for u in layered}
    candidate = problem if fraction is None else problem_for(placement, fraction)
    return solver.evaluate_fixed(candidate, params, updates, act_policy).prediction.step_secs
  default = profile.split_fraction(problem.profile)
  choices = [(Placement.HOST_CPU, None)] + [
      (Placement.HOST_SPLIT, f) for f in sorted({round(default, 2), *LAYERED_FRACTIONS})]
  best, fraction = min(choices, key=step_secs)
  new_placement, reasons = dict(placement), dict(placed.reasons)
  note = reason(Kind.LAYERED, executor=best, fraction=fraction)
  for u in layered:
    for i in problem.updates[u].seeds:
      if placements.streamed(placement[i]):
        continue
      new_placement[i] = best
      if note not in reasons[i].notes:
        reasons[i] = reasons[i].with_note(note)
  changed = new_placement != dict(placement)
  return Placed.of(new_placement, reasons, placed.fused), changed, fraction


# The DHA kernel's shares of a layered split update's elements the planner weighs (besides the
# profile's `split_fraction`, which balances the two executors when both run alone).
LAYERED_FRACTIONS = (0.6, 0.7, 0.8, 0.9)


def _apply(sol: "solver.Solution", problem: "problem_lib.Problem", inv: Inventory,
           placed: Placed, user_fixed: frozenset[int], budget: "int | None") -> Placed:
  """The placements `placed` with the solver's choices `sol` for `problem` applied."""
  placement, reasons, fused = dict(placed.placement), dict(placed.reasons), set(placed.fused)
  pred = sol.prediction
  fit = (reason(Kind.FIT_NO_BUDGET) if budget is None else
         reason(Kind.FIT_PEAK, peak=pred.peak_hbm_bytes, budget=budget))
  if not sol.fits:
    fit = reason(Kind.FIT_NONE)
  for u, item in enumerate(problem.updates):
    if item.fixed:
      continue
    where = sol.updates[u]
    cost = item.costs.get(where)
    for i in item.seeds:
      if where == Placement.DEVICE:
        placement[i] = Placement.DEVICE
        fused.discard(i)
        reasons[i] = reason(Kind.STATE_ON_DEVICE, fit=fit, host_secs=item.best()[1].secs)
      elif not sol.fits:
        placement[i] = where
        fused.add(i)
        reasons[i] = reason(Kind.STATE_RULE_BASED, executor=where, secs=cost.secs)
      else:
        placement[i] = where
        fused.add(i)
        reasons[i] = (reason(Kind.STATE_MOVED, executor=where, freed=item.device_nbytes,
                             secs=cost.secs, bound=cost.bound) if budget is not None
                      else reason(Kind.STATE_ON_HOST, executor=where))
  for p in problem.params:
    where = sol.params.get(p.index, Placement.DEVICE)
    placement[p.index] = where
    if where == Placement.DEVICE:
      reasons[p.index] = reason(Kind.PARAM_ON_DEVICE, fit=fit)
    else:
      fused.add(p.index)  # its update runs where it lives, in a fused host update
      reasons[p.index] = reason(
          Kind.PARAM_ON_HOST, placement=where, nbytes=p.nbytes, freed=p.nbytes + p.grad_nbytes,
          rows=p.dha_nbytes, dha_gbps=problem.profile.dha_matmul_gbps,
          link_gbps=problem.profile.link_h2d_gbps)
  # Leaves served by XLA's transfers are on the device during the step anyway: they stay there
  # unless nothing fits (then every candidate goes to the host, as the rule-based plan did).
  for leaf in inv.leaves:
    i = leaf.index
    if placement[i] == Placement.HOST_XLA and i not in user_fixed and sol.fits:
      placement[i] = Placement.DEVICE
      reasons[i] = reason(Kind.KEPT_ON_DEVICE, fallback=reasons[i])
  return Placed.of(placement, reasons, fused)


def _not_fitting(sol: "solver.Solution", budget: "int | None", host_limit: "int | None",
                 problem: "problem_lib.Problem | None" = None,
                 placed: "tuple[Inventory, Mapping[int, str], set[int]] | None" = None
                 ) -> Finding:
  """The finding of a search that found no plan within the budgets: what the plan made is and
  which budget it misses by how much, and the limits missed.

  `placed`: (inventory, final placement per leaf index, leaves the user's policy placed), to
  describe the plan actually made (else: the rule-based plan's rule).
  """
  pred = sol.prediction
  parts, missed = [], []
  if problem is not None and host_limit is not None:
    # What the host would have to pin for the least device memory the planner can reach:
    # every movable optimizer-state call and every parameter it may stream or read zero-copy.
    most = problem.fixed_pinned_bytes + sum(it.pinned_nbytes for it in problem.updates) + sum(
        p.nbytes for p in problem.params if set(p.options) - {Placement.DEVICE})
    if most > host_limit:
      parts.append(f"moving every leaf it may move to the host would pin {format_bytes(most)}, "
                   f"over the host limit of {format_bytes(host_limit)}")
      missed.append(BudgetViolation(limit="host_limit", need_bytes=most, limit_bytes=host_limit,
                                    binding=True))
  if budget is not None and pred.peak_hbm_bytes > budget:
    parts.append(f"predicted peak device memory {format_bytes(pred.peak_hbm_bytes)} exceeds the "
                 f"device budget of {format_bytes(budget)}")
    missed.append(BudgetViolation(limit="device_budget", need_bytes=pred.peak_hbm_bytes,
                                  limit_bytes=budget))
  if host_limit is not None and pred.pinned_bytes > host_limit:
    parts.append(f"pinned bytes {format_bytes(pred.pinned_bytes)} exceed the host limit of "
                 f"{format_bytes(host_limit)}")
    missed.append(BudgetViolation(limit="host_limit", need_bytes=pred.pinned_bytes,
                                  limit_bytes=host_limit))
  what = "the rule-based plan (every optimizer-state leaf on the host)"
  if placed is not None:
    inv, where, by_user = placed
    groups: dict[tuple[str, str, bool], int] = {}
    for leaf in inv.leaves:
      if placements.record(where[leaf.index]).on_host:
        key = (leaf.role, where[leaf.index], leaf.index in by_user)
        groups[key] = groups.get(key, 0) + 1
    names = {Role.OPTIMIZER_STATE: "optimizer-state leaves", Role.PARAM: "parameters"}
    host = [f"{n} {names.get(role, 'other leaves')} ({p}{', placed by the policy' if user else ''})"
            for (role, p, user), n in sorted(groups.items())]
    what = ("its fallback plan: " + (", ".join(host) + " in pinned_host, the rest on the device"
                                     if host else "every leaf on the device"))
  return Finding(sentence="no placement the planner can make fits the budgets; this is " + what
                 + ": " + "; ".join(parts or ["over a budget"]), violations=tuple(missed))
