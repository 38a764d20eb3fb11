// CPU handlers of the streaming custom calls `jaxtier_stream_{fetch,wait,send}_ffi` (operands,
// results and attributes: stream.h; contract: docs/design.md, "Streaming: fetch / wait /
// send"). On the CPU there is no link to overlap: fetch and send copy synchronously with
// memcpy, and wait has nothing to wait for. The semantics (what ends up in which buffer) are the
// CUDA handlers' (stream_kernels.cu), which run the same copies asynchronously.

#include <cstdint>
#include <cstring>

#include "ffi_helpers.h"
#include "handlers.h"
#include "stream.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtier {
namespace {

void Run(const stream::Plan& plan) {
  // Pass-throughs first: they are only copied when XLA did not alias the buffers (it does when
  // it honours input_output_aliases, always so far). No copy overlaps a pass-through buffer.
  for (const stream::Copy& c : plan.passes) {
    if (c.src != c.dst && c.bytes > 0) std::memcpy(c.dst, c.src, c.bytes);
  }
  for (const stream::Copy& c : plan.copies) {
    if (c.bytes > 0) std::memcpy(c.dst, c.src, c.bytes);
  }
}

ffi::Error StreamFetchCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t index,
                              int64_t num_leaves) {
  stream::Plan plan;
  JT_RETURN_IF_ERROR(stream::PrepareFetch(args, rets, index, num_leaves, &plan));
  Run(plan);
  return ffi::Error::Success();
}

ffi::Error StreamWaitCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                             int32_t direction) {
  stream::Plan plan;
  JT_RETURN_IF_ERROR(stream::PrepareWait(args, rets, direction, &plan));
  Run(plan);
  return ffi::Error::Success();
}

ffi::Error StreamSendCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t index) {
  stream::Plan plan;
  JT_RETURN_IF_ERROR(stream::PrepareSend(args, rets, index, &plan));
  Run(plan);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StreamFetchCpu, StreamFetchCpuImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()                // host leaves, after
                                  .RemainingRets()                // slices, after
                                  .Attr<int64_t>("index")         // index
                                  .Attr<int64_t>("num_leaves"));  // num_leaves

XLA_FFI_DEFINE_HANDLER_SYMBOL(StreamWaitCpu, StreamWaitCpuImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()                // arrays, after
                                  .RemainingRets()                // arrays
                                  .Attr<int32_t>("direction"));   // direction

XLA_FFI_DEFINE_HANDLER_SYMBOL(StreamSendCpu, StreamSendCpuImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()                // host leaves, values
                                  .RemainingRets()                // host leaves
                                  .Attr<int64_t>("index"));       // index

}  // namespace jaxtier
