// Python module `_jaxtier_ffi`: hands the XLA FFI handlers to Python as capsules.
//
//   registrations() -> {"cpu": {"jaxtier_host_update_ffi": capsule,
//                               "jaxtier_host_update_{layer,join,release}_ffi": capsule,
//                               "jaxtier_stream_fetch_ffi": capsule, (wait, send alike),
//                               "jaxtier_dha_gather_ffi": capsule,
//                               "jaxtier_dha_matmul_ffi": capsule,
//                               "jaxtier_dha_scatter_add_ffi": capsule},
//                       "CUDA": {"jaxtier_host_update_ffi": {"instantiate": capsule,
//                                                            "execute": capsule},
//                                "jaxtier_host_update_{layer,join,release}_ffi": capsule,
//                                "jaxtier_stream_fetch_ffi": {"instantiate": ..., (alike)},
//                                "jaxtier_dha_gather_ffi": capsule,
//                                "jaxtier_dha_matmul_ffi": capsule,
//                                "jaxtier_dha_scatter_add_ffi": {"instantiate": ...,
//                                                                "execute": ...}}}
//                      # "CUDA" only in a build with CUDA
//   state_types() -> {"CUDA": {"jaxtier_host_update_state": {"type_id": capsule,
//                                                              "type_info": capsule},
//                              "jaxtier_stream_state": {...},
//                              "jaxtier_dha_scatter_add_state": {...}}}
//                      # {} without CUDA; register these (jax.ffi.register_ffi_type) BEFORE the
//                      # handlers: XLA checks a stateful handler's type when it is registered
//   has_cuda() -> bool

#include <type_traits>
#include <utility>

#include <nanobind/nanobind.h>

#include "handlers.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace jaxtier {
namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

constexpr bool kHasCuda =
#if defined(JAXTIER_WITH_CUDA) && JAXTIER_WITH_CUDA
    true;
#else
    false;
#endif

nb::dict Registrations() {
  nb::dict registrations;
  nb::dict cpu;
  cpu["jaxtier_host_update_ffi"] = EncapsulateFfiHandler(HostUpdateCpu);
  cpu["jaxtier_host_update_layer_ffi"] = EncapsulateFfiHandler(HostUpdateLayerCpu);
  cpu["jaxtier_host_update_join_ffi"] = EncapsulateFfiHandler(HostUpdateJoinCpu);
  cpu["jaxtier_host_update_release_ffi"] = EncapsulateFfiHandler(HostUpdateReleaseCpu);
  cpu["jaxtier_stream_fetch_ffi"] = EncapsulateFfiHandler(StreamFetchCpu);
  cpu["jaxtier_stream_wait_ffi"] = EncapsulateFfiHandler(StreamWaitCpu);
  cpu["jaxtier_stream_send_ffi"] = EncapsulateFfiHandler(StreamSendCpu);
  cpu["jaxtier_dha_gather_ffi"] = EncapsulateFfiHandler(DhaGatherCpu);
  cpu["jaxtier_dha_matmul_ffi"] = EncapsulateFfiHandler(DhaMatmulCpu);
  cpu["jaxtier_dha_scatter_add_ffi"] = EncapsulateFfiHandler(DhaScatterAddCpu);
  registrations["cpu"] = cpu;
#if defined(JAXTIER_WITH_CUDA) && JAXTIER_WITH_CUDA
  nb::dict host_update_cuda;  // a stateful handler: one capsule per stage
  host_update_cuda["instantiate"] = EncapsulateFfiHandler(HostUpdateCudaInstantiate);
  host_update_cuda["execute"] = EncapsulateFfiHandler(HostUpdateCuda);
  nb::dict cuda;
  cuda["jaxtier_host_update_ffi"] = host_update_cuda;
  cuda["jaxtier_host_update_layer_ffi"] = EncapsulateFfiHandler(HostUpdateLayerCuda);
  cuda["jaxtier_host_update_join_ffi"] = EncapsulateFfiHandler(HostUpdateJoinCuda);
  cuda["jaxtier_host_update_release_ffi"] = EncapsulateFfiHandler(HostUpdateReleaseCuda);
  // The three streaming targets share one instantiate stage (and state type).
  const std::pair<const char*, XLA_FFI_Handler*> stream_targets[] = {
      {"jaxtier_stream_fetch_ffi", StreamFetchCuda},
      {"jaxtier_stream_wait_ffi", StreamWaitCuda},
      {"jaxtier_stream_send_ffi", StreamSendCuda}};
  for (const auto& [name, execute] : stream_targets) {
    nb::dict stages;
    stages["instantiate"] = EncapsulateFfiHandler(StreamCudaInstantiate);
    stages["execute"] = EncapsulateFfiHandler(execute);
    cuda[name] = stages;
  }
  cuda["jaxtier_dha_gather_ffi"] = EncapsulateFfiHandler(DhaGatherCuda);
  cuda["jaxtier_dha_matmul_ffi"] = EncapsulateFfiHandler(DhaMatmulCuda);
  nb::dict scatter_add_cuda;  // a stateful handler: one capsule per stage
  scatter_add_cuda["instantiate"] = EncapsulateFfiHandler(DhaScatterAddCudaInstantiate);
  scatter_add_cuda["execute"] = EncapsulateFfiHandler(DhaScatterAddCuda);
  cuda["jaxtier_dha_scatter_add_ffi"] = scatter_add_cuda;
  registrations["CUDA"] = cuda;
#endif
  return registrations;
}

nb::dict StateTypes() {
  nb::dict types;
#if defined(JAXTIER_WITH_CUDA) && JAXTIER_WITH_CUDA
  nb::dict host_update_state;
  host_update_state["type_id"] =
      nb::capsule(reinterpret_cast<void*>(HostUpdateCudaStateTypeId()));
  host_update_state["type_info"] = nb::capsule(
      const_cast<void*>(reinterpret_cast<const void*>(HostUpdateCudaStateTypeInfo())));
  nb::dict cuda;
  cuda["jaxtier_host_update_state"] = host_update_state;
  nb::dict stream_state;
  stream_state["type_id"] = nb::capsule(reinterpret_cast<void*>(StreamCudaStateTypeId()));
  stream_state["type_info"] = nb::capsule(
      const_cast<void*>(reinterpret_cast<const void*>(StreamCudaStateTypeInfo())));
  cuda["jaxtier_stream_state"] = stream_state;
  nb::dict scatter_add_state;
  scatter_add_state["type_id"] =
      nb::capsule(reinterpret_cast<void*>(DhaScatterAddCudaStateTypeId()));
  scatter_add_state["type_info"] = nb::capsule(
      const_cast<void*>(reinterpret_cast<const void*>(DhaScatterAddCudaStateTypeInfo())));
  cuda["jaxtier_dha_scatter_add_state"] = scatter_add_state;
  types["CUDA"] = cuda;
#endif
  return types;
}

}  // namespace
}  // namespace jaxtier

NB_MODULE(_jaxtier_ffi, m) {
  m.doc() = "XLA FFI handlers of jaxtier (registered by jaxtier._src.primitives).";
  m.def("registrations", &jaxtier::Registrations,
        "Maps platform ('cpu', and 'CUDA' when built with CUDA) to {target name: capsule}.");
  m.def("state_types", &jaxtier::StateTypes,
        "Maps platform to {type name: {'type_id': capsule, 'type_info': capsule}}, for "
        "jax.ffi.register_ffi_type; register them before the handlers.");
  m.def("has_cuda", []() { return jaxtier::kHasCuda; },
        "True when the module was built with the CUDA handlers.");
}
