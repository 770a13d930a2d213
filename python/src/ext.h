// What the two halves of the module kvq._kvq share (kvq_ext.cc: caches, methods, container;
// store_ext.cc: the prefix store): kvq Status -> Python exceptions, byte buffers, and the
// Python-side ModelCache with its lock.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>

#include "kvq/cache.h"
#include "kvq/status.h"
#include "kvq/thread_pool.h"

namespace nb = nanobind;

namespace kvq {

// ---- errors ----

// One exception class per ErrorCode (index = code), created at import.
inline PyObject* g_error_base = nullptr;
inline PyObject* g_errors[11] = {};

// Raises the Python exception for a failed Status (the GIL must be held).
[[noreturn]] inline void raise_status(const Status& st) {
  const int code = static_cast<int>(st.code());
  PyErr_SetString((code > 0 && code < 11) ? g_errors[code] : g_error_base, st.message().c_str());
  throw nb::python_error();
}

inline void check(const Status& st) {
  if (!st.ok()) raise_status(st);
}

template <class T>
T unwrap(Result<T>&& r) {
  if (!r.ok()) raise_status(r.status());
  return std::move(r).value();
}

[[noreturn]] inline void raise_type_error(const std::string& message) {
  PyErr_SetString(PyExc_TypeError, message.c_str());
  throw nb::python_error();
}

// A contiguous byte view of any buffer-protocol object (bytes, bytearray, memoryview, numpy),
// held for the duration of a call (a bytearray cannot be resized while it is exported).
class Buffer {
 public:
  explicit Buffer(nb::handle obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      raise_type_error(std::string("expected a contiguous bytes-like object, got ") +
                       nb::inst_name(obj).c_str());
    }
  }
  ~Buffer() { PyBuffer_Release(&view_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(view_.buf); }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

// ---- caches ----

// A ModelCache with what its options point to (the thread pool) and the lock that serialises
// mutating calls from several Python threads.
struct PyModel {
  PyModel(ModelCache c, std::shared_ptr<ThreadPool> p) : pool(std::move(p)), cache(std::move(c)) {}
  std::shared_ptr<ThreadPool> pool;  // null: calls run on the calling thread
  ModelCache cache;
  mutable std::shared_mutex mu;
};

// Runs f without the GIL, under the cache's lock (shared for const calls, exclusive otherwise).
// The lock is always taken after the GIL is released, so a thread holding it never waits for the
// GIL and the two cannot deadlock.
template <class F>
auto run_shared(const PyModel& m, F&& f) {
  nb::gil_scoped_release release;
  std::shared_lock lock(m.mu);
  return f();
}
template <class F>
auto run_exclusive(PyModel& m, F&& f) {
  nb::gil_scoped_release release;
  std::unique_lock lock(m.mu);
  return f();
}

// The store's bindings (store_ext.cc), added to the module at import.
void bind_store(nb::module_& m);

}  // namespace kvq
