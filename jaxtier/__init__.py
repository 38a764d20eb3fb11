"""jaxtier: train JAX models larger than device memory by tiering state into pinned host memory.

The public API is what this module exports; everything under `jaxtier._src` may change, and
`jaxtier.experimental` holds mechanisms `offload` does not reach yet.
"""

# First: `python -m jaxtier` and `python -m jaxtier.examples.train` end a Ctrl-C while they
# import in one line, not a traceback (other code importing jaxtier keeps its SIGINT handler).
from jaxtier._src import early_interrupt as _early_interrupt
_early_interrupt.install_for_main_module()

import jax as _jax  # noqa: F401  (before jaxtier's extension: the other order crashed in ml_dtypes)

from jaxtier._src.analysis.inventory import LeafInfo as LeafInfo
from jaxtier._src.api import admit as admit
from jaxtier._src.api import available_host_bytes as available_host_bytes
from jaxtier._src.api import calibrate as calibrate
from jaxtier._src.api import offload as offload
from jaxtier._src.api import plan as plan
from jaxtier._src.errors import AdmissionError as AdmissionError
from jaxtier._src.errors import CheckpointMismatchError as CheckpointMismatchError
from jaxtier._src.errors import OptionError as OptionError
from jaxtier._src.errors import PlanError as PlanError
from jaxtier._src.hardware.profile import DEFAULT_PROFILE as DEFAULT_PROFILE
from jaxtier._src.hardware.profile import HardwareProfile as HardwareProfile
from jaxtier._src.hardware.machine import load as load_profile
from jaxtier._src.hardware.profile import save as save_profile
from jaxtier._src.hardware.profile import split_fraction as split_fraction
from jaxtier._src.planning.cost_model import ActivationModel as ActivationModel
from jaxtier._src.planning.cost_model import ActivationOption as ActivationOption
from jaxtier._src.planning.plan import BudgetViolation as BudgetViolation
from jaxtier._src.planning.plan import DeviceBudget as DeviceBudget
from jaxtier._src.planning.plan import LeafPlan as LeafPlan
from jaxtier._src.planning.plan import Plan as Plan
from jaxtier._src.planning.plot import plot_plan as plot_plan
from jaxtier._src.runtime import OffloadedStep as OffloadedStep
from jaxtier._src.units import format_bytes as format_bytes
from jaxtier._src.units import format_rate as format_rate
from jaxtier._src.units import parse_bytes as parse_bytes
from jaxtier._src.vocab import Executor as Executor
from jaxtier._src.vocab import MemoryKind as MemoryKind
from jaxtier._src.vocab import NamedPolicy as NamedPolicy
from jaxtier._src.vocab import Placement as Placement
from jaxtier._src.vocab import Role as Role

__version__ = "0.1.0"
