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
  by default; ../shared/MEASURED.md); XLA's GPU client makes one such pool per device for
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


# The share of what the host has available that a raised pinned pool may take (the rest is left
# to the process's other allocations and the system).
POOL_HEADROOM = 0.9


def pinned_pool_that_fits(need_bytes: int, num_local_devices: int = 1) -> "int | None":
  """The XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB that lets each device pin `need_bytes`, where XLA's
  pinned pool is what stops it and this host has the memory (POOL_HEADROOM of each device's
  share of MemAvailable); else None.

  Returns:
    GiB (int, rounded up), or None: the pool already holds `need_bytes`, the host lacks the
    memory, or its available memory cannot be read.
  """
  available = available_bytes()
  if available is None:
    return None
  cap = xla_pinned_pool_bytes()
  cap = XLA_PINNED_POOL_DEFAULT_BYTES if cap is None else cap
  share = available // max(1, num_local_devices)
  if need_bytes <= cap or need_bytes > POOL_HEADROOM * share:
    return None
  return math.ceil(need_bytes / 2**30)
