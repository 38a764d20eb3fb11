"""A `jax.profiler` trace of an offloaded CPU step names every jaxtier custom call it ran.

Each fetch, wait, send, host update, layer call and join runs inside a `jax.named_scope`
(`jaxtier.stream_fetch[layer]`, `jaxtier.host_update_layer[layer]`, ...): the trace's events
carry the HLO instruction they ran, and that instruction's metadata carries the scope.
"""

import glob
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import _stacks
import jaxtier
from jaxtier._src.primitives.base import ffi_disabled

LAYERS, WIDTH = 3, 16


def _scopes_in_trace(step, state, batch, tmp_path):
  """{scope family: count} of the jaxtier custom calls the traced steps ran (in the trace)."""
  compiled = [step.lower(state, batch).compile().as_text()]
  if step._programs.split.has_update:  # pylint: disable=protected-access
    compiled.append(step.lower_update(state, batch).compile().as_text())
  op_names = {}
  for text in compiled:
    for m in re.finditer(r"%(\S+) = .*custom_call_target=\"jaxtier_\w+\".*?op_name=\"([^\"]+)\"",
                         text):
      op_names[m.group(1)] = m.group(2)
  assert op_names
  state, _ = step(state, batch)  # compiled and warm
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(2):
      state, _ = step(state, batch)
    jax.block_until_ready(state)
  (path,) = glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)
  ran = set()
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    for line in plane.lines:
      for event in line.events:
        ran.update(v for k, v in event.stats if k == "hlo_op" and v in op_names)
  families = {}
  for name in ran:
    scope = re.search(r"jaxtier\.(\w+)(\[\d+\])?", op_names[name])
    assert scope, op_names[name]
    families[scope.group(1)] = families.get(scope.group(1), 0) + 1
  return families


def _step(graphdef, tx):
  def step(state, x):
    value, g = jax.value_and_grad(
        lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2))(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": value}
  return step


@pytest.mark.skipif(ffi_disabled(), reason="the custom calls are replaced by JAX references")
@pytest.mark.parametrize("policy, want", [
    ("optimizer_state_on_host", ("host_update_layer", "host_update_join", "host_update")),
    ({r"\['blocks'\]": "host_stream"}, ("stream_fetch", "stream_send", "stream_wait",
                                        "host_update_layer", "host_update_join")),
])
def test_trace_names_every_jaxtier_call(policy, want, tmp_path):
  graphdef, params = nnx.split(_stacks.Stack(nnx.Rngs(0), layers=LAYERS, width=WIDTH, head=1))
  tx = optax.adam(1e-2)
  x = jnp.ones((4, WIDTH))
  step = jaxtier.offload(_step(graphdef, tx), policy=policy)
  state = step.place({"params": params, "opt": tx.init(params)}, x)
  got = _scopes_in_trace(step, state, x, tmp_path)
  # XLA:CPU's trace does not hold an event of every thunk it runs: each family at least once.
  # On a GPU the trace holds what ran on the GPU and the copy engines: a wait or a join only
  # makes XLA's stream wait for an event, and leaves none.
  if jax.default_backend() == "gpu":
    want = tuple(w for w in want if w not in ("stream_wait", "host_update_join"))
  assert set(want) <= set(got), got
