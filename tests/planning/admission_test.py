"""Refusals before anything is allocated: a state over the device budget names its largest
leaves and the rule-based plan it fell back to, and says when the host limit binds first."""

import jax
import jax.numpy as jnp
from planning._toy import HOST_EXEC, STEP, mlp_state, toy_batch
import pytest

import jaxtier
from jaxtier._src.hardware import profile
from jaxtier._src.planning import admission


def test_infeasible_budget_names_the_largest_leaves():
  with pytest.raises(jaxtier.PlanError) as err:
    # The serial schedule: on a GPU the layered updates' executor is the planner's own choice
    # (tests/lowering/overlap_test.py), and this is the rule-based plan's.
    jaxtier.plan(STEP, mlp_state(), toy_batch(), device_budget=10_000, overlap_update=False)
  msg = str(err.value)
  assert "over the device budget of 9.77 KiB (10000 bytes)" in msg
  assert "['params']['w1'] 256.00 KiB" in msg
  refused = err.value.plan
  # The refused plan is the rule-based one: optimizer state on the host, said in its notes.
  assert {l.placement for l in refused.leaves if l.role == "optimizer_state"} == {HOST_EXEC}
  assert not refused.fits and refused.verdicts and "DOES NOT FIT" in str(refused)
  # The state alone is over the budget asked for (a PlanError: no allocator's limit missed);
  # the plan's verdict records the peak over it.
  assert refused.device_budget == jaxtier.DeviceBudget(given=10_000, usable=10_000,
                                                       source="given")
  assert refused.device_bytes > 10_000 and err.value.reason.startswith(
      f"the state needs {jaxtier.format_bytes(refused.device_bytes)} "
      f"({refused.device_bytes} bytes) of device memory")
  [missed] = refused.violations
  assert (missed.limit, missed.limit_bytes) == ("device_budget", 10_000)
  assert missed.need_bytes == refused.predicted_peak_hbm_bytes > 10_000 and not missed.binding


@pytest.mark.slow
def test_refusal_names_the_host_limit_when_it_binds_and_budget_above_the_gpu_is_noted():
  # The 8b decoder against a 10 GiB device budget for an absent H200 (pinnable: the default
  # profile's 64 GiB): offloading everything movable would pin 87 GiB, so the refusal says the
  # host limit binds, not only "raise device_budget"; a budget above the GPU's memory is noted.
  from jaxtier.examples import train  # pylint: disable=g-import-not-at-top
  _, state, step = train.make_train_state("8b", 1e-3, abstract=True)
  batch = jax.ShapeDtypeStruct((1, 128), jnp.int32)
  with pytest.raises(jaxtier.PlanError, match=r"over the device budget of 10\.00 GiB.*But the "
                     r"host limit binds first: moving every leaf it may move to the host would "
                     r"pin [0-9.]+ GiB, over the host limit of 64\.00 GiB") as err:
    jaxtier.plan(step, state, batch, device_budget="10GiB", platform="gpu")
  refused = err.value.plan
  binding = refused.binding_violation()
  assert (binding.limit, binding.limit_bytes) == ("host_limit", 64 * 2**30)
  assert binding.need_bytes > 80 * 2**30, binding
  assert refused.device_budget.given == 10 * 2**30 and refused.device_bytes > 10 * 2**30
  assert "device_budget" in {v.limit for v in refused.violations} and not refused.fits
  plan = jaxtier.plan(step, state, batch, device_budget="200GiB", platform="gpu")
  # (For an absent H200, the default profile's allocator: 105.30 GiB; here, this GPU's.)
  limit = "105.30 GiB: the profile's" if jax.default_backend() != "gpu" else ""
  assert any(f"device budget 200.00 GiB is above what JAX's allocator may use ({limit}" in n
             for n in plan.notes), plan.notes


def test_an_absent_gpus_allocator_follows_the_fraction_set(monkeypatch):
  # Planning for an H200 that is not here: the profile's HBM is what the allocator holds at
  # XLA's default fraction (0.75); XLA_PYTHON_CLIENT_MEM_FRACTION scales it, as on that GPU.
  if jax.default_backend() == "gpu":
    pytest.skip("here the GPU's own allocator limit is the figure")
  d = profile.DEFAULT_PROFILE
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  assert admission.allocator_bytes(d)[0] == d.hbm_bytes
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  limit, where = admission.allocator_bytes(d)
  assert limit == int(d.hbm_bytes * 0.9 / 0.75)
  assert where == "the profile's HBM (NVIDIA H200) at XLA_PYTHON_CLIENT_MEM_FRACTION=0.9"
  budget, why = admission.default_device_budget(d)
  assert budget == int(limit * 0.95) and why.endswith("less 5%")


def test_admission_counts_the_compiled_steps_pinned_bytes_beyond_the_state(monkeypatch):
  # A compiled step that allocates pinned_host memory beyond the state (outputs not aliased to
  # an input, host temporaries: what XLA's host figures report on a GPU; the CPU backend
  # reports none, so the figures are made here) is refused before anything is allocated when
  # state and extra together are over the host limit, naming both; within it, it is placed.
  import dataclasses  # pylint: disable=g-import-not-at-top

  from jaxtier._src.planning import verify as verify_lib  # pylint: disable=g-import-not-at-top
  real = verify_lib.memory_figures
  extra_out, extra_temp = 3 << 20, 1 << 20
  monkeypatch.setattr(verify_lib, "memory_figures", lambda c: dataclasses.replace(
      real(c), host_output_bytes=extra_out + 4096, host_alias_bytes=4096,
      host_temp_bytes=extra_temp))
  pinned = jaxtier.plan(STEP, mlp_state(), toy_batch(),
                        policy="optimizer_state_on_host").pinned_bytes
  need = pinned + extra_out + extra_temp
  state = mlp_state()
  step = jaxtier.offload(STEP, policy="optimizer_state_on_host", host_budget=need - 1)
  with pytest.raises(jaxtier.AdmissionError) as err:
    step.place(state, toy_batch())
  msg = str(err.value)
  assert f"it needs {jaxtier.format_bytes(need)} ({need} bytes) of pinned host memory" in msg
  assert (f"(the state's {jaxtier.format_bytes(pinned)} and 4.00 MiB that the compiled step "
          "allocates beyond it") in msg
  assert f"over the host budget of {jaxtier.format_bytes(need - 1)}" in msg
  assert err.value.plan.compiler_host_extra_bytes == extra_out + extra_temp
  assert all(not x.is_deleted() for x in jax.tree.leaves(state))  # nothing consumed
  step = jaxtier.offload(STEP, policy="optimizer_state_on_host", host_budget=need)
  placed = step.place(state, toy_batch())
  assert step.plan.compiler_host_extra_bytes == extra_out + extra_temp
  assert {x.sharding.memory_kind for x in jax.tree.leaves(placed)} == {"device", "pinned_host"}


@pytest.mark.slow
def test_a_gpu_refusal_by_xlas_pinned_pool_names_the_value_that_fits(monkeypatch):
  # 13b for an absent H200: 94.55 GiB pinned over XLA's default 64 GiB pool. The fix names the
  # setting and the value that would hold the plan.
  if jax.default_backend() == "gpu":
    pytest.skip("planned for an absent H200; on a GPU machine the pool and host are this one's")
  from jaxtier.examples import train  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
  _, state, step = train.make_train_state("13b", 1e-3, abstract=True)
  batch = jax.ShapeDtypeStruct((1, 128), jnp.int32)
  with pytest.raises(jaxtier.AdmissionError) as err:
    jaxtier.plan(step, state, batch, platform="gpu")
  need = err.value.plan.pinned_bytes
  assert f"it needs {jaxtier.format_bytes(need)}" in str(err.value)
  assert (f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 by default): raise it (to "
          f"{-(-need // 2**30)} or more, set before JAX starts)") in str(err.value)


def test_a_refusal_by_the_pinned_pool_of_this_hosts_gpu_carries_the_setting_that_fits(
    monkeypatch):
  # As admission sees it on a GPU machine (the pinnable limit measured on this host, HERE),
  # with 120 GiB available: the refusal names the pool size that fits and carries it as a
  # setting for the CLI to apply before JAX starts. Planned for an absent GPU, it does not.
  if jax.default_backend() == "gpu":
    pytest.skip("planned for an absent H200; on a GPU machine the pool and host are this one's")
  from jaxtier._src.hardware import host  # pylint: disable=g-import-not-at-top
  from jaxtier._src.planning import admission  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import train  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
  _, state, step = train.make_train_state("13b", 1e-3, abstract=True)
  batch = jax.ShapeDtypeStruct((1, 128), jnp.int32)
  with pytest.raises(jaxtier.AdmissionError) as err:
    jaxtier.plan(step, state, batch, platform="gpu")
  assert dict(err.value.settings) == {}  # an absent GPU: its host is not this one
  plan = err.value.plan
  monkeypatch.setattr(host, "available_bytes", lambda: 120 * 2**30)
  with pytest.raises(jaxtier.AdmissionError) as err:
    admission.admit(plan, 64 * 2**30, host.HERE_PINNABLE)
  assert dict(err.value.settings) == {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "108"}
  assert ("XLA's pinned pool is the limit and this host has the memory: set "
          "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=108 before JAX starts") in str(err.value)


def test_a_peak_over_what_jaxs_allocator_holds_is_refused_with_the_fraction_that_fits(
    monkeypatch):
  # On a GPU the compiled step's peak meets JAX's allocator (memory_stats' bytes_limit, the
  # fraction XLA_PYTHON_CLIENT_MEM_FRACTION of the memory free at start-up), less 5% for
  # fragmentation. Over it, the plan is refused before allocating, naming the fraction under
  # which it fits where the GPU has the memory; without that room the fix is more offload.
  import dataclasses  # pylint: disable=g-import-not-at-top

  from jaxtier._src.hardware import host  # pylint: disable=g-import-not-at-top
  from jaxtier._src.planning import admission  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  limit = int(0.75 * 135.3 * 2**30)
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: limit)
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch())
  admission.admit_device(dataclasses.replace(plan, compiler_peak_hbm_bytes=90 * 2**30), limit)
  admission.admit_device(plan, None)  # no GPU here: nothing to check
  over = dataclasses.replace(plan, compiler_peak_hbm_bytes=115 * 2**30)
  with pytest.raises(jaxtier.AdmissionError) as err:
    admission.admit_device(over, limit)
  msg = str(err.value)
  assert ("the compiled step's peak is 115.00 GiB (123480309760 bytes) of device memory, over "
          "what JAX's allocator holds on this GPU (101.47 GiB, XLA_PYTHON_CLIENT_MEM_FRACTION="
          "0.75) less 5% for fragmentation (96.40 GiB)") in msg
  assert "set XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 before JAX starts" in msg
  assert dict(err.value.settings) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}
  assert err.value.plan is over
  with pytest.raises(jaxtier.AdmissionError) as err:
    admission.admit_device(dataclasses.replace(plan, compiler_peak_hbm_bytes=130 * 2**30), limit)
  assert dict(err.value.settings) == {}
  assert "Fix: keep more state in pinned_host" in str(err.value)


def test_a_plan_over_the_ram_of_the_cpu_backend_is_refused_before_allocating(monkeypatch):
  # On the CPU backend device and pinned_host memory are this host's RAM: a plan needing more
  # than is available was a warning, then a raw RESOURCE_EXHAUSTED in the first step.
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's check")
  import optax  # pylint: disable=g-import-not-at-top
  from jaxtier._src.hardware import host  # pylint: disable=g-import-not-at-top
  tx = optax.adam(1e-3)

  def init(key):
    params = {"w": jax.random.normal(key, (512, 512))}
    return {"params": params, "opt": tx.init(params)}

  def step(state, x):
    g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(state["params"])
    u, o = tx.update(g, state["opt"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}
  x = jnp.ones((8, 512))
  # 3 MiB: room for the 2 MiB of moments pinned, not for them and the 2 MiB device peak too.
  monkeypatch.setattr(host, "available_bytes", lambda: 3 << 20)
  off = jaxtier.offload(step, policy="optimizer_state_on_host")
  with pytest.raises(jaxtier.AdmissionError) as err:
    off.init(init, jax.random.key(0), example_args=(x,))
  msg = str(err.value)
  assert ("plan refused before allocating anything: on the CPU backend device and pinned_host "
          "memory are this host's RAM") in msg
  assert "over the 3.00 MiB available" in msg and "Fix: a smaller batch" in msg
  monkeypatch.setattr(host, "available_bytes", lambda: 1 << 40)
  state = jaxtier.offload(step, policy="optimizer_state_on_host").init(
      init, jax.random.key(0), example_args=(x,))
  assert state["opt"][0].mu["w"].sharding.memory_kind == "pinned_host"


def test_a_plan_over_the_device_budget_given_is_refused_by_its_prediction_where_not_compiled():
  # `jaxtier.offload` admits the plan it keeps against the device budget given (unless
  # allow_over_budget): by its verdict, with the predicted peak where no compiled one is known.
  fmt = jaxtier.format_bytes
  full = jaxtier.plan(STEP, mlp_state(), toy_batch(), policy="none")
  admission.admit_device_budget(full)  # no budget given: nothing to refuse
  budget = full.device_bytes  # the state fits; its step's peak does not
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch(), policy="none", device_budget=budget)
  peak = plan.predicted_peak_hbm_bytes
  assert not plan.fits and plan.compiler_peak_hbm_bytes is None and peak > budget
  with pytest.raises(jaxtier.AdmissionError) as err:
    admission.admit_device_budget(plan)
  e = err.value
  assert (e.limit, e.need_bytes, e.limit_bytes, e.plan) == ("device_budget", peak, budget, plan)
  assert e.reason == (f"the predicted peak device memory is {fmt(peak)} ({peak} bytes), "
                      f"{fmt(peak - budget)} over the device budget of {fmt(budget)} "
                      f"({budget} bytes)")
  assert "Largest device leaves: " in str(e) and "['params']['w1'] 256.00 KiB" in str(e)
  admission.admit_device_budget(jaxtier.plan(STEP, mlp_state(), toy_batch(), policy="none",
                                             device_budget=peak))


def test_admitting_the_device_reads_the_allocators_limit_it_is_given_not_again(monkeypatch):
  # The caller passes the allocator's limit (read once per plan); naming the fraction that
  # holds the peak uses that figure, not another `allocator_limit_bytes()` call.
  import dataclasses  # pylint: disable=g-import-not-at-top

  from jaxtier._src.hardware import host  # pylint: disable=g-import-not-at-top
  from jaxtier._src.planning import admission  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch())  # on a GPU, planning reads it itself
  calls = []
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: calls.append(1))
  with pytest.raises(jaxtier.AdmissionError) as err:
    admission.admit_device(dataclasses.replace(plan, compiler_peak_hbm_bytes=115 * 2**30),
                           int(0.75 * 135.3 * 2**30))
  assert "set XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 before JAX starts" in str(err.value)
  assert err.value.limit == "device_memory" and not calls


def test_admit_refuses_a_jitted_step_over_the_allocator_naming_the_fraction(monkeypatch):
  # A jax.jit step that jaxtier did not plan (train --offload=none): its compiled peak against
  # JAX's allocator less 5%, as a plan's. Limits are set around the peak the compiler reports.
  from jaxtier._src.hardware import host  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  shapes = jax.eval_shape(mlp_state)
  lowered = jax.jit(STEP, donate_argnums=0).lower(shapes, toy_batch())
  # The compiler's figures as verification reads them (argument + output - alias + temp, or
  # XLA's own peak where larger: tests/analysis cover that rule).
  from jaxtier._src.analysis import step_costs  # pylint: disable=g-import-not-at-top
  peak = step_costs.memory_figures(lowered).peak_bytes
  m = lowered.compile().memory_analysis()
  assert peak >= m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes > 0
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: None)
  jaxtier.admit(lowered)  # no GPU here: nothing to check
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: 2 * peak)
  jaxtier.admit(lowered)
  # At the peak itself, 5% short: XLA's default 0.75 of a GPU whose free memory is 4/3 of the
  # peak; 0.79 of it holds the peak with the margin, and the fraction named adds 0.02.
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: peak)
  with pytest.raises(jaxtier.AdmissionError) as err:
    jaxtier.admit(lowered)
  msg = str(err.value)
  assert msg.startswith("jaxtier: step refused before allocating anything: the compiled "
                        f"step's peak is ")
  assert f"({peak} bytes) of device memory" in msg
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.75) less 5% for fragmentation" in msg
  assert dict(err.value.settings) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.81"}
  assert err.value.limit == "device_memory" and err.value.plan is None
  # Half the peak: no fraction of this GPU holds it, so the fix is to offload.
  monkeypatch.setattr(host, "allocator_limit_bytes", lambda: peak // 2)
  with pytest.raises(jaxtier.AdmissionError) as err:
    jaxtier.admit(lowered.compile())
  assert dict(err.value.settings) == {}
  assert "Fix: place state in pinned_host (jaxtier.offload)" in str(err.value)


def test_admit_refuses_what_is_not_a_lowered_or_compiled_program():
  # On any backend: a jitted function not yet lowered returned None, as if it fit.
  step = jax.jit(STEP)
  for program in (step, 42, None):
    with pytest.raises(TypeError, match=r"jaxtier.admit: expected jax.jit\(f\).lower\(\*args\) "
                       r"or its .compile\(\), got "):
      jaxtier.admit(program)
