#include "container_cli.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "core/file_io.h"
#include "core/json.h"

namespace kvq::cli {

std::string tensor_names_json(const std::vector<std::pair<std::string, std::string>>& names) {
  json::Value arr = json::Value::array();
  for (const auto& [k, v] : names) {
    json::Value pair = json::Value::array();
    pair.push(json::Value::string(k));
    pair.push(json::Value::string(v));
    arr.push(std::move(pair));
  }
  return arr.dump();
}

std::vector<std::pair<std::string, std::string>> tensor_names(const ContainerMeta& meta) {
  std::vector<std::pair<std::string, std::string>> names;
  const int n = meta.shape.n_layers;
  auto it = meta.attributes.find(kTensorNamesAttribute);
  if (it != meta.attributes.end()) {
    auto v = json::parse(it->second);
    std::set<std::string> seen;
    if (v.ok() && v->is_array() && static_cast<int>(v->items().size()) == n) {
      for (const auto& p : v->items()) {
        if (!p.is_array() || p.items().size() != 2 || !p.items()[0].is_string() ||
            !p.items()[1].is_string())
          break;
        const std::string& k = p.items()[0].as_string();
        const std::string& vn = p.items()[1].as_string();
        if (k.empty() || vn.empty() || k == "__metadata__" || vn == "__metadata__" ||
            !seen.insert(k).second || !seen.insert(vn).second)
          break;
        names.emplace_back(k, vn);
      }
    }
    if (static_cast<int>(names.size()) == n) return names;
    names.clear();
  }
  for (int i = 0; i < n; ++i)
    names.emplace_back("layers." + std::to_string(i) + ".k", "layers." + std::to_string(i) + ".v");
  return names;
}

std::string model_spec_text(const ContainerMeta& meta) {
  std::string s = meta.method_spec;
  for (const auto& [layer, text] : meta.overrides) s += "@" + std::to_string(layer) + ":" + text;
  return s;
}

Result<std::vector<uint8_t>> read_input(const std::string& path) {
  if (path != "-") return read_file(path);
  std::vector<uint8_t> data;
  uint8_t buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(STDIN_FILENO, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(std::string("cannot read standard input: ") + std::strerror(errno));
    }
    if (n == 0) break;
    data.insert(data.end(), buf, buf + n);
  }
  return data;
}

}  // namespace kvq::cli
