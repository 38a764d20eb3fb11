"""When each fused host update runs (`analysis/update_schedule.py`), decided alone.

A stack of layers under `nnx.scan` with its optimizer state on the host: the stack's updates are
layered, the head's serial (no layer loop). Each rule that keeps an update serial gives its
reason as a record: overlap_update off, JAXTIER_DISABLE_FFI, a mesh, a global-norm clip, a host
leaf read outside its update, a result not written over a device leaf. An embedding table read
in place is updated row by row. The planner records what `decide` returns and costs it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import _stacks
from jaxtier._src.analysis import inventory
from jaxtier._src.analysis import update_schedule as us
from jaxtier._src.analysis.update_schedule import Mode, Refusal, Why
from jaxtier._src.planning import planner

LAYERS, WIDTH = 4, 16
ON_HOST = "optimizer_state_on_host"


def _stack_step(tx, read_params=False):
  graphdef, params = nnx.split(_stacks.Stack(nnx.Rngs(0), layers=LAYERS, width=WIDTH, head=2))

  def step(state, x, y):
    def loss(p):
      return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)
    value, g = jax.value_and_grad(loss)(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    new = {"params": optax.apply_updates(state["params"], u), "opt": o}
    if read_params:  # the stack's old params read by a loop after the backward pass
      for m in jax.tree.leaves(state["params"]["blocks"]):
        value = value + jax.lax.scan(lambda c, layer: (c + jnp.sum(layer), None), 0.0, m)[0]
    return new, value

  x = jax.ShapeDtypeStruct((8, WIDTH), jnp.float32)
  y = jax.ShapeDtypeStruct((8, 2), jnp.float32)
  return step, {"params": params, "opt": tx.init(params)}, (x, y)


def _planned(step, state, args, policy=ON_HOST, **kw):
  inv = inventory.take_inventory(step, state, args)
  plan = planner.make_plan(inv, platform="cpu", policy=policy, **kw)
  return inv.closed_jaxpr.jaxpr, plan


def _decide(jaxpr, plan, **kw):
  given = dict(pinned={l.index for l in plan.leaves if l.memory_kind == "pinned_host"},
               tables={l.index for l in plan.leaves
                       if l.placement == "host_dha" and l.role == "param"})
  return us.decide(jaxpr, plan.components, plan.leaves, **{**given, **kw})


def _seed_paths(plan, s):
  return [plan.leaves[i].path for i in plan.components[s.component].component.seeds]


def _by_part(plan, schedule):
  """{'blocks' / 'head': the schedules of the updates of that part's moments}."""
  out = {"blocks": [], "head": []}
  for s in schedule:
    paths = _seed_paths(plan, s)
    out["blocks" if any("blocks" in p for p in paths) else "head"].append(s)
  return out


def test_a_stack_s_updates_are_layered_and_the_head_s_serial():
  jaxpr, plan = _planned(*_stack_step(optax.adam(1e-2)))
  got = _decide(jaxpr, plan)
  assert got == plan.schedule  # the plan records what `decide` returns
  assert [s.component for s in got] == list(range(len(plan.components)))
  parts = _by_part(plan, got)
  assert len(parts["blocks"]) == 2 and parts["head"], got
  for s in parts["blocks"]:
    assert s.mode == Mode.LAYERED and s.reason is None
    assert jaxpr.eqns[s.loop].primitive.name == "scan"
    assert s.length == LAYERS
    n = int(np.prod(plan.components[s.component].results[0].shape))
    assert s.count * LAYERS == n
    assert s.grads and len(s.targets) == len(plan.components[s.component].results)
    # Adam's moments are pinned_host leaves it writes in place.
    written = us.host_leaves_written([s], {l.index for l in plan.leaves
                                           if l.memory_kind == "pinned_host"})
    assert len(written) == 2 and all("blocks" in plan.leaves[i].path for i in written)
    assert s.table == -1 and s.grad == -1 and s.scatter == -1
  for s in parts["head"]:
    assert s.mode == Mode.SERIAL and s.reason == Refusal(Why.NO_LAYER_LOOP)
    assert "not a layer loop's output" in str(s.reason)


@pytest.mark.parametrize("case, why, text", [
    ("off", Why.OVERLAP_OFF, "overlap_update is off"),
    ("ffi", Why.FFI_DISABLED, "JAXTIER_DISABLE_FFI is set"),
])
def test_a_switch_keeps_every_update_serial(case, why, text, monkeypatch):
  if case == "ffi":
    monkeypatch.setenv("JAXTIER_DISABLE_FFI", "1")
  jaxpr, plan = _planned(*_stack_step(optax.adam(1e-2)), overlap_update=case != "off")
  got = _decide(jaxpr, plan, overlap_update=case != "off")
  assert len(got) == len(plan.components) >= 3
  assert all(s.mode == Mode.SERIAL and s.reason == Refusal(why) for s in got), got
  assert {str(s.reason) for s in got} == {text}
  # The planner costs that: no layered phase, and the plan records the same.
  assert plan.schedule == got
  assert "layered host update (exposed)" not in [name for name, _, _ in plan.segments]


def test_a_leaf_on_a_mesh_keeps_its_update_serial():
  jaxpr, plan = _planned(*_stack_step(optax.adam(1e-2)))
  meshed = {i for c in plan.components for i in c.component.seeds}
  got = _decide(jaxpr, plan, meshed=meshed)
  assert all(s.mode == Mode.SERIAL and s.reason.kind == Why.ON_MESH for s in got), got
  assert str(got[0].reason) == "sharded over a mesh"


def test_a_global_norm_clip_guards_the_stack_on_its_predicate():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  jaxpr, plan = _planned(*_stack_step(tx))
  got = _decide(jaxpr, plan)
  blocks = _by_part(plan, got)["blocks"]
  # Layered on the guess `norm < max` (the clip does not bind): the norm is read only by the
  # case that guess leaves unchosen.
  assert blocks and all(s.mode == Mode.LAYERED and s.guarded for s in blocks), blocks
  assert all(s.guesses == ((1.0,),) and len(s.unread) == 1 for s in blocks), blocks
  assert plan.schedule == got
  assert "layered host update (exposed)" in [name for name, _, _ in plan.segments]
  assert plan.speculation is not None and plan.speculation.enabled


def test_a_scale_by_the_global_norm_keeps_the_stack_serial():
  # Every gradient divided by the norm, clipped or not: no guess of a predicate leaves it
  # unread, so the update waits for the backward pass.
  def normalize():
    def update(g, state, params=None):
      del params
      norm = optax.tree.norm(g)
      return jax.tree.map(lambda t: t / norm, g), state
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  tx = optax.chain(normalize(), optax.adam(1e-2))
  jaxpr, plan = _planned(*_stack_step(tx))
  got = _decide(jaxpr, plan)
  blocks = _by_part(plan, got)["blocks"]
  assert blocks and all(s.mode == Mode.SERIAL for s in blocks)
  assert all(s.reason.kind == Why.WAITS_FOR_EVERY_GRADIENT for s in blocks), blocks
  assert "global-norm clip" in str(blocks[0].reason)
  assert plan.speculation is None
  assert "layered host update (exposed)" not in [name for name, _, _ in plan.segments]


def test_a_host_leaf_read_outside_its_update_keeps_it_serial_and_is_costed_so():
  # The stack's params streamed (host leaves its updates write in place), read again by a loop
  # after the backward pass: an update during that pass would change what the loop reads.
  jaxpr, plan = _planned(*_stack_step(optax.adam(1e-2), read_params=True),
                         policy={r"\['params'\]\['blocks'\]": "host_stream"})
  assert {l.placement for l in plan.leaves if "['params']['blocks']" in l.path} == {
      "host_stream"}
  got = _decide(jaxpr, plan)
  blocks = _by_part(plan, got)["blocks"]
  assert blocks and all(s.mode == Mode.SERIAL for s in blocks), got
  why = blocks[0].reason
  assert why.kind == Why.HOST_LEAF_READ_OUTSIDE and "['params']['blocks']" in why.leaf, why
  assert str(why) == f"host leaf {why.leaf} is read outside its update"
  assert plan.schedule == got
  assert "layered host update (exposed)" not in [name for name, _, _ in plan.segments]
  # Read by nothing else, the streamed stack's updates are layered.
  jaxpr, plan = _planned(*_stack_step(optax.adam(1e-2)),
                         policy={r"\['params'\]\['blocks'\]": "host_stream"})
  assert all(s.mode == Mode.LAYERED for s in _by_part(plan, plan.schedule)["blocks"])
  assert "layered host update (exposed)" in [name for name, _, _ in plan.segments]


def test_a_new_param_not_written_over_a_device_leaf_keeps_it_serial():
  jaxpr, plan = _planned(*_stack_step(optax.adam(1e-2)))
  params = {l.index for l in plan.leaves if l.role == "param"}
  pinned = {l.index for l in plan.leaves if l.memory_kind == "pinned_host"} | params
  blocks = _by_part(plan, _decide(jaxpr, plan, pinned=pinned))["blocks"]
  assert blocks and all(s.mode == Mode.SERIAL for s in blocks)
  assert {s.reason.kind for s in blocks} == {Why.NOT_OVER_DEVICE_LEAF}
  assert all("blocks" in s.reason.leaf and "params" in s.reason.leaf for s in blocks)


def test_a_refusal_renders_its_fields():
  assert str(Refusal(Why.LAYERS_DO_NOT_SPLIT, elements=10, layers=3)) == (
      "10 elements do not split into 3 layers")
  assert str(Refusal(Why.OPERAND_NOT_STACKED, operand=2, layers=4)) == (
      "operand 2 is not stacked over the 4 layers")
  assert Refusal(Why.RETURNED_TWICE, leaf="a") != Refusal(Why.RETURNED_TWICE, leaf="b")
  assert set(us._TEXT) == set(Why)  # every kind renders


V, D, B, T = 96, 16, 4, 6
EMB = "['params']['emb']"


def _table_step(tx):
  rng = np.random.default_rng(0)
  params = {"emb": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
            "head": jnp.asarray(rng.normal(size=(D, V)) * 0.3, jnp.float32)}

  def step(state, ids, targets):
    def loss(p):
      logits = jnp.tanh(jnp.take(p["emb"], ids, axis=0)) @ p["head"]
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    value, g = jax.value_and_grad(loss)(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, value

  ids = jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32)
  return step, {"params": params, "opt": tx.init(params)}, (ids, jnp.roll(ids, 1, axis=1))


def test_a_table_read_in_place_is_updated_row_by_row():
  jaxpr, plan = _planned(*_table_step(optax.adamw(1e-2)), policy={r"\['emb'\]": "host_dha"})
  got = _decide(jaxpr, plan)
  assert got == plan.schedule
  table = next(l.index for l in plan.leaves if l.path == EMB)
  rows = [s for s in got if s.mode == Mode.ROWS]
  assert len(rows) == 1, got
  (s,) = rows
  assert s.table == table and s.reason is None
  assert jaxpr.eqns[s.loop].primitive.name == "gather"
  assert jaxpr.eqns[s.scatter].primitive.name == "scatter-add"
  assert (s.length, s.count) == (V, D)
  assert plan.components[s.component].operands[s.grad].kind == "value"
  assert table in s.written_leaves
  # Not read in place: its gradient is no pinned_host buffer, and the update waits.
  got = _decide(jaxpr, plan, tables=())
  assert got[s.component].mode == Mode.SERIAL
  assert got[s.component].reason.kind == Why.NO_LAYER_LOOP
