// Checked CUDA runtime calls for the CUDA handlers (stream_kernels.cu, dha_kernels.cu): a failed
// call becomes an ffi::Error naming the handler, the call and CUDA's error name and string.
//
//   JT_CUDA_CHECK(op, cudaMemcpyAsync(...), "cudaMemcpyAsync (what it copies)");

#ifndef JAXTIER_XLA_FFI_SRC_CUDA_CHECK_H_
#define JAXTIER_XLA_FFI_SRC_CUDA_CHECK_H_

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxtier {

// "<op>: <what> failed: <cudaGetErrorName>: <cudaGetErrorString>", as an internal error.
inline xla::ffi::Error CudaError(const char* op, const std::string& what, cudaError_t e) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal,
                         std::string(op) + ": " + what + " failed: " + cudaGetErrorName(e) +
                             ": " + cudaGetErrorString(e));
}

}  // namespace jaxtier

// Returns CudaError(op, what, e) from the enclosing handler when `expr` is not cudaSuccess.
#define JT_CUDA_CHECK(op, expr, what)                                                    \
  do {                                                                                   \
    const cudaError_t jt_cuda_error = (expr);                                            \
    if (jt_cuda_error != cudaSuccess) return ::jaxtier::CudaError(op, what, jt_cuda_error); \
  } while (0)

#endif  // JAXTIER_XLA_FFI_SRC_CUDA_CHECK_H_
