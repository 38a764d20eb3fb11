"""Any elementwise optax optimizer runs through the fused host update and trains like `jax.jit`.

For each optimizer of the table: 50 steps of a small MLP, offloaded (`jaxtier.offload`, policy
'optimizer_state_on_host') against plain device training (`jax.jit(step, donate_argnums=0)`)
from the same seed. Losses agree to 1e-5 relative, final params and optimizer state to fp32 tolerance, and the plan
puts every moment leaf on the host executor (`host_cpu` on CPU, `host_dha` on GPU). Optimizers
whose update is not one elementwise pass (Adafactor's factored moments, a Shampoo-like
preconditioner) train the same through XLA's memory-kind transfers (`host_xla`), and the plan
names each such leaf and why. An update applied under a traced condition (apply_if_finite,
MultiSteps skipping non-finite steps) is one `cond` over the whole tree, made selects per leaf
before planning (`analysis/conditions.py`): it fuses too.
"""

import contextlib
import logging
import re

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier
from conftest import optax_train_step

HOST_EXEC = "host_dha" if jax.default_backend() == "gpu" else "host_cpu"
# Every optimizer-state leaf on the host ('auto' keeps a state that fits on the device).
ON_HOST = "optimizer_state_on_host"
STEPS = 50
SHAPES = {"dense1": {"kernel": (12, 24), "bias": (24,)},
          "dense2": {"kernel": (24, 16), "bias": (16,)},
          "out": {"kernel": (16, 4), "bias": (4,)}}
NUM_PARAMS = 6


def _params(dtype=jnp.float32, seed=0):
  shapes, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  leaves = [(jax.random.normal(k, s) * (0.3 if len(s) > 1 else 0.05)).astype(dtype)
            for k, s in zip(keys, shapes)]
  return jax.tree.unflatten(treedef, leaves)


def _loss(p, x, y):
  f32 = lambda a: a.astype(jnp.float32)
  h = x
  for name in ("dense1", "dense2"):
    h = jnp.tanh(h @ f32(p[name]["kernel"]) + f32(p[name]["bias"]))
  return jnp.mean((h @ f32(p["out"]["kernel"]) + f32(p["out"]["bias"]) - y) ** 2)


def _step_fn(tx):
  return optax_train_step(tx, _loss)


def _batch(i):
  k1, k2 = jax.random.split(jax.random.PRNGKey(1000 + i % 4))
  x = jax.random.normal(k1, (32, 12))
  return x, jnp.sin(x[:, :4]) + 0.1 * jax.random.normal(k2, (32, 4))


def _train(step, state, steps=STEPS):
  losses = []
  for i in range(steps):
    state, m = step(state, _batch(i))
    losses.append(float(m["loss"]))
  return state, np.asarray(losses)


def _pairs(out):
  """Splits a tree of (update, state) pairs into two trees."""
  is_pair = lambda x: isinstance(x, tuple)
  return (jax.tree.map(lambda o: o[0], out, is_leaf=is_pair),
          jax.tree.map(lambda o: o[1], out, is_leaf=is_pair))


def _frozen_by_array_mask():
  """Zeroes the updates where a boolean mask array (closed over: a constant) is False."""
  masks = jax.tree.map(lambda p: jax.random.bernoulli(jax.random.PRNGKey(p.size), 0.8, p.shape),
                       _params())

  def update(u, state, params=None):
    del params
    return jax.tree.map(lambda u, m: jnp.where(m, u, jnp.zeros_like(u)), u, masks), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _elementwise_zoo(lr=1e-2):
  """Momentum through integer conversions, floor division, a 3-way `select_n` on an integer,
  boolean logic, `sign` and a `lax.cond` on the (device) step count: all elementwise."""

  def init(params):
    return {"count": jnp.zeros([], jnp.int32), "m": jax.tree.map(jnp.zeros_like, params)}

  def update(g, state, params=None):
    del params
    count = state["count"] + 1

    def one(g, m):
      m = 0.9 * m + g
      k = jnp.clip(jnp.floor(jnp.abs(m) * 40.0), 0, 2).astype(jnp.int32)
      k = jnp.clip((k * 3) // 2 - k % 2, 0, 2)
      scaled = lax.select_n(k, m, 0.5 * m, 0.25 * m)
      keep = jnp.logical_and(m > -10.0, jnp.isfinite(m))
      u = lax.cond(count > 5, lambda s: jnp.abs(s) * jnp.sign(m), lambda s: s, scaled)
      return -lr * jnp.where(keep, u, 0.0), m

    u, m = _pairs(jax.tree.map(one, g, state["m"]))
    return u, {"count": count, "m": m}

  return optax.GradientTransformation(init, update)


def _shampoo_like(lr=3e-2, beta=0.9):
  """A left preconditioner per 2-D leaf, L = beta L + (1 - beta) G G^T, and RMSprop for 1-D
  leaves: the 2-D update solves against L (not elementwise), the 1-D one is elementwise."""

  def init(params):
    return jax.tree.map(lambda p: jnp.zeros((p.shape[0],) * 2) if p.ndim == 2
                        else jnp.zeros_like(p), params)

  def update(g, state, params=None):
    del params

    def one(g, s):
      if g.ndim != 2:
        s = beta * s + (1 - beta) * g * g
        return -lr * g / (jnp.sqrt(s) + 1e-4), s
      s = beta * s + (1 - beta) * (g @ g.T)
      damping = jnp.trace(s) / s.shape[0] + 1e-4
      return -lr * damping * jnp.linalg.solve(s + damping * jnp.eye(s.shape[0]), g), s

    return _pairs(jax.tree.map(one, g, state))

  return optax.GradientTransformation(init, update)


def _decay_mask(params):
  return jax.tree.map(lambda p: p.ndim > 1, params)


FUSED = "fused"
# name -> (optimizer factory, FUSED or a regex the reason of its host_xla leaves matches).
OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(5e-2), FUSED),  # no state: nothing to offload.
    "sgd_momentum": (lambda: optax.sgd(5e-2, momentum=0.9), FUSED),
    "sgd_nesterov": (lambda: optax.sgd(5e-2, momentum=0.9, nesterov=True), FUSED),
    "adam": (lambda: optax.adam(1e-2), FUSED),
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), FUSED),
    "lion": (lambda: optax.lion(1e-3, weight_decay=0.01), FUSED),
    "rmsprop": (lambda: optax.rmsprop(3e-3), FUSED),
    "rmsprop_momentum": (lambda: optax.rmsprop(1e-3, momentum=0.9), FUSED),
    "rmsprop_centered": (lambda: optax.rmsprop(1e-3, centered=True), FUSED),
    "rmsprop_centered_momentum": (lambda: optax.rmsprop(1e-3, centered=True, momentum=0.9),
                                  FUSED),
    "adabelief": (lambda: optax.adabelief(1e-2), FUSED),
    "masked_weight_decay": (lambda: optax.chain(
        optax.add_decayed_weights(1e-2, mask=_decay_mask), optax.scale_by_adam(),
        optax.scale(-1e-2)), FUSED),
    "bool_array_mask": (lambda: optax.chain(optax.scale_by_adam(), _frozen_by_array_mask(),
                                            optax.scale(-1e-2)), FUSED),
    "adamw_warmup_cosine": (lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS), weight_decay=0.1), FUSED),
    "adam_exponential_decay": (lambda: optax.adam(optax.exponential_decay(1e-2, 10, 0.7)),
                               FUSED),
    "sgd_piecewise_constant": (lambda: optax.sgd(
        optax.piecewise_constant_schedule(5e-2, {15: 0.5, 30: 0.2}), momentum=0.9), FUSED),
    "clip_by_global_norm_adamw": (lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1)), FUSED),
    "elementwise_zoo": (_elementwise_zoo, FUSED),
    # Not one elementwise pass: served by XLA's memory-kind transfers, with the reason.
    # Adafactor clips each update by its RMS (a reduction); the factored v_row and v_col of a
    # kernel also meet in an outer product ("host leaves of different sizes [12, 24] interact").
    "adafactor": (lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
                  r"`reduce_sum` is not elementwise"),
    "shampoo_like": (_shampoo_like, "`reduce_sum` is not elementwise"),
    # MultiSteps: one lax.cond (skip / update) over the whole state reads every leaf. With
    # the default predicate the branch index is a constant: the analysis takes that branch
    # and the accumulators fuse. A real predicate (skip_not_finite) keeps the cond, whose
    # skipping branch keeps the state: it becomes selects per leaf, and fuses too.
    "multisteps_adam": (lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), FUSED),
    "multisteps_skip_not_finite": (lambda: optax.MultiSteps(
        optax.adam(1e-2), every_k_schedule=2, should_skip_update_fn=optax.skip_not_finite),
                                   FUSED),
    "apply_if_finite_adamw": (lambda: optax.apply_if_finite(
        optax.adamw(1e-2, weight_decay=0.1), max_consecutive_errors=3), FUSED),
}


def _state(tx, dtype=jnp.float32):
  params = _params(dtype)
  return {"params": params, "opt": tx.init(params)}


@pytest.fixture(scope="module")
def device_runs():
  """Plain `jax.jit` training per optimizer, computed once (final state, losses)."""
  cache = {}

  def get(name):
    if name not in cache:
      tx = OPTIMIZERS[name][0]()
      cache[name] = _train(jax.jit(_step_fn(tx), donate_argnums=0), _state(tx))
    return cache[name]
  return get


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offloaded_equals_device_training(name, device_runs):
  make, expect = OPTIMIZERS[name]
  tx = make()
  ref_state, ref = device_runs(name)
  step = jaxtier.offload(_step_fn(tx), policy=ON_HOST)
  # SGD has no optimizer state: the policy places nothing, and says so.
  with (pytest.warns(UserWarning, match=f"policy '{ON_HOST}' places nothing")
        if name == "sgd" else contextlib.nullcontext()):
    state = step.place(_state(tx), _batch(0))
  plan = {leaf.path: leaf for leaf in step.plan.leaves}
  moments = [leaf for leaf in step.plan.leaves
             if leaf.path.startswith("['opt']") and leaf.role == "optimizer_state"]
  if name != "sgd":
    assert moments, step.plan
  for leaf in moments:
    if expect == FUSED:
      assert leaf.placement == HOST_EXEC, (leaf, str(step.plan))
    else:
      assert leaf.placement in (HOST_EXEC, "host_xla"), leaf
  placements = [leaf.placement for leaf in step.plan.leaves]
  if expect == FUSED:
    assert "host_xla" not in placements, str(step.plan)
    assert step.plan.num_host_updates == (NUM_PARAMS if moments else 0)
  else:
    fallback = [leaf for leaf in moments if leaf.placement == "host_xla"]
    assert fallback, str(step.plan)
    for leaf in fallback:
      assert leaf.memory_kind == "pinned_host"
      assert "not one elementwise pass" in leaf.reason and re.search(expect, leaf.reason), leaf
  assert all(plan[p].placement == "device" for p in plan if p.startswith("['params']"))

  state, got = _train(step, state)
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  assert ref[-1] < 0.7 * ref[0], ref  # it trains at all.
  got_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  for (path, a), b in zip(got_leaves, jax.tree.leaves(ref_state)):
    leaf = jax.tree_util.keystr(path)
    assert a.sharding.memory_kind == plan[leaf].memory_kind, leaf
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6, err_msg=leaf)


def _host_update_inputs(step):
  """Per fused component: its primitives, and the device-computed (non-leaf) array operands."""
  jaxpr = step._planned.inventory.closed_jaxpr.jaxpr  # pylint: disable=protected-access
  out = []
  for cc in step.plan.components:  # pylint: disable=protected-access
    prims = {jaxpr.eqns[k].primitive.name for k in cc.component.eqns}
    arrays = [s for s in cc.operands
              if s.kind == "value" and s.index < 0 and int(np.prod(s.var.aval.shape)) > 1]
    scalars = [s for s in cc.operands if s.kind == "value" and not s.var.aval.shape]
    out.append((prims, arrays, scalars))
  return out


def test_clip_by_global_norm_scaling_is_fused_as_a_scalar():
  # The global norm is a reduction over all gradients: it stays on the device. Scaling each
  # gradient by it is elementwise: the program reads the raw gradient once and the norm as a
  # scalar operand, and the moments are updated on the host.
  tx = OPTIMIZERS["clip_by_global_norm_adamw"][0]()
  step = jaxtier.offload(_step_fn(tx), policy=ON_HOST)
  step.place(_state(tx), _batch(0))
  assert all(l.placement == HOST_EXEC for l in step.plan.leaves
             if ".mu[" in l.path or ".nu[" in l.path)
  for prims, arrays, scalars in _host_update_inputs(step):
    assert "select_n" in prims and "div" in prims, prims  # the clip's select(norm < 1, g, g/n)
    assert len(arrays) == 1, arrays  # the raw gradient only
    assert len(scalars) >= 3, scalars  # the norm, the clip predicate, bias corrections


def test_adam_reads_the_gradient_once():
  tx = optax.adam(1e-2)
  step = jaxtier.offload(_step_fn(tx), policy=ON_HOST)
  step.place(_state(tx), _batch(0))
  for prims, arrays, _ in _host_update_inputs(step):
    assert "integer_pow" in prims and len(arrays) == 1, (prims, arrays)


BF16 = ["adamw", "lion", "sgd_momentum", "clip_by_global_norm_adamw"]


@pytest.mark.parametrize("name", BF16)
def test_bf16_params_with_fp32_masters(name):
  # bf16 params, fp32 optimizer state. Offloaded: the update runs on the host from fp32 master
  # copies. Reference: the same optimizer on fp32 masters on the device, params rounded to bf16
  # for the forward each step. They differ by bf16 roundings only: the device rounds the
  # gradient (and optax's arithmetic on it) to bf16, the program computes in fp32 and rounds
  # only what it stores (docs/design.md), hence tolerances of a few bf16 ulps.
  tx = OPTIMIZERS[name][0]()
  params = _params(jnp.bfloat16)
  masters = jax.tree.map(lambda p: p.astype(jnp.float32), params)  # as `place` derives them
  step = jaxtier.offload(_step_fn(tx), policy=ON_HOST)
  state = step.place({"params": params, "opt": tx.init(masters)}, _batch(0))
  assert "host_xla" not in [leaf.placement for leaf in step.plan.leaves]
  for leaf in step.plan.leaves:
    if leaf.path.startswith("['params']"):
      assert leaf.placement == "device" and leaf.master_nbytes == 4 * int(np.prod(leaf.shape))
      assert "fp32 master" in leaf.reason
    elif leaf.role == "optimizer_state":
      assert leaf.placement == HOST_EXEC

  @jax.jit
  def ref_step(master, opt, batch):
    params = jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)
    loss, g = jax.value_and_grad(_loss)(params, *batch)
    u, opt = tx.update(g, opt, master)
    return optax.apply_updates(master, u), opt, loss

  opt = tx.init(masters)
  ref, got = [], []
  for i in range(20):
    masters, opt, loss = ref_step(masters, opt, _batch(i))
    ref.append(float(loss))
    state, m = step(state, _batch(i))
    got.append(float(m["loss"]))
  # Lion's update is sign(interpolation) * lr: a component near zero whose last bit differs
  # between the two programs flips to the other sign, a whole lr step. On the H200 the loss
  # traces drift apart by up to 0.64% over 20 steps (GPU matmul roundings); the others stay
  # within 0.5%.
  np.testing.assert_allclose(got, ref, rtol=1e-2 if name == "lion" else 5e-3)
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(state["params"]))
  want = jax.tree.map(lambda m: np.asarray(m.astype(jnp.bfloat16), np.float32), masters)
  have = jax.tree.map(lambda p: np.asarray(p, np.float32), state["params"])
  for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=2e-3)
  for a, b in zip(jax.tree.leaves(state["opt"]), jax.tree.leaves(opt)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=2e-2 * float(np.abs(b).max(initial=1e-6)))


def test_fallback_is_logged_with_leaf_and_reason(caplog):
  tx = OPTIMIZERS["shampoo_like"][0]()
  with caplog.at_level(logging.INFO, logger="jaxtier"):
    jaxtier.plan(_step_fn(tx), _state(tx), _batch(0), policy=ON_HOST)
  lines = [r.getMessage() for r in caplog.records if r.name == "jaxtier"]
  for path in ("['opt']['dense1']['kernel']", "['opt']['out']['kernel']"):
    assert any(path in line and "host_xla" in line and "not elementwise" in line
               for line in lines), lines
