"""How the example trainer keeps a run: numbered checkpoints in one directory, the newest resumed.

A checkpoint of the run after step ``n`` (steps counted from 1) is two entries of the run's
directory:

- ``step_0000000n/``: the training state written by orbax-checkpoint (through
  ``OffloadedStep.save``, the step's fp32 masters included, or, for a ``jax.jit`` step, an orbax
  ``StandardCheckpointer`` of the state alone);
- ``step_0000000n.json``: the run's settings that a resumed run must share, the step count and
  the losses so far. Written after the state, by a rename: a checkpoint is complete when both
  exist, and only a complete one is resumed or counted.

The batch order is a function of the seed and the step (`data.batches(start=...)`), so a run
resumed from step ``n`` reads the batches an uninterrupted run reads from there, and its losses
are that run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import _thread
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

_NAME = re.compile(r"step_(\d{8})")
# Orbax writes a state into a temporary directory beside its own, renamed when it is complete.
_TMP = re.compile(r"step_(\d{8})\.orbax-checkpoint-tmp.*")

# The settings a resumed run must share with its checkpoint's run: they fix the state's
# structure, the data and the batch order (`--steps` may differ: the schedule then follows it).
SHARED_SETTINGS = ("config", "batch_size", "seq_len", "seed", "data", "tokenizer", "vocab_size",
                   "learning_rate", "warmup_steps", "clip", "clip_norm", "offload")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """A complete checkpoint of a run.

  Attributes:
    path: the state's directory (``<checkpoint_dir>/step_0000000n``).
    step: the steps the run had completed when it was saved (n).
    losses: the loss of each of those steps (float per step).
    settings: the run's settings (`SHARED_SETTINGS` and ``steps``).
  """

  path: str
  step: int
  losses: tuple[float, ...]
  settings: dict[str, Any]


def path_of(directory: str, step: int) -> str:
  """The state directory of the checkpoint after `step` steps."""
  return os.path.join(os.path.abspath(directory), f"step_{step:08d}")


def _state_dirs(directory: str) -> list[tuple[int, str, bool]]:
  """(step, path, complete) of each checkpoint state directory in `directory` (orbax's
  temporary ones too), oldest first ([] when it does not exist); complete: not temporary, and
  its ``.json`` is there too."""
  if not os.path.isdir(directory):
    return []
  found = []
  for name in os.listdir(directory):
    m, tmp = _NAME.fullmatch(name), _TMP.fullmatch(name)
    path = os.path.join(os.path.abspath(directory), name)
    if (m or tmp) and os.path.isdir(path):
      found.append((int((m or tmp).group(1)), path,
                    m is not None and os.path.isfile(path + ".json")))
  return sorted(found)


def unfinished_state(directory: str, step: int) -> "str | None":
  """The path of what a save stopped midway left of the checkpoint after `step` steps (its
  state directory without its ``.json``, or orbax's temporary one), None where it left
  nothing."""
  return next((path for s, path, whole in _state_dirs(directory) if s == step and not whole),
              None)


def complete(directory: str) -> list[Checkpoint]:
  """The complete checkpoints in `directory`, oldest first; [] when it does not exist."""
  found = []
  for step, path, whole in _state_dirs(directory):
    if whole:
      with open(path + ".json") as f:
        record = json.load(f)
      found.append(Checkpoint(path, step, tuple(record["losses"]), record["settings"]))
  return found


def _step_of(path: str) -> int:
  return int((_NAME.fullmatch(os.path.basename(path)) or _TMP.fullmatch(
      os.path.basename(path))).group(1))


def incomplete(directory: str) -> list[str]:
  """The paths of the checkpoints in `directory` whose state was not finished (a state
  directory without its ``.json``: a save stopped midway), oldest first; [] when none."""
  return [path for _, path, whole in _state_dirs(directory) if not whole]


def check_resumable(checkpoint: Checkpoint, settings: dict[str, Any]) -> None:
  """Raises ValueError where `settings` (this run's) differ from `checkpoint`'s run in one of
  `SHARED_SETTINGS`, naming each, or where the checkpoint is at or past this run's last step."""
  saved = dict(checkpoint.settings)
  if "clip_norm" not in saved:  # saved before --clip_norm: --clip clipped to 1.0
    saved["clip_norm"] = 1.0 if saved.get("clip") else None
  differ = [f"--{k}={settings[k]!r} (the checkpoint's run: {saved.get(k)!r})"
            for k in SHARED_SETTINGS if saved.get(k) != settings[k]]
  if differ:
    raise ValueError(
        f"checkpoint {checkpoint.path} is of another run: {', '.join(differ)}; resume it with "
        "the settings it was saved with, or pass another --checkpoint_dir to start a new run")
  if checkpoint.step >= settings["steps"]:
    raise ValueError(
        f"checkpoint {checkpoint.path} is at step {checkpoint.step}, this run's last "
        f"(--steps={settings['steps']}): nothing is left to train; pass a larger --steps to go "
        "on, or another --checkpoint_dir to start a new run")


def save(directory: str, step: int, losses: list[float], settings: dict[str, Any],
         write_state: Callable[[str], None], keep: int) -> str:
  """Writes the checkpoint after `step` steps and keeps the newest `keep` complete ones.

  Args:
    directory: the run's checkpoint directory (made if missing).
    step: the steps completed.
    losses: the loss of each of them.
    settings: the run's settings (`SHARED_SETTINGS` and ``steps``).
    write_state: writes the state to the path it is given (which does not exist yet).
    keep: how many complete checkpoints to keep (>= 1); older ones are deleted.

  Returns:
    The state's path.
  """
  os.makedirs(directory, exist_ok=True)
  path = path_of(directory, step)
  if os.path.exists(path):
    if os.path.isfile(path + ".json"):
      return path  # saved already at this step
    shutil.rmtree(path)  # the state of a save that never completed
  write_state(path)
  with open(path + ".json.tmp", "w") as f:
    json.dump({"step": step, "losses": losses, "settings": settings}, f)
  os.replace(path + ".json.tmp", path + ".json")
  for old in complete(directory)[:-keep]:
    os.remove(old.path + ".json")  # incomplete first, then gone
    shutil.rmtree(old.path, ignore_errors=True)
  for older in incomplete(directory):  # saves stopped midway before this one: never resumed
    if _step_of(older) < step:
      shutil.rmtree(older, ignore_errors=True)
  return path


class SigintDeferred:
  """Within `deferred()`, a first Ctrl-C (SIGINT) sets `asked` instead of raising, so that the
  loop can stop at a step's end with its state whole; a second one raises KeyboardInterrupt at
  once. Outside it (or off the main thread, where Python delivers no signals) SIGINT acts as
  usual.

  Python may run the handler inside a garbage collector callback (jax registers one), where a
  raised KeyboardInterrupt is only printed as "Exception ignored" and the run goes on. Within
  `deferred()` such a KeyboardInterrupt is signalled again instead, 10 ms later from another
  thread (`_thread.interrupt_main`), so that it is raised in the code the callback interrupted.
  """

  def __init__(self):
    self.asked = False
    self.forced = False  # a second Ctrl-C came: it raised, wherever the run was

  @contextlib.contextmanager
  def deferred(self) -> Iterator["SigintDeferred"]:
    if threading.current_thread() is not threading.main_thread():
      yield self
      return

    def handler(signum, frame):
      del signum, frame
      if self.asked:
        self.forced = True
        raise KeyboardInterrupt
      self.asked = True

    unraisable = sys.unraisablehook

    def hook(info):
      if isinstance(info.exc_value, KeyboardInterrupt):
        # From another thread, a moment later: from here (still in the callback, or in the
        # starting of a thread) the handler would run at once, and raise where it is dropped.
        threading.Timer(0.01, _thread.interrupt_main, args=(signal.SIGINT,)).start()
      else:
        unraisable(info)

    previous = signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = hook
    try:
      yield self
    finally:
      sys.unraisablehook = unraisable
      signal.signal(signal.SIGINT, previous)
