"""How the example trainer places and checks its state: the offload modes and the budget verdict."""

from __future__ import annotations

import contextlib
import logging

import jaxtier


def stream_layers_policy(path: str, leaf) -> "str | None":
  """`offload="stream"`: the layer stack's params stream from pinned_host; the rest auto."""
  return "host_stream" if leaf.role == "param" and "['layers']" in path else None


OFFLOAD_MODES = ("none", "auto", "stream", "optimizer_state_on_host")


@contextlib.contextmanager
def verdicts_printed():
  """Within it jaxtier logs no "DOES NOT FIT" warning: for a caller that prints the plan it
  makes, whose notes carry the same verdicts (said once, not twice)."""
  logger = logging.getLogger("jaxtier")
  keep = lambda record: not record.getMessage().startswith("jaxtier: DOES NOT FIT: ")
  logger.addFilter(keep)
  try:
    yield
  finally:
    logger.removeFilter(keep)


class OverBudgetError(ValueError):
  """`run(allow_over_budget=False)`: the plan does not fit the budget the caller gave.

  Raised after planning (the plan is printed) and before the first step; over the device
  budget, before the state is allocated (`jaxtier.offload` refuses the plan).
  """


def _flag_size(nbytes: int) -> str:
  """`nbytes` rounded up to a whole MiB (GiB from 10 GiB), as a size flag takes it: 91MiB."""
  import math  # pylint: disable=g-import-not-at-top
  if nbytes >= 10 * 2**30:
    return f"{math.ceil(nbytes / 2**30)}GiB"
  return f"{math.ceil(nbytes / 2**20)}MiB"


def over_budget(plan, offload: str, *, remat_policy: "str | None" = None) -> "str | None":
  """Why `plan` misses the device / host budget it was given, with the fix; None if it fits.

  Over when a budget was given and: the compiled step's peak device memory (else the
  predicted one) exceeds the device budget, the pinned bytes exceed the host budget, or the
  plan says it does not fit (`Plan.fits`; unless it was re-planned for a smaller budget and
  the compiled peak fits the one given). The fixes leave out what `offload` and
  `remat_policy` (the model's) already are.
  """
  given = plan.device_budget.given
  if given is None and plan.host_budget is None:
    return None
  problems, fixes = [], []
  predicted, compiled = plan.predicted_peak_hbm_bytes, plan.compiler_peak_hbm_bytes
  peak = compiled if compiled is not None else predicted
  usable = plan.device_budget.usable
  replanned = given is not None and usable is not None and usable < given
  note_over = not plan.fits and not (
      replanned and compiled is not None)
  device_over = given is not None and peak is not None and (peak > given or note_over)
  if device_over:
    figures = " and ".join(
        f"{jaxtier.format_bytes(b)} {what}" for b, what in ((predicted, "predicted"),
                                                     (compiled, "compiled")) if b is not None)
    problems.append(f"peak device memory {figures}, over the --device_budget of "
                    f"{jaxtier.format_bytes(given)}")
    # The compiled step's peak is what runs (the prediction may be above it).
    fixes.append(f"a larger --device_budget (at least {_flag_size(peak)})")
  host_over = plan.host_budget is not None and plan.pinned_bytes > plan.host_budget
  if host_over:
    problems.append(f"pinned host memory {jaxtier.format_bytes(plan.pinned_bytes)}, over the "
                    f"--host_budget of {jaxtier.format_bytes(plan.host_budget)}")
    fixes.append("a larger --host_budget")
  if note_over and not problems:
    problems.append(plan.verdicts[0])
    fixes.append("larger budgets")
  if not problems:
    return None
  # Under auto, the plans it tried with more state on the host once its own was over (their
  # peaks are in the plan's notes, printed before this).
  tried = getattr(plan, "escalation", None)
  if tried is not None:
    problems.append(f"no plan auto tried fits it ({', '.join(a.name for a in tried.tried)}: "
                    "the 'escalated' line above gives each one's peak)")
  if device_over:
    more_on_host = {
        "optimizer_state_on_host": "--offload=auto or --offload=stream (more state in "
                                   "pinned_host)",
        "auto": "--offload=stream (the layers' params streamed from pinned_host)",
    }.get(offload)
    if offload == "auto" and tried is not None and any(a.name == "stream" for a in tried.tried):
      more_on_host = None  # auto has tried it
    fixes.append(more_on_host or "a smaller --batch_size or --seq_len")
    # Activations are most of a small state's peak: saving fewer of them often fits.
    if remat_policy != "nothing_saveable":
      fixes.append("--remat_policy=nothing_saveable (fewer activations kept for the backward "
                   "pass)")
  return (f"the plan does not fit: {'; '.join(problems)}. Fix: {', or '.join(fixes)}; or "
          "--allow_over_budget to train anyway")


def jit_over_budget(program, device_budget, state_bytes: int, *,
                    remat_policy: "str | None" = None) -> "str | None":
  """Why the `jax.jit` step `program` (`--offload=none`: all `state_bytes` of state on the
  device; lowered or compiled) misses the `device_budget` given, with the fixes; None where
  it fits, where no budget is given, or where the backend reports no memory figures.

  Its peak is the compiled program's, as `jaxtier.admit` reads it (arguments + outputs -
  aliased + temporaries, or XLA's own peak where larger). The state pins no host memory: a
  host budget always holds.
  """
  from jaxtier._src.analysis import step_costs  # pylint: disable=g-import-not-at-top
  given = jaxtier.parse_bytes(device_budget, "--device_budget")
  if given is None:
    return None
  figures = step_costs.memory_figures(program)
  if figures is None or figures.peak_bytes <= given:
    return None
  fixes = ["--offload=auto (jaxtier places in pinned_host what the budget leaves no room for)",
           f"a larger --device_budget (at least {_flag_size(figures.peak_bytes)})"]
  if remat_policy != "nothing_saveable":
    fixes.append("--remat_policy=nothing_saveable (fewer activations kept for the backward "
                 "pass)")
  return (f"the step does not fit: peak device memory {jaxtier.format_bytes(figures.peak_bytes)}"
          f" compiled (jax.jit, all {jaxtier.format_bytes(state_bytes)} of state on the "
          f"device), over the --device_budget of {jaxtier.format_bytes(given)}. Fix: "
          f"{', or '.join(fixes)}")


# The share of the state's bytes that the example's CPU device budget leaves no room for.
CPU_OFFLOAD_SHARE = 0.5


def cpu_device_budget(train_step, state, *args, overlap_update: bool = True
                      ) -> "tuple[int, int] | None":
  """The device budget `run(offload="auto")` gives the planner on the CPU backend where none
  is given: the all-device plan's predicted peak less CPU_OFFLOAD_SHARE of the state's bytes,
  so that the planner places part of the state in pinned_host, as it would on a device too
  small for the step (docs/design.md, "The example offloads on the CPU").

  On the CPU backend device and pinned_host memory are the same RAM, so no budget is needed
  there; without one `auto` keeps every leaf on the device, and the example would show none of
  jaxtier's placements.

  Args:
    train_step: the step, as `jaxtier.offload` takes it.
    state, *args: its arguments (arrays or `jax.ShapeDtypeStruct`s; nothing is allocated).
    overlap_update: as `jaxtier.offload`'s.

  Returns:
    (budget, all-device peak), bytes per device; None where the plan predicts no peak.
  """
  plan = jaxtier.plan(train_step, state, *args, overlap_update=overlap_update)
  peak = plan.predicted_peak_hbm_bytes
  if peak is None:
    return None
  return peak - int(CPU_OFFLOAD_SHARE * (plan.device_bytes + plan.pinned_bytes)), peak


def placement_line(plan, why: str) -> str:
  """One line: the state's bytes in pinned_host under `plan` (of which roles), and `why`; where
  'auto' escalated to another plan (`Plan.escalation`), which one and why."""
  pinned = [leaf for leaf in plan.leaves if leaf.memory_kind == "pinned_host"]
  escalated = getattr(plan, "escalation", None)
  if escalated is not None and escalated.kept not in ("auto", "auto re-planned"):
    own = escalated.tried[0].compiler_peak_hbm_bytes
    why += (f"; planned as {escalated.kept}: auto's own plan compiles to "
            f"{jaxtier.format_bytes(own)}, over the {jaxtier.format_bytes(escalated.limit_bytes)}"
            " limit")
  if not pinned:
    return f"offload: all {jaxtier.format_bytes(plan.device_bytes)} of state on the device, {why}"
  order = ("param", "optimizer_state", "other")
  roles = " and ".join(sorted({str(leaf.role) for leaf in pinned},
                              key=lambda r: order.index(r) if r in order else len(order)))
  return f"offload: {roles} {jaxtier.format_bytes(plan.pinned_bytes)} in pinned_host, {why}"
