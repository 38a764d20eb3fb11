// Helpers shared by every handler family (host_update, stream, dha): error construction, the
// checks of operands and results that several families make, and the one macro that checks a
// CUDA runtime call (JT_CUDA_CHECK, compiled only by nvcc).
//
// Errors a caller can fix are InvalidArgument errors worded
//   "Invalid <what> for <where> to <op>. Expected <expected>, got <got>."
// e.g. "Invalid dtype for input 0 (table) to jaxtier_dha_gather. Expected float32, bfloat16 or
// float16, got int32." Failures of the runtime are Internal errors starting "<op>: ".
//
// The header compiles with a plain C++17 compiler and with nvcc.

#ifndef JAXTIER_XLA_FFI_SRC_FFI_HELPERS_H_
#define JAXTIER_XLA_FFI_SRC_FFI_HELPERS_H_

#include <stddef.h>
#include <stdint.h>

#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"

// Returns the xla::ffi::Error of `expr` from the enclosing function when it is a failure.
#define JT_RETURN_IF_ERROR(expr)                                     \
  do {                                                               \
    if (::xla::ffi::Error jt_error_ = (expr); jt_error_.failure()) { \
      return jt_error_;                                              \
    }                                                                \
  } while (0)

namespace jaxtier {

// "Invalid <what> for <where> to <op>. Expected <expected>, got <got>.", as InvalidArgument.
inline xla::ffi::Error Invalid(const char* op, const std::string& what, const std::string& where,
                               const std::string& expected, const std::string& got) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument,
                         "Invalid " + what + " for " + where + " to " + op + ". Expected " +
                             expected + ", got " + got + ".");
}

// "<op>: <message>", as Internal: a failure that no operand or attribute of the call explains.
inline xla::ffi::Error Internal(const char* op, const std::string& message) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal, std::string(op) + ": " + message);
}

// The NumPy name of a dtype ("float32", "bfloat16", ...), or "dtype code <n>".
inline std::string DtypeName(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32:
      return "float32";
    case xla::ffi::DataType::BF16:
      return "bfloat16";
    case xla::ffi::DataType::F16:
      return "float16";
    case xla::ffi::DataType::F64:
      return "float64";
    case xla::ffi::DataType::S32:
      return "int32";
    case xla::ffi::DataType::S64:
      return "int64";
    case xla::ffi::DataType::PRED:
      return "bool";
    default:
      return "dtype code " + std::to_string(static_cast<int>(t));
  }
}

// "[d_from, ..., d_last]": a shape, or the part of it from dimension `from` on.
inline std::string DimsString(xla::ffi::Span<const int64_t> dims, size_t from = 0) {
  std::string s = "[";
  for (size_t i = from; i < dims.size(); ++i) {
    if (i > from) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// The storage dtypes of the elementwise handlers: float32, bfloat16, float16.
inline bool IsFloatStorage(xla::ffi::DataType t) {
  return t == xla::ffi::DataType::F32 || t == xla::ffi::DataType::BF16 ||
         t == xla::ffi::DataType::F16;
}

// An error unless `t` (the dtype of `where`) is one of the float storage dtypes.
inline xla::ffi::Error CheckFloatStorage(const char* op, const std::string& where,
                                         xla::ffi::DataType t) {
  if (IsFloatStorage(t)) return xla::ffi::Error::Success();
  return Invalid(op, "dtype", where, "float32, bfloat16 or float16", DtypeName(t));
}

// Operand i of a variadic call as an array (`where` names it in the error).
inline xla::ffi::Error GetArg(const char* op, xla::ffi::RemainingArgs args, size_t i,
                              const std::string& where, std::optional<xla::ffi::AnyBuffer>* out) {
  xla::ffi::ErrorOr<xla::ffi::AnyBuffer> buf = args.get<xla::ffi::AnyBuffer>(i);
  if (buf.has_error()) return Invalid(op, "type", where, "an array", "something else");
  out->emplace(*buf);
  return xla::ffi::Error::Success();
}

// Result r of a variadic call as an array (`where` names it in the error).
inline xla::ffi::Error GetRet(const char* op, xla::ffi::RemainingRets rets, size_t r,
                              const std::string& where, std::optional<xla::ffi::AnyBuffer>* out) {
  xla::ffi::ErrorOr<xla::ffi::Result<xla::ffi::AnyBuffer>> buf =
      rets.get<xla::ffi::AnyBuffer>(r);
  if (buf.has_error()) return Invalid(op, "type", where, "an array", "something else");
  out->emplace(**buf);
  return xla::ffi::Error::Success();
}

}  // namespace jaxtier

#if defined(__CUDACC__)
#include <cuda_runtime.h>

namespace jaxtier {

// The file name of a path (for __FILE__, which may be absolute).
constexpr const char* FileName(const char* path) {
  const char* name = path;
  for (const char* p = path; *p != '\0'; ++p) {
    if (*p == '/') name = p + 1;
  }
  return name;
}

// "<op>: <call> failed (<what>) at <file>:<line>: <cudaGetErrorName>: <cudaGetErrorString>",
// as Internal; without the parenthesis when `what` is empty.
inline xla::ffi::Error CudaError(const char* op, const char* call, const std::string& what,
                                 const char* file, int line, cudaError_t e) {
  return Internal(op, std::string(call) + " failed" + (what.empty() ? "" : " (" + what + ")") +
                          " at " + FileName(file) + ":" + std::to_string(line) + ": " +
                          cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

}  // namespace jaxtier

// Checks one CUDA runtime call: returns CudaError (the op, the call as written, `what`, the
// file and line, CUDA's error) from the enclosing function, which returns xla::ffi::Error, when
// `call` does not return cudaSuccess. `what` says what the call was for ("" for nothing more);
// it is evaluated only on failure. A kernel launch is checked with
//   JT_CUDA_CHECK(op, cudaGetLastError(), "launch of <kernel>");
#define JT_CUDA_CHECK(op, call, what)                                                 \
  do {                                                                                \
    if (const cudaError_t jt_cuda_error_ = (call); jt_cuda_error_ != cudaSuccess) {   \
      return ::jaxtier::CudaError(op, #call, what, __FILE__, __LINE__, jt_cuda_error_); \
    }                                                                                 \
  } while (0)

#endif  // defined(__CUDACC__)

#endif  // JAXTIER_XLA_FFI_SRC_FFI_HELPERS_H_
