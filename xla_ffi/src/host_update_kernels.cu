// CUDA handler of `jaxtier_host_update_ffi`: one grid-stride kernel interprets the op program
// (program.h, docs/design.md) per element. Operands and results may live in pinned host memory
// (read and written zero-copy over the link) or in device memory; the kernel does not care.
// No nanobind here: module.cc registers the symbol.

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "handlers.h"
#include "program.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtier {
namespace {

using host_update::HostUpdateParams;
using host_update::Instruction;

constexpr int kThreadsPerBlock = 256;

// The parameters (about 2 KB) stay in the kernel's constant parameter space; __grid_constant__
// keeps the dynamically indexed arrays from being copied to local memory.
__global__ void __launch_bounds__(kThreadsPerBlock)
    HostUpdateKernel(const __grid_constant__ HostUpdateParams p) {
  using namespace host_update;  // opcodes
  float r[kMaxRegisters];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += stride) {
    for (int k = 0; k < p.num_instructions; ++k) {
      const Instruction ins = p.instructions[k];
      switch (KindOf(ins.op)) {
        case OpKind::kLoad:
          r[ins.dst] = LoadAsFloat(p.operands[ins.a], p.operand_type[ins.a],
                                   p.operand_scalar[ins.a] ? 0 : i);
          break;
        case OpKind::kConst:
          r[ins.dst] = p.consts[ins.a];
          break;
        case OpKind::kStore:
          StoreFromFloat(p.results[ins.dst], p.result_type[ins.dst], i, r[ins.a]);
          break;
        case OpKind::kCopy:
          r[ins.dst] = r[ins.a];
          break;
        case OpKind::kUnary:
          r[ins.dst] = EvalUnary(ins.op, r[ins.a]);
          break;
        case OpKind::kBinary:
          r[ins.dst] = EvalBinary(ins.op, r[ins.a], r[ins.b]);
          break;
        case OpKind::kTernary:
          r[ins.dst] = EvalTernary(ins.op, r[ins.a], r[ins.b], r[ins.c]);
          break;
        default:
          break;  // rejected by PrepareHostUpdate
      }
    }
  }
}

// Blocks that fill the device, computed once per device.
constexpr int kMaxDevices = 64;
std::atomic<int> g_resident_blocks[kMaxDevices];

ffi::Error ResidentBlocks(int* blocks) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jaxtier_host_update: cudaGetDevice failed: ") +
                          cudaGetErrorString(e));
  }
  std::atomic<int>* slot = device < kMaxDevices ? &g_resident_blocks[device] : nullptr;
  if (slot != nullptr && (*blocks = slot->load(std::memory_order_relaxed)) > 0) {
    return ffi::Error::Success();
  }
  int num_sms = 0, per_sm = 0;
  e = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, HostUpdateKernel,
                                                      kThreadsPerBlock, 0);
  }
  if (e != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jaxtier_host_update: querying the device failed: ") +
                          cudaGetErrorString(e));
  }
  *blocks = num_sms * (per_sm > 0 ? per_sm : 1);
  if (slot != nullptr) slot->store(*blocks, std::memory_order_relaxed);
  return ffi::Error::Success();
}

ffi::Error HostUpdateCudaImpl(cudaStream_t stream, ffi::RemainingArgs args,
                              ffi::RemainingRets rets, ffi::Span<const int32_t> program,
                              ffi::Span<const float> consts, int32_t num_regs,
                              ffi::Span<const int32_t> aliases) {
  HostUpdateParams params;
  ffi::Error error =
      host_update::PrepareHostUpdate(args, rets, program, consts, num_regs, aliases, &params);
  if (error.failure()) return error;
  if (params.n == 0 || params.num_instructions == 0) return ffi::Error::Success();

  int resident = 0;
  if (error = ResidentBlocks(&resident); error.failure()) return error;
  const int64_t needed = (params.n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const int grid = static_cast<int>(needed < resident ? needed : resident);
  HostUpdateKernel<<<grid, kThreadsPerBlock, 0, stream>>>(params);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jaxtier_host_update: kernel launch failed: ") +
                          cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace

// Not marked kCmdBufferCompatible: behaviour under XLA's command-buffer (CUDA graph) capture, with
// pinned_host operands whose addresses change between steps, has not been verified.
XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateCuda, HostUpdateCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()     // stream
                                  .RemainingArgs()                              // operands
                                  .RemainingRets()                              // results
                                  .Attr<ffi::Span<const int32_t>>("program")    // program
                                  .Attr<ffi::Span<const float>>("consts")       // consts
                                  .Attr<int32_t>("num_regs")                    // num_regs
                                  .Attr<ffi::Span<const int32_t>>("aliases"));  // aliases

}  // namespace jaxtier
