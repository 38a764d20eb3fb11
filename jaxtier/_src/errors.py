"""The errors jaxtier raises for a state it cannot place (re-exported by `jaxtier`)."""

from __future__ import annotations

from typing import Any


class PlanError(ValueError):
  """The state cannot be placed as asked (a budget, a leaf's dtype, an unknown placement).

  When a complete plan was refused (over a budget), `plan` holds it; else None.
  """

  plan: Any = None  # the refused `Plan`, or None


class AdmissionError(PlanError):
  """The plan needs more pinned host memory than the budget or the host allows.

  Raised before anything is allocated; the caller's state is untouched. `plan` holds the
  refused plan (for printing).
  """

  plan: Any = None  # the refused `Plan`, or None
