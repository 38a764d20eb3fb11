"""`StepRunner`: one plan's programs run over the placed state, Ctrl-C held while they run."""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src import pipeline
from jaxtier._src.lowering import rewrite as rewrite_lib
from jaxtier._src.runtime import placing
from jaxtier._src.runtime.masters import MasterCopies

log = logging.getLogger("jaxtier")

# Calls 2 .. 1 + MEASURED_STEPS of an offloaded step are timed (synchronised) and reported
# against the plan's prediction (`Plan.measured_step_secs`).
MEASURED_STEPS = 3

INTERRUPTED_NOTE = (
    "jaxtier: interrupted during a step, after its inputs were donated: the step ran to its "
    "end, and its new state is `step.last_state` (its metrics `step.last_metrics`); continue "
    "from it: `state = step.last_state`")


# The steps whose late predicates (a clip that binds, a non-finite gradient) the guess is
# taken from, and those whose misses decide whether to guess at all.
GUESS_FROM = 4
MISS_WINDOW = 8


class Guesser:
  """Guesses the late predicates of the next step from the recent ones.

  The guess is the assignment the last `GUESS_FROM` steps took most often (the latest among
  equal counts): a run whose clip stops binding guesses again two steps later. Before any step
  it is the first of `guesses` (all true: the clip does not bind, the gradients are finite).
  No guess (the step runs the serial schedule) where that assignment is not one of `guesses`,
  or where more than `max_miss` of the last `MISS_WINDOW` steps took another: a wrong guess
  costs its speculative step and the serial one.

  Attributes:
    history: the recent steps' predicates, oldest first.
    tried, missed: the steps guessed, and those whose guess missed.
    unguessed: the steps run with no guess (the serial schedule).
  """

  def __init__(self, guesses: Sequence[tuple[float, ...]], max_miss: float):
    self.guesses = tuple(tuple(g) for g in guesses)
    self.max_miss = max_miss
    self.history: collections.deque = collections.deque(maxlen=MISS_WINDOW)
    self.tried = self.missed = self.unguessed = 0

  def guess(self) -> "tuple[float, ...] | None":
    if not self.history:
      return self.guesses[0] if self.guesses else None
    recent = list(self.history)[-GUESS_FROM:]
    counts = collections.Counter(recent)
    best = max(counts.values())
    pick = next(g for g in reversed(recent) if counts[g] == best)
    miss = sum(g != pick for g in self.history) / len(self.history)
    if pick not in self.guesses or miss > self.max_miss:
      return None
    return pick

  def saw(self, actual: tuple[float, ...], guessed: "tuple[float, ...] | None") -> None:
    """Records a step's predicates, and whether a guess made for it held."""
    self.history.append(actual)
    if guessed is None:
      self.unguessed += 1
    else:
      self.tried += 1
      self.missed += actual != guessed


class StepRunner:
  """Runs one plan's step programs (`StepPrograms`) over the placed state's leaves.

  It dispatches `compute`, then (once `compute` succeeded) `update`, as `lowering/calling.py`
  declares them, then the metrics that read what the update made (`rewrite.TailProgram`);
  holds Ctrl-C from the dispatch until the new state is taken; adds to a failed step's error
  what it left of the state; times calls 2 .. 1 + MEASURED_STEPS.

  Attributes:
    scratch: the pinned_host gradient buffers (`StreamSchedule.scratch`): allocated by
      `ensure_scratch`, donated to `compute` and returned by it each step.
    calls: the steps run.
    step_times: the timed steps' seconds (synchronised), at most MEASURED_STEPS.
  """

  def __init__(self, planned: "pipeline.Planned", masters: MasterCopies,
               on_measured: Callable[[float], None] = lambda secs: None):
    """Args:
      planned: the plan and its programs.
      masters: the fp32 masters the programs read and write (updated in place).
      on_measured: called with the median of the timed steps' seconds once all are timed.
    """
    self._programs = planned.programs
    self._plan = planned.plan
    self._out_treedef = planned.inventory.out_treedef
    self._num_part_outs = len(planned.inventory.closed_jaxpr.jaxpr.outvars)
    tail = planned.inventory.tail
    self._tail = rewrite_lib.TailProgram(tail) if tail is not None else None
    self._masters = masters
    self._on_measured = on_measured
    self.scratch: list[jax.Array] = []
    self.calls = 0
    self.step_times: list[float] = []
    spec = self._programs.speculative  # built where the plan speculates
    self.guesser = (Guesser(spec.split.guesses, self._plan.speculation.max_miss)
                    if spec is not None else None)
    self._spares: dict[tuple[str, int], jax.Array] = {}

  def ensure_scratch(self) -> None:
    """Allocates the pinned_host buffers that receive streamed leaves' gradients (once)."""
    stream = self._programs.stream
    if len(self.scratch) != len(stream.scratch):
      self.scratch = [jax.device_put(np.zeros(s.shape, s.dtype), sh)
                      for s, sh in zip(stream.scratch, self._programs.scratch_shardings)]

  def scratch_avals(self) -> list[Any]:
    """The gradient buffers, or their shapes and dtypes before they exist (for lowering)."""
    return self.scratch or [jax.ShapeDtypeStruct(s.shape, s.dtype)
                            for s in self._programs.stream.scratch]

  def run(self, moved: Sequence[Any], arg_leaves: Sequence[Any],
          keep: Callable[[Any, Any], None],
          finish: Callable[[Any, Any], tuple[Any, Any]] = lambda s, m: (s, m)
          ) -> tuple[Any, Any]:
    """Runs one step: `(new_state, metrics)` of the state's flat leaves `moved` (placed as
    planned, no buffer twice: `placing.for_step`; donated) and the other arguments' flat
    leaves, as `finish(new_state, metrics)` makes them of the programs' (the static leaves put
    back: `statics.StepCall.merge_outputs`).

    From the dispatch of `compute` (which consumes the device leaves) until `keep(new_state,
    metrics)` has taken the new state, Ctrl-C is held: an interrupt there would lose the state
    given (donated) and the state made (not yet returned). A held one is then raised as
    KeyboardInterrupt, with a note saying where the new state is.

    Raises:
      Exception: what a program raised, with a note of what it left of the state
        (`failure_note`).
    """
    self.ensure_scratch()
    self.calls += 1
    timing = 2 <= self.calls <= 1 + MEASURED_STEPS  # the first call compiles
    held = HeldInterrupt()
    try:
      result = finish(*self._dispatch(moved, arg_leaves, timing))
      keep(*result)
    except BaseException:
      held.release()
      raise
    # The handler comes back as the last thing the step does.
    return held.release(result, note=INTERRUPTED_NOTE)

  def _dispatch(self, moved: Sequence[Any], arg_leaves: Sequence[Any], timing: bool
                ) -> tuple[Any, Any]:
    """The step's programs over the placed state leaves `moved`: (new state, metrics)."""
    t0 = time.perf_counter()
    guess = self.guesser.guess() if self.guesser is not None else None
    if guess is not None:
      result = self._speculate(moved, arg_leaves, guess)  # records the predicates
      if result is not None:
        if timing:
          self._record_step_time(result[0], time.perf_counter() - t0)
        return result[1]
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
    masters = self._masters.by_index()
    inputs = split.compute_inputs(moved, arg_leaves, self.scratch, masters)
    try:
      computed = self._programs.compute(inputs)
      self.scratch = list(computed.scratch)
      if split.has_update or split.layered_host or split.layered_masters:
        jax.block_until_ready(computed)
    except Exception as e:
      self.scratch = []  # donated to the failed program; fresh buffers next time
      if split.layered_host or split.layered_masters:
        self._masters.forget()  # donated too: derived again
      if hasattr(e, "add_note"):
        e.add_note(self.failure_note(inputs.device_leaves))
      raise
    if self.guesser is not None and guess is None:
      self.guesser.saw(tuple(float(x) for x in computed.guards), None)
    outs, result = self._finish(self._programs, moved, masters, computed)
    if timing:
      self._record_step_time(outs, time.perf_counter() - t0)
    return result

  def _finish(self, programs: Any, moved: Sequence[Any], masters: dict[int, Any],
              computed: Any) -> tuple[list[Any], tuple[Any, Any]]:
    """Once `programs.compute` has made `computed`: runs their update program (where they have
    one), takes the masters the two made, and returns the step's flat outputs and (new state,
    metrics)."""
    split = programs.split
    updated = None
    if split.has_update:
      update = programs.update([x.sharding for x in computed.feeds])
      updated = update(split.update_inputs(moved, masters, computed.feeds, self.scratch))
    outs = split.assemble(moved, computed, updated, self._num_part_outs)
    self._masters.update(split.new_masters(computed, updated), outs)
    if self._tail is not None:  # the metrics that read what the update made
      tail = self._tail.tail
      outs = tail.outputs_of(outs, self._tail([outs[k] for k in tail.inputs]))
    out = jax.tree_util.tree_unflatten(self._out_treedef, outs)
    return outs, (out[0], out[1])

  def _speculate(self, moved: Sequence[Any], arg_leaves: Sequence[Any],
                 guess: tuple[float, ...]
                 ) -> "tuple[list[Any], tuple[Any, Any]] | None":
    """The step run speculatively (`StepPrograms.speculative`): its guarded updates layered on
    the guessed late predicates, written to spare buffers while the state is only read. Once
    its compute program has run, the predicates it made are compared with the guess: equal,
    the step's outputs are those of the serial schedule bit for bit, the spares hold the new
    values and the old buffers become the next step's spares; different, the spares are
    dropped back and None is returned: the caller runs the serial schedule over the intact
    state. A compute program that fails also leaves the state intact (its error is raised,
    noted so). Returns what `_finish` does."""
    spec = self._programs.speculative
    split = spec.split
    masters = self._masters.by_index()
    try:
      spares = self._spare_buffers(spec, moved, masters)
    except Exception as e:  # pylint: disable=broad-except  (XLA's allocator errors vary)
      log.warning("jaxtier: no room for the spare buffers of the guessed updates (%s); the "
                  "clipped steps run the serial schedule", str(e).splitlines()[0][:300])
      self.guesser, self._spares = None, {}
      return None
    inputs = split.speculative_inputs(moved, arg_leaves, self.scratch, masters, spares)
    try:
      computed = spec.compute(inputs)
      self.scratch = list(computed.scratch)
      jax.block_until_ready(computed)
    except Exception as e:
      self.scratch, self._spares = [], {}  # donated to the failed program
      if _out_of_memory(e):
        # The spares and the undonated device leaves are the guessed step's own memory: the
        # serial schedule (what the plan admitted) runs instead, from now on.
        log.warning("jaxtier: the guessed updates ran out of memory (%s); the clipped steps "
                    "run the serial schedule", str(e).splitlines()[0][:300])
        self.guesser = None
        self.ensure_scratch()
        return None
      if hasattr(e, "add_note"):
        e.add_note("jaxtier: the step failed in its speculative compute program, which only "
                   "reads the state: every leaf of the state given is intact and usable.")
      raise
    actual = tuple(float(x) for x in computed.guards)
    self.guesser.saw(actual, guess)
    written = self._written(split, computed)
    if actual != guess:
      self._spares = written  # the guessed values: overwritten next time
      log.debug("jaxtier: late predicates %s, guessed %s: the serial schedule runs", actual,
                guess)
      return None
    # The buffers the state held become the next step's spares (the caller gave them:
    # donated, as the serial schedule's programs take them).
    self._spares = split.by_spare_key(moved, masters)
    return self._finish(spec, moved, masters, computed)

  @staticmethod
  def _written(split: Any, computed: Any) -> dict[tuple[str, int], jax.Array]:
    """The spare buffers a speculative compute program handed back, by key."""
    leaves = (dict(zip(split.layered_host, computed.layered_host))
              | dict(zip(split.spare_device, computed.first[:len(split.spare_device)])))
    return split.by_spare_key(leaves, dict(zip(split.layered_masters, computed.layered_masters)))

  def _spare_buffers(self, spec: Any, moved: Sequence[Any], masters: dict[int, Any]
                     ) -> dict[tuple[str, int], jax.Array]:
    """One spare buffer per buffer the speculative updates write: those kept from the last
    step, else new ones (zeros, made where they live). A kept one that is the storage of a
    leaf of this step's state (the caller passed an old state again) is replaced."""
    split = spec.split
    likes = split.by_spare_key(moved, masters)
    shardings = split.by_spare_key(spec.state_shardings,
                                   {i: m.sharding for i, m in masters.items()})
    taken = {placing.buffer_key(x) for x in list(moved) + list(masters.values())
             if isinstance(x, jax.Array)}
    out = {}
    for key, like in likes.items():
      sh = shardings[key]
      x = self._spares.get(key)
      if (x is None or x.is_deleted() or x.shape != like.shape or x.dtype != like.dtype
          or placing.buffer_key(x) in taken):
        x = jax.jit(lambda s=like.shape, d=like.dtype: jnp.zeros(s, d), out_shardings=sh)()
      out[key] = x
    return out

  def failure_note(self, device_leaves: Sequence[Any]) -> str:
    """What a failed compute program left of the state (added to its exception), given the
    device leaves passed to it: those it consumed, and the host leaves it may have left partly
    updated (those updated layer by layer in it), named by path."""
    split = self._programs.split
    deleted = sum(x.is_deleted() for x in device_leaves if isinstance(x, jax.Array))
    device_part = (f"{deleted} of its {len(device_leaves)} device leaves were donated to the "
                   "failed program (as with jax.jit(donate_argnums=...))." if deleted else
                   "its device leaves were not consumed.")
    written = sorted(set(split.layered_host) | set(split.overlap.device_leaves)
                     | set(split.layered_masters))
    if not written:
      return ("jaxtier: the step failed before its host updates ran: the state's pinned_host "
              "leaves are intact and usable; " + device_part)
    paths = ", ".join(self._plan.leaves[i].path for i in written[:6]) + (
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
    self.step_times.append(dispatch_secs + time.perf_counter() - t0)
    if len(self.step_times) == MEASURED_STEPS:
      measured = float(np.median(self.step_times))
      self._on_measured(measured)
      predicted = self._plan.predicted_step_secs
      log.info("jaxtier: step time measured %.4g ms (median of %d)%s", measured * 1e3,
               MEASURED_STEPS, "" if not predicted else
               f", predicted {predicted * 1e3:.4g} ms ({predicted / measured:.3g} of measured)")


def _out_of_memory(error: BaseException) -> bool:
  """Whether `error` is an allocator's out-of-memory error (XLA's RESOURCE_EXHAUSTED)."""
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


class HeldInterrupt:
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
