#include "model/thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVQ_CPU_RELAX() _mm_pause()
#else
#define KVQ_CPU_RELAX() ((void)0)
#endif

namespace kvq::model {

namespace {

thread_local bool tl_in_item = false;

// One parallel_for call. Workers that wake late may still hold it (shared_ptr) after the caller
// returned; they can then only find next >= n and never touch fn.
struct Job {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t n = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Claims and runs items until none is left.
void run_items(Job& job) {
  tl_in_item = true;
  for (;;) {
    const int64_t i = job.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job.n) break;
    (*job.fn)(i);
    job.done.fetch_add(1, std::memory_order_release);
  }
  tl_in_item = false;
}

class Pool {
 public:
  explicit Pool(int threads) { start(threads); }
  ~Pool() { stop(); }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void resize(int threads) {
    if (threads == this->threads()) return;
    stop();
    start(threads);
  }

  void run(int64_t n, const std::function<void(int64_t)>& fn) {
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      ++generation_;
    }
    cv_.notify_all();
    run_items(*job);
    // Every item was claimed; wait only for the ones still running on other threads.
    for (int spin = 0; job->done.load(std::memory_order_acquire) < n; ++spin) {
      if (spin < 4096) {
        KVQ_CPU_RELAX();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  void start(int threads) {
    stopping_ = false;
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this] { worker(); });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
    job_.reset();
  }

  void worker() {
    uint64_t seen = 0;
    for (;;) {
      // Spin a little before sleeping: back-to-back regions (a forward pass) then need no
      // wake-up through the kernel.
      for (int spin = 0; spin < 2000 && generation_.load(std::memory_order_acquire) == seen; ++spin)
        KVQ_CPU_RELAX();
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
        if (stopping_) return;
        job = job_;
      }
      if (job) run_items(*job);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  bool stopping_ = false;
  std::shared_ptr<Job> job_;
  std::vector<std::thread> workers_;
};

int default_threads() {
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

std::mutex g_pool_mu;
std::unique_ptr<Pool> g_pool;
int g_threads = 0;  // 0: default

Pool& pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  const int want = g_threads > 0 ? g_threads : default_threads();
  if (!g_pool) {
    g_pool = std::make_unique<Pool>(want);
  } else {
    g_pool->resize(want);
  }
  return *g_pool;
}

}  // namespace

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || tl_in_item || pool_threads() == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  pool().run(n, fn);
}

int pool_threads() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  return g_threads > 0 ? g_threads : default_threads();
}

void set_pool_threads(int n) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_threads = n < 1 ? 1 : n;
}

}  // namespace kvq::model
