"""Verification: the planned step's compiled `memory_analysis()` against the plan's budget."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtier._src.analysis.step_costs import MemoryFigures, memory_figures


def verify(plan: Any, compiled: Any, *, device_argument_bytes: "int | None" = None,
           host_argument_bytes: "int | None" = None) -> "tuple[bool, MemoryFigures | None]":
  """Checks a compiled planned step against the plan's device budget.

  Reads `compiled.memory_analysis()` (a `jax.stages.Compiled`, or a `Lowered`, compiled here):
  per device, peak = argument + output - alias + temp bytes in device memory. Backends differ
  in whether `argument_size_in_bytes` counts pinned_host arguments (the CPU backend does and
  reports no host figures; on the H200 with jax 0.11.2, W5 measured the device peak 0.57 GiB
  under the figure, about the program's pinned_host arguments): when the argument figure
  reaches the device and host arguments together, the host arguments are taken out of the
  peak (their aliased outputs cancel in output - alias). Where the backend reports no host
  figures, the argument figure counts every host argument the program uses (jit drops the
  unused ones, such as the leaves only the update program reads): what it holds beyond the
  device arguments, up to the host arguments' bytes, is taken out.

  Args:
    plan: the `Plan` (its `device_budget.usable` is the limit).
    compiled: the planned step, compiled or lowered.
    device_argument_bytes, host_argument_bytes: the program's argument bytes per device in
      device memory and in pinned_host; None: unknown (then the plan's `pinned_bytes` are the
      host arguments, taken out when the backend reports no host figures).

  The metrics computed after the update (`Plan.tail_peak_hbm_bytes`) run in a program of
  their own: where their estimated peak is above the compiled one, it is the peak.

  Returns:
    (ok, figures): ok is False only when the backend reports figures and their peak exceeds
    the budget; figures is None when the backend reports none (nothing to check).
  """
  fig = memory_figures(compiled)
  if fig is not None:
    if host_argument_bytes is None or device_argument_bytes is None:
      host = int(getattr(plan, "pinned_bytes", 0) or 0)
      counted = not fig.host_argument_bytes
    elif not fig.host_argument_bytes:
      host = min(int(host_argument_bytes), max(0, fig.argument_bytes - device_argument_bytes))
      counted = True
    else:
      host = int(host_argument_bytes)
      # 1% slack for padding and small arguments (scalars, the batch).
      counted = fig.argument_bytes >= 0.99 * (device_argument_bytes + host)
    if host and counted:
      fig = dataclasses.replace(fig, argument_bytes=max(0, fig.argument_bytes - host),
                                peak_bytes=max(0, fig.peak_bytes - host),
                                host_argument_bytes=host)
  tail = getattr(plan, "tail_peak_hbm_bytes", None)
  if fig is not None and tail is not None and tail > fig.peak_bytes:
    # The metrics computed after the update run in a program of their own, after this one
    # (`Plan.tail_peak_hbm_bytes`): the step's peak is theirs where higher.
    fig = dataclasses.replace(fig, peak_bytes=tail)
  budget = plan.device_budget.usable
  if fig is None or budget is None:
    return True, fig
  return fig.peak_bytes <= budget, fig
