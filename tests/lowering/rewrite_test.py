"""The fused host updates as the lowering runs them: device results from a call of their own,
written in place over the donated old value; host results in place in pinned_host after it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxtier
from jaxtier._src.analysis import op_program_compiler


def _mlp(dtype=jnp.float32):
  params = {"w1": jnp.ones((64, 128), dtype) * 0.01, "w2": jnp.ones((128, 8), dtype) * 0.02}
  return params


def _step(tx, metrics=lambda p, g: {}):
  def step(state, batch):
    p = state["params"]
    loss, g = jax.value_and_grad(
        lambda q: jnp.mean(jnp.tanh(batch @ q["w1"].astype(jnp.float32))
                           @ q["w2"].astype(jnp.float32)))(p)
    u, o = tx.update(g, state["opt"], p)
    return {"params": optax.apply_updates(p, u), "opt": o}, {"loss": loss, **metrics(p, g)}
  return step


def _donated_device_args(lowered_text: str) -> int:
  main = re.search(r"func.func public @main\((.*?)\) ->", lowered_text, re.S).group(1)
  return sum(1 for a in main.split("%arg")[1:]
             if 'memory_kind = "device"' in a and "tf.aliasing_output" in a)


def test_a_device_param_is_written_in_place_by_a_call_before_its_moments():
  tx = optax.adamw(1e-2, weight_decay=0.1)
  params = _mlp()
  state = {"params": params, "opt": tx.init(params)}
  batch = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32)
  off = jaxtier.offload(_step(tx), policy="optimizer_state_on_host")
  placed = off.place(state, batch)
  leaves = [l.path for l in off.plan.leaves]
  for cc in off.plan.components:
    device_call, host_call = op_program_compiler.calls_of(cc)
    assert not device_call.ordered and host_call.ordered
    (k,) = device_call.results
    assert not op_program_compiler.is_host_result(cc, k)
    # The param's new value overwrites the param itself (AdamW's moments never read it).
    target = cc.operands[device_call.operands[device_call.aliases[0]]]
    assert target.kind == "value" and "['params']" in leaves[target.index]
    assert target.index not in {cc.operands[i].index for i in host_call.operands}
    assert all(op_program_compiler.is_host_result(cc, r) for r in host_call.results)
  # Both old params are donated to the update program, and paired with their new values.
  assert _donated_device_args(off.lower_update(placed, batch).as_text()) == 2
  ref = jax.jit(_step(tx))
  ref_state = state
  for _ in range(5):
    ref_state, m_ref = ref(ref_state, batch)
    placed, m = off(placed, batch)
    np.testing.assert_allclose(float(m["loss"]), float(m_ref["loss"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_a_bf16_param_from_its_master_gets_a_buffer_of_its_own():
  # The new bf16 param comes from the fp32 master; the only device operand of its shape is
  # the gradient, which the host call still reads: nothing is written over.
  tx = optax.adamw(1e-2)
  params = _mlp(jnp.bfloat16)
  state = {"params": params, "opt": tx.init(params)}
  batch = jnp.ones((16, 64), jnp.float32)
  off = jaxtier.offload(_step(tx), policy="optimizer_state_on_host")
  placed = off.place(state, batch)
  for cc in off.plan.components:
    device_call, _ = op_program_compiler.calls_of(cc)
    assert device_call.aliases == (-1,)
  assert _donated_device_args(off.lower_update(placed, batch).as_text()) == 0
  placed, m = off(placed, batch)
  assert np.isfinite(float(m["loss"]))


def test_an_old_param_the_step_also_returns_is_not_written_over():
  tx = optax.adam(0.5)
  params = _mlp()
  state = {"params": params, "opt": tx.init(params)}
  batch = jnp.ones((16, 64), jnp.float32)
  w2 = np.asarray(params["w2"])  # the state is donated to the step
  step = _step(tx, metrics=lambda p, g: {"old_w2": p["w2"]})
  off = jaxtier.offload(step, policy="optimizer_state_on_host")
  placed = off.place(state, batch)
  # Only w1 is written over; w2's old value is also a result of the step.
  assert _donated_device_args(off.lower_update(placed, batch).as_text()) == 1
  new, m = off(placed, batch)
  np.testing.assert_array_equal(np.asarray(m["old_w2"]), w2)
  assert not np.allclose(np.asarray(new["params"]["w2"]), w2)


def test_the_pinned_pool_is_reserved_as_one_buffer_on_a_gpu_plan_only(monkeypatch, caplog):
  import dataclasses
  from jaxtier._src.lowering import compiled
  tx = optax.adam(1e-2)
  params = _mlp()
  state = {"params": params, "opt": tx.init(params)}
  off = jaxtier.offload(_step(tx), policy="optimizer_state_on_host")
  off.place(state, jnp.ones((16, 64), jnp.float32))
  plan, shardings = off.plan, off._programs.state_shardings
  monkeypatch.setattr(compiled, "RESERVE_MIN_BYTES", 0)
  cpu = dataclasses.replace(plan, platform="cpu")
  assert not compiled.reserve_pinned_pool(cpu, shardings)  # the CPU backend has no pool
  gpu = dataclasses.replace(plan, platform="gpu")
  made = []
  real = jax.jit
  monkeypatch.setattr(jax, "jit", lambda f, **kw: made.append(kw) or real(f, **kw))
  assert compiled.reserve_pinned_pool(gpu, shardings)
  (kw,) = made
  assert kw["out_shardings"].memory_kind == "pinned_host"
  monkeypatch.setattr(compiled, "RESERVE_MIN_BYTES", plan.pinned_bytes + 1)
  assert not compiled.reserve_pinned_pool(gpu, shardings)  # too small to matter
  # A reservation that cannot be made is logged, and the leaves are made one by one.
  monkeypatch.setattr(compiled, "RESERVE_MIN_BYTES", 0)
  monkeypatch.setattr(jax, "jit", lambda f, **kw: (_ for _ in ()).throw(RuntimeError("no")))
  assert not compiled.reserve_pinned_pool(gpu, shardings)
  assert "could not reserve" in caplog.text
