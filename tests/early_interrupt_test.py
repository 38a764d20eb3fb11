"""Ctrl-C while a command line entry point starts (`early_interrupt`): which processes install
the handler, and what it does where Python's default handler would lose the interrupt.

The entry points themselves, interrupted while they import, are tested in cli_test.py and
launcher_test.py.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jaxtier._src import early_interrupt


def test_the_module_python_runs_is_read_past_its_own_options():
  main_module = early_interrupt.main_module
  assert main_module(["python", "-m", "jaxtier", "train", "-m", "x"]) == "jaxtier"
  assert main_module(["python", "-mjaxtier.examples.train"]) == "jaxtier.examples.train"
  assert main_module(["python", "-X", "importtime", "-W", "ignore", "-u", "-m",
                      "jaxtier"]) == "jaxtier"
  assert main_module(["python", "-Bm", "jaxtier", "run"]) == "jaxtier"  # options clustered
  assert main_module(["python", "-Ximporttime", "-m", "jaxtier"]) == "jaxtier"
  assert main_module(["python", "--check-hash-based-pycs", "never", "-m", "jaxtier"]) == "jaxtier"
  # A script, a program (-c) or standard input: no module, whatever their arguments say.
  assert main_module(["python", "script.py", "-m", "jaxtier"]) is None
  assert main_module(["python", "-c", "import jaxtier", "-m", "jaxtier"]) is None
  assert main_module(["python", "-Bc", "import jaxtier"]) is None
  assert main_module(["python", "-", "-m", "jaxtier"]) is None
  assert main_module(["python"]) is None


def test_each_command_says_what_was_interrupted():
  said = early_interrupt.said_for
  assert said("jaxtier", ["-m", "train", "--config=tiny"]) == early_interrupt.BEFORE_TRAINING
  assert said("jaxtier.examples.train", ["-m"]) == early_interrupt.BEFORE_TRAINING
  assert said("jaxtier", ["-m", "run", "--", "script.py"]) == early_interrupt.BEFORE_SCRIPT
  assert said("jaxtier", ["-m", "plan"]) == early_interrupt.INTERRUPTED
  assert said("jaxtier", ["-m"]) == early_interrupt.INTERRUPTED


def test_install_replaces_only_pythons_default_handler_and_restore_puts_it_back():
  saved = signal.getsignal(signal.SIGINT)
  try:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    early_interrupt.restore()  # not installed: nothing to do
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    early_interrupt.install("interrupted")
    assert signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, saved)
    early_interrupt.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # A program's own handler, and SIGINT ignored, are left as they are.
    own = lambda signum, frame: None
    for handler in (own, signal.SIG_IGN):
      signal.signal(signal.SIGINT, handler)
      early_interrupt.install("interrupted")
      assert signal.getsignal(signal.SIGINT) is handler
      early_interrupt.restore()
      assert signal.getsignal(signal.SIGINT) is handler
  finally:
    signal.signal(signal.SIGINT, saved)


# A SIGINT that Python handles inside a garbage collector callback, as it may inside JAX's
# (`jax._src.lib`) while an entry point imports: the module is loaded from its file (it imports
# nothing of jaxtier's), so that no JAX is imported.
_IN_A_GC_CALLBACK = textwrap.dedent("""
    import gc, importlib.util, os, signal, sys
    spec = importlib.util.spec_from_file_location("early_interrupt", sys.argv[1])
    early_interrupt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(early_interrupt)
    if sys.argv[2] == "install":
      early_interrupt.install("interrupted (Ctrl-C) in a gc callback")

    def interrupt(phase, info):
      if phase == "start":
        gc.callbacks.remove(interrupt)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10):  # Python runs the handler here, in the callback
          pass

    gc.callbacks.append(interrupt)
    gc.collect()
    print("went on")
    """)


def test_a_ctrl_c_in_a_gc_callback_ends_the_process_in_a_line_not_ignored():
  run = lambda how: subprocess.run(
      [sys.executable, "-c", _IN_A_GC_CALLBACK, early_interrupt.__file__, how],
      capture_output=True, text=True, timeout=60, check=False)
  # Python's default handler: its KeyboardInterrupt is ignored, and the program goes on.
  default = run("default")
  assert default.returncode == 0 and default.stdout == "went on\n", default
  assert "Exception ignored" in default.stderr and "KeyboardInterrupt" in default.stderr
  ended = run("install")
  assert ended.returncode == 130 and ended.stdout == "", ended
  assert ended.stderr == "\ninterrupted (Ctrl-C) in a gc callback\n", ended.stderr


@pytest.mark.slow
def test_importing_jaxtier_leaves_sigint_to_the_program(tmp_path):
  # Only the command line entry points install the handler: `import jaxtier` from a script, a
  # program or another module run with `python -m` leaves Python's default.
  check = ("import signal, jaxtier; print(signal.getsignal(signal.SIGINT) is "
           "signal.default_int_handler)")
  (tmp_path / "uses_jaxtier.py").write_text(check)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for args in (["-c", check], ["-m", "uses_jaxtier"]):
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout == "True\n", (args, out.stderr[-2000:])
