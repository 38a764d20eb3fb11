"""`StepRunner` alone: a plan's programs run over placed leaves, timed, Ctrl-C held, a failed
step's note; and `HeldInterrupt`."""

import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import optax_train_step
from jaxtier._src import pipeline
from jaxtier._src.options import OffloadOptions
from jaxtier._src.runtime import placing
from jaxtier._src.runtime.masters import MasterCopies
from jaxtier._src.runtime.runner import (INTERRUPTED_NOTE, MEASURED_STEPS, HeldInterrupt,
                                         StepRunner)

TX = optax.adamw(1e-2)
STEP = optax_train_step(TX, lambda p, x, y: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))
BATCH = (jnp.ones((8, 16)), jnp.zeros((8, 4)))


def _state():
  rng = np.random.default_rng(0)
  params = {"w1": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32) * 0.1,
            "w2": jnp.asarray(rng.normal(size=(32, 4)), jnp.float32) * 0.1}
  return {"params": params, "opt": TX.init(params)}


def _runner(on_measured=lambda secs: None):
  state = _state()
  planned = pipeline.plan_step(STEP, OffloadOptions(policy="optimizer_state_on_host"), state,
                               (BATCH,))
  programs = planned.programs
  masters = MasterCopies(programs.master_indices, programs.master_shardings)
  leaves = [placing.put(x, sh, lp) for x, sh, lp in zip(
      jax.tree.leaves(state), programs.state_shardings, planned.plan.leaves)]
  return StepRunner(planned, masters, on_measured=on_measured), planned, leaves


def test_the_runner_steps_as_jit_does_and_keeps_each_new_state():
  measured = []
  runner, planned, leaves = _runner(measured.append)
  assert runner.calls == 0 and runner.scratch == []
  kept = []
  ref_step = jax.jit(STEP)
  want = _state()
  for k in range(1 + MEASURED_STEPS):
    moved = placing.for_step(leaves, planned.programs.state_shardings)
    state, metrics = runner.run(moved, jax.tree.leaves((BATCH,)),
                                keep=lambda s, m: kept.append((s, m)))
    assert kept[-1][0] is state and kept[-1][1] is metrics
    want, m_ref = ref_step(want, BATCH)
    np.testing.assert_allclose(float(metrics["loss"]), float(m_ref["loss"]), rtol=1e-5)
    for x, lp in zip(jax.tree.leaves(state), planned.plan.leaves):
      assert x.sharding.memory_kind == lp.memory_kind, lp.path
    leaves = jax.tree.leaves(state)
    assert len(measured) == (1 if k == MEASURED_STEPS else 0), (k, measured)
  assert runner.calls == 1 + MEASURED_STEPS and len(runner.step_times) == MEASURED_STEPS
  assert measured[0] == float(np.median(runner.step_times)) and measured[0] > 0
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_the_runner_donates_the_device_leaves_and_reads_the_host_ones():
  runner, planned, leaves = _runner()
  split = planned.programs.split
  runner.run(leaves, jax.tree.leaves((BATCH,)), keep=lambda s, m: None)
  for i, lp in enumerate(planned.plan.leaves):
    donated = i in split.device_leaves or i in split.updated_host or i in split.layered_host
    assert leaves[i].is_deleted() == donated, lp.path
  assert split.device_leaves and split.updated_host  # both kinds were seen


def test_the_failure_note_says_what_the_failed_program_consumed():
  runner, planned, leaves = _runner()
  assert not planned.programs.split.layered_host
  gone = jnp.ones(3)
  gone.delete()
  note = runner.failure_note([gone, jnp.ones(2)])
  assert note.startswith("jaxtier: the step failed before its host updates ran: the state's "
                         "pinned_host leaves are intact")
  assert "1 of its 2 device leaves were donated" in note
  assert "were not consumed" in runner.failure_note([jnp.ones(2)])


def test_the_scratch_buffers_are_shapes_before_they_exist():
  runner, planned, _ = _runner()
  assert runner.scratch_avals() == [jax.ShapeDtypeStruct(s.shape, s.dtype)
                                    for s in planned.programs.stream.scratch]
  runner.ensure_scratch()
  assert len(runner.scratch) == len(planned.programs.stream.scratch)


def test_a_held_sigint_is_raised_at_release_with_the_note():
  held = HeldInterrupt()
  signal.raise_signal(signal.SIGINT)  # held: nothing raised here
  assert held.pending
  with pytest.raises(KeyboardInterrupt) as info:
    held.release("value", note="where the state is")
  assert info.value.__notes__ == ["where the state is"]
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  assert "step.last_state" in INTERRUPTED_NOTE


def test_release_without_a_sigint_returns_the_value_and_restores_the_handler():
  held = HeldInterrupt()
  assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
  assert held.release(("state", "metrics"), note="unused") == ("state", "metrics")
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  assert held.release("again") == "again"  # a second release does nothing


def test_nothing_is_held_outside_the_main_thread():
  got = {}

  def run():
    held = HeldInterrupt()
    got["handler"] = signal.getsignal(signal.SIGINT)
    got["value"] = held.release(7)
  t = threading.Thread(target=run)
  t.start()
  t.join()
  assert got == {"handler": signal.default_int_handler, "value": 7}
