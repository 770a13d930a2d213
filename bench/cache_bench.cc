// Cache micro-benchmarks, one row per method in the table (so new methods are benchmarked
// without extra wiring): append (encode), read (decode) and one decode-step attention over a
// 2048-token cache shaped like SmolLM2-135M (3 KV heads, 9 query heads, head_dim 64).
//
//   build/kvq_bench --benchmark_filter=Cache
#include <benchmark/benchmark.h>

#include <cmath>

#include "cache/ledger.h"
#include "kvq/cache.h"
#include "kvq/synthetic.h"

namespace kvq {
namespace {

constexpr int64_t kH = 3, kHq = 9, kD = 64, kS = 2048;

const SyntheticKV& data() {
  static const SyntheticKV kv = [] {
    SyntheticOptions o;
    o.heads = kH;
    o.dim = kD;
    o.tokens = kS;
    return make_synthetic_kv(o);
  }();
  return kv;
}

// Queries for the 9 query heads: each KV head's synthetic queries, repeated.
const std::vector<float>& queries() {
  static const std::vector<float> q = [] {
    std::vector<float> out(static_cast<size_t>(kHq * kS * kD));
    for (int64_t hq = 0; hq < kHq; ++hq)
      std::copy(data().q.begin() + (hq / 3) * kS * kD, data().q.begin() + (hq / 3 + 1) * kS * kD,
                out.begin() + hq * kS * kD);
    return out;
  }();
  return q;
}

ModelCache filled(const std::string& spec) {
  auto c = ModelCache::create(spec, ModelShape::uniform(1, kH, kD, kHq));
  if (!c.ok()) std::abort();
  const TensorView q = TensorView::bhsd(queries().data(), DType::kF32, 1, kHq, kS, kD);
  if (!c->layer(0)
           .append(TensorView::bhsd(data().k.data(), DType::kF32, 1, kH, kS, kD),
                   TensorView::bhsd(data().v.data(), DType::kF32, 1, kH, kS, kD), &q)
           .ok())
    std::abort();
  return std::move(*c);
}

void BM_CacheAppend(benchmark::State& st, std::string spec) {
  auto c = ModelCache::create(spec, ModelShape::uniform(1, kH, kD, kHq));
  const TensorView q = TensorView::bhsd(queries().data(), DType::kF32, 1, kHq, kS, kD);
  for (auto _ : st) {
    c->reset();
    benchmark::DoNotOptimize(
        c->layer(0).append(TensorView::bhsd(data().k.data(), DType::kF32, 1, kH, kS, kD),
                           TensorView::bhsd(data().v.data(), DType::kF32, 1, kH, kS, kD), &q));
  }
  st.SetItemsProcessed(st.iterations() * 2 * kH * kS * kD);
}

void BM_CacheRead(benchmark::State& st, std::string spec) {
  ModelCache c = filled(spec);
  std::vector<float> k(static_cast<size_t>(kH * kS * kD)), v(k.size());
  for (auto _ : st)
    benchmark::DoNotOptimize(
        c.layer(0).read(0, kS, MutTensorView::bhsd(k.data(), DType::kF32, 1, kH, kS, kD),
                        MutTensorView::bhsd(v.data(), DType::kF32, 1, kH, kS, kD)));
  st.SetItemsProcessed(st.iterations() * 2 * kH * kS * kD);
}

// One decode step: 9 query heads attend over 2048 tokens.
void BM_CacheAttendDecode(benchmark::State& st, std::string spec) {
  ModelCache c = filled(spec);
  std::vector<float> out(static_cast<size_t>(kHq * kD));
  const TensorView q =
      TensorView::bhsd(queries().data(), DType::kF32, 1, kHq, kS, kD).slice_tokens(kS - 1, 1);
  for (auto _ : st)
    benchmark::DoNotOptimize(
        c.layer(0).attend(q, 0.125f, MutTensorView::bhsd(out.data(), DType::kF32, 1, kHq, 1, kD)));
  st.SetItemsProcessed(st.iterations() * 2 * kH * kS * kD);  // K/V elements read
}

// The CUDA layer's ledger work per decode append: plan on a copy, commit by assignment, over a
// layer holding state.range(0) blocks of equal accounting (KIVI's; 4096 blocks of 32 tokens:
// 131k tokens).
void BM_LedgerPlanAppend(benchmark::State& st) {
  Ledger l(LedgerShape{32, 32, 128});
  const CacheBytes bb{4096, 4096, 512, 0, 0, 0, 0};
  const int64_t n0 = st.range(0) * 32 + 128;
  l.begin_append(16, n0);
  for (int64_t done = 0; done < n0;) {
    const int64_t n = l.next_run(n0 - done);
    l.advance(n);
    done += n;
    while (l.seal_due()) l.record_block(bb, false);
  }
  for (auto _ : st) {
    Ledger plan = l;
    plan.begin_append(16, 1);
    plan.advance(1);
    while (plan.seal_due()) plan.record_block(bb, plan.keep_exact_of_due_block());
    l = plan;
    benchmark::DoNotOptimize(l);
  }
}
BENCHMARK(BM_LedgerPlanAppend)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);

int register_all() {
  for (const auto& m : method_table()) {
    const std::string spec = Spec(m).to_string();
    benchmark::RegisterBenchmark(("CacheAppend/" + m.name).c_str(), BM_CacheAppend, spec)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("CacheRead/" + m.name).c_str(), BM_CacheRead, spec)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("CacheAttendDecode/" + m.name).c_str(), BM_CacheAttendDecode,
                                 spec)
        ->Unit(benchmark::kMicrosecond);
  }
  return 0;
}
const int registered = register_all();

}  // namespace
}  // namespace kvq
