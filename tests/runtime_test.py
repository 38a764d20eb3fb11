"""The offloaded step at run time: calls timed against the prediction, and (on a GPU) one leaf of
16 GiB placed in pinned_host and updated in place."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier
from jaxtier._src import runtime


def test_a_16gib_fp32_leaf_in_pinned_host_is_updated_in_place(gpu):
  # One leaf of 4 x 2^30 fp32 elements (16 GiB) placed in pinned_host (XLA's pinned pool takes it
  # in one allocation) and updated in place by a step; the step's device peak stays small.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  n = 4 * 2**30
  mesh = Mesh(np.asarray([gpu]), ("d",))
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")

  def step(state, g):
    acc = 0.5 * state["acc"] + g
    return {"acc": acc, "w": state["w"] * 1.0}, {"w": jnp.sum(state["w"])}
  state = {"acc": jax.jit(lambda: jnp.ones((n,), jnp.float32), out_shardings=dev)(),
           "w": jax.device_put(jnp.ones((16,), jnp.float32), dev)}
  g = jax.device_put(jnp.float32(1.0), dev)
  off = jaxtier.offload(step, policy={r"\['acc'\]": "host_dha"})
  try:
    state = off.place(state, g)
  except jaxtier.AdmissionError as e:
    msg = str(e)
    assert "['acc']" in msg and "16.00 GiB" in msg and str(4 * n) in msg, msg
    pytest.xfail(f"the 16 GiB pinned allocation failed here: {msg}")
  assert off.plan.placements()["['acc']"] == "host_dha"
  assert state["acc"].sharding.memory_kind == "pinned_host"
  for _ in range(2):
    state, _ = off(state, g)
  assert state["acc"].sharding.memory_kind == "pinned_host"
  back = jax.device_put(state["acc"], dev)  # 16 GiB back to HBM, every element checked
  # (min and max, not indexing: an index of 2^32 overflows JAX's int32 indices).
  lo, hi = jax.jit(lambda a: (jnp.min(a), jnp.max(a)))(back)
  assert (float(lo), float(hi)) == (1.75, 1.75)
  del back
  assert off.plan.compiler_peak_hbm_bytes is None or off.plan.compiler_peak_hbm_bytes < 2**30


def test_offloaded_step_reports_measured_against_predicted_step_time(caplog):
  # Calls 2-4 are timed and the plan gains the measured step time beside its prediction.
  tx = optax.adam(1e-2)

  def step(state, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p) ** 2))(state["w"])
    u, o = tx.update(g, state["opt"], state["w"])
    return {"w": optax.apply_updates(state["w"], u), "opt": o}, {}
  w = jnp.ones((32, 32)) * 0.1
  x = jnp.ones((8, 32))
  off = jaxtier.offload(step, policy="optimizer_state_on_host")
  st = off.place({"w": w, "opt": tx.init(w)}, x)
  with caplog.at_level(logging.INFO, logger="jaxtier"):
    for k in range(1 + runtime.MEASURED_STEPS):
      assert off.plan.measured_step_secs is None, k
      st, _ = off(st, x)
  measured = off.plan.measured_step_secs
  assert measured is not None and 0 < measured < 60
  assert off.plan.predicted_step_secs is not None
  assert "measured step:" in str(off.plan)
  assert any("step time measured" in r.getMessage() and "predicted" in r.getMessage()
             for r in caplog.records)
