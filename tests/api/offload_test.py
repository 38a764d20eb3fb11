"""jaxtier.offload on CPU: offloaded training equals device training; placements; errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier
from conftest import optax_train_step

# The executor of host-resident updates: host CPU threads on the CPU backend, the DHA kernel on
# a GPU (these tests run on both; the H200 benchmark script runs them there).
HOST_EXEC = "host_dha" if jax.default_backend() == "gpu" else "host_cpu"
# The rule-based plan (every optimizer-state leaf to pinned_host): what these tests of the host
# update need. Policy 'auto' keeps a state that fits on the device (tests/planning/
# planner_test.py tests it).
ON_HOST = "optimizer_state_on_host"


def _mlp_state(tx, dtype=jnp.float32, seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = {"w1": (jax.random.normal(k1, (16, 32)) * 0.3).astype(dtype),
            "w2": (jax.random.normal(k2, (32, 4)) * 0.3).astype(dtype),
            "b": jnp.zeros(4, dtype)}
  return {"params": params, "opt": tx.init(params)}


def _loss(p, x, y):
  h = jnp.tanh(x @ p["w1"].astype(jnp.float32))
  return jnp.mean((h @ p["w2"].astype(jnp.float32) + p["b"].astype(jnp.float32) - y) ** 2)


def _step_fn(tx):
  return optax_train_step(tx, _loss)


def _batch(seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(100 + seed))
  return jax.random.normal(k1, (64, 16)), jax.random.normal(k2, (64, 4))


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _train(step, state, steps):
  losses = []
  for i in range(steps):
    state, m = step(state, _batch(i % 4))
    losses.append(float(m["loss"]))
  return state, np.asarray(losses)


TX = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 50), weight_decay=0.1)


def test_a_state_read_through_numpy_views_is_stepped_and_the_views_keep_their_values():
  # np.asarray of a pinned_host leaf is a view of its memory (zero-copy): XLA will not donate a
  # buffer so referenced. The step runs on copies of those leaves; the views keep the values
  # they had, and the step trains as jax.jit does.
  step = jaxtier.offload(_step_fn(TX), policy=ON_HOST)
  state = step.place(_mlp_state(TX), _batch())
  views = [np.asarray(x) for x in jax.tree.leaves(state)]
  kept = [np.array(v) for v in views]
  ref_state, ref = _train(jax.jit(_step_fn(TX)), _mlp_state(TX), 3)
  state, got = _train(step, state, 3)
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  for v, k in zip(views, kept):
    np.testing.assert_array_equal(v, k)


def test_adamw_offloaded_equals_device_50_steps():
  step_fn = _step_fn(TX)
  ref_state, ref = _train(jax.jit(step_fn, donate_argnums=0), _mlp_state(TX), 50)
  step = jaxtier.offload(step_fn)
  state = step.place(_mlp_state(TX), _batch())
  state, got = _train(step, state, 50)
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)
  assert ref[-1] < 0.8 * ref[0]


def test_plan_places_optimizer_state_in_pinned_host():
  step = jaxtier.offload(_step_fn(TX), policy=ON_HOST)
  state = step.place(_mlp_state(TX), _batch())
  placements = step.plan.placements()
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    name = jax.tree_util.keystr(path)
    if ".mu[" in name or ".nu[" in name:
      assert placements[name] == HOST_EXEC
      assert leaf.sharding.memory_kind == "pinned_host", name
    else:
      assert placements[name] == "device"
      assert leaf.sharding.memory_kind == "device", name
  state, _ = step(state, _batch())
  kinds = {jax.tree_util.keystr(p): x.sharding.memory_kind
           for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  assert kinds["['opt'][0].mu['w1']"] == "pinned_host"
  assert kinds["['params']['w1']"] == "device"
  assert step.plan.pinned_bytes == 2 * (16 * 32 + 32 * 4 + 4) * 4
  assert HOST_EXEC in str(step.plan) and "optimizer_state" in str(step.plan)
  # A fixed policy compiles no device-only step: the predicted peak says what it leaves out,
  # beside the compiled offloaded step's figure.
  shown = str(step.plan)
  assert re.search(r"peak (HBM|device memory): [0-9.]+ \w+ predicted \(no activations\), "
                   r"[0-9.]+ \w+ compiled", shown), shown
  details = step.plan.table()
  assert "per device (state and gradients only: no activations)" in details, details
  assert step.plan.compiler_peak_hbm_bytes and "; compiler: " in details


def test_lower_plans_from_the_states_shapes_before_it_exists():
  # As `jax.jit(step).lower(shapes, batch)`: the compute program of the plan, and the first
  # call with the real state uses that plan.
  step = jaxtier.offload(_step_fn(TX), policy=ON_HOST)
  state = _mlp_state(TX)
  shapes = jax.eval_shape(lambda: state)
  assert step.lower(shapes, _batch()).compile().memory_analysis() is not None
  plan = step.plan
  assert plan.pinned_bytes == 2 * (16 * 32 + 32 * 4 + 4) * 4
  ref, _ = jax.jit(_step_fn(TX))(_copy(state), _batch())
  new, _ = step(state, _batch())
  assert step.plan.leaves == plan.leaves and step.plan.notes == plan.notes  # not re-planned
  assert new["opt"][0].mu["w1"].sharding.memory_kind == "pinned_host"
  np.testing.assert_allclose(new["params"]["w1"], ref["params"]["w1"], rtol=1e-6, atol=1e-7)


def test_bf16_params_get_fp32_masters():
  tx = optax.adamw(1e-2, weight_decay=0.1, mu_dtype=jnp.float32)
  step_fn = _step_fn(tx)
  step = jaxtier.offload(step_fn, policy=ON_HOST)
  state = step.place(_mlp_state(tx, jnp.bfloat16), _batch())
  masters = {l.path: l.master_nbytes for l in step.plan.leaves if l.master_nbytes}
  assert masters == {"['params']['b']": 16, "['params']['w1']": 16 * 32 * 4,
                     "['params']['w2']": 32 * 4 * 4}
  # Reference: the same AdamW in fp32 on fp32 masters, params rounded to bf16 each step.
  ref_tx_state = _mlp_state(tx, jnp.bfloat16)
  master = jax.tree.map(lambda p: p.astype(jnp.float32), ref_tx_state["params"])
  opt = ref_tx_state["opt"]

  @jax.jit
  def ref_step(master, opt, batch):
    params = jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)
    x, y = batch
    def loss_fn(p):
      return _step_fn(tx).__code__ and None
    del loss_fn
    (_, g) = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"].astype(jnp.float32))
                                                     @ p["w2"].astype(jnp.float32)
                                                     + p["b"].astype(jnp.float32) - y) ** 2))(params)
    g32 = jax.tree.map(lambda a: a.astype(jnp.float32), g)
    u, opt = tx.update(g32, opt, master)
    return optax.apply_updates(master, u), opt
  for i in range(10):
    state, _ = step(state, _batch(i % 4))
    master, opt = ref_step(master, opt, _batch(i % 4))
  got = state["params"]
  for k in ("w1", "w2", "b"):
    np.testing.assert_allclose(np.asarray(got[k], np.float32),
                               np.asarray(master[k].astype(jnp.bfloat16), np.float32),
                               rtol=1e-2, atol=1e-3)
    assert got[k].dtype == jnp.bfloat16


def test_user_policy_host_xla_param_trains_like_device():
  step_fn = _step_fn(TX)
  _, ref = _train(jax.jit(step_fn, donate_argnums=0), _mlp_state(TX), 10)
  step = jaxtier.offload(step_fn, policy={r"\['params'\]\['w1'\]": "host_xla"})
  state = step.place(_mlp_state(TX), _batch())
  assert step.plan.placements()["['params']['w1']"] == "host_xla"
  assert state["params"]["w1"].sharding.memory_kind == "pinned_host"
  state, got = _train(step, state, 10)
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  assert state["params"]["w1"].sharding.memory_kind == "pinned_host"


def test_non_elementwise_optimizer_state_falls_back_to_xla():
  # An update that reduces over a moment (here: normalises it by its own norm) is not one
  # elementwise pass: the leaf stays in pinned_host but is served by XLA's transfers.
  def normalized_momentum():
    def init(params):
      return jax.tree.map(jnp.zeros_like, params)
    def update(g, mu, params=None):
      mu = jax.tree.map(lambda m, g: 0.9 * m + g, mu, g)
      return jax.tree.map(lambda m: -1e-2 * m / (jnp.linalg.norm(m) + 1e-6), mu), mu
    return optax.GradientTransformation(init, update)
  tx = normalized_momentum()
  step_fn = _step_fn(tx)
  _, ref = _train(jax.jit(step_fn, donate_argnums=0), _mlp_state(tx), 10)
  step = jaxtier.offload(step_fn, policy={r"\['opt'\]": "host_cpu"})
  state = step.place(_mlp_state(tx), _batch())
  leaf = {l.path: l for l in step.plan.leaves}["['opt']['w1']"]
  assert leaf.placement == "host_xla" and "reduce" in leaf.reason, leaf
  _, got = _train(step, state, 10)
  np.testing.assert_allclose(got, ref, rtol=1e-5)


# ---- bad input: clear errors naming the leaf, state left usable ----------------------------

def test_a_non_array_leaf_is_static_and_kept():
  # As eqx.filter_jit treats it: passed to the step as it is, not placed, kept in the state.
  step_fn = _step_fn(TX)

  def named_step(state, batch):
    new, metrics = step_fn({k: v for k, v in state.items() if k != "name"}, batch)
    return dict(new, name=state["name"]), metrics
  state = dict(_mlp_state(TX), name="run-1")
  step = jaxtier.offload(named_step)
  placed = step.place(state, _batch())
  assert placed["name"] == "run-1" and all("name" not in l.path for l in step.plan.leaves)
  state, _ = step(placed, _batch())
  assert state["name"] == "run-1"


def test_python_number_leaf_becomes_an_array():
  # Flax's TrainState.create(...) starts with step=0, a Python int; jax.jit accepts it.
  step_fn = _step_fn(TX)

  def counting_step(state, batch):
    new, metrics = step_fn({k: v for k, v in state.items() if k != "step"}, batch)
    return dict(new, step=state["step"] + 1), metrics
  state = dict(_mlp_state(TX), step=0)
  step = jaxtier.offload(counting_step)
  state, _ = step(step.place(state, _batch()), _batch())
  assert int(state["step"]) == 1 and state["step"].dtype == jnp.int32


def test_called_under_jit_is_refused():
  step = jaxtier.offload(_step_fn(TX))
  state = step.place(_mlp_state(TX), _batch())
  with pytest.raises(TypeError, match="called under a JAX transformation"):
    jax.jit(step)(state, _batch())


def test_integer_leaf_offloaded_is_refused():
  step = jaxtier.offload(_step_fn(TX), policy={r"count": "host_cpu"})
  with pytest.raises(jaxtier.PlanError,
                     match=re.escape("leaf ['opt'][0].count (int32[]) would be placed host_cpu")
                     ) as err:
    step.place(_mlp_state(TX), _batch())
  # Refused while asking the policy: before any plan, over no budget.
  assert err.value.plan is None and err.value.reason == ""
  assert not isinstance(err.value, jaxtier.AdmissionError)


def test_donated_state_reused_is_named():
  step = jaxtier.offload(_step_fn(TX))
  state = step.place(_mlp_state(TX), _batch())
  new_state, _ = step(state, _batch())
  with pytest.raises(ValueError, match=r"state leaf \['opt'\]\[0\]\.count .* was deleted: it was "
                                       r"donated to an earlier step"):
    step(state, _batch())
  step(new_state, _batch())  # the returned state is still good.


def test_placed_state_passed_again_as_an_argument_is_named():
  # The state is also the second argument: once placed, its optimizer state is in pinned_host,
  # where the step (compiled with that argument on the device) cannot take it.
  def step2(state, ref, batch):
    new, m = _step_fn(TX)(state, batch)
    return new, {**m, "ref": jnp.sum(ref["params"]["w1"])}
  step = jaxtier.offload(step2, policy="optimizer_state_on_host")
  state = _mlp_state(TX)
  placed = step.place(state, _copy(state), _batch())
  with pytest.raises(ValueError, match=r"argument \[0\]\['opt'\]\[0\]\.mu\['b'\] \(after the "
                                       r"state\) is in 'pinned_host' memory but the step was "
                                       r"compiled with it in 'device' memory"):
    step(placed, placed, _batch())
  # Nothing was donated: the placed state still trains, with a device copy as the argument.
  ref = jax.device_put(_copy(_mlp_state(TX)), jax.devices()[0])
  new, m = step(placed, ref, _batch())
  assert np.isfinite(float(m["loss"]))


@pytest.mark.parametrize("kw", [dict(device_budget=0), dict(host_budget=-1),
                                dict(host_budget="0GB"), dict(device_budget="lots"),
                                dict(device_budget=1.5), dict(host_budget="1.5B")])
def test_bad_budget_is_refused(kw):
  # 1.5 was truncated to 1 byte; a size that is not whole bytes is refused as a bad one is.
  (name, value), = kw.items()
  with pytest.raises(ValueError, match=f"jaxtier.offload: {name}: expected") as err:
    jaxtier.offload(_step_fn(TX), **kw)
  assert isinstance(err.value, jaxtier.OptionError)
  assert (err.value.option, err.value.value) == (name, value)
  # '1.5GiB' is a whole number of bytes.
  assert jaxtier.offload(_step_fn(TX), device_budget="1.5GiB")._options.device_budget == 3 * 2**29


@pytest.mark.parametrize("kw, expected", [
    (dict(overlap_update="yes"), "a bool"), (dict(overlap_update=1), "a bool"),
    (dict(donate_argnums="0"), "an int or a tuple of ints"),
    (dict(donate_argnums=(0, 1.0)), "an int or a tuple of ints"),
    (dict(allow_over_budget="no"), "a bool"), (dict(allow_over_budget=None), "a bool")])
def test_an_option_of_the_wrong_type_is_refused_naming_it(kw, expected):
  # overlap_update="yes" was taken (a truthy string).
  (name, value), = kw.items()
  with pytest.raises(TypeError, match=rf"^jaxtier.offload: expected {name} ") as err:
    jaxtier.offload(_step_fn(TX), **kw)
  assert isinstance(err.value, jaxtier.OptionError)
  assert (err.value.option, err.value.value, err.value.expected) == (name, value, expected)
  assert jaxtier.offload(_step_fn(TX), overlap_update=np.bool_(False))._options.overlap_update \
      is False
  assert jaxtier.offload(_step_fn(TX), allow_over_budget=np.bool_(True)
                         )._options.allow_over_budget is True


def test_a_step_that_is_not_callable_is_refused_when_wrapped():
  for wrap in (lambda f: jaxtier.offload(f), lambda f: jaxtier.offload(policy="auto")(f)):
    with pytest.raises(TypeError, match=r"jaxtier.offload: expected the train step, a callable "
                       r"`train_step\(state, \*args\) -> \(new_state, metrics\)`, got int 42"):
      wrap(42)


def test_admission_refuses_before_allocating_state_intact():
  state = _mlp_state(TX)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
  step = jaxtier.offload(_step_fn(TX), host_budget=1000, policy=ON_HOST)
  with pytest.raises(jaxtier.AdmissionError) as err:
    step.place(state, _batch())
  msg = str(err.value)
  assert "refused before allocating anything" in msg
  assert f"({2 * (16 * 32 + 32 * 4 + 4) * 4} bytes)" in msg and "(1000 bytes)" in msg
  assert err.value.limit == "host_limit" and err.value.plan.host_budget == 1000
  assert err.value.plan.pinned_bytes == 2 * (16 * 32 + 32 * 4 + 4) * 4
  assert "['opt'][0].mu['w1'] 2.00 KiB" in msg  # the largest host leaves are listed
  for x, b in zip(jax.tree.leaves(state), before):
    assert not x.is_deleted() and x.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(x), b)
  with pytest.raises(jaxtier.AdmissionError):
    step(state, _batch())  # calling directly is refused the same way.
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))


# Some donated leaves have no output of the same program to alias them: jax says so.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_device_budget_over_is_refused():
  step = jaxtier.offload(_step_fn(TX), device_budget=100)
  with pytest.raises(jaxtier.PlanError, match=r"over the device budget of 100 B \(100 bytes\)"
                     ) as err:
    step.place(_mlp_state(TX), _batch())
  # The suggested policy names a real path prefix of the state, and applying it works.
  hint = re.search(r"policy=(\{.*?\})\)", str(err.value)).group(1)
  assert hint == "{\"^\\\\['params'\\\\]\": 'host_xla'}", hint
  assert err.value.plan is not None and err.value.plan.device_bytes > 100
  assert err.value.plan.device_budget.given == 100 and not err.value.plan.fits
  assert err.value.reason == (
      f"the state needs {jaxtier.format_bytes(err.value.plan.device_bytes)} "
      f"({err.value.plan.device_bytes} bytes) of device memory after offloading, over the "
      "device budget of 100 B (100 bytes)")
  # With it the state fits the budget; the step's peak (its gradients and activations) does
  # not, so the plan runs only with allow_over_budget (else refused: the tests below).
  hinted = dict(device_budget=100, policy={r"^\['params'\]": "host_xla"})
  with pytest.raises(jaxtier.AdmissionError) as err:
    jaxtier.offload(_step_fn(TX), **hinted).place(_mlp_state(TX), _batch())
  assert err.value.limit == "device_budget" and err.value.plan.device_bytes == 8
  step = jaxtier.offload(_step_fn(TX), **hinted, allow_over_budget=True)
  step.place(_mlp_state(TX), _batch())
  assert step.plan.device_bytes == 8  # only the two int32 step counters remain on device.


def _state_bytes(state):
  return sum(x.nbytes for x in jax.tree.leaves(state))


def test_a_plan_over_the_device_budget_given_is_refused_before_allocating():
  # A budget the state fits but the step does not (its gradients and activations come on
  # top): no placement fits, and the plan is refused before anything is allocated, whether
  # the step is called, placed or initialised; the caller's state is left as it was.
  state = _mlp_state(TX)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
  budget = _state_bytes(state)
  step = jaxtier.offload(_step_fn(TX), device_budget=budget)
  with pytest.raises(jaxtier.AdmissionError) as err:
    step(state, _batch())
  e = err.value
  assert isinstance(e, jaxtier.PlanError) and isinstance(e, ValueError)
  assert (e.limit, e.limit_bytes) == ("device_budget", budget) and not e.settings
  plan = e.plan
  # The verdict judged with the compiled step's peak, the figure refused.
  assert plan is not None and not plan.fits and plan.device_budget.given == budget
  peak = plan.compiler_peak_hbm_bytes or plan.predicted_peak_hbm_bytes
  assert e.need_bytes == peak > budget
  assert [(v.limit, v.limit_bytes) for v in plan.violations] == [("device_budget", budget)]
  assert all(v.need_bytes > budget for v in plan.violations) and plan.verdicts
  fmt = jaxtier.format_bytes
  msg = str(e)
  assert msg.startswith("jaxtier: plan refused before allocating anything: ")
  assert (f"peak device memory is {fmt(peak)} ({peak} bytes" in msg
          and f"{fmt(peak - budget)} over the device budget of {fmt(budget)} ({budget} bytes)"
          in msg), msg
  assert e.reason in msg and f"a larger device_budget (at least {fmt(peak)})" in msg
  assert "allow_over_budget=True" in msg
  # Auto's own plan was over by its compiled step: the plan with the optimizer state on the
  # host was tried too, and the streamed plan could not be made (no layer stack here); the
  # refusal lists the three, with why, and offers no policy as a fix, since auto tried them.
  assert [a.name for a in plan.escalation.tried] == ["auto", "optimizer_state_on_host", "stream"]
  assert "no parameter leaf may be streamed" in plan.escalation.tried[-1].why
  assert "keeps more state in pinned_host" not in msg
  assert ("The plans tried under auto, by their compiled step's peak device memory against the "
          f"limit of {fmt(budget)}: " + "; ".join(a.describe() for a in plan.escalation.tried)
          ) in msg, msg
  assert step.plan is None  # no plan was taken up
  for x, b in zip(jax.tree.leaves(state), before):
    assert not x.is_deleted() and x.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(x), b)
  with pytest.raises(jaxtier.AdmissionError, match="over the device budget"):
    step.place(state, _batch())
  with pytest.raises(jaxtier.AdmissionError, match="over the device budget"):
    step.init(lambda: _mlp_state(TX), example_args=(_batch(),))
  # The state is still the caller's: it trains, as jax.jit trains it.
  ref = jax.jit(_step_fn(TX))(_mlp_state(TX), _batch())
  got = jax.jit(_step_fn(TX))(state, _batch())
  np.testing.assert_allclose(float(got[1]["loss"]), float(ref[1]["loss"]), rtol=1e-6)


def test_allow_over_budget_runs_the_plan_over_the_budget_like_jit(caplog):
  # As before the refusal: said (DOES NOT FIT), run as planned.
  budget = _state_bytes(_mlp_state(TX))
  step_fn = _step_fn(TX)
  step = jaxtier.offload(step_fn, device_budget=budget, allow_over_budget=True)
  with caplog.at_level("WARNING", logger="jaxtier"):
    state = step.place(_mlp_state(TX), _batch())
  assert [r for r in caplog.records if "DOES NOT FIT" in r.getMessage()]
  assert not step.plan.fits and step.plan.device_budget.given == budget
  assert [v.limit for v in step.plan.violations] == ["device_budget"]
  _, ref = _train(jax.jit(step_fn, donate_argnums=0), _mlp_state(TX), 5)
  _, got = _train(step, state, 5)
  np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_without_a_device_budget_allow_over_budget_changes_nothing():
  # No budget given: nothing to refuse (a budget the planner sets itself is not the caller's).
  for allow in (False, True):
    step = jaxtier.offload(_step_fn(TX), allow_over_budget=allow)
    state = step.place(_mlp_state(TX), _batch())
    assert step.plan.device_budget.given is None
    _, losses = _train(step, state, 2)
    assert np.all(np.isfinite(losses))


def test_step_must_return_state_and_metrics():
  step = jaxtier.offload(lambda s, b: s)
  with pytest.raises(TypeError, match="expected the step to return \\(new_state, metrics\\)"):
    step.place(_mlp_state(TX), _batch())


def test_jaxtier_plan_does_not_place():
  state = _mlp_state(TX)
  p = jaxtier.plan(_step_fn(TX), state, _batch(), policy=ON_HOST)
  assert p.num_host_updates == 3
  assert all(x.sharding.memory_kind == "device" for x in jax.tree.leaves(state))
  assert p.bytes_by_memory_kind()["pinned_host"] == 2 * (16 * 32 + 32 * 4 + 4) * 4


def test_tree_wide_jitted_update_is_still_fused_per_leaf():
  # optax on jax 0.11 wraps its bias correction in one `jax.jit` over every moment leaf at
  # once; jaxtier inlines such calls so that each leaf's update is still one host pass.
  @jax.jit
  def scale_all(tree, s):
    return jax.tree.map(lambda t: t / s, tree)

  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(g, mu, params=None):
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, mu, g)
    return jax.tree.map(lambda m: -1e-2 * m, scale_all(mu, jnp.float32(0.5))), mu

  tx = optax.GradientTransformation(init, update)
  step_fn = _step_fn(tx)
  _, ref = _train(jax.jit(step_fn, donate_argnums=0), _mlp_state(tx), 10)
  step = jaxtier.offload(step_fn, policy=ON_HOST)
  state = step.place(_mlp_state(tx), _batch())
  assert step.plan.num_host_updates == 3
  assert {l.placement for l in step.plan.leaves if l.path.startswith("['opt']")} == {HOST_EXEC}
  _, got = _train(step, state, 10)
  np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_replan_after_placement_with_new_batch_shape():
  # A new batch shape re-traces and re-plans the step; the state is already in pinned_host.
  step_fn = _step_fn(TX)
  ref_state, _ = _train(jax.jit(step_fn, donate_argnums=0), _mlp_state(TX), 2)
  ref_state, ref_m = jax.jit(step_fn, donate_argnums=0)(ref_state, tuple(b[:32] for b in _batch(2)))
  step = jaxtier.offload(step_fn, policy=ON_HOST)
  state, _ = _train(step, step.place(_mlp_state(TX), _batch()), 2)
  state, m = step(state, tuple(b[:32] for b in _batch(2)))
  np.testing.assert_allclose(float(m["loss"]), float(ref_m["loss"]), rtol=1e-5)
  # A second wrapper accepts the placed state too.
  other = jaxtier.offload(step_fn, policy=ON_HOST)
  state, _ = other(state, _batch())
  assert state["opt"][0].mu["w1"].sharding.memory_kind == "pinned_host"


def test_batches_alternating_between_two_shapes_plan_each_once(monkeypatch):
  # As jax.jit keeps an executable per input shape, the step keeps a plan per shape: the
  # second time a shape comes back, nothing is traced or planned again.
  from jaxtier._src import pipeline  # pylint: disable=g-import-not-at-top
  planned = []
  plan_step = pipeline.plan_step
  monkeypatch.setattr(pipeline, "plan_step",
                      lambda *a, **k: planned.append(1) or plan_step(*a, **k))
  step_fn = _step_fn(TX)
  batches = [tuple(b[:32] if k % 2 else b for b in _batch(k)) for k in range(6)]
  ref_state, ref = _mlp_state(TX), []
  for b in batches:
    ref_state, m = jax.jit(step_fn, donate_argnums=0)(ref_state, b)
    ref.append(float(m["loss"]))
  step = jaxtier.offload(step_fn, policy=ON_HOST)
  state, got = step.place(_mlp_state(TX), batches[0]), []
  for b in batches:
    state, m = step(state, b)
    got.append(float(m["loss"]))
  assert len(planned) == 2
  np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_bias_broadcast_against_activations_is_a_param_without_metrics():
  # A bias is read elementwise by its own update but broadcast against activations in the
  # forward pass: it is a param (stays on device), even when the step reports no metrics.
  tx = optax.adamw(1e-2)
  params = {"w": jnp.ones((16, 8)) * 0.1, "b": jnp.zeros(8)}

  def step(state, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}
  plan = jaxtier.plan(step, {"params": params, "opt": tx.init(params)}, jnp.ones((4, 16)),
                      policy=ON_HOST)
  roles = {l.path: (l.role, l.placement) for l in plan.leaves}
  assert roles["['params']['b']"] == ("param", "device")
  assert roles["['opt'][0].mu['b']"] == ("optimizer_state", HOST_EXEC)
  assert plan.num_host_updates == 2


def test_same_array_twice_in_state_and_key_leaves():
  # optax.contrib.prodigy keeps the initial params in its state (the same arrays), and
  # optax.noisy_sgd carries a PRNG key: both must plan and train like jax.jit.
  params = {"w": jnp.ones((16, 4)) * 0.1}
  key = jax.random.key(0)

  def step(state, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(state["params"])
    k, sub = jax.random.split(state["key"])
    noise = 1e-3 * jax.random.normal(sub, g["w"].shape)
    mu = 0.9 * state["mu"] + g["w"] + noise
    return {"params": {"w": state["params"]["w"] - 1e-2 * mu + 0 * state["init"]},
            "init": state["init"], "mu": mu, "key": k}, {}
  fresh = lambda: {"params": params, "init": params["w"], "mu": jnp.zeros((16, 4)), "key": key}
  want, _ = jax.jit(step)(fresh(), jnp.ones((2, 16)))
  off = jaxtier.offload(step, policy=ON_HOST)
  got, _ = off(off.place(fresh(), jnp.ones((2, 16))), jnp.ones((2, 16)))
  assert {l.path: l.dtype for l in off.plan.leaves}["['key']"] == "key<fry>"
  np.testing.assert_allclose(np.asarray(got["params"]["w"]), np.asarray(want["params"]["w"]),
                             rtol=1e-6)


def test_one_buffer_under_two_leaves_after_place():
  # place() returns new Array objects over the buffers it did not need to move, so two leaves
  # holding one array come back as two objects over one buffer: the step must still not
  # donate that buffer twice.
  tx = optax.adam(1e-2)

  def step(state, x):
    loss = lambda p: jnp.sum(jnp.tanh(x @ p["w"]) * jnp.mean(p["v"]))
    g = jax.grad(loss)(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}

  def fresh():
    w = jnp.ones((8, 8)) * 0.1
    params = {"w": w, "v": w}
    return {"params": params, "opt": tx.init(params)}
  x = jnp.ones((4, 8))
  want = jax.jit(step)(jax.jit(step)(fresh(), x)[0], x)[0]
  off = jaxtier.offload(step, policy=ON_HOST)
  st = off.place(fresh(), x)
  for _ in range(2):
    st, _ = off(st, x)
  for k in ("w", "v"):
    np.testing.assert_allclose(np.asarray(st["params"][k]), np.asarray(want["params"][k]),
                               rtol=1e-6)


def test_gpu_plan_keeps_the_chosen_executor_per_fused_call():
  # Planning for a GPU (no GPU needed): the user's executor is kept; leaves that share a fused
  # call with it follow it, and the plan says so.
  state = _mlp_state(TX)
  plan = jaxtier.plan(_step_fn(TX), state, _batch(), platform="gpu",
                      policy={r"\.mu\[": "host_split", r"\.nu\['w1'\]": "host_cpu"})
  p = {l.path: l for l in plan.leaves}
  assert p["['opt'][0].mu['w2']"].placement == "host_split"
  assert p["['opt'][0].nu['w2']"].placement == "host_split"  # auto (host_dha) follows its call
  assert "shares a fused call with (host_split)" in p["['opt'][0].nu['w2']"].reason
  # w1: one leaf asks host_split, one host_cpu: a tie, settled by name order, said in the plan.
  assert p["['opt'][0].nu['w1']"].placement == "host_cpu"
  assert p["['opt'][0].mu['w1']"].placement == "host_cpu"
  assert "shares a fused call with (host_cpu)" in p["['opt'][0].mu['w1']"].reason
  rule = jaxtier.plan(_step_fn(TX), state, _batch(), platform="gpu", policy=ON_HOST)
  assert {l.placement for l in rule.leaves if l.role == "optimizer_state"} == {"host_dha"}
  # 'auto' with no budget: the state fits the (default) H200 budget, so it stays on the device.
  auto = jaxtier.plan(_step_fn(TX), state, _batch(), platform="gpu")
  assert {l.placement for l in auto.leaves} == {"device"}


def test_metrics_of_host_updated_leaves_come_back_on_the_device():
  # A metric that is an updated host leaf (a moment), an elementwise function of one, or a
  # param: the host update produces the first two in pinned_host. With the state a tuple
  # (params first), JAX would pair such a metric with a donated pinned_host input buffer while
  # its sharding says device, and the process would abort (SIGABRT) on the first step. The
  # metrics must come back on the device and equal jax.jit's.
  tx = optax.adamw(1e-3)
  loss_grad = jax.value_and_grad(_loss)

  def step_fn(state, batch):
    params, opt = state
    loss, g = loss_grad(params, *batch)
    u, opt = tx.update(g, opt, params)
    params = optax.apply_updates(params, u)
    return (params, opt), {"loss": loss, "mu": opt[0].mu["b"], "nu2": opt[0].nu["w1"] * 2.0,
                           "w2": params["w2"]}

  def fresh():
    s = _mlp_state(tx)
    return (s["params"], s["opt"])

  ref_state = fresh()
  ref = jax.jit(step_fn)
  step = jaxtier.offload(step_fn, policy="optimizer_state_on_host")
  state = step.place(fresh(), _batch())
  assert {l.memory_kind for l in step.plan.leaves if ".mu[" in l.path} == {"pinned_host"}
  for i in range(2):
    ref_state, m1 = ref(ref_state, _batch(i))
    state, m2 = step(state, _batch(i))
    for k in ("loss", "mu", "nu2", "w2"):
      assert m2[k].sharding.memory_kind == "device", k
      np.testing.assert_allclose(np.asarray(m2[k]), np.asarray(m1[k]), rtol=1e-5, atol=1e-7,
                                 err_msg=k)


def test_failed_step_leaves_state_usable():
  # A step that fails while being traced (here: for a new batch shape) has donated nothing:
  # the caller's state is intact and the next good call proceeds from it.
  step_fn = _step_fn(TX)

  def fragile(state, batch):
    if batch[0].shape[0] != 64:
      raise ValueError("only batches of 64")
    return step_fn(state, batch)
  step = jaxtier.offload(fragile)
  state, _ = step(step.place(_mlp_state(TX), _batch()), _batch())
  before = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
  with pytest.raises(ValueError, match="only batches of 64"):
    step(state, tuple(b[:32] for b in _batch()))
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))
  for x, b in zip(jax.tree.leaves(state), before):
    np.testing.assert_array_equal(np.asarray(x), b)
  state, m = step(state, _batch())
  assert np.isfinite(float(m["loss"]))


def test_step_failing_at_run_time_leaves_host_leaves_intact():
  # The step raises while it runs (after its forward has started), not while tracing: the
  # compute program reads the host leaves without donating them, so they survive intact.
  def boom(flag):
    if flag:
      raise RuntimeError("interrupted")

  def step_fn(state, batch, fail):
    jax.debug.callback(boom, fail)
    return _step_fn(TX)(state, batch)

  step = jaxtier.offload(step_fn, policy="optimizer_state_on_host")
  state = step.place(_mlp_state(TX), _batch(), jnp.asarray(False))
  state, _ = step(state, _batch(), jnp.asarray(False))  # one good step: moments are nonzero
  host = {l.path for l in step.plan.leaves if l.memory_kind == "pinned_host"}
  assert host
  flat, _ = jax.tree_util.tree_flatten_with_path(state)
  before = {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}
  with pytest.raises(Exception, match="interrupted"):
    jax.block_until_ready(step(state, _batch(), jnp.asarray(True)))
  for p, x in flat:
    path = jax.tree_util.keystr(p)
    if path in host:
      assert not x.is_deleted(), path
      assert x.sharding.memory_kind == "pinned_host"
      np.testing.assert_array_equal(np.asarray(x), before[path])
  # JAX also keeps the failed call's error in the device's runtime token, which it waits on at
  # interpreter exit (on the H200, jax 0.11.2 printed it there as an exception in an atexit
  # callback). A later call with a callback on that device replaces the token.
  # (The failed call's donated device leaves are deleted, as jax.jit's are: take the device
  # from a host leaf.)
  device = next(iter(next(x for p, x in flat if jax.tree_util.keystr(p) in host).devices()))

  def calm(flag):
    jax.debug.callback(boom, flag)
    return flag
  jax.block_until_ready(jax.jit(calm)(jax.device_put(jnp.asarray(False), device)))
  jax.effects_barrier()


def test_policy_of_no_known_form_is_refused_when_wrapping():
  # As a bad budget is: at `offload(...)`, not at the first call.
  for bad in ("stream", None, 3):
    with pytest.raises(jaxtier.PlanError, match=r"expected policy 'auto', 'none', "
                       r"'optimizer_state_on_host', a callable .* got " + repr(bad)) as err:
      jaxtier.offload(_step_fn(TX), policy=bad)
    assert err.value.plan is None and err.value.reason == ""


def test_policy_errors_name_the_pattern_or_leaf_and_keep_the_state():
  # A bad regex, a policy callable that raises and a pattern that matches nothing: each is
  # reported with what the user wrote (and the leaf), and nothing is placed or donated.
  state = _mlp_state(TX)
  with pytest.raises(jaxtier.PlanError, match=r"policy pattern '\[w1' is not a regular "
                     r"expression .*escape brackets") as err:
    jaxtier.offload(_step_fn(TX), policy={"[w1": "host_cpu"}).place(state, _batch())
  assert err.value.plan is None and isinstance(err.value.__cause__, re.error)

  def bad(path, leaf):
    del leaf
    if "w2" in path:
      raise KeyError("no rule for w2")
    return None
  with pytest.raises(jaxtier.PlanError, match=r"policy callable raised for leaf "
                     r"\['opt'\]\[0\]\.mu\['w2'\] .*KeyError") as err:
    jaxtier.offload(_step_fn(TX), policy=bad).place(state, _batch())
  assert err.value.plan is None and isinstance(err.value.__cause__, KeyError)
  with pytest.raises(jaxtier.PlanError, match="policy callable raised") as err:
    jaxtier.offload(_step_fn(TX), policy=lambda path: None).place(state, _batch())
  assert err.value.plan is None and isinstance(err.value.__cause__, TypeError)

  with pytest.warns(UserWarning, match=r"policy pattern .*nope.* matches no state leaf \(paths "
                    r"look like \['"):
    step = jaxtier.offload(_step_fn(TX), policy={r"\['nope'\]": "host_cpu"})
    placed = step.place(state, _batch())
  # The state passed in is still usable: the refused plans placed nothing.
  ref_state, ref = _train(jax.jit(_step_fn(TX)), _copy(state), 3)
  _, got = _train(step, placed, 3)
  np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_a_changed_state_leaf_is_named_when_the_retrace_fails():
  # Like jax.jit, a call with other shapes re-traces; when the user's step then fails, the
  # error says which state leaf changed since the plan (the user's own error stays first).
  step = jaxtier.offload(_step_fn(TX))
  state = step.place(_mlp_state(TX), _batch())
  state, _ = step(state, _batch())
  bad = dict(state, params=dict(state["params"], w1=jnp.zeros((16, 33))))
  with pytest.raises(TypeError) as e:
    step(bad, _batch())
  notes = "\n".join(getattr(e.value, "__notes__", []))
  assert "state leaf ['params']['w1'] was float32[16, 32], now float32[16, 33]" in notes, notes
  # The placed state is still usable.
  state, m = step(state, _batch(1))
  assert np.isfinite(float(m["loss"]))


def test_a_step_that_changes_a_leafs_shape_is_refused_naming_it():
  # Placement is per leaf and kept from step to step: a step whose update broadcasts a leaf to
  # a new shape (here: a moment given a leading axis makes the param it updates grow) is
  # refused at trace time with the leaf, both shapes and the likely cause, before it reaches
  # the runtime, which would abort the process on a memory-kind mismatch.
  step = jaxtier.offload(_step_fn(TX), policy={r"\['opt'\].*w2": "host_cpu"})
  state = step.place(_mlp_state(TX), _batch())
  state, _ = step(state, _batch())
  opt = list(state["opt"])
  w2 = state["params"]["w2"]
  opt[0] = opt[0]._replace(mu=dict(opt[0].mu, w2=jnp.zeros((2, *w2.shape))))
  bad = dict(state, opt=tuple(opt))
  with pytest.raises(TypeError, match=r"returns state leaf \['params'\]\['w2'\] as "
                     r"float32\[2, 32, 4\], but it came in as float32\[32, 4\].*broadcasting"):
    step(bad, _batch())
  state, m = step(state, _batch(1))  # the placed state still trains
  assert np.isfinite(float(m["loss"]))


# Some donated leaves have no output of the same program to alias them: jax says so.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_leaves_falling_back_to_host_xla_for_one_reason_are_warned_once(caplog):
  # A policy placing a 3-layer MLP's params host_cpu: each param is read by the forward pass,
  # so the params fall back to host_xla (their moments keep host_cpu), said once per reason
  # (the biases are read by `add`, the kernels by `dot_general`), not once per leaf.
  import logging  # pylint: disable=g-import-not-at-top
  tx = optax.adam(1e-3)
  params = {f"l{i}": {"w": jnp.ones((8, 8)), "b": jnp.zeros(8)} for i in range(3)}
  state = {"params": params, "opt": tx.init(params)}

  def step(state, x):
    def loss(p):
      h = x
      for i in range(3):
        h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
      return jnp.sum(h)
    u, o = tx.update(jax.grad(loss)(state["params"]), state["opt"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}
  off = jaxtier.offload(step, policy={r"\['l\d'\]": "host_cpu"})
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    off.place(state, jnp.ones((2, 8)))
  lines = [r.getMessage() for r in caplog.records if "back to host_xla" in r.getMessage()]
  assert len(lines) == 2, lines
  assert all(line.startswith("jaxtier: 3 leaves (['params']['l0']") for line in lines), lines
  assert all("no fused host update can serve it" in line for line in lines)
  placed = {l.path: l.placement for l in off.plan.leaves if "['l" in l.path}
  assert {p for p, v in placed.items() if v == "host_xla"} == {
      p for p in placed if p.startswith("['params']")}
  assert {v for p, v in placed.items() if p.startswith("['opt']")} == {"host_cpu"}


def test_fp32_masters_survive_a_new_batch_shape():
  # A last, smaller batch re-plans the step (as jax.jit re-traces); the fp32 masters live in the
  # step, not in the caller's state, and carry over to the new plan for the params the caller
  # passes back, rather than being re-derived from the rounded bf16 params.
  tx = optax.adamw(1e-2, weight_decay=0.1, mu_dtype=jnp.float32)
  step = jaxtier.offload(_step_fn(tx), policy=ON_HOST)
  state = step.place(_mlp_state(tx, jnp.bfloat16), _batch())
  for i in range(3):
    state, _ = step(state, _batch(i))

  def masters():
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    got = dict(zip(step._programs.master_indices, step._masters))  # pylint: disable=protected-access
    return {k: np.asarray(got[paths.index(f"['params']['{k}']")]) for k in ("w1", "w2", "b")}
  before = masters()
  rounded = {k: np.asarray(state["params"][k], np.float32) for k in before}
  assert any(not np.array_equal(before[k], rounded[k]) for k in before)  # fp32 bits of their own
  x, y = _batch(3)
  small = (x[:16], y[:16])
  state = step.place(state, small)  # re-planned for 16 rows: the same masters
  after = masters()
  for k in before:
    np.testing.assert_array_equal(after[k], before[k])
  state, metrics = step(state, small)
  assert np.isfinite(float(metrics["loss"]))
  # A state the step did not return gets masters derived from its params, as before.
  fresh = _mlp_state(tx, jnp.bfloat16, seed=1)
  state = step.place(fresh, _batch())
  for k, m in masters().items():
    np.testing.assert_array_equal(m, np.asarray(fresh["params"][k], np.float32))
