// kvq/container.h — the .kvq file: save, load, stream and inspect compressed caches.
//
// The bytes are defined by docs/format.md (normative, versioned); this header is the API.
//
//   kvq::Status st = kvq::save_cache(cache, "ctx.kvq");          // atomic: temp file + rename
//   kvq::Result<kvq::ModelCache> c = kvq::load_cache("ctx.kvq");  // bit-identical contents
//
// Streaming, as a cache grows (e.g. while a prompt is prefilled chunk by chunk):
//
//   kvq::FdByteSink out(pipe_fd);
//   auto w = kvq::ContainerWriter::start(cache, out);     // header + metadata
//   ... append tokens ...; w->write_new_blocks(cache);    // blocks sealed since the last call
//   w->finish(cache);                                     // windows, states, index, end
//
//   kvq::ContainerReader r;                               // on the other side of the pipe
//   while (bytes arrive) r.feed(p, n);                    // layers are built as they complete
//   kvq::Result<kvq::ModelCache> c = r.take();            // once r.done()
//
// Every reader validates every byte it is given (checksums, lengths, order, limits, then the
// method's own checks) and returns kFormat, kCorrupt, kUnsupported or kLimit; it never crashes,
// never reads out of bounds and never allocates in proportion to a declared size before the
// bytes are there. Codes and conditions are listed in docs/format.md §8.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvq/cache.h"
#include "kvq/status.h"

namespace kvq {

inline constexpr uint16_t kContainerMajorVersion = 1;
inline constexpr uint16_t kContainerMinorVersion = 0;
// Record and payload alignment in the file (bytes).
inline constexpr size_t kContainerAlignment = 64;

// Free-form text attributes stored in the metadata (docs/format.md §3.1), e.g. "kvq.source".
using ContainerAttributes = std::map<std::string, std::string>;

// Limits a reader enforces on declared sizes (docs/format.md §7); exceeding one is kLimit.
struct ContainerLimits {
  uint64_t max_record_bytes = uint64_t{1} << 40;  // payload of any one record
  uint64_t max_stream_bytes = uint64_t{1} << 40;  // bytes a ContainerReader accepts in total
  uint64_t max_elements = uint64_t{1} << 36;      // K+V elements the file represents
};

// What the META record says.
struct ContainerMeta {
  uint16_t major_version = 0, minor_version = 0;
  std::string kvq_version;   // the writer's kvq version (informative)
  std::string method_spec;   // canonical spec
  LayerOverrides overrides;  // layer -> "k=v,..." (the parameters that differ from method_spec)
  ModelShape shape;          // per_layer filled when layers differ, else `layer`
  ContainerAttributes attributes;
};

// One CHNK record, as read from its header.
struct ContainerChunk {
  uint64_t record_offset = 0;  // file offset of the record header; the payload is at +64
  int layer = 0;
  ChunkKind kind = ChunkKind::kState;
  DType dtype = DType::kF16;  // window chunks only (q8 rows: their scales', f16)
  WindowFormat window_format = WindowFormat::k16Bit;  // window chunks only
  int64_t t0 = 0, tokens = 0, batch = 0;
  uint64_t size = 0;         // payload bytes
  uint64_t checksum = 0;     // stored XXH64 of the payload
  bool checksum_ok = false;  // whether the payload matched it (inspect_container)
};

// ---- writing ----

// Serializes a whole cache (every layer's blocks and tail, layer by layer). Fails with
// kUnsupported when the cache's per-layer specs cannot be described by its method spec and
// per-layer overrides (every cache built by ModelCache::create can be).
Result<std::vector<uint8_t>> serialize_cache(const ModelCache& cache,
                                             const ContainerAttributes& attributes = {});
// serialize_cache() written to `path` atomically: a failure never replaces an existing file.
Status save_cache(const ModelCache& cache, const std::string& path,
                  const ContainerAttributes& attributes = {});

// Where a ContainerWriter's bytes go.
class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual Status write(const void* data, size_t size) = 0;
  // Called once by ContainerWriter::finish() after the last byte (e.g. commit an atomic file).
  virtual Status close() { return ok_status(); }
};

class VectorByteSink final : public ByteSink {
 public:
  Status write(const void* data, size_t size) override;
  std::vector<uint8_t> bytes;
};

// Writes to a file descriptor the caller owns (a pipe, a socket, a file that a reader follows
// while it grows). Retries short writes and EINTR; does not close the descriptor.
class FdByteSink final : public ByteSink {
 public:
  explicit FdByteSink(int fd) : fd_(fd) {}
  Status write(const void* data, size_t size) override;

 private:
  int fd_;
};

// Writes a file atomically: bytes go to a temporary file next to `path`, renamed over `path` by
// close() (i.e. by ContainerWriter::finish()). Destroyed before that, it removes the temporary
// file and leaves any existing `path` untouched.
class AtomicFileByteSink final : public ByteSink {
 public:
  static Result<std::unique_ptr<AtomicFileByteSink>> open(const std::string& path);
  ~AtomicFileByteSink() override;
  Status write(const void* data, size_t size) override;
  Status close() override;

 private:
  struct Impl;
  explicit AtomicFileByteSink(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Streaming writer: chunks are appended as the cache grows. Every call takes the same cache (it
// may have grown in between; it must not have been trimmed into blocks already written — a
// stream cannot take chunks back — nor reset). Layer order of the file's chunks follows the calls.
class ContainerWriter {
 public:
  // Writes the file header and the META record. `out` must outlive the writer.
  static Result<ContainerWriter> start(const ModelCache& cache, ByteSink& out,
                                       const ContainerAttributes& attributes = {});
  // Appends every block sealed since the previous call, layer by layer. kInvalidArgument if a
  // layer now holds fewer blocks than were written (it was trimmed or reset).
  Status write_new_blocks(const ModelCache& cache);
  // Writes the remaining blocks, then every layer's window and state, the index and the END
  // record, and closes the sink. The writer accepts no call after it.
  Status finish(const ModelCache& cache);
  uint64_t bytes_written() const { return pos_; }

 private:
  ContainerWriter(ByteSink& out, int n_layers)
      : out_(&out), written_blocks_(static_cast<size_t>(n_layers), 0) {}
  Status check_cache(const ModelCache& cache) const;
  Status write_record(const uint8_t header[64], const uint8_t* payload, uint64_t size);
  Status write_chunk(int layer, int64_t batch, DType window_dtype, WindowFormat window_format,
                     const ChunkRef& c);

  struct IndexEntry {
    uint64_t offset;
    uint32_t layer;
    uint8_t kind, dtype;
    int64_t t0, tokens;
    uint64_t size, checksum;
  };
  ByteSink* out_;
  uint64_t pos_ = 0;
  bool failed_ = false, finished_ = false;
  std::vector<int64_t> written_blocks_;  // per layer: blocks already in the stream
  std::vector<int64_t> written_batch_;   // per layer: the batch size of those blocks
  std::vector<IndexEntry> index_;
  std::string meta_fingerprint_;  // the shape + spec the stream was started with
};

// ---- reading ----

// Parses and validates a whole file held in memory and builds its cache.
Result<ModelCache> parse_cache(const uint8_t* data, size_t size,
                               const ContainerLimits& limits = {});
// Reads `path` (any size up to the limits) and parses it.
Result<ModelCache> load_cache(const std::string& path, const ContainerLimits& limits = {});

// Streaming reader: feed bytes in any pieces (a pipe, a growing file). Records are checked as
// soon as they are complete; layer l is built as soon as its chunks and every earlier layer are
// complete, and its chunk bytes are then released. Errors are sticky: after one, feed() and
// finish() return it again.
class ContainerReader {
 public:
  explicit ContainerReader(const ContainerLimits& limits = {});
  ~ContainerReader();
  ContainerReader(ContainerReader&&) noexcept;
  ContainerReader& operator=(ContainerReader&&) noexcept;

  Status feed(const uint8_t* data, size_t size);
  // Call at the end of the input: kCorrupt ("truncated") unless the END record has been read.
  Status finish();
  // Whether the END record has been read and everything validated.
  bool done() const;
  uint64_t bytes_consumed() const;
  // The metadata, once the META record has been read (else nullptr).
  const ContainerMeta* meta() const;
  // Layers [0, layers_ready()) are built.
  int layers_ready() const;
  // The cache; only once done() (kInvalidArgument before). Moves it out.
  Result<ModelCache> take();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct ReadFdOptions {
  ContainerLimits limits;
  // A file still being written: at end of file, wait and read again instead of failing, until
  // the END record arrives or no byte has arrived for `idle_timeout_ms`.
  bool follow = false;
  int idle_timeout_ms = 10000;
  int poll_interval_ms = 5;
};
// Reads a container from a descriptor (pipe, socket, file) with a ContainerReader, returning the
// reader once done (meta() and take() then available).
Result<ContainerReader> read_container_fd(int fd, const ReadFdOptions& options = {});

// Structure of a file without building its cache: metadata and every chunk record, with each
// payload's checksum verified and recorded in ContainerChunk::checksum_ok (a mismatch is not an
// error here; any structural problem is).
struct ContainerInfo {
  ContainerMeta meta;
  std::vector<ContainerChunk> chunks;  // in file order
  std::vector<std::string> skipped;    // "TYPE at offset N" of skipped optional records
  uint64_t file_size = 0;
  bool checksums_ok() const;
};
Result<ContainerInfo> inspect_container(const uint8_t* data, size_t size,
                                        const ContainerLimits& limits = {});

// Random access through the index (docs/format.md §4): reads only the end record, the index and
// the metadata, and checks each chunk's record header against its index entry. Payloads are
// pointers into `data`, which must outlive the view; they sit at 64-byte-aligned offsets from
// `data` (so they are 64-byte aligned in memory when `data` is, e.g. a memory mapping).
class ContainerView {
 public:
  static Result<ContainerView> open(const uint8_t* data, size_t size,
                                    const ContainerLimits& limits = {});
  const ContainerMeta& meta() const { return meta_; }
  const std::vector<ContainerChunk>& chunks() const { return chunks_; }
  // Chunk i as a ChunkRef pointing into the file; the checksum is verified first (kCorrupt).
  Result<ChunkRef> chunk(size_t i) const;

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  ContainerMeta meta_;
  std::vector<ContainerChunk> chunks_;
};

}  // namespace kvq
