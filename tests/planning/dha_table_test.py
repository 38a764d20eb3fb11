"""The planner reads an embedding table in place (host_dha) where HBM is short, and says why."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxtier
from jaxtier.examples import llama, train_state

EMBED = "[0]['embed']['embedding'].value"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="plans for an absent GPU")
def test_8b_with_a_128k_vocabulary_under_a_tight_budget_reads_the_table_in_place(monkeypatch):
  # XLA's pinned pool raised as a user of this size must (the 64 GB default holds less than
  # the optimizer state alone).
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
  config = dataclasses.replace(llama.CONFIGS["8b"], vocab_size=131072)
  _, state, step = train_state.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((4, 2049), jnp.int32)
  acts = llama.activation_model(config, 4, 2048)
  plan = jaxtier.plan(step, state, tokens, device_budget="66GB", platform="gpu", activations=acts)
  assert plan.fits
  table = {l.path: l for l in plan.leaves}[EMBED]
  assert table.placement == "host_dha" and table.memory_kind == "pinned_host"
  # 4 x 2048 ids of 4096 fp32 per step: 128 MiB of rows, not the 2 GiB table.
  assert "an embedding table whose rows the DHA gather reads in place (128.00 MiB of rows per " \
         "step, not the 2.00 GiB a copy of the table would move" in table.reason
  # Its pinned bytes: the table and the buffer its gradient rows are added into.
  moments = [l for l in plan.leaves if "['embed']" in l.path and l.role == "optimizer_state"]
  assert all(l.memory_kind == "pinned_host" for l in moments)
  # The matmul weights are not read in place (streaming them beats it on the H200).
  assert not any(l.placement == "host_dha" for l in plan.leaves
                 if l.role == "param" and l.path != EMBED)


def test_jaxtier_plan_can_be_told_no_table_is_read_in_place(monkeypatch):
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
  config = dataclasses.replace(llama.CONFIGS["8b"], vocab_size=131072)
  _, state, step = train_state.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((4, 2049), jnp.int32)
  plan = jaxtier.plan(step, state, tokens, device_budget="66GB", platform="gpu",
                      activations=llama.activation_model(config, 4, 2048), dha_readable=())
  assert {l.path: l for l in plan.leaves}[EMBED].placement == "device"
