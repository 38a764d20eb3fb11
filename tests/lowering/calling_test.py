"""The step programs' calling convention (`lowering/calling.py`): named inputs and outputs, the
donated fields declared once and donated by `Program`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import optax_train_step
import jaxtier
from jaxtier._src.lowering import calling


def test_the_donated_fields_are_the_declared_ones():
  assert calling.donated_fields(calling.ComputeIn) == (
      "device_leaves", "scratch", "layered_host", "layered_masters")
  assert calling.donate_argnums(calling.ComputeIn) == (0, 3, 4, 5)
  assert calling.donated_fields(calling.UpdateIn) == ("updated_host", "masters",
                                                      "donated_feeds")
  assert calling.donate_argnums(calling.UpdateIn) == (0, 2, 4)


def test_program_io_is_a_pytree_of_its_fields():
  x = calling.ComputeIn(device_leaves=[1, 2], args=[3], layered_masters=[4])
  assert jax.tree.leaves(x) == [1, 2, 3, 4]
  doubled = jax.tree.map(lambda v: 2 * v, x)
  assert isinstance(doubled, calling.ComputeIn)
  assert (doubled.device_leaves, doubled.host_leaves, doubled.args) == ([2, 4], (), [6])
  assert calling.fields_of(calling.UpdateOut(outs=[1], masters=[2])) == [[1], [2]]


def _program():
  def fn(inputs):
    return calling.UpdateOut(
        outs=[u + r for u, r in zip(inputs.updated_host, inputs.read_host)],
        masters=[m * 2 for m in inputs.masters])
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return calling.Program(
      fn, calling.UpdateIn(updated_host=[sh], read_host=[sh], masters=[sh]),
      calling.UpdateOut(outs=[sh], masters=[sh]))


def test_a_program_donates_exactly_the_donated_fields():
  program = _program()
  inputs = calling.UpdateIn(updated_host=[jnp.ones(4)], read_host=[jnp.full(4, 2.0)],
                            masters=[jnp.full(4, 3.0)])
  out = program(inputs)
  assert isinstance(out, calling.UpdateOut)
  np.testing.assert_array_equal(np.asarray(out.outs[0]), np.full(4, 3.0))
  np.testing.assert_array_equal(np.asarray(out.masters[0]), np.full(4, 6.0))
  if jax.default_backend() in ("cpu", "gpu"):  # backends that implement donation
    assert inputs.updated_host[0].is_deleted() and inputs.masters[0].is_deleted()
  # A read field is never consumed.
  assert not inputs.read_host[0].is_deleted()
  np.testing.assert_array_equal(np.asarray(inputs.read_host[0]), np.full(4, 2.0))


def test_a_program_takes_only_its_input_class_and_lowers_with_named_outputs():
  program = _program()
  with pytest.raises(TypeError, match="expected a UpdateIn, got ComputeIn"):
    program(calling.ComputeIn())
  spec = jax.ShapeDtypeStruct((4,), jnp.float32)
  compiled = program.lower(calling.UpdateIn(updated_host=[spec], read_host=[spec],
                                            masters=[spec])).compile()
  assert isinstance(compiled.output_shardings, calling.UpdateOut)
  assert [a.shape for a in compiled.out_info.masters] == [(4,)]
  assert "jit_fn" in program.lower(calling.UpdateIn(
      updated_host=[spec], read_host=[spec], masters=[spec])).as_text()


_TX = optax.adamw(1e-2)
_STEP = optax_train_step(_TX, lambda p, x, y: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))


def test_the_step_groups_each_state_leaf_into_one_input_field():
  params = {"w1": jnp.ones((16, 32)) * 0.1, "w2": jnp.ones((32, 4)) * 0.1}
  batch = (jnp.ones((8, 16)), jnp.zeros((8, 4)))
  step = jaxtier.offload(_STEP, policy="optimizer_state_on_host")
  state = step.place({"params": params, "opt": _TX.init(params)}, batch)
  split = step._programs.split  # pylint: disable=protected-access
  leaves = list(range(len(jax.tree.leaves(state))))
  inputs = split.compute_inputs(leaves, ["x", "y"], [], {})
  state_fields = inputs.device_leaves + inputs.host_leaves + inputs.layered_host
  assert sorted(state_fields) == leaves
  assert set(inputs.host_leaves) == {l.index for l in step.plan.leaves
                                     if l.memory_kind == "pinned_host"}
  assert inputs.args == ["x", "y"]
  # The update program writes the moments in place: donated to it, not to `compute`.
  feeds = [f"feed{k}" for k in range(split.num_feeds)]
  update = split.update_inputs(leaves, {}, feeds, [])
  assert update.updated_host and set(update.updated_host) <= set(inputs.host_leaves)
  assert not set(update.read_host) & set(update.updated_host)
  assert sorted(update.feeds + update.donated_feeds) == sorted(feeds)
  assert update.donated_feeds == [feeds[k] for k in split.donated_feeds]
