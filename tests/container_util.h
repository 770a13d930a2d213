// Test helpers for the .kvq container: a second, independent reading of docs/format.md that takes
// files apart into records and puts them back together with fresh checksums, index and END
// record — so tests can build files that are damaged in exactly one way.
#pragma once

#include <xxhash.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvq/cache.h"

namespace kvq::testing {

inline uint32_t fourcc(const char* s) {
  uint32_t v;
  std::memcpy(&v, s, 4);
  return v;
}
template <class T>
inline void put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
inline T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline size_t padded(size_t n) { return (n + 63) / 64 * 64; }

struct RawRecord {
  uint32_t type = 0, flags = 0;
  std::array<uint8_t, 32> fields{};
  std::vector<uint8_t> payload;
};

struct RawFile {
  std::array<uint8_t, 64> header{};
  std::vector<RawRecord> records;
  // Index of the first record of a type (-1 if none).
  int find(const char* type, int nth = 0) const {
    for (size_t i = 0; i < records.size(); ++i)
      if (records[i].type == fourcc(type) && nth-- == 0) return static_cast<int>(i);
    return -1;
  }
};

// Splits a well-formed file into its header and records.
inline RawFile split_file(const std::vector<uint8_t>& f) {
  RawFile r;
  std::memcpy(r.header.data(), f.data(), 64);
  size_t pos = 64;
  while (pos + 64 <= f.size()) {
    RawRecord rec;
    rec.type = get<uint32_t>(&f[pos]);
    rec.flags = get<uint32_t>(&f[pos + 4]);
    const uint64_t n = get<uint64_t>(&f[pos + 8]);
    std::memcpy(rec.fields.data(), &f[pos + 24], 32);
    rec.payload.assign(f.begin() + static_cast<std::ptrdiff_t>(pos + 64),
                       f.begin() + static_cast<std::ptrdiff_t>(pos + 64 + n));
    pos += 64 + padded(n);
    r.records.push_back(std::move(rec));
  }
  return r;
}

inline void rehash_file_header(uint8_t* h) { put<uint64_t>(h + 56, XXH64(h, 56, 0)); }
inline void rehash_record_header(uint8_t* h) { put<uint64_t>(h + 56, XXH64(h, 56, 0)); }

// Joins records with fresh checksums. With fix_index, the INDX payload and the END fields are
// recomputed from the CHNK records, so that the only damage is the one the test made.
inline std::vector<uint8_t> join_file(RawFile f, bool fix_index = true) {
  if (fix_index) {
    std::vector<uint8_t> index;
    size_t pos = 64, n = 0, index_pos = 0;
    for (auto& rec : f.records) {
      if (rec.type == fourcc("CHNK")) {
        uint8_t e[48] = {};
        put<uint64_t>(e, pos);
        std::memcpy(e + 8, rec.fields.data(), 4);        // layer
        e[12] = rec.fields[4];                           // kind
        e[13] = rec.fields[5];                           // dtype
        std::memcpy(e + 16, rec.fields.data() + 8, 16);  // t0, tokens
        put<uint64_t>(e + 32, rec.payload.size());
        put<uint64_t>(e + 40, XXH64(rec.payload.data(), rec.payload.size(), 0));
        index.insert(index.end(), e, e + 48);
        ++n;
      }
      if (rec.type == fourcc("INDX")) {
        rec.payload = index;
        put<uint64_t>(rec.fields.data(), n);
        index_pos = pos;
      }
      if (rec.type == fourcc("END ")) {
        put<uint64_t>(rec.fields.data(), index_pos);
        put<uint64_t>(rec.fields.data() + 8, n);
        put<uint64_t>(rec.fields.data() + 16, pos + 64);
      }
      pos += 64 + padded(rec.payload.size());
    }
  }
  std::vector<uint8_t> out(f.header.begin(), f.header.end());
  rehash_file_header(out.data());
  for (const auto& rec : f.records) {
    uint8_t h[64] = {};
    put<uint32_t>(h, rec.type);
    put<uint32_t>(h + 4, rec.flags);
    put<uint64_t>(h + 8, rec.payload.size());
    put<uint64_t>(h + 16, XXH64(rec.payload.data(), rec.payload.size(), 0));
    std::memcpy(h + 24, rec.fields.data(), 32);
    rehash_record_header(h);
    out.insert(out.end(), h, h + 64);
    out.insert(out.end(), rec.payload.begin(), rec.payload.end());
    out.resize(padded(out.size()), 0);
  }
  return out;
}

// File offset of record i of a joined file.
inline size_t record_offset(const RawFile& f, int i) {
  size_t pos = 64;
  for (int j = 0; j < i; ++j) pos += 64 + padded(f.records[static_cast<size_t>(j)].payload.size());
  return pos;
}

// Replaces the method spec string in a META payload (docs/format.md §3.1).
inline void set_meta_spec(RawFile& f, const std::string& spec) {
  auto& meta = f.records[0].payload;
  const size_t at = 20 + get<uint32_t>(meta.data() + 16);
  const uint32_t old = get<uint32_t>(meta.data() + at);
  meta.erase(meta.begin() + static_cast<std::ptrdiff_t>(at + 4),
             meta.begin() + static_cast<std::ptrdiff_t>(at + 4 + old));
  meta.insert(meta.begin() + static_cast<std::ptrdiff_t>(at + 4), spec.begin(), spec.end());
  put<uint32_t>(meta.data() + at, static_cast<uint32_t>(spec.size()));
}

// Deterministic K/V values (a splitmix64 stream; the same on every platform, unlike
// std::normal_distribution), with per-channel offsets like real keys.
inline std::vector<float> golden_values(size_t n, int64_t dim, uint64_t seed) {
  std::vector<float> x(n);
  uint64_t s = seed;
  auto next = [&s] {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (size_t i = 0; i < n; ++i) {
    const double u = static_cast<double>(next() >> 11) / 9007199254740992.0;  // [0, 1)
    const double chan = static_cast<double>((i % static_cast<size_t>(dim)) % 5) - 2.0;
    x[i] = static_cast<float>((u * 4.0 - 2.0) + chan);
  }
  return x;
}

// K/V digest of a cache: XXH64 over every layer's read() output (fp32 K then V) and offsets.
inline uint64_t cache_digest(const ModelCache& c) {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  for (int l = 0; l < c.n_layers(); ++l) {
    const LayerCache& L = c.layer(l);
    const int64_t B = L.batch(), H = L.shape().n_kv_heads, S = L.offset(), D = L.shape().head_dim;
    const int64_t hdr[4] = {B, H, S, D};
    XXH64_update(st, hdr, sizeof hdr);
    if (B == 0 || S == 0) continue;
    std::vector<float> k(static_cast<size_t>(B * H * S * D)), v(k.size());
    if (!L.read(0, S, MutTensorView::bhsd(k.data(), DType::kF32, B, H, S, D),
                MutTensorView::bhsd(v.data(), DType::kF32, B, H, S, D))
             .ok())
      std::abort();
    XXH64_update(st, k.data(), k.size() * 4);
    XXH64_update(st, v.data(), v.size() * 4);
  }
  const uint64_t d = XXH64_digest(st);
  XXH64_freeState(st);
  return d;
}

}  // namespace kvq::testing
