// CPU handlers of the DHA compute family (dha.h, docs/design.md "DHA compute"):
//   jaxtier_dha_gather_ffi   rows = table[ids] (zeros for ids outside [0, V))
//   jaxtier_dha_matmul_ffi   y = x @ w[index] (transpose 0) or x @ w[index]^T (transpose 1)
//
// On the CPU backend a pinned_host buffer is ordinary host memory: these are plain loops, the
// reference for the CUDA kernels (dha_kernels.cu). Matmul accumulates in fp32 and rounds y once.

#include <stdint.h>
#include <string.h>

#include <vector>

#include "dha.h"
#include "ffi_helpers.h"
#include "handlers.h"
#include "program.h"
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

}  // namespace

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

}  // namespace jaxtier
