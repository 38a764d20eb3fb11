// CUDA handlers of the DHA compute family (dha.h, docs/design.md "DHA compute"): GPU kernels
// that read a host-resident (pinned_host) table or weight in place over PCIe, with no copy to
// HBM. Every other buffer (ids, x, y) is in device memory. Nothing here asks where the host
// operand lives: a device-resident one works the same, only faster.
//
// gather (jaxtier_dha_gather_ffi): one warp per output row (grid-stride over the ids); the warp
// copies the row with 16-byte loads when the row length and both base pointers allow it (else
// 4- or 2-byte ones), four loads in flight per lane before the stores. An id outside [0, V)
// writes zeros and reads nothing.
//
// matmul (jaxtier_dha_matmul_ffi): y[M, O] = x[M, R] @ B, B = w[index] ([R, O]) or w[index]^T
// (w[index] is [O, R]). A block owns O-columns [o0, o0 + BO), x-rows [m0, m0 + MT) and a range of
// R-stages (BR reduction rows each; split-R over blockIdx.y). Each stage:
//   * the block's BR x BO tile of B arrives from host memory in 16-byte loads (128-byte runs
//     along w's rows), issued one stage ahead into registers so that they are in flight while
//     the block computes on the previous stage, then stored to shared memory (transposed for
//     transpose = 1);
//   * the x tile [MT, BR] comes from device memory (L2) into shared memory as fp32;
//   * each thread accumulates an RM x 8 tile of y in fp32 registers (fmaf).
// Every element of w[index] is read from host memory once when M <= 512 (MT = 512 at most);
// a larger M is cut into chunks of 512 rows, each of which reads w again. With more than one
// R-split, each split writes fp32 partial sums to the call's second result [S, M, O] (allocated
// by XLA like any result; Python chooses S from the shapes and the SM count,
// dha.matmul_partial_shape, and drops the result) and a second kernel adds them in split order
// (deterministic) and rounds to y's dtype; with none (a result without elements), the kernel
// writes y directly. (XLA's FFI ScratchAllocator is not used: on jax 0.11.2 / CUDA it failed
// every allocation, even of 100 KB.)
//
// scatter_add (jaxtier_dha_scatter_add_ffi): buffer = 0, buffer[ids[n]] += rows[n], written in
// place into a donated pinned_host buffer by the host CPUs, never by the GPU: zeroing a 2 GB
// buffer over PCIe would alone take ~40 ms of the link, and host memory writes at host DRAM
// speed. No kernel runs. The handler only enqueues, on two streams of its own:
//   copy stream  ids[lo, hi) and rows[lo, hi) of chunk c to pinned staging slot c % 2 (copy
//                engine, cudaMemcpyAsync), after the host has finished with chunk c - 2 there;
//   host stream  host functions (cudaLaunchHostFunc, no CUDA call inside), on jaxtier's CPU
//                thread pool: zero an f32 buffer (ScatterAddBegin, dha.cc, while the first two
//                chunks are copied), then per chunk, once its copy is done, add it into the
//                buffer or a bf16 buffer's fp32 sums (ScatterAddChunk), then write a bf16
//                buffer once, whole: sums rounded, zeros elsewhere (ScatterAddEnd). With
//                attribute `zeroed` (a buffer its caller keeps zero) nothing is zeroed and a
//                bf16 buffer gets only the rows of its ids.
// Ordering: both streams wait for an event recorded on XLA's stream at the call (the ids and
// rows are written, earlier readers of the buffer are done); XLA's stream waits for an event
// recorded on the host stream after the last host function, so all later work on it sees the
// finished buffer, and the next call (whose streams wait for XLA's stream) never finds staging
// or scratch in use. Pinned staging: two slots of at most JAXTIER_DHA_SCATTER_CHUNK_BYTES
// (default 16 MiB, so 32 MiB; a slot grows to one id and one row when a row is larger, and is
// smaller when all the ids and rows of a call fit in less), per call site (FFI state, made by
// the instantiate stage) and device, allocated on first use, grown only, freed with the
// executable. A bf16 buffer's fp32 sums (dha.h, ScatterAddScratch) live beside it.
//
// No handler here is marked kCmdBufferCompatible: the behaviour of gather and matmul under
// XLA's command-buffer (CUDA graph) capture with pinned_host operands has not been verified,
// and scatter_add uses its own streams, event waits and host functions.
// No nanobind here: module.cc registers the symbols.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dha.h"
#include "ffi_helpers.h"
#include "handlers.h"
#include "op_program.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtier {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

ffi::Error NumSms(const char* op, int* num_sms) {
  int device = 0;
  JT_CUDA_CHECK(op, cudaGetDevice(&device), "");
  JT_CUDA_CHECK(op, cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device),
                "the SM count of device " + std::to_string(device));
  if (*num_sms < 1) *num_sms = 1;
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------------
// gather
// ------------------------------------------------------------------------------------------------

constexpr int kGatherThreads = 256;
constexpr int kGatherWarps = kGatherThreads / 32;
constexpr int kGatherUnroll = 4;

// V: the load unit (uint4: 16 bytes, uint32_t, uint16_t); row_vecs: units per row.
template <typename V>
__global__ void __launch_bounds__(kGatherThreads)
    DhaGatherKernel(const V* __restrict__ table, const int32_t* __restrict__ ids,
                    V* __restrict__ out, int64_t num_ids, int64_t num_rows, int64_t row_vecs) {
  const int lane = threadIdx.x % 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kGatherWarps;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kGatherWarps + threadIdx.x / 32;
       i < num_ids; i += num_warps) {
    const int32_t id = ids[i];
    V* dst = out + i * row_vecs;
    if (id < 0 || id >= num_rows) {
      for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = V{};
      continue;
    }
    const V* src = table + static_cast<int64_t>(id) * row_vecs;
    int64_t v = lane;
    for (; v + (kGatherUnroll - 1) * 32 < row_vecs; v += kGatherUnroll * 32) {
      V buf[kGatherUnroll];
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) buf[u] = src[v + u * 32];
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) dst[v + u * 32] = buf[u];
    }
    for (; v < row_vecs; v += 32) dst[v] = src[v];
  }
}

template <typename V>
ffi::Error LaunchGather(cudaStream_t stream, const void* table, const int32_t* ids, void* out,
                        const dha::GatherShape& s, int num_sms) {
  const int64_t blocks =
      std::min<int64_t>(CeilDiv(s.num_ids, kGatherWarps), int64_t{num_sms} * 16);
  DhaGatherKernel<V><<<static_cast<unsigned>(blocks), kGatherThreads, 0, stream>>>(
      static_cast<const V*>(table), ids, static_cast<V*>(out), s.num_ids, s.num_rows,
      s.row_bytes / static_cast<int64_t>(sizeof(V)));
  JT_CUDA_CHECK(dha::kGatherName, cudaGetLastError(), "launch of DhaGatherKernel");
  return ffi::Error::Success();
}

ffi::Error DhaGatherCudaImpl(cudaStream_t stream, ffi::AnyBuffer table,
                             ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out) {
  dha::GatherShape s;
  JT_RETURN_IF_ERROR(dha::CheckGather(table, ids, *out, &s));
  if (s.num_ids == 0 || s.row_bytes == 0) return ffi::Error::Success();
  int num_sms = 1;
  JT_RETURN_IF_ERROR(NumSms(dha::kGatherName, &num_sms));
  const void* src = table.untyped_data();
  void* dst = out->untyped_data();
  const uintptr_t bases = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  if (s.row_bytes % 16 == 0 && bases % 16 == 0) {
    return LaunchGather<uint4>(stream, src, ids.typed_data(), dst, s, num_sms);
  }
  if (s.row_bytes % 4 == 0 && bases % 4 == 0) {
    return LaunchGather<uint32_t>(stream, src, ids.typed_data(), dst, s, num_sms);
  }
  return LaunchGather<uint16_t>(stream, src, ids.typed_data(), dst, s, num_sms);
}

// ------------------------------------------------------------------------------------------------
// matmul
// ------------------------------------------------------------------------------------------------

constexpr int kThreads = 256;
constexpr int kRN = 8;  // y columns per thread
constexpr int64_t kMaxGridY = 65535;  // gridDim.y: the split index

// Storage conversions. S is the raw storage type (uint32_t: f32 bits, uint16_t: bf16 bits).
template <typename S>
__device__ __forceinline__ float ToFloat(S v);
template <>
__device__ __forceinline__ float ToFloat<uint32_t>(uint32_t v) { return __uint_as_float(v); }
template <>
__device__ __forceinline__ float ToFloat<uint16_t>(uint16_t v) {
  return __uint_as_float(static_cast<uint32_t>(v) << 16);
}

template <typename S>
__device__ __forceinline__ S FromFloat(float f);
template <>
__device__ __forceinline__ uint32_t FromFloat<uint32_t>(float f) { return __float_as_uint(f); }
template <>
__device__ __forceinline__ uint16_t FromFloat<uint16_t>(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));  // round to nearest even
}

template <typename S>
union Pack16 {
  uint4 u;
  S e[16 / sizeof(S)];
};

struct MatmulArgs {
  const void* x;   // [M, R], device memory
  const void* w;   // layer `index` of w (host memory): [R, O] (transpose 0) or [O, R]
  void* y;         // [M, O], device memory (written when partial == nullptr)
  float* partial;  // [S, M, O] fp32 partial sums (the call's result 1), or nullptr
  int64_t m, r, o;
  int64_t stages_per_split;
  int vec_w;  // 1: w's rows and base allow 16-byte loads
};

// Tile shape of a kernel instance: kTX x kTY threads, each kRM rows x kRN columns of y.
template <typename S, int kTX, int kRM>
struct Tile {
  static constexpr int kTY = kThreads / kTX;
  static constexpr int kMT = kRM * kTY;                          // x rows per block
  static constexpr int kBO = kTX * kRN;                          // y columns per block
  static constexpr int kBR = 128 / static_cast<int>(sizeof(S));  // reduction rows per stage
  static constexpr int kVec = 16 / static_cast<int>(sizeof(S));  // elements per 16-byte load
  static constexpr int kLoads = kBR * kBO / kVec / kThreads;     // 16-byte w loads per thread
  static constexpr int kXPitch = kMT + 4;                        // floats per x-tile row
  static constexpr size_t kXBytes = size_t{kBR} * kXPitch * sizeof(float);
  static constexpr size_t kSmemBytes = kXBytes + size_t{kBR} * kBO * sizeof(S);
  static_assert(kLoads * kVec * kThreads == kBR * kBO, "w tile must split into 16-byte loads");
  static_assert((kMT * kBR) % kThreads == 0, "x tile must split evenly over the threads");
  static_assert(kXBytes % 16 == 0, "the w tile must start 16-byte aligned");
};

template <typename S, int kTX, int kRM, bool kTrans>
__global__ void __launch_bounds__(kThreads, 1)
    DhaMatmulKernel(const MatmulArgs a) {
  using Tl = Tile<S, kTX, kRM>;
  constexpr int kMT = Tl::kMT, kBO = Tl::kBO, kBR = Tl::kBR, kVec = Tl::kVec;
  constexpr int kLoads = Tl::kLoads, kXPitch = Tl::kXPitch;

  extern __shared__ __align__(16) unsigned char smem[];
  float* xs = reinterpret_cast<float*>(smem);         // [kBR][kXPitch]: x tile, transposed
  S* bs = reinterpret_cast<S*>(smem + Tl::kXBytes);   // [kBR][kBO]: B tile

  const int tid = threadIdx.x;
  const int tx = tid % kTX;
  const int ty = tid / kTX;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kBO;
  const int64_t m0 = static_cast<int64_t>(blockIdx.z) * kMT;
  const int64_t num_stages = (a.r + kBR - 1) / kBR;
  const int64_t s_begin = static_cast<int64_t>(blockIdx.y) * a.stages_per_split;
  const int64_t s_end = min(num_stages, s_begin + a.stages_per_split);
  const S* w = static_cast<const S*>(a.w);
  const S* x = static_cast<const S*>(a.x);
  // w's row length and row count: B[r, o] = w[r * o_len + o] or w[o * r_len + r].
  const int64_t row_len = kTrans ? a.r : a.o;
  const int64_t num_w_rows = kTrans ? a.o : a.r;

  uint4 wreg[kLoads];
  float acc[kRM][kRN];
#pragma unroll
  for (int i = 0; i < kRM; ++i) {
#pragma unroll
    for (int j = 0; j < kRN; ++j) acc[i][j] = 0.0f;
  }

  // Issues the host loads of stage `stage`'s B tile into wreg (zeros outside w).
  auto load_w = [&](int64_t stage) {
    const int64_t r0 = stage * kBR;
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int v = tid + j * kThreads;
      int64_t row, col;  // w element of the first of the kVec elements (along w's row)
      if (!kTrans) {
        row = r0 + v / (kBO / kVec);
        col = o0 + (v % (kBO / kVec)) * kVec;
      } else {
        row = o0 + v / (kBR / kVec);
        col = r0 + (v % (kBR / kVec)) * kVec;
      }
      Pack16<S> p;
      p.u = make_uint4(0u, 0u, 0u, 0u);
      if (row < num_w_rows && col < row_len) {
        const S* src = w + row * row_len + col;
        if (a.vec_w) {  // row_len % kVec == 0: the whole vector is inside the row
          p.u = *reinterpret_cast<const uint4*>(src);
        } else {
#pragma unroll
          for (int k = 0; k < kVec; ++k) p.e[k] = col + k < row_len ? src[k] : S(0);
        }
      }
      wreg[j] = p.u;
    }
  };

  // Stores wreg into the B tile bs[r][o].
  auto store_w = [&]() {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int v = tid + j * kThreads;
      if (!kTrans) {
        const int rr = v / (kBO / kVec);
        const int oo = (v % (kBO / kVec)) * kVec;
        *reinterpret_cast<uint4*>(bs + rr * kBO + oo) = wreg[j];
      } else {
        const int oo = v / (kBR / kVec);
        const int rr = (v % (kBR / kVec)) * kVec;
        Pack16<S> p;
        p.u = wreg[j];
#pragma unroll
        for (int k = 0; k < kVec; ++k) bs[(rr + k) * kBO + oo] = p.e[k];
      }
    }
  };

  // The x tile of stage `stage`, as fp32 (zeros outside x).
  auto load_x = [&](int64_t stage) {
    const int64_t r0 = stage * kBR;
#pragma unroll 4
    for (int e = tid; e < kMT * kBR; e += kThreads) {
      const int mm = e / kBR;
      const int rr = e % kBR;
      const int64_t gm = m0 + mm;
      const int64_t gr = r0 + rr;
      float v = 0.0f;
      if (gm < a.m && gr < a.r) v = ToFloat<S>(x[gm * a.r + gr]);
      xs[rr * kXPitch + mm] = v;
    }
  };

  auto compute = [&]() {
#pragma unroll 2
    for (int rr = 0; rr < kBR; ++rr) {
      float xv[kRM];
      const float* xp = xs + rr * kXPitch + ty * kRM;
      if constexpr (kRM % 4 == 0) {
#pragma unroll
        for (int i = 0; i < kRM; i += 4) {
          const float4 q = *reinterpret_cast<const float4*>(xp + i);
          xv[i] = q.x;
          xv[i + 1] = q.y;
          xv[i + 2] = q.z;
          xv[i + 3] = q.w;
        }
      } else {
#pragma unroll
        for (int i = 0; i < kRM; ++i) xv[i] = xp[i];
      }
      float wv[kRN];
      const S* bp = bs + rr * kBO + tx * kRN;
#pragma unroll
      for (int h = 0; h < kRN; h += kVec) {
        Pack16<S> p;
        p.u = *reinterpret_cast<const uint4*>(bp + h);
#pragma unroll
        for (int k = 0; k < kVec; ++k) wv[h + k] = ToFloat<S>(p.e[k]);
      }
#pragma unroll
      for (int i = 0; i < kRM; ++i) {
#pragma unroll
        for (int j = 0; j < kRN; ++j) acc[i][j] = fmaf(xv[i], wv[j], acc[i][j]);
      }
    }
  };

  if (s_begin < s_end) {
    load_w(s_begin);
    for (int64_t s = s_begin; s < s_end; ++s) {
      __syncthreads();  // the previous stage's compute is done with xs and bs
      store_w();
      load_x(s);
      __syncthreads();
      if (s + 1 < s_end) load_w(s + 1);  // in flight during this stage's compute
      compute();
    }
  }

#pragma unroll
  for (int i = 0; i < kRM; ++i) {
    const int64_t gm = m0 + ty * kRM + i;
    if (gm >= a.m) continue;
#pragma unroll
    for (int j = 0; j < kRN; ++j) {
      const int64_t go = o0 + tx * kRN + j;
      if (go >= a.o) continue;
      if (a.partial != nullptr) {
        a.partial[(static_cast<int64_t>(blockIdx.y) * a.m + gm) * a.o + go] = acc[i][j];
      } else {
        static_cast<S*>(a.y)[gm * a.o + go] = FromFloat<S>(acc[i][j]);
      }
    }
  }
}

// y = sum over the splits of partial[s] (in split order), rounded to y's dtype.
template <typename S>
__global__ void __launch_bounds__(kThreads)
    DhaReduceKernel(const float* __restrict__ partial, S* __restrict__ y, int64_t mo,
                    int64_t splits) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < mo;
       i += stride) {
    float sum = 0.0f;
    for (int64_t s = 0; s < splits; ++s) sum += partial[s * mo + i];
    y[i] = FromFloat<S>(sum);
  }
}

// `partial`: the [max_splits, M, O] fp32 result, or nullptr with max_splits == 1.
template <typename S, int kTX, int kRM, bool kTrans>
ffi::Error LaunchMatmul(cudaStream_t stream, const dha::MatmulShape& s, const void* x,
                        const void* w, void* y, float* partial, int64_t max_splits) {
  using Tl = Tile<S, kTX, kRM>;
  const char* op = dha::kMatmulName;
  const int64_t col_tiles = CeilDiv(s.o, Tl::kBO);
  const int64_t m_chunks = CeilDiv(s.m, Tl::kMT);
  const int64_t stages = CeilDiv(s.r, Tl::kBR);
  if (m_chunks > 65535 || col_tiles > 0x7fffffff) {
    return Invalid(op, "shape", "input 0 (x)",
                   "at most 65535 * " + std::to_string(Tl::kMT) + " rows and " +
                       std::to_string(int64_t{0x7fffffff} * Tl::kBO) + " columns",
                   "[" + std::to_string(s.m) + ", " + std::to_string(s.r) + "] -> " +
                       std::to_string(s.o) + " columns");
  }
  // The split of R over blockIdx.y: as many ranges of stages as the partial sums have rows
  // (Python sized them for about 4 blocks per SM), never more than there are stages.
  if (max_splits > kMaxGridY) {
    return Invalid(op, "shape", "result 1 (partial sums)",
                   "at most " + std::to_string(kMaxGridY) + " splits", std::to_string(max_splits));
  }
  const int64_t mo = s.m * s.o;
  int64_t splits = std::max<int64_t>(1, std::min<int64_t>(max_splits, stages));
  const int64_t stages_per_split = CeilDiv(stages, splits);
  splits = CeilDiv(stages, stages_per_split);  // no split without a stage; <= max_splits

  MatmulArgs args;
  args.x = x;
  args.w = w;
  args.y = y;
  args.partial = nullptr;
  args.m = s.m;
  args.r = s.r;
  args.o = s.o;
  args.stages_per_split = stages_per_split;
  const int64_t row_len = s.transpose ? s.r : s.o;
  args.vec_w = reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
               (row_len * int64_t{sizeof(S)}) % 16 == 0;
  if (splits > 1) args.partial = partial;  // rows [0, splits) of it
  auto kernel = DhaMatmulKernel<S, kTX, kRM, kTrans>;
  if (Tl::kSmemBytes > 48 * 1024) {
    JT_CUDA_CHECK(op,
                  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(Tl::kSmemBytes)),
                  std::to_string(Tl::kSmemBytes) + " bytes of shared memory for DhaMatmulKernel");
  }
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(splits),
                  static_cast<unsigned>(m_chunks));
  kernel<<<grid, kThreads, Tl::kSmemBytes, stream>>>(args);
  JT_CUDA_CHECK(op, cudaGetLastError(), "launch of DhaMatmulKernel");
  if (splits > 1) {
    int num_sms = 1;
    JT_RETURN_IF_ERROR(NumSms(op, &num_sms));
    const int64_t blocks = std::min<int64_t>(CeilDiv(mo, kThreads), int64_t{num_sms} * 8);
    DhaReduceKernel<S><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        args.partial, static_cast<S*>(y), mo, splits);
    JT_CUDA_CHECK(op, cudaGetLastError(), "launch of DhaReduceKernel");
  }
  return ffi::Error::Success();
}

// Picks the tile for M (rows of y per block up to 512) and the layout of w.
// Keep this table in step with dha.py's _MATMUL_TILES (it sizes the partial sums from it).
template <typename S, bool kTrans>
ffi::Error DispatchTile(cudaStream_t stream, const dha::MatmulShape& s, const void* x,
                        const void* w, void* y, float* p, int64_t splits) {
  if (s.m <= 8) return LaunchMatmul<S, 32, 1, kTrans>(stream, s, x, w, y, p, splits);
  if (s.m <= 16) return LaunchMatmul<S, 32, 2, kTrans>(stream, s, x, w, y, p, splits);
  if (s.m <= 32) return LaunchMatmul<S, 32, 4, kTrans>(stream, s, x, w, y, p, splits);
  if (s.m <= 64) return LaunchMatmul<S, 32, 8, kTrans>(stream, s, x, w, y, p, splits);
  if (s.m <= 128) return LaunchMatmul<S, 16, 8, kTrans>(stream, s, x, w, y, p, splits);
  if (s.m <= 256) return LaunchMatmul<S, 8, 8, kTrans>(stream, s, x, w, y, p, splits);
  return LaunchMatmul<S, 8, 16, kTrans>(stream, s, x, w, y, p, splits);
}

ffi::Error DhaMatmulCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> partial,
                             int64_t index, int32_t transpose) {
  dha::MatmulShape s;
  JT_RETURN_IF_ERROR(dha::CheckMatmul(x, w, *y, index, transpose, &s));
  int64_t splits = 1;
  JT_RETURN_IF_ERROR(dha::CheckMatmulPartial(*partial, s, &splits));
  if (s.m == 0 || s.o == 0) return ffi::Error::Success();
  const size_t esize = dha::ElementBytes(s.dtype);
  if (s.r == 0) {
    JT_CUDA_CHECK(
        dha::kMatmulName,
        cudaMemsetAsync(y->untyped_data(), 0, static_cast<size_t>(s.m * s.o) * esize, stream),
        "y of an empty reduction");
    return ffi::Error::Success();
  }
  const void* wl = static_cast<const char*>(w.untyped_data()) + s.w_offset * esize;
  const void* xp = x.untyped_data();
  void* yp = y->untyped_data();
  float* pp = splits > 1 ? static_cast<float*>(partial->untyped_data()) : nullptr;
  if (s.dtype == ffi::DataType::F32) {
    return s.transpose ? DispatchTile<uint32_t, true>(stream, s, xp, wl, yp, pp, splits)
                       : DispatchTile<uint32_t, false>(stream, s, xp, wl, yp, pp, splits);
  }
  return s.transpose ? DispatchTile<uint16_t, true>(stream, s, xp, wl, yp, pp, splits)
                     : DispatchTile<uint16_t, false>(stream, s, xp, wl, yp, pp, splits);
}

// ------------------------------------------------------------------------------------------------
// scatter_add: host CPUs zero and fill the host buffer, fed by copy-engine copies to staging
// ------------------------------------------------------------------------------------------------

constexpr int kScatterSlots = 2;
constexpr int64_t kDefaultScatterChunkBytes = int64_t{16} << 20;
constexpr int64_t kMinScatterChunkBytes = int64_t{4} << 10;
constexpr int64_t kScatterAlignBytes = 256;

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// One device's streams, events, pinned staging and bf16 scratch, for one call site. One call
// enqueues at a time (mu); the host functions of one call at a time use staging and scratch
// (stream order: a call's streams wait for XLA's stream, which waits for the previous call).
struct ScatterDevice {
  explicit ScatterDevice(int device) : device(device) {}
  ~ScatterDevice();
  ScatterDevice(const ScatterDevice&) = delete;
  ScatterDevice& operator=(const ScatterDevice&) = delete;

  // Creates the streams and events (on the current device, which must be `device`).
  ffi::Error Init();
  // Waits until no host function or copy of an earlier call can still use staging or scratch.
  ffi::Error Quiesce(const char* why);
  // Makes the pinned staging at least `bytes` long (growing waits for the streams first).
  ffi::Error EnsureStaging(int64_t bytes);

  const int device;
  std::mutex mu;
  cudaStream_t copy_stream = nullptr;
  cudaStream_t host_stream = nullptr;
  cudaEvent_t start = nullptr;  // on XLA's stream, at the call
  cudaEvent_t done = nullptr;   // on the host stream, after the last host function
  cudaEvent_t copied[kScatterSlots] = {};    // on the copy stream: a slot's chunk is staged
  cudaEvent_t consumed[kScatterSlots] = {};  // on the host stream: a slot's chunk is added
  char* staging = nullptr;  // pinned host memory, kScatterSlots slots
  int64_t staging_bytes = 0;
  dha::ScatterAddScratch scratch;  // bf16 buffers: the fp32 sums
};

ffi::Error ScatterDevice::Init() {
  for (cudaStream_t* s : {&copy_stream, &host_stream}) {
    JT_CUDA_CHECK(dha::kScatterAddName, cudaStreamCreateWithFlags(s, cudaStreamNonBlocking),
                  "a stream of the scatter-add");
  }
  for (cudaEvent_t* e : {&start, &done, &copied[0], &copied[1], &consumed[0], &consumed[1]}) {
    JT_CUDA_CHECK(dha::kScatterAddName, cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                  "an event of the scatter-add");
  }
  static_assert(kScatterSlots == 2, "Init lists the slots' events");
  return ffi::Error::Success();
}

ffi::Error ScatterDevice::Quiesce(const char* why) {
  for (cudaStream_t s : {copy_stream, host_stream}) {
    JT_CUDA_CHECK(dha::kScatterAddName, cudaStreamSynchronize(s), why);
  }
  return ffi::Error::Success();
}

ffi::Error ScatterDevice::EnsureStaging(int64_t bytes) {
  if (staging_bytes >= bytes) return ffi::Error::Success();
  JT_RETURN_IF_ERROR(Quiesce("before growing the pinned staging"));
  if (staging != nullptr) {
    JT_CUDA_CHECK(dha::kScatterAddName, cudaFreeHost(staging), "the pinned staging");
    staging = nullptr;
    staging_bytes = 0;
  }
  void* p = nullptr;
  JT_CUDA_CHECK(dha::kScatterAddName,
                cudaHostAlloc(&p, static_cast<size_t>(bytes), cudaHostAllocPortable),
                std::to_string(bytes) + " bytes of pinned staging");
  staging = static_cast<char*>(p);
  staging_bytes = bytes;
  return ffi::Error::Success();
}

ScatterDevice::~ScatterDevice() {
  // CUDA errors are ignored here (void): nothing can report them (this runs when XLA frees the
  // executable, through the state type's deleter, possibly at process exit).
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                        cudaSetDevice(device) == cudaSuccess;
  for (cudaStream_t s : {copy_stream, host_stream}) {
    if (s != nullptr) (void)cudaStreamSynchronize(s);
  }
  if (staging != nullptr) (void)cudaFreeHost(staging);
  for (cudaEvent_t e : {start, done, copied[0], copied[1], consumed[0], consumed[1]}) {
    if (e != nullptr) (void)cudaEventDestroy(e);
  }
  for (cudaStream_t s : {copy_stream, host_stream}) {
    if (s != nullptr) (void)cudaStreamDestroy(s);
  }
  if (switched) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();  // leave no error of ours behind for a later check on this thread
}

// Per-instance state (one per scatter_add call site of an executable), made by the instantiate
// stage; its devices' resources are made on first use.
struct ScatterAddState {
  static ffi::TypeId id;

  int64_t chunk_bytes = kDefaultScatterChunkBytes;  // staging bytes per slot

  ffi::Error Resources(int device, ScatterDevice** out) {
    std::lock_guard<std::mutex> lock(mu);
    if (device < 0) {
      return Internal(dha::kScatterAddName, "invalid current device " + std::to_string(device));
    }
    if (devices.size() <= static_cast<size_t>(device)) devices.resize(device + 1);
    if (devices[device] == nullptr) {
      auto r = std::make_unique<ScatterDevice>(device);
      JT_RETURN_IF_ERROR(r->Init());
      devices[device] = std::move(r);
    }
    *out = devices[device].get();
    return ffi::Error::Success();
  }

  std::mutex mu;
  std::vector<std::unique_ptr<ScatterDevice>> devices;  // by device ordinal
};

ffi::TypeId ScatterAddState::id = {};  // assigned by XLA when the type is registered

void DeleteScatterAddState(void* state) { delete static_cast<ScatterAddState*>(state); }

// One call, as its host functions see it: heap-allocated, reference-counted by the handler and
// by each host function enqueued, deleted by the last to finish.
struct ScatterCall;

struct ScatterChunk {
  ScatterCall* call;
  int slot;
  int64_t count;  // ids in the chunk
};

struct ScatterCall {
  dha::ScatterAddShape shape;
  void* buffer = nullptr;  // host memory
  dha::ScatterAddScratch* scratch = nullptr;
  char* slot_base[kScatterSlots] = {};
  int64_t rows_offset = 0;  // bytes into a slot where the rows start (the ids at 0)
  std::vector<ScatterChunk> chunks;
  std::atomic<int> refs{1};  // the handler's
};

void Release(ScatterCall* call) {
  if (call->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete call;
}

// Host functions: no CUDA calls in here (cudaLaunchHostFunc's contract). They block while the
// CPU thread pool works.
void CUDART_CB ScatterBeginHostFn(void* arg) {
  ScatterCall* call = static_cast<ScatterCall*>(arg);
  dha::ScatterAddBegin(call->shape, call->buffer, call->scratch);
  Release(call);
}

void CUDART_CB ScatterChunkHostFn(void* arg) {
  const ScatterChunk* chunk = static_cast<const ScatterChunk*>(arg);
  ScatterCall* call = chunk->call;
  {
    host_update::ScopedIeeeFloatingPoint ieee;  // the CPU handler's bits
    const char* slot = call->slot_base[chunk->slot];
    dha::ScatterAddChunk(call->shape, call->buffer, reinterpret_cast<const int32_t*>(slot),
                         slot + call->rows_offset, chunk->count, call->scratch);
  }
  Release(call);
}

void CUDART_CB ScatterEndHostFn(void* arg) {
  ScatterCall* call = static_cast<ScatterCall*>(arg);
  {
    host_update::ScopedIeeeFloatingPoint ieee;
    dha::ScatterAddEnd(call->shape, call->buffer, call->scratch);
  }
  Release(call);
}

// Enqueues fn(arg), a host function that releases a reference to `call` when it has run.
ffi::Error LaunchScatterHostFn(cudaStream_t stream, cudaHostFn_t fn, void* arg,
                               ScatterCall* call) {
  call->refs.fetch_add(1, std::memory_order_relaxed);  // before: fn may run at once
  if (const cudaError_t e = cudaLaunchHostFunc(stream, fn, arg); e != cudaSuccess) {
    call->refs.fetch_sub(1, std::memory_order_relaxed);  // fn never runs; the handler holds one
    return CudaError(dha::kScatterAddName, "cudaLaunchHostFunc", "a host function",
                     __FILE__, __LINE__, e);
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<std::unique_ptr<ScatterAddState>> DhaScatterAddCudaInstantiateImpl(
    int32_t /*zeroed: read per call*/) {
  auto state = std::make_unique<ScatterAddState>();
  if (const char* env = std::getenv("JAXTIER_DHA_SCATTER_CHUNK_BYTES"); env && *env) {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    if (end == env || *end != '\0' || v < kMinScatterChunkBytes) {
      return ffi::Unexpected<ffi::Error>(
          Invalid(dha::kScatterAddName, "value",
                  "environment variable JAXTIER_DHA_SCATTER_CHUNK_BYTES",
                  "an integer number of bytes >= " + std::to_string(kMinScatterChunkBytes), env));
    }
    state->chunk_bytes = v;
  }
  return ffi::ErrorOr<std::unique_ptr<ScatterAddState>>(std::move(state));
}

ffi::Error DhaScatterAddCudaImpl(cudaStream_t xla_stream, ScatterAddState* state,
                                 ffi::AnyBuffer buffer, ffi::Buffer<ffi::S32> ids,
                                 ffi::AnyBuffer rows, ffi::Result<ffi::AnyBuffer> out,
                                 int32_t zeroed) {
  const char* op = dha::kScatterAddName;
  dha::ScatterAddShape s;
  JT_RETURN_IF_ERROR(dha::CheckScatterAdd(buffer, ids, rows, *out, &s));
  s.zeroed = zeroed != 0;
  if (s.buffer_bytes() == 0) return ffi::Error::Success();
  // The host CPUs write the buffer: it must be host memory (pinned_host), not device memory.
  cudaPointerAttributes attr;
  JT_CUDA_CHECK(op, cudaPointerGetAttributes(&attr, buffer.untyped_data()), "input 0 (buffer)");
  if (attr.type == cudaMemoryTypeDevice) {
    return Invalid(op, "memory", "input 0 (buffer)",
                   "host memory (memory kind pinned_host: the host CPUs zero and write it)",
                   "device memory");
  }
  int device = 0;
  JT_CUDA_CHECK(op, cudaGetDevice(&device), "");
  ScatterDevice* dev = nullptr;
  JT_RETURN_IF_ERROR(state->Resources(device, &dev));
  std::lock_guard<std::mutex> lock(dev->mu);

  // Chunks: as many ids (4 bytes each, then their rows) as a slot of chunk_bytes holds, at
  // least one.
  const int64_t row_bytes = s.row_bytes();
  const int64_t n = s.num_ids;
  int64_t chunk_ids = std::max<int64_t>(
      1, (state->chunk_bytes - kScatterAlignBytes) / (4 + row_bytes));
  chunk_ids = std::min(chunk_ids, std::max<int64_t>(n, 1));
  const int64_t rows_offset = AlignUp(chunk_ids * 4, kScatterAlignBytes);
  const int64_t slot_bytes = AlignUp(rows_offset + chunk_ids * row_bytes, kScatterAlignBytes);
  const int64_t num_chunks = (n + chunk_ids - 1) / chunk_ids;
  if (num_chunks > 0) JT_RETURN_IF_ERROR(dev->EnsureStaging(kScatterSlots * slot_bytes));
  if (!dev->scratch.Fits(s, chunk_ids)) {
    JT_RETURN_IF_ERROR(dev->Quiesce("before growing the scatter-add's host scratch"));
    JT_RETURN_IF_ERROR(dev->scratch.Reserve(s, chunk_ids));
  }

  auto owned = std::make_unique<ScatterCall>();
  ScatterCall* call = owned.get();
  call->shape = s;
  call->buffer = out->untyped_data();
  call->scratch = &dev->scratch;
  call->rows_offset = rows_offset;
  for (int k = 0; k < kScatterSlots; ++k) call->slot_base[k] = dev->staging + k * slot_bytes;
  call->chunks.resize(static_cast<size_t>(num_chunks));
  for (int64_t c = 0; c < num_chunks; ++c) {
    call->chunks[c] = ScatterChunk{call, static_cast<int>(c % kScatterSlots),
                                   std::min(chunk_ids, n - c * chunk_ids)};
  }
  // From here on host functions hold references; the handler drops its own when it returns.
  struct HandlerRef {
    ScatterCall* call;
    ~HandlerRef() { Release(call); }
  } handler_ref{owned.release()};

  JT_CUDA_CHECK(op, cudaEventRecord(dev->start, xla_stream), "the start of the call");
  for (cudaStream_t st : {dev->copy_stream, dev->host_stream}) {
    JT_CUDA_CHECK(op, cudaStreamWaitEvent(st, dev->start, 0), "a scatter-add stream on XLA's");
  }
  JT_RETURN_IF_ERROR(LaunchScatterHostFn(dev->host_stream, ScatterBeginHostFn, call, call));
  const char* id_src = reinterpret_cast<const char*>(ids.typed_data());
  const char* row_src = static_cast<const char*>(rows.untyped_data());
  for (int64_t c = 0; c < num_chunks; ++c) {
    ScatterChunk* chunk = &call->chunks[c];
    const int slot = chunk->slot;
    char* base = call->slot_base[slot];
    const int64_t lo = c * chunk_ids;
    if (c >= kScatterSlots) {
      JT_CUDA_CHECK(op, cudaStreamWaitEvent(dev->copy_stream, dev->consumed[slot], 0),
                    "the copy stream on the host's use of a staging slot");
    }
    JT_CUDA_CHECK(op,
                  cudaMemcpyAsync(base, id_src + lo * 4, static_cast<size_t>(chunk->count * 4),
                                  cudaMemcpyDefault, dev->copy_stream),
                  "input 1 (ids) to pinned staging");
    if (row_bytes > 0) {
      JT_CUDA_CHECK(op,
                    cudaMemcpyAsync(base + rows_offset, row_src + lo * row_bytes,
                                    static_cast<size_t>(chunk->count * row_bytes),
                                    cudaMemcpyDefault, dev->copy_stream),
                    "input 2 (rows) to pinned staging");
    }
    JT_CUDA_CHECK(op, cudaEventRecord(dev->copied[slot], dev->copy_stream), "a staged chunk");
    JT_CUDA_CHECK(op, cudaStreamWaitEvent(dev->host_stream, dev->copied[slot], 0),
                  "the host stream on a staged chunk");
    JT_RETURN_IF_ERROR(LaunchScatterHostFn(dev->host_stream, ScatterChunkHostFn, chunk, call));
    JT_CUDA_CHECK(op, cudaEventRecord(dev->consumed[slot], dev->host_stream),
                  "an added chunk");
  }
  JT_RETURN_IF_ERROR(LaunchScatterHostFn(dev->host_stream, ScatterEndHostFn, call, call));
  JT_CUDA_CHECK(op, cudaEventRecord(dev->done, dev->host_stream), "the end of the scatter-add");
  JT_CUDA_CHECK(op, cudaStreamWaitEvent(xla_stream, dev->done, 0),
                "XLA's stream on the scatter-add");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_TypeId* DhaScatterAddCudaStateTypeId() { return &ScatterAddState::id; }

const XLA_FFI_TypeInfo* DhaScatterAddCudaStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = {XLA_FFI_TypeInfo_STRUCT_SIZE, nullptr,
                                        &DeleteScatterAddState};
  return &info;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DhaGatherCuda, DhaGatherCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()          // table [V, D] (pinned_host)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids [...]
                                  .Ret<ffi::AnyBuffer>());        // rows [..., D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DhaMatmulCuda, DhaMatmulCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()          // x [M, R]
                                  .Arg<ffi::AnyBuffer>()          // w [K, N] / [L, K, N]
                                  .Ret<ffi::AnyBuffer>()          // y [M, O]
                                  .Ret<ffi::AnyBuffer>()          // partial sums [S, M, O] f32
                                  .Attr<int64_t>("index")         // layer of a stacked w
                                  .Attr<int32_t>("transpose"));   // 1: y = x @ w[index]^T

XLA_FFI_DEFINE_HANDLER_SYMBOL(DhaScatterAddCudaInstantiate, DhaScatterAddCudaInstantiateImpl,
                              ffi::Ffi::BindInstantiate().Attr<int32_t>("zeroed"));

// Not kCmdBufferCompatible: its own streams, event waits and host functions.
XLA_FFI_DEFINE_HANDLER_SYMBOL(DhaScatterAddCuda, DhaScatterAddCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<ffi::State<ScatterAddState>>()        // state
                                  .Arg<ffi::AnyBuffer>()          // buffer [V, D] (pinned_host)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids [...]
                                  .Arg<ffi::AnyBuffer>()          // rows [..., D]
                                  .Ret<ffi::AnyBuffer>()          // the buffer (aliased)
                                  .Attr<int32_t>("zeroed"));      // 1: only the ids' rows

}  // namespace jaxtier
