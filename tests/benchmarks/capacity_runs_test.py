"""W4's choice of configs by the card's bound (`capacity_bench.capacity_runs`)."""

import os
import sys

import pytest

from jaxtier.examples import llama

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
import capacity_bench  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.parametrize("bound", [13.3e9, 17.85e9])  # an H100's and an H200's, 125 GiB host
def test_capacity_runs_cover_the_cards_bound_from_below(bound):
  runs = capacity_bench.capacity_runs(int(bound)).split(",")
  sizes = [llama.param_count(llama.CONFIGS[r.split(":")[0]]) for r in runs]
  assert len(runs) >= 2 and sizes == sorted(sizes)
  assert all(r.endswith(":auto:1") for r in runs)
  assert all(capacity_bench.MIN_OF_BOUND * bound <= n <= bound for n in sizes), sizes
  # Every config of that range is tried.
  inside = [n for n in map(llama.param_count, llama.CONFIGS.values())
            if capacity_bench.MIN_OF_BOUND * bound <= n <= bound]
  assert sorted(inside) == sizes


def test_capacity_runs_below_every_range_take_the_largest_under_it():
  runs = capacity_bench.capacity_runs(int(5e9))
  assert runs == "1b:auto:1"
