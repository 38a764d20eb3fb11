"""The verdict is made in one place (`admission.judge`), against one device budget
(`DeviceBudget`, set by `admission.plan_device_budget`)."""

import jax
import pytest

import jaxtier
from jaxtier._src.hardware import profile
from jaxtier._src.planning import admission
from jaxtier._src.planning.plan import Finding, Verdict

MiB = 2**20
OVER = Finding(sentence="predicted peak device memory 12.00 MiB exceeds the device budget of "
               "10.00 MiB", violations=(jaxtier.BudgetViolation(
                   limit="device_budget", need_bytes=12 * MiB, limit_bytes=10 * MiB),))
HOST = Finding(sentence="pinned bytes 5.00 MiB exceed the host limit of 4.00 MiB",
               violations=(jaxtier.BudgetViolation(
                   limit="host_limit", need_bytes=5 * MiB, limit_bytes=4 * MiB),))


def test_no_finding_fits():
  assert admission.judge((), jaxtier.DeviceBudget.of(10 * MiB)) == Verdict()
  assert Verdict().fits and not Verdict().violations and not Verdict().overruled


def test_a_finding_stands_against_the_budget_given():
  got = admission.judge([OVER, HOST], jaxtier.DeviceBudget.of(10 * MiB))
  assert not got.fits and got.findings == (OVER, HOST)
  assert [(v.limit, v.need_bytes, v.limit_bytes) for v in got.violations] == [
      ("device_budget", 12 * MiB, 10 * MiB), ("host_limit", 5 * MiB, 4 * MiB)]
  assert got.verdicts == (OVER.sentence, HOST.sentence) and not got.overruled


def test_a_capped_budget_missed_is_the_devices_memory_missed():
  capped = jaxtier.DeviceBudget(given=200 * MiB, usable=10 * MiB, source="capped")
  got = admission.judge([OVER], capped)
  assert not got.fits and [v.limit for v in got.violations] == ["device_memory"]
  assert got.violations[0].need_bytes == 12 * MiB
  # Not overruled by a compiled peak under it: the device's memory is not the budget planned.
  assert admission.judge([OVER], capped, 9 * MiB) == got


def test_the_compiled_peak_overrules_a_device_budget_finding_only():
  budget = jaxtier.DeviceBudget.of(10 * MiB)
  got = admission.judge([OVER], budget, compiler_peak_hbm_bytes=9 * MiB)
  assert got.fits and not got.violations and not got.verdicts and got.findings == (OVER,)
  assert got.overruled == (f"the prediction said: {OVER.sentence}; the compiled step's peak, "
                           "9.00 MiB, fits the budget",)
  # Over the budget compiled too, or a host limit missed as well: the findings stand.
  assert not admission.judge([OVER], budget, 11 * MiB).fits
  stands = admission.judge([OVER, HOST], budget, 9 * MiB)
  assert not stands.fits and [v.limit for v in stands.violations] == ["device_budget",
                                                                     "host_limit"]


def test_a_replan_budgets_findings_are_notes():
  replan = jaxtier.DeviceBudget.of(10 * MiB).replanned(6 * MiB)
  assert (replan.given, replan.usable, replan.source, replan.asked) == (
      10 * MiB, 6 * MiB, "re-plan", 6 * MiB)
  got = admission.judge([OVER, HOST], replan)
  assert got.fits and not got.violations and got.findings == (OVER, HOST)
  assert got.overruled == tuple(f"against the re-plan budget of 6.00 MiB, not yours: {f.sentence}"
                                for f in (OVER, HOST))
  # Judged again once compiled: the same verdict (its notes are not said twice).
  assert admission.judge(got.findings, replan, 7 * MiB) == got


def test_a_compiled_peak_over_the_budget_given_does_not_fit():
  # The prediction fitted (no finding), or the plan was made against a re-plan budget: the
  # compiled step's peak over the budget given is what misses it.
  compiled_over = ("the compiled step's peak device memory 11.00 MiB exceeds the device budget "
                   "of 10.00 MiB")
  for budget, findings in ((jaxtier.DeviceBudget.of(10 * MiB), ()),
                           (jaxtier.DeviceBudget.of(10 * MiB).replanned(6 * MiB), (OVER,))):
    got = admission.judge(findings, budget, 11 * MiB)
    assert not got.fits and got.verdicts[-1] == compiled_over, got
    assert [(v.limit, v.need_bytes, v.limit_bytes) for v in got.violations] == [
        ("device_budget", 11 * MiB, 10 * MiB)]
    assert got.findings == findings  # (judged again, it is not said twice)
    assert admission.judge(got.findings, budget, 11 * MiB) == got
    assert admission.judge(findings, budget, 10 * MiB).fits
  # A finding over the budget that stands says it already; none given: none to miss.
  assert len(admission.judge([OVER], jaxtier.DeviceBudget.of(10 * MiB), 11 * MiB).verdicts) == 1
  assert admission.judge((), jaxtier.DeviceBudget(), 11 * MiB).fits


def test_the_budget_planned_against():
  d = profile.DEFAULT_PROFILE
  given, notes = admission.plan_device_budget(10 * MiB, "cpu", d)
  assert given == jaxtier.DeviceBudget(given=10 * MiB, usable=10 * MiB, source="given")
  assert notes == [] and given.asked == 10 * MiB
  none, notes = admission.plan_device_budget(None, "cpu", d)
  assert none == jaxtier.DeviceBudget() and none.source == "none" and notes == []
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU here its allocator's limit is the figure")
  usable, why = admission.default_device_budget(d)
  default, notes = admission.plan_device_budget(None, "gpu", d)
  assert default == jaxtier.DeviceBudget(given=None, usable=usable, source="default")
  assert notes == [f"device budget: none given; planned against "
                   f"{jaxtier.format_bytes(usable)} ({why})"]
  capped, notes = admission.plan_device_budget(usable + 1, "gpu", d)
  assert (capped.given, capped.usable, capped.source) == (usable + 1, usable, "capped")
  assert len(notes) == 1 and "is above what JAX's allocator may use" in notes[0]
  # A re-plan's budget is planned against as it is.
  replan = jaxtier.DeviceBudget.of(usable).replanned(usable // 2)
  assert admission.plan_device_budget(replan, "gpu", d) == (replan, [])
