"""The built-in profiles of the cards jaxtier knows (the H200's measured rates scaled by each
card's datasheet): their figures, how a device kind picks one, `load` on a GPU with no stored
profile, and a plan for an absent GPU that names its card."""

import dataclasses
import json
import logging
import os
import types

import jax
import pytest
from planning._toy import STEP, mlp_state, toy_batch

import jaxtier
from jaxtier._src.hardware import machine
from jaxtier._src.hardware import profile
from jaxtier._src.hardware.host import XLA_MEM_FRACTION_DEFAULT
from jaxtier._src.planning import plan_text, planner

D = profile.DEFAULT_PROFILE
H100_KIND = "NVIDIA H100 80GB HBM3"
# The rates the link bounds, halved on the A100's PCIe Gen4.
LINK_BOUND = ("link_h2d_gbps", "link_d2h_gbps", "link_duplex_gbps", "dha_read_gbps",
              "dha_write_gbps", "dha_rw_gbps", "dha_adamw_params_per_sec", "dha_update_gbps",
              "dha_gather_gbps", "dha_matmul_gbps")
# The host's figures: every built-in keeps the H200 machine's.
HOST = ("host_dram_gbps", "cpu_adamw_params_per_sec", "cpu_threads", "pinnable_bytes")


def test_the_h100_keeps_the_h200s_compute_and_link_and_scales_its_hbm():
  h100 = profile.builtin_profile(H100_KIND)
  assert h100 is profile.BUILTIN_PROFILES["H100"]
  # 989 TFLOP/s dense bf16 on both (GH100, 132 SMs); HBM3 3.35 TB/s against HBM3e's 4.8.
  assert h100.matmul_tflops == D.matmul_tflops == 700.0
  assert h100.hbm_gbps == pytest.approx(4000.0 * 3.35 / 4.8)
  assert h100.hbm_bytes == int(81_559 * 2**20 * XLA_MEM_FRACTION_DEFAULT)
  for name in LINK_BOUND + HOST + ("dha_update_elements_per_sec", "dha_layer_grid",
                                   "inter_gpu_gbps"):
    assert getattr(h100, name) == getattr(D, name), name
  assert h100.device_kind == H100_KIND and h100.is_default
  assert h100.source == ("defaults for an NVIDIA H100 (the H200's measured rates scaled by the "
                         "datasheet; not calibrated)")


def test_the_a100_scales_compute_hbm_and_halves_the_link():
  a100 = profile.builtin_profile("NVIDIA A100-SXM4-80GB")
  assert a100.matmul_tflops == pytest.approx(700.0 * 312 / 989)
  assert a100.hbm_gbps == pytest.approx(4000.0 * 2.04 / 4.8)
  assert a100.hbm_bytes == int(81_920 * 2**20 * XLA_MEM_FRACTION_DEFAULT)
  for name in LINK_BOUND:  # PCIe Gen4 x16: half Gen5's rate
    assert getattr(a100, name) == pytest.approx(getattr(D, name) / 2), name
  assert a100.link_h2d_gbps == pytest.approx(26.5)
  assert a100.dha_adamw_params_per_sec == pytest.approx(2.739e9 / 2)
  # SMs x boost clock: 108 x 1,410 MHz against 132 x 1,980; NVLink 3 600 GB/s against 900.
  assert a100.dha_update_elements_per_sec == pytest.approx(16.3e9 * 108 * 1410 / (132 * 1980))
  assert a100.inter_gpu_gbps == pytest.approx(300.0 * 600 / 900)
  for name in HOST + ("dha_layer_grid",):
    assert getattr(a100, name) == getattr(D, name), name
  assert a100.device_kind == "NVIDIA A100-SXM4-80GB" and a100.is_default
  assert a100.source.startswith("defaults for an NVIDIA A100 (")


def test_a_device_kind_picks_its_card_by_name_and_unknown_ones_fall_back_to_the_h200():
  assert profile.builtin_profile("NVIDIA H200") is D
  for kind, card in (("H100", "H100"), ("h100", "H100"), ("NVIDIA H100 PCIe", "H100"),
                     ("a100", "A100"), ("NVIDIA A100-SXM4-40GB", "A100"), ("H200", "H200")):
    assert profile.card_of(kind) == card, kind
    assert profile.builtin_profile(kind) is profile.BUILTIN_PROFILES[card]
  # Grace Hopper's GH200 is not an H200 (its host is on NVLink-C2C); nor a CPU a card.
  for kind in ("NVIDIA GH200 480GB", "NVIDIA L40S", "cpu", "TPU v5 lite", ""):
    assert profile.card_of(kind) is None, kind
    assert profile.builtin_profile(kind) is D


def test_an_unknown_or_misplaced_device_kind_is_refused_naming_the_known_cards():
  with pytest.raises(jaxtier.OptionError) as e:
    profile.check_device_kind("V100", "gpu")
  assert e.value.option == "device_kind" and e.value.value == "V100"
  assert "H100, H200, A100" in e.value.expected
  assert str(e.value) == ("jaxtier: no built-in hardware profile for device_kind 'V100'; "
                          "known: H100, H200, A100")
  with pytest.raises(jaxtier.OptionError, match="expected device_kind a string"):
    profile.check_device_kind(100, "gpu")
  with pytest.raises(jaxtier.OptionError, match="names a GPU, and the plan is for 'cpu'"):
    profile.check_device_kind("H100", "cpu")
  assert profile.check_device_kind(None, "cpu") is None
  # (ValueError and TypeError both catch it.)
  with pytest.raises(ValueError):
    jaxtier.plan(STEP, mlp_state(), toy_batch(), platform="gpu", device_kind="V100")


def _gpu_here(monkeypatch, kind):
  """This machine as JAX would see it on a GPU of `kind` (the cache path is keyed by it)."""
  device = types.SimpleNamespace(device_kind=kind, platform="gpu")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *a, **k: [device])


def test_load_on_a_gpu_without_a_stored_profile_is_its_cards_built_in(tmp_path, monkeypatch,
                                                                       caplog):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  _gpu_here(monkeypatch, H100_KIND)
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert machine.load() is profile.BUILTIN_PROFILES["H100"]
  assert "planning with the built-in H100 figures (the H200's measured rates scaled by the " \
         "H100's datasheet; not calibrated)" in caplog.text
  assert "profile-NVIDIA_H100_80GB_HBM3-jax" in caplog.text
  # The card may be named for the GPU here: the same profile.
  assert machine.load(platform="gpu", device_kind="h100", warn=False) is (
      profile.BUILTIN_PROFILES["H100"])
  # Another card than this GPU's is refused: its plan would mix that card's rates with this
  # GPU's memory.
  with pytest.raises(jaxtier.OptionError, match=r"not this machine's GPU \(NVIDIA H100"):
    machine.load(platform="gpu", device_kind="A100")
  # A stale profile: the card's built-in, said so.
  path = profile.cache_path()
  os.makedirs(os.path.dirname(path))
  with open(path, "w") as f:
    json.dump(dataclasses.asdict(profile.BUILTIN_PROFILES["H100"]), f)  # no format_version
  monkeypatch.setattr(machine, "_WARNED", set())  # (said once per path: this path again)
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert machine.load() is profile.BUILTIN_PROFILES["H100"]
  assert "written by an older jaxtier" in caplog.text and "built-in H100 figures" in caplog.text
  # A calibrated one is what it says.
  measured = dataclasses.replace(profile.BUILTIN_PROFILES["H100"], link_h2d_gbps=51.0,
                                 source="calibrated on NVIDIA H100 80GB HBM3")
  assert machine.load(profile.save(measured)) == measured


def test_load_on_an_h200_or_an_unknown_gpu_is_the_h200_default(tmp_path, monkeypatch, caplog):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  _gpu_here(monkeypatch, "NVIDIA H200")
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert machine.load() is D
  assert "planning with the H200 defaults. Run" in caplog.text
  _gpu_here(monkeypatch, "NVIDIA L40S")
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    assert machine.load() is D
  assert ("planning with the H200 defaults (no built-in figures for NVIDIA L40S; known: H100, "
          "H200, A100)") in caplog.text


def test_a_plan_on_a_gpu_with_a_built_in_profile_names_its_card(monkeypatch):
  # No stored profile on an H100: the plan's times are the H100's built-in rates, and the
  # summary says so with the command that measures this machine.
  _gpu_here(monkeypatch, H100_KIND)
  rates = planner._rates_of(profile.BUILTIN_PROFILES["H100"], "gpu")
  assert rates == "the built-in H100 profile's rates, not this machine's"
  assert plan_text._short_rates(rates) == "uncalibrated H100 built-in rates"
  assert planner._rates_of(D, "gpu") == "the default profile's H200 rates, not this machine's"
  calibrated = dataclasses.replace(profile.BUILTIN_PROFILES["H100"], source="calibrated")
  assert planner._rates_of(calibrated, "gpu") == ""
  assert profile.describe(profile.BUILTIN_PROFILES["A100"]) == "the built-in A100 profile"
  assert profile.describe(D) == "the default hardware profile"
  assert profile.describe(calibrated) == "a stored profile"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="plans for a GPU that is not here")
def test_a_plan_for_an_absent_gpu_uses_the_card_named(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  state, batch = mlp_state(), toy_batch()
  h200 = jaxtier.plan(STEP, state, batch, platform="gpu")
  h100 = jaxtier.plan(STEP, state, batch, platform="gpu", device_kind="H100")
  a100 = jaxtier.plan(STEP, state, batch, platform="gpu", device_kind="a100")
  assert h200.hardware_kind == "NVIDIA H200" and h100.hardware_kind == H100_KIND
  assert a100.hardware_kind == "NVIDIA A100-SXM4-80GB"
  assert f"hardware profile: {profile.BUILTIN_PROFILES['H100'].source}" in h100.notes
  said = [n for n in h100.notes if n.startswith("planned for gpu")]
  assert said and "without one (cpu): the built-in H100 profile;" in said[0], h100.notes
  assert any("the default hardware profile" in n for n in h200.notes)  # as before
  assert not h100.rates_of  # the card planned for, not this machine
  # All on the device: the same matmul rate, less HBM bandwidth on the H100, less of both on
  # the A100; its memory is the H100's 80 GB, not the H200's 141.
  assert h200.predicted_step_secs < h100.predicted_step_secs < a100.predicted_step_secs
  assert h100.resource_secs["compute"] > h200.resource_secs["compute"]
  usable = lambda p: p.device_budget.usable
  assert usable(h100) == int(profile.BUILTIN_PROFILES["H100"].hbm_bytes * 0.95)
  assert usable(h100) < usable(h200)
  assert json.loads(h100.to_json())["hardware_kind"] == H100_KIND
  # With the optimizer state in pinned_host the A100's link, half the H200's, costs more.
  small = dict(platform="gpu", device_budget=600_000)
  host_h200 = jaxtier.plan(STEP, state, batch, **small)
  host_a100 = jaxtier.plan(STEP, state, batch, device_kind="A100", **small)
  assert {l.placement for l in host_a100.leaves} != {"device"}
  assert host_a100.predicted_step_secs > host_h200.predicted_step_secs
