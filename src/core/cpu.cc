#include "core/cpu.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#if KVQ_SIMD_X86
#include <cpuid.h>
#endif

namespace kvq {

namespace detail {
std::atomic<int8_t> simd_level_state{kSimdUnset};
}  // namespace detail

namespace {

SimdLevel detect() {
#if KVQ_SIMD_X86
  __builtin_cpu_init();  // harmless if the runtime already ran it; needed before constructors
  // F16C: clang 14's __builtin_cpu_supports does not know it, so read CPUID.1:ECX bit 29. Its
  // YMM state is the AVX state that __builtin_cpu_supports("avx2") has already checked.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
                    __builtin_cpu_supports("popcnt") && f16c;
  if (!avx2) return SimdLevel::kScalar;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vbmi2");
  return avx512 ? SimdLevel::kAvx512 : SimdLevel::kAvx2;
#else
  return SimdLevel::kScalar;
#endif
}

}  // namespace

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "?";
}

SimdLevel cpu_simd_level() {
  static const SimdLevel level = detect();
  return level;
}

SimdLevel simd_level_from_env(const char* value, SimdLevel cpu) {
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return cpu;
  SimdLevel want;
  if (std::strcmp(value, "scalar") == 0) {
    want = SimdLevel::kScalar;
  } else if (std::strcmp(value, "avx2") == 0) {
    want = SimdLevel::kAvx2;
  } else if (std::strcmp(value, "avx512") == 0) {
    want = SimdLevel::kAvx512;
  } else {
    std::fprintf(stderr,
                 "kvq: warning: KVQ_SIMD=%s is not one of scalar, avx2, avx512, auto; using auto "
                 "(%s)\n",
                 value, simd_level_name(cpu));
    return cpu;
  }
  return want < cpu ? want : cpu;
}

namespace detail {

SimdLevel init_simd_level() {
  // The static makes the environment read (and any warning) happen once, whichever thread
  // gets here first; a level set for testing before that is kept.
  static const SimdLevel from_env = simd_level_from_env(std::getenv("KVQ_SIMD"), cpu_simd_level());
  int8_t expected = kSimdUnset;
  simd_level_state.compare_exchange_strong(expected, static_cast<int8_t>(from_env),
                                           std::memory_order_relaxed);
  return static_cast<SimdLevel>(simd_level_state.load(std::memory_order_relaxed));
}

}  // namespace detail

SimdLevel set_simd_level_for_testing(SimdLevel level) {
  const SimdLevel cpu = cpu_simd_level();
  const SimdLevel set = level < cpu ? level : cpu;
  detail::simd_level_state.store(static_cast<int8_t>(set), std::memory_order_relaxed);
  return set;
}

}  // namespace kvq
