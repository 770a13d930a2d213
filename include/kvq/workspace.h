// kvq/workspace.h — scratch memory that callers own and reuse.
//
// Every temporary a cache needs on its append and attend paths (dequantized tiles, score rows,
// unpacked codes) comes from a Workspace, never from the heap directly: once a workspace has
// seen the largest call of a workload it allocates nothing more (flashinfer's plan/run idea,
// without the plan). A Workspace is a stack of aligned allocations released in frames:
//
//   Workspace::Frame frame(ws);            // everything allocated below is released at scope end
//   float* tile = ws.alloc<float>(T * D);  // 64-byte aligned, uninitialised
//
// A workspace grows by whole chunks; when a frame closes back to empty and the workspace is
// made of several chunks, it merges them into one of their total size, so a repeated workload
// settles on a single allocation. A Workspace is not thread-safe: one per thread (WorkspacePool
// hands them out).
//
// Scratch that is not a flat array (objects holding containers, such as the entropy coder's
// tables) lives in a workspace's persistent slots instead: persistent<T>() constructs one T per
// workspace on first use and returns the same object on every later call, so its containers keep
// their capacity and a warm caller allocates nothing. Frames do not release slots.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace kvq {

class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  template <class T>
  T* alloc(size_t n) {
    return static_cast<T*>(alloc_bytes(n * sizeof(T)));
  }
  void* alloc_bytes(size_t bytes);

  // Releases what was allocated after its construction when it goes out of scope.
  class Frame {
   public:
    explicit Frame(Workspace& ws) : ws_(ws), mark_(ws.mark()) {}
    ~Frame() { ws_.release_to(mark_); }
    Frame(const Frame&) = delete;
    Frame& operator=(const Frame&) = delete;

   private:
    Workspace& ws_;
    size_t mark_;
  };

  // The workspace's one T (default-constructed on first use; its state is whatever the last user
  // left, so callers reset what they read). A caller must not hold two references to the same
  // T at once expecting two objects: use one struct with two members instead.
  template <class T>
  T& persistent() {
    const void* key = &slot_tag<T>;
    for (auto& s : slots_)
      if (s.key == key) return static_cast<Slot<T>&>(*s.obj).value;
    auto obj = std::make_unique<Slot<T>>();
    T& value = obj->value;
    slots_.push_back({key, std::move(obj)});
    return value;
  }

  // Bytes reserved (the chunks' capacity).
  size_t capacity() const;
  // Heap allocations this workspace has made so far (tests check that warm paths make none).
  uint64_t allocations() const { return allocations_; }
  // Frees every chunk and destroys the persistent objects. Only valid with no open frame and no
  // reference to a persistent object in use.
  void release();

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  struct Chunk {
    std::unique_ptr<std::byte, Free> mem;
    size_t size = 0;
  };
  static Chunk new_chunk(size_t size);
  struct SlotBase {
    virtual ~SlotBase() = default;
  };
  template <class T>
  struct Slot final : SlotBase {
    T value{};
  };
  struct SlotEntry {
    const void* key;  // &slot_tag<T>: one address per type
    std::unique_ptr<SlotBase> obj;
  };
  template <class T>
  static constexpr char slot_tag = 0;
  size_t mark() const { return used_; }
  void release_to(size_t mark);

  std::vector<Chunk> chunks_;  // allocations are carved from the chunks in order
  size_t used_ = 0;            // bytes in use, counted over the chunks as if concatenated
  uint64_t allocations_ = 0;
  std::vector<SlotEntry> slots_;
};

// Workspaces for concurrent callers: acquire() returns one not in use (creating one only when
// more callers than ever before are active at once), release() gives it back.
class WorkspacePool {
 public:
  Workspace* acquire();
  void release(Workspace* ws);
  // Sum of the pooled workspaces' capacities.
  size_t capacity() const;

  // acquire() for a scope.
  class Lease {
   public:
    explicit Lease(WorkspacePool& p) : pool_(p), ws_(p.acquire()) {}
    ~Lease() { pool_.release(ws_); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Workspace& get() { return *ws_; }

   private:
    WorkspacePool& pool_;
    Workspace* ws_;
  };

 private:
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Workspace>> all_;
  std::vector<Workspace*> free_;
};

}  // namespace kvq
