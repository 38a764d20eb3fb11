"""The placement registry: each record's memory kind, executor, pinned bytes and eligibility,
checked against what the planner does with a toy MLP's leaves placed there."""

import re

import jax
from planning._toy import HOST_EXEC, STEP, mlp_state, toy_batch
import pytest

import jaxtier
from jaxtier._src.analysis import inventory
from jaxtier._src.errors import PlanError
from jaxtier._src.planning import cost_model, placements, policy
from jaxtier._src.planning.placements import REGISTRY, RefusalKind, Schedule
from jaxtier._src.vocab import Executor, MemoryKind, Placement, Role

RECORDS = list(REGISTRY.values())
IDS = [str(r.placement) for r in RECORDS]
ON_GPU = jax.default_backend() == "gpu"
NU_W2 = "['opt'][0].nu['w2']"


@pytest.fixture(scope="module")
def toy_inv():
  return inventory.take_inventory(STEP, mlp_state(), (toy_batch(),))


def test_every_placement_has_one_record_in_the_solvers_order():
  assert set(REGISTRY) == set(Placement) and len(RECORDS) == len(Placement)
  assert all(p is r.placement for p, r in REGISTRY.items())
  assert placements.PARAM_PLACEMENTS == ("device", "host_stream", "host_dha")
  assert placements.EXECUTOR_PLACEMENTS == ("host_dha", "host_cpu", "host_split")
  assert set(placements.HOST_PLACEMENTS) == set(Placement) - {Placement.DEVICE}
  for p in placements.EXECUTOR_PLACEMENTS:
    assert placements.of_executor(REGISTRY[p].executor) is p
  assert placements.of_executor("split") is Placement.HOST_SPLIT
  with pytest.raises(ValueError):
    placements.of_executor("host_xla")


# (memory kind, executor, schedule of a parameter, of other leaves, fused update, the DHA share)
WANT = {
    "device": ("device", None, "resident", "resident", False, None),
    "host_stream": ("pinned_host", None, "streamed", "streamed", True, None),
    "host_dha": ("pinned_host", "host_dha", "gathered", "updated_in_place", True, 1.0),
    "host_cpu": ("pinned_host", "host_cpu", "updated_in_place", "updated_in_place", True, 0.0),
    "host_split": ("pinned_host", "split", "updated_in_place", "updated_in_place", True, None),
    "host_xla": ("pinned_host", None, "copied", "copied", False, None),
}


@pytest.mark.parametrize("rec", RECORDS, ids=IDS)
def test_record_fields(rec):
  kind, executor, param_schedule, schedule, fused, share = WANT[rec.placement]
  assert rec.memory_kind == kind and rec.on_host == (kind == MemoryKind.PINNED_HOST)
  assert rec.executor == executor
  assert rec.schedule_of(Role.PARAM) == param_schedule
  assert rec.schedule_of(Role.OPTIMIZER_STATE) == schedule == rec.schedule
  assert rec.fused_update is fused and rec.dha_share == share
  assert placements.served(rec.placement, Role.PARAM) == (param_schedule in ("streamed",
                                                                             "gathered"))


# Pinned bytes of a 1000-byte parameter whose gradient is sent in 500 bytes, and of a
# 1000-byte optimizer-state leaf.
PINNED = {"device": (0, 0), "host_stream": (2000, 1000), "host_dha": (2000, 1000),
          "host_cpu": (1000, 1000), "host_split": (1000, 1000), "host_xla": (1000, 1000)}


@pytest.mark.parametrize("rec", RECORDS, ids=IDS)
def test_pinned_bytes_are_what_the_cost_model_charges(rec):
  param, state = PINNED[rec.placement]
  assert rec.pinned_bytes(1000, role=Role.PARAM, sent_grad_nbytes=500) == param
  assert rec.pinned_bytes(1000, role=Role.OPTIMIZER_STATE, sent_grad_nbytes=500) == state
  if rec.on_host:
    assert cost_model.placed_pinned_bytes(rec.placement, 1000, 500) == param


class _Param:
  nbytes, grad_nbytes, stream_grad_nbytes, num_layers = 1000, 1000, 500, 4
  dha_read_nbytes, dha_write_nbytes = 64, 32


@pytest.mark.parametrize("rec", RECORDS, ids=IDS)
def test_cost_hooks(rec):
  traffic, buffers = rec.traffic(_Param()), rec.buffers(_Param())
  want = {"host_stream": ((1000, 500, 0, 0), 2 * 2000 // 4), "host_dha": ((0, 0, 64, 32), 96)}
  (fetch, grad, read, write), held = want.get(rec.placement, ((0, 0, 0, 0), 0))
  assert (traffic.fetch_bytes, traffic.grad_bytes) == (fetch, grad)
  assert (traffic.dha_read_bytes, traffic.dha_write_bytes) == (read, write)
  assert buffers == held


def _refusal_kinds(rec, inv):
  return {l.path: (None if (r := rec.refusal(inv, l)) is None else r.kind) for l in inv.leaves}


@pytest.mark.parametrize("rec", RECORDS, ids=IDS)
def test_eligibility_on_the_toy_matches_the_policy(rec, toy_inv):
  kinds = _refusal_kinds(rec, toy_inv)
  by_path = {l.path: l for l in toy_inv.leaves}
  # The toy's leaves: two matrices read by matmuls, their AdamW moments, an int32 count.
  for path, kind in kinds.items():
    leaf = by_path[path]
    if rec.placement == Placement.DEVICE:
      want = None
    elif rec.placement == Placement.HOST_STREAM:
      want = RefusalKind.NOT_A_STACK  # no layer loop reads any of them
    elif rec.placement == Placement.HOST_DHA and leaf.role == Role.PARAM:
      want = RefusalKind.NOT_A_TABLE  # read by a matmul, not gathered by rows
    else:
      want = None if leaf.is_float else RefusalKind.NOT_FLOAT
    assert kind == want, (path, kind)
    refused = rec.refusal(toy_inv, leaf)
    asked = {"^" + re.escape(path) + "$": str(rec.placement)}
    if refused is None:
      got = policy.requested(toy_inv, asked, HOST_EXEC)[leaf.index]
      assert got.user_placed and REGISTRY[got.placement].memory_kind == rec.memory_kind
    elif rec.placement == Placement.HOST_STREAM and leaf.role == Role.OPTIMIZER_STATE:
      # Optimizer state asked to be streamed is placed with the host executor instead.
      got = policy.requested(toy_inv, asked, HOST_EXEC)[leaf.index]
      assert got.placement == HOST_EXEC and not got.user_placed
    else:
      with pytest.raises(PlanError, match=re.escape(refused.why or "only floating-point")):
        policy.requested(toy_inv, asked, HOST_EXEC)
  assert placements.Refusal(rec.placement, RefusalKind.NOT_FLOAT) == placements.Refusal(
      rec.placement, RefusalKind.NOT_FLOAT, "")


@pytest.mark.parametrize("rec", RECORDS, ids=IDS)
def test_the_planner_places_an_optimizer_state_leaf_as_the_record_says(rec):
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch(), policy={re.escape(NU_W2): rec.placement})
  leaf = {l.path: l for l in plan.leaves}[NU_W2]
  if placements.streamed(rec.placement):
    # Optimizer state is not streamed: asked for host_stream, it is left to the solver (which
    # keeps it on the device: everything fits).
    want = Placement.DEVICE
    assert not leaf.user_placed
  elif rec.schedule is Schedule.UPDATED_IN_PLACE and not ON_GPU:
    want = Placement.HOST_CPU  # every executor is the CPU handler on the CPU backend
  else:
    want = rec.placement
  assert leaf.placement == want
  final = REGISTRY[leaf.placement]
  assert leaf.memory_kind == final.memory_kind
  calls = [cc for cc in plan.components if leaf.index in cc.component.seeds]
  if final.executor is None:
    assert not calls  # on the device, or copied by XLA: no fused host update
  else:
    assert [cc.executor for cc in calls] == [final.executor]
    assert final.executor in tuple(Executor)
  # The plan's pinned bytes: the host leaves' own (no fp32 masters in this fp32 toy).
  assert plan.pinned_bytes == sum(
      REGISTRY[l.placement].pinned_bytes(l.nbytes, role=l.role) for l in plan.leaves
      if l.role != Role.PARAM)
