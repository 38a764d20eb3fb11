// CPU handler of `jaxtier_host_update_ffi`: runs the op program (op_program.h, docs/design.md)
// over N elements, in place where the results alias operands.
//
// Execution is blocked interpretation: for a block of kBlock elements each instruction runs over
// the whole block in a tight loop (which the compiler vectorises), with the registers held as
// per-thread fp32 scratch [num_regs][kBlock]. Large calls are split across one persistent,
// lazily created thread pool. The program is first rewritten into a plan (BuildPlan): uniform
// values folded, pairs of arithmetic instructions fused into one pass, f32 vector operands read
// in place and f32 results written by the instruction that computes them, so that fp32 AdamW
// takes 9 passes over a block instead of 19. The element loops are compiled for baseline
// x86-64, AVX2 and AVX-512 (target_clones, chosen at load time); every fp32 operation rounds on
// its own (no FMA contraction, -ffp-contract=off), so every variant gives the same bits.
//
// The layer call (`jaxtier_host_update_layer_ffi`) runs the program over one window of stacked
// operands, or over rows of a table (RunCpuPlanRows): the rows its ids name, or every other
// row, split across the pool by rows.
//
// The same executor (BuildCpuPlan + RunCpuPlan, op_program.h) serves the CUDA handler's
// `host_cpu` and `split` executors, from host functions on jaxtier's streams. The CPU handler
// takes the `executor` / `dha_fraction` attributes (validated) and ignores them: it is the host
// CPU executor already.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "ffi_helpers.h"
#include "handlers.h"
#include "op_program.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtier {
namespace {

using host_update::HostUpdateParams;
using host_update::Instruction;

// Elements per interpreted block: 256 fp32 = 1 KiB per register, so a typical optimizer
// program (about 10 live registers), its memory streams' current block and the prefetched next
// one stay in L1 even when two hyperthreads share it. (Measured with
// benchmarks/diagnostics/host_cpu_microbench.py: 256 and 512 ran alike on one thread, 1024 was slower.)
constexpr int kBlock = 256;
// Below this many elements the call runs on the calling thread.
constexpr int64_t kMinParallelElements = 65536;
// Smallest piece of work handed to one pool task.
constexpr int64_t kMinTaskElements = 16 * kBlock;

#if defined(__clang__)
#define JT_VECTORIZE _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define JT_VECTORIZE _Pragma("GCC ivdep")
#else
#define JT_VECTORIZE
#endif

// ------------------------------------------------------------------------------------------------
// Floating-point control (flush-to-zero / denormals-are-zero, rounding mode). XLA:CPU runs with
// denormals flushed; pool threads adopt the calling thread's setting so that a call gives the
// same bits whether it runs inline or split across the pool.
// ------------------------------------------------------------------------------------------------

uint64_t GetFpControl() {
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
  return _mm_getcsr();
#elif defined(__aarch64__)
  uint64_t fpcr;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
  return fpcr;
#else
  return 0;
#endif
}

void SetFpControl(uint64_t value) {
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
  _mm_setcsr(static_cast<unsigned int>(value) & ~0x3fu);  // keep the sticky flags clear
#elif defined(__aarch64__)
  __asm__ __volatile__("msr fpcr, %0" : : "r"(value));
#else
  (void)value;
#endif
}

// ------------------------------------------------------------------------------------------------
// Thread pool: one per process, created on first use, never destroyed (its threads wait for work
// until the process exits). One job runs at a time; concurrent callers queue on submit_mu_. The
// calling thread runs tasks too.
// ------------------------------------------------------------------------------------------------

class ThreadPool {
 public:
  // Number of threads (including the caller) from JAXTIER_CPU_THREADS, else the hardware.
  static ThreadPool& Global() {
    static ThreadPool* pool = new ThreadPool(ConfiguredThreads());
    return *pool;
  }

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(t) for every t in [0, num_tasks) and returns when all have finished.
  void ParallelFor(int64_t num_tasks, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> submit_lock(submit_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      num_tasks_ = num_tasks;
      fp_control_ = GetFpControl();
      next_task_.store(0, std::memory_order_relaxed);
      busy_workers_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    work_cv_.notify_all();
    RunTasks(fn, num_tasks);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return busy_workers_ == 0; });
    job_ = nullptr;
  }

 private:
  explicit ThreadPool(int num_threads) {
    for (int t = 1; t < num_threads; ++t) workers_.emplace_back([this] { WorkerLoop(); });
  }

  static int ConfiguredThreads() {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("JAXTIER_CPU_THREADS"); env != nullptr && *env != '\0') {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      if (end != env && *end == '\0' && v > 0) n = static_cast<int>(std::min<long>(v, 1024));
    }
    return std::max(n, 1);
  }

  void RunTasks(const std::function<void(int64_t)>& fn, int64_t num_tasks) {
    for (;;) {
      const int64_t t = next_task_.fetch_add(1, std::memory_order_relaxed);
      if (t >= num_tasks) return;
      fn(t);
    }
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    for (;;) {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      const std::function<void(int64_t)>* job = job_;
      const int64_t num_tasks = num_tasks_;
      const uint64_t fp_control = fp_control_;
      lock.unlock();
      SetFpControl(fp_control);
      RunTasks(*job, num_tasks);
      lock.lock();
      if (--busy_workers_ == 0) done_cv_.notify_one();
    }
  }

  std::mutex submit_mu_;  // one job at a time
  std::mutex mu_;         // guards the job fields below
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  int busy_workers_ = 0;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t num_tasks_ = 0;
  uint64_t fp_control_ = 0;
  std::atomic<int64_t> next_task_{0};
  std::vector<std::thread> workers_;
};

// ------------------------------------------------------------------------------------------------
// CPU plan. Before the element loop the program is rewritten once per call:
//   * uniform values (consts, scalar operands, and everything computed only from them) are
//     evaluated once, in fp32 with the same functions, and read as broadcast scalars;
//   * a LOAD of an f32 vector operand reads the operand's memory in place (no copy) unless a
//     STORE into that same buffer (an aliased result) comes before the loaded value's last use.
// The arithmetic is unchanged, so the bits are the same as a plain per-element evaluation.
// ------------------------------------------------------------------------------------------------

using host_update::CpuPlan;
using host_update::kDirectStore;
using host_update::kFusedSecond;
using host_update::kInPlace;
using host_update::kUniformA;
using host_update::kUniformB;
using host_update::kUniformC;
using host_update::PlannedInstruction;

// The registers `u` reads (non-uniform fields only), in `regs`; returns how many.
int ReadRegisters(const PlannedInstruction& u, uint8_t regs[3]) {
  using namespace host_update;  // opcodes
  int n = 0;
  auto add = [&](uint8_t reg, uint8_t bit) {
    if (!(u.mode & bit)) regs[n++] = reg;
  };
  if (u.op2 != 0) {  // fused
    add(u.a, kUniformA);
    if (KindOf(u.op) == OpKind::kBinary) add(u.b, kUniformB);
    add(u.c, kUniformC);
    return n;
  }
  switch (KindOf(u.op)) {
    case OpKind::kTernary:
      add(u.c, kUniformC);
      [[fallthrough]];
    case OpKind::kBinary:
      add(u.b, kUniformB);
      [[fallthrough]];
    case OpKind::kStore:
    case OpKind::kCopy:
    case OpKind::kUnary:
      add(u.a, kUniformA);
      break;
    default:
      break;
  }
  return n;
}

bool Reads(const PlannedInstruction& u, uint8_t reg) {
  uint8_t regs[3];
  const int n = ReadRegisters(u, regs);
  for (int i = 0; i < n; ++i) {
    if (regs[i] == reg) return true;
  }
  return false;
}

// Whether `u` defines register `reg` (every planned instruction but a STORE defines its dst).
bool Defines(const PlannedInstruction& u, uint8_t reg) {
  return u.op != host_update::kStore && u.dst == reg;
}

// The ops a fused instruction takes: first (t = op(x, y) or op(x)) and second (op2(t, z)).
bool FusableFirst(uint8_t op) {
  using namespace host_update;  // opcodes
  return op == kAdd || op == kSub || op == kMul || op == kDiv || op == kSqrt;
}
bool FusableSecond(uint8_t op) {
  using namespace host_update;  // opcodes
  return op == kAdd || op == kSub || op == kMul || op == kDiv;
}

// Drops the instructions marked dead (op 0), keeping the order.
void Compact(CpuPlan* plan) {
  int out = 0;
  for (int k = 0; k < plan->num_instructions; ++k) {
    if (plan->instructions[k].op != 0) plan->instructions[out++] = plan->instructions[k];
  }
  plan->num_instructions = out;
}

// Pair fusion: an arithmetic instruction k (t = op(x, y)) whose value has exactly one reader m,
// a binary arithmetic instruction, is computed inside m (r = op2(t, z)), so that t never goes
// through memory. Moving k's evaluation down to m is exact when nothing between k and m
// redefines x, y or t; m then reads x and y (MarkInPlaceLoads runs after this and sees those
// reads at m). The order of every operation's operands is kept (kFusedSecond), so NaN payloads
// propagate as before.
void FusePairs(CpuPlan* plan) {
  using namespace host_update;  // opcodes
  const int n = plan->num_instructions;
  PlannedInstruction* code = plan->instructions;
  for (int k = 0; k < n; ++k) {
    const PlannedInstruction first = code[k];
    if (first.op == 0 || first.op2 != 0 || !FusableFirst(first.op)) continue;
    const bool unary = KindOf(first.op) == OpKind::kUnary;
    const uint8_t t = first.dst;
    uint8_t inputs[3];
    const int num_inputs = ReadRegisters(first, inputs);
    // The first reader of t, with nothing in between redefining t or the inputs.
    int m = -1;
    for (int j = k + 1; j < n && m < 0; ++j) {
      const PlannedInstruction& u = code[j];
      if (u.op == 0) continue;
      if (Reads(u, t)) {
        m = j;
        break;
      }
      bool clobbers = Defines(u, t);
      for (int i = 0; i < num_inputs; ++i) clobbers = clobbers || Defines(u, inputs[i]);
      if (clobbers) break;
    }
    if (m < 0) continue;
    const PlannedInstruction second = code[m];
    if (second.op2 != 0 || KindOf(second.op) != OpKind::kBinary || !FusableSecond(second.op)) {
      continue;
    }
    const bool t_is_a = !(second.mode & kUniformA) && second.a == t;
    const bool t_is_b = !(second.mode & kUniformB) && second.b == t;
    if (t_is_a == t_is_b) continue;  // read twice (t op t)
    // t is dead after m: m redefines it, or no later instruction reads it before a redefinition.
    bool dead = true;
    for (int j = m + 1; j < n && second.dst != t; ++j) {
      if (code[j].op == 0) continue;
      if (Reads(code[j], t)) {
        dead = false;
        break;
      }
      if (Defines(code[j], t)) break;
    }
    if (!dead) continue;
    PlannedInstruction fused = first;
    fused.mode = first.mode & (kUniformA | kUniformB);
    if (unary) fused.b = fused.a;
    fused.op2 = second.op;
    fused.dst = second.dst;
    if (t_is_a) {
      fused.c = second.b;
      if (second.mode & kUniformB) fused.mode |= kUniformC;
    } else {
      fused.c = second.a;
      if (second.mode & kUniformA) fused.mode |= kUniformC;
      fused.mode |= kFusedSecond;
    }
    code[m] = fused;
    code[k].op = 0;  // dead
  }
  Compact(plan);
}

// In-place LOADs of f32 vector operands: safe unless a STORE into the operand's buffer (a
// result aliasing it) runs before the last read of the loaded register.
void MarkInPlaceLoads(const HostUpdateParams& p, CpuPlan* plan) {
  using namespace host_update;  // opcodes
  for (int k = 0; k < plan->num_instructions; ++k) {
    PlannedInstruction& ld = plan->instructions[k];
    if (ld.op != kLoad || p.operand_type[ld.a] != kF32) continue;
    const uint8_t reg = ld.dst;
    int last_read = k;
    int first_clobber = plan->num_instructions;  // first STORE into the operand's buffer
    for (int j = k + 1; j < plan->num_instructions; ++j) {
      const PlannedInstruction& u = plan->instructions[j];
      if (Reads(u, reg)) last_read = j;
      if (u.op == kStore && p.results[u.dst] == p.operands[ld.a] &&
          first_clobber == plan->num_instructions) {
        first_clobber = j;
      }
      if (Defines(u, reg)) break;  // redefined: this value is dead
    }
    // A STORE that is itself the last read copies the value onto itself: still safe.
    if (first_clobber >= last_read) ld.mode |= kInPlace;
  }
}

// Folds the STORE of a computed register into an f32 result into the register's definition d,
// which then writes the result's memory directly (kDirectStore); the STORE is dropped. Moving the
// write from the STORE s up to d is exact when: the result is stored only there; d is an
// arithmetic definition (not a LOAD); and, when the result aliases an operand, nothing in
// (d, s) reads that operand's old values (no LOAD of it, no read of an in-place view of it).
// Later reads of the register read the result's memory, which nothing else writes.
void FoldStores(const HostUpdateParams& p, CpuPlan* plan) {
  using namespace host_update;  // opcodes
  const int n = plan->num_instructions;
  PlannedInstruction* code = plan->instructions;
  for (int s = 0; s < n; ++s) {
    const PlannedInstruction st = code[s];
    if (st.op != kStore || (st.mode & kUniformA) || p.result_type[st.dst] != kF32) continue;
    int stores = 0;
    for (int j = 0; j < n; ++j) stores += code[j].op == kStore && code[j].dst == st.dst;
    if (stores != 1) continue;
    int d = s - 1;
    while (d >= 0 && !Defines(code[d], st.a)) --d;
    if (d < 0 || code[d].op == kLoad || code[d].op == 0 || (code[d].mode & kDirectStore)) continue;
    // The operand whose buffer this result is (at most one: PrepareHostUpdate), if any.
    int aliased = -1;
    for (int i = 0; i < p.num_operands; ++i) {
      if (!p.operand_scalar[i] && p.operands[i] == p.results[st.dst]) aliased = i;
    }
    bool safe = true;
    if (aliased >= 0) {
      // view[r]: register r currently holds an in-place view of the aliased operand.
      bool view[kMaxRegisters] = {};
      for (int j = 0; j < s && safe; ++j) {
        const PlannedInstruction& u = code[j];
        if (j > d) {
          if (u.op == kLoad && u.a == aliased) safe = false;
          uint8_t regs[3];
          const int num = ReadRegisters(u, regs);
          for (int i = 0; i < num; ++i) safe = safe && !view[regs[i]];
        }
        if (u.op != kStore) {
          view[u.dst] = u.op == kLoad && (u.mode & kInPlace) && u.a == aliased;
        }
      }
    }
    if (!safe) continue;
    code[d].mode |= kDirectStore;
    code[d].result = st.dst;
    code[s].op = 0;  // dead
  }
  Compact(plan);
}

void BuildPlan(const HostUpdateParams& p, CpuPlan* plan) {
  using namespace host_update;  // opcodes
  bool is_uniform[kMaxRegisters] = {};
  uint8_t slot_of[kMaxRegisters] = {};
  int num_slots = 0;
  auto new_uniform = [&](int reg, float value) {
    plan->uniform[num_slots] = value;
    is_uniform[reg] = true;
    slot_of[reg] = static_cast<uint8_t>(num_slots++);
  };

  for (int k = 0; k < p.num_instructions; ++k) {
    const Instruction ins = p.instructions[k];
    const OpKind kind = KindOf(ins.op);
    PlannedInstruction out{ins.op, 0, ins.dst, ins.a, ins.b, ins.c};
    auto field = [&](uint8_t reg, uint8_t bit, uint8_t* f) {
      if (is_uniform[reg]) {
        out.mode |= bit;
        *f = slot_of[reg];
      }
    };
    switch (kind) {
      case OpKind::kLoad:
        if (p.operand_scalar[ins.a]) {
          new_uniform(ins.dst, LoadAsFloat(p.operands[ins.a], p.operand_type[ins.a], 0));
          continue;
        }
        break;
      case OpKind::kConst:
        new_uniform(ins.dst, p.consts[ins.a]);
        continue;
      case OpKind::kStore:
        field(ins.a, kUniformA, &out.a);
        plan->instructions[plan->num_instructions++] = out;
        continue;  // writes no register
      case OpKind::kCopy:
        if (is_uniform[ins.a]) {
          is_uniform[ins.dst] = true;
          slot_of[ins.dst] = slot_of[ins.a];
          continue;
        }
        break;
      case OpKind::kUnary:
        if (is_uniform[ins.a]) {
          new_uniform(ins.dst, EvalUnary(ins.op, plan->uniform[slot_of[ins.a]]));
          continue;
        }
        break;
      case OpKind::kBinary:
        if (is_uniform[ins.a] && is_uniform[ins.b]) {
          new_uniform(ins.dst, EvalBinary(ins.op, plan->uniform[slot_of[ins.a]],
                                          plan->uniform[slot_of[ins.b]]));
          continue;
        }
        field(ins.a, kUniformA, &out.a);
        field(ins.b, kUniformB, &out.b);
        break;
      case OpKind::kTernary:
        if (is_uniform[ins.a] && is_uniform[ins.b] && is_uniform[ins.c]) {
          new_uniform(ins.dst,
                      EvalTernary(ins.op, plan->uniform[slot_of[ins.a]],
                                  plan->uniform[slot_of[ins.b]], plan->uniform[slot_of[ins.c]]));
          continue;
        }
        field(ins.a, kUniformA, &out.a);
        field(ins.b, kUniformB, &out.b);
        field(ins.c, kUniformC, &out.c);
        break;
      case OpKind::kInvalid:
        continue;
    }
    is_uniform[ins.dst] = false;  // a vector definition
    plan->instructions[plan->num_instructions++] = out;
  }

  FusePairs(plan);
  MarkInPlaceLoads(p, plan);
  FoldStores(p, plan);
}

// ------------------------------------------------------------------------------------------------
// Block loops. A destination block may coincide with a source block (dst == a), which is safe for
// elementwise loops; the vectorize pragmas tell the compiler so. Uniform inputs are broadcast.
// ------------------------------------------------------------------------------------------------

#if defined(__GNUC__)
#define JT_INLINE inline __attribute__((always_inline))
#else
#define JT_INLINE inline
#endif

// Clones of the element loop for wider vector units, chosen at load time (x86-64 + glibc ifunc).
// Portable: the default clone is baseline x86-64.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(JAXTIER_NO_TARGET_CLONES)
#define JT_TARGET_CLONES __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define JT_TARGET_CLONES
#endif

template <int kOp>
JT_INLINE void UnaryBlock(float* d, const float* x, int len) {
  JT_VECTORIZE
  for (int j = 0; j < len; ++j) d[j] = host_update::ApplyUnary<kOp>(x[j]);
}

template <int kOp, bool kUa, bool kUb>
JT_INLINE void BinaryBlock(float* d, const float* x, const float* y, int len) {
  const float xs = *x, ys = *y;
  JT_VECTORIZE
  for (int j = 0; j < len; ++j) {
    d[j] = host_update::ApplyBinary<kOp>(kUa ? xs : x[j], kUb ? ys : y[j]);
  }
}

template <int kOp, bool kUa, bool kUb, bool kUc>
JT_INLINE void TernaryBlock(float* d, const float* x, const float* y, const float* z, int len) {
  const float xs = *x, ys = *y, zs = *z;
  JT_VECTORIZE
  for (int j = 0; j < len; ++j) {
    d[j] = host_update::ApplyTernary<kOp>(kUa ? xs : x[j], kUb ? ys : y[j], kUc ? zs : z[j]);
  }
}

// A fused pair (PlannedInstruction): t = op(x, y) (or op(x)), d = op2(t, z) (or op2(z, t)).
template <int kOp, int kOp2, bool kSecond, bool kUa, bool kUb, bool kUc>
JT_INLINE void FusedBlock(float* d, const float* x, const float* y, const float* z, int len) {
  constexpr bool kUnary = kOp >= host_update::kFirstUnary && kOp <= host_update::kLastUnary;
  const float xs = *x, ys = *y, zs = *z;
  JT_VECTORIZE
  for (int j = 0; j < len; ++j) {
    float t;
    if constexpr (kUnary) {
      t = host_update::ApplyUnary<kOp>(x[j]);
    } else {
      t = host_update::ApplyBinary<kOp>(kUa ? xs : x[j], kUb ? ys : y[j]);
    }
    const float w = kUc ? zs : z[j];
    d[j] = kSecond ? host_update::ApplyBinary<kOp2>(w, t) : host_update::ApplyBinary<kOp2>(t, w);
  }
}

template <int kOp, int kOp2, bool kSecond>
JT_INLINE void FusedModes(int mode, float* d, const float* x, const float* y, const float* z,
                          int len) {
  using host_update::kUniformA;
  using host_update::kUniformB;
  using host_update::kUniformC;
  const bool uc = (mode & kUniformC) != 0;
  switch (mode & (kUniformA | kUniformB)) {
    case kUniformA:
      if (uc) return FusedBlock<kOp, kOp2, kSecond, true, false, true>(d, x, y, z, len);
      return FusedBlock<kOp, kOp2, kSecond, true, false, false>(d, x, y, z, len);
    case kUniformB:
      if (uc) return FusedBlock<kOp, kOp2, kSecond, false, true, true>(d, x, y, z, len);
      return FusedBlock<kOp, kOp2, kSecond, false, true, false>(d, x, y, z, len);
    default:
      if (uc) return FusedBlock<kOp, kOp2, kSecond, false, false, true>(d, x, y, z, len);
      return FusedBlock<kOp, kOp2, kSecond, false, false, false>(d, x, y, z, len);
  }
}

template <int kOp, int kOp2>
JT_INLINE void FusedOrder(int mode, float* d, const float* x, const float* y, const float* z,
                          int len) {
  if (mode & host_update::kFusedSecond) return FusedModes<kOp, kOp2, true>(mode, d, x, y, z, len);
  return FusedModes<kOp, kOp2, false>(mode, d, x, y, z, len);
}

template <int kOp>
JT_INLINE void FusedSecondOp(int op2, int mode, float* d, const float* x, const float* y,
                             const float* z, int len) {
  using namespace host_update;  // opcodes
  switch (op2) {
    case kAdd: return FusedOrder<kOp, kAdd>(mode, d, x, y, z, len);
    case kSub: return FusedOrder<kOp, kSub>(mode, d, x, y, z, len);
    case kMul: return FusedOrder<kOp, kMul>(mode, d, x, y, z, len);
    default: return FusedOrder<kOp, kDiv>(mode, d, x, y, z, len);
  }
}

// Runs one fused instruction over a block (its own function: the pair kernels are many).
JT_TARGET_CLONES
void FusedInstruction(int op, int op2, int mode, float* d, const float* x, const float* y,
                      const float* z, int len) {
  using namespace host_update;  // opcodes
  switch (op) {
    case kAdd: return FusedSecondOp<kAdd>(op2, mode, d, x, y, z, len);
    case kSub: return FusedSecondOp<kSub>(op2, mode, d, x, y, z, len);
    case kMul: return FusedSecondOp<kMul>(op2, mode, d, x, y, z, len);
    case kDiv: return FusedSecondOp<kDiv>(op2, mode, d, x, y, z, len);
    default: return FusedSecondOp<kSqrt>(op2, mode, d, x, y, z, len);
  }
}

JT_INLINE void LoadBlock(const void* base, uint8_t type, int64_t i0, int len, float* d) {
  switch (type) {
    case host_update::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + i0;
      JT_VECTORIZE
      for (int j = 0; j < len; ++j) d[j] = host_update::Bf16ToFloat(src[j]);
      break;
    }
    case host_update::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + i0;
      JT_VECTORIZE
      for (int j = 0; j < len; ++j) d[j] = host_update::F16ToFloat(src[j]);
      break;
    }
    default: {
      const float* src = static_cast<const float*>(base) + i0;
      JT_VECTORIZE
      for (int j = 0; j < len; ++j) d[j] = src[j];
      break;
    }
  }
}

template <bool kUniform>
JT_INLINE void StoreBlock(void* base, uint8_t type, int64_t i0, int len, const float* x) {
  const float xs = *x;
  switch (type) {
    case host_update::kBF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + i0;
      JT_VECTORIZE
      for (int j = 0; j < len; ++j) dst[j] = host_update::FloatToBf16(kUniform ? xs : x[j]);
      break;
    }
    case host_update::kF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + i0;
      JT_VECTORIZE
      for (int j = 0; j < len; ++j) dst[j] = host_update::FloatToF16(kUniform ? xs : x[j]);
      break;
    }
    default: {
      float* dst = static_cast<float*>(base) + i0;
      if (!kUniform && dst == x) break;  // storing a value back where it was loaded from
      JT_VECTORIZE
      for (int j = 0; j < len; ++j) dst[j] = kUniform ? xs : x[j];
      break;
    }
  }
}

// Runs the plan over elements [begin, end). `scratch` holds kMaxRegisters * kBlock floats.
JT_TARGET_CLONES
void RunRange(const HostUpdateParams& p, const CpuPlan& plan, int64_t begin, int64_t end,
              float* scratch) {
  using namespace host_update;  // opcodes
  const float* src[kMaxRegisters];  // where each register's current block lives
  // The memory streams of the plan (vector operands loaded, results stored): the next block of
  // each is prefetched into L1 while this block runs, a few lines per instruction, so that DRAM
  // reads overlap the block's passes. (Measured: 1.6 vs 1.0 G params/s on one thread for fp32
  // AdamW from DRAM; prefetching whole blocks at once, two or four blocks ahead, was slower than
  // none.)
  const char* streams[kMaxOperands + kMaxResults];
  int stream_bytes[kMaxOperands + kMaxResults];
  int num_streams = 0;
  for (int k = 0; k < plan.num_instructions; ++k) {
    const PlannedInstruction& ins = plan.instructions[k];
    const void* base;
    int bytes;
    if (ins.op == kLoad) {
      base = p.operands[ins.a];
      bytes = static_cast<int>(StorageBytes(p.operand_type[ins.a]));
    } else if (ins.op == kStore || (ins.mode & kDirectStore)) {
      const int r = ins.op == kStore ? ins.dst : ins.result;
      base = p.results[r];
      bytes = static_cast<int>(StorageBytes(p.result_type[r]));
    } else {
      continue;
    }
    bool seen = false;
    for (int s = 0; s < num_streams; ++s) seen = seen || streams[s] == base;
    if (!seen) {
      streams[num_streams] = static_cast<const char*>(base);
      stream_bytes[num_streams++] = bytes;
    }
  }
  const int lines_per_stream_max = kBlock * 4 / 64;
  const int total_lines = num_streams * lines_per_stream_max;
  const int lines_per_instruction =
      (total_lines + plan.num_instructions - 1) / std::max(plan.num_instructions, 1);
  for (int64_t i0 = begin; i0 < end; i0 += kBlock) {
    const int len = static_cast<int>(std::min<int64_t>(kBlock, end - i0));
    const int64_t ahead = i0 + kBlock;
    const int64_t ahead_len = std::min<int64_t>(kBlock, end - ahead);  // <= 0: none
    int next_line = 0;  // of total_lines: stream next_line / lines_per_stream_max
    for (int k = 0; k < plan.num_instructions; ++k) {
      if (ahead_len > 0) {
        for (int q = 0; q < lines_per_instruction && next_line < total_lines; ++q, ++next_line) {
          const int s = next_line / lines_per_stream_max;
          const int64_t byte = static_cast<int64_t>(next_line % lines_per_stream_max) * 64;
          if (byte < ahead_len * stream_bytes[s]) {
            __builtin_prefetch(streams[s] + ahead * stream_bytes[s] + byte, 0, 3);
          }
        }
      }
      const PlannedInstruction ins = plan.instructions[k];
      const int mode = ins.mode;
      float* d = (mode & kDirectStore)
                     ? static_cast<float*>(p.results[ins.result]) + i0
                     : scratch + static_cast<int64_t>(ins.dst) * kBlock;
      const float* x = (mode & kUniformA) ? &plan.uniform[ins.a] : src[ins.a];
      const float* y = (mode & kUniformB) ? &plan.uniform[ins.b] : src[ins.b];
      const float* z = (mode & kUniformC) ? &plan.uniform[ins.c] : src[ins.c];
      if (ins.op2 != 0) {
        FusedInstruction(ins.op, ins.op2, mode, d, x, y, z, len);
        src[ins.dst] = d;
        continue;
      }
      switch (ins.op) {
        case kLoad:
          if (mode & kInPlace) {
            src[ins.dst] = static_cast<const float*>(p.operands[ins.a]) + i0;
            continue;
          }
          LoadBlock(p.operands[ins.a], p.operand_type[ins.a], i0, len, d);
          break;
        case kStore:
          if (mode & kUniformA) {
            StoreBlock<true>(p.results[ins.dst], p.result_type[ins.dst], i0, len, x);
          } else {
            StoreBlock<false>(p.results[ins.dst], p.result_type[ins.dst], i0, len, x);
          }
          continue;  // writes no register
        case kCopy:
          if (d != x) std::copy(x, x + len, d);
          break;
#define JT_UNARY(OP)           \
  case OP:                     \
    UnaryBlock<OP>(d, x, len); \
    break;
          JT_UNARY(kNeg) JT_UNARY(kAbs) JT_UNARY(kSqrt) JT_UNARY(kRsqrt) JT_UNARY(kExp)
          JT_UNARY(kLog) JT_UNARY(kTanh) JT_UNARY(kLogistic) JT_UNARY(kSign) JT_UNARY(kFloor)
          JT_UNARY(kCeil) JT_UNARY(kLog1p) JT_UNARY(kExpm1) JT_UNARY(kSin) JT_UNARY(kCos)
          JT_UNARY(kNot) JT_UNARY(kErf) JT_UNARY(kRound) JT_UNARY(kIsFinite)
#undef JT_UNARY
#define JT_BINARY(OP)                                                   \
  case OP:                                                              \
    if (mode & kUniformA) {                                             \
      BinaryBlock<OP, true, false>(d, x, y, len);                       \
    } else if (mode & kUniformB) {                                      \
      BinaryBlock<OP, false, true>(d, x, y, len);                       \
    } else {                                                            \
      BinaryBlock<OP, false, false>(d, x, y, len);                      \
    }                                                                   \
    break;
          JT_BINARY(kAdd) JT_BINARY(kSub) JT_BINARY(kMul) JT_BINARY(kDiv) JT_BINARY(kMax)
          JT_BINARY(kMin) JT_BINARY(kPow) JT_BINARY(kAtan2) JT_BINARY(kGt) JT_BINARY(kGe)
          JT_BINARY(kLt) JT_BINARY(kLe) JT_BINARY(kEq) JT_BINARY(kNe) JT_BINARY(kAnd)
          JT_BINARY(kOr) JT_BINARY(kRem)
#undef JT_BINARY
#define JT_TERNARY(OP)                                                               \
  case OP:                                                                           \
    switch (mode & (kUniformA | kUniformB | kUniformC)) {                            \
      case 0: TernaryBlock<OP, false, false, false>(d, x, y, z, len); break;         \
      case kUniformA: TernaryBlock<OP, true, false, false>(d, x, y, z, len); break;  \
      case kUniformB: TernaryBlock<OP, false, true, false>(d, x, y, z, len); break;  \
      case kUniformC: TernaryBlock<OP, false, false, true>(d, x, y, z, len); break;  \
      case kUniformA | kUniformB:                                                    \
        TernaryBlock<OP, true, true, false>(d, x, y, z, len);                        \
        break;                                                                       \
      case kUniformA | kUniformC:                                                    \
        TernaryBlock<OP, true, false, true>(d, x, y, z, len);                        \
        break;                                                                       \
      default:                                                                       \
        TernaryBlock<OP, false, true, true>(d, x, y, z, len);                        \
        break;                                                                       \
    }                                                                                \
    break;
          JT_TERNARY(kSelect) JT_TERNARY(kClamp)
#undef JT_TERNARY
        default:
          continue;  // rejected by PrepareHostUpdate
      }
      src[ins.dst] = d;
    }
  }
}

// Register blocks start on cache lines (64 bytes), so that no vector load or store of a block
// straddles two lines.
struct alignas(64) RegisterBlock {
  float v[kBlock];
};

float* ThreadScratch() {
  thread_local std::unique_ptr<RegisterBlock[]> scratch(
      new RegisterBlock[host_update::kMaxRegisters]);
  return scratch[0].v;
}

ffi::Error HostUpdateCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                             ffi::Dictionary attrs) {
  host_update::HostUpdateAttrs a;
  HostUpdateParams params;
  JT_RETURN_IF_ERROR(host_update::DecodeAndPrepare(args, rets, attrs, &a, &params));
  if (params.n == 0 || params.num_instructions == 0) return ffi::Error::Success();
  // The plan is about 2.5 KB: keep it off the (XLA:CPU) caller's stack.
  auto plan = std::make_unique<CpuPlan>();
  BuildPlan(params, plan.get());
  host_update::RunCpuPlan(params, *plan, 0, params.n);
  return ffi::Error::Success();
}

// The layer call runs at once on the CPU backend, when XLA:CPU's thunk executor reaches it (by
// its operands: the lowering orders it with order-only operands and tokens).
ffi::Error HostUpdateLayerCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                  ffi::Dictionary attrs) {
  host_update::LayerAttrs a;
  HostUpdateParams params;
  int32_t aliases[host_update::kMaxResults];
  host_update::LayerRows rows;
  JT_RETURN_IF_ERROR(
      host_update::DecodeAndPrepareLayer(args, rets, attrs, &a, &params, aliases, &rows));
  if (params.n == 0 || params.num_instructions == 0) return ffi::Error::Success();
  auto plan = std::make_unique<CpuPlan>();
  BuildPlan(params, plan.get());
  if (a.rows == host_update::kWindow) {
    host_update::RunCpuPlan(params, *plan, 0, params.n);
  } else {
    const uint8_t zero_type = a.zero_operand >= 0 ? params.operand_type[a.zero_operand] : 0;
    host_update::RunCpuPlanRows(params, *plan, a.row_length, a.rows, rows.ids, rows.num_ids,
                                const_cast<void*>(rows.zero_base), zero_type);
  }
  return ffi::Error::Success();
}

ffi::Error HostUpdateJoinCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return host_update::PrepareJoin(args, rets);
}

// The layer calls of the CPU backend have run when they return: nothing to wait for.
ffi::Error HostUpdateReleaseCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                    int32_t num_values) {
  return host_update::PrepareRelease(args, rets, num_values);
}

}  // namespace

namespace host_update {

namespace {
std::mutex g_layer_targets_mu;
std::unordered_multiset<const void*>& LayerTargets() {
  static auto* targets = new std::unordered_multiset<const void*>();
  return *targets;
}
}  // namespace

void RecordLayerTargets(const void* const* bases, int count) {
  std::lock_guard<std::mutex> lock(g_layer_targets_mu);
  for (int r = 0; r < count; ++r) LayerTargets().insert(bases[r]);
}

bool TakeLayerTarget(const void* base) {
  std::lock_guard<std::mutex> lock(g_layer_targets_mu);
  auto& targets = LayerTargets();
  if (targets.find(base) == targets.end()) return false;
  // One join per written buffer: every record of it is taken.
  targets.erase(base);
  return true;
}

void BuildCpuPlan(const HostUpdateParams& p, CpuPlan* plan) {
  *plan = CpuPlan();
  BuildPlan(p, plan);
}

void RunCpuPlan(const HostUpdateParams& p, const CpuPlan& plan, int64_t lo, int64_t hi) {
  const int64_t n = hi - lo;
  if (n <= 0 || plan.num_instructions == 0) return;
  ThreadPool* pool = n >= kMinParallelElements ? &ThreadPool::Global() : nullptr;
  if (pool == nullptr || pool->num_threads() == 1) {
    RunRange(p, plan, lo, hi, ThreadScratch());
    return;
  }
  // About four tasks per thread (for balance), each a whole number of blocks.
  const int64_t target = (n + 4 * pool->num_threads() - 1) / (4 * pool->num_threads());
  const int64_t task = std::max(kMinTaskElements, (target + kBlock - 1) / kBlock * kBlock);
  const int64_t num_tasks = (n + task - 1) / task;
  pool->ParallelFor(num_tasks, [&](int64_t t) {
    const int64_t begin = lo + t * task;
    RunRange(p, plan, begin, std::min(hi, begin + task), ThreadScratch());
  });
}

void RunCpuPlanRows(const HostUpdateParams& p, const CpuPlan& plan, int64_t row_length,
                    int32_t rows, const int32_t* ids, int64_t num_ids, void* zero,
                    uint8_t zero_type) {
  if (row_length <= 0 || plan.num_instructions == 0) return;
  const int64_t num_rows = p.n / row_length;
  std::vector<uint8_t> named(static_cast<size_t>(num_rows), 0);
  for (int64_t n = 0; n < num_ids; ++n) {
    const int32_t id = ids[n];
    if (id >= 0 && id < num_rows) named[id] = 1;
  }
  const uint8_t want = rows == kRowsOfIds ? 1 : 0;
  // The picked rows as runs [first, last) in row order, and the ordinal of each run's first.
  std::vector<std::pair<int64_t, int64_t>> runs;
  std::vector<int64_t> first_ordinal;
  int64_t picked = 0;
  for (int64_t r = 0; r < num_rows;) {
    if (named[r] != want) {
      ++r;
      continue;
    }
    const int64_t begin = r;
    while (r < num_rows && named[r] == want) ++r;
    runs.emplace_back(begin, r);
    first_ordinal.push_back(picked);
    picked += r - begin;
  }
  if (picked == 0) return;
  // About four tasks per thread, each a whole number of rows of at least kMinTaskElements.
  const int64_t threads = picked * row_length < kMinParallelElements ? 1 : CpuThreads();
  const int64_t min_rows = (kMinTaskElements + row_length - 1) / row_length;
  const int64_t rows_per_task =
      std::max(min_rows, (picked + 4 * threads - 1) / (4 * threads));
  const int64_t num_tasks = (picked + rows_per_task - 1) / rows_per_task;
  const int64_t zero_row_bytes = row_length * StorageBytes(zero_type);
  ParallelFor(num_tasks, [&](int64_t t) {
    int64_t lo = t * rows_per_task;
    const int64_t hi = std::min(picked, lo + rows_per_task);
    size_t k = static_cast<size_t>(
        std::upper_bound(first_ordinal.begin(), first_ordinal.end(), lo) -
        first_ordinal.begin() - 1);
    float* scratch = ThreadScratch();
    while (lo < hi) {
      const int64_t skip = lo - first_ordinal[k];
      const int64_t row = runs[k].first + skip;
      const int64_t take = std::min(hi - lo, runs[k].second - runs[k].first - skip);
      RunRange(p, plan, row * row_length, (row + take) * row_length, scratch);
      if (zero != nullptr) {
        memset(static_cast<char*>(zero) + row * zero_row_bytes, 0,
               static_cast<size_t>(take * zero_row_bytes));
      }
      lo += take;
      ++k;
    }
  });
}

int CpuThreads() { return ThreadPool::Global().num_threads(); }

void ParallelFor(int64_t num_tasks, const std::function<void(int64_t)>& fn) {
  if (num_tasks <= 0) return;
  if (num_tasks == 1 || ThreadPool::Global().num_threads() == 1) {  // no wake-up of the pool
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  ThreadPool::Global().ParallelFor(num_tasks, fn);
}

ScopedIeeeFloatingPoint::ScopedIeeeFloatingPoint() : saved_(GetFpControl()) {
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
  SetFpControl(0x1f80);  // all exceptions masked, round to nearest, no FTZ / DAZ
#elif defined(__aarch64__)
  SetFpControl(0);  // round to nearest, no flush-to-zero
#endif
}

ScopedIeeeFloatingPoint::~ScopedIeeeFloatingPoint() { SetFpControl(saved_); }

}  // namespace host_update

// Attributes are decoded as a dictionary (DecodeHostUpdateAttrs) so that `executor` and
// `dha_fraction` may be absent.
XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateCpu, HostUpdateCpuImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()                // operands
                                  .RemainingRets()                // results
                                  .Attrs<ffi::Dictionary>());     // program, consts, num_regs,
                                                                  // aliases, executor,
                                                                  // dha_fraction


XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateLayerCpu, HostUpdateLayerCpuImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()              // operands, then order-only
                                  .RemainingRets()              // the token
                                  .Attrs<ffi::Dictionary>());   // as DecodeLayerAttrs

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateJoinCpu, HostUpdateJoinCpuImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()    // pass-through arrays, then order-only
                                  .RemainingRets());  // the arrays, aliased

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostUpdateReleaseCpu, HostUpdateReleaseCpuImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()                     // values, then order-only
                                  .RemainingRets()                     // the token
                                  .Attr<int32_t>("num_values"));       // num_values

}  // namespace jaxtier
