"""Per-layer host updates inside the backward pass (`lowering/overlap.py`).

A stack of layers under `nnx.scan` with its optimizer state on the host, or its params streamed
too: the stacked leaves are updated layer by layer in the compute program, the others after it.
Each optimizer of the optimizer table gives the serial schedule's values, both ways (bit for bit
on the CPU; fp32, and bf16 with masters or streamed);
a global-norm clip keeps the stack serial, with its reason; the compiled program reads the host
leaves in place; a step that fails after the layered updates began names what it left.
"""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import _stacks
import jaxtier
from jaxtier._src.analysis import update_schedule
from jaxtier._src.analysis.update_schedule import Mode, Refusal, Why
from jaxtier._src.analysis import inventory
from jaxtier._src.hardware import profile
from jaxtier._src.lowering import hlo as hlo_lib
from jaxtier._src.lowering import overlap
from jaxtier._src.planning import planner
from jaxtier._src.primitives import host_update as hu

LAYERS, WIDTH = 4, 16
ON_HOST = "optimizer_state_on_host"
# The stack's params streamed: their updates read the gradients where the sends land them.
STREAM = {r"\['params'\]\['blocks'\]": "host_stream"}
POLICIES = {"host": ON_HOST, "stream": STREAM}


def Stack(rngs, compute_dtype=None):  # pylint: disable=invalid-name
  return _stacks.Stack(rngs, layers=LAYERS, width=WIDTH, head=2, compute_dtype=compute_dtype)


def _model(dtype=jnp.float32, compute_dtype=None):
  graphdef, params = nnx.split(Stack(nnx.Rngs(0), compute_dtype))
  return graphdef, jax.tree.map(lambda p: p.astype(dtype), params)


def _step(graphdef, tx):
  def step(state, batch):
    x, y = batch

    def loss(p):
      return jnp.mean((nnx.merge(graphdef, p)(x).astype(jnp.float32) - y) ** 2)
    value, g = jax.value_and_grad(loss)(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": value}
  return step


def _batch(i):
  k1, k2 = jax.random.split(jax.random.PRNGKey(100 + i % 3))
  return jax.random.normal(k1, (8, WIDTH)), jax.random.normal(k2, (8, 2))


def _train(tx, overlap, dtype=jnp.float32, steps=6, policy=ON_HOST, compute_dtype=None):
  graphdef, params = _model(dtype, compute_dtype)
  step = jaxtier.offload(_step(graphdef, tx), policy=policy, overlap_update=overlap)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  losses = []
  for i in range(steps):
    state, m = step(state, _batch(i))
    losses.append(float(m["loss"]))
  return step, state, losses


OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(5e-2, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
    "rmsprop_centered_momentum": lambda: optax.rmsprop(1e-3, centered=True, momentum=0.9),
    "adabelief": lambda: optax.adabelief(1e-2),
    "adamw_warmup_cosine": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.1),
    "clip_by_global_norm_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05),
                                                     optax.adamw(1e-2)),
}


def _layered_paths(step):
  split = step._programs.split
  return sorted(step.plan.leaves[i].path for i in split.layered_host)


ON_GPU = jax.default_backend() == "gpu"


def _assert_same(s_state, l_state, s_losses, l_losses, rtol=1e-5):
  """Bit for bit on the CPU. On a GPU the unrolled backward pass is compiled apart from the
  rolled one, and its gradients differ in the last bit (reduction order): fp32 tolerance
  (`rtol`: bf16 params round such a bit to one of theirs)."""
  if not ON_GPU:
    assert l_losses == s_losses
  np.testing.assert_allclose(l_losses, s_losses, rtol=rtol)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(s_state)[0],
                          jax.tree.leaves(l_state)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if ON_GPU:
      np.testing.assert_allclose(b, a, rtol=10 * rtol,
                                 atol=rtol * float(np.max(np.abs(a)) or 1.0), err_msg=str(path))
    else:
      np.testing.assert_array_equal(b, a, err_msg=str(path))


@pytest.mark.parametrize("where", list(POLICIES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_layered_equals_serial(name, where):
  serial, s_state, s_losses = _train(OPTIMIZERS[name](), overlap=False, policy=POLICIES[where])
  layered, l_state, l_losses = _train(OPTIMIZERS[name](), overlap=True, policy=POLICIES[where])
  _assert_same(s_state, l_state, s_losses, l_losses)
  ov = layered._programs.split.overlap
  assert not serial._programs.split.overlap.updates
  # The lowered programs run what each plan records (`Plan.schedule`), which it costed.
  # (Guarded ones, a clip's, are serial there: they run layered in the speculative programs,
  # `speculation_test.py`.)
  for step in (serial, layered):
    lowered = step._programs.split.overlap
    assert lowered.components == {s.component for s in step.plan.schedule
                                  if s.mode != Mode.SERIAL and not s.guarded}
    assert lowered.serial == {
        s.component: Refusal(Why.WAITS_FOR_EVERY_GRADIENT) if s.guarded else s.reason
        for s in step.plan.schedule if s.mode == Mode.SERIAL or s.guarded}
    assert {u.scan for u in lowered.updates} == {s.loop for s in step.plan.schedule
                                                 if s.mode == Mode.LAYERED and not s.guarded}
  assert set(serial._programs.split.overlap.serial.values()) == {Refusal(Why.OVERLAP_OFF)}
  if name.startswith("clip"):
    # The clip scale needs every gradient: in the programs that run once a guess failed (or
    # with none), nothing runs before the backward pass ends.
    assert not ov.updates
    assert any(why.kind == Why.WAITS_FOR_EVERY_GRADIENT for why in ov.serial.values()), ov.serial
    assert any("global-norm clip" in str(why) for why in ov.serial.values()), ov.serial
  else:
    # The stacked block's kernel and bias are layered; the head (no layer loop) is not.
    assert len(ov.updates) == 2, ov.serial
    assert all("blocks" in p for p in _layered_paths(layered)), _layered_paths(layered)
    if where == "host":
      assert any(why.kind == Why.NO_LAYER_LOOP for why in ov.serial.values()), ov.serial
      assert any("not a layer loop" in str(why) for why in ov.serial.values()), ov.serial
    else:
      # Streamed: the params are layered host leaves too, their gradients read where they
      # land; the head's state stays on the device (no host update of it).
      assert all(u.sent for u in ov.updates)
      assert sum("['params']" in p for p in _layered_paths(layered)) == 2


@pytest.mark.parametrize("where", list(POLICIES))
def test_bf16_params_with_masters_layered_equal_serial(where):
  tx = optax.adamw(1e-2, weight_decay=0.1)
  _, s_state, s_losses = _train(tx, overlap=False, dtype=jnp.bfloat16, policy=POLICIES[where])
  layered, l_state, l_losses = _train(tx, overlap=True, dtype=jnp.bfloat16,
                                      policy=POLICIES[where])
  _assert_same(s_state, l_state, s_losses, l_losses, rtol=1e-2)
  split = layered._programs.split
  if where == "host":
    assert len(split.layered_masters) == 2  # the block's kernel and bias masters
    assert len(split.overlap.device_leaves) == 2  # their bf16 params, written on the device
    serial_masters = set(split.update_masters)
    assert serial_masters and not serial_masters & set(split.layered_masters)
  else:
    # Streamed bf16 params live in pinned_host and are updated there in place (fp32
    # arithmetic, rounded when stored, as `jax.jit` does): no masters.
    assert not split.layered_masters and not split.overlap.device_leaves
    assert sum("['params']" in layered.plan.leaves[i].path for i in split.layered_host) == 2


@pytest.mark.parametrize("where", list(POLICIES))
def test_bf16_layers_hand_their_gradients_over_in_bf16(where):
  # fp32 params in bf16 layers: each stacked gradient is a bf16 value widened. The layer calls
  # take it in bf16 (half the bytes kept alive until the join and copied down), or read the
  # bf16 buffer a streamed scan sends it into, and give the serial step's numbers.
  tx = optax.adamw(1e-2, weight_decay=0.1)
  kw = dict(policy=POLICIES[where], compute_dtype=jnp.bfloat16)
  _, s_state, s_losses = _train(tx, overlap=False, **kw)
  layered, l_state, l_losses = _train(tx, overlap=True, **kw)
  _assert_same(s_state, l_state, s_losses, l_losses)
  split = layered._programs.split
  bf16 = jnp.dtype(jnp.bfloat16)
  assert len(split.overlap.updates) == 2, split.overlap.serial  # the block's kernel and bias
  # Without remat the backward scan reads the forward's bf16 copies, not the stack: no
  # streamed scan there, so in both placements the gradients reach the calls from the device
  # (a streamed scan's bf16 buffer: `streaming_test.py`).
  for u in split.overlap.updates:
    assert not u.sent and set(u.narrow.values()) == {bf16}, u
  # The compiled calls take those operands in bf16.
  graphdef, params = _model(compute_dtype=jnp.bfloat16)
  state = layered.place({"params": params, "opt": tx.init(params)}, _batch(0))
  hlo = layered.lower(state, _batch(0)).compile().as_text()
  calls = [l for l in hlo.splitlines() if f'custom_call_target="{hu.LAYER_TARGET}"' in l]
  assert len(calls) == 2 * LAYERS
  narrow = {p for u in split.overlap.updates for p in u.narrow}
  for line in calls:
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, ", line).group(1).split(", ")
    assert all(layouts[p].startswith("bf16[") for p in narrow), layouts


def test_layered_step_matches_jax_jit():
  tx = optax.adamw(1e-2, weight_decay=0.1)
  graphdef, params = _model()
  step = _step(graphdef, tx)
  state = {"params": params, "opt": tx.init(params)}
  ref = jax.jit(step)
  losses = []
  for i in range(6):
    state, m = ref(state, _batch(i))
    losses.append(float(m["loss"]))
  _, _, got = _train(tx, overlap=True)
  np.testing.assert_allclose(got, losses, rtol=1e-5)


def test_compute_program_reads_host_leaves_in_place():
  tx = optax.adamw(1e-2)
  graphdef, params = _model()
  step = jaxtier.offload(_step(graphdef, tx), policy=ON_HOST)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  compiled = step.lower(state, _batch(0)).compile()
  hlo = compiled.as_text()
  # Neither the layer calls nor the joins get a host leaf through a copy or a slice.
  assert hlo_lib.hlo_violations(hlo, target=hu.LAYER_TARGET) == []
  assert hlo_lib.hlo_violations(hlo, target=hu.JOIN_TARGET) == []
  # One call per layer per stacked leaf (kernel, bias), each with the profile's share of the
  # GPU's blocks for its kernel part (the CPU handler ignores it).
  assert hlo.count(f'custom_call_target="{hu.LAYER_TARGET}"') == 2 * LAYERS
  grid = f"dha_grid = {profile.DEFAULT_PROFILE.dha_layer_grid:.6e} : f32"
  calls = [l for l in hlo.splitlines() if f'custom_call_target="{hu.LAYER_TARGET}"' in l]
  assert all(grid in l for l in calls), (grid, calls[0][-600:])
  # One join per written buffer: the stacked kernel's and bias's mu and nu (pinned_host), and
  # the kernel and bias themselves (device, written over their old values).
  assert hlo.count(f'custom_call_target="{hu.JOIN_TARGET}"') == 6
  # No written buffer is copied: the stacked params (device) are written over their old values.
  copies = [line for line in hlo.splitlines() if " copy(" in line
            and any(f"f32[{LAYERS},{WIDTH}" in line.split("=")[1].split("copy(")[0]
                    for _ in (0,))]
  assert not copies, copies
  # The moments come back in their own buffers: nothing in pinned_host beyond the state.
  ma = compiled.memory_analysis()
  assert ma.host_output_size_in_bytes - ma.host_alias_size_in_bytes <= 8 * 16, ma
  assert ma.host_temp_size_in_bytes == 0, ma


@pytest.mark.parametrize("lag", [None, 1, 2])
def test_a_layer_s_gradient_is_released_a_few_layers_after_its_call(monkeypatch, lag):
  # The kernel's gradient slices (f32[16,16]) die at their release, RELEASE_LAG layers after
  # their calls; only the last RELEASE_LAG layers' are kept until the joins (all of them with no
  # release). The values are the same either way.
  monkeypatch.setattr(update_schedule, "RELEASE_LAG", lag)
  tx = optax.adamw(1e-2)
  graphdef, params = _model()
  step = jaxtier.offload(_step(graphdef, tx), policy=ON_HOST)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  hlo = step.lower(state, _batch(0)).compile().as_text()
  slice_type = f"f32[{WIDTH},{WIDTH}]"

  def calls(target):
    return [l for l in hlo.splitlines() if f'custom_call_target="{target}"' in l]

  shape_of = dict(re.findall(r"^\s*(%[\w.-]+) = (\S+?)\{", hlo, re.M))

  def slices_named(line):
    operands = re.findall(r"%[\w.-]+", line.split("custom-call(")[1].split(")")[0])
    return sum(shape_of.get(o) == slice_type for o in operands)
  kept = LAYERS if lag is None else lag
  releases = calls(hu.RELEASE_TARGET)
  assert len(releases) == LAYERS - kept
  # Each release names the slice it frees, and the next layer's outputs (order-only).
  assert all(slices_named(l) == 2 for l in releases), releases
  joins = calls(hu.JOIN_TARGET)
  assert joins and all(slices_named(l) == kept for l in joins), [slices_named(l) for l in joins]
  _, got, got_losses = _train(tx, overlap=True, steps=3)
  monkeypatch.setattr(update_schedule, "RELEASE_LAG", None)
  _, want, want_losses = _train(tx, overlap=True, steps=3)
  _assert_same(want, got, want_losses, got_losses)


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_a_gpu_plan_counts_a_few_layers_of_the_layered_gradients(monkeypatch, platform):
  # The stack's moments on the host, layered over 20 layers: a GPU plan holds RELEASE_LAG + 1
  # layers of the stacked params' gradients at its peak, not 20; a CPU plan all of them (XLA:CPU
  # makes every slice of the stacked params at the start of the unrolled backward pass).
  layers = 20
  tx = optax.adamw(1e-2)
  graphdef, params = nnx.split(_stacks.Stack(nnx.Rngs(0), layers=layers, width=WIDTH, head=2))
  x = jax.ShapeDtypeStruct((8, WIDTH), jnp.float32)
  y = jax.ShapeDtypeStruct((8, 2), jnp.float32)

  def peak(lag):
    monkeypatch.setattr(update_schedule, "RELEASE_LAG", lag)
    plan = jaxtier.plan(_step(graphdef, tx), {"params": params, "opt": tx.init(params)},
                        (x, y), policy=ON_HOST, platform=platform)
    assert {s.mode for s in plan.schedule} == {Mode.LAYERED, Mode.SERIAL}, plan.schedule
    return plan.predicted_peak_hbm_bytes
  stacked = sum(a.nbytes for a in jax.tree.leaves(params["blocks"]))
  freed = peak(None) - peak(2)
  if platform == "gpu":
    assert freed == pytest.approx(stacked * (1 - 3 / layers), abs=16), (freed, stacked)
  else:
    assert freed == 0


def test_a_failed_layered_step_names_the_leaves_it_left():
  tx = optax.adam(1e-2)
  graphdef, params = _model()
  calls = {"n": 0}

  def fail_at():  # the third layer differentiated: two layers' updates have run
    calls["n"] += 1
    return calls["n"] >= 3

  graphdef = nnx.split(_stacks.failing_stack(fail_at, layers=LAYERS, width=WIDTH))[0]
  step = jaxtier.offload(_step(graphdef, tx), policy=ON_HOST)
  state = step.place({"params": params, "opt": tx.init(params)}, _batch(0))
  assert step._programs.split.overlap.updates
  with pytest.raises(Exception) as info:
    jax.block_until_ready(step(state, _batch(0)))
  notes = "\n".join(getattr(info.value, "__notes__", []))
  assert "updated layer by layer" in notes, notes
  assert "blocks" in notes and "step.restore" in notes, notes
  # The head's moments were not layered: they are intact.
  assert not state["opt"][0].mu["head"]["kernel"].get_value().is_deleted()


def test_gpu_plan_picks_the_layered_executor_of_a_streamed_stack():
  if ON_GPU:
    pytest.skip("on a GPU the plan times this GPU's scans; the case is the H200 profile's")
  # The user streams the stack's params; the planner still picks its moments' executor by the
  # overlapped step (the params' placement fixes none): a layered one, not host_dha's serial
  # choice, and the calls run on it.
  tx = optax.adamw(1e-2)
  graphdef, params = _model()
  x = jax.ShapeDtypeStruct((8, WIDTH), jnp.float32)
  y = jax.ShapeDtypeStruct((8, 2), jnp.float32)
  plan = jaxtier.plan(_step(graphdef, tx), {"params": params, "opt": tx.init(params)}, (x, y),
                      policy={r"\['params'\]\['blocks'\]": "host_stream"}, platform="gpu")
  moments = [l for l in plan.leaves if "blocks" in l.path and l.role == "optimizer_state"]
  assert moments and all(l.placement in ("host_cpu", "host_split") for l in moments), [
      (l.path, l.placement) for l in moments]
  assert all("layer by layer inside the backward pass" in l.reason for l in moments)
  assert all(l.placement == "host_stream" for l in plan.leaves
             if "blocks" in l.path and l.role == "param")
  executors = {c.executor for c in plan.components
               if any("blocks" in plan.leaves[i].path for i in c.component.seeds)}
  assert executors == {"host_cpu" if moments[0].placement == "host_cpu" else "split"}, executors


@pytest.mark.parametrize("batch, want", [(8, "host_split"), (4096, "host_cpu")])
def test_gpu_plan_picks_the_layered_executor_by_the_overlap(batch, want):
  if ON_GPU:
    pytest.skip("on a GPU the plan times this GPU's scans; the case is the H200 profile's")
  # Planned for an H200 (default profile): with little compute the update is exposed and the
  # split (kernel and CPU at once) is faster; with enough compute to hide it, host_cpu takes no
  # SMs from the compute. (Hidden, what shows is the last layer's update: over 20 layers, as in
  # the example's 1b, the split's shorter tail does not pay for its kernel's slowing.)
  tx = optax.adamw(1e-2)
  graphdef, params = nnx.split(_stacks.Stack(nnx.Rngs(0), layers=20, width=WIDTH, head=2))
  x = jax.ShapeDtypeStruct((batch, WIDTH), jnp.float32)
  y = jax.ShapeDtypeStruct((batch, 2), jnp.float32)
  plan = jaxtier.plan(_step(graphdef, tx), {"params": params, "opt": tx.init(params)}, (x, y),
                      policy=ON_HOST, platform="gpu")
  layered = [l for l in plan.leaves if "blocks" in l.path and l.role == "optimizer_state"]
  assert layered and all(l.placement == want for l in layered), [
      (l.path, l.placement) for l in layered]
  assert all("layer by layer inside the backward pass" in l.reason for l in layered)
  head = [l for l in plan.leaves if "head" in l.path and l.role == "optimizer_state"]
  assert all(l.placement == "host_dha" for l in head)
  if want == "host_split":
    # The planner weighs the kernel's share too: the update outlasts the backward pass, so the
    # kernel takes more than the profile's balance (0.50) and runs on the idle GPU after it.
    splits = [c for c in plan.components if c.executor == "split"]
    assert splits and {c.dha_fraction for c in splits} <= set(planner.LAYERED_FRACTIONS)
    assert all("the DHA kernel's share 0." in l.reason for l in layered)
    # A split the user placed keeps the profile's share, and is predicted slower.
    fixed = jaxtier.plan(_step(graphdef, tx), {"params": params, "opt": tx.init(params)},
                         (x, y), policy={r"opt.*blocks": "host_split"}, platform="gpu")
    shares = [c.dha_fraction for c in fixed.components if c.executor == "split"]
    assert shares and shares == pytest.approx(
        [profile.split_fraction(profile.DEFAULT_PROFILE)] * len(shares))
    assert plan.predicted_step_secs < fixed.predicted_step_secs


@pytest.mark.parametrize("case", ["layered", "clip", "off", "stream"])
def test_jaxtier_plan_says_and_costs_the_schedule_the_lowering_runs(case):
  # jaxtier.plan lowers nothing: its notes and its predicted phases still follow the per-layer
  # schedule `offload` would run (a streamed stack: layered too; a clip: layered on a guess;
  # overlap_update=False: serial).
  tx = (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)) if case == "clip"
        else optax.adam(1e-2))
  graphdef, params = _model()
  x = jax.ShapeDtypeStruct((8, WIDTH), jnp.float32)
  y = jax.ShapeDtypeStruct((8, 2), jnp.float32)
  policy = {r"\['params'\]\['blocks'\]": "host_stream"} if case == "stream" else ON_HOST
  plan = jaxtier.plan(_step(graphdef, tx), {"params": params, "opt": tx.init(params)}, (x, y),
                      policy=policy, overlap_update=case != "off")
  phases = [name for name, _, _ in plan.segments]
  layered = [n for n in plan.notes if "layer by layer inside the backward pass" in n]
  serial = " ".join(n for n in plan.notes if "run after the backward pass" in n)
  if case in ("layered", "stream", "clip"):
    assert layered and "layered host update (exposed)" in phases, (plan.notes, phases)
  else:
    assert not layered and "layered host update (exposed)" not in phases, (plan.notes, phases)
    assert "overlap_update is off" in serial, plan.notes
  guessed = [n for n in plan.notes if "run on a guess" in n]
  assert bool(guessed) == (case == "clip"), plan.notes


def test_a_lowering_that_cannot_build_the_plan_s_schedule_raises(monkeypatch):
  # The plan records two layered updates: a lowering under other options, of a state on a
  # mesh, or of a plan that records no schedule refuses to build another one.
  tx = optax.adam(1e-2)
  graphdef, params = _model()
  step = _step(graphdef, tx)
  state = {"params": params, "opt": tx.init(params)}
  inv = inventory.take_inventory(step, state, (_batch(0),))
  plan = planner.make_plan(inv, platform="cpu", policy=ON_HOST)
  jaxpr = inv.closed_jaxpr.jaxpr
  assert sum(s.mode == Mode.LAYERED for s in plan.schedule) == 2
  _, ov, _ = overlap.schedules(jaxpr, plan)
  assert len(ov.updates) == 2 and ov.components == {
      s.component for s in plan.schedule if s.mode == Mode.LAYERED}
  with pytest.raises(overlap.ScheduleError, match="overlap_update is off"):
    overlap.schedules(jaxpr, plan, None, enabled=False)
  with monkeypatch.context() as m:
    m.setenv("JAXTIER_DISABLE_FFI", "1")
    with pytest.raises(overlap.ScheduleError, match="JAXTIER_DISABLE_FFI"):
      overlap.schedules(jaxpr, plan)

  class OnMesh:  # pylint: disable=too-few-public-methods
    mesh = types.SimpleNamespace(size=2)
  with pytest.raises(overlap.ScheduleError, match="sharded over a mesh of 2 devices"):
    overlap.schedules(jaxpr, plan, [OnMesh()] * len(plan.leaves))
  with pytest.raises(overlap.ScheduleError, match="records the schedule of 0 host updates"):
    overlap.schedules(jaxpr, dataclasses.replace(plan, schedule=()))
  # A plan made with overlap_update=False records every update serial: lowered so.
  off = planner.make_plan(inv, platform="cpu", policy=ON_HOST, overlap_update=False)
  _, ov, _ = overlap.schedules(jaxpr, off, None, enabled=False)
  assert not ov.updates and set(ov.serial.values()) == {Refusal(Why.OVERLAP_OFF)}
