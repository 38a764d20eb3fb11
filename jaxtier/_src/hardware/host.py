"""Facts of this host: what it can pin, what memory is available, XLA's pool limits."""

from __future__ import annotations

import math
import os

# What `pinnable_bytes` is, in a refusal, when it was measured on this host.
HERE_PINNABLE = "each local device's share of what this host can pin now"


def pinnable_bytes(platform: str, num_local_devices: int = 1) -> "int | None":
  """Bytes each of this process's devices can still pin: its share of MemAvailable.

  Plans count bytes per device, and every device of this process keeps its shards of the host
  leaves in this host's memory: a replicated host leaf on 8 local GPUs is pinned 8 times, an
  FSDP-sharded one once in 8 pieces. So the host's MemAvailable is split evenly over
  `num_local_devices` (the state's mesh devices that this process addresses). On GPU, each
  device's share is also capped by XLA's pinned pool, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 GiB
  by default); XLA's GPU client makes one such pool per device for
  pinned_host buffers (read in XLA's allocator setup, not measured with several GPUs). Other
  processes on the same host (one process per GPU) are not seen: each assumes the host's free
  memory is its own.

  Args:
    platform: 'cpu' or 'gpu'.
    num_local_devices: devices of this process sharing the host's memory (>= 1).

  Returns:
    Bytes per device, or None where /proc/meminfo is unavailable.
  """
  available = available_bytes()
  if available is None:
    return None
  share = available // max(1, num_local_devices)
  if platform == "gpu":
    cap = xla_pinned_pool_bytes()
    if cap is not None and pinned_pool_preallocated():
      return cap  # pinned when JAX started: already taken out of MemAvailable
    return int(min(share, XLA_PINNED_POOL_DEFAULT_BYTES if cap is None else cap))
  return share


def available_bytes() -> "int | None":
  """The host's MemAvailable from /proc/meminfo, bytes (None where it cannot be read)."""
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    return None


# XLA's pinned host pool on a GPU when XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB is not set (64 GiB).
XLA_PINNED_POOL_DEFAULT_BYTES = 64 * 2**30


def xla_pinned_pool_bytes() -> "int | None":
  """XLA's pinned host pool per GPU as XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB sets it (GiB, read
  as XLA reads it), bytes; None where the variable is not set (XLA then uses 64 GiB)."""
  cap = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
  return int(float(cap) * 2**30) if cap else None


def pinned_pool_preallocated() -> bool:
  """Whether XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE asks XLA to pin its whole pool (of
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) as one region when JAX starts, read as XLA reads it."""
  return os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "").strip().lower() in (
      "1", "true")


# The share of what the host has available that a raised pinned pool may take (the rest is left
# to the process's other allocations and the system).
POOL_HEADROOM = 0.9


def pinned_pool_that_fits(need_bytes: int, num_local_devices: int = 1) -> "int | None":
  """The XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB that lets each device pin `need_bytes`, where XLA's
  pinned pool is what stops it and this host has the memory: the room there is, POOL_HEADROOM
  of each device's share of MemAvailable; else None.

  Returns:
    GiB (int, rounded down), or None: the pool already holds `need_bytes`, the host lacks the
    memory, or its available memory cannot be read.
  """
  room = pinned_pool_room_bytes(num_local_devices)
  if room is None:
    return None
  cap = xla_pinned_pool_bytes()
  cap = XLA_PINNED_POOL_DEFAULT_BYTES if cap is None else cap
  if need_bytes <= cap or need_bytes > room:
    return None
  # All the room there is, not the need: after compiling, a re-plan may move more state to
  # the host. The pool pins only what its regions take (`compiled.reserve_pinned_pool` makes
  # the state's one region).
  return room // 2**30


def pinned_pool_room_bytes(num_local_devices: int = 1) -> "int | None":
  """The largest pinned pool per device `pinned_pool_that_fits` may name on this host
  (POOL_HEADROOM of each device's share of MemAvailable), bytes; None where it cannot be read."""
  available = available_bytes()
  cap = xla_pinned_pool_bytes()
  if cap is not None and pinned_pool_preallocated():
    return cap  # the pool was pinned when JAX started
  if available is None:
    return None
  return int(POOL_HEADROOM * (available // max(1, num_local_devices)))


# JAX's GPU allocator takes this fraction of the GPU's free memory at start-up unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise.
XLA_MEM_FRACTION_DEFAULT = 0.75
# The largest fraction `mem_fraction_that_fits` names: the rest is left to the CUDA context's
# libraries (cuBLAS and cuDNN workspaces, pinned staging) that allocate outside XLA's pool.
MAX_MEM_FRACTION = 0.95


def xla_mem_fraction() -> float:
  """XLA_PYTHON_CLIENT_MEM_FRACTION as XLA reads it, or its default (0.75)."""
  value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  try:
    return float(value) if value else XLA_MEM_FRACTION_DEFAULT
  except ValueError:
    return XLA_MEM_FRACTION_DEFAULT


def allocator_limit_bytes() -> "int | None":
  """What JAX's allocator may hold on this process's first GPU (`memory_stats()['bytes_limit']`),
  bytes; None without a GPU or where the backend reports no limit."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "gpu":
    return None
  stats = jax.local_devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return int(limit) if limit else None


def mem_fraction_that_fits(need_bytes: int, margin: float) -> "str | None":
  """The XLA_PYTHON_CLIENT_MEM_FRACTION under which JAX's allocator holds `need_bytes` with
  `margin` of its limit left free, where the allocator's fraction is what stops it and the GPU
  has the memory (at most MAX_MEM_FRACTION); else None.

  The allocator's limit is the fraction of the memory the GPU had free when JAX started
  (`allocator_limit_bytes() / xla_mem_fraction()`).

  Returns:
    The fraction as a string of two decimals (rounded up, plus 0.02 for the compiled step's
    departure from a prediction, at most MAX_MEM_FRACTION), or None: no GPU here, the current
    limit already holds `need_bytes`, or even MAX_MEM_FRACTION would not.
  """
  limit = allocator_limit_bytes()
  if limit is None:
    return None
  return fraction_that_holds(need_bytes, margin, limit)


def fraction_that_holds(need_bytes: int, margin: float, limit: int) -> "str | None":
  """`mem_fraction_that_fits` for an allocator whose limit is `limit` bytes under the current
  XLA_PYTHON_CLIENT_MEM_FRACTION (this GPU's, or the one of a GPU that is not here)."""
  fraction = xla_mem_fraction()
  if need_bytes <= limit * (1 - margin):
    return None
  free_at_start = limit / fraction
  wanted = math.ceil(100 * need_bytes / ((1 - margin) * free_at_start)) / 100
  if wanted > MAX_MEM_FRACTION:
    return None
  return f"{max(min(wanted + 0.02, MAX_MEM_FRACTION), fraction):.2f}"
