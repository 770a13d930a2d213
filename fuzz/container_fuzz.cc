// Fuzz target: the .kvq container readers (docs/format.md) on arbitrary bytes.
//
// Every reader must return a Status, never crash. Properties checked on top:
//  * the whole-file loader and the streaming reader (fed in pieces whose sizes come from the
//    input's hash) accept exactly the same files;
//  * a file the loader accepts is also accepted by inspect_container and by the index reader
//    (ContainerView), which see the same chunk records, and it saves and loads again to the
//    same bytes.
// Limits are small so that a file declaring a huge cache is refused (kLimit) before anything
// that large is built.
#include <xxhash.h>

#include <vector>

#include "fuzz_util.h"
#include "kvq/container.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvq;
  ContainerLimits limits;
  limits.max_elements = uint64_t{1} << 22;
  limits.max_record_bytes = uint64_t{1} << 26;
  limits.max_stream_bytes = uint64_t{1} << 26;

  auto whole = parse_cache(data, size, limits);

  ContainerReader reader(limits);
  uint64_t h = XXH64(data, size, 1);
  size_t pos = 0;
  Status st;
  while (st.ok() && pos < size) {
    const size_t n = std::min<size_t>(size - pos, 1 + (h & 0xff));
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    st = reader.feed(data + pos, n);
    pos += n;
  }
  if (st.ok()) st = reader.finish();
  KVQ_FUZZ_CHECK(st.ok() == whole.ok());

  auto info = inspect_container(data, size, limits);
  auto view = ContainerView::open(data, size, limits);
  if (view.ok()) {
    for (size_t i = 0; i < view->chunks().size(); ++i) (void)view->chunk(i);
  }
  if (!whole.ok()) return 0;
  KVQ_FUZZ_CHECK(info.ok() && info->checksums_ok());
  KVQ_FUZZ_CHECK(view.ok() && view->chunks().size() == info->chunks.size());
  for (size_t i = 0; i < info->chunks.size(); ++i)
    KVQ_FUZZ_CHECK(view->chunks()[i].record_offset == info->chunks[i].record_offset);
  auto taken = reader.take();
  KVQ_FUZZ_CHECK(taken.ok());

  // Save and load again: the same bytes both times.
  auto again = serialize_cache(*whole);
  KVQ_FUZZ_CHECK(again.ok());
  auto reloaded = parse_cache(again->data(), again->size(), limits);
  KVQ_FUZZ_CHECK(reloaded.ok());
  auto third = serialize_cache(*reloaded);
  KVQ_FUZZ_CHECK(third.ok() && *third == *again);
  auto from_stream = serialize_cache(*taken);
  KVQ_FUZZ_CHECK(from_stream.ok() && *from_stream == *again);
  return 0;
}
