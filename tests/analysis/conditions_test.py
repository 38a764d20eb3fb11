"""An update applied under a traced condition becomes selects per leaf (`analysis/conditions.py`).

`optax.apply_if_finite` traces one `cond` over every gradient and the whole inner state. The
pass, run where the step is traced, inlines its branches and selects each output: no `cond` is
left, each moment's update fuses as plain AdamW's does, and a `cond` of the model's forward pass
(and its transpose in the backward) is left as it is, as are conds with effects and
`lax.platform_dependent`'s. The rewritten jaxpr computes the original's values bit for bit, one
primitive at a time. Offloaded training with apply_if_finite skips the same steps as `jax.jit`
training, a skipped non-finite step and max_consecutive_errors running out included, and equals
it bit for bit on the CPU where XLA computes AdamW one IEEE operation at a time
(IEEE_XLA_FLAGS), to fp32 rounding otherwise, as plain AdamW does.
"""

import os
import subprocess
import sys

import jax
from jax import lax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import _stacks
import jaxtier
from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import conditions
from jaxtier._src.analysis import inventory
from jaxtier._src.planning import planner

HOST_EXEC = "host_dha" if jax.default_backend() == "gpu" else "host_cpu"
ON_HOST = "optimizer_state_on_host"
SHAPES = {"dense1": {"kernel": (12, 24), "bias": (24,)},
          "out": {"kernel": (24, 4), "bias": (4,)}}
MAX_ERRORS = 3


def _params(seed=0):
  shapes, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, s) * 0.3
                                      for k, s in zip(keys, shapes)])


def _mlp(p, x):
  h = jnp.tanh(x @ p["dense1"]["kernel"] + p["dense1"]["bias"])
  return h @ p["out"]["kernel"] + p["out"]["bias"]


def _gated(p, x):
  """The MLP with a `cond` in its forward pass on a traced predicate (the batch's sign); one
  branch reads the bias too, so the other's transpose makes the bias a zero gradient."""
  d = p["dense1"]
  h = lax.cond(jnp.sum(x) > 0, lambda d: x @ d["kernel"],
               lambda d: x @ (2.0 * d["kernel"]) + d["bias"], d)
  return jnp.tanh(h + d["bias"]) @ p["out"]["kernel"] + p["out"]["bias"]


def _step_fn(tx, model=_mlp):
  """A step over `{"params", "opt"}`; the batch's `scale` multiplies the loss (1.0 changes no
  bit; inf makes every gradient non-finite, as an overflowing loss scale does)."""
  def step(state, batch):
    x, y, scale = batch

    def loss(p):
      return jnp.mean((model(p, x) - y) ** 2) * scale
    value, g = jax.value_and_grad(loss)(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": value}
  return step


def _batch(i, scale=1.0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(1000 + i % 4))
  x = jax.random.normal(k1, (32, 12))
  return x, jnp.sin(x[:, :4]) + 0.1 * jax.random.normal(k2, (32, 4)), jnp.float32(scale)


def _state(tx):
  p = _params()
  return {"params": p, "opt": tx.init(p)}


def _if_finite(inner=None):
  return optax.apply_if_finite(inner or optax.adamw(1e-2, weight_decay=0.1), MAX_ERRORS)


def _traced(tx, model=_mlp):
  """(the step as `jc.inline_calls` leaves it, as the inventory leaves it, number of leaves)."""
  step, state = _step_fn(tx, model), _state(tx)
  closed = jc.inline_calls(jax.make_jaxpr(step)(state, _batch(0)))
  inv = inventory.take_inventory(step, state, (_batch(0),))
  return closed, inv, len(inv.leaves)


def _names(jaxpr):
  return [e.primitive.name for e in jaxpr.eqns]


def _paths(tx):
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(_state(tx))[0]]


def test_apply_if_finite_s_cond_becomes_a_select_per_output():
  tx = _if_finite()
  closed, inv, n = _traced(tx)
  before = closed.jaxpr
  assert _names(before).count("cond") == 1
  (k,) = conditions.conditional_updates(before, n)
  cond = before.eqns[k]
  # The rejecting branch hands back the inner state (its moments and count) and zero updates,
  # which the step adds to the params: all of them are kept.
  kept = [_paths(tx)[i] for i in conditions.kept_leaves(before, k, n)]
  assert kept == [p for p in _paths(tx) if p.startswith(("['opt'].inner_state", "['params']"))]

  after = inv.closed_jaxpr.jaxpr
  assert "cond" not in _names(after)
  assert not conditions.conditional_updates(after, n)
  # One select per output of the cond.
  assert _names(after).count("select_n") >= _names(before).count("select_n") + len(cond.outvars)
  # Each new moment is a select whose first case (the rejected step) is the old moment.
  for i, path in enumerate(_paths(tx)):
    if ".mu[" in path or ".nu[" in path:
      out = after.outvars[i]
      eqn = next(e for e in after.eqns if out in e.outvars)
      assert eqn.primitive.name == "select_n" and eqn.invars[1] is after.invars[i], path
      # On the predicate's bool, as `lax.cond` converted it to the index: cases[index].
      assert eqn.invars[0].aval.dtype == jnp.bool_ and eqn.invars[0].aval.shape == ()


def test_a_step_without_a_conditional_update_is_left_as_traced():
  closed, inv, n = _traced(optax.adamw(1e-2))
  assert conditions.select_conds(closed, n) is closed
  assert _names(inv.closed_jaxpr.jaxpr) == _names(closed.jaxpr)


@pytest.mark.parametrize("wrapped", [False, True], ids=["sgd", "apply_if_finite_sgd"])
def test_a_cond_in_the_model_s_forward_and_backward_is_left_alone(wrapped):
  tx = _if_finite(optax.sgd(5e-2)) if wrapped else optax.sgd(5e-2)
  closed, inv, n = _traced(tx, _gated)
  model_conds = 2  # the forward's, and its transpose in the backward pass
  assert _names(closed.jaxpr).count("cond") == model_conds + wrapped
  after = inv.closed_jaxpr.jaxpr
  assert _names(after).count("cond") == model_conds
  conds = [k for k, e in enumerate(after.eqns) if e.primitive.name == "cond"]
  assert all(not conditions.kept_leaves(after, k, n) for k in conds)
  if wrapped:
    # apply_if_finite over a stateless SGD keeps no optimizer state: its skipping branch
    # returns zero updates, which the step adds to the params.
    (k,) = conditions.conditional_updates(closed.jaxpr, n)
    kept = [_paths(tx)[i] for i in conditions.kept_leaves(closed.jaxpr, k, n)]
    assert kept == [p for p in _paths(tx) if p.startswith("['params']")], kept
  else:
    # The backward's cond makes the kernel's whole gradient, which SGD turns into the new
    # kernel elementwise, and in one branch a zero gradient for the bias: reaching the new
    # state is not what makes a cond an update that may be skipped; keeping a leaf is.
    kernel = _paths(tx).index("['params']['dense1']['kernel']")
    backward = conds[-1]
    made = [o for o in after.eqns[backward].outvars if o.aval.shape == (12, 24)]
    assert made and conditions._reaches_elementwise(  # pylint: disable=protected-access
        after, backward, made[0], kernel)


def _guarded(inner, effect):
  """`inner` applied when the gradients are finite; the skipping branch runs `effect`."""
  def init(params):
    return inner.init(params)

  def update(g, state, params=None):
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(g)]))

    def skip(_):
      effect(ok)
      return jax.tree.map(jnp.zeros_like, g), state
    return lax.cond(ok, lambda _: inner.update(g, state, params), skip, None)
  return optax.GradientTransformation(init, update)


def _no_effect(ok):
  del ok


def _debug_callback(ok):
  jax.debug.callback(lambda v: None, ok)


def _io_callback(ok):
  io_callback(lambda v: None, None, ok, ordered=True)


@pytest.mark.parametrize("effect, rewritten", [(_no_effect, True), (_debug_callback, False),
                                               (_io_callback, False)],
                         ids=["none", "debug_callback", "ordered_io_callback"])
def test_a_cond_with_effects_is_left_alone(effect, rewritten):
  closed, inv, _ = _traced(_guarded(optax.adam(1e-2), effect))
  (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
  assert bool(cond.effects) != rewritten
  assert _names(inv.closed_jaxpr.jaxpr).count("cond") == (0 if rewritten else 1)


def _momentum_unless_cpu():
  """Momentum SGD whose momentum is kept as it is on the CPU (`lax.platform_dependent`)."""
  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(g, m, params=None):
    del params
    m = lax.platform_dependent(m, cpu=lambda m: m,
                               default=lambda m: jax.tree.map(lambda a, b: 0.9 * a + b, m, g))
    return jax.tree.map(lambda a: -1e-2 * a, m), m
  return optax.GradientTransformation(init, update)


def test_a_platform_dependent_cond_is_left_alone():
  # Its CPU branch keeps the momentum, but the index names the platform it is lowered for: the
  # other branches need not lower there.
  closed, inv, n = _traced(_momentum_unless_cpu())
  assert _names(closed.jaxpr).count("cond") == 1
  assert not conditions.conditional_updates(closed.jaxpr, n)
  assert _names(inv.closed_jaxpr.jaxpr).count("cond") == 1


def _switched(lr=5e-2):
  """Momentum SGD whose step count picks one of three branches: keep the momentum, update it,
  or update it at twice the rate (a `lax.switch`, its index clamped into range)."""
  def init(params):
    return {"count": jnp.zeros([], jnp.int32), "m": jax.tree.map(jnp.zeros_like, params)}

  def update(g, state, params=None):
    del params
    branches = [lambda m: m, lambda m: jax.tree.map(lambda a, b: 0.9 * a + b, m, g),
                lambda m: jax.tree.map(lambda a, b: 0.9 * a + 2.0 * b, m, g)]
    m = lax.switch(state["count"] % 4, branches, state["m"])
    return jax.tree.map(lambda a: -lr * a, m), {"count": state["count"] + 1, "m": m}
  return optax.GradientTransformation(init, update)


def _op_by_op(jaxpr, consts, args):
  """`jaxpr` evaluated one primitive at a time, eagerly: a `cond` runs the branch its index
  names (the last one for an index out of range, as XLA's Conditional does) and calls run their
  bodies, so that no compiler fuses (and rounds) two primitives together."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jc.Literal) else env[v]
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive.name == "cond":
      branches = eqn.params["branches"]
      k = int(ins[0])
      body, cs = jc.open_jaxpr(branches[k if 0 <= k < len(branches) else -1])
      outs = _op_by_op(body, cs, ins[1:])
    elif jc.inner_jaxpr(eqn) is not None:
      body, cs = jc.open_jaxpr(jc.inner_jaxpr(eqn))
      outs = _op_by_op(body, cs, ins[len(ins) - len(body.invars):])
    else:
      outs = jc.bind_eqn(eqn, ins)
    env.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, jc.DropVar))
  return [read(v) for v in jaxpr.outvars]


@pytest.mark.parametrize("name", ["apply_if_finite", "switch"])
def test_the_rewritten_step_computes_the_same_bits(name):
  tx = _if_finite() if name == "apply_if_finite" else _switched()
  closed, inv, n = _traced(tx)
  assert "cond" not in _names(inv.closed_jaxpr.jaxpr)
  (k,) = conditions.conditional_updates(closed.jaxpr, n)
  kept = conditions.kept_leaves(closed.jaxpr, k, n)
  state = jax.tree.leaves(_state(tx))
  taken = set()
  for i, scale in enumerate([1.0, np.inf, 1.0, np.nan]):
    flat = state + jax.tree.leaves(_batch(i, scale))
    want = _op_by_op(closed.jaxpr, closed.consts, flat)
    got = _op_by_op(inv.closed_jaxpr.jaxpr, inv.closed_jaxpr.consts, flat)
    for k, (a, b) in enumerate(zip(want, got)):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"step {i} out {k}")
    taken.add(all(np.array_equal(want[j], state[j]) for j in kept))
    state = want[:n]
  assert taken == {True, False}  # the branch that keeps the leaves runs, and the other one


def _stack_step(tx):
  graphdef, params = nnx.split(_stacks.Stack(nnx.Rngs(0), layers=4, width=16, head=2))

  def step(state, x, y):
    def loss(p):
      return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)
    value, g = jax.value_and_grad(loss)(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, value

  args = (jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((8, 2), jnp.float32))
  return step, {"params": params, "opt": tx.init(params)}, args


def test_apply_if_finite_s_moments_are_placed_as_plain_adamw_s():
  def placements(tx):
    plan = planner.make_plan(inventory.take_inventory(*_stack_step(tx)), platform="cpu",
                             policy=ON_HOST)
    moments = {l.path.split("inner_state")[-1].lstrip("]")
               if "inner_state" in l.path else l.path.removeprefix("['opt']"): l
               for l in plan.leaves if ".mu[" in l.path or ".nu[" in l.path}
    return moments, plan

  plain, plain_plan = placements(optax.adamw(1e-2))
  wrapped, plan = placements(_if_finite(optax.adamw(1e-2)))
  assert len(wrapped) == len(plain) == 8
  for path, leaf in wrapped.items():
    # (Planned for the CPU on any machine: its host updates run on the CPU.)
    assert leaf.placement == "host_cpu" == plain[path].placement, (leaf, str(plan.table()))
    assert leaf.role == "optimizer_state"
  assert "host_xla" not in {l.placement for l in plan.leaves}, plan.table()
  assert plan.num_host_updates == plain_plan.num_host_updates


# Steps whose loss scale is not finite: one skipped alone, then more in a row than
# max_consecutive_errors allows (the last of them is applied, as apply_if_finite says).
NON_FINITE = {3: np.inf, 8: np.inf, 9: np.nan, 10: np.inf, 11: np.inf}
STEPS = 12
# XLA's CPU compiler rounds some of AdamW's arithmetic otherwise than one IEEE operation at a
# time, as the fused host update computes it: it contracts a multiply and an add into one FMA
# where the CPU has FMA, and makes a division by a broadcast scalar (the bias correction) a
# multiplication by its reciprocal. Plain AdamW's offloaded values differ from `jax.jit`'s in the
# last bits so. These flags turn both off; under them offloaded training equals `jax.jit`'s bit
# for bit (`test_offloaded_apply_if_finite_is_jax_jit_bit_for_bit_under_ieee_xla`).
IEEE_XLA_FLAGS = ("--xla_cpu_max_isa=AVX", "--xla_disable_hlo_passes=algsimp")
IEEE_XLA = (jax.default_backend() == "cpu"
            and all(f in os.environ.get("XLA_FLAGS", "").split() for f in IEEE_XLA_FLAGS))


def _snapshot(state):
  return jax.tree.map(np.asarray, state)


def _run(step, state):
  states, losses = [], []
  for i in range(STEPS):
    state, m = step(state, _batch(i, NON_FINITE.get(i, 1.0)))
    states.append(_snapshot(state))
    losses.append(np.asarray(m["loss"]))
  return states, losses


def _check_skips(states, losses):
  """What apply_if_finite did, step by step: skipped steps keep params, moments and count bit
  for bit and count the error; a finite step updates; max_consecutive_errors + 1 in a row
  applies the non-finite update."""
  inner = lambda s: s["opt"].inner_state
  for i in range(1, STEPS):
    prev, cur = states[i - 1], states[i]
    counts = (int(cur["opt"].notfinite_count), int(cur["opt"].total_notfinite))
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves((prev["params"], inner(prev))),
                                                    jax.tree.leaves((cur["params"], inner(cur)))))
    if i == 3:  # skipped: params, moments and count unchanged; the counters count it
      assert same and counts == (1, 1) and not bool(cur["opt"].last_finite)
      assert not np.isfinite(losses[i])
    elif i in (8, 9, 10):  # skipped, up to max_consecutive_errors in a row
      assert same and counts == (i - 7, i - 6), (i, counts)
    elif i == 11:  # one more than allowed: applied, the non-finite update reaches the params
      assert not same and counts == (4, 5)
      assert int(inner(cur)[0].count) == int(inner(prev)[0].count) + 1
      assert not all(np.isfinite(p).all() for p in jax.tree.leaves(cur["params"]))
    else:  # a finite step updates, and resets the run of errors
      assert not same and counts[0] == 0 and bool(cur["opt"].last_finite), i
      assert int(inner(cur)[0].count) == int(inner(prev)[0].count) + 1
  assert np.isfinite(losses[7]) and losses[7] < losses[0]


def test_offloaded_apply_if_finite_trains_as_jax_jit():
  """Offloaded against `jax.jit` training: the same skips, and the same values (bit for bit
  under IEEE_XLA_FLAGS on the CPU; else to fp32 rounding, as plain AdamW's)."""
  tx = _if_finite()
  ref_states, ref_losses = _run(jax.jit(_step_fn(tx), donate_argnums=0), _state(tx))
  step = jaxtier.offload(_step_fn(tx), policy=ON_HOST)
  state = step.place(_state(tx), _batch(0))
  by_path = {l.path: l for l in step.plan.leaves}
  moments = [p for p in by_path if ".mu[" in p or ".nu[" in p]
  assert len(moments) == 8 and all(by_path[p].placement == HOST_EXEC for p in moments)
  assert step.plan.num_host_updates == 4
  states, losses = _run(step, state)
  _check_skips(ref_states, ref_losses)
  _check_skips(states, losses)
  for i in range(STEPS):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path((states[i], losses[i]))[0],
                            jax.tree.leaves((ref_states[i], ref_losses[i]))):
      msg = f"step {i}: {jax.tree_util.keystr(path)}"
      if IEEE_XLA:
        np.testing.assert_array_equal(a, b, err_msg=msg)
      else:
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=msg)


@pytest.mark.skipif(IEEE_XLA, reason="the in-process test ran under IEEE_XLA_FLAGS")
def test_offloaded_apply_if_finite_is_jax_jit_bit_for_bit_under_ieee_xla(tmp_path):
  """The test above in a fresh interpreter on the CPU, with IEEE_XLA_FLAGS (read when JAX
  starts its backend): every value of every step equal to `jax.jit`'s, bit for bit."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(IEEE_XLA_FLAGS))
  test = f"{__file__}::test_offloaded_apply_if_finite_trains_as_jax_jit"
  p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                     capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
  assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
