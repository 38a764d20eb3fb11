"""The pipeline that `offload` and `plan` share: the profile it plans with when the platform is
absent, and the refinement of a plan against the compiled step's peak."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from planning._toy import STEP, mlp_state, toy_batch

import jaxtier
from jaxtier._src import pipeline


def test_gpu_plan_without_a_gpu_uses_the_default_profile():
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch(), platform="gpu", device_budget=600_000)
  if jax.default_backend() != "gpu":
    assert any("machine without one" in n and "default hardware profile" in n
               for n in plan.notes), plan.notes
  ex = {l.placement for l in plan.leaves if l.role == "optimizer_state"} - {"device"}
  assert ex and ex <= {"host_dha", "host_cpu", "host_split"}


def test_offload_refines_its_plan_with_the_compiled_peak_and_keeps_it_within_budget(
    monkeypatch, caplog):
  # The pre-compile peak of a plan with optimizer state on the host is above its compiled
  # peak (the device-only step's transient holds the update's temporaries): `offload`
  # re-plans with that credit and keeps the new plan only if it is predicted faster and
  # compiles within the budget; otherwise the first plan stays. Either way the step trains as
  # jax.jit does and the compiled peak is within the budget.
  from jaxtier.examples import llama, train
  config = dataclasses.replace(llama.CONFIGS["tiny"], num_layers=4)
  _, state, step_fn = train.make_train_state(config, 1e-3)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, config.max_seq_len + 1)),
                      jnp.int32)
  full = jaxtier.plan(step_fn, state, batch, policy="none")
  rule = jaxtier.plan(step_fn, state, batch, policy="optimizer_state_on_host")
  budget = (full.predicted_peak_hbm_bytes + rule.predicted_peak_hbm_bytes) // 2
  monkeypatch.setattr(pipeline, "REFINE_CREDIT_SHARES", ())
  first = jaxtier.offload(step_fn, device_budget=budget)
  first.place(state, batch)
  first_plan = first.plan
  monkeypatch.undo()
  assert first_plan.compiler_peak_hbm_bytes < first_plan.predicted_peak_hbm_bytes
  with caplog.at_level(logging.INFO, logger="jaxtier"):
    step = jaxtier.offload(step_fn, device_budget=budget)
    placed = step.place(state, batch)
  refined = any(n.startswith("refined:") for n in step.plan.notes)
  tried = [r.getMessage() for r in caplog.records if "refined plan" in r.getMessage()
           or "keeping the first plan" in r.getMessage()]
  assert tried, "a plan predicted above its compiled peak by > 2% of the budget is refined"
  assert step.plan.compiler_peak_hbm_bytes <= budget
  if refined:
    assert step.plan.predicted_step_secs < first_plan.predicted_step_secs
  else:
    assert "keeping the first plan" in tried[-1]
    assert [l.placement for l in step.plan.leaves] == [l.placement for l in first_plan.leaves]
  _, ref_state, ref_fn = train.make_train_state(config, 1e-3)
  ref = jax.jit(ref_fn)
  for _ in range(2):
    ref_state, m1 = ref(ref_state, batch)
    placed, m2 = step(placed, batch)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-5)
