// core/cpu.h — which SIMD paths the library runs, chosen at run time.
//
// libkvq is compiled for the baseline of its architecture (x86-64: SSE2), so one build runs on
// any x86-64 CPU. Each SIMD kernel is a function compiled for its instruction set with a target
// attribute (KVQ_TARGET_AVX2, KVQ_TARGET_AVX512 below) and is called only when simd_level()
// allows it; everything else is plain C++. Every level stores bit-identical bytes (packed codes,
// quantization parameters, entropy-coded streams, fp16/bf16 conversions, the dot products of
// numerics/kernels.h): tests/simd_test.cc compares every dispatched function at every level the
// CPU supports with the scalar level.
//
// Levels, each including the ones below:
//   kScalar  no intrinsics at all: the portable C++ paths (the only level off x86-64). The
//            compiler may still vectorise plain loops for the baseline (SSE2).
//   kAvx2    AVX2, FMA, F16C, BMI1, BMI2 and POPCNT (Intel Haswell, AMD Zen 1 and later). The
//            128-bit SSE2 kernels (bit unpacking, byte transpose) run from this level on too.
//   kAvx512  the AVX2 set plus AVX-512 F, BW, VL, DQ, VBMI and VBMI2 (Intel Ice Lake, AMD Zen 4
//            and later).
//
// The level is what the CPU (and the OS: AVX state must be enabled, which __builtin_cpu_supports
// checks) supports, lowered by the environment variable KVQ_SIMD = scalar | avx2 | avx512 |
// auto, read once on first use. KVQ_SIMD never raises the level above the CPU's (avx512 on an
// AVX2 machine runs avx2); an unknown value prints one line on stderr and means auto. Off x86-64
// there is nothing to choose and the library never asks, so the variable is not read.
#pragma once

#include <atomic>
#include <cstdint>

namespace kvq {

enum class SimdLevel : int8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// "scalar", "avx2", "avx512"
const char* simd_level_name(SimdLevel level);

// What this CPU and OS support (ignores KVQ_SIMD). kScalar off x86-64.
SimdLevel cpu_simd_level();

// The KVQ_SIMD rule: `value` (the variable's text, or null when unset) applied to the CPU's
// level `cpu`. Unknown values print "kvq: warning: ..." on stderr and give `cpu` (auto).
SimdLevel simd_level_from_env(const char* value, SimdLevel cpu);

namespace detail {
inline constexpr int8_t kSimdUnset = -1;
extern std::atomic<int8_t> simd_level_state;  // a SimdLevel, or kSimdUnset before first use
SimdLevel init_simd_level();
}  // namespace detail

// The level every dispatched function runs at: cpu_simd_level() lowered by KVQ_SIMD. One
// relaxed atomic load after the first call, so kernels may ask it on every call.
inline SimdLevel simd_level() {
  const int8_t v = detail::simd_level_state.load(std::memory_order_relaxed);
  return v != detail::kSimdUnset ? static_cast<SimdLevel>(v) : detail::init_simd_level();
}

// Tests only: run the library at `level` from now on, clamped to cpu_simd_level(). Returns the
// level in effect afterwards. Not synchronised with concurrent library calls: change it only
// while no other thread is inside kvq.
SimdLevel set_simd_level_for_testing(SimdLevel level);

// Sets a level for one scope and restores the previous one (tests).
class ScopedSimdLevelForTesting {
 public:
  explicit ScopedSimdLevelForTesting(SimdLevel level)
      : previous_(simd_level()), level_(set_simd_level_for_testing(level)) {}
  ~ScopedSimdLevelForTesting() { set_simd_level_for_testing(previous_); }
  ScopedSimdLevelForTesting(const ScopedSimdLevelForTesting&) = delete;
  ScopedSimdLevelForTesting& operator=(const ScopedSimdLevelForTesting&) = delete;
  // The level actually set (lower than asked for on a CPU without it).
  SimdLevel level() const { return level_; }

 private:
  SimdLevel previous_;
  SimdLevel level_;
};

}  // namespace kvq

// Function attributes for the kernels of each level (GCC and clang). A function carrying one may
// use that level's intrinsics and is compiled (and auto-vectorised) for it; it must only be
// called when simd_level() is at least that level. Helpers that such a function calls with
// vector arguments need the same attribute. KVQ_ALWAYS_INLINE bodies written in plain C++ can be
// compiled once per level by calling them from wrappers with these attributes.
//
// POPCNT is in both sets because every AVX2 CPU has it and std::popcount would otherwise be a
// library call in the rANS encoder's inner loop.
// Defining KVQ_NO_X86_SIMD builds x86-64 as if it were any other architecture: no intrinsics at
// all, the code a non-x86 build compiles (a way to build and test that code on an x86 machine).
#if defined(__x86_64__) && !defined(KVQ_NO_X86_SIMD)
#define KVQ_SIMD_X86 1
#define KVQ_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt")))
#define KVQ_TARGET_AVX512                                                        \
  __attribute__((                                                                \
      target("avx2,fma,f16c,bmi,bmi2,popcnt,avx512f,avx512bw,avx512vl,avx512dq," \
             "avx512vbmi,avx512vbmi2")))
#else
#define KVQ_SIMD_X86 0
#endif
#define KVQ_ALWAYS_INLINE inline __attribute__((always_inline))

// Plain C++ compiled once per level. Given a KVQ_ALWAYS_INLINE function template
// `template <SimdLevel L> ret name_body(...)`, in an anonymous namespace
//   KVQ_LEVEL_CLONES(void, axpy, (float* y, float a, const float* x, int64_t n), (y, a, x, n))
// defines axpy_avx512, axpy_avx2 and axpy_scalar: name_body<L> compiled (and auto-vectorised)
// for each level; inside the public function
//   KVQ_LEVEL_DISPATCH(axpy, (y, a, x, n));
// returns the call of the clone for simd_level(). The clones are out of line, so the public
// function is a load, a compare and a tail jump (calls on rows of 64 elements notice more). A
// body may use L to call a level's intrinsic helpers (plain `inline` functions with that level's
// target attribute: they inline into the clone of that level; an always_inline one would not
// compile into the body template). Use it for loops where a benchmark shows that the width pays.
#define KVQ_LEVEL_CLONE_SCALAR(ret, name, params, args) \
  [[gnu::noinline]] ret name##_scalar params { return name##_body<::kvq::SimdLevel::kScalar> args; }
#if KVQ_SIMD_X86
#define KVQ_LEVEL_CLONES(ret, name, params, args)                \
  [[gnu::noinline]] KVQ_TARGET_AVX512 ret name##_avx512 params { \
    return name##_body<::kvq::SimdLevel::kAvx512> args;          \
  }                                                              \
  [[gnu::noinline]] KVQ_TARGET_AVX2 ret name##_avx2 params {     \
    return name##_body<::kvq::SimdLevel::kAvx2> args;            \
  }                                                              \
  KVQ_LEVEL_CLONE_SCALAR(ret, name, params, args)
#define KVQ_LEVEL_DISPATCH(name, args) \
  switch (::kvq::simd_level()) {       \
    case ::kvq::SimdLevel::kAvx512:    \
      return name##_avx512 args;       \
    case ::kvq::SimdLevel::kAvx2:      \
      return name##_avx2 args;         \
    case ::kvq::SimdLevel::kScalar:    \
      break;                           \
  }                                    \
  return name##_scalar args
#else
#define KVQ_LEVEL_CLONES(ret, name, params, args) KVQ_LEVEL_CLONE_SCALAR(ret, name, params, args)
#define KVQ_LEVEL_DISPATCH(name, args) return name##_scalar args
#endif
