"""`OffloadedStep`: places the state and runs the planned step (planning: `pipeline`)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import signal
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src import checkpoint as checkpoint_lib
from jaxtier._src import pipeline
from jaxtier._src.analysis import inventory as inv_lib
from jaxtier._src.errors import AdmissionError
from jaxtier._src.lowering import compiled as compiled_lib
from jaxtier._src.options import OffloadOptions
from jaxtier._src.planning.plan import LeafPlan, Plan
from jaxtier._src.units import format_bytes
from jaxtier._src.vocab import MemoryKind

log = logging.getLogger("jaxtier")

# Calls 2 .. 1 + MEASURED_STEPS of an offloaded step are timed (synchronised) and reported
# against the plan's prediction (`Plan.measured_step_secs`).
MEASURED_STEPS = 3
# Plans kept per OffloadedStep, one per input shapes (the most recent ones).
PLAN_CACHE = 4


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

  def __init__(self, fn: Callable[..., Any], options: OffloadOptions):
    self._fn = fn
    self._options = options
    self.plan: "Plan | None" = None
    self._planned: "pipeline.Planned | None" = None
    self._programs: "compiled_lib.StepPrograms | None" = None  # the planned step's programs
    self._calls, self._step_times = 0, []
    self._masters: list[jax.Array] = []
    self._master_sources: tuple[Any, ...] = ()
    # {param leaf index: (master, the param it was the master of)} of the plan before this one.
    self._carried_masters: dict[int, tuple[jax.Array, Any]] = {}
    self.last_state: Any = None
    self.last_metrics: Any = None
    self._scratch: list[jax.Array] = []
    # The plans of the last PLAN_CACHE inputs' shapes, most recent last (as jax.jit keeps one
    # executable per input shape): a batch that alternates between shapes plans each once.
    self._plan_cache: collections.OrderedDict[Any, pipeline.Planned] = collections.OrderedDict()
    functools.update_wrapper(self, fn)

  # -- planning ----------------------------------------------------------------------------
  def _ensure_plan(self, state: Any, args: Sequence[Any], abstract: bool = False) -> None:
    """Plans the step for these inputs (`pipeline.plan_step`) unless planned for them
    (`abstract`: the state's leaves are `jax.ShapeDtypeStruct`s)."""
    sig = pipeline.signature(state, args)
    if self._planned is not None and sig == self._planned.signature:
      return
    changes = "" if self._planned is None else pipeline.changes(
        self._planned.signature, sig, state, args)
    planned = self._plan_cache.get(sig)
    if planned is not None:
      log.info("jaxtier: the step's inputs changed since the last call (%s): using the plan "
               "made for these shapes before", changes)
    else:
      if changes:
        log.warning("jaxtier: the step's inputs changed since they were planned (%s): "
                    "re-tracing and re-planning, as jax.jit re-traces", changes)
      planned = pipeline.plan_step(self._fn, self._options, state, args, changes=changes,
                                   abstract=abstract)
    self._plan_cache[sig] = planned
    self._plan_cache.move_to_end(sig)
    while len(self._plan_cache) > PLAN_CACHE:
      self._plan_cache.popitem(last=False)
    # The fp32 masters are state the caller does not hold: a new plan (new input shapes) keeps
    # them for the params it still keeps masters for (`_refresh_masters`), else the next step
    # would re-derive them from the rounded bf16 params.
    carried = ({} if self._programs is None else
               {i: (m, src) for i, m, src in zip(self._programs.master_indices, self._masters,
                                                 self._master_sources)})
    self._planned, self.plan = planned, planned.plan
    self._programs = planned.programs
    self._calls, self._step_times = 0, []
    self._masters, self._master_sources, self._scratch = [], (), []
    self._carried_masters = carried

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
    state = as_arrays("OffloadedStep.place", state)
    if self.plan is None and not example_args:
      raise TypeError("OffloadedStep.place: the step has no plan yet; pass example arguments "
                      "for tracing it, e.g. `step.place(state, batch)`")
    if example_args:
      self._ensure_plan(state, example_args)
    inv_lib.check_leaves("OffloadedStep.place", state)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if not any(jc.memory_kind_of(x) == MemoryKind.PINNED_HOST for x in leaves):
      compiled_lib.reserve_pinned_pool(self.plan, self._programs.state_shardings)
    placed = [_put(x, s, lp) for x, s, lp in zip(leaves, self._programs.state_shardings,
                                                  self.plan.leaves)]
    self._refresh_masters(leaves, placed)
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
    self._refresh_masters(made, made)
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
    state = as_arrays("OffloadedStep.save", state)
    inv_lib.check_leaves("OffloadedStep.save", state)
    leaves = jax.tree_util.tree_leaves(state)
    self._refresh_masters(leaves, leaves)
    checkpoint_lib.save(directory, state, dict(zip(self._master_keys(), self._masters)))

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
    idx = self._programs.master_indices
    master_targets = {k: jax.ShapeDtypeStruct(leaves[i].shape, jnp.float32, sharding=sh)
                      for k, i, sh in zip(self._master_keys(), idx,
                                          self._programs.master_shardings)}
    restored, masters = checkpoint_lib.restore(
        directory, jax.tree_util.tree_unflatten(treedef, targets), master_targets)
    out = jax.tree_util.tree_leaves(restored)
    self._masters = [masters[k] for k in self._master_keys()]
    self._master_sources = tuple(out[i] for i in idx)
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

  def _master_keys(self) -> list[str]:
    """Checkpoint names of the masters: their param's leaf index."""
    return [f"leaf_{i}" for i in self._programs.master_indices]

  def _refresh_masters(self, original: list[Any], placed: list[Any]) -> None:
    idx = self._programs.master_indices
    if not idx:
      return
    sources = tuple(placed[i] for i in idx)
    if len(self._master_sources) == len(sources) and all(
        a is b for a, b in zip(self._master_sources, sources)):
      return
    carried, self._carried_masters = self._carried_masters, {}
    if self._master_sources:
      log.warning("jaxtier: the state's bf16/f16 params are not the ones the last step returned; "
                  "re-deriving their fp32 master copies from them")

    def master(i, sh):
      if i in carried and original[i] is carried[i][1]:  # planned again: the same param
        return jax.device_put(carried[i][0], sh)
      return jax.device_put(jnp.asarray(original[i], jnp.float32), sh)
    self._masters = [master(i, sh) for i, sh in zip(idx, self._programs.master_shardings)]
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
    state = as_arrays("jaxtier.offload", state)
    inv_lib.check_leaves("jaxtier.offload", state)
    self._ensure_plan(state, args)
    self._check_arg_memory_kinds(args)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    want = self._programs.state_shardings
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
    # From the dispatch of the compute program (which consumes the device leaves) to the new
    # state's assembly, Ctrl-C is held: an interrupt there would lose the state given (donated)
    # and the state made (not yet returned). It is raised once the step has its new state,
    # which `last_state` then holds.
    held = _HeldInterrupt()
    try:
      self.last_state, self.last_metrics = self._run(moved, arg_leaves, timing)
    except BaseException:
      held.release()
      raise
    # The handler comes back as the last thing the step does.
    return held.release((self.last_state, self.last_metrics), note=(
        "jaxtier: interrupted during a step, after its inputs were donated: the step ran to "
        "its end, and its new state is `step.last_state` (its metrics `step.last_metrics`); "
        "continue from it: `state = step.last_state`"))

  def _run(self, moved: list[Any], arg_leaves: list[Any], timing: bool) -> tuple[Any, Any]:
    """The step's programs over the placed state leaves `moved`: (new state, metrics)."""
    t0 = time.perf_counter()
    split = self._programs.split
    # 1. Forward, backward, streaming, and the updates of leaves stacked over layers, layer by
    #    layer (`split.overlap`): those host leaves and masters are donated to it; the other
    #    host leaves are read, not donated (a failure here leaves them intact).
    # 2. The other fused host updates, in place on the donated host leaves and masters. Dispatched
    #    only once the compute program has succeeded: an update fed by a failed program would
    #    still consume (donate) the host leaves. The wait costs one dispatch's latency per step.
    #    A plan with layered host leaves waits too, so that a failure is raised here, with the
    #    note naming the leaves it may have left half-updated; a plan with neither does not
    #    wait (dispatch stays asynchronous).
    master_of = dict(zip(self._programs.master_indices, self._masters))
    inputs = split.compute_inputs(moved, arg_leaves, self._scratch, master_of)
    try:
      computed = self._programs.compute(inputs)
      self._scratch = list(computed.scratch)
      if split.has_update or split.layered_host or split.layered_masters:
        jax.block_until_ready(computed)
    except Exception as e:
      self._scratch = []  # donated to the failed program; fresh buffers next time
      if split.layered_host or split.layered_masters:
        self._masters, self._master_sources = [], ()  # donated too: derived again
      if hasattr(e, "add_note"):
        e.add_note(self._failure_note(inputs.device_leaves))
      raise
    updated = None
    if split.has_update:
      update = self._programs.update([x.sharding for x in computed.feeds])
      updated = update(split.update_inputs(moved, master_of, computed.feeds, self._scratch))
    master_of.update(split.new_masters(computed, updated))
    self._masters = [master_of[i] for i in self._programs.master_indices]
    outs = split.assemble(moved, computed, updated,
                          self._planned.inventory.out_treedef.num_leaves)
    self._master_sources = tuple(outs[i] for i in self._programs.master_indices)
    if timing:
      self._record_step_time(outs, time.perf_counter() - t0)
    out = jax.tree_util.tree_unflatten(self._planned.inventory.out_treedef, outs)
    return out[0], out[1]

  def _failure_note(self, dev: Sequence[Any]) -> str:
    """What a failed compute program left of the state (added to its exception)."""
    split = self._programs.split
    deleted = sum(x.is_deleted() for x in dev if isinstance(x, jax.Array))
    device_part = (f"{deleted} of its {len(dev)} device leaves were donated to the failed "
                   "program (as with jax.jit(donate_argnums=...))." if deleted else
                   "its device leaves were not consumed.")
    written = sorted(set(split.layered_host) | set(split.overlap.device_leaves)
                     | set(split.layered_masters))
    if not written:
      return ("jaxtier: the step failed before its host updates ran: the state's pinned_host "
              "leaves are intact and usable; " + device_part)
    paths = ", ".join(self.plan.leaves[i].path for i in written[:6]) + (
        f" and {len(written) - 6} more" if len(written) > 6 else "")
    return ("jaxtier: the step failed inside its compute program, where leaves stacked over "
            f"layers are updated layer by layer: {paths} (and their fp32 masters) were donated "
            "to it, and any of their layers (or a table's rows) may already hold the next "
            "step's values while others hold this step's. Restore the state from a checkpoint "
            "(`step.restore(path, state)`, or in a new process `step.restore(path, "
            "abstract_state, example_args=(batch,))`); the other pinned_host leaves are "
            "intact. "
            + device_part)

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
    specs = self._programs.state_specs(state)
    return self._programs.compute.lower(self._programs.split.compute_inputs(
        specs, jax.tree_util.tree_leaves(args), self._scratch_avals(),
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
        leaves, self._programs.master_specs(leaves), feed_avals, self._scratch_avals()))

  def _scratch_avals(self) -> list[Any]:
    return self._scratch or [jax.ShapeDtypeStruct(s.shape, s.dtype)
                             for s in self._programs.stream.scratch]

  def _ensure_scratch(self) -> None:
    """Allocates the pinned_host buffers that receive streamed leaves' gradients (once)."""
    stream = self._programs.stream
    if len(self._scratch) != len(stream.scratch):
      self._scratch = [jax.device_put(np.zeros(s.shape, s.dtype), sh)
                       for s, sh in zip(stream.scratch, self._programs.scratch_shardings)]


class _HeldInterrupt:
  """Holds SIGINT (Ctrl-C) from its creation until `release`, which delivers a held one.

  Only in the main thread, and only where a Python handler is installed (the default one
  raises KeyboardInterrupt); elsewhere nothing is held.
  """

  def __init__(self):
    self.pending, self._handler = False, None
    if threading.current_thread() is threading.main_thread():
      handler = signal.getsignal(signal.SIGINT)
      if callable(handler):
        self._handler = signal.signal(signal.SIGINT, self._hold)

  def _hold(self, signum: int, frame: Any) -> None:
    del signum, frame
    self.pending = True

  def release(self, value: Any = None, note: str = "") -> Any:
    """Puts the handler back and returns `value`; where a SIGINT was held, runs the handler
    instead (which raises KeyboardInterrupt, `note` added)."""
    handler, self._handler = self._handler, None
    if handler is None:
      return value
    signal.signal(signal.SIGINT, handler)
    if self.pending:
      try:
        handler(signal.SIGINT, None)
      except BaseException as e:  # pylint: disable=broad-except  (KeyboardInterrupt, re-raised)
        if note and hasattr(e, "add_note"):
          e.add_note(note)
        raise
    return value


def _put(x: Any, sharding: Any, leaf: LeafPlan) -> Any:
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
            "memory, or keep the leaf on the device (policy)"
            if leaf.memory_kind == MemoryKind.PINNED_HOST
            else "lower device_budget so that the plan moves more state to the host")
    error = AdmissionError(
        f"OffloadedStep.place: could not allocate leaf {leaf.path} ({leaf.dtype}"
        f"{list(leaf.shape)}, {format_bytes(leaf.nbytes)} = {leaf.nbytes} bytes per "
        f"device) in {leaf.memory_kind}: {text.splitlines()[0][:300]}. Fix: {hint}.")
    error.limit = ("host_limit" if leaf.memory_kind == MemoryKind.PINNED_HOST
                   else "device_memory")
    raise error from e


def _buffer_key(x: Any) -> Any:
  """What identifies `x`'s storage: its shards' (device, buffer address), else the object."""
  try:
    return tuple((sh.device.id, sh.data.unsafe_buffer_pointer()) for sh in x.addressable_shards)
  except Exception:  # pylint: disable=broad-except  (a backend without raw pointers)
    return id(x)


def as_arrays(api: str, state: Any) -> Any:
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
