#include "kvq/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVQ_CPU_RELAX() _mm_pause()
#else
#define KVQ_CPU_RELAX() ((void)0)
#endif

namespace kvq {

namespace {

thread_local bool tl_in_item = false;

// The claim counter packs the job's generation (high 32 bits) with the next item index (low 32
// bits): a worker that wakes up after its job ended sees another generation and claims nothing,
// so one job slot is reused without reference counting (and without allocating per call). A
// worker would have to sleep through 2^32 jobs to mistake one for another.
constexpr int kIndexBits = 32;
constexpr int64_t kMaxItems = (int64_t{1} << kIndexBits) - 1;
constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
constexpr uint64_t kGenMask = (uint64_t{1} << (64 - kIndexBits)) - 1;

}  // namespace

struct ThreadPool::Impl {
  std::mutex run_mu;  // one parallel_for at a time
  std::mutex mu;      // guards generation changes, fn, n, stopping
  std::condition_variable cv;
  std::atomic<uint64_t> generation{0};  // bumped per job (and at stop)
  std::atomic<uint64_t> ticket{0};      // generation << kIndexBits | next index
  std::atomic<int64_t> done{0};
  const FunctionRef* fn = nullptr;
  int64_t n = 0;
  bool stopping = false;
  std::vector<std::thread> workers;

  // Claims and runs items of generation `gen` until none is left.
  // `f` is dereferenced only after a claim of generation `gen` succeeded: the job is then alive.
  void run_items(uint64_t gen, const FunctionRef* f, int64_t count) {
    const bool outer = tl_in_item;
    tl_in_item = true;
    for (;;) {
      uint64_t t = ticket.load(std::memory_order_relaxed);
      if ((t >> kIndexBits) != (gen & kGenMask)) break;
      const int64_t i = static_cast<int64_t>(t & kIndexMask);
      if (i >= count) break;
      if (!ticket.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      (*f)(i);
      done.fetch_add(1, std::memory_order_release);
    }
    tl_in_item = outer;
  }

  void worker() {
    // A worker that starts late (after jobs, or after the pool began stopping) must not wait for
    // a generation that already came: it starts from 0 and checks `stopping` before waiting.
    uint64_t seen = 0;
    for (;;) {
      for (int spin = 0; spin < 2000 && generation.load(std::memory_order_acquire) == seen; ++spin)
        KVQ_CPU_RELAX();
      const FunctionRef* f;
      int64_t count;
      uint64_t gen;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock,
                [&] { return stopping || generation.load(std::memory_order_relaxed) != seen; });
        seen = gen = generation.load(std::memory_order_relaxed);
        if (stopping) return;
        f = fn;
        count = n;
      }
      if (f) run_items(gen, f, count);
    }
  }
};

ThreadPool::ThreadPool(int threads) : impl_(std::make_unique<Impl>()) {
  for (int t = 1; t < threads; ++t) impl_->workers.emplace_back([this] { impl_->worker(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
    impl_->generation.fetch_add(1, std::memory_order_release);
  }
  impl_->cv.notify_all();
  for (auto& w : impl_->workers) w.join();
}

int ThreadPool::threads() const { return static_cast<int>(impl_->workers.size()) + 1; }

bool ThreadPool::in_parallel_item() { return tl_in_item; }

void ThreadPool::parallel_for(int64_t n, FunctionRef fn) {
  if (n <= 0) return;
  if (n == 1 || tl_in_item || impl_->workers.empty()) {
    const bool outer = tl_in_item;
    tl_in_item = true;
    for (int64_t i = 0; i < n; ++i) fn(i);
    tl_in_item = outer;
    return;
  }
  if (n > kMaxItems) {  // the claim counter's index field
    for (int64_t base = 0; base < n; base += kMaxItems) {
      const int64_t len = std::min(kMaxItems, n - base);
      parallel_for(len, [&](int64_t i) { fn(base + i); });
    }
    return;
  }
  Impl& p = *impl_;
  std::lock_guard<std::mutex> run_lock(p.run_mu);
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    gen = p.generation.load(std::memory_order_relaxed) + 1;
    p.fn = &fn;
    p.n = n;
    p.done.store(0, std::memory_order_relaxed);
    p.ticket.store((gen & kGenMask) << kIndexBits, std::memory_order_relaxed);
    p.generation.store(gen, std::memory_order_release);
  }
  p.cv.notify_all();
  p.run_items(gen, &fn, n);
  // Every item was claimed; wait only for the ones still running on other threads.
  for (int spin = 0; p.done.load(std::memory_order_acquire) < n; ++spin) {
    if (spin < 4096) {
      KVQ_CPU_RELAX();
    } else {
      std::this_thread::yield();
    }
  }
  std::lock_guard<std::mutex> lock(p.mu);
  p.fn = nullptr;  // a late worker that reads it now sees no job
}

int hardware_threads() {
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

}  // namespace kvq
