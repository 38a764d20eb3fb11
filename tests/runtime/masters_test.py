"""`MasterCopies` alone: the fp32 masters of bf16 params updated on the host, derived, kept,
carried to a new plan, and saved and restored."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import optax_train_step
import jaxtier
from jaxtier._src import checkpoint as checkpoint_lib
from jaxtier._src.runtime.masters import MasterCopies


def _pinned():
  return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def _params(seed=0):
  rng = np.random.default_rng(seed)
  # Values a bf16 cannot hold exactly, so that a master's fp32 bits differ from its param's.
  return [jnp.asarray(rng.normal(size=(8, 4)), jnp.bfloat16), jnp.zeros((3,), jnp.float32),
          jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16)]


def _same(a, b):
  return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


def _copies(carried=None):
  return MasterCopies([0, 2], [_pinned(), _pinned()], carried=carried)


def test_the_plan_keeps_masters_for_the_bf16_params_updated_on_the_host():
  tx = optax.adamw(1e-2, mu_dtype=jnp.float32)
  step_fn = optax_train_step(tx, lambda p, x, y: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))
  params = {"w": jnp.ones((16, 4), jnp.bfloat16), "b": jnp.zeros((4,), jnp.float32)}
  step = jaxtier.offload(step_fn, policy={r"\['w'\]": "host_cpu"})
  step.place({"params": params, "opt": tx.init(params)},
             (jnp.ones((8, 16), jnp.bfloat16), jnp.zeros((8, 4), jnp.float32)))
  w = [l.index for l in step.plan.leaves if l.path == "['params']['w']"]
  assert step._masters.indices == w  # pylint: disable=protected-access
  (master,) = step._masters  # pylint: disable=protected-access
  assert master.dtype == jnp.float32 and master.sharding.memory_kind == "pinned_host"
  np.testing.assert_array_equal(np.asarray(master), np.ones((16, 4), np.float32))


def test_masters_are_derived_from_the_params_in_fp32_in_pinned_host():
  copies, params = _copies(), _params()
  assert len(copies) == 0 and copies.by_index() == {}
  copies.refresh(params, params)
  assert len(copies) == 2 and sorted(copies.by_index()) == [0, 2]
  for i, m in copies.by_index().items():
    assert m.dtype == jnp.float32 and m.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(m), np.asarray(params[i], np.float32))


def test_masters_are_kept_for_the_params_they_were_written_beside(caplog):
  copies, params = _copies(), _params()
  copies.refresh(params, params)
  # A step's new masters (fp32 values no bf16 holds), written beside its new params.
  new = {i: jax.device_put(jnp.asarray(params[i], jnp.float32) + 1e-3, _pinned())
         for i in (0, 2)}
  outs = [jnp.asarray(new[0], jnp.bfloat16), params[1], jnp.asarray(new[2], jnp.bfloat16)]
  copies.update(new, outs)
  assert all(copies.by_index()[i] is new[i] for i in (0, 2))
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    copies.refresh(outs, outs)  # the state the step returned: its masters stand
  assert all(copies.by_index()[i] is new[i] for i in (0, 2))
  assert not caplog.records
  # Another state: derived again from its params, and said so.
  other = _params(seed=1)
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    copies.refresh(other, other)
  assert "re-deriving their fp32 master copies" in caplog.text
  for i in (0, 2):
    np.testing.assert_array_equal(np.asarray(copies.by_index()[i]),
                                  np.asarray(other[i], np.float32))


def test_an_update_of_some_masters_keeps_the_others():
  copies, params = _copies(), _params()
  copies.refresh(params, params)
  before = copies.by_index()
  new = jax.device_put(jnp.full((5,), 7.0), _pinned())
  copies.update({2: new}, params)
  assert _same(copies.by_index(), {0: before[0], 2: new})


def test_a_new_plan_carries_the_masters_of_the_params_passed_back():
  old, params = _copies(), _params()
  old.refresh(params, params)
  exact = {i: jax.device_put(jnp.asarray(params[i], jnp.float32) + 1e-3, _pinned())
           for i in (0, 2)}
  old.update(exact, params)
  new = _copies(carried=old.carried())
  assert len(new) == 0
  # The same param objects as given (placed anew for the new plan): the old masters' bits.
  moved = [jnp.copy(x) for x in params]
  new.refresh(params, moved)
  for i in (0, 2):
    np.testing.assert_array_equal(np.asarray(new.by_index()[i]), np.asarray(exact[i]))
  # Another param object: derived, not carried.
  other = _copies(carried=old.carried())
  copies = [jnp.copy(x) for x in params]
  other.refresh(copies, copies)
  np.testing.assert_array_equal(np.asarray(other.by_index()[0]),
                                np.asarray(params[0], np.float32))


def test_forgotten_masters_are_derived_again():
  copies, params = _copies(), _params()
  copies.refresh(params, params)
  copies.update({0: jax.device_put(jnp.full((8, 4), 3.0), _pinned())}, params)
  copies.forget()
  assert len(copies) == 0
  copies.refresh(params, params)
  np.testing.assert_array_equal(np.asarray(copies.by_index()[0]),
                                np.asarray(params[0], np.float32))


def test_masters_are_saved_and_restored_with_the_state(tmp_path):
  copies, params = _copies(), _params()
  copies.refresh(params, params)
  exact = {i: jax.device_put(jnp.asarray(params[i], jnp.float32) + 1e-3, _pinned())
           for i in (0, 2)}
  copies.update(exact, params)
  assert copies.keys() == ["leaf_0", "leaf_2"]
  assert set(copies.checkpoint_items()) == {"leaf_0", "leaf_2"}
  checkpoint_lib.save(tmp_path / "ckpt", params, copies.checkpoint_items())

  restored_copies = _copies()
  targets = restored_copies.checkpoint_targets(params)
  assert {k: (t.shape, t.dtype) for k, t in targets.items()} == {
      "leaf_0": ((8, 4), jnp.float32), "leaf_2": ((5,), jnp.float32)}
  state, masters = checkpoint_lib.restore(tmp_path / "ckpt", params, targets)
  restored_copies.restored(masters, state)
  for i in (0, 2):
    got = restored_copies.by_index()[i]
    assert got.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(exact[i]))
  # The restored state's params are the masters' own: the next step continues from them.
  before = restored_copies.by_index()
  restored_copies.refresh(state, state)
  assert _same(restored_copies.by_index(), before)
  with pytest.raises(KeyError):
    _copies().restored({"leaf_0": masters["leaf_0"]}, state)
