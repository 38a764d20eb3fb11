"""The plan as text for a terminal: a short summary, and the per-leaf table with every note.

Both fit `width` columns: no line is longer, and a leaf's path is never broken across lines
(a long one is shortened in the middle, `shorten_path`). `Plan.summary` and `Plan.table` call
these.
"""

from __future__ import annotations

import re
import shutil
import textwrap

from jaxtier._src.units import format_bytes, format_share
from jaxtier._src.vocab import Placement, Role

# Where the terminal's width is unknown (no terminal, no COLUMNS).
DEFAULT_WIDTH = 80
# The narrowest width laid out; a smaller one is taken as this.
MIN_WIDTH = 40
# The most lines `summary` prints.
SUMMARY_MAX_LINES = 20
# The most lines one finding (a verdict, a note) takes in the summary.
FINDING_MAX_LINES = 6
# The table's leaf column is kept at least this wide (or as wide as the longest path).
PATH_MIN_WIDTH = 48
ELLIPSIS = "…"
# The short form of a dtype, as JAX prints an abstract array (`f32[32,4096]`).
_DTYPE_SHORT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16",
                "int64": "s64", "int32": "s32", "int16": "s16", "int8": "s8",
                "uint64": "u64", "uint32": "u32", "uint16": "u16", "uint8": "u8",
                "bool": "pred", "complex64": "c64", "complex128": "c128"}
# A path's parts: `[0]`, `['layers']`, `.value`.
_PATH_PART = re.compile(r"\[[^\]]*\]|\.[A-Za-z_]\w*|[^\[.]+")
_CALIBRATE = "python -m jaxtier calibrate"
# The notes the summary shows (beside the verdicts): a re-plan against a smaller budget, a
# plan made for a platform this machine does not have, and auto's escalation to a plan with
# more state on the host.
_FINDINGS = ("re-planned", "planned for ", "escalated")
# `Plan.rates_of` for a card's built-in profile (`planner._rates_of`).
_BUILTIN_RATES = re.compile(r"the built-in (\S+) profile's rates, not this machine's")


def terminal_width(width: "int | None" = None, default: int = DEFAULT_WIDTH) -> int:
  """`width` columns, or the terminal's (COLUMNS, else the terminal, else `default`), at
  least MIN_WIDTH."""
  if width is None:
    width = shutil.get_terminal_size((default, 24)).columns or default
  return max(int(width), MIN_WIDTH)


def shorten_path(path: str, width: int) -> str:
  """`path` in at most `width` characters: whole parts elided from its middle (`…`).

  Keeps the first part and as many of the last ones as fit, then more of the first, e.g.
  `[1]['opt_state'][0]['mu']['layers']['mlp']['w_up'].value` in 35 columns is
  `[1]['opt_state'][0]…['w_up'].value`. A path whose first and last parts alone do not fit is
  cut in the middle of its characters.
  """
  if width < 1:
    return ""
  if len(path) <= width:
    return path
  parts = _PATH_PART.findall(path)
  if "".join(parts) == path and len(parts) >= 2:
    head, tail = [parts[0]], [parts[-1]]
    rest = parts[1:-1]
    used = len(parts[0]) + len(parts[-1]) + len(ELLIPSIS)
    if used <= width:
      take_tail = True  # the leaf's own name first: it tells leaves apart
      while rest:
        sides = (True, False) if take_tail else (False, True)
        side = next((t for t in sides if used + len(rest[-1 if t else 0]) <= width), None)
        if side is None:
          break
        part = rest.pop() if side else rest.pop(0)
        used += len(part)
        if side:
          tail.insert(0, part)
        else:
          head.append(part)
        take_tail = not side
      return "".join(head) + ELLIPSIS + "".join(tail)
  keep = width - len(ELLIPSIS)
  front = (keep + 1) // 2
  return path[:front] + ELLIPSIS + (path[len(path) - (keep - front):] if keep > front else "")


def fit_lines(text: str, width: int, indent: str = "  ", max_lines: "int | None" = None
              ) -> list[str]:
  """`text` wrapped at word boundaries into lines of at most `width` characters (the lines
  after the first indented by `indent`); a word longer than a line (a long path) is shortened
  in the middle, never broken. At most `max_lines` lines, the last ending in `…` where text
  was left out."""
  words = [shorten_path(w, width - len(indent)) for w in text.split()]
  lines = textwrap.wrap(" ".join(words), width=width, subsequent_indent=indent,
                        break_long_words=False, break_on_hyphens=False)
  lines = [line if len(line) <= width else shorten_path(line, width) for line in lines] or [""]
  if max_lines is not None and len(lines) > max_lines:
    lines = lines[:max_lines]
    last = lines[-1]
    if len(last) + len(ELLIPSIS) > width:
      last = last[:width - len(ELLIPSIS)].rstrip()
    lines[-1] = last + ELLIPSIS
  return lines


def shape_text(shape: "tuple[int, ...]", dtype: str) -> str:
  """The leaf as JAX writes an abstract array: `f32[32,4096]`."""
  return f"{_DTYPE_SHORT.get(str(dtype), str(dtype))}[{','.join(map(str, shape))}]"


def _columns(rows: list[list[str]], right: "set[int]") -> list[str]:
  """`rows` (the first the header) as aligned columns two spaces apart; the columns in
  `right` right-aligned."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  out = []
  for r in rows:
    cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
    out.append("  ".join(cells).rstrip())
  return out


def byte_matrix(plan) -> list[str]:
  """State bytes per placement (rows) and role (columns), with totals, as aligned lines;
  fp32 masters (in pinned_host) a row of their own."""
  roles = [r for r in Role if any(leaf.role == r for leaf in plan.leaves)]
  roles += sorted({str(leaf.role) for leaf in plan.leaves} - {str(r) for r in roles})
  placements = [p for p in Placement if any(leaf.placement == p for leaf in plan.leaves)]
  placements += sorted({str(leaf.placement) for leaf in plan.leaves}
                       - {str(p) for p in placements})
  cell = {}
  for leaf in plan.leaves:
    key = (str(leaf.placement), str(leaf.role))
    cell[key] = cell.get(key, 0) + leaf.nbytes
    if leaf.master_nbytes:
      key = ("fp32 masters", str(leaf.role))
      cell[key] = cell.get(key, 0) + leaf.master_nbytes
  rows_of = [str(p) for p in placements] + (
      ["fp32 masters"] if any(leaf.master_nbytes for leaf in plan.leaves) else [])
  counts = {}
  for leaf in plan.leaves:
    counts[str(leaf.placement)] = counts.get(str(leaf.placement), 0) + 1
  show = lambda b: "-" if not b else format_bytes(b)
  rows = [["placement", "leaves"] + [str(r) for r in roles] + ["total"]]
  for name in rows_of:
    values = [cell.get((name, str(r)), 0) for r in roles]
    rows.append([name, str(counts.get(name, "")) if name in counts else ""]
                + [show(v) for v in values] + [show(sum(values))])
  totals = [sum(v for (_, role), v in cell.items() if role == str(r)) for r in roles]
  rows.append(["total", str(len(plan.leaves))] + [show(v) for v in totals]
              + [show(sum(totals))])
  return _columns(rows, right=set(range(1, len(rows[0]))))


def _ms(secs: float) -> str:
  return f"{secs * 1e3:.4g} ms"


def summary_lines(plan, width: int, more: str = "plan.table()") -> list[str]:
  """The plan in at most SUMMARY_MAX_LINES lines of at most `width` columns: bytes per role
  and placement, the memory kinds against their limits, the predicted step and peak, the
  verdict and the findings that change what to do; `more` says where the rest is."""
  fit = lambda text, **kw: fit_lines(text, width, **kw)
  # (The verdict's own line, below, says DOES NOT FIT and why.)
  verdict = "fits" if plan.fits else "does not fit"
  updates = plan.num_host_updates
  lines = fit(f"jaxtier plan ({plan.platform}): {verdict}; {updates} fused host update"
              f"{'' if updates == 1 else 's'}/step")
  lines += [line if len(line) <= width else line[:width] for line in byte_matrix(plan)]
  pinned = f"pinned_host {format_bytes(plan.pinned_bytes)}"
  if plan.pinnable_bytes is not None and (plan.host_budget is None
                                          or plan.pinnable_bytes < plan.host_budget):
    pinned += f" of {format_bytes(plan.pinnable_bytes)} pinnable"
    if plan.host_budget is not None:
      pinned += f" (host_budget {format_bytes(plan.host_budget)})"
  elif plan.host_budget is not None:
    pinned += f" of the {format_bytes(plan.host_budget)} host budget"
  lines += fit(f"state: device {format_bytes(plan.device_bytes)}, {pinned}")
  if plan.predicted_step_secs is not None or plan.measured_step_secs is not None:
    step = []
    if plan.predicted_step_secs is not None:
      step.append(f"{_ms(plan.predicted_step_secs)} predicted (bound by {plan.critical_path})")
    if plan.measured_step_secs is not None:
      step.append(f"{_ms(plan.measured_step_secs)} measured")
    lines += fit("step: " + ", ".join(step))
  spec = plan.speculation
  if spec is not None and spec.serial_step_secs is not None:
    if spec.enabled:
      some = (f"{len(spec.components)} of {len(spec.components) + len(spec.waiting)} "
              "guarded updates" if spec.waiting else "updates")
      lines += fit(f"clip/finite check: {some} run on a guess that it passes (spares "
                   f"{format_bytes(spec.spare_pinned_bytes)} pinned); a missed guess "
                   f"{_ms(spec.speculative_step_secs + spec.serial_step_secs)}; no guess "
                   f"({_ms(spec.serial_step_secs)}) while over "
                   f"{format_share(spec.max_miss)} of recent steps miss")
    else:
      lines += fit(f"clip/finite check: updates run after the backward pass, "
                   f"{_ms(spec.serial_step_secs)} ({spec.why})")
  if plan.predicted_peak_hbm_bytes is not None or plan.compiler_peak_hbm_bytes is not None:
    memory = "HBM" if plan.platform == "gpu" else "device memory"
    peak = []
    if plan.predicted_peak_hbm_bytes is not None:
      partial = any(n.startswith("transient device bytes") and "the gradients only" in n
                    for n in plan.notes)
      peak.append(f"{format_bytes(plan.predicted_peak_hbm_bytes)} predicted"
                  + (" (no activations)" if partial else ""))
    if plan.compiler_peak_hbm_bytes is not None:
      peak.append(f"{format_bytes(plan.compiler_peak_hbm_bytes)} compiled")
    budget = plan.device_budget
    limit = ("" if budget.usable is None else f"; budget {format_bytes(budget.given)}"
             if budget.given == budget.usable else f"; planned against "
             f"{format_bytes(budget.usable)}" + (
                 f" (of the {format_bytes(budget.given)} given: what JAX's allocator may use, "
                 "less a margin; XLA_PYTHON_CLIENT_MEM_FRACTION raises it)"
                 if budget.source == "capped" and budget.given is not None else ""))
    lines += fit(f"peak {memory}: {', '.join(peak)}{limit}")
  lines += fit(f"activations: {plan.activation_policy}")
  tail = fit(f"(each leaf and all {len(plan.notes)} notes: {more})")
  findings = [f"DOES NOT FIT: {v}" for v in plan.verdicts]
  findings += [n for n in plan.notes if n.startswith(_FINDINGS)]
  if plan.rates_of:
    findings.append(f"times: {_short_rates(plan.rates_of)}: {_CALIBRATE}")
  for text in findings:
    room = SUMMARY_MAX_LINES - len(lines) - len(tail)
    if room <= 0:
      break
    lines += fit(text, max_lines=min(FINDING_MAX_LINES, room))
  return lines + tail


def _short_rates(rates_of: str) -> str:
  """`Plan.rates_of` as the summary says it: the H200 defaults, or a card's built-in rates,
  named shortly, as uncalibrated (on this machine, they are not its own)."""
  if "default" in rates_of and "H200" in rates_of:
    return "uncalibrated H200 default rates"
  builtin = _BUILTIN_RATES.fullmatch(rates_of)
  return f"uncalibrated {builtin.group(1)} built-in rates" if builtin else rates_of


def table_lines(plan, width: int, reasons: bool = True) -> list[str]:
  """Every leaf of `plan`, one line each (path, `dtype[shape]`, bytes, role where the width
  leaves room, placement; with `reasons` its reason indented under it), then the predicted
  phases and every note, in lines of at most `width` columns."""
  masters = any(leaf.master_nbytes for leaf in plan.leaves)
  rows = []
  for leaf in plan.leaves:
    row = [leaf.path, shape_text(leaf.shape, leaf.dtype), format_bytes(leaf.nbytes),
           str(leaf.role), str(leaf.placement)]
    if masters:
      row.append(format_bytes(leaf.master_nbytes) if leaf.master_nbytes else "-")
    rows.append(row)
  header = ["leaf", "dtype[shape]", "bytes", "role", "placement"] + (
      ["fp32 master"] if masters else [])
  widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
  # The leaf column takes what the others leave. Where that is less than PATH_MIN_WIDTH (or
  # the longest path), the role column goes, then the dtype[shape] one: a path shortened
  # further would no longer tell leaves apart (`['mu']` from `['nu']`).
  others = lambda cols: sum(widths[i] + 2 for i in cols)
  cols = list(range(1, len(header)))
  for optional in (3, 1):
    if width - others(cols) < min(PATH_MIN_WIDTH, widths[0]):
      cols.remove(optional)
  path_width = max(min(widths[0], width - others(cols)), 8)
  right = {2} | ({5} if masters else set())

  def line(row):
    cells = [shorten_path(row[0], path_width).ljust(path_width)]
    for i in cols:
      cells.append(row[i].rjust(widths[i]) if i in right else row[i].ljust(widths[i]))
    return "  ".join(cells).rstrip()[:width]

  lines = fit_lines(f"jaxtier plan ({plan.platform}): {len(plan.leaves)} leaves; device "
                    f"{format_bytes(plan.device_bytes)}, pinned_host "
                    f"{format_bytes(plan.pinned_bytes)}", width)
  lines.append(line(header))
  lines.append("-" * min(width, path_width + others(cols)))
  for leaf, row in zip(plan.leaves, rows):
    lines.append(line(row))
    if reasons and leaf.reason:
      lines += ["    " + x for x in fit_lines(leaf.reason, width - 4, indent="")]
  lines.append("")
  lines += [x for text in plan.prediction_lines() for x in fit_lines(text, width)]
  return lines


def one_line(plan) -> str:
  """The plan in one line, for a log: whether it fits, the state's bytes per memory kind (the
  roles in pinned_host), the peak device memory against the budget and the predicted step.

  Example: `fits; state: device 4.01 MiB, pinned_host 8.02 MiB (optimizer_state); peak device
  memory 6.3 MiB compiled, budget 9 MiB; step 1.2 ms predicted`.
  """
  roles = sorted({str(l.role) for l in plan.leaves if l.memory_kind == "pinned_host"},
                 key=lambda r: (_ROLE_ORDER.index(r) if r in _ROLE_ORDER else len(_ROLE_ORDER),
                                r))
  host = f" ({', '.join(roles)})" if roles else ""
  parts = [f"{'fits' if plan.fits else 'DOES NOT FIT'}; state: device "
           f"{format_bytes(plan.device_bytes)}, pinned_host {format_bytes(plan.pinned_bytes)}"
           f"{host}"]
  peak = plan.compiler_peak_hbm_bytes
  which = "compiled"
  if peak is None:
    peak, which = plan.predicted_peak_hbm_bytes, "predicted"
  if peak is not None:
    memory = "HBM" if plan.platform == "gpu" else "device memory"
    budget = plan.device_budget.usable
    parts.append(f"peak {memory} {format_bytes(peak)} {which}"
                 + ("" if budget is None else f", budget {format_bytes(budget)}"))
  if plan.predicted_step_secs is not None:
    parts.append(f"step {_ms(plan.predicted_step_secs)} predicted")
  return "; ".join(parts)


_ROLE_ORDER = (Role.PARAM, Role.OPTIMIZER_STATE, Role.OTHER)


def summary(plan, width: "int | None" = None, more: str = "plan.table()") -> str:
  """`summary_lines` at `width` (None: the terminal's), as one string."""
  return "\n".join(summary_lines(plan, terminal_width(width), more))


def table(plan, width: "int | None" = None, reasons: bool = True) -> str:
  """`table_lines` at `width` (None: the terminal's), as one string."""
  return "\n".join(table_lines(plan, terminal_width(width), reasons))
