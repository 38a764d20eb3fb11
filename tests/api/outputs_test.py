"""Steps whose outputs are constants or alias their inputs: trained as jax.jit trains them.

Case C8 (a constant among the metrics, as MaxText's loss terms that are 0.0): the traced step's
output is a literal, not a value the step computes; jaxtier returns it as jax.jit does and keeps
every leaf's role.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier

TX = optax.adamw(1e-3)


def _state():
  params = {"w": jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)}
  return {"params": params, "opt": TX.init(params)}


def _step(extra):
  def train_step(state, batch):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(state["params"])
    u, o = TX.update(g, state["opt"], state["params"])
    metrics = {"loss": loss, **extra(state, batch)}
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, metrics
  return train_step


EXTRAS = {
    "python_float": lambda s, b: {"z_loss": 0.0},
    "python_int": lambda s, b: {"moe_lb_loss": 0},
    "python_bool": lambda s, b: {"skipped": False},
    "numpy_scalar": lambda s, b: {"mtp_loss": np.float32(0.5)},
    "jnp_zeros": lambda s, b: {"aux": jnp.zeros(())},
    "the_batch": lambda s, b: {"batch": b},
    "an_old_param": lambda s, b: {"w_before": s["params"]["w"]},
    "two_constants_alike": lambda s, b: {"a": 0.0, "b": 0.0},
}


@pytest.mark.parametrize("policy", ["optimizer_state_on_host", "none"])
@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_constant_and_aliased_outputs_come_back_as_jit_returns_them(extra, policy):
  step_fn = _step(EXTRAS[extra])
  batch = jnp.linspace(0.0, 1.0, 8 * 64).reshape(8, 64)
  ref_state, ref = jax.jit(step_fn)(_state(), batch)
  step = jaxtier.offload(step_fn, policy=policy)
  state = step.place(_state(), batch)
  state, got = step(state, batch)
  assert jax.tree.structure(got) == jax.tree.structure(ref)
  for k in ref:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), rtol=1e-6)
    assert np.asarray(got[k]).dtype == np.asarray(ref[k]).dtype, k
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  # The metrics do not change what the moments are: on the host under the rule that puts them
  # there.
  if policy == "optimizer_state_on_host":
    moments = [l for l in step.plan.leaves if ".mu[" in l.path or ".nu[" in l.path]
    assert moments and all(l.role.value == "optimizer_state" for l in moments)
    assert all(l.memory_kind == "pinned_host" for l in moments)


def _norm_step(with_param_norm):
  def train_step(state, batch):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(state["params"])
    u, o = TX.update(g, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], u)
    metrics = {"loss": loss}
    if with_param_norm:
      metrics["param_norm"] = jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(params)))
    return {"params": params, "opt": o}, metrics
  return train_step


def test_a_rule_that_places_nothing_says_so_naming_the_policy():
  # Case C9 (a metric computed from the updated params, as MaxText's param_norm): the moments
  # then feed a reduction, so the inventory counts them as params and the rule places nothing
  # on the host. The step still trains as jit does, and the policy says it placed nothing.
  batch = jnp.linspace(0.0, 1.0, 8 * 64).reshape(8, 64)
  quiet = jaxtier.offload(_norm_step(False), policy="optimizer_state_on_host")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    quiet.place(_state(), batch)
  assert quiet.plan.pinned_bytes > 0
  step = jaxtier.offload(_norm_step(True), policy="optimizer_state_on_host")
  with pytest.warns(UserWarning, match=r"policy 'optimizer_state_on_host' places nothing in "
                    r"pinned_host: no state leaf has the role optimizer_state .*\['opt'\]"):
    state = step.place(_state(), batch)
  assert step.plan.pinned_bytes == 0
  ref_state, ref = jax.jit(_norm_step(True))(_state(), batch)
  state, got = step(state, batch)
  np.testing.assert_allclose(float(got["param_norm"]), float(ref["param_norm"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
