"""`OffloadedStep`: places the state and runs the planned step (planning: `pipeline`).

The step delegates to its collaborators: `PlanCache` (one plan per input signature),
`MasterCopies` (the fp32 masters), `StepRunner` (dispatch, Ctrl-C, failure notes, timing) and
`placing` (the state's leaves in their planned shardings). Leaves that are not arrays are
static (`analysis/statics.py`): the plan and the programs see the array leaves alone, and the
static ones are handed to the wrapped step, and back in its outputs, as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from jaxtier._src import checkpoint as checkpoint_lib
from jaxtier._src import jax_compat as jc
from jaxtier._src import pipeline
from jaxtier._src.analysis import inventory as inv_lib
from jaxtier._src.analysis import statics
from jaxtier._src.analysis import step_costs
from jaxtier._src.errors import CheckpointMismatchError
from jaxtier._src.lowering import compiled as compiled_lib
from jaxtier._src.options import OffloadOptions
from jaxtier._src.planning.plan import Plan
from jaxtier._src.runtime import placing
from jaxtier._src.runtime.masters import MasterCopies
from jaxtier._src.runtime.plan_cache import PlanCache
from jaxtier._src.runtime.runner import StepRunner
from jaxtier._src.vocab import MemoryKind


def _key_names(path: str) -> tuple[str, ...]:
  """The keys of a path as `jax.tree_util.keystr` writes it (`['a'].b[0]`: ('a', 'b', '0')),
  whatever form each key takes (a checkpoint's metadata holds them as dict keys)."""
  return tuple(a or b or c for a, b, c in re.findall(r"\['([^']*)'\]|\.(\w+)|\[(\d+)\]", path))


class _Entry(NamedTuple):
  """One plan of the step (`PlanCache`'s value): the plan and programs, and the step call
  that was traced for it (its static outputs)."""

  planned: "pipeline.Planned"
  call: statics.StepCall


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

  Leaves that are not arrays (callables, `functools.partial`s, strings, a module's Python
  bools and ints) are static, as `eqx.filter_jit` treats them: not traced, placed or counted,
  passed to the step as they are and kept in the state it returns; other static values plan
  the step again, as `jax.jit` re-traces for new static arguments. A Python number of the state
  that the step changes (Flax's `TrainState.step` before the first step) is traced as a 0-d
  array, as `jax.jit` traces it; Python ints and floats among the other arguments are traced
  too, bools are static (`analysis/statics.py`).

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
    self._call: "statics.StepCall | None" = None  # the plan's traced step (static outputs)
    self._counters: set[str] = set()  # state paths of Python numbers the step changes
    self._planned: "pipeline.Planned | None" = None
    self._programs: "compiled_lib.StepPrograms | None" = None  # the planned step's programs
    self._masters = MasterCopies()
    self._runner: "StepRunner | None" = None
    functools.update_wrapper(self, fn)

  # -- planning ----------------------------------------------------------------------------
  def _split(self, state: Any, args: Sequence[Any] = (), abstract: bool = False
             ) -> tuple[statics.Split, statics.Split]:
    """The state and the other arguments split into their arrays and static leaves
    (`abstract`: the state's Python numbers that are traced become `jax.ShapeDtypeStruct`s)."""
    state = statics.split(state, lambda path, x: path in self._counters)
    if abstract:
      state = dataclasses.replace(state, arrays=jax.tree_util.tree_map(
          lambda x: x if isinstance(x, jax.ShapeDtypeStruct)
          else jax.ShapeDtypeStruct(np.shape(x), x.dtype), state.arrays))
    return state, statics.split(tuple(args), statics.traced_argument)

  def _ensure_plan(self, state: Any, args: Sequence[Any], abstract: bool = False
                   ) -> tuple[statics.Split, statics.Split]:
    """Plans the step for these inputs (`pipeline.plan_step`) unless planned for them
    (`abstract`: the state's leaves are `jax.ShapeDtypeStruct`s); returns them split as the
    plan takes them (`_split`)."""
    while True:
      state_s, args_s = self._split(state, args, abstract)

      def make(changes, state_s=state_s, args_s=args_s):
        call = statics.StepCall(self._fn, state_s, args_s, "jaxtier.offload")
        return _Entry(pipeline.plan_step(call, self._options, state_s.arrays, args_s.arrays,
                                         changes=changes, abstract=abstract), call)
      try:
        if self._plans.select(state_s.arrays, args_s.arrays, make,
                              static=(state_s.key, args_s.key)):
          self._use(self._plans.current)
        return state_s, args_s
      except statics.NumbersChanged as e:  # counters: traced again as arrays
        self._counters.update(e.paths)

  def _use(self, entry: _Entry) -> None:
    """Makes `entry` the step's plan: a fresh runner (buffers, timing) and fp32 masters."""
    planned, self._call = entry
    # The fp32 masters are state the caller does not hold: a new plan (new input shapes) keeps
    # them for the params it still keeps masters for (`MasterCopies.refresh`), else the next
    # step would re-derive them from the rounded bf16 params.
    programs = planned.programs
    self._masters = MasterCopies(programs.master_indices, programs.master_shardings,
                                 carried=self._masters.carried())
    self._planned, self.plan, self._programs = planned, planned.plan, programs
    self._runner = StepRunner(planned, self._masters, on_measured=self._measured)

  def _measured(self, secs: float) -> None:
    """Records the measured step (seconds) in the plan; a kept time of the device-only step
    that it contradicts is dropped, to be timed again (`step_costs.check_step_time`)."""
    self.plan = dataclasses.replace(self.plan, measured_step_secs=secs)
    step_costs.check_step_time(self._planned.step_time_key, self.plan.predicted_step_secs, secs)

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
      state: the training state pytree (its leaves that are not arrays are static: kept as
        they are).
      *example_args: the step's other arguments (e.g. a batch), needed to trace and plan the
        step the first time; later calls may omit them.

    Returns:
      A pytree like `state` whose array leaves carry `NamedSharding`s with memory kind
      'device' or 'pinned_host'. `place` itself donates nothing, but as `jax.device_put`
      does, it returns a leaf already in its planned memory kind as it is: the step donates
      the placed state, and with it those leaves of the input. Copy the input first
      (`jax.tree.map(jnp.copy, state)`) where it is needed after the step.

    Raises:
      TypeError: no example arguments before a plan exists.
      jaxtier.PlanError / AdmissionError: from planning; nothing has been allocated then.
    """
    if self.plan is None and not example_args:
      raise TypeError("OffloadedStep.place: the step has no plan yet; pass example arguments "
                      "for tracing it, e.g. `step.place(state, batch)`")
    if example_args:
      split, _ = self._ensure_plan(state, example_args)
    else:
      split, _ = self._split(state)
    inv_lib.check_leaves("OffloadedStep.place", split.arrays)
    leaves, treedef = jax.tree_util.tree_flatten(split.arrays)
    if not any(jc.memory_kind_of(x) == MemoryKind.PINNED_HOST for x in leaves):
      compiled_lib.reserve_pinned_pool(self.plan, self._programs.state_shardings)
    placed = [placing.put(x, s, lp) for x, s, lp in zip(leaves, self._programs.state_shardings,
                                                         self.plan.leaves)]
    self._masters.refresh(leaves, placed)
    self.last_state = self.last_metrics = None  # a new run starts from this state
    return statics.merge(jax.tree_util.tree_unflatten(treedef, placed), split.static)

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
      ValueError: `init_fn` returns another structure than the one planned (the message names
        the leaves that differ).
      jaxtier.PlanError / AdmissionError: from planning; nothing has been allocated then.
    """
    split, leaves, treedef = self._plan_abstract(
        statics.eval_shape(init_fn, *init_args), example_args, "init", "init_fn returns",
        "step.init(init_fn, key, example_args=(batch,))")
    planned = split.arrays
    counters = set(self._counters)

    def arrays_of_init(*args):
      # Only its arrays, in the structure planned: a node's static data (a partial that a
      # module holds) is a new object in each call, equal only to itself.
      got = statics.split(init_fn(*args), lambda path, x: path in counters, in_trace=True)
      diff = statics.structure_diff(planned, got.arrays, ("state planned", "state init_fn "
                                                          "returns"))
      if diff:
        raise ValueError("OffloadedStep.init: init_fn returns another state than the one "
                         f"planned: {'; '.join(diff)}")
      return jax.tree_util.tree_unflatten(treedef, jax.tree_util.tree_leaves(got.arrays))

    made: list[Any] = [None] * len(leaves)
    compiled_lib.reserve_pinned_pool(self.plan, self._programs.state_shardings)
    for indices, program in compiled_lib.initializers(
        arrays_of_init, self.plan, self._programs.state_shardings, treedef):
      for i, x in zip(indices, program(*init_args)):
        made[i] = x
    self._masters.refresh(made, made)
    self.last_state = self.last_metrics = None  # a new run starts from this state
    return statics.merge(jax.tree_util.tree_unflatten(treedef, made), split.static)

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
    state, _ = self._split(state)
    inv_lib.check_leaves("OffloadedStep.save", state.arrays)
    leaves = jax.tree_util.tree_leaves(state.arrays)
    self._masters.refresh(leaves, leaves)
    checkpoint_lib.save(directory, state.arrays, self._masters.checkpoint_items())

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
    while True:  # before the step is traced for it
      given, _ = self._split(state, abstract=True)
      try:
        checkpoint_lib.check_like(directory, given.arrays)
        break
      except CheckpointMismatchError as e:
        # A Python number the saved run traced (a counter, as the step changes it) is an
        # array in the checkpoint: traced here too.
        numbers = {_key_names(p): p for p, x in zip(
            given.paths, jax.tree_util.tree_leaves(given.static)) if statics.is_number(x)}
        counter = numbers.get(_key_names(e.leaf)) if e.given is None and e.saved else None
        if counter is None or counter in self._counters:
          raise
        self._counters.add(counter)
    split, leaves, treedef = self._plan_abstract(
        state, example_args, "restore", "the state has",
        "step.restore(path, state, example_args=(batch,))")
    targets = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
               for x, sh in zip(leaves, self._programs.state_shardings)]
    restored, masters = checkpoint_lib.restore(
        directory, jax.tree_util.tree_unflatten(treedef, targets),
        self._masters.checkpoint_targets(leaves))
    self._masters.restored(masters, jax.tree_util.tree_leaves(restored))
    self.last_state = self.last_metrics = None  # a new run starts from this state
    return statics.merge(restored, split.static)

  def _plan_abstract(self, abstract: Any, example_args: Sequence[Any], api: str, has: str,
                     example: str) -> tuple[statics.Split, list[Any], Any]:
    """Plans the step for an abstract state (its arrays as `jax.ShapeDtypeStruct`s, unless
    planned) and returns it split (`_split`) and its arrays' (leaves, treedef).

    Raises:
      TypeError: no example arguments before a plan exists.
      ValueError: another number of leaves than planned.
    """
    if self.plan is None and not example_args:
      raise TypeError(f"OffloadedStep.{api}: the step has no plan yet; pass example arguments "
                      f"for tracing it, e.g. `{example}`")
    if example_args:
      split, _ = self._ensure_plan(abstract, tuple(example_args), abstract=True)
    else:
      split, _ = self._split(abstract, abstract=True)
    leaves, treedef = jax.tree_util.tree_flatten(split.arrays)
    if len(leaves) != len(self.plan.leaves):
      raise ValueError(f"OffloadedStep.{api}: {has} {len(leaves)} leaves; the step was planned "
                       f"for {len(self.plan.leaves)} (static leaves not counted)")
    return split, leaves, treedef

  # -- running -----------------------------------------------------------------------------
  def __call__(self, state: Any, *args: Any) -> tuple[Any, Any]:
    """Runs one step: `(state, *args) -> (new_state, metrics)`, the state donated.

    Arguments are positional, as the wrapped step takes them. Leaves that are not arrays are
    static (the class docstring); a Python number of the state that the step changes (Flax
    `TrainState.step`) becomes a 0-d array in the returned state.

    Raises:
      ValueError: a state leaf was already donated to an earlier step (named by path).
      TypeError: called under a JAX transformation.
    """
    state_s, args_s = self._ensure_plan(state, args)
    inv_lib.check_leaves("jaxtier.offload", state_s.arrays)
    self._check_arg_memory_kinds(args_s.arrays)
    leaves = jax.tree_util.tree_leaves(state_s.arrays)
    moved = placing.for_step(leaves, self._programs.state_shardings)
    self._masters.refresh(leaves, moved)
    return self._runner.run(moved, jax.tree_util.tree_leaves(args_s.arrays), keep=self._keep,
                            finish=self._call.merge_outputs)

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
    state, args = self._ensure_plan(state, args, abstract=any(
        isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(state)))
    specs = self._programs.state_specs(state.arrays)
    return self._programs.compute.lower(self._programs.split.compute_inputs(
        specs, jax.tree_util.tree_leaves(args.arrays), self._runner.scratch_avals(),
        self._programs.master_specs(specs)))

  def lower_update(self, state: Any, *args: Any):
    """`jax.stages.Lowered` of the step's fused host-update program (its custom calls)."""
    split, _ = self._ensure_plan(state, args)
    leaves = jax.tree_util.tree_leaves(split.arrays)
    compiled = self.lower(state, *args).compile()
    feed_sh = list(compiled.output_shardings.feeds)
    feed_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in compiled.out_info.feeds]
    update = self._programs.update(feed_sh)
    return update.lower(self._programs.split.update_inputs(
        leaves, self._programs.master_specs(leaves), feed_avals, self._runner.scratch_avals()))
