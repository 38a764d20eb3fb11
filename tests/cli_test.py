"""The command line (`python -m jaxtier train|plan|calibrate`): exit codes and what it prints.

Each test runs the installed package in a process of its own (as a user would) with an empty
profile cache, on small configs (a few seconds each). Most are forked from one process that has
imported jax, flax and optax once (`_Forks`), the seconds a new interpreter spends on its imports
saved per command: the child runs `python -m jaxtier` as a new one would, with its own
arguments, environment, working directory, output files and exit status.
"""

import atexit
import json
import math
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile

import jax
import pytest

import jaxtier
from jaxtier._src import early_interrupt

import _early_ctrl_c

# The forking process: imports the example trainer (jax, flax, optax; no backend is started),
# then per request line forks a child that runs `python -m jaxtier <args>` and answers with the
# child's pid, then its exit status.
_FORKS = r"""
import json, os, runpy, sys, traceback
import jaxtier.examples.train
for line in sys.stdin:
  req = json.loads(line)
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      os.chdir(req["cwd"])
      os.environ.clear()
      os.environ.update(req["env"])
      for fd, path in ((1, req["out"]), (2, req["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
      os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
      sys.argv = ["jaxtier", *req["args"]]
      sys.orig_argv = [sys.executable, "-m", "jaxtier", *req["args"]]
      try:
        runpy.run_module("jaxtier", run_name="__main__", alter_sys=True)
        code = 0
      except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
          code = e.code or 0
        else:
          print(e.code, file=sys.stderr)
    except BaseException:
      traceback.print_exc()
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
  print(json.dumps({"pid": pid}), flush=True)
  _, status = os.waitpid(pid, 0)
  print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class _Forks:
  """The forking process (one per test process, started at the first command)."""

  proc = None

  @classmethod
  def run(cls, args, env, cwd, timeout):
    if cls.proc is None or cls.proc.poll() is not None:
      cls.proc = subprocess.Popen([sys.executable, "-c", _FORKS], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, cwd=cwd, env=env)
      atexit.register(cls.proc.kill)
    with tempfile.TemporaryDirectory() as folder:
      out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
      cls.proc.stdin.write(json.dumps(dict(args=list(args), env=env, cwd=str(cwd), out=out,
                                           err=err)).encode() + b"\n")
      cls.proc.stdin.flush()
      pid = json.loads(cls.proc.stdout.readline())["pid"]
      if not select.select([cls.proc.stdout], [], [], timeout)[0]:
        os.kill(pid, signal.SIGKILL)
        cls.proc.stdout.readline()
        raise subprocess.TimeoutExpired(["python", "-m", "jaxtier", *args], timeout)
      code = json.loads(cls.proc.stdout.readline())["returncode"]
      read = lambda path: open(path, encoding="utf-8", errors="replace").read()
      return subprocess.CompletedProcess(args, code, read(out), read(err))


def _cli(tmp_path, *args, timeout=300):
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
  return _Forks.run(args, env, tmp_path, timeout)


def _said(out: str, start: str) -> str:
  """The line of `out` that starts with `start`, joined with the lines it wraps onto (those
  indented under it: the CLI wraps at the terminal's width)."""
  lines = out.splitlines()
  i = next(i for i, l in enumerate(lines) if l.startswith(start))
  j = i + 1
  while j < len(lines) and lines[j].startswith("  "):
    j += 1
  return " ".join([lines[i]] + [l.strip() for l in lines[i + 1:j]])


def _flat(out: str) -> str:
  """`out` with its wrapped lines joined: every run of white space one space."""
  return " ".join(out.split())


@pytest.mark.slow
def test_plan_json_refused_exits_1_with_verdict(tmp_path):
  # The 8b state's device bytes alone are over 10 GiB: the plan is refused. The text form
  # prints REFUSED and exits 1; the JSON form exits 1 too and says so in fields.
  flags = ["plan", "--config=8b", "--platform=gpu", "--device_budget=10GiB"]
  text = _cli(tmp_path, *flags)
  assert text.returncode == 1, text.stderr[-2000:]
  assert "REFUSED: the state needs" in text.stdout
  # The fixes in command-line terms (the library's name Python policies).
  assert "from the command line: a larger --device_budget" in text.stdout
  assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=<GiB>" in _flat(text.stdout)
  out = _cli(tmp_path, *flags, "--json")
  assert out.returncode == 1, out.stderr[-2000:]
  plan = json.loads(out.stdout)
  assert plan["fits"] is False
  assert plan["refused"].startswith("the state needs ") and "over the device budget" in (
      plan["refused"])
  # The existing keys stay.
  assert plan["device_budget"] == 10 * 2**30 and plan["leaves"] and plan["notes"]


@pytest.mark.slow
def test_plan_names_the_xla_settings_train_would_run_it_with(tmp_path):
  # The 14b decoder at batch 10 for an absent H200: over XLA's default pinned pool (64 GiB)
  # and its default allocator fraction (0.75), which `train` raises itself on the GPU. The
  # plan names the values; planned again under them, it fits. (At batch 1 the device holds
  # the params and a few layers' gradients, under the fraction: the activations of batch 10
  # bring it over.)
  flags = ["plan", "--config=14b", "--platform=gpu", "--batch_size=10"]
  first = _cli(tmp_path, *flags, timeout=300)
  assert first.returncode == 1, first.stderr[-2000:]
  said = re.search(r"(XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)=(\d+) (XLA_PYTHON_CLIENT_MEM_FRACTION)="
                   r"(0\.\d\d) before this command, as `python -m jaxtier train` sets them",
                   _flat(first.stdout))
  assert said, first.stdout[-3000:]
  assert 100 <= int(said.group(2)) <= 125 and 0.75 < float(said.group(4)) <= 0.95
  env = {said.group(1): said.group(2), said.group(3): said.group(4)}
  again = subprocess.run([sys.executable, "-m", "jaxtier", *flags, "--details"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"),
                                  JAX_PLATFORMS="cpu", **env))
  assert again.returncode == 0, again.stdout[-3000:]
  assert f"at XLA_PYTHON_CLIENT_MEM_FRACTION={said.group(4).rstrip('0')}" in _flat(
      again.stdout)


@pytest.mark.slow
def test_plan_budget_above_an_absent_gpus_memory_plans_against_the_device(tmp_path):
  # A device budget above the H200's memory makes no room on it: the plan is made against
  # what its allocator holds (less 5%). 8b then fits by moving state to pinned_host; 14b does
  # not, and the fix named is not "a larger budget".
  out = _cli(tmp_path, "plan", "--config=8b", "--platform=gpu", "--batch_size=1",
             "--device_budget=500GiB", "--json", timeout=300)
  assert out.returncode == 0, out.stdout[-3000:]
  plan = json.loads(out.stdout)
  assert plan["fits"] and plan["planned_device_budget"] == int(
      jaxtier.DEFAULT_PROFILE.hbm_bytes * 0.95)
  assert plan["predicted_peak_hbm_bytes"] <= plan["planned_device_budget"]
  assert any("is above what JAX's allocator may use" in n and "planned against 100.04 GiB" in n
             for n in plan["notes"]), plan["notes"]
  out = _cli(tmp_path, "plan", "--config=14b", "--platform=gpu", "--batch_size=10",
             "--device_budget=500GiB", timeout=300)
  assert out.returncode == 1, out.stdout[-3000:]
  hint = _said(out.stdout, "from the command line:")
  assert "--device_budget" not in hint and "XLA_PYTHON_CLIENT_MEM_FRACTION=" in hint, hint
  # The summary says why the budget planned against is not the one given.
  assert ("planned against 100.04 GiB (of the 500.00 GiB given: what JAX's allocator may use, "
          "less a margin; XLA_PYTHON_CLIENT_MEM_FRACTION raises it)") in _flat(out.stdout), out.stdout


@pytest.mark.slow
def test_plan_json_over_budget_not_refused_exits_1(tmp_path):
  # 8 MiB holds the tiny decoder's state but not its step's peak: DOES NOT FIT, not refused.
  out = _cli(tmp_path, "plan", "--config=tiny", "--device_budget=8MiB", "--json")
  assert out.returncode == 1, out.stderr[-2000:]
  plan = json.loads(out.stdout)
  assert plan["fits"] is False and plan["refused"] is None
  assert plan["verdicts"] and not any("DOES NOT FIT" in n for n in plan["notes"])
  assert any(v["limit"] == "device_budget" for v in plan["violations"]), plan["violations"]
  missed = next(v for v in plan["violations"] if v["limit"] == "device_budget")
  assert missed["limit_bytes"] == 8 * 2**20 == plan["device_budget"], missed
  assert missed["need_bytes"] > 8 * 2**20 and not missed["binding"], missed


@pytest.mark.slow
def test_plan_without_a_budget_names_the_cpu_budget_train_plans_against(tmp_path):
  # `train --offload=auto` on the CPU sets a budget of its own so that the example offloads;
  # `plan` with none keeps all on the device, and says which budget train plans against:
  # the all-device peak less half the state (`budgets.cpu_device_budget`).
  out = _cli(tmp_path, "plan", "--config=tiny", "--json")
  plan = json.loads(out.stdout)
  text = _cli(tmp_path, "plan", "--config=tiny")
  assert text.returncode == 0, text.stderr[-2000:]
  note = _said(text.stdout, "note: with no --device_budget")
  assert plan["pinned_bytes"] == 0 and "`train` on the CPU plans against a device budget" in note
  # The budget train prints, for the model's activation policy as train runs it.
  for flags in ([], ["--remat_policy=nothing_saveable"]):
    said = _said(_cli(tmp_path, "plan", "--config=tiny", *flags).stdout,
                 "note: with no --device_budget")
    budget = int(re.search(r"\((\d+) bytes: its all-device step's peak less half the state",
                           said).group(1))
    trained = _cli(tmp_path, "train", "--config=tiny", "--steps=1", *flags).stdout
    trained = " ".join(trained.split())
    assert (f"to fit a {jaxtier.format_bytes(budget)} device budget (CPU default)"
            in trained), (said, trained)
  # Given a budget, or under another policy, nothing to say.
  for flags in (["--device_budget=1GiB"], ["--offload=optimizer_state_on_host"]):
    assert "note: with no --device_budget" not in _cli(tmp_path, "plan", "--config=tiny",
                                                       *flags).stdout


def test_plan_names_the_activation_policy_it_plans_for(tmp_path):
  # The model's policy, as --remat_policy names it: the config's default where the flag is not
  # given ('none' for tiny: no layer rematerialised), not Python's None; with the name the
  # plan's "activations:" line gives it.
  for args, config, policy in (
      (["--config=tiny"], "tiny: 492,160 params, batch 16 x seq 128",
       "none (activations: keep; the config's default)"),
      (["--config=tiny", "--remat_policy=none"], "tiny: 492,160 params, batch 16 x seq 128",
       "none (activations: keep)"),
      (["--config=tiny", "--remat_policy=nothing_saveable"],
       "tiny: 492,160 params, batch 16 x seq 128", "nothing_saveable (activations: remat)"),
      (["--config=tiny", "--remat_policy=dots_saveable"],
       "tiny: 492,160 params, batch 16 x seq 128", "dots_saveable"),
      (["--config=1b", "--platform=gpu"], "1b: 1,028,737,024 params, batch 8 x seq 2048",
       "dots_with_no_batch_dims_saveable (activations: save_dots; the config's default)")):
    out = _cli(tmp_path, "plan", *args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _said(out.stdout, "config ") == f"config {config}, remat_policy {policy}", out.stdout
  out = _cli(tmp_path, "plan", "--config=tiny")
  assert ("activations: keep (jax.checkpoint_policies.everything_saveable)"
          in out.stdout.splitlines()), out.stdout


def test_plan_with_a_remat_policy_plans_that_policy(tmp_path):
  # As train runs it: the step traced with the policy asked, and the planner not free to
  # choose another (with no budget on the CPU it would choose keep, the fastest).
  for name, policy in (("remat", "nothing_saveable"),
                       ("offload", "offload_dot_with_no_batch_dims")):
    out = _cli(tmp_path, "plan", "--config=tiny", f"--remat_policy={policy}", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    assert plan["activation_policy"] == f"{name} (jax.checkpoint_policies.{policy})", plan
    assert plan["assumed_checkpoint_policy"] is None
    text = _cli(tmp_path, "plan", "--config=tiny", f"--remat_policy={policy}").stdout
    assert f"activations: {name} (jax.checkpoint_policies.{policy})" in text.splitlines(), text
    assert "this plan assumes the activation policy" not in _flat(text), text
    assert f"and runs --remat_policy={policy}; this plan has no device budget" in _flat(text)
  # Without the flag the planner may choose: the tiny decoder's fastest is keep.
  plan = json.loads(_cli(tmp_path, "plan", "--config=tiny", "--json").stdout)
  assert plan["activation_policy"] == "keep (jax.checkpoint_policies.everything_saveable)"


def test_plan_json_fitting_exits_0(tmp_path):
  out = _cli(tmp_path, "plan", "--config=tiny", "--json")
  assert out.returncode == 0, out.stderr[-2000:]
  plan = json.loads(out.stdout)
  assert plan["fits"] is True and plan["refused"] is None


@pytest.mark.slow
def test_plan_for_an_absent_gpu_says_where_the_pinnable_limit_comes_from(tmp_path):
  # The 13b moments need 95 GiB pinned; the limit is the profile's (no GPU here), not this
  # host's free memory.
  out = _cli(tmp_path, "plan", "--config=13b", "--platform=gpu")
  assert out.returncode == 1, out.stderr[-2000:]
  assert ("over what the hardware profile says the GPU's host can pin (no GPU here) of "
          "64.00 GiB") in _flat(out.stdout)


@pytest.mark.slow
def test_train_replanned_under_an_internal_budget_shows_no_verdict_against_it(tmp_path):
  # The compiled step of auto's plan comes out over 7 MiB: auto escalates, and once the plan
  # with the optimizer state on the host fits, re-plans its own against a smaller internal
  # budget (7 MiB less what it was over). The solver's verdict against that budget is not the
  # plan's against the user's (the compiled check, whose verdict train prints as its error
  # when over): the notes do not say DOES NOT FIT. (--allow_over_budget: the plan is printed
  # either way.)
  out = _train(tmp_path, "--batch_size=1", "--seq_len=32", "--device_budget=7MiB",
               "--remat_policy=nothing_saveable", "--allow_over_budget")
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  if not any(l.startswith("re-planned") for l in lines):
    # XLA's CPU compiler sizes the step by the machine's CPU (its vector width and threads):
    # where the first plan's compiled step fits 7 MiB there is nothing to re-plan.
    peak = re.search(r"peak device memory: [0-9.]+ MiB predicted, ([0-9.]+) MiB compiled; "
                     r"budget 7\.00 MiB", out.stdout)
    assert peak and float(peak.group(1)) <= 7.0, out.stdout
    pytest.skip("this machine's compiled step fits 7 MiB: no re-plan to check")
  assert not any("DOES NOT FIT" in l for l in lines), out.stdout


@pytest.mark.slow
def test_plan_that_assumes_another_activation_policy_says_how_to_train_it(tmp_path):
  # Under 7 MiB the planner picks a remat policy for the tiny decoder, which keeps its
  # activations: the plan fits only if train is told to remat, and the note names the flag.
  out = _cli(tmp_path, "plan", "--config=tiny", "--batch_size=1", "--seq_len=32",
             "--device_budget=7MiB")
  assert out.returncode == 0, out.stderr[-2000:]
  said = re.search(r"note: this plan assumes the activation policy (\w+), not the model's: "
                   r"train with --remat_policy=(\w+)", _flat(out.stdout))
  assert said and said.group(1) == said.group(2), out.stdout
  assert said.group(1) in ("nothing_saveable", "dots_with_no_batch_dims_saveable",
                           "dots_saveable")


def test_plan_offload_stream_plans_as_train_runs_it(tmp_path):
  # --offload=stream is one of the flag's values (train's): plan places the layers' params
  # host_stream as train does, rather than passing 'stream' on to jaxtier.plan as a policy
  # name (it is none, and would be refused).
  out = _cli(tmp_path, "plan", "--config=tiny", "--offload=stream", "--json")
  assert out.returncode == 0, out.stderr[-2000:]
  plan = json.loads(out.stdout)
  placed = {l["path"]: l["placement"] for l in plan["leaves"]}
  streamed = [p for p, where in placed.items() if where == "host_stream"]
  assert streamed and all("['layers']" in p for p in streamed)


def test_calibrate_without_gpu_warns_once_with_readable_rates(tmp_path):
  # JAX_PLATFORMS=cpu (set by _cli): the CPU backend is the compute device.
  out = _cli(tmp_path, "calibrate")
  assert out.returncode == 0, out.stderr[-2000:]
  said = out.stdout + out.stderr
  assert said.count("no GPU here") == 1, said  # one warning, not a log line and a print
  assert "warning: no GPU here" in out.stdout
  assert "split share" not in said  # the split executor needs a GPU
  rates = dict(line.split(None, 1) for line in out.stdout.splitlines()
               if line.split(None, 1)[0].endswith(("_gbps", "_tflops", "_per_sec")))
  # This CPU's matmul rate, well below 1 TFLOP/s, with 3 significant digits (not "0").
  matmul = rates["matmul_tflops"].split()[0]
  assert 0 < float(matmul) < 50 and len(matmul.lstrip("0.").replace(".", "")) == 3, matmul


@pytest.mark.parametrize("where, says", [
    ("missing/dir/plan.png", "does not exist"),
    ("plan.xyz", "cannot draw a .xyz image"),
    (".", "got a directory"),
])
def test_plan_plot_to_an_unwritable_path_fails_before_planning(tmp_path, where, says):
  out = _cli(tmp_path, "plan", "--config=tiny", f"--plot={where}")
  assert out.returncode == 2
  # (Before it, matplotlib may log that it built its font cache.)
  said = out.stderr.splitlines()[-1]
  assert said.startswith(f"python -m jaxtier plan: --plot={where}: ") and says in said, said
  assert said.endswith("; python -m jaxtier plan --help lists its flags"), said
  assert "Traceback" not in out.stderr
  assert "jaxtier plan" not in out.stdout  # failed before planning, not after printing it


def _train(tmp_path, *args):
  text = tmp_path / "text.txt"
  if not text.exists():
    text.write_text(json.__doc__ * 40)  # a small corpus: loading the default one takes seconds
  return _cli(tmp_path, "train", "--config=tiny", "--steps=2", "--batch_size=2", "--seq_len=16",
              f"--data={text}", *args)


@pytest.mark.slow
def test_train_state_over_the_budget_names_what_is_left_to_try(tmp_path):
  # Under auto the planner has already put the optimizer state on the host: the params alone
  # are over 1 MiB. The command-line fix names streaming, not the mode already tried.
  out = _train(tmp_path, "--offload=auto", "--device_budget=1MiB",
               f"--json_out={tmp_path / 'refused.json'}")
  assert out.returncode == 1, out.stderr[-2000:]
  assert "error: PlanError: the state needs" in out.stderr, out.stderr[-2000:]
  # --json_out is written on this exit path too, saying how the run ended.
  said = json.loads((tmp_path / "refused.json").read_text())
  assert said["ended"] == "refused" and said["error"].startswith("PlanError: the state needs")
  hint = next(l for l in out.stderr.splitlines() if l.startswith("from the command line:"))
  assert "--offload=stream moves the layers' params to pinned_host" in hint, hint
  assert "optimizer_state_on_host" not in hint and "--host_budget" not in hint, hint
  assert "activations come on top of the state" in hint, hint


def test_train_refused_pinned_memory_names_what_is_left_to_try(tmp_path):
  # The optimizer state on the host is over a 1 KB host budget: the fix names auto (not tried
  # yet; under auto the hint leaves it out), not the batch, which pins nothing, nor a smaller
  # config: tiny is the smallest.
  out = _train(tmp_path, "--offload=optimizer_state_on_host", "--host_budget=1KB")
  assert out.returncode == 1, out.stderr[-2000:]
  assert "error: AdmissionError: plan refused before allocating anything" in out.stderr
  hint = next(l for l in out.stderr.splitlines() if l.startswith("from the command line:"))
  assert hint == ("from the command line: raise --host_budget (where the host has the memory), "
                  "or --offload=auto (keeps on the device what fits there)"), hint


@pytest.mark.slow
def test_train_over_the_budget_given_is_an_error_before_training(tmp_path):
  # 2 MiB holds the streamed decoder's device state but not its step's peak.
  out = _train(tmp_path, "--offload=stream", "--device_budget=2MiB")
  assert out.returncode == 1, out.stderr[-2000:]
  errors = [_said(out.stderr, "error:")]
  assert sum(l.startswith("error:") for l in out.stderr.splitlines()) == 1, out.stderr[-2000:]
  assert re.search(r"error: the plan does not fit: peak device memory [\d.]+ MiB predicted and "
                   r"[\d.]+ MiB compiled, over the --device_budget of 2.00 MiB\. Fix: a larger "
                   r"--device_budget \(at least \d+MiB\)", errors[0]), errors[0]
  assert "--allow_over_budget" in errors[0] and "Traceback" not in out.stderr
  assert "done: loss" not in out.stdout  # no step ran
  assert not any(l.startswith("step ") for l in out.stdout.splitlines())
  # The plan (printed first) says what it is: params streamed by the policy, not "every
  # optimizer-state leaf on the host".
  said = " ".join(out.stdout.split())
  assert "DOES NOT FIT" in said and "rule-based plan (every optimizer-state leaf" not in said
  assert "parameters (host_stream, placed by the policy) in pinned_host" in said


@pytest.mark.slow
def test_train_offload_none_over_the_budget_given_is_an_error_before_training(tmp_path):
  # jax.jit's step, all its state on the device: its compiled peak is checked as a plan is.
  out = _train(tmp_path, "--offload=none", "--device_budget=1MB")
  assert out.returncode == 1, out.stderr[-2000:]
  # One message, wrapped at the terminal's width.
  assert out.stderr.startswith("error:") and all(
      l.startswith("  ") for l in out.stderr.splitlines()[1:]), out.stderr[-2000:]
  assert re.fullmatch(
      r"error: the step does not fit: peak device memory [\d.]+ MiB compiled \(jax\.jit, all "
      r"[\d.]+ MiB of state on the device\), over the --device_budget of 976\.56 KiB\. Fix: "
      r"--offload=auto \(jaxtier places in pinned_host what the budget leaves no room for\), "
      r"or a larger --device_budget \(at least \d+MiB\), or --remat_policy=nothing_saveable "
      r"\(fewer activations kept for the backward pass\); or --allow_over_budget to train "
      r"anyway", _flat(out.stderr)), out.stderr[-2000:]
  assert not any(l.startswith("step ") for l in out.stdout.splitlines())


@pytest.mark.parametrize("flags, said", [
    (["--checkpoint_every=5"], "--checkpoint_every without --checkpoint_dir: no checkpoint is "
                               "kept; add --checkpoint_dir=DIR (or drop it)"),
    (["--keep_checkpoints=2"], "--keep_checkpoints without --checkpoint_dir: no checkpoint is "
                               "kept; add --checkpoint_dir=DIR (or drop it)"),
    (["--checkpoint_every=5", "--keep_checkpoints=2"],
     "--checkpoint_every and --keep_checkpoints without --checkpoint_dir: no checkpoint is "
     "kept; add --checkpoint_dir=DIR (or drop them)"),
])
def test_train_checkpoint_flags_without_a_checkpoint_dir_are_a_usage_error(tmp_path, flags,
                                                                           said):
  out = _cli(tmp_path, "train", "--config=tiny", "--steps=1", *flags)
  assert (out.returncode, out.stdout) == (2, ""), out.stderr[-2000:]
  assert out.stderr == (f"python -m jaxtier train: {said}; python -m jaxtier train --help "
                        "lists its flags\n")


@pytest.mark.slow
def test_train_over_budget_runs_with_allow_over_budget_and_within_budget(tmp_path):
  out = _train(tmp_path, "--offload=auto", "--device_budget=2MiB", "--allow_over_budget")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "DOES NOT FIT" in out.stdout and "done: loss" in out.stdout
  out = _train(tmp_path, "--offload=auto", "--device_budget=1GiB")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "done: loss" in out.stdout and "error" not in out.stderr
  # A state alone over the budget cannot be placed: the flag does not apply, and says so.
  out = _train(tmp_path, "--offload=auto", "--device_budget=1KB", "--allow_over_budget")
  assert out.returncode == 1 and "done: loss" not in out.stdout, out.stderr[-2000:]
  assert "error: PlanError: the state needs" in out.stderr
  assert ("note: --allow_over_budget runs a plan whose step may peak over the budget; it cannot "
          "run one whose state alone is over it") in out.stderr


def _plan_on_this_backend(tmp_path, *args):
  """`jaxtier plan` on the backend the tests run on (not forced to the CPU), pool cap unset."""
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
  env.pop("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", None)
  return subprocess.run([sys.executable, "-m", "jaxtier", "plan", *args], capture_output=True,
                        text=True, env=env, cwd=tmp_path, timeout=600)


@pytest.mark.slow
def test_plan_cli_gpu_on_cpu_says_default_profile_and_plots(tmp_path):
  png = tmp_path / "plan.png"
  # 'small' keeps its activations (about 5 GB here): under 2 GB the plan rematerialises.
  out = _plan_on_this_backend(tmp_path, "--config=small", "--platform=gpu",
                              "--device_budget=2GB", f"--plot={png}")
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout
  if jax.default_backend() != "gpu":
    assert "planned for gpu on a machine without one (cpu): the default hardware profile" in (
        _flat(text))
  assert re.search(r"^step: [0-9.]+ ms predicted \(bound by \w+\)$", text, re.M), text
  assert re.search(r"^peak HBM: [0-9.]+ GiB predicted", text, re.M) and "DOES NOT" not in text
  assert "activations: remat (jax.checkpoint_policies.nothing_saveable); the traced step uses " \
         "keep: apply it in the model" in _flat(text)
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
  js = _plan_on_this_backend(tmp_path, "--config=small", "--platform=gpu", "--json")
  assert js.returncode == 0, js.stderr[-3000:]
  data = json.loads(js.stdout)
  assert data["predicted_step_secs"] > 0 and data["predicted_peak_hbm_bytes"] > 0
  assert {l["placement"] for l in data["leaves"]} == {"device"}  # fits the default budget


@pytest.mark.slow
def test_without_the_examples_extra_calibrate_runs_and_plan_names_the_extra(tmp_path):
  # The library and `calibrate` need none of flax / optax / tqdm (the `examples` extra); the
  # example model's `train` and `plan` say which are missing and what to install.
  blocked = ("import runpy, sys\n"
             "sys.modules.update(flax=None, optax=None, tqdm=None)  # as if not installed\n"
             "sys.argv = ['jaxtier', *sys.argv[1:]]\n"
             "runpy.run_module('jaxtier', run_name='__main__', alter_sys=True)\n")
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
  run = lambda *args: subprocess.run([sys.executable, "-c", blocked, *args], capture_output=True,
                                     text=True, env=env, cwd=tmp_path, timeout=120)
  out = run("plan", "--config=tiny")
  assert out.returncode == 1, out.stderr[-2000:]
  assert ("python -m jaxtier plan: the example trainer needs flax, optax, tqdm packages: install "
          "jaxtier with its examples extra, pip install 'jaxtier[examples]'") in out.stderr
  out = run("calibrate", "--json")
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout)["host_dram_gbps"] > 0


def test_train_runs_again_with_the_xla_settings_that_fit(monkeypatch):
  # `python -m jaxtier train` applies a refusal's settings (read by XLA when JAX starts) by
  # running the same command again with them, at most twice, and never over a setting the
  # user made; a second re-run may change a setting the first one made.
  import jaxtier.__main__ as cli  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
  pool, fraction = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "XLA_PYTHON_CLIENT_MEM_FRACTION"
  monkeypatch.delenv(pool, raising=False)
  monkeypatch.delenv(fraction, raising=False)
  monkeypatch.delenv("JAXTIER_RERUN", raising=False)
  cli._rerun_with({pool: "95", fraction: "0.91"})
  ((exe, argv, env),) = calls
  assert exe == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
  assert env[pool] == "95" and env[fraction] == "0.91"
  assert env["JAXTIER_RERUN"] == f"1:{pool},{fraction}"
  cli._rerun_with({})
  assert len(calls) == 1
  # The re-run: its compiled step needs a larger pool than predicted.
  monkeypatch.setenv("JAXTIER_RERUN", env["JAXTIER_RERUN"])
  monkeypatch.setenv(pool, "95")
  cli._rerun_with({pool: "99"})
  assert len(calls) == 2 and calls[1][2][pool] == "99"
  assert calls[1][2]["JAXTIER_RERUN"] == f"2:{pool},{fraction}"
  assert cli.MAX_RERUNS == 4
  monkeypatch.setenv("JAXTIER_RERUN", f"{cli.MAX_RERUNS}:{pool},{fraction}")
  cli._rerun_with({pool: "120"})  # the re-runs are spent
  monkeypatch.delenv("JAXTIER_RERUN")
  monkeypatch.setenv(pool, "80")  # the user's own setting
  cli._rerun_with({pool: "95"})
  assert len(calls) == 2


def test_a_sequence_over_the_models_maximum_is_refused_before_anything_runs(tmp_path):
  # tiny's maximum is 128: 100,000 ran on into a raw 16 TB allocation. A usage error, said
  # where the flags are parsed (plan --json too: no plan is made, so no JSON is printed).
  for command in (("train", "--config=tiny", "--steps=1"), ("plan", "--config=tiny"),
                  ("plan", "--config=tiny", "--json")):
    out = _cli(tmp_path, *command, "--seq_len=100000")
    assert (out.returncode, out.stdout) == (2, ""), out.stderr[-2000:]
    assert out.stderr == (
        f"python -m jaxtier {command[0]}: --seq_len=100000 is over the tiny model's maximum "
        "sequence length of 128; use --seq_len=128 or less (or a config with a longer "
        f"max_seq_len); python -m jaxtier {command[0]} --help lists its flags\n"), out.stderr


@pytest.mark.parametrize("args, says", [
    (["train", "--vocab_size=1000"],
     "--vocab_size=1000 with --tokenizer=byte: byte-level text has 256 ids; leave --vocab_size "
     "unset, or use --tokenizer=bpe with --vocab_size in 32768, 65536, 131072"),
    (["train", "--tokenizer=byte", "--vocab_size=32768"],
     "--vocab_size=32768 with --tokenizer=byte: byte-level text has 256 ids; leave --vocab_size "
     "unset, or use --tokenizer=bpe with --vocab_size in 32768, 65536, 131072"),
    (["plan", "--tokenizer=bpe", "--vocab_size=1000"],
     "--vocab_size=1000 with --tokenizer=bpe: expected one of 32768, 65536, 131072"),
    (["train", "--remat_policy=bogus"],
     "flag --remat_policy=bogus: expected 'none' or one of everything_saveable, "
     "nothing_saveable, dots_saveable, checkpoint_dots, dots_with_no_batch_dims_saveable, "
     "checkpoint_dots_with_no_batch_dims, offload_dot_with_no_batch_dims"),
    (["plan", "--remat_policy=bogus"],
     "flag --remat_policy=bogus: expected 'none' or one of everything_saveable, "
     "nothing_saveable, dots_saveable, checkpoint_dots, dots_with_no_batch_dims_saveable, "
     "checkpoint_dots_with_no_batch_dims, offload_dot_with_no_batch_dims"),
    (["train", "--clip_norm=0.5", "--noclip"],
     "--clip_norm clips: drop --noclip (or --clip_norm, to train unclipped)"),
])
def test_flags_that_contradict_or_are_out_of_range_are_usage_errors(tmp_path, args, says):
  # Said where the flags are parsed, before anything is loaded: one line naming the flag,
  # exit status 2 (not 'error: ValueError: ...' and 1 after the data was read).
  out = _cli(tmp_path, *args)
  assert (out.returncode, out.stdout) == (2, ""), out.stderr[-2000:]
  assert out.stderr == (f"python -m jaxtier {args[0]}: {says}; python -m jaxtier {args[0]} "
                        "--help lists its flags\n"), out.stderr


def test_a_data_file_that_is_not_text_is_refused(tmp_path):
  blob = tmp_path / "weights.npy"
  blob.write_bytes(b"\x93NUMPY\x01\x00" + bytes(range(256)) * 8)
  out = _cli(tmp_path, "train", "--config=tiny", "--steps=1", f"--data={blob}")
  assert out.returncode == 1, out.stderr[-2000:]
  assert f"error: ValueError: load_tokens: '{blob}' is not UTF-8 text (byte 0 of" in out.stderr
  assert "uint16 token file whose name ends in .bin or .u16" in out.stderr


@pytest.mark.slow
def test_train_prints_no_info_log_lines_unless_asked(tmp_path):
  # absl printed jaxtier's INFO lines (`I1201 ... jaxtier: peak device memory ...`) into the
  # trainer's output; --verbosity=0 asks for them.
  info = re.compile(r"^I\d{4} .*jaxtier:", re.M)
  out = _train(tmp_path, "--offload=optimizer_state_on_host")
  assert out.returncode == 0, out.stderr[-2000:]
  assert not info.search(out.stdout + out.stderr)
  out = _train(tmp_path, "--offload=optimizer_state_on_host", "--verbosity=0")
  assert out.returncode == 0, out.stderr[-2000:]
  assert info.search(out.stdout + out.stderr)


@pytest.mark.slow
def test_plan_summary_fits_the_terminal_and_details_show_reasons(tmp_path):
  env = {**os.environ, "COLUMNS": "90", "JAX_PLATFORMS": "cpu",
         "XDG_CACHE_HOME": str(tmp_path / "cache")}
  run = lambda *args: subprocess.run(
      [sys.executable, "-m", "jaxtier", "plan", "--config=tiny", *args], capture_output=True,
      text=True, timeout=120, cwd=tmp_path, env=env)
  summary, details, verbose = run(), run("--details"), run("--verbose")
  for out in (summary, details, verbose):
    assert out.returncode == 0, out.stderr[-2000:]
    assert max(len(l) for l in out.stdout.splitlines()) <= 90, out.stdout
  lines = summary.stdout.splitlines()
  # The config line, the summary, and the note of the CPU budget `train` would plan against.
  assert len(lines) <= 24, summary.stdout
  assert "jaxtier plan (cpu): fits; 0 fused host updates/step" in lines[1:3], lines
  hint = lines.index("(each leaf and all 3 notes: python -m jaxtier plan --details)")
  assert lines[hint + 1].startswith("note: with no --device_budget, `train` on the CPU"), lines
  assert "reason" not in summary.stdout and "['layers']" not in summary.stdout
  rows = lambda out: [l for l in out.splitlines() if l.startswith("[")]
  # (--verbose is --details; pinnable memory moves with the host's free memory.)
  assert len(rows(details.stdout)) == 39 and rows(details.stdout) == rows(verbose.stdout)
  assert "    parameter: read by the step's compute" in details.stdout


@pytest.mark.slow
def test_plan_for_an_absent_gpu_names_its_card(tmp_path):
  # --device_kind picks the built-in profile of the GPU planned for: the H100's 80 GB and
  # slower HBM, not the H200's; the plan says which. An unknown card is an error in a line.
  # (`_cli` runs on the CPU backend: the GPU is not here on any machine.)
  h100 = _cli(tmp_path, "plan", "--config=tiny", "--platform=gpu", "--device_kind=H100",
              "--json")
  h200 = _cli(tmp_path, "plan", "--config=tiny", "--platform=gpu", "--json")
  assert h100.returncode == 0 and h200.returncode == 0, (h100.stderr + h200.stderr)[-3000:]
  got, default = json.loads(h100.stdout), json.loads(h200.stdout)
  assert got["hardware_kind"] == "NVIDIA H100 80GB HBM3"
  assert default["hardware_kind"] == "NVIDIA H200"
  assert got["planned_device_budget"] < 60 * 2**30 < default["planned_device_budget"]
  assert got["predicted_step_secs"] > default["predicted_step_secs"]  # HBM 3.35 TB/s, not 4.8
  assert any("without one (cpu): the built-in H100 profile;" in n for n in got["notes"])
  text = _cli(tmp_path, "plan", "--config=tiny", "--platform=gpu", "--device_kind=H100")
  assert text.returncode == 0, text.stderr[-3000:]
  assert "planned for gpu on a machine without one (cpu): the built-in H100 profile" in (
      _flat(text.stdout))
  assert "not this machine" not in text.stdout  # the card planned for, not this machine
  bad = _cli(tmp_path, "plan", "--config=tiny", "--platform=gpu", "--device_kind=V100")
  assert bad.returncode == 2 and not bad.stdout
  assert bad.stderr.strip() == ("python -m jaxtier plan: --device_kind=V100: no built-in hardware "
                                "profile for device_kind 'V100'; known: H100, H200, A100; python "
                                "-m jaxtier plan --help lists its flags")
  cpu = _cli(tmp_path, "plan", "--config=tiny", "--device_kind=H100")  # a CPU plan has no card
  assert cpu.returncode == 2 and not cpu.stdout
  assert cpu.stderr.strip() == ("python -m jaxtier plan: --device_kind=H100: names the GPU "
                                "planned for, and this plan is for cpu: add --platform=gpu; "
                                "python -m jaxtier plan --help lists its flags")


@pytest.mark.slow
def test_a_cpu_plan_says_its_step_time_is_an_h200s_once(tmp_path):
  # No stored profile here (XDG_CACHE_HOME is the test's): the CPU plan predicts with the
  # default profile's H200 rates and says so once, with the command that measures this
  # machine; a GPU plan with that profile is for an H200. Once calibrated, no such line.
  cpu = _cli(tmp_path, "plan", "--config=tiny")
  gpu = _cli(tmp_path, "plan", "--config=tiny", "--platform=gpu")
  times = [l for l in cpu.stdout.splitlines() if l.startswith("times: ")]
  assert times == ["times: uncalibrated H200 default rates: python -m jaxtier calibrate"]
  assert cpu.stdout.count("python -m jaxtier calibrate") == 1
  assert "not this machine" not in gpu.stdout and "calibrate" not in gpu.stdout
  # Calibrated as the CLI plans, for the CPU backend (JAX_PLATFORMS=cpu: on a GPU machine too),
  # into the cache the CLI reads.
  stored = _cli(tmp_path, "calibrate")
  assert stored.returncode == 0, stored.stderr[-2000:]
  calibrated = _cli(tmp_path, "plan", "--config=tiny")
  assert calibrated.returncode == 0, calibrated.stderr[-2000:]
  assert "calibrate" not in calibrated.stdout and "not this machine" not in calibrated.stdout
  assert re.search(r"^step: [0-9.]+ ms predicted", calibrated.stdout, re.M)


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend calibrates itself")
def test_a_cpu_plan_without_a_profile_predicts_the_step_train_measures_within_2x(tmp_path):
  # No stored profile, auto-calibration on (the suite turns it off): the first plan measures
  # this machine, stores the profile and predicts with it; train reads it and measures the step.
  # A bound on the prediction's error (a factor of 2), not a speed.
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
             JAXTIER_AUTO_CALIBRATE="1")
  plan = _Forks.run(("plan", "--config=tiny", "--json"), env, tmp_path, 300)
  assert plan.returncode == 0, plan.stderr[-2000:]
  assert plan.stderr.count("no hardware profile for cpu: measured this machine in") == 1
  predicted = json.loads(plan.stdout)
  assert not predicted["rates_of"]  # this machine's rates
  assert any(n.startswith("compute: the device-only step run on this device")
             for n in predicted["notes"]), predicted["notes"]
  run = _Forks.run(("train", "--config=tiny", "--steps=30", "--log_every=5",
                    f"--json_out={tmp_path / 'run.json'}"), env, tmp_path, 300)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "measured this machine" not in run.stderr  # the stored profile, read
  with open(tmp_path / "run.json") as f:
    times = json.load(f)["step_times"][1:]  # (the first compiles)
  measured = sum(times) / len(times)
  ratio = predicted["predicted_step_secs"] / measured
  assert 0.5 <= ratio <= 2.0, (predicted["predicted_step_secs"], measured)


def test_plan_streams_as_train_does_unless_nostream(tmp_path):
  # A device budget the state fits only with the layers' params streamed: `plan` finds that
  # plan as `train --offload=auto` (jaxtier.offload) would; --nostream forbids it.
  flags = ["plan", "--config=tiny", "--device_budget=53MiB", "--json"]
  streams = json.loads(_cli(tmp_path, *flags).stdout)
  never = json.loads(_cli(tmp_path, *flags, "--nostream").stdout)
  placed = lambda p: {l["placement"] for l in p["leaves"]}
  assert "host_stream" in placed(streams), placed(streams)
  assert "host_stream" not in placed(never)


@pytest.mark.slow
def test_plan_names_the_pinned_limit_in_force_over_a_larger_host_budget(tmp_path):
  # XLA's pinned pool (the profile's 64 GiB, planning for an absent GPU) is below the
  # host_budget given: the header and the pinned line say the limit that applies, and why.
  out = _cli(tmp_path, "plan", "--config=1b", "--platform=gpu", "--host_budget=126GB",
             "--offload=optimizer_state_on_host").stdout
  state = _said(out, "state: ")
  assert re.search(r"pinned_host [0-9.]+ GiB of 64.00 GiB pinnable", state), state
  assert "host_budget 117.35 GiB" in state and "117.35" not in state.split("pinnable")[0]


def test_help_is_short_and_each_commands_help_lists_its_flags(tmp_path, monkeypatch):
  # The commands, a line each, and how to list one command's flags; no flag's help.
  out = _cli(tmp_path, "--help")
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert len(lines) <= 12 and "--config" not in out.stdout, out.stdout
  for command in ("train", "plan", "calibrate", "run"):
    assert any(re.match(rf"  {command} +\w", l) for l in lines), (command, out.stdout)
  assert "`python -m jaxtier train --help`" in out.stdout
  # A command's help: what it does and the flags it reads (absl's own help for each), not
  # those of the others.
  listed = lambda text: set(re.findall(r"^--(?:\[no\])?(\w+)", text, re.M))
  train, plan, calibrate = (_cli(tmp_path, command, "--help")
                            for command in ("train", "plan", "calibrate"))
  for got in (train, plan, calibrate):
    assert got.returncode == 0, got.stderr[-2000:]
  assert train.stdout.startswith("usage: python -m jaxtier train [--flags]\n\nTrains the "
                                 "example Flax NNX decoder"), train.stdout
  assert {"config", "steps", "clip", "clip_norm", "overlap_update", "checkpoint_dir",
          "device_budget"} <= listed(train.stdout), train.stdout
  assert not listed(train.stdout) & {"json", "stream", "plot", "details", "platform"}
  assert "--[no]overlap_update: Update the layers' params" in train.stdout
  assert {"config", "batch_size", "remat_policy", "json", "stream", "plot", "details",
          "verbose", "platform", "device_kind"} <= listed(plan.stdout), plan.stdout
  assert not listed(plan.stdout) & {"steps", "data", "seed", "checkpoint_dir", "json_out"}
  assert listed(calibrate.stdout) == {"json"}, calibrate.stdout
  run = _cli(tmp_path, "--help", "run")
  assert run.returncode == 0 and "--[no]strict" in run.stdout, run.stdout
  # run's help in the form of the others': usage, what it does, its flags (no module heading,
  # no absl wording of a repeated flag).
  assert run.stdout.startswith("usage: python -m jaxtier run [--flags] -- (script.py | -m "
                               "module) [script arguments]\n\nRuns an unmodified script"), run.stdout
  assert "\nflags (before --; the script's own, absl's included, follow it):\n--device_budget: " \
      in run.stdout, run.stdout
  assert listed(run.stdout) == {"device_budget", "host_budget", "plan_json", "policy", "step",
                                "strict"}, run.stdout
  assert ("--step: module:function (or a function's name, in any module) to wrap; repeat it "
          "for more (default: the first train step the script calls).") in _flat(run.stdout)
  assert "launcher" not in run.stdout and "repeat this option" not in run.stdout
  # A command's help says only what applies to it.
  flat_plan = _flat(plan.stdout)
  assert "plan:" not in plan.stdout and "json_out" not in plan.stdout, plan.stdout
  assert ("--tokenizer: <byte|bpe>: byte: each byte is a token (vocab 256); bpe: a byte-level "
          "BPE vocabulary of --vocab_size ids, as `train --tokenizer=bpe` trains; the model's "
          "vocab_size follows.") in flat_plan, plan.stdout
  assert ("--clip_norm: Clip gradients to this global norm (> 0; implies --clip, whose 1.0 it "
          "replaces).") in flat_plan
  assert "--[no]json: Print the plan as JSON (for tools), with 'fits'" in flat_plan
  assert "--[no]json: Print the profile as JSON (for tools)." in _flat(calibrate.stdout)
  assert "cached under $XDG_CACHE_HOME/jaxtier/tokenizers" in _flat(train.stdout)
  assert "with --clip or --clip_norm, clip_norm, each step's gradient norm" in _flat(train.stdout)
  # Each fitted to the terminal's width.
  monkeypatch.setenv("COLUMNS", "80")
  for args in (["--help"], ["run", "--help"], ["plan", "--help"], ["train", "--help"]):
    out = _cli(tmp_path, *args)
    assert out.returncode == 0 and max(map(len, out.stdout.splitlines())) <= 80, out.stdout
  top = _cli(tmp_path, "--help").stdout
  assert "  calibrate  measure this machine's links, memory and executors; store the\n" \
         "             profile\n" in top, top
  full = _cli(tmp_path, "--helpfull")
  assert full.returncode == 0 and "--verbosity" in full.stdout and "--steps" in full.stdout


def test_help_into_a_pipe_closed_early_ends_without_a_traceback(tmp_path):
  # `python -m jaxtier --help | head -3` (or a plan's --details): the reader is gone before
  # the text is written. The
  # process ends quietly with exit status 1, as Python's docs advise for a broken pipe (their
  # 'Note on SIGPIPE'), not with a BrokenPipeError traceback (or status 120 from the
  # interpreter's own flush at exit). A pipe whose read end is closed makes every write fail,
  # whatever the help's length.
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
  env.pop("PYTHONUNBUFFERED", None)  # stdout buffered, as a user's is
  asked = [["--help"], ["train", "--help"], ["--help", "run"], ["run", "--help"],
           ["--helpfull"], ["plan", "--config=tiny", "--details"]]
  procs = []
  for args in asked:
    read, write = os.pipe()
    os.close(read)
    procs.append(subprocess.Popen([sys.executable, "-m", "jaxtier", *args], stdout=write,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path))
    os.close(write)
  ended = []
  for args, proc in zip(asked, procs):
    err = proc.communicate(timeout=120)[1]
    ended.append((args, proc.returncode, err))
  assert ended == [(args, 1, "") for args in asked], ended
  # `train ... | head -1`: the reader goes after the first line; the next write in the
  # training fails (each line is written at once: PYTHONUNBUFFERED, or a long run's output
  # past stdout's buffer), and the run ends there, quietly.
  with subprocess.Popen([sys.executable, "-m", "jaxtier", "train", "--config=tiny",
                         "--steps=30", "--log_every=2"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, env=dict(env, PYTHONUNBUFFERED="1"),
                        cwd=tmp_path) as train:
    assert train.stdout.readline().startswith("config tiny:")
    train.stdout.close()
    err = train.stderr.read()
    train.wait(timeout=300)
  assert train.returncode == 1 and "BrokenPipe" not in err, err[-2000:]
  assert "Traceback" not in err and "error:" not in err, err[-2000:]


def test_an_unknown_or_missing_command_is_named_in_a_short_usage(tmp_path):
  commands = "; expected one of train, plan, calibrate, run"
  # After a command, the list of commands would read as if the command were wrong.
  for args, got in ((["bogus"], "unknown command 'bogus'" + commands),
                    ([], "no command given" + commands),
                    (["train", "extra"], "unexpected arguments ['extra'] after 'train'; flags "
                                         "take --name=value, and one command is given")):
    out = _cli(tmp_path, *args)
    assert out.returncode == 2
    assert out.stderr.startswith(f"python -m jaxtier: {got}.\nusage: python -m jaxtier "
                                 "{train|plan|calibrate|run}"), out.stderr
    assert len(out.stderr.splitlines()) == 2, out.stderr


@pytest.mark.slow
def test_a_plan_over_the_device_budget_names_the_remat_policy(tmp_path):
  # The 1b step's activations are most of an 8 GiB budget's overrun: the fixes name the policy
  # that recomputes them, unless it is the one planned.
  flags = ["plan", "--config=1b", "--platform=gpu", "--device_budget=8GiB"]
  kept = _cli(tmp_path, *flags, timeout=300)
  assert kept.returncode == 1, kept.stderr[-2000:]
  assert "; --remat_policy=nothing_saveable (the layers' activations recomputed in the " \
         "backward pass, not kept);" in _flat(kept.stdout)
  remat = _cli(tmp_path, *flags, "--remat_policy=nothing_saveable", timeout=300)
  assert remat.returncode == 1, remat.stderr[-2000:]
  assert "from the command line: " in remat.stdout and "--remat_policy=" not in remat.stdout


@pytest.mark.slow
def test_a_plan_that_does_not_fit_says_so_once_and_names_no_host_fix(tmp_path):
  # 8 MiB is under the tiny decoder's peak: the plan's notes say DOES NOT FIT, and no log line
  # says it again. The device budget is the limit missed, not the host's: the fixes name
  # neither --host_budget nor XLA's pinned pool (for a GPU too).
  for platform in ("cpu", "gpu"):
    out = _cli(tmp_path, "plan", "--config=tiny", "--device_budget=8MiB",
               f"--platform={platform}")
    assert out.returncode == 1, out.stderr[-2000:]
    said = out.stdout + out.stderr
    assert said.count("DOES NOT FIT") == 1, said[-3000:]
    assert "DOES NOT FIT: no placement the planner can make fits the budgets" in (
        _flat(out.stdout))
    hint = _said(out.stdout, "from the command line:")
    assert hint.startswith("from the command line: a larger --device_budget; "), hint
    assert "--host_budget" not in hint and "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" not in hint, hint
  # The same verdict as fields (the CPU's: test_plan_json_over_budget_not_refused_exits_1).
  plan = json.loads(_cli(tmp_path, "plan", "--config=tiny", "--device_budget=8MiB",
                         "--platform=gpu", "--json").stdout)
  assert [v["limit"] for v in plan["violations"]] == ["device_budget"], plan["violations"]
  assert plan["violations"][0]["limit_bytes"] == 8 * 2**20 == plan["planned_device_budget"]
  assert plan["violations"][0]["need_bytes"] > 8 * 2**20 and not plan["fits"]


@pytest.mark.slow
def test_a_plan_over_the_host_budget_names_the_host_fixes(tmp_path):
  # Refused over --host_budget: the host's limit is the one missed, and the fixes say so.
  out = _cli(tmp_path, "plan", "--config=tiny", "--platform=gpu", "--host_budget=1KB",
             "--offload=optimizer_state_on_host")
  assert out.returncode == 1, out.stderr[-2000:]
  assert "REFUSED: plan refused before allocating anything: it needs 3.75 MiB" in _flat(
      out.stdout)
  hint = _said(out.stdout, "from the command line:")
  # No --device_budget was given: the budget is the device's memory, no larger one to ask for.
  # --host_budget refused it, not XLA's pool; the batch does not change the pinned bytes, and
  # tiny is the smallest config. Under auto the moments may stay on the device.
  assert hint == ("from the command line: a larger --host_budget, where it is the limit; "
                  "--offload=auto (keeps on the device what fits there)"), hint


@pytest.mark.slow
def test_a_plan_over_the_gpu_without_a_budget_asks_for_no_larger_budget(tmp_path):
  # A batch no H200 holds, no --device_budget given: the plan was told to raise a budget it
  # never set. The fixes are the batch and the activations.
  out = _cli(tmp_path, "plan", "--config=tiny", "--platform=gpu", "--batch_size=200000")
  assert out.returncode == 1, out.stderr[-2000:]
  hint = _said(out.stdout, "from the command line:")
  assert "--device_budget" not in hint and "a smaller --batch_size" in hint, hint
  assert "--config" not in hint, hint  # tiny has no smaller config


def test_a_state_over_the_device_budget_is_not_told_to_shrink_activations(tmp_path):
  # The small decoder's state alone is over 8 MiB with its moments on the host: fewer
  # activations or a smaller batch cannot fit it; streaming the layers' params may.
  out = _cli(tmp_path, "plan", "--config=small", "--device_budget=8MiB",
             "--offload=optimizer_state_on_host")
  assert out.returncode == 1, out.stderr[-2000:]
  hint = _said(out.stdout, "from the command line:")
  assert hint == ("from the command line: --offload=stream (the layers' params streamed from "
                  "pinned_host too); a larger --device_budget; a smaller --config"), hint


def test_the_nostream_hint_is_shown_only_where_nostream_kept_the_planner_from_streaming(
    tmp_path):
  # Over the device budget under auto, --nostream forbade what may fit: the hint says so. Not
  # without --nostream, nor under a policy that streams nothing whatever the flag.
  hint = "without --nostream (the planner may stream the layers' params from pinned_host)"
  flags = ["plan", "--config=tiny", "--device_budget=8MiB"]
  for extra, shown in (([], False), (["--nostream"], True),
                       (["--nostream", "--offload=optimizer_state_on_host"], False)):
    out = _cli(tmp_path, *flags, *extra)
    assert out.returncode == 1, out.stderr[-2000:]
    fixes = _said(out.stdout, "from the command line:")
    assert (hint in fixes) == shown, (extra, fixes)


@pytest.mark.slow
def test_train_fixes_for_a_refusal_name_the_limit_that_refused_it(monkeypatch):
  # JAX's device allocator refused the plan (admission on a GPU): the host is not the limit,
  # so --host_budget is no fix. Over the pinned host memory it is.
  import dataclasses  # pylint: disable=g-import-not-at-top

  import jaxtier.__main__ as cli  # pylint: disable=g-import-not-at-top
  from jaxtier._src.planning import admission  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import train_state  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  _, state, step = train_state.make_train_state("tiny", 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((1, 33), jax.numpy.int32)
  plan = jaxtier.plan(step, state, tokens)
  with pytest.raises(jaxtier.AdmissionError) as device:
    admission.admit_device(dataclasses.replace(plan, compiler_peak_hbm_bytes=130 * 2**30),
                           int(0.75 * 135.3 * 2**30))
  assert device.value.limit == "device_memory"
  fixes = cli._admission_fixes(device.value, "auto")
  assert fixes == ["--offload=stream (the layers' params streamed from pinned_host)",
                   "--remat_policy=nothing_saveable (fewer activations kept for the backward "
                   "pass)", "a smaller --batch_size, --seq_len or --config"]
  assert cli._admission_fixes(device.value, "stream")[0].startswith("--remat_policy=")
  # A jax.jit step (--offload=none) over the allocator: jaxtier's offload is the first fix.
  assert cli._admission_fixes(device.value, "none")[0] == (
      "--offload=auto (jaxtier places in pinned_host what the device cannot hold)")
  with pytest.raises(jaxtier.AdmissionError) as host:
    admission.admit(dataclasses.replace(plan, pinned_bytes=2 * 2**20, host_budget=2**20), None)
  assert host.value.limit == "host_limit"
  assert cli._admission_fixes(host.value, "auto") == [
      "raise --host_budget (where the host has the memory)", "a smaller --config"]
  # The smallest config (tiny) is told of no smaller one.
  assert cli._admission_fixes(host.value, "auto", smallest=True) == [
      "raise --host_budget (where the host has the memory)"]
  assert cli._admission_fixes(device.value, "auto", smallest=True)[-1] == (
      "a smaller --batch_size or --seq_len")
  # Where auto escalated to the streamed plan, the refusal lists the plans tried, and neither
  # the library nor the command line offers more state on the host as a fix.
  from jaxtier._src.planning.plan import Attempt, Escalation  # pylint: disable=g-import-not-at-top
  tried = tuple(Attempt(name=n, compiler_peak_hbm_bytes=gib * 2**30) for n, gib in (
      ("auto", 140), ("optimizer_state_on_host", 135), ("stream", 130)))
  escalated = dataclasses.replace(plan, compiler_peak_hbm_bytes=130 * 2**30, escalation=Escalation(
      limit_bytes=int(0.75 * 135.3 * 0.95 * 2**30), tried=tried, kept="stream", fits=False))
  with pytest.raises(jaxtier.AdmissionError) as over:
    admission.admit_device(escalated, int(0.75 * 135.3 * 2**30))
  assert ("The plans tried under auto, by their compiled step's peak device memory against the "
          "limit of 96.40 GiB: auto 140.00 GiB; optimizer_state_on_host 135.00 GiB; stream "
          "130.00 GiB.") in str(over.value), str(over.value)
  assert "keep more state in pinned_host" not in str(over.value)
  assert cli._admission_fixes(over.value, "auto")[0].startswith("--remat_policy=")


def test_plan_refuses_nostream_with_the_stream_policy(tmp_path):
  out = _cli(tmp_path, "plan", "--config=tiny", "--offload=stream", "--nostream")
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr == ("python -m jaxtier plan: --nostream contradicts --offload=stream, which "
                        "streams the layers' params from pinned_host: drop one of them; python "
                        "-m jaxtier plan --help lists its flags\n"), out.stderr[-2000:]


def test_train_refuses_a_json_out_it_could_not_write_before_training(tmp_path):
  # Checked when the flags are parsed: no step runs, so no result is lost at the end.
  out = _cli(tmp_path, "train", "--config=tiny", "--steps=1",
             f"--json_out={tmp_path}/missing/result.json")
  assert out.returncode == 2, out.stderr[-2000:]
  assert f"the folder of '{tmp_path}/missing/result.json'" in out.stderr, out.stderr[-2000:]
  assert "does not exist or is not writable" in out.stderr
  assert "step 1" not in out.stdout and "Traceback" not in out.stderr
  folder = _cli(tmp_path, "train", "--config=tiny", "--steps=1", f"--json_out={tmp_path}")
  assert folder.returncode == 2 and "is a folder; name a file in it" in folder.stderr


@pytest.mark.slow
def test_a_flag_the_command_does_not_read_is_said_to_be_ignored(tmp_path):
  # The commands share one flag namespace: `plan --steps=3` parsed, planned and never said
  # that --steps did nothing.
  out = _cli(tmp_path, "plan", "--config=tiny", "--steps=3", "--data=x.txt", "--batch_size=2")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "warning: python -m jaxtier plan does not use --steps, --data; ignored" in out.stderr
  # A boolean flag is named as typed.
  out = _train(tmp_path, "--nostream")  # (a small corpus: the default one takes seconds)
  assert "warning: python -m jaxtier train does not use --nostream; ignored" in out.stderr
  quiet = _cli(tmp_path, "plan", "--config=tiny", "--batch_size=2", "--nostream", "--verbose")
  assert quiet.returncode == 0 and "does not use" not in quiet.stderr, quiet.stderr[-2000:]


def test_train_refuses_a_negative_seed_and_log_every_zero_when_parsed(tmp_path):
  # Caught where the flags are parsed, naming the flag, not after the data was loaded.
  for flag, bound in (("--seed=-1", "--seed"), ("--log_every=0", "--log_every"),
                      ("--warmup_steps=-2", "--warmup_steps")):
    out = _cli(tmp_path, "train", "--config=tiny", "--steps=1", flag)
    assert out.returncode == 2, out.stdout[-2000:]
    assert bound in out.stderr and "step 1" not in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("args, says", [
    (["plan", "--nope"], "python -m jaxtier plan: Unknown command line flag 'nope'; "
                         "python -m jaxtier plan --help lists its flags"),
    (["train", "--confg=tiny"], "python -m jaxtier train: Unknown command line flag 'confg'. "
                                "Did you mean: config ?; python -m jaxtier train --help lists "
                                "its flags"),
    (["--config=huge", "plan"], "python -m jaxtier plan: flag --config=huge: value should be one "
                                "of <tiny|small|1b|8b|12b|13b|14b|15b|16b|17b>; python -m "
                                "jaxtier plan --help lists its flags"),
    (["train", "--seed=-1"], "python -m jaxtier train: flag --seed=-1: -1 is not a "
                             "non-negative integer; python -m jaxtier train --help lists its "
                             "flags"),
    (["train", "--learning_rate=nan"], "python -m jaxtier train: flag --learning_rate=nan: "
                                       "expected a finite learning rate > 0, got nan; python -m "
                                       "jaxtier train --help lists its flags"),
    (["train", "--data=no_such.txt"], "python -m jaxtier train: flag --data=no_such.txt: no "
                                      "such file: no_such.txt; python -m jaxtier train --help "
                                      "lists its flags"),
    (["train", "--checkpoint_dir=a_file"], "python -m jaxtier train: flag "
                                           "--checkpoint_dir=a_file: 'a_file' is a file, not a "
                                           "folder; name a folder; python -m jaxtier train "
                                           "--help lists its flags"),
    (["calibrate", "--batch_size"], "python -m jaxtier calibrate: Missing value for flag "
                                    "--batch_size; python -m jaxtier calibrate --help lists its "
                                    "flags"),
    (["run", "--nope", "--", "script.py"], "python -m jaxtier run: Unknown command line flag "
                                           "'nope'; python -m jaxtier run --help lists its flags"),
    (["--nope"], "python -m jaxtier: Unknown command line flag 'nope'; python -m jaxtier --help "
                 "lists the commands"),
])
def test_a_bad_flag_is_said_in_one_line_with_exit_status_2_on_every_command(tmp_path, args,
                                                                             says):
  # As the command line's other usage errors (an unknown command; run's), not absl's
  # 'FATAL Flags parsing error' and exit status 1. Bad values of the files a run reads and
  # writes are said so before anything is built (a checkpoint folder that is a file was an
  # error after the last step, every checkpoint lost).
  (tmp_path / "a_file").write_text("")
  out = _cli(tmp_path, *args)
  assert (out.returncode, out.stdout, out.stderr) == (2, "", says + "\n")


def test_plan_details_lists_every_leaf_within_the_width(tmp_path, monkeypatch):
  # --details: one line per leaf, its reason under it, and every note; no line over the
  # terminal's width.
  monkeypatch.setenv("COLUMNS", "80")
  plan = _cli(tmp_path, "plan", "--config=tiny", "--details")
  assert plan.returncode == 0, plan.stderr[-2000:]
  rows = [l for l in plan.stdout.splitlines() if re.match(r"\[[01]\]\S* ", l)]
  assert len(rows) == 39, plan.stdout  # the tiny state's leaves
  assert {l.split()[-1] for l in rows} == {"device"}
  assert any(l.startswith("    parameter: ") for l in plan.stdout.splitlines())
  assert max(len(l) for l in plan.stdout.splitlines()) <= 80
  assert "note: transient device bytes" in plan.stdout


@pytest.mark.slow
def test_train_clip_norm_clips_and_reports_the_steps_it_clipped(tmp_path):
  # A max norm under every step's gradient norm: each timed step clips. The summary says so in
  # one line (wrapped at the terminal's width), each step's line gives its norm, and
  # --json_out has the figures.
  out = _train(tmp_path, "--clip_norm=1e-6", "--steps=3", "--log_every=1", "--offload=none",
               f"--json_out={tmp_path / 'r.json'}")
  assert out.returncode == 0, out.stderr[-2000:]
  said = json.loads((tmp_path / "r.json").read_text())
  assert said["clip_norm"] == 1e-6 and said["clipped_fraction"] == 1.0
  assert len(said["grad_norms"]) == 3 and said["grad_norm"]["steps"] == 2
  assert re.fullmatch(r"clip: max norm 1e-06, over it \(clipped\) on 2 of 2 timed steps; "
                      r"gradient norm min [\d.]+, median [\d.]+, max [\d.]+",
                      _said(out.stdout, "clip: ")), out.stdout
  steps = [l for l in out.stdout.splitlines() if l.startswith("step ")]
  assert len(steps) == 2 and all(re.search(r"ms/step  gnorm [\d.e+-]+$", l) for l in steps), steps
  bad = _train(tmp_path, "--clip_norm=0")
  assert bad.returncode != 0 and "--clip_norm must be a finite number > 0" in bad.stderr


@pytest.mark.slow
def test_train_stops_at_the_first_non_finite_loss_with_the_step_and_a_hint(tmp_path):
  # --learning_rate=1e6 trained 20 NaN steps and exited 0.
  out = _train(tmp_path, "--learning_rate=1e6", "--steps=20", f"--json_out={tmp_path / 'r.json'}")
  assert out.returncode == 1, out.stderr[-2000:]
  said = json.loads((tmp_path / "r.json").read_text())
  assert said["ended"] == "non_finite_loss", said
  losses = said["losses"]
  bad = next(i for i, x in enumerate(losses) if not math.isfinite(x)) + 1
  assert bad == len(losses) < 20  # stopped at the first non-finite loss, not after the run
  assert f"error: the loss at step {bad} is nan: training stopped there" in out.stderr
  assert "lower --learning_rate (it is 1e+06)" in out.stderr
  assert not any(l.startswith(f"step {bad + 2:>6}/") for l in out.stdout.splitlines())
  assert "done: loss" not in out.stdout and "Traceback" not in out.stderr


@pytest.mark.slow
def test_train_interrupted_then_run_again_resumes_with_an_uninterrupted_runs_losses(tmp_path):
  # Ctrl-C (SIGINT) at a random step of `train --checkpoint_dir=D` saves a checkpoint at the
  # end of that step and exits 130; the same command again resumes from it, and its losses
  # are those of a run never interrupted, exactly.
  text = tmp_path / "text.txt"
  text.write_text(json.__doc__ * 40)
  steps, at = 200, random.Random().randint(3, 15)
  flags = ["train", "--config=tiny", f"--steps={steps}", "--batch_size=2", "--seq_len=16",
           f"--data={text}", "--log_every=1", "--offload=optimizer_state_on_host"]
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
             PYTHONUNBUFFERED="1")
  kept = [f"--checkpoint_dir={tmp_path / 'D'}", "--checkpoint_every=50"]
  first = subprocess.Popen([sys.executable, "-m", "jaxtier", *flags, *kept,
                            f"--json_out={tmp_path / 'first.json'}"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
  for line in first.stdout:
    if line.startswith(f"step {at:>6}/"):
      first.send_signal(signal.SIGINT)
      break
  stdout, stderr = first.communicate(timeout=120)
  assert first.returncode == 130, (at, stderr[-2000:])
  said = json.loads((tmp_path / "first.json").read_text())
  stopped = said["losses"] and len(said["losses"])
  assert said["ended"] == "interrupted" and at <= stopped < steps, (at, said)
  saved = str(tmp_path / "D" / f"step_{stopped:08d}")
  assert said["checkpoint"] == saved
  assert (f"interrupted at step {stopped} (Ctrl-C): the newest checkpoint is {saved}; the same "
          "command resumes from it") in stderr, stderr[-2000:]
  again = subprocess.run([sys.executable, "-m", "jaxtier", *flags, *kept,
                          f"--json_out={tmp_path / 'again.json'}"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
  assert again.returncode == 0, again.stderr[-2000:]
  assert f"resuming from {saved} (step {stopped} of {steps})" in again.stdout
  whole = _cli(tmp_path, *flags, f"--json_out={tmp_path / 'whole.json'}", timeout=300)
  assert whole.returncode == 0, whole.stderr[-2000:]
  resumed = json.loads((tmp_path / "again.json").read_text())
  reference = json.loads((tmp_path / "whole.json").read_text())
  assert resumed["ended"] == "completed" and resumed["resumed_from"] == stopped
  assert resumed["losses"][stopped:] == reference["losses"][stopped:]
  assert resumed["losses"][:stopped] == said["losses"]  # kept with the checkpoint
  # The newest 3 checkpoints are kept (every 50 steps and the last).
  assert sorted(p.name for p in (tmp_path / "D").iterdir()) == [
      f"step_{n:08d}{ext}" for n in (100, 150, 200) for ext in ("", ".json")]


@pytest.mark.slow
def test_the_example_run_as_a_module_ends_a_ctrl_c_as_train_does(tmp_path):
  # `python -m jaxtier.examples.train` (as `python -m jaxtier run` starts it too): Ctrl-C in
  # the training loop says at which step and what was kept, and exits 130, no traceback.
  text = tmp_path / "text.txt"
  text.write_text(json.__doc__ * 40)
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
             PYTHONUNBUFFERED="1")
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxtier.examples.train", "--config=tiny", "--steps=2000",
       "--batch_size=2", "--seq_len=16", f"--data={text}", "--log_every=1",
       f"--json_out={tmp_path / 'out.json'}"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
  for line in proc.stdout:
    if line.startswith(f"step {3:>6}/"):
      proc.send_signal(signal.SIGINT)
      break
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 130, stderr[-2000:]
  said = json.loads((tmp_path / "out.json").read_text())
  stopped = len(said["losses"])
  assert said["ended"] == "interrupted" and 3 <= stopped < 2000, said
  assert (f"interrupted at step {stopped} (Ctrl-C): nothing was saved (--checkpoint_dir keeps "
          "the run)") in stderr, stderr[-2000:]
  assert "Traceback" not in stderr, stderr[-2000:]


# Where a Ctrl-C lands while `train` starts: after the import of a module (`-X importtime`
# says when each ends), a number of imports after it, and seconds after that. First, right
# after jaxtier's first lines and on during the imports; then in JAX's import once its garbage
# collector callback is in (a KeyboardInterrupt raised in that callback was ignored, and the
# run went on); once JAX, Flax and the trainer are imported. Each point is before `train.main`
# hands Ctrl-C back to Python (a fixed delay of a second or more can land after it on a fast
# machine).
_STARTING = [("jaxtier._src.early_interrupt", 1, delay) for delay in (0, 0.05, 0.3)] + [
    ("jax._src.lib", 0, 0), ("jax._src.lib", 0, 0.1), ("jax", 0, 0), ("flax.nnx", 0, 0),
    ("jaxtier.examples.train", 0, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("after,lines,delay", _STARTING)
def test_train_ctrl_c_while_starting_ends_in_its_line_and_130(tmp_path, after, lines, delay):
  # Nothing has started: one line says so, exit status 130; no traceback, and never ignored.
  text = tmp_path / "text.txt"
  text.write_text(json.__doc__ * 40)
  out = _early_ctrl_c.ctrl_c_while_starting(
      ["-m", "jaxtier", "train", "--config=tiny", "--steps=2000", "--batch_size=2",
       "--seq_len=16", f"--data={text}", f"--json_out={tmp_path / 'out.json'}"],
      after=after, lines=lines, delay=delay, cwd=tmp_path)
  assert out.returncode == 130, out.stderr[-3000:]
  assert out.stderr.split("\n") == ["", early_interrupt.BEFORE_TRAINING, ""], out.stderr[-3000:]
  assert not any(l.startswith("step ") for l in out.stdout.splitlines()), out.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("after,lines,delay", [
    ("jaxtier._src.early_interrupt", 1, 0.05), ("jax._src.lib", 0, 0), ("flax.nnx", 0, 0),
    ("jaxtier.examples.llama", 0, 0)])
def test_the_example_run_as_a_module_ends_a_ctrl_c_while_starting_as_train_does(
    tmp_path, after, lines, delay):
  text = tmp_path / "text.txt"
  text.write_text(json.__doc__ * 40)
  out = _early_ctrl_c.ctrl_c_while_starting(
      ["-m", "jaxtier.examples.train", "--config=tiny", "--steps=2000", "--batch_size=2",
       "--seq_len=16", f"--data={text}"], after=after, lines=lines, delay=delay, cwd=tmp_path)
  assert out.returncode == 130, out.stderr[-3000:]
  assert out.stderr.split("\n") == ["", early_interrupt.BEFORE_TRAINING, ""], out.stderr[-3000:]


def test_train_refuses_a_batch_that_cannot_fit_before_compiling_it(tmp_path):
  # --batch_size=100000 on the CPU: refused only after 130 s of XLA's constant folding. Now
  # from the shapes: the layers' inputs and the logits alone are 100000 x 128 x (2 x 128 + 256)
  # x 4 bytes = 24.4 GiB, over the host's memory (this machine's, or any under 24 GiB).
  text = tmp_path / "text.txt"
  text.write_text(json.__doc__ * 40)
  available = jaxtier.available_host_bytes()
  if available is None or available > 24 * 2**30:
    pytest.skip("needs a host with under 24 GiB of available memory")
  out = _cli(tmp_path, "train", "--config=tiny", "--steps=1", "--batch_size=100000",
             f"--data={text}", f"--json_out={tmp_path / 'r.json'}")
  assert out.returncode == 1, out.stderr[-2000:]
  said = json.loads((tmp_path / "r.json").read_text())
  assert said["ended"] == "refused" and said["error"].startswith(
      "AdmissionError: step refused before compiling it: a batch of 100000 x 128 tokens needs "
      "at least 24.42 GiB"), said
  assert "from the command line: a smaller --batch_size, or --seq_len" in out.stderr
  assert "constant folding" not in out.stderr.lower() and "step 1" not in out.stdout
