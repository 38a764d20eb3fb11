// The streaming custom calls (`jaxtier_stream_{fetch,wait,send}_ffi`): what a call copies, as
// decoded and validated from its operands, results and attributes. Shared by the CPU handlers
// (stream.cc) and the CUDA handlers (stream_kernels.cu); the contract is in docs/design.md
// ("Streaming: fetch / wait / send") and the Python side is jaxtier/_src/primitives/stream.py.
//
//   fetch  operands: host_leaves[0..n) [L_k, ...], after[0..m)
//          results:  slices[0..n) (host_leaves[k].shape[1:]), after[0..m) (aliased, in place)
//          attributes: index (int64, in [0, L_k) for every k), num_leaves (int64, n)
//          copies: host_leaves[k] bytes [index * S_k, (index + 1) * S_k) -> slices[k]
//   wait   operands: arrays[0..n), after[0..m) (order-only, not read)
//          results:  arrays[0..n) (aliased, in place)
//          attributes: direction (int32: 0 h2d, 1 d2h)
//   send   operands: host_leaves[0..n) [L_k, ...], values[0..n) (host_leaves[k].shape[1:])
//          results:  host_leaves[0..n) (aliased, in place: the leaves must be donated)
//          attributes: index (int64, in [0, L_k) for every k)
//          copies: values[k] -> host_leaves[k] bytes [index * S_k, (index + 1) * S_k)
//
// S_k is the byte size of one slice of leaf k (its byte size / L_k). The header compiles with a
// plain C++17 compiler and with nvcc; no CUDA in here.

#ifndef JAXTIER_XLA_FFI_SRC_STREAM_H_
#define JAXTIER_XLA_FFI_SRC_STREAM_H_

#include <stddef.h>
#include <stdint.h>

#include <optional>
#include <string>
#include <vector>

#include "ffi_helpers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxtier {
namespace stream {

enum Direction : int32_t { kHostToDevice = 0, kDeviceToHost = 1 };

// One byte copy. For a pass-through (an aliased result), src == dst when XLA aliased the
// buffers as asked, and then nothing is copied.
struct Copy {
  const void* src;
  void* dst;
  size_t bytes;
};

// What one call does: `copies` are the transfers (fetch: host -> device, send: device -> host);
// `passes` the aliased pass-through results.
struct Plan {
  std::vector<Copy> copies;
  std::vector<Copy> passes;
};

namespace internal {

// Checks that operand i and result r are the same array type and adds the pass-through.
inline xla::ffi::Error AddPass(const char* op, xla::ffi::RemainingArgs args, size_t i,
                               xla::ffi::RemainingRets rets, size_t r, Plan* plan) {
  std::optional<xla::ffi::AnyBuffer> in_buf, out_buf;
  JT_RETURN_IF_ERROR(GetArg(op, args, i, "input " + std::to_string(i), &in_buf));
  JT_RETURN_IF_ERROR(GetRet(op, rets, r, "result " + std::to_string(r), &out_buf));
  const xla::ffi::AnyBuffer& in = *in_buf;
  const xla::ffi::AnyBuffer& out = *out_buf;
  if (in.element_type() != out.element_type() || in.size_bytes() != out.size_bytes()) {
    return Invalid(op, "type", "result " + std::to_string(r),
                   "the type of input " + std::to_string(i) + " (" +
                       DtypeName(in.element_type()) + ", " + std::to_string(in.size_bytes()) +
                       " bytes), which it aliases",
                   DtypeName(out.element_type()) + ", " + std::to_string(out.size_bytes()) +
                       " bytes");
  }
  plan->passes.push_back(Copy{in.untyped_data(), out.untyped_data(), in.size_bytes()});
  return xla::ffi::Error::Success();
}

// Checks a stacked leaf and a slice-shaped array against each other and `index`; sets the
// byte offset and size of slice `index` of the leaf.
inline xla::ffi::Error CheckSlice(const char* op, const xla::ffi::AnyBuffer& leaf,
                                  const std::string& leaf_name,
                                  const xla::ffi::AnyBuffer& slice,
                                  const std::string& slice_name, int64_t index, size_t* offset,
                                  size_t* bytes) {
  const auto dims = leaf.dimensions();
  if (dims.size() < 1) {
    return Invalid(op, "rank", leaf_name, "a stacked array [L, ...] (rank >= 1)", "rank 0");
  }
  const int64_t num_slices = dims[0];
  if (index < 0 || index >= num_slices) {
    return Invalid(op, "value", "attribute index (" + leaf_name + " has L = " +
                                    std::to_string(num_slices) + ")",
                   "a value in [0, " + std::to_string(num_slices) + ")", std::to_string(index));
  }
  const auto sdims = slice.dimensions();
  bool same = sdims.size() + 1 == dims.size();
  for (size_t d = 0; same && d < sdims.size(); ++d) same = sdims[d] == dims[d + 1];
  if (!same) {
    return Invalid(op, "shape", slice_name,
                   DimsString(dims, 1) + " (a slice of " + leaf_name + " " + DimsString(dims) + ")",
                   DimsString(sdims));
  }
  if (slice.element_type() != leaf.element_type()) {
    return Invalid(op, "dtype", slice_name,
                   "the dtype of " + leaf_name + " (" + DtypeName(leaf.element_type()) + ")",
                   DtypeName(slice.element_type()));
  }
  *bytes = leaf.size_bytes() / static_cast<size_t>(num_slices);
  if (*bytes != slice.size_bytes()) {
    return Invalid(op, "byte size", slice_name,
                   std::to_string(*bytes) + " bytes (one slice of " + leaf_name + ")",
                   std::to_string(slice.size_bytes()));
  }
  *offset = static_cast<size_t>(index) * *bytes;
  return xla::ffi::Error::Success();
}

}  // namespace internal

inline constexpr const char kFetchName[] = "jaxtier_stream_fetch";
inline constexpr const char kWaitName[] = "jaxtier_stream_wait";
inline constexpr const char kSendName[] = "jaxtier_stream_send";

// fetch: n = num_leaves stacked leaves, then the `after` pass-throughs.
inline xla::ffi::Error PrepareFetch(xla::ffi::RemainingArgs args, xla::ffi::RemainingRets rets,
                                    int64_t index, int64_t num_leaves, Plan* plan) {
  const char* op = kFetchName;
  const int64_t num_args = static_cast<int64_t>(args.size());
  if (static_cast<int64_t>(rets.size()) != num_args) {
    return Invalid(op, "number of results", "the call",
                   std::to_string(num_args) + " (one per input)", std::to_string(rets.size()));
  }
  if (num_leaves < 0 || num_leaves > num_args) {
    return Invalid(op, "value", "attribute num_leaves",
                   "a value in [0, " + std::to_string(num_args) + "]",
                   std::to_string(num_leaves));
  }
  plan->copies.clear();
  plan->passes.clear();
  for (int64_t k = 0; k < num_leaves; ++k) {
    std::optional<xla::ffi::AnyBuffer> leaf, slice;
    const std::string leaf_name = "input " + std::to_string(k) + " (host leaf " +
                                  std::to_string(k) + ")";
    const std::string slice_name = "result " + std::to_string(k);
    JT_RETURN_IF_ERROR(GetArg(op, args, k, leaf_name, &leaf));
    JT_RETURN_IF_ERROR(GetRet(op, rets, k, slice_name, &slice));
    size_t offset = 0, bytes = 0;
    JT_RETURN_IF_ERROR(
        internal::CheckSlice(op, *leaf, leaf_name, *slice, slice_name, index, &offset, &bytes));
    plan->copies.push_back(Copy{static_cast<const char*>(leaf->untyped_data()) + offset,
                                slice->untyped_data(), bytes});
  }
  for (int64_t i = num_leaves; i < num_args; ++i) {
    JT_RETURN_IF_ERROR(internal::AddPass(op, args, i, rets, i, plan));
  }
  return xla::ffi::Error::Success();
}

// wait: results pass through the first operands; the rest of the operands are order-only.
inline xla::ffi::Error PrepareWait(xla::ffi::RemainingArgs args, xla::ffi::RemainingRets rets,
                                   int32_t direction, Plan* plan) {
  const char* op = kWaitName;
  if (direction != kHostToDevice && direction != kDeviceToHost) {
    return Invalid(op, "value", "attribute direction", "0 (h2d) or 1 (d2h)",
                   std::to_string(direction));
  }
  if (rets.size() > args.size()) {
    return Invalid(op, "number of results", "the call",
                   "at most the number of inputs (" + std::to_string(args.size()) + ")",
                   std::to_string(rets.size()));
  }
  plan->copies.clear();
  plan->passes.clear();
  for (size_t r = 0; r < rets.size(); ++r) {
    JT_RETURN_IF_ERROR(internal::AddPass(op, args, r, rets, r, plan));
  }
  return xla::ffi::Error::Success();
}

// send: n stacked leaves, then n values; results are the leaves, in place. A result that is
// not its leaf's buffer is an error (the slice would be written into a copy that XLA made).
inline xla::ffi::Error PrepareSend(xla::ffi::RemainingArgs args, xla::ffi::RemainingRets rets,
                                   int64_t index, Plan* plan) {
  const char* op = kSendName;
  const size_t n = rets.size();
  if (args.size() != 2 * n) {
    return Invalid(op, "number of inputs", "the call",
                   std::to_string(2 * n) + " (the " + std::to_string(n) +
                       " host leaves, then one value per leaf)",
                   std::to_string(args.size()));
  }
  plan->copies.clear();
  plan->passes.clear();
  for (size_t k = 0; k < n; ++k) {
    std::optional<xla::ffi::AnyBuffer> leaf_buf, value_buf, out_buf;
    const std::string leaf_name = "input " + std::to_string(k) + " (host leaf " +
                                  std::to_string(k) + ")";
    const std::string value_name = "input " + std::to_string(n + k) + " (value " +
                                   std::to_string(k) + ")";
    JT_RETURN_IF_ERROR(GetArg(op, args, k, leaf_name, &leaf_buf));
    JT_RETURN_IF_ERROR(GetArg(op, args, n + k, value_name, &value_buf));
    JT_RETURN_IF_ERROR(GetRet(op, rets, k, "result " + std::to_string(k), &out_buf));
    const xla::ffi::AnyBuffer& leaf = *leaf_buf;
    const xla::ffi::AnyBuffer& value = *value_buf;
    const xla::ffi::AnyBuffer& out = *out_buf;
    size_t offset = 0, bytes = 0;
    JT_RETURN_IF_ERROR(
        internal::CheckSlice(op, leaf, leaf_name, value, value_name, index, &offset, &bytes));
    if (out.element_type() != leaf.element_type() ||
        out.size_bytes() != leaf.size_bytes()) {
      return Invalid(op, "type", "result " + std::to_string(k),
                     "the type of " + leaf_name + ", which it aliases", "another type");
    }
    if (out.untyped_data() != leaf.untyped_data()) {
      return Invalid(op, "buffer", "result " + std::to_string(k),
                     "the buffer of " + leaf_name +
                         " (the host leaf must be donated to the enclosing jit and aliased "
                         "by input_output_aliases, so that the slice is written in place)",
                     "a different buffer");
    }
    plan->copies.push_back(
        Copy{value.untyped_data(), static_cast<char*>(out.untyped_data()) + offset, bytes});
  }
  return xla::ffi::Error::Success();
}

}  // namespace stream
}  // namespace jaxtier

#endif  // JAXTIER_XLA_FFI_SRC_STREAM_H_
