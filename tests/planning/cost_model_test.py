"""The cost model's formulas against values computed by hand under a profile of round numbers:
the host update per executor, XLA's own copies, compute, a streamed stage, activation choices."""

import dataclasses

from planning._toy import GB, P
import pytest

from jaxtier._src.analysis import step_costs as step_costs_lib
from jaxtier._src.hardware import profile
from jaxtier._src.planning import cost_model


def test_update_cost_formulas():
  t = cost_model.UpdateTraffic(host_read_bytes=GB, host_write_bytes=GB, device_in_bytes=GB // 2,
                               device_out_bytes=GB // 4)
  dha = cost_model.update_cost("host_dha", t, P)
  # Elements unknown: max(R / 100, W / 50, (R + W) / 60 (duplex), (R + W) / 80 (dha_rw)) GB/s
  # = max(0.01, 0.02, 0.0333, 0.025) s.
  assert dha.secs == pytest.approx(2 / 60) and dha.bound == "dha"
  assert (dha.h2d_bytes, dha.d2h_bytes) == (GB, GB)
  # With the elements: the kernel's time max(N / E, (R + W) / u) on the whole grid, E and u the
  # profile's 16.3e9 elements/s and 78 GB/s. 125e6 elements: max(7.7 ms, 25.6 ms).
  n = 125 * 10**6
  t_n = dataclasses.replace(t, elements=n)
  kernel = max(n / 16.3e9, 2 * GB / 78e9)
  assert cost_model.update_cost("host_dha", t_n, P).secs == pytest.approx(max(2 / 60, kernel))
  # The default reproduces one layer call of the H200 (diagnostics/dha_update_rate_h200.json): AdamW
  # moments in pinned_host (16 B per element) near the link's 78 GB/s on the whole grid and on a
  # quarter (measured 4.96e9 and 4.99e9 elements/s), below it on an eighth (2.90e9); every
  # operand in HBM 16.3e9 and 9.0e9 elements/s on the whole grid and a quarter.
  d = profile.DEFAULT_PROFILE
  moments = cost_model.UpdateTraffic(host_read_bytes=8 * n, host_write_bytes=8 * n,
                                     device_in_bytes=0, device_out_bytes=0, elements=n)
  rate = lambda traffic, grid: n / cost_model.update_cost("host_dha", traffic, d, grid=grid).secs
  assert rate(moments, 1.0) == pytest.approx(4.96e9, rel=0.02)
  assert rate(moments, 0.25) == pytest.approx(4.99e9, rel=0.03)
  assert rate(moments, 0.125) == pytest.approx(2.90e9, rel=0.02)
  assert n / d.dha_update_secs(n, 0) == pytest.approx(16.3e9)
  assert n / d.dha_update_secs(n, 0, grid=0.25) == pytest.approx(9.0e9, rel=0.03)
  with pytest.raises(ValueError, match=r"expected grid in \(0, 1\], got 0"):
    d.dha_update_secs(n, 0, grid=0)
  cpu = cost_model.update_cost("host_cpu", t, P)
  # M = 0.88 (R + W) + 1.76 (D_in + D_out) = 3.08 GB at 30 GB/s (1e9 params/s x 30 B); links:
  # 0.5 GB / 40, 0.25 GB / 50.
  assert cpu.secs == pytest.approx(3.08 / 30) and cpu.bound == "host_cpu"
  assert (cpu.h2d_bytes, cpu.d2h_bytes) == (GB // 4, GB // 2)
  # In place only (a streamed layer's update: its gradient is already in pinned_host).
  in_place = cost_model.UpdateTraffic(host_read_bytes=GB, host_write_bytes=GB, device_in_bytes=0,
                                      device_out_bytes=0)
  assert cost_model.update_cost("host_cpu", in_place, P).secs == pytest.approx(0.88 * 2 / 30)
  split = cost_model.update_cost("host_split", t, P, dha_fraction=0.8)
  # Both executors' host DRAM traffic: the CPU's share R + W + 1.5 (D_in + D_out) = 3.125 GB.
  dram = (0.8 * 2.0 + 0.2 * 3.125) / 100
  assert split.secs == pytest.approx(max(0.8 * 2 / 60, 0.2 * 3.08 / 30, dram))
  assert split.bound == "dha" and split.secs < min(dha.secs, cpu.secs)
  # On the CPU backend pinned_host is host memory: every byte once, at the CPU rate.
  on_cpu = cost_model.update_cost("host_dha", t, P, platform="cpu")
  assert on_cpu.secs == pytest.approx(2.75 / 30) and on_cpu.h2d_bytes == 0
  with pytest.raises(ValueError, match="expected executor"):
    cost_model.update_cost("host_gpu", t, P)


def test_xla_copy_and_compute_formulas():
  c = cost_model.xla_copy_cost(GB, P)
  assert c.secs == pytest.approx(1 / 50 + 1 / 40) and c.bound == "link_d2h"
  # FLOPs at 100 TFLOP/s plus half the elementwise bytes at 1000 GB/s.
  assert step_costs_lib.compute_secs(1e14, 2e12, P) == pytest.approx(1.0 + 0.5 * 2.0)


def test_stream_stage_formulas():
  # Nothing streamed: the stage is its compute.
  c = cost_model.stream_stage(compute_secs=0.3, num_layers=10, fetch_bytes=0, grad_bytes=0,
                              profile=P)
  assert c.secs == pytest.approx(0.3) and c.bound == "compute" and c.h2d_bytes == 0
  # Compute-bound streaming: per layer fetch 0.1 GB (2 ms at 50 GB/s) under 10 ms forward;
  # only the first fetch is exposed.
  c = cost_model.stream_stage(compute_secs=0.3, num_layers=10, fetch_bytes=GB, grad_bytes=GB,
                              profile=P)
  assert c.secs == pytest.approx(0.3 + 0.1 / 50) and c.bound == "compute"
  assert (c.h2d_bytes, c.d2h_bytes) == (2 * GB, GB)
  # Link-bound: 1 GB per layer. Forward 1/50 s; backward both directions at 30 GB/s each
  # (duplex 60 / 2): max(2 x 10 ms, 1/30, 1/30) s; plus the first fetch.
  c = cost_model.stream_stage(compute_secs=0.03, num_layers=1, fetch_bytes=GB, grad_bytes=GB,
                              profile=P)
  assert c.secs == pytest.approx(1 / 50 + 1 / 30 + 1 / 50) and c.bound == "link_h2d"
  # An embedding table's rows read in place go at the DHA gather's rate (not the raw zero-copy
  # read's): 1 GB of rows per layer-stage at 25 GB/s forward and backward.
  slow = dataclasses.replace(P, dha_gather_gbps=25.0)
  c = cost_model.stream_stage(compute_secs=0.0, num_layers=1, fetch_bytes=0, grad_bytes=0,
                              dha_read_bytes=GB, profile=slow)
  assert c.secs == pytest.approx(2 / 25) and c.dha_secs == pytest.approx(2 / 25)


def test_activation_choices():
  model = cost_model.ActivationModel.simple(keep_bytes=100, remat_bytes=10, forward_flops=7.0,
                                            traced="remat")
  ch = cost_model.activation_choices(model)
  assert ch["remat"] == cost_model.ActivationChoice(policy="remat", device_delta_bytes=0,
                                                    extra_flops=0.0, offload_bytes=0)
  assert ch["keep"].device_delta_bytes == 90 and ch["keep"].extra_flops == -7.0
  assert ch["offload"].offload_bytes == 90 and ch["offload"].device_delta_bytes == 0
  with pytest.raises(ValueError, match="expected traced in"):
    cost_model.ActivationModel.simple(keep_bytes=1, remat_bytes=1, forward_flops=0,
                                      traced="sometimes")


def test_layered_updates_hide_under_the_backward_pass():
  prof = profile.DEFAULT_PROFILE
  layers = cost_model.Cost(secs=0.6, bound="compute")  # backward: 2/3 of it, 0.4 s
  common = dict(layers=layers, layer_compute_secs=0.6, other_compute_secs=0.0, updates=[],
                xla_copies=[], peak_hbm_bytes=0, pinned_bytes=0, profile=prof)
  cpu = lambda secs: cost_model.Cost(secs=secs, cpu_secs=secs, bound="host_cpu")
  # 0.3 s over 10 layers fits in the backward pass: only the last layer's update shows.
  hidden = cost_model.predict(**common, overlapped=[(cpu(0.3), 10)])
  assert hidden.step_secs == pytest.approx(0.6 + 0.03)
  # 0.6 s does not: it starts after the first layer's backward (0.04 s) and ends 0.24 s late.
  exposed = cost_model.predict(**common, overlapped=[(cpu(0.6), 10)])
  assert exposed.step_secs == pytest.approx(0.6 + 0.6 + 0.04 - 0.4)
  assert ("layered host update (exposed)", pytest.approx(0.24), "host_cpu") in [
      (n, s, b) for n, s, b in exposed.segments]
  # A split's kernel shares the GPU with the compute: its busy seconds slow the step.
  split = cost_model.Cost(secs=0.3, cpu_secs=0.3, dha_secs=0.2, bound="dha")
  slowed = cost_model.predict(**common, overlapped=[(split, 10)])
  # On the profile's share of the blocks (0.25: 0.14 + 0.43 / 4 of each kernel second).
  assert cost_model.dha_contention(P.dha_layer_grid) == pytest.approx(0.2475)
  assert slowed.step_secs == pytest.approx(0.6 + 0.03 + 0.2475 * 0.2)
  whole = cost_model.predict(**{**common, "profile": dataclasses.replace(P, dha_layer_grid=1.0)},
                             overlapped=[(split, 10)])
  assert whole.step_secs == pytest.approx(0.6 + 0.03 + 0.57 * 0.2)
  # The serial schedule adds the whole update.
  serial = cost_model.predict(**{**common, "updates": [cpu(0.3)]})
  assert serial.step_secs == pytest.approx(0.9)


def test_layered_updates_hide_under_the_measured_backward_share():
  # U = 0.5 s over 10 layers beside 0.6 s of layer stages: the update outlasts a backward pass
  # of b seconds by U + b / L - b (at least its last layer, U / L = 0.05 s): b = 2/3 of the
  # stages by default (0.4 s), or the share measured from the timed scans.
  upd = cost_model.Cost(secs=0.5, cpu_secs=0.5, bound="host_cpu")
  layers = cost_model.Cost(secs=0.6, bound="compute")
  def exposed(**kw):
    pred = cost_model.predict(layers=layers, layer_compute_secs=0.6, other_compute_secs=0.0,
                              updates=(), xla_copies=(), peak_hbm_bytes=0, pinned_bytes=0,
                              profile=P, overlapped=[(upd, 10)], **kw)
    return pred.step_secs - 0.6
  assert exposed() == pytest.approx(0.5 + 0.04 - 0.4)
  assert exposed(backward_share=0.75) == pytest.approx(0.5 + 0.045 - 0.45)
  assert exposed(backward_share=0.5) == pytest.approx(0.5 + 0.03 - 0.3)
  assert exposed(backward_share=1.0) == pytest.approx(0.05)
  # Gradients a streamed scan sends land one iteration late: the chain starts after two
  # layers' backward, and at least the last two layers' updates show.
  assert exposed(sent_lag_layers=1) == pytest.approx(0.5 + 0.08 - 0.4)
  assert exposed(sent_lag_layers=1, backward_share=1.0) == pytest.approx(0.1)
