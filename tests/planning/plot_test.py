"""The plan drawn (`jaxtier.plot_plan`): without matplotlib it names the extra to install."""

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
