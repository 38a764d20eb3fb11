"""Units: rates printed with three significant digits, as the plan's compute source shows them."""

import pytest

import jaxtier
from jaxtier._src import units
from jaxtier._src.analysis import step_costs as step_costs_lib
from jaxtier._src.hardware import profile


def test_rates_print_with_three_significant_digits():
  assert [units.format_rate(x) for x in (0.4377, 0.000412, 80.54, 700.0, 4000.0, 2.3e9)] == [
      "0.438", "0.000412", "80.5", "700", "4000", "2.3e+09"]
  prof = profile.HardwareProfile(matmul_tflops=0.4377, hbm_gbps=12.34)
  costs = step_costs_lib.StepCosts(flops=1.0, elementwise_bytes=1.0, transient_bytes=0,
                                   transient_source="test")
  assert ("matmul FLOPs at 0.438 TFLOP/s plus elementwise bytes at 12.3 GB/s HBM"
          in costs.compute_source(prof))


def test_sizes_parse_as_written_and_bad_ones_are_refused_naming_what():
  assert units.parse_bytes("80GB") == 80 * 10**9
  assert units.parse_bytes("16GiB") == 16 * 2**30
  assert units.parse_bytes(512) == 512 and units.parse_bytes(None) is None
  with pytest.raises(ValueError, match=r"^parse_bytes: expected a size like 80GB"):
    units.parse_bytes("abc")
  with pytest.raises(ValueError, match=r"^host_budget: expected a size > 0 bytes"):
    units.parse_bytes(-1, "host_budget")
  assert [units.format_bytes(n) for n in (12, 3 * 2**20, 3 * 2**29)] == [
      "12 B", "3.00 MiB", "1.50 GiB"]


@pytest.mark.parametrize("value, bytes_", [(1.5, 1.5), ("1.5B", 1.5), ("0.5KiB", None),
                                           ("1.0001KB", 1000.1)])
def test_a_size_that_is_not_whole_bytes_is_refused_not_rounded(value, bytes_):
  # 1.5 was truncated to 1 byte. '0.5KiB' is 512 bytes, whole: taken.
  if bytes_ is None:
    assert units.parse_bytes(value) == 512
    return
  with pytest.raises(jaxtier.OptionError, match=rf"^jaxtier.offload: device_budget: expected a "
                     rf"whole number of bytes, got {value!r} \({bytes_:g} bytes\)") as err:
    units.parse_bytes(value, "jaxtier.offload: device_budget")
  assert (err.value.option, err.value.value) == ("device_budget", value)
  assert isinstance(err.value, ValueError) and isinstance(err.value, TypeError)


def test_whole_sizes_parse_exactly():
  # A decimal fraction of a unit is exact (no float rounding), and so is a float of whole bytes.
  assert units.parse_bytes("0.1KB") == 100 and units.parse_bytes("1.5GiB") == 3 * 2**29
  assert units.parse_bytes(2.0**40) == 2**40 and units.parse_bytes("1.25 MB") == 1_250_000
  for bad, why in ((True, r"expected bytes \(int\) or a size string, got bool True"),
                   (float("inf"), "expected a finite size"), ([8], "got list")):
    with pytest.raises(jaxtier.OptionError, match=why) as err:
      units.parse_bytes(bad, "host_budget")
    assert err.value.option == "host_budget" and err.value.value is bad


def test_format_share_keeps_a_small_share_from_reading_as_zero():
  assert [units.format_share(x) for x in (0.0, 0.0042, 0.00042, 0.0099, 0.01, 0.37, 1.0)] == [
      "0%", "0.42%", "0.042%", "0.99%", "1%", "37%", "100%"]
