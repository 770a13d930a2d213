// Helpers shared by the tests.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvq/cache.h"
#include "kvq/tensor.h"

namespace kvq::testing {

// Root of the source tree (for tests/data) and of ../shared (may not exist).
std::string source_dir();
std::string shared_dir();
bool file_exists(const std::string& path);

// Random [B, H, S, D] fp32 data with some per-channel structure.
std::vector<float> random_kv(int64_t B, int64_t H, int64_t S, int64_t D, uint64_t seed,
                             float scale = 1.0f);

// Every method in the table with small parameters suitable for fast tests (residual and group
// small so that sealing happens within a few dozen tokens), plus one variant per alternative
// choice of each enum parameter, and a few listed modes that no enum reaches (kvq's outliers).
std::vector<std::string> small_specs();

// A ChunkSink that keeps copies of every chunk, for export/import tests.
struct ChunkCollector : ChunkSink {
  std::vector<ChunkRef> refs;
  std::vector<std::vector<uint8_t>> store;
  Status put(const ChunkRef& c) override {
    store.emplace_back(c.data, c.data + c.size);
    refs.push_back(c);
    return ok_status();
  }
  // The chunks, pointing at the kept copies.
  std::vector<ChunkRef> chunks() const {
    std::vector<ChunkRef> out = refs;
    for (size_t i = 0; i < out.size(); ++i) out[i].data = store[i].data();
    return out;
  }
};

// A whole file as bytes in a string (empty when it cannot be read).
std::string read_whole(const std::string& path);
// Single quotes make any string one shell word, as it would arrive from execve.
std::string shell_quote(const std::string& s);

// Reads all K and V of a layer as fp32 [B, H, offset, D].
void read_all(const LayerCache& c, std::vector<float>& k, std::vector<float>& v);

}  // namespace kvq::testing
