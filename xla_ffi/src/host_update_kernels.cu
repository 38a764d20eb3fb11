// CUDA handler of `jaxtier_host_update_ffi` (op program: op_program.h, docs/design.md). Attribute
// `executor` picks who computes the update:
//
//   0 host_dha  One grid-stride kernel interprets the program per element on XLA's stream.
//               Operands and results may live in pinned host memory (read and written zero-copy
//               over the link) or in device memory; the kernel does not care.
//   1 host_cpu  Host CPU threads run the program (the CPU handler's executor, host_update.cc)
//               from host functions (cudaLaunchHostFunc) on jaxtier's own streams. Buffers in
//               host memory are used in place; device buffers (gradients, device params, device
//               scalars) are staged through pinned buffers: the element range is cut into chunks,
//               chunk c goes to stream c % 3 and its staging slot, and each stream runs
//               down-copy, CPU compute, up-copy, so that the down-copy of one chunk, the compute of
//               the next and the up-copy of the one before overlap.
//   2 split     The kernel runs on [0, k) on XLA's stream while the CPU runs on [k, N) on jaxtier's
//               streams; k = dha_fraction * N, rounded to a multiple of 256.
//
// Ordering with XLA: an event recorded on XLA's stream at the start of the call gates jaxtier's
// streams; XLA's stream waits on an event of each jaxtier stream at the end. Streams, events and
// the pinned staging buffer are per-instance state (created by the instantiate stage, filled per
// device on first use, grown only when a call needs more staging, freed with the executable).
// The layer calls (`jaxtier_host_update_layer_ffi`, below) instead share one set per device and
// do not make XLA's stream wait: the join does, and a release for the values it names. A layer call over rows of a table (op_program.h,
// LayerAttrs::rows) runs on the CPU threads alone, from one host function on stream 0, in place
// on host buffers.
// Neither path is marked kCmdBufferCompatible (own streams, host functions, event waits).
// No nanobind here: module.cc registers the symbols.

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ffi_helpers.h"
#include "handlers.h"
#include "op_program.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtier {
namespace {

using host_update::HostUpdateParams;
using host_update::Instruction;
using host_update::kJoinOpName;
using host_update::kLayerOpName;
using host_update::kReleaseOpName;
using host_update::kOpName;  // the op that errors name

constexpr int kThreadsPerBlock = 256;

// The parameters (about 2 KB) stay in the kernel's constant parameter space; __grid_constant__
// keeps the dynamically indexed arrays from being copied to local memory.
__global__ void __launch_bounds__(kThreadsPerBlock)
    HostUpdateKernel(const __grid_constant__ HostUpdateParams p) {
  using namespace host_update;  // opcodes
  float r[kMaxRegisters];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += stride) {
    for (int k = 0; k < p.num_instructions; ++k) {
      const Instruction ins = p.instructions[k];
      switch (KindOf(ins.op)) {
        case OpKind::kLoad:
          r[ins.dst] = LoadAsFloat(p.operands[ins.a], p.operand_type[ins.a],
                                   p.operand_scalar[ins.a] ? 0 : i);
          break;
        case OpKind::kConst:
          r[ins.dst] = p.consts[ins.a];
          break;
        case OpKind::kStore:
          StoreFromFloat(p.results[ins.dst], p.result_type[ins.dst], i, r[ins.a]);
          break;
        case OpKind::kCopy:
          r[ins.dst] = r[ins.a];
          break;
        case OpKind::kUnary:
          r[ins.dst] = EvalUnary(ins.op, r[ins.a]);
          break;
        case OpKind::kBinary:
          r[ins.dst] = EvalBinary(ins.op, r[ins.a], r[ins.b]);
          break;
        case OpKind::kTernary:
          r[ins.dst] = EvalTernary(ins.op, r[ins.a], r[ins.b], r[ins.c]);
          break;
        default:
          break;  // rejected by PrepareHostUpdate
      }
    }
  }
}

// Blocks that fill the device, computed once per device.
constexpr int kMaxDevices = 64;
std::atomic<int> g_resident_blocks[kMaxDevices];

ffi::Error ResidentBlocks(int* blocks) {
  int device = 0;
  JT_CUDA_CHECK(kOpName, cudaGetDevice(&device), "");
  std::atomic<int>* slot = device < kMaxDevices ? &g_resident_blocks[device] : nullptr;
  if (slot != nullptr && (*blocks = slot->load(std::memory_order_relaxed)) > 0) {
    return ffi::Error::Success();
  }
  int num_sms = 0, per_sm = 0;
  JT_CUDA_CHECK(kOpName, cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
                "the SM count of device " + std::to_string(device));
  JT_CUDA_CHECK(kOpName,
                cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, HostUpdateKernel,
                                                              kThreadsPerBlock, 0),
                "blocks of HostUpdateKernel per SM");
  *blocks = num_sms * (per_sm > 0 ? per_sm : 1);
  if (slot != nullptr) slot->store(*blocks, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// Launches the kernel over elements [0, params.n) on `stream`, on at most `grid_share` of the
// blocks the device holds at once (at least one). Each block strides over its elements until
// the range is done, so a full grid holds every SM until then and kernels on other streams
// wait; a layer call's smaller share leaves XLA's compute the other SMs.
ffi::Error LaunchKernel(cudaStream_t stream, const HostUpdateParams& params,
                        double grid_share = 1.0) {
  if (params.n == 0 || params.num_instructions == 0) return ffi::Error::Success();
  int resident = 0;
  JT_RETURN_IF_ERROR(ResidentBlocks(&resident));
  if (grid_share < 1.0) {
    resident = static_cast<int>(resident * grid_share);
    if (resident < 1) resident = 1;
  }
  const int64_t needed = (params.n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const int grid = static_cast<int>(needed < resident ? needed : resident);
  HostUpdateKernel<<<grid, kThreadsPerBlock, 0, stream>>>(params);
  JT_CUDA_CHECK(kOpName, cudaGetLastError(), "launch of HostUpdateKernel");
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------------
// Host CPU executor driven from the GPU program (executors host_cpu and split).
// ------------------------------------------------------------------------------------------------

constexpr int kNumStreams = 3;
// Staging bytes per slot (one chunk of every staged buffer); JAXTIER_HOST_CPU_CHUNK_BYTES
// overrides it (read when an executable is instantiated).
constexpr int64_t kDefaultChunkBytes = int64_t{32} << 20;
constexpr int64_t kMinChunkBytes = int64_t{64} << 10;
constexpr int64_t kChunkAlignElements = 4096;
constexpr int64_t kRegionAlignBytes = 256;
// Device scalar operands come down into 64-byte slots at the start of the staging buffer.
constexpr int64_t kScalarSlotBytes = 64;
constexpr int64_t kScalarAreaBytes = host_update::kMaxOperands * kScalarSlotBytes;
constexpr int64_t kStagingGranularityBytes = int64_t{2} << 20;

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// The staging bytes per slot: JAXTIER_HOST_CPU_CHUNK_BYTES if set (at least `min_bytes`), else
// kDefaultChunkBytes.
ffi::Error ChunkBytesFromEnv(const char* op, int64_t min_bytes, int64_t* out) {
  *out = kDefaultChunkBytes;
  const char* env = std::getenv("JAXTIER_HOST_CPU_CHUNK_BYTES");
  if (env == nullptr || !*env) return ffi::Error::Success();
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  if (end == env || *end != '\0' || v < min_bytes) {
    return Invalid(op, "value", "environment variable JAXTIER_HOST_CPU_CHUNK_BYTES",
                   "an integer number of bytes >= " + std::to_string(min_bytes), env);
  }
  *out = v;
  return ffi::Error::Success();
}

// The events recorded on the streams a layer call enqueued work on, after that work.
struct ReadEvents {
  ReadEvents() = default;
  ReadEvents(const ReadEvents&) = delete;
  ReadEvents& operator=(const ReadEvents&) = delete;
  // A stream may still wait for an event: CUDA frees it once it has completed.
  ~ReadEvents() {
    for (cudaEvent_t e : events) (void)cudaEventDestroy(e);
  }
  std::vector<cudaEvent_t> events;
};

// Streams, events and pinned staging of one device: owned by one instance's state (a fused
// call, whose consecutive calls never overlap: a call's streams wait for XLA's stream to reach
// the call, and XLA's stream waits for the previous call's streams), or shared by the layer
// calls of the process (which pipeline on the streams, `EnqueueCpuRange`). One call enqueues
// at a time (mu).
struct DeviceResources {
  explicit DeviceResources(int device) : device(device) {}
  ~DeviceResources();
  DeviceResources(const DeviceResources&) = delete;
  DeviceResources& operator=(const DeviceResources&) = delete;

  // Creates the streams and events (on the current device, which must be `device`).
  ffi::Error Init();
  // Makes the pinned staging buffer at least `bytes` long. Growing waits for this device's
  // jaxtier streams (earlier calls may still read the old buffer), then reallocates.
  ffi::Error EnsureStaging(int64_t bytes);

  const int device;
  std::mutex mu;
  cudaStream_t streams[kNumStreams] = {};
  cudaEvent_t start = nullptr;  // on XLA's stream, at the start of a call
  cudaEvent_t ready = nullptr;  // on streams[0], once the CPU plan of a call is built
  cudaEvent_t done[kNumStreams] = {};
  // Layer calls only: the kernel part runs here, at the lowest priority, beside XLA's compute.
  cudaStream_t kernel_stream = nullptr;
  cudaEvent_t kernel_done = nullptr;
  char* staging = nullptr;  // pinned host memory
  int64_t staging_bytes = 0;
  // Layer calls only: per value a call reads as it is (count elements: a layer's gradient
  // slice), the events recorded after each call that read it, for the release. Emptied by the
  // release of the value, and wholly by a join (which waits for every stream).
  std::unordered_map<const void*, std::vector<std::shared_ptr<ReadEvents>>> reads;
};


ffi::Error DeviceResources::Init() {
  for (cudaStream_t& s : streams) {
    JT_CUDA_CHECK(kOpName, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                  "a jaxtier stream of the host CPU executor");
  }
  int least = 0, greatest = 0;
  JT_CUDA_CHECK(kOpName, cudaDeviceGetStreamPriorityRange(&least, &greatest), "");
  JT_CUDA_CHECK(kOpName,
                cudaStreamCreateWithPriority(&kernel_stream, cudaStreamNonBlocking, least),
                "the low-priority kernel stream of layer calls");
  for (cudaEvent_t* e : {&start, &ready, &done[0], &done[1], &done[2], &kernel_done}) {
    JT_CUDA_CHECK(kOpName, cudaEventCreateWithFlags(e, cudaEventDisableTiming), "");
  }
  static_assert(kNumStreams == 3, "Init lists the done events");
  return ffi::Error::Success();
}

ffi::Error DeviceResources::EnsureStaging(int64_t bytes) {
  if (staging_bytes >= bytes) return ffi::Error::Success();
  for (cudaStream_t s : streams) {
    JT_CUDA_CHECK(kOpName, cudaStreamSynchronize(s),
                  "before growing the pinned staging buffer");
  }
  if (staging != nullptr) {
    JT_CUDA_CHECK(kOpName, cudaFreeHost(staging), "the pinned staging buffer");
    staging = nullptr;
    staging_bytes = 0;
  }
  const int64_t size = AlignUp(bytes, kStagingGranularityBytes);
  void* p = nullptr;
  JT_CUDA_CHECK(kOpName, cudaHostAlloc(&p, static_cast<size_t>(size), cudaHostAllocPortable),
                std::to_string(size) + " bytes of pinned staging buffer");
  staging = static_cast<char*>(p);
  staging_bytes = size;
  return ffi::Error::Success();
}

DeviceResources::~DeviceResources() {
  // CUDA errors are ignored here (void): nothing can report them (this runs when XLA frees the
  // executable, through the state type's deleter, possibly at process exit).
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                        cudaSetDevice(device) == cudaSuccess;
  for (cudaStream_t s : streams) {
    if (s != nullptr) (void)cudaStreamSynchronize(s);
  }
  if (staging != nullptr) (void)cudaFreeHost(staging);
  if (kernel_stream != nullptr) (void)cudaStreamSynchronize(kernel_stream);
  for (cudaEvent_t e : {start, ready, done[0], done[1], done[2], kernel_done}) {
    if (e != nullptr) (void)cudaEventDestroy(e);
  }
  for (cudaStream_t s : streams) {
    if (s != nullptr) (void)cudaStreamDestroy(s);
  }
  if (kernel_stream != nullptr) (void)cudaStreamDestroy(kernel_stream);
  if (switched) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();  // leave no error of ours behind for a later check on this thread
}

// Per-instance state (one per custom call of an executable), created by the instantiate stage.
struct HostUpdateState {
  static ffi::TypeId id;

  int32_t executor = host_update::kExecutorHostDha;
  int64_t chunk_bytes = kDefaultChunkBytes;

  // The resources of `device`, created on first use (on the current device).
  ffi::Error Resources(int device, DeviceResources** out) {
    std::lock_guard<std::mutex> lock(mu);
    if (device < 0) return Internal(kOpName, "invalid current device " + std::to_string(device));
    if (devices.size() <= static_cast<size_t>(device)) devices.resize(device + 1);
    if (devices[device] == nullptr) {
      auto r = std::make_unique<DeviceResources>(device);
      JT_RETURN_IF_ERROR(r->Init());
      devices[device] = std::move(r);
    }
    *out = devices[device].get();
    return ffi::Error::Success();
  }

  std::mutex mu;
  std::vector<std::unique_ptr<DeviceResources>> devices;  // by device ordinal
};

ffi::TypeId HostUpdateState::id = {};  // assigned by XLA when the type is registered

void DeleteHostUpdateState(void* state) { delete static_cast<HostUpdateState*>(state); }

// One call of the CPU path: what its host functions need. Heap-allocated, reference-counted by
// the handler and by each host function enqueued, deleted by the last to finish.
struct CpuCall;

struct CpuChunk {
  CpuCall* call;
  int slot;  // also the stream
  int64_t lo, hi;
};

struct CpuCall {
  HostUpdateParams params;  // as validated: where XLA put the buffers
  // A rows call (RowsHostFn): the rows, the ids (host-readable: staged or in place) and the
  // operand zeroed on the picked rows.
  int32_t rows = host_update::kWindow;
  int64_t row_length = 0;
  const int32_t* ids = nullptr;
  int64_t num_ids = 0;
  void* zero = nullptr;
  uint8_t zero_type = 0;
  char* slot_base[kNumStreams] = {};
  int64_t operand_offset[host_update::kMaxOperands];  // bytes into a slot; -1: in place
  int64_t result_offset[host_update::kMaxResults];    // bytes into a slot; -1: in place
  const void* scalar_src[host_update::kMaxOperands] = {};  // host-readable scalar operands
  // The scalars as BuildPlanHostFn read them (8 bytes each, the largest storage is 4): chunks
  // read these, so the next call may reuse the staging's scalar area once the plan is built.
  alignas(8) char scalar_copy[host_update::kMaxOperands][8] = {};
  std::vector<CpuChunk> chunks;
  host_update::CpuPlan plan;
  std::atomic<bool> plan_ready{false};
  std::atomic<int> refs{1};  // the handler's
};

void Release(CpuCall* call) {
  if (call->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete call;
}

// Host-side view of chunk [lo, hi): vector pointers rebased to element lo (host buffers) or set
// to the chunk's staging slot (device buffers); scalars read from host memory. Aliased pairs stay
// aliased (a staged aliased pair shares one region), so one plan serves every chunk.
void ChunkParams(const CpuCall& call, int slot, int64_t lo, int64_t hi, HostUpdateParams* p) {
  using host_update::StorageBytes;
  *p = call.params;
  p->n = hi - lo;
  for (int i = 0; i < p->num_operands; ++i) {
    if (p->operand_scalar[i]) {
      p->operands[i] = call.scalar_src[i];
    } else if (call.operand_offset[i] >= 0) {
      p->operands[i] = call.slot_base[slot] + call.operand_offset[i];
    } else {
      p->operands[i] =
          static_cast<const char*>(call.params.operands[i]) + lo * StorageBytes(p->operand_type[i]);
    }
  }
  for (int r = 0; r < p->num_results; ++r) {
    if (call.result_offset[r] >= 0) {
      p->results[r] = call.slot_base[slot] + call.result_offset[r];
    } else {
      p->results[r] = static_cast<char*>(call.params.results[r]) + lo * StorageBytes(p->result_type[r]);
    }
  }
}

// Host functions: no CUDA calls in here (cudaLaunchHostFunc's contract). They may block while
// the CPU thread pool works.
void CUDART_CB BuildPlanHostFn(void* arg) {
  CpuCall* call = static_cast<CpuCall*>(arg);
  for (int i = 0; i < call->params.num_operands; ++i) {
    if (!call->params.operand_scalar[i]) continue;
    memcpy(call->scalar_copy[i], call->scalar_src[i],
           static_cast<size_t>(host_update::StorageBytes(call->params.operand_type[i])));
    call->scalar_src[i] = call->scalar_copy[i];
  }
  {
    host_update::ScopedIeeeFloatingPoint ieee;
    HostUpdateParams p;
    const CpuChunk& first = call->chunks.front();
    ChunkParams(*call, first.slot, first.lo, first.hi, &p);
    host_update::BuildCpuPlan(p, &call->plan);
    call->plan_ready.store(true, std::memory_order_release);
  }
  Release(call);
}

void CUDART_CB RunChunkHostFn(void* arg) {
  const CpuChunk* chunk = static_cast<const CpuChunk*>(arg);
  CpuCall* call = chunk->call;
  {
    host_update::ScopedIeeeFloatingPoint ieee;
    HostUpdateParams p;
    ChunkParams(*call, chunk->slot, chunk->lo, chunk->hi, &p);
    if (call->plan_ready.load(std::memory_order_acquire)) {
      host_update::RunCpuPlan(p, call->plan, 0, p.n);
    } else {
      // Unreachable: the stream waited for the event recorded after BuildPlanHostFn. Kept so
      // that a broken ordering cannot read a half-built plan.
      host_update::CpuPlan plan;
      host_update::BuildCpuPlan(p, &plan);
      host_update::RunCpuPlan(p, plan, 0, p.n);
    }
  }
  Release(call);
}

// A rows call, whole: the scalars copied out of the shared staging, the plan built, then the
// picked rows updated on the CPU thread pool.
void CUDART_CB RowsHostFn(void* arg) {
  CpuCall* call = static_cast<CpuCall*>(arg);
  HostUpdateParams p = call->params;
  for (int i = 0; i < p.num_operands; ++i) {
    if (!p.operand_scalar[i]) continue;
    memcpy(call->scalar_copy[i], call->scalar_src[i],
           static_cast<size_t>(host_update::StorageBytes(p.operand_type[i])));
    p.operands[i] = call->scalar_copy[i];
  }
  {
    host_update::ScopedIeeeFloatingPoint ieee;
    host_update::BuildCpuPlan(p, &call->plan);
    host_update::RunCpuPlanRows(p, call->plan, call->row_length, call->rows, call->ids,
                                call->num_ids, call->zero, call->zero_type);
  }
  Release(call);
}

ffi::Error EnqueueHostFn(cudaStream_t stream, cudaHostFn_t fn, void* arg) {
  JT_CUDA_CHECK(kOpName, cudaLaunchHostFunc(stream, fn, arg), "");
  return ffi::Error::Success();
}

// Enqueues fn(arg), a host function that releases a reference to `call` when it has run.
ffi::Error LaunchHostFn(cudaStream_t stream, cudaHostFn_t fn, void* arg, CpuCall* call) {
  call->refs.fetch_add(1, std::memory_order_relaxed);  // before: fn may run at once
  ffi::Error error = EnqueueHostFn(stream, fn, arg);
  if (error.failure()) {
    call->refs.fetch_sub(1, std::memory_order_relaxed);  // fn never runs; the handler holds one
  }
  return error;
}

ffi::Error IsDeviceMemory(const void* ptr, const std::string& where, bool* on_device) {
  cudaPointerAttributes attr;
  JT_CUDA_CHECK(kOpName, cudaPointerGetAttributes(&attr, ptr), where);
  // Host (pinned), unregistered (pageable) and managed memory are all readable by the CPU.
  *on_device = attr.type == cudaMemoryTypeDevice;
  return ffi::Error::Success();
}

// Enqueues the CPU executor over elements [lo, hi) of `params` (lo < hi) on `dev`'s streams.
// The caller holds dev->mu and has recorded dev->start on `xla_stream` where the CPU part may
// begin; on success `xla_stream` waits for the CPU part, unless `deferred` (a layer call: the
// streams are shared with the other layer calls, and a join waits). Deferred calls pipeline
// one after another: stream s always stages through the same fixed region of the staging
// buffer (so its calls reuse it in stream order), and the scalars are copied out of the shared
// scalar area by the plan's host function, before the next call's stream 0 writes it.
ffi::Error EnqueueCpuRange(cudaStream_t xla_stream, int64_t chunk_bytes, DeviceResources* dev,
                           const HostUpdateParams& params, const int32_t* aliases,
                           int64_t lo, int64_t hi, bool deferred) {
  using host_update::StorageBytes;
  auto owned = std::make_unique<CpuCall>();
  CpuCall* call = owned.get();
  call->params = params;
  const int num_operands = params.num_operands;
  const int num_results = params.num_results;

  // Where each buffer lives, asked once per call.
  bool operand_on_device[host_update::kMaxOperands] = {};
  bool result_on_device[host_update::kMaxResults] = {};
  for (int i = 0; i < num_operands; ++i) {
    JT_RETURN_IF_ERROR(IsDeviceMemory(params.operands[i], "input " + std::to_string(i),
                                      &operand_on_device[i]));
  }
  for (int r = 0; r < num_results; ++r) {
    JT_RETURN_IF_ERROR(IsDeviceMemory(params.results[r], "result " + std::to_string(r),
                                      &result_on_device[r]));
  }

  // Staging layout. A staged result that aliases a staged vector operand shares its region
  // (copied down, updated in place, copied up); any other staged result has its own (copied up
  // only: the program stores every result).
  int64_t bytes_per_element = 0;
  bool any_device_scalar = false;
  for (int i = 0; i < num_operands; ++i) {
    call->operand_offset[i] = -1;
    if (!operand_on_device[i]) continue;
    if (params.operand_scalar[i]) {
      any_device_scalar = true;
    } else {
      bytes_per_element += StorageBytes(params.operand_type[i]);
    }
  }
  auto shares_operand_region = [&](int r) {
    const int32_t a = aliases[r];
    return a >= 0 && operand_on_device[a] && !params.operand_scalar[a];
  };
  for (int r = 0; r < num_results; ++r) {
    call->result_offset[r] = -1;
    if (result_on_device[r] && !shares_operand_region(r)) {
      bytes_per_element += StorageBytes(params.result_type[r]);
    }
  }
  const int64_t n = hi - lo;
  int64_t chunk = n;
  if (bytes_per_element > 0) {
    chunk = std::max(kChunkAlignElements,
                     chunk_bytes / bytes_per_element / kChunkAlignElements * kChunkAlignElements);
    chunk = std::min(chunk, n);
  }
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int num_streams = static_cast<int>(std::min<int64_t>(kNumStreams, num_chunks));
  int64_t slot_bytes = 0;
  for (int i = 0; i < num_operands; ++i) {
    if (operand_on_device[i] && !params.operand_scalar[i]) {
      call->operand_offset[i] = slot_bytes;
      slot_bytes += AlignUp(chunk * StorageBytes(params.operand_type[i]), kRegionAlignBytes);
    }
  }
  for (int r = 0; r < num_results; ++r) {
    if (!result_on_device[r]) continue;
    if (shares_operand_region(r)) {
      call->result_offset[r] = call->operand_offset[aliases[r]];
    } else {
      call->result_offset[r] = slot_bytes;
      slot_bytes += AlignUp(chunk * StorageBytes(params.result_type[r]), kRegionAlignBytes);
    }
  }
  int64_t scalar_bytes = any_device_scalar ? kScalarAreaBytes : 0;
  int64_t region = slot_bytes;
  if (deferred) {
    // Fixed: every chunk's slot fits (chunk * bytes per element, plus each buffer's alignment).
    scalar_bytes = kScalarAreaBytes;
    region = AlignUp(chunk_bytes + (host_update::kMaxOperands + host_update::kMaxResults) *
                                       kRegionAlignBytes,
                     kRegionAlignBytes);
    if (slot_bytes > region) {
      return Internal(kLayerOpName, "a chunk's staging (" + std::to_string(slot_bytes) +
                                        " bytes) is over the fixed region of " +
                                        std::to_string(region));
    }
  }
  if (slot_bytes > 0 || scalar_bytes > 0) {
    JT_RETURN_IF_ERROR(
        dev->EnsureStaging(scalar_bytes + (deferred ? kNumStreams : num_streams) * region));
  }
  for (int s = 0; s < num_streams; ++s) {
    call->slot_base[s] = dev->staging + scalar_bytes + s * region;
  }
  call->chunks.resize(static_cast<size_t>(num_chunks));
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = lo + c * chunk;
    call->chunks[c] = CpuChunk{call, static_cast<int>(c % num_streams), begin,
                               std::min(hi, begin + chunk)};
  }

  // From here on host functions hold references; the handler drops its own when it returns.
  struct HandlerRef {
    CpuCall* call;
    ~HandlerRef() { Release(call); }
  } handler_ref{owned.release()};

  for (int s = 0; s < num_streams; ++s) {
    JT_CUDA_CHECK(kOpName, cudaStreamWaitEvent(dev->streams[s], dev->start, 0),
                  "jaxtier stream on XLA's stream");
  }
  // Scalars first (stream 0), then the plan, which reads them.
  for (int i = 0; i < num_operands; ++i) {
    if (!params.operand_scalar[i]) continue;
    if (operand_on_device[i]) {
      char* dst = dev->staging + i * kScalarSlotBytes;
      JT_CUDA_CHECK(kOpName,
                    cudaMemcpyAsync(dst, params.operands[i], StorageBytes(params.operand_type[i]),
                                    cudaMemcpyDeviceToHost, dev->streams[0]),
                    "scalar input " + std::to_string(i) + " to pinned staging");
      call->scalar_src[i] = dst;
    } else {
      call->scalar_src[i] = params.operands[i];
    }
  }
  JT_RETURN_IF_ERROR(LaunchHostFn(dev->streams[0], BuildPlanHostFn, call, call));
  JT_CUDA_CHECK(kOpName, cudaEventRecord(dev->ready, dev->streams[0]), "the CPU plan is built");

  // Operands the program reads (a target it only writes, as a bf16 param made from its master,
  // is not copied down).
  bool loaded[host_update::kMaxOperands] = {};
  for (int k = 0; k < params.num_instructions; ++k) {
    if (params.instructions[k].op == host_update::kLoad) loaded[params.instructions[k].a] = true;
  }
  for (int64_t c = 0; c < num_chunks; ++c) {
    CpuChunk* chunk_desc = &call->chunks[c];
    const cudaStream_t stream = dev->streams[chunk_desc->slot];
    char* slot = call->slot_base[chunk_desc->slot];
    const int64_t len = chunk_desc->hi - chunk_desc->lo;
    for (int i = 0; i < num_operands; ++i) {
      if (call->operand_offset[i] < 0 || !loaded[i]) continue;
      const int64_t es = StorageBytes(params.operand_type[i]);
      JT_CUDA_CHECK(kOpName,
                    cudaMemcpyAsync(slot + call->operand_offset[i],
                                    static_cast<const char*>(params.operands[i]) +
                                        chunk_desc->lo * es,
                                    static_cast<size_t>(len * es), cudaMemcpyDeviceToHost, stream),
                    "input " + std::to_string(i) + " to pinned staging");
    }
    if (c > 0 && c < num_streams) {
      JT_CUDA_CHECK(kOpName, cudaStreamWaitEvent(stream, dev->ready, 0), "for the CPU plan");
    }
    JT_RETURN_IF_ERROR(LaunchHostFn(stream, RunChunkHostFn, chunk_desc, call));
    for (int r = 0; r < num_results; ++r) {
      if (call->result_offset[r] < 0) continue;
      const int64_t es = StorageBytes(params.result_type[r]);
      JT_CUDA_CHECK(kOpName,
                    cudaMemcpyAsync(static_cast<char*>(params.results[r]) + chunk_desc->lo * es,
                                    slot + call->result_offset[r], static_cast<size_t>(len * es),
                                    cudaMemcpyHostToDevice, stream),
                    "result " + std::to_string(r) + " from pinned staging");
    }
  }
  for (int s = 0; s < num_streams; ++s) {
    JT_CUDA_CHECK(kOpName, cudaEventRecord(dev->done[s], dev->streams[s]),
                  "the end of a jaxtier stream's part");
    if (deferred) continue;
    JT_CUDA_CHECK(kOpName, cudaStreamWaitEvent(xla_stream, dev->done[s], 0),
                  "XLA's stream on a jaxtier stream");
  }
  return ffi::Error::Success();
}

// Enqueues a rows call (op_program.h, LayerAttrs::rows) on stream 0 of `dev`'s streams, deferred
// like a layer call (a join waits): the ids come down into stream 0's fixed staging region (or
// are read in place from host memory), the scalars into the shared scalar area, then one host
// function runs the call. Every vector operand must be host memory: the CPUs update the picked
// rows in place, and nothing is staged but the ids and scalars. The caller holds dev->mu and has
// recorded dev->start on XLA's stream.
ffi::Error EnqueueCpuRows(int64_t chunk_bytes, DeviceResources* dev,
                          const HostUpdateParams& params, const host_update::LayerAttrs& a,
                          const host_update::LayerRows& rows) {
  using host_update::StorageBytes;
  for (int i = 0; i < params.num_operands; ++i) {
    if (params.operand_scalar[i]) continue;
    bool on_device = false;
    JT_RETURN_IF_ERROR(IsDeviceMemory(params.operands[i], "input " + std::to_string(i),
                                      &on_device));
    if (on_device) {
      return Invalid(kLayerOpName, "memory", "input " + std::to_string(i),
                     "host memory (memory kind pinned_host: a rows call updates a host table "
                     "and its state in place)",
                     "device memory");
    }
  }
  const int64_t region = AlignUp(
      chunk_bytes + (host_update::kMaxOperands + host_update::kMaxResults) * kRegionAlignBytes,
      kRegionAlignBytes);
  const int64_t ids_bytes = rows.num_ids * 4;
  bool ids_on_device = false;
  if (rows.num_ids > 0) {
    JT_RETURN_IF_ERROR(IsDeviceMemory(rows.ids, "the ids", &ids_on_device));
  }
  if (ids_on_device && ids_bytes > region) {
    return Invalid(kLayerOpName, "size", "the ids",
                   "at most " + std::to_string(region / 4) +
                       " ids (the staging region; JAXTIER_HOST_CPU_CHUNK_BYTES sets it)",
                   std::to_string(rows.num_ids));
  }
  JT_RETURN_IF_ERROR(dev->EnsureStaging(kScalarAreaBytes + kNumStreams * region));
  auto owned = std::make_unique<CpuCall>();
  CpuCall* call = owned.get();
  call->params = params;
  call->rows = a.rows;
  call->row_length = a.row_length;
  call->num_ids = rows.num_ids;
  call->zero = const_cast<void*>(rows.zero_base);
  call->zero_type = a.zero_operand >= 0 ? params.operand_type[a.zero_operand] : 0;
  struct HandlerRef {
    CpuCall* call;
    ~HandlerRef() { Release(call); }
  } handler_ref{owned.release()};

  const cudaStream_t stream = dev->streams[0];
  JT_CUDA_CHECK(kLayerOpName, cudaStreamWaitEvent(stream, dev->start, 0),
                "jaxtier stream on XLA's stream");
  for (int i = 0; i < params.num_operands; ++i) {
    if (!params.operand_scalar[i]) continue;
    bool on_device = false;
    JT_RETURN_IF_ERROR(IsDeviceMemory(params.operands[i], "input " + std::to_string(i),
                                      &on_device));
    if (!on_device) {
      call->scalar_src[i] = params.operands[i];
      continue;
    }
    char* dst = dev->staging + i * kScalarSlotBytes;
    JT_CUDA_CHECK(kLayerOpName,
                  cudaMemcpyAsync(dst, params.operands[i], StorageBytes(params.operand_type[i]),
                                  cudaMemcpyDeviceToHost, stream),
                  "scalar input " + std::to_string(i) + " to pinned staging");
    call->scalar_src[i] = dst;
  }
  call->ids = rows.ids;
  if (ids_on_device) {
    char* dst = dev->staging + kScalarAreaBytes;  // stream 0's region
    JT_CUDA_CHECK(kLayerOpName,
                  cudaMemcpyAsync(dst, rows.ids, static_cast<size_t>(ids_bytes),
                                  cudaMemcpyDeviceToHost, stream),
                  "the ids to pinned staging");
    call->ids = reinterpret_cast<const int32_t*>(dst);
  }
  JT_RETURN_IF_ERROR(LaunchHostFn(stream, RowsHostFn, call, call));
  JT_CUDA_CHECK(kLayerOpName, cudaEventRecord(dev->done[0], stream),
                "the end of a jaxtier stream's part");
  return ffi::Error::Success();
}

// Elements [0, k) go to the kernel: k = dha_fraction * n rounded to a multiple of 256, in [0, n].
int64_t SplitPoint(int64_t n, float dha_fraction) {
  const double blocks = std::nearbyint(static_cast<double>(dha_fraction) * static_cast<double>(n) /
                                       static_cast<double>(host_update::kSplitAlignElements));
  const int64_t k = static_cast<int64_t>(blocks) * host_update::kSplitAlignElements;
  return std::min(std::max<int64_t>(k, 0), n);
}

ffi::ErrorOr<std::unique_ptr<HostUpdateState>> HostUpdateCudaInstantiateImpl(
    ffi::Dictionary attrs) {
  host_update::HostUpdateAttrs a;
  if (ffi::Error e = host_update::DecodeHostUpdateAttrs(attrs, &a); e.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  auto state = std::make_unique<HostUpdateState>();
  state->executor = a.executor;
  if (ffi::Error e = ChunkBytesFromEnv(kOpName, kMinChunkBytes, &state->chunk_bytes);
      e.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  return ffi::ErrorOr<std::unique_ptr<HostUpdateState>>(std::move(state));
}

ffi::Error HostUpdateCudaImpl(cudaStream_t stream, HostUpdateState* state,
                              ffi::RemainingArgs args, ffi::RemainingRets rets,
                              ffi::Dictionary attrs) {
  host_update::HostUpdateAttrs a;
  HostUpdateParams params;
  JT_RETURN_IF_ERROR(host_update::DecodeAndPrepare(args, rets, attrs, &a, &params));
  if (params.n == 0 || params.num_instructions == 0) return ffi::Error::Success();

  int64_t k = params.n;  // the kernel's share: [0, k)
  if (a.executor == host_update::kExecutorHostCpu) k = 0;
  if (a.executor == host_update::kExecutorSplit) k = SplitPoint(params.n, a.dha_fraction);
  if (k == params.n) return LaunchKernel(stream, params);

  int device = 0;
  JT_CUDA_CHECK(kOpName, cudaGetDevice(&device), "");
  DeviceResources* dev = nullptr;
  JT_RETURN_IF_ERROR(state->Resources(device, &dev));
  std::lock_guard<std::mutex> lock(dev->mu);
  // Recorded before the kernel: the CPU part does not wait for it.
  JT_CUDA_CHECK(kOpName, cudaEventRecord(dev->start, stream), "the start of the call");
  if (k > 0) {
    HostUpdateParams head = params;
    head.n = k;
    JT_RETURN_IF_ERROR(LaunchKernel(stream, head));
  }
  return EnqueueCpuRange(stream, state->chunk_bytes, dev, params, a.aliases.begin(), k, params.n,
                         /*deferred=*/false);
}

// ------------------------------------------------------------------------------------------------
// Layer calls and the join (op_program.h): one set of streams and staging per device, shared by
// every layer call of the process; never freed (layer calls of any executable may use them).
// ------------------------------------------------------------------------------------------------

// At least 1 MiB for layer calls: a chunk of 4096 elements of every buffer then fits the fixed
// region each stream stages through.
constexpr int64_t kMinLayerChunkBytes = int64_t{1} << 20;

std::mutex g_shared_mu;
DeviceResources* g_shared[kMaxDevices] = {};

// This device's shared resources (created on first use when `create`; else may be null).
ffi::Error SharedResources(int device, bool create, DeviceResources** out) {
  if (device < 0 || device >= kMaxDevices) {
    return Internal(kOpName, "device ordinal " + std::to_string(device) + " out of range");
  }
  std::lock_guard<std::mutex> lock(g_shared_mu);
  if (g_shared[device] == nullptr && create) {
    auto r = std::make_unique<DeviceResources>(device);
    JT_RETURN_IF_ERROR(r->Init());
    g_shared[device] = r.release();
  }
  *out = g_shared[device];
  return ffi::Error::Success();
}

// Records, for the release, that this layer call reads its values of `count` elements that it
// does not write (a layer's gradient slice): events after its kernel part and its CPU part.
ffi::Error RecordReads(ffi::RemainingArgs args, const host_update::LayerAttrs& a, bool kernel,
                       bool cpu, DeviceResources* dev) {
  if (a.count <= 1) return ffi::Error::Success();
  std::vector<const void*> values;
  for (int32_t i = 0; i < a.num_operands; ++i) {
    bool written = false;
    for (int32_t t : a.targets) written = written || t == i;
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (written || !buf.has_value() || static_cast<int64_t>(buf->element_count()) != a.count) {
      continue;
    }
    values.push_back(buf->untyped_data());
  }
  if (values.empty()) return ffi::Error::Success();
  auto read = std::make_shared<ReadEvents>();
  std::vector<cudaStream_t> streams;
  if (kernel) streams.push_back(dev->kernel_stream);
  if (cpu) streams.insert(streams.end(), dev->streams, dev->streams + kNumStreams);
  for (cudaStream_t s : streams) {
    cudaEvent_t e = nullptr;
    JT_CUDA_CHECK(kLayerOpName, cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                  "an event for the release of the call's values");
    read->events.push_back(e);
    JT_CUDA_CHECK(kLayerOpName, cudaEventRecord(e, s), "the end of the call's reads");
  }
  for (const void* v : values) dev->reads[v].push_back(read);
  return ffi::Error::Success();
}

ffi::Error HostUpdateLayerCudaImpl(cudaStream_t stream, ffi::RemainingArgs args,
                                   ffi::RemainingRets rets, ffi::Dictionary attrs) {
  host_update::LayerAttrs a;
  HostUpdateParams params;
  int32_t aliases[host_update::kMaxResults];
  host_update::LayerRows rows;
  JT_RETURN_IF_ERROR(
      host_update::DecodeAndPrepareLayer(args, rets, attrs, &a, &params, aliases, &rows));
  if (params.n == 0 || params.num_instructions == 0) return ffi::Error::Success();
  if (a.rows != host_update::kWindow) {
    if (a.base.executor != host_update::kExecutorHostCpu) {
      return Invalid(kLayerOpName, "value", "attribute executor",
                     "1 (host_cpu): a rows call runs on the host CPUs",
                     std::to_string(a.base.executor));
    }
    int device = 0;
    JT_CUDA_CHECK(kLayerOpName, cudaGetDevice(&device), "");
    DeviceResources* dev = nullptr;
    JT_RETURN_IF_ERROR(SharedResources(device, /*create=*/true, &dev));
    int64_t chunk_bytes = 0;
    JT_RETURN_IF_ERROR(ChunkBytesFromEnv(kLayerOpName, kMinLayerChunkBytes, &chunk_bytes));
    std::lock_guard<std::mutex> lock(dev->mu);
    JT_CUDA_CHECK(kLayerOpName, cudaEventRecord(dev->start, stream), "the start of the call");
    return EnqueueCpuRows(chunk_bytes, dev, params, a, rows);
  }
  int64_t k = params.n;  // the kernel's share: [0, k)
  if (a.base.executor == host_update::kExecutorHostCpu) k = 0;
  if (a.base.executor == host_update::kExecutorSplit) k = SplitPoint(params.n, a.base.dha_fraction);
  int device = 0;
  JT_CUDA_CHECK(kLayerOpName, cudaGetDevice(&device), "");
  DeviceResources* dev = nullptr;
  JT_RETURN_IF_ERROR(SharedResources(device, /*create=*/true, &dev));
  std::lock_guard<std::mutex> lock(dev->mu);
  JT_CUDA_CHECK(kLayerOpName, cudaEventRecord(dev->start, stream), "the start of the call");
  if (k > 0) {
    // The kernel on the low-priority stream: after XLA's stream reaches the call and after the
    // previous layer call's kernel.
    JT_CUDA_CHECK(kLayerOpName, cudaStreamWaitEvent(dev->kernel_stream, dev->start, 0), "");
    HostUpdateParams head = params;
    head.n = k;
    JT_RETURN_IF_ERROR(LaunchKernel(dev->kernel_stream, head, a.dha_grid));
    JT_CUDA_CHECK(kLayerOpName, cudaEventRecord(dev->kernel_done, dev->kernel_stream),
                  "the end of the kernel part");
  }
  if (k < params.n) {
    int64_t chunk_bytes = 0;
    JT_RETURN_IF_ERROR(ChunkBytesFromEnv(kLayerOpName, kMinLayerChunkBytes, &chunk_bytes));
    JT_RETURN_IF_ERROR(EnqueueCpuRange(stream, chunk_bytes, dev, params, aliases, k, params.n,
                                       /*deferred=*/true));
  }
  return RecordReads(args, a, k > 0, k < params.n, dev);
}

ffi::Error HostUpdateJoinCudaImpl(cudaStream_t stream, ffi::RemainingArgs args,
                                  ffi::RemainingRets rets) {
  JT_RETURN_IF_ERROR(host_update::PrepareJoin(args, rets));
  int device = 0;
  JT_CUDA_CHECK(kJoinOpName, cudaGetDevice(&device), "");
  DeviceResources* dev = nullptr;
  JT_RETURN_IF_ERROR(SharedResources(device, /*create=*/false, &dev));
  if (dev == nullptr) return ffi::Error::Success();  // no layer call has run on this device
  std::lock_guard<std::mutex> lock(dev->mu);
  for (cudaEvent_t e : {dev->done[0], dev->done[1], dev->done[2], dev->kernel_done}) {
    JT_CUDA_CHECK(kJoinOpName, cudaStreamWaitEvent(stream, e, 0),
                  "XLA's stream on the layer calls' streams");
  }
  dev->reads.clear();  // every read is waited for
  return ffi::Error::Success();
}

ffi::Error HostUpdateReleaseCudaImpl(cudaStream_t stream, ffi::RemainingArgs args,
                                     ffi::RemainingRets rets, int32_t num_values) {
  JT_RETURN_IF_ERROR(host_update::PrepareRelease(args, rets, num_values));
  int device = 0;
  JT_CUDA_CHECK(kReleaseOpName, cudaGetDevice(&device), "");
  DeviceResources* dev = nullptr;
  JT_RETURN_IF_ERROR(SharedResources(device, /*create=*/false, &dev));
  if (dev == nullptr) return ffi::Error::Success();  // no layer call has run on this device
  std::lock_guard<std::mutex> lock(dev->mu);
  for (int32_t i = 0; i < num_values; ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (!buf.has_value()) {
      return Invalid(kReleaseOpName, "input", "input " + std::to_string(i), "an array",
                     "another operand");
    }
    auto it = dev->reads.find(buf->untyped_data());
    if (it == dev->reads.end()) continue;  // no layer call read it since the last join
    for (const auto& read : it->second) {
      for (cudaEvent_t e : read->events) {
        JT_CUDA_CHECK(kReleaseOpName, cudaStreamWaitEvent(stream, e, 0),
                      "XLA's stream on the reads of input " + std::to_string(i));
      }
    }
    dev->reads.erase(it);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_TypeId* HostUpdateCudaStateTypeId() { return &HostUpdateState::id; }

const XLA_FFI_TypeInfo* HostUpdateCudaStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = {XLA_FFI_TypeInfo_STRUCT_SIZE, nullptr,
                                        &DeleteHostUpdateState};
  return &info;
}

// Attributes are decoded as a dictionary (DecodeHostUpdateAttrs): `executor` and `dha_fraction`
// may be absent. Not kCmdBufferCompatible: host_cpu / split use their own streams, host functions
// and event waits, and the DHA path's behaviour under XLA's command-buffer (CUDA graph) capture,
// with pinned_host operands whose addresses change between steps, has not been verified.
XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateCudaInstantiate, HostUpdateCudaInstantiateImpl,
                              ffi::Ffi::BindInstantiate()
                                  .Attrs<ffi::Dictionary>());  // the attributes

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateLayerCuda, HostUpdateLayerCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .RemainingArgs()             // operands, then order-only
                                  .RemainingRets()             // the token
                                  .Attrs<ffi::Dictionary>());  // as DecodeLayerAttrs

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateJoinCuda, HostUpdateJoinCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .RemainingArgs()    // pass-through arrays, then order-only
                                  .RemainingRets());  // the arrays, aliased

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateReleaseCuda, HostUpdateReleaseCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .RemainingArgs()                // values, then order-only
                                  .RemainingRets()                // the token
                                  .Attr<int32_t>("num_values"));  // num_values

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateCuda, HostUpdateCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<ffi::State<HostUpdateState>>()        // state
                                  .RemainingArgs()                           // operands
                                  .RemainingRets()                           // results
                                  .Attrs<ffi::Dictionary>());  // program, consts, num_regs,
                                                               // aliases, executor, dha_fraction

}  // namespace jaxtier
