"""The planner: cost-model formulas, the solver on synthetic problems, `auto` end to end, the CLI.

Formulas are checked against hand-computed values under a profile of round numbers; the solver
against problems whose answer is known (fits -> all device; a tight budget -> optimizer state to
the host; tighter -> parameters streamed when allowed; infeasible -> the rule-based plan and a
PlanError naming the largest leaves); `auto` under a device budget that the all-device plan
exceeds must run and train like `jax.jit`.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

from conftest import optax_train_step
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier
from jaxtier._src import pipeline, runtime, units
from jaxtier._src.analysis import layer_stacks
from jaxtier._src.analysis import step_costs as step_costs_lib
from jaxtier._src.hardware import calibrate as calibration
from jaxtier._src.hardware import host as host_lib
from jaxtier._src.hardware import profile
from jaxtier._src.planning import cost_model, solver
from jaxtier._src.planning import policy as policy_lib
from jaxtier._src.planning import problem as problem_lib
from jaxtier._src.planning import verify as verify_lib

HOST_EXEC = "host_dha" if jax.default_backend() == "gpu" else "host_cpu"
# Round numbers, so that every expected value below is computed by hand.
P = profile.HardwareProfile(
    link_h2d_gbps=50.0, link_d2h_gbps=40.0, link_duplex_gbps=60.0, dha_read_gbps=100.0,
    dha_write_gbps=50.0, dha_rw_gbps=80.0, host_dram_gbps=100.0, cpu_adamw_params_per_sec=1e9,
    dha_adamw_params_per_sec=3e9, matmul_tflops=100.0, hbm_gbps=1000.0)
GB = 1e9


# ---- cost model formulas ----------------------------------------------------------------------

def test_profile_rates_and_validation():
  assert P.cpu_update_gbps() == pytest.approx(32.0)  # 1e9 params/s x 32 B/param
  assert profile.split_fraction(P) == pytest.approx(0.75)
  with pytest.raises(ValueError, match="expected dha_read_gbps > 0"):
    profile.HardwareProfile(dha_read_gbps=-1.0)
  with pytest.raises(ValueError, match="expected device_kind to be a string"):
    profile.HardwareProfile(device_kind=3)
  d = profile.DEFAULT_PROFILE
  assert d.is_default and d.link_duplex_gbps < d.link_h2d_gbps + d.link_d2h_gbps
  assert d.pinnable_bytes == 64 * 2**30 and d.hbm_bytes < 144 * 2**30


def test_update_cost_formulas():
  t = cost_model.UpdateTraffic(host_read_bytes=GB, host_write_bytes=GB, device_in_bytes=GB // 2,
                       device_out_bytes=GB // 4)
  dha = cost_model.update_cost("host_dha", t, P)
  # Elements unknown: max(R / 100, W / 50, (R + W) / 60 (duplex), (R + W) / 80 (dha_rw)) GB/s
  # = max(0.01, 0.02, 0.0333, 0.025) s.
  assert dha.secs == pytest.approx(2 / 60) and dha.bound == "dha"
  assert (dha.h2d_bytes, dha.d2h_bytes) == (GB, GB)
  # With the elements: the kernel's time N * t + (R + W) / u, t from the AdamW rate at 24
  # bytes per element: t = 1 / 3e9 - 24 / u. 125e6 elements (16 B each), u = 121 GB/s.
  n = 125 * 10**6
  t_n = dataclasses.replace(t, elements=n)
  per_elem = 1 / 3e9 - 24 / 121e9
  kernel = n * per_elem + 2 * GB / 121e9
  assert cost_model.update_cost("host_dha", t_n, P).secs == pytest.approx(max(2 / 60, kernel))
  # The fitted default reproduces W2's AdamW rate (24 B/param) and the H200's 16 B/param one.
  d = profile.DEFAULT_PROFILE
  w2 = cost_model.UpdateTraffic(host_read_bytes=12 * n, host_write_bytes=12 * n, device_in_bytes=0,
                        device_out_bytes=0, elements=n)
  assert n / cost_model.update_cost("host_dha", w2, d).secs == pytest.approx(d.dha_adamw_params_per_sec)
  moments = dataclasses.replace(w2, host_read_bytes=8 * n, host_write_bytes=8 * n)
  assert n / cost_model.update_cost("host_dha", moments, d).secs == pytest.approx(3.34e9, rel=0.01)
  cpu = cost_model.update_cost("host_cpu", t, P)
  # M = R + W + 2 (D_in + D_out) = 3.5 GB at 32 GB/s; links: 0.5 GB / 40, 0.25 GB / 50.
  assert cpu.secs == pytest.approx(3.5 / 32) and cpu.bound == "host_cpu"
  assert (cpu.h2d_bytes, cpu.d2h_bytes) == (GB // 4, GB // 2)
  split = cost_model.update_cost("host_split", t, P, dha_fraction=0.8)
  dram = (0.8 * 2.0 + 0.2 * 3.5) / 100  # both executors' host DRAM traffic
  assert split.secs == pytest.approx(max(0.8 * 2 / 60, 0.2 * 3.5 / 32, dram))
  assert split.bound == "dha" and split.secs < min(dha.secs, cpu.secs)
  # On the CPU backend pinned_host is host memory: every byte once, at the CPU rate.
  on_cpu = cost_model.update_cost("host_dha", t, P, platform="cpu")
  assert on_cpu.secs == pytest.approx(2.75 / 32) and on_cpu.h2d_bytes == 0
  with pytest.raises(ValueError, match="expected executor"):
    cost_model.update_cost("host_gpu", t, P)


def test_xla_copy_and_compute_formulas():
  c = cost_model.xla_copy_cost(GB, P)
  assert c.secs == pytest.approx(1 / 50 + 1 / 40) and c.bound == "link_d2h"
  # FLOPs at 100 TFLOP/s plus half the elementwise bytes at 1000 GB/s.
  assert step_costs_lib.compute_secs(1e14, 2e12, P) == pytest.approx(1.0 + 0.5 * 2.0)


def test_stream_stage_formulas():
  # Nothing streamed: the stage is its compute.
  c = cost_model.stream_stage(compute_secs=0.3, num_layers=10, fetch_bytes=0, grad_bytes=0, profile=P)
  assert c.secs == pytest.approx(0.3) and c.bound == "compute" and c.h2d_bytes == 0
  # Compute-bound streaming: per layer fetch 0.1 GB (2 ms at 50 GB/s) under 10 ms forward;
  # only the first fetch is exposed.
  c = cost_model.stream_stage(compute_secs=0.3, num_layers=10, fetch_bytes=GB, grad_bytes=GB,
                      profile=P)
  assert c.secs == pytest.approx(0.3 + 0.1 / 50) and c.bound == "compute"
  assert (c.h2d_bytes, c.d2h_bytes) == (2 * GB, GB)
  # Link-bound: 1 GB per layer. Forward 1/50 s; backward both directions at 30 GB/s each
  # (duplex 60 / 2): max(2 x 10 ms, 1/30, 1/30) s; plus the first fetch.
  c = cost_model.stream_stage(compute_secs=0.03, num_layers=1, fetch_bytes=GB, grad_bytes=GB, profile=P)
  assert c.secs == pytest.approx(1 / 50 + 1 / 30 + 1 / 50) and c.bound == "link_h2d"


def test_activation_choices():
  model = cost_model.ActivationModel.simple(keep_bytes=100, remat_bytes=10, forward_flops=7.0,
                                    traced="remat")
  ch = cost_model.activation_choices(model)
  assert ch["remat"] == cost_model.ActivationChoice(policy="remat", device_delta_bytes=0,
                                            extra_flops=0.0, offload_bytes=0)
  assert ch["keep"].device_delta_bytes == 90 and ch["keep"].extra_flops == -7.0
  assert ch["offload"].offload_bytes == 90 and ch["offload"].device_delta_bytes == 0
  with pytest.raises(ValueError, match="expected traced in"):
    cost_model.ActivationModel.simple(keep_bytes=1, remat_bytes=1, forward_flops=0, traced="sometimes")


def test_jaxpr_flops_count_scan_iterations_and_stacked_leaves():
  def f(w, x):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
    return jnp.sum(h @ jnp.ones((64, 2)))
  w = jax.ShapeDtypeStruct((6, 64, 64), jnp.float32)
  x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
  closed = jax.make_jaxpr(jax.grad(f))(w, x)
  flops, ew = step_costs_lib.jaxpr_costs(closed)
  layer = 2 * 128 * 64 * 64
  # forward: 6 layers + head; backward: 2 dots per layer (dh, dW) + the head's dh.
  assert flops == pytest.approx(3 * 6 * layer + 2 * (2 * 128 * 64 * 2))
  assert ew > 0
  # XLA's own count sees the scan body once.
  xla = jax.jit(jax.grad(f)).lower(w, x).compile().cost_analysis()
  xla = xla[0] if isinstance(xla, list) else xla
  assert xla["flops"] < flops / 2
  assert layer_stacks.stacked_layers(closed.jaxpr, 1) == {0: (layer_stacks.stacked_layers(closed.jaxpr, 1)[0][0], 6)}


def test_scan_bodies_timed_replace_their_analytic_compute(monkeypatch):
  def f(w, x):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
    return jnp.sum(h @ jnp.ones((64, 2)))
  w = jnp.ones((6, 64, 64), jnp.float32) * 0.01
  x = jnp.ones((128, 64), jnp.float32)
  closed = jax.make_jaxpr(jax.grad(f))(w, x)
  timed = step_costs_lib.time_scan_bodies(closed, reps=2)
  # The forward scan and its transpose: two bodies, 6 iterations each.
  assert (timed.count, timed.iterations) == (2, 12)
  assert timed.secs > 0
  flops, ew = step_costs_lib.jaxpr_costs(closed)
  # What the bodies account for analytically: every dot except the head's two.
  assert timed.flops == pytest.approx(flops - 2 * (2 * 128 * 64 * 2))
  costs = step_costs_lib.StepCosts(flops=flops, elementwise_bytes=ew, transient_bytes=0,
                       transient_source="-", timed=timed)
  prof = profile.DEFAULT_PROFILE
  rest = step_costs_lib.compute_secs(flops - timed.flops, ew - timed.elementwise_bytes, prof)
  assert costs.compute_secs(prof) == pytest.approx(timed.secs + rest)
  assert "2 scan bodies timed on this device" in costs.compute_source(prof)
  # No scan: nothing to time; the analytic formula stays.
  assert step_costs_lib.time_scan_bodies(jax.make_jaxpr(lambda a: a @ a)(jnp.ones((8, 8)))) is None
  # Through the planner (forced on the CPU backend): the plan's notes say how compute was found.
  monkeypatch.setenv("JAXTIER_TIME_SCANS", "1")
  plan = jaxtier.plan(lambda w, x: (w - 0.1 * jax.grad(f)(w, x), None), w, x)
  assert any("scan bodies timed" in n for n in plan.notes), plan.notes


def test_memory_figures_and_verify_without_analysis():
  class NoAnalysis:
    def memory_analysis(self):
      return None

  class Zeros:
    def memory_analysis(self):
      return type("M", (), {"argument_size_in_bytes": 0, "output_size_in_bytes": 0,
                            "temp_size_in_bytes": 0})()
  plan = type("Plan", (), {"planned_device_budget": 10, "pinned_bytes": 0})()
  assert step_costs_lib.memory_figures(NoAnalysis()) is None and step_costs_lib.memory_figures(Zeros()) is None
  assert verify_lib.verify(plan, NoAnalysis()) == (True, None)
  compiled = jax.jit(lambda x: (x * 2).sum()).lower(jnp.ones((256, 256))).compile()
  fig = step_costs_lib.memory_figures(compiled)
  assert fig is not None and fig.argument_bytes == 256 * 256 * 4
  ok, fig2 = verify_lib.verify(plan, compiled)
  assert not ok and fig2.peak_bytes == fig.peak_bytes >= 256 * 256 * 4


# ---- the solver on synthetic problems ---------------------------------------------------------

def _problem(budget, *, streamable=False, activations=None, host_budget=None):
  """Two stacks of 10 layers: 1 GB of params (+1 GB of gradients) each, with 2 GB of moments
  updated on the host (host_cpu on the CPU platform: 4 GB of traffic at 32 GB/s = 0.125 s);
  0.5 s of compute each. All on the device: 2 + 2 + 4 = 8 GB at the peak."""
  traffic = cost_model.UpdateTraffic(host_read_bytes=2 * 10**9, host_write_bytes=2 * 10**9,
                             device_in_bytes=0, device_out_bytes=0)
  updates = tuple(problem_lib.UpdateItem(
      seeds=(10 + l,), label=f"mu{l}", device_nbytes=2 * 10**9, pinned_nbytes=2 * 10**9,
      costs={"host_cpu": cost_model.update_cost("host_cpu", traffic, P, platform="cpu")})
      for l in range(2))
  opts = ("device", "host_stream") if streamable else ("device",)
  params = tuple(problem_lib.ParamItem(
      index=l, path=f"['layers_{l}']['w']", nbytes=10**9, grad_nbytes=10**9,
      stage=f"['layers_{l}']", stage_order=l, num_layers=10, compute_secs=0.5, options=opts,
      update=l) for l in range(2))
  return problem_lib.Problem(params=params, updates=updates, fixed_device_bytes=0,
                        fixed_pinned_bytes=0, transient_bytes=2 * 10**9,
                        other_compute_secs=0.0, device_budget=budget, host_budget=host_budget,
                        profile=P, platform="cpu", activations=activations)


def test_solver_fits_all_on_device():
  for budget in (None, 8 * 10**9):
    sol = solver.solve(_problem(budget))
    assert sol.fits and set(sol.params.values()) == {"device"}
    assert set(sol.updates.values()) == {"device"}
    assert sol.prediction.step_secs == pytest.approx(1.0)
    assert sol.prediction.peak_hbm_bytes == 8 * 10**9
    assert sol.prediction.critical_path == "compute" and sol.prediction.pinned_bytes == 0


def test_solver_tight_budget_moves_optimizer_state_then_streams():
  sol = solver.solve(_problem(6 * 10**9))  # one stack's moments must go
  assert sol.fits and sorted(sol.updates.values()) == ["device", "host_cpu"]
  assert sol.prediction.peak_hbm_bytes == 6 * 10**9
  assert sol.prediction.step_secs == pytest.approx(1.0 + 0.125)
  assert sol.prediction.critical_path == "compute"
  sol = solver.solve(_problem(4 * 10**9))  # all moments go; params still fit
  assert sol.fits and set(sol.updates.values()) == {"host_cpu"}
  assert sol.prediction.step_secs == pytest.approx(1.25)
  assert sol.prediction.critical_path == "compute"  # 1 s of compute, then 0.25 s of updates
  assert dict((s[0], s[2]) for s in sol.prediction.segments)["host update"] == "host_cpu"
  assert sol.prediction.pinned_bytes == 4 * 10**9
  # Tighter: nothing fits without streaming; with it, one stack is streamed: its 1 GB of
  # params and 1 GB of gradients leave the device, double buffers of one layer (0.2 GB x 2)
  # come in. Per layer 0.1 GB in 33 ms of forward: the link hides under compute.
  assert not solver.solve(_problem(3 * 10**9)).fits
  sol = solver.solve(_problem(3 * 10**9, streamable=True))
  assert sol.fits and sorted(sol.params.values()) == ["device", "host_stream"]
  assert sol.prediction.peak_hbm_bytes == 2 * 10**9 + 4 * 10**8
  assert sol.prediction.pinned_bytes == 5 * 10**9  # 4 GB of moments + the streamed stack
  assert sol.prediction.resource_secs["link_h2d"] == pytest.approx(2 * 10**9 / (50 * GB))
  # Streaming costs only the first layer's fetch (0.1 GB at 50 GB/s) on top of the updates.
  assert sol.prediction.step_secs == pytest.approx(1.25 + 0.1 / 50)


def test_solver_credits_the_update_temporaries_of_host_updates():
  # 2 GB of the transient are the device-side optimizer update's temporaries (4 GB transient,
  # 2 GB of it gradients): all on the device the peak is 10 GB. Under 7 GB without a credit
  # both stacks' moments must go; credited 0.5 byte per byte of moments moved, one stack's
  # moments free 2 + 1 GB and suffice.
  problem = dataclasses.replace(_problem(7 * 10**9), transient_bytes=4 * 10**9)
  sol = solver.solve(problem)
  assert sol.fits and set(sol.updates.values()) == {"host_cpu"}
  assert sol.prediction.peak_hbm_bytes == 6 * 10**9
  credited = solver.solve(dataclasses.replace(problem, update_credit=0.5))
  assert credited.fits and sorted(credited.updates.values()) == ["device", "host_cpu"]
  assert credited.prediction.peak_hbm_bytes == 7 * 10**9
  assert credited.prediction.step_secs < sol.prediction.step_secs
  # The credit never takes more than the transient beyond the gradients (2 GB): with both
  # stacks' moments moved and a credit of 2, the peak is 10 - 4 - 2 GB, not 10 - 4 - 8.
  both = solver.evaluate_fixed(dataclasses.replace(problem, update_credit=2.0),
                               {0: "device", 1: "device"}, {0: "host_cpu", 1: "host_cpu"})
  assert both.prediction.peak_hbm_bytes == 4 * 10**9


def test_solver_infeasible_returns_the_rule_based_plan():
  sol = solver.solve(_problem(10**8, streamable=True))
  assert not sol.fits
  assert set(sol.updates.values()) == {"host_cpu"} and set(sol.params.values()) == {"device"}
  # The host budget binds too: no plan may pin more than it.
  sol = solver.solve(_problem(4 * 10**9, host_budget=10**9))
  assert not sol.fits


def test_solver_chooses_activation_policy():
  # Traced: keep (3 GB of activations). Remat frees them for one forward (+1/3 s).
  acts = cost_model.ActivationModel.simple(keep_bytes=3 * 10**9, remat_bytes=0,
                                   forward_flops=1e14 / 3, traced="keep")
  sol = solver.solve(_problem(None, activations=acts))
  assert sol.activation_policy == "keep" and sol.prediction.step_secs == pytest.approx(1.0)
  sol = solver.solve(_problem(6 * 10**9, activations=acts))
  # Offloading 3 GB each way under 1 s of compute is free of compute but the link has
  # 3 GB / 40 GB/s = 75 ms to hide; keep over budget is impossible; remat costs 0.33 s.
  assert sol.fits and sol.activation_policy == "offload"
  assert sol.prediction.step_secs < 1.0 + 1 / 3


# ---- the planner end to end (CPU) -------------------------------------------------------------

TX = optax.adamw(1e-2, weight_decay=0.1)


def _mlp(seed=0, width=256):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = {"w1": jax.random.normal(k1, (width, width)) * 0.05,
            "w2": jax.random.normal(k2, (width, 8)) * 0.05}
  return {"params": params, "opt": TX.init(params)}


def _loss(p, x, y):
  return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def _batch(width=256, seed=0):
  k = jax.random.PRNGKey(10 + seed)
  x = jax.random.normal(k, (8, width))
  return x, jnp.sin(x[:, :8])


STEP = optax_train_step(TX, _loss)


def test_auto_without_budget_keeps_everything_on_device():
  plan = jaxtier.plan(STEP, _mlp(), _batch())
  assert {l.placement for l in plan.leaves} == {"device"} and plan.num_host_updates == 0
  assert plan.predicted_step_secs > 0 and plan.critical_path == "compute"
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(_mlp()))
  assert plan.predicted_peak_hbm_bytes > state_bytes
  data = json.loads(plan.to_json())
  for key in ("predicted_step_secs", "critical_path", "predicted_peak_hbm_bytes",
              "resource_secs", "segments", "notes"):
    assert key in data
  text = str(plan)
  assert "predicted step:" in text and "predicted peak HBM:" in text


def test_auto_under_a_budget_the_device_plan_exceeds_runs_like_jit():
  full = jaxtier.offload(STEP)
  state = full.place(_mlp(), _batch())
  all_device_peak = full.plan.compiler_peak_hbm_bytes or full.plan.predicted_peak_hbm_bytes
  budget = int(all_device_peak * 0.85)
  step = jaxtier.offload(STEP, device_budget=budget)
  placed = step.place(_mlp(), _batch())
  plan = step.plan
  kinds = {l.path: l.placement for l in plan.leaves}
  assert kinds["['opt'][0].mu['w1']"] == HOST_EXEC and kinds["['opt'][0].nu['w1']"] == HOST_EXEC
  assert kinds["['params']['w1']"] == "device"
  assert plan.predicted_peak_hbm_bytes <= budget < all_device_peak
  assert plan.compiler_peak_hbm_bytes is not None  # the planned step was compiled and checked
  assert "moved to pinned_host to fit the device budget" in {
      l.path: l.reason for l in plan.leaves}["['opt'][0].mu['w1']"]
  ref = jax.jit(STEP, donate_argnums=0)
  s1 = _mlp()
  del state
  for i in range(5):
    s1, m1 = ref(s1, _batch(seed=i))
    placed, m2 = step(placed, _batch(seed=i))
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(placed["params"]["w1"]), np.asarray(s1["params"]["w1"]),
                             rtol=2e-5, atol=1e-7)


def test_named_rule_and_user_policy_under_the_solver():
  rule = jaxtier.plan(STEP, _mlp(), _batch(), policy="optimizer_state_on_host")
  assert {l.placement for l in rule.leaves if l.role == "optimizer_state"} == {HOST_EXEC}
  # A user-placed leaf stays put, with the executor the user named; the solver places the
  # rest (here: everything fits).
  plan = jaxtier.plan(STEP, _mlp(), _batch(), policy={r"\.nu\['w2'\]": "host_cpu"})
  p = {l.path: l for l in plan.leaves}
  assert p["['opt'][0].nu['w2']"].placement == "host_cpu"
  assert p["['opt'][0].nu['w2']"].reason.startswith(policy_lib.USER_PLACED)
  assert p["['opt'][0].mu['w1']"].placement == "device"


def test_infeasible_budget_names_the_largest_leaves():
  with pytest.raises(jaxtier.PlanError) as err:
    jaxtier.plan(STEP, _mlp(), _batch(), device_budget=10_000)
  msg = str(err.value)
  assert "over the device budget of 9.77 KiB (10000 bytes)" in msg
  assert "['params']['w1'] 256.00 KiB" in msg
  refused = err.value.plan
  # The refused plan is the rule-based one: optimizer state on the host, said in its notes.
  assert {l.placement for l in refused.leaves if l.role == "optimizer_state"} == {HOST_EXEC}
  assert not refused.fits and refused.verdicts and "DOES NOT FIT" in str(refused)


def test_sharded_budgets_are_per_device_in_plan():
  # One device here: bytes per device are whole leaves; tests/sharding_test.py covers meshes.
  plan = jaxtier.plan(STEP, _mlp(), _batch())
  assert {l.path: l.nbytes for l in plan.leaves}["['params']['w1']"] == 256 * 256 * 4


def test_gpu_plan_without_a_gpu_uses_the_default_profile():
  plan = jaxtier.plan(STEP, _mlp(), _batch(), platform="gpu", device_budget=600_000)
  if jax.default_backend() != "gpu":
    assert any("machine without one" in n and "default hardware profile" in n
               for n in plan.notes), plan.notes
  ex = {l.placement for l in plan.leaves if l.role == "optimizer_state"} - {"device"}
  assert ex and ex <= {"host_dha", "host_cpu", "host_split"}


def test_load_profile_for_an_absent_platform_is_the_default(tmp_path):
  if jax.default_backend() == "gpu":
    pytest.skip("this machine has a GPU")
  assert profile.load(platform="gpu") == profile.DEFAULT_PROFILE
  p = calibration.calibrate(num_params=1 << 14)
  assert p.device_kind == jax.devices()[0].device_kind and "calibrated" in p.source
  assert p.host_dram_gbps > 0 and p.cpu_threads >= 1
  assert p.link_h2d_gbps == profile.DEFAULT_PROFILE.link_h2d_gbps  # not measured here
  assert profile.load(profile.save(p, str(tmp_path / "p.json"))) == p


def test_rates_print_with_three_significant_digits():
  assert [units.format_rate(x) for x in (0.4377, 0.000412, 80.54, 700.0, 4000.0, 2.3e9)] == [
      "0.438", "0.000412", "80.5", "700", "4000", "2.3e+09"]
  prof = profile.HardwareProfile(matmul_tflops=0.4377, hbm_gbps=12.34)
  costs = step_costs_lib.StepCosts(flops=1.0, elementwise_bytes=1.0, transient_bytes=0,
                       transient_source="test")
  assert ("matmul FLOPs at 0.438 TFLOP/s plus elementwise bytes at 12.3 GB/s HBM"
          in costs.compute_source(prof))


def test_stale_stored_profile_is_ignored_with_one_warning(tmp_path, monkeypatch, caplog):
  import dataclasses
  import logging
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  path = profile.cache_path()
  os.makedirs(os.path.dirname(path))
  # What an older build stored: no format version, and an H200's matmul rate for this machine.
  old = dataclasses.replace(profile.DEFAULT_PROFILE, cpu_adamw_params_per_sec=1.5e9,
                            device_kind=jax.devices()[0].device_kind,
                            source="calibrated on cpu (host measured, 2026-11-01)")
  with open(path, "w") as f:
    json.dump(dataclasses.asdict(old), f)
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert profile.load() is profile.DEFAULT_PROFILE
    assert profile.load() is profile.DEFAULT_PROFILE
  stale = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
  assert len(stale) == 1, stale  # once per path
  assert f"ignoring {path}: written by an older jaxtier" in stale[0]
  assert "python -m jaxtier calibrate" in stale[0]
  # An older version number is stale too; the current one loads.
  with open(path, "w") as f:
    json.dump({"format_version": profile.PROFILE_FORMAT_VERSION - 1,
               **dataclasses.asdict(old)}, f)
  assert profile.load() is profile.DEFAULT_PROFILE
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert profile.load(profile.save(old)) == old
  assert not caplog.records
  with open(path) as f:
    assert json.load(f)["format_version"] == profile.PROFILE_FORMAT_VERSION


# ---- the CLI --------------------------------------------------------------------------------

def _cli(tmp_path, *args):
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
  env.pop("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", None)
  return subprocess.run([sys.executable, "-m", "jaxtier", "plan", *args], capture_output=True,
                        text=True, env=env, cwd=tmp_path, timeout=600)


def test_plan_cli_gpu_on_cpu_says_default_profile_and_plots(tmp_path):
  png = tmp_path / "plan.png"
  # 'small' keeps its activations (about 5 GB here): under 2 GB the plan rematerialises.
  out = _cli(tmp_path, "--config=small", "--platform=gpu", "--device_budget=2GB",
             f"--plot={png}")
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout
  if jax.default_backend() != "gpu":
    assert "no GPU here" in text and "the default hardware profile: an H200 machine" in text
  assert re.search(r"predicted step: [0-9.]+ ms, critical path: \w+", text)
  assert "predicted peak HBM:" in text and "DOES NOT FIT" not in text
  assert "activations: remat (jax.checkpoint_policies.nothing_saveable); the traced step uses " \
         "keep: apply it in the model" in text
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
  js = _cli(tmp_path, "--config=small", "--platform=gpu", "--json")
  assert js.returncode == 0, js.stderr[-3000:]
  data = json.loads(js.stdout)
  assert data["predicted_step_secs"] > 0 and data["predicted_peak_hbm_bytes"] > 0
  assert {l["placement"] for l in data["leaves"]} == {"device"}  # fits the default budget


# ---- GPU: case C2, one 16 GiB fp32 leaf in pinned_host ------------------------------------------

def test_c2_16gib_fp32_leaf_in_pinned_host(gpu):
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
    pytest.xfail(f"C2 finding: the 16 GiB pinned allocation failed here: {msg}")
  assert off.plan.placements()["['acc']"] == "host_dha"
  assert state["acc"].sharding.memory_kind == "pinned_host"
  for _ in range(2):
    state, _ = off(state, g)
  assert state["acc"].sharding.memory_kind == "pinned_host"
  back = jax.device_put(state["acc"], dev)  # 16 GiB back to HBM, every element checked
  # (min and max, not indexing: an index of 2^32 overflows JAX's int32 indices, which the
  # first H200 run of this test hit after the leaf had been placed and stepped).
  lo, hi = jax.jit(lambda a: (jnp.min(a), jnp.max(a)))(back)
  assert (float(lo), float(hi)) == (1.75, 1.75)
  del back
  assert off.plan.compiler_peak_hbm_bytes is None or off.plan.compiler_peak_hbm_bytes < 2**30


def test_offloaded_step_reports_measured_against_predicted_step_time(caplog):
  # Calls 2-4 are timed and the plan gains the measured step time beside its prediction.
  import logging

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


def test_auto_streams_where_only_streaming_fits_and_its_plan_says_it_fits():
  # A budget halfway between the optimizer-offload rule's peak and that of a plan streaming
  # every layer param: `auto` must stream, and the plan re-evaluated after its cut must predict
  # the same fit the search found (it once counted the streamed params' gradients whole on the
  # device there and reported a spurious DOES NOT FIT).
  import dataclasses

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


def test_offload_refines_its_plan_with_the_compiled_peak_and_keeps_it_within_budget(
    monkeypatch, caplog):
  # The pre-compile peak of a plan with optimizer state on the host is above its compiled
  # peak (the device-only step's transient holds the update's temporaries): `offload`
  # re-plans with that credit and keeps the new plan only if it is predicted faster and
  # compiles within the budget; otherwise the first plan stays. Either way the step trains as
  # jax.jit does and the compiled peak is within the budget.
  import logging

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


def test_host_stream_pattern_matching_optimizer_state_puts_it_on_the_host():
  # The README's example pattern r"\['layers'\]" matches the layers' params and also their
  # optimizer state (its paths mirror the params'): the params are streamed, the state is
  # placed on the host with the platform's executor (it used to be refused: "no scan reads
  # it layer by layer").
  from jaxtier.examples import llama, train
  config = dataclasses.replace(llama.CONFIGS["tiny"], num_layers=2)
  _, abstract, step_fn = train.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((2, config.max_seq_len + 1), jnp.int32)
  plan = jaxtier.plan(step_fn, abstract, tokens, policy={r"\['layers'\]": "host_stream"})
  layers = [l for l in plan.leaves if "['layers']" in l.path]
  assert {l.placement for l in layers if l.role == "param"} == {"host_stream"}
  states = [l for l in layers if l.role == "optimizer_state"]
  assert states and {l.placement for l in states} == {HOST_EXEC}
  assert all("optimizer state is not streamed" in l.reason for l in states)
  assert {l.placement for l in plan.leaves if "['layers']" not in l.path
          and l.role == "param"} == {"device"}


def test_cpu_plan_without_budget_is_checked_against_the_hosts_available_memory(monkeypatch):
  # No device budget on the CPU backend, but its memory is the host's RAM: a plan that needs
  # more than is available says DOES NOT FIT (the 8b config on a 23 GiB machine said it fit).
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's check")
  # The state's arrays already exist in that RAM: the plan needs only the rest; a state of
  # ShapeDtypeStructs (planning a model not allocated) needs all of it.
  plan = jaxtier.plan(STEP, _mlp(), _batch())
  assert plan.fits and not plan.verdicts
  resident = sum(x.nbytes for x in jax.tree.leaves(_mlp()))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _mlp())
  total = plan.predicted_peak_hbm_bytes + plan.pinned_bytes
  for state, need in ((_mlp(), total - resident), (abstract, total)):
    monkeypatch.setattr(host_lib, "available_bytes", lambda: need - 1)
    plan = jaxtier.plan(STEP, state, _batch())
    assert not plan.fits and plan.violations[0].limit == "host_memory"
    note = plan.verdicts[0]
    assert f"the plan needs {units.format_bytes(need)} more" in note, note
    assert "--platform=gpu" in note
    monkeypatch.setattr(host_lib, "available_bytes", lambda: need)
    plan = jaxtier.plan(STEP, state, _batch())
    assert plan.fits and not plan.verdicts


def test_dead_code_in_the_step_does_not_change_the_plan():
  # A value the step computes from a moment and never returns is dropped, as jax.jit drops
  # it: it used to read as a non-elementwise use of the moment (a reduce_sum), which sent the
  # moment to host_xla and the plan over its budget.
  def dead(state, batch):
    unused = jnp.sum(state["opt"][0].mu["w1"])  # noqa: F841
    return STEP(state, batch)

  full = jaxtier.plan(STEP, _mlp(), _batch(), policy="optimizer_state_on_host")
  with_dead = jaxtier.plan(dead, _mlp(), _batch(), policy="optimizer_state_on_host")
  assert [l.placement for l in with_dead.leaves] == [l.placement for l in full.leaves]
  assert {l.path: l.placement for l in with_dead.leaves}["['opt'][0].mu['w1']"] == HOST_EXEC
  assert with_dead.predicted_peak_hbm_bytes == full.predicted_peak_hbm_bytes


def test_does_not_fit_note_describes_the_plan_made():
  # Under the CLI's `--offload=stream` policy the layers' params are host_stream (placed by the
  # policy): the note must say so, not that this is "every optimizer-state leaf on the host".
  import dataclasses

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
    state_only = jaxtier.plan(step_fn, abstract, tokens, policy=policy,
                              device_budget=10**9).device_bytes
    # Room for the device state, not for the step's transient buffers.
    plan = jaxtier.plan(step_fn, abstract, tokens, policy=policy, device_budget=state_only + 1)
    assert not plan.fits
    note = plan.verdicts[0]
    assert "this is its fallback plan: " in note and host in note, note
    assert "every optimizer-state leaf on the host" not in note
    assert f"exceeds the device budget of {units.format_bytes(state_only + 1)}" in note


def test_refusal_names_the_host_limit_when_it_binds_and_budget_above_the_gpu_is_noted():
  # The 8b decoder against a 10 GiB device budget for an absent H200 (pinnable: the default
  # profile's 64 GiB): offloading everything movable would pin 87 GiB, so the refusal says the
  # host limit binds, not only "raise device_budget"; a budget above the GPU's memory is noted.
  from jaxtier.examples import train  # pylint: disable=g-import-not-at-top
  _, state, step = train.make_train_state("8b", 1e-3, abstract=True)
  batch = jax.ShapeDtypeStruct((1, 128), jnp.int32)
  with pytest.raises(jaxtier.PlanError, match=r"over the device budget of 10\.00 GiB.*But the "
                     r"host limit binds first: moving every leaf it may move to the host would "
                     r"pin [0-9.]+ GiB, over the host limit of 64\.00 GiB"):
    jaxtier.plan(step, state, batch, device_budget="10GiB", platform="gpu")
  plan = jaxtier.plan(step, state, batch, device_budget="200GiB", platform="gpu")
  assert any("device budget 200.00 GiB is above this GPU's memory" in n for n in plan.notes)
