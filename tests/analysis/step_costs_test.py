"""Step costs: FLOPs counted from the jaxpr (every scan iteration, stacked layers found) and
scan bodies timed on this device in place of the analytic compute figure."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtier
from jaxtier._src.analysis import layer_stacks
from jaxtier._src.analysis import step_costs as step_costs_lib
from jaxtier._src.hardware import profile


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
  assert layer_stacks.stacked_layers(closed.jaxpr, 1) == {
      0: (layer_stacks.stacked_layers(closed.jaxpr, 1)[0][0], 6)}


def test_scan_bodies_timed_replace_their_analytic_compute(monkeypatch):
  def f(w, x):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
    return jnp.sum(h @ jnp.ones((64, 2)))
  w = jnp.ones((6, 64, 64), jnp.float32) * 0.01
  x = jnp.ones((128, 64), jnp.float32)
  closed = jax.make_jaxpr(jax.grad(f))(w, x)
  timed = step_costs_lib.time_scan_bodies(closed, reps=2)
  layer_flops = 2 * 128 * 64 * 64
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
  # A body over the FLOPs limit is left to the analytic count (the CPU backend's limit keeps
  # a large model's layers from running for minutes): here the forward's (2 * 128 * 64 * 64
  # FLOPs) is timed and its transpose's (twice that) is not.
  capped = step_costs_lib.time_scan_bodies(closed, reps=1, max_body_flops=1.5 * layer_flops)
  assert (capped.count, capped.iterations) == (1, 6)
  assert step_costs_lib.time_scan_bodies(closed, reps=1, max_body_flops=1.0) is None
  # No scan: nothing to time; the analytic formula stays.
  assert step_costs_lib.time_scan_bodies(jax.make_jaxpr(lambda a: a @ a)(jnp.ones((8, 8)))) is None
  # Through the planner (forced on the CPU backend): the plan's notes say how compute was found.
  # On a GPU the scan bodies are timed; on the CPU backend the whole step is run.
  monkeypatch.setenv("JAXTIER_TIME_SCANS", "1")
  plan = jaxtier.plan(lambda w, x: (w - 0.1 * jax.grad(f)(w, x), None), w, x)
  said = ("scan bodies timed" if jax.default_backend() == "gpu"
          else "the device-only step run on this device")
  assert any(said in n for n in plan.notes), plan.notes


def test_on_the_cpu_the_device_only_step_is_run_and_its_time_is_the_compute():
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend runs the whole step")
  def f(w, x):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
    return jnp.sum(h)
  w = jax.ShapeDtypeStruct((4, 64, 64), jnp.float32)
  x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
  step = lambda w, x: (w - 0.1 * jax.grad(f)(w, x), jnp.sum(w))
  closed = jax.make_jaxpr(step)(w, x)
  costs = step_costs_lib.measure_step(closed, [w], [x], platform="cpu",
                                      state_device_bytes=4 * 64 * 64 * 4, time_scans=True)
  prof = profile.DEFAULT_PROFILE
  assert costs.step_secs > 0 and costs.timed is None  # (its scans not timed apart)
  assert costs.compute_secs(prof) == costs.step_secs
  analytic = step_costs_lib.compute_secs(costs.flops, costs.elementwise_bytes, prof)
  assert f"the device-only step run on this device, {costs.step_secs * 1e3:.4g} ms" in (
      costs.compute_source(prof))
  assert f"{analytic * 1e3:.4g} ms)" in costs.compute_source(prof)
  # Planning for a GPU here: its scans are timed on this CPU, not the step (no GPU to run it).
  gpu = step_costs_lib.measure_step(closed, [w], [x], platform="gpu",
                                    state_device_bytes=4 * 64 * 64 * 4, time_scans=True)
  assert gpu.step_secs is None and gpu.timed.count == 2
  # Not run: a step over the input limit, or with a `while` loop (zeros may not end it).
  compiled = jax.jit(step, donate_argnums=0).lower(w, x).compile()
  assert step_costs_lib.time_step(compiled, [w, x], closed, reps=1) > 0
  assert step_costs_lib.time_step(compiled, [w, x], closed, max_input_bytes=1000) is None
  loop = lambda w, x: (jax.lax.while_loop(lambda c: jnp.sum(c) < 1.0, lambda c: c + 1, w), x)
  looped = jax.make_jaxpr(loop)(w, x)
  assert step_costs_lib.time_step(jax.jit(loop).lower(w, x).compile(), [w, x], looped) is None


def test_a_later_process_reads_the_timed_step_from_the_figures_cache(monkeypatch):
  # A calibrated CPU compiles the device-only step in full and runs it: a later process (the
  # in-process caches emptied) reads both its figures and its time from disk, and neither
  # lowers nor runs it.
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend runs the whole step")
  w = jax.ShapeDtypeStruct((4, 64, 64), jnp.float32)
  x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
  step = lambda w, x: (w - 0.1 * jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w[0])))(w, x),
                       jnp.sum(w))
  closed = jax.make_jaxpr(step)(w, x)
  measure = lambda: step_costs_lib.measure_step(
      closed, [w], [x], platform="cpu", state_device_bytes=4 * 64 * 64 * 4, time_scans=True)
  first = measure()
  step_costs_lib._COMPILED_FIGURES.clear()  # pylint: disable=protected-access
  step_costs_lib._TIMED_STEPS.clear()  # pylint: disable=protected-access
  monkeypatch.setattr(step_costs_lib, "time_step", lambda *a, **k: pytest.fail("timed again"))
  monkeypatch.setattr(jax.stages.Lowered, "compile",
                      lambda *a, **k: pytest.fail("compiled again"))
  later = measure()
  assert first.step_secs > 0 and later.step_secs == pytest.approx(first.step_secs, abs=1e-9)
  assert later.transient_bytes == first.transient_bytes
  assert "read from the figures cache" in later.transient_source
  assert "with its time on this machine" in later.transient_source
  assert "figures cache" not in first.transient_source


def test_time_step_takes_the_fastest_of_its_runs(monkeypatch):
  # A fake clock that only the step's runs advance (warm-up 0.5 s, then 0.3, 0.1, 0.2 s): other
  # work on a shared machine only ever adds to a run, so the fastest run is the step's time.
  import time
  clock, durations = [0.0], iter([0.5, 0.3, 0.1, 0.2])
  monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

  def compiled(*args):
    clock[0] += next(durations)
    return args[0]
  w = jax.ShapeDtypeStruct((4,), jnp.float32)
  closed = jax.make_jaxpr(lambda w: w)(w)
  assert step_costs_lib.time_step(compiled, [w], closed, reps=3) == pytest.approx(0.1)


def _measure_timed(times: list, clear: bool = True):
  """`measure_step` of a small step on a calibrated CPU, `time_step` faked to return the next
  of `times` (seconds); the in-process caches emptied first where `clear` (a new process)."""
  w = jax.ShapeDtypeStruct((4, 32, 32), jnp.float32)
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  step = lambda w, x: (w - 0.1 * jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w[0])))(w, x),
                       jnp.sum(w))
  if clear:
    step_costs_lib._COMPILED_FIGURES.clear()  # pylint: disable=protected-access
    step_costs_lib._TIMED_STEPS.clear()  # pylint: disable=protected-access
  return step_costs_lib.measure_step(
      jax.make_jaxpr(step)(w, x), [w], [x], platform="cpu", state_device_bytes=4 * 32 * 32 * 4,
      time_scans=True)


def test_a_kept_step_time_a_run_contradicts_is_timed_again(monkeypatch):
  # A time taken under load (0.2 s) is kept; a run measuring 0.15 s (within RETIME_FACTOR)
  # keeps it, one measuring 0.1 s drops it, and the next planning times the step again.
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend runs the whole step")
  times = [0.2, 0.1]
  monkeypatch.setattr(step_costs_lib, "time_step", lambda *a, **k: times.pop(0))
  first = _measure_timed(times)
  assert first.step_secs == 0.2 and first.step_time_key
  assert not step_costs_lib.check_step_time(first.step_time_key, 0.2, 0.15)
  later = _measure_timed(times)  # a later process reads it
  assert later.step_secs == 0.2 and later.step_time_key == first.step_time_key
  assert times == [0.1]
  assert step_costs_lib.check_step_time(first.step_time_key, 0.2, 0.1)
  # Dropped in this process too: the same step planned again here is timed again.
  again = _measure_timed(times, clear=False)
  assert again.step_secs == 0.1 and times == []
  # And kept on disk for a later process.
  assert _measure_timed(times).step_secs == 0.1
  # A run slower by more than the factor (a time taken in a lull) drops it as well.
  assert step_costs_lib.check_step_time(first.step_time_key, 0.1, 0.2)
  times.append(0.25)
  assert _measure_timed(times).step_secs == 0.25
  # Nothing to check: a step not timed, or no prediction.
  assert not step_costs_lib.check_step_time(None, 0.1, 1.0)
  assert not step_costs_lib.check_step_time(first.step_time_key, None, 1.0)


def test_a_scan_body_too_large_to_time_leaves_the_others_timed():
  # The backward body also reads the forward's residuals: over the limit it stays analytic
  # while the forward body is timed.
  def f(w, x):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
    return jnp.sum(h)
  w = jnp.ones((4, 32, 32), jnp.float32)
  x = jnp.ones((64, 32), jnp.float32)
  closed = jax.make_jaxpr(jax.grad(f))(w, x)
  sizes = []
  for eqn in closed.jaxpr.eqns:
    if eqn.primitive.name == "scan":
      sizes.append(sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
                       for v in eqn.params["jaxpr"].jaxpr.invars))
  assert len(sizes) == 2 and sizes[0] < sizes[1]
  timed = step_costs_lib.time_scan_bodies(closed, reps=1, max_input_bytes=sizes[0])
  assert (timed.count, timed.iterations) == (1, 4)
  assert step_costs_lib.time_scan_bodies(closed, reps=1, max_input_bytes=sizes[0] - 1) is None


class _FakeTimes(dict):
  """A stand-in for the timed bodies' cache: the n-th body asked for took n seconds (the
  forward loop 1, its transpose 2, ...), so that shares are exact and the order shows."""

  def __contains__(self, key):
    if not dict.__contains__(self, key):
      dict.__setitem__(self, key, float(len(self) + 1))
    return True


def test_the_backward_share_is_the_transposed_scans_time_over_all(monkeypatch):
  def f(w, x):
    body = jax.checkpoint(lambda h, wl: (jnp.tanh(h @ wl), None))
    h, _ = jax.lax.scan(body, x, w)
    return jnp.sum(h)
  w = jnp.ones((4, 32, 32), jnp.float32)
  x = jnp.ones((64, 32), jnp.float32)
  monkeypatch.setattr(step_costs_lib, "_TIMED_BODIES", _FakeTimes())
  timed = step_costs_lib.time_scan_bodies(jax.make_jaxpr(jax.grad(f))(w, x), reps=1)
  # Forward 1 s x 4 iterations, its transpose 2 s x 4: the second of the pair is the backward.
  assert timed.count == 2 and timed.secs == pytest.approx(12.0)
  assert timed.backward_share == pytest.approx(8.0 / 12.0)
  # One scan alone (no backward pass to pair it with): no share measured.
  closed = jax.make_jaxpr(lambda w, x: jax.lax.scan(lambda h, wl: (h @ wl, None), x, w)[0])(w, x)
  assert step_costs_lib.time_scan_bodies(closed, reps=1).backward_share is None
