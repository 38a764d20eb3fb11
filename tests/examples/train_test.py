"""The example trainer (jaxtier/examples/train.py): the train step, `run` (loss falls,
deterministic, offloaded and streamed equal to device training), budgets and bad arguments,
refused before anything is allocated (CPU, < 1 minute)."""

import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys

from examples._micro import MICRO
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtier
from jaxtier._src.hardware import host as host_lib
from jaxtier.examples import train


@pytest.mark.slow
def test_train_step_keeps_state_structure():
  _, state, train_step = train.make_train_state(MICRO, 1e-3, seed=0)
  batch = jax.ShapeDtypeStruct((2, 9), jnp.int32)
  new_state, metrics = jax.eval_shape(train_step, state, batch)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  for new, old in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
    assert (new.shape, new.dtype) == (old.shape, old.dtype)
  assert metrics["loss"].shape == () and metrics["loss"].dtype == jnp.float32


def _run(corpus, **kwargs):
  kwargs = dict(config_name="tiny", config=MICRO, steps=20, batch_size=8,
                seq_len=32, data=corpus, seed=0, learning_rate=1e-2,
                log_every=10, progress=False) | kwargs
  return train.run(**kwargs)


@pytest.fixture(scope="module")
def device_run(corpus):
  """`_run`'s defaults on the device (jax.jit): 20 steps. The streamed run's reference too (its
  losses do not depend on log_every: test_run_is_deterministic)."""
  return _run(corpus)


def test_run_loss_falls(device_run):
  result = device_run
  losses = result["losses"]
  assert len(losses) == 20 and len(result["step_times"]) == 20
  assert all(math.isfinite(x) for x in losses)
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
  assert result["tokens_per_sec"] > 0


@pytest.mark.slow
def test_run_is_deterministic(corpus):
  a = _run(corpus, steps=5, clip=True, log_every=2)
  b = _run(corpus, steps=5, clip=True, log_every=5)
  if jax.default_backend() == "cpu":
    assert a["losses"] == b["losses"]
  else:  # XLA's GPU scatter-add (the embedding's gradient) adds in no fixed order
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-6)
  c = _run(corpus, steps=5, clip=True, seed=1)
  assert c["losses"] != a["losses"]


@pytest.mark.slow
def test_decoder_offloaded_equals_device_50_steps(corpus):
  # Same seed, 50 steps, fp32: the loss traces are equal within 1e-5 relative.
  ref = _run(corpus, steps=50, offload="none", log_every=50)
  got = _run(corpus, steps=50, offload="optimizer_state_on_host", log_every=50)
  np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
  assert np.mean(ref["losses"][-5:]) < np.mean(ref["losses"][:5]) - 0.5
  # Every AdamW moment lives in pinned_host and is updated there; params stay on device.
  executor = "host_dha" if jax.default_backend() == "gpu" else "host_cpu"
  assert executor in got["plan"] and "optimizer_state" in got["plan"]


@pytest.mark.slow
def test_decoder_streamed_params_equal_device(corpus, device_run):
  # The layer stack's params placed host_stream (fetched layer by layer in the forward and the
  # backward scans, gradients sent to pinned_host): the loss trace equals the device run's
  # (the same 20 steps, offload="none").
  ref = device_run
  got = _run(corpus, steps=20, offload="stream", log_every=20, clip=False)
  np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
  assert "host_stream" in got["plan"] and "['layers']" in got["plan"]


@pytest.mark.slow
def test_run_auto_on_the_cpu_offloads_part_of_the_state_and_trains_as_jit(
    corpus, device_run, capsys, monkeypatch):
  # No device budget given: on the CPU backend the example sets one under the step's need,
  # so that the planner places part of the state in pinned_host; the losses are jit's.
  if jax.default_backend() != "cpu":
    pytest.skip("the example's own device budget is the CPU backend's")
  monkeypatch.setenv("COLUMNS", "200")  # each line unwrapped
  got = _run(corpus, steps=20, offload="auto", log_every=20)
  out = capsys.readouterr().out
  assert got["plan_bytes"]["pinned_host"] > 0 and got["plan_bytes"]["device"] > 0
  assert got["memory"]["pinned_host live (measured)"] > 0
  np.testing.assert_allclose(got["losses"], device_run["losses"], rtol=1e-5)
  said = [l for l in out.splitlines() if l.startswith("offload: ")]
  assert len(said) == 1 and re.fullmatch(
      r"offload: (param and )?optimizer_state [0-9.]+ \w+ in pinned_host, to fit a "
      r"[0-9.]+ \w+ device budget \(CPU default\)", said[0]), out
  budget = re.search(r"to fit a ([0-9.]+ \w+) device budget", said[0]).group(1)
  assert f"; budget {budget}" in out  # the summary's peak line: the same budget


@pytest.mark.slow
def test_run_plan_details_prints_every_leaf(corpus, capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "80")
  _run(corpus, steps=1, offload="optimizer_state_on_host", plan_details=True)
  out = capsys.readouterr().out
  rows = [l for l in out.splitlines() if re.match(r"\[[01]\]\S* ", l)]
  assert len(rows) == 39  # the tiny state's leaves, one line each
  placements = [l.split()[-1] for l in rows]
  # Every AdamW moment on the host: on a GPU updated by the DHA kernel, whole (host_dha) or
  # with the CPUs taking a share (host_split, the layers' stacks); on the CPU by host_cpu.
  executors = {"host_dha", "host_split"} if jax.default_backend() == "gpu" else {"host_cpu"}
  assert sum(p in executors for p in placements) == 24 and placements.count("device") == 15
  assert any(l.startswith("    optimizer state") for l in out.splitlines()), out
  assert max(len(l) for l in out.splitlines() if l in rows) <= 80


def test_run_offload_auto_passes_budgets(corpus):
  import jaxtier
  with pytest.raises(jaxtier.AdmissionError, match=r"over the host budget of 1000 B") as err:
    _run(corpus, steps=1, offload="optimizer_state_on_host", host_budget="1000")
  assert err.value.limit == "host_limit" and err.value.plan.host_budget == 1000
  assert err.value.plan.pinned_bytes > 1000 and not err.value.settings


@pytest.mark.slow
def test_run_over_budget_raises_before_training_unless_allowed(corpus, capsys):
  with pytest.raises(train.OverBudgetError, match=r"the plan does not fit: peak device memory "
                     r".* over the --device_budget of 1.00 MiB\. Fix: a larger --device_budget"
                     ) as err:
    _run(corpus, steps=1, offload="optimizer_state_on_host", device_budget="1MiB",
         allow_over_budget=False)
  # jaxtier.offload refused the plan before the state existed; the trainer said it its way.
  import jaxtier  # pylint: disable=g-import-not-at-top
  refused = err.value.__cause__
  assert isinstance(refused, jaxtier.AdmissionError) and refused.limit == "device_budget"
  assert refused.limit_bytes == 2**20 < refused.need_bytes and not refused.plan.fits
  out = capsys.readouterr().out
  assert "jaxtier plan" in out and "done: loss" not in out  # planned, printed, no step ran
  assert not any(line.startswith("step ") for line in out.splitlines())
  # Without a budget given nothing is checked; with allow_over_budget (run's default) it trains.
  assert len(_run(corpus, steps=1, offload="optimizer_state_on_host",
                  allow_over_budget=False)["losses"]) == 1
  assert len(_run(corpus, steps=1, offload="optimizer_state_on_host",
                  device_budget="1MiB")["losses"]) == 1


@pytest.mark.slow
def test_run_offload_none_checks_its_jitted_steps_peak_against_the_device_budget(corpus,
                                                                                capsys):
  # As a plan over the budget given: refused before the state exists unless
  # allow_over_budget, which trains after a warning.
  with pytest.raises(train.OverBudgetError) as err:
    _run(corpus, steps=1, offload="none", device_budget="1MiB", allow_over_budget=False)
  assert re.fullmatch(
      r"the step does not fit: peak device memory [\d.]+ MiB compiled \(jax\.jit, all [\d.]+ "
      r"KiB of state on the device\), over the --device_budget of 1\.00 MiB\. Fix: "
      r"--offload=auto \(jaxtier places in pinned_host what the budget leaves no room for\), "
      r"or a larger --device_budget \(at least \d+MiB\), or --remat_policy=nothing_saveable "
      r"\(fewer activations kept for the backward pass\); or --allow_over_budget to train "
      r"anyway", str(err.value)), str(err.value)
  assert not any(l.startswith("step ") for l in capsys.readouterr().out.splitlines())
  assert len(_run(corpus, steps=1, offload="none", device_budget="1MiB")["losses"]) == 1
  assert "warning: the step does not fit: peak device memory " in capsys.readouterr().out
  # Within the budget (and under a host budget, which none's state never pins): no word.
  _run(corpus, steps=1, offload="none", device_budget="1GiB", host_budget="1MiB",
       allow_over_budget=False)
  assert "warning" not in capsys.readouterr().out


@pytest.mark.slow
def test_run_offload_none_says_where_its_state_is_built_or_restored(corpus, tmp_path, capsys):
  where = str(tmp_path / "run")
  _run(corpus, steps=2, offload="none", checkpoint_dir=where, checkpoint_every=1)
  said = " ".join(capsys.readouterr().out.split())
  assert "of state on the device, as --offload=none asks (jax.jit)" in said, said
  shutil.rmtree(f"{where}/step_00000002")
  os.remove(f"{where}/step_00000002.json")
  _run(corpus, steps=2, offload="none", checkpoint_dir=where, checkpoint_every=1)
  said = " ".join(capsys.readouterr().out.split())
  # Restored on the device: what jits the step (python -m jaxtier run) may move it.
  assert re.search(r"offload: --offload=none \(jax\.jit\); \S+ \S+ of state restored on the "
                   r"device", said), said
  assert "as --offload=none asks" not in said, said


def test_run_rejects_bad_arguments(corpus):
  with pytest.raises(ValueError, match="offload"):
    _run(corpus, offload="sometimes")
  with pytest.raises(ValueError, match="config"):
    train.run(config_name="nope", data=corpus, progress=False)


def test_a_bad_flag_to_the_trainer_run_as_a_script_is_said_in_one_line(tmp_path):
  # As `python -m jaxtier train` says it (exit status 2, the flag and where the flags are
  # listed), not absl's 'FATAL Flags parsing error' and exit status 1.
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
  for flag, says in (("--bogus_flag", "Unknown command line flag 'bogus_flag'"),
                     ("--seed=-1", "flag --seed=-1: -1 is not a non-negative integer")):
    out = subprocess.run([sys.executable, "-m", "jaxtier.examples.train", flag],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (
        2, "", f"python -m jaxtier.examples.train: {says}; python -m jaxtier.examples.train "
               "--help lists its flags\n")


@pytest.mark.slow
def test_bf16_params_get_masters_under_remat_and_scan():
  # nnx.scan with a remat policy hands the stacked params back out of the scan; the optimizer
  # update reads that pass-through, which must still count as reading the param (fp32 master).
  import dataclasses

  import jaxtier
  cfg = dataclasses.replace(MICRO, param_dtype=jnp.bfloat16,
                            remat_policy="dots_with_no_batch_dims_saveable")
  _, state, step = train.make_train_state(cfg, 1e-3, abstract=True)
  plan = jaxtier.plan(step, state, jax.ShapeDtypeStruct((2, 9), jnp.int32),
                      policy="optimizer_state_on_host")
  params = [l for l in plan.leaves if l.path.startswith("[0]")]
  assert params and all(l.master_nbytes == l.nbytes * 2 for l in params), [
      (l.path, l.master_nbytes) for l in params if l.master_nbytes != l.nbytes * 2]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU backend's host memory")
def test_run_refuses_a_state_larger_than_host_memory_before_allocating(corpus, monkeypatch):
  # On the CPU backend the state is built in host memory: a config whose state exceeds what
  # the host has available is refused with the sizes before anything is allocated, not left to
  # end in an allocator abort. `small` needs ~0.2 GiB; the host is made to have 64 MiB.

  monkeypatch.setattr(host_lib, "available_bytes", lambda: 64 << 20)
  built = []
  monkeypatch.setattr(train, "make_train_state",
                      lambda *a, **k: built.append(k.get("abstract")) or
                      _real_make_train_state(*a, **k))
  with pytest.raises(ValueError, match=r"the small state .* needs [0-9.]+ GiB of host memory "
                     r"to build here, and this host has 0\.06 GiB available; use a smaller"):
    train.run(config_name="small", steps=1, data=corpus, progress=False)
  assert built == [True]  # only the abstract (eval_shape) state was made


_real_make_train_state = train.make_train_state


def test_over_budget_names_the_compiled_peak_and_the_remat_fix():
  # The prediction of a streamed step is above its compiled peak: the budget to ask for is the
  # compiled one (the step that runs), and saving fewer activations is named as a fix.
  from jaxtier.examples import budgets  # pylint: disable=g-import-not-at-top
  plan = type("Plan", (), dict(
      device_budget=jaxtier.DeviceBudget(given=75 * 2**20), host_budget=None, fits=True,
      predicted_peak_hbm_bytes=int(109.22 * 2**20), compiler_peak_hbm_bytes=int(90.36 * 2**20),
      pinned_bytes=0, verdicts=()))()
  why = budgets.over_budget(plan, "stream")
  assert "peak device memory 109.22 MiB predicted and 90.36 MiB compiled" in why, why
  # (A size the flag takes, rounded up.)
  assert "a larger --device_budget (at least 91MiB)" in why, why
  assert "--remat_policy=nothing_saveable" in why, why
  # Not where the model already saves nothing (a fresh-user trial was told to pass the flag it
  # had passed).
  why = budgets.over_budget(plan, "stream", remat_policy="nothing_saveable")
  assert "a larger --device_budget" in why and "--remat_policy" not in why, why
  plan.device_budget = jaxtier.DeviceBudget(given=100 * 2**20)  # the compiled step fits
  assert budgets.over_budget(plan, "stream") is None


def test_the_summary_line_names_the_policy_auto_escalated_to():
  # Auto's own plan compiled over the device limit and the plan with the optimizer state on
  # the host was kept: train's one line says so, with the figures; a re-planned auto plan is
  # still auto.
  from jaxtier._src.planning.plan import Attempt, Escalation  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import budgets  # pylint: disable=g-import-not-at-top
  escalation = Escalation(limit_bytes=int(71.46 * 2**30), tried=(
      Attempt(name="auto", compiler_peak_hbm_bytes=int(72.06 * 2**30)),
      Attempt(name="optimizer_state_on_host", compiler_peak_hbm_bytes=int(52.72 * 2**30))),
      kept="optimizer_state_on_host", fits=True)
  leaf = type("Leaf", (), dict(memory_kind="pinned_host", role="optimizer_state"))()
  plan = type("Plan", (), dict(leaves=(leaf,), pinned_bytes=58 * 2**30, device_bytes=29 * 2**30,
                               escalation=escalation))()
  line = budgets.placement_line(plan, "as it fits there")
  assert line == ("offload: optimizer_state 58.00 GiB in pinned_host, as it fits there; "
                  "planned as optimizer_state_on_host: auto's own plan compiles to 72.06 GiB, "
                  "over the 71.46 GiB limit"), line
  assert "\n" not in line
  plan.escalation = dataclasses.replace(escalation, kept="auto re-planned")
  assert budgets.placement_line(plan, "as it fits there") == (
      "offload: optimizer_state 58.00 GiB in pinned_host, as it fits there")
  plan.escalation = None
  assert budgets.placement_line(plan, "as it fits there") == (
      "offload: optimizer_state 58.00 GiB in pinned_host, as it fits there")


def test_run_warns_of_a_corpus_smaller_than_one_steps_batch(corpus, caplog):
  # 200 tokens against 8 x 33 per step: trained all the same, with a warning naming the sizes.
  with caplog.at_level("WARNING"):
    result = _run(corpus[:200], steps=1)
  assert len(result["losses"]) == 1
  said = [r.getMessage() for r in caplog.records if "the corpus is" in r.getMessage()]
  assert said == ["run: the corpus is 200 tokens, fewer than one step's batch of 264 tokens "
                  "(8 x 33): 1 step reads it 1.3 times over; use more --data, or fewer "
                  "--steps, a smaller --batch_size or --seq_len"], said
  caplog.clear()
  with caplog.at_level("WARNING"):
    _run(corpus, steps=1)
  assert not [r for r in caplog.records if "the corpus is" in r.getMessage()]


@pytest.mark.slow
def test_run_says_a_plan_does_not_fit_once_in_the_plan_it_prints(corpus, caplog, capsys,
                                                                 monkeypatch):
  # The plan printed says DOES NOT FIT in its notes; jaxtier's log does not say it again.
  steps = []
  real = train._offload_step
  monkeypatch.setattr(train, "_offload_step", lambda *a, **k: steps.append(real(*a, **k))
                      or steps[-1])
  with caplog.at_level("WARNING"):
    _run(corpus, steps=1, offload="auto", device_budget="300KiB")
  out = capsys.readouterr().out
  assert "\nDOES NOT FIT: " in out and out.count("DOES NOT FIT") == 1
  assert not [r for r in caplog.records if "DOES NOT FIT" in r.getMessage()]
  [step] = steps
  assert not step.plan.fits and step.plan.device_budget.given == 300 * 2**10
  missed = {v.limit: v for v in step.plan.violations}
  assert missed["device_budget"].limit_bytes == 300 * 2**10, missed
  assert missed["device_budget"].need_bytes > 300 * 2**10, missed
  assert f"DOES NOT FIT: {step.plan.verdicts[0]}"[:60] in " ".join(out.split())


@pytest.mark.slow
def test_run_offload_none_over_the_allocator_is_refused_before_the_state_exists(
    corpus, monkeypatch):
  # --offload=none is a plain jax.jit step: over JAX's allocator it was a raw
  # RESOURCE_EXHAUSTED in the first step (8b, batch 4, XLA's default fraction on the H200).
  # Now its compiled peak is admitted first and the initialiser never runs.
  import jaxtier  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(host_lib, "allocator_limit_bytes", lambda: 1 << 20)
  inits = []
  real = train.state_initializer

  def counted(*args, **kwargs):
    init = real(*args, **kwargs)
    return lambda: inits.append(1) or init()
  monkeypatch.setattr(train, "state_initializer", counted)
  with pytest.raises(jaxtier.AdmissionError, match=r"step refused before allocating anything: "
                     r"the compiled step's peak is .* over what JAX's allocator holds on this "
                     r"GPU \(1\.00 MiB") as err:
    _run(corpus, steps=1, offload="none")
  assert err.value.limit == "device_memory" and not inits
  monkeypatch.setattr(host_lib, "allocator_limit_bytes", lambda: 1 << 40)
  assert len(_run(corpus, steps=1, offload="none")["losses"]) == 1 and inits


@pytest.mark.slow
def test_run_warns_when_the_warmup_is_not_under_the_steps(corpus, capsys):
  # A fresh-user trial ran --warmup_steps=100 --steps=10 and was told nothing: the schedule
  # never reached the learning rate asked for.
  _run(corpus, steps=2, warmup_steps=2)
  assert ("warning: warmup_steps=2 is not under steps=2: the learning rate never reaches its "
          "peak of 0.01") in capsys.readouterr().out
  _run(corpus, steps=2, warmup_steps=1)
  assert "warmup_steps" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_ctrl_c_that_stops_a_checkpoint_midway_is_said_and_a_resume_skips_it(
    corpus, tmp_path, capsys, monkeypatch):
  # A second Ctrl-C while the checkpoint of step 6 is being written (its state directory made,
  # its .json not yet): the run names that checkpoint as incomplete and step 3's as the newest
  # complete one; the same run again resumes from step 3 and says it skips step 6's.
  where = str(tmp_path / "run")
  save = train.checkpoints_lib.save

  def stopped_at_6(directory, step, *args, **kwargs):
    if step == 6:
      os.makedirs(train.checkpoints_lib.path_of(directory, step))
      raise KeyboardInterrupt  # as the deferred handler raises on a second Ctrl-C
    return save(directory, step, *args, **kwargs)
  monkeypatch.setattr(train.checkpoints_lib, "save", stopped_at_6)
  with pytest.raises(train.Interrupted) as stopped:
    _run(corpus, steps=9, checkpoint_dir=where, checkpoint_every=3, log_every=3)
  three, six = f"{where}/step_00000003", f"{where}/step_00000006"
  assert (stopped.value.step, stopped.value.checkpoint, stopped.value.unfinished) == (
      6, three, six)
  monkeypatch.undo()
  capsys.readouterr()
  again = _run(corpus, steps=9, checkpoint_dir=where, checkpoint_every=3, log_every=3)
  out = capsys.readouterr().out
  assert f"resuming from {three} (step 3 of 9)" in out
  assert f"skipping 1 incomplete checkpoint (a save stopped midway): {six}" in out, out
  assert again["resumed_from"] == 3 and again["checkpoint"] == f"{where}/step_00000009"
  assert os.path.isfile(six + ".json")  # written whole this time
  # What the command line says of it (and its exit status, 130).
  monkeypatch.setattr(train.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
  with pytest.raises(SystemExit, match="130"):
    train.exit_interrupted(stopped.value)
  said = capsys.readouterr().err
  assert (f"interrupted at step 6 (Ctrl-C twice): the second stopped the checkpoint {six} "
          "being written; it is incomplete, and a resumed run skips it. The newest complete "
          f"checkpoint is {three}; the same command resumes from it") in said, said


@pytest.mark.parametrize("when", ["before the write", "inside the writer"])
def test_a_second_ctrl_c_around_a_save_says_what_it_stopped(corpus, tmp_path, capsys,
                                                           monkeypatch, when):
  # Two real SIGINTs at the save of step 6: the first asks the run to stop (saved), the second
  # raises. Before the write starts, nothing of step 6 exists; inside the writer (orbax's
  # threads fail on their way out, as a RuntimeError) its state directory is left incomplete.
  # Either way the run ends as Interrupted, and says so: never a traceback, nor "nothing was
  # saved (--checkpoint_dir keeps the run)" to a run that passed it.
  import signal  # pylint: disable=g-import-not-at-top
  where = str(tmp_path / "run")
  save = train.checkpoints_lib.save

  def twice_at_6(directory, step, *args, **kwargs):
    if step != 6:
      return save(directory, step, *args, **kwargs)
    if when == "inside the writer":
      os.makedirs(train.checkpoints_lib.path_of(directory, step))
    try:
      signal.raise_signal(signal.SIGINT)
      signal.raise_signal(signal.SIGINT)
    finally:
      if when == "inside the writer":
        raise RuntimeError("cannot join thread before it is started")
    return None
  monkeypatch.setattr(train.checkpoints_lib, "save", twice_at_6)
  with pytest.raises(train.Interrupted) as stopped:
    _run(corpus, steps=9, checkpoint_dir=where, checkpoint_every=3, log_every=3)
  three, six = f"{where}/step_00000003", f"{where}/step_00000006"
  assert (stopped.value.step, stopped.value.checkpoint, stopped.value.twice) == (6, three, True)
  assert stopped.value.unfinished == (six if when == "inside the writer" else None)
  monkeypatch.setattr(train.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
  capsys.readouterr()
  with pytest.raises(SystemExit, match="130"):
    train.exit_interrupted(stopped.value)
  said = " ".join(capsys.readouterr().err.split())
  if when == "inside the writer":
    assert f"the second stopped the checkpoint {six} being written" in said, said
  else:
    assert ("interrupted at step 6 (Ctrl-C twice): the second stopped the run before its "
            f"checkpoint was written. The newest complete checkpoint is {three}; the same "
            "command resumes from it") in said, said


def test_a_resume_with_more_steps_warns_that_the_schedule_is_stretched(corpus, tmp_path,
                                                                       capsys):
  where = str(tmp_path / "run")
  _run(corpus, steps=3, checkpoint_dir=where, log_every=3)
  capsys.readouterr()
  _run(corpus, steps=5, checkpoint_dir=where, log_every=5)
  said = " ".join(capsys.readouterr().out.split())
  assert ("warning: the checkpoint's run had --steps=3; the learning-rate schedule (its warmup "
          "and cosine decay span --steps) is now 5 steps long, so from step 4 on the learning "
          "rates are those of a 5-step run, and the run matches neither a 3-step nor a 5-step "
          "run from the start") in said, said


def test_run_resumes_from_its_newest_checkpoint_with_an_uninterrupted_runs_losses(
    corpus, tmp_path, capsys):
  # Checkpoints at steps 3 and 6; with the last one gone (as if the run had stopped after step
  # 3), the same run resumes from step 3: the state, the step and the batch order.
  where = str(tmp_path / "run")
  whole = _run(corpus, steps=6, checkpoint_dir=where, checkpoint_every=3, log_every=3)
  assert whole["checkpoint"] == f"{where}/step_00000006" and whole["resumed_from"] == 0
  assert sorted(os.listdir(where)) == ["step_00000003", "step_00000003.json", "step_00000006",
                                       "step_00000006.json"]
  shutil.rmtree(f"{where}/step_00000006")  # no .json, no state: not a checkpoint
  os.remove(f"{where}/step_00000006.json")
  capsys.readouterr()
  resumed = _run(corpus, steps=6, checkpoint_dir=where, checkpoint_every=3, log_every=3,
                 keep_checkpoints=1)
  out = capsys.readouterr().out
  assert f"resuming from {where}/step_00000003 (step 3 of 6)" in out
  assert "warning: the checkpoint's run had --steps" not in out  # the same --steps
  assert resumed["resumed_from"] == 3 and resumed["losses"] == whole["losses"]
  assert sorted(os.listdir(where)) == ["step_00000006", "step_00000006.json"]  # the newest 1
  # The run is done: nothing left to train. Another run's settings are refused, named.
  with pytest.raises(ValueError, match=r"is at step 6, this run's last \(--steps=6\): nothing "
                     r"is left to train"):
    _run(corpus, steps=6, checkpoint_dir=where)
  with pytest.raises(ValueError, match=r"is of another run: --batch_size=4 \(the checkpoint's "
                     r"run: 8\), --seed=1 \(the checkpoint's run: 0\); resume it with"):
    _run(corpus, steps=9, checkpoint_dir=where, seed=1, batch_size=4)


@pytest.mark.slow
def test_run_stops_at_the_first_non_finite_loss(corpus):
  # A learning rate of 1e6: the loss turns NaN within a few steps of 20; the run stops there.
  with pytest.raises(train.NonFiniteLossError, match=r"the loss at step \d+ is nan: training "
                     r"stopped there \(the first non-finite loss\); lower --learning_rate "
                     r"\(it is 1e\+06\)") as err:
    _run(corpus, steps=20, learning_rate=1e6, log_every=20)
  e = err.value
  assert math.isnan(e.loss) and e.step == len(e.result["losses"]) < 20
  assert all(math.isfinite(x) for x in e.result["losses"][:-1])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU backend's host memory")
def test_a_batch_whose_activations_cannot_fit_is_refused_before_compiling(corpus, monkeypatch):
  # --batch_size=100000 was refused after 130 s of XLA constant folding. The layers' inputs
  # and the logits (8 x 32 tokens: 2 x 32 + 256 values of 4 bytes each) and the state are
  # over the host's memory, made 600 KiB here: refused from the shapes, no step planned.
  import jaxtier  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(host_lib, "available_bytes", lambda: 600 << 10)
  planned = []
  monkeypatch.setattr(train, "_offload_step", lambda *a, **k: planned.append(1))
  with pytest.raises(jaxtier.AdmissionError, match=r"^step refused before compiling it: a batch "
                     r"of 8 x 32 tokens needs at least [\d.]+ KiB for the state and the step's "
                     r"activations \(each layer's input, kept for the backward pass, and the "
                     r"logits\), over the 600\.00 KiB this host has available") as err:
    _run(corpus, steps=1, offload="auto")
  assert err.value.limit == "host_memory" and not planned and err.value.plan is None
  state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      train.make_train_state(MICRO, 1e-2, abstract=True)[1]))
  assert jaxtier.format_bytes((2 * 32 + 256) * 8 * 32 * 4 + state) in err.value.reason


def test_the_measured_pinned_host_bytes_count_each_buffer_once():
  # Two Array objects over one buffer (as an orbax save leaves of each saved leaf until the
  # next step donates it) are one buffer's bytes.
  import gc  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import train  # pylint: disable=g-import-not-at-top
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  x = jax.device_put(np.ones(1000, np.float32), sharding)
  alias = jax.make_array_from_single_device_arrays(x.shape, sharding, [x])
  assert alias is not x and alias.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
  gc.collect()  # what earlier tests left for the collector goes first
  held = train._memory_figures(None)["pinned_host live (measured)"]  # pylint: disable=protected-access
  del x, alias
  gc.collect()
  freed = train._memory_figures(None)["pinned_host live (measured)"]  # pylint: disable=protected-access
  assert held - freed == 4000


def test_clip_norm_implies_clipping_and_replaces_clips_norm():
  assert train.clip_norm_of(False, None) is None
  assert train.clip_norm_of(True, None) == 1.0
  assert train.clip_norm_of(False, 0.25) == 0.25 and train.clip_norm_of(True, 4) == 4.0
  for bad in (0.0, -1.0, math.inf, math.nan, True):
    with pytest.raises(ValueError, match=r"run: expected clip_norm > 0 \(finite\) or None"):
      train.clip_norm_of(False, bad)


def test_clip_figures_count_the_timed_steps_over_the_norm():
  # The first step (compiled, not timed) is left out, as from tokens_per_sec; a step clips
  # where its norm is over clip_norm (optax scales the gradients by clip_norm / norm there).
  clip_figures = train._clip_figures  # pylint: disable=protected-access
  figures = clip_figures([9.0, 1.0, 2.0, 3.0, 2.0], 2.0)
  assert figures["clipped_fraction"] == 0.25
  assert figures["grad_norm"] == {"min": 1.0, "median": 2.0, "max": 3.0, "steps": 4}
  assert figures["grad_norms"] == [9.0, 1.0, 2.0, 3.0, 2.0] and figures["clip_norm"] == 2.0
  assert clip_figures([5.0], 2.0)["clipped_fraction"] == 1.0  # one step: it is the timed one
  for norms, clip_norm in (([1.0, 2.0], None), ([], 1.0)):
    figures = clip_figures(norms, clip_norm)
    assert figures["grad_norm"] is None and figures["clipped_fraction"] is None


def test_a_checkpoint_saved_before_clip_norm_resumes_with_its_norm():
  from jaxtier.examples import checkpoints  # pylint: disable=g-import-not-at-top
  settings = {k: None for k in checkpoints.SHARED_SETTINGS} | {"steps": 9}
  old = checkpoints.Checkpoint("ckpt", 3, (1.0,) * 3, {k: v for k, v in settings.items()
                                                       if k != "clip_norm"} | {"clip": True})
  checkpoints.check_resumable(old, settings | {"clip": True, "clip_norm": 1.0})
  with pytest.raises(ValueError, match=r"--clip_norm=0\.5 \(the checkpoint's run: 1\.0\)"):
    checkpoints.check_resumable(old, settings | {"clip": True, "clip_norm": 0.5})


@pytest.mark.slow
def test_the_clipped_step_returns_the_gradients_norm_before_the_clip():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
  _, _, plain = train.make_train_state(MICRO, 1e-3, seed=0)
  assert set(jax.eval_shape(plain, train.make_train_state(MICRO, 1e-3)[1], batch)[1]) == {"loss"}
  graphdef, state, step = train.make_train_state(
      MICRO, train.OptimizerConfig(learning_rate=1e-3, clip_norm=1e-3), seed=0)
  model, _ = nnx.merge(graphdef, state)
  model_def, params, rest = nnx.split(model, nnx.Param, ...)
  from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
  grads = jax.grad(lambda p: llama.loss_fn(nnx.merge(model_def, p, rest), batch))(params)
  _, metrics = jax.jit(step)(state, batch)
  assert metrics["grad_norm"].shape == () and metrics["grad_norm"].dtype == jnp.float32
  norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads)))
  np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)
  assert float(metrics["grad_norm"]) > 1e-3  # over clip_norm: this step clips


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["none", "optimizer_state_on_host"])
def test_run_clip_norm_clips_the_steps_over_it(corpus, device_run, offload):
  # A clip_norm under every step's norm clips them all (and changes the losses); one over
  # them all clips none, and the run is the unclipped one, step for step.
  tight = _run(corpus, offload=offload, clip_norm=1e-6)
  loose = _run(corpus, offload=offload, clip_norm=1e6)
  for got, norm, fraction in ((tight, 1e-6, 1.0), (loose, 1e6, 0.0)):
    assert got["clip_norm"] == norm and got["clipped_fraction"] == fraction
    assert len(got["grad_norms"]) == 20 and all(0 < g < 1e6 for g in got["grad_norms"])
    g = got["grad_norm"]
    assert g["steps"] == 19 and g["min"] <= g["median"] <= g["max"]
  np.testing.assert_allclose(loose["losses"], device_run["losses"], rtol=1e-5)
  np.testing.assert_allclose(loose["grad_norms"][:1], tight["grad_norms"][:1], rtol=1e-5)
  assert tight["losses"][-1] != pytest.approx(device_run["losses"][-1], rel=1e-3)
  assert device_run["clip_norm"] is None and device_run["clipped_fraction"] is None
  assert device_run["grad_norms"] == []


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["optimizer_state_on_host", "stream"])
def test_clipped_run_on_guesses_equals_the_serial_schedule_over_200_steps(corpus, offload):
  # Clipped at 0.7 (about the 85th percentile of this run's gradient norms): the clip binds on
  # some steps and not on others; the updates run on the guess that it does not bind, a missed
  # guess reruns the step serially. The loss trace is the serial schedule's, bit for bit.
  serial = _run(corpus, offload=offload, clip_norm=0.7, steps=200, log_every=50,
                overlap_update=False)
  guessed = _run(corpus, offload=offload, clip_norm=0.7, steps=200, log_every=50)
  assert 0 < serial["clipped_fraction"] < 1, serial["clipped_fraction"]
  assert serial["guessed"] is None
  got = guessed["guessed"]
  assert got["held"] > 0 and got["missed"] > 0, got
  assert got["held"] + got["missed"] + got["serial"] == 200
  if jax.default_backend() == "cpu":
    assert guessed["losses"] == serial["losses"]
  else:
    np.testing.assert_allclose(guessed["losses"], serial["losses"], rtol=1e-5)


def test_a_second_ctrl_c_inside_a_gc_callback_still_stops_the_run(capsys):
  # Python may run the SIGINT handler inside a garbage collector callback (jax has one), where
  # a raised KeyboardInterrupt is printed as "Exception ignored" and dropped. Within deferred()
  # it is raised again in the code the callback interrupted.
  import gc  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  sigint = train.checkpoints_lib.SigintDeferred()
  calls = []

  def second_ctrl_c_in_callback(phase, info):
    del info
    if phase == "start" and not calls:
      calls.append(phase)
      signal.raise_signal(signal.SIGINT)  # its handler runs here, in the callback

  waited, hook = [], sys.unraisablehook
  with pytest.raises(KeyboardInterrupt):
    with sigint.deferred():
      signal.raise_signal(signal.SIGINT)  # the first: asked, nothing raised
      assert sigint.asked
      gc.callbacks.append(second_ctrl_c_in_callback)
      try:
        gc.collect()
        start = time.monotonic()
        while not waited:  # the KeyboardInterrupt arrives here
          if time.monotonic() - start > 10:
            waited.append("10 s")
      finally:
        gc.callbacks.remove(second_ctrl_c_in_callback)
  assert calls == ["start"] and not waited
  assert "Exception ignored" not in capsys.readouterr().err
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  assert sys.unraisablehook is hook
