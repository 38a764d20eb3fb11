"""The pipeline that `offload` and `plan` share: the profile it plans with when the platform is
absent, and the refinement of a plan against the compiled step's peak."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


@pytest.mark.slow
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
  if first_plan.escalation is not None:
    # Where auto's own plan compiles over the budget it escalates instead of refining: on an
    # H100 this step's packed plan compiled 5.9% over its prediction (142,857,136 bytes
    # against 134,941,416, benchmarks/results/tests/all_h100.log). The plan escalation kept
    # fits, as it promises.
    assert first_plan.escalation.fits and first_plan.compiler_peak_hbm_bytes <= budget
    pytest.skip("auto's own plan compiled over the budget and escalated: "
                f"{first_plan.escalation.tried_text()}")
  assert first_plan.pinned_bytes > 0, first_plan.table()
  assert first_plan.compiler_peak_hbm_bytes < first_plan.predicted_peak_hbm_bytes
  # How far the prediction overestimates depends on the card's compiler (over 2% of this
  # budget on an H200, under it on an H100): any overestimate is to be tried here.
  monkeypatch.setattr(pipeline, "REFINE_MIN_OVERESTIMATE", 0.0)
  with caplog.at_level(logging.INFO, logger="jaxtier"):
    step = jaxtier.offload(step_fn, device_budget=budget)
    placed = step.place(state, batch)
  refined = any(n.startswith("refined:") for n in step.plan.notes)
  tried = [r.getMessage() for r in caplog.records if "refined plan" in r.getMessage()
           or "plan refined" in r.getMessage() or "keeping the first plan" in r.getMessage()]
  assert tried, "a plan predicted above its compiled peak is refined"
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


@pytest.mark.slow
def test_a_plan_refused_under_xlas_settings_names_the_settings_under_which_one_fits(
    monkeypatch):
  # The 14b decoder on an H200 as JAX starts there by default (pool 64 GiB, fraction 0.75 of
  # 135.3 GiB free, 120 GiB of host memory available): its optimizer state alone needs
  # 106 GiB pinned, so the plan is refused. The refusal plans again against what the machine
  # has and names the settings under which that plan fits: the pool at the host's room (0.9 of
  # what is available) and the fraction that holds its predicted peak; the CLI applies them.
  from jaxtier._src import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  from jaxtier._src.analysis import inventory as inv_lib  # pylint: disable=g-import-not-at-top
  from jaxtier._src.hardware import host, machine, profile  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import train  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: int(0.75 * 135.3 * 2**30))
  monkeypatch.setattr(host, "available_bytes", lambda: 120 * 2**30)
  _, state, step = train.make_train_state("14b", 1e-3, abstract=True)
  args = (jax.ShapeDtypeStruct((1, 128), jnp.int32),)
  inv = inv_lib.take_inventory(step, state, args, allow_abstract=True)
  costs = pipeline_lib._step_costs(inv, state, args, "gpu", "auto", always=True)
  fixed = dict(platform="gpu", policy="auto", host_budget=None, pinnable_bytes=64 * 2**30,
               hardware=machine.load(platform="gpu"), streamable=pipeline_lib._streamable(inv),
               resident_bytes=0, stream_blocked="")
  with pytest.raises(jaxtier.AdmissionError) as first:
    pipeline_lib._admitted_plan(inv, fixed, None, costs)
  assert first.value.limit == "host_limit" and first.value.plan.pinned_bytes > 64 * 2**30
  with pytest.raises(jaxtier.AdmissionError) as err:
    pipeline_lib._raise_with_room(first.value, inv, fixed, None, costs, state)
  settings = dict(err.value.settings)
  room = err.value.plan
  assert room.fits and 64 * 2**30 < room.pinned_bytes <= 108 * 2**30
  assert settings["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == "108"
  fraction = float(settings["XLA_PYTHON_CLIENT_MEM_FRACTION"])
  assert 0.75 < fraction <= 0.95
  assert room.predicted_peak_hbm_bytes <= fraction * 135.3 * 2**30 * 0.95
  msg = str(err.value)
  assert ("under XLA's settings in force, it needs 106.37 GiB (114214625280 bytes) of pinned "
          "host memory per device, over each local device's share of what this host can pin "
          "now of 64.00 GiB") in msg
  assert (f"A plan fits this machine with XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=108 and "
          f"XLA_PYTHON_CLIENT_MEM_FRACTION={settings['XLA_PYTHON_CLIENT_MEM_FRACTION']} (it "
          f"needs pinned_host {jaxtier.format_bytes(room.pinned_bytes)}") in msg
  # Where the settings in force are all the machine has, nothing is named.
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "108")
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: int(0.95 * 135.3 * 2**30))
  pipeline_lib._raise_with_room(first.value, inv, dict(fixed, pinnable_bytes=108 * 2**30),
                                None, costs, state)


@pytest.mark.slow
def test_does_not_fit_is_said_only_of_a_plan_whose_compiled_step_is_over(caplog):
  # The streamed tiny decoder under a budget its first prediction is over but its compiled
  # step is under: the plan fits, and nothing warned DOES NOT FIT on the way (it did, before
  # the compiled step was known).
  from jaxtier.examples import llama, train  # pylint: disable=g-import-not-at-top
  config = llama.CONFIGS["tiny"]
  _, state, step_fn = train.make_train_state(config, 1e-3)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, config.max_seq_len + 1)),
                      jnp.int32)
  probe = jaxtier.offload(step_fn, policy=train.stream_layers_policy)
  probe.place(jax.tree.map(jnp.copy, state), batch)
  first = jaxtier.plan(step_fn, state, batch, policy=train.stream_layers_policy)
  compiled = probe.plan.compiler_peak_hbm_bytes
  assert first.predicted_peak_hbm_bytes > compiled
  budget = (first.predicted_peak_hbm_bytes + compiled) // 2
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    step = jaxtier.offload(step_fn, policy=train.stream_layers_policy, device_budget=budget)
    step.place(state, batch)
  assert step.plan.fits and step.plan.compiler_peak_hbm_bytes <= budget
  assert not [r for r in caplog.records if "DOES NOT FIT" in r.getMessage()]
  # What the prediction missed (if the plan kept is one it missed) stands no longer: the
  # compiled step overruled it.
  verdict = step.plan.verdict
  assert not step.plan.violations and step.plan.device_budget.given == budget
  assert len(verdict.overruled) == len(verdict.findings)
  assert all((v.limit, v.limit_bytes) == ("device_budget", budget) and v.need_bytes > budget
             for f in verdict.findings for v in f.violations), verdict
  # Over the compiled peak too: said, and run only where allowed (else refused).
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    over = jaxtier.offload(step_fn, policy=train.stream_layers_policy,
                           device_budget=compiled // 4, allow_over_budget=True)
    over.place(state, batch)
  assert [r for r in caplog.records if "DOES NOT FIT" in r.getMessage()]
  assert not over.plan.fits and over.plan.device_budget.given == compiled // 4
  assert [(v.limit, v.limit_bytes) for v in over.plan.violations if not v.binding] == [
      ("device_budget", compiled // 4)], over.plan.violations
  assert all(v.need_bytes > v.limit_bytes for v in over.plan.violations)
  with pytest.raises(jaxtier.AdmissionError) as err:
    jaxtier.offload(step_fn, policy=train.stream_layers_policy,
                    device_budget=compiled // 4).place(state, batch)
  assert (err.value.limit, err.value.limit_bytes) == ("device_budget", compiled // 4)
  assert err.value.need_bytes == err.value.plan.compiler_peak_hbm_bytes > compiled // 4
  assert not err.value.plan.fits


@pytest.mark.slow
def test_auto_streams_where_only_the_streamed_compiled_step_fits(caplog):
  # The tiny decoder under a budget between the compiled peaks of its streamed step and of
  # its best unstreamed one (optimizer state on the host): the solver's prediction finds no
  # fitting placement, and `auto` escalates to the streamed plan, which fits by its compiled
  # step (the plan with the optimizer state on the host is tried first: the solver's own, or
  # compiled once more where the solver's fallback placed other leaves).
  from jaxtier.examples import llama, train  # pylint: disable=g-import-not-at-top
  config = llama.CONFIGS["tiny"]
  _, state, step_fn = train.make_train_state(config, 1e-3)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (16, config.max_seq_len + 1)),
                      jnp.int32)
  peak = {}
  for name, policy in (("stream", train.stream_layers_policy),
                       ("host", "optimizer_state_on_host")):
    probe = jaxtier.offload(step_fn, policy=policy)
    probe.place(jax.tree.map(jnp.copy, state), batch)
    peak[name] = probe.plan.compiler_peak_hbm_bytes
  assert peak["stream"] < peak["host"], peak
  budget = (peak["stream"] + peak["host"]) // 2
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    step = jaxtier.offload(step_fn, device_budget=budget)
    placed = step.place(jax.tree.map(jnp.copy, state), batch)
  assert step.plan.fits and step.plan.compiler_peak_hbm_bytes <= budget, step.plan
  assert "host_stream" in {l.placement for l in step.plan.leaves}
  escalation = step.plan.escalation
  assert escalation.kept == "stream" and escalation.fits, escalation
  assert [a.name for a in escalation.tried] == ["auto", "optimizer_state_on_host", "stream"]
  assert any(n.startswith("escalated to stream: ") for n in step.plan.notes)
  assert not [r for r in caplog.records if "DOES NOT FIT" in r.getMessage()]
  assert not step.plan.violations and step.plan.device_budget.given == budget
  placed, metrics = step(placed, batch)
  assert np.isfinite(float(metrics["loss"]))
