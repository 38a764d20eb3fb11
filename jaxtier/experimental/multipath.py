"""Multi-path fetch: a replicated pinned_host leaf reaches every device over all host links.

A leaf replicated over a mesh in `pinned_host` memory (every device holds the whole leaf in its
host's memory) is needed whole on every device, e.g. a streamed layer weight under data
parallelism. Fetching it the plain way (`fetch_single_path`) moves the whole leaf over each
device's own host link: N devices, each its own PCIe link, each carrying all B bytes, so the
fetch takes B / link_rate however many devices there are. `fetch_replicated` instead has device
k read only its 1/N slice from the host (B / N bytes over its link) and then all-gathers the
slices over `axis_name` (on GPUs: NVLink, ~10x the PCIe rate), so the host side takes
B / (N * link_rate) and the N links work at once (docs/design.md, "Multi-device").

Per device and fetch, for a slice of B bytes and N devices along `axis_name`:

| path | host -> device bytes | device <-> device bytes received |
| --- | --- | --- |
| `fetch_single_path` | B | 0 |
| `fetch_replicated` | B / N | B * (N - 1) / N |

`fetch_sharded` moves the same bytes as `fetch_replicated` from a leaf stored sharded over
`axis_name` in pinned_host (1/N of it per device, no per-device read offset).

All run inside `shard_map` over the whole mesh, so they can be called inside a jitted step (a
`lax.scan` over layers passes the layer `index`) or eagerly. `host_read_shapes` reads the
compiled HLO back to check what each device actually reads from host memory.
"""

from __future__ import annotations

import re
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.lowering import hlo as hlo_lib


def _axis_size(api: str, mesh: Mesh, axis_name: Any) -> int:
  """The size of `mesh` axis `axis_name`; raises when the mesh has no such axis."""
  if axis_name not in mesh.shape:
    raise ValueError(f"{api}: expected axis_name to be one of the mesh axes "
                     f"{tuple(mesh.axis_names)}, got {axis_name!r}")
  return mesh.shape[axis_name]


def _check(api: str, host_leaf: Any, mesh: Mesh, index: Any) -> tuple[int, ...]:
  """The shape of the fetched slice; raises for a bad mesh, leaf or static index."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"{api}: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
  shape = tuple(np.shape(host_leaf))
  try:  # a concrete array; a tracer (inside jit) has no sharding to check.
    kind = jc.memory_kind_of(host_leaf)
  except Exception:  # pylint: disable=broad-except
    kind = None
  if kind not in (None, "pinned_host"):
    raise ValueError(f"{api}: expected a leaf in memory kind 'pinned_host', got {kind!r}; "
                     "place it with jax.device_put(x, NamedSharding(mesh, P(), "
                     "memory_kind='pinned_host'))")
  if index is None:
    return shape
  if not shape:
    raise ValueError(f"{api}: index given for a 0-d leaf; pass index=None")
  if isinstance(index, (int, np.integer)) and not 0 <= int(index) < shape[0]:
    raise ValueError(f"{api}: expected 0 <= index < {shape[0]} (dimension 0 of {list(shape)}), "
                     f"got {index}")
  return shape[1:]


def _take(w: Any, index: Any, split_axis: "int | None" = None, start: Any = 0,
          rows: int = 0) -> Any:
  """`w[index]` (or `w`), rows [start, start + rows) of `split_axis` (None: all), on device.

  One `dynamic_slice` of the host array, then the move to device memory, then (with `index`)
  dropping the layer axis: the slice is the only op on host memory, so XLA moves just that
  window; any other op there (even a reshape) could become host compute (XLA warns so).
  """
  if index is None and split_axis is None:
    return jax.device_put(w, jc.memory_space("device"))
  lead = 0 if index is None else 1
  starts = [0] * w.ndim
  sizes = list(w.shape)
  if index is not None:
    starts[0], sizes[0] = index, 1
  if split_axis is not None:
    starts[lead + split_axis], sizes[lead + split_axis] = start, rows
  part = jax.device_put(jax.lax.dynamic_slice(w, starts, sizes), jc.memory_space("device"))
  return part.reshape(part.shape[1:]) if index is not None else part


def fetch_replicated(host_leaf: jax.Array, mesh: Mesh, axis_name: str, *, index: Any = None,
                     split_axis: int = 0) -> jax.Array:
  """Multi-path fetch: each device reads 1/N of the slice from host, then all-gathers it.

  Args:
    host_leaf: array [d0, d1, ...], any dtype, memory kind 'pinned_host', replicated over
      `mesh` (`NamedSharding(mesh, P(), memory_kind='pinned_host')`): every device has the
      whole leaf in its host's memory. Inside jit, the traced argument of such an array.
    mesh: the mesh the leaf is replicated over.
    axis_name: mesh axis to split the read over (N = mesh.shape[axis_name] devices); the
      slices are all-gathered over it. Devices along other axes repeat the same reads.
    index: None (fetch the whole leaf) or an int / int32 0-d array: fetch
      `host_leaf[index]` (layer `index` of stacked layers; inside `lax.scan`, the loop index).
      A traced index is clamped into range, as `lax.dynamic_slice` does.
    split_axis: axis of the fetched slice split into N parts (its size must divide by N).

  Returns:
    The slice, shape [d0, d1, ...] (or [d1, ...] with `index`), dtype of `host_leaf`, in
    memory kind 'device', replicated over `mesh`. Each device moved B / N bytes over its host
    link and received B * (N - 1) / N bytes from its peers (B: the slice's bytes).

  Raises:
    ValueError: the leaf is not in pinned_host, `axis_name` is not a mesh axis, the split
      axis does not divide by N, or a static `index` is out of range.

  Note: the read's offset depends on the device (partition id). On 8 CPU devices the compiled
  program reads exactly the 1/N window; whether a GPU build also moves only that window over
  PCIe (and not the whole slice) is what benchmarks/multigpu_bench.py checks on two GPUs
  (`fetch_sharded` avoids the question).
  """
  api = "jaxtier.multipath.fetch_replicated"
  shape = _check(api, host_leaf, mesh, index)
  n = _axis_size(api, mesh, axis_name)
  if not 0 <= split_axis < len(shape):
    raise ValueError(f"{api}: expected 0 <= split_axis < {len(shape)} for a slice of shape "
                     f"{list(shape)}, got {split_axis}")
  if shape[split_axis] % n:
    raise ValueError(
        f"{api}: expected dimension {split_axis} of the slice {list(shape)} to divide by the "
        f"{n} devices of mesh axis {axis_name!r}, got {shape[split_axis]}; pick another "
        "split_axis, pad the leaf, or use fetch_single_path")
  rows = shape[split_axis] // n

  def per_device(w, i):
    k = jax.lax.axis_index(axis_name)
    part = _take(w, i, split_axis, k * rows, rows)
    return jax.lax.all_gather(part, axis_name, axis=split_axis, tiled=True)

  return _run(per_device, host_leaf, mesh, index)


def fetch_single_path(host_leaf: jax.Array, mesh: Mesh, *, index: Any = None) -> jax.Array:
  """Single-path fetch (the baseline): each device copies the whole slice from its host.

  Args:
    host_leaf, mesh, index: as `fetch_replicated`.

  Returns:
    The slice, shape [d0, ...] (or [d1, ...] with `index`), in memory kind 'device',
    replicated over `mesh`. Each device moved all B bytes of the slice over its host link.

  Raises:
    ValueError: the leaf is not in pinned_host, or a static `index` is out of range.
  """
  _check("jaxtier.multipath.fetch_single_path", host_leaf, mesh, index)

  def per_device(w, i):
    return _take(w, i)

  return _run(per_device, host_leaf, mesh, index)


def sharded_host_spec(axis_name: str, split_axis: int = 0, indexed: bool = False) -> P:
  """The spec of a leaf stored for `fetch_sharded`: `axis_name` on the split axis.

  Args:
    axis_name: mesh axis the leaf is split over.
    split_axis: axis of the fetched slice that is split (of the layer, when `indexed`).
    indexed: the leaf stacks layers on axis 0 and is fetched one layer at a time.

  Returns:
    e.g. P(None, 'd') for split_axis=0 of stacked layers: place the leaf with
    `NamedSharding(mesh, spec, memory_kind='pinned_host')`.
  """
  return P(*([None] * (split_axis + int(indexed)) + [axis_name]))


def fetch_sharded(host_leaf: jax.Array, mesh: Mesh, axis_name: str, *, index: Any = None,
                  split_axis: int = 0) -> jax.Array:
  """Multi-path fetch of a leaf stored sharded in pinned_host: copy the local shard, gather.

  The same traffic as `fetch_replicated` (B / N bytes per device over its host link, an
  all-gather over `axis_name`), from a leaf that each device holds only 1/N of in host memory
  (N times less pinned memory). Each device copies its whole local shard (or one layer of it):
  the host read has no per-device offset, only the layer index.

  Args:
    host_leaf: array [d0, d1, ...] in memory kind 'pinned_host', sharded as
      `NamedSharding(mesh, sharded_host_spec(axis_name, split_axis, index is not None),
      memory_kind='pinned_host')`.
    mesh, axis_name, index, split_axis: as `fetch_replicated`.

  Returns:
    As `fetch_replicated`: the whole slice in memory kind 'device', replicated over `mesh`.

  Raises:
    ValueError: as `fetch_replicated`, or a concrete leaf not sharded as above.
  """
  api = "jaxtier.multipath.fetch_sharded"
  shape = _check(api, host_leaf, mesh, index)
  n = _axis_size(api, mesh, axis_name)
  if not 0 <= split_axis < len(shape) or shape[split_axis] % n:
    raise ValueError(f"{api}: expected dimension {split_axis} of the slice {list(shape)} to "
                     f"divide by the {n} devices of mesh axis {axis_name!r}")
  spec = sharded_host_spec(axis_name, split_axis, index is not None)
  try:
    got = host_leaf.sharding.spec
  except Exception:  # pylint: disable=broad-except  (a tracer, or a sharding without a spec)
    got = None
  if got is not None and tuple(got) + (None,) * (len(spec) - len(got)) != tuple(spec):
    raise ValueError(f"{api}: expected the leaf sharded as {spec}, got {got}; place it with "
                     f"NamedSharding(mesh, {spec}, memory_kind='pinned_host')")

  def per_device(w, i):
    return jax.lax.all_gather(_take(w, i), axis_name, axis=split_axis, tiled=True)

  return _run(per_device, host_leaf, mesh, index, spec)


def _run(per_device: Any, host_leaf: Any, mesh: Mesh, index: Any,
         leaf_spec: P = P()) -> jax.Array:
  # The leaf replicated (or as `leaf_spec`) in, the result replicated out: every device runs
  # `per_device` on its own host copy (or shard). The output
  # is the same on every device by construction (an all-gather, or the same slice read);
  # check_vma=False because jax 0.10's all_gather result is typed as varying. Under jit
  # always: eager shard_map refuses a device_put to a memory space (jax 0.10); inside a caller's
  # jit this jit is inlined.
  args = (host_leaf,) if index is None else (host_leaf, jax.numpy.asarray(index, "int32"))
  body = (lambda w: per_device(w, None)) if index is None else per_device
  in_specs = (leaf_spec,) + (P(),) * (len(args) - 1)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(),
                               check_vma=False))(*args)


_SHAPE = re.compile(r"^([a-z0-9]+)\[([0-9,]*)\]")


def host_read_shapes(hlo_text: str) -> list[tuple[str, str, tuple[int, ...], int]]:
  """What each device's compiled program reads out of host-memory (S(5)) entry parameters.

  For every instruction of the entry computation (after partitioning: per device) that takes
  a host entry parameter as an operand, one row: (instruction name, opcode, result shape,
  result bytes). A fetch of B bytes per device shows as one `dynamic-slice` (or a fusion
  around one) whose result is B bytes; on GPUs XLA may show it as a copy out of the host
  parameter instead.

  Args:
    hlo_text: `jax.stages.Compiled.as_text()` of a jitted program.

  Returns:
    Rows as above, in program order; empty when no host parameter is read.
  """
  host = hlo_lib.host_parameters(hlo_text)
  params: dict[str, int] = {}
  rows = []
  for name, rhs in hlo_lib.entry_instructions(hlo_text):
    num = re.search(r"\bparameter\((\d+)\)", rhs)
    if num:
      if "S(5)" in rhs.split(" parameter(")[0] or int(num.group(1)) in host:
        params[name] = int(num.group(1))
      continue
    ops = hlo_lib.operands_of(rhs)
    if not any(o in params for o in ops):
      continue
    m = _SHAPE.match(rhs)
    opcode = hlo_lib.OPCODE.search(rhs)
    if m is None:
      continue
    shape = tuple(int(d) for d in m.group(2).split(",") if d)
    itemsize = jax.numpy.dtype(_DTYPES.get(m.group(1), "float32")).itemsize
    rows.append((name, opcode.group(1) if opcode else "?", shape,
                 int(np.prod(shape, dtype=np.int64)) * itemsize))
  return rows


_DTYPES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16", "f64": "float64", "s32": "int32", "s8": "int8",
           "u8": "uint8", "s64": "int64", "u32": "uint32", "pred": "bool", "s16": "int16"}


def count_all_gathers(hlo_text: str) -> int:
  """All-gathers in a compiled HLO module (sync `all-gather(` or async `all-gather-start(`)."""
  return len(re.findall(r"\ball-gather(?:-start)?\(", hlo_text))


def all_gather_groups(hlo_text: str) -> list[list[list[int]]]:
  """The device groups of each all-gather in a compiled HLO module, in program order.

  XLA prints `replica_groups=` in one of three forms, depending on its version:
    explicit  `{{0,2,4,6},{1,3,5,7}}`
    iota      `[2,4]<=[4,2]T(1,0)`: iota(N) reshaped to [4, 2], transposed by (1, 0), read as
              2 groups of 4;
    mesh axes `mesh['a'=4,'b'=2] {'a'}` (jax 0.11): the devices of a mesh (iota unless a
              `, device_ids=(...)` list follows the axes) grouped over the named axes, the
              other axes fixed; a sub-axis `'a':(pre)size` takes `size` of axis a's positions,
              `pre` apart.
  Each is expanded to its list of groups; a group lists device ids in gather order.

  Args:
    hlo_text: `jax.stages.Compiled.as_text()` of a jitted program.

  Returns:
    One entry per `all-gather(` / `all-gather-start(` instruction: its groups ([] for `{}`:
    all devices in one group).

  Raises:
    ValueError: a replica_groups form this parser does not know (with the text).
  """
  out = []
  for line in hlo_text.splitlines():
    if not re.search(r"\ball-gather(?:-start)?\(", line):
      continue
    at = line.find("replica_groups=")
    if at < 0:
      raise ValueError(f"all_gather_groups: expected replica_groups= in {line.strip()[:300]}")
    out.append(_parse_replica_groups(line[at + len("replica_groups="):]))
  return out


_IOTA_GROUPS = re.compile(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?\s*\{([^}]*)\}")


def _ints(text: str) -> list[int]:
  return [int(t) for t in re.findall(r"\d+", text)]


def _parse_replica_groups(text: str) -> list[list[int]]:
  """Groups from the text right after `replica_groups=` (see `all_gather_groups`)."""
  if text.startswith("{"):
    depth = 0
    for end, ch in enumerate(text):
      depth += {"{": 1, "}": -1}.get(ch, 0)
      if depth == 0:
        break
    inner = text[1:end]
    return [_ints(g) for g in re.findall(r"\{([^{}]*)\}", inner)]
  m = _IOTA_GROUPS.match(text)
  if m:
    num_groups, size = int(m.group(1)), int(m.group(2))
    dims = _ints(m.group(3))
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
      ids = ids.transpose(_ints(m.group(4)))
    return ids.reshape(num_groups, size).tolist()
  m = _MESH_GROUPS.match(text)
  if m:
    names, sizes = [], []
    for axis in m.group(1).split(","):
      name, size = axis.rsplit("=", 1)
      names.append(name.strip().strip("'\""))
      sizes.append(int(size))
    n = int(np.prod(sizes))
    ids = np.asarray(_ints(m.group(2)) if m.group(2) else np.arange(n)).reshape(sizes)
    # Each mesh axis becomes one or three dimensions: [size], or [pre, sub, size / (pre * sub)]
    # for a sub-axis; the grouped ones go last, in the order listed.
    dims: list[int] = []
    grouped: list[int] = []
    first: dict[str, int] = {}
    refs = [r.strip() for r in m.group(3).split(",") if r.strip()]
    subs: dict[str, tuple[int, int]] = {}
    for ref in refs:
      sm = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", ref)
      if sm is None or sm.group(1) not in names:
        raise ValueError(f"all_gather_groups: unknown axis {ref!r} in {text[:300]}")
      if sm.group(2):
        if sm.group(1) in subs:
          raise ValueError(f"all_gather_groups: two sub-axes of one axis in {text[:300]}")
        subs[sm.group(1)] = (int(sm.group(2)), int(sm.group(3)))
    for name, size in zip(names, sizes):
      first[name] = len(dims)
      if name in subs:
        pre, sub = subs[name]
        dims += [pre, sub, size // (pre * sub)]
      else:
        dims.append(size)
    for ref in refs:
      name = re.fullmatch(r"['\"]?([^'\":]+)['\"]?.*", ref).group(1)
      grouped.append(first[name] + (1 if name in subs else 0))
    rest = [d for d in range(len(dims)) if d not in grouped]
    size = int(np.prod([dims[d] for d in grouped]))
    return ids.reshape(dims).transpose(rest + grouped).reshape(-1, size).tolist()
  raise ValueError(f"all_gather_groups: unknown replica_groups form {text[:300]}")
