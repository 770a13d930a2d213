#include "kv_pairs.h"

#include <algorithm>
#include <cctype>
#include <cstring>

namespace kvq::cli {

bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = std::isdigit(static_cast<unsigned char>(a[i])),
               db = std::isdigit(static_cast<unsigned char>(b[j]));
    if (da && db) {
      size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      // Compare digit runs as numbers: skip leading zeros, then by length, then lexically.
      size_t is = i, js = j;
      while (is + 1 < ie && a[is] == '0') ++is;
      while (js + 1 < je && b[js] == '0') ++js;
      if (ie - is != je - js) return ie - is < je - js;
      const int c = a.compare(is, ie - is, b, js, je - js);
      if (c != 0) return c < 0;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

Result<std::vector<LayerKV>> pair_layers(const SafeTensorsFile& f) {
  std::vector<LayerKV> out;
  const std::pair<const char*, const char*> suffixes[] = {
      {"keys", "values"}, {"key", "value"}, {"k", "v"}};
  for (const auto& t : f.tensors) {
    for (const auto& [ks, vs] : suffixes) {
      const std::string& kn = t.name;
      const size_t kl = std::strlen(ks);
      if (kn.size() < kl || kn.compare(kn.size() - kl, kl, ks) != 0) continue;
      const std::string prefix = kn.substr(0, kn.size() - kl);
      const SafeTensor* v = f.find(prefix + vs);
      if (!v) continue;
      LayerKV l;
      l.name = prefix;
      l.k_name = kn;
      l.v_name = v->name;
      KVQ_ASSIGN_OR_RETURN(l.k, t.view4());
      KVQ_ASSIGN_OR_RETURN(l.v, v->view4());
      if (const SafeTensor* q = f.find(prefix + "q")) {
        KVQ_ASSIGN_OR_RETURN(TensorView qv, q->view4());
        l.q = qv;
      }
      out.push_back(l);
      break;
    }
  }
  if (out.empty())
    return not_found(
        "no K/V tensor pairs (names ending in k/v, key/value or keys/values) in the input");
  std::stable_sort(out.begin(), out.end(),
                   [](const LayerKV& a, const LayerKV& b) { return natural_less(a.name, b.name); });
  return out;
}

}  // namespace kvq::cli
