"""`PlanCache` alone: one plan per input signature, the least recently used dropped."""

import logging
import types

import jax.numpy as jnp
import pytest

from jaxtier._src.runtime.plan_cache import PLAN_CACHE, PlanCache


def _inputs(rows, dtype=jnp.float32):
  return {"w": jnp.zeros((4, 4))}, (jnp.zeros((rows, 4), dtype),)


class _Planner:
  """A stand-in for `pipeline.plan_step`: counts its calls, returns a new plan each time."""

  def __init__(self):
    self.made: list[str] = []

  def __call__(self, changes):
    self.made.append(changes)
    return types.SimpleNamespace(number=len(self.made))


def test_a_plan_is_made_once_per_input_shape_and_reused():
  cache, make = PlanCache(), _Planner()
  assert cache.current is None
  assert cache.select(*_inputs(8), make) is True
  assert make.made == [""] and cache.current.number == 1
  first = cache.current
  # The same shapes (other values): no new plan, `current` unchanged.
  assert cache.select(*_inputs(8), make) is False
  assert len(make.made) == 1 and cache.current is first
  # New shapes: planned again, `changes` naming the leaf that changed.
  assert cache.select(*_inputs(16), make) is True
  assert len(make.made) == 2 and cache.current.number == 2
  assert make.made[1] == "batch leaf [0] was float32[8, 4], now float32[16, 4]"
  # Back to the first shapes: the kept plan, not planned again.
  assert cache.select(*_inputs(8), make) is True
  assert len(make.made) == 2 and cache.current is first
  assert len(cache) == 2


def test_a_new_dtype_is_a_new_signature():
  cache, make = PlanCache(), _Planner()
  cache.select(*_inputs(8), make)
  assert cache.select(*_inputs(8, jnp.bfloat16), make) is True
  assert len(make.made) == 2 and "bfloat16[8, 4]" in make.made[1]


def test_the_least_recently_selected_plan_is_dropped_beyond_capacity():
  assert PLAN_CACHE == 4
  cache, make = PlanCache(capacity=2), _Planner()
  for rows in (1, 2, 3):
    cache.select(*_inputs(rows), make)
  assert len(make.made) == 3 and len(cache) == 2
  cache.select(*_inputs(2), make)  # kept
  assert len(make.made) == 3
  cache.select(*_inputs(1), make)  # dropped: planned again
  assert len(make.made) == 4 and cache.current.number == 4


def test_a_reused_plan_is_logged_and_a_new_one_warned(caplog):
  cache, make = PlanCache(), _Planner()
  with caplog.at_level(logging.INFO, logger="jaxtier"):
    cache.select(*_inputs(8), make)
    assert not caplog.records  # the first plan is no change
    cache.select(*_inputs(16), make)
    cache.select(*_inputs(8), make)
  levels = [(r.levelno, "re-planning" in r.getMessage(), "made for these shapes before"
             in r.getMessage()) for r in caplog.records]
  assert levels == [(logging.WARNING, True, False), (logging.INFO, False, True)]


def test_a_failed_plan_leaves_the_current_one():
  cache, make = PlanCache(), _Planner()
  cache.select(*_inputs(8), make)
  first = cache.current

  def fails(changes):
    raise ValueError(f"cannot plan: {changes}")
  with pytest.raises(ValueError, match=r"cannot plan: batch leaf \[0\]"):
    cache.select(*_inputs(16), fails)
  assert cache.current is first and len(cache) == 1
  assert cache.select(*_inputs(8), make) is False
