// CPU handlers of the DHA compute family (dha.h, docs/design.md "DHA compute"):
//   jaxtier_dha_gather_ffi       rows = table[ids] (zeros for ids outside [0, V))
//   jaxtier_dha_matmul_ffi       y = x @ w[index] (transpose 0) or x @ w[index]^T (transpose 1)
//   jaxtier_dha_scatter_add_ffi  buffer = 0, then buffer[ids[n]] += rows[n] (in place; with
//                                `zeroed`, a buffer already zero: only the ids' rows written)
// and the host-side scatter-add (ScatterAdd*, dha.h), which the CUDA handler of
// jaxtier_dha_scatter_add_ffi (dha_kernels.cu) runs from host functions on staged chunks.
//
// On the CPU backend a pinned_host buffer is ordinary host memory: gather and matmul are plain
// loops, the reference for the CUDA kernels (dha_kernels.cu). Matmul accumulates in fp32 and
// rounds y once. The scatter-add runs on jaxtier's CPU thread pool (op_program.h), each row's
// additions in the order of n whatever the thread count: a row belongs to one task (its id, or
// for a bf16 buffer its slot, modulo the task count), and every task reads the ids in order. An
// f32 buffer is zeroed, then added into; a bf16 buffer's rows are summed in fp32 beside it and
// the buffer is written once at the end (sums rounded, zeros elsewhere): each byte once.

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <limits>
#include <new>
#include <vector>

#include "dha.h"
#include "ffi_helpers.h"
#include "handlers.h"
#include "op_program.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtier {
namespace {

ffi::Error DhaGatherCpuImpl(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                            ffi::Result<ffi::AnyBuffer> out) {
  dha::GatherShape s;
  JT_RETURN_IF_ERROR(dha::CheckGather(table, ids, *out, &s));
  const char* src = static_cast<const char*>(table.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* id = ids.typed_data();
  for (int64_t i = 0; i < s.num_ids; ++i) {
    char* row = dst + i * s.row_bytes;
    if (id[i] >= 0 && id[i] < s.num_rows) {
      memcpy(row, src + static_cast<int64_t>(id[i]) * s.row_bytes, s.row_bytes);
    } else {
      memset(row, 0, s.row_bytes);
    }
  }
  return ffi::Error::Success();
}

// Loads n elements of storage type `dt` as fp32.
void ToFloat(ffi::DataType dt, const void* src, int64_t n, float* dst) {
  if (dt == ffi::DataType::F32) {
    memcpy(dst, src, n * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src);
  if (dt == ffi::DataType::BF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = host_update::Bf16ToFloat(h[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = host_update::F16ToFloat(h[i]);
  }
}

// Stores n fp32 values as storage type `dt` (round to nearest even).
void FromFloat(ffi::DataType dt, const float* src, int64_t n, void* dst) {
  if (dt == ffi::DataType::F32) {
    memcpy(dst, src, n * sizeof(float));
    return;
  }
  uint16_t* h = static_cast<uint16_t*>(dst);
  if (dt == ffi::DataType::BF16) {
    for (int64_t i = 0; i < n; ++i) h[i] = host_update::FloatToBf16(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) h[i] = host_update::FloatToF16(src[i]);
  }
}

// `partial` (the CUDA kernel's split-reduction scratch) is checked and left untouched: this
// loop does not split the reduction.
ffi::Error DhaMatmulCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> partial, int64_t index,
                            int32_t transpose) {
  dha::MatmulShape s;
  JT_RETURN_IF_ERROR(dha::CheckMatmul(x, w, *y, index, transpose, &s));
  int64_t splits = 1;
  JT_RETURN_IF_ERROR(dha::CheckMatmulPartial(*partial, s, &splits));
  if (s.m == 0 || s.o == 0) return ffi::Error::Success();
  const int64_t esize = dha::ElementBytes(s.dtype);
  const char* wbase = static_cast<const char*>(w.untyped_data()) + s.w_offset * esize;
  std::vector<float> xf(static_cast<size_t>(s.m * s.r));
  ToFloat(s.dtype, x.untyped_data(), s.m * s.r, xf.data());
  std::vector<float> acc(static_cast<size_t>(s.m * s.o), 0.0f);
  if (!s.transpose) {
    // w[index] is [R, O]: each row of w is converted once and used by every row of x.
    std::vector<float> wrow(static_cast<size_t>(s.o));
    for (int64_t r = 0; r < s.r; ++r) {
      ToFloat(s.dtype, wbase + r * s.o * esize, s.o, wrow.data());
      for (int64_t m = 0; m < s.m; ++m) {
        const float xv = xf[m * s.r + r];
        float* a = acc.data() + m * s.o;
        const float* wv = wrow.data();
        for (int64_t o = 0; o < s.o; ++o) a[o] += xv * wv[o];
      }
    }
  } else {
    // w[index] is [O, R]: y[m, o] is the dot product of x's row m with w's row o.
    std::vector<float> wrow(static_cast<size_t>(s.r));
    for (int64_t o = 0; o < s.o; ++o) {
      ToFloat(s.dtype, wbase + o * s.r * esize, s.r, wrow.data());
      for (int64_t m = 0; m < s.m; ++m) {
        const float* xv = xf.data() + m * s.r;
        float sum = 0.0f;
        for (int64_t r = 0; r < s.r; ++r) sum += xv[r] * wrow[r];
        acc[m * s.o + o] = sum;
      }
    }
  }
  FromFloat(s.dtype, acc.data(), s.m * s.o, y->untyped_data());
  return ffi::Error::Success();
}

ffi::Error DhaScatterAddCpuImpl(ffi::AnyBuffer buffer, ffi::Buffer<ffi::S32> ids,
                                ffi::AnyBuffer rows, ffi::Result<ffi::AnyBuffer> out,
                                int32_t zeroed) {
  dha::ScatterAddShape s;
  JT_RETURN_IF_ERROR(dha::CheckScatterAdd(buffer, ids, rows, *out, &s));
  s.zeroed = zeroed != 0;
  if (s.buffer_bytes() == 0) return ffi::Error::Success();
  dha::ScatterAddScratch scratch;
  JT_RETURN_IF_ERROR(scratch.Reserve(s, s.num_ids));
  // IEEE fp32 (no flush of denormals), as the CUDA handler's host functions compute.
  host_update::ScopedIeeeFloatingPoint ieee;
  void* dst = out->untyped_data();
  dha::ScatterAddBegin(s, dst, &scratch);
  dha::ScatterAddChunk(s, dst, ids.typed_data(), rows.untyped_data(), s.num_ids, &scratch);
  dha::ScatterAddEnd(s, dst, &scratch);
  return ffi::Error::Success();
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The host-side scatter-add (dha.h)
// ------------------------------------------------------------------------------------------------

namespace dha {
namespace {

// A zeroing task covers at least this many bytes (below twice it, the caller zeroes alone).
constexpr int64_t kMinZeroTaskBytes = int64_t{4} << 20;
// Below this many row elements a chunk is added by the calling thread alone.
constexpr int64_t kMinParallelElements = int64_t{1} << 17;
// The flag of a chunk_slot code (dha.h): this id is its slot's first in the call (its sum
// starts here).
constexpr int64_t kFirstInSlot = int64_t{1} << 32;

int64_t AddTasks(int64_t elements) {
  return elements < kMinParallelElements ? 1 : host_update::CpuThreads();
}

// dst[j] += src[j] (kAssign: dst[j] = 0 + src[j], a sum's first term; the sign of a zero
// follows the addition) for j < n, src widened to fp32. dst and src never overlap.
template <bool kBf16Src, bool kAssign>
inline void AddRow(float* __restrict__ dst, const void* __restrict__ src, int64_t n) {
  if constexpr (kBf16Src) {
    const uint16_t* h = static_cast<const uint16_t*>(src);
    for (int64_t j = 0; j < n; ++j) {
      dst[j] = (kAssign ? 0.0f : dst[j]) + host_update::Bf16ToFloat(h[j]);
    }
  } else {
    const float* f = static_cast<const float*>(src);
    for (int64_t j = 0; j < n; ++j) dst[j] = (kAssign ? 0.0f : dst[j]) + f[j];
  }
}

template <bool kBf16Src>
void AddChunkInto(const ScatterAddShape& s, float* buffer, const int32_t* ids, const char* rows,
                  int64_t count) {
  const int64_t d = s.dim;
  const int64_t row_bytes = s.row_bytes();
  const int64_t tasks = AddTasks(count * d);
  host_update::ParallelFor(tasks, [&](int64_t t) {
    for (int64_t n = 0; n < count; ++n) {
      const int32_t id = ids[n];
      if (id < 0 || id >= s.num_rows || static_cast<int64_t>(id) % tasks != t) continue;
      AddRow<kBf16Src, false>(buffer + id * d, rows + n * row_bytes, d);
    }
  });
}

template <bool kBf16Src>
void AddChunkToSums(const ScatterAddShape& s, ScatterAddScratch* scratch, const char* rows,
                    int64_t count) {
  const int64_t d = s.dim;
  const int64_t row_bytes = s.row_bytes();
  const int64_t tasks = AddTasks(count * d);
  const int64_t* codes = scratch->chunk_slot.get();
  float* sums = scratch->sums.get();
  host_update::ParallelFor(tasks, [&](int64_t t) {
    for (int64_t n = 0; n < count; ++n) {
      const int64_t code = codes[n];
      if (code < 0) continue;
      const int64_t slot = code & (kFirstInSlot - 1);
      if (slot % tasks != t) continue;
      if (code & kFirstInSlot) {
        AddRow<kBf16Src, true>(sums + slot * d, rows + n * row_bytes, d);
      } else {
        AddRow<kBf16Src, false>(sums + slot * d, rows + n * row_bytes, d);
      }
    }
  });
}

// Rows of `row_bytes` per task of a pass over `bytes` (num_rows rows): all of them below twice
// kMinZeroTaskBytes, else about four tasks per thread of at least kMinZeroTaskBytes each.
int64_t RowsPerTask(int64_t bytes, int64_t row_bytes, int64_t num_rows) {
  if (bytes < 2 * kMinZeroTaskBytes || row_bytes == 0) return std::max<int64_t>(num_rows, 1);
  const int64_t task_bytes = std::max(kMinZeroTaskBytes, bytes / (4 * host_update::CpuThreads()));
  return std::max<int64_t>(1, task_bytes / row_bytes);
}

// memset(base, 0, bytes), split over the pool when large.
void ZeroBytes(char* base, int64_t bytes) {
  const int64_t per_task = RowsPerTask(bytes, 4096, (bytes + 4095) / 4096) * 4096;  // whole pages
  const int64_t tasks = (bytes + per_task - 1) / per_task;
  host_update::ParallelFor(tasks, [&](int64_t t) {
    const int64_t lo = t * per_task;
    memset(base + lo, 0, static_cast<size_t>(std::min(bytes, lo + per_task) - lo));
  });
}

// `new T[n]` without initialising (so untouched pages are never committed); null on failure.
template <typename T>
std::unique_ptr<T[]> Allocate(int64_t n) {
  return std::unique_ptr<T[]>(new (std::nothrow) T[static_cast<size_t>(std::max<int64_t>(n, 1))]);
}

// Makes `*p` hold at least `need` elements (`*capacity` of them), reallocating only when it
// holds fewer; the old buffer is freed first. False when the allocation failed (then empty).
template <typename T>
bool Grow(std::unique_ptr<T[]>* p, int64_t* capacity, int64_t need) {
  if (*capacity >= need) return true;
  p->reset();
  *capacity = 0;
  *p = Allocate<T>(need);
  if (!*p) return false;
  *capacity = need;
  return true;
}

// The rows a call can reach (int32 ids reach rows below 2^31 only), its slots at most.
int64_t ReachableRows(const ScatterAddShape& s) {
  return std::min(s.num_rows, int64_t{std::numeric_limits<int32_t>::max()} + 1);
}
int64_t MaxSlots(const ScatterAddShape& s) { return std::min(s.num_ids, ReachableRows(s)); }

}  // namespace

bool ScatterAddScratch::Fits(const ScatterAddShape& s, int64_t max_chunk_ids) const {
  if (s.buffer_type != ffi::DataType::BF16) return true;
  const int64_t slots = MaxSlots(s);
  return slot_capacity >= slots && sums_capacity >= slots * s.dim &&
         map_capacity >= ReachableRows(s) && chunk_capacity >= max_chunk_ids;
}

ffi::Error ScatterAddScratch::Reserve(const ScatterAddShape& s, int64_t max_chunk_ids) {
  if (s.buffer_type != ffi::DataType::BF16) return ffi::Error::Success();
  const int64_t rows = ReachableRows(s);
  const int64_t slots = MaxSlots(s);
  auto fail = [&](const char* what, int64_t bytes) {
    return Internal(kScatterAddName, "could not allocate " + std::to_string(bytes) +
                                         " bytes of host memory for " + what + " (bfloat16 "
                                         "buffer [" + std::to_string(s.num_rows) + ", " +
                                         std::to_string(s.dim) + "], " +
                                         std::to_string(s.num_ids) + " ids)");
  };
  if (!Grow(&sums, &sums_capacity, slots * s.dim)) {
    return fail("the fp32 sums of the distinct ids", slots * s.dim * 4);
  }
  if (!Grow(&slot_row, &slot_capacity, slots)) {
    return fail("the rows of the distinct ids", slots * 4);
  }
  if (map_capacity < rows) {
    // A new map starts empty (-1: no slot); a call leaves it so.
    if (!Grow(&row_slot, &map_capacity, rows)) return fail("the map of rows to sums", rows * 4);
    std::fill_n(row_slot.get(), rows, -1);
  }
  if (!Grow(&chunk_slot, &chunk_capacity, max_chunk_ids)) {
    return fail("the slots of a chunk's ids", max_chunk_ids * 8);
  }
  return ffi::Error::Success();
}

void ScatterAddBegin(const ScatterAddShape& s, void* buffer, ScatterAddScratch* scratch) {
  // Slots left by a call that never reached End (its enqueueing failed half-way): unmapped, so
  // that the map is all -1 again. Nothing to do after a complete call.
  for (int64_t slot = 0; slot < scratch->num_slots; ++slot) {
    scratch->row_slot[scratch->slot_row[slot]] = -1;
  }
  scratch->num_slots = 0;
  // A bf16 buffer is written once, by End (sums and zeros in one pass); an f32 one is added
  // into in place, so it is zeroed now.
  if (s.buffer_type == ffi::DataType::F32 && !s.zeroed) {
    ZeroBytes(static_cast<char*>(buffer), s.buffer_bytes());
  }
}

void ScatterAddChunk(const ScatterAddShape& s, void* buffer, const int32_t* ids,
                     const void* rows, int64_t count, ScatterAddScratch* scratch) {
  if (count <= 0 || s.dim == 0) return;
  const char* r = static_cast<const char*>(rows);
  const bool bf16_rows = s.rows_type == ffi::DataType::BF16;
  if (s.buffer_type == ffi::DataType::F32) {
    float* b = static_cast<float*>(buffer);
    bf16_rows ? AddChunkInto<true>(s, b, ids, r, count) : AddChunkInto<false>(s, b, ids, r, count);
    return;
  }
  // bf16 buffer: each distinct valid id gets a slot (an fp32 sum) at its first appearance, in
  // the order of n (one pass, on this thread), then the tasks add the rows into the sums.
  int64_t* codes = scratch->chunk_slot.get();
  int32_t* row_slot = scratch->row_slot.get();
  for (int64_t n = 0; n < count; ++n) {
    const int32_t id = ids[n];
    if (id < 0 || id >= s.num_rows) {
      codes[n] = -1;
      continue;
    }
    int32_t slot = row_slot[id];
    if (slot >= 0) {
      codes[n] = slot;
      continue;
    }
    slot = static_cast<int32_t>(scratch->num_slots++);
    row_slot[id] = slot;
    scratch->slot_row[slot] = id;
    codes[n] = slot | kFirstInSlot;
  }
  bf16_rows ? AddChunkToSums<true>(s, scratch, r, count)
            : AddChunkToSums<false>(s, scratch, r, count);
}

void ScatterAddEnd(const ScatterAddShape& s, void* buffer, ScatterAddScratch* scratch) {
  if (s.buffer_type != ffi::DataType::BF16) return;
  const int64_t slots = scratch->num_slots;
  scratch->num_slots = 0;
  if (slots == 0) {
    if (!s.zeroed) ZeroBytes(static_cast<char*>(buffer), s.buffer_bytes());
    return;
  }
  const int64_t d = s.dim;
  uint16_t* b = static_cast<uint16_t*>(buffer);
  if (s.zeroed) {
    // Only the rows with a slot are written (the rest are zero already), one slot per task.
    host_update::ParallelFor(slots, [&](int64_t slot) {
      const int64_t row = scratch->slot_row[slot];
      const float* sum = scratch->sums.get() + slot * d;
      uint16_t* dst = b + row * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = host_update::FloatToBf16(sum[j]);
    });
    for (int64_t slot = 0; slot < slots; ++slot) scratch->row_slot[scratch->slot_row[slot]] = -1;
    return;
  }
  // One pass over the rows, each written once: a row with a slot gets its sum rounded to bf16
  // (and leaves the map, all -1 again for the next call), each run of rows without one zeros.
  const int64_t row_bytes = d * 2;
  const int64_t mapped = ReachableRows(s);
  const int64_t rows_per_task = RowsPerTask(s.buffer_bytes(), row_bytes, s.num_rows);
  const int64_t tasks = (s.num_rows + rows_per_task - 1) / rows_per_task;
  host_update::ParallelFor(tasks, [&](int64_t t) {
    const int64_t lo = t * rows_per_task;
    const int64_t hi = std::min(s.num_rows, lo + rows_per_task);
    int64_t zeros_from = lo;  // the start of the current run of rows without a slot
    for (int64_t row = lo; row < std::min(hi, mapped); ++row) {
      const int32_t slot = scratch->row_slot[row];
      if (slot < 0) continue;
      memset(b + zeros_from * d, 0, static_cast<size_t>((row - zeros_from) * row_bytes));
      const float* sum = scratch->sums.get() + static_cast<int64_t>(slot) * d;
      uint16_t* dst = b + row * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = host_update::FloatToBf16(sum[j]);
      scratch->row_slot[row] = -1;
      zeros_from = row + 1;
    }
    memset(b + zeros_from * d, 0, static_cast<size_t>((hi - zeros_from) * row_bytes));
  });
}

}  // namespace dha

XLA_FFI_DEFINE_HANDLER_SYMBOL(DhaGatherCpu, DhaGatherCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // table [V, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids [...]
                                  .Ret<ffi::AnyBuffer>());        // rows [..., D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DhaMatmulCpu, DhaMatmulCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x [M, R]
                                  .Arg<ffi::AnyBuffer>()          // w [K, N] or [L, K, N]
                                  .Ret<ffi::AnyBuffer>()          // y [M, O]
                                  .Ret<ffi::AnyBuffer>()          // partial sums (unused)
                                  .Attr<int64_t>("index")         // layer of a stacked w
                                  .Attr<int32_t>("transpose"));   // 1: y = x @ w[index]^T

XLA_FFI_DEFINE_HANDLER_SYMBOL(DhaScatterAddCpu, DhaScatterAddCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // buffer [V, D] (in place)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids [...]
                                  .Arg<ffi::AnyBuffer>()          // rows [..., D]
                                  .Ret<ffi::AnyBuffer>()          // the buffer (aliased)
                                  .Attr<int32_t>("zeroed"));      // 1: only the ids' rows

}  // namespace jaxtier
