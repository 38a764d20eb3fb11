"""XLA FFI handlers of jaxtier, built from ``xla_ffi/src`` (``module.cc``)."""

from typing import Any

def registrations() -> dict[str, dict[str, Any]]:
    """Maps a platform to ``{target name: handler}``.

    ``"cpu"`` is always present; ``"CUDA"`` only in a build with CUDA. A handler is a
    ``PyCapsule`` wrapping an XLA FFI handler, or (the CUDA handler, which keeps per-instance
    state) a dict ``{"instantiate": PyCapsule, "execute": PyCapsule}``; either goes to
    ``jax.ffi.register_ffi_target(name, handler, platform=...)``. Register ``state_types()``
    first. Targets: ``"jaxtier_host_update_ffi"``, ``"jaxtier_stream_fetch_ffi"``,
    ``"jaxtier_host_update_layer_ffi"``, ``"jaxtier_host_update_join_ffi"``,
    ``"jaxtier_stream_wait_ffi"``, ``"jaxtier_stream_send_ffi"``, ``"jaxtier_dha_gather_ffi"``,
    ``"jaxtier_dha_matmul_ffi"``, ``"jaxtier_dha_scatter_add_ffi"`` (the layer, join, gather and
    matmul targets are plain capsules on both platforms; scatter_add is stateful on "CUDA").
    """

def state_types() -> dict[str, dict[str, dict[str, Any]]]:
    """Maps a platform to ``{type name: {"type_id": PyCapsule, "type_info": PyCapsule}}``.

    The per-instance state types of the stateful handlers, for
    ``jax.ffi.register_ffi_type(name, registration, platform=...)``, which must run before
    ``registrations()`` are registered (XLA checks the state type when it registers a handler).
    ``{}`` in a build without CUDA; else ``{"CUDA": {"jaxtier_host_update_state": ...,
    "jaxtier_stream_state": ..., "jaxtier_dha_scatter_add_state": ...}}``.
    """

def has_cuda() -> bool:
    """True when the module was built with the CUDA handlers."""
