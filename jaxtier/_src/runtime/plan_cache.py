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
  and the other arguments.

  Attributes:
    current: the plan (`pipeline.Planned`) selected last; None before the first `select`.
  """

  def __init__(self, capacity: int = PLAN_CACHE):
    self.capacity = capacity
    self.current: "pipeline.Planned | None" = None
    self._current_key: Any = None
    # Most recently selected last.
    self._kept: collections.OrderedDict[Any, pipeline.Planned] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._kept)

  def select(self, state: Any, args: Sequence[Any],
             make: Callable[[str], "pipeline.Planned"]) -> bool:
    """Makes `current` the plan for these inputs: the current one if it was made for their
    signature, else a kept one, else `make(changes)` (`changes`: what differs from the current
    plan's inputs, '' for the first plan), kept from then on (the least recently selected one
    dropped beyond `capacity`).

    Args:
      state, args: the step's state and other arguments (arrays or `jax.ShapeDtypeStruct`s).
      make: plans the step for these inputs (`pipeline.plan_step`).

    Returns:
      Whether `current` changed.

    Raises:
      What `make` raises; `current` is then unchanged.
    """
    key = pipeline.signature(state, args)
    if self.current is not None and key == self._current_key:
      return False
    changes = "" if self.current is None else pipeline.changes(
        self._current_key, key, state, args)
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
