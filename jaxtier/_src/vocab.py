"""The words of a plan, each defined once: memory kinds, placements, executors, roles, policies.

Every enum is a `StrEnum`: its members are the strings users write (`policy={...:
'host_stream'}`) and that plans print and serialise, so they compare equal to those strings.
"""

from __future__ import annotations

import enum


class MemoryKind(enum.StrEnum):
  """Where a buffer lives, as JAX names the memory (`jax.sharding.*.memory_kind`)."""

  DEVICE = "device"  # HBM
  PINNED_HOST = "pinned_host"  # page-locked host DRAM


class Placement(enum.StrEnum):
  """Where one state leaf lives and how the step reaches it (docs/design.md's vocabulary).

  - `device`: stays in HBM.
  - `host_dha`: in pinned_host; its update is a GPU kernel reading and writing it in place
    (direct host access, zero-copy).
  - `host_cpu`: in pinned_host; host CPU threads compute its update (on the CPU backend, the
    only executor).
  - `host_split`: in pinned_host; the DHA kernel and the host CPUs each update a share of it.
  - `host_xla`: in pinned_host; XLA's memory-kind transfers copy it to the device for the step.
  - `host_stream`: in pinned_host; a stack of layers fetched one layer ahead of its use by the
    copy engines, its gradient sent back layer by layer, its update a fused host update.

  What each one means to the planner, the cost model and the lowering (memory kind, executor,
  pinned bytes, eligibility, cost, lowering schedule): `planning/placements.py`'s registry.
  """

  DEVICE = "device"
  HOST_DHA = "host_dha"
  HOST_CPU = "host_cpu"
  HOST_SPLIT = "host_split"
  HOST_XLA = "host_xla"
  HOST_STREAM = "host_stream"


class Executor(enum.StrEnum):
  """Who runs a fused host update (the custom call's `executor` attribute)."""

  HOST_DHA = "host_dha"  # a GPU kernel on the host buffers, zero-copy
  HOST_CPU = "host_cpu"  # host CPU threads (on a GPU, started in stream order)
  SPLIT = "split"  # both at once, each on a share of the elements


class Role(enum.StrEnum):
  """What a state leaf is to the step, from its uses in the traced jaxpr (`inventory`)."""

  PARAM = "param"  # read by the step's compute (forward / backward)
  OPTIMIZER_STATE = "optimizer_state"  # read and written only by the elementwise update
  OTHER = "other"  # counters, and leaves the step does not update elementwise


class NamedPolicy(enum.StrEnum):
  """The policies `jaxtier.offload(policy=...)` knows by name."""

  AUTO = "auto"  # the solver: the fastest predicted plan within the budgets
  NONE = "none"  # every leaf on the device
  # Every optimizer-state leaf on the host, the rest on the device (the rule-based plan).
  OPTIMIZER_STATE_ON_HOST = "optimizer_state_on_host"


def is_named(policy: object, *names: NamedPolicy) -> bool:
  """Whether `policy` is one of the named policies `names` (any of them when none given)."""
  return isinstance(policy, str) and policy in (names or tuple(NamedPolicy))
