"""XLA FFI handlers of jaxtier, built from ``xla_ffi/src`` (``module.cc``)."""

from typing import Any

def registrations() -> dict[str, dict[str, Any]]:
    """Maps a platform to ``{target name: PyCapsule}``.

    ``"cpu"`` is always present; ``"CUDA"`` only in a build with CUDA. Each capsule wraps an
    XLA FFI handler, for ``jax.ffi.register_ffi_target(name, capsule, platform=...)``.
    Targets: ``"jaxtier_host_update_ffi"``.
    """

def has_cuda() -> bool:
    """True when the module was built with the CUDA handlers."""
