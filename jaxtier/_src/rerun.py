"""Running the command line again with XLA settings that fit its plan (`train`, `run`)."""

from __future__ import annotations

import os
import sys

# Times a command runs itself again with XLA settings that fit its plan. The settings of a first
# re-run come from a plan predicted before compiling, and its compiled step may need more; XLA
# compiles against the allocator's limit, so a step compiled under a larger fraction may peak
# higher again (the 14b at batch 12 on the H200: 0.83, then 0.89, then 0.92).
MAX_RERUNS = 4


def rerun_with(settings: "dict[str, str]", *, allocated: str = "nothing was allocated") -> None:
  """Runs this command again with `settings` in its environment (XLA reads them when JAX
  starts, so they cannot take effect in this process), at most MAX_RERUNS times; returns where
  it may not: no settings, one of them set by the user, or the re-runs spent.

  JAXTIER_RERUN holds the re-runs so far and the settings they made, which a later re-run may
  change again. `allocated` says what this process had allocated (in the note printed).
  """
  runs, _, ours = os.environ.get("JAXTIER_RERUN", "0").partition(":")
  ours_set = set(filter(None, ours.split(",")))
  user_set = [k for k in settings if k in os.environ and k not in ours_set]
  if not settings or int(runs or 0) >= MAX_RERUNS or user_set:
    return
  said = " ".join(f"{k}={v}" for k, v in settings.items())
  print(f"note: the step fits with {said}, which XLA reads when JAX starts: running this "
        f"command again with it ({allocated})", file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  marker = f"{int(runs or 0) + 1}:{','.join(sorted(ours_set | set(settings)))}"
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
            dict(os.environ, JAXTIER_RERUN=marker, **settings))
