// XLA FFI handler symbols of jaxtier. Registered by module.cc (`registrations()`).

#ifndef JAXTIER_XLA_FFI_SRC_HANDLERS_H_
#define JAXTIER_XLA_FFI_SRC_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

namespace jaxtier {

// Target `jaxtier_host_update_ffi` on platform "cpu" (host_update.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateCpu);
// Targets `jaxtier_host_update_{layer,join,release}_ffi` (host_update.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateLayerCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateJoinCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateReleaseCpu);

// Targets `jaxtier_stream_fetch_ffi`, `jaxtier_stream_wait_ffi`, `jaxtier_stream_send_ffi` on
// platform "cpu" (stream.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(StreamFetchCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(StreamWaitCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(StreamSendCpu);

// Targets `jaxtier_dha_gather_ffi`, `jaxtier_dha_matmul_ffi` and `jaxtier_dha_scatter_add_ffi`
// on platform "cpu" (dha.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaScatterAddCpu);

#if defined(JAXTIER_WITH_CUDA) && JAXTIER_WITH_CUDA
// Target `jaxtier_host_update_ffi` on platform "CUDA" (host_update_kernels.cu): the instantiate
// stage (creates the per-instance state) and the execute stage.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateCuda);
// Targets `jaxtier_host_update_{layer,join,release}_ffi` on "CUDA" (host_update_kernels.cu):
// stateless; the layer calls share per-device streams.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateLayerCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateJoinCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateReleaseCuda);

// Targets `jaxtier_dha_gather_ffi` and `jaxtier_dha_matmul_ffi` on platform "CUDA"
// (dha_kernels.cu): stateless, the kernels read the host operand in place.
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaGatherCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaMatmulCuda);
// Target `jaxtier_dha_scatter_add_ffi` on platform "CUDA" (dha_kernels.cu): the instantiate stage
// (per-instance state: streams, events, pinned staging) and the execute stage. Its state type is
// registered as "jaxtier_dha_scatter_add_state".
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaScatterAddCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaScatterAddCuda);
XLA_FFI_TypeId* DhaScatterAddCudaStateTypeId();
const XLA_FFI_TypeInfo* DhaScatterAddCudaStateTypeInfo();

// The per-instance state type of the CUDA handler, registered with XLA (as
// "jaxtier_host_update_state", platform "CUDA") before the handler: its type id (XLA writes the
// assigned id into it) and its type info (the deleter).
XLA_FFI_TypeId* HostUpdateCudaStateTypeId();
const XLA_FFI_TypeInfo* HostUpdateCudaStateTypeInfo();

// Targets `jaxtier_stream_{fetch,wait,send}_ffi` on platform "CUDA" (stream_kernels.cu): one
// instantiate stage shared by the three (it creates the per-instance state: the events) and an
// execute stage each. Their state type is registered as "jaxtier_stream_state".
XLA_FFI_DECLARE_HANDLER_SYMBOL(StreamCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(StreamFetchCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(StreamWaitCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(StreamSendCuda);
XLA_FFI_TypeId* StreamCudaStateTypeId();
const XLA_FFI_TypeInfo* StreamCudaStateTypeInfo();
#endif

}  // namespace jaxtier

#endif  // JAXTIER_XLA_FFI_SRC_HANDLERS_H_
