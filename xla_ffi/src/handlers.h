// XLA FFI handler symbols of jaxtier. Registered by module.cc (`registrations()`).

#ifndef JAXTIER_XLA_FFI_SRC_HANDLERS_H_
#define JAXTIER_XLA_FFI_SRC_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

namespace jaxtier {

// Target `jaxtier_host_update_ffi` on platform "cpu" (host_update.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateCpu);

// Targets `jaxtier_dha_gather_ffi` and `jaxtier_dha_matmul_ffi` on platform "cpu" (dha.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaMatmulCpu);

#if defined(JAXTIER_WITH_CUDA) && JAXTIER_WITH_CUDA
// Target `jaxtier_host_update_ffi` on platform "CUDA" (host_update_kernels.cu): the instantiate
// stage (creates the per-instance state) and the execute stage.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateCuda);

// Targets `jaxtier_dha_gather_ffi` and `jaxtier_dha_matmul_ffi` on platform "CUDA"
// (dha_kernels.cu): stateless, the kernels read the host operand in place.
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaGatherCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DhaMatmulCuda);

// The per-instance state type of the CUDA handler, registered with XLA (as
// "jaxtier_host_update_state", platform "CUDA") before the handler: its type id (XLA writes the
// assigned id into it) and its type info (the deleter).
XLA_FFI_TypeId* HostUpdateCudaStateTypeId();
const XLA_FFI_TypeInfo* HostUpdateCudaStateTypeInfo();
#endif

}  // namespace jaxtier

#endif  // JAXTIER_XLA_FFI_SRC_HANDLERS_H_
