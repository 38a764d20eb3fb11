"""DHA compute (gather, matmul, scatter_add on host-resident operands): unstable API.

The implementation is `jaxtier._src.primitives.dha` (one module per custom-call family); this
name is that very module, not a copy of its names: `jaxtier.experimental.dha.X` is
`jaxtier._src.primitives.dha.X` for every X, private ones included, so that setting an attribute
here (as tests and benchmarks/sanitizer_programs.py set `_num_sms`) changes what the family uses.
"""

import sys

from jaxtier._src.primitives import dha as _dha
from jaxtier._src.primitives.dha import GATHER_TARGET as GATHER_TARGET
from jaxtier._src.primitives.dha import MATMUL_TARGET as MATMUL_TARGET
from jaxtier._src.primitives.dha import SCATTER_ADD_TARGET as SCATTER_ADD_TARGET
from jaxtier._src.primitives.dha import TARGETS as TARGETS
from jaxtier._src.primitives.dha import gather as gather
from jaxtier._src.primitives.dha import matmul as matmul
from jaxtier._src.primitives.dha import matmul_bwd as matmul_bwd
from jaxtier._src.primitives.dha import matmul_partial_shape as matmul_partial_shape
from jaxtier._src.primitives.dha import matmul_t as matmul_t
from jaxtier._src.primitives.dha import scatter_add as scatter_add

sys.modules[__name__] = _dha
