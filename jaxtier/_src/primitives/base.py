"""Loads jaxtier's compiled XLA FFI handlers and registers them with JAX.

The extension is imported only after `jax` (on the H200 machine, importing a nanobind FFI module
before jax crashed inside ml_dtypes), and only when a custom call is first
lowered, so `import jaxtier` stays cheap and works without the extension for planning.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import jax

_lock = threading.Lock()


class ExtensionMissing(ImportError):
  """jaxtier's compiled extension is missing or lacks the backend's handlers."""


@functools.cache
def _module():
  try:
    import _jaxtier_ffi  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - depends on the install
    raise ExtensionMissing(
        "jaxtier's compiled extension `_jaxtier_ffi` could not be imported "
        f"({e}); reinstall with `pip install .` from the jaxtier source tree, or set "
        "JAXTIER_DISABLE_FFI=1 to run the pure-JAX reference implementation") from e
  return _jaxtier_ffi


def has_cuda() -> bool:
  """True when the extension was compiled with its CUDA handlers."""
  return bool(_module().has_cuda())


_registered = False


def ensure_registered() -> None:
  """Registers every handler the extension carries, for 'cpu' and (if built) 'CUDA'. Idempotent.

  Raises:
    ExtensionMissing: the extension cannot be imported, or the default backend is a GPU and
      the extension was built without CUDA.
  """
  global _registered
  if _registered:
    return
  with _lock:
    if _registered:
      return
    # State types first: XLA checks a stateful handler's state type when the handler is
    # registered (the CUDA handler keeps its streams and staging buffers in FFI state).
    types = getattr(_module(), "state_types", dict)()
    if types:
      jax.default_backend()  # start the plugins' registration hooks before registering.
    for platform, entries in types.items():
      for name, registration in entries.items():
        jax.ffi.register_ffi_type(name, registration, platform=platform)
    regs = _module().registrations()
    for platform, handlers in regs.items():
      for name, capsule in handlers.items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform, api_version=1)
    if jax.default_backend() == "gpu" and "CUDA" not in regs:
      raise ExtensionMissing(
          "jaxtier was not compiled with CUDA support but JAX runs on a GPU; reinstall with "
          "`pip install . -Ccmake.define.JAXTIER_ENABLE_CUDA=ON` (needs nvcc)")
    _registered = True


def ffi_disabled() -> bool:
  """True when the kill switch `JAXTIER_DISABLE_FFI=1` asks for the pure-JAX reference."""
  return os.environ.get("JAXTIER_DISABLE_FFI", "0") not in ("", "0", "false", "False")


def scope_name(target: str) -> str:
  """The name a call of `target` carries in traces: `jaxtier.host_update_layer` for
  `jaxtier_host_update_layer_ffi`."""
  return "jaxtier." + target.removeprefix("jaxtier_").removesuffix("_ffi")


def ffi_call(target: str, results: Any, *, aliases: "dict[int, int] | None" = None,
             has_side_effect: bool = False, vmap_method: "str | None" = None,
             scope: "str | None" = None) -> Any:
  """`jax.ffi.ffi_call` of one of jaxtier's targets, its handlers registered first.

  Args:
    target: the custom call's name (`jaxtier_<family>_ffi`, `module.cc`'s `registrations()`).
    results: the result types (`jax.ShapeDtypeStruct`s), one or a sequence.
    aliases: {operand index: result index} updated in place (input_output_aliases).
    has_side_effect: keep the call even when its results are unused (the streaming calls).
    vmap_method: as `jax.ffi.ffi_call`'s (None: not batchable).
    scope: the name the call carries in profiler traces and HLO metadata (`jax.named_scope`);
      default: the target's, as `jaxtier.host_update_layer` for `jaxtier_host_update_layer_ffi`.

  Returns:
    `call(*operands, **attributes)`: `jax.ffi.ffi_call`'s callable, run inside the scope.

  Raises:
    ExtensionMissing: as `ensure_registered`.
  """
  ensure_registered()
  kwargs = {} if vmap_method is None else {"vmap_method": vmap_method}
  call = jax.ffi.ffi_call(target, results, input_output_aliases=aliases or {},
                          has_side_effect=has_side_effect, **kwargs)
  name = scope or scope_name(target)

  def named(*operands: Any, **attributes: Any) -> Any:
    with jax.named_scope(name):
      return call(*operands, **attributes)
  return named
