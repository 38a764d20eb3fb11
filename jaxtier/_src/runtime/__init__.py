"""Runtime: the offloaded step, its state placed and its programs run by the plan."""

from jaxtier._src.runtime.offloaded_step import OffloadedStep as OffloadedStep
from jaxtier._src.runtime.plan_cache import PLAN_CACHE as PLAN_CACHE
from jaxtier._src.runtime.runner import MEASURED_STEPS as MEASURED_STEPS
