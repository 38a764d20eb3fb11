"""Embedding tables read in place (host_dha): analysis, plan, lowering and training on the CPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier
from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import conditions
from jaxtier._src.analysis import lookups
from jaxtier._src.lowering import hlo as hlo_lib
from jaxtier._src.primitives import dha
from jaxtier._src.primitives import host_update as hu

V, D, B, T = 96, 16, 4, 6
TABLE = r"\['emb'\]"


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"emb": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
          "w": jnp.asarray(rng.normal(size=(D, D)) * 0.3, jnp.float32),
          "head": jnp.asarray(rng.normal(size=(D, V)) * 0.3, jnp.float32)}


def _loss(p, ids, targets):
  x = jnp.take(p["emb"], ids, axis=0)
  h = jnp.tanh(x @ p["w"])
  logits = h @ p["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _step_fn(tx, loss=_loss):
  def step(state, ids, targets):
    p, o = state["params"], state["opt"]
    value, g = jax.value_and_grad(loss)(p, ids, targets)
    u, o = tx.update(g, o, p)
    return {"params": optax.apply_updates(p, u), "opt": o}, value
  return step


def _batch(seed):
  rng = np.random.default_rng(100 + seed)
  # Repeated ids: their gradient rows add up in the scatter.
  ids = rng.integers(0, V // 3, size=(B, T)).astype(np.int32)
  return jnp.asarray(ids), jnp.asarray(np.roll(ids, -1, axis=1))


def _state(tx):
  p = _params()
  return {"params": p, "opt": tx.init(p)}


def _jaxpr(tx, loss=_loss):
  """The step's top-level jaxpr as `inventory.take_inventory` leaves it for the planner."""
  ids, targets = _batch(0)
  closed = jax.make_jaxpr(_step_fn(tx, loss))(_state(tx), ids, targets)
  return conditions.select_conds(jc.inline_calls(closed),
                                 num_state=len(jax.tree.leaves(_state(tx)))).jaxpr


def _index(tx, path):
  flat = jax.tree_util.tree_flatten_with_path(_state(tx))[0]
  return [jax.tree_util.keystr(p) for p, _ in flat].index(path)


EMB = "['params']['emb']"


def test_the_table_is_found_with_its_gather_and_scatter():
  jaxpr = _jaxpr(optax.adamw(1e-2))
  got = lookups.table_lookup(jaxpr, _index(optax.adamw(1e-2), EMB))
  assert isinstance(got, lookups.TableLookup)
  assert jaxpr.eqns[got.gather].primitive.name == "gather"
  assert jaxpr.eqns[got.scatter].primitive.name == "scatter-add"
  assert got.num_ids == B * T and got.row_nbytes == D * 4
  assert got.rows_nbytes == B * T * D * 4


def test_a_matmul_weight_is_not_a_table():
  jaxpr = _jaxpr(optax.adamw(1e-2))
  why = lookups.table_lookup(jaxpr, _index(optax.adamw(1e-2), "['params']['head']"))
  assert isinstance(why, lookups.NotATable) and "dot_general" in why.why


def test_a_clipped_gradient_is_not_served_in_place():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  why = lookups.table_lookup(_jaxpr(tx), _index(tx, EMB))
  assert isinstance(why, lookups.NotATable) and "global-norm clip" in why.why


def test_a_conditional_or_factored_update_is_refused_naming_why():
  # apply_if_finite's `cond` is made selects before planning (`analysis/conditions.py`); what
  # keeps the table off the host is its non-finite check, a reduction of the table's gradient
  # on the device.
  tx = optax.apply_if_finite(optax.adamw(1e-2), max_consecutive_errors=3)
  why = lookups.table_lookup(_jaxpr(tx), _index(tx, EMB))
  assert isinstance(why, lookups.NotATable) and "non-finite check" in why.why, why
  assert "`reduce_and`" in why.why, why
  tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
  why = lookups.table_lookup(_jaxpr(tx), _index(tx, EMB))
  assert isinstance(why, lookups.NotATable) and "Adafactor" in why.why, why


def test_a_tied_table_is_not_served_in_place():
  def tied(p, ids, targets):
    x = jnp.take(p["emb"], ids, axis=0)
    logits = jnp.tanh(x @ p["w"]) @ p["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  why = lookups.table_lookup(_jaxpr(optax.adamw(1e-2), tied), _index(optax.adamw(1e-2), EMB))
  assert isinstance(why, lookups.NotATable)
  assert "dot_general" in why.why or "transpose" in why.why


def test_a_clamped_gather_is_refused_naming_the_mode():
  def clamped(p, ids, targets):
    x = jnp.take(p["emb"], ids, axis=0, mode="clip")
    return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(x @ p["w"]) @ p["head"],
                                                           targets).mean()
  tx = optax.adamw(1e-2)
  why = lookups.table_lookup(_jaxpr(tx, clamped), _index(tx, EMB))
  assert isinstance(why, lookups.NotATable)
  assert "mode CLIP" in why.why and "default mode" in why.why, why


def test_placing_a_weight_host_dha_is_refused_with_the_reason():
  tx = optax.adamw(1e-2)
  off = jaxtier.offload(_step_fn(tx), policy={r"\['params'\]\['w'\]": "host_dha"})
  with pytest.raises(jaxtier.PlanError,
                     match=r"leaf \['params'\]\['w'\] \(float32\[16, 16\]\) cannot be placed "
                           r"'host_dha': the step reads it with `dot_general`") as err:
    off.place(_state(tx), *_batch(0))
  assert err.value.plan is None and err.value.reason == ""


def _train(step, state, steps):
  losses = []
  for s in range(steps):
    state, loss = step(state, *_batch(s))
    losses.append(float(loss))
  return state, np.array(losses)


@pytest.mark.parametrize("tx", [optax.adamw(1e-2, weight_decay=0.1), optax.sgd(0.3, momentum=0.9)],
                         ids=["adamw", "sgd_momentum"])
def test_a_table_read_in_place_trains_equal_to_the_device_one_50_steps(tx):
  ref_state, ref_losses = _train(jax.jit(_step_fn(tx)), _state(tx), 50)
  off = jaxtier.offload(_step_fn(tx), policy={TABLE: "host_dha"})
  state = off.place(_state(tx), *_batch(0))
  leaves = {l.path: l for l in off.plan.leaves}
  table = leaves[EMB]
  assert table.placement == "host_dha" and table.memory_kind == "pinned_host"
  assert all(l.memory_kind == "pinned_host" for p, l in leaves.items() if "['emb']" in p)
  assert leaves["['params']['w']"].placement == "device"
  # Its update runs row by row inside the compute program, not after it; the note names it.
  assert any(f"the update of {EMB} (host_dha" in n and "runs row by row" in n
             for n in off.plan.notes), off.plan.notes
  got_state, losses = _train(off, state, 50)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  # The table (so its gradients, summed over repeated ids) and its moments match.
  for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(got_state)[0],
                               jax.tree_util.tree_leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
  assert got_state["params"]["emb"].sharding.memory_kind == "pinned_host"


def _device_buffers(hlo_text, shape):
  """Entry instructions of `shape` (e.g. 'f32[96,16]') outside the host memory space S(5)."""
  host = hlo_lib.host_parameters(hlo_text)  # the entry layout's S(5) parameters
  out = []
  for name, rhs in hlo_lib.entry_instructions(hlo_text):
    m = re.match(rf"{re.escape(shape)}(\{{[^}}]*\}})?\s", rhs)
    param = re.search(r" parameter\((\d+)\)", rhs)
    if param and int(param.group(1)) in host:
      continue
    if any(f'custom_call_target="{t}"' in rhs for t in (dha.SCATTER_ADD_TARGET, hu.JOIN_TARGET)):
      continue  # its result is its host operand, aliased (XLA:CPU does not annotate it S(5))
    if m and "S(5)" not in (m.group(1) or ""):
      out.append(f"{name} = {rhs[:160]}")
  return out


@pytest.mark.parametrize("tx", [optax.adamw(1e-2, weight_decay=0.1),
                                optax.chain(optax.scale_by_lion(), optax.scale(-1e-2))],
                         ids=["adamw", "lion"])
def test_the_row_by_row_update_gives_the_serial_update_s_bits(tx):
  # The same step with the table's update after the compute program (overlap_update=False):
  # the untouched rows' update (zero gradient) and the touched rows' give its very bits.
  runs = {}
  for overlap in (False, True):
    off = jaxtier.offload(_step_fn(tx), policy={TABLE: "host_dha"}, overlap_update=overlap)
    state = off.place(_state(tx), *_batch(0))
    assert any("runs row by row" in n for n in off.plan.notes) == overlap, off.plan.notes
    # The lowered program updates by rows what the plan records so (`Plan.schedule`).
    tables = off._programs.split.overlap.tables
    rows = [s for s in off.plan.schedule if s.mode == "rows"]
    assert len(rows) == int(overlap), off.plan.schedule
    assert [(u.component, u.rows.table, u.rows.gather, u.rows.scatter) for u in tables] == [
        (s.component, s.table, s.loop, s.scatter) for s in rows]
    if overlap:
      assert off.plan.leaves[rows[0].table].path == EMB
    runs[overlap] = _train(off, state, 12)
  (serial, serial_losses), (rows, rows_losses) = runs[False], runs[True]
  np.testing.assert_array_equal(rows_losses, serial_losses)
  for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(rows)[0],
                               jax.tree_util.tree_leaves(serial)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=jax.tree_util.keystr(path))


def test_the_compute_program_gathers_and_scatters_with_no_table_on_the_device():
  tx = optax.adamw(1e-2)
  off = jaxtier.offload(_step_fn(tx), policy={TABLE: "host_dha"})
  state = off.place(_state(tx), *_batch(0))
  hlo = off.lower(state, *_batch(0)).compile().as_text()
  assert hlo_lib.hlo_violations(hlo, target=dha.GATHER_TARGET) == []
  assert hlo_lib.hlo_violations(hlo, target=dha.SCATTER_ADD_TARGET) == []
  # No table-sized buffer in device memory: not the table, not a dense gradient, not zeros.
  assert _device_buffers(hlo, f"f32[{V},{D}]") == []
  # Nor a scatter into one (the loss's own scatter, of the labels, is another shape).
  assert not [l for l in hlo.splitlines() if " scatter(" in l and f"f32[{V},{D}]" in l]


def test_plan_offers_the_table_to_the_solver_with_its_rows_bytes():
  from jaxtier._src import pipeline  # pylint: disable=g-import-not-at-top
  from jaxtier._src.analysis import inventory  # pylint: disable=g-import-not-at-top
  tx = optax.adamw(1e-2)
  inv = inventory.take_inventory(_step_fn(tx), _state(tx), _batch(0))
  assert pipeline.dha_readable_tables(inv) == {_index(tx, EMB): B * T * D * 4}


def test_the_plan_predicts_the_table_s_row_update_mostly_hidden():
  # A step that computes long enough to hide the untouched rows: only the named rows' share
  # (B * T of V at most) of the table's update is exposed; the serial schedule exposes it all.
  tx = optax.adamw(1e-2)
  segments = {}
  for overlap in (True, False):
    # Planned for the CPU, whose one executor (host_cpu) runs both schedules.
    plan = jaxtier.plan(_step_fn(tx), _state(tx), *_batch(0), policy={TABLE: "host_dha"},
                        overlap_update=overlap, platform="cpu")
    segments[overlap] = {name: secs for name, secs, _ in plan.segments}
  rows = segments[True]["table rows update (exposed)"]
  serial = segments[False]["host update"]
  assert "host update" not in segments[True]
  hidden = serial * (1 - B * T / V)
  want = serial * B * T / V + max(0.0, hidden - segments[True]["forward+backward"])
  assert rows == pytest.approx(want, rel=1e-6) and rows < serial


def test_a_failed_step_names_the_table_its_untouched_rows_may_have_left_updated():
  tx = optax.adamw(1e-2)
  calls = {"n": 0}

  def fail(x):
    calls["n"] += 1
    if calls["n"] >= 2:  # the second step's backward pass, after its untouched rows' update
      raise RuntimeError("injected failure in the backward pass")
    return x

  @jax.custom_vjp
  def probe(h):
    return h

  def probe_bwd(_, g):
    return (jax.pure_callback(fail, jax.ShapeDtypeStruct(g.shape, g.dtype), g),)
  probe.defvjp(lambda h: (h, None), probe_bwd)

  def loss(p, ids, targets):
    x = probe(jnp.take(p["emb"], ids, axis=0))
    logits = jnp.tanh(x @ p["w"]) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  off = jaxtier.offload(_step_fn(tx, loss), policy={TABLE: "host_dha"})
  state = off.place(_state(tx), *_batch(0))
  state, _ = off(state, *_batch(0))
  with pytest.raises(Exception) as info:
    jax.block_until_ready(off(state, *_batch(1)))
  notes = "\n".join(getattr(info.value, "__notes__", []))
  assert EMB in notes and "a table's rows" in notes and "step.restore" in notes, notes
  # A new state trains as the device step does: the failed step's buffers are not reused.
  calls["n"] = -10**6
  ref_state, ref_losses = _train(jax.jit(_step_fn(tx, loss)), _state(tx), 3)
  got_state, losses = _train(off, off.place(_state(tx), *_batch(0)), 3)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
