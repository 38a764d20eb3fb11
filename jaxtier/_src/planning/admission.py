"""Admission: a plan's verdict against its budgets (`judge`), and the refusal, before anything
is allocated, of a plan over what may be held (`admit` before compiling, `admit_compiled`
after)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Sequence

from jaxtier._src.errors import AdmissionError, PlanError
from jaxtier._src.hardware import profile
from jaxtier._src.hardware import host as host_lib
from jaxtier._src.hardware.host import HERE_PINNABLE
from jaxtier._src.planning.plan import (BudgetViolation, DeviceBudget, Finding, LeafPlan, Plan,
                                        Verdict)
from jaxtier._src.units import format_bytes

# Share of the device's memory a default budget leaves free (fragmentation, workspace).
DEVICE_MARGIN = 0.05


def allocator_bytes(hardware: "profile.HardwareProfile") -> tuple[int, str]:
  """(bytes, where from) of the device memory JAX's allocator may use on the GPU planned for.

  This machine's GPU: its allocator's limit (`memory_stats()['bytes_limit']`). A GPU that is not
  here: the profile's `hbm_bytes` (what the allocator holds at XLA's default fraction, 0.75)
  scaled to XLA_PYTHON_CLIENT_MEM_FRACTION where it is set, as it would be on that GPU.
  """
  here = host_lib.allocator_limit_bytes()
  if here is not None:
    return here, "what JAX's allocator may use on this GPU"
  fraction = host_lib.xla_mem_fraction()
  limit = int(hardware.hbm_bytes * fraction / host_lib.XLA_MEM_FRACTION_DEFAULT)
  return limit, (f"the profile's HBM ({hardware.device_kind}) at {FRACTION_SETTING}="
                 f"{fraction:g}")


def default_device_budget(hardware: "profile.HardwareProfile") -> tuple[int, str]:
  """(bytes, why) of the device budget planned against when none is given, on a GPU: what JAX's
  allocator may use there (`allocator_bytes`), less DEVICE_MARGIN for fragmentation and
  compiler workspace the model does not see."""
  limit, where = allocator_bytes(hardware)
  return int(limit * (1 - DEVICE_MARGIN)), f"{where} less {DEVICE_MARGIN:.0%}"


def plan_device_budget(device_budget: "int | DeviceBudget | None", platform: str,
                       hardware: "profile.HardwareProfile") -> tuple[DeviceBudget, list[str]]:
  """The device budget a plan for `platform` is made against, and the notes that say why.

  On a GPU, no budget given is what JAX's allocator may use less DEVICE_MARGIN
  (`default_device_budget`: source 'default'); a budget above that on a GPU that is not here
  is capped to it (room above an absent GPU's memory is no room: source 'capped'). On a GPU
  here, a budget above the allocator's limit is kept and noted: admission checks the compiled
  step's peak against the allocator (`admit_device`).

  Args:
    device_budget: the budget asked for (`DeviceBudget.of`): bytes per device, or None.
    platform: 'cpu' or 'gpu'.
    hardware: the profile of the GPU planned for.

  Returns:
    (the budget with its `usable` bytes set, the notes for the plan).
  """
  budget = DeviceBudget.of(device_budget)
  asked, notes = budget.asked, []
  if asked is not None and platform == "gpu":
    limit, where = allocator_bytes(hardware)
    usable = int(limit * (1 - DEVICE_MARGIN))
    above = (f"device budget {format_bytes(asked)} is above what JAX's allocator may "
             f"use ({format_bytes(limit)}: {where}; profile: {hardware.source}): ")
    if asked > usable and host_lib.allocator_limit_bytes() is None:
      # (On a GPU here, admission checks the compiled peak against the allocator, and names
      # the fraction that would hold it: `train` runs itself again with it.)
      budget = DeviceBudget(given=budget.given, usable=usable, source="capped")
      notes.append(above + f"planned against {format_bytes(usable)}, that less "
                   f"{DEVICE_MARGIN:.0%}")
    elif asked > limit:
      notes.append(above + "the compiled step is admitted against that")
  if asked is None and platform == "gpu":
    usable, why = default_device_budget(hardware)
    budget = DeviceBudget(given=budget.given, usable=usable, source="default")
    notes.append(f"device budget: none given; planned against {format_bytes(usable)} ({why})")
  return budget, notes


def judge(findings: Sequence[Finding], device_budget: DeviceBudget,
          compiler_peak_hbm_bytes: "int | None" = None) -> Verdict:
  """The verdict of a plan: whether it fits its budgets, and the limits it misses.

  The one place a plan's verdict is made: by the planner from what its prediction misses,
  and again once the step is compiled, with the compiled step's peak.

  A finding stands, except where the plan was made against a re-plan budget (its findings
  are against that internal budget, not the user's: the compiled step judges the plan), or
  where the compiled step's peak, `compiler_peak_hbm_bytes`, is within the budget planned
  against and every limit missed is that budget (the compiler's figure is the one the
  allocator meets). Where the budget was capped at what the allocator of an absent GPU may
  use, a miss of it is a miss of the device's memory ('device_memory'). A compiled peak over
  the budget the user gave is a finding of its own where none that stands misses that budget
  (the prediction fitted it, or the plan was made against a re-plan budget).

  Args:
    findings: what the prediction misses (`Finding`s), against `device_budget.usable`.
    device_budget: the budget the plan was made against.
    compiler_peak_hbm_bytes: the compiled step's peak device memory, bytes per device (None:
      not compiled).

  Returns:
    The `Verdict`: its `overruled` notes say which findings do not stand and why.
  """
  findings = tuple(findings)
  if device_budget.source == "capped":
    findings = tuple(dataclasses.replace(f, violations=tuple(
        dataclasses.replace(v, limit="device_memory") if v.limit == "device_budget" else v
        for v in f.violations)) for f in findings)
  peak, usable = compiler_peak_hbm_bytes, device_budget.usable
  violations = tuple(v for f in findings for v in f.violations)
  if device_budget.source == "re-plan":
    internal = format_bytes(device_budget.usable)
    verdict = Verdict(findings=findings, overruled=tuple(
        f"against the re-plan budget of {internal}, not yours: {f.sentence}" for f in findings))
  elif (peak is not None and (usable is None or peak <= usable)
        and all(v.limit == "device_budget" for v in violations)):
    verdict = Verdict(findings=findings, overruled=tuple(
        f"the prediction said: {f.sentence}; the compiled step's peak, {format_bytes(peak)}, "
        "fits the budget" for f in findings))
  else:
    verdict = Verdict(findings=findings, fits=not findings, violations=violations,
                      verdicts=tuple(f.sentence for f in findings))
  given = device_budget.given
  if (peak is not None and given is not None and peak > given
      and device_budget.source in ("given", "re-plan")
      and not any(v.limit == "device_budget" for v in verdict.violations)):
    over = Finding(
        sentence=f"the compiled step's peak device memory {format_bytes(peak)} exceeds the "
        f"device budget of {format_bytes(given)}",
        violations=(BudgetViolation(limit="device_budget", need_bytes=peak,
                                    limit_bytes=given),))
    verdict = dataclasses.replace(
        verdict, fits=False, violations=verdict.violations + over.violations,
        verdicts=verdict.verdicts + (over.sentence,))
  return verdict


FRACTION_SETTING = "XLA_PYTHON_CLIENT_MEM_FRACTION"
POOL_SETTING = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def pool_settings(gib: int) -> dict[str, str]:
  """The environment settings that give XLA a pinned pool of `gib` GiB per GPU."""
  return {POOL_SETTING: str(gib)}


def admit_device(plan: Plan, allocator_limit: "int | None") -> None:
  """Refuses `plan` before anything is allocated where its peak device memory (the compiled
  step's `memory_analysis`, else the prediction) is over what JAX's allocator can hold on this
  GPU less DEVICE_MARGIN (`admit_device_peak`).

  Args:
    plan: the plan, after verification when the step was compiled.
    allocator_limit: `memory_stats()['bytes_limit']` of this GPU; None (no GPU here): nothing
      to check.

  Raises:
    AdmissionError: the peak over the allocator's limit less DEVICE_MARGIN; its `plan` is
      `plan`.
  """
  peak = plan.compiler_peak_hbm_bytes
  source = "the compiled step's peak"
  if peak is None:
    peak, source = plan.predicted_peak_hbm_bytes, "the predicted peak"
  largest = _largest([l for l in plan.leaves if l.memory_kind == "device"], lambda l: l.nbytes)
  tried = plan.escalation
  detail = (f"{_capital(tried.tried_text())}. " if tried is not None else "") + (
      f"Largest device leaves: {largest}. " if largest else "")
  more_on_host = ("" if _tried_all_host(plan) else "keep more state in pinned_host (policy, "
                  "or host_stream for the layers' params), ")
  try:
    admit_device_peak(peak, allocator_limit, source=source, detail=detail,
                      fix=(f"{more_on_host}a smaller batch or sequence, or rematerialise "
                           "more (remat_policy)"))
  except AdmissionError as e:
    e.plan = plan
    raise


def admit_device_peak(peak: "int | None", allocator_limit: "int | None", *, source: str,
                      fix: str, detail: str = "", what: str = "plan") -> None:
  """Refuses a program whose peak device memory, `peak` bytes, is over what JAX's allocator can
  hold on this GPU, `allocator_limit` bytes, less DEVICE_MARGIN (fragmentation: XLA allocates
  each program's temporaries as one buffer, so the free memory must hold it in one piece).

  Where the allocator's fraction is what stops it and the GPU has the memory, the refusal names
  the fraction that fits and carries it in `AdmissionError.settings`
  (`host.fraction_that_holds` of `allocator_limit`); else it gives `fix`.

  Args:
    peak: bytes; None: nothing to check.
    allocator_limit: `memory_stats()['bytes_limit']` of this GPU; None (no GPU here): nothing
      to check.
    source: what `peak` is, for the message ("the compiled step's peak").
    fix: the fix where no fraction would hold it.
    detail: sentences placed before the fix (the largest leaves).
    what: what is refused, for the message ("plan", or "step" for a program jaxtier did not
      plan).

  Raises:
    AdmissionError: `limit` 'device_memory', `reason` the sizes, `settings` the fraction.
  """
  if allocator_limit is None or peak is None:
    return
  usable = int(allocator_limit * (1 - DEVICE_MARGIN))
  if peak <= usable:
    return
  fraction = host_lib.fraction_that_holds(peak, DEVICE_MARGIN, allocator_limit)
  if fraction is not None:
    fix = (f"JAX's allocator fraction is the limit and this GPU has the memory: set "
           f"{FRACTION_SETTING}={fraction} before JAX starts (python -m jaxtier train does)")
  reason = (f"{source} is {format_bytes(peak)} ({peak} bytes) of device memory, over what "
            f"JAX's allocator holds on this GPU ({format_bytes(allocator_limit)}, "
            f"{FRACTION_SETTING}={host_lib.xla_mem_fraction():g}) less {DEVICE_MARGIN:.0%} for "
            f"fragmentation ({format_bytes(usable)})")
  error = AdmissionError(
      f"jaxtier: {what} refused before allocating anything: {reason}. {detail}Fix: {fix}.")
  error.reason = reason
  error.settings = {FRACTION_SETTING: fraction} if fraction is not None else {}
  error.limit, error.need_bytes, error.limit_bytes = "device_memory", peak, usable
  raise error


def admit_device_budget(plan: Plan) -> None:
  """Refuses `plan` before anything is allocated where it does not fit the device budget the
  caller gave (`jaxtier.offload(device_budget=...)` without `allow_over_budget=True`): its
  verdict (`judge`, with the compiled step's peak where the step was compiled) says it does
  not fit. A plan without a budget given (one the planner set itself) is not refused here.

  Raises:
    AdmissionError: `limit` 'device_budget', `need_bytes` the step's peak device memory (the
      compiled step's, else the predicted one), `limit_bytes` the budget given, `reason` the
      sizes, `plan` the plan.
  """
  given = plan.device_budget.given
  if given is None or plan.fits:
    return
  predicted, compiled = plan.predicted_peak_hbm_bytes, plan.compiler_peak_hbm_bytes
  peak = compiled if compiled is not None else predicted
  if peak is None or peak <= given:
    # The compiled peak fits, but the findings stand on another limit missed with the budget
    # (a host limit that binds): the figure they missed the budget by.
    peak = max((v.need_bytes for v in plan.violations if v.limit == "device_budget"),
               default=peak)
  if peak is not None and peak > given:
    figures = (f"the compiled step's peak device memory is {format_bytes(peak)} ({peak} bytes"
               + (f"; predicted {format_bytes(predicted)}" if predicted is not None else "")
               + ")" if peak == compiled else
               f"the predicted peak device memory is {format_bytes(peak)} ({peak} bytes)")
    reason = (f"{figures}, {format_bytes(peak - given)} over the device budget of "
              f"{format_bytes(given)} ({given} bytes)")
  else:
    reason = (f"it does not fit the device budget of {format_bytes(given)} ({given} bytes): "
              + "; ".join(plan.verdicts))
  largest = _largest([l for l in plan.leaves if l.memory_kind == "device"], lambda l: l.nbytes)
  binding = plan.binding_violation()
  host_note = "" if binding is None else (
      f" But the host limit binds first: moving every leaf it may move to the host would pin "
      f"{format_bytes(binding.need_bytes)}, over the host limit of "
      f"{format_bytes(binding.limit_bytes)} (the smaller of host_budget and what the host can "
      f"pin; on a GPU {POOL_SETTING} raises XLA's pinned pool, if the host has the memory).")
  tried = plan.escalation
  error = AdmissionError(
      f"jaxtier: plan refused before allocating anything: {reason}. "
      + (f"{_capital(tried.tried_text())}. " if tried is not None else "")
      + (f"Largest device leaves: {largest}. " if largest else "")
      + "Fix: a larger device_budget"
      + (f" (at least {format_bytes(peak)})" if peak is not None and peak > given else "")
      + ("" if _tried_all_host(plan) else
         "; a policy that keeps more state in pinned_host (a {regex: placement} dict or a "
         "callable: 'host_stream' for a stack of layers' params, 'optimizer_state_on_host')")
      + "; fewer activations (a smaller batch or sequence, or rematerialise more: "
      "jax.checkpoint); or allow_over_budget=True to run the plan as it is." + host_note)
  error.reason = reason
  error.limit, error.need_bytes, error.limit_bytes = "device_budget", peak, given
  error.plan = plan
  raise error


def admit_host_memory(plan: Plan, available: "int | None", resident_bytes: int = 0) -> None:
  """Refuses `plan` before anything is allocated where, on the CPU backend, it needs more of this
  host's RAM than is available: there device and pinned_host memory are both that RAM, so the
  step needs its peak device memory (the compiled step's, else the prediction) and its pinned
  bytes, less the state's arrays that already exist.

  Raises:
    AdmissionError: the need over `available` (MemAvailable, bytes), with the sizes and the fix.
  """
  peak = plan.compiler_peak_hbm_bytes or plan.predicted_peak_hbm_bytes
  if plan.platform != "cpu" or available is None or peak is None:
    return
  pinned = plan.pinned_need_bytes
  need = peak + pinned - resident_bytes
  if need <= available:
    return
  reason = (f"on the CPU backend device and pinned_host memory are this host's RAM, and the "
            f"step needs {format_bytes(need)} ({need} bytes) of it (peak "
            f"{format_bytes(peak)} and pinned {format_bytes(pinned)}"
            + (f", less the state's {format_bytes(resident_bytes)} already allocated"
               if resident_bytes else "")
            + f"), over the {format_bytes(available)} available")
  error = AdmissionError(
      f"jaxtier: plan refused before allocating anything: {reason}. Fix: a smaller batch, "
      "sequence or model; or plan for a GPU (platform='gpu' in jaxtier.plan, --platform=gpu "
      "in python -m jaxtier plan).")
  error.reason = reason
  error.limit, error.need_bytes, error.limit_bytes = "host_memory", need, available
  error.plan = plan
  raise error


def _tried_all_host(plan: Plan) -> bool:
  """Whether 'auto' escalated `plan` as far as the layers' params streamed, its optimizer
  state on the host, or found that no leaf may be streamed (`Plan.escalation`): a policy
  keeping more state there is no fix then."""
  return plan.escalation is not None and any(a.name == "stream" for a in plan.escalation.tried)


def _capital(text: str) -> str:
  """`text` with its first letter in upper case (a sentence made from a clause)."""
  return text[:1].upper() + text[1:]


def _largest(leaves: list[LeafPlan], key: Callable[[LeafPlan], int], k: int = 5) -> str:
  top = sorted(leaves, key=key, reverse=True)[:k]
  return "; ".join(f"{leaf.path} {format_bytes(key(leaf))}" for leaf in top if key(leaf))


def _prefix_regex(leaves: list[LeafPlan]) -> str:
  """A policy regex matching the first path component of the largest of `leaves`."""
  top = max(leaves, key=lambda l: l.nbytes).path
  m = re.match(r"(\[[^\]]*\]|\.[A-Za-z_]\w*)", top)
  return "^" + re.escape(m.group(1) if m else top)


def admit(plan: Plan, pinnable_bytes: "int | None", pinnable_what: str = HERE_PINNABLE) -> None:
  """Refuses `plan`, as planned (before its step is compiled), where its state needs more than
  may be held: the pinned host bytes (`plan.pinned_bytes`, masters included) against the host
  budget and what the host can pin, `pinnable_bytes` (from `pinnable_what`); the state's device
  bytes against the device budget asked for (`DeviceBudget.asked`).

  Raises:
    AdmissionError: pinned bytes over the host budget or over `pinnable_bytes`; `limit`
      'host_limit', `plan` the plan.
    PlanError: the state's device bytes over the device budget; `plan` the plan.
  """
  try:
    _admit_pinned(plan, pinnable_bytes, pinnable_what)
    _admit_device_state(plan)
  except PlanError as e:
    e.plan = plan
    raise


def admit_compiled(plan: Plan, pinnable_bytes: "int | None", *,
                   allocator_limit: "int | None", available: "int | None",
                   resident_bytes: int = 0, num_local_devices: int = 1) -> None:
  """Refuses `plan`, once its step is compiled and before anything is allocated, where the
  compiled step needs more than may be held (`admit` checked its state before compiling): its
  peak device memory against JAX's allocator (`admit_device`), the CPU backend's RAM
  (`admit_host_memory`), and the pinned bytes it allocates beyond the state
  (`compiler_host_extra_bytes`) with the state's against the host's limits.

  Args:
    plan: the plan, with the compiled step's figures where it was compiled.
    pinnable_bytes: what this host can pin per device (None: not checked).
    allocator_limit: `memory_stats()['bytes_limit']` of this GPU (None: no GPU here).
    available: this host's available RAM, where the CPU backend holds the step (else None).
    resident_bytes: bytes of the state already allocated in that RAM.
    num_local_devices: the devices of this host, which share its pinned memory: where XLA's
      pinned pool is the limit and the host has the memory, the refusal names the pool size
      that fits and carries it in `AdmissionError.settings` (`host.pinned_pool_that_fits`).

  Raises:
    AdmissionError: the limit missed in `limit`, the plan in `plan`.
  """
  admit_device(plan, allocator_limit)
  admit_host_memory(plan, available, resident_bytes)
  if plan.compiler_host_extra_bytes:
    try:
      _admit_pinned(plan, pinnable_bytes, HERE_PINNABLE, num_local_devices)
    except PlanError as e:
      e.plan = plan
      raise


def _admit_pinned(plan: Plan, pinnable_bytes: "int | None", pinnable_what: str,
                  num_local_devices: int = 1) -> None:
  """Refuses pinned host bytes (the state's and, once compiled, what the compiled step
  allocates beyond them) over the host budget or `pinnable_bytes`."""
  extra = plan.pinned_need_bytes - plan.pinned_bytes
  need = plan.pinned_need_bytes
  host = [l for l in plan.leaves if l.memory_kind == "pinned_host" or l.master_nbytes]
  host_bytes = lambda l: (l.nbytes if l.memory_kind == "pinned_host" else 0) + l.master_nbytes
  for pool, limit, what, fix in (
      (False, plan.host_budget, "the host budget", "raise host_budget, or keep more leaves on "
       "the device (policy)"),
      (True, pinnable_bytes, pinnable_what, "free host "
       "memory, keep more leaves on the device (policy), or shard replicated host leaves over "
       "the mesh" + ("; on a GPU, XLA's pinned pool is capped by "
                     f"{POOL_SETTING} (64 by default): raise it "
                     f"(to {math.ceil(need / 2**30)} or more, set before JAX starts) "
                     "if the host has the memory" if plan.platform == "gpu" else ""))):
    if limit is not None and need > limit:
      settings = {}
      if pool and plan.platform == "gpu" and pinnable_what == HERE_PINNABLE:
        gib = host_lib.pinned_pool_that_fits(need, num_local_devices)
        if gib is not None:
          settings = pool_settings(gib)
          fix = (f"XLA's pinned pool is the limit and this host has the memory: set "
                 f"{POOL_SETTING}={gib} before JAX starts (python -m "
                 f"jaxtier train does), or keep more leaves on the device (policy)")
      compiled = "" if not extra else (
          f" (the state's {format_bytes(plan.pinned_bytes)} and {format_bytes(extra)} that the "
          "compiled step allocates beyond it: its programs' pinned_host outputs not aliased to "
          "an input, their host temporaries, the streamed leaves' gradient buffers and the "
          "spare buffers of a clipped step's guessed updates)")
      reason = (f"it needs {format_bytes(need)} ({need} bytes) of pinned host memory per "
                f"device{compiled}, over {what} of {format_bytes(limit)} ({limit} bytes)")
      error = AdmissionError(
          f"jaxtier: plan refused before allocating anything: {reason}. Largest host leaves: "
          f"{_largest(host, host_bytes)}. Fix: {fix}.")
      error.reason = reason
      error.settings = settings
      error.limit, error.need_bytes, error.limit_bytes = "host_limit", need, limit
      raise error


def _admit_device_state(plan: Plan) -> None:
  """Refuses a state whose device bytes alone are over the device budget asked for."""
  given = plan.device_budget.asked
  if given is not None and plan.device_bytes > given:
    dev = [l for l in plan.leaves if l.memory_kind == "device"]
    # Where offloading more would pin more than the host may, the notes say so: the binding
    # limit is then the host's, and a policy alone cannot help.
    binding = plan.binding_violation()
    host_note = None if binding is None else (
        f"moving every leaf it may move to the host would pin {format_bytes(binding.need_bytes)}"
        f", over the host limit of {format_bytes(binding.limit_bytes)}")
    reason = (f"the state needs {format_bytes(plan.device_bytes)} ({plan.device_bytes} bytes) "
              f"of device memory after offloading, over the device budget of "
              f"{format_bytes(given)} ({given} bytes)")
    error = PlanError(
        f"jaxtier: {reason}. Largest device "
        f"leaves: {_largest(dev, lambda l: l.nbytes)}. Fix: raise device_budget, or place "
        f"more leaves on the host with a policy (e.g. policy={{{_prefix_regex(dev)!r}: "
        "'host_xla'})." + ("" if host_note is None else
                          f" But the host limit binds first: {host_note} (the smaller of "
                          "host_budget and what the host can pin; on a GPU "
                          f"{POOL_SETTING} raises XLA's pinned pool, if the "
                          "host has the memory)"))
    error.reason = reason
    raise error
