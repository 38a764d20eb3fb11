"""Static leaves: the leaves of the step's state and arguments that are not arrays.

A leaf that is not an array (a callable, a `functools.partial`, a string, a Python bool or int
in a module's fields) is static, as `eqx.filter_jit` treats it: it is not traced, placed or
counted; the step receives it as it is, and the new state keeps what the step returns there.
Everything jaxtier plans and runs sees the arrays only: `split` gives the pytree with each
static leaf replaced by None (an empty subtree, so the array leaves keep their paths), and
`merge` puts the static leaves back.

Python numbers follow JAX where they must vary. In the state, a number the step changes (a
counter, Flax's `TrainState.step` before its first step) is made a 0-d array, as `jax.jit`
makes it (`StepCall` finds them while tracing and raises `NumbersChanged`; the caller traces
again with them as arrays); the others stay static. In the other arguments, ints and floats
are traced as `jax.jit` traces them (a learning rate or step number passed each call must not
re-plan); bools are static (the step branches on them).

Structure checks (`same_structure`, `structure_diff`) compare the pytree's node types, its
leaves' paths and its arrays' shapes and dtypes, not the static data a node holds (a
`functools.partial` that a Flax NNX module keeps compares equal only to itself, so two
initialisations of one model have unequal tree structures that print the same).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_NUMBERS = (bool, int, float, complex)


def is_array(x: Any) -> bool:
  """Whether a leaf is an array the step traces: a `jax.Array` (or a tracer), a NumPy array
  or scalar, or a `jax.ShapeDtypeStruct` (an abstract state)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def is_number(x: Any) -> bool:
  """Whether a leaf is a Python number (bool, int, float or complex)."""
  return isinstance(x, _NUMBERS) and not isinstance(x, np.generic)


def traced_argument(path: str, x: Any) -> bool:
  """Whether a Python number among the step's arguments (after the state) is traced: ints,
  floats and complex numbers are, as `jax.jit` traces them; bools are static."""
  del path
  return not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Split:
  """A pytree split into its array leaves and its static ones.

  Attributes:
    arrays: the pytree with each static leaf replaced by None (its leaves are arrays).
    static: the pytree with each array leaf replaced by None.
    paths: the static leaves' paths (`jax.tree_util.keystr`), in flattening order.
  """

  arrays: Any
  static: Any
  paths: tuple[str, ...]

  @property
  def key(self) -> tuple[tuple[str, Any], ...]:
    """The static leaves as a hashable value: (path, leaf) pairs, a leaf that cannot be hashed
    by its identity. Equal keys mean the same static leaves, as `jax.jit` compares static
    arguments."""
    leaves = jax.tree_util.tree_leaves(self.static)
    return tuple((p, _Hashed(x)) for p, x in zip(self.paths, leaves))


class _Hashed:
  """A static leaf as a dictionary key: by value where it hashes, else by identity."""

  def __init__(self, value: Any):
    self.value = value
    try:
      self._hash = hash((type(value), value))
      self._by_value = True
    except TypeError:
      self._hash, self._by_value = id(value), False

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, _Hashed):
      return NotImplemented
    if not (self._by_value and other._by_value):
      return self.value is other.value
    return same_static(self.value, other.value)


def same_static(a: Any, b: Any) -> bool:
  """Whether two static leaves are the same: one object, or equal values of one type."""
  if a is b:
    return True
  if type(a) is not type(b):
    return False
  try:
    return bool(a == b)
  except Exception:  # pylint: disable=broad-except  (an __eq__ that returns no bool)
    return False


def split(tree: Any, numbers: Callable[[str, Any], bool] = lambda path, x: False,
          convert: bool = True, in_trace: bool = False) -> Split:
  """Splits `tree` into its arrays and its static leaves.

  Args:
    tree: a pytree.
    numbers: `numbers(path, x)` for each Python number `x`: True where it is an array leaf
      (traced), False where it is static.
    convert: make the Python numbers that are array leaves 0-d arrays (`jnp.asarray`, as
      `jax.jit` converts them); False leaves them as they are (JAX converts a step's outputs
      itself).
    in_trace: `tree` is a value inside one of jaxtier's traces (its arrays may be tracers).

  Raises:
    TypeError: a leaf is a tracer where `tree` is no value of jaxtier's traces: the offloaded
      step was called under `jax.jit`, `grad` or `vmap`.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  arrays, static, paths = [], [], []
  for path, x in flat:
    name = jax.tree_util.keystr(path)
    if not in_trace and isinstance(x, jax.core.Tracer):
      raise TypeError("jaxtier: called under a JAX transformation (jit, grad, vmap...); call the "
                      "offloaded step directly: it compiles itself, with the placement baked in")
    if is_array(x):
      arrays.append(x)
      static.append(None)
    elif is_number(x) and numbers(name, x):
      arrays.append(jnp.asarray(x) if convert else x)
      static.append(None)
    else:
      arrays.append(None)
      static.append(x)
      paths.append(name)
  return Split(treedef.unflatten(arrays), treedef.unflatten(static), tuple(paths))


def merge(arrays: Any, static: Any) -> Any:
  """The pytree `split` split: each None of `arrays` replaced by `static`'s leaf there."""
  return jax.tree_util.tree_map(lambda a, s: s if a is None else a, arrays, static,
                                is_leaf=lambda x: x is None)


def eval_shape(fn: Callable[..., Any], *args: Any) -> Any:
  """`jax.eval_shape(fn, *args)` of a function whose output has static leaves: its arrays as
  `jax.ShapeDtypeStruct`s, its static leaves (Python numbers among them) as they are."""
  static: list[Any] = []

  def arrays(*a):
    got = split(fn(*a), convert=False, in_trace=True)
    static.append(got.static)
    return got.arrays
  shapes = jax.eval_shape(arrays, *args)
  return merge(shapes, static[-1])


class NumbersChanged(Exception):
  """Raised while tracing (`StepCall`): the step returns state leaves that came in as static
  Python numbers changed (counters). Trace again with `paths` traced."""

  def __init__(self, paths: Sequence[str]):
    super().__init__("jaxtier: the step changes the Python numbers at " + ", ".join(paths)
                     + " of its state: they are traced as 0-d arrays")
    self.paths = tuple(paths)


class StepCall:
  """`fn(state, *args) -> (new_state, metrics)` over the array leaves alone.

  `step_call(state_arrays, *arg_arrays)` merges the static leaves back (`state`, `args`:
  the `Split`s of the inputs), calls `fn`, and returns the arrays of its new state and metrics
  (Python numbers among the metrics stay, as `jax.jit` returns them: as arrays). The static
  leaves it returned are then `outputs`: put them back with `merge_outputs`.

  The new state keeps the input's structure: where the step returns a structure that differs
  only in a node's static data (`same_structure`), the input's is used.

  Raises (while tracing):
    NumbersChanged: a static Python number of the state is returned changed.
    TypeError: the new state holds, where a static leaf came in, an array (other than for a
      Python number), or a static leaf where an array came in (named by path).
  """

  def __init__(self, fn: Callable[..., Any], state: Split, args: Split, api: str):
    self.fn, self.state, self.args, self.api = fn, state, args, api
    self.outputs: "tuple[Any, Any] | None" = None
    for attr in ("__name__", "__qualname__"):  # JAX names the traced program after it
      if hasattr(fn, attr):
        setattr(self, attr, getattr(fn, attr))

  def __call__(self, state_arrays: Any, *arg_arrays: Any) -> Any:
    state = merge(state_arrays, self.state.static)
    args = merge(tuple(arg_arrays), self.args.static)
    out = self.fn(state, *args)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      return out  # `take_inventory` says what is wrong
    new_state = self._new_state(state, out[0])
    metrics = split(out[1], lambda path, x: True, convert=False, in_trace=True)
    self.outputs = (new_state.static, metrics.static)
    return new_state.arrays, metrics.arrays

  def _new_state(self, state: Any, new: Any) -> Split:
    """The step's new state split as its state came in (`StepCall`'s doc)."""
    given, treedef = jax.tree_util.tree_flatten_with_path(state)
    got = jax.tree_util.tree_flatten_with_path(new)[0]
    if not same_structure(state, new):
      # `take_inventory` names what differs.
      return split(new, lambda path, x: False, convert=False, in_trace=True)
    static_at = set(self.state.paths)
    arrays, static, changed = [], [], []
    for (path, old), (_, x) in zip(given, got):
      name = jax.tree_util.keystr(path)
      if name not in static_at:
        if not (is_array(x) or is_number(x)):
          raise TypeError(
              f"{self.api}: the step returns state leaf {name} as a {type(x).__name__} "
              f"({x!r:.60}), but it came in as an array; return an array of its shape and "
              "dtype there")
        arrays.append(x)
        static.append(None)
      elif not is_array(x) and same_static(x, old):
        arrays.append(None)
        static.append(x)
      elif is_number(old):
        changed.append(name)
      elif is_array(x):
        raise TypeError(
            f"{self.api}: the step returns state leaf {name} as an array, but it came in as a "
            f"static {type(old).__name__} ({old!r:.60}), which jaxtier does not trace; keep it "
            "as it came, or pass an array there")
      else:  # another static value: kept, as jit returns what a step makes there
        arrays.append(None)
        static.append(x)
    if changed:
      raise NumbersChanged(changed)
    return Split(treedef.unflatten(arrays), treedef.unflatten(static), self.state.paths)

  def merge_outputs(self, new_state: Any, metrics: Any) -> tuple[Any, Any]:
    """The step's (new_state, metrics) from their arrays and the static leaves it returned."""
    if self.outputs is None:
      return new_state, metrics
    return merge(new_state, self.outputs[0]), merge(metrics, self.outputs[1])


# -- structure checks --------------------------------------------------------------------------

def _skeleton(treedef: Any) -> Any:
  """The node types of a tree structure, nested, without the data the nodes hold."""
  data = treedef.node_data()
  if data is None:
    return "*"
  return (data[0], tuple(_skeleton(c) for c in treedef.children()))


def _leaves_by_path(tree: Any) -> dict[str, Any]:
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def same_structure(a: Any, b: Any) -> bool:
  """Whether pytrees `a` and `b` have one structure, up to the static data their nodes hold:
  equal tree structures, or the same node types and leaf paths."""
  da, db = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
  if da == db:
    return True
  return _skeleton(da) == _skeleton(db) and list(_leaves_by_path(a)) == list(_leaves_by_path(b))


def describe(x: Any) -> str:
  """A leaf in a few words: 'float32[64,64]' for an array, 'a static partial' otherwise."""
  if is_array(x):
    dtype = x.dtype
    name = (jnp.dtype(dtype).name if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
            else str(dtype))
    return f"{name}{list(np.shape(x))}"
  return f"a static {type(x).__name__}"


def structure_diff(a: Any, b: Any, names: tuple[str, str] = ("expected", "got"),
                   limit: int = 4) -> list[str]:
  """What differs between pytrees `a` and `b` (arrays, `jax.ShapeDtypeStruct`s or static
  leaves), one short line per difference, the first `limit` and a count of the others: leaves
  only one has, leaves whose shape, dtype or kind differ (named by path), else the first node
  whose type differs. [] when they have one structure (`same_structure`) and their arrays
  the same shapes and dtypes."""
  left, right = _leaves_by_path(a), _leaves_by_path(b)
  na, nb = names
  lines = [f"{p}: {describe(x)} in the {na}, absent from the {nb}"
           for p, x in left.items() if p not in right]
  lines += [f"{p}: {describe(x)} in the {nb}, absent from the {na}"
            for p, x in right.items() if p not in left]
  for p, x in left.items():
    if p in right and describe(x) != describe(right[p]):
      lines.append(f"{p}: {describe(x)} in the {na}, {describe(right[p])} in the {nb}")
  if not lines:
    where = _first_node_difference(jax.tree_util.tree_structure(a),
                                   jax.tree_util.tree_structure(b), ())
    if where is not None:
      trail, ta, tb = where
      at = " under " + " > ".join(trail) if trail else " at the root"
      lines.append(f"a node {ta} in the {na} where the {nb} has a {tb}{at}")
  more = len(lines) - limit
  return lines[:limit] + ([f"and {more} more"] if more > 0 else [])


def _first_node_difference(a: Any, b: Any, trail: tuple[str, ...]
                           ) -> "tuple[tuple[str, ...], str, str] | None":
  """(the nodes above it, its description in a, in b) of the first node whose type or number
  of children differs, or None."""
  def name(d):
    data = d.node_data()
    kind = "leaf" if data is None else getattr(data[0], "__name__", str(data[0]))
    return f"{kind} of {len(d.children())}" if data is not None else kind
  if name(a) != name(b):
    return trail, name(a), name(b)
  for k, (ca, cb) in enumerate(zip(a.children(), b.children())):
    got = _first_node_difference(ca, cb, trail + (f"{name(a)}[{k}]",))
    if got is not None:
      return got
  return None
