"""Policy requests compose: each leaf's request is honoured or refused with its own reason.

A parameter placed with a host executor (`host_cpu`) is read by the forward pass, so no fused
host update can serve it: it alone falls back to `host_xla`, and the other leaves keep their
placements (a requested `host_stream` stack stays streamed, its moments on the host; the
parameter's own moments on `host_cpu`). The step still trains like `jax.jit`.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import _stacks
import jaxtier

LAYERS, WIDTH = 3, 16


def _setup():
  graphdef, params = nnx.split(_stacks.Stack(nnx.Rngs(0), layers=LAYERS, width=WIDTH,
                                             inputs=8, name="layers"))
  tx = optax.adamw(1e-2)

  def step(state, x):
    value, g = jax.value_and_grad(
        lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2))(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": value}
  return step, {"params": params, "opt": tx.init(params)}


def _by_path(plan):
  return {l.path: l for l in plan.leaves}


@pytest.mark.parametrize("policy", [{"layers": "host_stream", "w_in": "host_cpu"},
                                    {"w_in": "host_cpu"}])
def test_each_request_is_honoured_or_refused_alone(policy, caplog):
  step, state = _setup()
  x = jnp.ones((4, 8))
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    plan = jaxtier.plan(step, state, x, platform="cpu", policy=policy)
  leaves = _by_path(plan)
  w_in = [l for p, l in leaves.items() if p.startswith("['params']['w_in']")]
  assert w_in and all(l.placement == "host_xla" for l in w_in)
  assert all("no fused host update can serve it" in l.reason for l in w_in)
  moments = [l for p, l in leaves.items() if "['w_in']" in p and p.startswith("['opt']")]
  assert moments and all(l.placement == "host_cpu" for l in moments)
  stack = [l for p, l in leaves.items() if p.startswith("['params']['layers']")]
  stack_moments = [l for p, l in leaves.items() if "['layers']" in p and p.startswith("['opt']")]
  if "layers" in policy:
    assert all(l.placement == "host_stream" for l in stack)
    assert all(l.placement == "host_cpu" for l in stack_moments)
  else:  # nothing asked of them: as auto places them, not as w_in's fallback would
    assert all(l.placement == "device" for l in stack + stack_moments)
    assert not any("w_in" in l.reason for l in stack + stack_moments)
  # The warning names the parameters alone.
  warned = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()
            or "fall back" in r.getMessage()]
  assert warned and all("['layers']" not in m for m in warned), warned


# Some donated leaves have no output of the same program to alias them: jax says so.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_composed_policy_trains_like_jit():
  step, state = _setup()
  batches = [jax.random.normal(jax.random.PRNGKey(i), (4, 8)) for i in range(4)]
  ref_state, want = jax.tree.map(jnp.copy, state), []
  for x in batches:
    ref_state, m = jax.jit(step)(ref_state, x)
    want.append(float(m["loss"]))
  off = jaxtier.offload(step, policy={"layers": "host_stream", "w_in": "host_cpu"})
  placed, got = off.place(state, batches[0]), []
  for x in batches:
    placed, m = off(placed, x)
    got.append(float(m["loss"]))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(ref_state), jax.tree.leaves(placed)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
