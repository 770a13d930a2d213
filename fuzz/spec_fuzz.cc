// Fuzz target: spec strings — method specs (parse_spec, include/kvq/spec.h) and model specs with
// per-layer overrides (parse_model_spec, include/kvq/cache.h). A spec that parses prints in one
// canonical form that parses back to the same spec and prints identically.
#include <string>

#include "fuzz_util.h"
#include "kvq/cache.h"
#include "kvq/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvq;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto ms = parse_model_spec(text); ms.ok()) {
    const std::string canonical = ms->to_string();
    auto again = parse_model_spec(canonical);
    KVQ_FUZZ_CHECK(again.ok());
    KVQ_FUZZ_CHECK(again->spec == ms->spec && again->overrides == ms->overrides);
    KVQ_FUZZ_CHECK(again->to_string() == canonical);
  }
  auto s = parse_spec(text);
  if (!s.ok()) {
    KVQ_FUZZ_CHECK(!s.status().message().empty());
    return 0;
  }
  const std::string canonical = s->to_string();
  auto again = parse_spec(canonical);
  KVQ_FUZZ_CHECK(again.ok());
  KVQ_FUZZ_CHECK(*again == *s);
  KVQ_FUZZ_CHECK(again->to_string() == canonical);
  // Applying the same assignments again is a no-op.
  const size_t colon = canonical.find(':');
  if (colon != std::string::npos) {
    Spec copy = *s;
    KVQ_FUZZ_CHECK(copy.apply(canonical.substr(colon + 1)).ok());
    KVQ_FUZZ_CHECK(copy == *s);
  }
  return 0;
}
