"""The planner end to end (`jaxtier.plan`, `jaxtier.offload` with policy 'auto').

Without a budget everything stays on the device; under a device budget that the all-device plan
exceeds, the plan moves optimizer state to the host (or streams the layer stack where only that
fits) and the step trains like `jax.jit`; a plan that does not fit says so, describing the plan
made; on the CPU backend the plan is checked against the host's available memory.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from planning._toy import HOST_EXEC, STEP, mlp_state, toy_batch
import pytest

import jaxtier
from jaxtier._src import units
from jaxtier._src.hardware import host as host_lib


def test_auto_without_budget_keeps_everything_on_device():
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch())
  assert {l.placement for l in plan.leaves} == {"device"} and plan.num_host_updates == 0
  assert plan.predicted_step_secs > 0 and plan.critical_path == "compute"
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(mlp_state()))
  assert plan.predicted_peak_hbm_bytes > state_bytes
  data = json.loads(plan.to_json())
  for key in ("predicted_step_secs", "critical_path", "predicted_peak_hbm_bytes",
              "resource_secs", "segments", "notes"):
    assert key in data
  text = str(plan)  # the summary
  assert text == plan.summary() and len(text.splitlines()) <= 20
  if jax.default_backend() == "cpu":
    # Planned for the CPU backend: its device memory is RAM, not HBM.
    assert "\nstep: " in text and "\npeak device memory: " in text
    assert "HBM" not in text and "predicted peak device memory:" in plan.table()
  else:
    assert "\nstep: " in text and "\npeak HBM: " in text
  gpu = jaxtier.plan(STEP, mlp_state(), toy_batch(), platform="gpu")
  assert "\npeak HBM: " in str(gpu) and "predicted peak HBM:" in gpu.table()


def test_auto_under_a_budget_the_device_plan_exceeds_runs_like_jit():
  full = jaxtier.offload(STEP)
  state = full.place(mlp_state(), toy_batch())
  all_device_peak = full.plan.compiler_peak_hbm_bytes or full.plan.predicted_peak_hbm_bytes
  budget = int(all_device_peak * 0.85)
  # The serial schedule: on a GPU the executor of layered updates is the planner's choice.
  step = jaxtier.offload(STEP, device_budget=budget, overlap_update=False)
  placed = step.place(mlp_state(), toy_batch())
  plan = step.plan
  kinds = {l.path: l.placement for l in plan.leaves}
  assert kinds["['opt'][0].mu['w1']"] == HOST_EXEC and kinds["['opt'][0].nu['w1']"] == HOST_EXEC
  assert kinds["['params']['w1']"] == "device"
  assert plan.predicted_peak_hbm_bytes <= budget < all_device_peak
  assert plan.compiler_peak_hbm_bytes is not None  # the planned step was compiled and checked
  assert "moved to pinned_host to fit the device budget" in {
      l.path: l.reason for l in plan.leaves}["['opt'][0].mu['w1']"]
  ref = jax.jit(STEP, donate_argnums=0)
  s1 = mlp_state()
  del state
  for i in range(5):
    s1, m1 = ref(s1, toy_batch(seed=i))
    placed, m2 = step(placed, toy_batch(seed=i))
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(placed["params"]["w1"]), np.asarray(s1["params"]["w1"]),
                             rtol=2e-5, atol=1e-7)


def test_sharded_budgets_are_per_device_in_plan():
  # One device here: bytes per device are whole leaves (meshes: tests/api/offload_sharded_test.py).
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch())
  assert {l.path: l.nbytes for l in plan.leaves}["['params']['w1']"] == 256 * 256 * 4


@pytest.mark.slow
def test_auto_streams_where_only_streaming_fits_and_its_plan_says_it_fits():
  # A budget halfway between the optimizer-offload rule's peak and that of a plan streaming
  # every layer param: `auto` must stream, and the plan re-evaluated after its cut must predict
  # the same fit the search found (the re-evaluation must not count the streamed params'
  # gradients whole on the device, which would make the plan say DOES NOT FIT).
  from jaxtier.examples import llama, train
  config = dataclasses.replace(llama.CONFIGS["tiny"], num_layers=6, d_model=64, num_heads=4,
                               d_ff=128, max_seq_len=32)
  _, abstract, step_fn = train.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((2, 33), jnp.int32)
  rule = jaxtier.plan(step_fn, abstract, tokens, policy="optimizer_state_on_host")
  stream_all = jaxtier.plan(
      step_fn, abstract, tokens,
      policy=lambda path, leaf: ("host_stream" if leaf.role == "param" and "['layers']" in path
                                 else "host_cpu" if leaf.role == "optimizer_state" else None))
  assert stream_all.predicted_peak_hbm_bytes < rule.predicted_peak_hbm_bytes
  budget = (stream_all.predicted_peak_hbm_bytes + rule.predicted_peak_hbm_bytes) // 2
  plan = jaxtier.plan(step_fn, abstract, tokens, device_budget=budget)
  assert plan.fits and not plan.verdicts, plan.verdicts
  assert any(l.placement == "host_stream" for l in plan.leaves)
  assert plan.predicted_peak_hbm_bytes <= budget


def test_cpu_plan_without_budget_is_checked_against_the_hosts_available_memory(monkeypatch):
  # No device budget on the CPU backend, but its memory is the host's RAM: a plan that needs
  # more than is available says DOES NOT FIT (as the 8b config's plan does on a 23 GiB host).
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's check")
  # The state's arrays already exist in that RAM: the plan needs only the rest; a state of
  # ShapeDtypeStructs (planning a model not allocated) needs all of it.
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch())
  assert plan.fits and not plan.verdicts
  resident = sum(x.nbytes for x in jax.tree.leaves(mlp_state()))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_state())
  total = plan.predicted_peak_hbm_bytes + plan.pinned_bytes
  for state, need in ((mlp_state(), total - resident), (abstract, total)):
    monkeypatch.setattr(host_lib, "available_bytes", lambda: need - 1)
    plan = jaxtier.plan(STEP, state, toy_batch())
    assert not plan.fits and plan.violations[0].limit == "host_memory"
    assert (plan.violations[0].need_bytes, plan.violations[0].limit_bytes) == (need, need - 1)
    note = plan.verdicts[0]
    assert f"the plan needs {units.format_bytes(need)} more" in note, note
    assert "--platform=gpu" in note
    monkeypatch.setattr(host_lib, "available_bytes", lambda: need)
    plan = jaxtier.plan(STEP, state, toy_batch())
    assert plan.fits and not plan.verdicts


@pytest.mark.slow
def test_does_not_fit_note_describes_the_plan_made():
  # Under the CLI's `--offload=stream` policy the layers' params are host_stream (placed by the
  # policy): the note must say so, not that this is "every optimizer-state leaf on the host".
  from jaxtier.examples import llama, train
  config = dataclasses.replace(llama.CONFIGS["tiny"], num_layers=2, d_model=32, num_heads=2,
                               d_ff=64, max_seq_len=16)
  _, abstract, step_fn = train.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((2, 17), jnp.int32)
  for policy, host in ((train.stream_layers_policy,
                        f"optimizer-state leaves ({HOST_EXEC}), 9 parameters (host_stream, "
                        "placed by the policy) in pinned_host, the rest on the device"),
                       ("auto", f"optimizer-state leaves ({HOST_EXEC}) in pinned_host, the "
                        "rest on the device")):
    # The serial schedule: on a GPU the layered updates' executor is the planner's own choice.
    # Under auto no parameter streams: on a GPU the planner would stream some to fit.
    kw = dict(overlap_update=False, streamable=frozenset() if policy == "auto" else None)
    state_only = jaxtier.plan(step_fn, abstract, tokens, policy=policy, device_budget=10**9,
                              **kw).device_bytes
    # Room for the device state, not for the step's transient buffers.
    plan = jaxtier.plan(step_fn, abstract, tokens, policy=policy, device_budget=state_only + 1,
                        **kw)
    assert not plan.fits
    note = plan.verdicts[0]
    assert "this is its fallback plan: " in note and host in note, note
    assert "every optimizer-state leaf on the host" not in note
    assert f"exceeds the device budget of {units.format_bytes(state_only + 1)}" in note


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="plans for an absent GPU")
def test_layered_updates_beside_a_streamed_stack_start_a_layer_later(monkeypatch):
  # A streamed scan's gradients land in pinned_host one iteration late (XLA schedules the
  # send and its wait after the next iteration's compute): the plan's tail counts two
  # layers, a plan without a streamed stack one.
  from jaxtier._src.planning import solver  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import llama, train_state  # pylint: disable=g-import-not-at-top
  seen = []
  predict = solver.cost_model.predict

  def spy(**kw):
    seen.append(kw.get("sent_lag_layers", 0))
    return predict(**kw)

  monkeypatch.setattr(solver.cost_model, "predict", spy)
  config = dataclasses.replace(llama.CONFIGS["tiny"], num_layers=4)
  _, state, step = train_state.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((2, 33), jnp.int32)
  streamed = jaxtier.plan(step, state, tokens, platform="gpu", policy={
      r"\['w_down'\]": "host_stream", r"(mu|nu).*w_down": "host_cpu"})
  assert {l.placement for l in streamed.leaves if "w_down" in l.path} == {"host_stream",
                                                                          "host_cpu"}
  assert seen[-1] == 1
  tail = dict((n, s) for n, s, _ in streamed.segments)["layered host update (exposed)"]
  u = streamed.resource_secs["host_cpu"]
  assert tail >= 2 * u / 4 * (1 - 1e-9)
  seen.clear()
  on_host = jaxtier.plan(step, state, tokens, platform="gpu", policy={
      r"(mu|nu).*w_down": "host_cpu"})
  assert not any(l.placement == "host_stream" for l in on_host.leaves)
  assert seen[-1] == 0
