"""The Plan: the contract between planning and lowering (a placement per leaf, its verdicts)."""

from __future__ import annotations

import dataclasses
import json

from jaxtier._src.units import format_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafPlan:
  """Where one leaf lives and why.

  Attributes:
    path: pytree path of the leaf in the state.
    shape, dtype, nbytes: the leaf (bytes per device).
    role: `param`, `optimizer_state` or `other`.
    placement: one of tuple(Placement).
    memory_kind: 'device' or 'pinned_host'.
    master_nbytes: bytes of the fp32 master copy in pinned_host (0 when none).
    reason: why this placement.
    user_placed: whether the user's policy asked for this placement (the solver does not move
      a leaf the user placed).
  """

  index: int
  path: str
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  role: str
  placement: str
  memory_kind: str
  master_nbytes: int
  reason: str
  user_placed: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetViolation:
  """A limit the plan misses: what it needs against what the limit allows, bytes per device.

  Attributes:
    limit: which limit: 'device_budget' (peak device memory), 'host_limit' (pinned bytes:
      the smaller of host_budget and what the host can pin), 'host_memory' (the CPU backend's
      RAM, which holds device and pinned_host memory alike), 'device_memory' (peak device
      memory, where the device budget given is above what JAX's allocator may use, less 5%:
      the plan is made against that instead).
    need_bytes: what the plan needs of it.
    limit_bytes: what the limit allows.
    binding: the limit that decides the plan: a host limit that binds before the device budget
      (moving every movable leaf to the host would pin more than it allows), so that a policy
      alone cannot make the plan fit.
  """

  limit: str
  need_bytes: int
  limit_bytes: int
  binding: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finding:
  """A limit the plan's prediction misses: one sentence for people, the limits for tools.

  Attributes:
    sentence: what misses which limit by how much (printed after "DOES NOT FIT: ").
    violations: the limits missed (none where the search found no plan within the budgets
      but no single limit is over).
  """

  sentence: str
  violations: tuple[BudgetViolation, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
  """Whether a plan fits its budgets. Made by `admission.judge` alone, from the planner's
  findings, the device budget and, once the step is compiled, its peak.

  Attributes:
    findings: what the planner's prediction misses, against the budget planned for.
    fits: False where a finding stands, or where the compiled step's peak is over the device
      budget given (`jaxtier.offload` refuses a plan that does not fit the device budget
      given, unless `allow_over_budget=True`).
    violations: the limits missed by the findings that stand, and the device budget given
      where only the compiled step's peak misses it.
    verdicts: one sentence per finding that stands (and for such a compiled peak), for people.
    overruled: notes on the findings that do not stand: the compiled step's peak fits the
      budget the prediction missed, or the plan was made against a re-plan budget (then the
      compiled step judges it, against the budget given).
  """

  findings: tuple[Finding, ...] = ()
  fits: bool = True
  violations: tuple[BudgetViolation, ...] = ()
  verdicts: tuple[str, ...] = ()
  overruled: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceBudget:
  """The device budget: the bytes per device the user gave, and those the plan is made against.

  One value from `jaxtier.offload(device_budget=)` to the solver (`Problem.device_budget` is
  its `usable`). The two figures differ where the budget is set for the user
  (`admission.plan_device_budget`): none given on a GPU, a budget above what JAX's allocator
  may use on an absent GPU, or a re-plan after the compiled step's peak came out over it.

  Attributes:
    given: what the user gave, bytes per device (None: none).
    usable: what the plan is made against, bytes per device (None: no limit).
    source: why `usable` is what it is: 'given' (the user's), 'none' (no limit: none given
      and none needed, on the CPU backend), 'default' (none given: what JAX's allocator may
      use on the GPU, less a margin), 'capped' (the given one is above what JAX's allocator
      may use on an absent GPU: that, less a margin), 're-plan' (smaller than the one given,
      by what the compiled step's peak was over it).
  """

  given: "int | None" = None
  usable: "int | None" = None
  source: str = "none"

  @classmethod
  def of(cls, given: "int | DeviceBudget | None") -> "DeviceBudget":
    """The budget the user gave, `given` bytes per device (None: none), as asked for."""
    if isinstance(given, DeviceBudget):
      return given
    return cls(given=given, usable=given, source="none" if given is None else "given")

  @property
  def asked(self) -> "int | None":
    """The budget the planner is asked to meet, bytes: a re-plan's, else the one given."""
    return self.usable if self.source == "re-plan" else self.given

  def replanned(self, usable: int) -> "DeviceBudget":
    """This budget re-planned against `usable` bytes (`usable` below the compiled peak)."""
    return DeviceBudget(given=self.given, usable=usable, source="re-plan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attempt:
  """One plan `auto` tried once its own plan's compiled step was over the device limit.

  Attributes:
    name: which plan: 'auto' (the solver's), 'optimizer_state_on_host' (every optimizer-state
      leaf in pinned_host, as that policy places it), 'stream' (the layer stacks' params
      `host_stream`, their optimizer state on the host, the rest placed by 'auto'), or
      'auto re-planned' (the solver against the budget less what its first compiled step was
      over).
    compiler_peak_hbm_bytes: its compiled step's peak device memory, bytes per device (None:
      not compiled, `why` says why).
    why: why it was not compiled or not kept where its peak does not say ('' otherwise): a
      refusal before compiling, 'stream' not planned because no leaf may be streamed (and
      why), or the pinned host memory it needs over the host's limit.
  """

  name: str
  compiler_peak_hbm_bytes: "int | None" = None
  why: str = ""

  def describe(self) -> str:
    """'<name> <peak>' ('<name>: <why>' where not compiled)."""
    if self.compiler_peak_hbm_bytes is None:
      return f"{self.name}: {self.why}"
    return (f"{self.name} {format_bytes(self.compiler_peak_hbm_bytes)}"
            + (f" ({self.why})" if self.why else ""))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Escalation:
  """How 'auto' searched for a plan whose compiled step fits, once its own plan's compiled
  peak was over the device limit (`pipeline`'s escalation: every optimizer-state leaf on the
  host, then the layer stacks' params streamed too).

  Attributes:
    limit_bytes: the device limit the compiled peaks were held to, bytes per device: the
      device budget planned against, or what JAX's allocator holds on this GPU less
      `admission.DEVICE_MARGIN` where that is less.
    tried: the plans tried, in order (`Attempt`), the first being auto's own.
    kept: the `Attempt.name` of the plan kept: the first whose compiled peak fits (or, after
      'optimizer_state_on_host' fit, 'auto re-planned' where its compiled peak fits too);
      where none fits, the one with the lowest compiled peak.
    fits: whether the kept plan's compiled peak is within `limit_bytes`.
  """

  limit_bytes: int
  tried: tuple[Attempt, ...]
  kept: str
  fits: bool

  def tried_text(self) -> str:
    """The plans tried with their compiled peaks, and the limit, in one sentence."""
    return (f"the plans tried under auto, by their compiled step's peak device memory against "
            f"the limit of {format_bytes(self.limit_bytes)}: "
            + "; ".join(a.describe() for a in self.tried))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanningCost:
  """What planning a step took (`pipeline.plan_step`): wall seconds in all and per phase,
  and the backend compiles among them.

  Attributes:
    secs: wall seconds from tracing the step to the plan kept (its programs compiled).
    phases: (phase, wall seconds) in the order they first ran: 'trace' (the step traced and
      analysed: `analysis.inventory`), 'step costs' (the device-only step's costs, compiled
      where the solver plans, unless an earlier process left its figures in
      `analysis/figures_cache.py`), 'plan' (the solver and admission), 'lower' (the plan's programs
      built), 'verify' (the planned programs lowered and compiled, their compiled peak read),
      'refine' and 'escalate' (more plans compiled: `pipeline._refine`, `_escalated`).
    compiles: backend (XLA) compiles during planning; the step's first call reuses the
      compiled programs of the plan kept.
    compile_secs: their seconds (JAX's backend-compile events), part of `secs`.
  """

  secs: float
  phases: tuple[tuple[str, float], ...]
  compiles: int
  compile_secs: float

  def slowest(self) -> str:
    """The phase that took the most time ('' where none ran)."""
    return max(self.phases, key=lambda p: p[1])[0] if self.phases else ""

  def describe(self) -> str:
    """'<secs> s (trace 0.70 s, ..., verify 3.10 s); <n> backend compiles (<s> s)', the phases
    under 5 ms left out."""
    phases = ", ".join(f"{name} {secs:.2f} s" for name, secs in self.phases if secs >= 0.005)
    return (f"{self.secs:.2f} s ({phases}); {self.compiles} backend compile"
            f"{'' if self.compiles == 1 else 's'} ({self.compile_secs:.2f} s)")

  def record(self) -> dict:
    """The figures as a JSON-ready dict."""
    return {"secs": self.secs, "phases": dict(self.phases), "compiles": self.compiles,
            "compile_secs": self.compile_secs}


@dataclasses.dataclass(frozen=True)
class Speculation:
  """How a plan's guarded updates run: layered on guessed late predicates (the clip does not
  bind, the gradients are finite), the guessed writes kept in spare buffers until the real
  predicates are known; the serial schedule where the guess was wrong.

  A step whose guess holds takes `speculative_step_secs`; one whose guess fails takes that and
  `serial_step_secs` more (its speculative compute, then the serial schedule); with no guess it
  takes `serial_step_secs`. Guessing pays while the share of recent steps it misses is under
  `max_miss` = (serial - speculative) / serial: the break-even (`runtime/runner.Guesser`).

  Attributes:
    components: the guarded components (indices into `Plan.components`).
    spare_pinned_bytes: the spare buffers in pinned_host (a copy of every host leaf and fp32
      master the guarded and other layered updates write), bytes per device.
    spare_device_bytes: the spare buffers on the device (the device leaves they write), and
      the device leaves the speculative compute reads without donating, bytes per device.
    speculative_step_secs: the predicted step, guess right (`Plan.predicted_step_secs`).
    serial_step_secs: the predicted step of the serial schedule.
    max_miss: the break-even share of wrong guesses (above).
    enabled: whether the step speculates: False where the spares do not fit the host
      budget or what the host can pin (`why` says which).
    why: why it does not speculate ('' where it does).
    waiting: guarded components that wait for the late predicates instead (serial, after the
      backward pass) because their spares do not fit beside the others'
      (`update_schedule.Why.NO_ROOM_FOR_SPARES`); () where every one guesses.
    all_spare_pinned_bytes: the pinned_host spares were every guarded update to guess (as
      `spare_pinned_bytes` where none waits), bytes per device.
  """

  components: tuple[int, ...]
  spare_pinned_bytes: int
  spare_device_bytes: int
  speculative_step_secs: "float | None"
  serial_step_secs: "float | None"
  max_miss: float
  enabled: bool = True
  why: str = ""
  waiting: tuple[int, ...] = ()
  all_spare_pinned_bytes: int = 0

  def mean_step_secs(self, held: int, missed: int, serial: int) -> "float | None":
    """The predicted mean step (seconds) over `held` steps whose guess held, `missed` whose
    guess missed and `serial` run with no guess (`OffloadedStep.guesses`); None where a
    prediction is missing or there are no steps."""
    spec, ser = self.speculative_step_secs, self.serial_step_secs
    if spec is None or ser is None or not held + missed + serial:
      return None
    return (held * spec + missed * (spec + ser) + serial * ser) / (held + missed + serial)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The placement of every state leaf, with its byte totals (all per device).

  Attributes:
    leaves: one `LeafPlan` per state leaf.
    platform: 'cpu' or 'gpu'.
    device_bytes: state bytes held in device memory (HBM).
    pinned_bytes: state bytes held in pinned host memory, masters included.
    device_budget: the device budget given and the one planned against (`DeviceBudget`).
    host_budget: the host budget given (None: no limit), bytes.
    num_host_updates: fused host updates per step (`components`); one with results in both
      memory kinds runs as two custom calls (`op_program_compiler.calls_of`).
    predicted_step_secs: the cost model's step time, seconds (None: not predicted).
    critical_path: the resource that bounds most of the step ('compute', 'link_h2d',
      'link_d2h', 'dha', 'host_cpu', 'host_dram').
    predicted_peak_hbm_bytes: predicted peak device memory per device: device state +
      transient buffers (gradients, activations, workspace) + stream buffers, bytes.
    resource_secs: busy seconds per step of each resource ('compute', 'link_h2d',
      'link_d2h', 'dha', 'host_cpu').
    segments: the step's serial phases: (name, seconds, bounding resource).
    activation_policy: the activation policy the prediction assumes.
    assumed_checkpoint_policy: the `jax.checkpoint_policies` name of that policy where it is
      not the traced step's (the model must apply it for the prediction to hold), else None.
    notes: where the figures come from (profile, transient bytes), and warnings.
    compiler_peak_hbm_bytes: the compiled step's peak device memory from its
      `memory_analysis()` (set after compiling; None before, or where the backend reports none).
    compiler_host_extra_bytes: pinned host bytes the compiled step needs beyond the state,
      per device: its compute and update programs' host outputs not aliased and host
      temporaries (`MemoryFigures.host_extra_bytes`), and the streamed leaves' gradient buffers;
      admission counts them with `pinned_bytes` (None before compiling).
    measured_step_secs: the median wall time of the offloaded step's calls 2 to
      1 + MEASURED_STEPS, seconds, each synchronised (set once measured; None before).
    verdict: whether it fits its budgets (`Verdict`; `fits`, `violations` and `verdicts`
      read it).
    num_planning_notes: how many of `notes` the planner wrote (the verdicts print after
      them, before the notes that verifying and refining added).
    components: the fused host updates the lowering runs, one compiled op program each
      (`op_program_compiler.CompiledComponent`); not part of the plan's JSON.
    schedule: when each of them runs, one `update_schedule.UpdateSchedule` per component
      (serial, layered inside the backward pass, or row by row; why where serial): what the
      planner costed and what the lowering builds; not part of the plan's JSON.
    rates_of: whose rates the predictions use, where not this machine's ('' when they are:
      a calibrated profile, or a GPU planned on a machine without one, for which the built-in
      profile (the default H200's, or that of the card named) is the GPU planned for).
    pinnable_bytes, pinnable_what: what the host can pin per device (None: not checked), and
      where that figure comes from (on a GPU: XLA's pinned pool caps it).
    hardware_kind: the `device_kind` of the hardware profile the predictions use ('NVIDIA H200'
      for the default profile, 'NVIDIA H100 80GB HBM3' for the H100's built-in one; the notes
      give its `source`); '' where not recorded.
    speculation: how the guarded updates (a clipped or guarded step's, speculating on late
      predicates: `analysis/update_schedule.py`) run, or None where there are none.
    escalation: under 'auto', the plans tried once its own plan's compiled step was over the
      device limit and the one kept (`Escalation`); None where it was not over.
    tail_peak_hbm_bytes: the device memory the metrics computed after the update
      (`inventory.MetricTail`) hold while they run, bytes per device: the device state, and
      the new values of the pinned_host leaves they read, which their program copies to the
      device whole (`rewrite.TailProgram`). None where the step has no such metrics. Both peaks
      above are at least this figure.
    planning: what planning it took (`PlanningCost`: seconds per phase, backend compiles);
      None for a plan not made by `offload` (`jaxtier.plan` compiles nothing of it).
    compiled_from_cache: `compiler_peak_hbm_bytes` was read from the figures an earlier
      process recorded for the same compute program (`analysis/figures_cache.py`), which is
      not compiled here: a plan 'auto' tried and dropped, its peak over the device limit.
  """

  leaves: tuple[LeafPlan, ...]
  platform: str
  device_bytes: int
  pinned_bytes: int
  device_budget: DeviceBudget
  host_budget: "int | None"
  num_host_updates: int
  predicted_step_secs: "float | None" = None
  critical_path: str = ""
  predicted_peak_hbm_bytes: "int | None" = None
  resource_secs: dict = dataclasses.field(default_factory=dict)
  segments: tuple = ()
  activation_policy: str = "as traced (not modelled)"
  assumed_checkpoint_policy: "str | None" = None
  notes: tuple[str, ...] = ()
  compiler_peak_hbm_bytes: "int | None" = None
  compiler_host_extra_bytes: "int | None" = None
  measured_step_secs: "float | None" = None
  verdict: Verdict = Verdict()
  num_planning_notes: "int | None" = None
  components: tuple = dataclasses.field(default=(), repr=False, compare=False)
  schedule: tuple = dataclasses.field(default=(), repr=False, compare=False)
  rates_of: str = ""
  pinnable_bytes: "int | None" = None
  pinnable_what: str = ""
  hardware_kind: str = ""
  speculation: "Speculation | None" = None
  escalation: "Escalation | None" = None
  tail_peak_hbm_bytes: "int | None" = None
  planning: "PlanningCost | None" = dataclasses.field(default=None, compare=False)
  compiled_from_cache: bool = dataclasses.field(default=False, compare=False)

  @property
  def pinned_need_bytes(self) -> int:
    """Pinned host bytes the step holds, per device: the state's (`pinned_bytes`), what its
    compiled programs allocate beyond it, and the spare buffers of a speculating step."""
    spares = (self.speculation.spare_pinned_bytes
              if self.speculation is not None and self.speculation.enabled else 0)
    return self.pinned_bytes + (self.compiler_host_extra_bytes or 0) + spares

  @property
  def fits(self) -> bool:
    """False when the plan misses a budget (`violations` says which, `verdicts` says so for
    people). `jaxtier.offload` refuses such a plan where a device budget was given, unless
    `allow_over_budget=True`; then, and where none was given, the step runs as planned."""
    return self.verdict.fits

  @property
  def violations(self) -> tuple[BudgetViolation, ...]:
    """The limits the plan misses."""
    return self.verdict.violations

  @property
  def verdicts(self) -> tuple[str, ...]:
    """Why the plan does not fit, one sentence per finding, for people."""
    return self.verdict.verdicts

  def binding_violation(self) -> "BudgetViolation | None":
    """The violation of a limit that binds before the device budget, if any."""
    return next((v for v in self.violations if v.binding), None)

  def bytes_by_memory_kind(self) -> dict[str, int]:
    """{'device': bytes, 'pinned_host': bytes} of the state, masters included."""
    return {"device": self.device_bytes, "pinned_host": self.pinned_bytes}

  def placements(self) -> dict[str, str]:
    """{leaf path: placement}."""
    return {leaf.path: leaf.placement for leaf in self.leaves}

  def to_json(self) -> str:
    """The plan as JSON: its fields (not `components` nor `schedule`), the device budget as two
    figures (`device_budget`, the one given; `planned_device_budget`, the one planned
    against), the verdict as three (`fits`, `violations`, `verdicts`)."""
    fields = {}
    for f in dataclasses.fields(self):
      if f.name in ("components", "schedule"):
        continue
      if f.name == "device_budget":
        fields["device_budget"] = self.device_budget.given
      elif f.name == "verdict":
        fields.update(fits=self.fits, violations=self.violations, verdicts=self.verdicts)
      else:
        fields[f.name] = getattr(self, f.name)
      if f.name == "assumed_checkpoint_policy":
        fields["planned_device_budget"] = self.device_budget.usable
    return json.dumps({k: _plain(v) for k, v in fields.items()}, indent=1)

  def __str__(self) -> str:
    return self.summary()

  def summary(self, width: "int | None" = None, more: str = "plan.table()") -> str:
    """The plan in at most 20 lines (what `print(plan)` shows): state bytes per placement and
    role, the memory kinds against their limits, the predicted step and peak, the verdict and
    the findings that change what to do (a verdict, a re-plan, rates that are not this
    machine's).

    Args:
      width: columns (None: the terminal's: COLUMNS, else the terminal, else 80). No line is
        longer.
      more: where the per-leaf table and every note are, for the last line.
    """
    from jaxtier._src.planning import plan_text  # pylint: disable=g-import-not-at-top
    return plan_text.summary(self, width, more)

  def one_line(self) -> str:
    """The plan in one line (for a log): fits or not, the state's bytes per memory kind and
    the roles in pinned_host, the peak device memory (compiled, else predicted) against the
    budget planned for, and the predicted step time."""
    from jaxtier._src.planning import plan_text  # pylint: disable=g-import-not-at-top
    return plan_text.one_line(self)

  def table(self, width: "int | None" = None, reasons: bool = True) -> str:
    """Every leaf, one line each (path, `dtype[shape]`, bytes, role, placement; with `reasons`
    why, indented under it), then the predictions and every note.

    Args:
      width: columns (None: the terminal's: COLUMNS, else the terminal, else 80). No line is
        longer: a long leaf path is shortened in the middle (`…`), never broken across lines.
      reasons: include each leaf's reason.
    """
    from jaxtier._src.planning import plan_text  # pylint: disable=g-import-not-at-top
    return plan_text.table(self, width, reasons)

  def format(self, width: "int | None" = None, reasons: bool = True) -> str:
    """`table(width, reasons)`."""
    return self.table(width, reasons)

  def _host_limit(self) -> str:
    """' of <limit>' for the pinned bytes: the host budget, or what the host (on a GPU: XLA's
    pinned pool) can pin where that is less, named."""
    pinnable = self.pinnable_bytes
    if pinnable is None or (self.host_budget is not None and self.host_budget <= pinnable):
      return _budget(self.host_budget)
    given = ("" if self.host_budget is None
             else f"; host_budget {format_bytes(self.host_budget)}")
    return f" of {format_bytes(pinnable)} pinnable ({self.pinnable_what}{given})"

  def prediction_lines(self) -> list[str]:
    """The predictions and notes, as printable lines."""
    lines = []
    if self.predicted_step_secs is not None:
      rates = "" if not self.rates_of else (
          f" ({self.rates_of}: `python -m jaxtier calibrate` measures this machine)")
      lines.append(f"predicted step: {self.predicted_step_secs * 1e3:.4g} ms{rates}, critical "
                   f"path: {self.critical_path}")
      lines.append("  phases: " + "; ".join(f"{name} {secs * 1e3:.4g} ms ({bound})"
                                           for name, secs, bound in self.segments))
      lines.append("  busy: " + ", ".join(f"{k} {v * 1e3:.4g} ms"
                                          for k, v in self.resource_secs.items() if v))
    if self.measured_step_secs is not None:
      ratio = ("" if not self.predicted_step_secs else
               f" (predicted / measured {self.predicted_step_secs / self.measured_step_secs:.2f})")
      lines.append(f"measured step: {self.measured_step_secs * 1e3:.4g} ms{ratio}")
    if self.predicted_peak_hbm_bytes is not None:
      budget = self.device_budget.usable
      memory = "HBM" if self.platform == "gpu" else "device memory"  # what it is here
      # Without a compiled device-only step (a fixed policy) the prediction has no activations.
      partial = any(n.startswith("transient device bytes") and "the gradients only" in n
                    for n in self.notes)
      lines.append(f"predicted peak {memory}: {format_bytes(self.predicted_peak_hbm_bytes)} "
                   "per device"
                   f"{' (state and gradients only: no activations)' if partial else ''}"
                   f"{'' if budget is None else f' of {format_bytes(budget)} planned'}"
                   + ("" if self.compiler_peak_hbm_bytes is None else
                      f"; compiler: {format_bytes(self.compiler_peak_hbm_bytes)}"))
    lines.append(f"pinned host: {format_bytes(self.pinned_bytes)} per device"
                 f"{self._host_limit()}")
    lines.append(f"activations: {self.activation_policy}")
    k = len(self.notes) if self.num_planning_notes is None else self.num_planning_notes
    lines.extend(f"note: {n}" for n in self.notes[:k])
    lines.extend(f"note: {v}" for v in verdict_lines(self.verdicts))
    lines.extend(f"note: {n}" for n in self.notes[k:])
    return lines


def verdict_lines(verdicts: "tuple[str, ...] | list[str]") -> list[str]:
  """The verdicts as the plan prints and logs them."""
  return [f"DOES NOT FIT: {v}" for v in verdicts]


def _plain(value):
  if dataclasses.is_dataclass(value):
    return dataclasses.asdict(value)
  if isinstance(value, (tuple, list)):
    return [_plain(v) for v in value]
  return value


def _budget(b: "int | None") -> str:
  return "" if b is None else f" of {format_bytes(b)}"
