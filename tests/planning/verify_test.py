"""The check of a plan against the compiled step's `memory_analysis()`."""

import jax
import jax.numpy as jnp

from jaxtier._src.analysis import step_costs as step_costs_lib
from jaxtier._src.planning import verify as verify_lib


def test_memory_figures_and_verify_without_analysis():
  class NoAnalysis:
    def memory_analysis(self):
      return None

  class Zeros:
    def memory_analysis(self):
      return type("M", (), {"argument_size_in_bytes": 0, "output_size_in_bytes": 0,
                            "temp_size_in_bytes": 0})()
  plan = type("Plan", (), {"planned_device_budget": 10, "pinned_bytes": 0})()
  assert (step_costs_lib.memory_figures(NoAnalysis()) is None
          and step_costs_lib.memory_figures(Zeros()) is None)
  assert verify_lib.verify(plan, NoAnalysis()) == (True, None)
  compiled = jax.jit(lambda x: (x * 2).sum()).lower(jnp.ones((256, 256))).compile()
  fig = step_costs_lib.memory_figures(compiled)
  assert fig is not None and fig.argument_bytes == 256 * 256 * 4
  ok, fig2 = verify_lib.verify(plan, compiled)
  assert not ok and fig2.peak_bytes == fig.peak_bytes >= 256 * 256 * 4
