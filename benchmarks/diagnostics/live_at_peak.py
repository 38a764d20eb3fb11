"""What is live in XLA's preallocated temp buffer at its liveness peak, from a dump.

Run a workload with `XLA_FLAGS=--xla_dump_to=DIR`, pick a module's scheduled HLO
(`*after_optimizations.txt`) and its buffer assignment (`*-buffer-assignment.txt`), then:

  python3 benchmarks/diagnostics/live_at_peak.py HLO.txt BUFFER_ASSIGNMENT.txt \
      [--top=40] [--at=INSTRUCTION] > live.txt

What it does:
1. Reads the `preallocated-temp` allocation of the buffer assignment: every temp value's id, name
   (`fusion.12{0}` is element 0 of instruction fusion.12's tuple output), size, offset, shape.
2. Reads the scheduled HLO (`is_scheduled=true`: each computation's text order is its schedule)
   and flattens the schedule the way XLA's HloLiveRange does in module scope: walking ENTRY in
   order, a while's condition and body, and an async-start's, call's or conditional's callees, get
   their times just before the instruction itself; fusion bodies are not scheduled. Time = index
   in that flat sequence.
3. Redoes a small HloDataflowAnalysis: which instruction positions define a new value and which
   alias an operand (tuple, bitcast, `%x#i` tuple-element operands, async-start/-done, call and
   async parameters), and each value's live interval [definition, last use]: parameters start at
   their computation's start, a while's use of its init value ends at the body's start, values at a
   computation's root live to the computation's end (ENTRY's root: to the end of the program).
4. At each time it sums the sizes of the live temp values, counting each (offset, size) slot once
   (so aliases of one buffer, e.g. a loop-carried value and its while phis, and in-place updates,
   count once), and prints the time with the largest sum (the live peak), its instruction and
   the values live there by size; also the allocation size and allocation / peak (what packing
   costs: fragmentation).
5. Checks the intervals against the offsets: two values whose byte ranges overlap must not be
   live at once, unless they alias (while phis: init, body/cond parameter, body root, result) or
   one is updated in place into the other at the one time where both meet. It prints how many
   pairs break that; ~0 means the intervals match what XLA's heap packing assumed.

Standard library only.
"""

import argparse
import collections
import re
import sys

_VALUE_RE = re.compile(
    r"value: <(\d+) ([^\s{>]+)(\{[\d,]*\})?( \(phi\))? @(\d+)> \(size=(\d+),offset=(\d+)\): (.*)")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(")
_INSTR_RE = re.compile(r"^\s+(ROOT\s+)?%([^\s=]+)\s+=\s+(.*)$")
_REF_RE = re.compile(r"%([\w.\-]+)((?:#\d+)*)")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_COMMENT_RE = re.compile(r"/\*.*?\*/")

# Opcodes whose output positions all alias operand 0's.
_FORWARDING = {"bitcast", "opt-barrier", "optimization-barrier", "domain", "add-dependency"}


class Value:
  """One temp value of the buffer assignment."""

  def __init__(self, vid, name, index, phi, size, offset, shape):
    self.vid, self.name, self.index, self.phi = vid, name, index, phi
    self.size, self.offset, self.shape = size, offset, shape
    self.start = self.end = None  # live interval, inclusive, in flat schedule time

  @property
  def key(self):
    return (self.name, self.index)

  @property
  def label(self):
    if self.index is None:
      return self.name
    return f"{self.name}{{{','.join(map(str, self.index))}}}"


class Instr:
  """One HLO instruction: name, output shape tree, opcode, operand refs, callees."""

  def __init__(self, name, comp, is_root, shape, opcode, refs, attrs, text):
    self.name, self.comp, self.is_root = name, comp, is_root
    self.shape, self.opcode, self.refs, self.attrs = shape, opcode, refs, attrs
    m = _OP_NAME_RE.search(text)
    self.op_name = m.group(1) if m else ""
    self.time = None


def read_temp_values(path):
  """(allocation size, [Value]) of the `preallocated-temp` allocation."""
  size, values, inside = None, [], False
  for line in open(path):
    if line.startswith("allocation "):
      inside = "preallocated-temp" in line
      if inside:
        size = int(re.match(r"allocation \d+: size (\d+)", line).group(1))
      continue
    if inside:
      m = _VALUE_RE.search(line)
      if m:
        index = None
        if m.group(3) is not None:
          inner = m.group(3)[1:-1]
          index = tuple(int(i) for i in inner.split(",")) if inner else ()
        values.append(Value(int(m.group(1)), m.group(2), index, bool(m.group(4)),
                            int(m.group(6)), int(m.group(7)), m.group(8).strip()))
      elif line.strip() and not line.startswith(" "):
        inside = False
  if size is None:
    raise SystemExit(f"no preallocated-temp allocation in {path}")
  return size, values


def _matching(s, i):
  """Index just past the bracket that closes the one at s[i]."""
  pairs = {"(": ")", "[": "]", "{": "}"}
  depth = []
  for j in range(i, len(s)):
    c = s[j]
    if c in pairs:
      depth.append(pairs[c])
    elif depth and c == depth[-1]:
      depth.pop()
      if not depth:
        return j + 1
  return len(s)


def _parse_shape(s, i=0):
  """(shape tree, end): a tuple shape is a list of trees, an array shape is its text."""
  if s[i] == "(":
    children, i = [], i + 1
    while s[i] != ")":
      child, i = _parse_shape(s, i)
      children.append(child)
      while s[i] in ", ":
        i += 1
    return children, i + 1
  j = i
  while j < len(s) and s[j] not in ",) ":
    j = _matching(s, j) if s[j] in "[{(" else j + 1
  return s[i:j], j


def _positions(shape, prefix=()):
  """All shape indices of a shape tree, the tuple itself included."""
  out = [prefix]
  if isinstance(shape, list):
    for i, child in enumerate(shape):
      out += _positions(child, prefix + (i,))
  return out


def read_hlo(path):
  """({computation: [Instr] in schedule order}, entry name, {instr name: Instr})."""
  comps, entry, instrs, current = collections.OrderedDict(), None, {}, None
  for raw in open(path):
    line = _COMMENT_RE.sub("", raw.rstrip("\n"))
    if current is None:
      m = _HEADER_RE.match(line)
      if m and line.rstrip().endswith("{"):
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTR_RE.match(line)
    if not m:
      continue
    name, rest = m.group(2), m.group(3)
    shape, i = _parse_shape(rest)
    om = re.match(r"\s*([\w-]+)\(", rest[i:])
    if not om:
      continue
    opcode = om.group(1)
    open_paren = i + om.end() - 1
    close = _matching(rest, open_paren)
    refs = [(r.group(1), tuple(int(k) for k in r.group(2).split("#")[1:]))
            for r in _REF_RE.finditer(rest[open_paren + 1:close - 1])]
    attrs = {}
    tail = re.sub(r"metadata=\{[^}]*\}", "", rest[close:])
    for key in ("calls", "condition", "body", "to_apply", "true_computation",
                "false_computation"):
      am = re.search(rf"\b{key}=%([\w.\-]+)", tail)
      if am:
        attrs[key] = [am.group(1)]
    for key in ("branch_computations", "calls"):
      am = re.search(rf"\b{key}=\{{([^}}]*)\}}", tail)
      if am:
        attrs[key] = re.findall(r"%([\w.\-]+)", am.group(1))
    am = re.search(r"\bindex=(\d+)", tail)
    if am:
      attrs["index"] = int(am.group(1))
    am = re.search(r"\bparameter\((\d+)\)", rest)
    if opcode == "parameter" and am:
      attrs["number"] = int(am.group(1))
    ins = Instr(name, current, bool(m.group(1)), shape, opcode, refs, attrs, rest)
    comps[current].append(ins)
    instrs[name] = ins
  if entry is None:
    raise SystemExit(f"no ENTRY computation in {path}")
  return comps, entry, instrs


class LiveRanges:
  """Flat schedule, value definitions/aliases and live intervals of one HLO module."""

  def __init__(self, comps, entry, instrs):
    self.comps, self.entry, self.instrs = comps, entry, instrs
    self.flat = []            # Instr by time
    self.span = {}            # computation -> (first time, last time)
    self.caller = {}          # computation -> (calling Instr, role, callee ordinal)
    self.valmap = {}          # instr name -> {position: value key}
    self.defined = {}         # value key -> defining Instr
    self.start, self.end = {}, {}
    self.parent = {}          # union-find over value keys: aliases of one buffer
    self._flatten(entry)
    for ins in self.flat:
      self._define(ins)
    self._group_control_flow()
    self._live_intervals()

  def _flatten(self, comp):
    first = len(self.flat)
    for ins in self.comps[comp]:
      callees = []
      if ins.opcode == "while":
        callees = [(ins.attrs["condition"][0], "cond"), (ins.attrs["body"][0], "body")]
      elif ins.opcode in ("call", "conditional", "async-start"):
        for key in ("calls", "to_apply", "true_computation", "false_computation",
                    "branch_computations"):
          callees += [(c, ins.opcode) for c in ins.attrs.get(key, [])]
      for k, (callee, role) in enumerate(callees):
        if callee in self.comps and callee not in self.span:
          self.caller[callee] = (ins, role, k)
          self._flatten(callee)
      ins.time = len(self.flat)
      self.flat.append(ins)
    self.span[comp] = (first, len(self.flat) - 1)

  def _under(self, name, index):
    """{sub-position: value key} at and below `index` of instruction `name`'s output."""
    n = len(index)
    return {p[n:]: v for p, v in self.valmap.get(name, {}).items() if p[:n] == index}

  def _define(self, ins):
    vm, new = {}, []
    positions = _positions(ins.shape)
    op = ins.opcode
    if op == "tuple":
      vm[()] = (ins.name, ())
      new.append(())
      for i, (name, index) in enumerate(ins.refs):
        for p, v in self._under(name, index).items():
          vm[(i,) + p] = v
    elif op in _FORWARDING and ins.refs:
      vm.update(self._under(*ins.refs[0]))
    elif op == "get-tuple-element":
      name, index = ins.refs[0]
      vm.update(self._under(name, index + (ins.attrs.get("index", 0),)))
    elif op == "parameter" and ins.comp in self.caller and \
        self.caller[ins.comp][1] in ("async-start", "call", "conditional"):
      call, _, k = self.caller[ins.comp]
      # A branch's only parameter is the conditional's operand 1 + branch number.
      number = k + 1 if call.opcode == "conditional" else ins.attrs.get("number", 0)
      vm.update(self._under(*call.refs[number]))
    elif op == "call":
      root = self.comps[ins.attrs["to_apply"][0]][-1]
      vm.update(self._under(root.name, ()))
    elif op == "async-start":
      root = self.comps[ins.attrs["calls"][0]][-1]
      for p in positions:
        if len(p) >= 2 and p[0] == 0 and p[1] < len(ins.refs):
          sub = self._under(*ins.refs[p[1]])
          if p[2:] in sub:
            vm[p] = sub[p[2:]]
            continue
        if p[:1] == (1,):
          sub = self._under(root.name, ())
          if p[1:] in sub:
            vm[p] = sub[p[1:]]
            continue
        new.append(p)
    elif op in ("async-done", "async-update", "copy-done"):
      start = ins.refs[0]
      off = (1,) if op == "async-done" else ((0,) if op == "copy-done" else ())
      vm.update(self._under(start[0], start[1] + off))
    else:  # parameters of ENTRY/while bodies (phis), while (phi), fusions, custom calls, ...
      new = positions
    for p in new:
      vm[p] = (ins.name, p)
      self.defined[(ins.name, p)] = ins
    for p in positions:  # anything unresolved: treat as defined here
      if p not in vm:
        vm[p] = (ins.name, p)
        self.defined[(ins.name, p)] = ins
    self.valmap[ins.name] = vm

  def find(self, k):
    while self.parent.get(k, k) != k:
      k = self.parent[k]
    return k

  def _union(self, a, b):
    ra, rb = self.find(a), self.find(b)
    if ra != rb:
      self.parent[ra] = rb

  def _group_control_flow(self):
    """While init/phis/body root, and conditional phi/branch roots, are one buffer each."""
    for ins in self.flat:
      members = []
      if ins.opcode == "while":
        cond, body = ins.attrs["condition"][0], ins.attrs["body"][0]
        members = [self._under(*ins.refs[0]), self._under(self.comps[body][0].name, ()),
                   self._under(self.comps[body][-1].name, ())]
        members += [self._under(i.name, ()) for i in self.comps[cond] if i.opcode == "parameter"]
      elif ins.opcode == "conditional":
        for key in ("true_computation", "false_computation", "branch_computations"):
          for c in ins.attrs.get(key, []):
            members.append(self._under(self.comps[c][-1].name, ()))
      if not members:
        continue
      for p, v in self.valmap[ins.name].items():
        for m in members:
          if p in m:
            self._union(v, m[p])

  def _use(self, key, t):
    self.end[key] = max(self.end.get(key, t), t)

  def _live_intervals(self):
    for key, ins in self.defined.items():
      t = ins.time
      if ins.opcode == "parameter":
        t = self.span[ins.comp][0]
      self.start[key] = t
      self.end[key] = t
    for ins in self.flat:
      if ins.opcode == "tuple":
        continue  # passes its operands through; uses of the tuple count
      t = ins.time
      if ins.opcode == "while":
        t = self.span[ins.attrs["body"][0]][0]  # init value dies as the body starts
      for name, index in ins.refs:
        if ins.opcode in ("get-tuple-element", "copy"):
          sub = {(): self.valmap.get(name, {}).get(index)}
        else:
          sub = self._under(name, index)
        for v in sub.values():
          if v is not None:
            self._use(v, t)
    for comp, instrs in self.comps.items():
      if comp not in self.span or not instrs:
        continue
      end = self.span[comp][1]
      for v in self.valmap.get(instrs[-1].name, {}).values():
        self._use(v, end)

  def uses(self, key, ins):
    """Whether instruction `ins` reads value `key` (through any alias)."""
    for name, index in ins.refs:
      if key in self._under(name, index).values():
        return True
    return False


def _where(lr, ins):
  """A short description of where an instruction sits: its computation and its caller."""
  comp = ins.comp
  if comp == lr.entry:
    return "ENTRY"
  chain = []
  while comp in lr.caller:
    call, role, _ = lr.caller[comp]
    chain.append(f"{role} {comp} of {call.name}")
    comp = call.comp
  return " / ".join(chain)


def _fmt(n):
  return f"{n / 2**20:10.1f} MiB"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("hlo", help="scheduled HLO text (*after_optimizations.txt)")
  parser.add_argument("buffer_assignment", help="*-buffer-assignment.txt of the same module")
  parser.add_argument("--top", type=int, default=40, help="live values to print")
  parser.add_argument("--at", default=None, help="also print what is live at this instruction")
  args = parser.parse_args()

  alloc_size, values = read_temp_values(args.buffer_assignment)
  comps, entry, instrs = read_hlo(args.hlo)
  lr = LiveRanges(comps, entry, instrs)

  missing = []
  for v in values:
    key = (v.name, v.index if v.index is not None else ())
    if key not in lr.start:
      missing.append(v.label)
      continue
    v.start, v.end = lr.start[key], lr.end[key]
  values = [v for v in values if v.start is not None]
  T = len(lr.flat)

  # Live bytes per time, each (offset, size) slot once.
  by_time = [dict() for _ in range(T)]
  for v in values:
    for t in range(v.start, v.end + 1):
      by_time[t][(v.offset, v.size)] = v
  live = [sum(s for (_, s) in slots) for slots in by_time]
  peak_t = max(range(T), key=lambda t: live[t])
  peak = live[peak_t]

  print(f"{args.hlo}")
  print(f"  flat schedule: {T} instructions; {len(values)} temp values placed "
        f"({len(missing)} not found in the HLO{': ' + ', '.join(missing[:8]) if missing else ''})")
  print(f"  preallocated-temp allocation: {alloc_size:,} B ({alloc_size / 2**30:.3f} GiB)")
  print(f"  live peak: {peak:,} B ({peak / 2**30:.3f} GiB) at t={peak_t}")
  print(f"  fragmentation (allocation / live peak): {alloc_size / peak:.4f}  "
        f"(allocation - peak = {alloc_size - peak:,} B)")

  # Peak per computation, to see whether the peak is in ENTRY or inside a loop body.
  print("\n  largest live bytes per computation:")
  for comp, (a, b) in sorted(lr.span.items(), key=lambda kv: kv[1][0]):
    if b < a:
      continue
    t = max(range(a, b + 1), key=lambda x: live[x])
    if comp == entry or lr.caller.get(comp, (None, "", 0))[1] in ("body", "cond"):
      print(f"    {comp:28s} t=[{a},{b}]  max {live[t]:,} B at t={t} {lr.flat[t].name}")

  def dump(t, title):
    ins = lr.flat[t]
    print(f"\n{title}: t={t} %{ins.name} ({ins.opcode}) in {_where(lr, ins)}")
    print(f"  op_name: {ins.op_name}")
    print(f"  live temp bytes: {live[t]:,} B in {len(by_time[t])} slots")
    rows = sorted(by_time[t].values(), key=lambda v: -v.size)
    for v in rows[:args.top]:
      d = lr.defined.get((v.name, v.index if v.index is not None else ()))
      first, last = lr.flat[v.start].name, lr.flat[v.end].name
      print(f"  {_fmt(v.size)}  {v.label:42s} {v.shape[:40]:40s} [{v.start},{v.end}] "
            f"{first} .. {last}  | {(d.op_name if d else '')[:90]}")
    if len(rows) > args.top:
      rest = sum(v.size for v in rows[args.top:])
      print(f"  ... {len(rows) - args.top} more slots, {rest:,} B")

  dump(peak_t, "live peak")
  if args.at:
    if args.at not in instrs or instrs[args.at].time is None:
      print(f"\nno scheduled instruction {args.at}")
    else:
      dump(instrs[args.at].time, f"at {args.at}")

  # Check: values overlapping in bytes must not be live at once.
  order = sorted(values, key=lambda v: v.offset)
  bad, in_place, aliased = [], 0, 0
  for i, a in enumerate(order):
    for b in order[i + 1:]:
      if b.offset >= a.offset + a.size:
        break
      lo, hi = max(a.start, b.start), min(a.end, b.end)
      if lo > hi:
        continue
      ka = (a.name, a.index if a.index is not None else ())
      kb = (b.name, b.index if b.index is not None else ())
      if lr.find(ka) == lr.find(kb):
        aliased += 1
        continue
      if lo == hi:
        ins = lr.flat[lo]
        if (lr.defined.get(ka) is ins and lr.uses(kb, ins)) or \
            (lr.defined.get(kb) is ins and lr.uses(ka, ins)):
          in_place += 1
          continue
      bad.append((a, b, lo, hi))
  print(f"\ncheck: pairs of temp values overlapping in offset range: live at once although not "
        f"aliases = {len(bad)}; (aliases of one buffer: {aliased}, in-place reuse at the one "
        f"instruction where they meet: {in_place})")
  if peak > alloc_size:
    print("  WARNING: live peak exceeds the allocation: the intervals are too long somewhere")
  for a, b, lo, hi in bad[:20]:
    print(f"  {a.label} [{a.start},{a.end}] off {a.offset} size {a.size}  vs  "
          f"{b.label} [{b.start},{b.end}] off {b.offset} size {b.size}  both live t=[{lo},{hi}]")
  print("  (0 means the intervals agree with how XLA packed the buffers)" if not bad else
        "  (nonzero: these intervals are longer than the ones XLA assumed)")


if __name__ == "__main__":
  main()
