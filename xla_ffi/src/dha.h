// DHA compute (direct host access): the shapes and checks shared by the CPU handlers (dha.cc)
// and the CUDA handlers (dha_kernels.cu) of
//
//   jaxtier_dha_gather_ffi   rows[..., D] = table[ids[...], :]       (table [V, D])
//   jaxtier_dha_matmul_ffi   y[M, O] = x[M, R] @ B                   (B = w[index] or w[index]^T)
//
// The contract is docs/design.md ("DHA compute: gather and matmul on host operands"); the Python
// side is jaxtier/_src/primitives/dha.py. The table / weight is usually a pinned_host buffer
// that the CUDA kernels read in place over PCIe; nothing here depends on where it lives.
//
// Compiles with a plain C++17 compiler and with nvcc (host code only).

#ifndef JAXTIER_XLA_FFI_SRC_DHA_H_
#define JAXTIER_XLA_FFI_SRC_DHA_H_

#include <stdint.h>

#include <string>

#include "ffi_helpers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxtier::dha {

inline constexpr char kGatherName[] = "jaxtier_dha_gather";
inline constexpr char kMatmulName[] = "jaxtier_dha_matmul";

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

}  // namespace jaxtier::dha

#endif  // JAXTIER_XLA_FFI_SRC_DHA_H_
