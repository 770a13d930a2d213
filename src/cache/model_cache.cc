#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "cache/backend.h"
#include "cache/codec.h"
#include "cache/layer.h"
#include "kvq/cache.h"
#include "numerics/q8_rows.h"

namespace kvq {

size_t window_row_bytes(WindowFormat format, int64_t head_dim) {
  return format == WindowFormat::kQ8 ? q8_row_bytes(head_dim) : static_cast<size_t>(head_dim) * 2;
}

const char* chunk_kind_name(ChunkKind k) {
  switch (k) {
    case ChunkKind::kBlockKeys:
      return "block_keys";
    case ChunkKind::kBlockValues:
      return "block_values";
    case ChunkKind::kWindowKeys:
      return "window_keys";
    case ChunkKind::kWindowValues:
      return "window_values";
    case ChunkKind::kState:
      return "state";
  }
  return "unknown";
}

CacheBytes& CacheBytes::operator+=(const CacheBytes& o) {
  key_codes += o.key_codes;
  value_codes += o.value_codes;
  params += o.params;
  residual += o.residual;
  meta += o.meta;
  tables += o.tables;
  elements += o.elements;
  return *this;
}

Status validate_model_shape(const ModelShape& shape) {
  if (shape.n_layers < 1 || shape.n_layers > 4096)
    return invalid_argument("model shape: n_layers must be in [1, 4096], got " +
                            std::to_string(shape.n_layers));
  if (!shape.per_layer.empty() && static_cast<int>(shape.per_layer.size()) != shape.n_layers)
    return invalid_argument("model shape: per_layer has " + std::to_string(shape.per_layer.size()) +
                            " entries for " + std::to_string(shape.n_layers) + " layers");
  for (int i = 0; i < shape.n_layers; ++i) {
    const LayerShape& l = shape.at(i);
    const std::string where = "model shape, layer " + std::to_string(i) + ": ";
    if (l.n_kv_heads < 1 || l.n_kv_heads > 4096)
      return invalid_argument(where + "n_kv_heads must be in [1, 4096], got " +
                              std::to_string(l.n_kv_heads));
    if (l.head_dim < 1 || l.head_dim > 4096)
      return invalid_argument(where + "head_dim must be in [1, 4096], got " +
                              std::to_string(l.head_dim));
    if (!(l.rope.theta > 0) || !std::isfinite(l.rope.theta) || !(l.rope.freq_scale > 0) ||
        !std::isfinite(l.rope.freq_scale) || static_cast<int>(l.rope.mode) > 2)
      return invalid_argument(where + "RoPE theta and freq_scale must be finite and positive");
    if (l.rope.mode == RopeShape::Mode::kHalf && l.head_dim % 2 != 0)
      return invalid_argument(where + "RoPE needs an even head_dim");
    if (l.n_q_heads < 0 || (l.n_q_heads && l.n_q_heads % l.n_kv_heads != 0))
      return invalid_argument(where + "n_q_heads (" + std::to_string(l.n_q_heads) +
                              ") must be a multiple of n_kv_heads (" +
                              std::to_string(l.n_kv_heads) + ")");
  }
  return ok_status();
}

std::string ModelSpec::to_string() const {
  std::string s = spec.to_string();
  for (const auto& [layer, text] : overrides) s += "@" + std::to_string(layer) + ":" + text;
  return s;
}

Result<ModelSpec> parse_model_spec(std::string_view text) {
  const size_t at = text.find('@');
  KVQ_ASSIGN_OR_RETURN(Spec base, parse_spec(text.substr(0, at)));
  ModelSpec ms{base, {}};
  std::map<int, Spec> layer_specs;  // to canonicalise merged overrides
  std::string_view rest = at == std::string_view::npos ? std::string_view() : text.substr(at + 1);
  while (at != std::string_view::npos) {
    const size_t next = rest.find('@');
    const std::string_view item = rest.substr(0, next);
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos || colon == 0)
      return invalid_argument("layer override '" + std::string(item) +
                              "' must look like L:k=v or A-B:k=v");
    const std::string range(item.substr(0, colon));
    int a = 0, b = 0;
    char tail = 0;
    if (std::sscanf(range.c_str(), "%d-%d%c", &a, &b, &tail) == 2) {
    } else if (std::sscanf(range.c_str(), "%d%c", &a, &tail) == 1) {
      b = a;
    } else {
      return invalid_argument("bad layer range '" + range + "' in '" + std::string(item) + "'");
    }
    if (a < 0 || b < a || b >= 4096)
      return invalid_argument("layer range '" + range + "' must satisfy 0 <= first <= last < 4096");
    const std::string_view assignments = item.substr(colon + 1);
    for (int l = a; l <= b; ++l) {
      auto it = layer_specs.try_emplace(l, base).first;
      KVQ_RETURN_IF_ERROR(it->second.apply(assignments).with_context("layer " + std::to_string(l)));
    }
    if (next == std::string_view::npos) break;
    rest = rest.substr(next + 1);
  }
  // Canonical overrides: only the parameters that differ from the base, in table order.
  for (const auto& [layer, ls] : layer_specs) {
    std::string diff = ls.diff_from(base);
    if (!diff.empty()) ms.overrides[layer] = std::move(diff);
  }
  return ms;
}

namespace {

Status apply_overrides(std::vector<Spec>& specs, const LayerOverrides& overrides) {
  for (const auto& [layer, text] : overrides) {
    if (layer < 0 || layer >= static_cast<int>(specs.size()))
      return out_of_range("override for layer " + std::to_string(layer) + " but the model has " +
                          std::to_string(specs.size()) + " layers");
    KVQ_RETURN_IF_ERROR(specs[static_cast<size_t>(layer)].apply(text).with_context(
        "override for layer " + std::to_string(layer)));
  }
  return ok_status();
}

}  // namespace

Result<ModelCache> ModelCache::create(std::string_view spec_text, const ModelShape& shape,
                                      const LayerOverrides& overrides,
                                      const CacheOptions& options) {
  KVQ_ASSIGN_OR_RETURN(ModelSpec ms, parse_model_spec(spec_text));
  KVQ_RETURN_IF_ERROR(validate_model_shape(shape));
  std::vector<Spec> specs(static_cast<size_t>(shape.n_layers), ms.spec);
  KVQ_RETURN_IF_ERROR(apply_overrides(specs, ms.overrides));
  KVQ_RETURN_IF_ERROR(apply_overrides(specs, overrides));
  return build(ms.spec, shape, specs, options);
}

Result<ModelCache> ModelCache::create(const Spec& spec, const ModelShape& shape,
                                      const LayerOverrides& overrides,
                                      const CacheOptions& options) {
  KVQ_RETURN_IF_ERROR(validate_model_shape(shape));
  std::vector<Spec> specs(static_cast<size_t>(shape.n_layers), spec);
  KVQ_RETURN_IF_ERROR(apply_overrides(specs, overrides));
  return build(spec, shape, specs, options);
}

Result<ModelCache> ModelCache::build(const Spec& spec, const ModelShape& shape,
                                     const std::vector<Spec>& specs, const CacheOptions& options) {
  const LayerBackend device_backend =
      options.device.type == DeviceType::kCpu ? nullptr : find_layer_backend(options.device.type);
  if (options.device.type != DeviceType::kCpu && !device_backend)
    return unsupported("a cache on " + device_name(options.device) +
                       " needs kvq built with its CUDA backend (KVQ_CUDA=ON, linked as kvq_cuda)"
                       " and a GPU");
  KVQ_ASSIGN_OR_RETURN(auto codecs, spec.method().build(specs, shape));
  KVQ_CHECK(static_cast<int>(codecs.size()) == shape.n_layers);
  CacheOptions opts = options;
  if (!opts.workspaces) opts.workspaces = std::make_shared<WorkspacePool>();  // one per model
  ModelCache cache(spec, shape, opts);
  if (device_backend) {
    KVQ_ASSIGN_OR_RETURN(cache.layers_, device_backend(std::move(codecs), shape, opts));
    KVQ_CHECK(static_cast<int>(cache.layers_.size()) == shape.n_layers);
    return cache;
  }
  for (auto& c : codecs) cache.layers_.push_back(std::make_unique<CpuLayer>(std::move(c), opts));
  return cache;
}

ModelSpec ModelCache::model_spec() const {
  ModelSpec ms{spec_, {}};
  for (int i = 0; i < n_layers(); ++i) {
    std::string diff = layers_[static_cast<size_t>(i)]->spec().diff_from(spec_);
    if (!diff.empty()) ms.overrides[i] = std::move(diff);
  }
  return ms;
}

int64_t ModelCache::offset() const { return layers_.empty() ? 0 : layers_[0]->offset(); }

Status ModelCache::trim(int64_t n) {
  for (const auto& l : layers_)
    if (n < 0 || n > l->offset())
      return out_of_range("trim(" + std::to_string(n) + ") but a layer holds " +
                          std::to_string(l->offset()) + " tokens");
  // Trim from the last layer down: layers that read another layer's state (XQuant reuse
  // layers read their anchor, an earlier layer) let go of it before it changes.
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) KVQ_CHECK((*it)->trim(n).ok());
  return ok_status();
}

void ModelCache::reset() {
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) (*it)->reset();
}

ModelCache ModelCache::clone() const {
  ModelCache c(spec_, shape_, options_);
  CloneMemo memo;
  for (const auto& l : layers_) c.layers_.push_back(l->clone(memo));
  return c;
}

CacheBytes ModelCache::bytes() const {
  CacheBytes total;
  for (const auto& l : layers_) total += l->bytes();
  return total;
}

uint64_t ModelCache::resident_bytes() const {
  uint64_t r = 0;
  for (const auto& l : layers_) r += l->resident_bytes();
  return r;
}

uint64_t ModelCache::workspace_bytes() const {
  uint64_t r = options_.workspaces ? options_.workspaces->capacity() : 0;
  for (const auto& l : layers_) r += l->workspace_bytes();
  return r;
}

Status reference_attend(const LayerCache& cache, const TensorView& q, float scale,
                        const MutTensorView& out) {
  const int64_t B = cache.batch(), S = cache.offset();
  const LayerShape& sh = cache.shape();
  const int64_t H = sh.n_kv_heads, D = sh.head_dim, Hq = sh.n_q_heads ? sh.n_q_heads : H;
  const int64_t Tq = q.shape[2];
  if (q.shape[0] != B || q.shape[1] != Hq || q.shape[3] != D || Tq < 1 || Tq > S)
    return shape_mismatch("reference_attend: bad q " + describe(q));
  if (out.shape != q.shape || out.dtype != DType::kF32)
    return shape_mismatch("reference_attend: out must be f32 with q's shape");
  // The per-query semantics from the external-attention contract: keys below the query's seal
  // boundary from read(), the others from read_exact().
  std::vector<float> k(static_cast<size_t>(B * H * S * D)), v(k.size());
  KVQ_RETURN_IF_ERROR(cache.read(0, S, MutTensorView::bhsd(k.data(), DType::kF32, B, H, S, D),
                                 MutTensorView::bhsd(v.data(), DType::kF32, B, H, S, D)));
  const int64_t eb = cache.exact_begin(), ne = S - eb;
  std::vector<float> ke(static_cast<size_t>(B * H * ne * D)), ve(ke.size());
  KVQ_RETURN_IF_ERROR(cache.read_exact(eb, ne,
                                       MutTensorView::bhsd(ke.data(), DType::kF32, B, H, ne, D),
                                       MutTensorView::bhsd(ve.data(), DType::kF32, B, H, ne, D)));
  auto key = [&](int64_t b, int64_t h, int64_t j, int64_t d, int64_t boundary) -> double {
    return j < boundary ? k[static_cast<size_t>(((b * H + h) * S + j) * D + d)]
                        : ke[static_cast<size_t>(((b * H + h) * ne + j - eb) * D + d)];
  };
  auto value = [&](int64_t b, int64_t h, int64_t j, int64_t d, int64_t boundary) -> double {
    return j < boundary ? v[static_cast<size_t>(((b * H + h) * S + j) * D + d)]
                        : ve[static_cast<size_t>(((b * H + h) * ne + j - eb) * D + d)];
  };
  const int64_t group = Hq / H;
  std::vector<double> p(static_cast<size_t>(S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t h = hq / group;
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t pos = S - Tq + t, boundary = cache.sealed_tokens_for_query(pos);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= pos; ++j) {
          double s = 0;
          for (int64_t d = 0; d < D; ++d)
            s += static_cast<double>(q.load(b, hq, t, d)) * key(b, h, j, d, boundary);
          p[static_cast<size_t>(j)] = s * scale;
          mx = std::max(mx, p[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= pos; ++j)
          sum += (p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - mx));
        float* o = static_cast<float*>(out.data) + out.offset(b, hq, t, 0);
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t j = 0; j <= pos; ++j)
            acc += p[static_cast<size_t>(j)] * value(b, h, j, d, boundary);
          o[d * out.strides[3]] = static_cast<float>(acc / sum);
        }
      }
    }
  return ok_status();
}

}  // namespace kvq
