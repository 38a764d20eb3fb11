"""`HardwareProfile`: the rates and capacities the cost model uses, its defaults, the built-in
profiles of the cards jaxtier knows (`builtin_profile`) and storage."""

from __future__ import annotations

import dataclasses
import math
import os
import re

from jaxtier._src import paths
from jaxtier._src.hardware.host import XLA_MEM_FRACTION_DEFAULT

# Bytes of memory traffic per parameter of an AdamW update with an fp32 master, fp32 moments in
# pinned_host and bf16 gradients / params on the device:
#   DHA kernel, over the link: master, m, v read (12) and written (12).
H200_HBM_BYTES = 143_771 * 2**20  # nvidia-smi's total on the H200
DHA_LINK_BYTES_PER_PARAM = 24


#   CPU executor, host DRAM: master, m, v read and written (24), the staged gradient read and the
#   staged param written (2 + 2), and the copy engines' writes / reads of those stagings counted
#   at half (1 + 1: `cost_model.STAGING_DRAM_FACTOR`).
CPU_DRAM_BYTES_PER_PARAM = 30

# Shares of the GPU's resident blocks at which the DHA update kernel's rates saturate
# (`HardwareProfile.dha_update_secs`), from one layer call on the H200
# (diagnostics/dha_update_rate_h200.json). Compute: all operands in HBM, 16.3e9 elements/s on the
# whole grid, 9.0e9 on a quarter, 4.8e9 on an eighth: about 37e9 per whole grid's worth of
# blocks up to 16.3e9, so 0.44. Link: moments in pinned_host, 79.4 GB/s on the whole grid and
# 79.8 on a quarter, 46.5 on an eighth: about 372 GB/s per whole grid's worth of blocks up to
# the link's rate, so 0.21.
DHA_COMPUTE_GRID = 0.44
DHA_LINK_GRID = 0.21




# The format of a stored profile, kept in its JSON as "format_version". A stored profile of an
# older format (or none: before versioning) is ignored by `load`: its figures may come from an
# older calibration (e.g. version 1 stored no CPU compute figures, so a CPU plan used an H200's
# 700 TFLOP/s; version 3 read `dha_update_gbps` as a per-byte rate added to a per-element
# cost). Bump it whenever what `calibrate` measures, or how, or what a field means, changes.
PROFILE_FORMAT_VERSION = 4


_STR_FIELDS = ("device_kind", "source")


_DICT_FIELDS = ("versions",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
  """Rates and capacities of one GPU and its host, as jaxtier's mechanisms see them.

  Attributes:
    link_h2d_gbps: copy-engine bandwidth pinned host -> device, one direction alone, GB/s.
    link_d2h_gbps: copy-engine bandwidth device -> pinned host, one direction alone, GB/s.
    link_duplex_gbps: both directions at once (two streams), the two together, GB/s.
    dha_read_gbps: a kernel reading pinned host memory in place (zero-copy), GB/s.
    dha_write_gbps: a kernel writing pinned host memory in place, GB/s.
    dha_rw_gbps: a kernel reading and writing pinned host memory at once, both directions
      together, GB/s (what the fused host update's DHA kernel achieves).
    host_dram_gbps: host memory bandwidth (STREAM triad, all CPU threads), GB/s.
    cpu_adamw_params_per_sec: AdamW update rate of the host CPU executor (fp32 master and
      moments on the host, bf16 gradient and param staged), params/s.
    dha_adamw_params_per_sec: AdamW update rate of the DHA kernel, params/s (fp32 master
      and moments in pinned_host: 24 bytes per param over the link).
    dha_update_gbps: the DHA update kernel's rate in host bytes read + written per second,
      GB/s, on enough of the GPU's blocks to keep the link busy (`dha_update_secs`).
    dha_update_elements_per_sec: the DHA update kernel's rate with every operand in HBM, on
      the whole grid, elements/s: its own cost per element, apart from the link.
    dha_layer_grid: the share of the device's resident thread blocks a layer call's DHA kernel
      runs on, beside XLA's compute, in (0, 1] (`host_update_layer`'s `dha_grid`).
    dha_gather_gbps: the DHA gather's rate, bytes of gathered rows per second, GB/s (8,192
      random rows of a pinned_host fp32 table, 8 KiB each): what reading an embedding table's
      rows in place costs (`cost_model.stream_stage`).
    dha_matmul_gbps: the DHA matmul's rate at 128 rows of x, bytes of the pinned_host weight
      read per second, GB/s: a matmul weight read in place pays only where this beats the
      copy engines' `link_h2d_gbps` (the planner's note says which).
    matmul_tflops: achieved bf16 matmul throughput (8192^3 GEMM), TFLOP/s.
    hbm_gbps: achieved HBM bandwidth (device-to-device copy, read + write counted), GB/s.
    hbm_bytes: device memory JAX's allocator may use (`memory_stats()['bytes_limit']`) at
      XLA's default fraction (XLA_PYTHON_CLIENT_MEM_FRACTION=0.75), bytes.
    pinnable_bytes: pinned host memory the host can give (MemAvailable, capped by XLA's pinned
      pool `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`), bytes.
    inter_gpu_gbps: GPU-to-GPU bandwidth (NVLink) one direction, GB/s (not measured with one
      GPU; for multi-path transfers).
    cpu_threads: host CPU threads the CPU executor may use.
    device_kind: `jax.Device.device_kind` the figures were taken on.
    versions: software versions at calibration ({'jax': ..., 'jaxlib': ..., 'jaxtier': ...}).
    source: 'defaults' or 'calibrated' (and where), for the plan's notes.
  """

  link_h2d_gbps: float = 53.0
  link_d2h_gbps: float = 54.0
  # 44.3 GB/s each way measured on the H200 with both directions busy (two streams).
  link_duplex_gbps: float = 88.0
  # SM loads from pinned host: 50.4 - 50.8 GB/s on the H200, any grid from 132x256 up.
  dha_read_gbps: float = 50.0
  # Not measured alone; taken as the read rate, rounded down.
  dha_write_gbps: float = 48.0
  # A zero-copy read + write probe reached ~65 GB/s on the H200, but the AdamW DHA kernel
  # reached 2.30e9 params/s x 24 B = 55 GB/s (W2) and the 1b e2e run 52 GB/s: the kernel's rate.
  dha_rw_gbps: float = 52.0
  host_dram_gbps: float = 80.5
  # `jaxtier.calibrate` on this H200 (benchmarks/results/calibrate/h200_af23580.log): host_cpu AdamW
  # 2.73e9 params/s, transfers included (W2 reached 3.30e9 on larger calls; its first run,
  # before the executor's fused passes, 2.03e9).
  cpu_adamw_params_per_sec: float = 2.73e9
  # W2 (w2/host_update_h200.json): host_dha 2.739e9 params/s.
  dha_adamw_params_per_sec: float = 2.739e9
  # One layer call of the DHA update kernel on the H200 (diagnostics/dha_update_rate_h200.json):
  # AdamW moments in pinned_host (16 B per element) 79.4 GB/s on the whole grid and 79.8 on a
  # quarter; master and moments there (24 B) 69.6 and 76.3; all operands in HBM 16.3e9
  # elements/s on the whole grid. 78 GB/s is within 12% of each host case, and of W3's serial
  # update (1b, two calls a component: 355 ms measured, 374 predicted).
  dha_update_gbps: float = 78.0
  dha_update_elements_per_sec: float = 16.3e9
  # The kernel's blocks hold their SMs until a layer's update is done. Alone, a layer call of
  # AdamW with its moments in pinned_host (16 B per element over the link) runs at 4.96e9
  # elements/s on the whole grid and 4.99e9 on a quarter of it (79.8 GB/s: the link), 2.90e9
  # on an eighth (diagnostics/dha_update_rate_h200.json). W3 (1b, batch 8, the split at 0.8,
  # w3/1b_b8_osh_grid_h200.json): 315.6 ms per step on a quarter, 352.3 on the whole grid,
  # 420.6 on an eighth.
  dha_layer_grid: float = 0.25
  # W6 (w6/1b_128k_h200.json, H200): 8,192 rows of a 131,072 x 2,048 fp32 table in 1.43 ms, 47 GB/s.
  dha_gather_gbps: float = 47.0
  # diagnostics/dha_crossover_h200.json (H200): an 8192 x 8192 bf16 weight read in place at 49.1
  # GB/s for 1 to 128 rows of x, against 53.7 GB/s copying it (0.91-0.92 of the copy).
  dha_matmul_gbps: float = 49.0
  # ~790 TFLOP/s on a bf16 8192^3 GEMM; training steps reach less (smaller and skinnier GEMMs).
  matmul_tflops: float = 700.0
  # ~4,050 GB/s device-to-device copy (read + write counted).
  hbm_gbps: float = 4000.0
  hbm_bytes: int = int(H200_HBM_BYTES * XLA_MEM_FRACTION_DEFAULT)
  # XLA's pinned pool cap (64 GiB by default) is below the H200 host's 125 GiB of RAM.
  pinnable_bytes: int = 64 * 2**30
  inter_gpu_gbps: float = 300.0
  cpu_threads: int = 16
  device_kind: str = "NVIDIA H200"
  versions: dict = dataclasses.field(default_factory=lambda: {"jax": "0.11.2"})
  source: str = "defaults (an H200 machine as measured for jaxtier; see docs/design.md)"

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in _STR_FIELDS:
        if not isinstance(value, str):
          raise ValueError(f"HardwareProfile: expected {field.name} to be a string, got "
                           f"{value!r}")
        continue
      if field.name in _DICT_FIELDS:
        if not isinstance(value, dict):
          raise ValueError(f"HardwareProfile: expected {field.name} to be a dict, got {value!r}")
        continue
      if (isinstance(value, bool) or not isinstance(value, (int, float))
          or not math.isfinite(value) or value <= 0):
        raise ValueError(f"HardwareProfile: expected {field.name} > 0 (finite), got {value!r}")
    if self.dha_layer_grid > 1:
      raise ValueError(f"HardwareProfile: expected dha_layer_grid in (0, 1], got "
                       f"{self.dha_layer_grid!r}")

  @property
  def is_default(self) -> bool:
    return self.source.startswith("defaults")

  def rates(self) -> dict[str, float]:
    """The numeric fields, {name: value} (for printing)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name not in _STR_FIELDS + _DICT_FIELDS}

  def dha_update_secs(self, elements: float, host_bytes: float, grid: float = 1.0) -> float:
    """Seconds of the DHA update kernel for a call over `elements` elements moving
    `host_bytes` (read + written) of pinned host memory, on the share `grid` of the GPU's
    resident blocks (1: the whole grid; a layer call's is `dha_layer_grid`).

      secs = max(elements / (dha_update_elements_per_sec * min(1, grid / DHA_COMPUTE_GRID)),
                 host_bytes / (dha_update_gbps * min(1, grid / DHA_LINK_GRID)))

    The kernel's blocks work through the call's elements at a rate that grows with their
    number until it saturates (DHA_COMPUTE_GRID), and keep enough zero-copy loads in flight to
    fill the link only from DHA_LINK_GRID of the blocks up. The link's caps apply separately
    (`cost_model.update_cost`).
    """
    if not 0 < grid <= 1:
      raise ValueError(f"dha_update_secs: expected grid in (0, 1], got {grid!r}")
    compute = float(elements) / (self.dha_update_elements_per_sec
                                 * min(1.0, grid / DHA_COMPUTE_GRID))
    link = float(host_bytes) / (self.dha_update_gbps * 1e9 * min(1.0, grid / DHA_LINK_GRID))
    return max(compute, link)

  def cpu_update_gbps(self) -> float:
    """The CPU executor's effective host-DRAM streaming rate, GB/s.

    = cpu_adamw_params_per_sec * CPU_DRAM_BYTES_PER_PARAM / 1e9: the AdamW rate turned into the
    bytes it moves, so that an update of any op program is costed by the bytes it moves.
    """
    return self.cpu_adamw_params_per_sec * CPU_DRAM_BYTES_PER_PARAM / 1e9


DEFAULT_PROFILE = HardwareProfile()


# Built-in profiles of other cards: the H200's measured rates (`DEFAULT_PROFILE`) scaled by the
# ratio of the cards' datasheet figures, as no other card has been calibrated for jaxtier. The
# host's figures (host DRAM, the CPU executor, its threads, the pinnable memory) stay the H200
# machine's: they are the host's, not the card's.
#
# Datasheet figures of the H200 SXM (NVIDIA H200 Tensor Core GPU datasheet): dense bf16 peak
# 989 TFLOP/s (the GH100 compute of the H100 SXM: 132 SMs), HBM3e 4.8 TB/s, NVLink 4 900 GB/s
# (both directions), PCIe Gen5 x16.
H200_BF16_TFLOPS = 989.0
H200_HBM_TBPS = 4.8
H200_NVLINK_GBPS = 900.0

# H100 SXM 80GB (NVIDIA H100 Tensor Core GPU datasheet): the H200's GH100 compute (132 SMs, 989
# TFLOP/s dense bf16), so matmul_tflops and the DHA kernel's per-element rate stay the H200's;
# HBM3 3.35 TB/s; NVLink 4 900 GB/s and PCIe Gen5 x16 as the H200's, so the link and zero-copy
# rates stay too; memory 81,559 MiB (nvidia-smi's total on the H100 80GB HBM3).
H100_HBM_TBPS = 3.35
H100_HBM_BYTES = 81_559 * 2**20
H100_PROFILE = dataclasses.replace(
    DEFAULT_PROFILE,
    hbm_gbps=DEFAULT_PROFILE.hbm_gbps * H100_HBM_TBPS / H200_HBM_TBPS,
    hbm_bytes=int(H100_HBM_BYTES * XLA_MEM_FRACTION_DEFAULT),
    device_kind="NVIDIA H100 80GB HBM3",
    source="defaults for an NVIDIA H100 (the H200's measured rates scaled by the datasheet; "
           "not calibrated)")

# A100 SXM4 80GB (NVIDIA A100 Tensor Core GPU datasheet): dense bf16 peak 312 TFLOP/s; HBM2e
# 2.04 TB/s (2,039 GB/s); 80 GB (81,920 MiB); NVLink 3 600 GB/s (both directions); PCIe Gen4
# x16: 16 GT/s a lane against Gen5's 32, the same 128b/130b encoding, so the copy engines' and
# the zero-copy rates (and the DHA kernel's, which the link bounds) are half the H200's. The DHA
# kernel's per-element rate with its operands in HBM (16.3e9 AdamW elements/s on the H200, some
# 0.5 TB/s: far from its HBM's bound) is scaled by SMs x boost clock: 108 x 1,410 MHz against
# 132 x 1,980.
A100_BF16_TFLOPS = 312.0
A100_HBM_TBPS = 2.04
A100_HBM_BYTES = 81_920 * 2**20
A100_NVLINK_GBPS = 600.0
PCIE_GEN4_OF_GEN5 = 0.5
A100_SM_CLOCK_OF_H200 = (108 * 1410) / (132 * 1980)
# The rates the link bounds: the copy engines', zero-copy's and the DHA kernels'.
LINK_BOUND_FIELDS = ("link_h2d_gbps", "link_d2h_gbps", "link_duplex_gbps", "dha_read_gbps",
                     "dha_write_gbps", "dha_rw_gbps", "dha_adamw_params_per_sec",
                     "dha_update_gbps", "dha_gather_gbps", "dha_matmul_gbps")
A100_PROFILE = dataclasses.replace(
    DEFAULT_PROFILE,
    **{name: getattr(DEFAULT_PROFILE, name) * PCIE_GEN4_OF_GEN5 for name in LINK_BOUND_FIELDS},
    dha_update_elements_per_sec=(DEFAULT_PROFILE.dha_update_elements_per_sec
                                 * A100_SM_CLOCK_OF_H200),
    matmul_tflops=DEFAULT_PROFILE.matmul_tflops * A100_BF16_TFLOPS / H200_BF16_TFLOPS,
    hbm_gbps=DEFAULT_PROFILE.hbm_gbps * A100_HBM_TBPS / H200_HBM_TBPS,
    hbm_bytes=int(A100_HBM_BYTES * XLA_MEM_FRACTION_DEFAULT),
    inter_gpu_gbps=DEFAULT_PROFILE.inter_gpu_gbps * A100_NVLINK_GBPS / H200_NVLINK_GBPS,
    device_kind="NVIDIA A100-SXM4-80GB",
    source="defaults for an NVIDIA A100 (the H200's measured rates scaled by the datasheet; "
           "not calibrated)")

# The built-in profiles by the card's name in `jax.Device.device_kind` ('NVIDIA H100 80GB
# HBM3', 'NVIDIA A100-SXM4-80GB'); the H200's is the default profile itself.
BUILTIN_PROFILES = {"H100": H100_PROFILE, "H200": DEFAULT_PROFILE, "A100": A100_PROFILE}
# A card's name as a word of its own: 'GH200' (Grace Hopper, its host on NVLink-C2C) is not an
# H200.
_CARD = re.compile(r"(?<![A-Z0-9])(" + "|".join(BUILTIN_PROFILES) + r")(?![0-9])")


def card_of(device_kind: str) -> "str | None":
  """The built-in card `device_kind` names ('H100', 'H200' or 'A100', any case, as a word of
  its own: 'NVIDIA H100 80GB HBM3' is 'H100'), or None."""
  match = _CARD.search(device_kind.upper())
  return match.group(1) if match else None


def builtin_profile(device_kind: str) -> HardwareProfile:
  """The built-in profile of the card `device_kind` names (`card_of`), else `DEFAULT_PROFILE`
  (the H200's): rates and memory from the H200's measured figures scaled by the card's
  datasheet (`BUILTIN_PROFILES`), not calibrated."""
  card = card_of(device_kind)
  return BUILTIN_PROFILES[card] if card else DEFAULT_PROFILE


def check_device_kind(device_kind: "str | None", platform: str) -> "str | None":
  """The card `device_kind` names, for a plan for `platform` on this machine; None when not given.

  `device_kind` names the GPU planned for where this machine has none (`platform` 'gpu' on a
  CPU machine). On a GPU it may only name this machine's own card (its stored or built-in
  profile is the one used).

  Raises:
    jaxtier.OptionError: not a string, a card with no built-in profile, given for a CPU plan,
      or naming another card than this machine's GPU.
  """
  from jaxtier._src.errors import OptionError  # pylint: disable=g-import-not-at-top
  if device_kind is None:
    return None
  known = ", ".join(BUILTIN_PROFILES)
  expected = f"a GPU with a built-in profile: one of {known} (or a device kind naming one)"
  if not isinstance(device_kind, str):
    raise OptionError(f"jaxtier: expected device_kind a string ({expected}), got "
                      f"{device_kind!r}", option="device_kind", value=device_kind,
                      expected=expected)
  card = card_of(device_kind)
  if card is None:
    raise OptionError(f"jaxtier: no built-in hardware profile for device_kind {device_kind!r}; "
                      f"known: {known}", option="device_kind", value=device_kind,
                      expected=expected)
  if platform != "gpu":
    raise OptionError(f"jaxtier: device_kind {device_kind!r} names a GPU, and the plan is for "
                      f"{platform!r}: plan with platform 'gpu'", option="device_kind",
                      value=device_kind, expected=expected)
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() == "gpu":
    here = jax.devices()[0].device_kind
    if card_of(here) != card:
      raise OptionError(
          f"jaxtier: device_kind {device_kind!r} is not this machine's GPU ({here}): a plan "
          "for this GPU uses its own profile (device_kind names the GPU planned for on a "
          "machine without one)", option="device_kind", value=device_kind, expected=expected)
  return card


def describe(hardware: HardwareProfile) -> str:
  """Which profile `hardware` is, for a plan's notes: 'the default hardware profile' (the
  H200's), 'the built-in H100 profile', or 'a stored profile'."""
  if hardware == DEFAULT_PROFILE:
    return "the default hardware profile"
  card = card_of(hardware.device_kind) if hardware.is_default else None
  return f"the built-in {card} profile" if card else "a stored profile"


def split_fraction(profile: HardwareProfile = DEFAULT_PROFILE) -> float:
  """The `dha_fraction` of the `split` executor: the DHA kernel's share of the elements.

  Both executors finish together when each gets elements in proportion to its rate:
  dha_rate / (dha_rate + cpu_rate).

  Args:
    profile: the machine's rates.

  Returns:
    A fraction in (0, 1).
  """
  dha = profile.dha_adamw_params_per_sec
  cpu = profile.cpu_adamw_params_per_sec
  return dha / (dha + cpu)


def cache_path(device_kind: "str | None" = None) -> str:
  """Where `save` keeps the profile: the user's cache dir, keyed by device kind and versions."""
  import jax  # pylint: disable=g-import-not-at-top
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  kind = device_kind or jax.devices()[0].device_kind
  kind = kind.replace(" ", "_").replace("/", "_")
  return os.path.join(base, "jaxtier", f"profile-{kind}-jax{jax.__version__}.json")


def save(profile: HardwareProfile, path: "str | None" = None) -> str:
  """Writes `profile` as JSON (default: `cache_path()`), with `PROFILE_FORMAT_VERSION` as
  "format_version"; returns the path. The file is written whole or not at all (a temporary
  file beside it, renamed), so that a process loading it meanwhile never reads half of it."""
  path = path or cache_path()
  paths.write_json(path, {"format_version": PROFILE_FORMAT_VERSION,
                          **dataclasses.asdict(profile)}, indent=1)
  return path
