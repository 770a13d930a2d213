#include "test_util.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#include "kvq/spec.h"

namespace kvq::testing {

std::string source_dir() {
  if (const char* e = std::getenv("KVQ_SOURCE_DIR")) return e;
  return KVQ_SOURCE_DIR;
}

std::string shared_dir() {
  if (const char* e = std::getenv("KVQ_SHARED_DIR")) return e;
  return source_dir() + "/../shared";
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::vector<float> random_kv(int64_t B, int64_t H, int64_t S, int64_t D, uint64_t seed,
                             float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(B * H * S * D));
  std::vector<float> chan(static_cast<size_t>(D));
  for (auto& c : chan) c = 0.5f * n(rng);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = scale * (n(rng) + chan[i % static_cast<size_t>(D)] * 3.0f);
  return x;
}

std::vector<std::string> small_specs() {
  std::vector<std::string> out;
  for (const auto& m : method_table()) {
    Spec s = test_spec(m);  // the row's own small settings, so tests seal early
    out.push_back(s.to_string());
    // One variant per alternative choice of every enum parameter, so every mode of every method
    // meets the contract (variants a method's validator rejects are skipped).
    for (const auto& p : m.params) {
      if (p.type != ParamType::kEnum) continue;
      for (size_t c = 0; c < p.choices.size(); ++c) {
        if (static_cast<double>(c) == p.default_value) continue;
        Spec v = s;
        if (!v.set(p.name, p.choices[c]).ok()) continue;
        if (m.validate && !m.validate(v).ok()) continue;
        out.push_back(v.to_string());
      }
    }
  }
  // Modes that no enum choice reaches (an integer switch, off at its default), with the
  // quantizer paths they meet; last, so that the names of the rows above keep their indices.
  const std::pair<const char*, const char*> extra[] = {
      {"kvq", "outliers=50"},
      {"kvq", "outliers=50,params=f16,k_rot=on,rope=post"},
      {"kvq", "outliers=50,params=f16,k_levels=gauss,v_levels=gauss,v_rot=off,entropy=on"},
      {"kvq", "outliers=50,entropy=on"},
  };
  for (const auto& [name, settings] : extra) {
    const MethodDef* m = find_method(name);
    if (!m) continue;
    Spec s = test_spec(*m);
    if (!s.apply(settings).ok() || (m->validate && !m->validate(s).ok())) std::abort();
    out.push_back(s.to_string());
  }
  return out;
}

std::string read_whole(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

void read_all(const LayerCache& c, std::vector<float>& k, std::vector<float>& v) {
  const int64_t B = c.batch(), H = c.shape().n_kv_heads, S = c.offset(), D = c.shape().head_dim;
  k.assign(static_cast<size_t>(B * H * S * D), 0.0f);
  v.assign(k.size(), 0.0f);
  if (S == 0) return;
  Status st = c.read(0, S, MutTensorView::bhsd(k.data(), DType::kF32, B, H, S, D),
                     MutTensorView::bhsd(v.data(), DType::kF32, B, H, S, D));
  if (!st.ok()) std::abort();
}

}  // namespace kvq::testing
