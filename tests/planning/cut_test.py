"""The cut of the optimizer update out of the traced step, by dataflow."""

import jax.numpy as jnp
from planning._toy import HOST_EXEC, STEP, mlp_state, toy_batch

import jaxtier


def test_dead_code_in_the_step_does_not_change_the_plan():
  # A value the step computes from a moment and never returns is dropped, as jax.jit drops
  # it: it is no use of the moment, so it must not read as a non-elementwise one (a
  # reduce_sum), which would send the moment to host_xla and the plan over its budget.
  def dead(state, batch):
    unused = jnp.sum(state["opt"][0].mu["w1"])  # noqa: F841
    return STEP(state, batch)

  full = jaxtier.plan(STEP, mlp_state(), toy_batch(), policy="optimizer_state_on_host")
  with_dead = jaxtier.plan(dead, mlp_state(), toy_batch(), policy="optimizer_state_on_host")
  assert [l.placement for l in with_dead.leaves] == [l.placement for l in full.leaves]
  assert {l.path: l.placement for l in with_dead.leaves}["['opt'][0].mu['w1']"] == HOST_EXEC
  assert with_dead.predicted_peak_hbm_bytes == full.predicted_peak_hbm_bytes
