// The .kvq container (docs/format.md): bit-exact round trips for every method in the table,
// streaming writers and readers (incremental bytes, a pipe, a growing file), random access
// through the index, atomic writes, and damaged files of every kind.
#include "kvq/container.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cstring>
#include <random>
#include <thread>

#include "container_util.h"
#include "core/file_io.h"
#include "test_util.h"

namespace kvq {
namespace {

constexpr int64_t B = 2, H = 2, HQ = 4, D = 32, S = 70;
constexpr int kLayers = 3;

ModelShape shape() {
  return ModelShape::uniform(kLayers, H, D, HQ,
                             RopeShape{RopeShape::Mode::kAdjacent, 10000.0, 1.0});
}

struct Data {
  std::vector<std::vector<float>> k, v, q;  // per layer [B, H(q), S, D]
};

Data make_data(uint64_t seed) {
  Data d;
  for (int l = 0; l < kLayers; ++l) {
    d.k.push_back(testing::random_kv(B, H, S, D, seed + 10 * static_cast<uint64_t>(l)));
    d.v.push_back(testing::random_kv(B, H, S, D, seed + 10 * static_cast<uint64_t>(l) + 1));
    d.q.push_back(testing::random_kv(B, HQ, S, D, seed + 10 * static_cast<uint64_t>(l) + 2, 0.3f));
  }
  return d;
}

// Appends tokens [s0, s0 + n) of every layer (as `dtype`, converted from the fp32 data).
Status append_all(ModelCache& c, const Data& d, int64_t s0, int64_t n, DType dtype = DType::kF32,
                  int only_layer = -1) {
  for (int l = 0; l < kLayers; ++l) {
    if (only_layer >= 0 && l != only_layer) continue;
    const size_t L = static_cast<size_t>(l);
    std::vector<uint16_t> k16, v16;
    TensorView k = TensorView::bhsd(d.k[L].data(), DType::kF32, B, H, S, D).slice_tokens(s0, n);
    TensorView v = TensorView::bhsd(d.v[L].data(), DType::kF32, B, H, S, D).slice_tokens(s0, n);
    if (dtype != DType::kF32) {
      k16.resize(d.k[L].size());
      v16.resize(d.v[L].size());
      for (size_t i = 0; i < k16.size(); ++i) {
        k16[i] = dtype == DType::kBF16 ? f32_to_bf16(d.k[L][i]) : f32_to_f16(d.k[L][i]);
        v16[i] = dtype == DType::kBF16 ? f32_to_bf16(d.v[L][i]) : f32_to_f16(d.v[L][i]);
      }
      k = TensorView::bhsd(k16.data(), dtype, B, H, S, D).slice_tokens(s0, n);
      v = TensorView::bhsd(v16.data(), dtype, B, H, S, D).slice_tokens(s0, n);
    }
    const TensorView q =
        TensorView::bhsd(d.q[L].data(), DType::kF32, B, HQ, S, D).slice_tokens(s0, n);
    KVQ_RETURN_IF_ERROR(c.layer(l).append(k, v, &q));
  }
  return ok_status();
}

ModelCache make(const std::string& spec, const LayerOverrides& o = {}) {
  auto c = ModelCache::create(spec, shape(), o);
  if (!c.ok()) {
    ADD_FAILURE() << spec << ": " << c.status().to_string();
    std::abort();
  }
  return std::move(*c);
}

class VectorSink final : public ChunkSink {
 public:
  Status put(const ChunkRef& c) override {
    chunks.push_back({c.kind, c.t0, c.tokens, std::vector<uint8_t>(c.data, c.data + c.size)});
    return ok_status();
  }
  struct Stored {
    ChunkKind kind;
    int64_t t0, tokens;
    std::vector<uint8_t> bytes;
    bool operator==(const Stored& o) const {
      return kind == o.kind && t0 == o.t0 && tokens == o.tokens && bytes == o.bytes;
    }
  };
  std::vector<Stored> chunks;
};

std::vector<VectorSink::Stored> exported(const LayerCache& l) {
  VectorSink s;
  EXPECT_TRUE(l.export_blocks(0, s).ok());
  EXPECT_TRUE(l.export_tail(s).ok());
  return s.chunks;
}

// Everything observable about two caches is identical: spec, shape, serialized state, read(),
// attention outputs, byte accounting.
void expect_identical(const ModelCache& a, const ModelCache& b, const std::string& what) {
  ASSERT_EQ(a.n_layers(), b.n_layers()) << what;
  EXPECT_TRUE(a.spec() == b.spec()) << what;
  for (int l = 0; l < a.n_layers(); ++l) {
    const LayerCache& x = a.layer(l);
    const LayerCache& y = b.layer(l);
    SCOPED_TRACE(what + ", layer " + std::to_string(l));
    EXPECT_TRUE(x.spec() == y.spec());
    EXPECT_EQ(x.offset(), y.offset());
    EXPECT_EQ(x.batch(), y.batch());
    EXPECT_EQ(x.sealed_tokens(), y.sealed_tokens());
    EXPECT_EQ(x.n_blocks(), y.n_blocks());
    EXPECT_EQ(x.window_dtype(), y.window_dtype());
    EXPECT_TRUE(exported(x) == exported(y));
    const CacheBytes bx = x.bytes(), by = y.bytes();
    EXPECT_EQ(bx.key_codes, by.key_codes);
    EXPECT_EQ(bx.value_codes, by.value_codes);
    EXPECT_EQ(bx.params, by.params);
    EXPECT_EQ(bx.residual, by.residual);
    EXPECT_EQ(bx.meta, by.meta);
    EXPECT_EQ(bx.elements, by.elements);
    EXPECT_EQ(x.resident_bytes(), y.resident_bytes());
    if (x.batch() == 0 || x.offset() == 0) continue;
    std::vector<float> kx, vx, ky, vy;
    testing::read_all(x, kx, vx);
    testing::read_all(y, ky, vy);
    EXPECT_EQ(0, std::memcmp(kx.data(), ky.data(), kx.size() * 4));
    EXPECT_EQ(0, std::memcmp(vx.data(), vy.data(), vx.size() * 4));
    // Attention of the next decode query (a loaded cache holds no exact values of sealed
    // tokens, so the newest token's query is the one it can serve; cache.h).
    const int64_t Tq = 1, Dl = x.shape().head_dim;
    const int64_t Hq = x.shape().n_q_heads ? x.shape().n_q_heads : x.shape().n_kv_heads;
    const std::vector<float> q = testing::random_kv(x.batch(), Hq, Tq, Dl, 99, 0.3f);
    std::vector<float> ox(q.size()), oy(q.size());
    const TensorView qv = TensorView::bhsd(q.data(), DType::kF32, x.batch(), Hq, Tq, Dl);
    ASSERT_TRUE(
        x.attend(qv, 0.25f, MutTensorView::bhsd(ox.data(), DType::kF32, x.batch(), Hq, Tq, Dl))
            .ok());
    ASSERT_TRUE(
        y.attend(qv, 0.25f, MutTensorView::bhsd(oy.data(), DType::kF32, x.batch(), Hq, Tq, Dl))
            .ok());
    EXPECT_EQ(0, std::memcmp(ox.data(), oy.data(), ox.size() * 4));
  }
}

ModelCache load_bytes(const std::vector<uint8_t>& f) {
  auto c = parse_cache(f.data(), f.size());
  if (!c.ok()) {
    ADD_FAILURE() << c.status().to_string();
    std::abort();
  }
  return std::move(*c);
}

std::vector<uint8_t> save_bytes(const ModelCache& c, const ContainerAttributes& attrs = {}) {
  auto f = serialize_cache(c, attrs);
  if (!f.ok()) {
    ADD_FAILURE() << f.status().to_string();
    std::abort();
  }
  return std::move(*f);
}

// Feeds `f` to a streaming reader in pieces of random sizes.
Result<ModelCache> stream_bytes(const std::vector<uint8_t>& f, uint64_t seed,
                                int* ready_before_end = nullptr) {
  ContainerReader r;
  std::mt19937_64 rng(seed);
  size_t pos = 0;
  int ready = 0;
  while (pos < f.size()) {
    const size_t n = std::min<size_t>(f.size() - pos, 1 + rng() % 97);
    KVQ_RETURN_IF_ERROR(r.feed(f.data() + pos, n));
    pos += n;
    if (!r.done()) ready = r.layers_ready();
  }
  KVQ_RETURN_IF_ERROR(r.finish());
  if (ready_before_end) *ready_before_end = ready;
  return r.take();
}

std::string tmp_path(const std::string& name) {
  const char* t = std::getenv("TMPDIR");
  return std::string(t ? t : "/tmp") + "/kvq_container_test_" + std::to_string(::getpid()) + "_" +
         name;
}

// ---- round trips, every method ----

class ContainerRoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(ContainerRoundTrip, SaveLoadIsBitExact) {
  const Data d = make_data(3);
  ModelCache c = make(GetParam());
  // Uneven growth: a prefill chunk, then decode tokens; layers end with sealed blocks, a window
  // and (for some methods) state.
  ASSERT_TRUE(append_all(c, d, 0, 37).ok());
  for (int64_t s = 37; s < 57; ++s) ASSERT_TRUE(append_all(c, d, s, 1).ok());
  const auto f = save_bytes(c);
  EXPECT_EQ(f.size() % 64, 0u);
  ModelCache back = load_bytes(f);
  expect_identical(c, back, GetParam());
  // Saving the loaded cache gives the same bytes (the format is a function of the state).
  EXPECT_EQ(save_bytes(back), f);
  // Streaming reader, incremental bytes: the same cache.
  auto streamed = stream_bytes(f, 1);
  ASSERT_TRUE(streamed.ok()) << streamed.status().to_string();
  expect_identical(c, *streamed, GetParam() + " (streamed)");
  // Both continue identically.
  ASSERT_TRUE(append_all(c, d, 57, S - 57).ok());
  ASSERT_TRUE(append_all(back, d, 57, S - 57).ok());
  expect_identical(c, back, GetParam() + " after more tokens");
}

TEST_P(ContainerRoundTrip, EmptyPartialAndBf16Caches) {
  const Data d = make_data(4);
  {
    ModelCache empty = make(GetParam());
    ModelCache back = load_bytes(save_bytes(empty));
    expect_identical(empty, back, "empty");
    ASSERT_TRUE(append_all(back, d, 0, 20).ok());  // a loaded empty cache is usable
  }
  {
    ModelCache partial = make(GetParam());  // only layer 0 received tokens
    ASSERT_TRUE(append_all(partial, d, 0, 33, DType::kF32, 0).ok());
    expect_identical(partial, load_bytes(save_bytes(partial)), "partial");
  }
  {
    ModelCache bf = make(GetParam());
    ASSERT_TRUE(append_all(bf, d, 0, 45, DType::kBF16).ok());
    // q8 rows keep fp16 scales whatever the input's type.
    ASSERT_EQ(bf.layer(0).window_dtype(),
              bf.layer(0).window_format() == WindowFormat::kQ8 ? DType::kF16 : DType::kBF16);
    expect_identical(bf, load_bytes(save_bytes(bf)), "bf16");
  }
  {
    ModelCache trimmed = make(GetParam());  // trimmed back to zero tokens: batch stays fixed
    ASSERT_TRUE(append_all(trimmed, d, 0, 5).ok());
    ASSERT_TRUE(trimmed.trim(5).ok());
    expect_identical(trimmed, load_bytes(save_bytes(trimmed)), "trimmed to 0");
  }
}

TEST_P(ContainerRoundTrip, StreamingWriterAsTheCacheGrows) {
  const Data d = make_data(5);
  ModelCache c = make(GetParam());
  VectorByteSink out;
  auto w = ContainerWriter::start(c, out);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  std::mt19937 rng(7);
  for (int64_t s = 0; s < S;) {
    const int64_t n = std::min<int64_t>(S - s, 1 + static_cast<int64_t>(rng() % 9));
    ASSERT_TRUE(append_all(c, d, s, n).ok());
    ASSERT_TRUE(w->write_new_blocks(c).ok());
    s += n;
  }
  ASSERT_TRUE(w->finish(c).ok());
  EXPECT_EQ(w->bytes_written(), out.bytes.size());
  EXPECT_FALSE(w->write_new_blocks(c).ok());  // finished
  expect_identical(c, load_bytes(out.bytes), "streamed file");
  auto s2 = stream_bytes(out.bytes, 2);
  ASSERT_TRUE(s2.ok()) << s2.status().to_string();
  expect_identical(c, *s2, "streamed file, streaming reader");
  // The index-based reader sees the same chunks.
  auto info = inspect_container(out.bytes.data(), out.bytes.size());
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_TRUE(info->checksums_ok());
  auto view = ContainerView::open(out.bytes.data(), out.bytes.size());
  ASSERT_TRUE(view.ok()) << view.status().to_string();
  ASSERT_EQ(view->chunks().size(), info->chunks.size());
  ModelCache via_view = make(GetParam());
  for (int l = 0; l < kLayers; ++l) {
    std::vector<ChunkRef> refs;
    int64_t batch = 0, offset = 0;
    DType wd = DType::kF16;
    for (size_t i = 0; i < view->chunks().size(); ++i) {
      const ContainerChunk& cc = view->chunks()[i];
      EXPECT_EQ(cc.record_offset, info->chunks[i].record_offset);
      if (cc.layer != l) continue;
      auto ref = view->chunk(i);
      ASSERT_TRUE(ref.ok());
      EXPECT_EQ(static_cast<size_t>(ref->data - out.bytes.data()) % 64, 0u);
      refs.push_back(*ref);
      batch = cc.batch;
      if (cc.kind == ChunkKind::kState) offset = cc.tokens;
      if (cc.kind == ChunkKind::kWindowKeys) wd = cc.dtype;
    }
    ASSERT_TRUE(via_view.layer(l).import_chunks(refs, batch, offset, wd).ok());
  }
  expect_identical(c, via_view, "via the index");
}

TEST_P(ContainerRoundTrip, EveryTruncationAndBitFlipIsAnError) {
  // A small model keeps the file small: every byte is flipped.
  // head_dim 8, or 32 for formats made of blocks of 32 (llama.cpp's).
  int64_t d = 8;
  const RopeShape rope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};
  auto c = ModelCache::create(GetParam(), ModelShape::uniform(2, 1, d, 2, rope));
  if (!c.ok()) c = ModelCache::create(GetParam(), ModelShape::uniform(2, 1, d = 32, 2, rope));
  ASSERT_TRUE(c.ok());
  const std::vector<float> k = testing::random_kv(1, 1, 13, d, 1),
                           v = testing::random_kv(1, 1, 13, d, 2);
  for (int l = 0; l < 2; ++l)
    ASSERT_TRUE(c->layer(l)
                    .append(TensorView::bhsd(k.data(), DType::kF32, 1, 1, 13, d),
                            TensorView::bhsd(v.data(), DType::kF32, 1, 1, 13, d))
                    .ok());
  const auto f = save_bytes(*c);
  for (size_t n = 0; n < f.size(); ++n) {
    auto r = parse_cache(f.data(), n);
    ASSERT_FALSE(r.ok()) << n;
    ASSERT_TRUE(r.status().code() == ErrorCode::kCorrupt || r.status().code() == ErrorCode::kFormat)
        << n;
    ContainerReader sr;
    (void)sr.feed(f.data(), n);
    ASSERT_FALSE(sr.finish().ok()) << n;
  }
  // Every single-bit change of the file is detected (checksums, zero padding, magic, version).
  std::vector<uint8_t> g = f;
  for (size_t i = 0; i < g.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      g[i] ^= static_cast<uint8_t>(1u << bit);
      auto r = parse_cache(g.data(), g.size());
      ASSERT_FALSE(r.ok()) << "byte " << i << " bit " << bit;
      const ErrorCode code = r.status().code();
      ASSERT_TRUE(code == ErrorCode::kCorrupt || code == ErrorCode::kFormat ||
                  code == ErrorCode::kUnsupported)
          << r.status().to_string();
      g[i] ^= static_cast<uint8_t>(1u << bit);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllMethods, ContainerRoundTrip,
                         ::testing::ValuesIn(testing::small_specs()),
                         [](const ::testing::TestParamInfo<std::string>& param_info) {
                           std::string n = param_info.param.substr(0, param_info.param.find(':'));
                           for (auto& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n + "_" + std::to_string(param_info.index);
                         });

// ---- specific behaviour ----

const char* kKivi = "kivi:k_bits=2,v_bits=2,group=4,residual=8";

std::vector<uint8_t> kivi_file(const ContainerAttributes& attrs = {}) {
  const Data d = make_data(8);
  ModelCache c = make(kKivi, {{1, "k_bits=4"}});
  EXPECT_TRUE(append_all(c, d, 0, 30).ok());
  return save_bytes(c, attrs);
}

TEST(Container, OverridesAndAttributesAreStored) {
  const auto f = kivi_file({{"kvq.source", "unit test"}, {"z", ""}});
  auto info = inspect_container(f.data(), f.size());
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->meta.method_spec, "kivi:k_bits=2,v_bits=2,group=4,residual=8");
  ASSERT_EQ(info->meta.overrides.size(), 1u);
  EXPECT_EQ(info->meta.overrides.at(1), "k_bits=4");
  EXPECT_EQ(info->meta.attributes.at("kvq.source"), "unit test");
  EXPECT_EQ(info->meta.attributes.at("z"), "");
  EXPECT_EQ(info->meta.major_version, 1);
  EXPECT_EQ(info->meta.shape.n_layers, kLayers);
  EXPECT_EQ(info->meta.shape.at(2).n_q_heads, HQ);
  ModelCache c = load_bytes(f);
  EXPECT_EQ(c.layer(1).spec().get_int("k_bits"), 4);
  EXPECT_EQ(c.layer(0).spec().get_int("k_bits"), 2);
  EXPECT_FALSE(serialize_cache(c, {{"", "x"}}).ok());
  EXPECT_FALSE(serialize_cache(c, {{"a", std::string("x\0y", 3)}}).ok());
}

TEST(Container, PerLayerShapes) {
  ModelShape s;
  s.n_layers = 2;
  s.per_layer = {LayerShape{2, 16, 4}, LayerShape{1, 8, 0}};
  auto c = ModelCache::create(kKivi, s);
  ASSERT_TRUE(c.ok());
  std::vector<float> k = testing::random_kv(1, 2, 13, 16, 1),
                     v = testing::random_kv(1, 2, 13, 16, 2);
  ASSERT_TRUE(c->layer(0)
                  .append(TensorView::bhsd(k.data(), DType::kF32, 1, 2, 13, 16),
                          TensorView::bhsd(v.data(), DType::kF32, 1, 2, 13, 16))
                  .ok());
  ASSERT_TRUE(c->layer(1)
                  .append(TensorView::bhsd(k.data(), DType::kF32, 1, 1, 13, 8),
                          TensorView::bhsd(v.data(), DType::kF32, 1, 1, 13, 8))
                  .ok());
  ModelCache back = load_bytes(save_bytes(*c));
  ASSERT_EQ(back.shape().per_layer.size(), 2u);
  EXPECT_EQ(back.shape().at(1).head_dim, 8);
  EXPECT_EQ(back.shape().at(1).n_q_heads, 0);
  expect_identical(*c, back, "per-layer shapes");
}

TEST(Container, DeterministicOutput) { EXPECT_EQ(kivi_file(), kivi_file()); }

TEST(Container, SaveIsAtomic) {
  const std::string path = tmp_path("atomic.kvq");
  const Data d = make_data(9);
  ModelCache c = make(kKivi);
  ASSERT_TRUE(append_all(c, d, 0, 25).ok());
  ASSERT_TRUE(save_cache(c, path).ok());
  auto good = read_file(path);
  ASSERT_TRUE(good.ok());
  {  // A stream abandoned half way (e.g. the process fails) leaves the good file untouched.
    auto sink = AtomicFileByteSink::open(path);
    ASSERT_TRUE(sink.ok());
    auto w = ContainerWriter::start(c, **sink);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->write_new_blocks(c).ok());
  }
  auto after = read_file(path);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*after, *good);
  // A failed save (bad attributes) changes nothing either.
  EXPECT_FALSE(save_cache(c, path, {{"", ""}}).ok());
  EXPECT_EQ(*read_file(path), *good);
  // No temporary files are left behind.
  const std::string dir = path.substr(0, path.rfind('/'));
  const std::string base = path.substr(path.rfind('/') + 1);
  DIR* dp = ::opendir(dir.c_str());
  ASSERT_NE(dp, nullptr);
  int leftovers = 0;
  while (dirent* e = ::readdir(dp))
    if (std::string(e->d_name).rfind(base + ".tmp", 0) == 0) ++leftovers;
  ::closedir(dp);
  EXPECT_EQ(leftovers, 0);
  auto loaded = load_cache(path);
  ASSERT_TRUE(loaded.ok());
  expect_identical(c, *loaded, "saved file");
  EXPECT_EQ(load_cache(path + ".missing").status().code(), ErrorCode::kIo);
  ::unlink(path.c_str());
}

TEST(Container, WriterRefusesTakingChunksBack) {
  const Data d = make_data(10);
  ModelCache c = make(kKivi);
  VectorByteSink out;
  auto w = ContainerWriter::start(c, out);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(append_all(c, d, 0, 40).ok());
  ASSERT_TRUE(w->write_new_blocks(c).ok());
  ASSERT_TRUE(c.trim(30).ok());  // reaches into streamed blocks
  EXPECT_EQ(w->write_new_blocks(c).code(), ErrorCode::kInvalidArgument);
  ModelCache other = make("fp16");
  auto w2 = ContainerWriter::start(c, out);
  ASSERT_TRUE(w2.ok());
  EXPECT_EQ(w2->write_new_blocks(other).code(), ErrorCode::kInvalidArgument);
}

TEST(Container, StreamThroughAPipe) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const Data d = make_data(11);
  ModelCache c = make(kKivi);
  std::thread writer([&] {
    FdByteSink out(fds[1]);
    auto w = ContainerWriter::start(c, out);
    ASSERT_TRUE(w.ok());
    for (int64_t s = 0; s < S; s += 10) {
      ASSERT_TRUE(append_all(c, d, s, std::min<int64_t>(10, S - s)).ok());
      ASSERT_TRUE(w->write_new_blocks(c).ok());
    }
    ASSERT_TRUE(w->finish(c).ok());
    ::close(fds[1]);
  });
  auto r = read_container_fd(fds[0]);
  writer.join();
  ::close(fds[0]);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_NE(r->meta(), nullptr);
  EXPECT_EQ(r->meta()->method_spec, "kivi:k_bits=2,v_bits=2,group=4,residual=8");
  EXPECT_EQ(r->layers_ready(), kLayers);
  auto back = r->take();
  ASSERT_TRUE(back.ok());
  expect_identical(c, *back, "pipe");
  EXPECT_FALSE(r->take().ok());
}

TEST(Container, FollowAGrowingFile) {
  const std::string path = tmp_path("growing.kvq");
  const int wfd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(wfd, 0);
  const int rfd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(rfd, 0);
  const Data d = make_data(12);
  ModelCache c = make(kKivi);
  std::thread writer([&] {
    FdByteSink out(wfd);
    auto w = ContainerWriter::start(c, out);
    ASSERT_TRUE(w.ok());
    for (int64_t s = 0; s < S; s += 7) {
      ASSERT_TRUE(append_all(c, d, s, std::min<int64_t>(7, S - s)).ok());
      ASSERT_TRUE(w->write_new_blocks(c).ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
    }
    ASSERT_TRUE(w->finish(c).ok());
  });
  ReadFdOptions o;
  o.follow = true;
  auto r = read_container_fd(rfd, o);
  writer.join();
  ::close(wfd);
  ::close(rfd);
  ::unlink(path.c_str());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  auto back = r->take();
  ASSERT_TRUE(back.ok());
  expect_identical(c, *back, "growing file");
}

TEST(Container, FollowGivesUpOnAStalledFile) {
  const std::string path = tmp_path("stalled.kvq");
  auto f = kivi_file();
  f.resize(f.size() / 2);
  ASSERT_TRUE(write_file_atomic(path, f.data(), f.size()).ok());
  const int fd = ::open(path.c_str(), O_RDONLY);
  ReadFdOptions o;
  o.follow = true;
  o.idle_timeout_ms = 50;
  auto r = read_container_fd(fd, o);
  ::close(fd);
  ::unlink(path.c_str());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kCorrupt);
  EXPECT_NE(r.status().message().find("truncated"), std::string::npos);
}

TEST(Container, LayersBecomeReadyBeforeTheEnd) {
  // save_cache writes layer 0's tail before layer 1's blocks' tails...: with all tails at the
  // end, layers complete one after the other before INDX/END arrive.
  const auto f = kivi_file();
  int ready = 0;
  auto r = stream_bytes(f, 3, &ready);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(ready, kLayers);  // every layer was built before the END record arrived
}

// ---- damaged files: specific errors ----

Status parse_status(const std::vector<uint8_t>& f, const ContainerLimits& limits = {}) {
  auto r = parse_cache(f.data(), f.size(), limits);
  Status st = r.ok() ? ok_status() : r.status();
  // The streaming reader and the inspector agree with the loader on valid vs invalid.
  ContainerReader sr(limits);
  Status ss = sr.feed(f.data(), f.size());
  if (ss.ok()) ss = sr.finish();
  EXPECT_EQ(ss.code(), st.code()) << "stream: " << ss.to_string() << " / whole: " << st.to_string();
  return st;
}

TEST(ContainerErrors, WrongMagicAndVersion) {
  auto f = kivi_file();
  auto g = f;
  g[1] = 'X';
  EXPECT_EQ(parse_status(g).code(), ErrorCode::kFormat);
  g = {'h', 'e', 'l', 'l', 'o'};
  EXPECT_EQ(parse_status(g).code(), ErrorCode::kFormat);
  g = f;
  testing::put<uint16_t>(g.data() + 8, 2);
  testing::rehash_file_header(g.data());
  Status st = parse_status(g);
  EXPECT_EQ(st.code(), ErrorCode::kUnsupported);
  EXPECT_NE(st.message().find("format version 2.0"), std::string::npos) << st.message();
  g = f;
  testing::put<uint16_t>(g.data() + 10, 7);  // a newer minor version reads fine
  testing::rehash_file_header(g.data());
  EXPECT_TRUE(parse_status(g).ok());
  g = f;
  g[20] = 1;  // reserved byte without a fresh checksum
  EXPECT_EQ(parse_status(g).code(), ErrorCode::kCorrupt);
}

TEST(ContainerErrors, UnknownMethodIsNamed) {
  auto raw = testing::split_file(kivi_file());
  testing::set_meta_spec(raw, "zipzap:bits=3");
  Status st = parse_status(testing::join_file(raw));
  EXPECT_EQ(st.code(), ErrorCode::kUnsupported);
  EXPECT_NE(st.message().find("'zipzap'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("kivi"), std::string::npos) << st.message();
  // A known method with a parameter this kvq does not know.
  raw = testing::split_file(kivi_file());
  testing::set_meta_spec(raw, "kivi:k_bits=2,newparam=1");
  st = parse_status(testing::join_file(raw));
  EXPECT_EQ(st.code(), ErrorCode::kUnsupported);
  EXPECT_NE(st.message().find("newparam"), std::string::npos) << st.message();
}

TEST(ContainerErrors, LyingAndHugeLengths) {
  const auto f = kivi_file();
  auto raw = testing::split_file(f);
  const int chunk = raw.find("CHNK");
  const size_t off = testing::record_offset(raw, chunk);
  auto g = f;
  testing::put<uint64_t>(g.data() + off + 8, f.size());  // runs past the end
  testing::rehash_record_header(g.data() + off);
  EXPECT_EQ(parse_status(g).code(), ErrorCode::kCorrupt);
  g = f;
  testing::put<uint64_t>(g.data() + off + 8, uint64_t{1} << 62);
  testing::rehash_record_header(g.data() + off);
  EXPECT_EQ(parse_status(g).code(), ErrorCode::kLimit);
  g = f;
  testing::put<uint64_t>(g.data() + 64 + 8, uint64_t{1} << 30);  // META beyond 16 MiB
  testing::rehash_record_header(g.data() + 64);
  EXPECT_EQ(parse_status(g).code(), ErrorCode::kLimit);
  g = f;
  testing::put<uint64_t>(g.data() + off + 8,
                         testing::get<uint64_t>(g.data() + off + 8) + 64);  // a lie within the file
  testing::rehash_record_header(g.data() + off);
  EXPECT_EQ(parse_status(g).code(), ErrorCode::kCorrupt);
  // Counts in the metadata.
  raw = testing::split_file(f);
  testing::put<uint32_t>(raw.records[0].payload.data(), 100000);
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kCorrupt);
  raw = testing::split_file(f);
  testing::put<uint32_t>(raw.records[0].payload.data() + 16, 0x7fffffff);  // version string length
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kCorrupt);
  // Batch and token counts.
  raw = testing::split_file(f);
  testing::put<uint64_t>(raw.records[static_cast<size_t>(chunk)].fields.data() + 24,
                         uint64_t{1} << 40);
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kCorrupt);
  raw = testing::split_file(f);
  testing::put<uint64_t>(raw.records[static_cast<size_t>(chunk)].fields.data() + 16,
                         uint64_t{1} << 40);
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kCorrupt);
  // A window that claims a huge batch (all other fields consistent): the size check catches it.
  raw = testing::split_file(f);
  for (auto& rec : raw.records)
    if (rec.type == testing::fourcc("CHNK") && testing::get<uint32_t>(rec.fields.data()) == 0)
      testing::put<uint64_t>(rec.fields.data() + 24, 65536);
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kCorrupt);
}

TEST(ContainerErrors, Limits) {
  const auto f = kivi_file();
  ContainerLimits small;
  small.max_elements = 1000;
  EXPECT_EQ(parse_status(f, small).code(), ErrorCode::kLimit);
  small = {};
  small.max_record_bytes = 100;
  EXPECT_EQ(parse_status(f, small).code(), ErrorCode::kLimit);
  small = {};
  small.max_stream_bytes = 1000;
  ContainerReader r(small);
  EXPECT_EQ(r.feed(f.data(), f.size()).code(), ErrorCode::kLimit);
  EXPECT_EQ(r.finish().code(), ErrorCode::kLimit);  // sticky
}

TEST(ContainerErrors, RecordsAndOrder) {
  const auto f = kivi_file();
  // An unknown optional record is skipped; an unknown required one is an error naming it.
  auto raw = testing::split_file(f);
  testing::RawRecord extra;
  extra.type = testing::fourcc("XTRA");
  extra.flags = 1;
  extra.payload = {1, 2, 3};
  raw.records.insert(raw.records.begin() + 2, extra);
  auto g = testing::join_file(raw);
  EXPECT_TRUE(parse_status(g).ok());
  auto info = inspect_container(g.data(), g.size());
  ASSERT_TRUE(info.ok());
  ASSERT_EQ(info->skipped.size(), 1u);
  EXPECT_EQ(info->skipped[0].substr(0, 4), "XTRA");
  EXPECT_TRUE(ContainerView::open(g.data(), g.size()).ok());
  raw.records[2].flags = 0;
  Status st = parse_status(testing::join_file(raw));
  EXPECT_EQ(st.code(), ErrorCode::kUnsupported);
  EXPECT_NE(st.message().find("'XTRA'"), std::string::npos);
  // Swapped chunks, a missing chunk, a duplicated META, chunks after the index.
  raw = testing::split_file(f);
  std::swap(raw.records[1], raw.records[2]);
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kCorrupt);
  raw = testing::split_file(f);
  raw.records.erase(raw.records.begin() + 1);
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kCorrupt);
  raw = testing::split_file(f);
  raw.records.insert(raw.records.begin() + 1, raw.records[0]);
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kFormat);
  raw = testing::split_file(f);
  std::swap(raw.records[0], raw.records[1]);
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kFormat);
  raw = testing::split_file(f);
  const int idx = raw.find("INDX");
  std::swap(raw.records[static_cast<size_t>(idx)], raw.records[static_cast<size_t>(idx - 1)]);
  EXPECT_FALSE(parse_status(testing::join_file(raw)).ok());
  // An index that disagrees with its records; an END that lies.
  raw = testing::split_file(f);
  raw.records[static_cast<size_t>(idx)].payload[16] ^= 1;
  EXPECT_EQ(parse_status(testing::join_file(raw, false)).code(), ErrorCode::kCorrupt);
  raw = testing::split_file(f);
  raw.records.back().fields[8] ^= 1;
  EXPECT_EQ(parse_status(testing::join_file(raw, false)).code(), ErrorCode::kCorrupt);
  // Trailing bytes.
  g = f;
  g.push_back(0);
  EXPECT_EQ(parse_status(g).code(), ErrorCode::kCorrupt);
  // Unknown chunk kind.
  raw = testing::split_file(f);
  raw.records[1].fields[4] = 9;
  EXPECT_EQ(parse_status(testing::join_file(raw)).code(), ErrorCode::kUnsupported);
  // Method-level damage with valid checksums: a NaN scale in a kivi block.
  raw = testing::split_file(f);
  auto& bk = raw.records[1].payload;
  ASSERT_EQ(raw.records[1].fields[4], 0);  // block keys
  bk[bk.size() - 3] = 0xff;                // the last (scale, zero) pair's scale high byte: NaN
  bk[bk.size() - 4] = 0xff;
  st = parse_status(testing::join_file(raw));
  EXPECT_EQ(st.code(), ErrorCode::kCorrupt);
  EXPECT_NE(st.message().find("layer 0"), std::string::npos) << st.message();
}

TEST(ContainerErrors, InspectReportsBadChecksumsWithoutFailing) {
  auto f = kivi_file();
  auto raw = testing::split_file(f);
  const size_t off = testing::record_offset(raw, 1);
  f[off + 64 + 2] ^= 0x10;  // a payload byte of the first chunk
  auto info = inspect_container(f.data(), f.size());
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_FALSE(info->checksums_ok());
  EXPECT_FALSE(info->chunks[0].checksum_ok);
  EXPECT_TRUE(info->chunks[1].checksum_ok);
  EXPECT_EQ(parse_status(f).code(), ErrorCode::kCorrupt);
  auto view = ContainerView::open(f.data(), f.size());
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->chunk(0).status().code(), ErrorCode::kCorrupt);
  EXPECT_TRUE(view->chunk(1).ok());
}

TEST(ContainerErrors, ViewChecksTheIndex) {
  const auto f = kivi_file();
  EXPECT_TRUE(ContainerView::open(f.data(), f.size()).ok());
  for (size_t n : {size_t{0}, size_t{64}, f.size() - 64, f.size() - 1}) {
    auto v = ContainerView::open(f.data(), n);
    EXPECT_FALSE(v.ok()) << n;
  }
  auto raw = testing::split_file(f);
  const int idx = raw.find("INDX");
  testing::put<uint64_t>(raw.records[static_cast<size_t>(idx)].payload.data(),
                         64);  // points at META
  auto g = testing::join_file(raw, false);
  EXPECT_EQ(ContainerView::open(g.data(), g.size()).status().code(), ErrorCode::kCorrupt);
}

}  // namespace
}  // namespace kvq
