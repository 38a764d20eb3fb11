"""A plan drawn: device and pinned host bytes per leaf group (matplotlib)."""

from __future__ import annotations


def leaf_group(path: str, role: str) -> str:
  """A leaf's group for summaries: its role and first three named path components."""
  import re  # pylint: disable=g-import-not-at-top
  names = [a or b for a, b in re.findall(r"\['([^']+)'\]|\.([A-Za-z_]\w*)", path)]
  names = [n for n in names if n != "value"]
  return f"{role}: {'/'.join(names[:3]) or path}"


# Units for an axis of bytes, largest first: an axis is drawn in the largest that its largest
# figure reaches (at least 1 of it), so that a small model's bars do not read 0.0 GiB.
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def axis_unit(largest: float) -> tuple[str, int]:
  """The unit (name, bytes) to draw an axis whose largest figure is `largest` bytes in."""
  return next(((name, size) for name, size in _UNITS if largest >= size), _UNITS[-1])


def plot_plan(plan, path: str, *, title: str = "jaxtier plan") -> str:
  """Draws device and pinned host bytes per leaf group of `plan` into the image `path`.

  Two panels of horizontal bars (`plan_figure`): HBM (device state per group, with the
  predicted peak and the budget planned against as lines) and pinned host memory (host leaves
  and fp32 masters).

  Returns:
    The path written.

  Raises:
    ImportError: matplotlib is not installed (the `plot` extra).
  """
  fig = plan_figure(plan, title=title)  # (first: it names the extra where matplotlib is absent)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plan_figure(plan, *, title: str = "jaxtier plan"):
  """`plot_plan`'s figure (a `matplotlib.figure.Figure`, not closed). Each panel's axis is in
  the unit its largest figure reaches (`axis_unit`: GiB, MiB, KiB or B, per device); a panel
  with nothing to draw (no pinned_host bytes and no host budget) says so over an axis of 0 to 1.

  Raises:
    ImportError: matplotlib is not installed (the `plot` extra).
  """
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("jaxtier.plot_plan needs matplotlib: pip install 'jaxtier[plot]' (from a "
                      "checkout: pip install '.[plot]')") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from jaxtier._src.units import format_bytes  # pylint: disable=g-import-not-at-top

  groups: dict[str, list[float]] = {}
  for leaf in plan.leaves:
    g = groups.setdefault(leaf_group(leaf.path, leaf.role), [0.0, 0.0])
    if leaf.memory_kind == "device":
      g[0] += leaf.nbytes
    else:
      g[1] += leaf.nbytes
    g[1] += leaf.master_nbytes
  names = sorted(groups, key=lambda k: -(groups[k][0] + groups[k][1]))
  if plan.predicted_peak_hbm_bytes:
    transient = "transient: gradients, activations, workspace (predicted)"
    groups[transient] = [max(0, plan.predicted_peak_hbm_bytes - plan.device_bytes), 0.0]
    names.insert(0, transient)
  fig, axes = plt.subplots(1, 2, figsize=(13, 1.2 + 0.35 * max(4, len(names))), sharey=True)
  ys = range(len(names))
  budget = plan.device_budget.usable
  unit, size = axis_unit(max([groups[n][0] for n in names] + [
      plan.predicted_peak_hbm_bytes or 0, budget or 0]))
  axes[0].barh(ys, [groups[n][0] / size for n in names], color="tab:blue")
  axes[0].set_title(f"device (HBM), {unit} per device")
  if plan.predicted_peak_hbm_bytes:
    axes[0].axvline(plan.predicted_peak_hbm_bytes / size, color="tab:red", ls="--",
                    label=f"predicted peak {format_bytes(plan.predicted_peak_hbm_bytes)}")
  if budget:
    axes[0].axvline(budget / size, color="black", ls=":", label=f"budget {format_bytes(budget)}")
  host = [groups[n][1] for n in names]
  if any(host) or plan.host_budget:
    unit, size = axis_unit(max(host + [plan.host_budget or 0]))
    axes[1].barh(ys, [b / size for b in host], color="tab:orange")
    axes[1].set_title(f"pinned host, {unit} per device (total "
                      f"{format_bytes(plan.pinned_bytes)})")
    if plan.host_budget:
      axes[1].axvline(plan.host_budget / size, color="black", ls=":",
                      label=f"budget {format_bytes(plan.host_budget)}")
  else:
    axes[1].set_title("pinned host, per device")
    axes[1].set_xlim(0, 1)
    axes[1].set_xticks([])
    axes[1].text(0.5, 0.5, "nothing in pinned_host", transform=axes[1].transAxes,
                 ha="center", va="center", color="gray")
  axes[0].set_yticks(list(ys))
  axes[0].set_yticklabels(names, fontsize=8)
  axes[0].invert_yaxis()
  for ax in axes:
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8, loc="lower right")
  step = (f"predicted step {plan.predicted_step_secs * 1e3:.0f} ms, critical path "
          f"{plan.critical_path}" if plan.predicted_step_secs is not None else "")
  fig.suptitle(f"{title}\n{step}", fontsize=10)
  fig.tight_layout()
  return fig
