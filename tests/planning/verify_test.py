"""The check of a plan against the compiled step's `memory_analysis()`."""

import jax
import jax.numpy as jnp

from jaxtier._src.analysis import step_costs as step_costs_lib
from jaxtier._src.planning import verify as verify_lib

import jaxtier


def test_memory_figures_and_verify_without_analysis():
  class NoAnalysis:
    def memory_analysis(self):
      return None

  class Zeros:
    def memory_analysis(self):
      return type("M", (), {"argument_size_in_bytes": 0, "output_size_in_bytes": 0,
                            "temp_size_in_bytes": 0})()
  plan = type("Plan", (), {"device_budget": jaxtier.DeviceBudget.of(10), "pinned_bytes": 0})()
  assert (step_costs_lib.memory_figures(NoAnalysis()) is None
          and step_costs_lib.memory_figures(Zeros()) is None)
  assert verify_lib.verify(plan, NoAnalysis()) == (True, None)
  compiled = jax.jit(lambda x: (x * 2).sum()).lower(jnp.ones((256, 256))).compile()
  fig = step_costs_lib.memory_figures(compiled)
  assert fig is not None and fig.argument_bytes == 256 * 256 * 4
  ok, fig2 = verify_lib.verify(plan, compiled)
  assert not ok and fig2.peak_bytes == fig.peak_bytes >= 256 * 256 * 4


def _analysis(**sizes):
  class Compiled:
    def memory_analysis(self):
      return type("M", (), sizes)()
  return Compiled()


def test_host_arguments_come_out_of_a_peak_that_counts_them():
  plan = type("Plan", (), {"device_budget": jaxtier.DeviceBudget.of(1000),
                           "pinned_bytes": 0})()
  # No host figures (the CPU backend): the argument figure holds the host arguments the
  # program uses. 300 device bytes, 600 of the 800 host bytes used (jit dropped the leaves only
  # the update program reads): 600 come out.
  cpu = _analysis(argument_size_in_bytes=900, output_size_in_bytes=700,
                  alias_size_in_bytes=600, temp_size_in_bytes=400)
  ok, fig = verify_lib.verify(plan, cpu, device_argument_bytes=300, host_argument_bytes=800)
  assert ok and (fig.argument_bytes, fig.peak_bytes, fig.host_argument_bytes) == (300, 800, 600)
  # Host figures reported (a GPU): the argument figure is device memory only; nothing comes out.
  gpu = _analysis(argument_size_in_bytes=300, output_size_in_bytes=700,
                  alias_size_in_bytes=600, temp_size_in_bytes=400,
                  host_argument_size_in_bytes=800)
  ok, fig = verify_lib.verify(plan, gpu, device_argument_bytes=300, host_argument_bytes=800)
  assert ok and (fig.argument_bytes, fig.peak_bytes) == (300, 800)
