"""jaxtier: train JAX models larger than device memory by tiering state into pinned host memory.

Public API (everything else lives in `jaxtier._src` and may change):
  offload, plan, calibrate, OffloadedStep, Plan, LeafPlan, HardwareProfile, PlanError,
  AdmissionError.
"""

import jax as _jax  # noqa: F401  (jax must be imported before jaxtier's extension: MEASURED.md)

from jaxtier._src.api import offload as offload
from jaxtier._src.api import calibrate as calibrate
from jaxtier._src.api import OffloadedStep as OffloadedStep
from jaxtier._src.api import plan as plan
from jaxtier._src.inventory import LeafInfo as LeafInfo
from jaxtier._src.planner import AdmissionError as AdmissionError
from jaxtier._src.planner import LeafPlan as LeafPlan
from jaxtier._src.planner import Plan as Plan
from jaxtier._src.planner import PlanError as PlanError
from jaxtier._src.profile import HardwareProfile as HardwareProfile

__version__ = "0.1.0"
