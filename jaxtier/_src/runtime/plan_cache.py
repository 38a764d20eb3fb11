"""`PlanCache`: the step's plans, one per input signature (the most recent ones)."""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Sequence

from jaxtier._src import pipeline

log = logging.getLogger("jaxtier")

# Plans kept per OffloadedStep, one per input shapes (the most recent ones).
PLAN_CACHE = 4


class PlanCache:
  """The plans of the last `capacity` input signatures, as `jax.jit` keeps one executable per
  input shape: a batch that alternates between shapes plans each once.

  A signature (`pipeline.signature`) is the pytree structures, shapes and dtypes of the state
  and the other arguments, and their static leaves (`statics.Split.key`), as `jax.jit` keys
  its executables by static arguments too.

  Attributes:
    current: what `make` returned for the inputs selected last (`OffloadedStep`'s plan and
      the traced step call); None before the first `select`.
  """

  def __init__(self, capacity: int = PLAN_CACHE):
    self.capacity = capacity
    self.current: Any = None
    self._current_key: Any = None
    # Most recently selected last.
    self._kept: collections.OrderedDict[Any, Any] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._kept)

  def select(self, state: Any, args: Sequence[Any], make: Callable[[str], Any],
             static: Any = ()) -> bool:
    """Makes `current` the plan for these inputs: the current one if it was made for their
    signature, else a kept one, else `make(changes)` (`changes`: what differs from the current
    plan's inputs, '' for the first plan), kept from then on (the least recently selected one
    dropped beyond `capacity`).

    Args:
      state, args: the step's state and other arguments (arrays or `jax.ShapeDtypeStruct`s).
      make: plans the step for these inputs (`pipeline.plan_step`).
      static: their static leaves, a hashable value (`statics.Split.key`).

    Returns:
      Whether `current` changed.

    Raises:
      What `make` raises; `current` is then unchanged.
    """
    key = (pipeline.signature(state, args), static)
    if self.current is not None and key == self._current_key:
      return False
    changes = ""
    if self.current is not None:
      changes = pipeline.changes(self._current_key[0], key[0], state, args)
      if key[1] != self._current_key[1]:
        changes = "; ".join(filter(None, [changes, "the static (non-array) leaves"]))
    planned = self._kept.get(key)
    if planned is not None:
      log.info("jaxtier: the step's inputs changed since the last call (%s): using the plan "
               "made for these shapes before", changes)
    else:
      if changes:
        log.warning("jaxtier: the step's inputs changed since they were planned (%s): "
                    "re-tracing and re-planning, as jax.jit re-traces", changes)
      planned = make(changes)
    self._kept[key] = planned
    self._kept.move_to_end(key)
    while len(self._kept) > self.capacity:
      self._kept.popitem(last=False)
    self.current, self._current_key = planned, key
    return True
