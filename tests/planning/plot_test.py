"""The plan drawn (`jaxtier.plot_plan`): without matplotlib it names the extra to install."""

import re
import sys

from planning._toy import STEP, mlp_state, toy_batch
import pytest

import jaxtier


def test_plot_plan_without_matplotlib_names_the_plot_extra(monkeypatch, tmp_path):
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch())
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
  with pytest.raises(ImportError, match=r"needs matplotlib: pip install 'jaxtier\[plot\]'"):
    jaxtier.plot_plan(plan, str(tmp_path / "plan.png"))
  assert not (tmp_path / "plan.png").exists()


def test_axes_are_in_the_unit_the_bytes_reach(tmp_path):
  pytest.importorskip("matplotlib")
  from jaxtier._src.planning import plot
  assert plot.axis_unit(5 * 2**30) == ("GiB", 2**30)
  assert plot.axis_unit(2**30 - 1) == ("MiB", 2**20)
  assert plot.axis_unit(115 * 2**20) == ("MiB", 2**20)
  assert plot.axis_unit(3000) == ("KiB", 2**10)
  assert plot.axis_unit(12) == ("B", 1) and plot.axis_unit(0) == ("B", 1)
  # A small plan (all on the device, no budget): its device axis in KiB or MiB with the peak
  # labelled as `format_bytes` says it, and its empty pinned_host panel saying so over 0 to 1.
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch())
  assert plan.pinned_bytes == 0 and 2**10 <= plan.predicted_peak_hbm_bytes < 2**30
  fig = plot.plan_figure(plan)
  device, host = fig.axes
  unit = plot.axis_unit(plan.predicted_peak_hbm_bytes)[0]
  assert unit in ("KiB", "MiB") and device.get_title() == f"device (HBM), {unit} per device"
  peak = jaxtier.format_bytes(plan.predicted_peak_hbm_bytes)
  assert device.get_legend_handles_labels()[1] == [f"predicted peak {peak}"]
  assert device.get_xlim()[1] >= plan.predicted_peak_hbm_bytes / plot.axis_unit(
      plan.predicted_peak_hbm_bytes)[1]
  assert host.get_xlim() == (0.0, 1.0)
  assert [t.get_text() for t in host.texts] == ["nothing in pinned_host"]
  # With state in pinned_host, that panel draws it in its own unit, its total in the title.
  placed = jaxtier.plan(STEP, mlp_state(), toy_batch(), policy="optimizer_state_on_host")
  assert placed.pinned_bytes > 0
  host = plot.plan_figure(placed).axes[1]
  assert re.fullmatch(r"pinned host, (B|KiB|MiB) per device \(total (.*)\)",
                      host.get_title()).group(2) == jaxtier.format_bytes(placed.pinned_bytes)
  assert not host.texts
  assert jaxtier.plot_plan(placed, str(tmp_path / "plan.png")) == str(tmp_path / "plan.png")
  assert (tmp_path / "plan.png").stat().st_size > 0
