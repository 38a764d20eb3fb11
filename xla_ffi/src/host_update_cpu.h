// The host CPU executor of the op program (host_update.cc), shared by the CPU handler and by the
// CUDA handler's `host_cpu` / `split` executors (host_update_kernels.cu), which run it from host
// functions on their own streams.
//
// Plain C++17: no CUDA, no XLA FFI types beyond program.h.

#ifndef JAXTIER_XLA_FFI_SRC_HOST_UPDATE_CPU_H_
#define JAXTIER_XLA_FFI_SRC_HOST_UPDATE_CPU_H_

#include <cstdint>

#include "program.h"

namespace jaxtier::host_update {

// Operand modes of a planned instruction: bit 0/1/2 set = field a/b/c reads a uniform slot.
inline constexpr uint8_t kUniformA = 1, kUniformB = 2, kUniformC = 4;
// For a planned LOAD: mode kInPlace = point the register at the operand's memory.
inline constexpr uint8_t kInPlace = 8;
// For a fused instruction (op2 != 0): the first op's value is op2's second operand, not its first.
inline constexpr uint8_t kFusedSecond = 16;
// For an instruction that defines a register: write the value straight into the memory of
// f32 result `result` (whose STORE was dropped from the plan) and read it from there.
inline constexpr uint8_t kDirectStore = 32;

// One instruction of a CPU plan. A fused instruction (op2 != 0) computes
//   t = op(r[a], r[b])  (or op(r[a]) for a unary op),  r[dst] = op2(t, r[c])  (or op2(r[c], t)
// under kFusedSecond), every operation rounded to fp32 on its own: the two instructions of the
// program it replaces, without the intermediate register.
struct PlannedInstruction {
  uint8_t op, mode, dst, a, b, c;
  uint8_t op2 = 0;     // the second op of a fused instruction; 0: not fused
  uint8_t result = 0;  // under kDirectStore: the result index
};

// The program rewritten for the CPU once per call (BuildCpuPlan): uniform values (consts,
// scalar operands and everything computed only from them) evaluated once; pairs of arithmetic
// instructions fused; in-place LOADs marked; f32 STOREs folded into the value's definition.
struct CpuPlan {
  int32_t num_instructions = 0;
  PlannedInstruction instructions[kMaxInstructions];
  float uniform[kMaxInstructions];  // one slot per uniform definition
};

// Builds the plan of `p`. Reads every scalar operand (element 0) through `p.operands`, so those
// pointers must be host-readable and their values final. The in-place analysis compares operand
// and result pointers: any later `p` passed to RunCpuPlan with this plan must alias the same
// operand/result pairs (rebasing every vector pointer by the same element offset keeps that).
void BuildCpuPlan(const HostUpdateParams& p, CpuPlan* plan);

// Runs `plan` over elements [lo, hi) of `p`'s vector operands and results (host memory), split
// across jaxtier's CPU thread pool (JAXTIER_CPU_THREADS, default: all hardware threads) when the
// range is large. Scalar operands are not read (the plan holds their values). Blocks until done.
// Pool threads adopt the calling thread's floating-point control (FTZ/DAZ, rounding).
void RunCpuPlan(const HostUpdateParams& p, const CpuPlan& plan, int64_t lo, int64_t hi);

// Sets IEEE defaults on the calling thread for its lifetime (x86: MXCSR 0x1f80, round to nearest,
// no flush-to-zero, no denormals-are-zero; aarch64: FPCR 0) and restores the previous state.
// The CUDA kernel computes with IEEE denormals (no --ftz), so the CPU executors run under this
// when they serve a GPU program: both give the same bits.
class ScopedIeeeFloatingPoint {
 public:
  ScopedIeeeFloatingPoint();
  ~ScopedIeeeFloatingPoint();
  ScopedIeeeFloatingPoint(const ScopedIeeeFloatingPoint&) = delete;
  ScopedIeeeFloatingPoint& operator=(const ScopedIeeeFloatingPoint&) = delete;

 private:
  uint64_t saved_;
};

}  // namespace jaxtier::host_update

#endif  // JAXTIER_XLA_FFI_SRC_HOST_UPDATE_CPU_H_
