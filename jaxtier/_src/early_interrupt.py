"""Ctrl-C (SIGINT) while a command line entry point starts, before its own handling is in place.

`python -m jaxtier ...` and `python -m jaxtier.examples.train` spend their first seconds
importing JAX, Flax and the rest. Python's default handler raises KeyboardInterrupt wherever the
signal lands: in an import, a traceback through it; in a garbage collector callback (JAX adds
one), "Exception ignored" and the run goes on. The handler installed here ends the process
instead, at once: one line on stderr and exit status 130, as a Ctrl-C before training does
later. Nothing has started, so nothing is lost.

It stays until the entry point's own handling begins (`restore`): `train`'s in the example
trainer's `main` (which writes --json_out), `run`'s just before the script starts (which sees
Python's default handler). `plan` and `calibrate` keep it to their end: they write nothing
until they are done.

Only the command line entry points install it: `python -m` imports a module's packages before
it runs the module, so `jaxtier/__init__.py` calls `install_for_main_module` first, and that
installs it only while `python -m` starts one of `ENTRY_POINTS`. `import jaxtier` from other
code leaves SIGINT as it is.
"""

import os
import signal
import sys

BEFORE_TRAINING = "interrupted (Ctrl-C) before training: nothing was saved"
BEFORE_SCRIPT = "jaxtier run: interrupted (Ctrl-C) before the script started"
INTERRUPTED = "interrupted (Ctrl-C)"

# The modules that are command line entry points when `python -m` runs them.
ENTRY_POINTS = ("jaxtier", "jaxtier.__main__", "jaxtier.examples.train")
# Python's short options that take a value (`-c` ends the options: its value is the program).
_VALUED = "cmWX"

_said: "str | None" = None  # the line of the handler installed; None where none is
_previous = None  # the handler it replaced


def said_for(module: str, argv: "list[str]") -> str:
  """The line said for a Ctrl-C while `python -m module` starts with `argv` (`sys.argv`: its
  first argument is the command of `python -m jaxtier`)."""
  if module == "jaxtier.examples.train":
    return BEFORE_TRAINING
  return {"train": BEFORE_TRAINING, "run": BEFORE_SCRIPT}.get(
      argv[1] if len(argv) > 1 else "", INTERRUPTED)


def main_module(orig_argv: "list[str]") -> "str | None":
  """The module that the interpreter command line `orig_argv` (`sys.orig_argv`) runs with
  `-m`; None where it runs a script, `-c` or standard input."""
  rest = list(orig_argv[1:])
  while rest:
    arg = rest.pop(0)
    if arg == "--check-hash-based-pycs":  # Python's one long option with a value
      rest = rest[1:]
    elif arg.startswith("--"):
      if arg == "--":
        return None
    elif not arg.startswith("-") or arg == "-":  # a script, or the program on standard input
      return None
    else:
      for i, option in enumerate(arg[1:], 2):  # a cluster of short options, as -Bm
        if option in _VALUED:
          value = arg[i:] or (rest.pop(0) if rest else None)
          if option == "m":
            return value
          if option == "c":
            return None
          break  # -W and -X: their value is skipped
  return None


def install_for_main_module() -> None:
  """`install`s the handler where this process is `python -m` of one of `ENTRY_POINTS`, while
  it starts: Python imports the module's packages (this one among them) while `sys.argv[0]` is
  still '-m'. Elsewhere it does nothing."""
  if sys.argv[:1] != ["-m"]:
    return
  module = main_module(list(getattr(sys, "orig_argv", [])))
  if module in ENTRY_POINTS:
    install(said_for(module, sys.argv))


def install(said: str) -> None:
  """From now until `restore`, SIGINT ends the process at once: `said` on stderr, exit status
  130.

  Only where Python's default handler (or this one) is installed: a process started with
  SIGINT ignored (in the background) keeps ignoring it, and a handler of the program's own is
  left alone. Only in the main thread, where Python runs signal handlers.
  """
  global _said, _previous
  handler = signal.getsignal(signal.SIGINT)
  if handler is _end:
    _said = said
  elif handler is signal.default_int_handler:
    _said, _previous = said, handler  # first: the handler may run as soon as it is installed
    try:
      signal.signal(signal.SIGINT, _end)
    except ValueError:  # not the main thread
      _said = _previous = None


def restore() -> None:
  """Puts back the handler `install` replaced (Python's default: Ctrl-C raises
  KeyboardInterrupt). Nothing where `install`'s is not the handler installed."""
  global _said, _previous
  if signal.getsignal(signal.SIGINT) is not _end:
    return
  try:
    signal.signal(signal.SIGINT, _previous)
  except ValueError:  # not the main thread: it stays until the main thread restores it
    return
  _said = _previous = None


def _end(signum: int, frame: object) -> None:
  """The handler: says `_said` and exits 130 at once, as `python -m jaxtier train` ends an
  interrupted run (no interpreter teardown, which can crash while XLA's threads run). The line
  is written to the file descriptor, not through `sys.stderr`, which the interrupted code may
  be writing to."""
  del signum, frame
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except  (closed, None, or being written)
      pass
  try:
    os.write(2, f"\n{_said or INTERRUPTED}\n".encode())
  except OSError:
    pass
  os._exit(130)
