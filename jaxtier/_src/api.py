"""`jaxtier.offload` and `jaxtier.plan`: the public entry points (re-exported by `jaxtier`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src import cost_model
from jaxtier._src import inventory as inv_lib
from jaxtier._src import jax_compat as jc
from jaxtier._src import lowering
from jaxtier._src import planner
from jaxtier._src import profile

log = logging.getLogger("jaxtier")


class _Missing:
  def __repr__(self):
    return "MISSING"


MISSING: Any = _Missing()
# Re-plans after the compiled step's peak device memory came out over the budget.
MAX_REPLANS = 2


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
    self._compiled: list[Any] = []
    self._inventory: "inv_lib.Inventory | None" = None
    self._jitted = None
    self._masters: list[jax.Array] = []
    self._master_sources: tuple[Any, ...] = ()
    self._signature = None
    functools.update_wrapper(self, fn)

  # -- planning ----------------------------------------------------------------------------
  def _ensure_plan(self, state: Any, args: Sequence[Any]) -> None:
    sig = _signature(state, args)
    if self.plan is not None and sig == self._signature:
      return
    inv = inv_lib.take_inventory(self._fn, state, args)
    platform = jc.platform_of(jax.tree_util.tree_leaves(state)[0]) if jax.tree_util.tree_leaves(
        state) else jax.default_backend()
    hardware = profile.load(platform=platform)
    costs = _step_costs(inv, state, args, platform, self._options.policy)
    budget = self._options.device_budget
    previous = None
    for attempt in range(MAX_REPLANS + 1):
      try:
        plan, compiled = planner.make_plan(
            inv, platform=platform, policy=self._options.policy, device_budget=budget,
            host_budget=self._options.host_budget,
            pinnable_bytes=planner.pinnable_bytes(platform), hardware=hardware, step_costs=costs)
      except planner.PlanError as e:
        if previous is None:
          raise
        log.warning("jaxtier: re-planning against %s failed (%s); keeping the previous plan",
                    planner.format_bytes(budget), str(e).split(". ")[0])
        self._install(inv, *previous, sig, state, args)
        break
      if attempt:  # planned against a smaller budget than the user's: show theirs
        plan = dataclasses.replace(plan, device_budget=self._options.device_budget, notes=(
            *plan.notes, f"re-planned ({attempt}) against {planner.format_bytes(budget)}: the "
            "compiled step's peak was over the budget"))
      self._install(inv, plan, compiled, sig, state, args)
      smaller = self._verify(state, args, attempt)
      if smaller is None:
        break
      previous, budget = (self.plan, compiled), smaller
    log.debug("jaxtier plan:\n%s", self.plan)

  def _install(self, inv: Any, plan: "planner.Plan", compiled: list[Any], sig: Any, state: Any,
               args: Sequence[Any]) -> None:
    self._inventory, self.plan, self._compiled, self._signature = inv, plan, compiled, sig
    self._masters, self._master_sources = [], ()
    self._jitted = self._build(state, args)

  def _verify(self, state: Any, args: Sequence[Any], attempt: int) -> "int | None":
    """Compiles the planned step and compares the compiler's peak with the budget planned for.

    Records the compiler's figure in the plan. Returns a smaller device budget to re-plan with
    when the compiler's peak exceeds it and the solver may still move leaves (at most
    MAX_REPLANS times), else None.
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
      lowered = self._jitted.lower(
          [spec(x, sh) for x, sh in zip(leaves, state_sh)],
          [jax.ShapeDtypeStruct(np.shape(leaves[i]), jnp.float32,
                                sharding=state_sh[i].with_memory_kind("pinned_host"))
           for i in lowering.master_indices(self._compiled)],
          [spec(x, getattr(x, "sharding", None)) for x in jax.tree_util.tree_leaves(args)])
      ok, fig = cost_model.verify(plan, lowered)
    except Exception as e:  # pylint: disable=broad-except  (the first call compiles and reports)
      log.debug("jaxtier: compiling the planned step to verify it failed: %r", e)
      return None
    if fig is None:
      return None
    self.plan = dataclasses.replace(plan, compiler_peak_hbm_bytes=fig.peak_bytes)
    budget = plan.planned_device_budget
    log.info("jaxtier: peak device memory per device: predicted %d bytes, compiler %d bytes%s",
             plan.predicted_peak_hbm_bytes, fig.peak_bytes,
             "" if budget is None else f", budget {budget} bytes")
    if ok:
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
    state_sh = self._shardings(state)
    run = lowering.rewrite(self._inventory.closed_jaxpr, self.plan, self._compiled, state_sh)
    n_state = len(self.plan.leaves)
    master_idx = lowering.master_indices(self._compiled)
    master_sh = [state_sh[i].with_memory_kind("pinned_host") for i in master_idx]
    out_treedef = self._inventory.out_treedef

    def flat_step(state_leaves, master_leaves, arg_leaves):
      outs, masters = run(state_leaves, master_leaves, arg_leaves)
      return outs[:n_state], masters, outs[n_state:]

    n_metrics = out_treedef.num_leaves - n_state
    # Explicit in_shardings for every argument (the batch too): JAX pairs donated buffers
    # with outputs by memory kind only when every argument's memory kind is known; otherwise
    # (jax 0.11) it paired a device param with a same-shaped pinned_host moment, which XLA's
    # verifier rejects.
    mesh = jc.common_mesh((state, args))
    arg_sh = [jc.named_sharding(x, getattr(getattr(x, "sharding", None), "memory_kind", None)
                                or "device", mesh) for x in jax.tree_util.tree_leaves(args)]
    jitted = jax.jit(flat_step, donate_argnums=(0, 1),
                     in_shardings=(state_sh, master_sh, arg_sh),
                     out_shardings=(state_sh, master_sh, [None] * n_metrics))
    return jitted

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
    leaves, treedef = jax.tree_util.tree_flatten(state)
    want = self._shardings(state)
    moved = [x if _same_placement(x, s) else jax.device_put(x, s) for x, s in zip(leaves, want)]
    # The same buffer twice in the state (e.g. an optimizer keeping a reference to the params)
    # cannot be donated twice: later occurrences get their own copy.
    seen: set[int] = set()
    for i, x in enumerate(moved):
      if id(x) in seen:
        moved[i] = jnp.copy(x)
      seen.add(id(x))
    self._refresh_masters(leaves, moved)
    arg_leaves = jax.tree_util.tree_leaves(args)
    new_leaves, self._masters, metric_leaves = self._jitted(moved, self._masters, arg_leaves)
    idx = lowering.master_indices(self._compiled)
    self._master_sources = tuple(new_leaves[i] for i in idx)
    out = jax.tree_util.tree_unflatten(self._inventory.out_treedef,
                                       list(new_leaves) + list(metric_leaves))
    return out[0], out[1]

  def lower(self, state: Any, *args: Any):
    """`jax.stages.Lowered` of the planned step (for `.compile().memory_analysis()`, HLO)."""
    self._ensure_plan(state, args)
    leaves = jax.tree_util.tree_leaves(state)
    return self._jitted.lower(leaves, self._masters or [
        jax.ShapeDtypeStruct(leaves[i].shape, jnp.float32)
        for i in lowering.master_indices(self._compiled)], jax.tree_util.tree_leaves(args))


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
      'device', 'host_dha', 'host_cpu', 'host_split', 'host_xla'.
    donate_argnums: arguments donated to the step; must include 0.

  Returns:
    An `OffloadedStep` (or a decorator making one, when `fun` is omitted).

  Raises:
    ValueError: a budget <= 0 or not a size, or donate_argnums without 0.

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


def plan(fun: Callable[..., Any], state: Any, *args: Any, device_budget: Any = None,
         host_budget: Any = None, policy: Any = "auto", platform: "str | None" = None,
         streamable: Any = frozenset(), dha_readable: Any = frozenset(),
         activations: "cost_model.ActivationModel | None" = None) -> planner.Plan:
  """The plan `offload` would make for `fun(state, *args)`, without placing anything.

  `state` and `args` may be arrays or `jax.ShapeDtypeStruct`s (to plan a model that is not
  allocated). `platform` ('cpu' or 'gpu'; default: JAX's default backend) picks the executors
  the plan names; for a platform this machine does not have, the stored or default hardware
  profile gives the rates and the pinnable host memory, and the plan's notes say so.

  The plan carries the cost model's predictions: `predicted_step_secs`, `critical_path`,
  `predicted_peak_hbm_bytes`, `resource_secs`. `streamable` / `dha_readable` (state leaf
  indices) allow `host_stream` / `host_dha` placements of parameters; `activations` (a
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
  if platform == here:
    pinnable = planner.pinnable_bytes(platform)
  else:  # planning for an absent GPU: what its profile says the host could pin, or XLA's
    # pinned-pool cap when the caller sets it (to plan for a host where it is raised).
    cap = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    pinnable = int(float(cap) * 2**30) if cap else hardware.pinnable_bytes
  result, _ = planner.make_plan(
      inv, platform=platform, policy=options.policy, device_budget=options.device_budget,
      host_budget=options.host_budget, pinnable_bytes=pinnable, hardware=hardware,
      step_costs=_step_costs(inv, state, args, platform, options.policy, always=True),
      streamable=streamable, dha_readable=dha_readable, activations=activations)
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
      state_device_bytes=sum(l.nbytes for l in inv.leaves), compile_step=solves)
