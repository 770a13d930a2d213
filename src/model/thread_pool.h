// The engine's worker threads.
//
// Why not OpenMP regions: a forward pass has ~150 parallel regions per decoded token, and an
// OpenMP region ends with a barrier that waits for every thread of the team. On a machine shared
// with other jobs a worker is often descheduled, and each barrier then waits milliseconds for it:
// a SmolLM2 decode step measured 7x slower with two OpenMP threads than with one on a busy 2-core
// machine. Here the caller claims work items from the same atomic counter as the workers and
// returns as soon as every *claimed* item is done: a worker that wakes up late finds nothing left
// and costs nothing. When the machine is idle, workers are woken through a condition variable
// after a short spin, so small regions stay cheap.
#pragma once

#include <cstdint>
#include <functional>

namespace kvq::model {

// Runs fn(i) for every i in [0, n) on the caller and the pool's workers, and returns when all
// have finished. Items may run in any order and concurrently. Calls from inside a running item
// (nesting) run serially on that thread. n <= 1, or a pool of one thread, runs on the caller.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

// Threads used by parallel_for, the caller included (default: the hardware's concurrency).
int pool_threads();
// Sets the thread count (>= 1); takes effect for the next parallel_for. Not thread-safe with
// respect to concurrent parallel_for calls.
void set_pool_threads(int n);

}  // namespace kvq::model
