"""`python -m jaxtier run`: unmodified scripts (tests/scripts/, none imports jaxtier) trained
with their step offloaded, against the same scripts run alone.

The scripts run as a user runs them, each in a process of its own: alone (`python script.py`)
and under `python -m jaxtier run` with a device budget that puts part of the state in
pinned_host; their printed losses must agree. The launcher's choices (which function, the
fallback, --strict, --step) are also checked in this process, on a small script.
"""

import itertools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier._src import early_interrupt
from jaxtier._src import launcher as launcher_lib
from jaxtier._src.runtime import runner as runner_lib
from jaxtier._src.units import format_bytes

import _early_ctrl_c

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
WRAPPED = re.compile(r"^jaxtier run: wrapped (\S+): (.*)$", re.M)
README = pathlib.Path(__file__).parent.parent / "README.md"


def _python(tmp_path, *args, env=None, timeout=600):
  """`python *args` in a process of its own, on the CPU, with an empty profile cache."""
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
             **(env or {}))
  out = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=timeout, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def _losses(stdout: str) -> list[float]:
  return [float(x) for x in re.findall(r"loss (\S+)", stdout)]


def _wrapped(stderr: str) -> dict[str, str]:
  """{function: its plan's one line} of the launcher's 'wrapped' lines (each joined with the
  indented lines it wraps onto)."""
  return dict(WRAPPED.findall(re.sub(r"\n  (?=\S)", " ", stderr)))


def _joined(stderr: str) -> str:
  """`stderr` with each of the launcher's lines joined with the indented lines it wraps onto."""
  return re.sub(r"\n  (?=\S)", " ", stderr)


def _pinned_bytes(line: str) -> str:
  return re.search(r"pinned_host (\S+ \S+?)[;, (]", line).group(1)


@pytest.mark.slow
def test_an_nnx_script_trains_as_alone_with_its_optimizer_state_on_the_host(tmp_path):
  script = SCRIPTS / "nnx_mlp.py"
  alone = _python(tmp_path, script)
  run = _python(tmp_path, "-m", "jaxtier", "run", "--device_budget=4MB", "--", script)
  (line,) = _wrapped(run.stderr).values()
  assert list(_wrapped(run.stderr)) == ["nnx_mlp:train_step"], run.stderr
  assert line.startswith("fits;") and "(optimizer_state)" in line, line
  assert _pinned_bytes(line) != "0 B", line
  assert len(_losses(alone.stdout)) == 8
  np.testing.assert_allclose(_losses(run.stdout), _losses(alone.stdout), rtol=1e-5)
  assert "warning" not in run.stderr, run.stderr
  # The README's example is this run's line as a terminal of 100 columns shows it (the step
  # time predicted is this machine's).
  example = re.search(r"```\n(jaxtier run: wrapped .*?)\n```", README.read_text(), re.S).group(1)
  wide = _python(tmp_path, "-m", "jaxtier", "run", "--device_budget=4MB", "--", script,
                 env={"COLUMNS": "100"})
  said = wide.stderr[wide.stderr.index("jaxtier run: wrapped"):].splitlines()
  said = "\n".join(said[:len(example.splitlines())])
  step_time = lambda text: re.sub(r"step \S+ ms predicted", "step <t> ms predicted", text)
  assert step_time(said) == step_time(example), said


@pytest.mark.slow
def test_an_equinox_script_trains_as_alone_with_its_optimizer_state_on_the_host(tmp_path):
  pytest.importorskip("equinox")
  script = SCRIPTS / "eqx_mlp.py"
  alone = _python(tmp_path, script)
  run = _python(tmp_path, "-m", "jaxtier", "run", "--device_budget=4MB", "--", script)
  wrapped = _wrapped(run.stderr)
  assert list(wrapped) == ["eqx_mlp:main.<locals>.train_step"], run.stderr
  line = wrapped["eqx_mlp:main.<locals>.train_step"]
  assert "(optimizer_state)" in line and _pinned_bytes(line) != "0 B", line
  assert len(_losses(alone.stdout)) == 8
  np.testing.assert_allclose(_losses(run.stdout), _losses(alone.stdout), rtol=1e-5)


@pytest.mark.slow
def test_the_example_trainer_without_offload_trains_as_alone_its_state_built_on_the_host(
    tmp_path):
  # `--offload=none` is plain jax.jit with donation; the trainer lowers the step on shapes
  # (jaxtier.admit) before it builds the state with jax.jit(init)(): the launcher plans at that
  # lowering, and the state is built where the plan puts it.
  flags = ["--offload=none", "--steps=4", "--batch_size=2", "--seq_len=32", "--log_every=1"]
  _python(tmp_path, "-m", "jaxtier.examples.train", *flags, "--json_out=alone.json")
  run = _python(tmp_path, "-m", "jaxtier", "run", "--device_budget=8MB", "--", "-m",
                "jaxtier.examples.train", *flags, "--json_out=run.json")
  name = "jaxtier.examples.train_state:make_train_state.<locals>.train_step"
  assert list(_wrapped(run.stderr)) == [name], run.stderr
  assert _pinned_bytes(_wrapped(run.stderr)[name]) != "0 B", run.stderr
  assert (f"jaxtier run: built the state of {name} where its plan puts it "
          "(jaxtier.examples.train_state:state_initializer.<locals>.init)"
          ) in _joined(run.stderr), run.stderr
  # The trainer says where its state was built, not what --offload=none asked.
  said = " ".join(run.stdout.split())
  assert re.search(r"offload: --offload=none \(jax\.jit\), yet \S+ MiB of the \S+ MiB of "
                   r"state was built in pinned_host", said), said
  alone = json.loads((tmp_path / "alone.json").read_text())
  offloaded = json.loads((tmp_path / "run.json").read_text())
  assert alone["ended"] == offloaded["ended"] == "completed"
  assert len(alone["losses"]) == 4
  np.testing.assert_allclose(offloaded["losses"], alone["losses"], rtol=1e-5)
  # The trainer measures the pinned_host arrays live after its run: the state's host leaves.
  assert alone["memory"]["pinned_host live (measured)"] == 0
  assert offloaded["memory"]["pinned_host live (measured)"] > 0


@pytest.mark.slow
def test_the_shardings_a_script_gives_are_kept(tmp_path):
  # Two CPU devices; the script's in_shardings split the params and moments by rows.
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  script = SCRIPTS / "sharded_step.py"
  alone = _python(tmp_path, script, env=env)
  run = _python(tmp_path, "-m", "jaxtier", "run", "--device_budget=1.5MB", "--", script,
                env=env)
  assert list(_wrapped(run.stderr)) == ["sharded_step:train_step"], run.stderr
  alone_out = json.loads(alone.stdout.splitlines()[-1])
  run_out = json.loads(run.stdout.splitlines()[-1])
  assert "'d'" in alone_out["state"]["['params']['w1']"][0], alone_out
  specs = lambda out: {path: spec for path, (spec, _) in out["state"].items()}
  assert specs(run_out) == specs(alone_out)
  assert run_out["loss"] == alone_out["loss"]  # out_shardings of the metrics
  kinds = {path: kind for path, (_, kind) in run_out["state"].items()}
  assert "pinned_host" in kinds.values(), kinds
  assert {kind for _, kind in alone_out["state"].values()} == {"device"}
  np.testing.assert_allclose(_losses(run.stdout), _losses(alone.stdout), rtol=1e-5)


# A script that says whether it has Python's default SIGINT handler, then waits for a Ctrl-C.
SIGINT_SEEN = textwrap.dedent("""
    import signal, sys, time
    try:  # (said inside it: a Ctrl-C sent as soon as the line is read is caught)
      print("default handler:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
      time.sleep(60)
    except KeyboardInterrupt:
      print("KeyboardInterrupt in the script")
      sys.exit(3)
    """)


@pytest.mark.slow
@pytest.mark.parametrize("after,lines,delay", [
    ("jaxtier._src.early_interrupt", 1, 0), ("jaxtier._src.early_interrupt", 1, 0.05),
    ("jaxtier._src.early_interrupt", 1, 0.3), ("jax._src.lib", 0, 0),
    ("jaxtier._src.launcher", 0, 0), ("flax", 0, 0)])
def test_ctrl_c_before_the_script_starts_ends_the_run_in_a_line_and_130(tmp_path, after,
                                                                         lines, delay):
  # In the imports (JAX's, the launcher's, Flax's for its patch of nnx.jit): the script never
  # runs, one line says so, exit status 130; no traceback, and never ignored.
  (tmp_path / "script.py").write_text(SIGINT_SEEN)
  out = _early_ctrl_c.ctrl_c_while_starting(["-m", "jaxtier", "run", "--", "script.py"],
                                            after=after, lines=lines, delay=delay, cwd=tmp_path)
  assert out.returncode == 130, out.stderr[-3000:]
  assert out.stderr.split("\n") == ["", early_interrupt.BEFORE_SCRIPT, ""], out.stderr[-3000:]
  assert out.stdout == ""


@pytest.mark.slow
def test_the_script_has_pythons_ctrl_c(tmp_path):
  # The launcher's own handler is gone before the script starts: a Ctrl-C in the script is its
  # KeyboardInterrupt, as under `python script.py`.
  (tmp_path / "script.py").write_text(SIGINT_SEEN)
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
             PYTHONUNBUFFERED="1")
  proc = subprocess.Popen([sys.executable, "-m", "jaxtier", "run", "--", "script.py"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=tmp_path)
  assert proc.stdout.readline() == "default handler: True\n"
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 3, err[-3000:]
  assert out == "KeyboardInterrupt in the script\n"
  assert "Traceback" not in err and "interrupted" not in err, err[-3000:]


# -- the launcher's choices, in this process ----------------------------------------------------

TWO_STEPS = SCRIPTS / "two_steps.py"


def _run_here(capsys, *flags, script=TWO_STEPS, argv=("3",)):
  """`python -m jaxtier run *flags -- script *argv` in this process: (exit status, stdout,
  stderr)."""
  code = launcher_lib.main([*flags, "--", str(script), *argv])
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.fixture(scope="module")
def two_steps_alone():
  """two_steps.py's losses, run alone in a process of its own."""
  out = subprocess.run([sys.executable, str(TWO_STEPS), "3"], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True)
  return out.stdout


def _numbers(stdout: str) -> np.ndarray:
  return np.array([[float(x) for x in re.findall(r" (?:a|b|eval) (\S+)", line)]
                   for line in stdout.splitlines() if line.startswith("step ")])


def test_the_first_step_called_is_wrapped_and_said(capsys, two_steps_alone):
  jit = jax.jit
  code, out, err = _run_here(capsys, "--device_budget=3MB")
  assert code == 0, err
  assert jax.jit is jit  # the patches are undone
  assert list(_wrapped(err)) == ["two_steps:step_a"], err
  assert err.count("jaxtier run: left two_steps:step_b to jax.jit: only the first train step "
                   "is wrapped (two_steps:step_a)") == 1, err
  np.testing.assert_allclose(_numbers(out), _numbers(two_steps_alone), rtol=1e-5)


def test_the_wrapped_line_fits_the_terminals_width(capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "60")
  code, _, err = _run_here(capsys, "--device_budget=3MB")
  assert code == 0, err
  lines = err.splitlines()
  first = next(i for i, l in enumerate(lines) if l.startswith("jaxtier run: wrapped "))
  said = [lines[first]] + list(itertools.takewhile(lambda l: l.startswith("  "),
                                                   lines[first + 1:]))
  assert lines[first].startswith("jaxtier run: wrapped two_steps:step_a: fits; state:"), err
  assert len(said) >= 3 and max(map(len, said)) <= 60, said
  joined = " ".join(l.strip() for l in said)
  assert re.fullmatch(r"jaxtier run: wrapped two_steps:step_a: fits; state: device 1.52 MiB, "
                      r"pinned_host 0 B; peak device memory \S+ MiB compiled, budget 2.86 MiB; "
                      r"step \S+ ms predicted", joined), joined
  # A function's name longer than the line is kept whole, as --step takes it.
  assert launcher_lib._fit_to_terminal("jaxtier run: wrapped " + "m" * 70 + ":f: fits") == (
      "jaxtier run: wrapped\n  " + "m" * 70 + ":f:\n  fits")


def test_every_line_run_says_fits_the_terminals_width(capsys, monkeypatch, tmp_path):
  # Its notice before the script, its warnings at the end, the state built where planned: each
  # wrapped to COLUMNS as the 'wrapped' line is.
  monkeypatch.setenv("COLUMNS", "60")
  said = []
  code, _, err = _run_here(capsys, "--step=two_steps:stepa")
  assert code == 0, err
  said.append(err)
  assert _joined(err).splitlines() == [
      "jaxtier run: --step=two_steps:stepa: two_steps defines no function 'stepa' (did you mean "
      "'step_a'?); the script runs, and what it wraps is said at its end",
      "jaxtier run: warning: --step=two_steps:stepa named no function that the script jitted as "
      "a train step (one that donates a state and returns it) and called"], err
  (tmp_path / "no_step.py").write_text("import jax\nprint(jax.jit(lambda x: x + 1)(1))\n")
  code, _, err = _run_here(capsys, script=tmp_path / "no_step.py", argv=())
  assert code == 0, err
  said.append(err)
  assert _joined(err) == (
      "jaxtier run: warning: no jitted function donated a state and returned it: the script ran "
      "unwrapped (jaxtier wraps jax.jit, nnx.jit and eqx.filter_jit with donation)\n"), err
  (tmp_path / "lowered_first.py").write_text(LOWERED_FIRST)
  code, _, err = _run_here(capsys, "--policy=optimizer_state_on_host",
                           script=tmp_path / "lowered_first.py", argv=())
  assert code == 0, err
  said.append(err)
  assert ("jaxtier run: built the state of lowered_first:step where its plan puts it "
          "(lowered_first:init)") in _joined(err).splitlines(), err
  lines = "".join(said).splitlines()
  assert max(map(len, lines)) <= 60, lines
  assert len(lines) > len(_joined("".join(said)).splitlines())  # wrapped, not cut


INTERRUPTED = textwrap.dedent("""
    import jax, jax.numpy as jnp, optax
    adam = optax.adamw(1e-2)
    def loss_fn(params, x):
      return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)
    def step(state, x):
      loss, grads = jax.value_and_grad(loss_fn)(state["params"], x)
      updates, opt = adam.update(grads, state["opt"], state["params"])
      return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss
    train = jax.jit(step, donate_argnums=0)
    params = {"w": jnp.full((256, 512), 0.01)}
    state, x = {"params": params, "opt": adam.init(params)}, jnp.ones((8, 256))
    for i in range(3):
      try:
        state, loss = train(state, x)
      except KeyboardInterrupt as e:
        print("NOTE", " ".join(getattr(e, "__notes__", [])))
        state, loss = train.last_result
      print("LOSS", repr(float(loss)))
    """)


def _sigint_in_second_step(monkeypatch):
  """A SIGINT held while the run's second step runs (as if Ctrl-C came then)."""
  release, held = runner_lib.HeldInterrupt.release, [0]
  def sigint_in_second_step(self, value=None, note=""):
    if note:
      held[0] += 1
      self.pending = self.pending or held[0] == 2
    return release(self, value, note)
  monkeypatch.setattr(runner_lib.HeldInterrupt, "release", sigint_in_second_step)


def test_ctrl_c_inside_a_step_names_what_the_script_can_continue_from(capsys, tmp_path,
                                                                      monkeypatch):
  # A SIGINT held while the second step runs (its state donated) is raised once the step has
  # ended: the note names the jitted function's `last_result`, and the script continues from
  # it to the losses of a run not interrupted.
  script = tmp_path / "interrupted.py"
  script.write_text(INTERRUPTED)
  policy = "--policy=optimizer_state_on_host"
  code, calm, err = _run_here(capsys, policy, script=script, argv=())
  assert code == 0 and "NOTE" not in calm, err
  _sigint_in_second_step(monkeypatch)
  code, out, err = _run_here(capsys, policy, script=script, argv=())
  assert code == 0, err
  notes = [l for l in out.splitlines() if l.startswith("NOTE")]
  assert notes == ["NOTE jaxtier run: interrupted during a step of interrupted:step, after its "
                   "inputs were donated: the step ran to its end, and what the call would have "
                   "returned is the jitted function's `last_result`; continue from it (for `f = "
                   "jax.jit(train_step, donate_argnums=0)`: `state, metrics = f.last_result`)"]
  assert [l for l in out.splitlines() if l.startswith("LOSS")] == [
      l for l in calm.splitlines() if l.startswith("LOSS")]


UNCAUGHT = INTERRUPTED.replace("""  try:
    state, loss = train(state, x)
  except KeyboardInterrupt as e:
    print("NOTE", " ".join(getattr(e, "__notes__", [])))
    state, loss = train.last_result
""", """  state, loss = train(state, x)
  if i == 1:
    os.kill(os.getpid(), signal.SIGINT)  # in the script's own line, not in a step
""").replace("import jax,", "import os, signal, jax,")


def test_a_ctrl_c_the_script_does_not_catch_ends_run_in_a_line_and_130(capsys, tmp_path,
                                                                       monkeypatch):
  # No traceback through the launcher and jaxtier's step: one line, what was interrupted and
  # the script's line it reached, wrapped to the terminal's width; exit status 130.
  monkeypatch.setenv("COLUMNS", "72")
  script = tmp_path / "uncaught.py"
  script.write_text(UNCAUGHT)
  policy = "--policy=optimizer_state_on_host"
  code, out, err = _run_here(capsys, policy, script=script, argv=())
  assert code == 130 and out.count("LOSS") == 1, err
  assert _joined(err).splitlines()[-2:] == [
      "", f"jaxtier run: interrupted (Ctrl-C) in the script ({script}, line 16): the script "
      "ended there, and only what it saved itself is kept"], err
  # (The script's path, longer than a line here, is kept whole.)
  assert all(len(l) <= 72 or str(script) in l for l in err.splitlines()), err
  assert "Traceback" not in err
  # Inside the second step (its state donated): the step is named, not the note's advice
  # (the script, which did not catch it, cannot take `last_result`).
  _sigint_in_second_step(monkeypatch)
  code, out, err = _run_here(capsys, policy, script=script, argv=())
  assert code == 130 and out.count("LOSS") == 1, err
  assert _joined(err).splitlines()[-2:] == [
      "", f"jaxtier run: interrupted (Ctrl-C) in a step of uncaught:step ({script}, line 14): "
      "the script ended there, and only what it saved itself is kept"], err
  assert all(len(l) <= 72 or str(script) in l for l in err.splitlines()), err
  assert "last_result" not in err and "Traceback" not in err


@pytest.mark.slow
def test_python_m_jaxtier_run_ends_an_uncaught_ctrl_c_with_130(tmp_path):
  # The command line: the line alone on stderr after the plan's, status 130, no traceback.
  (tmp_path / "uncaught.py").write_text(UNCAUGHT)
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
             COLUMNS="200")
  out = subprocess.run([sys.executable, "-m", "jaxtier", "run", "--", "uncaught.py"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
                       check=False)
  assert out.returncode == 130, out.stderr[-3000:]
  assert out.stderr.endswith(
      "\n\njaxtier run: interrupted (Ctrl-C) in the script (uncaught.py, line 16): the script "
      "ended there, and only what it saved itself is kept\n"), out.stderr[-3000:]
  assert "Traceback" not in out.stderr and out.stdout.count("LOSS") == 1, out.stderr[-3000:]


def test_step_names_the_function_wrapped(capsys, tmp_path, two_steps_alone):
  # step_b donates two arguments (params, opt) and returns them with its loss.
  plans = tmp_path / "plans.json"
  code, out, err = _run_here(capsys, "--device_budget=1MB", "--step=two_steps:step_b",
                             f"--plan_json={plans}")
  assert code == 0, err
  wrapped = _wrapped(err)
  assert list(wrapped) == ["two_steps:step_b"], err
  assert "(optimizer_state)" in wrapped["two_steps:step_b"], err
  assert "left " not in err, err
  np.testing.assert_allclose(_numbers(out), _numbers(two_steps_alone), rtol=1e-5)
  # --plan_json: the plan of the line, leaf by leaf (the state is (params, opt)); w1's
  # momentum (384 KiB) cannot stay on the device beside w1 and its gradient.
  (plan,) = json.loads(plans.read_text()).values()
  roles = {leaf["path"]: leaf["role"] for leaf in plan["leaves"]}
  assert roles == {"[0]['w1']": "param", "[0]['w2']": "param",
                   "[1][0].trace['w1']": "optimizer_state",
                   "[1][0].trace['w2']": "optimizer_state"}, roles
  pinned = {leaf["path"]: leaf["nbytes"] for leaf in plan["leaves"]
            if leaf["memory_kind"] == "pinned_host"}
  assert "[1][0].trace['w1']" in pinned, pinned
  assert sum(pinned.values()) == plan["pinned_bytes"]
  assert f"pinned_host {format_bytes(plan['pinned_bytes'])} (optimizer_state)" in wrapped[
      "two_steps:step_b"]


def test_a_step_that_cannot_be_offloaded_runs_unwrapped_after_one_warning(capsys,
                                                                          two_steps_alone):
  # policy none keeps all 1.52 MiB of step_a's state on the device: over a 1 MB budget.
  code, out, err = _run_here(capsys, "--policy=none", "--device_budget=1MB")
  assert code == 0, err
  warnings = [l for l in _joined(err).splitlines() if "warning" in l]
  # What refused it (`PlanError.reason`), and the fix as this command line gives it, not the
  # Python API's policy mapping.
  assert warnings == [
      "jaxtier run: warning: two_steps:step_a runs unwrapped: PlanError: the state needs "
      "1.52 MiB (1597444 bytes) of device memory after offloading, over the device budget of "
      "976.56 KiB (1000000 bytes). Fix: a larger --device_budget, or --policy=auto (the planner "
      "puts what it may on the host)"], err
  assert _wrapped(err) == {}, err  # nor step_b: the first step was step_a
  # The script's own jit runs it: on the CPU bit for bit as alone; on a GPU XLA's reductions
  # may sum in another order from run to run (xla_gpu_deterministic_ops is off by default).
  rtol = 1e-6 if jax.default_backend() == "gpu" else 0
  np.testing.assert_allclose(_numbers(out), _numbers(two_steps_alone), rtol=rtol, atol=0)


def test_a_refusal_names_the_flag_of_the_limit_that_refused_it(capsys):
  # The optimizer state pinned is over --host_budget: a larger --host_budget is the fix, not a
  # larger --device_budget (`AdmissionError.limit` says which limit refused it).
  code, _, err = _run_here(capsys, "--policy=optimizer_state_on_host", "--host_budget=100KB",
                           argv=("1",))
  assert code == 0, err
  (warning,) = [l for l in _joined(err).splitlines() if "warning" in l]
  assert warning.startswith("jaxtier run: warning: two_steps:step_a runs unwrapped: "
                            "AdmissionError: it needs "), warning
  assert warning.endswith(" of pinned host memory per device, over the host budget of 97.66 KiB "
                          "(100000 bytes). Fix: a larger --host_budget, or --policy=auto (the "
                          "planner keeps on the device what fits there)"), warning


def test_strict_stops_where_the_step_cannot_be_offloaded(capsys):
  code, out, err = _run_here(capsys, "--policy=none", "--device_budget=1MB", "--strict")
  assert code == 1
  assert _joined(err).strip().splitlines()[-1].startswith(
      "jaxtier run: error: two_steps:step_a cannot be offloaded: PlanError: the state needs "
      "1.52 MiB (1597444 bytes) of device memory after offloading, over the device budget of "
      "976.56 KiB (1000000 bytes)"), err
  assert "step 0" not in out  # it stopped at the first step


def test_strict_stops_where_a_named_step_is_never_wrapped(capsys):
  code, _, err = _run_here(capsys, "--step=evaluate", "--strict")
  assert code == 1
  assert err.strip().splitlines()[-1] == (
      "jaxtier run: error: --step=evaluate named no function that the script jitted as a train "
      "step (one that donates a state and returns it) and called"), err


def test_a_step_in_no_importable_module_is_said_before_the_script_runs(capsys):
  # A mistyped module in --step: said before the script runs (not after all its steps); under
  # --strict the run stops there. The script's own module is named as the script.
  code, out, err = _run_here(capsys, "--step=nosuch:step_a", "--strict")
  assert (code, out) == (1, "")
  assert _joined(err).strip() == (
      "jaxtier run: --step=nosuch:step_a: no such module can be imported (the script's own "
      "functions are named two_steps:function); --strict: stopped before the script ran"), err
  code, out, err = _run_here(capsys, "--step=nosuch:step_a", "--step=two_steps:step_b")
  assert code == 0 and "step 0" in out, err
  assert _joined(err).startswith(
      "jaxtier run: --step=nosuch:step_a: no such module can be imported (the script's own "
      "functions are named two_steps:function); the script runs, and what it wraps is said at "
      "its end\n"), err
  assert "two_steps:step_b" in err  # wrapped, as asked


def test_a_step_its_module_does_not_define_is_said_before_the_script_runs(capsys):
  # A mistyped function in --step: said before the script runs, with the closest name the
  # module defines; under --strict the run stops there.
  code, out, err = _run_here(capsys, "--step=two_steps:stepa", "--strict")
  assert (code, out) == (1, "")
  assert err == ("jaxtier run: --step=two_steps:stepa: two_steps defines no function 'stepa' "
                 "(did you mean 'step_a'?); --strict: stopped before the script ran\n"), err
  code, out, err = _run_here(capsys, "--step=__main__:stepa", "--step=two_steps:step_b")
  assert code == 0 and "step 0" in out, err
  assert err.startswith("jaxtier run: --step=__main__:stepa: two_steps defines no function "
                        "'stepa' (did you mean 'step_a'?); the script runs, and what it wraps is "
                        "said at its end\n"), err
  assert list(_wrapped(err)) == ["two_steps:step_b"], err


def test_a_bare_step_name_the_script_does_not_name_is_said_before_it_runs(capsys, tmp_path):
  # --step=function (no module): looked for in the script's own source, the file run or the
  # module -m runs, before it runs; under --strict the run stops there.
  code, out, err = _run_here(capsys, "--strict", "--step=stepa")
  assert (code, out) == (1, "")
  assert _joined(err) == ("jaxtier run: --step=stepa: two_steps neither defines nor imports a "
                          "function 'stepa' (did you mean 'step_a'?); --strict: stopped before "
                          "the script ran\n"), err
  code = launcher_lib.main(["--strict", "--step=train_stpe", "--", "-m",
                            "jaxtier.examples.train"])
  err = capsys.readouterr().err
  assert code == 1 and _joined(err) == (
      "jaxtier run: --step=train_stpe: jaxtier.examples.train neither defines nor imports a "
      "function 'train_stpe' (did you mean 'train_step'?); --strict: stopped before the script "
      "ran\n"), err
  # A name the script imports or reaches through a module is its to name, not said.
  (tmp_path / "uses_a_library.py").write_text(
      "import two_steps\nfrom two_steps import step_b as b\nprint(two_steps.step_a, b)\n")
  options = launcher_lib.RunOptions(steps=("step_a", "step_b", "two_steps:step_b"))
  target = launcher_lib.Target(path=str(tmp_path / "uses_a_library.py"), module=None, argv=())
  assert launcher_lib.undefined_steps(options, target) == {}
  code, out, err = _run_here(capsys, "--step=step_b", "--device_budget=3MB")
  assert code == 0 and "step 0" in out and "neither" not in err, err
  assert list(_wrapped(err)) == ["two_steps:step_b"], err


SIDE_EFFECTS = textwrap.dedent("""
    import pathlib
    pathlib.Path("imported").write_text("a module of the script's, imported")
    def make():
      def train_step(state, x):
        return state, x
      return train_step
    def build():
      def step(state, x):
        return state, x
      step.__qualname__ = "named_later"
      return step
    """)


def test_a_steps_module_is_read_not_imported_before_the_script_runs(capsys, tmp_path,
                                                                    monkeypatch):
  # The module's source is read: its code (here one that writes a file) does not run before
  # the script's. A nested def counts, and so does a name the module gives as a string.
  monkeypatch.chdir(tmp_path)
  (tmp_path / "steps_module.py").write_text(SIDE_EFFECTS)
  monkeypatch.syspath_prepend(str(tmp_path))
  options = launcher_lib.RunOptions(steps=(
      "steps_module:train_stepp", "steps_module:make.<locals>.train_step",
      "steps_module:named_later", "steps_module:<lambda>", "train_stepp"))
  target = launcher_lib.Target(path=str(TWO_STEPS), module=None, argv=())
  assert launcher_lib.undefined_steps(options, target) == {
      "steps_module:train_stepp": "steps_module defines no function 'train_stepp' (did you mean "
                                  "'train_step'?)",
      # A bare name is looked for in the script (two_steps), not in the modules it imports.
      "train_stepp": "two_steps neither defines nor imports a function 'train_stepp' (did you "
                     "mean 'train_b'?)"}
  assert "steps_module" not in sys.modules and not (tmp_path / "imported").exists()
  code, _, err = _run_here(capsys, "--step=steps_module:make.<locals>.train_stepp", "--strict")
  assert code == 1 and _joined(err) == (
      "jaxtier run: --step=steps_module:make.<locals>.train_stepp: steps_module defines no "
      "function 'train_stepp' (did you mean 'train_step'?); --strict: stopped before the script "
      "ran\n"), err
  assert not (tmp_path / "imported").exists()


LOWERED_FIRST = textwrap.dedent("""
    # As the example trainer: the step lowered on shapes, then the state built by a jit.
    import jax, jax.numpy as jnp, optax
    tx = optax.adam(1e-2)
    def init():
      params = {"w": jnp.full((256, 256), 0.01), "b": jnp.zeros((256,))}
      return {"params": params, "opt": tx.init(params)}
    def step(state, x):
      loss, g = jax.value_and_grad(
          lambda p: jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - jnp.cos(x)) ** 2))(state["params"])
      u, opt = tx.update(g, state["opt"])
      return {"params": optax.apply_updates(state["params"], u), "opt": opt}, loss
    train = jax.jit(step, donate_argnums=0)
    x = jnp.linspace(-1, 1, 16 * 256).reshape(16, 256)
    lowered = train.lower(jax.eval_shape(init), x)
    print("lowered", type(lowered).__name__)
    state = jax.jit(init)()
    print("kinds", sorted({a.sharding.memory_kind for a in jax.tree.leaves(state)}))
    for i in range(3):
      state, loss = train(state, x)
      print(f"step {i} loss {float(loss)!r}")
""")


def test_a_step_lowered_before_its_state_exists_has_its_state_built_where_planned(
    capsys, tmp_path):
  script = tmp_path / "lowered_first.py"
  script.write_text(LOWERED_FIRST)
  alone = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True).stdout
  code, out, err = _run_here(capsys, "--policy=optimizer_state_on_host", script=script,
                             argv=())
  assert code == 0, err
  assert "jaxtier run: built the state of lowered_first:step where its plan puts it " \
         "(lowered_first:init)" in err, err
  assert "kinds ['device', 'pinned_host']" in out, out
  assert "kinds ['device']" in alone
  np.testing.assert_allclose(_losses(out), _losses(alone), rtol=1e-5)
  assert len(_losses(out)) == 3


# -- pieces ------------------------------------------------------------------------------------


def test_parse_splits_jaxtiers_flags_from_the_scripts():
  options, target = launcher_lib.parse(
      ["--device_budget=8GB", "--step=a:f", "--step=g", "--strict", "--", "-m",
       "jaxtier.examples.train", "--device_budget=1", "x"])
  assert options == launcher_lib.RunOptions(device_budget="8GB", steps=("a:f", "g"),
                                            strict=True)
  assert target == launcher_lib.Target(path=None, module="jaxtier.examples.train",
                                       argv=("--device_budget=1", "x"))
  # Without `--` the script starts at the first argument that is no flag.
  _, target = launcher_lib.parse(["--policy=none", str(TWO_STEPS), "--flag"])
  assert target.path == str(TWO_STEPS) and target.argv == ("--flag",)
  assert target.name == "two_steps"


@pytest.mark.parametrize("argv, says", [
    (["--device_budget=lots", "--", str(TWO_STEPS)],
     "--device_budget: expected a size like 80GB"),
    (["--host_budget=-5MB", "--", str(TWO_STEPS)], "--host_budget: expected a size"),
    (["--device_budget=0", "--", str(TWO_STEPS)],
     "--device_budget: expected a size > 0 bytes, got '0'; leave --device_budget out for no "
     "limit"),
    ([f"--plan_json={TWO_STEPS}/plans.json", "--", str(TWO_STEPS)],
     f"{TWO_STEPS} is a file, not a directory; pick another path"),
    (["--policy=fast", "--", str(TWO_STEPS)],
     "flag --policy=fast: value should be one of <auto|none|optimizer_state_on_host>"),
    (["--nope", "--", str(TWO_STEPS)], "Unknown command line flag 'nope'"),
    (["--step=a:b:c", "--", str(TWO_STEPS)],
     "expected --step=module:function or --step=function, got 'a:b:c'"),
    (["--plan_json=/no_such_dir/plans.json", "--", str(TWO_STEPS)],
     "--plan_json=/no_such_dir/plans.json: the directory /no_such_dir does not exist"),
    (["--plan_json=/proc/plans.json", "--", str(TWO_STEPS)],
     "--plan_json=/proc/plans.json: cannot write there"),
    ([f"--plan_json={os.path.dirname(TWO_STEPS)}", "--", str(TWO_STEPS)],
     "expected a file name (e.g. plans.json), got a directory"),
])
def test_a_bad_flag_exits_2_in_one_line_naming_it(capsys, argv, says):
  # As train, plan and calibrate say a bad flag: what is wrong, and where the flags are listed.
  assert launcher_lib.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("python -m jaxtier run: ") and says in err, err
  assert err.endswith("; python -m jaxtier run --help lists its flags\n"), err
  assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv, says", [
    (["--strict", "--"], "no script given (after --: script.py or -m module, then its "
                         "arguments)"),
    ([], "no script given (after --: script.py or -m module, then its arguments)"),
    (["--", "missing.py"], "no such script: missing.py"),
    (["--", "-m", "no_such_package.train"], "no module named 'no_such_package.train'"),
    (["-m", "jaxtier.no_such_module"], "no module named 'jaxtier.no_such_module'"),
])
def test_a_missing_script_exits_2_in_one_line(capsys, argv, says):
  # As a bad flag is said (and the other commands' usage errors).
  assert launcher_lib.main(argv) == 2
  err = capsys.readouterr().err
  assert err == (f"python -m jaxtier run: {says}; python -m jaxtier run --help lists its "
                 "flags\n"), err


@pytest.mark.parametrize("spec, name, target, named", [
    ("train_step", "__main__:train_step", "script", True),
    ("script:train_step", "script:train_step", "script", True),
    ("__main__:train_step", "script:train_step", "script", True),
    ("other:train_step", "script:train_step", "script", False),
    ("train_step", "pkg.mod:make.<locals>.train_step", "script", True),
    ("pkg.mod:make.<locals>.train_step", "pkg.mod:make.<locals>.train_step", "x", True),
    ("eval_step", "script:train_step", "script", False),
])
def test_step_names_a_function_by_module_and_name(spec, name, target, named):
  assert launcher_lib._named(spec, name, target) is named


def test_a_donated_argument_is_found_in_the_output():
  state = {"w": jnp.zeros((3, 2)), "n": jnp.zeros((), jnp.int32)}
  other = jnp.zeros((3, 2))
  as_out = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  loss = jax.ShapeDtypeStruct((), jnp.float32)
  match = launcher_lib._match
  assert match([0], (state, other), (as_out, loss)) == ((0,), (0,))
  assert match([0], (state, other), as_out) == ((0,), None)  # the whole output
  assert match([0], (state, other), {"loss": loss, "state": as_out}) == ((0,), (1,))
  # (params, opt) both donated, returned with the loss first.
  assert match([0, 1], (other, state), (loss, as_out, jax.ShapeDtypeStruct((3, 2), jnp.float32))
               ) == ((0, 1), (2, 1))
  assert match([0], (state, other), loss) == ((), ())
  # Another dtype is another state.
  assert match([0], ({"w": jnp.zeros((3, 2), jnp.bfloat16)},), ({"w": as_out["w"]}, loss)) == (
      (), ())
