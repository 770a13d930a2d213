// The CUDA backend against the CPU backend (label `gpu`; every test skips, saying so, when no
// CUDA device is visible). The CPU backend is the reference: for the same input, the GPU cache
// must hold the same bytes (its exported chunks are compared byte for byte), read back the same
// values, account the same bytes, and attend within the stated tolerance.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "cuda/cuda_layer.h"
#include "cuda/device_pool.h"
#include "kvq/cache.h"
#include "kvq/cuda.h"
#include "test_util.h"
#include "gpu_test.h"

namespace kvq {
namespace {

// Device memory holding a copy of host data (or `bytes` uninitialised bytes).
struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t bytes) : n(bytes) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) std::abort();
    cudaMemset(p, 0x7f, bytes);  // poison: unwritten outputs show up as huge values
  }
  template <class T>
  explicit DevBuf(const std::vector<T>& h) : DevBuf(h.size() * sizeof(T)) {
    if (cudaMemcpy(p, h.data(), n, cudaMemcpyHostToDevice) != cudaSuccess) std::abort();
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  std::vector<T> get() const {
    std::vector<T> h(n / sizeof(T));
    if (cudaDeviceSynchronize() != cudaSuccess) std::abort();
    if (cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost) != cudaSuccess) std::abort();
    return h;
  }
};

const Device kGpu = Device::cuda(0);

// K, V and Q of one layer, [B, H, S, D] (Q: [B, HQ, S, D]), on the host and on the device.
struct Data {
  int64_t B, H, HQ, S, D;
  std::vector<float> k, v, q;
  std::unique_ptr<DevBuf> dk, dv, dq;
  Data(int64_t b, int64_t h, int64_t hq, int64_t s, int64_t d, uint64_t seed)
      : B(b), H(h), HQ(hq), S(s), D(d) {
    k = testing::random_kv(B, H, S, D, seed);
    v = testing::random_kv(B, H, S, D, seed + 1);
    q = testing::random_kv(B, HQ, S, D, seed + 2, 0.3f);
    dk = std::make_unique<DevBuf>(k);
    dv = std::make_unique<DevBuf>(v);
    dq = std::make_unique<DevBuf>(q);
  }
  TensorView view(bool gpu, const std::vector<float>& host, const DevBuf& dev, int64_t heads,
                  int64_t s0, int64_t n) const {
    return TensorView::bhsd(gpu ? dev.p : host.data(), DType::kF32, B, heads, S, D,
                            gpu ? kGpu : Device{})
        .slice_tokens(s0, n);
  }
  TensorView K(bool gpu, int64_t s0, int64_t n) const { return view(gpu, k, *dk, H, s0, n); }
  TensorView V(bool gpu, int64_t s0, int64_t n) const { return view(gpu, v, *dv, H, s0, n); }
  TensorView Q(bool gpu, int64_t s0, int64_t n) const { return view(gpu, q, *dq, HQ, s0, n); }
};

ModelCache make(const std::string& spec, const Data& d, bool gpu, int layers = 1) {
  CacheOptions opt;
  if (gpu) opt.device = kGpu;
  auto c = ModelCache::create(spec, ModelShape::uniform(layers, static_cast<int>(d.H),
                                                        static_cast<int>(d.D),
                                                        static_cast<int>(d.HQ)),
                              opt);
  if (!c.ok()) {
    ADD_FAILURE() << spec << (gpu ? " on cuda:0: " : ": ") << c.status().to_string();
    std::abort();
  }
  return std::move(*c);
}

Status append(ModelCache& c, const Data& d, bool gpu, int64_t s0, int64_t n) {
  for (int l = 0; l < c.n_layers(); ++l) {
    const TensorView q = d.Q(gpu, s0, n);
    KVQ_RETURN_IF_ERROR(c.layer(l).append(d.K(gpu, s0, n), d.V(gpu, s0, n), &q));
  }
  return ok_status();
}

// Every exported chunk of layer 0 (blocks, window, state), as bytes.
std::vector<std::vector<uint8_t>> chunks(const ModelCache& c, int layer = 0) {
  testing::ChunkCollector sink;
  EXPECT_TRUE(c.layer(layer).export_blocks(0, sink).ok());
  EXPECT_TRUE(c.layer(layer).export_tail(sink).ok());
  return sink.store;
}
std::vector<ChunkRef> chunk_refs(const ModelCache& c, testing::ChunkCollector& sink) {
  EXPECT_TRUE(c.layer(0).export_blocks(0, sink).ok());
  EXPECT_TRUE(c.layer(0).export_tail(sink).ok());
  return sink.chunks();
}

// read() (or read_exact()) of [t0, t0 + n) from a GPU layer into device tensors of `dt`, as f32.
void gpu_read(const LayerCache& l, bool exact, int64_t t0, int64_t n, DType dt,
              std::vector<float>& k, std::vector<float>& v) {
  const int64_t B = l.batch(), H = l.shape().n_kv_heads, D = l.shape().head_dim;
  const size_t elems = static_cast<size_t>(B * H * n * D), es = dtype_size(dt);
  DevBuf ko(elems * es), vo(elems * es);
  const auto kv = MutTensorView::bhsd(ko.p, dt, B, H, n, D, kGpu);
  const auto vv = MutTensorView::bhsd(vo.p, dt, B, H, n, D, kGpu);
  const Status st = exact ? l.read_exact(t0, n, kv, vv) : l.read(t0, n, kv, vv);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const auto kh = ko.get<uint8_t>(), vh = vo.get<uint8_t>();
  k.resize(elems);
  v.resize(elems);
  for (size_t i = 0; i < elems; ++i) {
    k[i] = load_as_f32(kh.data(), dt, static_cast<int64_t>(i));
    v[i] = load_as_f32(vh.data(), dt, static_cast<int64_t>(i));
  }
}
void cpu_read(const LayerCache& l, bool exact, int64_t t0, int64_t n, DType dt,
              std::vector<float>& k, std::vector<float>& v) {
  const int64_t B = l.batch(), H = l.shape().n_kv_heads, D = l.shape().head_dim;
  const size_t elems = static_cast<size_t>(B * H * n * D), es = dtype_size(dt);
  std::vector<uint8_t> kh(elems * es), vh(elems * es);
  const auto kv = MutTensorView::bhsd(kh.data(), dt, B, H, n, D);
  const auto vv = MutTensorView::bhsd(vh.data(), dt, B, H, n, D);
  const Status st = exact ? l.read_exact(t0, n, kv, vv) : l.read(t0, n, kv, vv);
  ASSERT_TRUE(st.ok()) << st.to_string();
  k.resize(elems);
  v.resize(elems);
  for (size_t i = 0; i < elems; ++i) {
    k[i] = load_as_f32(kh.data(), dt, static_cast<int64_t>(i));
    v[i] = load_as_f32(vh.data(), dt, static_cast<int64_t>(i));
  }
}

// Where two chunk lists first differ: the chunk, its sizes, the byte.
std::string first_difference(const std::vector<std::vector<uint8_t>>& a,
                             const std::vector<std::vector<uint8_t>>& b) {
  if (a.size() != b.size())
    return std::to_string(a.size()) + " chunks against " + std::to_string(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    if (a[i].size() != b[i].size())
      return "chunk " + std::to_string(i) + ": " + std::to_string(a[i].size()) + " bytes against " +
             std::to_string(b[i].size());
    size_t j = 0;
    while (a[i][j] == b[i][j]) ++j;
    return "chunk " + std::to_string(i) + " of " + std::to_string(a.size()) + " (" +
           std::to_string(a[i].size()) + " bytes), byte " + std::to_string(j) + ": " +
           std::to_string(a[i][j]) + " against " + std::to_string(b[i][j]);
  }
  return "none";
}

// The GPU cache holds and shows exactly what the CPU cache does.
void expect_same_state(const ModelCache& cpu, const ModelCache& gpu, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(cpu.offset(), gpu.offset());
  for (int l = 0; l < cpu.n_layers(); ++l) {
    const LayerCache &a = cpu.layer(l), &b = gpu.layer(l);
    EXPECT_EQ(a.sealed_tokens(), b.sealed_tokens());
    EXPECT_EQ(a.n_blocks(), b.n_blocks());
    EXPECT_EQ(a.exact_begin(), b.exact_begin());
    EXPECT_TRUE(chunks(cpu, l) == chunks(gpu, l))
        << "exported chunks differ (layer " << l << "): "
        << first_difference(chunks(cpu, l), chunks(gpu, l));
    const CacheBytes x = a.bytes(), y = b.bytes();
    EXPECT_EQ(x.key_codes, y.key_codes);
    EXPECT_EQ(x.value_codes, y.value_codes);
    EXPECT_EQ(x.params, y.params);
    EXPECT_EQ(x.residual, y.residual);
    EXPECT_EQ(x.meta, y.meta);
    EXPECT_EQ(x.elements, y.elements);
    EXPECT_EQ(b.resident_bytes(), y.total());
    EXPECT_EQ(a.resident_bytes(), b.resident_bytes());
    if (a.offset() == 0) continue;
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      std::vector<float> ck, cv, gk, gv;
      cpu_read(a, false, 0, a.offset(), dt, ck, cv);
      gpu_read(b, false, 0, b.offset(), dt, gk, gv);
      EXPECT_TRUE(ck == gk && cv == gv) << "read() differs, dtype " << dtype_name(dt);
    }
    const int64_t e0 = a.exact_begin();
    std::vector<float> ck, cv, gk, gv;
    cpu_read(a, true, e0, a.offset() - e0, DType::kF32, ck, cv);
    gpu_read(b, true, e0, b.offset() - e0, DType::kF32, gk, gv);
    EXPECT_TRUE(ck == gk && cv == gv) << "read_exact() differs";
  }
}

// The methods the GPU holds, at settings that seal blocks within a few hundred tokens: the
// fast decode path's (bits 2/4/8, group 32) and ones only the generic kernels take (3 bits,
// groups of 4, no residual).
const char* const kSpecs[] = {
    "fp16",
    "kivi:k_bits=2,v_bits=2,group=32,residual=40",
    "kivi:k_bits=4,v_bits=4,group=32,residual=128",
    "kivi:k_bits=8,v_bits=8,group=32,residual=0",
    "kivi:k_bits=3,v_bits=2,group=4,residual=8",
    // XQuant: one layer is an anchor (KIVI's layout, calibrated or refit pairs); the two-layer
    // cases (StoresTheCpuBackendsBytes) add a reuse layer; CudaXQuant below tests reuse layers.
    "xquant:k_bits=2,v_bits=2,res_bits=2,group=32,residual=40",
    "xquant:k_bits=3,v_bits=2,res_bits=1,group=4,residual=8,fit=lsq,reuse_fit=minmax,eta=0.09",
    // ZipCache: attention-ranked (probes kept on the device, their log-sum-exps over the cache
    // as held) or norm-ranked masks, each value mode, split and shared key pairs, no salient
    // tokens and only salient ones.
    "zipcache:group=32,residual=40",
    "zipcache:hi_bits=3,lo_bits=1,frac=0.25,group=16,residual=8,saliency=norm,values=uniform,"
    "v_group=8",
    "zipcache:hi_bits=8,lo_bits=3,group=8,residual=0,probe=1,values=routed,kparams=shared,"
    "v_group=5",
    "zipcache:hi_bits=5,lo_bits=5,frac=1,group=4,residual=8,probe=0.5,kparams=shared",
    "zipcache:frac=0,group=16,residual=8,values=routed",
    // CacheGen (group == chunk, values=token, tables=shared): block 0 encoded on the host (the
    // layer's prototypes), later blocks by the GPU encoder; delta=auto at 4 and 8 bits (the
    // per-channel choice, 256-symbol histograms), token, group and anchor deltas, odd widths,
    // two layer groups (the second layer at 3 bits), no residual.
    "cachegen:bits=4,group=32,chunk=32,residual=40",
    "cachegen:bits=8,group=16,chunk=16,residual=16",
    "cachegen:bits=2,group=16,chunk=16,residual=0,delta=token",
    "cachegen:bits=3,group=32,chunk=32,residual=8,delta=anchor",
    "cachegen:bits=5,group=8,chunk=8,residual=8,delta=group",
    "cachegen:bits=4,group=32,chunk=32,residual=40,delta=none,layer_groups=2",
};

class CudaCache : public ::testing::TestWithParam<const char*> {};

// Prefill, single-token decode steps, a chunk that seals several blocks at once: after every
// append the GPU cache's state is the CPU cache's, byte for byte.
TEST_P(CudaCache, StoresTheCpuBackendsBytes) {
  REQUIRE_GPU();
  const Data d(2, 2, 4, 400, 64, 1);
  ModelCache cpu = make(GetParam(), d, false, 2), gpu = make(GetParam(), d, true, 2);
  int64_t off = 0;
  for (int64_t n : {150, 1, 1, 1, 37, 1, 100, 3}) {
    ASSERT_TRUE(append(cpu, d, false, off, n).ok());
    const Status st = append(gpu, d, true, off, n);
    ASSERT_TRUE(st.ok()) << st.to_string();
    off += n;
    expect_same_state(cpu, gpu, "after appending up to " + std::to_string(off));
  }
  if (std::string(GetParam()) != "fp16") {
    EXPECT_GT(gpu.layer(0).n_blocks(), 3);
  }
}

// Appends that seal blocks whose older tokens came earlier, block 0 included, with one new
// token or a few (CacheGen encodes block 0 on the host from its pages): the CPU cache's state
// after every append.
TEST_P(CudaCache, SealsBlocksBegunByEarlierAppends) {
  REQUIRE_GPU();
  const Data d(2, 2, 4, 200, 64, 3);
  ModelCache cpu = make(GetParam(), d, false), gpu = make(GetParam(), d, true);
  int64_t off = 0;
  for (int64_t n : {1, 6, 8, 15, 1, 1, 2, 30, 1, 64, 5}) {
    ASSERT_TRUE(append(cpu, d, false, off, n).ok());
    const Status st = append(gpu, d, true, off, n);
    ASSERT_TRUE(st.ok()) << st.to_string();
    off += n;
    expect_same_state(cpu, gpu, "after appending up to " + std::to_string(off));
  }
}

// Half-precision and strided (BSHD) input: the window rounds the same way.
TEST_P(CudaCache, HalfAndStridedInputAgree) {
  REQUIRE_GPU();
  const int64_t B = 1, H = 2, S = 200, D = 128;
  const auto k = testing::random_kv(B, H, S, D, 5), v = testing::random_kv(B, H, S, D, 6);
  std::vector<uint16_t> kh(k.size()), vh(v.size());  // [B, S, H, D] f16
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t x = 0; x < D; ++x) {
        kh[static_cast<size_t>((s * H + h) * D + x)] = f32_to_f16(k[static_cast<size_t>((h * S + s) * D + x)]);
        vh[static_cast<size_t>((s * H + h) * D + x)] = f32_to_f16(v[static_cast<size_t>((h * S + s) * D + x)]);
      }
  DevBuf dk(kh), dv(vh);
  const Data shape_only(B, H, H, 1, D, 0);
  ModelCache cpu = make(GetParam(), shape_only, false), gpu = make(GetParam(), shape_only, true);
  for (int64_t s0 : {0, 170}) {
    const int64_t n = s0 == 0 ? 170 : 30;
    ASSERT_TRUE(cpu.layer(0).append(TensorView::bshd(kh.data(), DType::kF16, B, S, H, D).slice_tokens(s0, n),
                                    TensorView::bshd(vh.data(), DType::kF16, B, S, H, D).slice_tokens(s0, n))
                    .ok());
    const Status st = gpu.layer(0).append(
        TensorView::bshd(dk.p, DType::kF16, B, S, H, D, kGpu).slice_tokens(s0, n),
        TensorView::bshd(dv.p, DType::kF16, B, S, H, D, kGpu).slice_tokens(s0, n));
    ASSERT_TRUE(st.ok()) << st.to_string();
  }
  expect_same_state(cpu, gpu, "f16 BSHD input");
}

// bf16 input (BHSD and BSHD): the window keeps bf16, and the stored bytes, reads (into f32, f16
// and bf16) and exported chunks are the CPU backend's for the same bf16 input.
TEST_P(CudaCache, Bf16InputAgrees) {
  REQUIRE_GPU();
  const int64_t B = 2, H = 2, S = 260, D = 64;
  const auto k = testing::random_kv(B, H, S, D, 7), v = testing::random_kv(B, H, S, D, 8);
  for (bool bshd : {false, true}) {
    SCOPED_TRACE(bshd ? "BSHD" : "BHSD");
    std::vector<uint16_t> kh(k.size()), vh(v.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t x = 0; x < D; ++x) {
            const size_t src = static_cast<size_t>(((b * H + h) * S + s) * D + x);
            const size_t dst = static_cast<size_t>(
                bshd ? ((b * S + s) * H + h) * D + x : ((b * H + h) * S + s) * D + x);
            kh[dst] = f32_to_bf16(k[src]);
            vh[dst] = f32_to_bf16(v[src]);
          }
    DevBuf dk(kh), dv(vh);
    auto view = [&](const void* p, Device dev) {
      return bshd ? TensorView::bshd(p, DType::kBF16, B, S, H, D, dev)
                  : TensorView::bhsd(p, DType::kBF16, B, H, S, D, dev);
    };
    const Data shape_only(B, H, H, 1, D, 0);
    ModelCache cpu = make(GetParam(), shape_only, false), gpu = make(GetParam(), shape_only, true);
    int64_t off = 0;
    for (int64_t n : {170, 1, 1, 57, 31}) {
      ASSERT_TRUE(cpu.layer(0)
                      .append(view(kh.data(), Device{}).slice_tokens(off, n),
                              view(vh.data(), Device{}).slice_tokens(off, n))
                      .ok());
      const Status st = gpu.layer(0).append(view(dk.p, kGpu).slice_tokens(off, n),
                                            view(dv.p, kGpu).slice_tokens(off, n));
      ASSERT_TRUE(st.ok()) << st.to_string();
      off += n;
      EXPECT_EQ(gpu.layer(0).window_dtype(), DType::kBF16);
      expect_same_state(cpu, gpu, "bf16 input up to " + std::to_string(off));
    }
  }
}

// Export on one backend, import on the other: the imported state is the one the CPU backend
// imports from the same chunks (an import keeps no retired exact values, so it is compared with
// an import, not with the source), its chunks are the source's, and what follows is identical.
TEST_P(CudaCache, ExportImportRoundTripsBothWays) {
  REQUIRE_GPU();
  const Data d(2, 2, 2, 300, 64, 2);
  for (bool from_gpu : {false, true}) {
    SCOPED_TRACE(from_gpu ? "GPU -> CPU" : "CPU -> GPU");
    ModelCache src = make(GetParam(), d, from_gpu);
    ASSERT_TRUE(append(src, d, from_gpu, 0, 233).ok());
    testing::ChunkCollector sink;
    const auto refs = chunk_refs(src, sink);
    ModelCache cpu = make(GetParam(), d, false), gpu = make(GetParam(), d, true);
    for (ModelCache* dst : {&cpu, &gpu}) {
      const Status st = dst->layer(0).import_chunks(refs, d.B, 233, src.layer(0).window_dtype());
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
    expect_same_state(cpu, gpu, "imported");
    EXPECT_TRUE(chunks(from_gpu ? cpu : gpu) == chunks(src));
    ASSERT_TRUE(append(src, d, from_gpu, 233, 67).ok());
    ASSERT_TRUE(append(cpu, d, false, 233, 67).ok());
    ASSERT_TRUE(append(gpu, d, true, 233, 67).ok());
    expect_same_state(cpu, gpu, "continued after the import");
    EXPECT_TRUE(chunks(from_gpu ? cpu : gpu) == chunks(src));
  }
}

// Bad chunks are refused by the GPU import as by the CPU's, and change nothing.
TEST_P(CudaCache, ImportRejectsInconsistentChunks) {
  REQUIRE_GPU();
  const Data d(1, 2, 2, 200, 64, 3);
  ModelCache cpu = make(GetParam(), d, false), gpu = make(GetParam(), d, true);
  ASSERT_TRUE(append(cpu, d, false, 0, 180).ok());
  ASSERT_TRUE(append(gpu, d, true, 0, 20).ok());
  const auto before = chunks(gpu);
  testing::ChunkCollector sink;
  const auto refs = chunk_refs(cpu, sink);
  EXPECT_FALSE(gpu.layer(0).import_chunks(refs, d.B, 181, DType::kF16).ok());  // wrong offset
  EXPECT_FALSE(gpu.layer(0).import_chunks(refs, d.B + 1, 180, DType::kF16).ok());  // wrong batch
  EXPECT_EQ(gpu.offset(), 20);
  EXPECT_TRUE(chunks(gpu) == before);
}

// Trims inside the window and into sealed blocks, reset and clone, against the CPU.
TEST_P(CudaCache, TrimResetAndClone) {
  REQUIRE_GPU();
  const Data d(2, 2, 4, 400, 64, 4);
  ModelCache cpu = make(GetParam(), d, false), gpu = make(GetParam(), d, true);
  ASSERT_TRUE(append(cpu, d, false, 0, 300).ok());
  ASSERT_TRUE(append(gpu, d, true, 0, 300).ok());
  for (int64_t n : {3, 1, 50, 77}) {  // the last ones reach into sealed blocks, mid-block
    ASSERT_TRUE(cpu.trim(n).ok());
    const Status st = gpu.trim(n);
    ASSERT_TRUE(st.ok()) << st.to_string();
    expect_same_state(cpu, gpu, "after trim " + std::to_string(n));
    const int64_t off = cpu.offset();
    ASSERT_TRUE(append(cpu, d, false, off, 20).ok());
    ASSERT_TRUE(append(gpu, d, true, off, 20).ok());
    expect_same_state(cpu, gpu, "re-appended after trim " + std::to_string(n));
  }
  EXPECT_EQ(gpu.trim(gpu.offset() + 1).code(), ErrorCode::kOutOfRange);

  ModelCache copy = gpu.clone(), cpu_copy = cpu.clone();  // a clone keeps no retired values
  expect_same_state(cpu_copy, copy, "clone");
  EXPECT_TRUE(chunks(copy) == chunks(gpu));
  ASSERT_TRUE(append(copy, d, true, copy.offset(), 5).ok());  // the original does not move
  expect_same_state(cpu, gpu, "original after appending to the clone");

  gpu.reset();
  cpu.reset();
  EXPECT_EQ(gpu.offset(), 0);
  EXPECT_EQ(gpu.resident_bytes(), 0u);
  ASSERT_TRUE(append(cpu, d, false, 0, 99).ok());
  ASSERT_TRUE(append(gpu, d, true, 0, 99).ok());
  expect_same_state(cpu, gpu, "after reset");
}

// Non-finite and out-of-range elements, wrong devices and shapes: the CPU backend's error, and
// the GPU cache unchanged.
TEST_P(CudaCache, BadInputLeavesTheCacheUntouched) {
  REQUIRE_GPU();
  Data d(1, 2, 2, 200, 64, 5);
  ModelCache gpu = make(GetParam(), d, true), cpu = make(GetParam(), d, false);
  ASSERT_TRUE(append(gpu, d, true, 0, 100).ok());
  ASSERT_TRUE(append(cpu, d, false, 0, 100).ok());
  const auto before = chunks(gpu);
  const uint64_t resident = gpu.resident_bytes();
  struct Case {
    size_t index;
    float value;
    bool in_v;
  };
  for (const Case c : {Case{(1 * 200 + 150) * 64 + 3, NAN, false},
                       Case{(0 * 200 + 101) * 64 + 63, INFINITY, true},
                       Case{(1 * 200 + 199) * 64 + 0, 70000.0f, false}}) {
    std::vector<float>& x = c.in_v ? d.v : d.k;
    const float old = x[c.index];
    x[c.index] = c.value;
    DevBuf dx(x);
    const TensorView kg = c.in_v ? d.K(true, 100, 100) : TensorView::bhsd(dx.p, DType::kF32, 1, 2, 200, 64, kGpu).slice_tokens(100, 100);
    const TensorView vg = c.in_v ? TensorView::bhsd(dx.p, DType::kF32, 1, 2, 200, 64, kGpu).slice_tokens(100, 100) : d.V(true, 100, 100);
    const Status sg = gpu.layer(0).append(kg, vg);
    const Status sc = cpu.layer(0).append(d.K(false, 100, 100), d.V(false, 100, 100));
    EXPECT_FALSE(sg.ok());
    EXPECT_EQ(sg.code(), sc.code()) << sg.to_string() << " vs " << sc.to_string();
    EXPECT_EQ(sg.message(), sc.message());
    x[c.index] = old;
    EXPECT_EQ(gpu.offset(), 100);
    EXPECT_EQ(gpu.resident_bytes(), resident);
    EXPECT_TRUE(chunks(gpu) == before);
  }
  // Host memory given to a GPU cache.
  const Status host = gpu.layer(0).append(d.K(false, 100, 1), d.V(false, 100, 1));
  EXPECT_EQ(host.code(), ErrorCode::kInvalidArgument) << host.to_string();
  // A NaN query.
  std::vector<float> q = d.q;
  q[static_cast<size_t>(100 * 64 + 5)] = NAN;
  DevBuf dq(q);
  const TensorView qv = TensorView::bhsd(dq.p, DType::kF32, 1, 2, 200, 64, kGpu).slice_tokens(100, 1);
  const TensorView kv = d.K(true, 100, 1), vv = d.V(true, 100, 1);
  EXPECT_EQ(gpu.layer(0).append(kv, vv, &qv).code(), ErrorCode::kNonFinite);
  EXPECT_TRUE(chunks(gpu) == before);
  EXPECT_EQ(gpu.offset(), 100);
  // Shapes.
  const TensorView k3 = d.K(true, 100, 2), v1 = d.V(true, 100, 1);
  EXPECT_EQ(gpu.layer(0).append(k3, v1).code(), ErrorCode::kShapeMismatch);
  EXPECT_TRUE(chunks(gpu) == before);
}

INSTANTIATE_TEST_SUITE_P(Methods, CudaCache, ::testing::ValuesIn(kSpecs),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return "m" + std::to_string(i.index);
                         });

// ---- XQuant: reuse layers read their anchor layer's codes on the device ----

// Three layers, each fed its own K/V/Q (a reuse layer fed its anchor's data would fit it
// exactly): layers=2 makes layer 1 reuse layer 0 and layer 2 an anchor; layers=3 makes layers
// 1 and 2 reuse layer 0.
struct XqModel {
  static constexpr int kLayers = 3;
  std::vector<std::unique_ptr<Data>> d;
  XqModel(int64_t B, int64_t H, int64_t HQ, int64_t S, int64_t D, uint64_t seed) {
    for (int l = 0; l < kLayers; ++l)
      d.push_back(std::make_unique<Data>(B, H, HQ, S, D, seed + 10 * static_cast<uint64_t>(l)));
  }
  ModelCache make(const std::string& spec, bool gpu) const {
    return ::kvq::make(spec, *d[0], gpu, kLayers);
  }
  Status append(ModelCache& c, bool gpu, int64_t s0, int64_t n) const {
    for (int l = 0; l < c.n_layers(); ++l) {
      const Data& x = *d[static_cast<size_t>(l)];
      const TensorView q = x.Q(gpu, s0, n);
      KVQ_RETURN_IF_ERROR(c.layer(l).append(x.K(gpu, s0, n), x.V(gpu, s0, n), &q));
    }
    return ok_status();
  }
};

// Every layer's chunks in layer order (the order an import must follow), with their bytes.
struct ModelChunks {
  std::vector<testing::ChunkCollector> sinks;
  explicit ModelChunks(const ModelCache& c) : sinks(static_cast<size_t>(c.n_layers())) {
    for (int l = 0; l < c.n_layers(); ++l) {
      EXPECT_TRUE(c.layer(l).export_blocks(0, sinks[static_cast<size_t>(l)]).ok());
      EXPECT_TRUE(c.layer(l).export_tail(sinks[static_cast<size_t>(l)]).ok());
    }
  }
};

const char* const kXqSpecs[] = {
    "xquant:k_bits=2,v_bits=2,res_bits=2,group=32,residual=40",
    "xquant:k_bits=3,v_bits=2,res_bits=1,group=4,residual=8,fit=lsq,reuse_fit=minmax,eta=0.09",
    "xquant:k_bits=4,v_bits=4,res_bits=0,group=32,residual=0,layers=3,eta=0",
    "xquant:k_bits=2,v_bits=2,res_bits=3,group=32,residual=64,layers=3,fit=lsq",
    // The decode kernel's other reuse variants: 4-bit codes with a 4-bit residual (two planes),
    // 2-bit codes without one.
    "xquant:k_bits=4,v_bits=4,res_bits=4,group=32,residual=32,reuse_fit=minmax",
    "xquant:k_bits=2,v_bits=2,res_bits=0,group=32,residual=48",
};

class CudaXQuant : public ::testing::TestWithParam<const char*> {};

// Prefill, decode steps and multi-block chunks: every layer holds the CPU backend's bytes (the
// reuse layers' exported chunks carry the hash of the anchor codes they read), reads back its
// values, and bills the same bytes.
TEST_P(CudaXQuant, ReuseLayersStoreTheCpuBackendsBytes) {
  REQUIRE_GPU();
  const XqModel m(2, 2, 4, 400, 64, 100);
  ModelCache cpu = m.make(GetParam(), false), gpu = m.make(GetParam(), true);
  int64_t off = 0;
  for (int64_t n : {150, 1, 1, 1, 37, 1, 100, 3}) {
    ASSERT_TRUE(m.append(cpu, false, off, n).ok());
    const Status st = m.append(gpu, true, off, n);
    ASSERT_TRUE(st.ok()) << st.to_string();
    off += n;
    expect_same_state(cpu, gpu, "after appending up to " + std::to_string(off));
  }
  EXPECT_GT(gpu.layer(1).n_blocks(), 3);
}

// A whole model exported on one backend and imported on the other, layer by layer: the state
// the CPU imports, the source's chunks, and identical appends after.
TEST_P(CudaXQuant, ExportImportRoundTripsBothWays) {
  REQUIRE_GPU();
  const XqModel m(2, 2, 2, 300, 64, 200);
  for (bool from_gpu : {false, true}) {
    SCOPED_TRACE(from_gpu ? "GPU -> CPU" : "CPU -> GPU");
    ModelCache src = m.make(GetParam(), from_gpu);
    ASSERT_TRUE(m.append(src, from_gpu, 0, 233).ok());
    ModelChunks exported(src);
    ModelCache cpu = m.make(GetParam(), false), gpu = m.make(GetParam(), true);
    for (ModelCache* dst : {&cpu, &gpu})
      for (int l = 0; l < XqModel::kLayers; ++l) {
        const Status st = dst->layer(l).import_chunks(
            exported.sinks[static_cast<size_t>(l)].chunks(), 2, 233, src.layer(l).window_dtype());
        ASSERT_TRUE(st.ok()) << "layer " << l << ": " << st.to_string();
      }
    expect_same_state(cpu, gpu, "imported");
    for (int l = 0; l < XqModel::kLayers; ++l)
      EXPECT_TRUE(chunks(from_gpu ? cpu : gpu, l) == chunks(src, l)) << "layer " << l;
    for (ModelCache* c : {&src, &cpu, &gpu}) {
      const bool on_gpu = c == &gpu || (c == &src && from_gpu);
      ASSERT_TRUE(m.append(*c, on_gpu, 233, 67).ok());
    }
    expect_same_state(cpu, gpu, "continued after the import");
    for (int l = 0; l < XqModel::kLayers; ++l)
      EXPECT_TRUE(chunks(from_gpu ? cpu : gpu, l) == chunks(src, l)) << "layer " << l;
  }
}

// A reuse layer's chunks imported against other anchor codes are refused (the hash), as on the
// CPU, and change nothing; so is a reuse layer imported before its anchor holds the blocks.
TEST_P(CudaXQuant, ImportAgainstOtherAnchorCodesIsRefused) {
  REQUIRE_GPU();
  const XqModel m(1, 2, 2, 300, 64, 300), other(1, 2, 2, 300, 64, 400);
  ModelCache src = m.make(GetParam(), false);
  ASSERT_TRUE(m.append(src, false, 0, 200).ok());
  ModelChunks exported(src);
  ModelCache cpu = m.make(GetParam(), false), gpu = m.make(GetParam(), true);
  for (ModelCache* c : {&cpu, &gpu}) {
    const Status empty = c->layer(1).import_chunks(exported.sinks[1].chunks(), 1, 200, DType::kF16);
    EXPECT_EQ(empty.code(), ErrorCode::kCorrupt) << empty.to_string();
    ASSERT_TRUE(other.append(*c, c == &gpu, 0, 200).ok());  // other codes in the anchor
  }
  const auto before = chunks(gpu, 1);
  const Status sc = cpu.layer(1).import_chunks(exported.sinks[1].chunks(), 1, 200, DType::kF16);
  const Status sg = gpu.layer(1).import_chunks(exported.sinks[1].chunks(), 1, 200, DType::kF16);
  EXPECT_EQ(sc.code(), ErrorCode::kCorrupt) << sc.to_string();
  EXPECT_EQ(sg.code(), sc.code()) << sg.to_string();
  EXPECT_EQ(sg.message(), sc.message());
  EXPECT_TRUE(chunks(gpu, 1) == before);
  expect_same_state(cpu, gpu, "after the refused imports");
}

// Model trims (reuse layers first) into sealed blocks, clone, reset; then one layer trimmed,
// cloned and reset on its own, so that reuse layers hold codes their anchor dropped: billed as
// meta by the anchor (or the lowest reuse layer), resident == accounted, as on the CPU.
TEST_P(CudaXQuant, TrimCloneResetAndCodesTheAnchorDropped) {
  REQUIRE_GPU();
  const XqModel m(2, 2, 4, 400, 64, 500);
  ModelCache cpu = m.make(GetParam(), false), gpu = m.make(GetParam(), true);
  ASSERT_TRUE(m.append(cpu, false, 0, 300).ok());
  ASSERT_TRUE(m.append(gpu, true, 0, 300).ok());
  for (int64_t n : {3, 50, 77}) {
    ASSERT_TRUE(cpu.trim(n).ok());
    const Status st = gpu.trim(n);
    ASSERT_TRUE(st.ok()) << st.to_string();
    expect_same_state(cpu, gpu, "after trim " + std::to_string(n));
    const int64_t off = cpu.offset();
    ASSERT_TRUE(m.append(cpu, false, off, 20).ok());
    ASSERT_TRUE(m.append(gpu, true, off, 20).ok());
    expect_same_state(cpu, gpu, "re-appended after trim " + std::to_string(n));
  }
  {
    ModelCache copy = gpu.clone(), cpu_copy = cpu.clone();
    expect_same_state(cpu_copy, copy, "clone");
    ASSERT_TRUE(m.append(copy, true, copy.offset(), 40).ok());
    ASSERT_TRUE(m.append(cpu_copy, false, cpu_copy.offset(), 40).ok());
    expect_same_state(cpu_copy, copy, "clone, appended");
    expect_same_state(cpu, gpu, "the original after appending to the clone");
  }
  // The anchor alone: its reuse layers keep the codes it drops.
  ASSERT_TRUE(cpu.layer(0).trim(90).ok());
  ASSERT_TRUE(gpu.layer(0).trim(90).ok());
  expect_same_state(cpu, gpu, "anchor trimmed alone");
  EXPECT_GT(gpu.layer(0).bytes().meta, 0u);
  {
    ModelCache copy = gpu.clone(), cpu_copy = cpu.clone();
    expect_same_state(cpu_copy, copy, "clone with dropped anchor codes");
  }
  {
    // A reuse layer cloned on its own: its group has no anchor, so it bills every anchor block
    // it reads (as the lowest reuse layer), through trims of the copy too.
    CloneMemo mc, mg;
    const auto cl = cpu.layer(1).clone(mc);
    const auto gl = gpu.layer(1).clone(mg);
    auto same = [&](const char* what) {
      SCOPED_TRACE(what);
      const CacheBytes x = cl->bytes(), y = gl->bytes();
      EXPECT_EQ(x.meta, y.meta);
      EXPECT_EQ(x.total(), y.total());
      EXPECT_EQ(gl->resident_bytes(), y.total());
      EXPECT_EQ(cl->resident_bytes(), gl->resident_bytes());
      testing::ChunkCollector a, b;
      EXPECT_TRUE(cl->export_blocks(0, a).ok() && cl->export_tail(a).ok());
      EXPECT_TRUE(gl->export_blocks(0, b).ok() && gl->export_tail(b).ok());
      EXPECT_TRUE(a.store == b.store) << "exported chunks differ";
    };
    same("a reuse layer cloned alone");
    EXPECT_GT(gl->bytes().meta, 0u);
    for (int64_t n : {1, 40}) {
      ASSERT_TRUE(cl->trim(n).ok());
      ASSERT_TRUE(gl->trim(n).ok());
      same(n == 1 ? "trimmed by 1" : "trimmed into its blocks");
    }
  }
  cpu.layer(0).reset();
  gpu.layer(0).reset();
  expect_same_state(cpu, gpu, "anchor reset alone");
  cpu.reset();
  gpu.reset();
  EXPECT_EQ(gpu.resident_bytes(), 0u);
  ASSERT_TRUE(m.append(cpu, false, 0, 99).ok());
  ASSERT_TRUE(m.append(gpu, true, 0, 99).ok());
  expect_same_state(cpu, gpu, "after reset");
}

// A reuse layer appended before its anchor sealed the tokens, or with another batch size: the
// CPU backend's error, and nothing changed.
TEST_P(CudaXQuant, ReuseBeforeTheAnchorIsRefused) {
  REQUIRE_GPU();
  const XqModel m(2, 2, 2, 300, 64, 600), one(1, 2, 2, 300, 64, 700);
  ModelCache cpu = m.make(GetParam(), false), gpu = m.make(GetParam(), true);
  const Data& x = *m.d[1];
  const Status sc = cpu.layer(1).append(x.K(false, 0, 200), x.V(false, 0, 200));
  const Status sg = gpu.layer(1).append(x.K(true, 0, 200), x.V(true, 0, 200));
  EXPECT_FALSE(sc.ok());
  EXPECT_EQ(sg.code(), sc.code()) << sg.to_string();
  EXPECT_EQ(sg.message(), sc.message());
  EXPECT_EQ(gpu.layer(1).offset(), 0);
  const Data& a = *m.d[0];
  ASSERT_TRUE(cpu.layer(0).append(a.K(false, 0, 200), a.V(false, 0, 200)).ok());
  ASSERT_TRUE(gpu.layer(0).append(a.K(true, 0, 200), a.V(true, 0, 200)).ok());
  const Data& y = *one.d[1];
  const Status bc = cpu.layer(1).append(y.K(false, 0, 200), y.V(false, 0, 200));
  const Status bg = gpu.layer(1).append(y.K(true, 0, 200), y.V(true, 0, 200));
  EXPECT_EQ(bc.code(), ErrorCode::kShapeMismatch) << bc.to_string();
  EXPECT_EQ(bg.code(), bc.code()) << bg.to_string();
  EXPECT_EQ(bg.message(), bc.message());
  EXPECT_EQ(gpu.layer(1).offset(), 0);
  EXPECT_EQ(gpu.layer(1).resident_bytes(), 0u);
}

double rel_err(const std::vector<float>& a, const std::vector<float>& r);
double row_rel_err(const std::vector<float>& a, const std::vector<float>& r, int64_t D);

// Decode and chunk attention over every layer (the fused decode kernel where it applies: anchors,
// and reuse layers with one or two code planes; the generic kernel otherwise; the chunk kernel
// for chunks) against the CPU backend, at the tolerances
// of CudaAttend below (4e-3 relative: decode over the whole output, chunks per output row).
TEST_P(CudaXQuant, AttendsAsTheCpuBackend) {
  REQUIRE_GPU();
  for (int64_t D : {64, 128}) {
    SCOPED_TRACE("head_dim " + std::to_string(D));
    const int64_t B = 2, H = 2, HQ = 8;
    const XqModel m(B, H, HQ, 700, D, 800 + static_cast<uint64_t>(D));
    ModelCache cpu = m.make(GetParam(), false), gpu = m.make(GetParam(), true);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    int64_t off = 0;
    for (int64_t n : {301, 1, 300, 1, 5, 1}) {
      ASSERT_TRUE(m.append(cpu, false, off, n).ok());
      ASSERT_TRUE(m.append(gpu, true, off, n).ok());
      off += n;
      const int64_t tq = n > 1 && n <= 8 ? n : 1;
      for (int l = 0; l < XqModel::kLayers; ++l) {
        SCOPED_TRACE("layer " + std::to_string(l) + ", offset " + std::to_string(off));
        const Data& x = *m.d[static_cast<size_t>(l)];
        const size_t elems = static_cast<size_t>(B * HQ * tq * D);
        std::vector<float> ref(elems);
        ASSERT_TRUE(cpu.layer(l)
                        .attend(x.Q(false, off - tq, tq), scale,
                                MutTensorView::bhsd(ref.data(), DType::kF32, B, HQ, tq, D))
                        .ok());
        DevBuf out(elems * 4);
        const Status st = gpu.layer(l).attend(
            x.Q(true, off - tq, tq), scale, MutTensorView::bhsd(out.p, DType::kF32, B, HQ, tq, D, kGpu));
        ASSERT_TRUE(st.ok()) << st.to_string();
        const auto got = out.get<float>();
        if (tq == 1) {
          EXPECT_LT(rel_err(got, ref), 4e-3);
        } else {
          EXPECT_LT(row_rel_err(got, ref, D), 4e-3);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Specs, CudaXQuant, ::testing::ValuesIn(kXqSpecs),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return "x" + std::to_string(i.index);
                         });

// ---- attention ----

struct AttendCase {
  const char* spec;
  int64_t D, ratio;  // head_dim, query heads per KV head
};

void PrintTo(const AttendCase& c, std::ostream* os) {
  *os << c.spec << ", head_dim " << c.D << ", " << c.ratio << " query heads per KV head";
}

class CudaAttend : public ::testing::TestWithParam<AttendCase> {};

double rel_err(const std::vector<float>& a, const std::vector<float>& r) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (static_cast<double>(a[i]) - r[i]) * (static_cast<double>(a[i]) - r[i]);
    den += static_cast<double>(r[i]) * r[i];
  }
  return std::sqrt(num / den);
}

// The largest relative error of one output row (D values: one query head at one position), so
// that one wrong row cannot hide in a large chunk's norm.
double row_rel_err(const std::vector<float>& a, const std::vector<float>& r, int64_t D) {
  double worst = 0;
  for (size_t i0 = 0; i0 < a.size(); i0 += static_cast<size_t>(D)) {
    const auto n = static_cast<ptrdiff_t>(D), o = static_cast<ptrdiff_t>(i0);
    const std::vector<float> x(a.begin() + o, a.begin() + o + n), y(r.begin() + o, r.begin() + o + n);
    worst = std::max(worst, rel_err(x, y));
  }
  return worst;
}

// Decode (one query: the fused kernel where it applies) and a 5-query chunk (the generic kernel,
// per-query seal boundaries inside one append that seals a block) against the CPU backend's
// attend(), at lengths that are not multiples of the block.
// Tolerances: decode ||gpu - cpu|| / ||cpu|| <= 4e-3 (keys and values dequantized to fp16 inside
// the tensor-core products: about 2^-11 relative per element); chunks (the chunk kernel, on
// tensor cores too, queries and probabilities also in fp16) 4e-3 for every output row.
TEST_P(CudaAttend, MatchesTheCpuBackend) {
  REQUIRE_GPU();
  const AttendCase c = GetParam();
  const int64_t B = 2, H = 2, HQ = H * c.ratio, S = 1200;
  const Data d(B, H, HQ, S, c.D, 10 + static_cast<uint64_t>(c.D + c.ratio));
  ModelCache cpu = make(c.spec, d, false), gpu = make(c.spec, d, true);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  int64_t off = 0;
  double worst = 0;  // the largest decode error, printed (the margin under the tolerance)
  for (int64_t n : {301, 1, 1, 700, 1, 5, 3, 1}) {
    ASSERT_TRUE(append(cpu, d, false, off, n).ok());
    ASSERT_TRUE(append(gpu, d, true, off, n).ok());
    off += n;
    std::vector<int64_t> tqs{1};
    if (n > 1 && n <= 8) tqs.push_back(n);
    for (int64_t tq : tqs) {
      const size_t elems = static_cast<size_t>(B * HQ * tq * c.D);
      std::vector<float> ref(elems);
      ASSERT_TRUE(cpu.layer(0)
                      .attend(d.Q(false, off - tq, tq), scale,
                              MutTensorView::bhsd(ref.data(), DType::kF32, B, HQ, tq, c.D))
                      .ok());
      DevBuf out(elems * 4);
      const Status st = gpu.layer(0).attend(
          d.Q(true, off - tq, tq), scale,
          MutTensorView::bhsd(out.p, DType::kF32, B, HQ, tq, c.D, kGpu));
      ASSERT_TRUE(st.ok()) << st.to_string();
      const auto got = out.get<float>();
      const double err = rel_err(got, ref);
      SCOPED_TRACE("offset " + std::to_string(off) + ", " + std::to_string(tq) + " queries");
      if (tq == 1) {
        EXPECT_LT(err, 4e-3);
        worst = std::max(worst, err);
      } else {
        EXPECT_LT(row_rel_err(got, ref, c.D), 4e-3);
      }
      // A range of KV heads writes only its query heads.
      if (tq == 1) {
        DevBuf part(elems * 4);
        ASSERT_TRUE(gpu.layer(0)
                        .attend(d.Q(true, off - 1, 1), scale,
                                MutTensorView::bhsd(part.p, DType::kF32, B, HQ, 1, c.D, kGpu), 1, 2)
                        .ok());
        const auto p = part.get<float>();
        for (int64_t b = 0; b < B; ++b)
          for (int64_t hq = 0; hq < HQ; ++hq)
            for (int64_t x = 0; x < c.D; ++x) {
              const size_t i = static_cast<size_t>((b * HQ + hq) * c.D + x);
              if (hq / c.ratio == 1)
                ASSERT_NEAR(p[i], ref[i], 2e-2f * (1 + std::fabs(ref[i])));
              else
                ASSERT_EQ(std::memcmp(&p[i], "\x7f\x7f\x7f\x7f", 4), 0) << "head " << hq;
            }
      }
    }
  }
  std::printf("decode error %s D=%lld ratio=%lld: %.3g\n", c.spec, static_cast<long long>(c.D),
              static_cast<long long>(c.ratio), worst);
}

std::vector<AttendCase> attend_cases() {
  std::vector<AttendCase> v;
  for (const char* s : {"fp16", "kivi:k_bits=2,v_bits=2,group=32", "kivi:k_bits=4,v_bits=4,group=32",
                        "kivi:k_bits=8,v_bits=8,group=32,residual=64",
                        "kivi:k_bits=3,v_bits=3,group=16,residual=40", "zipcache:group=32",
                        "zipcache:group=64,saliency=norm,values=routed,kparams=shared",
                        "cachegen:bits=4,group=32,chunk=32", "cachegen:bits=2,group=32,chunk=32",
                        "cachegen:bits=3,group=16,chunk=16,residual=40,delta=anchor"})
    for (int64_t D : {64, 128})
      for (int64_t r : {1, 2, 4, 8}) v.push_back({s, D, r});
  // ZipCache's decode kernel: odd widths (codes across 32-bit words), uniform values (position
  // order), every token in one subset (frac 0 and 1), per-channel value pairs (v_group 4 and 8),
  // blocks that are not a multiple of 32 tokens (60, 156), shared key pairs at odd widths, GQA
  // ratios the kernel pads (3, 5); group 16 (a 2-byte mask) takes the chunk kernel.
  for (const char* s : {"zipcache:group=64,hi_bits=5,lo_bits=3,values=uniform,frac=0.25",
                        "zipcache:group=32,hi_bits=7,lo_bits=1,values=routed,frac=0,v_group=4",
                        "zipcache:group=128,hi_bits=6,lo_bits=6,values=cst,frac=1,v_group=8",
                        "zipcache:group=60,hi_bits=3,lo_bits=2,kparams=shared,residual=70",
                        "zipcache:group=156,hi_bits=5,lo_bits=1,values=routed,residual=9",
                        "zipcache:group=16,hi_bits=3,lo_bits=2,residual=20"})
    for (int64_t D : {64, 128})
      for (int64_t r : {1, 3, 5}) v.push_back({s, D, r});
  // Its tensor-core variant (cst and routed values at widths 2, 4, 8; the two 4/2 ZipCache specs
  // of the first list take it too): 8-bit keys beside 2-bit ones, shared pairs, value groups of
  // 16, every token salient, none salient, blocks of 96 and 128 tokens.
  for (const char* s : {"zipcache:group=96,hi_bits=8,lo_bits=2,values=routed,frac=0.3,v_group=16,"
                        "kparams=shared,residual=40",
                        "zipcache:group=64,hi_bits=2,lo_bits=2,frac=1,residual=40",
                        "zipcache:group=128,hi_bits=8,lo_bits=8,frac=0,v_group=32,residual=33"})
    for (int64_t D : {64, 128})
      for (int64_t r : {1, 3, 5}) v.push_back({s, D, r});
  // 4/4 routed with v_group 8 (= head_dim / 8 at 64: the tensor cores with a value group per
  // lane; at 128 the fp32 kernel), and the fp32 kernel at the widths the tensor cores also take
  // (uniform values at 4/2 and 8/8).
  for (const char* s : {"zipcache:group=32,hi_bits=4,lo_bits=4,values=routed,v_group=8",
                        "zipcache:group=64,hi_bits=4,lo_bits=2,values=uniform,residual=40",
                        "zipcache:group=64,hi_bits=8,lo_bits=8,values=uniform,frac=0.5"})
    for (int64_t D : {64, 128})
      for (int64_t r : {2, 4, 8}) v.push_back({s, D, r});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttend, ::testing::ValuesIn(attend_cases()),
                         [](const ::testing::TestParamInfo<AttendCase>& i) {
                           return "c" + std::to_string(i.index) + "_d" +
                                  std::to_string(i.param.D) + "_gqa" +
                                  std::to_string(i.param.ratio);
                         });

// Prefill chunks (the chunk kernel: several query positions and heads per CTA, tiles shared)
// against the CPU backend: whole appended chunks attended at once, seal points inside them, GQA
// ratios that do not divide the CTA's 64 rows, every method the GPU holds (an XQuant reuse
// layer included), at the chunk tolerance (4e-3 relative, every output row).
TEST(CudaChunk, PrefillChunksMatchTheCpuBackend) {
  REQUIRE_GPU();
  struct Case {
    const char* spec;
    int layer;  // the layer attended (XQuant: 1 reuses layer 0)
  };
  double worst = 0;
  for (const Case c : {Case{"fp16", 0}, Case{"kivi:k_bits=2,v_bits=2,group=32,residual=40", 0},
                       Case{"kivi:k_bits=3,v_bits=2,group=4,residual=8", 0},
                       Case{"xquant:k_bits=2,v_bits=2,res_bits=2,group=32,residual=40", 1},
                       Case{"zipcache:group=32,residual=40", 0}})
    for (int64_t D : {64, 128, 96, 256})  // 96 and 256: the fp32 version of the chunk kernel
      for (int64_t ratio : {1, 3, 8}) {
        SCOPED_TRACE(std::string(c.spec) + ", head_dim " + std::to_string(D) + ", ratio " +
                     std::to_string(ratio));
        const int64_t B = 2, H = 2, HQ = H * ratio;
        const XqModel m(B, H, HQ, 800, D, 900 + static_cast<uint64_t>(D * ratio));
        ModelCache cpu = m.make(c.spec, false), gpu = m.make(c.spec, true);
        const float scale = 1.0f / std::sqrt(static_cast<float>(D));
        int64_t off = 0;
        for (int64_t n : {300, 1, 257, 64, 2}) {
          ASSERT_TRUE(m.append(cpu, false, off, n).ok());
          ASSERT_TRUE(m.append(gpu, true, off, n).ok());
          off += n;
          if (n == 1) continue;
          const Data& x = *m.d[static_cast<size_t>(c.layer)];
          const size_t elems = static_cast<size_t>(B * HQ * n * D);
          std::vector<float> ref(elems);
          ASSERT_TRUE(cpu.layer(c.layer)
                          .attend(x.Q(false, off - n, n), scale,
                                  MutTensorView::bhsd(ref.data(), DType::kF32, B, HQ, n, D))
                          .ok());
          DevBuf out(elems * 4);
          const Status st = gpu.layer(c.layer).attend(
              x.Q(true, off - n, n), scale,
              MutTensorView::bhsd(out.p, DType::kF32, B, HQ, n, D, kGpu));
          ASSERT_TRUE(st.ok()) << st.to_string();
          const auto got = out.get<float>();
          const double err = row_rel_err(got, ref, D);
          EXPECT_LT(err, 4e-3);
          worst = std::max(worst, err);
        }
      }
  std::printf("chunk error (largest over every case and output row): %.3g\n", worst);
}

// A bf16 cache (bf16 K/V input, so a bf16 window) attended by bf16 and fp16 queries (outputs are
// f32, as on the CPU): decode and a 4-query chunk against the CPU backend fed the same bytes,
// at the tolerances above.
TEST(CudaAttendDtypes, Bf16CacheAndHalfQueriesMatchTheCpuBackend) {
  REQUIRE_GPU();
  const int64_t B = 2, H = 2, HQ = 8, S = 700, D = 128;
  const auto k = testing::random_kv(B, H, S, D, 31), v = testing::random_kv(B, H, S, D, 32);
  const auto q = testing::random_kv(B, HQ, S, D, 33, 0.3f);
  std::vector<uint16_t> kb(k.size()), vb(v.size());
  for (size_t i = 0; i < k.size(); ++i) kb[i] = f32_to_bf16(k[i]), vb[i] = f32_to_bf16(v[i]);
  DevBuf dk(kb), dv(vb);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // ZipCache's decode kernels too: the tensor-core variant (4/2, cst) and the fp32 one (5/3,
  // uniform values), both reading a bf16 window.
  for (const char* spec : {"fp16", "kivi:k_bits=2,v_bits=2,group=32",
                           "kivi:k_bits=4,v_bits=4,group=32", "kivi:k_bits=3,v_bits=3,group=16",
                           "zipcache:saliency=norm,residual=64",
                           "zipcache:hi_bits=5,lo_bits=3,values=uniform,saliency=norm"}) {
    SCOPED_TRACE(spec);
    const Data shape_only(B, H, HQ, 1, D, 0);
    ModelCache cpu = make(spec, shape_only, false), gpu = make(spec, shape_only, true);
    int64_t off = 0;
    for (int64_t n : {333, 1, 4, 1}) {
      const auto K = [&](const void* p, Device dev) {
        return TensorView::bhsd(p, DType::kBF16, B, H, S, D, dev).slice_tokens(off, n);
      };
      const auto V = K;
      ASSERT_TRUE(cpu.layer(0).append(K(kb.data(), Device{}), V(vb.data(), Device{})).ok());
      ASSERT_TRUE(gpu.layer(0).append(K(dk.p, kGpu), V(dv.p, kGpu)).ok());
      off += n;
      ASSERT_EQ(gpu.layer(0).window_dtype(), DType::kBF16);
      for (DType qt : {DType::kBF16, DType::kF16}) {
        SCOPED_TRACE(std::string("queries ") + dtype_name(qt) + ", offset " + std::to_string(off));
        std::vector<uint16_t> qh(q.size());
        for (size_t i = 0; i < q.size(); ++i)
          qh[i] = qt == DType::kBF16 ? f32_to_bf16(q[i]) : f32_to_f16(q[i]);
        DevBuf dq(qh);
        const int64_t tq = n > 1 && n <= 8 ? n : 1;
        const size_t elems = static_cast<size_t>(B * HQ * tq * D);
        std::vector<float> ref(elems);
        ASSERT_TRUE(cpu.layer(0)
                        .attend(TensorView::bhsd(qh.data(), qt, B, HQ, S, D).slice_tokens(off - tq, tq),
                                scale, MutTensorView::bhsd(ref.data(), DType::kF32, B, HQ, tq, D))
                        .ok());
        DevBuf out(elems * 4);
        const Status st = gpu.layer(0).attend(
            TensorView::bhsd(dq.p, qt, B, HQ, S, D, kGpu).slice_tokens(off - tq, tq), scale,
            MutTensorView::bhsd(out.p, DType::kF32, B, HQ, tq, D, kGpu));
        ASSERT_TRUE(st.ok()) << st.to_string();
        const auto got = out.get<float>();
        if (tq == 1) {
          EXPECT_LT(rel_err(got, ref), 4e-3);
        } else {
          EXPECT_LT(row_rel_err(got, ref, D), 4e-3);
        }
      }
    }
  }
}

// ---- memory ----

// Decode appends take their memory from the pool: after the first blocks, no cudaMalloc.
TEST(CudaMemory, DecodeAppendsDoNotCallCudaMalloc) {
  REQUIRE_GPU();
  const Data d(4, 8, 32, 1500, 128, 20);
  ModelCache gpu = make("kivi:k_bits=2,v_bits=2,group=32", d, true, 4);
  ASSERT_TRUE(append(gpu, d, true, 0, 1000).ok());
  auto before = cuda::memory_stats(gpu);
  ASSERT_TRUE(before.ok());
  for (int64_t i = 1000; i < 1400; ++i) ASSERT_TRUE(append(gpu, d, true, i, 1).ok());
  auto after = cuda::memory_stats(gpu);
  ASSERT_TRUE(after.ok());
  EXPECT_LE(after->device_allocations, before->device_allocations + 2)
      << "400 decode steps made " << after->device_allocations - before->device_allocations
      << " cudaMalloc calls";
  EXPECT_GE(after->in_use, gpu.resident_bytes());
  EXPECT_GE(after->reserved, after->in_use);
  CacheOptions cpu_opt;
  auto cpu = ModelCache::create("fp16", ModelShape::uniform(1, 2, 64), cpu_opt);
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(cuda::memory_stats(*cpu).status().code(), ErrorCode::kInvalidArgument);
}

// ZipCache's probes go back to the pool when the blocks they rank are sealed (a probe made and
// seen out within one append too): the pool's use beyond what the cache holds stays flat.
TEST(CudaMemory, ZipCacheProbesAreReturned) {
  REQUIRE_GPU();
  const Data d(2, 2, 4, 704, 64, 21);
  ModelCache gpu = make("zipcache:group=8,residual=0,probe=1", d, true, 2);
  ASSERT_TRUE(append(gpu, d, true, 0, 100).ok());
  // Measured after single-token appends: the exact values a long append's queries read are
  // held until the next append (workspace, not resident).
  ASSERT_TRUE(append(gpu, d, true, 100, 1).ok());
  auto overhead = [&] {
    auto m = cuda::memory_stats(gpu);
    EXPECT_TRUE(m.ok());
    return static_cast<int64_t>(m->in_use) - static_cast<int64_t>(gpu.resident_bytes());
  };
  const int64_t before = overhead();
  for (int64_t i = 101; i < 400; ++i) ASSERT_TRUE(append(gpu, d, true, i, 1).ok());
  ASSERT_TRUE(append(gpu, d, true, 400, 300).ok());
  ASSERT_TRUE(append(gpu, d, true, 700, 1).ok());
  // 600 probes of 1056 bytes each were made (1280 in the pool); the tables' doubling and the
  // blocks' rounding to 256 bytes are a few KiB.
  EXPECT_LT(overhead(), before + 65536);
}

// Runs with many probe rows (here 64 streams, four query heads each, every position a probe)
// take the tiled probe kernel (key tiles shared by 32 rows); the other tests' runs take the
// per-row one. Both store the CPU backend's bytes.
TEST(CudaZip, TiledProbesMatchTheCpuBackend) {
  REQUIRE_GPU();
  const Data d(8, 8, 32, 260, 64, 29);
  const char* spec = "zipcache:group=16,residual=16,probe=1,values=routed";
  ModelCache cpu = make(spec, d, false), gpu = make(spec, d, true);
  int64_t off = 0;
  for (int64_t n : {150, 1, 37, 72}) {
    ASSERT_TRUE(append(cpu, d, false, off, n).ok());
    ASSERT_TRUE(append(gpu, d, true, off, n).ok());
    off += n;
    expect_same_state(cpu, gpu, "after appending up to " + std::to_string(off));
  }
}

// A large query against keys of a wide range (|q * scale_d| far beyond fp16's range): the
// tensor-core decode folds q * scale_d into fp16 operands scaled by a power of two, so the result
// stays finite and matches the CPU backend (4/2 cst takes the tensor cores, 5/3 the fp32 kernel).
TEST(CudaZip, LargeQueriesAgainstWideKeysMatchTheCpuBackend) {
  REQUIRE_GPU();
  for (const char* spec : {"zipcache:saliency=norm,group=32,residual=16",
                           "zipcache:saliency=norm,group=32,residual=16,hi_bits=5,lo_bits=3"}) {
    SCOPED_TRACE(spec);
    Data d(1, 2, 8, 160, 128, 41);
    for (float& x : d.k) x *= 3000.0f;  // |k| up to ~3e4: a 2-bit step of ~5e3
    for (float& x : d.q) x *= 100.0f;   // |q * scale * log2 e * step| up to ~2e5
    d.dk = std::make_unique<DevBuf>(d.k);
    d.dq = std::make_unique<DevBuf>(d.q);
    ModelCache cpu = make(spec, d, false), gpu = make(spec, d, true);
    ASSERT_TRUE(append(cpu, d, false, 0, 160).ok());
    ASSERT_TRUE(append(gpu, d, true, 0, 160).ok());
    const float scale = 1.0f / std::sqrt(128.0f);
    const size_t elems = 8 * 128;
    std::vector<float> ref(elems);
    ASSERT_TRUE(cpu.layer(0)
                    .attend(d.Q(false, 159, 1), scale,
                            MutTensorView::bhsd(ref.data(), DType::kF32, 1, 8, 1, 128))
                    .ok());
    DevBuf out(elems * 4);
    ASSERT_TRUE(gpu.layer(0)
                    .attend(d.Q(true, 159, 1), scale,
                            MutTensorView::bhsd(out.p, DType::kF32, 1, 8, 1, 128, kGpu))
                    .ok());
    const auto got = out.get<float>();
    for (float x : got) ASSERT_TRUE(std::isfinite(x));
    EXPECT_LT(rel_err(got, ref), 4e-3);
  }
}

// The newest tq queries of d attended by a CPU and a GPU layer: the CPU's output finite, the
// GPU's finite and within 4e-3 of it row by row (one head at one position). The CPU's output
// comes back in ref.
// The range cases are about the tensor-core kernels: a decode step (one query) reaches the decode
// kernel of its method (KIVI's and XQuant's, or ZipCache's), a chunk the chunk kernel.
void expect_tensor_core_kernel(const LayerCache& gpu, int64_t tq) {
  using K = cuda::CudaLayer::AttendKernel;
  const auto* layer = dynamic_cast<const cuda::CudaLayer*>(&gpu);
  ASSERT_NE(layer, nullptr);
  const K k = layer->attend_kernel(static_cast<int>(tq));
  if (tq == 1) {
    EXPECT_TRUE(k == K::kFast || k == K::kZip) << "kernel " << static_cast<int>(k);
  } else {
    EXPECT_EQ(k, K::kChunk);
  }
}

void expect_attend_agrees(const LayerCache& cpu, const LayerCache& gpu, const Data& d, int64_t tq,
                          float scale, std::vector<float>& ref) {
  expect_tensor_core_kernel(gpu, tq);
  const size_t elems = static_cast<size_t>(d.B * d.HQ * tq * d.D);
  ref.assign(elems, 0.0f);
  ASSERT_TRUE(cpu.attend(d.Q(false, d.S - tq, tq), scale,
                         MutTensorView::bhsd(ref.data(), DType::kF32, d.B, d.HQ, tq, d.D))
                  .ok());
  for (float x : ref) ASSERT_TRUE(std::isfinite(x));
  DevBuf out(elems * 4);
  ASSERT_TRUE(gpu.attend(d.Q(true, d.S - tq, tq), scale,
                         MutTensorView::bhsd(out.p, DType::kF32, d.B, d.HQ, tq, d.D, kGpu))
                  .ok());
  const auto got = out.get<float>();
  EXPECT_EQ(std::count_if(got.begin(), got.end(), [](float x) { return !std::isfinite(x); }), 0);
  EXPECT_LT(row_rel_err(got, ref, d.D), 4e-3);
}

// Values at the edge of fp16's range: a 2-bit group reaching 65504 has its scale rounded
// outward (over [0, 65504]: 21840, so code 3 dequantizes to 65520), so its top code dequantizes
// past 65504 (finite in fp32 on the CPU; in an fp16 FMA it would round to infinity). Every
// method's decode kernel (5/3 bits: ZipCache's fp32 one) and the chunk kernel stay finite and
// agree with the CPU backend. The premise is checked on the first block (sealed for every spec
// here): the CPU's dequantized values pass 65504 (XQuant's anchor calibration pulls its range in:
// its values come within 4 % of the edge, not past it).
TEST(CudaAttendRange, ValuesAtFp16sEdgeStayFinite) {
  REQUIRE_GPU();
  for (const char* spec : {"kivi:k_bits=2,v_bits=2,group=32", "kivi:k_bits=4,v_bits=4,group=32",
                           "xquant:k_bits=2,v_bits=2,res_bits=2,group=32,residual=40",
                           "zipcache:saliency=norm,group=32,residual=16",
                           "zipcache:saliency=norm,group=32,residual=16,hi_bits=5,lo_bits=3",
                           "zipcache:saliency=norm,group=32,residual=16,values=routed"}) {
    SCOPED_TRACE(spec);
    Data d(1, 2, 8, 160, 128, 43);
    for (size_t i = 0; i < d.v.size(); ++i)
      d.v[i] = i % 5 == 0 ? 65504.0f : std::min(std::fabs(d.v[i]) * 30000.0f, 65504.0f);
    d.dv = std::make_unique<DevBuf>(d.v);
    ModelCache cpu = make(spec, d, false), gpu = make(spec, d, true);
    ASSERT_TRUE(append(cpu, d, false, 0, 160).ok());
    ASSERT_TRUE(append(gpu, d, true, 0, 160).ok());
    {
      std::vector<float> k, v;
      cpu_read(cpu.layer(0), false, 0, 32, DType::kF32, k, v);
      const float top = *std::max_element(v.begin(), v.end());
      ASSERT_GT(top, std::string(spec).rfind("xquant", 0) == 0 ? 63000.0f : 65504.0f);
    }
    const float scale = 1.0f / std::sqrt(128.0f);
    for (int64_t tq : {int64_t{1}, int64_t{16}}) {
      SCOPED_TRACE(tq);
      std::vector<float> ref;
      expect_attend_agrees(cpu.layer(0), gpu.layer(0), d, tq, scale, ref);
    }
  }
}

// Large queries on KIVI's and XQuant's tensor-core decode, which multiplies the query by the key
// scales in fp16: against keys of a wide range (products past 65504 for some rows: the premise
// is checked) and past fp16's range themselves. Rows past the kernel's limit are scaled by a
// power of two (three of the eight rows here; the others keep 2^0); the results stay finite and
// match the CPU backend. Layer 1 of the XQuant caches is a reuse layer (its anchor's codes, its
// own scales; one with a residual). ZipCache's tensor-core decode takes the query past fp16. So
// does the chunk kernel (16 queries), which scales such a row by a power of two too (before, it
// saturated the query to +-65504: the premise checks that this would be wrong here); with wide
// keys it is not asked: it rounds the query and the dequantized keys to fp16 (2^-11 of a score),
// and rows of these scores (~1e6) whose top two lie closer than that are ill-conditioned for it
// (XQuant's here: a relative gap of 1.1e-4, an error of 0.97, as the same rounding on the CPU
// gives).
TEST(CudaAttendRange, LargeQueriesAgainstWideKeysMatchTheCpuBackend) {
  REQUIRE_GPU();
  struct Case {
    const char* spec;
    int bits, layers;
    float q_mul;
  };
  for (const Case& c :
       {Case{"kivi:k_bits=2,v_bits=2,group=32,residual=32", 2, 1, 300.0f},
        Case{"kivi:k_bits=4,v_bits=4,group=32,residual=32", 4, 1, 1500.0f},
        Case{"kivi:k_bits=8,v_bits=8,group=32,residual=32", 8, 1, 20000.0f},
        Case{"xquant:k_bits=2,v_bits=2,group=32,residual=32", 2, 2, 300.0f},
        Case{"xquant:k_bits=2,v_bits=2,res_bits=2,group=32,residual=32", 2, 2, 300.0f},
        // Only a query past fp16 (ZipCache's wide keys: CudaZip.LargeQueries...).
        Case{"zipcache:saliency=norm,group=32,residual=16", 0, 1, 0.0f}}) {
    for (const bool past_fp16 : {false, true}) {
      if (c.bits == 0 && !past_fp16) continue;
      SCOPED_TRACE(std::string(c.spec) + (past_fp16 ? ", a query past fp16" : ", wide keys"));
      Data d(1, 2, 8, 160, 128, 47);
      const float scale = 1.0f / std::sqrt(128.0f), scale_log2 = scale * 1.4426950f;
      // Query heads 0-2 large (rows of the first KV head's warp; 3-7 as they were).
      for (int64_t hq = 0; hq < 3; ++hq)
        for (int64_t i = 0; i < d.S * d.D; ++i)
          d.q[hq * d.S * d.D + i] *= past_fp16 ? 3e6f : c.q_mul;
      if (!past_fp16)
        for (float& x : d.k) x *= 3000.0f;
      // The premise: the last query's largest |q_d * scale_log2 * key scale_d| of a sealed group
      // (the first 128 tokens: a window of 32), or its largest |q_d * scale_log2|, passes 65504.
      double worst = 0.0;
      for (int64_t hq = 0; hq < 3; ++hq)
        for (int64_t dim = 0; dim < d.D; ++dim) {
          const double q = std::fabs(d.q[(hq * d.S + 159) * d.D + dim]) * scale_log2;
          if (past_fp16) {
            worst = std::max(worst, q);
            continue;
          }
          for (int64_t g0 = 0; g0 < 128; g0 += 32) {
            float lo = INFINITY, hi = -INFINITY;
            for (int64_t tok = g0; tok < g0 + 32; ++tok) {
              lo = std::min(lo, d.k[tok * d.D + dim]);  // KV head 0
              hi = std::max(hi, d.k[tok * d.D + dim]);
            }
            worst = std::max(worst, q * (hi - lo) / ((1 << c.bits) - 1));
          }
        }
      ASSERT_GT(worst, 65504.0);
      d.dk = std::make_unique<DevBuf>(d.k);
      d.dq = std::make_unique<DevBuf>(d.q);
      ModelCache cpu = make(c.spec, d, false, c.layers), gpu = make(c.spec, d, true, c.layers);
      ASSERT_TRUE(append(cpu, d, false, 0, 160).ok());
      ASSERT_TRUE(append(gpu, d, true, 0, 160).ok());
      for (int layer = 0; layer < c.layers; ++layer)
        for (const int64_t tq : {int64_t{1}, int64_t{16}}) {
          if (tq > 1 && !past_fp16) continue;
          SCOPED_TRACE(::testing::Message() << "layer " << layer << ", " << tq << " queries");
          std::vector<float> ref;
          expect_attend_agrees(cpu.layer(layer), gpu.layer(layer), d, tq, scale, ref);
          if (past_fp16) {  // the premise: a query saturated to fp16's range would be wrong
            std::vector<float> q_sat = d.q, ref_sat(ref.size());
            const float lim = 65504.0f / scale_log2;
            for (float& x : q_sat) x = std::clamp(x, -lim, lim);
            ASSERT_TRUE(cpu.layer(layer)
                            .attend(TensorView::bhsd(q_sat.data(), DType::kF32, 1, 8, d.S, d.D)
                                        .slice_tokens(160 - tq, tq),
                                    scale,
                                    MutTensorView::bhsd(ref_sat.data(), DType::kF32, 1, 8, tq, 128))
                            .ok());
            ASSERT_GT(row_rel_err(ref_sat, ref, 128), 0.1);
          }
        }
    }
  }
}

// XQuant's reuse layers fit their key scales by least squares on the anchor's codes (the
// default), clamped only to 65504, not bounded by the layer's own range: keys that run against
// the anchor's codes (anchor codes 0, 3 and fifteen each of 1 and 2 per group; reuse keys -6e4
// on codes 0-1, +6e4 on 2-3: a slope of 9e4, clamped) give a 2-bit scale of 65504, so q * s
// passes fp16 for a query of |q * scale * log2 e| = 1.2, which a range-based bound (1.5 at 2
// bits) would not scale. The decode kernel scales every row past 1 and matches the CPU.
TEST(CudaAttendRange, LeastSquaresReuseScalesAgainstModestQueries) {
  REQUIRE_GPU();
  const char* spec = "xquant:k_bits=2,v_bits=2,group=32,residual=32";
  Data d(1, 2, 8, 160, 128, 53);
  const float scale = 1.0f / std::sqrt(128.0f), scale_log2 = scale * 1.4426950f;
  std::vector<float> k0(d.k.size()), k1(d.k.size());
  for (size_t i = 0; i < d.k.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i / 128) % 160 % 32;  // token within its group
    const float a = r == 0 ? 0.0f : r == 1 ? 3.0f : r < 17 ? 1.0f : 2.0f;
    k0[i] = a;
    k1[i] = a >= 2.0f ? 60000.0f : -60000.0f;
  }
  for (int64_t hq = 0; hq < 3; ++hq)  // rows of KV head 0: |q * scale * log2 e| = 1.2
    for (int64_t i = 0; i < d.S * d.D; ++i)
      d.q[hq * d.S * d.D + i] = (d.q[hq * d.S * d.D + i] > 0 ? 1.2f : -1.2f) / scale_log2;
  d.dq = std::make_unique<DevBuf>(d.q);
  const DevBuf dk0(k0), dk1(k1);
  auto kview = [&](bool gpu, int layer) {
    const std::vector<float>& h = layer == 0 ? k0 : k1;
    const DevBuf& dv = layer == 0 ? dk0 : dk1;
    return TensorView::bhsd(gpu ? dv.p : h.data(), DType::kF32, 1, 2, 160, 128,
                            gpu ? kGpu : Device{});
  };
  ModelCache cpu = make(spec, d, false, 2), gpu = make(spec, d, true, 2);
  for (int layer = 0; layer < 2; ++layer) {
    const TensorView qc = d.Q(false, 0, 160), qg = d.Q(true, 0, 160);
    ASSERT_TRUE(cpu.layer(layer).append(kview(false, layer), d.V(false, 0, 160), &qc).ok());
    ASSERT_TRUE(gpu.layer(layer).append(kview(true, layer), d.V(true, 0, 160), &qg).ok());
  }
  std::vector<float> ref;
  expect_attend_agrees(cpu.layer(1), gpu.layer(1), d, 1, scale, ref);
}

// A query beyond fp16's range: both backends keep the probe's query saturated to +-65504 (its
// log-sum-exp stays finite), store the same state, and that state imports again.
TEST(CudaZip, QueriesBeyondFp16Saturate) {
  REQUIRE_GPU();
  Data d(1, 2, 4, 64, 64, 23);
  for (size_t i = 0; i < d.q.size(); i += 97) d.q[i] = (i % 2 ? 1e6f : -3e5f);
  d.dq = std::make_unique<DevBuf>(d.q);
  const char* spec = "zipcache:group=16,residual=16,probe=1";
  ModelCache cpu = make(spec, d, false), gpu = make(spec, d, true);
  ASSERT_TRUE(append(cpu, d, false, 0, 40).ok());
  ASSERT_TRUE(append(gpu, d, true, 0, 40).ok());
  expect_same_state(cpu, gpu, "saturated probes");
  testing::ChunkCollector sink;
  const auto refs = chunk_refs(gpu, sink);
  ModelCache back = make(spec, d, false);
  const Status st = back.layer(0).import_chunks(refs, d.B, 40, DType::kF16);
  EXPECT_TRUE(st.ok()) << st.to_string();
}

// More than the device has: kLimit with a message, and the pool still serves.
TEST(CudaMemory, OutOfMemoryIsAClearError) {
  REQUIRE_GPU();
  cuda::DevicePool pool(0);
  auto huge = pool.alloc(size_t{1} << 50);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), ErrorCode::kLimit);
  EXPECT_NE(huge.status().message().find("out of GPU memory"), std::string::npos);
  EXPECT_FALSE(pool.reserve(size_t{1} << 50).ok());
  auto small = pool.alloc(1000);
  ASSERT_TRUE(small.ok());
  pool.free(*small, 1000);
  auto again = pool.alloc(1000);  // a freed piece is reused
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *small);
  EXPECT_EQ(pool.device_allocations(), 1u);
}

// Methods without GPU kernels are refused at creation, naming the way out.
TEST(CudaMemory, MethodsWithoutKernelsAreRefused) {
  REQUIRE_GPU();
  CacheOptions opt;
  opt.device = kGpu;
  // Methods without kernels, and CacheGen settings whose codes are not KIVI's or whose tables
  // the GPU encoder does not write.
  for (const char* spec : {"turboquant", "cachegen:group=32,chunk=64", "cachegen:values=channel",
                           "cachegen:tables=pooled", "cachegen:group=512,chunk=512"}) {
    auto c = ModelCache::create(spec, ModelShape::uniform(2, 2, 64), opt);
    ASSERT_FALSE(c.ok()) << spec;
    EXPECT_EQ(c.status().code(), ErrorCode::kUnsupported) << spec;
    EXPECT_NE(c.status().message().find("CPU backend"), std::string::npos)
        << c.status().to_string();
  }
  opt.device = Device::cuda(99);
  EXPECT_EQ(ModelCache::create("fp16", ModelShape::uniform(1, 2, 64), opt).status().code(),
            ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvq
