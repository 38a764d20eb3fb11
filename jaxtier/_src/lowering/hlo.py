"""HLO text inspection: what feeds a custom call's host operands (the HLO guards use it)."""

from __future__ import annotations

import re

from jaxtier._src.primitives import host_update as hu


def _split_top(text: str) -> list[str]:
  """Splits `text` at commas that are not inside (), [] or {}."""
  parts, depth, cur = [], 0, []
  for ch in text:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return [p.strip() for p in parts]


def host_parameters(hlo_text: str) -> set[int]:
  """Entry parameter numbers whose layout is in the host memory space S(5)."""
  m = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo_text)
  if not m:
    return set()
  params = _split_top(re.sub(r"/\*.*?\*/", "", m.group(1)))
  return {k for k, p in enumerate(params) if "S(5)" in p}


def entry_instructions(hlo_text: str) -> list[tuple[str, str]]:
  """(name, right-hand side) of each instruction of the HLO text's ENTRY computation, in order."""
  out = []
  in_entry = False
  for line in hlo_text.splitlines():
    s = line.strip()
    if s.startswith("ENTRY"):
      in_entry = True
      continue
    if in_entry and s == "}":
      break
    if in_entry and " = " in s:
      lhs, rhs = s.split(" = ", 1)
      out.append((lhs.replace("ROOT", "").strip().lstrip("%"), rhs))
  return out


def hlo_violations(hlo_text: str, target: str = hu.TARGET) -> list[str]:
  """What in compiled HLO moves or computes on a host operand before a `target` custom call.

  The alarm for XLA's undocumented behaviour on host operands (jax 0.11.2 on the H200): a
  pinned_host leaf must reach the custom call as the entry parameter itself. For each operand
  of each `target` call in the entry computation, follow its producers back through copy,
  copy-start/-done, slice, dynamic-slice, bitcast and fusion instructions: reaching an entry
  parameter in the host memory space (S(5)) through any of them is a violation. Any host
  compute (`_xla_compute_type="host"`) in the entry computation is one too.

  Returns:
    Human-readable violations; empty when clean, or a single line when no `target` call exists.
  """
  host_params = host_parameters(hlo_text)
  defs: dict[str, str] = {}
  calls: list[tuple[str, list[str]]] = []
  bad: list[str] = []
  for name, rhs in entry_instructions(hlo_text):
    defs[name] = rhs
    if "_xla_compute_type" in rhs:
      bad.append(f"{name}: host compute in the entry computation")
    if f'custom_call_target="{target}"' in rhs:
      calls.append((name, operands_of(rhs)))

  def opcode(rhs: str) -> str:
    m = OPCODE.search(rhs)
    return m.group(1) if m else "?"

  def host_source(name: str, depth: int = 0) -> bool:
    rhs = defs.get(name, "")
    op = opcode(rhs)
    if op == "parameter":
      num = re.search(r"parameter\((\d+)\)", rhs)
      return ("S(5)" in rhs.split(" parameter(")[0]) or (
          num is not None and int(num.group(1)) in host_params)
    if depth > 8 or op not in _MOVES:
      return False
    return any(host_source(a, depth + 1) for a in operands_of(rhs))

  for name, args in calls:
    for a in args:
      op = opcode(defs.get(a, ""))
      if op in _MOVES and host_source(a):
        bad.append(f"{name}: operand {a} is produced by `{op}` from a host parameter")
  if not calls:
    bad.append(f"no custom call to {target} in the entry computation")
  return bad


_MOVES = frozenset({"copy", "copy-start", "copy-done", "dynamic-slice", "slice", "bitcast",
                    "fusion", "get-tuple-element", "reshape", "transpose", "convert"})


OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9\-]*)\(")


def operands_of(rhs: str) -> list[str]:
  """Instruction names an HLO instruction's right-hand side reads."""
  m = OPCODE.search(rhs)
  inner = rhs[m.end():] if m else ""
  depth, out = 1, []
  for ch in inner:
    if ch == "(":
      depth += 1
    elif ch == ")":
      depth -= 1
      if depth == 0:
        break
    out.append(ch)
  names = []
  for tok in _split_top("".join(out)):
    tok = re.sub(r"/\*.*?\*/", "", tok).strip()
    if tok:
      names.append(tok.split()[-1].lstrip("%"))
  return names
