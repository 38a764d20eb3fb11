"""The solver on synthetic problems whose answer is known: fits -> all on the device; a tight
budget -> optimizer state to the host; tighter -> parameters streamed where allowed; the update
temporaries credited; infeasible -> the rule-based plan; the activation policy chosen."""

import dataclasses

from planning._toy import GB, P
import pytest

from jaxtier._src.planning import cost_model, solver
from jaxtier._src.planning import problem as problem_lib


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
  assert sol.prediction.step_secs == pytest.approx(1.0 + 4 / 30)  # 4 GB moved at 30 GB/s
  assert sol.prediction.critical_path == "compute"
  sol = solver.solve(_problem(4 * 10**9))  # all moments go; params still fit
  assert sol.fits and set(sol.updates.values()) == {"host_cpu"}
  assert sol.prediction.step_secs == pytest.approx(1.0 + 8 / 30)
  assert sol.prediction.critical_path == "compute"  # 1 s of compute, then 0.27 s of updates
  assert dict((s[0], s[2]) for s in sol.prediction.segments)["host update"] == "host_cpu"
  assert sol.prediction.pinned_bytes == 4 * 10**9
  # Tighter: nothing fits without streaming; with it, one stack is streamed: its 1 GB of
  # params and 1 GB of gradients leave the device, double buffers of one layer (0.2 GB x 2)
  # come in. Per layer 0.1 GB in 33 ms of forward: the link hides under compute.
  assert not solver.solve(_problem(3 * 10**9)).fits
  sol = solver.solve(_problem(3 * 10**9, streamable=True))
  assert sol.fits and sorted(sol.params.values()) == ["device", "host_stream"]
  assert sol.prediction.peak_hbm_bytes == 2 * 10**9 + 4 * 10**8
  # 4 GB of moments, the streamed stack, its gradient buffer and the compiled step's pinned
  # copy of that gradient (the host_stream record's `grad_buffers`, `placements.py`)
  assert sol.prediction.pinned_bytes == 7 * 10**9
  assert sol.prediction.resource_secs["link_h2d"] == pytest.approx(2 * 10**9 / (50 * GB))
  # Streaming costs only the first layer's fetch (0.1 GB at 50 GB/s) on top of the updates.
  assert sol.prediction.step_secs == pytest.approx(1.0 + 8 / 30 + 0.1 / 50)


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
