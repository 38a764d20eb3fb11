"""A policy pattern over a module's leaves places the ones it can and names the ones it skips."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier

TX = optax.sgd(1e-2)


def _state():
  params = {"layers": {"w": jnp.linspace(-1.0, 1.0, 3 * 16 * 16).reshape(3, 16, 16)},
            "head": jnp.ones((16, 4))}
  rng = {"layers": {"count": jnp.zeros((3,), jnp.int32), "key": jax.random.key_data(
      jax.random.split(jax.random.key(0), 3))}}
  return {"params": params, "rng": rng, "opt": TX.init(params)}


def _step(state, x):
  def loss_fn(p):
    h = x
    for k in range(3):
      h = jnp.tanh(h @ p["layers"]["w"][k])
    return jnp.mean((h @ p["head"]) ** 2)
  loss, g = jax.value_and_grad(loss_fn)(state["params"])
  u, o = TX.update(g, state["opt"], state["params"])
  rng = {"layers": {"count": state["rng"]["layers"]["count"] + 1,
                    "key": state["rng"]["layers"]["key"]}}
  return {"params": optax.apply_updates(state["params"], u), "rng": rng, "opt": o}, {"loss": loss}


def test_a_pattern_skips_rng_keys_and_counters_naming_them_and_places_the_rest():
  x = jnp.linspace(0.0, 1.0, 8 * 16).reshape(8, 16)
  step = jaxtier.offload(_step, policy={r"\['layers'\]": "host_xla"})
  with pytest.warns(UserWarning, match=r"patterns match 2 leaves that are not floating point "
                    r"\(\['rng'\]\['layers'\]\['count'\], \['rng'\]\['layers'\]\['key'\]\)"):
    state = step.place(_state(), x)
  where = step.plan.placements()
  assert where["['params']['layers']['w']"] == "host_xla"
  assert where["['rng']['layers']['count']"] == "device"
  assert where["['rng']['layers']['key']"] == "device"
  ref_state, ref = jax.jit(_step)(_state(), x)
  state, got = step(state, x)
  np.testing.assert_allclose(float(got["loss"]), float(ref["loss"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_callable_policy_placing_a_counter_on_the_host_is_still_refused_naming_it():
  x = jnp.ones((8, 16))
  policy = lambda path, leaf: "host_xla" if "count" in path else None
  with pytest.raises(jaxtier.PlanError, match=r"\['rng'\]\['layers'\]\['count'\] \(int32\[3\]\)"
                     r" would be placed host_xla, but only floating-point leaves"):
    jaxtier.offload(_step, policy=policy).place(_state(), x)


def _axis1_step(tx):
  # A stack scanned along axis 1, as flax's `nn.scan` with variable_axes={'params': 1} (MaxText's
  # default param_scan_axis) leaves it: the layer loop reads a transpose of it.
  def step(state, x):
    def loss_fn(p):
      def body(h, w):
        return jnp.tanh(h @ w), None
      h, _ = jax.lax.scan(body, x, jnp.moveaxis(p["layers"]["w"], 1, 0))
      return jnp.mean(h ** 2)
    loss, g = jax.value_and_grad(loss_fn)(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": loss}
  return step


def _axis1_state(tx):
  params = {"layers": {"w": jnp.linspace(-0.5, 0.5, 16 * 3 * 16).reshape(16, 3, 16)}}
  return {"params": params, "opt": tx.init(params)}


def test_a_stack_on_axis_1_is_not_streamed_and_the_refusal_names_the_axis():
  tx = optax.adamw(1e-2)
  x = jnp.linspace(0.0, 1.0, 8 * 16).reshape(8, 16)
  with pytest.raises(jaxtier.PlanError, match=r"\['params'\]\['layers'\]\['w'\] \(float32\[16, "
                     r"3, 16\]\) cannot be placed 'host_stream': it is a stack of layers along "
                     r"axis 1 .* param_scan_axis=0"):
    jaxtier.plan(_axis1_step(tx), _axis1_state(tx), x,
                 policy={r"\['params'\]\['layers'\]": "host_stream"})


def test_a_stack_on_axis_1_trains_with_its_optimizer_state_on_the_host_as_jit():
  tx = optax.adamw(1e-2)
  x = jnp.linspace(0.0, 1.0, 8 * 16).reshape(8, 16)
  step = jaxtier.offload(_axis1_step(tx), policy="optimizer_state_on_host")
  state = step.place(_axis1_state(tx), x)
  assert step.plan.bytes_by_memory_kind()["pinned_host"] > 0
  want = _axis1_state(tx)
  jitted = jax.jit(_axis1_step(tx))
  for _ in range(3):
    state, metrics = step(state, x)
    want, want_metrics = jitted(want, x)
    np.testing.assert_allclose(float(metrics["loss"]), float(want_metrics["loss"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_auto_over_its_budget_says_why_a_stack_on_axis_1_is_not_streamed():
  # Under a budget 1 byte below the compiled peak with the optimizer state on the host, auto
  # escalates; the streamed plan cannot be made, and the refusal says why (the axis and the
  # fix) instead of offering 'host_stream'.
  tx = optax.adamw(1e-2)
  x = jnp.linspace(0.0, 1.0, 8 * 16).reshape(8, 16)
  probe = jaxtier.offload(_axis1_step(tx), policy="optimizer_state_on_host")
  probe.place(_axis1_state(tx), x)
  budget = probe.plan.compiler_peak_hbm_bytes - 1
  with pytest.raises(jaxtier.AdmissionError) as err:
    jaxtier.offload(_axis1_step(tx), device_budget=budget).place(_axis1_state(tx), x)
  tried = err.value.plan.escalation.tried
  assert [a.name for a in tried] == ["auto", "optimizer_state_on_host", "stream"], tried
  assert tried[-1].compiler_peak_hbm_bytes is None
  assert tried[-1].why.startswith(
      "not planned: no parameter leaf may be streamed (the largest, ['params']['layers']['w']: "
      "it is a stack of layers along axis 1"), tried[-1].why
  msg = str(err.value)
  assert "stream: not planned: " in msg and "param_scan_axis=0" in msg, msg
  assert "'host_stream' for a stack of layers' params" not in msg, msg
