"""Reasons are records (a kind and its fields) rendered as the plan prints them."""

import dataclasses
import types

import pytest

from jaxtier._src.planning import reasons
from jaxtier._src.planning.reasons import Kind, Placed, reason, render


def test_a_reason_renders_with_its_notes_in_order():
  r = reason(Kind.USER_PLACED).with_note(reason(Kind.UPDATED_IN_PLACE_BY, executor="host_cpu"))
  r = r.with_note(reason(Kind.LAYERED, executor="host_split", fraction=0.8))
  assert render(r) == ("placed by the user's policy; updated in place by host_cpu; updated "
                       "layer by layer inside the backward pass, by host_split (the DHA "
                       "kernel's share 0.80)")
  # A re-cut names its executor in place of the last one, last.
  again = r.without(Kind.UPDATED_IN_PLACE_BY).with_note(
      reason(Kind.UPDATED_IN_PLACE_BY, executor="split"))
  assert [n.kind for n in again.notes] == [Kind.LAYERED, Kind.UPDATED_IN_PLACE_BY]
  assert render(again).endswith("(the DHA kernel's share 0.80); updated in place by split")
  assert r.kind is Kind.USER_PLACED and r.notes[1]["fraction"] == 0.8


def test_a_fallback_kept_on_the_device_drops_its_transfer_clause():
  fallback = reason(Kind.NOT_ELEMENTWISE, why="a reduction")
  assert render(fallback) == "update not one elementwise pass (a reduction): XLA memory-kind " \
                             "transfers"
  kept = render(reason(Kind.KEPT_ON_DEVICE, fallback=fallback))
  assert kept.startswith("update not one elementwise pass (a reduction): served by XLA's ")
  param = reason(Kind.PARAM_NOT_SERVED, by_user=True, why="read by a matmul")
  assert render(param).startswith("a parameter placed by the user's policy is read by a matmul")
  assert render(reason(Kind.KEPT_ON_DEVICE, fallback=param)).startswith(render(param) + ": ")


@pytest.mark.parametrize("placement,rows,want", [
    ("host_stream", None, "prefetched layer by layer ahead of its use (the copy engines move "
     "it at 50.0 GB/s; the DHA matmul would read it in place at 40.0, profile)"),
    ("host_dha", 2**20, "an embedding table whose rows the DHA gather reads in place (1.00 MiB "
     "of rows per step, not the 1.00 GiB a copy"),
    ("host_dha", None, "read in place by the GPU (zero-copy)"),
])
def test_a_parameter_on_the_host_says_how_its_placement_serves_it(placement, rows, want):
  text = render(reason(Kind.PARAM_ON_HOST, placement=placement, nbytes=2**30, freed=2**31,
                       rows=rows, dha_gbps=40.0, link_gbps=50.0))
  assert text.startswith("parameter: lives in pinned_host, " + want)
  assert "(frees 2.00 GiB with its gradient)" in text


def test_every_kind_renders_and_placed_is_read_only():
  assert set(reasons._TEXT) == set(Kind)
  placed = Placed.of({0: "device"}, {0: reason(Kind.POLICY_NONE)}, {1})
  assert isinstance(placed.placement, types.MappingProxyType)
  with pytest.raises(TypeError):
    placed.placement[0] = "host_cpu"  # type: ignore[index]
  with pytest.raises(dataclasses.FrozenInstanceError):
    placed.fused = frozenset()  # type: ignore[misc]
  assert render(placed.reasons[0]) == "policy 'none'" and placed.fused == {1}
