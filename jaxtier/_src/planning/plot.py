"""A plan drawn: device and pinned host bytes per leaf group (matplotlib)."""

from __future__ import annotations


def leaf_group(path: str, role: str) -> str:
  """A leaf's group for summaries: its role and first three named path components."""
  import re  # pylint: disable=g-import-not-at-top
  names = [a or b for a, b in re.findall(r"\['([^']+)'\]|\.([A-Za-z_]\w*)", path)]
  names = [n for n in names if n != "value"]
  return f"{role}: {'/'.join(names[:3]) or path}"


def plot_plan(plan, path: str, *, title: str = "jaxtier plan") -> str:
  """Draws device and pinned host bytes per leaf group of `plan` into the image `path`.

  Two panels of horizontal bars: HBM (device state per group, with the predicted peak and the
  budget planned against as lines) and pinned host memory (host leaves and fp32 masters).

  Returns:
    The path written.

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
  gib = 2.0**30
  fig, axes = plt.subplots(1, 2, figsize=(13, 1.2 + 0.35 * max(4, len(names))), sharey=True)
  ys = range(len(names))
  axes[0].barh(ys, [groups[n][0] / gib for n in names], color="tab:blue")
  axes[0].set_title("device (HBM), GiB per device")
  if plan.predicted_peak_hbm_bytes:
    axes[0].axvline(plan.predicted_peak_hbm_bytes / gib, color="tab:red", ls="--",
                    label=f"predicted peak {plan.predicted_peak_hbm_bytes / gib:.1f}")
  budget = plan.device_budget.usable
  if budget:
    axes[0].axvline(budget / gib, color="black", ls=":", label=f"budget {budget / gib:.1f}")
  axes[1].barh(ys, [groups[n][1] / gib for n in names], color="tab:orange")
  axes[1].set_title(f"pinned host, GiB per device (total {plan.pinned_bytes / gib:.1f})")
  if plan.host_budget:
    axes[1].axvline(plan.host_budget / gib, color="black", ls=":",
                    label=f"budget {plan.host_budget / gib:.1f}")
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
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
