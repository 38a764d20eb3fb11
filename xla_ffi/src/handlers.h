// XLA FFI handler symbols of jaxtier. Registered by module.cc (`registrations()`).

#ifndef JAXTIER_XLA_FFI_SRC_HANDLERS_H_
#define JAXTIER_XLA_FFI_SRC_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

namespace jaxtier {

// Target `jaxtier_host_update_ffi` on platform "cpu" (host_update.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateCpu);

#if defined(JAXTIER_WITH_CUDA) && JAXTIER_WITH_CUDA
// Target `jaxtier_host_update_ffi` on platform "CUDA" (host_update_kernels.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(HostUpdateCuda);
#endif

}  // namespace jaxtier

#endif  // JAXTIER_XLA_FFI_SRC_HANDLERS_H_
