"""The planner reads an embedding table in place (host_dha) where HBM is short, and says why."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxtier
from jaxtier.examples import llama, train_state

EMBED = "[0]['embed']['embedding'].value"


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="plans for an absent GPU")
def test_8b_with_a_128k_vocabulary_under_a_tight_budget_reads_the_table_in_place(monkeypatch):
  # XLA's pinned pool raised as a user of this size must (the 64 GB default holds less than
  # the optimizer state alone).
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
  config = dataclasses.replace(llama.CONFIGS["8b"], vocab_size=131072)
  _, state, step = train_state.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((4, 2049), jnp.int32)
  acts = llama.activation_model(config, 4, 2048)
  # (60 GB holds the table on the device: a layered update frees each layer's gradient.)
  plan = jaxtier.plan(step, state, tokens, device_budget="45GB", platform="gpu", activations=acts)
  assert plan.fits
  table = {l.path: l for l in plan.leaves}[EMBED]
  assert table.placement == "host_dha" and table.memory_kind == "pinned_host"
  # 4 x 2048 ids of 4096 fp32 per step: 128 MiB of rows, not the 2 GiB table.
  assert "an embedding table whose rows the DHA gather reads in place (128.00 MiB of rows per " \
         "step, not the 2.00 GiB a copy of the table would move" in table.reason
  # Its pinned bytes: the table and the buffer its gradient rows are added into.
  moments = [l for l in plan.leaves if "['embed']" in l.path and l.role == "optimizer_state"]
  assert all(l.memory_kind == "pinned_host" for l in moments)
  # The matmul weights are not read in place (streaming them beats it on the H200), and the
  # streamed ones say why, from the profile's two rates.
  assert not any(l.placement == "host_dha" for l in plan.leaves
                 if l.role == "param" and l.path != EMBED)
  streamed = [l for l in plan.leaves if l.placement == "host_stream"]
  assert streamed and all(
      "the copy engines move it at 53.0 GB/s; the DHA matmul would read it in place at 49.0"
      in l.reason for l in streamed), [l.reason for l in streamed]


def test_jaxtier_plan_can_be_told_no_table_is_read_in_place(monkeypatch):
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
  config = dataclasses.replace(llama.CONFIGS["8b"], vocab_size=131072)
  _, state, step = train_state.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((4, 2049), jnp.int32)
  plan = jaxtier.plan(step, state, tokens, device_budget="60GB", platform="gpu",
                      activations=llama.activation_model(config, 4, 2048), dha_readable=())
  assert {l.path: l for l in plan.leaves}[EMBED].placement == "device"


def test_a_users_table_is_read_in_place_where_only_that_fits():
  # A found-by-a-user case: the solver reserved double buffers of the whole table for reading
  # it in place (as for a streamed layer), so no plan fit; only the gathered rows are held.
  import optax  # pylint: disable=g-import-not-at-top
  v, d = 262144, 2048
  tx = optax.adamw(1e-3)

  def step(state, ids):
    def loss(p):
      x = jnp.take(p["embed"], ids, axis=0)
      return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
    g = jax.grad(loss)(state[0])
    u, o = tx.update(g, state[1], state[0])
    return (optax.apply_updates(state[0], u), o), {}

  params = {"embed": jax.ShapeDtypeStruct((v, d), jnp.float32),
            "w": jax.ShapeDtypeStruct((d, 64), jnp.float32)}
  state = (params, jax.eval_shape(tx.init, params))
  ids = jax.ShapeDtypeStruct((8, 512), jnp.int32)
  plan = jaxtier.plan(step, state, ids, device_budget="3GiB", platform="gpu")
  assert plan.fits, plan.verdicts
  assert {l.path: l for l in plan.leaves}["[0]['embed']"].placement == "host_dha"
  assert plan.predicted_peak_hbm_bytes < 1 * 2**30
