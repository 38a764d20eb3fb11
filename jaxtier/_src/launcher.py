"""`python -m jaxtier run`: runs an unmodified script with its train step offloaded.

The launcher patches `jax.jit`, `flax.nnx.jit` and `equinox.filter_jit` (where those import),
runs the script with `runpy` as Python would, and restores them when it ends. A function the
script jits is wrapped in a `Jitted`, which calls the original jit until a call shows that the
function is a train step: it donates a state and returns it. That function then runs as a
`jaxtier.offload`ed step (`Step`), and a line on stderr (wrapped to the terminal's width) says
which function and how it was planned (`--plan_json` writes each plan, leaf by leaf); every
line `run` prints itself is wrapped so (`_say`). Everything else the script does runs as it
wrote it.

What is a train step, by frontend:

- `jax.jit`: a donated argument (`donate_argnums` / `donate_argnames`) whose pytree (structure,
  shapes, dtypes) is the output, or one element of a tuple, list or dict output. The state is
  those arguments; the rest of the output is the step's metrics.
- `equinox.filter_jit` with `donate="all"` / `"warn"` (every argument donated) or
  `"all-except-first"` / `"warn-except-first"` (all but the first): as `jax.jit`, on the arrays
  of each argument (`eqx.partition(x, eqx.is_array)`); the rest is static, as filter_jit has it.
- `flax.nnx.jit`: a donated argument that is a graph node (a Module, an Optimizer). NNX steps
  update their nodes in place and may return only metrics: the state is `nnx.split` of every
  graph-node argument, and after each step `nnx.update` writes the new state into the script's
  objects, as `nnx.jit` does.

Where a step cannot be offloaded (its plan is refused, it does not trace, it takes options
jaxtier cannot keep) it runs as the original jit after a one-line warning, or the run stops
with `RunError` under `strict`. docs/design.md ("Run an unmodified script") says why it is
built this way.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import json
import logging
import os
import runpy
import sys
import textwrap
import threading
import traceback
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src import api
from jaxtier._src import command_help
from jaxtier._src import early_interrupt
from jaxtier._src import paths
from jaxtier._src import rerun
from jaxtier._src.errors import AdmissionError, PlanError
from jaxtier._src.options import OffloadOptions
from jaxtier._src.planning import plan_text
from jaxtier._src.runtime import runner
from jaxtier._src.units import format_bytes, parse_bytes
from jaxtier._src.vocab import NamedPolicy, is_named

# Functions defined in these packages are the libraries' own jits (an optimizer's, a framework's
# inner jit), never the script's step.
_LIBRARIES = frozenset({"jax", "jaxlib", "flax", "equinox", "optax", "orbax", "chex"})
_OWN = ("jaxtier._src", "jaxtier.experimental")
# jax.jit options a step offloaded by jaxtier cannot keep: it compiles its own programs for the
# state's devices.
_JAX_JIT_REFUSED = ("device", "backend", "compiler_options", "abstracted_axes")
_PREFIX = "jaxtier run"
# The columns a wrapped line fits where the terminal's width is unknown (no terminal, no
# COLUMNS).
_DEFAULT_WIDTH = 100


class RunError(RuntimeError):
  """`python -m jaxtier run --strict`: a step the launcher cannot offload, or none found."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOptions:
  """How `python -m jaxtier run` offloads the script's step.

  Attributes:
    policy: a named policy: 'auto' (the planner's solver), 'optimizer_state_on_host' or 'none'.
    device_budget: device memory the step may use at its peak, bytes per device or a size
      string ('80GB', '16GiB'); None: what `jaxtier.offload` takes by default (on a GPU, what
      JAX's allocator may use less 5%; on the CPU no limit).
    host_budget: pinned host memory the plan may pin, as `device_budget`; None: what the host
      can pin.
    steps: the functions to wrap, each 'module:function' or 'function' (`function` is the
      name or the qualified name; `module` the module that defines it, where a script run by
      path is named by its file's stem or '__main__'); empty: the first train step called.
    strict: raise `RunError` where a step cannot be offloaded (and at the end where none was),
      instead of a warning and the original jit.
    plan_json: a file to write the wrapped steps' plans to, as JSON `{function: plan}` (each
      `Plan.to_json()`: every leaf's path, role, placement and memory kind, the notes),
      rewritten whenever a step is planned again; None: none written.

  Raises:
    jaxtier.OptionError: a budget that is neither bytes > 0 nor a size string.
    ValueError: a policy that is not named, or a step that is not 'module:function'.
  """

  policy: str = NamedPolicy.AUTO
  device_budget: Any = None
  host_budget: Any = None
  steps: tuple[str, ...] = ()
  strict: bool = False
  plan_json: "str | None" = None

  def __post_init__(self):
    if self.policy not in tuple(NamedPolicy):
      raise ValueError(f"{_PREFIX}: expected --policy in {', '.join(NamedPolicy)}, got "
                       f"{self.policy!r}")
    # The budgets parsed as jaxtier.offload parses them (and refused as it refuses them).
    OffloadOptions(device_budget=self.device_budget, host_budget=self.host_budget,
                   policy=self.policy)
    for spec in self.steps:
      module, _, name = spec.rpartition(":")
      if not name or (":" in module) or (spec.count(":") and not module):
        raise ValueError(f"{_PREFIX}: expected --step=module:function or --step=function, got "
                         f"{spec!r}")


@dataclasses.dataclass(frozen=True)
class Target:
  """The script: a file (`path`) or a module (`module`, as `python -m` runs it), and its
  arguments (`argv`, without the program name)."""

  path: "str | None"
  module: "str | None"
  argv: tuple[str, ...]

  @property
  def name(self) -> str:
    """How the script's own functions are named (their module is '__main__'): the module, or
    the file's stem."""
    if self.module:
      return self.module
    return os.path.splitext(os.path.basename(self.path))[0]


class Launcher:
  """Patches the jits, runs a script, restores them; decides which functions are offloaded.

  Attributes:
    wrapped: the names ('module:function') of the functions run offloaded so far.
  """

  def __init__(self, options: RunOptions, target_name: str = "__main__",
               say: "Callable[[str], None] | None" = None):
    self.options = options
    self.target_name = target_name
    self.wrapped: list[str] = []
    self.unwrapped: list[str] = []  # steps that could not be offloaded (said when they were)
    self.claimed: "str | None" = None  # without --step: the first train step called
    self._say = say or _say
    self._said: set[str] = set()
    self._local = threading.local()
    # Steps planned (by `lower`) before their state exists: a jit that builds such a state builds
    # it where the plan puts it (`Jitted._build_pending_state`).
    self.pending: list[Step] = []
    self.plans: dict[str, Any] = {}  # {function: its latest plan}
    # The latest Ctrl-C raised out of an offloaded step, and what it interrupted there.
    self.interrupt: "tuple[BaseException, str] | None" = None
    self._originals: list[tuple[Any, str, Any]] = []

  # -- the patches ------------------------------------------------------------------------

  @contextlib.contextmanager
  def patched(self):
    """Within it `jax.jit`, `flax.nnx.jit` and `equinox.filter_jit` are the launcher's."""
    self._patch(jax, "jit", self._jax_jit)
    if importlib.util.find_spec("flax") is not None:
      from flax import nnx  # pylint: disable=g-import-not-at-top
      self._patch(nnx, "jit", self._nnx_jit)
    if importlib.util.find_spec("equinox") is not None:
      import equinox  # pylint: disable=g-import-not-at-top
      self._patch(equinox, "filter_jit", self._eqx_filter_jit)
    try:
      yield self
    finally:
      for module, name, original in reversed(self._originals):
        setattr(module, name, original)
      self._originals.clear()

  def _patch(self, module: Any, name: str, make: Callable[..., Any]) -> None:
    original = getattr(module, name)
    self._originals.append((module, name, original))

    @functools.wraps(original)
    def patched(fun: Any = _MISSING, /, **kwargs: Any) -> Any:
      if fun is _MISSING:  # `@jax.jit(donate_argnums=0)`: a decorator
        return lambda f: patched(f, **kwargs)
      with self.passthrough():
        jitted = original(fun, **kwargs)
      if self.inside or _is_library(fun):
        return jitted
      return Jitted(self, make(fun, kwargs), fun, jitted)

    setattr(module, name, patched)

  @contextlib.contextmanager
  def passthrough(self):
    """Within it the patched jits are the originals: the launcher's and jaxtier's own calls,
    the frameworks' inner jits, and jits traced inside a step."""
    self._local.depth = getattr(self._local, "depth", 0) + 1
    try:
      yield
    finally:
      self._local.depth -= 1

  @property
  def inside(self) -> bool:
    return getattr(self._local, "depth", 0) > 0

  def _jax_jit(self, fun: Any, kwargs: dict[str, Any]) -> "Frontend":
    return JaxJit(fun, kwargs)

  def _nnx_jit(self, fun: Any, kwargs: dict[str, Any]) -> "Frontend":
    return NnxJit(fun, kwargs)

  def _eqx_filter_jit(self, fun: Any, kwargs: dict[str, Any]) -> "Frontend":
    return EqxFilterJit(fun, kwargs)

  # -- running the script -----------------------------------------------------------------

  def run(self, target: Target) -> int:
    """Runs `target` under the patches, as `python script.py args` / `python -m module args`
    would; returns its exit status (raising what it raises, but `SystemExit`)."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    code: Any = 0
    try:
      with self.patched():
        # The script's Ctrl-C is Python's (KeyboardInterrupt); until now it ended the command.
        early_interrupt.restore()
        try:
          if target.module:
            sys.argv = [target.module, *target.argv]
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
          else:
            sys.argv = [target.path, *target.argv]
            # As `python script.py`: the script's folder first on the import path.
            folder = os.path.dirname(os.path.abspath(target.path))
            if sys.path:
              sys.path[0] = folder
            else:
              sys.path.insert(0, folder)
            runpy.run_path(target.path, run_name="__main__")
        except SystemExit as e:
          code = e.code
    finally:
      sys.argv = saved_argv
      if saved_path0 is not None and sys.path:
        sys.path[0] = saved_path0
    return _exit_status(code)

  def interrupted(self, error: KeyboardInterrupt, target: Target) -> str:
    """The line said where the script did not catch the Ctrl-C `error`: what it interrupted
    (a step of which function, or the script), the script's line it reached, and that the
    script ended there. (The note on `error`, for a script that catches it, says how to go
    on from a step's `last_result`; a script that did not has ended.)"""
    what = "in the script"
    if self.interrupt is not None and self.interrupt[0] is error:
      what = self.interrupt[1]
    where = _script_line(error, target)
    return (f"{_PREFIX}: {early_interrupt.INTERRUPTED} {what}"
            + (f" ({where})" if where else "")
            + ": the script ended there, and only what it saved itself is kept")

  def finish(self) -> None:
    """Says what the run wrapped where it wrapped nothing or not every step named.

    Raises:
      RunError: with `strict`, where the run wrapped no step, or not every step named.
    """
    missing = [s for s in self.options.steps
               if not any(_named(s, name, self.target_name) for name in self.wrapped)]
    if self.options.steps and missing:
      self._cannot(f"--step={', --step='.join(missing)} named no function that the script "
                   "jitted as a train step (one that donates a state and returns it) and called")
    elif not self.wrapped and not self.unwrapped:
      self._cannot("no jitted function donated a state and returned it: the script ran "
                   "unwrapped (jaxtier wraps jax.jit, nnx.jit and eqx.filter_jit with "
                   "donation)")

  # -- decisions --------------------------------------------------------------------------

  def name_of(self, fun: Any) -> str:
    """'module:qualname', where the script's own module is named as the script."""
    fun = _unwrapped(fun)
    module = getattr(fun, "__module__", None) or "?"
    if module == "__main__":
      module = self.target_name
    qualname = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", repr(fun))
    return f"{module}:{qualname}"

  def claim(self, name: str) -> "str | None":
    """None where the train step `name` may be wrapped, else why not (it is not named by
    --step, or, without --step, another train step was called first)."""
    if self.options.steps:
      if any(_named(s, name, self.target_name) for s in self.options.steps):
        return None
      return "not named by --step"
    if self.claimed is None:
      self.claimed = name
    if name != self.claimed:
      return (f"only the first train step is wrapped ({self.claimed}); --step names the ones "
              "to wrap")
    return None

  def named(self, name: str) -> bool:
    return any(_named(s, name, self.target_name) for s in self.options.steps)

  def said(self, text: str) -> None:
    """Says `text` ('jaxtier run: ' first) once, by `say` (on stderr, wrapped to the
    terminal's width: `_say`)."""
    if text not in self._said:
      self._said.add(text)
      self._say(f"{_PREFIX}: {text}")

  def planned(self, name: str, plan: Any) -> None:
    """Keeps `plan` as the step `name`'s latest, and writes them all to `plan_json`, if
    given."""
    self.plans[name] = plan
    if self.options.plan_json:
      plans = {n: json.loads(p.to_json()) for n, p in self.plans.items()}
      with open(self.options.plan_json, "w", encoding="utf-8") as f:
        json.dump(plans, f, indent=1)

  def _cannot(self, why: str, strict_why: "str | None" = None) -> None:
    if self.options.strict:
      raise RunError(f"{_PREFIX}: error: {strict_why or why}")
    self.said(f"warning: {why}")

  def cannot(self, name: str, why: str) -> None:
    """A step that cannot be offloaded: a warning (it runs as the original jit), or
    `RunError` under `strict`."""
    if name not in self.unwrapped:
      self.unwrapped.append(name)
    self._cannot(f"{name} runs unwrapped: {why}", f"{name} cannot be offloaded: {why}")

  def offload(self, fn: Callable[..., Any]) -> Any:
    options = self.options
    return api.offload(fn, policy=options.policy, device_budget=options.device_budget,
                       host_budget=options.host_budget)


class _Missing:
  def __repr__(self) -> str:
    return "<missing>"


_MISSING = _Missing()


def _say(text: str) -> None:
  """Prints `text` (`run`'s own words) on stderr, each of its lines wrapped to the terminal's
  width (`_fit_to_terminal`)."""
  print("\n".join(map(_fit_to_terminal, text.split("\n"))), file=sys.stderr, flush=True)


def _fit_to_terminal(line: str) -> str:
  """`line` wrapped at its spaces into lines of the terminal's width (COLUMNS, else the
  terminal's, else 100 columns: `plan_text.terminal_width`), those after the first indented
  by two spaces. A word longer than a line is kept whole: a function's name stays as --step
  takes it."""
  width = plan_text.terminal_width(default=_DEFAULT_WIDTH)
  return "\n".join(textwrap.wrap(line, width, subsequent_indent="  ", break_long_words=False,
                                 break_on_hyphens=False)) or line


def _command_line_fix(error: Exception, options: RunOptions) -> "str | None":
  """The fix for a plan refused over a budget, in `run`'s flags, chosen by the limit that
  refused it (`AdmissionError.limit`; a `PlanError` that is no `AdmissionError`: the state
  alone over the device budget); None where the error says no `reason`, or no flag of `run`
  raises its limit (the error's own fix then stands).
  """
  if not isinstance(error, PlanError) or not error.reason:
    return None
  limit = error.limit if isinstance(error, AdmissionError) else "device_budget"
  auto = is_named(options.policy, NamedPolicy.AUTO)
  if limit == "device_budget":
    need = getattr(error, "need_bytes", None)
    return ("a larger --device_budget" + (f" (at least {format_bytes(need)})" if need else "")
            + ("" if auto else ", or --policy=auto (the planner puts what it may on the host)"))
  if limit == "host_limit":
    fixes = []
    if (options.host_budget is not None and error.limit_bytes is not None
        and parse_bytes(options.host_budget) == error.limit_bytes):
      fixes.append("a larger --host_budget")
    if not auto:
      fixes.append("--policy=auto (the planner keeps on the device what fits there)")
    return ", or ".join(fixes) or None
  return None


def _unwrapped(fun: Any) -> Any:
  while isinstance(fun, functools.partial):
    fun = fun.func
  return fun


def _is_library(fun: Any) -> bool:
  module = getattr(_unwrapped(fun), "__module__", None) or ""
  return module.split(".")[0] in _LIBRARIES or module.startswith(_OWN)


def _named(spec: str, name: str, target_name: str) -> bool:
  """Whether --step=`spec` names the function `name` ('module:qualname')."""
  module, _, function = spec.rpartition(":")
  have_module, _, qualname = name.partition(":")
  if function not in (qualname, qualname.rsplit(".", 1)[-1]):
    return False
  return not module or module == have_module or (module == "__main__"
                                                 and have_module == target_name)


def _script_line(error: BaseException, target: Target) -> "str | None":
  """Where in the script's own file `error` was raised ('train.py, line 42': the innermost of
  its frames there), or None where none of them is."""
  if target.path:
    shown, file = target.path, os.path.abspath(target.path)
  else:
    try:
      spec = importlib.util.find_spec(target.module)
      if spec is not None and spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(f"{target.module}.__main__")
    except (ImportError, ValueError):
      return None
    if spec is None or not spec.origin:
      return None
    shown, file = target.module, os.path.abspath(spec.origin)
  lines = [n for frame, n in traceback.walk_tb(error.__traceback__)
           if os.path.abspath(frame.f_code.co_filename) == file]
  return f"{shown}, line {lines[-1]}" if lines else None


def _exit_status(code: Any) -> int:
  if code is None:
    return 0
  if isinstance(code, int):
    return code
  print(code, file=sys.stderr)
  return 1


# -- pytrees ----------------------------------------------------------------------------------


def _signature(tree: Any) -> Any:
  """The pytree structure and each leaf's (shape, dtype): what a step's state must keep."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, tuple((tuple(np.shape(x)), _dtype(x)) for x in leaves)


def _dtype(x: Any) -> Any:
  """`x`'s dtype as jax.jit sees it (a Python number's: its default dtype)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return jnp.result_type(x)
  return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else jnp.dtype(dtype)


def _children(tree: Any) -> "tuple[list[Any], Any]":
  """The top-level children of a tuple, list, dict or other pytree node, and the treedef that
  puts them back (`treedef.unflatten(children)`)."""
  return jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)


def _deleted(tree: Any) -> bool:
  return any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(tree))


def _has_tracer(tree: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _bind(fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> "tuple[Any, ...] | None":
  """The call's arguments as positional ones (keywords bound by the function's signature);
  None where a keyword-only or **kwargs argument is given."""
  if not kwargs:
    return args
  try:
    bound = inspect.signature(fun).bind(*args, **kwargs)
  except (TypeError, ValueError):
    return None
  return None if bound.kwargs else tuple(bound.args)


def _argnums(fun: Any, argnums: Any, argnames: Any) -> set[int]:
  """`argnums` and the positions of `argnames` in `fun`'s signature."""
  nums = {argnums} if isinstance(argnums, int) else set(argnums or ())
  names = {argnames} if isinstance(argnames, str) else set(argnames or ())
  if names:
    try:
      params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
      params = []
    nums |= {i for i, p in enumerate(params) if p.name in names and p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
  return nums


class Cannot(Exception):
  """Why a function that looks like a train step cannot be offloaded."""


# -- frontends: how each jit's function becomes `fn(state, *rest) -> (new_state, aux)` --------


@dataclasses.dataclass
class Layout:
  """How one call's arguments and output map onto `jaxtier.offload`'s step.

  Attributes:
    key: what the layout depends on beyond the arrays (static arguments, static parts); one
      `Step` per key.
    state: the positions of the arguments that make the state.
    pure: `pure(state, *rest) -> (new_state, aux)`, `state` a tuple of the state's parts.
    split: `split(args) -> (state, rest)`: a call's arguments as `pure` takes them.
    join: `join(args, new_state, aux) -> output`: the step's result as the script's function
      returns it (and the script's objects updated, for NNX).
  """

  key: Any
  state: tuple[int, ...]
  pure: Callable[..., Any]
  split: Callable[[tuple[Any, ...]], tuple[Any, tuple[Any, ...]]]
  join: Callable[[tuple[Any, ...], Any, Any], Any]
  in_shardings: Any = None   # jax.jit only: (state's, rest's) prefixes, or None
  out_shardings: Any = None  # jax.jit only: the aux's prefix, or None


class Frontend:
  """One jit's rules (`JaxJit`, `EqxFilterJit`, `NnxJit`)."""

  what = "jit"

  def __init__(self, fun: Any, kwargs: dict[str, Any]):
    self.fun = fun
    self.kwargs = kwargs

  def donates(self) -> bool:
    """Whether the jit donates anything (no call is a train step otherwise)."""
    raise NotImplementedError

  def refused_options(self) -> "str | None":
    """The jit's options jaxtier cannot keep, said; None where it can keep them all."""
    raise NotImplementedError

  def key(self, args: tuple[Any, ...]) -> Any:
    """What the layout of a call depends on beyond the arrays (hashable)."""
    raise NotImplementedError

  def layout(self, args: tuple[Any, ...], original: Any) -> "Layout | None":
    """The layout of a call with these (positional) arguments; None where the call is no train
    step (nothing donated comes back).

    Raises:
      Cannot: it is a train step that jaxtier cannot offload (said why).
    """
    raise NotImplementedError


def _match(donated: Sequence[int], args: tuple[Any, ...], out: Any,
           dynamic: Callable[[Any], Any] = lambda x: x
           ) -> "tuple[tuple[int, ...], tuple[Any, ...] | None]":
  """The donated arguments that come back in `out` (the whole output, or one of its top-level
  children each), and where: (positions, slots), slots None for the whole output. `dynamic`
  takes the arrays of an argument (or output) to compare."""
  wanted = [(i, _signature(dynamic(args[i]))) for i in donated]
  whole = _signature(dynamic(out))
  for i, sig in wanted:
    if sig == whole:
      return (i,), None
  children, _ = _children(out)
  if not children or (len(children) == 1 and children[0] is out):
    return (), ()
  sigs = [_signature(dynamic(c)) for c in children]
  positions, slots, used = [], [], set()
  for i, sig in wanted:
    # The child at the argument's own position first (`return params, opt_state, loss`).
    order = ([i] if i < len(sigs) else []) + list(range(len(sigs)))
    for j in order:
      if j not in used and sigs[j] == sig:
        positions.append(i)
        slots.append(j)
        used.add(j)
        break
  return tuple(positions), tuple(slots)


class _ByArgnums(Frontend):
  """A frontend whose static and donated arguments are given as jax.jit gives them:
  `static_argnums` / `static_argnames`, `donate_argnums` / `donate_argnames`."""

  def __init__(self, fun: Any, kwargs: dict[str, Any]):
    super().__init__(fun, kwargs)
    self.static = _argnums(fun, kwargs.get("static_argnums"), kwargs.get("static_argnames"))
    self.donated = _argnums(fun, kwargs.get("donate_argnums"),
                            kwargs.get("donate_argnames")) - self.static

  def donates(self) -> bool:
    return bool(self.donated)


class JaxJit(_ByArgnums):
  """`jax.jit(fun, donate_argnums=..., static_argnums=..., in_shardings=..., ...)`."""

  what = "jax.jit"

  def refused_options(self) -> "str | None":
    given = [k for k in _JAX_JIT_REFUSED if self.kwargs.get(k) is not None]
    for name in ("in_shardings", "out_shardings"):
      value = self.kwargs.get(name)
      if value is not None and not _is_sharding_prefix(value):
        given.append(f"{name} other than Shardings (PartitionSpecs need the jit's mesh)")
    return f"jax.jit's {', '.join(given)}" if given else None

  def key(self, args):
    return tuple(args[i] for i in sorted(self.static) if i < len(args))

  def layout(self, args, original):
    out = original.eval_shape(*args)
    donated = sorted(i for i in self.donated if i < len(args))
    positions, slots = _match(donated, args, out)
    if not positions:
      return None
    static = {i: args[i] for i in self.static if i < len(args)}
    dynamic = [i for i in range(len(args)) if i not in static]
    fun, n = self.fun, len(args)

    def assemble(state, rest):
      it, parts = iter(rest), dict(zip(positions, state))
      return [static[i] if i in static else parts[i] if i in parts else next(it)
              for i in range(n)]

    def pure(state, *rest):
      result = fun(*assemble(state, rest))
      if slots is None:
        return (result,), None
      children, _ = _children(result)
      return (tuple(children[j] for j in slots),
              tuple(c for j, c in enumerate(children) if j not in slots))

    top = None if slots is None else _children(out)[1]

    def join(call_args, new_state, aux):
      del call_args
      if slots is None:
        return new_state[0]
      children, it = [], iter(aux)
      parts = dict(zip(slots, new_state))
      for j in range(top.num_leaves):
        children.append(parts[j] if j in parts else next(it))
      return top.unflatten(children)

    rest_positions = [i for i in dynamic if i not in positions]
    in_sh = self._in_shardings(dynamic, positions, rest_positions)
    out_sh = self._out_shardings(out, positions, slots, args)
    return Layout(key=self.key(args), state=tuple(positions), pure=pure,
                  split=lambda a: (tuple(a[i] for i in positions),
                                   tuple(a[i] for i in rest_positions)),
                  join=join, in_shardings=in_sh, out_shardings=out_sh)

  def _in_shardings(self, dynamic, positions, rest_positions):
    """(the state parts' prefixes, the rest's), from `in_shardings` over the dynamic
    arguments (as jax.jit indexes them); None where none is given."""
    given = self.kwargs.get("in_shardings")
    if given is None:
      return None
    if not isinstance(given, (tuple, list)):
      return (tuple(given for _ in positions), tuple(given for _ in rest_positions))
    if len(given) != len(dynamic):
      raise Cannot(f"in_shardings has {len(given)} entries for {len(dynamic)} arguments")
    of = dict(zip(dynamic, given))
    return tuple(of[i] for i in positions), tuple(of[i] for i in rest_positions)

  def _out_shardings(self, out, positions, slots, args):
    """The aux's prefix of `out_shardings` (None where none is given). The state's part must
    be the state's own shardings: each leaf stays where it is placed, step after step."""
    given = self.kwargs.get("out_shardings")
    if given is None:
      return None
    if slots is None:
      state_given, aux_given = [given], None
    elif isinstance(given, jax.sharding.Sharding):
      state_given = [given] * len(slots)
      aux_given = tuple(given for j in range(_children(out)[1].num_leaves) if j not in slots)
    else:
      children = list(given) if isinstance(given, (tuple, list)) else _children(given)[0]
      if len(children) != _children(out)[1].num_leaves:
        raise Cannot("out_shardings is not a prefix of the output's top level")
      state_given = [children[j] for j in slots]
      aux_given = tuple(c for j, c in enumerate(children) if j not in slots)
    in_given = self.kwargs.get("in_shardings")
    dynamic = [k for k in range(len(args)) if k not in self.static]
    for i, sh in zip(positions, state_given):
      want = (in_given[dynamic.index(i)] if isinstance(in_given, (tuple, list))
              else in_given)
      if want is None:  # the shardings the argument has
        want = _shardings_of(args[i])
      if sh is not None and not _same_prefix(sh, want, args[i]):
        raise Cannot(f"out_shardings gives the state (argument {i}) other shardings than it "
                     "comes in with; jaxtier keeps each state leaf where it is placed")
    return aux_given


def _is_sharding_prefix(value: Any) -> bool:
  return all(isinstance(s, jax.sharding.Sharding) for s in jax.tree_util.tree_leaves(
      value, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))


def _shardings_of(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda x: getattr(x, "sharding", None), tree)


def _same_prefix(a: Any, b: Any, tree: Any) -> bool:
  """Whether sharding prefixes `a` and `b` give each leaf of `tree` the same sharding (memory
  kinds aside)."""
  def per_leaf(prefix):
    is_leaf = lambda x: x is None or isinstance(x, jax.sharding.Sharding)
    return jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda s, sub: jax.tree_util.tree_map(lambda _: _Box(s), sub), prefix, tree,
        is_leaf=is_leaf))
  for x, sa, sb in zip(jax.tree_util.tree_leaves(tree), per_leaf(a), per_leaf(b)):
    if sa.value is None or sb.value is None:
      continue
    if not sa.value.with_memory_kind("device").is_equivalent_to(
        sb.value.with_memory_kind("device"), np.ndim(x)):
      return False
  return True


@dataclasses.dataclass(frozen=True)
class _Box:
  """A sharding (or None) as one pytree leaf."""
  value: Any


def _put(tree: Any, prefix: Any) -> Any:
  """`tree` with each leaf in its sharding from the prefix `prefix` (None: left where it is),
  in the memory kind it is in (the plan decides that)."""
  def put(s, sub):
    def one(x):
      if s is None or not isinstance(x, jax.Array):
        return jax.device_put(x, s) if s is not None else x
      kind = x.sharding.memory_kind
      target = s.with_memory_kind(kind) if kind is not None else s
      return x if x.sharding.is_equivalent_to(target, x.ndim) else jax.device_put(x, target)
    return jax.tree_util.tree_map(one, sub)
  return jax.tree_util.tree_map(
      put, prefix, tree, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding))


class EqxFilterJit(Frontend):
  """`equinox.filter_jit(fun, donate=...)`: arrays traced, everything else static."""

  what = "eqx.filter_jit"

  def __init__(self, fun: Any, kwargs: dict[str, Any]):
    super().__init__(fun, kwargs)
    self.donate = kwargs.get("donate", "none")

  def donates(self) -> bool:
    return self.donate in ("all", "warn", "all-except-first", "warn-except-first")

  def refused_options(self) -> "str | None":
    others = sorted(k for k in self.kwargs if k != "donate")
    return f"eqx.filter_jit's {', '.join(others)}" if others else None

  def key(self, args):
    import equinox as eqx  # pylint: disable=g-import-not-at-top
    statics = []
    for a in args:
      leaves, treedef = jax.tree_util.tree_flatten(eqx.partition(a, eqx.is_array)[1])
      statics.append((treedef, tuple(_hashable(x) for x in leaves)))
    return tuple(statics)

  def layout(self, args, original):
    del original
    import equinox as eqx  # pylint: disable=g-import-not-at-top
    first = 0 if self.donate in ("all", "warn") else 1
    donated = list(range(first, len(args)))
    out = eqx.filter_eval_shape(self.fun, *args)
    is_array = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
    dynamic = lambda x: eqx.partition(x, is_array)[0]
    positions, slots = _match(donated, args, out, dynamic)
    if not positions:
      return None
    statics = [eqx.partition(a, eqx.is_array)[1] for a in args]
    fun, n = self.fun, len(args)
    out_static: dict[str, Any] = {}

    def pure(state, *rest):
      it, parts = iter(rest), dict(zip(positions, state))
      call = [eqx.combine(parts[i] if i in parts else next(it), statics[i]) for i in range(n)]
      result = fun(*call)
      dyn, out_static["value"] = eqx.partition(result, eqx.is_array)
      if slots is None:
        return (dyn,), None
      children, _ = _children(dyn)
      return (tuple(children[j] for j in slots),
              tuple(c for j, c in enumerate(children) if j not in slots))

    top = None if slots is None else _children(dynamic(out))[1]

    def join(call_args, new_state, aux):
      del call_args
      if slots is None:
        dyn = new_state[0]
      else:
        children, it, parts = [], iter(aux), dict(zip(slots, new_state))
        for j in range(top.num_leaves):
          children.append(parts[j] if j in parts else next(it))
        dyn = top.unflatten(children)
      return eqx.combine(dyn, out_static["value"])

    rest_positions = [i for i in range(n) if i not in positions]
    return Layout(key=self.key(args), state=tuple(positions), pure=pure,
                  split=lambda a: (tuple(dynamic(a[i]) for i in positions),
                                   tuple(dynamic(a[i]) for i in rest_positions)),
                  join=join)


def _hashable(x: Any) -> Any:
  try:
    hash(x)
    return x
  except TypeError:
    return id(x)


class NnxJit(_ByArgnums):
  """`flax.nnx.jit(fun, donate_argnums=..., ...)`: graph nodes in, updated in place."""

  what = "nnx.jit"

  def refused_options(self) -> "str | None":
    given = [k for k in ("in_shardings", "out_shardings", "device", "backend")
             if self.kwargs.get(k) is not None]
    if self.kwargs.get("graph") is False:
      given.append("graph=False")
    return f"nnx.jit's {', '.join(given)}" if given else None

  def key(self, args):
    nodes = self._nodes(args)
    from flax import nnx  # pylint: disable=g-import-not-at-top
    graphdef = nnx.graphdef(tuple(args[i] for i in nodes)) if nodes else None
    return (tuple(args[i] for i in sorted(self.static) if i < len(args)), tuple(nodes),
            graphdef)

  def _nodes(self, args) -> list[int]:
    from flax.nnx import graphlib  # pylint: disable=g-import-not-at-top
    return [i for i, a in enumerate(args) if i not in self.static and graphlib.is_graph_node(a)]

  def layout(self, args, original):
    del original
    from flax import nnx  # pylint: disable=g-import-not-at-top
    nodes = self._nodes(args)
    if not any(i in self.donated for i in nodes):
      return None
    static = {i: args[i] for i in self.static if i < len(args)}
    graphdef, _ = nnx.split(tuple(args[i] for i in nodes))
    fun, n = self.fun, len(args)
    rest_positions = [i for i in range(n) if i not in static and i not in nodes]

    def pure(state, *rest):
      objects = nnx.merge(graphdef, state[0])
      parts, it = dict(zip(nodes, objects)), iter(rest)
      result = fun(*[static[i] if i in static else parts[i] if i in parts else next(it)
                     for i in range(n)])
      if any(_is_node(x) for x in jax.tree_util.tree_leaves(result, is_leaf=_is_node)):
        raise Cannot("it returns a graph node; jaxtier offloads NNX steps that return arrays")
      return (nnx.state(objects),), result

    def split(call_args):
      return ((nnx.state(tuple(call_args[i] for i in nodes)),),
              tuple(call_args[i] for i in rest_positions))

    def join(call_args, new_state, aux):
      nnx.update(tuple(call_args[i] for i in nodes), new_state[0])
      return aux

    return Layout(key=self.key(args), state=tuple(nodes), pure=pure, split=split, join=join)


def _is_node(x: Any) -> bool:
  from flax.nnx import graphlib  # pylint: disable=g-import-not-at-top
  return graphlib.is_graph_node(x)


# -- the script's jitted functions --------------------------------------------------------------


class Step:
  """One train step offloaded: the layout of its calls and the `OffloadedStep` that runs them."""

  def __init__(self, launcher: Launcher, name: str, layout: Layout):
    self.launcher, self.name, self.layout = launcher, name, layout
    self.offloaded = launcher.offload(layout.pure)
    self._shown: Any = None
    self._plan: Any = None
    self.called = False
    self.lowered_state: Any = None  # the state's parts `lower` planned for (shapes)
    self.last_result: Any = None  # what an interrupted call would have returned

  def inputs(self, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    state, rest = self.layout.split(args)
    if self.layout.in_shardings is not None:
      state_sh, rest_sh = self.layout.in_shardings
      state = tuple(_put(s, sh) for s, sh in zip(state, state_sh))
      rest = tuple(_put(r, sh) for r, sh in zip(rest, rest_sh))
    return state, rest

  def __call__(self, args: tuple[Any, ...]) -> Any:
    state, rest = self.inputs(args)
    try:
      with self.launcher.passthrough():
        new_state, aux = self.offloaded(state, *rest)
    except KeyboardInterrupt as e:
      donated = self._interrupted(e, args)
      # For the line `main` says where the script does not catch it.
      self.launcher.interrupt = (e, f"in a step of {self.name}" if donated or self.called else
                                 f"while {self.name} was planned and compiled")
      raise
    if not self.called:
      self.called = True
      if self in self.launcher.pending:
        self.launcher.pending.remove(self)
    self.show()
    return self._result(args, new_state, aux)

  def _result(self, args: tuple[Any, ...], new_state: Any, aux: Any) -> Any:
    """What the script's jitted function returns for a call with `args`."""
    if self.layout.out_shardings is not None:
      aux = _put(aux, self.layout.out_shardings)
    return self.layout.join(args, new_state, aux)

  def _interrupted(self, error: KeyboardInterrupt, args: tuple[Any, ...]) -> bool:
    """Ctrl-C after the step's inputs were donated, the step run to its end: what the call
    would have returned becomes the jitted function's `last_result`, and the interrupt's note
    names that (the script holds the jitted function, not the `OffloadedStep`). Returns
    whether it was so."""
    notes = getattr(error, "__notes__", [])
    if runner.INTERRUPTED_NOTE not in notes or self.offloaded.last_state is None:
      return False
    self.last_result = self._result(args, self.offloaded.last_state,
                                    self.offloaded.last_metrics)
    notes.remove(runner.INTERRUPTED_NOTE)
    error.add_note(
        f"jaxtier run: interrupted during a step of {self.name}, after its inputs were "
        "donated: the step ran to its end, and what the call would have returned is the "
        "jitted function's `last_result`; continue from it (for `f = jax.jit(train_step, "
        "donate_argnums=0)`: `state, metrics = f.last_result`)")
    return True

  def lower(self, args: tuple[Any, ...]) -> Any:
    state, rest = self.layout.split(args)
    with self.launcher.passthrough():
      lowered = self.offloaded.lower(state, *rest)
    self.show()
    if not self.called and self not in self.launcher.pending:
      self.lowered_state = state
      self.launcher.pending.append(self)
    return lowered

  def show(self) -> None:
    """Says the plan in a line (wrapped to the terminal's width), where it is new (the
    first, or another placement)."""
    plan = self.offloaded.plan
    if plan is self._plan:
      return
    self._plan = plan
    self.launcher.planned(self.name, plan)
    key = tuple((l.path, l.placement) for l in plan.leaves)
    if key != self._shown:
      self._shown = key
      self.launcher.said(f"wrapped {self.name}: {plan.one_line()}")


class Jitted:
  """A function the script jitted: the original jit, or its train step offloaded.

  Called as the jitted function is; `lower` of an offloaded step gives its compute program
  (what holds the device memory); other attributes are the original's (`eval_shape`, `trace`,
  `clear_cache`).
  """

  def __init__(self, launcher: Launcher, frontend: Frontend, fun: Any, original: Any):
    functools.update_wrapper(self, fun)
    self._launcher, self._frontend, self._original = launcher, frontend, original
    self._name = launcher.name_of(fun)
    self._steps: dict[Any, Step] = {}
    self._unwrapped = not frontend.donates()  # runs the original from now on
    self._checked: set[Any] = set()  # argument signatures seen not to build a pending state
    self._last: "Step | None" = None  # the step of the latest offloaded call

  @property
  def last_result(self) -> Any:
    """What the latest offloaded call would have returned where Ctrl-C interrupted it after
    its inputs were donated (the step ran to its end); None where none was."""
    return None if self._last is None else self._last.last_result

  def __getattr__(self, name: str) -> Any:
    original = self.__dict__.get("_original")
    if original is None:
      raise AttributeError(name)
    return getattr(original, name)

  def __get__(self, obj: Any, objtype: Any = None) -> Any:
    return self if obj is None else functools.partial(self, obj)

  def __repr__(self) -> str:
    return f"<jaxtier run: {self._frontend.what} of {self._name}>"

  def _run_original(self, args, kwargs):
    with self._launcher.passthrough():
      return self._original(*args, **kwargs)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    launcher = self._launcher
    if launcher.inside or _has_tracer((args, kwargs)):
      return self._run_original(args, kwargs)
    if self._unwrapped:
      built = self._build_pending_state(args, kwargs)
      return built if built is not _MISSING else self._run_original(args, kwargs)
    step = self._step(args, kwargs)
    if step is None:
      return self._run_original(args, kwargs)
    positional = _bind(self._frontend.fun, args, kwargs)
    self._last, step.last_result = step, None
    if step.called:  # planned and run: an error now is the step's own
      return step(positional)
    try:
      return step(positional)
    except Exception as e:  # pylint: disable=broad-except
      if _deleted(step.layout.split(positional)[0]):
        raise  # the state was donated: nothing to fall back on
      self._give_up(step, e)
      return self._run_original(args, kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    if self._unwrapped or self._launcher.inside or _has_tracer((args, kwargs)):
      return self._original.lower(*args, **kwargs)
    step = self._step(args, kwargs)
    if step is None:
      return self._original.lower(*args, **kwargs)
    positional = _bind(self._frontend.fun, args, kwargs)
    try:
      return step.lower(positional)
    except Exception as e:  # pylint: disable=broad-except
      self._give_up(step, e)
      return self._original.lower(*args, **kwargs)

  def _give_up(self, step: Step, error: Exception) -> None:
    """The step could not be planned or run before its state was donated: the original jit
    runs it from now on."""
    self._steps.pop(step.layout.key, None)
    self._unwrapped = True
    if self._name in self._launcher.wrapped and not self._steps:
      self._launcher.wrapped.remove(self._name)
    if step in self._launcher.pending:
      self._launcher.pending.remove(step)
    if isinstance(error, AdmissionError) and getattr(error, "settings", None):
      # XLA reads its settings when JAX starts: the command again, with them (as `train`).
      rerun.rerun_with(error.settings, allocated="the step had allocated nothing")
    fix = _command_line_fix(error, self._launcher.options)
    if fix is not None:
      # What refused the plan, and the fix in this command line's flags (the error's own names
      # the Python API's arguments).
      first = f"{error.reason}. Fix: {fix}"
    else:
      first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    why = f"{type(error).__name__}: {first.removeprefix('jaxtier: ')}"
    try:
      self._launcher.cannot(self._name, why)
    except RunError as e:
      raise e from error

  def _step(self, args, kwargs) -> "Step | None":
    """The offloaded step for this call (made at the first call of its layout), or None
    where the call runs the original (and then, for good, where the function is no step or
    cannot be wrapped)."""
    launcher, frontend = self._launcher, self._frontend
    positional = _bind(frontend.fun, args, kwargs)
    if positional is None:
      self._unwrap_if_named("it is called with keyword-only arguments, which jaxtier's step "
                            "does not take")
      return None
    try:
      key = frontend.key(positional)
      step = self._steps.get(key)
    except TypeError:  # an unhashable static argument: jax.jit says so itself
      return None
    if step is not None:
      return step
    problem = layout = None
    try:
      with launcher.passthrough():
        layout = frontend.layout(positional, self._original)
    except Cannot as e:
      problem = str(e)
    except Exception:  # pylint: disable=broad-except  (the original jit says what is wrong)
      return None
    if layout is None and problem is None:
      self._unwrapped = True
      if launcher.named(self._name):
        launcher.cannot(self._name, "no donated argument comes back in its output (a train "
                        "step donates its state and returns the new one)")
      return None
    why = launcher.claim(self._name)
    if why is not None:
      if not launcher.options.steps:
        launcher.said(f"left {self._name} to {frontend.what}: {why}")
      self._unwrapped = True
      return None
    refused = frontend.refused_options()
    if refused or problem:
      self._unwrapped = True
      launcher.cannot(self._name, problem or f"{refused} given, which jaxtier cannot keep")
      return None
    step = Step(launcher, self._name, layout)
    self._steps[key] = step
    if self._name not in launcher.wrapped:
      launcher.wrapped.append(self._name)
    return step

  def _unwrap_if_named(self, why: str) -> None:
    self._unwrapped = True
    if self._launcher.named(self._name) or not self._launcher.options.steps:
      self._launcher.cannot(self._name, why)

  def _build_pending_state(self, args, kwargs) -> Any:
    """Where a step was planned (`lower`) before its state exists and this jit (no donation,
    no options) builds a state of that step's structure: the state built where the plan puts
    each leaf (`OffloadedStep.init`), not on the device first. Else _MISSING."""
    launcher = self._launcher
    if not launcher.pending or kwargs or not isinstance(self._frontend, JaxJit) or (
        self._frontend.static or self._frontend.refused_options()
        or self._frontend.kwargs.get("in_shardings") is not None
        or self._frontend.kwargs.get("out_shardings") is not None):
      return _MISSING
    try:
      seen = _signature(args)
      if seen in self._checked:
        return _MISSING
      self._checked.add(seen)
      out = self._original.eval_shape(*args)
    except Exception:  # pylint: disable=broad-except  (the call itself will say)
      return _MISSING
    for step in list(launcher.pending):
      shapes = step.lowered_state
      if len(shapes) != 1 or _signature(out) != _signature(shapes[0]):
        continue
      launcher.pending.remove(step)
      fun = self._frontend.fun
      with launcher.passthrough():
        state = step.offloaded.init(lambda *a: (fun(*a),), *args)[0]
      launcher.said(f"built the state of {step.name} where its plan puts it ({self._name})")
      return state
    return _MISSING


# -- the command line -----------------------------------------------------------------------------

USAGE = "usage: python -m jaxtier run [--flags] -- (script.py | -m module) [script arguments]"
# What `run` does, for `python -m jaxtier run --help`.
ABOUT = ("Runs an unmodified script (a file, or a module as `python -m` runs it) with its train "
         "step offloaded: the first function it jits with jax.jit, nnx.jit or eqx.filter_jit "
         "that donates a state and returns it, or those --step names. A line on stderr says "
         "which function and its plan; where a step cannot be offloaded it runs as the script "
         "jitted it, after a warning (--strict: the run stops, exit 1). The exit status is the "
         "script's.")


def help_text() -> str:
  """`python -m jaxtier run --help`: in the form of the other commands' help
  (`command_help.render`)."""
  values = _flag_values()
  shown = [command_help.with_help(values[name]) for name in values
           if name != "step"]
  shown.append(command_help.with_help(
      values["step"], "module:function (or a function's name, in any module) to wrap; "
      "repeat it for more (default: the first train step the script calls).",
      show_default=False))
  return command_help.render(USAGE, ABOUT, shown,
                             "flags (before --; the script's own, absl's included, follow it):")


class FlagError(ValueError):
  """A bad flag of `run`'s own (unknown, or a bad value); the message names it."""


def parse(argv: Sequence[str]) -> tuple[RunOptions, Target]:
  """`run`'s command line (after 'run'): jaxtier's flags, then the script and its arguments.

  jaxtier's flags come before `--` (or before the first argument that is not a flag); the
  script's own flags, absl's included, are left to the script.

  Raises:
    FlagError: an unknown flag, or a bad value (the message says which).
    ValueError: no script, or no such script or module.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  argv = list(argv)
  if "--" in argv:
    cut = argv.index("--")
    ours, script = argv[:cut], argv[cut + 1:]
  else:
    cut = next((i for i, a in enumerate(argv) if a == "-m" or not a.startswith("-")), len(argv))
    ours, script = argv[:cut], argv[cut:]
  values = _flag_values()
  try:
    values(["run", *ours])
  except flags.Error as e:
    raise FlagError(str(e)) from None
  if not script or script == ["-m"]:
    raise ValueError(f"{_PREFIX}: no script given (after --: script.py or -m module, then its "
                     "arguments)")
  if script[0] == "-m":
    if not _importable(script[1]):
      raise ValueError(f"{_PREFIX}: no module named {script[1]!r}")
    target = Target(path=None, module=script[1], argv=tuple(script[2:]))
  else:
    if not os.path.exists(script[0]):
      raise ValueError(f"{_PREFIX}: no such script: {script[0]}")
    target = Target(path=script[0], module=None, argv=tuple(script[1:]))
  for size in ("device_budget", "host_budget"):
    if getattr(values, size):
      try:
        parse_bytes(getattr(values, size), f"--{size}",
                    no_limit=f"leave --{size} out for no limit")
      except ValueError as e:
        raise FlagError(str(e)) from None
  if values.plan_json:
    why = paths.why_unwritable(values.plan_json, example="plans.json")
    if why:
      raise FlagError(f"--plan_json={values.plan_json}: {why}")
  try:
    options = RunOptions(policy=values.policy, device_budget=values.device_budget or None,
                         host_budget=values.host_budget or None, steps=tuple(values.step),
                         strict=values.strict,
                         # Absolute: the script may change its working directory.
                         plan_json=(os.path.abspath(values.plan_json) if values.plan_json
                                    else None))
  except ValueError as e:  # a --step that is not module:function
    raise FlagError(str(e).removeprefix(f"{_PREFIX}: ")) from None
  return options, target


def unimportable_steps(options: RunOptions, target: Target) -> list[str]:
  """The --step specs whose module is neither the script's own (`Target.name`, '__main__')
  nor importable now (`importlib.util.find_spec`): most likely mistyped. (A module the script
  makes importable later, by changing sys.path, is among them too: hence a warning, and an
  error only under --strict.)"""
  absent = []
  for spec in options.steps:
    module = spec.rpartition(":")[0]
    if module and module not in ("__main__", target.name) and not _importable(module):
      absent.append(spec)
  return absent


def undefined_steps(options: RunOptions, target: Target) -> dict[str, str]:
  """The --step specs whose module's source defines no function of that name, each with what
  to say of it: {spec: why}.

  The module (the script's own for `Target.name` or '__main__') is read, not imported, so
  nothing of it runs before the script: its source is parsed (`ast`) for a `def` (at any depth,
  as --step names a nested function too) or `class` of each part of the name but `<locals>`,
  or a string of it (a name given at run time). A spec with no module (a bare function name,
  which names a function of any module) is looked for in the script's own source (the script
  file, or the source of the module `-m` runs), where it may also be a name the script imports
  or uses (`jax.jit(lib.train_step)`). A module that cannot be imported
  (`unimportable_steps`) or whose source cannot be read, and a name with a `<lambda>` in it,
  are not checked.
  """
  undefined = {}
  for spec in options.steps:
    module, _, function = spec.rpartition(":")
    parts = [p for p in function.split(".") if p != "<locals>"]
    if any("<" in p for p in parts):
      continue
    found = _names_defined(module or "__main__", target)
    if found is None:
      continue
    defined, strings, used = found
    known = defined | strings | (set() if module else used)
    missing = [p for p in parts if p not in known]
    if missing:
      near = difflib.get_close_matches(missing[0], sorted(defined if module else
                                                           defined | used), n=1)
      shown = target.name if module in ("", "__main__") else module
      undefined[spec] = ((f"{shown} defines no function {missing[0]!r}" if module else
                          f"{shown} neither defines nor imports a function {missing[0]!r}")
                         + (f" (did you mean {near[0]!r}?)" if near else ""))
  return undefined


def _names_defined(module: str, target: Target
                   ) -> "tuple[set[str], set[str], set[str]] | None":
  """The names `module`'s source gives a `def` or `class` (at any depth), the strings it
  writes, and the other names it uses (imports, variables, attributes); None where its source
  cannot be read or parsed. The script's own module (`module` '__main__' or `Target.name`) is
  the script."""
  path = source = None
  if module in ("__main__", target.name) and target.path:
    path = target.path
  else:
    if module in ("__main__", target.name):
      module = target.module
    try:
      spec = importlib.util.find_spec(module)
      if spec is not None and spec.submodule_search_locations is not None and (
          module == target.module):  # `-m package` runs package.__main__
        spec = importlib.util.find_spec(f"{module}.__main__")
      if spec is not None and hasattr(spec.loader, "get_source"):
        source = spec.loader.get_source(spec.name)
    except (ImportError, ValueError):
      return None
  try:
    if path is not None:
      with open(path, "rb") as f:
        source = f.read()
    if source is None:  # an extension module, or one stored without source
      return None
    tree = ast.parse(source)
  except (OSError, SyntaxError, ValueError):
    return None
  defined, strings, used = set(), set(), set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      defined.add(node.name)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      strings.add(node.value)
    elif isinstance(node, ast.Name):
      used.add(node.id)
    elif isinstance(node, ast.Attribute):
      used.add(node.attr)
    elif isinstance(node, ast.alias):
      used.update(node.name.split("."))
  return defined, strings, used


def _importable(module: str) -> bool:
  """Whether `module` can be imported now (`importlib.util.find_spec`), without importing it."""
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a parent package that is absent, or an empty name
    return False


def _flag_values() -> Any:
  """`run`'s own flags, in a `FlagValues` of their own (absl's global one is the script's)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  values = flags.FlagValues()
  flags.DEFINE_enum("policy", NamedPolicy.AUTO, list(NamedPolicy), "How the step's state is "
                    "placed: auto (the planner: all on the device where it fits the budget), "
                    "optimizer_state_on_host, none.", flag_values=values)
  flags.DEFINE_string("device_budget", "", "Device memory the step may use at its peak, per "
                      "device, e.g. 80GB or 16GiB; empty: the machine's (on a GPU what JAX's "
                      "allocator may use less 5%).", flag_values=values)
  flags.DEFINE_string("host_budget", "", "Pinned host memory the plan may pin, per device; "
                      "empty: what the host can pin.", flag_values=values)
  flags.DEFINE_multi_string("step", [], "module:function (or function) to wrap; repeat for "
                            "more (default: the first train step the script calls)",
                            flag_values=values)
  flags.DEFINE_bool("strict", False, "Stop (exit 1) where the step cannot be offloaded, "
                    "before the script runs where a --step names a module that cannot be "
                    "imported or a function its module (for a bare name, the script) does not "
                    "name, and at the end where "
                    "no step (or not every --step) was wrapped, instead of a warning.",
                    flag_values=values)
  flags.DEFINE_string("plan_json", "", "Write the wrapped steps' plans to this file as JSON "
                      "({function: plan}: every leaf's placement and memory kind, the notes), "
                      "again whenever a step is planned again.", flag_values=values)
  return values


def main(argv: Sequence[str], *, exit_on_interrupt: bool = False) -> int:
  """`python -m jaxtier run ...`; returns the exit status: the script's, 2 for a bad command
  line, 1 where `--strict` stopped the run (or --help's reader closed the pipe), 130 where a
  Ctrl-C ended the script (it did not catch the KeyboardInterrupt): said in a line
  (`Launcher.interrupted`), no traceback.

  Args:
    argv: the command line after 'run'.
    exit_on_interrupt: after that line, end the process at once with status 130, as `train`
      ends an interrupted run: the interpreter's teardown, with XLA's threads mid-compile or
      mid-step, can crash. The command line's entry point passes True.
  """
  if any(a in ("-h", "--help", "--helpfull") for a in
         (argv[:argv.index("--")] if "--" in argv else argv[:1])):
    return command_help.print_help(help_text())
  try:
    options, target = parse(argv)
  except ValueError as e:  # a bad flag, or no script: in one line, as the other commands say it
    said = str(e).removeprefix(f"{_PREFIX}: ")
    print(f"python -m jaxtier run: {said}; python -m jaxtier run --help lists its flags",
          file=sys.stderr)
    return 2
  # A --step that names a module or a function that is not there, said before the script runs
  # (not only after it has run unwrapped to its end).
  absent = unimportable_steps(options, target)
  doubts = [f"--step={', --step='.join(absent)}: no such module can be imported (the "
            f"script's own functions are named {target.name}:function)"] if absent else []
  doubts += [f"--step={spec}: {why}" for spec, why in undefined_steps(options, target).items()
             if spec not in absent]
  for said in doubts:
    _say(f"{_PREFIX}: {said}; " + ("--strict: stopped before the script ran" if options.strict
                                   else "the script runs, and what it wraps is said at its end"))
  if doubts and options.strict:
    return 1
  # jaxtier's INFO lines (the compiled peak, re-plans) would be the script's to print: its own
  # logging set-up (absl's) shows them by default. Its warnings stay.
  logger = logging.getLogger("jaxtier")
  level = logger.level
  logger.setLevel(logging.WARNING)
  launcher = Launcher(options, target.name)
  try:
    code = launcher.run(target)
    launcher.finish()
  except RunError as e:
    _say(str(e))
    return 1
  except KeyboardInterrupt as e:  # the script did not catch it: a line, not its traceback
    _say("\n" + launcher.interrupted(e, target))
    if exit_on_interrupt:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(130)
    return 130
  finally:
    logger.setLevel(level)
  return code
