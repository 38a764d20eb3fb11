"""The errors jaxtier raises for a state it cannot place (re-exported by `jaxtier`)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping


class PlanError(ValueError):
  """The state cannot be placed as asked (a budget, a leaf's dtype, an unknown placement).

  When a complete plan was refused (over a budget), `plan` holds it; else None. `reason` is
  then what refused it, one clause with the sizes (e.g. "it needs 106.37 GiB ... of pinned host
  memory per device, over ... of 64.00 GiB"); '' otherwise.
  """

  plan: Any = None  # the refused `Plan`, or None
  reason: str = ""


class OptionError(PlanError, TypeError):
  """An option given in a type or form it does not take, refused where it is given.

  For example `jaxtier.offload(step, device_budget=1.5)` (not a whole number of bytes) or
  `overlap_update="yes"` (not a bool). Both a ValueError (a `PlanError`) and a TypeError, so
  that either catches it. `option` names the option ('device_budget'), `value` is the value
  given and `expected` says what the option takes.
  """

  def __init__(self, message: str, *, option: str, value: Any, expected: str):
    super().__init__(message)
    self.option, self.value, self.expected = option, value, expected


class CheckpointMismatchError(ValueError):
  """A checkpoint restored into a state of another structure, shapes or dtypes than it holds.

  Raised before the step is traced or anything is read. `leaf` is the first leaf that differs
  (its path, as `jax.tree_util.keystr` writes it), in the order of the state given (a leaf only
  the checkpoint has comes after those); `given` and `saved` are that leaf's dtype and shape on
  each side ('float32[8, 4]'), None where that side has no such leaf.
  """

  def __init__(self, message: str, *, leaf: str, given: "str | None", saved: "str | None"):
    super().__init__(message)
    self.leaf, self.given, self.saved = leaf, given, saved


class AdmissionError(PlanError):
  """The plan needs more memory than the budget, the host or XLA's allocators allow.

  Raised before anything is allocated; the caller's state is untouched. `plan` holds the
  refused plan (for printing). `settings` holds the environment settings that would admit it
  on this machine ({name: value}, e.g. {'XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB': '95'} where XLA's
  pinned pool refuses it and the host has the memory, {'XLA_PYTHON_CLIENT_MEM_FRACTION':
  '0.91'} where JAX's device allocator does and the GPU has the memory), to be set before JAX
  starts; empty where none would. `limit` names the limit that refused it, as
  `BudgetViolation.limit` does: 'device_budget' (the step's peak device memory over the
  `device_budget` given to `jaxtier.offload`, without `allow_over_budget=True`),
  'device_memory' (JAX's device allocator), 'host_limit' (pinned host memory: the host budget,
  or what the host can pin) or 'host_memory' (the CPU backend's RAM). `need_bytes` and
  `limit_bytes` are what the plan needs of that limit and what it allows, bytes per device, as
  `BudgetViolation`'s (None where the refusal names no one figure).
  """

  plan: Any = None  # the refused `Plan`, or None
  settings: Mapping[str, str] = MappingProxyType({})
  limit: str = ""
  need_bytes: "int | None" = None
  limit_bytes: "int | None" = None
