// kvq/cache.h — the cache contract.
//
// A LayerCache holds the keys and values of one attention layer in compressed, packed form.
// A ModelCache holds one LayerCache per layer, built from a spec string and a model shape.
//
//   auto cache = kvq::ModelCache::create("kivi:k_bits=2,v_bits=2", shape);
//   for each layer l:  cache->layer(l).append(k, v, &q);   // k, v: [B, H_kv, S_new, D]
//                      cache->layer(l).attend(q, scale, out);
//
// Contract, for every method:
//  * append() takes any S_new >= 1: prefill chunks and single decode tokens use the same call.
//    Appending a sequence in one call, in chunks, or token by token gives bit-identical contents
//    (chunk invariance), because what is stored depends only on absolute token positions.
//  * The newest `residual` tokens stay in fp16 (the residual window). Older tokens are sealed in
//    whole blocks whose boundaries are counted from absolute position 0.
//  * Compressed data is held packed. bytes() is the accounting of what is held, broken down by
//    kind; resident_bytes() is measured from the buffers actually allocated. They are equal.
//  * Attention semantics (per query): a query at absolute position p sees exactly what
//    token-by-token appending would hold at offset p + 1 — the blocks sealed by then,
//    dequantized as stored, and every newer token exact (as the window stores it, rounded to
//    fp16 or bf16). So attend() outputs, not only stored bytes, do not depend on how the caller
//    chunked its appends (tested bit for bit for every method). See "Attention" below.
//  * Bad input (shapes, dtypes, devices, NaN/Inf, values beyond fp16 range) returns an error and
//    leaves the cache exactly as it was.
//  * Const methods (read, attend, bytes) may run concurrently; mutating methods may not.
//
// Attention, for engines that run their own (e.g. a Hugging Face attention function):
//  * sealed_tokens_for_query(p): the seal boundary the query at position p sees. Keys and values
//    of tokens below it come from read() (dequantized from sealed blocks); tokens at or above it
//    (up to p) must be exact, from read_exact().
//  * read_exact(t0, n, ...) returns exact values of tokens [t0, t0 + n) for t0 >= exact_begin():
//    the window, and the blocks the last append sealed before its last token, whose exact values
//    the cache keeps until the next append, trim or reset (workspace, not state: they are not in
//    bytes(); workspace_bytes() reports them).
//  * The boundary moves by one block every T tokens (block_tokens()), so an engine handles it per
//    block of queries, not per query. A single decode token always has boundary
//    sealed_tokens(): for decode, read() alone is enough.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvq/spec.h"
#include "kvq/status.h"
#include "kvq/tensor.h"
#include "kvq/thread_pool.h"
#include "kvq/workspace.h"

namespace kvq {

// Where a cache lives and what it may use. Given at creation; shared by a model's layers.
struct CacheOptions {
  // The device that holds the cache's data (the CPU; CUDA where kvq was built with it). Tensors
  // passed to the cache must be on the same device.
  Device device{};
  // Threads for work inside a call (attend splits over batch and KV heads). Null: the calling
  // thread only. The pool must outlive the cache.
  ThreadPool* pool = nullptr;
  // Scratch for append and attend. Null: the cache makes its own (one per model). Shared pools
  // let several caches use one set of workspaces.
  std::shared_ptr<WorkspacePool> workspaces;
  // An opaque CUDA stream (cudaStream_t) for device caches; ignored on the CPU.
  void* stream = nullptr;
};

// How the model applied rotary position embeddings to the keys that enter the cache (keys are
// appended after RoPE). Methods that quantize keys before RoPE (kvq's own) undo and redo it with
// these parameters; a cache assumes token i of a layer sits at position i.
struct RopeShape {
  enum class Mode : uint8_t {
    kNone = 0,      // no RoPE, or unknown: such methods refuse to quantize pre-RoPE
    kAdjacent = 1,  // pairs (2i, 2i + 1) rotate together (llama.cpp's "normal", llama2.c)
    kHalf = 2,      // pairs (i, i + D/2) (GPT-NeoX's, Hugging Face Llama's rotate_half)
  };
  Mode mode = Mode::kNone;
  double theta = 10000.0;   // pair i turns by position * freq_scale * theta^(-2i / head_dim)
  double freq_scale = 1.0;  // linear position scaling
  bool operator==(const RopeShape&) const = default;
};

// Shape of one attention layer.
struct LayerShape {
  int n_kv_heads = 0;
  int head_dim = 0;
  int n_q_heads = 0;  // query heads (a multiple of n_kv_heads); 0 means n_kv_heads
  RopeShape rope{};   // optional: only methods that quantize keys before RoPE need it
};

struct ModelShape {
  int n_layers = 0;
  LayerShape layer;                   // every layer's shape unless `per_layer` is given
  std::vector<LayerShape> per_layer;  // optional: one entry per layer

  const LayerShape& at(int i) const { return per_layer.empty() ? layer : per_layer[i]; }
  static ModelShape uniform(int n_layers, int n_kv_heads, int head_dim, int n_q_heads = 0,
                            RopeShape rope = {}) {
    ModelShape s;
    s.n_layers = n_layers;
    s.layer = LayerShape{n_kv_heads, head_dim, n_q_heads, rope};
    return s;
  }
};
Status validate_model_shape(const ModelShape& shape);

// What a cache holds, in bytes, by kind. Every byte the cache holds for K/V is in exactly one
// field; nothing is an estimate.
struct CacheBytes {
  uint64_t key_codes = 0;    // packed (or entropy-coded) key codes
  uint64_t value_codes = 0;  // packed (or entropy-coded) value codes
  uint64_t params = 0;       // scales and zero points (fp16)
  uint64_t residual = 0;     // the fp16 residual window (allocated pages, K and V)
  uint64_t meta = 0;         // masks, coder tables, stream headers, saliency probes, ...
  // Lookup tables derived from the model's shape that the cache keeps to run, never stored
  // (kvq's RoPE angles, shared by a model's layers and billed by one of them): resident, so in
  // total(), but not part of the stored format's bits.
  uint64_t tables = 0;
  uint64_t elements = 0;     // K and V elements represented: 2 * B * H_kv * offset * D
  uint64_t total() const { return stored() + tables; }
  // The bytes of the stored format (everything but the tables).
  uint64_t stored() const { return key_codes + value_codes + params + residual + meta; }
  uint64_t fp16_bytes() const { return elements * 2; }
  // All-in bits per element (every stored byte above, divided by the elements represented).
  double bits_per_element() const {
    return elements ? 8.0 * static_cast<double>(stored()) / static_cast<double>(elements) : 0.0;
  }
  // fp16 bytes / stored bytes.
  double compression_ratio() const {
    return stored() ? static_cast<double>(fp16_bytes()) / static_cast<double>(stored()) : 0.0;
  }
  CacheBytes& operator+=(const CacheBytes& o);
  bool operator==(const CacheBytes&) const = default;
};

// Deep copies of caches that share state (XQuant layers read their anchor's codes) must share
// the copies in the same way. The memo maps an original shared object to its copy.
struct CloneMemo {
  std::unordered_map<const void*, std::shared_ptr<void>> copies;
};

// Serialization units of a layer's state, used by the .kvq container (docs/format.md). Sealed
// blocks never change once sealed, so a growing cache can stream them as they appear; the
// window and method state change with every token and are exported last.
enum class ChunkKind : uint8_t {
  kBlockKeys = 0,     // a sealed block's key part, in the method's stored layout
  kBlockValues = 1,   // a sealed block's value part
  kWindowKeys = 2,    // the window keys: [B, H, n] rows of the layer's WindowFormat
  kWindowValues = 3,  // the window values
  kState = 4,         // method state outside blocks (e.g. saliency probes); may be empty
};
const char* chunk_kind_name(ChunkKind k);

// How a layer holds its window rows (one row: the D values of one token and KV head), chosen
// by its method (kvq's window parameter); every other method holds 16-bit rows.
enum class WindowFormat : uint8_t {
  k16Bit = 0,  // D 16-bit elements of window_dtype(): IEEE binary16, or bfloat16
  kQ8 = 1,     // q8_0-like blocks of 32 values (one block when 32 does not divide D): an fp16
               // scale, then 32 int8 codes; 8.5 bits a value (docs/format.md §6)
};
// Bytes of one window row of D values.
size_t window_row_bytes(WindowFormat format, int64_t head_dim);

struct ChunkRef {
  ChunkKind kind = ChunkKind::kState;
  int64_t t0 = 0;      // first token position covered
  int64_t tokens = 0;  // tokens covered
  const uint8_t* data = nullptr;
  size_t size = 0;
};

class ChunkSink {
 public:
  virtual ~ChunkSink() = default;
  virtual Status put(const ChunkRef& chunk) = 0;
};

class LayerCache {
 public:
  virtual ~LayerCache() = default;

  // Appends keys and values of S_new new tokens: k, v [B, H_kv, S_new, D], any of f32/f16/bf16,
  // any strides. B is fixed by the first append (until reset). `q` is optional: the queries of
  // the same tokens after RoPE, [B, H_q, S_new, D]; methods that rank tokens by attention
  // (zipcache saliency=attn) use it and fall back to a documented proxy without it.
  virtual Status append(const TensorView& k, const TensorView& v,
                        const TensorView* q = nullptr) = 0;

  // Number of tokens held.
  virtual int64_t offset() const = 0;
  // Tokens [0, sealed_tokens()) are held compressed; the rest sit in the fp16 window.
  virtual int64_t sealed_tokens() const = 0;
  // Tokens per sealed block (T) and the residual window (R): block i seals at offset (i+1)T + R.
  virtual int64_t block_tokens() const = 0;
  virtual int64_t residual() const = 0;
  // Tokens of the last append (0 after trim, reset, import or clone).
  virtual int64_t last_append_tokens() const = 0;
  // First token whose exact value the cache still holds (see "Attention" above).
  virtual int64_t exact_begin() const = 0;
  // The seal boundary the query at position p sees: tokens below it are read dequantized, tokens
  // from it to p exact. Always >= exact_begin(). Meaningful for the queries attend() accepts.
  virtual int64_t sealed_tokens_for_query(int64_t p) const = 0;
  // The batch size fixed by the first append (0 when empty).
  virtual int64_t batch() const = 0;
  virtual const LayerShape& shape() const = 0;

  // Writes tokens [t0, t0 + n) of keys and values, dequantized, into k_out and v_out, each
  // [B, H_kv, n, D] of any dtype and strides (rounded to nearest even when 16-bit).
  virtual Status read(int64_t t0, int64_t n, const MutTensorView& k_out,
                      const MutTensorView& v_out) const = 0;
  // Exact values (as the window stores them) of tokens [t0, t0 + n), t0 >= exact_begin(); same
  // output contract as read().
  virtual Status read_exact(int64_t t0, int64_t n, const MutTensorView& k_out,
                            const MutTensorView& v_out) const = 0;

  // Causal attention of the newest T = q.tokens() tokens against everything held, with
  // dequantization inside the dot products: q [B, H_q, T, D], out [B, H_q, T, D] (f32), where
  // query t sits at position p = offset() - T + t and sees keys at positions <= p, under the
  // per-query semantics above. out = softmax(scale * q k^T) v. Query heads map to KV heads in
  // contiguous groups (GQA). The queries must be ones whose view the cache can still give: those
  // of the last append (any T <= last_append_tokens()), or older ones whose seal boundary has not
  // moved since; otherwise kInvalidArgument. `kv_head_begin/end` restrict the work to a range of
  // KV heads (and their query heads); the whole range runs on the cache's thread pool, if any.
  // `ws`: scratch for this call (null: one from the cache's workspace pool).
  virtual Status attend(const TensorView& q, float scale, const MutTensorView& out,
                        int kv_head_begin = 0, int kv_head_end = -1,
                        Workspace* ws = nullptr) const = 0;

  // Removes the newest n tokens (0 <= n <= offset()), rolling back codes, parameters, the
  // window and every counter. When the removed tokens sealed no block (sealed_tokens() is what
  // it was before they arrived), the cache is bit-identical to one that never received them.
  // Blocks sealed in the meantime stay sealed (their fp16 originals are gone); they hold exactly
  // the codes they will hold again once the offset passes their seal point, so states converge
  // as tokens are re-appended. A trim reaching into sealed blocks drops whole blocks, and a
  // block cut in two is reopened from its dequantized values.
  virtual Status trim(int64_t n) = 0;
  // Drops everything; the cache is as new (B may change on the next append).
  virtual void reset() = 0;
  // Deep copy. Shared state is copied once per memo (see CloneMemo).
  virtual std::unique_ptr<LayerCache> clone(CloneMemo& memo) const = 0;

  // Accounting of everything held (see CacheBytes).
  virtual CacheBytes bytes() const = 0;
  // Bytes of the buffers actually allocated for K/V data, measured by walking them.
  virtual uint64_t resident_bytes() const = 0;
  // Transient exact values kept for the last append's queries (see "Attention"); not state.
  virtual uint64_t workspace_bytes() const = 0;

  // ---- serialization (the container calls these) ----
  // Window element type (f16, or bf16 when the first append was bf16); for q8 rows, the type
  // of their scales (f16).
  virtual DType window_dtype() const = 0;
  // How window rows are held; kQ8 rows are exported and imported as they are held.
  virtual WindowFormat window_format() const { return WindowFormat::k16Bit; }
  // Sealed blocks [first_block, n_blocks) as kBlockKeys/kBlockValues chunk pairs, in order.
  virtual int64_t n_blocks() const = 0;
  virtual Status export_blocks(int64_t first_block, ChunkSink& sink) const = 0;
  // The window (kWindowKeys, kWindowValues) then the method state (kState).
  virtual Status export_tail(ChunkSink& sink) const = 0;
  // Replaces the whole state from chunks in export order (blocks, then tail), for a cache of
  // batch size `batch` holding `offset` tokens. Validates everything (sizes, positions, codes,
  // parameters) and changes nothing on error. The window chunks are rows of window_format()
  // (window_dtype: their 16-bit type, or f16 for q8 rows).
  virtual Status import_chunks(const std::vector<ChunkRef>& chunks, int64_t batch, int64_t offset,
                               DType window_dtype) = 0;

  // Canonical spec of this layer (after per-layer overrides).
  virtual const Spec& spec() const = 0;
  // Method-specific counters as "key=value" lines (e.g. how saliency was obtained).
  virtual std::string stats() const { return {}; }
};

// Per-layer parameter overrides applied on top of the model spec: layer index -> "k=v,k=v".
using LayerOverrides = std::map<int, std::string>;

// A model spec string: a method spec, then optional per-layer overrides after '@':
//
//   kivi:k_bits=2@0-3:k_bits=4,v_bits=4@29:v_bits=4
//
// Layers are an index or an inclusive range; later overrides of the same layer add to (and win
// over) earlier ones. Parsing checks the syntax and every assignment against the method's
// parameters; layer indices are checked against the model when the cache is built.
struct ModelSpec {
  Spec spec;
  LayerOverrides overrides;
  // Canonical: the canonical method spec, then one "@L:k=v,..." per overridden layer in order.
  std::string to_string() const;
};
Result<ModelSpec> parse_model_spec(std::string_view text);

class ModelCache {
 public:
  // Builds every layer from a parsed spec or a spec string. Per-layer overrides are validated
  // like the spec itself.
  static Result<ModelCache> create(const Spec& spec, const ModelShape& shape,
                                   const LayerOverrides& overrides = {},
                                   const CacheOptions& options = {});
  // spec_text may carry per-layer overrides (see ModelSpec); `overrides` apply after them.
  static Result<ModelCache> create(std::string_view spec_text, const ModelShape& shape,
                                   const LayerOverrides& overrides = {},
                                   const CacheOptions& options = {});
  static Result<ModelCache> create(std::string_view spec_text, const ModelShape& shape,
                                   const CacheOptions& options) {
    return create(spec_text, shape, {}, options);
  }

  ModelCache(ModelCache&&) = default;
  ModelCache& operator=(ModelCache&&) = default;

  int n_layers() const { return static_cast<int>(layers_.size()); }
  LayerCache& layer(int i) { return *layers_.at(static_cast<size_t>(i)); }
  const LayerCache& layer(int i) const { return *layers_.at(static_cast<size_t>(i)); }
  const Spec& spec() const { return spec_; }
  // The model spec with each layer's overrides (what create() was given, canonicalised).
  ModelSpec model_spec() const;
  const ModelShape& shape() const { return shape_; }

  // Tokens held by layer 0 (every layer holds the same number between full forward passes).
  int64_t offset() const;
  // Trims every layer by n tokens; validates for all layers before changing any.
  Status trim(int64_t n);
  void reset();
  // Deep copy, shared state included.
  ModelCache clone() const;

  CacheBytes bytes() const;
  uint64_t resident_bytes() const;
  uint64_t workspace_bytes() const;
  const CacheOptions& options() const { return options_; }

 private:
  ModelCache(Spec spec, ModelShape shape, CacheOptions options)
      : spec_(std::move(spec)), shape_(std::move(shape)), options_(std::move(options)) {}
  static Result<ModelCache> build(const Spec& spec, const ModelShape& shape,
                                  const std::vector<Spec>& layer_specs,
                                  const CacheOptions& options);
  Spec spec_;
  ModelShape shape_;
  CacheOptions options_;
  std::vector<std::unique_ptr<LayerCache>> layers_;
};

// Plain reference attention over dequantized K/V (read() then textbook softmax), used to test
// every attend() implementation. Same contract as LayerCache::attend.
Status reference_attend(const LayerCache& cache, const TensorView& q, float scale,
                        const MutTensorView& out);

}  // namespace kvq
