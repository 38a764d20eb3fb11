"""Shared test setup: CPU tests run everywhere; GPU tests skip unless a GPU is present.

`JAXTIER_REQUIRE_GPU=1` (set by the H200 benchmark scripts) turns a GPU skip into a failure.
The planner's hardware profile cache (`jaxtier calibrate` writes it under XDG_CACHE_HOME) is a
fresh empty directory for the test session, so that a profile calibrated on this machine does
not change what the tests plan: every test sees the defaults unless it writes its own. Nor does
the planner measure this machine where it finds no profile (JAXTIER_AUTO_CALIBRATE=0, inherited
by the CLI's subprocesses): its figures would vary by machine and load, and each test's fresh
cache would measure again; the tests of that calibration turn it on. JAX's compilation cache is
a fresh directory for the session too (below).
"""

import atexit
import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import tempfile

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxtier-tests-cache-")
os.environ["JAXTIER_AUTO_CALIBRATE"] = "0"
# JAX's persistent compilation cache, fresh for the session as the profile cache is: a program
# compiled once (the example decoder's step, built and planned by many tests and by the CLI's
# and benchmarks' subprocesses, which inherit these variables) is loaded, not compiled again.
# The key is the program and its compile options, so a hit is the same executable; programs
# with host callbacks are never cached (JAX's rule). The pytest-xdist workers (below) share the
# session's directory where JAX can lock it (a size limit turns its file lock on; it needs the
# filelock package), so that no process reads an entry another is still writing; else each
# worker has its own.
_WORKER = "PYTEST_XDIST_WORKER" in os.environ
_LOCKED = importlib.util.find_spec("filelock") is not None
if not (_WORKER and _LOCKED and os.path.isdir(os.environ.get("JAX_COMPILATION_CACHE_DIR", ""))):
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxtier-tests-jit-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
if _LOCKED:
  os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
# Not the small programs (most of them single ops run eagerly): loading one costs what
# compiling it does.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
# Plans print as wide as the terminal (160 columns where there is none, as in CI): the tests
# that read a printed plan, here and in the CLI's subprocesses, see that width whatever the
# terminal (or pytest-xdist, which sets COLUMNS=80) says. A test that checks the wrapping sets
# its own COLUMNS.
os.environ["COLUMNS"] = "160"
# Ctrl-C as in a terminal, however the tests were started: a process started in the
# background (`nohup ... &`) inherits SIGINT ignored, and Python then installs no
# KeyboardInterrupt for it, nor do the CLI's subprocesses, which inherit the disposition. The
# tests of what jaxtier does on Ctrl-C need Python's default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)

import jax
import optax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
# The cache settings above, also where something imported JAX before this file set them.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
if _LOCKED:
  jax.config.update("jax_compilation_cache_max_size",
                    int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))


XDIST_WORKERS = 2


@pytest.fixture(autouse=True)
def _own_figures_cache(tmp_path, monkeypatch):
  """Each test its own figures cache (`analysis/figures_cache.py`): what a test compiles is
  not another test's to read, so the compiles a test counts are its own."""
  monkeypatch.setenv("JAXTIER_FIGURES_CACHE", str(tmp_path / "figures-cache"))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """Runs the tests on XDIST_WORKERS pytest-xdist workers (`-n 2 --dist worksteal`) where
  pytest-xdist is installed, the machine has the cores and JAX can only use the CPU, unless
  the command line says how (`-n 0` or `-p no:xdist`: in this process) or asks for what
  workers do not give (`-s`, `--pdb`) or names single tests (`file::test`). Most of the suite's
  time is single-threaded (XLA's compiles, the subprocesses' imports): on 2 cores this takes
  about a quarter off. Each worker imports this file, so it has its own caches above, and its
  tests run one at a time.

  Not `addopts = "-n 2"`: pytest fails on that where pytest-xdist is missing, and a GPU
  machine would start two processes on one GPU, each preallocating most of its memory.
  """
  if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
      or config.getoption("numprocesses", None) is not None
      or config.getoption("dist", "no") != "no" or config.getoption("usepdb", False)
      or config.getoption("capture", "fd") == "no"
      or (config.args and all("::" in a for a in config.args))
      or len(os.sched_getaffinity(0)) < XDIST_WORKERS or not _cpu_only()):
    return
  config.option.numprocesses = XDIST_WORKERS
  config.option.dist = "worksteal"  # balances by stealing; keeps a module's tests together


def _cpu_only() -> bool:
  """Whether JAX here can use no accelerator (told JAX_PLATFORMS=cpu, or no PJRT plugin such as
  jax-cuda12-plugin installed), known without starting a backend."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return True
  return not (importlib.metadata.entry_points(group="jax_plugins")
              or importlib.util.find_spec("jax_plugins") or importlib.util.find_spec("libtpu"))


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@pytest.fixture
def gpu():
  if not has_gpu():
    if os.environ.get("JAXTIER_REQUIRE_GPU") == "1":
      pytest.fail("JAXTIER_REQUIRE_GPU=1 but JAX sees no GPU")
    pytest.skip("needs a GPU")
  return jax.devices("gpu")[0]


def optax_train_step(tx, loss_fn):
  """`train_step(state, (x, y)) -> (state, {"loss": ...})` over `{"params", "opt"}` with `tx`."""
  def train_step(state, batch):
    x, y = batch
    loss, g = jax.value_and_grad(loss_fn)(state["params"], x, y)
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": loss}
  return train_step


class BackendCompiles:
  """Counts the backend (XLA) compiles JAX reports while `counting` (`with compiles.counting():`),
  by the name of the program compiled."""

  _EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.names: list[str] = []
    self._on = False
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _listen(self, event, secs, **kwargs):
    del secs
    if self._on and event == self._EVENT:
      self.names.append(str(kwargs.get("fun_name", "")))

  @contextlib.contextmanager
  def counting(self):
    self._on = True
    try:
      yield self
    finally:
      self._on = False


_BACKEND_COMPILES = []


def backend_compiles() -> BackendCompiles:
  """The process's `BackendCompiles` (JAX's listeners cannot be removed: one is registered)."""
  if not _BACKEND_COMPILES:
    _BACKEND_COMPILES.append(BackendCompiles())
  counter = _BACKEND_COMPILES[0]
  counter.names = []
  return counter


def pytest_terminal_summary(terminalreporter):
  """One line per reason the skipped tests give, with a count (most: they need a GPU)."""
  skipped = terminalreporter.stats.get("skipped", [])
  reasons: dict[str, int] = {}
  for report in skipped:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    reasons[reason] = reasons.get(reason, 0) + 1
  if reasons:
    terminalreporter.write_line(f"skipped: {len(skipped)} tests: " + "; ".join(
        f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])))
