// GGUF reader: metadata, every dequantizer against gguf-py's reference values, and malformed
// files (truncated, bit-flipped, hand-built bad headers) that must give errors, never crashes.
#include "model/gguf.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/byte_io.h"

namespace kvq::gguf {
namespace {

std::string data_path(const std::string& name) {
  return std::string(KVQ_SOURCE_DIR) + "/tests/data/" + name;
}

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

TEST(Gguf, MetadataOfEveryType) {
  auto f = File::open(data_path("gguf_types.gguf"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(*f->get_uint("test.u8"), 200u);
  EXPECT_EQ(*f->get_int("test.i8"), -100);
  EXPECT_EQ(*f->get_uint("test.u16"), 60000u);
  EXPECT_EQ(*f->get_int("test.i16"), -30000);
  EXPECT_EQ(*f->get_uint("test.u32"), 4000000000u);
  EXPECT_EQ(*f->get_int("test.i32"), -2000000000);
  EXPECT_EQ(*f->get_float("test.f32"), 0.125);
  EXPECT_EQ(*f->get_uint("test.u64"), uint64_t{1} << 40);
  EXPECT_EQ(*f->get_int("test.i64"), -(int64_t{1} << 40));
  EXPECT_EQ(*f->get_float("test.f64"), 1e-300);
  EXPECT_TRUE(*f->get_bool("test.bool"));
  EXPECT_EQ(*f->get_string("test.string"), "h\xc3\xa9llo w\xc3\xb6rld");
  EXPECT_EQ(**f->get_int_array("test.ints"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(**f->get_float_array("test.floats"), (std::vector<double>{0.5, -1.5}));
  EXPECT_EQ(**f->get_string_array("test.strings"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(*f->get_string("general.architecture"), "kvqtest");

  // Wrong types and missing keys are errors with the key's name, not crashes.
  EXPECT_EQ(f->get_int("test.string").status().code(), ErrorCode::kFormat);
  EXPECT_EQ(f->get_uint("test.i8").status().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(f->get_bool("test.u8").status().code(), ErrorCode::kFormat);
  EXPECT_EQ(f->get_string_array("test.ints").status().code(), ErrorCode::kFormat);
  auto missing = f->get_int("no.such.key");
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no.such.key"), std::string::npos);
}

// Every dequantizer matches gguf-py's (the format's reference Python package) bit for bit.
TEST(Gguf, DequantizersMatchReference) {
  auto f = File::open(data_path("gguf_types.gguf"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  int checked = 0;
  for (const char* type :
       {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}) {
    SCOPED_TRACE(type);
    const std::string name = std::string("t.") + type;
    const TensorInfo* ti = f->find_tensor(name);
    ASSERT_NE(ti, nullptr);
    EXPECT_EQ(tensor_type_name(ti->type), type);
    EXPECT_EQ(ti->dims, (std::vector<int64_t>{512, 2}));
    std::vector<float> got, ref;
    ASSERT_TRUE(f->read_f32(name, {512, 2}, &got).ok());
    ASSERT_TRUE(f->read_f32(name + ".ref", {}, &ref).ok());
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], ref[i]) << "element " << i;
    ++checked;
  }
  EXPECT_EQ(checked, 11);
  std::vector<float> out;
  EXPECT_EQ(f->read_f32("t.Q4_1", {2, 512}, &out).code(), ErrorCode::kShapeMismatch);
  EXPECT_EQ(f->read_f32("t.nope", {}, &out).code(), ErrorCode::kNotFound);
}

TEST(Gguf, MissingFileIsIoError) {
  auto f = File::open(data_path("does_not_exist.gguf"));
  EXPECT_EQ(f.status().code(), ErrorCode::kIo);
}

// Dequantizes every tensor the parser accepted: if parse() vouched for the byte ranges, reading
// them must stay inside the buffer (ASan builds check this).
void read_everything(const File& f) {
  std::vector<float> out;
  for (const auto& t : f.tensors()) {
    if (tensor_type_supported(t.type) && t.n_elements <= (1 << 20)) {
      EXPECT_TRUE(f.read_f32(t.name, {}, &out).ok());
    }
  }
}

TEST(Gguf, EveryTruncationIsAnError) {
  const std::vector<uint8_t> bytes = read_all(data_path("gguf_types.gguf"));
  ASSERT_GT(bytes.size(), 1000u);
  auto whole = File::parse(bytes.data(), bytes.size());
  ASSERT_TRUE(whole.ok()) << whole.status().to_string();
  read_everything(*whole);
  size_t end = 0;  // where the last tensor's bytes end (padding may follow)
  for (const auto& t : whole->tensors())
    end =
        std::max(end, static_cast<size_t>(t.data - bytes.data()) + static_cast<size_t>(t.n_bytes));
  // Every prefix shorter than that lacks something the header promises.
  for (size_t n = 0; n < end; n += (n < 4096 ? 1 : 97)) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(n));
    auto f = File::parse(cut.data(), cut.size());
    ASSERT_FALSE(f.ok()) << "prefix of " << n << " bytes parsed";
    ASSERT_FALSE(f.status().message().empty());
  }
}

TEST(Gguf, BitFlipsNeverCrash) {
  const std::vector<uint8_t> bytes = read_all(data_path("gguf_types.gguf"));
  std::mt19937 rng(7);
  // The metadata and tensor directory sit in the first ~2 KB; flip bytes there.
  const size_t header = 2048;
  int accepted = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> b = bytes;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < flips; ++i) {
      const size_t pos = rng() % header;
      b[pos] = static_cast<uint8_t>(trial % 2 ? rng() : b[pos] ^ (1u << (rng() % 8)));
    }
    auto f = File::parse(b.data(), b.size());
    if (f.ok()) {
      ++accepted;
      read_everything(*f);
    } else {
      ASSERT_FALSE(f.status().message().empty());
    }
  }
  // Flips inside string bytes or values are legal files; most flips must still be caught.
  EXPECT_LT(accepted, 3000);
}

// Hand-built files for each structural error.
struct Builder {
  std::vector<uint8_t> out;
  ByteWriter w{out};
  void str(const std::string& s) {
    w.u64(s.size());
    w.bytes(s.data(), s.size());
  }
  void header(uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    w.bytes("GGUF", 4);
    w.u32(version);
    w.u64(n_tensors);
    w.u64(n_kv);
  }
  void kv_u32(const std::string& k, uint32_t v) {
    str(k);
    w.u32(4);
    w.u32(v);
  }
  void tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type, uint64_t off) {
    str(name);
    w.u32(static_cast<uint32_t>(dims.size()));
    for (auto d : dims) w.u64(d);
    w.u32(type);
    w.u64(off);
  }
  void pad(size_t align) {
    while (out.size() % align) w.u8(0);
  }
};

Status parse_status(const Builder& b) {
  auto f = File::parse(b.out.data(), b.out.size());
  return f.ok() ? ok_status() : f.status();
}

TEST(Gguf, StructuralErrors) {
  {
    Builder b;
    b.w.bytes("GGML", 4);
    b.w.u32(3);
    EXPECT_EQ(parse_status(b).code(), ErrorCode::kFormat);
  }
  {
    Builder b;
    b.header(1, 0, 0);
    EXPECT_EQ(parse_status(b).code(), ErrorCode::kUnsupported);
  }
  {
    Builder b;
    b.header(3, 0, 0);  // an empty but valid file
    EXPECT_TRUE(parse_status(b).ok());
  }
  {
    Builder b;  // counts far beyond the bytes present: refused before allocating
    b.header(3, 1000, uint64_t{1} << 19);
    EXPECT_EQ(parse_status(b).code(), ErrorCode::kFormat);
    Builder c;
    c.header(3, uint64_t{1} << 62, 0);
    EXPECT_EQ(parse_status(c).code(), ErrorCode::kLimit);
  }
  {
    Builder b;  // a string length of 2^60
    b.header(3, 0, 1);
    b.w.u64(uint64_t{1} << 60);
    b.w.zeros(64);
    EXPECT_EQ(parse_status(b).code(), ErrorCode::kLimit);
  }
  {
    Builder b;  // an array claiming 2^40 u32 elements
    b.header(3, 0, 1);
    b.str("a");
    b.w.u32(9);
    b.w.u32(4);
    b.w.u64(uint64_t{1} << 40);
    b.w.zeros(64);
    EXPECT_EQ(parse_status(b).code(), ErrorCode::kFormat);
  }
  {
    Builder b;  // unknown value type
    b.header(3, 0, 1);
    b.str("a");
    b.w.u32(99);
    b.w.zeros(8);
    EXPECT_EQ(parse_status(b).code(), ErrorCode::kFormat);
  }
  {
    Builder b;  // duplicate key
    b.header(3, 0, 2);
    b.kv_u32("a", 1);
    b.kv_u32("a", 2);
    EXPECT_EQ(parse_status(b).code(), ErrorCode::kCorrupt);
  }
  {
    Builder b;  // bad alignment
    b.header(3, 0, 1);
    b.kv_u32("general.alignment", 48);
    EXPECT_EQ(parse_status(b).code(), ErrorCode::kFormat);
  }
  auto one_tensor = [](std::vector<uint64_t> dims, uint32_t type, uint64_t off, size_t data) {
    Builder b;
    b.header(3, 1, 0);
    b.tensor("w", std::move(dims), type, off);
    b.pad(32);
    b.w.zeros(data);
    return parse_status(b);
  };
  EXPECT_TRUE(one_tensor({32, 2}, 3, 0, 40).ok());                               // Q4_1, exact
  EXPECT_EQ(one_tensor({32, 2}, 3, 0, 39).code(), ErrorCode::kFormat);           // 1 byte short
  EXPECT_EQ(one_tensor({32, 2}, 3, 32, 40).code(), ErrorCode::kFormat);          // past the end
  EXPECT_EQ(one_tensor({32, 2}, 3, 8, 80).code(), ErrorCode::kFormat);           // misaligned
  EXPECT_EQ(one_tensor({33, 2}, 3, 0, 80).code(), ErrorCode::kFormat);           // not whole blocks
  EXPECT_EQ(one_tensor({32, 0}, 0, 0, 80).code(), ErrorCode::kFormat);           // zero dim
  EXPECT_EQ(one_tensor({1, 1, 1, 1, 1}, 0, 0, 80).code(), ErrorCode::kFormat);   // 5 dims
  EXPECT_EQ(one_tensor({32}, 77, 0, 80).code(), ErrorCode::kUnsupported);        // unknown type
  EXPECT_EQ(one_tensor({uint64_t{1} << 39, uint64_t{1} << 39}, 0, 0, 8).code(),  // overflow
            ErrorCode::kFormat);
  {
    Builder b;  // duplicate tensor names
    b.header(3, 2, 0);
    b.tensor("w", {4}, 0, 0);
    b.tensor("w", {4}, 0, 32);
    b.pad(32);
    b.w.zeros(64);
    EXPECT_EQ(parse_status(b).code(), ErrorCode::kCorrupt);
  }
  {
    // A valid tensor of a type without a dequantizer is listed, and reading it is kUnsupported.
    Builder b;
    b.header(3, 1, 0);
    b.tensor("w", {256}, 10 /* Q2_K */, 0);
    b.pad(32);
    b.w.zeros(84);
    auto f = File::parse(b.out.data(), b.out.size());
    ASSERT_TRUE(f.ok());
    std::vector<float> out;
    EXPECT_EQ(f->read_f32("w", {}, &out).code(), ErrorCode::kUnsupported);
  }
}

}  // namespace
}  // namespace kvq::gguf
