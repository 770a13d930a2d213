// kvq/thread_pool.h — the worker threads kvq's caches (and its engine) run parallel work on.
//
// A ThreadPool of n threads runs parallel_for(count, fn) on the caller plus n - 1 workers. The
// caller claims items from the same counter as the workers and returns as soon as every claimed
// item is done, so a worker that wakes up late (a busy machine deschedules threads for
// milliseconds) finds nothing left and costs nothing: no barrier waits for a sleeping thread.
// Workers spin briefly before sleeping on a condition variable, so back-to-back regions (a
// forward pass has hundreds) need no wake-up through the kernel.
//
// parallel_for allocates nothing: `fn` is passed by reference (FunctionRef), the job lives in the
// pool. One parallel_for runs at a time per pool (concurrent callers take turns); a call from
// inside a running item (nesting) runs its items serially on that thread.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

namespace kvq {

// A non-owning reference to a callable `void(int64_t)`; the callable must outlive the call.
class FunctionRef {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef>>>
  FunctionRef(F&& f)  // NOLINT(google-explicit-constructor): a reference, like std::function_ref
      : obj_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o, int64_t i) { (*static_cast<std::remove_reference_t<F>*>(o))(i); }) {}
  void operator()(int64_t i) const { call_(obj_, i); }

 private:
  void* obj_;
  void (*call_)(void*, int64_t);
};

class ThreadPool {
 public:
  // threads >= 1 (the caller counts as one); values below 1 mean 1.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const;
  // Runs fn(i) for every i in [0, n), in any order and concurrently, and returns when all have
  // finished. n <= 1, a pool of one thread, or a nested call runs on the calling thread.
  void parallel_for(int64_t n, FunctionRef fn);

  // True while the calling thread is running an item of some pool's parallel_for.
  static bool in_parallel_item();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The hardware's concurrency (at least 1).
int hardware_threads();

}  // namespace kvq
