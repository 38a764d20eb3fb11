"""`OffloadedStep`: places the state and runs the planned step (planning: `pipeline`).

The step delegates to its collaborators: `PlanCache` (one plan per input signature),
`MasterCopies` (the fp32 masters), `StepRunner` (dispatch, Ctrl-C, failure notes, timing) and
`placing` (the state's leaves in their planned shardings).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src import checkpoint as checkpoint_lib
from jaxtier._src import jax_compat as jc
from jaxtier._src import pipeline
from jaxtier._src.analysis import inventory as inv_lib
from jaxtier._src.lowering import compiled as compiled_lib
from jaxtier._src.options import OffloadOptions
from jaxtier._src.planning.plan import Plan
from jaxtier._src.runtime import placing
from jaxtier._src.runtime.masters import MasterCopies
from jaxtier._src.runtime.plan_cache import PlanCache
from jaxtier._src.runtime.runner import StepRunner
from jaxtier._src.vocab import MemoryKind


class Guesses(NamedTuple):
  """`OffloadedStep.guesses`: steps whose guess held, missed, and steps run with none."""

  held: int
  missed: int
  serial: int


class OffloadedStep:
  """A train step whose state lives across device and pinned host memory, per its plan.

  Call it like the wrapped step: `state, metrics = step(state, batch)`. The state passed in is
  donated (consumed); use the returned one. Ctrl-C during a step is held from the moment the
  state is donated until the step has made its new state, then raised as KeyboardInterrupt:
  the new state is then `last_state`.

  Inputs of new shapes or dtypes are traced and planned again, as `jax.jit` re-traces; the
  plans of the last `PLAN_CACHE` (4) shapes are kept, so batches alternating between shapes
  plan each once (`plan` is the one of the last call).

  Attributes:
    plan: the `Plan` (None until the first `place` or call).
    last_state, last_metrics: what the last step made (None before the first, and after
      `place`, `init` or `restore` starts a run from another state).
  """

  @property
  def guesses(self) -> Guesses:
    """How the steps of the plan's guarded updates ran (`Plan.speculation`: a clipped or
    finite-checked step's updates, run on a guess that the clip does not bind): `held`, the
    steps whose guess held; `missed`, those whose guess missed (they ran the serial schedule
    too); `serial`, those run with no guess (recent steps clipped too often). All 0 where the
    plan has none."""
    guesser = self._runner.guesser if self._runner is not None else None
    if guesser is None:
      return Guesses(0, 0, 0)
    return Guesses(guesser.tried - guesser.missed, guesser.missed, guesser.unguessed)

  def __init__(self, fn: Callable[..., Any], options: OffloadOptions):
    self._fn = fn
    self._options = options
    self.plan: "Plan | None" = None
    self.last_state: Any = None
    self.last_metrics: Any = None
    self._plans = PlanCache()
    self._planned: "pipeline.Planned | None" = None
    self._programs: "compiled_lib.StepPrograms | None" = None  # the planned step's programs
    self._masters = MasterCopies()
    self._runner: "StepRunner | None" = None
    functools.update_wrapper(self, fn)

  # -- planning ----------------------------------------------------------------------------
  def _ensure_plan(self, state: Any, args: Sequence[Any], abstract: bool = False) -> None:
    """Plans the step for these inputs (`pipeline.plan_step`) unless planned for them
    (`abstract`: the state's leaves are `jax.ShapeDtypeStruct`s)."""
    if self._plans.select(state, args, lambda changes: pipeline.plan_step(
        self._fn, self._options, state, args, changes=changes, abstract=abstract)):
      self._use(self._plans.current)

  def _use(self, planned: "pipeline.Planned") -> None:
    """Makes `planned` the step's plan: a fresh runner (buffers, timing) and fp32 masters."""
    # The fp32 masters are state the caller does not hold: a new plan (new input shapes) keeps
    # them for the params it still keeps masters for (`MasterCopies.refresh`), else the next
    # step would re-derive them from the rounded bf16 params.
    programs = planned.programs
    self._masters = MasterCopies(programs.master_indices, programs.master_shardings,
                                 carried=self._masters.carried())
    self._planned, self.plan, self._programs = planned, planned.plan, programs
    self._runner = StepRunner(planned, self._masters, on_measured=self._measured)

  def _measured(self, secs: float) -> None:
    self.plan = dataclasses.replace(self.plan, measured_step_secs=secs)

  def _check_arg_memory_kinds(self, args: Sequence[Any]) -> None:
    """Raises ValueError naming an argument (not the state) whose memory kind is not the one
    the step was compiled for (jax.jit's own error names neither the argument nor the fix)."""
    for (path, x), want in zip(jax.tree_util.tree_flatten_with_path(args)[0],
                               self._programs.arg_memory_kinds):
      have = jc.memory_kind_of(x)
      if have is not None and have != want:
        raise ValueError(
            f"jaxtier.offload: argument {jax.tree_util.keystr(path)} (after the state) is in "
            f"{have!r} memory but the step was compiled with it in {want!r} memory. jaxtier "
            "places only the state (the first argument); an array of the placed state passed "
            "again as another argument lives where the plan put it (and is donated with the "
            f"state). Pass arguments in {want!r} memory, e.g. jax.device_put(x, "
            "jax.devices()[0]), or a copy (jnp.copy) made before the state was placed.")

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
    state = placing.as_arrays("OffloadedStep.place", state)
    if self.plan is None and not example_args:
      raise TypeError("OffloadedStep.place: the step has no plan yet; pass example arguments "
                      "for tracing it, e.g. `step.place(state, batch)`")
    if example_args:
      self._ensure_plan(state, example_args)
    inv_lib.check_leaves("OffloadedStep.place", state)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if not any(jc.memory_kind_of(x) == MemoryKind.PINNED_HOST for x in leaves):
      compiled_lib.reserve_pinned_pool(self.plan, self._programs.state_shardings)
    placed = [placing.put(x, s, lp) for x, s, lp in zip(leaves, self._programs.state_shardings,
                                                         self.plan.leaves)]
    self._masters.refresh(leaves, placed)
    self.last_state = self.last_metrics = None  # a new run starts from this state
    return jax.tree_util.tree_unflatten(treedef, placed)

  def init(self, init_fn: Callable[..., Any], *init_args: Any,
           example_args: Sequence[Any] = ()) -> Any:
    """Creates the state where the plan puts it: each leaf born in its memory kind.

    The plan is made from `jax.eval_shape(init_fn, *init_args)` (no memory holds the state
    while planning); then jitted initialisers compute the leaves with the plan's shardings as
    their `out_shardings` (`lowering.compiled.initializers`): the device leaves in one program,
    the pinned_host leaves in programs sized to fit the device memory the plan leaves free. No
    leaf is built on the device and then moved out, and no memory holds the whole state at
    once unless the plan keeps it there. The values are those of `jax.jit(init_fn)(*init_args)`
    (which may differ from an eager call of `init_fn` in the last bit, as any jit may).
    The leaves are created unsharded, on this process's first device and its pinned host
    memory: a state sharded over a mesh is placed with `place`.

    Args:
      init_fn: `init_fn(*init_args) -> state`, a pure function (e.g. of a PRNG key or seed)
        returning the training state pytree the step takes.
      *init_args: its arguments (arrays or Python scalars, traced as `jax.jit` traces them).
      example_args: the step's other arguments (e.g. a batch), needed to trace and plan the
        step the first time.

    Returns:
      The state, its leaves in their planned memory kinds (as `place` returns it).

    Raises:
      TypeError: no example arguments before a plan exists.
      ValueError: `init_fn` returns another structure than the one planned.
      jaxtier.PlanError / AdmissionError: from planning; nothing has been allocated then.
    """
    leaves, treedef = self._plan_abstract(
        jax.eval_shape(init_fn, *init_args), example_args, "init", "init_fn returns",
        "step.init(init_fn, key, example_args=(batch,))")
    made: list[Any] = [None] * len(leaves)
    compiled_lib.reserve_pinned_pool(self.plan, self._programs.state_shardings)
    for indices, program in compiled_lib.initializers(
        init_fn, self.plan, self._programs.state_shardings, treedef):
      for i, x in zip(indices, program(*init_args)):
        made[i] = x
    self._masters.refresh(made, made)
    self.last_state = self.last_metrics = None  # a new run starts from this state
    return jax.tree_util.tree_unflatten(treedef, made)

  # -- checkpoints ------------------------------------------------------------------------

  def save(self, directory: Any, state: Any) -> None:
    """Writes a checkpoint of `state` with orbax-checkpoint, the step's fp32 masters included.

    The fp32 master copies of bf16/f16 params updated on the host live in the step, not in the
    state; they are saved beside it, so that `restore` continues the run bit for bit. Each
    leaf is written from the memory it lives in (a pinned_host leaf from host memory). Returns
    once the files are written; `state` may then be passed to the next step.

    Args:
      directory: a path that does not exist yet (for example one per step).
      state: the state the last step returned, or a placed or initialised one (its masters are
        then derived from its params, as the next step would).

    Raises:
      ValueError: the step has no plan yet (place, init or run it first), or `directory` exists.
      ImportError: orbax-checkpoint is not installed.
    """
    if self.plan is None:
      raise ValueError("OffloadedStep.save: the step has no plan yet; place, init or run the "
                       "state first")
    state = placing.as_arrays("OffloadedStep.save", state)
    inv_lib.check_leaves("OffloadedStep.save", state)
    leaves = jax.tree_util.tree_leaves(state)
    self._masters.refresh(leaves, leaves)
    checkpoint_lib.save(directory, state, self._masters.checkpoint_items())

  def restore(self, directory: Any, state: Any, *, example_args: Sequence[Any] = ()) -> Any:
    """Reads a checkpoint written by `save`: the state, each leaf restored straight into its
    planned memory kind, and the step's fp32 masters.

    Args:
      directory: the checkpoint's path.
      state: the state's structure, shapes and dtypes: a state of the run, or an abstract one
        (`jax.eval_shape(init_fn, ...)`); its values are not read.
      example_args: the step's other arguments (e.g. a batch), needed to plan the step the
        first time (a new process).

    Returns:
      The restored state, placed as `place` would place it; the next step continues from it as
      from the saved state.

    Raises:
      TypeError: no example arguments before a plan exists.
      FileNotFoundError: no checkpoint at `directory`.
      jaxtier.CheckpointMismatchError (a ValueError): the checkpoint holds a state of another
        structure, shapes or dtypes; it names the first leaf that differs, before the step is
        traced for the state given.
      ValueError: the fp32 masters differ (the step was planned another way than the saved one).
    """
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), state)
    checkpoint_lib.check_like(directory, abstract)  # before the step is traced for it
    leaves, treedef = self._plan_abstract(
        abstract, example_args, "restore", "the state has",
        "step.restore(path, state, example_args=(batch,))")
    targets = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
               for x, sh in zip(leaves, self._programs.state_shardings)]
    restored, masters = checkpoint_lib.restore(
        directory, jax.tree_util.tree_unflatten(treedef, targets),
        self._masters.checkpoint_targets(leaves))
    self._masters.restored(masters, jax.tree_util.tree_leaves(restored))
    self.last_state = self.last_metrics = None  # a new run starts from this state
    return restored

  def _plan_abstract(self, abstract: Any, example_args: Sequence[Any], api: str, has: str,
                     example: str) -> tuple[list[Any], Any]:
    """Plans the step for an abstract state (unless planned) and returns its (leaves, treedef).

    Raises:
      TypeError: no example arguments before a plan exists.
      ValueError: another number of leaves than planned.
    """
    if self.plan is None and not example_args:
      raise TypeError(f"OffloadedStep.{api}: the step has no plan yet; pass example arguments "
                      f"for tracing it, e.g. `{example}`")
    if example_args:
      self._ensure_plan(abstract, tuple(example_args), abstract=True)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    if len(leaves) != len(self.plan.leaves):
      raise ValueError(f"OffloadedStep.{api}: {has} {len(leaves)} leaves; the step was planned "
                       f"for {len(self.plan.leaves)}")
    return leaves, treedef

  # -- running -----------------------------------------------------------------------------
  def __call__(self, state: Any, *args: Any) -> tuple[Any, Any]:
    """Runs one step: `(state, *args) -> (new_state, metrics)`, the state donated.

    Arguments are positional, as the wrapped step takes them. Python numbers in the state
    (Flax `TrainState.step`) become 0-d arrays in the returned state.

    Raises:
      ValueError: a state leaf was already donated to an earlier step (named by path).
      TypeError: a non-array state leaf.
    """
    state = placing.as_arrays("jaxtier.offload", state)
    inv_lib.check_leaves("jaxtier.offload", state)
    self._ensure_plan(state, args)
    self._check_arg_memory_kinds(args)
    leaves = jax.tree_util.tree_leaves(state)
    moved = placing.for_step(leaves, self._programs.state_shardings)
    self._masters.refresh(leaves, moved)
    return self._runner.run(moved, jax.tree_util.tree_leaves(args), keep=self._keep)

  def _keep(self, state: Any, metrics: Any) -> None:
    """Takes a step's new state and metrics (before a Ctrl-C held during the step is raised)."""
    self.last_state, self.last_metrics = state, metrics

  def lower(self, state: Any, *args: Any):
    """`jax.stages.Lowered` of the step's compute program (forward, backward, streaming).

    This is the program that holds the device memory: `.compile().memory_analysis()` gives
    its peak. The fused host updates run in a second program (`lower_update`). The state need
    not be placed yet, nor exist: its leaves may be `jax.ShapeDtypeStruct`s (as
    `jax.jit(step).lower(shapes, batch)` takes them), lowered with the plan's shardings.
    """
    self._ensure_plan(state, args, abstract=any(
        isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(state)))
    specs = self._programs.state_specs(state)
    return self._programs.compute.lower(self._programs.split.compute_inputs(
        specs, jax.tree_util.tree_leaves(args), self._runner.scratch_avals(),
        self._programs.master_specs(specs)))

  def lower_update(self, state: Any, *args: Any):
    """`jax.stages.Lowered` of the step's fused host-update program (its custom calls)."""
    self._ensure_plan(state, args)
    leaves = jax.tree_util.tree_leaves(state)
    compiled = self.lower(state, *args).compile()
    feed_sh = list(compiled.output_shardings.feeds)
    feed_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in compiled.out_info.feeds]
    update = self._programs.update(feed_sh)
    return update.lower(self._programs.split.update_inputs(
        leaves, self._programs.master_specs(leaves), feed_avals, self._runner.scratch_avals()))
