// The op program of the fused host update (`jaxtier_host_update_ffi`).
//
// The format is the contract in docs/design.md ("Op program format"); the Python encoder is
// jaxtier/_src/primitives/host_update.py. This header holds:
//   * the opcodes and limits,
//   * the decoded launch parameters (`HostUpdateParams`, a POD that the CUDA kernel takes by
//     value),
//   * the arithmetic of every instruction as `__host__ __device__` inline functions, so the CPU
//     and CUDA handlers compute exactly the same fp32 formulae,
//   * the validation of a call (`PrepareHostUpdate`), shared by both handlers,
//   * the host CPU executor's interface (`BuildCpuPlan`, `RunCpuPlan`, defined in
//     host_update.cc), which the CPU handler and the CUDA handler's `host_cpu` / `split`
//     executors (host_update_kernels.cu) both run.
//
// The header compiles with a plain C++17 compiler and with nvcc.

#ifndef JAXTIER_XLA_FFI_SRC_OP_PROGRAM_H_
#define JAXTIER_XLA_FFI_SRC_OP_PROGRAM_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "ffi_helpers.h"
#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define JT_HD __host__ __device__ __forceinline__
#else
#define JT_HD inline
#endif

namespace jaxtier::host_update {

// ---------------------------------------------------------------------------------------------
// Format and limits
// ---------------------------------------------------------------------------------------------

inline constexpr int kWordsPerInstruction = 5;  // op, dst, a, b, c
inline constexpr int kMaxInstructions = 256;
inline constexpr int kMaxRegisters = 64;
inline constexpr int kMaxConsts = 64;
inline constexpr int kMaxOperands = 32;
inline constexpr int kMaxResults = 16;

// Name used in error messages.
inline constexpr const char kOpName[] = "jaxtier_host_update";

// Attribute `executor`: who computes the update on a GPU (the CPU handler accepts all three and
// is the host CPU executor whatever the value).
enum Executor : int32_t {
  kExecutorHostDha = 0,  // the CUDA kernel, reading and writing host memory in place (zero-copy)
  kExecutorHostCpu = 1,  // host CPU threads, driven from the CUDA handler
  kExecutorSplit = 2,    // the kernel on [0, k), the CPU on [k, N); k from `dha_fraction`
};
inline constexpr int32_t kNumExecutors = 3;
// Split executor: the kernel's share [0, k) is rounded to a multiple of this many elements.
inline constexpr int64_t kSplitAlignElements = 256;

enum Op : uint8_t {
  kLoad = 1,      // r[dst] = operand[a][i] (operand[a][0] when scalar)
  kConst = 2,     // r[dst] = consts[a]
  kStore = 3,     // result[dst][i] = round(r[a])
  kCopy = 4,      // r[dst] = r[a]
  // Unary: r[dst] = f(r[a]).
  kNeg = 10,
  kAbs = 11,
  kSqrt = 12,
  kRsqrt = 13,
  kExp = 14,
  kLog = 15,
  kTanh = 16,
  kLogistic = 17,
  kSign = 18,
  kFloor = 19,
  kCeil = 20,
  kLog1p = 21,
  kExpm1 = 22,
  kSin = 23,
  kCos = 24,
  kNot = 25,
  kErf = 26,
  kRound = 27,
  kIsFinite = 28,
  // Binary: r[dst] = f(r[a], r[b]).
  kAdd = 40,
  kSub = 41,
  kMul = 42,
  kDiv = 43,
  kMax = 44,
  kMin = 45,
  kPow = 46,
  kAtan2 = 47,
  kGt = 48,
  kGe = 49,
  kLt = 50,
  kLe = 51,
  kEq = 52,
  kNe = 53,
  kAnd = 54,
  kOr = 55,
  kRem = 56,
  // Ternary.
  kSelect = 60,  // r[dst] = r[c] if r[a] != 0 else r[b]
  kClamp = 61,   // r[dst] = min(max(r[b], r[a]), r[c])
};

inline constexpr int kFirstUnary = kNeg;
inline constexpr int kLastUnary = kIsFinite;
inline constexpr int kFirstBinary = kAdd;
inline constexpr int kLastBinary = kRem;

// What the fields of an instruction name.
enum class OpKind : uint8_t { kInvalid, kLoad, kConst, kStore, kCopy, kUnary, kBinary, kTernary };

JT_HD OpKind KindOf(int32_t op) {
  if (op == kLoad) return OpKind::kLoad;
  if (op == kConst) return OpKind::kConst;
  if (op == kStore) return OpKind::kStore;
  if (op == kCopy) return OpKind::kCopy;
  if (op >= kFirstUnary && op <= kLastUnary) return OpKind::kUnary;
  if (op >= kFirstBinary && op <= kLastBinary) return OpKind::kBinary;
  if (op == kSelect || op == kClamp) return OpKind::kTernary;
  return OpKind::kInvalid;
}

// Storage dtypes of operands and results. Arithmetic is always fp32.
enum StorageType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// One decoded instruction. Every field fits a byte once validated (indices < 64).
struct Instruction {
  uint8_t op, dst, a, b, c;
};

// Everything one execution needs, validated. Plain data: the CUDA kernel takes it by value.
struct HostUpdateParams {
  int64_t n;  // elements per vector operand and per result
  int32_t num_instructions;
  int32_t num_registers;
  int32_t num_operands;
  int32_t num_results;
  const void* operands[kMaxOperands];
  void* results[kMaxResults];
  uint8_t operand_type[kMaxOperands];    // StorageType
  uint8_t operand_scalar[kMaxOperands];  // 1: one element, broadcast
  uint8_t result_type[kMaxResults];      // StorageType
  Instruction instructions[kMaxInstructions];
  float consts[kMaxConsts];
};
// Kernel parameters are limited to 4 KB on older toolkits; stay under it.
static_assert(sizeof(HostUpdateParams) <= 4096, "HostUpdateParams must fit a kernel parameter");

// ---------------------------------------------------------------------------------------------
// Bit casts and storage conversions
// ---------------------------------------------------------------------------------------------

JT_HD uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

JT_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// bf16 -> f32 is exact.
JT_HD float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// f32 -> bf16, round to nearest even; NaN stays NaN (quieted, sign kept).
JT_HD uint16_t FloatToBf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  const uint32_t u = FloatToBits(f);
  const uint32_t nan = (u >> 16) | 0x0040u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
#endif
}

// f16 -> f32 is exact. (Host: written without branches so the load loop vectorises.)
JT_HD float F16ToFloat(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  const uint32_t inf_nan = 0x7f800000u | (man << 13);        // payload kept
  const uint32_t normal = ((exp + 112u) << 23) | (man << 13);  // rebias 15 -> 127
  // Zero or subnormal: man * 2^-24, exact in fp32 (and a normal fp32, so never flushed).
  const uint32_t small = FloatToBits(static_cast<float>(static_cast<int32_t>(man)) *
                                     5.9604644775390625e-08f);
  const uint32_t bits = exp == 0x1fu ? inf_nan : (exp != 0u ? normal : small);
  return BitsToFloat(bits | sign);
#endif
}

// f32 -> f16, round to nearest even; overflow gives inf; NaN stays NaN (quieted, sign kept).
// (Host: every case is computed and one is selected, so the store loop vectorises.)
JT_HD uint16_t FloatToF16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t u = FloatToBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int32_t a = static_cast<int32_t>(u & 0x7fffffffu);
  const uint32_t ua = static_cast<uint32_t>(a);
  const uint32_t nan = 0x7e00u | ((ua >> 13) & 0x3ffu);
  // |f| < 2^-14: the f16 result is subnormal (or zero) with a step of 2^-24. Adding 0.5 puts the
  // value where the fp32 step is also 2^-24, so the fp32 addition does the rounding.
  const uint32_t small = FloatToBits(BitsToFloat(ua) + 0.5f) - 0x3f000000u;
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even.
  const uint32_t normal = (ua - 0x38000000u + 0x0fffu + ((ua >> 13) & 1u)) >> 13;
  const uint32_t h = a > 0x7f800000 ? nan                // NaN
                     : a >= 0x477ff000 ? 0x7c00u         // |f| >= 65520 (or inf) -> inf
                     : a < 0x38800000 ? small : normal;
  return static_cast<uint16_t>(h | sign);
#endif
}

JT_HD float LoadAsFloat(const void* base, uint8_t type, int64_t i) {
  switch (type) {
    case kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case kF16:
      return F16ToFloat(static_cast<const uint16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

JT_HD void StoreFromFloat(void* base, uint8_t type, int64_t i, float v) {
  switch (type) {
    case kBF16:
      static_cast<uint16_t*>(base)[i] = FloatToBf16(v);
      break;
    case kF16:
      static_cast<uint16_t*>(base)[i] = FloatToF16(v);
      break;
    default:
      static_cast<float*>(base)[i] = v;
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// Arithmetic. Accurate libm/CUDA math functions only, no fast-math approximations. Build without
// floating-point contraction (no FMA fusion) so every operation rounds to fp32 on its own.
// ---------------------------------------------------------------------------------------------

JT_HD bool IsNan(float x) { return x != x; }

// NaN-propagating max/min (XLA semantics): NaN if either input is NaN.
JT_HD float MaxPropagateNan(float x, float y) {
  const float m = x >= y ? x : y;
  return (IsNan(x) || IsNan(y)) ? x + y : m;
}

JT_HD float MinPropagateNan(float x, float y) {
  const float m = x <= y ? x : y;
  return (IsNan(x) || IsNan(y)) ? x + y : m;
}

template <int kOp>
JT_HD float ApplyUnary(float x) {
  if constexpr (kOp == kNeg) return -x;
  if constexpr (kOp == kAbs) return fabsf(x);
  if constexpr (kOp == kSqrt) return sqrtf(x);
  if constexpr (kOp == kRsqrt) return 1.0f / sqrtf(x);
  if constexpr (kOp == kExp) return expf(x);
  if constexpr (kOp == kLog) return logf(x);
  if constexpr (kOp == kTanh) return tanhf(x);
  if constexpr (kOp == kLogistic) return 1.0f / (1.0f + expf(-x));
  // -1 / 1 for negative / positive; zero (either sign) and NaN come back unchanged.
  if constexpr (kOp == kSign) return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x);
  if constexpr (kOp == kFloor) return floorf(x);
  if constexpr (kOp == kCeil) return ceilf(x);
  if constexpr (kOp == kLog1p) return log1pf(x);
  if constexpr (kOp == kExpm1) return expm1f(x);
  if constexpr (kOp == kSin) return sinf(x);
  if constexpr (kOp == kCos) return cosf(x);
  if constexpr (kOp == kNot) return x == 0.0f ? 1.0f : 0.0f;
  if constexpr (kOp == kErf) return erff(x);
  if constexpr (kOp == kRound) return roundf(x);  // half away from zero
  if constexpr (kOp == kIsFinite) return fabsf(x) <= 3.40282346638528859812e+38f ? 1.0f : 0.0f;
  return x;  // unreachable for valid opcodes
}

template <int kOp>
JT_HD float ApplyBinary(float x, float y) {
  if constexpr (kOp == kAdd) return x + y;
  if constexpr (kOp == kSub) return x - y;
  if constexpr (kOp == kMul) return x * y;
  if constexpr (kOp == kDiv) return x / y;
  if constexpr (kOp == kMax) return MaxPropagateNan(x, y);
  if constexpr (kOp == kMin) return MinPropagateNan(x, y);
  if constexpr (kOp == kPow) return powf(x, y);
  if constexpr (kOp == kAtan2) return atan2f(x, y);
  if constexpr (kOp == kGt) return x > y ? 1.0f : 0.0f;
  if constexpr (kOp == kGe) return x >= y ? 1.0f : 0.0f;
  if constexpr (kOp == kLt) return x < y ? 1.0f : 0.0f;
  if constexpr (kOp == kLe) return x <= y ? 1.0f : 0.0f;
  if constexpr (kOp == kEq) return x == y ? 1.0f : 0.0f;
  if constexpr (kOp == kNe) return x != y ? 1.0f : 0.0f;
  if constexpr (kOp == kAnd) return (x != 0.0f) & (y != 0.0f) ? 1.0f : 0.0f;
  if constexpr (kOp == kOr) return (x != 0.0f) | (y != 0.0f) ? 1.0f : 0.0f;
  if constexpr (kOp == kRem) return fmodf(x, y);
  return x;  // unreachable for valid opcodes
}

template <int kOp>
JT_HD float ApplyTernary(float a, float b, float c) {
  if constexpr (kOp == kSelect) return a != 0.0f ? c : b;
  if constexpr (kOp == kClamp) return MinPropagateNan(MaxPropagateNan(b, a), c);
  return a;  // unreachable for valid opcodes
}

// Runtime dispatch for one element (used by the CUDA kernel). The CPU handler instead switches
// once per block and calls the same ApplyUnary/ApplyBinary/ApplyTernary in a loop.
JT_HD float EvalUnary(uint8_t op, float x) {
  switch (op) {
#define JT_CASE(OP) \
  case OP:          \
    return ApplyUnary<OP>(x);
    JT_CASE(kNeg) JT_CASE(kAbs) JT_CASE(kSqrt) JT_CASE(kRsqrt) JT_CASE(kExp) JT_CASE(kLog)
    JT_CASE(kTanh) JT_CASE(kLogistic) JT_CASE(kSign) JT_CASE(kFloor) JT_CASE(kCeil)
    JT_CASE(kLog1p) JT_CASE(kExpm1) JT_CASE(kSin) JT_CASE(kCos) JT_CASE(kNot) JT_CASE(kErf)
    JT_CASE(kRound) JT_CASE(kIsFinite)
#undef JT_CASE
    default:
      return x;
  }
}

JT_HD float EvalBinary(uint8_t op, float x, float y) {
  switch (op) {
#define JT_CASE(OP) \
  case OP:          \
    return ApplyBinary<OP>(x, y);
    JT_CASE(kAdd) JT_CASE(kSub) JT_CASE(kMul) JT_CASE(kDiv) JT_CASE(kMax) JT_CASE(kMin)
    JT_CASE(kPow) JT_CASE(kAtan2) JT_CASE(kGt) JT_CASE(kGe) JT_CASE(kLt) JT_CASE(kLe)
    JT_CASE(kEq) JT_CASE(kNe) JT_CASE(kAnd) JT_CASE(kOr) JT_CASE(kRem)
#undef JT_CASE
    default:
      return x;
  }
}

JT_HD float EvalTernary(uint8_t op, float a, float b, float c) {
  return op == kSelect ? ApplyTernary<kSelect>(a, b, c) : ApplyTernary<kClamp>(a, b, c);
}

// ---------------------------------------------------------------------------------------------
// Validation (host only), shared by the CPU and CUDA handlers.
// ---------------------------------------------------------------------------------------------

namespace internal {

// The storage type of a float storage dtype (CheckFloatStorage has accepted it).
inline uint8_t StorageTypeOf(xla::ffi::DataType t) {
  return t == xla::ffi::DataType::BF16 ? kBF16 : t == xla::ffi::DataType::F16 ? kF16 : kF32;
}

inline std::string Range(int64_t lo, int64_t hi) {
  return "a value in [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
}

inline std::string Instr(int64_t k, const char* field) {
  return std::string("instruction ") + std::to_string(k) + " (field " + field +
         ") of attribute program";
}

}  // namespace internal

// The attributes of a call, decoded from the attribute dictionary. `executor` and
// `dha_fraction` are optional (calls built before they existed still run: DHA, 0.5).
struct HostUpdateAttrs {
  xla::ffi::Span<const int32_t> program;
  xla::ffi::Span<const float> consts;
  int32_t num_regs = 0;
  xla::ffi::Span<const int32_t> aliases;
  int32_t executor = kExecutorHostDha;
  float dha_fraction = 0.5f;
};

namespace internal {

template <typename T>
xla::ffi::Error GetAttr(const xla::ffi::Dictionary& attrs, const char* name,
                        const char* expected, bool required, T* out) {
  if (!attrs.contains(name)) {
    if (!required) return xla::ffi::Error::Success();
    return Invalid(kOpName, "attribute", "the call",
                   std::string("an attribute `") + name + "` (" + expected + ")", "none");
  }
  xla::ffi::ErrorOr<T> value = attrs.get<T>(name);
  if (value.has_error()) {
    return Invalid(kOpName, "type", std::string("attribute ") + name, expected,
                   "another type (" + value.error().message() + ")");
  }
  *out = *value;
  return xla::ffi::Error::Success();
}

}  // namespace internal

// Decodes and checks the attributes: program, consts, num_regs, aliases (required), executor
// (0, 1 or 2) and dha_fraction (in [0, 1]) (optional); an unknown attribute name is an error.
inline xla::ffi::Error DecodeHostUpdateAttrs(const xla::ffi::Dictionary& attrs,
                                             HostUpdateAttrs* out) {
  using internal::GetAttr;
  namespace ffi = xla::ffi;
  static constexpr const char* kKnown[] = {"aliases", "consts", "dha_fraction",
                                           "executor", "num_regs", "program"};
  for (auto it = attrs.begin(); it != attrs.end(); ++it) {
    const std::string_view name = *it;
    bool known = false;
    for (const char* k : kKnown) known = known || name == k;
    if (!known) {
      return Invalid(kOpName, "attribute", "the call",
                     "one of aliases, consts, dha_fraction, executor, num_regs, program",
                     "`" + std::string(name) + "`");
    }
  }
  JT_RETURN_IF_ERROR(GetAttr(attrs, "program", "an int32 array", true, &out->program));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "consts", "a float32 array", true, &out->consts));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "num_regs", "an int32 scalar", true, &out->num_regs));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "aliases", "an int32 array", true, &out->aliases));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "executor", "an int32 scalar", false, &out->executor));
  JT_RETURN_IF_ERROR(
      GetAttr(attrs, "dha_fraction", "a float32 scalar", false, &out->dha_fraction));
  if (out->executor < 0 || out->executor >= kNumExecutors) {
    return Invalid(kOpName, "value", "attribute executor",
                   "0 (host_dha), 1 (host_cpu) or 2 (split)", std::to_string(out->executor));
  }
  // Written so that NaN fails too.
  if (!(out->dha_fraction >= 0.0f && out->dha_fraction <= 1.0f)) {
    return Invalid(kOpName, "value", "attribute dha_fraction", "a value in [0, 1]",
                   std::to_string(out->dha_fraction));
  }
  return ffi::Error::Success();
}

// Size in bytes of one element of a storage type.
inline int64_t StorageBytes(uint8_t type) { return type == kF32 ? 4 : 2; }

// Validates the program, its constants and `num_regs` against `params->num_operands` and
// `params->num_results` (set by the caller) and stores them in `params`: opcodes, register,
// operand, result and constant indices, registers read only after they are written, every
// result stored.
inline xla::ffi::Error PrepareProgram(xla::ffi::Span<const int32_t> program,
                                      xla::ffi::Span<const float> consts, int32_t num_regs,
                                      HostUpdateParams* params) {
  using internal::Instr;
  using internal::Range;
  namespace ffi = xla::ffi;
  if (num_regs < 0 || num_regs > kMaxRegisters) {
    return Invalid(kOpName, "value", "attribute num_regs", Range(0, kMaxRegisters + 1),
                   std::to_string(num_regs));
  }
  params->num_registers = num_regs;
  if (consts.size() > static_cast<size_t>(kMaxConsts)) {
    return Invalid(kOpName, "length", "attribute consts", "at most " + std::to_string(kMaxConsts),
                   std::to_string(consts.size()));
  }
  for (size_t k = 0; k < consts.size(); ++k) params->consts[k] = consts[k];
  if (program.size() % kWordsPerInstruction != 0) {
    return Invalid(kOpName, "length", "attribute program",
                   "a multiple of " + std::to_string(kWordsPerInstruction),
                   std::to_string(program.size()));
  }
  const int64_t num_instructions = static_cast<int64_t>(program.size()) / kWordsPerInstruction;
  if (num_instructions > kMaxInstructions) {
    return Invalid(kOpName, "number of instructions", "attribute program",
                   "at most " + std::to_string(kMaxInstructions), std::to_string(num_instructions));
  }
  params->num_instructions = static_cast<int32_t>(num_instructions);

  // The program.
  bool written[kMaxRegisters] = {};
  bool stored[kMaxResults] = {};
  const int64_t num_consts = static_cast<int64_t>(consts.size());
  for (int64_t k = 0; k < num_instructions; ++k) {
    const int32_t* w = program.begin() + k * kWordsPerInstruction;
    const int32_t op = w[0], dst = w[1], a = w[2], b = w[3], c = w[4];
    const OpKind kind = KindOf(op);
    if (kind == OpKind::kInvalid) {
      return Invalid(kOpName, "opcode", Instr(k, "op"), "an opcode listed in docs/design.md",
                     std::to_string(op));
    }
    // Register reads (must be in range and written by an earlier instruction).
    auto check_read = [&](int32_t reg, const char* field) -> ffi::Error {
      if (reg < 0 || reg >= num_regs) {
        return Invalid(kOpName, "register index", Instr(k, field), Range(0, num_regs),
                       std::to_string(reg));
      }
      if (!written[reg]) {
        return Invalid(kOpName, "register read", Instr(k, field),
                       "a register written by an earlier instruction",
                       "register " + std::to_string(reg) + ", not written yet");
      }
      return ffi::Error::Success();
    };
    Instruction ins{static_cast<uint8_t>(op), 0, 0, 0, 0};
    switch (kind) {
      case OpKind::kLoad:
        if (a < 0 || a >= params->num_operands) {
          return Invalid(kOpName, "operand index", Instr(k, "a"), Range(0, params->num_operands),
                         std::to_string(a));
        }
        ins.a = static_cast<uint8_t>(a);
        break;
      case OpKind::kConst:
        if (a < 0 || a >= num_consts) {
          return Invalid(kOpName, "const index", Instr(k, "a"), Range(0, num_consts),
                         std::to_string(a));
        }
        ins.a = static_cast<uint8_t>(a);
        break;
      case OpKind::kStore:
        if (dst < 0 || dst >= params->num_results) {
          return Invalid(kOpName, "result index", Instr(k, "dst"), Range(0, params->num_results),
                         std::to_string(dst));
        }
        JT_RETURN_IF_ERROR(check_read(a, "a"));
        ins.dst = static_cast<uint8_t>(dst);
        ins.a = static_cast<uint8_t>(a);
        stored[dst] = true;
        break;
      case OpKind::kTernary:
        JT_RETURN_IF_ERROR(check_read(c, "c"));
        ins.c = static_cast<uint8_t>(c);
        [[fallthrough]];
      case OpKind::kBinary:
        JT_RETURN_IF_ERROR(check_read(b, "b"));
        ins.b = static_cast<uint8_t>(b);
        [[fallthrough]];
      case OpKind::kCopy:
      case OpKind::kUnary:
        JT_RETURN_IF_ERROR(check_read(a, "a"));
        ins.a = static_cast<uint8_t>(a);
        break;
      case OpKind::kInvalid:
        break;
    }
    if (kind != OpKind::kStore) {
      if (dst < 0 || dst >= num_regs) {
        return Invalid(kOpName, "register index", Instr(k, "dst"), Range(0, num_regs),
                       std::to_string(dst));
      }
      ins.dst = static_cast<uint8_t>(dst);
      written[dst] = true;
    }
    params->instructions[k] = ins;
  }
  for (int64_t r = 0; r < params->num_results; ++r) {
    if (!stored[r]) {
      return Invalid(kOpName, "program", "result " + std::to_string(r),
                     "a STORE to every result", "no STORE to this result");
    }
  }

  return ffi::Error::Success();
}

// Validates a call and fills `params`. Returns an InvalidArgument error naming the first
// problem found. Checks: operand/result counts and dtypes (f32/bf16/f16), element counts (N or
// 1 for operands, N for results), the program (length, opcodes, register/operand/result/const
// indices, registers read only after they are written, every result stored), num_regs, and the
// aliases (one per result, the aliased operand's buffer is the result's buffer).
inline xla::ffi::Error PrepareHostUpdate(xla::ffi::RemainingArgs args,
                                         xla::ffi::RemainingRets rets,
                                         xla::ffi::Span<const int32_t> program,
                                         xla::ffi::Span<const float> consts, int32_t num_regs,
                                         xla::ffi::Span<const int32_t> aliases,
                                         HostUpdateParams* params) {
  using internal::Instr;
  using internal::Range;
  namespace ffi = xla::ffi;

  const int64_t num_operands = static_cast<int64_t>(args.size());
  const int64_t num_results = static_cast<int64_t>(rets.size());
  if (num_operands > kMaxOperands) {
    return Invalid(kOpName, "number of operands", "the call",
                   "at most " + std::to_string(kMaxOperands), std::to_string(num_operands));
  }
  if (num_results > kMaxResults) {
    return Invalid(kOpName, "number of results", "the call",
                   "at most " + std::to_string(kMaxResults), std::to_string(num_results));
  }
  params->num_operands = static_cast<int32_t>(num_operands);
  params->num_results = static_cast<int32_t>(num_results);

  // Results first: they define N.
  int64_t n = -1;
  for (int64_t r = 0; r < num_results; ++r) {
    const std::string where = "result " + std::to_string(r);
    std::optional<ffi::AnyBuffer> buf;
    JT_RETURN_IF_ERROR(GetRet(kOpName, rets, r, where, &buf));
    const ffi::AnyBuffer& b = *buf;
    JT_RETURN_IF_ERROR(CheckFloatStorage(kOpName, where, b.element_type()));
    params->result_type[r] = internal::StorageTypeOf(b.element_type());
    const int64_t count = static_cast<int64_t>(b.element_count());
    if (n < 0) n = count;
    if (count != n) {
      return Invalid(kOpName, "element count", where, std::to_string(n) + " (as result 0)",
                     std::to_string(count));
    }
    params->results[r] = b.untyped_data();
  }
  // Without results nothing is written; N then comes from the vector operands, if any.
  for (int64_t i = 0; i < num_operands; ++i) {
    const std::string where = "input " + std::to_string(i);
    std::optional<ffi::AnyBuffer> buf;
    JT_RETURN_IF_ERROR(GetArg(kOpName, args, i, where, &buf));
    const ffi::AnyBuffer& b = *buf;
    JT_RETURN_IF_ERROR(CheckFloatStorage(kOpName, where, b.element_type()));
    params->operand_type[i] = internal::StorageTypeOf(b.element_type());
    const int64_t count = static_cast<int64_t>(b.element_count());
    if (n < 0 && count != 1) n = count;
    if (count != n && count != 1) {
      return Invalid(kOpName, "element count", where,
                     std::to_string(n) + " (a vector operand) or 1 (a scalar operand)",
                     std::to_string(count));
    }
    params->operands[i] = b.untyped_data();
    params->operand_scalar[i] = (count == 1) ? 1 : 0;
  }
  params->n = n < 0 ? 0 : n;

  JT_RETURN_IF_ERROR(PrepareProgram(program, consts, num_regs, params));
  if (aliases.size() != static_cast<size_t>(num_results)) {
    return Invalid(kOpName, "length", "attribute aliases",
                   std::to_string(num_results) + " (one entry per result)",
                   std::to_string(aliases.size()));
  }

  // Aliases: result r is updated in place in operand aliases[r].
  bool aliased[kMaxOperands] = {};
  for (int64_t r = 0; r < num_results; ++r) {
    const int32_t i = aliases[r];
    const std::string where = "result " + std::to_string(r) + " (attribute aliases)";
    if (i == -1) continue;
    if (i < -1 || i >= num_operands) {
      return Invalid(kOpName, "alias", where, "-1 or " + Range(0, num_operands), std::to_string(i));
    }
    if (aliased[i]) {
      return Invalid(kOpName, "alias", where, "each operand aliased by at most one result",
                     "operand " + std::to_string(i) + " again");
    }
    aliased[i] = true;
    if (params->operand_type[i] != params->result_type[r]) {
      return Invalid(kOpName, "alias", where, "an operand of the result's dtype",
                     "operand " + std::to_string(i) + " of another dtype");
    }
    if (params->operand_scalar[i] && params->n != 1) {
      return Invalid(kOpName, "alias", where,
                     "an operand of " + std::to_string(params->n) + " elements",
                     "operand " + std::to_string(i) + " of 1 element");
    }
    // A zero-size buffer has no meaningful address; nothing is written to it either.
    if (params->n > 0 && params->operands[i] != params->results[r]) {
      return Invalid(kOpName, "alias", where,
                     "the buffer of input " + std::to_string(i) +
                         " (declare the pair in input_output_aliases and donate the input)",
                     "a different buffer");
    }
  }
  return ffi::Error::Success();
}

// Both handlers' prologue: decode the attributes, then validate the call into `params`.
inline xla::ffi::Error DecodeAndPrepare(xla::ffi::RemainingArgs args,
                                        xla::ffi::RemainingRets rets,
                                        const xla::ffi::Dictionary& attrs, HostUpdateAttrs* a,
                                        HostUpdateParams* params) {
  JT_RETURN_IF_ERROR(DecodeHostUpdateAttrs(attrs, a));
  return PrepareHostUpdate(args, rets, a->program, a->consts, a->num_regs, a->aliases, params);
}

// ---------------------------------------------------------------------------------------------
// The layer call (`jaxtier_host_update_layer_ffi`) and the join (`jaxtier_host_update_join_ffi`)
// ---------------------------------------------------------------------------------------------
//
// A layer call runs the op program over one window [offset, offset + count) of stacked
// operands and writes each result into the window of an operand (`targets`): the per-layer
// update of a leaf stacked over layers, issued inside the backward pass. XLA sees the
// operands read and one token produced; the writes are the enclosing program's business (it
// makes them safe: every other reader of a window is ordered before the call, and the written
// buffers pass through a join, aliased, before anything else reads them).
//
//   operands: the program's [0, num_operands), then order-only ones (not read)
//   results:  one token (not written)
//   attributes: program, consts, num_regs, executor, dha_fraction (as the host update);
//     offset, count (int64, elements); targets (int32 [num_results]: the operand each result
//     is written into); num_operands (int32)
//   operand element counts: 1 (a broadcast scalar), count (read as is), or at least
//     offset + count (stacked: read from element offset on)
//
// On a GPU every executor returns at once: the CPU part runs on streams shared by every layer
// call of the process, the kernel part (host_dha's whole, the split's share) on a
// lowest-priority stream beside XLA's compute, and a join makes XLA's stream wait for both.
// The join's operands pass through to its results (aliased, in place), then order-only
// operands follow (as many pass through as the join has results).
//
// The release (`jaxtier_host_update_release_ffi`) ends the layer calls' reads of some of the
// values they read as they are (count elements: a layer's gradient slice), so that XLA may
// free or reuse those buffers after it: on a GPU, XLA's stream waits for every layer call that
// read one of them (and only those); on the CPU backend the calls have run already.
//
//   operands: the values [0, num_values), then order-only ones (not read)
//   results:  one token (not written)
//   attributes: num_values (int32)

inline constexpr const char kLayerOpName[] = "jaxtier_host_update_layer";
inline constexpr const char kJoinOpName[] = "jaxtier_host_update_join";
inline constexpr const char kReleaseOpName[] = "jaxtier_host_update_release";

// Which elements a layer call runs over: its window [offset, offset + count), or the rows of a
// table (`count` = num_rows * row_length elements, row r at [r * row_length, (r + 1) *
// row_length)) picked by the int32 ids operand that follows the program's operands: the rows of
// the distinct ids in [0, num_rows) (kRowsOfIds), or every other row (kRowsNotInIds).
inline constexpr int32_t kWindow = 0;
inline constexpr int32_t kRowsOfIds = 1;
inline constexpr int32_t kRowsNotInIds = 2;

struct LayerAttrs {
  HostUpdateAttrs base;  // program, consts, num_regs, executor, dha_fraction (aliases: unused)
  int64_t offset = 0;
  int64_t count = 0;
  xla::ffi::Span<const int32_t> targets;
  int32_t num_operands = 0;
  int32_t rows = kWindow;    // kWindow, kRowsOfIds or kRowsNotInIds
  int64_t row_length = 0;    // elements per row (rows calls)
  int32_t zero_operand = -1;  // rows calls: an operand whose picked rows are zeroed after use
  float dha_grid = 1.0f;      // the share of the device's resident blocks the kernel part takes
};

// A rows call's ids (operand num_operands, int32) as the handler found them.
struct LayerRows {
  const int32_t* ids = nullptr;
  int64_t num_ids = 0;
  int64_t num_rows = 0;
  const void* zero_base = nullptr;  // the zeroed operand's buffer, or null
};

// Decodes and checks a layer call's attributes; an unknown name is an error.
inline xla::ffi::Error DecodeLayerAttrs(const xla::ffi::Dictionary& attrs, LayerAttrs* out) {
  using internal::GetAttr;
  static constexpr const char* kKnown[] = {"consts",     "count",        "dha_fraction",
                                           "dha_grid",   "executor",     "num_operands",
                                           "num_regs",   "offset",       "program",
                                           "row_length", "rows",         "targets",
                                           "zero_operand"};
  for (auto it = attrs.begin(); it != attrs.end(); ++it) {
    const std::string_view name = *it;
    bool known = false;
    for (const char* k : kKnown) known = known || name == k;
    if (!known) {
      return Invalid(kLayerOpName, "attribute", "the call",
                     "one of consts, count, dha_fraction, dha_grid, executor, num_operands, "
                     "num_regs, offset, program, row_length, rows, targets, zero_operand",
                     "`" + std::string(name) + "`");
    }
  }
  HostUpdateAttrs& b = out->base;
  JT_RETURN_IF_ERROR(GetAttr(attrs, "program", "an int32 array", true, &b.program));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "consts", "a float32 array", true, &b.consts));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "num_regs", "an int32 scalar", true, &b.num_regs));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "executor", "an int32 scalar", false, &b.executor));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "dha_fraction", "a float32 scalar", false, &b.dha_fraction));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "dha_grid", "a float32 scalar", false, &out->dha_grid));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "offset", "an int64 scalar", true, &out->offset));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "count", "an int64 scalar", true, &out->count));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "targets", "an int32 array", true, &out->targets));
  JT_RETURN_IF_ERROR(
      GetAttr(attrs, "num_operands", "an int32 scalar", true, &out->num_operands));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "rows", "an int32 scalar", false, &out->rows));
  JT_RETURN_IF_ERROR(GetAttr(attrs, "row_length", "an int64 scalar", false, &out->row_length));
  JT_RETURN_IF_ERROR(
      GetAttr(attrs, "zero_operand", "an int32 scalar", false, &out->zero_operand));
  if (out->rows != kWindow && out->rows != kRowsOfIds && out->rows != kRowsNotInIds) {
    return Invalid(kLayerOpName, "value", "attribute rows",
                   "0 (the window), 1 (the rows of the ids) or 2 (the other rows)",
                   std::to_string(out->rows));
  }
  if (out->rows != kWindow &&
      (out->offset != 0 || out->row_length <= 0 || out->count % out->row_length != 0)) {
    return Invalid(kLayerOpName, "value", "attributes offset, count and row_length",
                   "offset 0 and a count that is a multiple of row_length > 0 (a rows call "
                   "runs over whole tables)",
                   std::to_string(out->offset) + ", " + std::to_string(out->count) + " and " +
                       std::to_string(out->row_length));
  }
  if (b.executor < 0 || b.executor >= kNumExecutors) {
    return Invalid(kLayerOpName, "value", "attribute executor",
                   "0 (host_dha), 1 (host_cpu) or 2 (split)", std::to_string(b.executor));
  }
  if (!(b.dha_fraction >= 0.0f && b.dha_fraction <= 1.0f)) {
    return Invalid(kLayerOpName, "value", "attribute dha_fraction", "a value in [0, 1]",
                   std::to_string(b.dha_fraction));
  }
  if (!(out->dha_grid > 0.0f && out->dha_grid <= 1.0f)) {
    return Invalid(kLayerOpName, "value", "attribute dha_grid", "a share of the blocks in (0, 1]",
                   std::to_string(out->dha_grid));
  }
  if (out->offset < 0 || out->count < 0) {
    return Invalid(kLayerOpName, "value", "attributes offset and count", "values >= 0",
                   std::to_string(out->offset) + " and " + std::to_string(out->count));
  }
  return xla::ffi::Error::Success();
}

// The buffers layer calls write, for the join's check that it hands back those very buffers
// (a copy XLA put in between would lose the writes): host_update.cc, one set per process.
void RecordLayerTargets(const void* const* bases, int count);
bool TakeLayerTarget(const void* base);

// Validates a layer call and fills `params` (n = count; pointers at the window) and `aliases`
// (per result, its target: the staged buffers of the CPU executor are shared with it); records
// the targets' buffers (`RecordLayerTargets`).
inline xla::ffi::Error PrepareLayerUpdate(xla::ffi::RemainingArgs args,
                                          xla::ffi::RemainingRets rets, const LayerAttrs& a,
                                          HostUpdateParams* params, int32_t* aliases,
                                          LayerRows* rows) {
  using internal::Range;
  namespace ffi = xla::ffi;
  const int64_t num_operands = a.num_operands;
  const int64_t with_ids = num_operands + (a.rows != kWindow ? 1 : 0);
  if (num_operands < 0 || num_operands > kMaxOperands ||
      with_ids > static_cast<int64_t>(args.size())) {
    return Invalid(kLayerOpName, "value", "attribute num_operands",
                   "at most " + std::to_string(kMaxOperands) + " and at most the " +
                       std::to_string(args.size()) + " operands of the call" +
                       (a.rows != kWindow ? ", less the ids" : ""),
                   std::to_string(num_operands));
  }
  *rows = LayerRows();
  if (a.rows != kWindow) {
    const std::string where = "input " + std::to_string(num_operands) + " (the ids)";
    std::optional<ffi::AnyBuffer> ids;
    JT_RETURN_IF_ERROR(GetArg(kLayerOpName, args, num_operands, where, &ids));
    if (ids->element_type() != ffi::DataType::S32) {
      return Invalid(kLayerOpName, "dtype", where, "int32", DtypeName(ids->element_type()));
    }
    rows->ids = static_cast<const int32_t*>(ids->untyped_data());
    rows->num_ids = static_cast<int64_t>(ids->element_count());
    rows->num_rows = a.count / a.row_length;
  }
  const int64_t num_results = static_cast<int64_t>(a.targets.size());
  if (num_results > kMaxResults) {
    return Invalid(kLayerOpName, "length", "attribute targets",
                   "at most " + std::to_string(kMaxResults), std::to_string(num_results));
  }
  if (rets.size() != 1) {
    return Invalid(kLayerOpName, "number of results", "the call", "1 (the token)",
                   std::to_string(rets.size()));
  }
  params->num_operands = static_cast<int32_t>(num_operands);
  params->num_results = static_cast<int32_t>(num_results);
  params->n = a.count;
  const int64_t end = a.offset + a.count;
  for (int64_t i = 0; i < num_operands; ++i) {
    const std::string where = "input " + std::to_string(i);
    std::optional<ffi::AnyBuffer> buf;
    JT_RETURN_IF_ERROR(GetArg(kLayerOpName, args, i, where, &buf));
    const ffi::AnyBuffer& b = *buf;
    JT_RETURN_IF_ERROR(CheckFloatStorage(kLayerOpName, where, b.element_type()));
    const uint8_t type = internal::StorageTypeOf(b.element_type());
    params->operand_type[i] = type;
    const int64_t size = static_cast<int64_t>(b.element_count());
    const char* base = static_cast<const char*>(b.untyped_data());
    if (size == 1 && a.count != 1) {
      params->operand_scalar[i] = 1;
      params->operands[i] = base;
    } else if (size == a.count) {
      params->operand_scalar[i] = 0;
      params->operands[i] = base;
    } else if (size >= end) {
      params->operand_scalar[i] = 0;
      params->operands[i] = base + a.offset * StorageBytes(type);
    } else {
      return Invalid(kLayerOpName, "element count", where,
                     "1, " + std::to_string(a.count) + " (the window) or at least " +
                         std::to_string(end) + " (a stack holding the window)",
                     std::to_string(size));
    }
  }
  bool targeted[kMaxOperands] = {};
  const void* bases[kMaxResults + 1] = {};
  for (int64_t r = 0; r < num_results; ++r) {
    const int32_t t = a.targets[r];
    const std::string where = "result " + std::to_string(r) + " (attribute targets)";
    if (t < 0 || t >= num_operands) {
      return Invalid(kLayerOpName, "target", where, Range(0, num_operands), std::to_string(t));
    }
    if (targeted[t] || params->operand_scalar[t]) {
      return Invalid(kLayerOpName, "target", where,
                     "a vector operand written by at most one result",
                     "operand " + std::to_string(t) + (targeted[t] ? " again" : ", a scalar"));
    }
    targeted[t] = true;
    std::optional<ffi::AnyBuffer> buf;
    JT_RETURN_IF_ERROR(GetArg(kLayerOpName, args, t, "input " + std::to_string(t), &buf));
    bases[r] = buf->untyped_data();
    params->result_type[r] = params->operand_type[t];
    params->results[r] = const_cast<void*>(params->operands[t]);
    aliases[r] = t;
  }
  int num_written = static_cast<int>(num_results);
  if (a.zero_operand != -1) {
    const int32_t z = a.zero_operand;
    const std::string where = "attribute zero_operand";
    if (a.rows != kRowsOfIds || z < 0 || z >= num_operands || targeted[z] ||
        params->operand_scalar[z]) {
      return Invalid(kLayerOpName, "value", where,
                     "-1, or in a rows-of-ids call a vector operand no result targets",
                     std::to_string(z));
    }
    std::optional<ffi::AnyBuffer> buf;
    JT_RETURN_IF_ERROR(GetArg(kLayerOpName, args, z, "input " + std::to_string(z), &buf));
    rows->zero_base = buf->untyped_data();
    bases[num_written++] = rows->zero_base;
  }
  JT_RETURN_IF_ERROR(PrepareProgram(a.base.program, a.base.consts, a.base.num_regs, params));
  RecordLayerTargets(bases, num_written);
  return xla::ffi::Error::Success();
}

// Both layer handlers' prologue: decode the attributes, then validate the call.
inline xla::ffi::Error DecodeAndPrepareLayer(xla::ffi::RemainingArgs args,
                                             xla::ffi::RemainingRets rets,
                                             const xla::ffi::Dictionary& attrs, LayerAttrs* a,
                                             HostUpdateParams* params, int32_t* aliases,
                                             LayerRows* rows) {
  JT_RETURN_IF_ERROR(DecodeLayerAttrs(attrs, a));
  return PrepareLayerUpdate(args, rets, *a, params, aliases, rows);
}

// Validates a join: its operands pass through to its results, in place, then order-only ones
// follow.
inline xla::ffi::Error PrepareJoin(xla::ffi::RemainingArgs args, xla::ffi::RemainingRets rets) {
  namespace ffi = xla::ffi;
  if (rets.size() > args.size()) {
    return Invalid(kJoinOpName, "number of results", "the call",
                   "at most the " + std::to_string(args.size()) + " operands",
                   std::to_string(rets.size()));
  }
  for (size_t r = 0; r < rets.size(); ++r) {
    std::optional<ffi::AnyBuffer> in, out;
    JT_RETURN_IF_ERROR(GetArg(kJoinOpName, args, r, "input " + std::to_string(r), &in));
    JT_RETURN_IF_ERROR(GetRet(kJoinOpName, rets, r, "result " + std::to_string(r), &out));
    if (in->size_bytes() > 0 && in->untyped_data() != out->untyped_data()) {
      return Invalid(kJoinOpName, "alias", "result " + std::to_string(r),
                     "the buffer of input " + std::to_string(r) + " (aliased, donated)",
                     "a different buffer");
    }
    if (in->size_bytes() > 0 && !TakeLayerTarget(in->untyped_data())) {
      return Invalid(kJoinOpName, "input", "input " + std::to_string(r),
                     "a buffer the layer calls wrote (the program copied it in between, and "
                     "their writes would be lost)",
                     "another buffer");
    }
  }
  return ffi::Error::Success();
}

// Validates a release: `num_values` values, then order-only operands; one token as its result.
inline xla::ffi::Error PrepareRelease(xla::ffi::RemainingArgs args, xla::ffi::RemainingRets rets,
                                      int32_t num_values) {
  if (num_values < 0 || static_cast<size_t>(num_values) > args.size()) {
    return Invalid(kReleaseOpName, "value", "attribute num_values",
                   "in [0, " + std::to_string(args.size()) + "] (the operands of the call)",
                   std::to_string(num_values));
  }
  if (rets.size() != 1) {
    return Invalid(kReleaseOpName, "number of results", "the call", "1 (the token)",
                   std::to_string(rets.size()));
  }
  return xla::ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// The host CPU executor (host_update.cc; plain C++17, no CUDA), shared by the CPU handler and by
// the CUDA handler's `host_cpu` / `split` executors (host_update_kernels.cu), which run it from
// host functions on their own streams.
// ---------------------------------------------------------------------------------------------

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

// Runs `plan` over rows of `p` (elements [0, p.n) as p.n / row_length rows): with `rows` ==
// kRowsOfIds the distinct ids[0 .. num_ids) in [0, num_rows), each once; with kRowsNotInIds
// every row none of them names. Out-of-range ids name no row. `zero` (when not null, an
// operand's buffer of `zero_type`) has each picked row zeroed after the row is updated. Split
// across the CPU thread pool by rows; blocks until done.
void RunCpuPlanRows(const HostUpdateParams& p, const CpuPlan& plan, int64_t row_length,
                    int32_t rows, const int32_t* ids, int64_t num_ids, void* zero,
                    uint8_t zero_type);

// jaxtier's CPU thread pool (host_update.cc), for other host-side work of the handlers (the
// DHA scatter-add: dha.cc). CpuThreads(): its threads, the calling thread included
// (JAXTIER_CPU_THREADS, default: all hardware threads; creates the pool). ParallelFor runs fn(t)
// for every t in [0, num_tasks), on the pool and the calling thread, and returns when all have
// finished; pool threads adopt the caller's floating-point control. One job at a time
// (concurrent callers queue); fn must not call ParallelFor.
int CpuThreads();
void ParallelFor(int64_t num_tasks, const std::function<void(int64_t)>& fn);

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

#endif  // JAXTIER_XLA_FFI_SRC_OP_PROGRAM_H_
