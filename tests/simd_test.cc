// Run-time SIMD dispatch (core/cpu.h): the level rules (KVQ_SIMD, clamping, the testing
// override), and, for every level this CPU supports, every dispatched function on varied inputs
// (odd lengths, every bit width, edge values) against the scalar level, bit for bit. Ends with
// whole caches of every method: the same stored bytes, reads and attention at every level.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/cpu.h"
#include "core/file_io.h"
#include "entropy/cachegen_codes.h"
#include "entropy/freq_table.h"
#include "entropy/rans.h"
#include "entropy/symbol_codec.h"
#include "entropy/transpose.h"
#include "kvq/bitpack.h"
#include "kvq/cache.h"
#include "kvq/container.h"
#include "kvq/dtype.h"
#include "kvq/group_quant.h"
#include "kvq/spec.h"
#include "kvq/zipcache.h"
#include "numerics/attention.h"
#include "numerics/kernels.h"
#include "test_util.h"

namespace kvq {
namespace {

// ---- helpers -------------------------------------------------------------------------------

// Every level this CPU supports, scalar first.
std::vector<SimdLevel> levels() {
  std::vector<SimdLevel> out;
  for (SimdLevel l : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512})
    if (l <= cpu_simd_level()) out.push_back(l);
  return out;
}

// The bytes of a result, so that floats compare by bit pattern (NaNs and -0 included).
template <class T>
void append_bytes(std::vector<uint8_t>& out, const T* data, size_t n) {
  const auto* p = reinterpret_cast<const uint8_t*>(data);
  out.insert(out.end(), p, p + n * sizeof(T));
}
template <class T>
void append_bytes(std::vector<uint8_t>& out, const std::vector<T>& v) {
  append_bytes(out, v.data(), v.size());
}
template <class T>
void append_value(std::vector<uint8_t>& out, const T& v) {
  append_bytes(out, &v, 1);
}

// Runs fn() (returning the bytes it produced) at every supported level and checks that each
// level produces exactly the scalar level's bytes. Reports the first differing byte.
template <class Fn>
void expect_same_at_every_level(const std::string& what, Fn&& fn) {
  std::vector<uint8_t> scalar;
  for (SimdLevel l : levels()) {
    ScopedSimdLevelForTesting at(l);
    ASSERT_EQ(at.level(), l);
    std::vector<uint8_t> got = fn();
    if (l == SimdLevel::kScalar) {
      scalar = std::move(got);
      continue;
    }
    ASSERT_EQ(got.size(), scalar.size()) << what << " at " << simd_level_name(l);
    const auto mm = std::mismatch(got.begin(), got.end(), scalar.begin());
    ASSERT_TRUE(mm.first == got.end())
        << what << " at " << simd_level_name(l) << ": byte " << (mm.first - got.begin()) << " is "
        << int{*mm.first} << ", scalar has " << int{*mm.second};
  }
}

// (Loops over shapes below copy each pair into plain locals: clang 14 cannot capture structured
// bindings in lambdas.)

// Lengths around every vector width and unrolling step.
const std::vector<size_t>& lengths() {
  static const std::vector<size_t> v = {0,  1,  2,  3,  5,  7,  8,  9,   15,  16,  17,  23,  31,
                                        32, 33, 47, 63, 64, 65, 96, 127, 128, 129, 255, 257, 1000};
  return v;
}

// Floats that exercise the fp16/bf16 rounding: zeros, subnormals of both formats, ties,
// the fp16 overflow edge, infinities and NaNs (quiet and signalling payloads).
std::vector<float> edge_floats() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          -65504.0f,
                          65519.0f,
                          65520.0f,
                          -65520.0f,
                          1e30f,
                          5.9604644775390625e-8f,   // 2^-24, the smallest fp16 subnormal
                          2.98023223876953125e-8f,  // 2^-25, a tie to zero
                          8.940696716308594e-8f,    // 1.5 * 2^-24, a tie to 2^-23
                          6.103515625e-5f,          // 2^-14, the smallest fp16 normal
                          1.00048828125f,           // 1 + 2^-11, an fp16 tie (to even: 1)
                          1.00146484375f,           // 1 + 3 * 2^-11, a tie up
                          std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::bit_cast<float>(0x7f800001u),   // signalling NaN
                          std::bit_cast<float>(0xffc12345u),   // negative quiet NaN, payload
                          std::bit_cast<float>(0x3f808000u),   // a bf16 tie (to even)
                          std::bit_cast<float>(0x3f818000u)};  // a bf16 tie up
  std::mt19937 rng(11);
  for (int i = 0; i < 3000; ++i) v.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (int i = 0; i < 1000; ++i) v.push_back(n(rng));
  return v;
}

// Finite data for quantization: normal values with outliers, constant runs, exact fp16 values,
// the fp16 range limits, tiny values and negative zeros.
std::vector<float> quant_data(size_t n, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (rng() % 16) {
      case 0:
        v[i] = 65504.0f * (rng() % 2 ? 1.0f : -1.0f);
        break;
      case 1:
        v[i] = -0.0f;
        break;
      case 2:
        v[i] = 1e-7f * nd(rng);
        break;
      case 3:
        v[i] = 300.0f * nd(rng);
        break;
      case 4:
        v[i] = f16_to_f32(static_cast<uint16_t>(rng() % 0x7c00u));  // exact fp16 values
        break;
      default:
        v[i] = nd(rng);
    }
  }
  if (n >= 40) std::fill(v.begin() + 8, v.begin() + 40, 0.25f);  // constant groups
  return v;
}

// ---- the level rules -----------------------------------------------------------------------

TEST(SimdLevel, Names) {
  EXPECT_STREQ(simd_level_name(SimdLevel::kScalar), "scalar");
  EXPECT_STREQ(simd_level_name(SimdLevel::kAvx2), "avx2");
  EXPECT_STREQ(simd_level_name(SimdLevel::kAvx512), "avx512");
}

TEST(SimdLevel, EnvironmentValuesLowerTheCpuLevelNeverRaiseIt) {
  for (SimdLevel cpu : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    EXPECT_EQ(simd_level_from_env(nullptr, cpu), cpu);
    EXPECT_EQ(simd_level_from_env("", cpu), cpu);
    EXPECT_EQ(simd_level_from_env("auto", cpu), cpu);
    EXPECT_EQ(simd_level_from_env("scalar", cpu), SimdLevel::kScalar);
    EXPECT_EQ(simd_level_from_env("avx2", cpu), std::min(cpu, SimdLevel::kAvx2));
    EXPECT_EQ(simd_level_from_env("avx512", cpu), cpu);
  }
}

TEST(SimdLevel, UnknownEnvironmentValueIsOneLineOnStderrAndMeansAuto) {
  for (const char* bad : {"AVX2", "sse2", "avx-512", "1", " scalar"}) {
    ::testing::internal::CaptureStderr();
    const SimdLevel got = simd_level_from_env(bad, SimdLevel::kAvx2);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(got, SimdLevel::kAvx2) << bad;
    EXPECT_EQ(err.rfind(std::string("kvq: warning: KVQ_SIMD=") + bad + " ", 0), 0u) << err;
    EXPECT_NE(err.find("using auto (avx2)"), std::string::npos) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
    EXPECT_EQ(err.back(), '\n');
  }
}

TEST(SimdLevel, StartsAtTheCpuLevelLoweredByTheEnvironment) {
  // Every test here restores the level it changes, so this holds in any test order.
  ::testing::internal::CaptureStderr();  // a bad KVQ_SIMD warns again here
  const SimdLevel want = simd_level_from_env(std::getenv("KVQ_SIMD"), cpu_simd_level());
  (void)::testing::internal::GetCapturedStderr();
  EXPECT_EQ(simd_level(), want);
  std::printf("cpu supports %s; running at %s; comparing levels:",
              simd_level_name(cpu_simd_level()), simd_level_name(simd_level()));
  for (SimdLevel l : levels()) std::printf(" %s", simd_level_name(l));
  std::printf("\n");
#if !KVQ_SIMD_X86
  EXPECT_EQ(cpu_simd_level(), SimdLevel::kScalar);  // another architecture, or KVQ_NO_X86_SIMD
#endif
}

TEST(SimdLevel, TestingOverrideIsClampedToTheCpuAndScoped) {
  const SimdLevel before = simd_level();
  {
    ScopedSimdLevelForTesting at(SimdLevel::kAvx512);
    EXPECT_EQ(at.level(), cpu_simd_level());
    EXPECT_EQ(simd_level(), cpu_simd_level());
    {
      ScopedSimdLevelForTesting inner(SimdLevel::kScalar);
      EXPECT_EQ(simd_level(), SimdLevel::kScalar);
      EXPECT_EQ(entropy::rans_simd_available(), false);
    }
    EXPECT_EQ(simd_level(), cpu_simd_level());
    EXPECT_EQ(entropy::rans_simd_available(), cpu_simd_level() == SimdLevel::kAvx512);
  }
  EXPECT_EQ(simd_level(), before);
}

// A bad KVQ_SIMD never breaks the CLI: one warning line, then the normal run. And the CLI's
// figures other than speed are the same with SIMD off.
TEST(SimdLevel, CliWithBadOrLoweredKvqSimd) {
  const std::string kvq = std::string(KVQ_BINARY_DIR) + "/kvq";
  if (!testing::file_exists(kvq)) GTEST_SKIP() << "no kvq binary at " << kvq;
  const char* tmp = std::getenv("TMPDIR");
  const std::string base =
      std::string(tmp ? tmp : "/tmp") + "/kvq_simd_test_" + std::to_string(::getpid()) + "_";
  auto run = [&](const std::string& env, std::string& out, std::string& err) {
    const std::string o = base + "out", e = base + "err";
    const std::string cmd = env + " " + kvq +
                            " bench --method kivi:k_bits=3 --tokens 300 --layers 1 --heads 2 "
                            "--dim 64 --min-time 0.001 --json > " +
                            o + " 2> " + e;
    const int st = std::system(cmd.c_str());
    auto slurp = [](const std::string& p) {
      auto b = read_file(p);
      return b.ok() ? std::string(b->begin(), b->end()) : std::string();
    };
    out = slurp(o);
    err = slurp(e);
    std::remove(o.c_str());
    std::remove(e.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  // The figures that do not depend on speed.
  auto stored = [](const std::string& json) {
    const size_t a = json.find("\"bits_per_element\""), b = json.find("\"encode_gelem_s\"");
    const size_t c = json.find("\"resident_bytes\"");
    if (a == std::string::npos || b == std::string::npos || c == std::string::npos) return json;
    return json.substr(a, b - a) + json.substr(c);
  };
  std::string out_bad, err_bad, out_auto, err_auto, out_scalar, err_scalar;
  ASSERT_EQ(run("KVQ_SIMD=bogus", out_bad, err_bad), 0) << err_bad;
#if KVQ_SIMD_X86
  EXPECT_EQ(err_bad.rfind("kvq: warning: KVQ_SIMD=bogus is not one of", 0), 0u) << err_bad;
  EXPECT_EQ(std::count(err_bad.begin(), err_bad.end(), '\n'), 1) << err_bad;
#else
  EXPECT_EQ(err_bad, "");  // nothing to choose: the library never reads KVQ_SIMD
#endif
  ASSERT_EQ(run("KVQ_SIMD=auto", out_auto, err_auto), 0) << err_auto;
  EXPECT_EQ(err_auto, "");
  ASSERT_EQ(run("KVQ_SIMD=scalar", out_scalar, err_scalar), 0) << err_scalar;
  EXPECT_EQ(err_scalar, "");
  EXPECT_NE(stored(out_auto).find("\"key_nmse\""), std::string::npos) << out_auto;
  EXPECT_EQ(stored(out_auto), stored(out_scalar));
  EXPECT_EQ(stored(out_auto), stored(out_bad));
}

// ---- core: fp16 / bf16 ---------------------------------------------------------------------

TEST(SimdDispatch, Fp16AndBf16Conversions) {
  const std::vector<float> f = edge_floats();
  std::vector<uint16_t> all16(0x10000);
  for (uint32_t h = 0; h < all16.size(); ++h) all16[h] = static_cast<uint16_t>(h);
  for (size_t n : lengths()) {
    for (size_t off : {size_t{0}, size_t{3}}) {  // unaligned starts too
      const size_t m = std::min(n, f.size() - off);
      expect_same_at_every_level("fp16/bf16 n=" + std::to_string(m), [&] {
        std::vector<uint16_t> h(m + 1, 0xEEEE), b(m + 1, 0xEEEE);
        std::vector<float> fh(m + 1, -7.0f), fb(m + 1, -7.0f);
        convert_f32_to_f16(f.data() + off, h.data(), m);
        convert_f32_to_bf16(f.data() + off, b.data(), m);
        convert_f16_to_f32(all16.data() + off * 997, fh.data(), m);
        convert_bf16_to_f32(all16.data() + off * 997, fb.data(), m);
        std::vector<uint8_t> out;
        append_bytes(out, h);
        append_bytes(out, b);
        append_bytes(out, fh);
        append_bytes(out, fb);
        return out;
      });
    }
  }
  // Every fp16 and bf16 bit pattern to fp32, and the edge floats in one long call.
  expect_same_at_every_level("fp16/bf16 exhaustive", [&] {
    std::vector<float> a(all16.size()), b(all16.size());
    std::vector<uint16_t> h(f.size()), bb(f.size());
    convert_f16_to_f32(all16.data(), a.data(), all16.size());
    convert_bf16_to_f32(all16.data(), b.data(), all16.size());
    convert_f32_to_f16(f.data(), h.data(), f.size());
    convert_f32_to_bf16(f.data(), bb.data(), f.size());
    std::vector<uint8_t> out;
    append_bytes(out, a);
    append_bytes(out, b);
    append_bytes(out, h);
    append_bytes(out, bb);
    return out;
  });
  // And the scalar level is the scalar functions of dtype.h.
  ScopedSimdLevelForTesting scalar(SimdLevel::kScalar);
  std::vector<uint16_t> h(f.size());
  convert_f32_to_f16(f.data(), h.data(), f.size());
  for (size_t i = 0; i < f.size(); ++i) ASSERT_EQ(h[i], f32_to_f16(f[i])) << i;
}

// ---- numerics: bit packing -----------------------------------------------------------------

TEST(SimdDispatch, BitPackingEveryWidth) {
  std::mt19937 rng(3);
  for (int bits = 1; bits <= 8; ++bits) {
    for (size_t n : lengths()) {
      // Codes with stray high bits (pack ignores them) and packed bytes with arbitrary contents.
      std::vector<uint8_t> codes(n), bytes(packed_size(n, bits) + 1);
      for (auto& c : codes) c = static_cast<uint8_t>(rng());
      for (auto& b : bytes) b = static_cast<uint8_t>(rng());
      expect_same_at_every_level(
          "bitpack bits=" + std::to_string(bits) + " n=" + std::to_string(n), [&] {
            // Canaries after each output catch writes past its end.
            std::vector<uint8_t> packed(packed_size(n, bits) + 9, 0xA5), unpacked(n + 9, 0xA5);
            pack_bits(codes.data(), n, bits, packed.data());
            unpack_bits(bytes.data(), n, bits, unpacked.data());
            std::vector<uint8_t> out = packed;
            out.insert(out.end(), unpacked.begin(), unpacked.end());
            return out;
          });
      // The reference defines both directions.
      std::vector<uint8_t> a(packed_size(n, bits)), r(a.size()), u(n), ur(n);
      pack_bits(codes.data(), n, bits, a.data());
      pack_bits_reference(codes.data(), n, bits, r.data());
      ASSERT_EQ(a, r) << bits << " " << n;
      unpack_bits(bytes.data(), n, bits, u.data());
      unpack_bits_reference(bytes.data(), n, bits, ur.data());
      ASSERT_EQ(u, ur) << bits << " " << n;
    }
  }
}

// ---- numerics: group quantization ----------------------------------------------------------

TEST(SimdDispatch, GroupQuantizationCodesAndParams) {
  for (int bits = 1; bits <= 8; ++bits) {
    for (const auto& shape : {std::pair<int64_t, int64_t>{1, 1},
                              {3, 5},
                              {17, 64},
                              {33, 31},
                              {128, 64},
                              {64, 128},
                              {7, 129}}) {
      const int64_t T = shape.first, D = shape.second;
      const int64_t ld = D + 3;  // a row stride wider than the row
      const std::vector<float> x = quant_data(static_cast<size_t>(T * ld), 100 * bits + T + D);
      for (int64_t G : {int64_t{1}, int64_t{4}, int64_t{32}, D}) {
        expect_same_at_every_level(
            "group_quant bits=" + std::to_string(bits) + " T=" + std::to_string(T) +
                " D=" + std::to_string(D) + " G=" + std::to_string(G),
            [&] {
              const size_t n = static_cast<size_t>(T * D);
              const int64_t ng = n_channel_groups(D, G);
              std::vector<uint8_t> cc(n), ct(n);
              std::vector<QuantParams> pc(static_cast<size_t>(D)), pt(static_cast<size_t>(T * ng));
              std::vector<float> dc(n), dt(n);
              quantize_per_channel(x.data(), T, D, ld, bits, cc.data(), pc.data());
              dequantize_per_channel(cc.data(), T, D, pc.data(), dc.data());
              quantize_per_token(x.data(), T, D, ld, G, bits, ct.data(), pt.data());
              dequantize_per_token(ct.data(), T, D, G, pt.data(), dt.data());
              std::vector<uint8_t> out;
              append_bytes(out, cc);
              append_bytes(out, pc);
              append_bytes(out, dc);
              append_bytes(out, ct);
              append_bytes(out, pt);
              append_bytes(out, dt);
              return out;
            });
      }
      // One group at a time, strided (a column), into strided codes.
      expect_same_at_every_level("quantize_group bits=" + std::to_string(bits), [&] {
        std::vector<uint8_t> out;
        for (int64_t d = 0; d < D; ++d) {
          const QuantParams p = fit_group(x.data() + d, static_cast<size_t>(T), ld, bits);
          std::vector<uint8_t> c(static_cast<size_t>(2 * T), 0xEE);
          quantize_group(x.data() + d, static_cast<size_t>(T), ld, p, bits, c.data(), 2);
          append_value(out, p);
          append_bytes(out, c);
          const QuantParams q =
              fit_group(x.data() + d * T % (T * ld - T + 1), static_cast<size_t>(T), 1, bits);
          append_value(out, q);
        }
        return out;
      });
    }
  }
}

TEST(SimdDispatch, ZipcacheChannelScaledTokenQuantization) {
  for (const auto& shape : {std::pair<int64_t, int64_t>{5, 16}, {37, 64}, {128, 128}}) {
    const int64_t S = shape.first, D = shape.second;
    const std::vector<float> x = quant_data(static_cast<size_t>(S * D), static_cast<uint64_t>(S));
    std::vector<uint8_t> bits(static_cast<size_t>(S));
    for (int64_t t = 0; t < S; ++t) bits[static_cast<size_t>(t)] = static_cast<uint8_t>(1 + t % 8);
    for (int64_t G : {int64_t{8}, D}) {
      expect_same_at_every_level("cst S=" + std::to_string(S) + " G=" + std::to_string(G), [&] {
        const int64_t ng = n_channel_groups(D, G);
        std::vector<uint16_t> cs(static_cast<size_t>(D));
        std::vector<uint8_t> codes(static_cast<size_t>(S * D));
        std::vector<QuantParams> params(static_cast<size_t>(S * ng));
        std::vector<float> out(codes.size());
        cst_quantize(x.data(), S, D, D, G, bits.data(), cs.data(), codes.data(), params.data());
        cst_dequantize(codes.data(), S, D, G, cs.data(), params.data(), out.data());
        std::vector<uint8_t> b;
        append_bytes(b, cs);
        append_bytes(b, codes);
        append_bytes(b, params);
        append_bytes(b, out);
        return b;
      });
    }
  }
}

// ---- numerics: kernels ---------------------------------------------------------------------

TEST(SimdDispatch, DotGemvAxpyScaleExp) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> a(2000), b(2000);
  for (auto& v : a) v = nd(rng);
  for (auto& v : b) v = nd(rng);
  a[5] = 1e30f;  // products that round differently with and without fusing
  b[5] = 1e-30f;
  a[9] = -0.0f;
  for (size_t n : lengths()) {
    const int64_t len = static_cast<int64_t>(n);
    expect_same_at_every_level("kernels n=" + std::to_string(n), [&] {
      std::vector<uint8_t> out;
      for (size_t off : {size_t{0}, size_t{1}}) {
        append_value(out, dot_f32(a.data() + off, b.data() + 2 * off, len));
        std::vector<float> y(b.begin(), b.begin() + static_cast<ptrdiff_t>(n));
        axpy_f32(y.data(), 0.37f, a.data() + off, len);
        scale_f32(y.data(), -1.7f, len);
        append_bytes(out, y);
        std::vector<float> e(n);
        // Scores around the clamps of exp_f32 (-87.3, 88) and far beyond them.
        std::vector<float> s(n);
        for (size_t i = 0; i < n; ++i) s[i] = 40.0f * a[i + off];
        append_value(out, exp_sum_f32(s.data(), 1.25f, len, e.data()));
        append_bytes(out, e);
      }
      // Rows of every count, row lengths that are and are not multiples of 8.
      for (int64_t rows : {0, 1, 3, 4, 5, 8, 13}) {
        std::vector<float> y(static_cast<size_t>(rows) + 1, -9.0f);
        if (len * (rows + 1) <= static_cast<int64_t>(a.size())) {
          gemv_f32(a.data(), rows, len, len + 1, b.data(), 0.125f, y.data());
          append_bytes(out, y);
        }
      }
      return out;
    });
    // The dot product's documented order is the reference's, at every level.
    for (SimdLevel l : levels()) {
      ScopedSimdLevelForTesting at(l);
      ASSERT_EQ(std::bit_cast<uint32_t>(dot_f32(a.data(), b.data(), len)),
                std::bit_cast<uint32_t>(dot_f32_reference(a.data(), b.data(), len)))
          << n << " " << simd_level_name(l);
    }
  }
}

TEST(SimdDispatch, AttentionTile) {
  std::mt19937 rng(14);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t D : {8, 17, 64, 80, 128})
    for (int64_t rows : {1, 3, 4, 5, 9})
      for (int64_t n : {1, 15, 16, 33, 130}) {
        std::vector<float> q(static_cast<size_t>(rows * D)), k(static_cast<size_t>(n * D)),
            v(k.size());
        for (auto& x : q) x = 0.3f * nd(rng);
        for (auto& x : k) x = nd(rng);
        for (auto& x : v) x = nd(rng);
        k[0] = 300.0f;  // a score that sends others' probabilities to exact zeros
        std::vector<std::vector<int64_t>> vis(3, std::vector<int64_t>(static_cast<size_t>(rows)));
        for (auto& t : vis)
          for (auto& x : t) x = static_cast<int64_t>(rng() % static_cast<uint32_t>(n + 1));
        vis[0][0] = n;
        expect_same_at_every_level("attend_tile D=" + std::to_string(D) +
                                       " rows=" + std::to_string(rows) + " n=" + std::to_string(n),
                                   [&] {
                                     Workspace ws;
                                     std::vector<float> m(static_cast<size_t>(rows), -INFINITY),
                                         l(static_cast<size_t>(rows), 0.0f),
                                         acc(static_cast<size_t>(rows * D), 0.0f);
                                     for (const auto& t : vis)  // three tiles in a row
                                       attend_tile(q.data(), rows, D, k.data(), v.data(), n,
                                                   t.data(), m.data(), l.data(), acc.data(), ws);
                                     std::vector<uint8_t> out;
                                     append_bytes(out, m);
                                     append_bytes(out, l);
                                     append_bytes(out, acc);
                                     return out;
                                   });
      }
}

// ---- entropy -------------------------------------------------------------------------------

std::vector<uint8_t> skewed_symbols(std::mt19937& rng, size_t n, int bits, double skew) {
  std::vector<uint8_t> v(n);
  std::geometric_distribution<int> g(skew);
  const int a = 1 << bits;
  for (auto& s : v) s = static_cast<uint8_t>(std::min(a - 1, g(rng)));
  return v;
}

TEST(SimdDispatch, TransposeBytes) {
  std::mt19937 rng(8);
  for (size_t rows : {0, 1, 15, 16, 17, 33, 128, 200})
    for (size_t cols : {1, 3, 16, 31, 48, 192}) {
      std::vector<uint8_t> src(rows * cols);
      for (auto& b : src) b = static_cast<uint8_t>(rng());
      expect_same_at_every_level("transpose " + std::to_string(rows) + "x" + std::to_string(cols),
                                 [&] {
                                   std::vector<uint8_t> dst(src.size() + 1, 0x5A);
                                   entropy::transpose_bytes(src.data(), rows, cols, dst.data());
                                   return dst;
                                 });
    }
}

TEST(SimdDispatch, HistogramsAndTables) {
  std::mt19937 rng(9);
  for (int bits = 1; bits <= 8; ++bits)
    for (int nt : {1, 5, 16, 17, 64, 65, 200})
      for (size_t rows : {0, 1, 7, 254, 255, 256, 600}) {
        if (rows * static_cast<size_t>(nt) > 60000) continue;
        std::vector<uint8_t> sym = skewed_symbols(rng, rows * nt + rng() % 3, bits, 0.3);
        expect_same_at_every_level(
            "count_symbols bits=" + std::to_string(bits) + " tables=" + std::to_string(nt) +
                " rows=" + std::to_string(rows),
            [&] {
              std::vector<uint32_t> c(static_cast<size_t>(nt) << bits);
              Status s = entropy::count_symbols(sym.data(), sym.size(), bits, nt, c.data());
              std::vector<uint8_t> out;
              append_value(out, s.ok());
              append_bytes(out, c);
              return out;
            });
        // A symbol out of range is found at every level.
        if (bits < 8 && !sym.empty()) {
          sym[sym.size() / 2] = static_cast<uint8_t>(1u << bits);
          for (SimdLevel l : levels()) {
            ScopedSimdLevelForTesting at(l);
            std::vector<uint32_t> c(static_cast<size_t>(nt) << bits);
            EXPECT_FALSE(entropy::count_symbols(sym.data(), sym.size(), bits, nt, c.data()).ok());
          }
        }
      }
  // Normalization (its scans are vectorised for alphabets that are multiples of 8).
  for (int bits = 1; bits <= 8; ++bits)
    for (int p = bits; p <= 12; p += 3)
      for (bool cover : {false, true}) {
        const int a = 1 << bits;
        std::vector<uint32_t> counts(static_cast<size_t>(a));
        for (int trial = 0; trial < 4; ++trial) {
          for (auto& c : counts) c = trial == 0 ? 0 : (rng() % 3 ? rng() % (100 << trial) : 0);
          if (trial == 3) std::fill(counts.begin(), counts.end(), 7u);  // ties everywhere
          expect_same_at_every_level("normalize bits=" + std::to_string(bits), [&] {
            std::vector<uint16_t> f(static_cast<size_t>(a), 0xEEEE);
            const bool ok = entropy::normalize_counts(counts.data(), a, p, cover, f.data());
            std::vector<uint8_t> out;
            append_value(out, ok);
            append_bytes(out, f);
            entropy::TableBuildOptions o;
            o.max_prob_bits = p;
            auto t = entropy::build_tables(counts.data(), 1, bits, o);
            append_value(out, t.ok());
            if (t.ok()) append_bytes(out, t->freq);
            return out;
          });
        }
      }
}

TEST(SimdDispatch, RansStreams) {
  std::mt19937 rng(10);
  for (int trial = 0; trial < 160; ++trial) {
    const int bits = 1 + trial % 8;
    const int n_tables = trial % 3 == 0 ? 1 : 1 + static_cast<int>(rng() % 40);
    const int lanes_log2 = trial % 4 == 0 ? static_cast<int>(rng() % 6) : 4 + trial % 2;
    const size_t lanes = size_t{1} << lanes_log2;
    const size_t run = trial % 5 == 0 ? 1 + rng() % 100 : lanes * (1 + rng() % 6);
    const size_t n = trial % 7 == 0 ? rng() % 50 : run * n_tables + rng() % 2 * (rng() % lanes);
    const std::vector<uint8_t> sym = skewed_symbols(rng, n, bits, 0.2 + 0.1 * (trial % 5));
    // Tables from the data's own histograms, at a precision that takes the slot-table path
    // (P <= 7) or the compare path.
    std::vector<uint32_t> counts(static_cast<size_t>(n_tables) << bits, 1);
    for (size_t i = 0; i < n; ++i) ++counts[((i / run) % n_tables << bits) + sym[i]];
    entropy::TableBuildOptions o;
    o.max_prob_bits = std::max(bits, trial % 2 ? 7 : 12);
    o.adaptive_precision = trial % 3 != 0;
    auto tables = entropy::build_tables(counts.data(), n_tables, bits, o);
    ASSERT_TRUE(tables.ok()) << tables.status().to_string();
    std::vector<uint8_t> stream;
    expect_same_at_every_level("rans encode trial " + std::to_string(trial), [&] {
      auto model = entropy::make_rans_model(*tables);
      EXPECT_TRUE(model.ok());
      std::vector<uint8_t> out;
      EXPECT_TRUE(entropy::rans_encode_stream(*model, sym.data(), n, run, lanes_log2, out).ok());
      stream = out;
      append_bytes(out, model->dec_lut);  // the decoder's slot tables are built per level too
      return out;
    });
    for (int damaged = 0; damaged < 2; ++damaged) {
      std::vector<uint8_t> in = stream;
      if (damaged && !in.empty()) in[rng() % in.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
      expect_same_at_every_level("rans decode trial " + std::to_string(trial), [&] {
        auto model = entropy::make_rans_model(*tables, entropy::RansModelUse::kDecode);
        std::vector<uint8_t> out(n + 8, 0xA5);
        const Status s = entropy::rans_decode_stream(*model, in.data(), in.size(), n, run,
                                                     lanes_log2, out.data());
        if (!damaged) {
          EXPECT_TRUE(s.ok()) << s.to_string();
          EXPECT_TRUE(std::equal(sym.begin(), sym.end(), out.begin()));
        }
        if (!s.ok()) out.assign(1, 0);  // after an error the output is unspecified
        append_value(out, static_cast<int>(s.code()));
        return out;
      });
    }
  }
}

TEST(SimdDispatch, SymbolCodecStreams) {
  std::mt19937 rng(12);
  for (int bits : {1, 2, 3, 4, 5, 8})
    for (const auto& shape : {std::pair<int64_t, int>{0, 4},
                              {5, 3},
                              {64, 48},
                              {128, 192},
                              {256, 64},
                              {100, 17},
                              {1024, 24}}) {
      const int64_t nt = shape.first;
      const int nc = shape.second;
      const size_t n = static_cast<size_t>(nt) * static_cast<size_t>(nc);
      const std::vector<uint8_t> sym = skewed_symbols(rng, n, bits, 0.35);
      // Shared tables of 12 prototypes (the 16-wide cost registers) over the data's channels.
      std::vector<uint32_t> hist(static_cast<size_t>(nc) << bits, 1);
      for (size_t i = 0; i < n; ++i) ++hist[((i % nc) << bits) + sym[i]];
      auto proto = entropy::build_prototypes(hist.data(), nc, bits, 12, 10);
      ASSERT_TRUE(proto.ok()) << proto.status().to_string();
      auto shared = entropy::make_shared_tables(*proto);
      ASSERT_TRUE(shared.ok());
      for (int variant = 0; variant < 4; ++variant) {
        entropy::SymbolCodecOptions o;
        o.layout = variant == 1 ? entropy::TableLayout::kPooled : entropy::TableLayout::kPerChannel;
        o.lanes_log2 = variant == 2 ? 5 : -1;
        o.inline_tables = variant != 3;
        const entropy::SharedTables* sh = variant >= 2 ? &*shared : nullptr;
        std::vector<uint8_t> stream;
        expect_same_at_every_level(
            "symbol codec bits=" + std::to_string(bits) + " n=" + std::to_string(n) +
                " variant=" + std::to_string(variant),
            [&] {
              std::vector<uint8_t> out;
              entropy::EncodeStats st;
              const Status s = entropy::encode_symbols(sym.data(), nt, nc, bits, o, out, &st, sh);
              EXPECT_TRUE(s.ok()) << s.to_string();
              stream = out;
              append_value(out, st.shannon_bits);
              return out;
            });
        expect_same_at_every_level("symbol decode n=" + std::to_string(n), [&] {
          std::vector<uint8_t> out(n + 4, 0xA5);
          const Status s =
              entropy::decode_symbols(stream.data(), stream.size(), nt, nc, bits, out.data(), sh);
          EXPECT_TRUE(s.ok()) << s.to_string();
          EXPECT_TRUE(std::equal(sym.begin(), sym.end(), out.begin()));
          return out;
        });
      }
    }
}

TEST(SimdDispatch, CachegenDeltas) {
  using namespace cachegen;
  std::mt19937 rng(13);
  for (int bits = 1; bits <= 8; ++bits)
    for (const auto& shape : {std::pair<int64_t, int64_t>{1, 1}, {9, 7}, {64, 64}, {130, 192}}) {
      const int64_t n = shape.first, dim = shape.second;
      std::vector<uint8_t> codes(static_cast<size_t>(n * dim));
      for (auto& c : codes) c = static_cast<uint8_t>(rng() % (1u << bits));
      expect_same_at_every_level("cachegen deltas bits=" + std::to_string(bits), [&] {
        std::vector<uint8_t> out;
        for (DeltaMode mode : {DeltaMode::kNone, DeltaMode::kToken, DeltaMode::kGroup,
                               DeltaMode::kAnchor, DeltaMode::kAuto}) {
          std::vector<uint8_t> sym(codes.size()), back(codes.size());
          std::vector<uint8_t> mask(mask_bytes(dim));
          std::vector<uint32_t> counts(static_cast<size_t>(dim) << bits);
          (void)chunk_symbols(mode, 16, codes.data(), n, dim, bits, sym.data(), mask.data(),
                              counts.data());
          chunk_codes(mode, 16, sym.data(), mask.data(), n, dim, bits, back.data());
          EXPECT_EQ(back, codes);
          // In place too.
          std::vector<uint8_t> inplace = codes;
          if (mode != DeltaMode::kAuto) {
            apply_delta(mode, 16, inplace.data(), n, dim, bits, inplace.data());
            EXPECT_EQ(inplace, sym);
            invert_delta(mode, 16, inplace.data(), n, dim, bits, inplace.data());
          } else {
            apply_channel_deltas(mask.data(), inplace.data(), n, dim, bits, inplace.data());
            EXPECT_EQ(inplace, sym);
            invert_channel_deltas(mask.data(), inplace.data(), n, dim, bits, inplace.data());
          }
          EXPECT_EQ(inplace, codes);
          append_bytes(out, sym);
          append_bytes(out, mask);
          if (mode == DeltaMode::kAuto) append_bytes(out, counts);
        }
        return out;
      });
    }
}

// ---- whole caches --------------------------------------------------------------------------

// Specs for the end-to-end check: every method and mode at test sizes, every method at its
// defaults, and each width of the bit-parameterised methods.
std::vector<std::string> cache_specs() {
  std::vector<std::string> out = testing::small_specs();
  for (const auto& m : method_table()) out.push_back(Spec(m).to_string());
  for (int b = 1; b <= 8; ++b)
    out.push_back("kivi:k_bits=" + std::to_string(b) + ",v_bits=" + std::to_string(9 - b));
  for (int b = 2; b <= 8; b += 3) out.push_back("cachegen:bits=" + std::to_string(b));
  return out;
}

class SimdCache : public ::testing::TestWithParam<std::string> {};

TEST_P(SimdCache, SameStoredBytesReadsAndAttentionAtEveryLevel) {
  constexpr int64_t B = 1, H = 2, HQ = 4, D = 64, S = 300;
  const ModelShape shape =
      ModelShape::uniform(2, H, D, HQ, RopeShape{RopeShape::Mode::kAdjacent, 10000.0, 1.0});
  const std::vector<float> k = testing::random_kv(B, H, S, D, 1),
                           v = testing::random_kv(B, H, S, D, 2),
                           q = testing::random_kv(B, HQ, S, D, 3, 0.3f);
  std::vector<uint16_t> k16(k.size());
  for (size_t i = 0; i < k.size(); ++i) k16[i] = f32_to_f16(k[i]);
  expect_same_at_every_level(GetParam(), [&] {
    auto c = ModelCache::create(GetParam(), shape);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    if (!c.ok()) return std::vector<uint8_t>{};
    std::vector<uint8_t> out;
    for (int l = 0; l < 2; ++l) {
      // Chunks of uneven sizes (prefill, then token by token); layer 1 gets fp16 keys.
      for (int64_t s0 = 0, step = 97; s0<S; s0 += step, step = step> 1 ? step / 3 : 1) {
        const int64_t n = std::min(step, S - s0);
        const TensorView kv = l == 0 ? TensorView::bhsd(k.data(), DType::kF32, B, H, S, D)
                                     : TensorView::bhsd(k16.data(), DType::kF16, B, H, S, D);
        const TensorView qn =
            TensorView::bhsd(q.data(), DType::kF32, B, HQ, S, D).slice_tokens(s0, n);
        const Status st = c->layer(l).append(
            kv.slice_tokens(s0, n),
            TensorView::bhsd(v.data(), DType::kF32, B, H, S, D).slice_tokens(s0, n), &qn);
        EXPECT_TRUE(st.ok()) << st.to_string();
        if (s0 + n == S) {  // attention of the last chunk's queries over everything held
          std::vector<float> o(static_cast<size_t>(B * HQ * n * D));
          EXPECT_TRUE(
              c->layer(l)
                  .attend(qn, 0.125f, MutTensorView::bhsd(o.data(), DType::kF32, B, HQ, n, D))
                  .ok());
          append_bytes(out, o);
        }
      }
      std::vector<float> rk, rv;
      testing::read_all(c->layer(l), rk, rv);
      append_bytes(out, rk);
      append_bytes(out, rv);
    }
    auto bytes = serialize_cache(*c);
    EXPECT_TRUE(bytes.ok()) << bytes.status().to_string();
    if (bytes.ok()) append_bytes(out, *bytes);
    append_value(out, c->resident_bytes());
    return out;
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, SimdCache, ::testing::ValuesIn(cache_specs()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = std::to_string(i.index) + "_" + i.param;
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

}  // namespace
}  // namespace kvq
