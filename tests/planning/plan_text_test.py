"""The plan as text: a summary of at most 20 lines and a per-leaf table, both within the
terminal's width, long leaf paths shortened in the middle and never broken across lines."""

import dataclasses
import re

import pytest

from jaxtier._src.planning import plan_text
from jaxtier._src.planning.plan import DeviceBudget, LeafPlan, Plan, Verdict

MiB = 2**20
GiB = 2**30


def _leaf(index, path, placement, role, nbytes=4 * MiB, master=0):
  return LeafPlan(index=index, path=path, shape=(32, nbytes // 128 // 4), dtype="float32",
                  nbytes=nbytes, role=role, placement=placement,
                  memory_kind="device" if placement == "device" else "pinned_host",
                  master_nbytes=master, reason=f"{role} {index}: " + "why " * 60)


def _plan(**fields):
  """A plan of an 8b-like state (53 leaves with paths up to 63 characters), host updates, a
  re-plan, a long verdict and many notes."""
  names = ["wq", "wk", "wv", "wo", "w_up", "w_gate", "w_down", "attn_norm']['scale",
           "mlp_norm']['scale"]
  leaves = []
  for name in names:
    leaves.append(_leaf(len(leaves), f"[0]['layers']['attn']['{name}'].value", "device",
                        "param", 2 * GiB))
  for moment in ("mu", "nu"):
    for name in names:
      leaves.append(_leaf(len(leaves), f"[1]['opt_state'][0]['{moment}']['layers']['mlp']"
                          f"['{name}'].value", "host_cpu", "optimizer_state", 2 * GiB))
  leaves.append(_leaf(len(leaves), "[0]['embed']['embedding'].value", "host_stream", "param",
                      64 * MiB, master=128 * MiB))
  leaves.append(_leaf(len(leaves), "[1]['step'].value", "device", "other", 4))
  device = sum(l.nbytes for l in leaves if l.placement == "device")
  pinned = sum(l.nbytes + l.master_nbytes for l in leaves if l.placement != "device")
  base = dict(leaves=tuple(leaves), platform="gpu", device_bytes=device, pinned_bytes=pinned,
              device_budget=DeviceBudget.of(40 * GiB), host_budget=None, num_host_updates=12,
              predicted_step_secs=2.234, critical_path="host_dram",
              predicted_peak_hbm_bytes=72 * GiB, compiler_peak_hbm_bytes=70 * GiB,
              segments=(("forward+backward", 1.0, "compute"),),
              resource_secs={"compute": 1.0}, activation_policy="remat (nothing_saveable)",
              notes=tuple(f"note {i}: " + "detail " * 40 for i in range(8))
              + ("re-planned (1) against 38.00 GiB: the compiled peak was over the budget",),
              verdict=Verdict(fits=False, verdicts=(
                  "no placement the planner can make fits the budgets; " + "because " * 30,)),
              num_planning_notes=8, pinnable_bytes=64 * GiB, pinnable_what="the profile")
  base.update(fields)
  return Plan(**base)


@pytest.mark.parametrize("width", [80, 120])
def test_summary_fits_twenty_lines_of_the_width(width):
  text = _plan().summary(width)
  lines = text.splitlines()
  assert 10 <= len(lines) <= plan_text.SUMMARY_MAX_LINES
  assert max(len(l) for l in lines) <= width
  # Bytes per placement and role, the verdict, the re-plan, where the rest is.
  matrix = [l.split() for l in lines if l.split()[:1] in (["device"], ["host_cpu"],
                                                          ["host_stream"], ["total"])]
  assert [row[0] for row in matrix] == ["device", "host_cpu", "host_stream", "total"]
  assert matrix[0][1] == "10" and matrix[1][1] == "18" and matrix[3][1] == "29"
  assert lines[0] == "jaxtier plan (gpu): does not fit; 12 fused host updates/step"
  assert any(l.startswith("DOES NOT FIT: no placement") for l in lines)
  assert any(l.startswith("re-planned (1)") for l in lines)
  assert "fp32 masters" in text and "128.00 MiB" in text  # the masters' own row
  assert "2234 ms predicted (bound by host_dram)" in text and "70.00 GiB compiled" in text
  assert lines[-1] == "(each leaf and all 9 notes: plan.table())"
  assert "note 3" not in text  # the other notes are the table's


def test_summary_is_what_print_gives_at_the_terminals_width(monkeypatch, capsys):
  monkeypatch.setenv("COLUMNS", "120")
  plan = _plan()
  assert plan.summary() == plan.summary(120)
  monkeypatch.setenv("COLUMNS", "60")
  assert max(len(l) for l in plan.summary().splitlines()) <= 60
  monkeypatch.delenv("COLUMNS")
  print(plan.summary())
  out = capsys.readouterr().out  # not a terminal: 80 columns
  assert max(len(l) for l in out.splitlines()) <= 80


def test_a_long_path_is_shortened_in_the_middle_and_never_broken():
  path = "[1]['opt_state'][0]['mu']['layers']['mlp']['w_up'].value"
  short = plan_text.shorten_path(path, 35)
  assert short == "[1]['opt_state'][0]…['w_up'].value"
  assert plan_text.shorten_path(path, 200) == path
  for width in range(12, len(path)):
    got = plan_text.shorten_path(path, width)
    assert len(got) <= width and got.count("…") == 1
    head, tail = got.split("…")
    assert path.startswith(head) and path.endswith(tail)
  assert plan_text.shorten_path("x" * 50, 9) == "xxxx…xxxx"  # no parts: characters
  plan = _plan()
  for width in (80, 120):
    lines = plan.table(width, reasons=False).splitlines()
    assert max(len(l) for l in lines) <= width
    for leaf in plan.leaves:  # one line per leaf, its path whole or cut in the middle
      mine = [l for l in lines if re.match(r"\[\d\]", l) and
              (l.startswith(leaf.path + " ") or ("…" in l.split()[0]
               and leaf.path.startswith(l.split()[0].split("…")[0])
               and leaf.path.endswith(l.split()[0].split("…")[1])))]
      assert mine, (width, leaf.path)
  # At 80 columns the longest paths are cut, yet the moments stay told apart.
  lines = plan.table(80, reasons=False).splitlines()
  assert any("…" in l for l in lines)
  assert any(l.startswith("[1]['opt_state'][0]['mu']") for l in lines)


def test_table_has_every_leaf_its_reasons_and_every_note():
  plan = _plan()
  text = plan.table(240)
  for leaf in plan.leaves:
    row = next(l for l in text.splitlines() if l.startswith(leaf.path + " "))
    assert leaf.placement in row.split() and plan_text.shape_text(leaf.shape, leaf.dtype) in row
  assert text.count("why why") >= len(plan.leaves)
  for note in plan.notes:
    assert note.split(":")[0] in text
  bare = plan.table(100, reasons=False)
  assert "why" not in bare
  assert len([l for l in bare.splitlines() if re.match(r"\[\d\]", l)]) == len(plan.leaves)
  assert max(len(l) for l in plan.table(80).splitlines()) <= 80


def test_the_calibrate_hint_is_said_once_and_only_where_rates_are_not_this_machines():
  rates = "the default profile's H200 rates, not this machine's"
  uncalibrated = _plan(rates_of=rates, verdict=Verdict())
  for width in (80, 120):
    text = uncalibrated.summary(width)
    assert text.count("python -m jaxtier calibrate") == 1
    assert "times: uncalibrated H200 default rates: python -m jaxtier calibrate" in text
  assert "calibrate" not in _plan(verdict=Verdict()).summary(80)
  # On a GPU with no stored profile, its card's built-in rates (`profile.builtin_profile`).
  h100 = _plan(rates_of="the built-in H100 profile's rates, not this machine's",
               verdict=Verdict())
  text = h100.summary(120)
  assert "times: uncalibrated H100 built-in rates: python -m jaxtier calibrate" in text
  assert text.count("python -m jaxtier calibrate") == 1 and "H200" not in text


def test_fit_lines_wraps_at_words_and_marks_what_it_leaves_out():
  text = "alpha " * 40
  lines = plan_text.fit_lines(text, 30, max_lines=3)
  assert len(lines) == 3 and lines[-1].endswith("…") and max(map(len, lines)) <= 30
  assert all(l.strip().startswith("alpha") for l in lines)
  assert plan_text.fit_lines("short", 30) == ["short"]


def test_one_line_says_the_verdict_bytes_peak_and_step():
  plan = _plan()
  assert plan.one_line() == (
      "DOES NOT FIT; state: device 18.00 GiB, pinned_host 36.19 GiB (param, optimizer_state); "
      "peak HBM 70.00 GiB compiled, budget 40.00 GiB; step 2234 ms predicted")
  assert "\n" not in plan.one_line()
  fits = _plan(verdict=Verdict(), compiler_peak_hbm_bytes=None, predicted_step_secs=None,
               platform="cpu")
  assert fits.one_line().endswith("; peak device memory 72.00 GiB predicted, budget 40.00 GiB")
  assert fits.one_line().startswith("fits; ")
