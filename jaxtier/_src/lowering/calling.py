"""The calling convention of the step's two programs: their inputs and outputs as named pytrees.

`compute` takes a `ComputeIn` and returns a `ComputeOut`; `update` takes an `UpdateIn` and
returns an `UpdateOut` (`rewrite.SplitStep`). Each input field is a list of arrays that is
either donated to the program (its buffers consumed, as with `jax.jit(donate_argnums=...)`,
and possibly written in place) or only read, declared once here by `donated()` / `read()`.
`Program` jits a program over its input's fields, donating exactly the donated ones.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax

_DONATED = "donated"
# What XLA says when a donated buffer is still referenced outside it (a NumPy view).
EXTERNAL_REFERENCE = "Donation requested for buffer with external reference"


def donated() -> Any:
  """A field whose arrays the program consumes (donates): never read after the call."""
  return dataclasses.field(default=(), metadata={_DONATED: True})


def read() -> Any:
  """A field whose arrays the program only reads: intact after the call, even a failed one."""
  return dataclasses.field(default=(), metadata={_DONATED: False})


def _pytree(cls: type) -> type:
  """Registers a frozen dataclass of list fields as a pytree (its fields are its children)."""
  return jax.tree_util.register_dataclass(
      cls, data_fields=[f.name for f in dataclasses.fields(cls)], meta_fields=[])


@_pytree
@dataclasses.dataclass(frozen=True)
class ComputeIn:
  """`compute`'s inputs: the state's leaves by group, the step's other arguments, the buffers.

  Fields (each a list of arrays, ordered as the `SplitStep` index list of the same name):
    device_leaves: the state's device leaves (donated: their new values reuse the buffers).
    host_leaves: its pinned_host leaves other than `layered_host` (read, never donated).
    args: the step's arguments after the state, flattened (read).
    scratch: the pinned_host gradient buffers (`StreamSchedule.scratch`; donated).
    layered_host: the pinned_host leaves updated layer by layer inside the backward pass
      (donated: updated in place).
    layered_masters: the fp32 masters of `layered_host` params, ordered as
      `SplitStep.layered_masters` (donated: updated in place).
  """

  device_leaves: Sequence[Any] = donated()
  host_leaves: Sequence[Any] = read()
  args: Sequence[Any] = read()
  scratch: Sequence[Any] = donated()
  layered_host: Sequence[Any] = donated()
  layered_masters: Sequence[Any] = donated()


@_pytree
@dataclasses.dataclass(frozen=True)
class SpeculativeIn:
  """The speculative `compute`'s inputs (`rewrite.SplitStep.speculative`): the state is only
  read, and every layered write goes to a spare buffer, so that a wrong guess loses nothing.

  Fields (each a list of arrays):
    device_leaves: the state's device leaves (read: intact for the serial schedule's rerun).
    host_leaves: all its pinned_host leaves, as `SplitStep.host_leaves` (read).
    args: the step's arguments after the state, flattened (read).
    spare_device: one buffer per device leaf a layered update writes
      (`SplitStep.spare_device`), of its shape and placement: the update writes the leaf's
      new value there (donated).
    scratch: the pinned_host gradient buffers (donated).
    masters: the fp32 masters of the layered params, as `SplitStep.layered_masters` (read).
    spare_host: likewise per `SplitStep.layered_host` leaf (donated).
    spare_masters: likewise per layered master (donated).

  The guess is the lowering's (`SplitStep.guesses`): the guarded calls' op programs are
  specialized to it.
  """

  device_leaves: Sequence[Any] = read()
  host_leaves: Sequence[Any] = read()
  args: Sequence[Any] = read()
  # Donated device buffers first: JAX pairs each donated input, in order, with the first
  # remaining output of its shape (`ComputeOut.first` holds their new values).
  spare_device: Sequence[Any] = donated()
  scratch: Sequence[Any] = donated()
  masters: Sequence[Any] = read()
  spare_host: Sequence[Any] = donated()
  spare_masters: Sequence[Any] = donated()


@_pytree
@dataclasses.dataclass(frozen=True)
class ComputeOut:
  """`compute`'s outputs.

  Fields:
    first: the outvars `SplitStep.compute_outs[:num_first]`: the device leaves' new values, in
      the order of `ComputeIn.device_leaves` (JAX pairs each with its donated buffer).
    feeds: the device values the fused host updates read (`UpdateIn.feeds`/`donated_feeds`).
    scratch: the gradient buffers, written (the next step donates them again).
    layered_host: the new values of `ComputeIn.layered_host` (the same buffers).
    layered_masters: the new values of `ComputeIn.layered_masters` (the same buffers).
    rest: the outvars `SplitStep.compute_outs[num_first:]` (metrics, other new leaves).
    guards: the value each late predicate took (`SplitStep.guards`, as float32 []).

  JAX pairs each output, in order, with the first donated input left of its shape and dtype,
  whatever its memory kind (the metrics' shardings are not given): `rest` comes after the
  pinned_host buffers, so that a metric of a layered leaf's shape cannot take its buffer.

  The speculative `compute` (`SpeculativeIn`) returns the same fields as a `SpeculativeOut`,
  `layered_host` and `layered_masters` in the spare buffers, and the new values of the device
  leaves it wrote in `SpeculativeIn.spare_device` first in `first`.
  """

  first: Sequence[Any] = ()
  feeds: Sequence[Any] = ()
  scratch: Sequence[Any] = ()
  layered_host: Sequence[Any] = ()
  layered_masters: Sequence[Any] = ()
  rest: Sequence[Any] = ()
  guards: Sequence[Any] = ()


@_pytree
@dataclasses.dataclass(frozen=True)
class SpeculativeOut:
  """The speculative `compute`'s outputs: `ComputeOut`'s fields, the pinned_host ones before
  `feeds` and `rest`. JAX pairs each donated input, in order, with the first remaining output
  of its shape (jax 0.10: whatever its memory kind): a spare host buffer must meet its own new
  value before a device output of the same shape (a moment kept on the device)."""

  first: Sequence[Any] = ()
  scratch: Sequence[Any] = ()
  layered_host: Sequence[Any] = ()
  layered_masters: Sequence[Any] = ()
  feeds: Sequence[Any] = ()
  rest: Sequence[Any] = ()
  guards: Sequence[Any] = ()


@_pytree
@dataclasses.dataclass(frozen=True)
class UpdateIn:
  """`update`'s inputs: the fused host updates' operands.

  Fields (each a list of arrays):
    updated_host: the pinned_host leaves `update` writes, as `SplitStep.updated_host` (donated:
      updated in place).
    read_host: the pinned_host leaves it only reads, as `SplitStep.read_host` (read).
    masters: the fp32 masters it updates, as `SplitStep.update_masters` (donated).
    feeds: `ComputeOut.feeds` that no result overwrites (read).
    donated_feeds: the feeds a result overwrites in place (`SplitStep.donated_feeds`; donated).
    scratch: the gradient buffers `compute` wrote (read).
  """

  updated_host: Sequence[Any] = donated()
  read_host: Sequence[Any] = read()
  masters: Sequence[Any] = donated()
  feeds: Sequence[Any] = read()
  donated_feeds: Sequence[Any] = donated()
  scratch: Sequence[Any] = read()


@_pytree
@dataclasses.dataclass(frozen=True)
class UpdateOut:
  """`update`'s outputs.

  Fields:
    outs: the outvars `SplitStep.update_outs` (the updated leaves' new values, in the buffers of
      `UpdateIn.updated_host`, and metrics computed by host updates).
    masters: the new values of `UpdateIn.masters` (the same buffers).
  """

  outs: Sequence[Any] = ()
  masters: Sequence[Any] = ()


def fields_of(inputs: Any) -> list[Any]:
  """The values of a program input's fields, in declaration order (not copied)."""
  return [getattr(inputs, f.name) for f in dataclasses.fields(inputs)]


def donate_argnums(cls: type) -> tuple[int, ...]:
  """Positions of `cls`'s donated fields: `jax.jit`'s `donate_argnums` over its fields."""
  return tuple(k for k, f in enumerate(dataclasses.fields(cls)) if f.metadata[_DONATED])


def donated_fields(cls: type) -> tuple[str, ...]:
  """Names of `cls`'s donated fields."""
  return tuple(f.name for f in dataclasses.fields(cls) if f.metadata[_DONATED])


class Program:
  """A step program jitted over the fields of its input, the donated ones donated.

  `program(inputs)` runs `fn(inputs)` (an `In` in, its output pytree out) as one jitted call;
  `program.lower(inputs)` lowers it (`jax.stages.Lowered`; the inputs may be
  `jax.ShapeDtypeStruct`s).
  """

  def __init__(self, fn: Callable[[Any], Any], in_shardings: Any, out_shardings: Any):
    """Args:
      fn: `fn(inputs) -> outputs`, traceable; its `__name__` names the jitted program.
      in_shardings: an instance of the input class whose fields hold one sharding per array.
      out_shardings: the output pytree of shardings (None: unspecified), as `jax.jit` takes it.
    """
    cls = type(in_shardings)

    def program(*fields):
      return fn(cls(*fields))
    # Named as `fn`, its parameters as the fields: XLA names the program and its parameters
    # after them (`jit_compute`, `%scratch_0`).
    program.__name__ = program.__qualname__ = getattr(fn, "__name__", "program")
    program.__signature__ = inspect.Signature([
        inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for f in dataclasses.fields(cls)])
    self.input_class = cls
    self._jitted = jax.jit(program, donate_argnums=donate_argnums(cls),
                           in_shardings=tuple(fields_of(in_shardings)),
                           out_shardings=out_shardings)

  def _fields(self, inputs: Any) -> list[Any]:
    if type(inputs) is not self.input_class:
      raise TypeError(f"expected a {self.input_class.__name__}, got {type(inputs).__name__}")
    return fields_of(inputs)

  def __call__(self, inputs: Any) -> Any:
    """Runs the program. A donated host array that a NumPy view still reads (`np.asarray` of
    a pinned_host array is zero-copy) cannot be donated: XLA refuses the call before running
    it. The program then runs on copies of the donated host arrays, so the caller's arrays and
    their views keep their values, as a donated device array's `np.asarray` copy does."""
    fields = self._fields(inputs)
    try:
      return self._jitted(*fields)
    except Exception as e:  # pylint: disable=broad-except  (XlaRuntimeError has no stable home)
      if EXTERNAL_REFERENCE not in str(e):
        raise
    donated = set(donate_argnums(self.input_class))
    return self._jitted(*[
        [_host_copy(x) for x in field] if k in donated else field
        for k, field in enumerate(fields)])

  def lower(self, inputs: Any) -> Any:
    return self._jitted.lower(*self._fields(inputs))


def _host_copy(x: Any) -> Any:
  """A copy of `x` in its own buffer where it lives outside device memory (a NumPy view may
  read it), else `x`."""
  kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
  if not isinstance(x, jax.Array) or kind in (None, "device"):
    return x
  return jax.device_put(x, x.sharding, may_alias=False)
