"""Ctrl-C inside an offloaded step loses nothing: SIGINT sent at each of many points of a step
leaves either the state given to it intact, or the step's new state in `step.last_state`."""

import os
import signal
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax

from conftest import optax_train_step
import jaxtier

TX = optax.adamw(1e-2, weight_decay=0.1)


_step = optax_train_step(
    TX, lambda p, x, y: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))


def _fresh():
  rng = np.random.default_rng(0)
  params = {"w1": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32) * 0.1,
            "w2": jnp.asarray(rng.normal(size=(32, 4)), jnp.float32) * 0.1}
  return {"params": params, "opt": TX.init(params)}


BATCH = (jnp.ones((8, 16), jnp.float32), jnp.zeros((8, 4), jnp.float32))


# The runtime's modules (`jaxtier/_src/runtime/`): a step runs its lines.
RUNTIME = os.path.join("jaxtier", "_src", "runtime", "")


def _in_runtime(filename):
  return RUNTIME in filename


def _interrupt_at(k):
  """A trace function that sends SIGINT at the k-th line run in jaxtier's runtime modules."""
  count = [0]

  def local(frame, event, arg):
    if event == "line":
      count[0] += 1
      if count[0] == k:
        signal.raise_signal(signal.SIGINT)
    return local

  def tracer(frame, event, arg):
    if event == "call" and _in_runtime(frame.f_code.co_filename):
      return local
    return None
  return tracer, count


def _values(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_sigint_at_every_point_of_a_step_leaves_the_state_before_or_after_it():
  step = jaxtier.offload(_step, policy="optimizer_state_on_host")
  before = step.place(jax.tree.map(jnp.copy, _fresh()), BATCH)
  want_before = _values(before)
  after, _ = step(before, BATCH)  # compiles; the reference new state
  want_after = _values(after)
  # How many lines a step runs in the runtime: every one of them is a point to interrupt at.
  tracer, count = _interrupt_at(-1)
  state = step.place(jax.tree.map(jnp.copy, _fresh()))
  sys.settrace(tracer)
  try:
    step(state, BATCH)
  finally:
    sys.settrace(None)
  points = count[0]
  assert points >= 20, points
  outcomes = {"returned": 0, "before": 0, "after": 0}
  unnoted = []
  for k in range(1, points + 1):
    state = step.place(jax.tree.map(jnp.copy, _fresh()))
    tracer, _ = _interrupt_at(k)
    new = None
    sys.settrace(tracer)
    try:
      new, _ = step(state, BATCH)
      got, kind = _values(new), "returned"
    except KeyboardInterrupt as e:
      if new is not None:  # raised in this test's frame, after the step returned
        got, kind = _values(new), "returned"
      elif any(x.is_deleted() for x in jax.tree.leaves(state)):
        # Donated: the step ran to its end; its state is in `last_state`, and the
        # interrupt says so unless it landed after the step put the handler back.
        if "step.last_state" not in "".join(getattr(e, "__notes__", [])):
          frames = [f for f in traceback.extract_tb(e.__traceback__)
                    if _in_runtime(f.filename)]
          unnoted.append((k, frames[-1].name if frames else None))
        got, kind = _values(step.last_state), "after"
      else:
        got, kind = _values(state), "before"
    finally:
      sys.settrace(None)
    sys.settrace(None)
    want = want_before if kind == "before" else want_after
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b, err_msg=f"SIGINT at line {k} of {points} ({kind})")
    outcomes[kind] += 1
  # Interrupts landed both before the donation and inside the held window; only those in the
  # step's last lines, after `HeldInterrupt.release` put the handler back, raise without the
  # note (at most its two lines after that).
  assert outcomes["before"] >= 1 and outcomes["after"] >= 10, outcomes
  assert len(unnoted) <= 2 and all(where == "release" for _, where in unnoted), unnoted
  # The step still runs on.
  new, m = step(step.last_state, BATCH)
  assert np.isfinite(float(m["loss"]))


def test_a_step_outside_the_main_thread_runs_as_before():
  import threading  # pylint: disable=g-import-not-at-top
  step = jaxtier.offload(_step, policy="optimizer_state_on_host")
  state = step.place(_fresh(), BATCH)
  out = {}
  t = threading.Thread(target=lambda: out.setdefault("r", step(state, BATCH)))
  t.start()
  t.join()
  assert np.isfinite(float(out["r"][1]["loss"]))
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
