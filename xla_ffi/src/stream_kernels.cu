// CUDA handlers of the streaming custom calls `jaxtier_stream_{fetch,wait,send}_ffi` (operands,
// results and attributes: stream.h; contract: docs/design.md, "Streaming: fetch / wait / send").
// No kernels: the copy engines move the bytes (cudaMemcpyAsync), ordered by events.
//
// Streams. Each device has two jaxtier copy streams, h2d (fetch) and d2h (send), created
// cudaStreamNonBlocking on first use and shared by every fetch / wait / send of every executable
// on that device (a process-global registry). They are never destroyed: a stream may be in use
// until the process ends, and destroying it from a static destructor would run after the CUDA
// runtime has been torn down. One mutex per device is held while a call enqueues its event
// record, its stream wait and its copies, so that a call's work is contiguous on the stream and
// "every copy issued so far" (wait) is well defined.
//
// Events. Each instance of a custom call (one per call site of an executable) owns its events,
// one per device, in FFI state made by the instantiate stage (cudaEventDisableTiming). A call
// records its event and makes the other stream wait for it before it releases the device mutex;
// cudaStreamWaitEvent captures the event as recorded at that moment, so re-recording it in a
// later call is safe.
//
//   fetch  record(ev, XLA's stream); h2d waits for ev (the destination buffers may be memory
//          that XLA reused: its earlier readers precede the call on XLA's stream); one
//          cudaMemcpyAsync per leaf, host_leaf + index * slice_bytes -> result, on h2d.
//   wait   record(ev, the direction's jaxtier stream); XLA's stream waits for ev: everything
//          jaxtier issued on that device in that direction is complete before XLA's next op.
//   send   record(ev, XLA's stream); d2h waits for ev (the values are computed); one
//          cudaMemcpyAsync per leaf, value -> host_leaf + index * slice_bytes, on d2h.
//
// Copies use cudaMemcpyDefault (unified addressing): a leaf in pinned host memory is the real
// use, but a leaf in device memory works too (a device-to-device copy on the same stream).
//
// Pass-through results (fetch's `after`, wait's `arrays`) alias their operands
// (input_output_aliases): the handler checks that the pointers are equal and then has nothing to
// do. Should XLA not alias them (it always has), the handler copies device-to-device on XLA's
// stream, which keeps XLA's ordering (wait copies after its stream wait, so an unaliased fetched
// slice is read only once complete). send's results must alias the host leaves: an unaliased
// result is an error (stream.h, PrepareSend).
//
// Not kCmdBufferCompatible: the handlers use their own streams and event waits, which XLA's
// command-buffer (CUDA graph) capture of its own stream cannot represent.
// No nanobind here: module.cc registers the symbols.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ffi_helpers.h"
#include "handlers.h"
#include "stream.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtier {
namespace {

// jaxtier's copy streams of one device, indexed by stream::Direction.
struct CopyStreams {
  std::mutex mu;  // held while one call enqueues its event record, stream wait and copies
  cudaStream_t stream[2] = {};
};

// Creates the copy streams of `device` (the current device) in `streams`.
ffi::Error CreateCopyStreams(const char* op, int device, CopyStreams* streams) {
  for (cudaStream_t& s : streams->stream) {
    JT_CUDA_CHECK(op, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                  "a jaxtier copy stream of device " + std::to_string(device));
  }
  return ffi::Error::Success();
}

// The copy streams of `device` (the current device), created on first use. Never freed.
ffi::Error GetCopyStreams(const char* op, int device, CopyStreams** out) {
  static std::mutex registry_mu;
  static std::vector<CopyStreams*>* registry = new std::vector<CopyStreams*>();
  std::lock_guard<std::mutex> lock(registry_mu);
  if (registry->size() <= static_cast<size_t>(device)) registry->resize(device + 1, nullptr);
  CopyStreams*& slot = (*registry)[device];
  if (slot == nullptr) {
    auto streams = std::make_unique<CopyStreams>();
    if (ffi::Error error = CreateCopyStreams(op, device, streams.get()); error.failure()) {
      // Undo the streams made before the failure (their errors, if any, are not the one to
      // report).
      for (cudaStream_t made : streams->stream) {
        if (made != nullptr) (void)cudaStreamDestroy(made);
      }
      return error;
    }
    slot = streams.release();
  }
  *out = slot;
  return ffi::Error::Success();
}

// Makes `device` the current device for the scope of a call, when it is not already (XLA sets
// it before it runs a handler; this only guards the streams and events, which belong to one
// device, against a thread whose current device differs).
class ScopedDevice {
 public:
  ScopedDevice() = default;
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  ~ScopedDevice() {
    if (switched_) (void)cudaSetDevice(previous_);  // nothing can report an error here
  }

  ffi::Error Enter(const char* op, int device) {
    if (device < 0) return Internal(op, "invalid device ordinal " + std::to_string(device));
    JT_CUDA_CHECK(op, cudaGetDevice(&previous_), "");
    if (previous_ != device) {
      JT_CUDA_CHECK(op, cudaSetDevice(device), "device " + std::to_string(device));
      switched_ = true;
    }
    return ffi::Error::Success();
  }

 private:
  int previous_ = -1;
  bool switched_ = false;
};

// Per-instance state (one per custom call of an executable), made by the instantiate stage.
struct StreamState {
  static ffi::TypeId id;

  StreamState() = default;
  StreamState(const StreamState&) = delete;
  StreamState& operator=(const StreamState&) = delete;
  ~StreamState() {
    // Runs when XLA frees the executable, possibly at process exit: errors are ignored. An event
    // still pending is released by CUDA once it completes.
    for (cudaEvent_t e : events) {
      if (e != nullptr) (void)cudaEventDestroy(e);
    }
    (void)cudaGetLastError();  // leave no error of ours behind for a later check on this thread
  }

  // This instance's event on `device` (the current device), created on first use.
  ffi::Error Event(const char* op, int device, cudaEvent_t* out) {
    std::lock_guard<std::mutex> lock(mu);
    if (events.size() <= static_cast<size_t>(device)) events.resize(device + 1, nullptr);
    if (events[device] == nullptr) {
      JT_CUDA_CHECK(op, cudaEventCreateWithFlags(&events[device], cudaEventDisableTiming),
                    "the call site's event on device " + std::to_string(device));
    }
    *out = events[device];
    return ffi::Error::Success();
  }

  std::mutex mu;
  std::vector<cudaEvent_t> events;  // by device ordinal
};

ffi::TypeId StreamState::id = {};  // assigned by XLA when the type is registered

void DeleteStreamState(void* state) { delete static_cast<StreamState*>(state); }

bool AnyBytes(const std::vector<stream::Copy>& copies) {
  for (const stream::Copy& c : copies) {
    if (c.bytes > 0) return true;
  }
  return false;
}

// Pass-through results that XLA did not alias (never seen: input_output_aliases is honoured)
// are copied device-to-device on XLA's stream.
ffi::Error CopyUnaliasedPasses(const char* op, const stream::Plan& plan, cudaStream_t stream) {
  for (size_t i = 0; i < plan.passes.size(); ++i) {
    const stream::Copy& c = plan.passes[i];
    if (c.src == c.dst || c.bytes == 0) continue;
    JT_CUDA_CHECK(op, cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream),
                  "pass-through " + std::to_string(i) + ", not aliased by XLA, on XLA's stream");
  }
  return ffi::Error::Success();
}

// Orders `copy_stream` after the work enqueued so far on `xla_stream`, then enqueues `copies` on
// it. The caller holds the device's mutex.
ffi::Error EnqueueCopies(const char* op, cudaStream_t xla_stream, cudaEvent_t ev,
                         cudaStream_t copy_stream, const std::vector<stream::Copy>& copies,
                         int64_t index, const char* what) {
  JT_CUDA_CHECK(op, cudaEventRecord(ev, xla_stream), "on XLA's stream");
  JT_CUDA_CHECK(op, cudaStreamWaitEvent(copy_stream, ev, 0), "jaxtier copy stream on XLA's stream");
  for (size_t k = 0; k < copies.size(); ++k) {
    const stream::Copy& c = copies[k];
    if (c.bytes == 0) continue;
    JT_CUDA_CHECK(op, cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, copy_stream),
                  std::string(what) + ", leaf " + std::to_string(k) + ", slice " +
                      std::to_string(index) + ", " + std::to_string(c.bytes) + " bytes");
  }
  return ffi::Error::Success();
}

// `device`'s copy streams and this call site's event on it.
ffi::Error CopyResources(const char* op, int device, StreamState* state, CopyStreams** streams,
                         cudaEvent_t* ev) {
  JT_RETURN_IF_ERROR(GetCopyStreams(op, device, streams));
  return state->Event(op, device, ev);
}

ffi::ErrorOr<std::unique_ptr<StreamState>> StreamCudaInstantiateImpl() {
  return ffi::ErrorOr<std::unique_ptr<StreamState>>(std::make_unique<StreamState>());
}

ffi::Error StreamFetchCudaImpl(cudaStream_t xla_stream, int32_t device, StreamState* state,
                               ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t index,
                               int64_t num_leaves) {
  const char* op = stream::kFetchName;
  stream::Plan plan;
  JT_RETURN_IF_ERROR(stream::PrepareFetch(args, rets, index, num_leaves, &plan));
  ScopedDevice scoped;
  JT_RETURN_IF_ERROR(scoped.Enter(op, device));
  // `after` pass-throughs: computed on XLA's stream, so an unaliased one is copied there.
  JT_RETURN_IF_ERROR(CopyUnaliasedPasses(op, plan, xla_stream));
  if (!AnyBytes(plan.copies)) return ffi::Error::Success();
  CopyStreams* streams = nullptr;
  cudaEvent_t ev = nullptr;
  JT_RETURN_IF_ERROR(CopyResources(op, device, state, &streams, &ev));
  std::lock_guard<std::mutex> lock(streams->mu);
  return EnqueueCopies(op, xla_stream, ev, streams->stream[stream::kHostToDevice], plan.copies,
                       index, "host leaf slice -> device");
}

ffi::Error StreamWaitCudaImpl(cudaStream_t xla_stream, int32_t device, StreamState* state,
                              ffi::RemainingArgs args, ffi::RemainingRets rets,
                              int32_t direction) {
  const char* op = stream::kWaitName;
  stream::Plan plan;
  JT_RETURN_IF_ERROR(stream::PrepareWait(args, rets, direction, &plan));
  ScopedDevice scoped;
  JT_RETURN_IF_ERROR(scoped.Enter(op, device));
  CopyStreams* streams = nullptr;
  cudaEvent_t ev = nullptr;
  JT_RETURN_IF_ERROR(CopyResources(op, device, state, &streams, &ev));
  {
    std::lock_guard<std::mutex> lock(streams->mu);
    JT_CUDA_CHECK(op, cudaEventRecord(ev, streams->stream[direction]),
                  direction == stream::kHostToDevice ? "on jaxtier's h2d stream"
                                                     : "on jaxtier's d2h stream");
    JT_CUDA_CHECK(op, cudaStreamWaitEvent(xla_stream, ev, 0), "XLA's stream on a jaxtier stream");
  }
  // After the stream wait: an unaliased `arrays` operand may be a slice still being fetched.
  return CopyUnaliasedPasses(op, plan, xla_stream);
}

ffi::Error StreamSendCudaImpl(cudaStream_t xla_stream, int32_t device, StreamState* state,
                              ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t index) {
  const char* op = stream::kSendName;
  stream::Plan plan;
  JT_RETURN_IF_ERROR(stream::PrepareSend(args, rets, index, &plan));  // checks the aliasing
  if (!AnyBytes(plan.copies)) return ffi::Error::Success();
  ScopedDevice scoped;
  JT_RETURN_IF_ERROR(scoped.Enter(op, device));
  CopyStreams* streams = nullptr;
  cudaEvent_t ev = nullptr;
  JT_RETURN_IF_ERROR(CopyResources(op, device, state, &streams, &ev));
  std::lock_guard<std::mutex> lock(streams->mu);
  return EnqueueCopies(op, xla_stream, ev, streams->stream[stream::kDeviceToHost], plan.copies,
                       index, "device value -> host leaf slice");
}

}  // namespace

XLA_FFI_TypeId* StreamCudaStateTypeId() { return &StreamState::id; }

const XLA_FFI_TypeInfo* StreamCudaStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = {XLA_FFI_TypeInfo_STRUCT_SIZE, nullptr, &DeleteStreamState};
  return &info;
}

// One instantiate stage for the three targets: each call site gets its own StreamState.
XLA_FFI_DEFINE_HANDLER_SYMBOL(StreamCudaInstantiate, StreamCudaInstantiateImpl,
                              ffi::Ffi::BindInstantiate());

XLA_FFI_DEFINE_HANDLER_SYMBOL(StreamFetchCuda, StreamFetchCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Ctx<ffi::State<StreamState>>()            // state
                                  .RemainingArgs()                           // host leaves, after
                                  .RemainingRets()                           // slices, after
                                  .Attr<int64_t>("index")                    // index
                                  .Attr<int64_t>("num_leaves"));             // num_leaves

XLA_FFI_DEFINE_HANDLER_SYMBOL(StreamWaitCuda, StreamWaitCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Ctx<ffi::State<StreamState>>()            // state
                                  .RemainingArgs()                           // arrays, after
                                  .RemainingRets()                           // arrays
                                  .Attr<int32_t>("direction"));              // direction

XLA_FFI_DEFINE_HANDLER_SYMBOL(StreamSendCuda, StreamSendCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Ctx<ffi::State<StreamState>>()            // state
                                  .RemainingArgs()                           // host leaves, values
                                  .RemainingRets()                           // host leaves
                                  .Attr<int64_t>("index"));                  // index

}  // namespace jaxtier
