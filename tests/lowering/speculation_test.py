"""Guarded updates run on a guess (`analysis/update_schedule.py`, `runtime/runner.py`).

A stack of layers under `nnx.scan`, its optimizer state on the host, clipped by
`optax.clip_by_global_norm`: the layered updates run during the backward pass on the guess that
the clip does not bind, writing spare buffers; a step whose clip binds runs the serial schedule
instead. Over many steps, where the clip binds on some and not on others, the state equals the
plan's serial programs' bit for bit, and on the CPU the schedule with no layered update's, for
every optimizer of the optimizer table.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxtier
from jaxtier._src.analysis import update_schedule
from jaxtier._src.analysis.update_schedule import Mode, Why
from jaxtier._src.lowering import hlo as hlo_lib
from jaxtier._src.primitives import host_update as hu
from jaxtier._src.runtime import runner

from lowering import overlap_test as ot

ON_GPU = jax.default_backend() == "gpu"
# The clip's max norm, and the steps whose batch is scaled up so that their gradient norm is
# over it (the others are under it).
MAX_NORM = 1.0
LOUD = 40.0


def _batch(i):
  x, y = ot._batch(i)
  loud = i % 7 == 3
  return x * (LOUD if loud else 1.0), y * (LOUD if loud else 0.05)


def _clipped(make):
  return optax.chain(optax.clip_by_global_norm(MAX_NORM), make())


def _train(tx, overlap, steps, dtype=jnp.float32, guess=True, host_budget=None):
  """`guess=False`: the plan's serial programs run every step (a step whose guess missed)."""
  graphdef, params = ot._model(dtype)
  step = jaxtier.offload(ot._step(graphdef, tx), policy=ot.ON_HOST, overlap_update=overlap,
                         host_budget=host_budget)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  if not guess:
    step._runner.guesser.guess = lambda: None
  losses, norms = [], []
  for i in range(steps):
    state, m = step(state, _batch(i))
    losses.append(float(m["loss"]))
  return step, state, losses


@pytest.fixture
def guess_at_any_miss_rate(monkeypatch):
  """The guesser guesses whatever share of recent guesses missed: the plan's break-even
  (`Speculation.max_miss`) rests on the machine's rates (a GPU's built-in profile, the CPU's
  defaults), and the tests that use this count the guesses made."""
  init = runner.Guesser.__init__
  monkeypatch.setattr(runner.Guesser, "__init__",
                      lambda self, guesses, max_miss: init(self, guesses, 1.0))


def _same(a_state, b_state):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(a_state)[0],
                          jax.tree.leaves(b_state)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(path))


def test_the_clip_s_updates_are_guarded_by_its_predicate():
  step, _, _ = _train(_clipped(lambda: optax.adamw(1e-2)), overlap=True, steps=1)
  plan = step.plan
  guarded = [s for s in plan.schedule if s.guarded]
  # The stacked kernel's and bias's updates: layered on the guess that the clip does not bind
  # (`norm < max` true); the norm itself is read only by the unchosen case.
  assert len(guarded) == 2 and all(s.mode == Mode.LAYERED for s in guarded)
  for s in guarded:
    cc = plan.components[s.component]
    assert s.guesses == ((1.0,),)
    assert [np.dtype(cc.operands[p].var.aval.dtype) for p in s.guards] == [np.bool_]
    assert [np.dtype(cc.operands[p].var.aval.dtype) for p in s.unread] == [np.float32]
  assert plan.speculation is not None and plan.speculation.enabled
  assert plan.speculation.components == tuple(s.component for s in guarded)
  # The serial schedule (its rerun) keeps them after the backward pass, and costs more.
  assert plan.speculation.serial_step_secs > plan.speculation.speculative_step_secs
  assert 0 < plan.speculation.max_miss < 1
  spec_secs, serial_secs = (plan.speculation.speculative_step_secs,
                            plan.speculation.serial_step_secs)
  # A held guess costs the guessed step, a miss that and a serial one, no guess a serial one.
  assert plan.speculation.mean_step_secs(2, 1, 1) == pytest.approx(
      (3 * spec_secs + 2 * serial_secs) / 4)
  assert plan.speculation.mean_step_secs(0, 0, 0) is None
  serial = step._programs.split.overlap
  assert not serial.updates
  assert {w.kind for w in serial.serial.values()} >= {Why.WAITS_FOR_EVERY_GRADIENT}
  spec = step._programs.speculative.split
  assert spec.speculative and spec.overlap.guarded and spec.guards == 1
  assert spec.guesses == ((1.0,),)


def test_reads_follows_the_case_a_fixed_predicate_picks():
  # r0 = operand 0 (a gradient); r1 = r0 / operand 1 (the norm); r2 = operand 2 (norm < max);
  # result = select(r2, r1, r0): r0 where r2 is true.
  op = hu.Op
  code = np.asarray([(op.LOAD, 0, 0, 0, 0), (op.LOAD, 1, 1, 0, 0), (op.DIV, 1, 0, 1, 0),
                     (op.LOAD, 2, 2, 0, 0), (op.SELECT, 3, 2, 1, 0),
                     (op.STORE, 0, 3, 0, 0)], np.int32)
  program = hu.Program(code=code, consts=np.zeros(1, np.float32), num_regs=4, num_operands=3,
                       num_results=1)
  assert not update_schedule.reads(program, {2: 1.0}, {1})
  assert update_schedule.reads(program, {2: 0.0}, {1})
  assert update_schedule.reads(program, {}, {1})
  # A predicate negated before the select is followed too.
  negated = np.concatenate([code[:4], [(op.NOT, 2, 2, 0, 0)], code[4:]]).astype(np.int32)
  program = hu.Program(code=negated, consts=np.zeros(1, np.float32), num_regs=4,
                       num_operands=3, num_results=1)
  assert update_schedule.reads(program, {2: 1.0}, {1})
  assert not update_schedule.reads(program, {2: 0.0}, {1})


@pytest.mark.parametrize("name", [
    "adamw",
    pytest.param("sgd_momentum", marks=pytest.mark.slow),
    pytest.param("adam", marks=pytest.mark.slow),
    pytest.param("lion", marks=pytest.mark.slow),
    pytest.param("rmsprop_centered_momentum", marks=pytest.mark.slow),
    pytest.param("adabelief", marks=pytest.mark.slow),
    pytest.param("adamw_warmup_cosine", marks=pytest.mark.slow),
])
@pytest.mark.usefixtures("guess_at_any_miss_rate")
def test_guessed_steps_equal_the_serial_schedule_bit_for_bit(name):
  # The reference: the plan's serial programs on every step (on a GPU a rolled backward pass,
  # as `overlap_update=False` compiles, rounds some gradients otherwise, and 200 steps drift
  # apart); on the CPU also the serial schedule with no layered update at all.
  steps = 200 if name != "adamw" else 60
  make = ot.OPTIMIZERS[name]
  _, s_state, s_losses = _train(_clipped(make), overlap=True, steps=steps, guess=False)
  step, l_state, l_losses = _train(_clipped(make), overlap=True, steps=steps)
  guesser = step._runner.guesser
  # The clip bound on some steps (each a missed guess: it ran the serial schedule) and not on
  # others (guesses that held).
  assert 0 < guesser.missed < guesser.tried, (guesser.tried, guesser.missed)
  assert l_losses == s_losses
  _same(s_state, l_state)
  if not ON_GPU:
    _, o_state, o_losses = _train(_clipped(make), overlap=False, steps=steps)
    assert l_losses == o_losses
    _same(o_state, l_state)


def _copy(tree):
  """A copy of a placed state, each leaf in its own memory kind and sharding."""
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x), x.sharding), tree)


@pytest.mark.parametrize("name", ["adamw", "adam", "lion"])
def test_a_guessed_step_equals_the_serial_programs_from_the_same_state(name):
  # Step by step, on every backend: from one state, the guessed step and the serial programs
  # a missed guess reruns give the same state bit for bit. Their gradients come from backward
  # passes unrolled alike (`rewrite.py`), so a GPU rounds them alike too.
  tx = _clipped(ot.OPTIMIZERS[name])
  graphdef, params = ot._model()
  step = jaxtier.offload(ot._step(graphdef, tx), policy=ot.ON_HOST)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  guesser = step._runner.guesser
  for i in range(8):
    kept = _copy(state)
    guesser.guess = lambda: (1.0,)  # the clip does not bind
    guessed, m_guessed = step(_copy(kept), _batch(i))
    guesser.guess = lambda: None
    serial, m_serial = step(_copy(kept), _batch(i))
    assert float(m_guessed["loss"]) == float(m_serial["loss"]), i
    _same(serial, guessed)
    state = guessed
  # The clip bound on some steps (their guess missed: the serial programs ran twice) and not
  # on the others (the guessed step's own state was compared).
  assert guesser.tried == guesser.unguessed == 8
  assert 0 < guesser.missed < 8, guesser.missed


def test_bf16_params_guessed_equal_the_serial_schedule():
  make = lambda: optax.adamw(1e-2, weight_decay=0.1)
  _, s_state, s_losses = _train(_clipped(make), overlap=False, steps=30, dtype=jnp.bfloat16)
  step, l_state, l_losses = _train(_clipped(make), overlap=True, steps=30, dtype=jnp.bfloat16)
  spec = step._programs.speculative.split
  # The block's fp32 masters and its bf16 params (on the device) are written to spares.
  assert len(spec.layered_masters) == 2 and len(spec.spare_device) == 2
  assert step._runner.guesser.missed > 0
  if not ON_GPU:
    assert l_losses == s_losses
    _same(s_state, l_state)
    masters = {i: np.asarray(m) for i, m in step._masters.by_index().items()}
    assert all(np.isfinite(m).all() for m in masters.values())


def _spare_bytes(plan, s):
  """The pinned bytes of the spares of schedule entry `s`'s buffers."""
  return sum(plan.leaves[i].master_nbytes if kind == "master" else plan.leaves[i].nbytes
             for kind, i in s.buffers
             if kind == "master" or plan.leaves[i].memory_kind != "device")


@pytest.mark.usefixtures("guess_at_any_miss_rate")
def test_spares_that_do_not_all_fit_guess_for_the_largest_update_alone():
  # A host budget with room for the kernel's spares and not for the bias's too: the kernel's
  # update runs on the guess, the bias's waits for the norm (serial, after the backward pass);
  # the state still equals the serial programs' bit for bit, steps clipped or not.
  tx = lambda: _clipped(lambda: optax.adamw(1e-2))
  whole = _train(tx(), overlap=True, steps=1)[0].plan
  guarded = sorted((s for s in whole.schedule if s.guarded),
                   key=lambda s: -_spare_bytes(whole, s))
  big, small = (_spare_bytes(whole, s) for s in guarded)
  assert big > small > 0 and whole.speculation.spare_pinned_bytes == big + small
  budget = whole.pinned_need_bytes - small // 2
  step, l_state, l_losses = _train(tx(), overlap=True, steps=60, host_budget=budget)
  plan = step.plan
  assert plan.fits and plan.pinned_need_bytes <= budget
  spec = plan.speculation
  assert spec.enabled and spec.spare_pinned_bytes == big
  assert spec.components == (guarded[0].component,)
  assert spec.waiting == (guarded[1].component,)
  waits = plan.schedule[guarded[1].component]
  assert waits.mode == Mode.SERIAL and waits.reason.kind == Why.NO_ROOM_FOR_SPARES
  # Its guess saves less than the whole one, and still some.
  assert (whole.speculation.speculative_step_secs < spec.speculative_step_secs
          < spec.serial_step_secs)
  assert "1 of 2 guarded updates run on a guess" in " ".join(plan.summary(width=400).split())
  guesser = step._runner.guesser
  assert 0 < guesser.missed < guesser.tried, (guesser.tried, guesser.missed)
  _, s_state, s_losses = _train(tx(), overlap=True, steps=60, guess=False, host_budget=budget)
  assert l_losses == s_losses
  _same(s_state, l_state)
  # With room for neither, no guess: the serial schedule, said why.
  none = _train(tx(), overlap=True, steps=1,
                host_budget=whole.pinned_need_bytes - big - small + small // 2)[0].plan
  assert not none.speculation.enabled and none.speculation.why, none.speculation


def test_guesses_left_waiting_by_the_pinned_pool_name_the_pool_that_fits(monkeypatch):
  # On a GPU whose pinned pool (not a host budget) leaves guarded updates waiting, the plan
  # names the pool with room for every spare, where the host has the memory.
  from jaxtier._src import pipeline  # pylint: disable=g-import-not-at-top
  from jaxtier._src.hardware import host as host_lib  # pylint: disable=g-import-not-at-top
  from jaxtier._src.options import OffloadOptions  # pylint: disable=g-import-not-at-top
  whole = _train(_clipped(lambda: optax.adamw(1e-2)), overlap=True, steps=1)[0].plan
  spec = whole.speculation
  partial = dataclasses.replace(whole, platform="gpu", speculation=dataclasses.replace(
      spec, components=spec.components[:1], waiting=spec.components[1:]))
  need = whole.pinned_bytes + spec.all_spare_pinned_bytes
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str((need - 1) / 2**30))
  monkeypatch.setattr(host_lib, "available_bytes", lambda: 200 * 2**30)
  said = pipeline._pool_for_spares(partial, host_lib.HERE_PINNABLE, OffloadOptions(), 1)
  assert said == ("1 guarded update waits for the norm for want of pinned memory for its "
                  "spares: with XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=180 (XLA's pinned pool; this "
                  "host has the memory, and XLA reads it when JAX starts) every one would "
                  "guess",)
  # Not where a host budget stops them, nor where every update guesses, nor on the CPU.
  assert not pipeline._pool_for_spares(partial, host_lib.HERE_PINNABLE,
                                       OffloadOptions(host_budget=need - 1), 1)
  assert not pipeline._pool_for_spares(dataclasses.replace(whole, platform="gpu"),
                                       host_lib.HERE_PINNABLE, OffloadOptions(), 1)
  assert not pipeline._pool_for_spares(dataclasses.replace(partial, platform="cpu"),
                                       host_lib.HERE_PINNABLE, OffloadOptions(), 1)


def test_a_step_that_always_clips_runs_the_serial_schedule():
  tx = optax.chain(optax.clip_by_global_norm(1e-6), optax.adamw(1e-2))
  _, s_state, s_losses = _train(tx, overlap=False, steps=10)
  tx = optax.chain(optax.clip_by_global_norm(1e-6), optax.adamw(1e-2))
  step, l_state, l_losses = _train(tx, overlap=True, steps=10)
  guesser = step._runner.guesser
  # The first guess missed; the recent steps all clipped since: no more guessing.
  assert (guesser.tried, guesser.missed) == (1, 1)
  assert guesser.guess() is None
  if not ON_GPU:
    assert l_losses == s_losses
    _same(s_state, l_state)


def test_old_state_given_again_is_not_overwritten():
  # The buffers a guessed step's state held become the next guessed step's spares (donated to
  # it, as the serial schedule donates the state). A caller that passes such a state again gets
  # new spares: the step reads it, and does not write its new values over it.
  tx = optax.chain(optax.clip_by_global_norm(1e9), optax.adam(1e-2))
  graphdef, params = ot._model()
  step = jaxtier.offload(ot._step(graphdef, tx), policy=ot.ON_HOST)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  first, _ = step(state, _batch(0))
  kept = jax.tree.map(np.asarray, first)
  second, m2 = step(first, _batch(1))
  again, m3 = step(first, _batch(1))
  assert (step._runner.guesser.tried, step._runner.guesser.missed) == (3, 0)
  _same(kept, first)
  if not ON_GPU:
    assert float(m2["loss"]) == float(m3["loss"])
    _same(second, again)
  # A state two steps old is donated as the spares of the step after (where the backend
  # donates, JAX says so on reading it): never written over while still readable.
  step(again, _batch(2))
  for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(first)):
    assert b.is_deleted() or np.array_equal(a, np.asarray(b))


def test_speculative_compute_reads_the_state_in_place():
  tx = _clipped(lambda: optax.adamw(1e-2))
  graphdef, params = ot._model()
  step = jaxtier.offload(ot._step(graphdef, tx), policy=ot.ON_HOST)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  step(state, _batch(0))  # builds the spares
  runner = step._runner
  spec = step._programs.speculative
  split = spec.split
  leaves = jax.tree.leaves(step.last_state)
  masters = step._masters.by_index()
  inputs = split.speculative_inputs(leaves, jax.tree.leaves(_batch(1)), runner.scratch, masters,
                                    runner._spare_buffers(spec, leaves, masters))
  hlo = spec.compute.lower(inputs).compile().as_text()
  # Neither the layer calls nor the joins get a host leaf (read or spare) through a copy or a
  # slice; one call per layer per stacked leaf, one join per spare written.
  assert hlo_lib.hlo_violations(hlo, target=hu.LAYER_TARGET) == []
  assert hlo_lib.hlo_violations(hlo, target=hu.JOIN_TARGET) == []
  assert hlo.count(f'custom_call_target="{hu.LAYER_TARGET}"') == 2 * ot.LAYERS
  assert hlo.count(f'custom_call_target="{hu.JOIN_TARGET}"') == 6


def test_a_failed_guessed_step_leaves_every_leaf_intact():
  # The speculative compute only reads the state: a failure in its backward pass, after some
  # layers' guessed updates ran, loses nothing, and the next step continues from that state.
  tx = optax.chain(optax.clip_by_global_norm(1e9), optax.adam(1e-2))
  graphdef, params = ot._model()
  calls = {"n": 0, "fail": False}

  def fail_at():  # once armed, at the third layer differentiated
    calls["n"] += 1
    return calls["fail"] and calls["n"] >= 3

  graphdef = nnx.split(ot._stacks.failing_stack(fail_at, layers=ot.LAYERS, width=ot.WIDTH))[0]
  step = jaxtier.offload(ot._step(graphdef, tx), policy=ot.ON_HOST)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  state, _ = step(state, _batch(0))  # a guessed step that held
  assert step._runner.guesser.tried == 1
  before = jax.tree.map(np.asarray, state)
  calls.update(n=0, fail=True)
  with pytest.raises(Exception) as info:
    jax.block_until_ready(step(state, _batch(1)))
  notes = "\n".join(getattr(info.value, "__notes__", []))
  assert "only reads the state" in notes and "intact" in notes, notes
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))
  _same(before, state)
  calls.update(fail=False)
  after, m = step(state, _batch(1))
  assert np.isfinite(float(m["loss"]))


@pytest.mark.usefixtures("guess_at_any_miss_rate")
def test_apply_if_finite_guesses_finite_and_skips_a_non_finite_step_exactly():
  # optax.apply_if_finite's `cond` is made selects (`analysis/conditions.py`): its updates are
  # guarded by the finite check. Steps 3 and 8 have a non-finite gradient: their guess
  # (finite) misses, the serial schedule skips them, and the state equals the serial one.
  def batch(i):
    x, y = ot._batch(i)
    return (x.at[0, 0].set(jnp.inf) if i in (3, 8) else x), y

  def train(overlap):
    tx = optax.apply_if_finite(optax.adamw(1e-2), max_consecutive_errors=3)
    graphdef, params = ot._model()
    step = jaxtier.offload(ot._step(graphdef, tx), policy=ot.ON_HOST, overlap_update=overlap)
    state = step.place({"params": params, "opt": tx.init(params)}, batch(0))
    kernels = []
    for i in range(12):
      state, _ = step(state, batch(i))
      kernels.append(np.asarray(state["params"]["blocks"]["w"]["kernel"].get_value()))
    return step, state, kernels

  _, s_state, _ = train(False)
  step, l_state, kernels = train(True)
  guarded = [s for s in step.plan.schedule if s.guarded]
  assert len(guarded) == 2 and all(s.guesses == ((1.0,), (0.0,)) for s in guarded)
  guesser = step._runner.guesser
  assert (guesser.tried, guesser.missed, guesser.unguessed) == (12, 2, 0)
  assert step.guesses == (10, 2, 0)
  # The non-finite steps were skipped: the params did not move, and the counter counted them.
  np.testing.assert_array_equal(kernels[3], kernels[2])
  np.testing.assert_array_equal(kernels[8], kernels[7])
  assert not np.array_equal(kernels[4], kernels[3])
  assert int(l_state["opt"].total_notfinite) == 2
  if not ON_GPU:
    _same(s_state, l_state)


def test_a_guessed_step_out_of_memory_runs_the_serial_schedule(caplog):
  # The spares and the undonated device leaves are memory the admitted plan did not count on:
  # a guessed compute that runs out of it leaves the state intact, the serial schedule runs
  # that step, and no step guesses again.
  tx = _clipped(lambda: optax.adam(1e-2))
  _, s_state, s_losses = _train(tx, overlap=False, steps=3)
  tx = _clipped(lambda: optax.adam(1e-2))
  graphdef, params = ot._model()
  step = jaxtier.offload(ot._step(graphdef, tx), policy=ot.ON_HOST)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  spec = step._programs.speculative

  class Exhausted:
    def __call__(self, inputs):
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 byte")

  spec.compute = Exhausted()
  losses = []
  with caplog.at_level("WARNING", logger="jaxtier"):
    for i in range(3):
      state, m = step(state, _batch(i))
      losses.append(float(m["loss"]))
  assert "ran out of memory" in caplog.text
  assert step._runner.guesser is None and step.guesses == (0, 0, 0)
  if not ON_GPU:
    assert losses == s_losses
    _same(s_state, state)


def test_guessed_calls_run_the_op_program_specialized_to_the_guess():
  # The clip's program computes `g / norm * max` and selects; specialized to `norm < max`
  # true it reads neither the norm nor the predicate and computes the same bits with fewer
  # instructions.
  step, _, _ = _train(_clipped(lambda: optax.adamw(1e-2)), overlap=True, steps=1)
  s = next(s for s in step.plan.schedule if s.guarded)
  cc = step.plan.components[s.component]
  fixed = {p: 1.0 for p in s.guards}
  special = update_schedule.specialize(cc.program, fixed)
  assert len(special.code) < len(cc.program.code)
  loads = {int(a) for op, _, a, _, _ in special.code.tolist() if op == hu.Op.LOAD}
  assert not loads & (set(s.guards) | set(s.unread))
  rng = np.random.default_rng(0)
  n = 4096
  ops = []
  for p, spec in enumerate(cc.operands):
    size = n if spec.kind != "value" or np.prod(spec.var.aval.shape) > 1 else 1
    value = rng.standard_normal(size).astype(np.float32)
    if p in s.guards:
      value = np.ones(size, np.float32)
    elif spec.kind == "host" or p in s.unread:
      value = np.abs(value) + 0.5
    ops.append(jnp.asarray(value))
  res = [jax.ShapeDtypeStruct((n,), jnp.float32) for _ in cc.results]
  run = lambda program: hu.host_update(program, ops, res, [-1] * len(res), executor="host_cpu")
  for a, b in zip(run(cc.program), run(special)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Specialized to the clip binding, the program still reads the norm.
  binds = update_schedule.specialize(cc.program, {p: 0.0 for p in s.guards})
  assert s.unread[0] in {int(a) for op, _, a, _, _ in binds.code.tolist() if op == hu.Op.LOAD}
