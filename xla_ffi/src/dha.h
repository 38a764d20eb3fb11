// DHA compute (direct host access): the shapes and checks shared by the CPU handlers (dha.cc)
// and the CUDA handlers (dha_kernels.cu) of
//
//   jaxtier_dha_gather_ffi       rows[..., D] = table[ids[...], :]   (table [V, D])
//   jaxtier_dha_matmul_ffi       y[M, O] = x[M, R] @ B               (B = w[index] or w[index]^T)
//   jaxtier_dha_scatter_add_ffi  buffer = 0; buffer[ids[n], :] += rows[n, :]   (in place)
//
// and the host-side scatter-add (ScatterAdd*, defined in dha.cc), which the CPU handler runs at
// once and the CUDA handler runs from host functions, chunk by chunk, on staged ids and rows.
// The contract is docs/design.md ("DHA compute: gather, matmul and scatter-add on host
// operands"); the Python side is jaxtier/_src/primitives/dha.py. The table / weight is usually a
// pinned_host buffer that the CUDA kernels read in place over PCIe; nothing here depends on
// where it lives. The scatter-add buffer must be host memory on a GPU (the host CPUs write it).
//
// Compiles with a plain C++17 compiler and with nvcc (host code only).

#ifndef JAXTIER_XLA_FFI_SRC_DHA_H_
#define JAXTIER_XLA_FFI_SRC_DHA_H_

#include <stdint.h>

#include <memory>
#include <string>

#include "ffi_helpers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxtier::dha {

inline constexpr char kGatherName[] = "jaxtier_dha_gather";
inline constexpr char kMatmulName[] = "jaxtier_dha_matmul";
inline constexpr char kScatterAddName[] = "jaxtier_dha_scatter_add";

// Bytes of one element of a float storage dtype (IsFloatStorage).
inline int ElementBytes(xla::ffi::DataType t) { return t == xla::ffi::DataType::F32 ? 4 : 2; }

// ---------------------------------------------------------------------------------------------
// gather: operands table [V, D] (f32 / bf16 / f16), ids [...] int32; result [..., D], the
// table's dtype. An id outside [0, V) (negative ids included: no wrap-around) gives a row of
// zeros.
// ---------------------------------------------------------------------------------------------

struct GatherShape {
  int64_t num_rows = 0;   // V
  int64_t row_bytes = 0;  // D * element bytes
  int64_t num_ids = 0;
};

inline xla::ffi::Error CheckGather(const xla::ffi::AnyBuffer& table,
                                   const xla::ffi::Buffer<xla::ffi::S32>& ids,
                                   const xla::ffi::AnyBuffer& out, GatherShape* shape) {
  const auto tdims = table.dimensions();
  if (tdims.size() != 2) {
    return Invalid(kGatherName, "rank", "input 0 (table)", "a 2-D table [V, D]",
                   DimsString(tdims));
  }
  JT_RETURN_IF_ERROR(CheckFloatStorage(kGatherName, "input 0 (table)", table.element_type()));
  if (out.element_type() != table.element_type()) {
    return Invalid(kGatherName, "dtype", "result 0", DtypeName(table.element_type()) +
                   " (the table's)", DtypeName(out.element_type()));
  }
  const auto idims = ids.dimensions();
  const auto odims = out.dimensions();
  bool ok = odims.size() == idims.size() + 1 && odims[idims.size()] == tdims[1];
  for (size_t i = 0; ok && i < idims.size(); ++i) ok = odims[i] == idims[i];
  if (!ok) {
    std::string want = DimsString(idims);
    want = want.substr(0, want.size() - 1) + (idims.size() ? ", " : "") +
           std::to_string(tdims[1]) + "] (ids shape + [D])";
    return Invalid(kGatherName, "shape", "result 0", want, DimsString(odims));
  }
  shape->num_rows = tdims[0];
  shape->row_bytes = tdims[1] * ElementBytes(table.element_type());
  shape->num_ids = static_cast<int64_t>(ids.element_count());
  return xla::ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// matmul: operands x [M, R] and w ([K, N] or stacked [L, K, N]), one dtype (f32 or bf16);
// results y [M, O] of that dtype and the fp32 partial sums (CheckMatmulPartial); attributes
// `index` (int64: the layer of a stacked w; 0 for a 2-D w) and `transpose` (int32 0/1).
//   transpose = 0:  R = K, O = N, y = x @ w[index]      (B[r, o] = w[index][r, o])
//   transpose = 1:  R = N, O = K, y = x @ w[index]^T    (B[r, o] = w[index][o, r])
// Accumulation is fp32; y is rounded once (round to nearest even).
// ---------------------------------------------------------------------------------------------

struct MatmulShape {
  int64_t m = 0, r = 0, o = 0;
  int64_t w_offset = 0;  // elements from w's start to layer `index`
  bool transpose = false;
  xla::ffi::DataType dtype = xla::ffi::DataType::F32;
};

inline xla::ffi::Error CheckMatmul(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& w,
                                   const xla::ffi::AnyBuffer& y, int64_t index, int32_t transpose,
                                   MatmulShape* shape) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y.dimensions();
  const auto dt = x.element_type();
  if (dt != xla::ffi::DataType::F32 && dt != xla::ffi::DataType::BF16) {
    return Invalid(kMatmulName, "dtype", "input 0 (x)", "float32 or bfloat16", DtypeName(dt));
  }
  if (w.element_type() != dt) {
    return Invalid(kMatmulName, "dtype", "input 1 (w)", DtypeName(dt) + " (x's)",
                   DtypeName(w.element_type()));
  }
  if (y.element_type() != dt) {
    return Invalid(kMatmulName, "dtype", "result 0", DtypeName(dt) + " (x's)",
                   DtypeName(y.element_type()));
  }
  if (xd.size() != 2) {
    return Invalid(kMatmulName, "rank", "input 0 (x)", "a 2-D x [M, R]", DimsString(xd));
  }
  if (wd.size() != 2 && wd.size() != 3) {
    return Invalid(kMatmulName, "rank", "input 1 (w)", "[K, N] or stacked [L, K, N]",
                   DimsString(wd));
  }
  if (transpose != 0 && transpose != 1) {
    return Invalid(kMatmulName, "value", "attribute transpose", "0 or 1",
                   std::to_string(transpose));
  }
  const int64_t layers = wd.size() == 3 ? wd[0] : 1;
  if (index < 0 || index >= layers) {
    return Invalid(kMatmulName, "value", "attribute index",
                   "a layer in [0, " + std::to_string(layers) + ") of w " + DimsString(wd),
                   std::to_string(index));
  }
  const int64_t k = wd[wd.size() - 2], n = wd[wd.size() - 1];
  const int64_t r = transpose ? n : k;
  const int64_t o = transpose ? k : n;
  if (xd[1] != r) {
    return Invalid(kMatmulName, "shape", "input 0 (x)",
                   std::string("x [M, ") + std::to_string(r) + "] to match w " + DimsString(wd) +
                       (transpose ? " transposed" : ""),
                   DimsString(xd));
  }
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != o) {
    return Invalid(kMatmulName, "shape", "result 0",
                   "[" + std::to_string(xd[0]) + ", " + std::to_string(o) + "]", DimsString(yd));
  }
  shape->m = xd[0];
  shape->r = r;
  shape->o = o;
  shape->w_offset = index * k * n;
  shape->transpose = transpose != 0;
  shape->dtype = dt;
  return xla::ffi::Error::Success();
}

// matmul's second result: fp32 partial sums of the split reduction, [S, M, O] with S >= 2
// (the CUDA kernel splits R into S ranges and adds the partials in split order), or no elements
// (no split: the kernel writes y directly). XLA allocates it like any result; the Python side
// sizes it (dha.matmul_partial_shape) and drops it. Sets *splits to S, or 1.
inline xla::ffi::Error CheckMatmulPartial(const xla::ffi::AnyBuffer& partial,
                                          const MatmulShape& s, int64_t* splits) {
  if (partial.element_type() != xla::ffi::DataType::F32) {
    return Invalid(kMatmulName, "dtype", "result 1 (partial sums)", "float32",
                   DtypeName(partial.element_type()));
  }
  *splits = 1;
  if (partial.element_count() == 0) return xla::ffi::Error::Success();
  const auto pd = partial.dimensions();
  if (pd.size() != 3 || pd[0] < 2 || pd[1] != s.m || pd[2] != s.o) {
    return Invalid(kMatmulName, "shape", "result 1 (partial sums)",
                   "[S, " + std::to_string(s.m) + ", " + std::to_string(s.o) +
                       "] with S >= 2, or no elements",
                   DimsString(pd));
  }
  *splits = pd[0];
  return xla::ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// scatter_add: operands buffer [V, D] (f32 / bf16; in place: the result is the same buffer,
// input_output_aliases {0: 0}), ids [...] int32, rows [..., D] (f32 / bf16, ids' shape + [D]);
// result [V, D], the buffer. The buffer is zeroed, then for n = 0, 1, ... in order, row n is
// added into row ids[n] when 0 <= ids[n] < V (any other id adds nothing). The sums are fp32
// (rows widened exactly) in the order of n; a bf16 buffer gets each row's sum rounded once
// (nearest even). No atomics: the same bits whatever the thread count.
// ---------------------------------------------------------------------------------------------

struct ScatterAddShape {
  int64_t num_rows = 0;  // V
  int64_t dim = 0;       // D
  int64_t num_ids = 0;   // N = ids.size
  xla::ffi::DataType buffer_type = xla::ffi::DataType::F32;
  xla::ffi::DataType rows_type = xla::ffi::DataType::F32;
  // Attribute `zeroed`: the buffer is already zero (its caller keeps it so), and only the rows
  // of the ids are written; else the whole buffer is.
  bool zeroed = false;

  int64_t buffer_bytes() const { return num_rows * dim * ElementBytes(buffer_type); }
  // Bytes of one row of `rows`.
  int64_t row_bytes() const { return dim * ElementBytes(rows_type); }
};

inline xla::ffi::Error CheckScatterAdd(const xla::ffi::AnyBuffer& buffer,
                                       const xla::ffi::Buffer<xla::ffi::S32>& ids,
                                       const xla::ffi::AnyBuffer& rows,
                                       const xla::ffi::AnyBuffer& out, ScatterAddShape* shape) {
  namespace ffi = xla::ffi;
  const auto bdims = buffer.dimensions();
  if (bdims.size() != 2) {
    return Invalid(kScatterAddName, "rank", "input 0 (buffer)", "a 2-D buffer [V, D]",
                   DimsString(bdims));
  }
  const ffi::DataType bt = buffer.element_type();
  if (bt != ffi::DataType::F32 && bt != ffi::DataType::BF16) {
    return Invalid(kScatterAddName, "dtype", "input 0 (buffer)", "float32 or bfloat16",
                   DtypeName(bt));
  }
  const ffi::DataType rt = rows.element_type();
  if (rt != ffi::DataType::F32 && rt != ffi::DataType::BF16) {
    return Invalid(kScatterAddName, "dtype", "input 2 (rows)", "float32 or bfloat16",
                   DtypeName(rt));
  }
  const auto idims = ids.dimensions();
  const auto rdims = rows.dimensions();
  bool ok = rdims.size() == idims.size() + 1 && rdims[idims.size()] == bdims[1];
  for (size_t i = 0; ok && i < idims.size(); ++i) ok = rdims[i] == idims[i];
  if (!ok) {
    std::string want = DimsString(idims);
    want = want.substr(0, want.size() - 1) + (idims.size() ? ", " : "") +
           std::to_string(bdims[1]) + "] (ids shape + [D])";
    return Invalid(kScatterAddName, "shape", "input 2 (rows)", want, DimsString(rdims));
  }
  const auto odims = out.dimensions();
  if (out.element_type() != bt || odims.size() != 2 || odims[0] != bdims[0] ||
      odims[1] != bdims[1]) {
    return Invalid(kScatterAddName, "type", "result 0",
                   DtypeName(bt) + DimsString(bdims) + " (the buffer's)",
                   DtypeName(out.element_type()) + DimsString(odims));
  }
  if (buffer.size_bytes() > 0 && out.untyped_data() != buffer.untyped_data()) {
    return Invalid(kScatterAddName, "alias", "result 0",
                   "the buffer of input 0 (input_output_aliases {0: 0}, donated)",
                   "a different buffer");
  }
  shape->num_rows = bdims[0];
  shape->dim = bdims[1];
  shape->num_ids = static_cast<int64_t>(ids.element_count());
  shape->buffer_type = bt;
  shape->rows_type = rt;
  return ffi::Error::Success();
}

// What a bf16 buffer needs beside it (an f32 buffer needs none of it): the fp32 sum of each
// distinct valid id ("slot", in order of first appearance), the map V -> slot (-1: none; all -1
// between calls) and each chunk's ids' slots. Pageable host memory, kept by its owner (the CUDA
// handler: one per call site and device) across calls; only `Reserve` allocates.
struct ScatterAddScratch {
  // Room for a call of shape `s` whose chunks have at most `max_chunk_ids` ids: sums for
  // min(N, V) slots (allocated uninitialised, so only the slots a call uses are touched), a
  // V-entry map, `max_chunk_ids` chunk slots. Keeps what it has where it is large enough.
  xla::ffi::Error Reserve(const ScatterAddShape& s, int64_t max_chunk_ids);
  // Whether Reserve(s, max_chunk_ids) would keep every array (allocate nothing).
  bool Fits(const ScatterAddShape& s, int64_t max_chunk_ids) const;

  std::unique_ptr<float[]> sums;        // [slot_capacity, D]
  std::unique_ptr<int32_t[]> row_slot;  // [map_capacity], row -> slot or -1
  std::unique_ptr<int32_t[]> slot_row;  // [slot_capacity], slot -> row
  // [chunk_capacity]: per id of a chunk, its slot (+ 2^32 at the slot's first id) or -1.
  std::unique_ptr<int64_t[]> chunk_slot;
  int64_t sums_capacity = 0;  // elements of `sums`
  int64_t slot_capacity = 0;
  int64_t map_capacity = 0;
  int64_t chunk_capacity = 0;
  int64_t num_slots = 0;  // used by the current call
};

// The host-side scatter-add, in three steps over host memory (`buffer`, `ids`, `rows` readable
// and, for the buffer, writable by the CPU): Begin zeroes an f32 buffer; Chunk adds `count`
// consecutive ids and their rows (chunks in the order of n: the CUDA handler's staged pieces, or
// the whole of them at once) into it, or for a bf16 buffer into the fp32 sums; End writes a bf16
// buffer once, whole: each sum rounded once into its row, zeros elsewhere. Large steps run on
// jaxtier's CPU thread pool (op_program.h); each row's additions stay in the order of n. Call with
// IEEE floating point (host_update::ScopedIeeeFloatingPoint) for the documented bits. A bf16
// buffer needs `scratch` reserved for the call (Reserve); nothing here allocates.
void ScatterAddBegin(const ScatterAddShape& s, void* buffer, ScatterAddScratch* scratch);
void ScatterAddChunk(const ScatterAddShape& s, void* buffer, const int32_t* ids,
                     const void* rows, int64_t count, ScatterAddScratch* scratch);
void ScatterAddEnd(const ScatterAddShape& s, void* buffer, ScatterAddScratch* scratch);

}  // namespace jaxtier::dha

#endif  // JAXTIER_XLA_FFI_SRC_DHA_H_
