"""`jaxtier.offload` and `jaxtier.plan`: the public entry points (re-exported by `jaxtier`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from jaxtier._src import cost_model
from jaxtier._src import inventory as inv_lib
from jaxtier._src import jax_compat as jc
from jaxtier._src import lowering
from jaxtier._src import planner
from jaxtier._src import profile
from jaxtier._src import streaming

log = logging.getLogger("jaxtier")


class _Missing:
  def __repr__(self):
    return "MISSING"


MISSING: Any = _Missing()
# Re-plans after the compiled step's peak device memory came out over the budget.
MAX_REPLANS = 2
# A verified plan whose compiled peak is more than this fraction of its device budget below
# its predicted peak is refined (`OffloadedStep._refine`).
REFINE_MIN_OVERESTIMATE = 0.02
# The shares of the measured overestimate credited, tried in turn until a refined plan's
# compiled peak is within the budget (each try compiles the step once more).
REFINE_CREDIT_SHARES = (1.0, 0.5)
# Calls 2 .. 1 + MEASURED_STEPS of an offloaded step are timed (synchronised) and reported
# against the plan's prediction (`Plan.measured_step_secs`).
MEASURED_STEPS = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadOptions:
  """Options of `jaxtier.offload` (validated when made).

  Attributes:
    device_budget: device memory the step may use at its peak (state, gradients, activations),
      bytes per device (int, or a string such as '80GB'/'16GiB'); None: no limit (on a GPU,
      the planner then plans against what the device has).
    host_budget: pinned host memory the plan may pin, bytes per device; None: no limit beyond
      what the host can pin.
    policy: 'auto', 'none', a callable `(path, LeafInfo) -> placement | None`, or a
      `{regex: placement}` dict over leaf paths.
    donate_argnums: must include 0 (the state is updated in place).
  """

  device_budget: "int | None" = None
  host_budget: "int | None" = None
  policy: Any = "auto"
  donate_argnums: tuple[int, ...] = (0,)

  def __post_init__(self):
    object.__setattr__(self, "device_budget",
                       planner.parse_bytes(self.device_budget, "jaxtier.offload: device_budget"))
    object.__setattr__(self, "host_budget",
                       planner.parse_bytes(self.host_budget, "jaxtier.offload: host_budget"))
    donate = tuple(self.donate_argnums) if isinstance(self.donate_argnums, (tuple, list)) else (
        self.donate_argnums,)
    if 0 not in donate:
      raise ValueError("jaxtier.offload: expected donate_argnums to include 0, got "
                       f"{self.donate_argnums!r}; host-resident leaves are updated in place, "
                       "which consumes the state passed in (use the returned state)")
    object.__setattr__(self, "donate_argnums", donate)
    planner.check_policy_form(self.policy, "jaxtier.offload")


class OffloadedStep:
  """A train step whose state lives across device and pinned host memory, per its plan.

  Call it like the wrapped step: `state, metrics = step(state, batch)`. The state passed in is
  donated (consumed); use the returned one.

  Attributes:
    plan: the `Plan` (None until the first `place` or call).
  """

  def __init__(self, fn: Callable[..., Any], options: OffloadOptions):
    self._fn = fn
    self._options = options
    self.plan: "planner.Plan | None" = None
    self._calls, self._step_times = 0, []
    self._compiled: list[Any] = []
    self._inventory: "inv_lib.Inventory | None" = None
    self._split: "lowering.SplitStep | None" = None
    self._compute = self._make_update = self._update = None
    self._masters: list[jax.Array] = []
    self._stream = streaming.EMPTY
    self._scratch: list[jax.Array] = []
    self._scratch_sh: list[Any] = []
    self._master_sources: tuple[Any, ...] = ()
    self._signature = None
    functools.update_wrapper(self, fn)

  # -- planning ----------------------------------------------------------------------------
  def _ensure_plan(self, state: Any, args: Sequence[Any]) -> None:
    sig = _signature(state, args)
    if self.plan is not None and sig == self._signature:
      return
    changes = "" if self.plan is None else _changes(self._signature, sig, state, args)
    if changes:
      log.warning("jaxtier: the step's inputs changed since they were planned (%s): re-tracing "
                  "and re-planning, as jax.jit re-traces", changes)
    try:
      inv = inv_lib.take_inventory(self._fn, state, args)
    except Exception as e:
      if changes and hasattr(e, "add_note"):
        e.add_note(f"jaxtier: the step was traced again because its inputs changed since they "
                   f"were planned: {changes}")
      raise
    platform = jc.platform_of(jax.tree_util.tree_leaves(state)[0]) if jax.tree_util.tree_leaves(
        state) else jax.default_backend()
    hardware = profile.load(platform=platform)
    blocked = _stream_blocked(state)
    streamable = set() if blocked else _streamable(inv)
    costs = _step_costs(inv, state, args, platform, self._options.policy)
    budget = self._options.device_budget
    # The same for every (re-)plan of this trace.
    fixed = dict(platform=platform, policy=self._options.policy,
                 host_budget=self._options.host_budget,
                 pinnable_bytes=planner.pinnable_bytes(platform, _num_local_devices(state)),
                 hardware=hardware, streamable=streamable,
                 resident_bytes=_resident_bytes(state), stream_blocked=blocked)

    def make(step_costs):
      return planner.make_plan(inv, device_budget=budget, step_costs=step_costs, **fixed)

    previous = None
    for attempt in range(MAX_REPLANS + 1):
      try:
        plan, compiled = make(costs)
      except planner.PlanError as e:
        if previous is None:
          raise
        log.warning("jaxtier: re-planning against %s failed (%s); keeping the previous plan",
                    planner.format_bytes(budget), str(e).split(". ")[0])
        self._install(inv, *previous, sig, state, args)
        break
      if attempt:  # planned against a smaller budget than the user's: show theirs
        # The solver's verdict against that internal budget is not the plan's against the
        # user's (the compiled check below judges that): it stays a note, not DOES NOT FIT.
        internal = planner.format_bytes(budget)
        notes = tuple(f"against the re-plan budget of {internal}, not yours: "
                      f"{n.removeprefix('DOES NOT FIT: ')}" if n.startswith("DOES NOT FIT")
                      else n for n in plan.notes)
        plan = dataclasses.replace(plan, device_budget=self._options.device_budget, notes=(
            *notes, f"re-planned ({attempt}) against {internal}: the compiled step's peak was "
            "over the budget"))
      self._install(inv, plan, compiled, sig, state, args)
      smaller = self._verify(state, args, attempt)
      if smaller is None:
        break
      previous, budget = (self.plan, compiled), smaller
    self._refine(inv, sig, state, args, costs, make)
    log.debug("jaxtier plan:\n%s", self.plan)

  def _refine(self, inv: Any, sig: Any, state: Any, args: Sequence[Any],
              costs: "cost_model.StepCosts", replan: Callable[..., Any]) -> None:
    """Re-plans with what compiling the plan taught: the update temporaries it freed.

    The transient bytes come from the device-only step, whose peak holds the optimizer
    update's temporaries; a step whose updates run on the host does not. When the compiled
    peak of the installed plan is below its predicted peak by more than
    REFINE_MIN_OVERESTIMATE of the budget, the difference per byte of optimizer state on the
    host becomes `StepCosts.update_credit` and the solver runs again under the same budget.
    The new plan is kept only if it is predicted faster and its compiled peak is within the
    budget; if it is over, half the credit is tried (REFINE_CREDIT_SHARES); otherwise the
    verified plan stays.
    """
    plan, compiled = self.plan, self._compiled
    policy = self._options.policy
    if isinstance(policy, str) and policy in ("none", planner.OPTIMIZER_STATE_ON_HOST):
      return
    budget, peak = plan.planned_device_budget, plan.compiler_peak_hbm_bytes
    predicted = plan.predicted_peak_hbm_bytes
    if budget is None or peak is None or predicted is None or peak > budget:
      return
    over = predicted - peak
    moved = sum(l.nbytes for l in plan.leaves
                if l.role == inv_lib.OPTIMIZER_STATE and l.placement != planner.DEVICE)
    if over <= REFINE_MIN_OVERESTIMATE * budget or moved <= 0:
      return
    for share in REFINE_CREDIT_SHARES:
      credit = costs.update_credit + share * over / moved
      try:
        refined, refined_compiled = replan(dataclasses.replace(costs, update_credit=credit))
      except planner.PlanError as e:
        log.debug("jaxtier: refining the plan failed: %r", e)
        break
      if (refined.predicted_step_secs is None or plan.predicted_step_secs is None
          or refined.predicted_step_secs >= plan.predicted_step_secs * 0.99):
        break  # a smaller credit gives a plan nearer the first: not faster either
      refined = dataclasses.replace(refined, device_budget=plan.device_budget, notes=(
          *refined.notes, f"refined: the first plan's peak was predicted "
          f"{planner.format_bytes(predicted)} and compiled to {planner.format_bytes(peak)}; "
          f"the transient bytes are credited {credit:.3g} bytes per byte of optimizer state "
          f"updated on the host (its update's temporaries); the first plan predicted "
          f"{plan.predicted_step_secs * 1e3:.2f} ms per step"))
      self._install(inv, refined, refined_compiled, sig, state, args)
      self._verify(state, args, MAX_REPLANS, refining=True)
      new_peak = self.plan.compiler_peak_hbm_bytes
      if new_peak is not None and new_peak <= budget:
        log.info("jaxtier: plan refined with the compiled step's peak: predicted step %.2f ms "
                 "(was %.2f ms)", self.plan.predicted_step_secs * 1e3,
                 plan.predicted_step_secs * 1e3)
        return
      log.info("jaxtier: a refined plan's compiled peak (%s) is over the budget (%s)",
               "unknown" if new_peak is None else planner.format_bytes(new_peak),
               planner.format_bytes(budget))
    if self.plan is not plan:
      log.info("jaxtier: keeping the first plan")
      self._install(inv, plan, compiled, sig, state, args)

  def _install(self, inv: Any, plan: "planner.Plan", compiled: list[Any], sig: Any, state: Any,
               args: Sequence[Any]) -> None:
    self._inventory, self.plan, self._compiled, self._signature = inv, plan, compiled, sig
    self._calls, self._step_times = 0, []
    self._masters, self._master_sources = [], ()
    self._build(state, args)

  def _verify(self, state: Any, args: Sequence[Any], attempt: int,
              refining: bool = False) -> "int | None":
    """Compiles the planned step and compares the compiler's peak with the budget planned for.

    Records the compiler's figure in the plan. Returns a smaller device budget to re-plan with
    when the compiler's peak exceeds it and the solver may still move leaves (at most
    MAX_REPLANS times), else None (always None when `refining`: the caller decides).
    """
    plan = self.plan
    if plan.predicted_peak_hbm_bytes is None:
      return None
    leaves = jax.tree_util.tree_leaves(state)
    state_sh = self._shardings(state)
    # Shapes with the shardings the call will see (the state may not be placed yet: `place`
    # plans before it moves): then the first call reuses this compilation.
    spec = lambda x, sh: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh)
    try:
      split = self._split
      specs = [spec(x, sh) for x, sh in zip(leaves, state_sh)]
      arg_specs = [spec(x, getattr(x, "sharding", None)) for x in jax.tree_util.tree_leaves(args)]
      scratch_specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
                       for s, sh in zip(self._stream.scratch, self._scratch_sh)]
      lowered = self._compute.lower(
          [specs[i] for i in split.device_leaves], [specs[i] for i in split.host_leaves],
          arg_specs, scratch_specs)
      every = ([specs[i] for i in split.device_leaves] + [specs[i] for i in split.host_leaves]
               + arg_specs + scratch_specs)
      host = sum(inv_lib.bytes_per_device(a) for a in every if _memory_kind(a) == "pinned_host")
      device_args = sum(inv_lib.bytes_per_device(a) for a in every) - host
      ok, fig = cost_model.verify(plan, lowered, host_argument_bytes=host,
                                  device_argument_bytes=device_args)
    except Exception as e:  # pylint: disable=broad-except  (the first call compiles and reports)
      log.debug("jaxtier: compiling the planned step to verify it failed: %r", e)
      return None
    if fig is None:
      return None
    self.plan = dataclasses.replace(
        plan, compiler_peak_hbm_bytes=fig.peak_bytes,
        notes=plan.notes + (f"compiled step's memory_analysis: {fig.describe()} (the "
                            f"arguments by their shardings: device {device_args}, pinned_host "
                            f"{host} bytes)",))
    budget = plan.planned_device_budget
    log.info("jaxtier: peak device memory per device: predicted %d bytes, compiler %d bytes%s",
             plan.predicted_peak_hbm_bytes, fig.peak_bytes,
             "" if budget is None else f", budget {budget} bytes")
    if ok or refining:
      return None
    # Re-planning helps only where the solver believed its plan fit (else it already offloaded
    # all it could) and may move leaves.
    solvable = (self._options.policy not in ("none", planner.OPTIMIZER_STATE_ON_HOST)
                and budget is not None and plan.predicted_peak_hbm_bytes <= budget)
    if attempt >= MAX_REPLANS or not solvable:
      log.warning("jaxtier: the compiled step's peak device memory (%s) exceeds the device "
                  "budget (%s)%s", planner.format_bytes(fig.peak_bytes),
                  planner.format_bytes(budget), "" if not solvable else
                  f" after {attempt} re-plans; keeping this plan")
      return None
    over = fig.peak_bytes - budget
    log.warning("jaxtier: the compiled step needs %s of device memory, %s over the budget of "
                "%s (predicted %s); re-planning with %s less", planner.format_bytes(
                    fig.peak_bytes), planner.format_bytes(over), planner.format_bytes(budget),
                planner.format_bytes(plan.predicted_peak_hbm_bytes), planner.format_bytes(over))
    return max(1, budget - over)

  def _shardings(self, state: Any) -> list[Any]:
    leaves = jax.tree_util.tree_leaves(state)
    mesh = jc.common_mesh(leaves)
    return [jc.named_sharding(x, lp.memory_kind, mesh) for x, lp in zip(leaves, self.plan.leaves)]

  def _build(self, state: Any, args: Sequence[Any]):
    """jits the two programs of the step (`lowering.SplitStep`); the update one lazily."""
    state_sh = self._shardings(state)
    jaxpr = self._inventory.closed_jaxpr.jaxpr
    self._stream = streaming.schedule(
        jaxpr, [l.index for l in self.plan.leaves if l.placement == planner.HOST_STREAM],
        {k for cc in self._compiled for k in cc.component.eqns})
    split = lowering.rewrite(self._inventory.closed_jaxpr, self.plan, self._compiled, state_sh,
                             self._stream)
    n_state = len(self.plan.leaves)
    master_sh = [state_sh[i].with_memory_kind("pinned_host")
                 for i in lowering.master_indices(self._compiled)]
    # A gradient buffer is sharded like its leaf (else replicated on the leaf's mesh).
    scratch_sh = [
        state_sh[s.leaf].with_memory_kind("pinned_host")
        if tuple(s.shape) == tuple(self.plan.leaves[s.leaf].shape) else
        NamedSharding(state_sh[s.leaf].mesh, PartitionSpec(), memory_kind="pinned_host")
        for s in self._stream.scratch]
    self._scratch, self._scratch_sh = [], scratch_sh
    # Explicit in_shardings for every argument (the batch too): JAX pairs donated buffers
    # with outputs by memory kind only when every argument's memory kind is known; otherwise
    # (jax 0.11) it paired a device param with a same-shaped pinned_host moment, which XLA's
    # verifier rejects.
    mesh = jc.common_mesh((state, args))
    arg_sh = [jc.named_sharding(x, _memory_kind(x) or "device", mesh)
              for x in jax.tree_util.tree_leaves(args)]
    self._arg_kinds = [sh.memory_kind for sh in arg_sh]
    out_sh = lambda js: [state_sh[j] if j < n_state else None for j in js]
    compute = jax.jit(
        split.compute, donate_argnums=(0, 3),
        in_shardings=([state_sh[i] for i in split.device_leaves],
                      [state_sh[i] for i in split.host_leaves], arg_sh, scratch_sh),
        out_shardings=(out_sh(split.compute_outs[:split.num_first]), [None] * split.num_feeds,
                       out_sh(split.compute_outs[split.num_first:]), scratch_sh))

    # A metric the update program returns (an updated leaf, or an elementwise function of one,
    # computed by a host update) comes out of the custom call in pinned_host: the step's
    # outputs other than the state are on the device, as under jax.jit (replicated over the
    # state's mesh: XLA copies them there).
    metric_mesh = mesh if mesh is not None else (state_sh[0].mesh if state_sh else None)
    metric_sh = (None if metric_mesh is None
                 else NamedSharding(metric_mesh, PartitionSpec(), memory_kind="device"))
    update_out_sh = [state_sh[j] if j < n_state else metric_sh for j in split.update_outs]

    def make_update(feed_sh):
      return jax.jit(
          split.update, donate_argnums=(0, 2),
          in_shardings=([state_sh[i] for i in split.updated_host],
                        [state_sh[i] for i in split.read_host], master_sh, feed_sh, scratch_sh),
          out_shardings=(update_out_sh, master_sh))

    self._split, self._compute, self._make_update, self._update = (
        split, compute, make_update, None)

  def _check_arg_memory_kinds(self, args: Sequence[Any]) -> None:
    """Raises ValueError naming an argument (not the state) whose memory kind is not the one
    the step was compiled for (jax.jit's own error names neither the argument nor the fix)."""
    for (path, x), want in zip(jax.tree_util.tree_flatten_with_path(args)[0], self._arg_kinds):
      have = _memory_kind(x)
      if have is not None and have != want:
        raise ValueError(
            f"jaxtier.offload: argument {jax.tree_util.keystr(path)} (after the state) is in "
            f"{have!r} memory but the step was compiled with it in {want!r} memory. jaxtier "
            "places only the state (the first argument); an array of the placed state passed "
            "again as another argument lives where the plan put it (and is donated with the "
            f"state). Pass arguments in {want!r} memory, e.g. jax.device_put(x, "
            "jax.devices()[0]), or a copy (jnp.copy) made before the state was placed.")

  def _leaf_groups(self, leaves: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    split = self._split
    return [leaves[i] for i in split.device_leaves], [leaves[i] for i in split.host_leaves]

  def place(self, state: Any, *example_args: Any) -> Any:
    """Moves each state leaf to its planned memory kind; returns the placed state.

    Args:
      state: the training state pytree (arrays only).
      *example_args: the step's other arguments (e.g. a batch), needed to trace and plan the
        step the first time; later calls may omit them.

    Returns:
      A pytree like `state` whose leaves carry `NamedSharding`s with memory kind 'device' or
      'pinned_host'. The input state is left as it was (not donated).

    Raises:
      TypeError: a non-array leaf (named by path), or no example arguments before a plan exists.
      jaxtier.PlanError / AdmissionError: from planning; nothing has been allocated then.
    """
    state = _arrays("OffloadedStep.place", state)
    if self.plan is None and not example_args:
      raise TypeError("OffloadedStep.place: the step has no plan yet; pass example arguments "
                      "for tracing it, e.g. `step.place(state, batch)`")
    if example_args:
      self._ensure_plan(state, example_args)
    inv_lib.check_leaves("OffloadedStep.place", state)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    placed = [_put(x, s, lp) for x, s, lp in zip(leaves, self._shardings(state),
                                                  self.plan.leaves)]
    self._refresh_masters(leaves, placed)
    return jax.tree_util.tree_unflatten(treedef, placed)

  def _refresh_masters(self, original: list[Any], placed: list[Any]) -> None:
    idx = lowering.master_indices(self._compiled)
    if not idx:
      return
    sources = tuple(placed[i] for i in idx)
    if len(self._master_sources) == len(sources) and all(
        a is b for a, b in zip(self._master_sources, sources)):
      return
    if self._master_sources:
      log.warning("jaxtier: the state's bf16/f16 params are not the ones the last step returned; "
                  "re-deriving their fp32 master copies from them")
    sh = self._shardings(placed)
    self._masters = [jax.device_put(jnp.asarray(original[i], jnp.float32),
                                    sh[i].with_memory_kind("pinned_host")) for i in idx]
    self._master_sources = sources

  # -- running -----------------------------------------------------------------------------
  def __call__(self, state: Any, *args: Any) -> tuple[Any, Any]:
    """Runs one step: `(state, *args) -> (new_state, metrics)`, the state donated.

    Arguments are positional, as the wrapped step takes them. Python numbers in the state
    (Flax `TrainState.step`) become 0-d arrays in the returned state.

    Raises:
      ValueError: a state leaf was already donated to an earlier step (named by path).
      TypeError: a non-array state leaf.
    """
    state = _arrays("jaxtier.offload", state)
    inv_lib.check_leaves("jaxtier.offload", state)
    self._ensure_plan(state, args)
    self._check_arg_memory_kinds(args)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    want = self._shardings(state)
    moved = [x if _same_placement(x, s) else jax.device_put(x, s) for x, s in zip(leaves, want)]
    # The same buffer twice in the state (e.g. an optimizer keeping a reference to the params)
    # cannot be donated twice: later occurrences get their own copy.
    # Two Array objects may share one buffer (device_put to the sharding an array already
    # has returns a new Array over the same buffer): compare buffers, not objects.
    seen: set[Any] = set()
    for i, x in enumerate(moved):
      key = _buffer_key(x)
      if key in seen:
        moved[i] = jnp.copy(x)
      seen.add(key)
    self._refresh_masters(leaves, moved)
    arg_leaves = jax.tree_util.tree_leaves(args)
    self._ensure_scratch()
    self._calls += 1
    timing = 2 <= self._calls <= 1 + MEASURED_STEPS  # the first call compiles
    t0 = time.perf_counter()
    split = self._split
    dev, host = self._leaf_groups(moved)
    # 1. Forward, backward, streaming: host leaves are read, not donated (a failure here
    #    leaves them intact).
    # 2. The fused host updates, in place on the donated host leaves and masters. Dispatched
    #    only once the compute program has succeeded: an update fed by a failed program would
    #    still consume (donate) the host leaves. The wait costs one dispatch's latency per step;
    #    a plan without host updates does not wait (dispatch stays asynchronous).
    try:
      first, feeds, rest, self._scratch = self._compute(dev, host, arg_leaves, self._scratch)
      if self._compiled:
        jax.block_until_ready((first, feeds, rest, self._scratch))
    except Exception as e:
      self._scratch = []  # donated to the failed program; fresh buffers next time
      if hasattr(e, "add_note"):
        deleted = sum(x.is_deleted() for x in dev if isinstance(x, jax.Array))
        e.add_note("jaxtier: the step failed before its host updates ran: the state's "
                   "pinned_host leaves are intact and usable; " + (
                       f"{deleted} of its {len(dev)} device leaves were donated to the failed "
                       "program (as with jax.jit(donate_argnums=...))." if deleted else
                       "its device leaves were not consumed (the program did not run)."))
      raise
    update_outs = []
    if self._compiled:
      if self._update is None:
        self._update = self._make_update([x.sharding for x in feeds])
      update_outs, self._masters = self._update(
          [moved[i] for i in split.updated_host], [moved[i] for i in split.read_host],
          self._masters, feeds, self._scratch)
    outs = split.assemble(moved, list(first) + list(rest), update_outs,
                          self._inventory.out_treedef.num_leaves)
    idx = lowering.master_indices(self._compiled)
    self._master_sources = tuple(outs[i] for i in idx)
    if timing:
      self._record_step_time(outs, time.perf_counter() - t0)
    out = jax.tree_util.tree_unflatten(self._inventory.out_treedef, outs)
    return out[0], out[1]

  def _record_step_time(self, outs: list[Any], dispatch_secs: float) -> None:
    """Times calls 2 .. 1 + MEASURED_STEPS (synchronised) and reports measured vs predicted."""
    t0 = time.perf_counter()
    jax.block_until_ready(outs)
    self._step_times.append(dispatch_secs + time.perf_counter() - t0)
    if len(self._step_times) == MEASURED_STEPS:
      measured = float(np.median(self._step_times))
      self.plan = dataclasses.replace(self.plan, measured_step_secs=measured)
      predicted = self.plan.predicted_step_secs
      log.info("jaxtier: step time measured %.4g ms (median of %d)%s", measured * 1e3,
               MEASURED_STEPS, "" if not predicted else
               f", predicted {predicted * 1e3:.4g} ms ({predicted / measured:.3g} of measured)")

  def lower(self, state: Any, *args: Any):
    """`jax.stages.Lowered` of the step's compute program (forward, backward, streaming).

    This is the program that holds the device memory: `.compile().memory_analysis()` gives
    its peak. The fused host updates run in a second program (`lower_update`). The state need
    not be placed yet: its leaves are lowered with the plan's shardings.
    """
    self._ensure_plan(state, args)
    leaves = [jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh)
              for x, sh in zip(jax.tree_util.tree_leaves(state), self._shardings(state))]
    dev, host = self._leaf_groups(leaves)
    return self._compute.lower(dev, host, jax.tree_util.tree_leaves(args), self._scratch_avals())

  def lower_update(self, state: Any, *args: Any):
    """`jax.stages.Lowered` of the step's fused host-update program (its custom calls)."""
    self._ensure_plan(state, args)
    leaves = jax.tree_util.tree_leaves(state)
    split = self._split
    compiled = self.lower(state, *args).compile()
    feed_sh = list(compiled.output_shardings[1])
    feed_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in
                  compiled.out_info[1]]
    update = self._update or self._make_update(feed_sh)
    masters = self._masters or [jax.ShapeDtypeStruct(leaves[i].shape, jnp.float32)
                                for i in lowering.master_indices(self._compiled)]
    return update.lower([leaves[i] for i in split.updated_host],
                        [leaves[i] for i in split.read_host], masters, feed_avals,
                        self._scratch_avals())

  def _scratch_avals(self) -> list[Any]:
    return self._scratch or [jax.ShapeDtypeStruct(s.shape, s.dtype)
                             for s in self._stream.scratch]

  def _ensure_scratch(self) -> None:
    """Allocates the pinned_host buffers that receive streamed leaves' gradients (once)."""
    if len(self._scratch) != len(self._stream.scratch):
      self._scratch = [jax.device_put(np.zeros(s.shape, s.dtype), sh)
                       for s, sh in zip(self._stream.scratch, self._scratch_sh)]


def _put(x: Any, sharding: Any, leaf: "planner.LeafPlan") -> Any:
  """`jax.device_put(x, sharding)`; an allocation failure is raised naming the leaf and sizes.

  Raises:
    jaxtier.AdmissionError: the memory kind's allocator could not hold the leaf (for pinned_host
      on a GPU: XLA's pinned pool, capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, or the host's
      page-locking limits for one allocation of this size).
  """
  try:
    return jax.device_put(x, sharding)
  except Exception as e:  # pylint: disable=broad-except  (XlaRuntimeError has no stable home)
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
      raise
    hint = ("XLA's pinned host pool is capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 by "
            "default) and allocates each leaf in one piece: raise the cap if the host has the "
            "memory, or keep the leaf on the device (policy)" if leaf.memory_kind == "pinned_host"
            else "lower device_budget so that the plan moves more state to the host")
    raise planner.AdmissionError(
        f"OffloadedStep.place: could not allocate leaf {leaf.path} ({leaf.dtype}"
        f"{list(leaf.shape)}, {planner.format_bytes(leaf.nbytes)} = {leaf.nbytes} bytes per "
        f"device) in {leaf.memory_kind}: {text.splitlines()[0][:300]}. Fix: {hint}.") from e


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
  """Parameter leaves the lowering can serve `host_stream` (`streaming.stream_reason`)."""
  return {l.index for l in inv.leaves if l.role == inv_lib.PARAM
          and not streaming.stream_reason(inv.closed_jaxpr.jaxpr, l.index)}


def _buffer_key(x: Any) -> Any:
  """What identifies `x`'s storage: its shards' (device, buffer address), else the object."""
  try:
    return tuple((sh.device.id, sh.data.unsafe_buffer_pointer()) for sh in x.addressable_shards)
  except Exception:  # pylint: disable=broad-except  (a backend without raw pointers)
    return id(x)


def _arrays(api: str, state: Any) -> Any:
  """`state` with Python numbers (e.g. Flax `TrainState.step`) made 0-d arrays, as jax.jit does.

  Raises:
    TypeError: a leaf is a tracer: the offloaded step was called under jit/grad/vmap.
  """
  def fix(x):
    if isinstance(x, jax.core.Tracer):
      raise TypeError(f"{api}: called under a JAX transformation (jit, grad, vmap...); call the "
                      "offloaded step directly: it compiles itself, with the placement baked in")
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
      return jnp.asarray(x)
    return x
  return jax.tree.map(fix, state)


def _same_placement(x: Any, s: Any) -> bool:
  sh = getattr(x, "sharding", None)
  return sh is not None and getattr(sh, "memory_kind", None) == s.memory_kind and (
      sh.is_equivalent_to(s, x.ndim))


def _num_local_devices(state: Any) -> int:
  """Devices of the state's mesh that this process addresses (1 without a mesh).

  Each keeps its shards of the host leaves in this host's memory; plans count bytes per device.
  """
  mesh = jc.common_mesh(state)
  if mesh is None:
    return 1
  here = jax.process_index()
  return max(1, sum(d.process_index == here for d in mesh.devices.flat))


def _changes(old: Any, new: Any, state: Any, args: Sequence[Any], limit: int = 4) -> str:
  """What differs between two `_signature`s, naming leaves by path ('' if nothing)."""
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


def _signature(state: Any, args: Sequence[Any]) -> Any:
  def sig(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))
                          for x in leaves)
  return sig(state), sig(tuple(args))


def offload(fun: Callable[..., Any] = MISSING, *, device_budget: Any = None,
            host_budget: Any = None, policy: Any = "auto",
            donate_argnums: "int | tuple[int, ...]" = (0,)) -> Any:
  """Wraps an unchanged train step so that its state spans device and pinned host memory.

  Works bare (`@jaxtier.offload`) or with options (`jaxtier.offload(step, host_budget='64GB')`).

  Args:
    fun: `train_step(state, *args) -> (new_state, metrics)`; `state` is a pytree of arrays and
      `new_state` has its structure.
    device_budget: device memory the step may use at its peak (state and transient buffers),
      bytes per device or a size string ('80GB', '16GiB'); None: no limit (on a GPU, what the
      device has). The compiled step's peak (`memory_analysis()`) is checked against it and
      the step re-planned (up to twice) when it is over.
    host_budget: pinned host memory the plan may pin, bytes per device or a size string; None:
      limited only by what the host can pin.
    policy: 'auto' (the planner's solver: the fastest predicted placement within the budgets;
      everything on the device when it fits), 'optimizer_state_on_host' (every optimizer-state
      leaf to pinned_host, updated there), 'none' (all on device), a callable
      `(path, LeafInfo) -> placement | None`, or a `{regex: placement}` dict matched against
      leaf paths (leaves it leaves to None/no match are planned as 'auto'). Placements:
      'device', 'host_dha', 'host_cpu', 'host_split', 'host_xla', 'host_stream' (a stack of
      layers read by a layer loop; a stream pattern's match on optimizer state puts that
      state on the host).
    donate_argnums: arguments donated to the step; must include 0.

  Returns:
    An `OffloadedStep` (or a decorator making one, when `fun` is omitted).

  Raises:
    ValueError: a budget <= 0 or not a size, or donate_argnums without 0.
    jaxtier.PlanError (a ValueError): a policy that is none of the forms above. Errors that
      need the traced step (a bad regex, an unknown placement, a budget the state cannot fit)
      are raised by `place` or the first call, naming the leaf.

  Example:
    >>> step = jaxtier.offload(train_step)            # doctest: +SKIP
    >>> state = step.place(state, batch)              # doctest: +SKIP
    >>> state, metrics = step(state, batch)           # doctest: +SKIP
    >>> print(step.plan)                              # doctest: +SKIP
  """
  options = OffloadOptions(device_budget=device_budget, host_budget=host_budget, policy=policy,
                           donate_argnums=donate_argnums)
  if fun is MISSING:
    return lambda f: OffloadedStep(f, options)
  return OffloadedStep(fun, options)


def calibrate(*, save: bool = True, path: "str | None" = None,
              **options: Any) -> profile.HardwareProfile:
  """Measures this machine's `HardwareProfile` and stores it where the planner finds it.

  What is measured, and how, is `jaxtier._src.profile.calibrate` (on a GPU: the link each way
  and in duplex, zero-copy read / write / read+write, both host-update executors' AdamW rates,
  bf16 matmul, HBM bandwidth and capacity; everywhere: host DRAM bandwidth, the CPU executor,
  the pinnable host memory; without a GPU the GPU figures stay the H200 defaults, with a
  warning). Units: GB/s, params/s, TFLOP/s, bytes.

  Args:
    save: store the profile as JSON (default: yes), in the user's cache directory keyed by
      device kind and jax version (`$XDG_CACHE_HOME/jaxtier/profile-<device>-jax<version>.json`)
      or at `path`. `offload` and `plan` load it from there.
    path: where to store it instead.
    **options: passed to the measurement (`measure_cpu`, `measure_device`, `num_params`).

  Returns:
    The measured profile.
  """
  measured = profile.calibrate(**options)
  if save:
    where = profile.save(measured, path)
    log.info("jaxtier.calibrate: profile stored at %s", where)
  return measured


def plan(fun: Callable[..., Any], state: Any, *args: Any, device_budget: Any = None,
         host_budget: Any = None, policy: Any = "auto", platform: "str | None" = None,
         streamable: Any = None, dha_readable: Any = frozenset(),
         activations: "cost_model.ActivationModel | None" = None) -> planner.Plan:
  """The plan `offload` would make for `fun(state, *args)`, without placing anything.

  `state` and `args` may be arrays or `jax.ShapeDtypeStruct`s (to plan a model that is not
  allocated). `platform` ('cpu' or 'gpu'; default: JAX's default backend) picks the executors
  the plan names; for a platform this machine does not have, the stored or default hardware
  profile gives the rates and the pinnable host memory, and the plan's notes say so.

  The plan carries the cost model's predictions: `predicted_step_secs`, `critical_path`,
  `predicted_peak_hbm_bytes`, `resource_secs`. `streamable` / `dha_readable` (state leaf
  indices) allow `host_stream` / `host_dha` placements of parameters (`streamable` None: every
  parameter the lowering can stream, as `offload` plans); `activations` (a
  `cost_model.ActivationModel`) lets the plan choose the activation policy.

  Raises:
    jaxtier.PlanError, jaxtier.AdmissionError, TypeError: as `OffloadedStep.place`.
  """
  options = OffloadOptions(device_budget=device_budget, host_budget=host_budget, policy=policy)
  inv = inv_lib.take_inventory(fun, _arrays("jaxtier.plan", state), args, api="jaxtier.plan")
  here = jax.default_backend()
  platform = platform or here
  if platform not in ("cpu", "gpu"):
    raise ValueError(f"jaxtier.plan: expected platform 'cpu' or 'gpu', got {platform!r}")
  hardware = profile.load(platform=platform)
  blocked = _stream_blocked(state)
  if blocked:  # none, whatever the caller allows
    streamable = frozenset()
  elif streamable is None:
    streamable = _streamable(inv)
  pinnable_what = planner.HERE_PINNABLE
  if platform == here:
    pinnable = planner.pinnable_bytes(platform, _num_local_devices(state))
  else:  # planning for an absent GPU: what its profile says the host could pin, or XLA's
    # pinned-pool cap when the caller sets it (to plan for a host where it is raised).
    cap = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    pinnable = int(float(cap) * 2**30) if cap else hardware.pinnable_bytes
    pinnable_what = ("XLA's pinned pool as XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB sets it" if cap
                     else "what the hardware profile says the GPU's host can pin (no GPU here)")
  result, _ = planner.make_plan(
      inv, platform=platform, policy=options.policy, device_budget=options.device_budget,
      host_budget=options.host_budget, pinnable_bytes=pinnable, hardware=hardware,
      step_costs=_step_costs(inv, state, args, platform, options.policy, always=True),
      streamable=streamable, dha_readable=dha_readable, activations=activations,
      resident_bytes=_resident_bytes(state), pinnable_what=pinnable_what,
      stream_blocked=blocked)
  if platform != here:
    result = dataclasses.replace(result, notes=result.notes + (
        f"planned for {platform} on a machine without one ({here}): "
        + ("the default hardware profile" if hardware.is_default else "a stored profile")
        + f"; pinnable host memory from the profile ({planner.format_bytes(pinnable)})",))
  return result


def _step_costs(inv: inv_lib.Inventory, state: Any, args: Sequence[Any], platform: str,
                policy: Any, always: bool = False) -> "cost_model.StepCosts":
  """FLOPs and transient bytes of the device-only step (compiled when the solver runs, or
  `always`: `jaxtier.plan` predicts for every policy)."""
  leaves = jax.tree_util.tree_leaves(state)
  solves = always or not (isinstance(policy, str)
                          and policy in ("none", planner.OPTIMIZER_STATE_ON_HOST))
  return cost_model.measure_step(
      inv.closed_jaxpr, leaves, jax.tree_util.tree_leaves(args), platform=platform,
      state_device_bytes=sum(l.nbytes for l in inv.leaves), compile_step=solves,
      time_scans=solves and _time_scans(platform))


def _resident_bytes(state: Any) -> int:
  """Bytes of the state's leaves that exist as arrays (not `jax.ShapeDtypeStruct`s)."""
  return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(state)
             if isinstance(x, (jax.Array, np.ndarray)))


def _memory_kind(x: Any) -> "str | None":
  """The memory kind of an array's (or aval's) sharding, None if it has none."""
  return getattr(getattr(x, "sharding", None), "memory_kind", None)


def _time_scans(platform: str) -> bool:
  """Whether the planner times the step's scan bodies on this machine's device
  (`cost_model.time_scan_bodies`): JAXTIER_TIME_SCANS=1/0 forces it; by default on a GPU being
  planned for (on the CPU backend the profile's rates are an H200's, and timing CPU bodies would
  make plans in tests depend on machine load)."""
  forced = os.environ.get("JAXTIER_TIME_SCANS")
  if forced is not None:
    return forced not in ("", "0", "false", "False")
  return platform == "gpu" and jax.default_backend() == "gpu"
