"""Options of `jaxtier.offload`, validated when made."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxtier._src import units
from jaxtier._src.errors import OptionError
from jaxtier._src.planning import policy as policy_lib


class _Missing:
  def __repr__(self):
    return "MISSING"


MISSING: Any = _Missing()


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadOptions:
  """Options of `jaxtier.offload` (validated when made: `OptionError` names the option).

  Attributes:
    device_budget: device memory the step may use at its peak (state, gradients, activations),
      bytes per device (int, or a string such as '80GB'/'16GiB'); None: no limit (on a GPU,
      the planner then plans against what the device has).
    host_budget: pinned host memory the plan may pin, bytes per device; None: no limit beyond
      what the host can pin.
    policy: 'auto', 'none', a callable `(path, LeafInfo) -> placement | None`, or a
      `{regex: placement}` dict over leaf paths.
    donate_argnums: must include 0 (the state is updated in place).
    overlap_update: update the leaves stacked over layers inside the backward pass, layer by
      layer, overlapped with the compute (the serial step's arithmetic; components that need
      every gradient first, such as a global-norm clip, stay serial). False runs every
      host update after the backward pass.
    allow_over_budget: run a plan that does not fit the `device_budget` given (warning that it
      does not fit); False (the default) refuses it, before anything is allocated, with an
      `AdmissionError` whose `limit` is 'device_budget'. No effect without a `device_budget`.
  """

  device_budget: "int | None" = None
  host_budget: "int | None" = None
  policy: Any = "auto"
  donate_argnums: tuple[int, ...] = (0,)
  overlap_update: bool = True
  allow_over_budget: bool = False

  def __post_init__(self):
    object.__setattr__(self, "device_budget",
                       units.parse_bytes(self.device_budget, "jaxtier.offload: device_budget"))
    object.__setattr__(self, "host_budget",
                       units.parse_bytes(self.host_budget, "jaxtier.offload: host_budget"))
    if not isinstance(self.overlap_update, (bool, np.bool_)):
      raise OptionError(f"jaxtier.offload: expected overlap_update True or False, got "
                        f"{type(self.overlap_update).__name__} {self.overlap_update!r:.80}",
                        option="overlap_update", value=self.overlap_update, expected="a bool")
    object.__setattr__(self, "overlap_update", bool(self.overlap_update))
    if not isinstance(self.allow_over_budget, (bool, np.bool_)):
      raise OptionError(f"jaxtier.offload: expected allow_over_budget True or False, got "
                        f"{type(self.allow_over_budget).__name__} "
                        f"{self.allow_over_budget!r:.80}",
                        option="allow_over_budget", value=self.allow_over_budget,
                        expected="a bool")
    object.__setattr__(self, "allow_over_budget", bool(self.allow_over_budget))
    donate = tuple(self.donate_argnums) if isinstance(self.donate_argnums, (tuple, list)) else (
        self.donate_argnums,)
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in donate):
      raise OptionError(f"jaxtier.offload: expected donate_argnums an int or a tuple of ints, "
                        f"got {self.donate_argnums!r:.80}", option="donate_argnums",
                        value=self.donate_argnums, expected="an int or a tuple of ints")
    donate = tuple(int(i) for i in donate)
    if 0 not in donate:
      raise ValueError("jaxtier.offload: expected donate_argnums to include 0, got "
                       f"{self.donate_argnums!r}; host-resident leaves are updated in place, "
                       "which consumes the state passed in (use the returned state)")
    object.__setattr__(self, "donate_argnums", donate)
    policy_lib.check_policy_form(self.policy, "jaxtier.offload")
