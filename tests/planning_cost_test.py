"""What planning a step costs: the backend compiles it takes under each policy (the step's
calls compile nothing more), the device-only step compiled only for its memory figures, the
phases timed and the slowest named when planning is long, and the analysis that walks only
the equations a leaf reaches."""

import logging

from conftest import backend_compiles
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from planning._toy import STEP, mlp_state, toy_batch

import jaxtier
from jaxtier._src import jax_compat as jc
from jaxtier._src import pipeline
from jaxtier._src.analysis import inventory as inv_lib
from jaxtier._src.analysis import jaxpr_graph
from jaxtier._src.analysis import step_costs
from jaxtier._src.planning.plan import PlanningCost


def _compiled_options(monkeypatch):
  """The `compiler_options` of each `Lowered.compile` call, in order."""
  seen = []
  compile_ = jax.stages.Lowered.compile

  def spy(self, compiler_options=None, **kwargs):
    seen.append(dict(compiler_options or {}))
    return compile_(self, compiler_options=compiler_options, **kwargs)
  monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
  return seen


def _run(step, state, batch, calls=2):
  """Places `state` and runs `calls` steps; returns the backend compiles of each part."""
  counter = backend_compiles()
  with counter.counting():
    placed = step.place(state, batch)
  planning = list(counter.names)
  counter.names = []
  with counter.counting():
    for _ in range(calls):
      placed, metrics = step(placed, batch)
    jax.block_until_ready(metrics)
  return planning, list(counter.names)


def test_optimizer_state_on_host_compiles_its_two_programs_once():
  # No device-only step (a fixed policy needs no solver), the compute and host-update programs
  # compiled once while planning, and the calls reuse them.
  step = jaxtier.offload(STEP, policy="optimizer_state_on_host")
  planning, calls = _run(step, mlp_state(), toy_batch())
  assert planning == ["jit(compute)", "jit(update)"], planning
  assert calls == [], calls
  cost = step.plan.planning
  assert cost.compiles == 2 and 0 < cost.compile_secs <= cost.secs
  names = [name for name, _ in cost.phases]
  assert names[:2] == ["trace", "step costs"] and "verify" in names, names
  assert sum(secs for _, secs in cost.phases) <= cost.secs


def test_auto_compiles_the_device_only_step_for_its_memory_figures_only(monkeypatch):
  # Under a budget below the all-device step's compiled peak, auto puts the optimizer state on
  # the host: the device-only step is compiled once with the figures-only options (never run
  # on the CPU's default profile), then the plan's two programs, and the calls compile nothing.
  state, batch = mlp_state(), toy_batch()
  peaks = {}
  for policy in ("none", "optimizer_state_on_host"):
    probe = jaxtier.offload(STEP, policy=policy)
    probe.place(jax.tree.map(jnp.copy, state), batch)
    peaks[policy] = probe.plan.compiler_peak_hbm_bytes
  assert peaks["none"] > peaks["optimizer_state_on_host"], peaks
  budget = (peaks["none"] + peaks["optimizer_state_on_host"]) // 2
  step_costs._COMPILED_FIGURES.clear()  # pylint: disable=protected-access
  options = _compiled_options(monkeypatch)
  step = jaxtier.offload(STEP, policy="auto", device_budget=budget)
  planning, calls = _run(step, jax.tree.map(jnp.copy, state), batch)
  assert planning == ["jit(jaxpr_as_fun)", "jit(compute)", "jit(update)"], planning
  assert calls == [], calls
  # (On a GPU none: it compiles as it runs. An option the installed XLA does not know is left
  # out: jax_compat.compile_with_options.)
  figures = step_costs.figures_compile_options(jax.default_backend())
  assert options[-3] == figures and figures.items() <= step_costs.FIGURES_COMPILE_OPTIONS.get(
      jax.default_backend(), {}).items(), options
  if jax.default_backend() == "cpu":
    assert figures.get("xla_backend_optimization_level") == 0, figures
  assert all(o == {} for o in options[-2:]), options
  assert step.plan.pinned_bytes > 0 and step.plan.compiler_peak_hbm_bytes <= budget
  assert step.plan.planning.compiles == 3


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="a GPU always has a device limit: what JAX's allocator holds")
def test_auto_without_a_device_limit_compiles_the_step_once(monkeypatch):
  # On the CPU backend with no budget, auto keeps every leaf on the device whatever the
  # device-only step's figures say: the device-only step is not compiled (its program is the
  # plan's), only the plan's compute program, and the calls reuse it.
  monkeypatch.setenv("JAXTIER_TIME_SCANS", "1")  # even where the CPU's step would be timed
  step_costs._COMPILED_FIGURES.clear()  # pylint: disable=protected-access
  step = jaxtier.offload(STEP, policy="auto")
  planning, calls = _run(step, mlp_state(), toy_batch())
  assert planning == ["jit(compute)"], planning
  assert calls == [], calls
  assert step.plan.pinned_bytes == 0 and step.plan.compiler_peak_hbm_bytes > 0
  assert any(n.startswith("transient device bytes") and "device-only step not compiled" in n
             for n in step.plan.notes), step.plan.notes
  # With a budget, the same step compiles the device-only step for its figures first.
  step_costs._COMPILED_FIGURES.clear()  # pylint: disable=protected-access
  budgeted = jaxtier.offload(STEP, policy="auto", device_budget=1 << 30)
  planning, _ = _run(budgeted, mlp_state(), toy_batch(), calls=1)
  assert planning[0] == "jit(jaxpr_as_fun)" and "jit(compute)" in planning, planning


def test_a_later_process_reads_the_device_only_steps_figures_from_disk(monkeypatch):
  # The same step planned again with the process's own caches emptied, as a new process plans
  # it: the device-only step's figures are read from the figures cache, not compiled, and the
  # plan is the same.
  state, batch = mlp_state(), toy_batch()
  probe = jaxtier.offload(STEP, policy="none")
  probe.place(jax.tree.map(jnp.copy, state), batch)
  budget = probe.plan.compiler_peak_hbm_bytes * 9 // 10
  plans = []
  for _ in range(2):
    step_costs._COMPILED_FIGURES.clear()  # pylint: disable=protected-access
    options = _compiled_options(monkeypatch)
    step = jaxtier.offload(STEP, policy="auto", device_budget=budget)
    placed, _ = step(step.place(jax.tree.map(jnp.copy, state), batch), batch)
    plans.append((step.plan, options))
  (first, first_options), (second, second_options) = plans
  figures = step_costs.figures_compile_options(jax.default_backend())
  assert first_options[0] == figures, first_options
  if figures:  # (a GPU compiles the device-only step as it runs: the notes below tell it)
    assert first_options.count(figures) == 1 and figures not in second_options
  transient = lambda plan: [n for n in plan.notes if n.startswith("transient device bytes")]
  assert "figures cache" not in transient(first)[0]
  assert transient(second)[0] == transient(first)[0] + (
      "; read from the figures cache "
      f"({step_costs.figures_cache.directory()}), not compiled again")
  where = lambda plan: [(l.path, l.memory_kind, l.placement) for l in plan.leaves]
  assert where(second) == where(first) and second.pinned_bytes > 0
  assert second.compiler_peak_hbm_bytes == first.compiler_peak_hbm_bytes <= budget


def test_figures_only_compile_gives_the_full_compiles_memory_figures():
  # What the solver reads of the device-only step: the same arguments, outputs and aliases, and
  # temporaries within 1 KiB of the compile that runs.
  state, batch = mlp_state(), toy_batch()
  lowered = jax.jit(STEP, donate_argnums=0).lower(state, batch)
  full = step_costs.memory_figures(lowered.compile())
  figures = step_costs.memory_figures(jc.compile_with_options(
      lowered, step_costs.figures_compile_options(jax.default_backend())))
  assert (figures.argument_bytes, figures.output_bytes, figures.alias_bytes) == (
      full.argument_bytes, full.output_bytes, full.alias_bytes)
  assert abs(figures.temp_bytes - full.temp_bytes) <= 1024, (figures, full)
  assert step_costs.figures_compile_options("gpu") == {}


def test_an_option_the_installed_xla_does_not_know_is_dropped_once(monkeypatch):
  # An XLA flag renamed between jaxlib releases: the compile goes on without it, and later
  # compiles leave it out from the start.
  monkeypatch.setattr(jc, "_UNKNOWN_COMPILE_OPTIONS", set())
  options = _compiled_options(monkeypatch)
  lowered = jax.jit(lambda x: x * 2.0).lower(jnp.ones(3))
  asked = {"xla_jaxtier_no_such_option": True, "xla_backend_optimization_level": 0}
  compiled = jc.compile_with_options(lowered, asked)
  np.testing.assert_array_equal(compiled(jnp.ones(3)), np.full(3, 2.0))
  assert options == [asked, {"xla_backend_optimization_level": 0}], options
  assert jc.known_compile_options(asked) == {"xla_backend_optimization_level": 0}
  jc.compile_with_options(lowered, asked)
  assert options[-1] == {"xla_backend_optimization_level": 0}, options
  with pytest.raises(Exception, match="xla_backend_optimization_level"):
    jc.compile_with_options(lowered, {"xla_backend_optimization_level": "not a level"})


def test_a_long_planning_is_said_in_one_line_naming_its_slowest_phase(monkeypatch, caplog):
  monkeypatch.setattr(pipeline, "LONG_PLANNING_SECS", 0.0)
  with caplog.at_level(logging.INFO, logger="jaxtier"):
    step = jaxtier.offload(STEP, policy="optimizer_state_on_host")
    step.place(mlp_state(), toy_batch())
  lines = [r for r in caplog.records if "planning the step took" in r.getMessage()]
  assert len(lines) == 1 and lines[0].levelno == logging.WARNING
  cost = step.plan.planning
  slowest = cost.slowest()
  assert slowest == max(cost.phases, key=lambda p: p[1])[0]
  assert lines[0].getMessage() == (f"jaxtier: planning the step took {cost.describe()}; most "
                                   f"of it {slowest}: {pipeline.PHASE_WHAT[slowest]}")


def test_a_short_planning_is_said_at_info(caplog):
  with caplog.at_level(logging.INFO, logger="jaxtier"):
    step = jaxtier.offload(STEP, policy="optimizer_state_on_host")
    step.place(mlp_state(), toy_batch())
  lines = [r for r in caplog.records if "planning the step took" in r.getMessage()]
  assert len(lines) == 1 and lines[0].levelno == logging.INFO


def test_planning_cost_describes_its_phases():
  cost = PlanningCost(secs=12.5, phases=(("trace", 0.7), ("step costs", 0.001),
                                         ("verify", 11.2)), compiles=3, compile_secs=10.9)
  assert cost.slowest() == "verify"
  assert cost.describe() == ("12.50 s (trace 0.70 s, verify 11.20 s); 3 backend compiles "
                             "(10.90 s)")
  assert cost.record() == {"secs": 12.5, "phases": {"trace": 0.7, "step costs": 0.001,
                                                    "verify": 11.2},
                           "compiles": 3, "compile_secs": 10.9}
  assert PlanningCost(secs=0.0, phases=(), compiles=0, compile_secs=0.0).slowest() == ""


def _taint_every_equation(jaxpr, seeds, skip=()):
  """`taint_forward` as a walk over every equation in order (the reference)."""
  tainted = {jaxpr.invars[i] for i in seeds}
  eqns = set()
  for k, eqn in enumerate(jaxpr.eqns):
    if k in skip:
      continue
    if any(isinstance(v, jc.Var) and v in tainted for v in eqn.invars):
      eqns.add(k)
      tainted.update(v for v in eqn.outvars if not isinstance(v, jc.DropVar))
  return eqns, tainted


@pytest.mark.parametrize("skip_every", [0, 3])
def test_taint_forward_walks_to_what_a_walk_of_every_equation_finds(skip_every):
  inv = inv_lib.take_inventory(STEP, mlp_state(), (toy_batch(),))
  jaxpr = inv.closed_jaxpr.jaxpr
  skip = frozenset(range(0, len(jaxpr.eqns), skip_every)) if skip_every else frozenset()
  for i in range(len(jaxpr.invars)):
    got = jaxpr_graph.taint_forward(jaxpr, [i], skip=skip)
    assert got == _taint_every_equation(jaxpr, [i], skip), i
  # Several seeds at once, as the host updates' components are found.
  seeds = [l.index for l in inv.leaves]
  assert jaxpr_graph.taint_forward(jaxpr, seeds) == _taint_every_equation(jaxpr, seeds)
  assert np.all([len(jaxpr_graph.taint_forward(jaxpr, [i])[0]) > 0
                 for i in range(len(inv.leaves))])


def test_taint_masks_walks_every_leaf_at_once_to_what_taint_forward_finds():
  inv = inv_lib.take_inventory(STEP, mlp_state(), (toy_batch(),))
  jaxpr = inv.closed_jaxpr.jaxpr
  skip = frozenset(range(0, len(jaxpr.eqns), 4))
  seeds = [l.index for l in inv.leaves]
  eqn_masks, var_masks = jaxpr_graph.taint_masks(jaxpr, seeds, skip=skip)
  for bit, i in enumerate(seeds):
    eqns, tainted = jaxpr_graph.taint_forward(jaxpr, [i], skip=skip)
    assert {k for k, m in enumerate(eqn_masks) if m >> bit & 1} == eqns, i
    assert {v for v, m in var_masks.items() if m >> bit & 1} == tainted, i
