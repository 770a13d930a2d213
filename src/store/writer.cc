// StoreWriter: puts in a background thread with its own backend, so that storing the chunks a
// prefill completes overlaps the computation instead of delaying the first token.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "kvq/store.h"

namespace kvq {

namespace {
// Failures in a row after which the store is taken for gone and the rest is dropped: one failed
// object (e.g. too large for the server) does not stop the others; a dead server does.
constexpr int kFailuresToGiveUp = 2;
constexpr size_t kErrorsKept = 4;
}  // namespace

struct StoreWriter::Impl {
  std::string url;
  StoreOptions options;
  uint64_t max_queued = 0;
  std::unique_ptr<StoreBackend> backend;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<std::string, std::vector<uint8_t>>> queue;
  uint64_t queued_bytes = 0;
  bool busy = false, stop = false, dead = false;
  int failures_in_a_row = 0;
  Report report;
  std::thread thread;

  void fail(const std::string& line) {
    ++report.failed;
    if (report.errors.size() < kErrorsKept) report.errors.push_back(line);
    if (++failures_in_a_row >= kFailuresToGiveUp) dead = true;
  }

  // Runs without the lock: only this thread touches the backend.
  Status write(const std::string& key, const std::vector<uint8_t>& value) {
    if (!backend) {
      auto b = open_store(url, options);
      if (!b.ok()) return b.status();
      backend = std::move(b).value();
    }
    return backend->put(key, value);
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop, and nothing left
      auto item = std::move(queue.front());
      queue.pop_front();
      queued_bytes -= item.second.size();
      if (dead) {
        ++report.failed;
        cv.notify_all();
        continue;
      }
      busy = true;
      lock.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      const Status st = write(item.first, item.second);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      lock.lock();
      busy = false;
      report.busy_s += s;
      if (st.ok()) {
        failures_in_a_row = 0;
        ++report.objects;
        report.bytes += item.second.size();
      } else {
        fail(item.first + ": " + st.message());
      }
      cv.notify_all();
    }
  }
};

StoreWriter::StoreWriter(std::string url, StoreOptions options, uint64_t max_queued_bytes)
    : impl_(std::make_unique<Impl>()) {
  impl_->url = std::move(url);
  impl_->options = options;
  impl_->max_queued = max_queued_bytes;
  impl_->thread = std::thread([this] { impl_->run(); });
}

StoreWriter::~StoreWriter() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
}

void StoreWriter::put(std::string key, std::vector<uint8_t> value) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] {
    return impl_->queue.empty() || impl_->queued_bytes + value.size() <= impl_->max_queued;
  });
  impl_->queued_bytes += value.size();
  impl_->queue.emplace_back(std::move(key), std::move(value));
  impl_->cv.notify_all();
}

StoreWriter::Report StoreWriter::flush() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return impl_->queue.empty() && !impl_->busy; });
  return impl_->report;
}

}  // namespace kvq
