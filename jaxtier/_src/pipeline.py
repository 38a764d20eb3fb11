"""The one planning pipeline, for `offload` and `plan`: trace, costs, plan, verify, refine.

`plan_step` traces the step (`analysis.inventory`), measures what the device-only step costs
(`analysis.step_costs`), loads the `HardwareProfile`, plans (`planning.planner.make_plan`),
lowers the plan into the step's two programs (`lowering.compiled.build`), checks the compiled
program's peak against the budget (when it is over: under 'auto', plans with more state on
the host, `ESCALATIONS`, `MAX_ESCALATION_COMPILES` compiles at most; under a policy that
leaves leaves to the solver, re-plans `MAX_REPLANS` times at most), and refines a plan whose
compiled peak came out well under its prediction. `plan_only` stops after planning: it
allocates and compiles nothing but the device-only step's costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import figures_cache
from jaxtier._src.analysis import inventory as inv_lib
from jaxtier._src.analysis import layer_stacks, lookups
from jaxtier._src.analysis import step_costs as step_costs_lib
from jaxtier._src.analysis import update_schedule
from jaxtier._src.errors import AdmissionError, PlanError
from jaxtier._src.hardware import host as host_lib
from jaxtier._src.hardware import machine
from jaxtier._src.hardware import profile
from jaxtier._src.lowering import compiled as compiled_lib
from jaxtier._src.options import OffloadOptions
from jaxtier._src.planning import admission, planner
from jaxtier._src.planning import policy as policy_lib
from jaxtier._src.planning import verify as verify_lib
from jaxtier._src.planning.plan import (Attempt, DeviceBudget, Escalation, Plan, PlanningCost,
                                        verdict_lines)
from jaxtier._src.units import format_bytes, format_share
from jaxtier._src.vocab import MemoryKind, NamedPolicy, Placement, Role, is_named

log = logging.getLogger("jaxtier")

# Re-plans after the compiled step's peak device memory came out over the budget, under a
# policy that leaves some leaves to the solver (a callable or a mapping). 'auto' escalates
# instead (`_escalated`).
MAX_REPLANS = 2
# Under 'auto', the plans tried in turn once its own plan's compiled step is over the device
# limit, each with more state on the host: every optimizer-state leaf (as policy
# 'optimizer_state_on_host' places it), then also the layer stacks' params streamed
# ('host_stream'; their optimizer state on the host, the rest placed by 'auto').
ESCALATIONS = (NamedPolicy.OPTIMIZER_STATE_ON_HOST, "stream")
# Compiles of a planned step's compute program (each with its host-update program, small
# beside it) that 'auto' may take after its own plan's compiled step was over the limit
# (`_escalated`): one per plan of ESCALATIONS until one fits, or, where
# 'optimizer_state_on_host' fits at once, one more for auto's plan re-planned against the
# budget less what its compiled step was over (kept where it fits too and is predicted
# faster). Two: the search adds at most two compiles of a planned step to planning's own (a
# budget re-plan before escalating would make it three); docs/design.md gives their times.
MAX_ESCALATION_COMPILES = 2
# A verified plan whose compiled peak is more than this fraction of its device budget below
# its predicted peak is refined (`_refine`).
REFINE_MIN_OVERESTIMATE = 0.02
# The shares of the measured overestimate credited, tried in turn until a refined plan's
# compiled peak is within the budget (each try compiles the step once more).
REFINE_CREDIT_SHARES = (1.0, 0.5)
_FIXED = (NamedPolicy.NONE, NamedPolicy.OPTIMIZER_STATE_ON_HOST)
# Planning that took longer than this, seconds, is logged as a warning that names its slowest
# phase (`PlanningCost`); shorter, at INFO.
LONG_PLANNING_SECS = 10.0
# What each planning phase spends its time on, for the line that names the slowest.
PHASE_WHAT = {
    "trace": "tracing the step and analysing its jaxpr",
    "step costs": "compiling the device-only step for its memory figures (policy 'auto' and "
                  "callables; a fixed policy such as 'optimizer_state_on_host' skips it; a "
                  "later process reads them from the figures cache)",
    "plan": "the solver",
    "lower": "building the plan's programs",
    "verify": "lowering and compiling the plan's programs with XLA (as jax.jit compiles the "
              "step; the first call reuses them)",
    "refine": "compiling the plans that refining made (`_refine`)",
    "escalate": "compiling the plans 'auto' escalated to, its own plan's compiled step being "
                "over the device limit (policy 'optimizer_state_on_host' compiles one plan)",
}
# JAX's event for each backend (XLA) compile.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _Clock:
  """Wall seconds per planning phase, and the backend compiles that JAX reports in this
  thread while `running` (`PlanningCost`). A phase entered inside another is its own: the
  outer one's clock stops meanwhile (the phases add up to at most the whole)."""

  _local = threading.local()
  _listening = False
  _lock = threading.Lock()

  def __init__(self):
    self.start = time.perf_counter()
    self.phases: dict[str, float] = {}
    self._open: list[list[Any]] = []  # [name, since] of the phases entered, innermost last
    self.compiles = 0
    self.compile_secs = 0.0

  @staticmethod
  def _on_event(event: str, secs: float, **kwargs: Any) -> None:
    del kwargs
    if event != BACKEND_COMPILE_EVENT:
      return
    for clock in getattr(_Clock._local, "active", ()):
      clock.compiles += 1
      clock.compile_secs += secs

  @contextlib.contextmanager
  def running(self) -> Iterator["_Clock"]:
    with _Clock._lock:
      if not _Clock._listening:
        jax.monitoring.register_event_duration_secs_listener(_Clock._on_event)
        _Clock._listening = True
    active = _Clock._local.__dict__.setdefault("active", [])
    active.append(self)
    try:
      yield self
    finally:
      active.remove(self)

  def _add(self, name: str, secs: float) -> None:
    self.phases[name] = self.phases.get(name, 0.0) + secs

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    now = time.perf_counter()
    if self._open:
      outer = self._open[-1]
      self._add(outer[0], now - outer[1])
    self._open.append([name, now])
    try:
      yield
    finally:
      end = time.perf_counter()
      _, since = self._open.pop()
      self._add(name, end - since)
      if self._open:
        self._open[-1][1] = end

  def cost(self) -> PlanningCost:
    return PlanningCost(secs=time.perf_counter() - self.start, phases=tuple(self.phases.items()),
                        compiles=self.compiles, compile_secs=self.compile_secs)


def _log_cost(cost: PlanningCost) -> None:
  """One line: what planning took, and (at WARNING where over LONG_PLANNING_SECS) what its
  slowest phase spends the time on."""
  slowest = cost.slowest()
  if cost.secs > LONG_PLANNING_SECS:
    log.warning("jaxtier: planning the step took %s; most of it %s: %s", cost.describe(),
                slowest, PHASE_WHAT.get(slowest, slowest))
  else:
    log.info("jaxtier: planning the step took %s", cost.describe())


@dataclasses.dataclass(frozen=True)
class Planned:
  """What the pipeline hands the runtime: the traced step, its plan and the programs.

  `step_time_key`: where the device-only step's time that the plan's prediction rests on is
  kept (`StepCosts.step_time_key`); the runtime checks it against the measured step
  (`step_costs.check_step_time`). None where the step was not timed.
  """

  inventory: inv_lib.Inventory
  plan: Plan
  programs: compiled_lib.StepPrograms
  signature: Any
  step_time_key: "str | None" = None


def plan_step(fn: Callable[..., Any], options: OffloadOptions, state: Any, args: Sequence[Any],
              *, changes: str = "", abstract: bool = False) -> Planned:
  """Plans `fn(state, *args)`, lowers the plan and verifies it by compiling.

  `changes`: why the step is planned again ('' the first time), added to a tracing error.
  `abstract`: the state's leaves are `jax.ShapeDtypeStruct`s (`OffloadedStep.init`).

  Under 'auto', a plan whose compiled step's peak is over the device limit (the budget planned
  against, or what JAX's allocator holds on this GPU less `admission.DEVICE_MARGIN` where that
  is less) is not re-planned against a smaller budget but escalated (`_escalated`): the plans of
  `ESCALATIONS` are compiled in turn and the first that fits is kept, `MAX_ESCALATION_COMPILES`
  compiles at most; the plan's `escalation` says which were tried.

  Raises:
    jaxtier.PlanError / AdmissionError: from planning, or the plan kept over the device budget
      given (`admission.admit_device_budget`, unless `options.allow_over_budget`) or over what
      JAX's allocator holds (`admission.admit_device`); under 'auto' after escalating, the
      refusal lists each plan tried with its compiled peak. Nothing has been allocated then.
  """
  clock = _Clock()
  with clock.running():
    planned = _plan_step(fn, options, state, args, changes, abstract, clock)
  cost = clock.cost()
  _log_cost(cost)
  return dataclasses.replace(planned, plan=dataclasses.replace(planned.plan, planning=cost))


def _plan_step(fn: Callable[..., Any], options: OffloadOptions, state: Any, args: Sequence[Any],
               changes: str, abstract: bool, clock: _Clock) -> Planned:
  """`plan_step`, each phase timed by `clock`."""
  try:
    with clock.phase("trace"):
      inv = inv_lib.take_inventory(fn, state, args, allow_abstract=abstract)
  except Exception as e:
    if changes and hasattr(e, "add_note"):
      e.add_note(f"jaxtier: the step was traced again because its inputs changed since they "
                 f"were planned: {changes}")
    raise
  leaves = jax.tree_util.tree_leaves(state)
  platform = jc.platform_of(leaves[0]) if leaves else jax.default_backend()
  blocked = _stream_blocked(state)
  with clock.phase("step costs"):
    costs = _step_costs(inv, state, args, platform, options.policy,
                        limited=options.device_budget is not None or platform != "cpu")
  with clock.phase("plan"):
    device_budget = DeviceBudget.of(options.device_budget)
    # The same for every (re-)plan of this trace.
    fixed = dict(platform=platform, policy=options.policy, host_budget=options.host_budget,
                 pinnable_bytes=host_lib.pinnable_bytes(platform, _num_local_devices(state)),
                 hardware=machine.load(platform=platform),
                 streamable=set() if blocked else _streamable(inv),
                 dha_readable={} if blocked else dha_readable_tables(inv),
                 resident_bytes=_resident_bytes(state), stream_blocked=blocked,
                 overlap_update=options.overlap_update, meshed=_meshed(state))
    sig = signature(state, args)

  def make(step_costs, budget):
    with clock.phase("plan"):
      return _admitted_plan(inv, fixed, budget, step_costs)

  def lower(plan, *notes):
    with clock.phase("lower"):
      programs = compiled_lib.build(inv, plan, state, args, options.overlap_update)
      notes += _schedule_notes(plan) + programs.split.lookup.notes
      return Planned(inv, dataclasses.replace(plan, notes=plan.notes + notes) if notes else plan,
                     programs, sig)

  gpu_here = platform == "gpu" and jax.default_backend() == "gpu"
  try:
    first = make(costs, device_budget)
  except PlanError as e:
    if gpu_here:
      _raise_with_room(e, inv, fixed, device_budget.given, costs, state)
    raise
  if not first.fits and gpu_here:
    _raise_with_room(None, inv, fixed, device_budget.given, costs, state, first)

  auto = is_named(options.policy, NamedPolicy.AUTO)
  # 'auto' escalates rather than re-plan against smaller budgets (`_escalated`).
  max_replans = 0 if auto else MAX_REPLANS
  previous = planned = replan_budget = None
  for attempt in range(max_replans + 1):
    try:
      plan = first if attempt == 0 else make(costs, device_budget)
    except PlanError as e:
      if previous is None:
        raise
      log.warning("jaxtier: re-planning against %s failed (%s); keeping the previous plan",
                  format_bytes(device_budget.usable), str(e).split(". ")[0])
      planned = previous
      break
    # (A re-plan's findings against its internal budget are notes: `admission.judge`.)
    replanned = () if not attempt else (
        f"re-planned ({attempt}) against {format_bytes(device_budget.usable)}: the compiled "
        "step's peak was over the budget",)
    lowered = lower(plan, *replanned)
    with clock.phase("verify"):
      # (Under 'auto', a plan an earlier process found over the limit is not compiled again.)
      planned, smaller = _verify(
          lowered, state, args, options.policy,
          skip_over=_device_limit(first.device_budget, platform) if auto else None)
    if smaller is None:
      break
    peak, usable = planned.plan.compiler_peak_hbm_bytes, device_budget.usable
    if attempt >= max_replans:
      if auto:  # the budget a re-plan would have had: `_escalated` may try it
        replan_budget = device_budget.replanned(smaller)
      else:
        log.warning("jaxtier: the compiled step's peak device memory (%s) exceeds the device "
                    "budget (%s) after %d re-plans; keeping this plan", format_bytes(peak),
                    format_bytes(usable), attempt)
      break
    log.warning("jaxtier: the compiled step needs %s of device memory, %s over the budget of "
                "%s (predicted %s); re-planning with %s less", format_bytes(peak),
                format_bytes(peak - usable), format_bytes(usable),
                format_bytes(planned.plan.predicted_peak_hbm_bytes), format_bytes(peak - usable))
    previous, device_budget = planned, device_budget.replanned(smaller)
  with clock.phase("refine"):
    planned = _refine(planned, state, args, costs, make, lower, options.policy)
  if auto:
    with clock.phase("escalate"):
      planned = _escalated(planned, _device_limit(first.device_budget, platform), replan_budget,
                           _Candidates(inv, fixed, costs, make, lower, state, args))
  if planned.plan.compiled_from_cache:  # kept all the same (none fits): compiled, to run
    with clock.phase("verify"):
      planned, _ = _verify(dataclasses.replace(planned, plan=dataclasses.replace(
          planned.plan, compiled_from_cache=False)), state, args, options.policy, refining=True)
  planned = dataclasses.replace(planned, step_time_key=costs.step_time_key)
  log.debug("jaxtier plan:\n%s", planned.plan)
  # Each plan was admitted as planned (`_admitted_plan`); the one kept is admitted with what
  # its compiled step needs (nothing is allocated yet: `place` and `init` allocate after
  # planning).
  admission.admit_compiled(
      planned.plan, fixed["pinnable_bytes"],
      allocator_limit=host_lib.allocator_limit_bytes() if platform == "gpu" else None,
      available=(host_lib.available_bytes()
                 if platform == "cpu" and jax.default_backend() == "cpu" else None),
      resident_bytes=fixed["resident_bytes"], num_local_devices=_num_local_devices(state))
  # Judged once the compiled step is known: a plan predicted over the budget whose compiled
  # step fits it fits (`_verify`). Over the budget the caller gave, it is refused unless they
  # allow it; a budget the planner set itself is not the caller's.
  if options.device_budget is not None and not options.allow_over_budget:
    admission.admit_device_budget(planned.plan)
  _warn_unfit(planned.plan)
  return planned


def _admitted_plan(inv: inv_lib.Inventory, fixed: dict[str, Any],
                   device_budget: "int | DeviceBudget | None",
                   costs: step_costs_lib.StepCosts, **changed: Any) -> Plan:
  """`planner.make_plan` with `plan_step`'s arguments (`fixed`, updated by `changed`), and
  the plan admitted as planned (`admission.admit`).

  Raises:
    jaxtier.PlanError / AdmissionError: from planning or admission; `plan` the refused plan.
  """
  fixed = {**fixed, **changed}
  plan = planner.make_plan(inv, device_budget=device_budget, step_costs=costs, **fixed)
  admission.admit(plan, fixed["pinnable_bytes"])
  return plan


def _warn_unfit(plan: Plan) -> None:
  for line in verdict_lines(plan.verdicts if not plan.fits else ()):
    log.warning("jaxtier: %s", line)


def _raise_with_room(error: "PlanError | None", inv: inv_lib.Inventory, fixed: dict[str, Any],
                     device_budget: "int | None", costs: step_costs_lib.StepCosts, state: Any,
                     plan: "Plan | None" = None) -> None:
  """Raises an AdmissionError naming the XLA settings under which a plan fits this machine,
  where the one made under the settings in force does not fit (or was refused: `error`).

  On a GPU of this machine the limits a plan meets are partly XLA's settings, read when JAX
  starts: the pinned pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) and the device allocator's
  fraction (XLA_PYTHON_CLIENT_MEM_FRACTION). The plan is made again against what the machine
  has (`host.pinned_pool_room_bytes`; the GPU's free memory at start-up times
  MAX_MEM_FRACTION, unless a device budget was given), allocating nothing. When that plan
  fits, the settings it needs are named. Returns (raising nothing) elsewhere: on the CPU, when
  the settings in force already give all there is, or when even the machine's room does not
  fit a plan. Called for a GPU of this machine only.
  """
  limit = host_lib.allocator_limit_bytes()
  num_local_devices = _num_local_devices(state)
  room_pinned = host_lib.pinned_pool_room_bytes(num_local_devices)
  if limit is None or room_pinned is None:
    return
  room_device = device_budget
  if room_device is None:
    free_at_start = limit / host_lib.xla_mem_fraction()
    room_device = int(free_at_start * host_lib.MAX_MEM_FRACTION * (1 - admission.DEVICE_MARGIN))
  pinnable = max(fixed["pinnable_bytes"] or 0, room_pinned)
  try:
    room = _admitted_plan(inv, fixed, room_device, costs, pinnable_bytes=pinnable)
  except PlanError:
    return
  if not room.fits:
    return
  settings = {}
  # The pool named is all the room the host has, not the plan's need: after compiling, a
  # re-plan may move more state to the host (XLA's pool is a cap that grows with use).
  pool = host_lib.pinned_pool_that_fits(room.pinned_bytes, num_local_devices)
  if pool is not None:
    settings.update(admission.pool_settings(pool))
  if device_budget is None and room.predicted_peak_hbm_bytes is not None:
    fraction = host_lib.fraction_that_holds(room.predicted_peak_hbm_bytes,
                                            admission.DEVICE_MARGIN, limit)
    if fraction is not None:
      settings[admission.FRACTION_SETTING] = fraction
  if not settings:
    return
  said = " and ".join(f"{k}={v}" for k, v in settings.items())
  if error is not None:
    why = error.reason or str(error).removeprefix("jaxtier: ")
  else:
    why = f"the plan does not fit: {plan.verdicts[0] if plan and plan.verdicts else ''}"
  refusal = AdmissionError(
      f"jaxtier: plan refused before allocating anything: under XLA's settings in force, "
      f"{why}. A plan fits this machine with {said} (it needs pinned_host "
      f"{format_bytes(room.pinned_bytes)}, predicted peak device memory "
      f"{format_bytes(room.predicted_peak_hbm_bytes)}). Fix: set {said} before JAX starts "
      "(python -m jaxtier train does), or keep more state on the device / in pinned_host with a "
      "policy.")
  refusal.settings = settings
  # XLA's pinned pool where it is among the settings, else JAX's device allocator.
  refusal.limit = "host_limit" if admission.POOL_SETTING in settings else "device_memory"
  refusal.plan = room
  raise refusal from error


def plan_only(fn: Callable[..., Any], options: OffloadOptions, state: Any, args: Sequence[Any],
              *, platform: str, streamable: Any = None, dha_readable: Any = None,
              activations: Any = None, device_kind: "str | None" = None) -> Plan:
  """The plan `plan_step` starts from, for `platform` (which this machine may lack).

  `streamable` / `dha_readable`: the parameter leaves (indices) that may be placed
  `host_stream` / `host_dha`; None: every one the lowering can serve so (`dha_readable`: the
  embedding tables among them). `device_kind`: the GPU planned for where this machine has
  none (`machine.load`).
  """
  inv = inv_lib.take_inventory(fn, state, args, api="jaxtier.plan")
  here = jax.default_backend()
  hardware = machine.load(platform=platform, device_kind=device_kind)
  blocked = _stream_blocked(state)
  if blocked:  # none, whatever the caller allows
    streamable = frozenset()
  elif streamable is None:
    streamable = _streamable(inv)
  tables = {} if blocked else dha_readable_tables(inv)
  dha_readable = tables if dha_readable is None else {
      i: b for i, b in tables.items() if i in set(dha_readable)}
  pinnable_what = host_lib.HERE_PINNABLE
  if platform == here:
    pinnable = host_lib.pinnable_bytes(platform, _num_local_devices(state))
  else:  # planning for an absent GPU: what its profile says the host could pin, or XLA's
    # pinned-pool cap when the caller sets it (to plan for a host where it is raised).
    cap = host_lib.xla_pinned_pool_bytes()
    pinnable = cap if cap is not None else hardware.pinnable_bytes
    pinnable_what = ("XLA's pinned pool as XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB sets it"
                     if cap is not None else
                     "what the hardware profile says the GPU's host can pin (no GPU here)")
  result = planner.make_plan(
      inv, platform=platform, policy=options.policy, device_budget=options.device_budget,
      host_budget=options.host_budget, pinnable_bytes=pinnable, hardware=hardware,
      step_costs=_step_costs(inv, state, args, platform, options.policy, always=True),
      streamable=streamable, dha_readable=dha_readable, activations=activations,
      resident_bytes=_resident_bytes(state), pinnable_what=pinnable_what,
      stream_blocked=blocked, overlap_update=options.overlap_update, meshed=_meshed(state))
  admission.admit(result, pinnable, pinnable_what)
  _warn_unfit(result)  # not compiled: the prediction is all there is
  notes = _schedule_notes(result) + _pool_for_spares(result, pinnable_what, options,
                                                    _num_local_devices(state))
  if platform != here:
    notes += (f"planned for {platform} on a machine without one ({here}): "
              + profile.describe(hardware)
              + f"; pinnable host memory from the profile ({format_bytes(pinnable)})",)
  return dataclasses.replace(result, notes=result.notes + notes) if notes else result


def _verify(planned: Planned, state: Any, args: Sequence[Any], policy: Any,
            refining: bool = False, skip_over: "int | None" = None
            ) -> "tuple[Planned, int | None]":
  """Compiles the planned step and compares the compiler's peak with the budget planned for.

  Records the compiler's figure in the plan. Returns the planned step and a smaller device
  budget to re-plan with (the budget less what the compiled peak is over it) when the
  compiler's peak exceeds it and the solver may still move leaves, else None (always None
  when `refining`: the caller decides). Compiles the compute program once (and the
  host-update program, for its pinned_host figures), and keeps its figures on disk
  (`figures_cache`).

  `skip_over`: bytes per device; where an earlier process compiled the same compute program
  and its peak was over this, its figures are read from `figures_cache` and nothing is
  compiled (`Plan.compiled_from_cache`): 'auto' then escalates without compiling a plan
  known not to fit (`_escalated` compiles such a plan where it keeps it).
  """
  plan = planned.plan
  if plan.predicted_peak_hbm_bytes is None:
    return planned, None
  try:
    lowered, device_args, host = planned.programs.lower_for_check(state, args)
    digest = figures_cache.key(lowered.as_text(), backend=jax.default_backend(),
                               extra=(str(device_args), str(host)))
    known = (figures_cache.load(digest, step_costs_lib.MemoryFigures)
             if skip_over is not None else None)
    if known is not None:
      ok, fig = verify_lib.verify(plan, known, host_argument_bytes=host,
                                  device_argument_bytes=device_args)
      if fig is not None and fig.peak_bytes > skip_over:
        return _known_over(planned, fig, device_args, host), (
            None if ok or refining else _smaller_budget(plan, fig.peak_bytes, policy))
    compiled = lowered.compile()
    figures = step_costs_lib.memory_figures(compiled)
    figures_cache.store(digest, figures)
    ok, fig = verify_lib.verify(plan, figures, host_argument_bytes=host,
                                device_argument_bytes=device_args)
  except Exception as e:  # pylint: disable=broad-except  (the first call compiles and reports)
    log.debug("jaxtier: compiling the planned step to verify it failed: %r", e)
    return planned, None
  if fig is None:
    return planned, None
  # Pinned_host bytes beyond the state: what the compiled compute and update programs allocate
  # there, and the streamed leaves' gradient buffers (jaxtier's, allocated once).
  update_extra = _update_host_extra_bytes(planned.programs, state, compiled)
  scratch = sum(inv_lib.bytes_per_device(s) for s in planned.programs.scratch_specs())
  # Judged again with the compiled step's peak: where only the prediction was over the device
  # budget, the compiler's figure, the one the allocator meets, may fit it.
  verdict = admission.judge(plan.verdict.findings, plan.device_budget, fig.peak_bytes)
  said = (_figures_note(fig, device_args, host),)
  if verdict != plan.verdict:
    said += verdict.overruled
  plan = dataclasses.replace(
      plan, compiler_peak_hbm_bytes=fig.peak_bytes,
      compiler_host_extra_bytes=fig.host_extra_bytes + update_extra + scratch, verdict=verdict,
      notes=plan.notes + said)
  budget = plan.device_budget.usable
  planned = dataclasses.replace(planned, plan=plan)
  log.info("jaxtier: peak device memory per device: predicted %d bytes, compiler %d bytes%s",
           plan.predicted_peak_hbm_bytes, fig.peak_bytes,
           "" if budget is None else f", budget {budget} bytes")
  return planned, None if ok or refining else _smaller_budget(plan, fig.peak_bytes, policy)


def _smaller_budget(plan: Plan, peak: int, policy: Any) -> "int | None":
  """`_verify`'s budget to re-plan with, where the compiled `peak` of `plan` is over its
  budget: the budget less what the peak is over; None where re-planning cannot help."""
  budget = plan.device_budget.usable
  # Re-planning helps only where the solver believed its plan fit (else it already offloaded
  # all it could) and may move leaves.
  solvable = (not is_named(policy, *_FIXED) and budget is not None
              and plan.predicted_peak_hbm_bytes <= budget)
  if not solvable:
    if not is_named(policy, NamedPolicy.AUTO):  # (auto escalates, and says what it kept)
      log.warning("jaxtier: the compiled step's peak device memory (%s) exceeds the device "
                  "budget (%s)", format_bytes(peak), format_bytes(budget))
    return None
  return max(1, budget - (peak - budget))


def _known_over(planned: Planned, fig: Any, device_args: int, host: int) -> Planned:
  """`planned` with the compiled figures an earlier process recorded for its compute program
  (`figures_cache`), not compiled here: its peak is over the limit `_verify` was given."""
  plan = planned.plan
  log.info("jaxtier: the planned step's compiled peak, %s, is over the limit as an earlier "
           "compile of the same program found (figures cache): not compiled again",
           format_bytes(fig.peak_bytes))
  return dataclasses.replace(planned, plan=dataclasses.replace(
      plan, compiler_peak_hbm_bytes=fig.peak_bytes, compiled_from_cache=True,
      notes=plan.notes + (_figures_note(fig, device_args, host, ", as an earlier compile of "
                                        "the same program recorded it (figures cache; not "
                                        "compiled again)"),)))


def _figures_note(fig: Any, device_args: int, host: int, source: str = "") -> str:
  """The plan's note of its compiled step's memory figures (`source`: where they came from,
  where not this compile)."""
  return (f"compiled step's memory_analysis{source}: {fig.describe()} (the arguments by their "
          f"shardings: device {device_args}, pinned_host {host} bytes)")


def _pool_for_spares(plan: Plan, pinnable_what: str, options: OffloadOptions,
                     num_local_devices: int) -> tuple[str, ...]:
  """A note naming the pinned pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) with which every guarded
  update of `plan` would guess, where XLA's pool is what leaves some of them waiting (no host
  budget stops them) and this host has the memory; () otherwise. XLA reads the setting when JAX
  starts, so this process cannot raise its pool."""
  spec = plan.speculation
  if (spec is None or (spec.enabled and not spec.waiting) or plan.platform != "gpu"
      or pinnable_what != host_lib.HERE_PINNABLE):
    return ()
  need = plan.pinned_bytes + spec.all_spare_pinned_bytes
  if options.host_budget is not None and need > options.host_budget:
    return ()
  gib = host_lib.pinned_pool_that_fits(need, num_local_devices)
  if gib is None:
    return ()
  waiting = len(spec.waiting) if spec.enabled else len(spec.components)
  return (f"{waiting} guarded update{'s wait' if waiting != 1 else ' waits'} for the norm for "
          f"want of pinned memory for {'their' if waiting != 1 else 'its'} spares: with "
          f"{admission.POOL_SETTING}={gib} (XLA's pinned pool; this host has the memory, and "
          "XLA reads it when JAX starts) every one would guess",)


def _schedule_notes(plan: Plan) -> tuple[str, ...]:
  """What the plan's notes say of when its host updates run (`Plan.schedule`)."""
  if not plan.components:
    return ()
  def named(paths: list[str]) -> str:
    paths = sorted(paths)
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")

  notes = []
  layered = [s for s in plan.schedule if s.mode == update_schedule.Mode.LAYERED]
  if layered:
    pinned = {l.index for l in plan.leaves if l.memory_kind == MemoryKind.PINNED_HOST}
    leaves = [plan.leaves[i].path
              for i in update_schedule.host_leaves_written(layered, pinned)]
    notes.append(f"{len(layered)} of {len(plan.components)} host updates run layer by layer "
                 f"inside the backward pass, overlapped with it (their {len(leaves)} host "
                 f"leaves: {named(leaves)})")
  spec = plan.speculation
  if spec is not None:
    miss = format_share(spec.max_miss)
    notes.append(
        f"{len(spec.components)} of them read a value computed from every gradient (a "
        "global-norm clip, a non-finite check): they run on a guess of it (the clip does not "
        "bind, the gradients are finite), writing spare buffers ("
        f"{format_bytes(spec.spare_pinned_bytes)} pinned); a wrong guess is redone after the "
        f"backward pass, bit for bit; guessing pays while under {miss} of the recent steps "
        "miss it" + (
            f"; {len(spec.waiting)} more run after the backward pass, their spares not "
            "fitting the pinned memory left (largest first, the spares that fit guess)"
            if spec.waiting else "") if spec.enabled else
        f"{len(spec.components)} of them read a value computed from every gradient (a "
        "global-norm clip, a non-finite check) and run after the backward pass: "
        f"{spec.why}")
  for s in plan.schedule:
    if s.mode != update_schedule.Mode.ROWS:
      continue
    table = plan.leaves[s.table].path
    notes.append(f"the update of {table} (host_dha: read in place) and its state runs row by "
                 "row on the host CPUs: the rows the step's ids do not name, whose gradient is "
                 "zero, while the step computes; the others once their gradient rows have "
                 "landed (the same numbers as one update after the backward pass)")
  by_reason: dict[update_schedule.Refusal, list[int]] = {}
  for s in plan.schedule:
    if s.mode == update_schedule.Mode.SERIAL:
      by_reason.setdefault(s.reason, []).append(s.component)
  for why, comps in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
    seeds = [plan.leaves[i].path for c in comps for i in plan.components[c].component.seeds]
    notes.append(f"{len(comps)} host update{'s run' if len(comps) > 1 else ' runs'} after the "
                 f"backward pass (their {len(seeds)} leaves: {named(seeds)}): {why}")
  return tuple(notes)


def _update_host_extra_bytes(programs: compiled_lib.StepPrograms, state: Any,
                             compiled_compute: Any) -> int:
  """Pinned_host bytes the compiled host-update program allocates beyond its arguments (its
  outputs not aliased to an input, its host temporaries); 0 where it has none, or where the
  backend reports no host figures."""
  try:
    lowered = programs.lower_update_for_check(state, compiled_compute)
    fig = None if lowered is None else step_costs_lib.memory_figures(lowered.compile())
  except Exception as e:  # pylint: disable=broad-except  (the first call compiles and reports)
    log.debug("jaxtier: compiling the host-update program to check it failed: %r", e)
    return 0
  return 0 if fig is None else fig.host_extra_bytes


# An attempt whose compiled peak an earlier process recorded (`figures_cache`): not compiled.
_CACHED = "as an earlier compile found it: not compiled again"
# The name of auto's plan re-planned against the budget less what its compiled step was over
# (`_escalated`), tried once 'optimizer_state_on_host' fits.
REPLANNED = "auto re-planned"


@dataclasses.dataclass(frozen=True)
class _Candidates:
  """What `_escalated` plans, lowers and verifies its plans with: `plan_step`'s trace
  (`inv`), fixed planning arguments, the device-only step's costs, its `make` (step costs,
  budget -> plan under 'auto') and `lower`, and the step's arguments."""

  inv: inv_lib.Inventory
  fixed: dict
  costs: step_costs_lib.StepCosts
  make: Callable[..., Plan]
  lower: Callable[..., Planned]
  state: Any
  args: Sequence[Any]

  def policy(self, name: str) -> Any:
    """The policy that makes the plan of ESCALATIONS named `name`; None where there is none
    (no leaf may be streamed)."""
    if name != "stream":
      return name
    streamable = set(self.fixed["streamable"])
    if not streamable:
      return None
    def stream_stacks(path: str, leaf: Any) -> "str | None":
      del path
      return Placement.HOST_STREAM if leaf.index in streamable else None
    return stream_stacks

  def unstreamable(self) -> str:
    """Why no leaf may be streamed, where `policy('stream')` is None: the state's sharding
    (`_stream_blocked`), else why its largest parameter leaf may not
    (`layer_stacks.stream_reason`: a stack scanned along another axis than 0 names it)."""
    if self.fixed["stream_blocked"]:
      return self.fixed["stream_blocked"]
    params = [l for l in self.inv.leaves if l.role == Role.PARAM]
    if not params:
      return "the state has no parameter leaf"
    largest = max(params, key=lambda l: l.nbytes)
    why = layer_stacks.stream_reason(self.inv.closed_jaxpr.jaxpr, largest.index)
    return f"no parameter leaf may be streamed (the largest, {largest.path}: {why})"


def _device_limit(budget: DeviceBudget, platform: str) -> "int | None":
  """Bytes per device that the compiled step's peak must fit: the budget planned against, or
  what JAX's allocator holds on this GPU less DEVICE_MARGIN (`admission.admit_device`) where
  that is less; None where neither limits it (the CPU backend without a budget)."""
  allocator = host_lib.allocator_limit_bytes() if platform == "gpu" else None
  held = None if allocator is None else int(allocator * (1 - admission.DEVICE_MARGIN))
  return min((b for b in (budget.usable, held) if b is not None), default=None)


def _layout(plan: Plan) -> tuple[tuple[str, bool], ...]:
  """Each leaf's memory kind and whether it is streamed: plans alike in this compile to about
  the same peak device memory, so `_escalated` compiles one of them only."""
  return tuple((l.memory_kind, l.placement == Placement.HOST_STREAM) for l in plan.leaves)


def _escalated(planned: Planned, limit: "int | None", replan_budget: "DeviceBudget | None",
               c: _Candidates) -> Planned:
  """Under 'auto': where the compiled step of `planned` (auto's plan) is over the device
  `limit` (bytes per device, `_device_limit`), the plans of ESCALATIONS with more state on the
  host, each planned against the budget `planned` was made against and verified by compiling
  its compute program (`_verify`); the first whose compiled peak is within `limit` is kept.
  Where that is the first, 'optimizer_state_on_host', and auto's plan re-planned against
  `replan_budget` (the budget less what its compiled step was over; None: auto's prediction
  did not fit, so the solver has no other plan) is another placement predicted faster, that
  one is compiled too and kept where it fits as well. A plan with the memory kinds of one
  already compiled is not compiled again. At most MAX_ESCALATION_COMPILES compiles.

  Where none fits, the plan with the lowest compiled peak is kept (admission then refuses it,
  listing the plans tried, unless a device budget given allows running over it). The plan kept
  records what was tried (`Plan.escalation`) and says so in one note.

  Nothing is escalated where XLA's allocator is the limit and a larger
  XLA_PYTHON_CLIENT_MEM_FRACTION holds auto's compiled step on this GPU: admission names that
  fraction (`AdmissionError.settings`), with which `python -m jaxtier train` runs itself again
  and the plan keeps more state on the device.

  Raises:
    AdmissionError: no plan's compiled step fits, and one fits the device but needs more
      pinned host memory than XLA's pinned pool in force allows, where a larger pool would hold
      it on this host (`settings` names the pool, `plan` is that plan).
  """
  own = planned.plan
  peak = own.compiler_peak_hbm_bytes
  if limit is None or peak is None or peak <= limit:
    return planned
  allocator = host_lib.allocator_limit_bytes() if own.platform == "gpu" else None
  if (allocator is not None and limit >= int(allocator * (1 - admission.DEVICE_MARGIN))
      and host_lib.fraction_that_holds(peak, admission.DEVICE_MARGIN, allocator) is not None):
    return planned
  log.info("jaxtier: auto's compiled step needs %s of device memory, over the limit of %s: "
           "planning with more state on the host", format_bytes(peak), format_bytes(limit))
  auto = str(NamedPolicy.AUTO)
  tried = [Attempt(name=auto, compiler_peak_hbm_bytes=peak,
                   why=_CACHED if own.compiled_from_cache else "")]
  compiled = {_layout(own): auto}
  verified = [(auto, planned)]
  kept = held = None  # held: (name, planned, refusal) fits the device, not the pinned pool
  compiles = 0
  for name in ESCALATIONS:
    policy = c.policy(name)
    if policy is None:
      tried.append(Attempt(name=str(name), why=f"not planned: {c.unstreamable()}"))
      continue
    if compiles >= MAX_ESCALATION_COMPILES:
      continue
    refusal = None
    try:
      plan = _admitted_plan(c.inv, c.fixed, own.device_budget, c.costs, policy=policy)
    except PlanError as e:
      if not (isinstance(e, AdmissionError) and e.settings and e.plan is not None):
        tried.append(Attempt(name=str(name), why="refused before compiling: "
                             + (e.reason or str(e).removeprefix("jaxtier: ").split(". ")[0])))
        continue
      # Refused for XLA's pinned pool, which a setting may enlarge: compiled all the same, to
      # know whether that setting is the fix (nothing is allocated).
      plan, refusal = e.plan, e
    same = compiled.get(_layout(plan))
    if same is not None:
      tried.append(Attempt(name=str(name), why=f"the same memory kinds as {same}'s plan: "
                           "not compiled again"))
      continue
    compiled[_layout(plan)] = str(name)
    candidate, _ = _verify(c.lower(plan), c.state, c.args, policy, refining=True,
                           skip_over=limit)
    compiles += not candidate.plan.compiled_from_cache
    got = candidate.plan.compiler_peak_hbm_bytes
    if got is None:
      tried.append(Attempt(name=str(name), why="its compiled step reports no memory figures"))
      continue
    if refusal is not None:
      tried.append(Attempt(name=str(name), compiler_peak_hbm_bytes=got,
                           why=f"refused for the host: {refusal.reason}"))
      if got <= limit and held is None:
        held = (str(name), candidate, refusal)
      continue
    tried.append(Attempt(name=str(name), compiler_peak_hbm_bytes=got,
                         why=_CACHED if candidate.plan.compiled_from_cache else ""))
    verified.append((str(name), candidate))
    if got <= limit:
      kept = (str(name), candidate)
      break
  if (kept is not None and kept[0] == ESCALATIONS[0] and replan_budget is not None
      and compiles < MAX_ESCALATION_COMPILES):
    kept = _faster_replan(kept, replan_budget, limit, compiled, tried, c)
  if kept is None and held is not None:
    raise _pool_refusal(held, Escalation(limit_bytes=limit, tried=tuple(tried), kept=held[0],
                                         fits=False))
  if kept is None:
    kept = min(verified, key=lambda nv: nv[1].plan.compiler_peak_hbm_bytes)
  name, chosen = kept
  escalation = Escalation(limit_bytes=limit, tried=tuple(tried), kept=name,
                          fits=chosen.plan.compiler_peak_hbm_bytes <= limit)
  if escalation.fits:
    note = f"escalated to {name}: {escalation.tried_text()}; " + (
        f"{name} is the first that fits" if name != REPLANNED else
        f"{ESCALATIONS[0]} fits, and {name} fits too and is predicted faster")
    log.warning("jaxtier: auto's compiled step needs %s of device memory, over the limit of "
                "%s: planned as %s, whose compiled step needs %s", format_bytes(peak),
                format_bytes(limit), name, format_bytes(chosen.plan.compiler_peak_hbm_bytes))
  else:
    note = (f"escalated, and no plan fits: {escalation.tried_text()}; kept {name}, the lowest")
  plan = chosen.plan
  if name == "stream":
    plan = dataclasses.replace(plan, leaves=tuple(dataclasses.replace(
        l, user_placed=False, reason=l.reason.replace(
            policy_lib.USER_PLACED, "streamed by auto: its own plan's compiled step was over "
            "the device limit"))
        for l in plan.leaves))
  return dataclasses.replace(chosen, plan=dataclasses.replace(
      plan, escalation=escalation, notes=plan.notes + (note,)))


def _faster_replan(kept: tuple[str, Planned], budget: DeviceBudget, limit: int,
                   compiled: dict, tried: list[Attempt], c: _Candidates
                   ) -> tuple[str, Planned]:
  """`_escalated`'s last try, once 'optimizer_state_on_host' fits: auto's plan against
  `budget` (the budget less what auto's compiled step was over), compiled where it is
  another placement predicted faster than `kept`'s; kept instead where its compiled peak is
  within `limit`. Appends to `tried` and `compiled`."""
  try:
    plan = c.make(c.costs, budget)
  except PlanError as e:
    log.debug("jaxtier: re-planning against %s failed: %s", format_bytes(budget.usable), e)
    return kept
  first = kept[1].plan
  if (_layout(plan) in compiled or plan.predicted_step_secs is None
      or first.predicted_step_secs is None
      or plan.predicted_step_secs >= 0.99 * first.predicted_step_secs):
    return kept
  compiled[_layout(plan)] = REPLANNED
  candidate, _ = _verify(c.lower(plan, f"re-planned against {format_bytes(budget.usable)}: "
                                 "auto's compiled step was over the budget"),
                         c.state, c.args, NamedPolicy.AUTO, refining=True, skip_over=limit)
  got = candidate.plan.compiler_peak_hbm_bytes
  tried.append(Attempt(name=REPLANNED, compiler_peak_hbm_bytes=got,
                       why=f"against {format_bytes(budget.usable)}" + (
                           f"; {_CACHED}" if candidate.plan.compiled_from_cache else "")))
  return (REPLANNED, candidate) if got is not None and got <= limit else kept


def _pool_refusal(held: tuple[str, Planned, AdmissionError],
                  escalation: Escalation) -> AdmissionError:
  """The refusal where no plan of `_escalated` fits and `held`'s (name, planned, refusal)
  fits the device but not XLA's pinned pool in force: it names the pool that holds it."""
  name, candidate, refusal = held
  said = " and ".join(f"{k}={v}" for k, v in refusal.settings.items())
  error = AdmissionError(
      f"jaxtier: plan refused before allocating anything: {escalation.tried_text()}. The "
      f"{name} plan fits the device ({format_bytes(candidate.plan.compiler_peak_hbm_bytes)} "
      f"of {format_bytes(escalation.limit_bytes)}), but {refusal.reason}. Fix: set {said} "
      "before JAX starts (python -m jaxtier train does); or fewer activations (a smaller "
      "batch or sequence, or rematerialise more: remat_policy).")
  error.reason = refusal.reason
  error.settings = dict(refusal.settings)
  error.limit = refusal.limit
  error.need_bytes, error.limit_bytes = refusal.need_bytes, refusal.limit_bytes
  error.plan = dataclasses.replace(candidate.plan, escalation=escalation)
  return error


def _refine(planned: Planned, state: Any, args: Sequence[Any],
            costs: step_costs_lib.StepCosts, replan: Callable[..., Plan],
            lower: Callable[[Plan], Planned], policy: Any) -> Planned:
  """Re-plans with what compiling the plan taught: the update temporaries it freed.

  The transient bytes come from the device-only step, whose peak holds the optimizer
  update's temporaries; a step whose updates run on the host does not. When the compiled
  peak of the verified plan is below its predicted peak by more than
  REFINE_MIN_OVERESTIMATE of the budget, the difference per byte of optimizer state on the
  host becomes `StepCosts.update_credit` and the solver runs again under the same budget.
  The new plan is kept only if it is predicted faster and its compiled peak is within the
  budget; if it is over, half the credit is tried (REFINE_CREDIT_SHARES); otherwise the
  verified plan stays.
  """
  plan = planned.plan
  if is_named(policy, *_FIXED):
    return planned
  budget, peak = plan.device_budget.usable, plan.compiler_peak_hbm_bytes
  predicted = plan.predicted_peak_hbm_bytes
  if budget is None or peak is None or predicted is None or peak > budget:
    return planned
  over = predicted - peak
  moved = sum(l.nbytes for l in plan.leaves
              if l.role == Role.OPTIMIZER_STATE and l.placement != Placement.DEVICE)
  if over <= REFINE_MIN_OVERESTIMATE * budget or moved <= 0:
    return planned
  tried = False
  for share in REFINE_CREDIT_SHARES:
    credit = costs.update_credit + share * over / moved
    try:
      refined = replan(dataclasses.replace(costs, update_credit=credit), plan.device_budget)
    except PlanError as e:
      log.debug("jaxtier: refining the plan failed: %r", e)
      break
    if (refined.predicted_step_secs is None or plan.predicted_step_secs is None
        or refined.predicted_step_secs >= plan.predicted_step_secs * 0.99):
      # A smaller credit gives a plan nearer the first: not faster either.
      log.info("jaxtier: the refined plan is not predicted faster than the first: keeping "
               "the first plan")
      return planned
    why = (f"refined: the first plan's peak was predicted "
           f"{format_bytes(predicted)} and compiled to {format_bytes(peak)}; "
           f"the transient bytes are credited {credit:.3g} bytes per byte of optimizer state "
           f"updated on the host (its update's temporaries); the first plan predicted "
           f"{plan.predicted_step_secs * 1e3:.2f} ms per step")
    tried = True
    candidate, _ = _verify(lower(refined, why), state, args, policy, refining=True)
    new_peak = candidate.plan.compiler_peak_hbm_bytes
    if new_peak is not None and new_peak <= budget:
      log.info("jaxtier: plan refined with the compiled step's peak: predicted step %.2f ms "
               "(was %.2f ms)", candidate.plan.predicted_step_secs * 1e3,
               plan.predicted_step_secs * 1e3)
      return candidate
    log.info("jaxtier: a refined plan's compiled peak (%s) is over the budget (%s)",
             "unknown" if new_peak is None else format_bytes(new_peak), format_bytes(budget))
  if tried:
    log.info("jaxtier: keeping the first plan")
  return planned


def _stream_blocked(state: Any) -> str:
  """Why no leaf of `state` may be streamed ('' when they may): the streaming custom calls
  run on one device; XLA's SPMD partitioner refuses them in a program over several
  ("Side-effect HLO must have sharding")."""
  mesh = jc.common_mesh(state)
  if mesh is None or mesh.size <= 1:
    return ""
  return (f"the state is sharded over a mesh of {mesh.size} devices, and streaming runs on one "
          "device only (its custom calls are not partitioned by XLA's SPMD pass yet)")


def _streamable(inv: inv_lib.Inventory) -> set[int]:
  """Parameter leaves the lowering can serve `host_stream` (`layer_stacks.stream_reason`)."""
  return {l.index for l in inv.leaves if l.role == Role.PARAM
          and not layer_stacks.stream_reason(inv.closed_jaxpr.jaxpr, l.index)}


def dha_readable_tables(inv: inv_lib.Inventory) -> dict[int, int]:
  """{parameter leaf: bytes of the rows one step gathers} of the embedding tables the lowering
  can serve in place (`host_dha`: `analysis/lookups.py`)."""
  params = [l.index for l in inv.leaves if l.role == Role.PARAM and l.is_float]
  return {i: t.rows_nbytes
          for i, t in lookups.table_lookups(inv.closed_jaxpr.jaxpr, params).items()}


def _num_local_devices(state: Any) -> int:
  """Devices of the state's mesh that this process addresses (1 without a mesh).

  Each keeps its shards of the host leaves in this host's memory; plans count bytes per device.
  """
  mesh = jc.common_mesh(state)
  if mesh is None:
    return 1
  here = jax.process_index()
  return max(1, sum(d.process_index == here for d in mesh.devices.flat))


def changes(old: Any, new: Any, state: Any, args: Sequence[Any], limit: int = 4) -> str:
  """What differs between two `signature`s, naming leaves by path ('' if nothing)."""
  out = []
  for what, tree, (old_def, old_leaves), (new_def, new_leaves) in (
      ("state", state, old[0], new[0]), ("batch", tuple(args), old[1], new[1])):
    if old_def != new_def:
      out.append(f"the {what}'s pytree structure")
      continue
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    for path, a, b in zip(paths, old_leaves, new_leaves):
      if a != b:
        fmt = lambda t: f"{t[1]}{list(t[0])}"
        out.append(f"{what} leaf {path or '(root)'} was {fmt(a)}, now {fmt(b)}")
  more = f" and {len(out) - limit} more" if len(out) > limit else ""
  return "; ".join(out[:limit]) + more


def signature(state: Any, args: Sequence[Any]) -> Any:
  """What a plan depends on: the pytree structures, shapes and dtypes of state and args."""
  def sig(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))
                          for x in leaves)
  return sig(state), sig(tuple(args))


def _step_costs(inv: inv_lib.Inventory, state: Any, args: Sequence[Any], platform: str,
                policy: Any, always: bool = False, limited: bool = True
                ) -> "step_costs_lib.StepCosts":
  """FLOPs and transient bytes of the device-only step (compiled when the solver runs, or
  `always`: `jaxtier.plan` predicts for every policy).

  `limited`: whether the plan has a device limit (a budget given, or a GPU's memory). Without
  one (the CPU backend, no budget) the solver keeps every leaf on the device whatever the
  transient bytes and the step's time, and the plan's own compile gives its peak: the
  device-only step is not compiled (a second compile of the same program), and the step's
  time is predicted from its FLOPs and bytes at the profile's rates.
  """
  leaves = jax.tree_util.tree_leaves(state)
  solves = always or not is_named(policy, *_FIXED)
  timed = (solves or is_named(policy, NamedPolicy.OPTIMIZER_STATE_ON_HOST)) and _time_scans(
      platform)
  return step_costs_lib.measure_step(
      inv.closed_jaxpr, leaves, jax.tree_util.tree_leaves(args), platform=platform,
      state_device_bytes=sum(l.nbytes for l in inv.leaves),
      compile_step=solves and (limited or always),
      # Also under optimizer_state_on_host: whether its layered updates hide under the
      # backward pass, and so their executor, rests on the compute's time.
      time_scans=timed)


def _meshed(state: Any) -> frozenset[int]:
  """The state leaves the lowering places on a mesh of more than one device: a leaf with a
  `NamedSharding` on its mesh, any other on the state's (`compiled.state_shardings`)."""
  leaves = jax.tree_util.tree_leaves(state)
  common = jc.common_mesh(leaves)
  out = set()
  for i, x in enumerate(leaves):
    sh = getattr(x, "sharding", None)
    mesh = sh.mesh if isinstance(sh, jax.sharding.NamedSharding) else common
    if mesh is not None and mesh.size > 1:
      out.add(i)
  return frozenset(out)


def _resident_bytes(state: Any) -> int:
  """Bytes of the state's leaves that exist as arrays (not `jax.ShapeDtypeStruct`s)."""
  return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(state)
             if isinstance(x, (jax.Array, np.ndarray)))


def _time_scans(platform: str) -> bool:
  """Whether the planner times the step's compute on this machine's device (`step_costs.
  measure_step`: on a GPU its scan bodies, on the CPU backend the whole device-only step):
  JAXTIER_TIME_SCANS=1/0 forces it; by default where the plan is for this machine's own backend
  and its rates are this machine's: on a GPU, and on the CPU backend once calibrated (with the
  default profile a CPU plan's other rates are an H200's, and timing on the CPU would make
  plans in tests depend on machine load)."""
  forced = os.environ.get("JAXTIER_TIME_SCANS")
  if forced is not None:
    return forced not in ("", "0", "false", "False")
  if platform != jax.default_backend():
    return False
  return platform == "gpu" or not machine.load(platform=platform, warn=False).is_default
