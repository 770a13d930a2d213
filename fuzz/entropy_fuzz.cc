// Fuzz target: the entropy coder's decoders (src/entropy/: symbol streams, serialized frequency
// tables) on arbitrary bytes, and its losslessness on arbitrary symbols.
//
// The first input byte picks the mode:
//   even: decode. An optional serialized table set (for shared-table streams), then a stream;
//         the scalar reference and the fastest path must agree (both fail, or both give the same
//         symbols), and decoded symbols must re-encode and decode to themselves.
//   odd:  round trip. The rest of the input are symbols (masked to `bits`), coded with options
//         taken from the input; decode(encode(x)) == x on both paths, and a stream never exceeds
//         1 + packed_size(n, bits) bytes.
#include <algorithm>
#include <optional>
#include <vector>

#include "entropy/symbol_codec.h"
#include "fuzz_util.h"
#include "kvq/bitpack.h"

namespace {

using namespace kvq;
using namespace kvq::entropy;

void check_decodes_to(const std::vector<uint8_t>& stream, int64_t n_tokens, int n_channels,
                      int bits, const std::vector<uint8_t>& symbols, const SharedTables* shared) {
  for (RansImpl impl : {RansImpl::kScalar, RansImpl::kAuto}) {
    std::vector<uint8_t> out(symbols.size() + 1, 0xAA);
    Status st = decode_symbols(stream.data(), stream.size(), n_tokens, n_channels, bits, out.data(),
                               shared, impl);
    KVQ_FUZZ_CHECK(st.ok());
    KVQ_FUZZ_CHECK(std::equal(symbols.begin(), symbols.end(), out.begin()));
    KVQ_FUZZ_CHECK(out.back() == 0xAA);  // nothing written past the end
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const uint8_t mode = in.u8();
  const int bits = 1 + in.u8() % 8;
  const int n_channels = 1 + in.u8() % 64;
  if (mode & 1) {
    SymbolCodecOptions o;
    o.prob_bits = 1 + in.u8() % 12;
    const uint8_t f = in.u8();
    o.layout = f % 3 == 0   ? TableLayout::kPerChannel
               : f % 3 == 1 ? TableLayout::kPooled
                            : TableLayout::kAuto;
    o.adaptive_precision = (f >> 2) & 1;
    o.lanes_log2 = static_cast<int>((f >> 3) % 7) - 1;  // -1..5
    o.impl = (f >> 6) & 1 ? RansImpl::kScalar : RansImpl::kAuto;
    size_t n = 0;
    const uint8_t* p = in.rest(&n);
    const int64_t n_tokens = static_cast<int64_t>(n / static_cast<size_t>(n_channels));
    std::vector<uint8_t> symbols(
        p, p + static_cast<size_t>(n_tokens) * static_cast<size_t>(n_channels));
    for (auto& s : symbols) s = static_cast<uint8_t>(s & ((1u << bits) - 1));
    std::vector<uint8_t> stream;
    Status st = encode_symbols(symbols.data(), n_tokens, n_channels, bits, o, stream);
    if (!st.ok()) {
      KVQ_FUZZ_CHECK(st.code() == ErrorCode::kInvalidArgument && stream.empty());
      return 0;
    }
    KVQ_FUZZ_CHECK(stream.size() <= 1 + packed_size(symbols.size(), bits));
    check_decodes_to(stream, n_tokens, n_channels, bits, symbols, nullptr);
    return 0;
  }
  const int64_t n_tokens = in.u16() % 2049;
  std::optional<SharedTables> shared;
  if (mode & 2) {
    size_t tn = 0;
    const uint8_t* tp = in.take(in.u16() % 4096, &tn);
    auto tables = deserialize_tables(tp, tn);
    if (tables.ok()) {
      auto s = make_shared_tables(std::move(*tables));
      if (s.ok()) shared.emplace(std::move(*s));
    }
  }
  size_t n = 0;
  const uint8_t* p = in.rest(&n);
  const size_t count = static_cast<size_t>(n_tokens) * static_cast<size_t>(n_channels);
  std::vector<uint8_t> a(count + 1, 0x55), b(count + 1, 0x55);
  const SharedTables* sp = shared ? &*shared : nullptr;
  Status sa = decode_symbols(p, n, n_tokens, n_channels, bits, a.data(), sp, RansImpl::kScalar);
  Status sb = decode_symbols(p, n, n_tokens, n_channels, bits, b.data(), sp, RansImpl::kAuto);
  KVQ_FUZZ_CHECK(sa.ok() == sb.ok());
  KVQ_FUZZ_CHECK(a.back() == 0x55 && b.back() == 0x55);
  if (!sa.ok()) return 0;
  KVQ_FUZZ_CHECK(a == b);
  a.pop_back();
  for (uint8_t s : a) KVQ_FUZZ_CHECK(s < (1u << bits));
  // Decoded symbols re-encode (with the shared tables when they fit this shape; a stream that
  // did not use them may have decoded with tables of another shape) and decode to themselves.
  std::vector<uint8_t> stream;
  Status enc = encode_symbols(a.data(), n_tokens, n_channels, bits, SymbolCodecOptions{}, stream,
                              nullptr, sp);
  if (!enc.ok() && sp && enc.code() == ErrorCode::kInvalidArgument) {
    sp = nullptr;
    stream.clear();
    enc = encode_symbols(a.data(), n_tokens, n_channels, bits, SymbolCodecOptions{}, stream);
  }
  KVQ_FUZZ_CHECK(enc.ok());
  check_decodes_to(stream, n_tokens, n_channels, bits, a, sp);
  return 0;
}
