"""Steps with any outputs: trained as jax.jit trains them, every leaf keeping its role.

Case C8 (a constant among the metrics, as MaxText's loss terms that are 0.0): the traced
step's output is a literal, not a value the step computes; jaxtier returns it as jax.jit does,
under every policy. Case C9 (a metric that reads the updated params, as MaxText's
`param_norm`): the metric is computed after the host update, from the new values wherever they
live; the moments stay optimizer state, in pinned_host, updated by the fused host update.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier

TX = optax.adamw(1e-3)
# optax.global_norm, by its newer name where optax has it (the old one warns it is deprecated).
NORM = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm
ON_HOST = "optimizer_state_on_host"
# (policy, options): the rule, the solver with a device budget too small for the whole state
# (64 KiB of fp32 AdamW state: it puts the moments on the host), and everything on the device.
POLICIES = {
    ON_HOST: dict(policy=ON_HOST),
    "auto_budget": dict(policy="auto", device_budget=60_000),
    "none": dict(policy="none"),
}


def _state():
  params = {"w": jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)}
  return {"params": params, "opt": TX.init(params)}


def _batch(i=0):
  return jnp.linspace(0.0, 1.0, 8 * 64).reshape(8, 64) + 0.1 * i


def _step(extra):
  """An AdamW step whose metrics are the loss and `extra(state, batch, new_params, grads,
  new_opt, updates)`."""
  def train_step(state, batch):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(state["params"])
    u, o = TX.update(g, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], u)
    metrics = {"loss": loss, **extra(state, batch, params, g, o, u)}
    return {"params": params, "opt": o}, metrics
  return train_step


def _moments(plan):
  return [l for l in plan.leaves if ".mu[" in l.path or ".nu[" in l.path]


def _train_both(step_fn, steps=2, **options):
  """(jaxtier's step, its last (state, metrics), jax.jit's) after `steps` steps."""
  step = jaxtier.offload(step_fn, **options)
  state = step.place(_state(), _batch())
  ref_state = _state()
  for i in range(steps):
    ref_state, ref = jax.jit(step_fn)(ref_state, _batch(i))
    state, got = step(state, _batch(i))
  return step, (state, got), (ref_state, ref)


def _assert_as_jit(got, ref):
  (state, metrics), (ref_state, ref_metrics) = got, ref
  assert jax.tree.structure(metrics) == jax.tree.structure(ref_metrics)
  for k in ref_metrics:
    np.testing.assert_allclose(np.asarray(metrics[k]), np.asarray(ref_metrics[k]), rtol=1e-6,
                               atol=1e-7, err_msg=k)
    assert np.asarray(metrics[k]).dtype == np.asarray(ref_metrics[k]).dtype, k
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


CONSTANTS = {
    "python_float": lambda *a: {"z_loss": 0.0},
    "python_int": lambda *a: {"moe_lb_loss": 0},
    "python_bool": lambda *a: {"skipped": False},
    "numpy_scalar": lambda *a: {"mtp_loss": np.float32(0.5)},
    "jnp_zeros": lambda *a: {"aux": jnp.zeros(())},
    # Folded to a literal while tracing: no equation computes it.
    "literal_expression": lambda *a: {"scaled": jnp.float32(0.0) * 2.0 + 1.0},
    "two_constants_alike": lambda *a: {"a": 0.0, "b": 0.0},
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("extra", sorted(CONSTANTS))
def test_constant_metrics_come_back_as_jit_returns_them(extra, policy):
  step, got, ref = _train_both(_step(CONSTANTS[extra]), **POLICIES[policy])
  _assert_as_jit(got, ref)
  # The constants do not change what the moments are, nor where the host policies put them.
  assert all(l.role == "optimizer_state" for l in _moments(step.plan))
  want = "device" if policy == "none" else "pinned_host"
  assert {l.memory_kind for l in _moments(step.plan)} == {want}


ALIASES = {
    "the_batch": lambda s, b, *a: {"batch": b},
    "an_old_param": lambda s, b, *a: {"w_before": s["params"]["w"]},
    # A moment the host update overwrites in place: the metric is its value before the step.
    "an_old_moment": lambda s, b, *a: {"mu_before": s["opt"][0].mu["w"]},
    "a_new_moment": lambda s, b, p, g, o, u: {"nu_after": o[0].nu["w"]},
}


@pytest.mark.parametrize("policy", [ON_HOST, "none"])
@pytest.mark.parametrize("extra", sorted(ALIASES))
def test_metrics_that_alias_inputs_or_new_leaves_come_back_as_jit_returns_them(extra, policy):
  step, got, ref = _train_both(_step(ALIASES[extra]), **POLICIES[policy])
  _assert_as_jit(got, ref)
  for k, x in got[1].items():
    assert x.sharding.memory_kind == "device", k
  if policy == ON_HOST:
    assert {l.memory_kind for l in _moments(step.plan)} == {"pinned_host"}


NORMS = {
    # Case C9: MaxText's param_norm, a norm of the updated params.
    "param_norm": lambda s, b, p, g, o, u: {"param_norm": NORM(p)},
    "grad_norm": lambda s, b, p, g, o, u: {"grad_norm": NORM(g)},
    "new_moment_norm": lambda s, b, p, g, o, u: {"mu_norm": NORM(o[0].mu)},
    "old_moment_norm": lambda s, b, p, g, o, u: {
        "mu_norm_before": NORM(s["opt"][0].mu)},
    "update_norm": lambda s, b, p, g, o, u: {"update_norm": NORM(u)},
    "all_at_once": lambda s, b, p, g, o, u: {
        "ratio": NORM(u) / NORM(p),
        "nu_max": jnp.max(o[0].nu["w"]), "grad_norm": NORM(g)},
}


@pytest.mark.parametrize("extra", sorted(NORMS))
def test_metrics_of_new_params_gradients_or_moments_keep_the_moments_on_the_host(extra):
  step, got, ref = _train_both(_step(NORMS[extra]), steps=3, policy=ON_HOST)
  _assert_as_jit(got, ref)
  moments = _moments(step.plan)
  assert len(moments) == 2
  assert all(l.role == "optimizer_state" for l in moments), [(l.path, l.role) for l in moments]
  assert {l.memory_kind for l in moments} == {"pinned_host"}
  # One fused host update (the moments and the param's new value), as without the metric.
  assert step.plan.num_host_updates == 1
  plain = jaxtier.offload(_step(lambda *a: {}), policy=ON_HOST)
  plain.place(_state(), _batch())
  assert step.plan.num_host_updates == plain.plan.num_host_updates
  assert step.plan.pinned_bytes == plain.plan.pinned_bytes == 2 * 64 * 64 * 4


def test_a_param_norm_under_auto_keeps_the_moments_on_the_host_too():
  step, got, ref = _train_both(_step(NORMS["param_norm"]), policy="auto",
                               device_budget=60_000)
  _assert_as_jit(got, ref)
  assert {l.memory_kind for l in _moments(step.plan)} == {"pinned_host"}
  assert step.plan.num_host_updates == 1


def test_the_plan_of_a_param_norm_step_is_the_plan_without_it():
  # jaxtier.plan (nothing allocated) sees the same roles and placements.
  with_norm = jaxtier.plan(_step(NORMS["param_norm"]), _state(), _batch(), policy=ON_HOST)
  without = jaxtier.plan(_step(lambda *a: {}), _state(), _batch(), policy=ON_HOST)
  assert [(l.path, l.role, l.placement) for l in with_norm.leaves] == [
      (l.path, l.role, l.placement) for l in without.leaves]


def _sgd_step(state, batch):
  loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(state["params"])
  params = jax.tree.map(lambda p, d: p - 0.1 * d, state["params"], g)
  return {"params": params}, {"loss": loss, "param_norm": NORM(params)}


def test_a_policy_that_places_nothing_says_so_naming_the_policy():
  # Plain SGD has no optimizer state: the rule has nothing to put on the host, and says so.
  state = {"params": {"w": jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)}}
  ref_state, ref = jax.jit(_sgd_step)(state, _batch())
  step = jaxtier.offload(_sgd_step, policy=ON_HOST)
  with pytest.warns(UserWarning, match=r"policy 'optimizer_state_on_host' places nothing in "
                    r"pinned_host: no state leaf has the role optimizer_state.*\['params'\]"):
    placed = step.place(state, _batch())
  assert step.plan.pinned_bytes == 0
  new, got = step(placed, _batch())
  _assert_as_jit((new, got), (ref_state, ref))
  # An AdamW step with the same metric places its moments: no warning.
  quiet = jaxtier.offload(_step(NORMS["param_norm"]), policy=ON_HOST)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    quiet.place(_state(), _batch())
  assert quiet.plan.pinned_bytes > 0


# Case C8 restated: a step returning {"loss": loss, "z_loss": 0.0}, under every policy, equal
# to jax.jit.
def _c8_step(state, batch):
  loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(state["params"])
  u, o = TX.update(g, state["opt"], state["params"])
  return ({"params": optax.apply_updates(state["params"], u), "opt": o},
          {"loss": loss, "z_loss": 0.0})


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_case_c8_constant_metric(policy):
  _, got, ref = _train_both(_c8_step, **POLICIES[policy])
  _assert_as_jit(got, ref)
  assert float(got[1]["z_loss"]) == 0.0


# Case C9 restated: optax.global_norm of the new params among the metrics; under
# optimizer_state_on_host every AdamW moment is still optimizer state, in pinned_host.
def _c9_state():
  params = {"w": jnp.ones((256, 256))}
  return {"params": params, "opt": TX.init(params)}


def _c9_step(with_param_norm):
  def train_step(state, batch):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(state["params"])
    u, o = TX.update(g, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], u)
    m = {"loss": loss}
    if with_param_norm:
      m["param_norm"] = NORM(params)
    return {"params": params, "opt": o}, m
  return train_step


def test_case_c9_param_norm():
  x = jnp.ones((8, 256))
  roles = {}
  for with_norm in (False, True):
    step = jaxtier.offload(_c9_step(with_norm), policy=ON_HOST)
    state = step.place(_c9_state(), x)
    state, got = step(state, x)
    ref_state, ref = jax.jit(_c9_step(with_norm))(_c9_state(), x)
    _assert_as_jit((state, got), (ref_state, ref))
    roles[with_norm] = [(l.path, l.role, l.placement, l.memory_kind) for l in step.plan.leaves]
    mus = [l for l in step.plan.leaves if ".mu[" in l.path]
    assert mus and all(l.role == "optimizer_state" and l.memory_kind == "pinned_host"
                       for l in mus)
  assert roles[True] == roles[False]


def test_metrics_beside_layered_updates_keep_them_layered():
  # The moments of a stack of layers are updated layer by layer inside the backward pass. A
  # norm of the new params runs after the step, and a metric of a layered moment's shape (a
  # gradient) comes back on the device: the compute program's outputs hand each donated
  # pinned_host buffer back to its own leaf, not to the metric (which aborted the process).
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import _stacks  # pylint: disable=g-import-not-at-top
  graphdef, params = nnx.split(_stacks.Stack(nnx.Rngs(0), layers=3, width=16, inputs=8,
                                             name="layers"))

  def step_fn(state, x):
    loss, g = jax.value_and_grad(
        lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2))(state["params"])
    u, o = TX.update(g, state["opt"], state["params"])
    p = optax.apply_updates(state["params"], u)
    return {"params": p, "opt": o}, {"loss": loss, "param_norm": NORM(p),
                                     "grad": g["layers"]["w"]["kernel"].get_value()}

  def fresh():
    return jax.tree.map(jnp.copy, {"params": params, "opt": TX.init(params)})
  step = jaxtier.offload(step_fn, policy=ON_HOST)
  state, ref_state = step.place(fresh(), jnp.ones((4, 8))), fresh()
  for i in range(3):
    x = jnp.ones((4, 8)) * (i + 1)
    state, got = step(state, x)
    ref_state, ref = jax.jit(step_fn)(ref_state, x)
    for k in ref:
      np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-7,
                                 err_msg=k)
  assert got["grad"].shape == (3, 16, 16) and got["grad"].sharding.memory_kind == "device"
  assert any("run layer by layer inside the backward pass" in n for n in step.plan.notes)
  moments = [l for l in step.plan.leaves if "['layers']" in l.path and l.path.startswith("['opt']")
             and l.role == "optimizer_state"]
  assert moments and {l.memory_kind for l in moments} == {"pinned_host"}


def test_metrics_that_read_new_host_leaves_count_their_copies_in_the_peak():
  # A norm of the new moments runs after the update, in a program that copies the two
  # pinned_host leaves (16 KiB each) to the device: the step's peak is that program's where
  # higher, so a budget that holds the compute program but not it is refused before allocating.
  moments = lambda s, b, p, g, o, u: {"m": NORM(o[0].mu) + NORM(o[0].nu)}
  device_state = 64 * 64 * 4 + 4  # w and AdamW's count
  plan = jaxtier.plan(_step(moments), _state(), _batch(), policy=ON_HOST)
  assert plan.tail_peak_hbm_bytes == device_state + 2 * 64 * 64 * 4
  assert plan.predicted_peak_hbm_bytes >= plan.tail_peak_hbm_bytes
  assert any(n.startswith("the metrics computed after the update read 2 pinned_host leaves "
                          "(['opt'][0].mu['w'], ['opt'][0].nu['w'])") for n in plan.notes)
  # A param norm reads a device leaf: nothing copied, and the tail is the device state.
  param = jaxtier.plan(_step(NORMS["param_norm"]), _state(), _batch(), policy=ON_HOST)
  assert param.tail_peak_hbm_bytes == device_state
  assert not any("after the update read" in n for n in param.notes)
  assert jaxtier.plan(_step(lambda *a: {}), _state(), _batch(),
                      policy=ON_HOST).tail_peak_hbm_bytes is None
  step = jaxtier.offload(_step(moments), policy=ON_HOST)
  step.place(_state(), _batch())
  compute_peak = jaxtier.offload(_step(lambda *a: {}), policy=ON_HOST)
  compute_peak.place(_state(), _batch())
  assert compute_peak.plan.compiler_peak_hbm_bytes < plan.tail_peak_hbm_bytes
  assert step.plan.compiler_peak_hbm_bytes == plan.tail_peak_hbm_bytes
  budget = (compute_peak.plan.compiler_peak_hbm_bytes + plan.tail_peak_hbm_bytes) // 2
  state = _state()
  with pytest.raises(jaxtier.AdmissionError, match="over the device budget") as err:
    jaxtier.offload(_step(moments), policy=ON_HOST, device_budget=budget).place(state, _batch())
  assert err.value.need_bytes == plan.tail_peak_hbm_bytes
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))
