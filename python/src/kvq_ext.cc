// kvq._kvq — Python bindings to kvq's public C++ API (include/kvq), nothing else.
//
// Tensors cross as nanobind ndarrays (DLPack or the buffer protocol): numpy arrays and torch
// tensors of any strides are viewed in place, never copied. A view carries the tensor's device;
// the cache refuses one it does not hold without touching its memory, so a CUDA tensor handed to
// a CPU cache is an error, not a crash.
//
// Errors: every kvq Status becomes an exception of a class per error code, a subclass of both
// kvq.Error and the Python exception it stands for (ValueError, OSError, ...), carrying kvq's
// message. Long calls release the GIL; a per-cache reader/writer lock keeps Python threads to
// the C++ contract (const calls may run concurrently, mutating calls may not).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "ext.h"
#include "kvq/cache.h"
#include "kvq/container.h"
#include "kvq/spec.h"
#include "kvq/status.h"
#include "kvq/tensor.h"
#include "kvq/thread_pool.h"
#include "kvq/version.h"

using namespace nb::literals;

namespace kvq {
namespace {

// ---- errors ----

struct ErrorClass {
  ErrorCode code;
  const char* name;
  PyObject* python_base;
  const char* doc;
};

// ---- tensors ----

using InArray = nb::ndarray<nb::ro>;  // any dtype, shape, strides and device; checked below
using OutArray = nb::ndarray<>;       // the same, writable

std::string dtype_text(nb::dlpack::dtype t) {
  const char* kind = "?";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int:
      kind = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      kind = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      kind = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      kind = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      kind = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      kind = "bool";
      break;
    default:  // the float8/6/4 formats and the rest: named by their code
      kind = "dlpack-code-";
      break;
  }
  std::string s = kind;
  if (s == "dlpack-code-") s += std::to_string(t.code) + "-bits-";
  s += std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

DType to_dtype(nb::dlpack::dtype t, const char* what) {
  const bool scalar = t.lanes == 1;
  if (scalar && t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 32)
    return DType::kF32;
  if (scalar && t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16)
    return DType::kF16;
  if (scalar && t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16)
    return DType::kBF16;
  raise_type_error(std::string(what) + " must be float32, float16 or bfloat16, got " +
                   dtype_text(t));
}

// The device a tensor says it lives on. Devices kvq has no name for are refused here; CPU and
// CUDA views go to the cache, which refuses one that is not its own.
Device to_device(int type, int id, const char* what) {
  if (type == nb::device::cpu::value) return Device::cpu();
  if (type == nb::device::cuda::value) return Device::cuda(id);
  raise_status(unsupported(std::string(what) + " is on DLPack device type " + std::to_string(type) +
                           "; kvq knows the CPU and CUDA devices"));
}

template <class View, class Array>
View to_view(const Array& a, const char* what) {
  if (a.ndim() != 4)
    raise_status(shape_mismatch(std::string(what) + " must be 4-D, logical [B, H, S, D], got " +
                                std::to_string(a.ndim()) + "-D"));
  View v;
  v.dtype = to_dtype(a.dtype(), what);
  v.device = to_device(a.device_type(), a.device_id(), what);
  for (size_t i = 0; i < 4; ++i) {
    v.shape[i] = static_cast<int64_t>(a.shape(i));
    v.strides[i] = a.stride(i);
  }
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  // kvq loads whole elements: a buffer at an address that is not a multiple of the element size
  // (numpy allows it for views of raw bytes) cannot be read as such.
  if (reinterpret_cast<uintptr_t>(v.data) % dtype_size(v.dtype) != 0)
    raise_status(invalid_argument(std::string(what) + " is not aligned to its element size (" +
                                  std::to_string(dtype_size(v.dtype)) + " bytes)"));
  return v;
}

TensorView in_view(const InArray& a, const char* what) { return to_view<TensorView>(a, what); }

MutTensorView out_view(const nb::object& obj, OutArray& holder, const char* what) {
  if (!nb::try_cast(obj, holder))
    raise_type_error(std::string(what) + " must be a writable array or tensor (numpy, torch, " +
                     "any DLPack producer), got " + nb::inst_name(obj).c_str());
  return to_view<MutTensorView>(holder, what);
}

// A new C-contiguous float32 numpy array of shape [B, H, S, D].
nb::object new_f32_array(int64_t b, int64_t h, int64_t s, int64_t d) {
  const size_t n = static_cast<size_t>(b * h * s * d);
  float* data = new float[n ? n : 1];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  const size_t shape[4] = {static_cast<size_t>(b), static_cast<size_t>(h), static_cast<size_t>(s),
                           static_cast<size_t>(d)};
  return nb::cast(nb::ndarray<nb::numpy, float, nb::ndim<4>>(data, 4, shape, owner));
}

// One layer of a PyModel. The Python object keeps its model alive (keep_alive in layer()).
struct PyLayer {
  PyModel* model;
  int index;
  LayerCache& get() const { return model->cache.layer(index); }
};

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0 && text.size() > 5 && text.size() < 10 &&
      text.find_first_not_of("0123456789", 5) == std::string::npos)
    return Device::cuda(std::stoi(text.substr(5)));
  raise_status(invalid_argument("unknown device '" + text + "' (expected cpu, cuda or cuda:N)"));
}

std::shared_ptr<ThreadPool> make_pool(int threads) {
  if (threads < 0)
    raise_status(invalid_argument("threads must be >= 0 (0: every hardware thread)"));
  if (threads == 0) threads = hardware_threads();
  return threads > 1 ? std::make_shared<ThreadPool>(threads) : nullptr;
}

void create_model(PyModel* self, const std::string& spec, const ModelShape& shape,
                  const LayerOverrides& overrides, const std::string& device, int threads) {
  CacheOptions options;
  options.device = parse_device(device);
  std::shared_ptr<ThreadPool> pool = make_pool(threads);
  options.pool = pool.get();
  Result<ModelCache> r = [&] {
    nb::gil_scoped_release release;
    return ModelCache::create(spec, shape, overrides, options);
  }();
  new (self) PyModel(unwrap(std::move(r)), std::move(pool));
}

void check_layer_index(const PyModel& m, int& i) {
  const int n = m.cache.n_layers();
  if (i < 0) i += n;
  if (i < 0 || i >= n) {
    PyErr_SetString(
        PyExc_IndexError,
        ("layer index out of range for a cache of " + std::to_string(n) + " layers").c_str());
    throw nb::python_error();
  }
}

// read() and read_exact(): into the given outputs, or into new float32 numpy arrays.
nb::tuple read_tokens(const PyLayer& l, bool exact, int64_t t0, int64_t n, nb::object k_out,
                      nb::object v_out) {
  const LayerCache& c = l.get();
  if (k_out.is_none() != v_out.is_none()) raise_type_error("give both k_out and v_out, or neither");
  // Checked here, before outputs are sized from the request, and without forming t0 + n (kvq's
  // own check computes it, which overflows for n near 2^63).
  const int64_t lo = exact ? c.exact_begin() : 0, offset = c.offset();
  if (t0 < lo || n < 0 || t0 > offset || n > offset - t0)
    raise_status(out_of_range(std::string(exact ? "read_exact" : "read") + " of " +
                              std::to_string(n) + " tokens from " + std::to_string(t0) +
                              " outside [" + std::to_string(lo) + ", " + std::to_string(offset) +
                              ")" + (exact ? " (exact values are held from exact_begin)" : "")));
  if (k_out.is_none()) {
    const LayerShape& s = c.shape();
    k_out = new_f32_array(c.batch(), s.n_kv_heads, n, s.head_dim);
    v_out = new_f32_array(c.batch(), s.n_kv_heads, n, s.head_dim);
  }
  OutArray kh, vh;
  const MutTensorView kv = out_view(k_out, kh, "k_out"), vv = out_view(v_out, vh, "v_out");
  check(run_shared(*l.model,
                   [&] { return exact ? c.read_exact(t0, n, kv, vv) : c.read(t0, n, kv, vv); }));
  return nb::make_tuple(k_out, v_out);
}

const char* param_type_name(ParamType t) {
  switch (t) {
    case ParamType::kInt:
      return "int";
    case ParamType::kFloat:
      return "float";
    case ParamType::kEnum:
      return "enum";
  }
  return "?";
}

// A parameter value as a Python int, float or str.
nb::object param_value(const ParamDef& p, double v) {
  switch (p.type) {
    case ParamType::kInt:
      return nb::int_(static_cast<int64_t>(v));
    case ParamType::kFloat:
      return nb::float_(v);
    case ParamType::kEnum:
      return nb::str(p.choices.at(static_cast<size_t>(v)).c_str());
  }
  return nb::none();
}

nb::object spec_value(const Spec& s, const ParamDef& p) {
  switch (p.type) {
    case ParamType::kInt:
      return nb::int_(s.get_int(p.name));
    case ParamType::kFloat:
      return nb::float_(s.get_float(p.name));
    case ParamType::kEnum:
      return nb::str(s.get_enum(p.name).c_str());
  }
  return nb::none();
}

nb::dict spec_params(const Spec& s) {
  nb::dict d;
  for (const ParamDef& p : s.method().params) d[p.name.c_str()] = spec_value(s, p);
  return d;
}

void make_errors(nb::module_& m) {
  g_error_base = PyErr_NewExceptionWithDoc(
      "kvq.Error",
      "Base of every error kvq reports. `code` names kvq's error code (e.g. 'shape_mismatch'); "
      "str(e) is kvq's message.",
      PyExc_Exception, nullptr);
  m.attr("Error") = nb::handle(g_error_base);
  const ErrorClass classes[] = {
      {ErrorCode::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError,
       "A parameter or spec string is wrong."},
      {ErrorCode::kShapeMismatch, "ShapeMismatchError", PyExc_ValueError,
       "Tensors with the wrong or disagreeing shapes (or strides)."},
      {ErrorCode::kNonFinite, "NonFiniteError", PyExc_ValueError, "NaN or Inf in an input tensor."},
      {ErrorCode::kOutOfRange, "OutOfRangeError", PyExc_ValueError,
       "A value or index outside what is representable or allowed."},
      {ErrorCode::kIo, "IoError", PyExc_OSError,
       "The operating system refused (open, read, write, rename), a missing file included."},
      {ErrorCode::kFormat, "FormatError", PyExc_ValueError,
       "Bytes are not in the expected format (magic, version, layout)."},
      {ErrorCode::kCorrupt, "CorruptError", PyExc_ValueError,
       "Bytes are in the format but inconsistent (checksum, lengths, symbols)."},
      {ErrorCode::kUnsupported, "UnsupportedError", PyExc_ValueError,
       "A valid request kvq does not implement (a device, a version)."},
      {ErrorCode::kNotFound, "NotFoundError", PyExc_ValueError,
       "A named thing (method, parameter) does not exist."},
      {ErrorCode::kLimit, "LimitError", PyExc_ValueError,
       "A resource limit would be exceeded (size, count)."},
  };
  auto make = [&](const char* name, PyObject* python_base, const char* doc, ErrorCode code) {
    PyObject* bases = PyTuple_Pack(2, g_error_base, python_base);
    PyObject* dict = PyDict_New();
    PyObject* code_name = PyUnicode_FromString(error_code_name(code));
    PyDict_SetItemString(dict, "code", code_name);
    Py_DECREF(code_name);
    const std::string qualified = std::string("kvq.") + name;
    PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, dict);
    Py_DECREF(bases);
    Py_DECREF(dict);
    if (!cls) throw nb::python_error();
    m.attr(name) = nb::handle(cls);
    return cls;
  };
  for (const ErrorClass& c : classes)
    g_errors[static_cast<int>(c.code)] = make(c.name, c.python_base, c.doc, c.code);
}

}  // namespace
}  // namespace kvq

NB_MODULE(_kvq, m) {
  using namespace kvq;
  m.doc() =
      "kvq's C++ library: KV-cache compression with one cache contract (include/kvq/cache.h).";
  m.attr("__version__") = KVQ_VERSION_STRING;
  make_errors(m);

  // ---- the method table ----
  nb::class_<ParamDef>(m, "Param", "One typed parameter of a method.")
      .def_ro("name", &ParamDef::name)
      .def_prop_ro(
          "type", [](const ParamDef& p) { return param_type_name(p.type); },
          "'int', 'float' or 'enum'.")
      .def_prop_ro(
          "default", [](const ParamDef& p) { return param_value(p, p.default_value); },
          "The default value (an int, float or str).")
      .def_prop_ro(
          "min",
          [](const ParamDef& p) {
            return p.type == ParamType::kEnum ? nb::none() : param_value(p, p.min);
          },
          "Inclusive lower bound (None for enums).")
      .def_prop_ro(
          "max",
          [](const ParamDef& p) {
            return p.type == ParamType::kEnum ? nb::none() : param_value(p, p.max);
          },
          "Inclusive upper bound (None for enums).")
      .def_ro("choices", &ParamDef::choices, "The allowed values of an enum (else empty).")
      .def_ro("doc", &ParamDef::doc)
      .def("__repr__", [](const ParamDef& p) {
        return "<kvq.Param " + p.name + ": " + param_type_name(p.type) + " = " +
               format_param_value(p, p.default_value) + ">";
      });

  nb::class_<BitStep>(m, "BitStep", "One step of a method's bit ladder (its test promises).")
      .def_ro("settings", &BitStep::settings)
      .def_ro("bits", &BitStep::bits)
      .def_ro("max_rel_error", &BitStep::max_rel_error);

  nb::class_<MethodDef>(m, "Method", "A row of kvq's method table.")
      .def_ro("id", &MethodDef::id, "Stable identity (never reused).")
      .def_ro("name", &MethodDef::name)
      .def_ro("summary", &MethodDef::summary)
      .def_ro("params", &MethodDef::params)
      .def_ro("test_settings", &MethodDef::test_settings,
              "Assignments that make blocks seal within a few dozen tokens.")
      .def_ro("bit_ladder", &MethodDef::bit_ladder)
      .def(
          // A Spec points at its table row, so it is built from the row, never from a copy.
          "test_spec", [](const MethodDef& d) { return test_spec(*find_method_by_id(d.id)); },
          "The defaults with test_settings applied (small windows and blocks).")
      .def(
          "params_markdown", [](const MethodDef& d) { return params_markdown(d); },
          "The parameter table as Markdown, as the method's documentation page carries it.")
      .def("__repr__", [](const MethodDef& d) { return "<kvq.Method " + d.name + ">"; });

  m.def(
      "methods",
      [] {
        nb::list rows;
        for (const MethodDef& d : method_table())
          rows.append(nb::cast(&d, nb::rv_policy::reference));
        return rows;
      },
      nb::sig("def methods() -> list[Method]"), "Every method of kvq's table, in its fixed order.");
  m.def(
      "find_method", [](std::string_view name) { return find_method(name); },
      nb::rv_policy::reference, "name"_a, nb::sig("def find_method(name: str) -> Method | None"),
      "The method called `name`, or None.");

  nb::class_<Spec>(m, "Spec",
                   "A method with one validated value per parameter. str() is the canonical form.")
      .def(
          "__init__",
          [](Spec* self, std::string_view text) { new (self) Spec(unwrap(parse_spec(text))); },
          "text"_a,
          "Parses and validates a spec string ('kivi:k_bits=2'); kvq's messages name the closest "
          "valid method or parameter.")
      .def_prop_ro(
          "method", [](const Spec& s) { return &s.method(); }, nb::rv_policy::reference)
      .def_prop_ro("method_name", &Spec::method_name)
      .def_prop_ro("params", &spec_params,
                   nb::for_getter(nb::sig("def params(self, /) -> dict[str, int | float | str]")),
                   "Every parameter's value, in table order.")
      .def(
          "get",
          [](const Spec& s, std::string_view name) {
            const int i = s.method().find_param(name);
            if (i < 0)
              raise_status(not_found("method " + s.method_name() + " has no parameter '" +
                                     std::string(name) + "'"));
            return spec_value(s, s.method().params[static_cast<size_t>(i)]);
          },
          "name"_a, "One parameter's value.")
      .def(
          "apply",
          [](const Spec& s, std::string_view assignments) {
            Spec copy = s;
            check(copy.apply(assignments));
            return copy;
          },
          "assignments"_a, "A copy with 'k=v,k=v' applied (then the cross-parameter check).")
      .def("diff_from", &Spec::diff_from, "base"_a,
           "'k=v,...' for the parameters that differ from `base` (same method).")
      .def("to_string", &Spec::to_string)
      .def("__str__", &Spec::to_string)
      .def("__repr__", [](const Spec& s) { return "kvq.Spec('" + s.to_string() + "')"; })
      .def("__eq__", [](const Spec& a, const Spec& b) { return a == b; })
      .def("__hash__", [](const Spec& s) { return nb::hash(nb::str(s.to_string().c_str())); });

  m.def(
      "parse_spec", [](std::string_view text) { return unwrap(parse_spec(text)); }, "text"_a,
      "Parses and validates a method spec string (no per-layer overrides).");
  m.def(
      "parse_model_spec",
      [](std::string_view text) {
        ModelSpec ms = unwrap(parse_model_spec(text));
        return nb::make_tuple(ms.spec, ms.overrides);
      },
      "text"_a, nb::sig("def parse_model_spec(text: str) -> tuple[Spec, dict[int, str]]"),
      "Parses a model spec 'method:k=v@L:k=v@A-B:k=v' into (Spec, {layer: 'k=v,...'}), "
      "overrides merged and canonical.");

  // ---- shapes and accounting ----
  nb::enum_<RopeShape::Mode>(m, "RopeMode",
                             "How the model pairs channels for RoPE (kvq/cache.h RopeShape).")
      .value("none", RopeShape::Mode::kNone, "no RoPE, or unknown")
      .value("adjacent", RopeShape::Mode::kAdjacent, "pairs (2i, 2i+1): llama.cpp, llama2.c")
      .value("half", RopeShape::Mode::kHalf, "pairs (i, i+D/2): Hugging Face's rotate_half");
  nb::class_<RopeShape>(m, "RopeShape",
                        "The rotary embedding the keys carry: methods that quantize keys "
                        "before RoPE (kvq's own) undo and redo it.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](RopeShape* self, RopeShape::Mode mode, double theta, double freq_scale) {
            new (self) RopeShape{mode, theta, freq_scale};
          },
          "mode"_a, "theta"_a = 10000.0, "freq_scale"_a = 1.0)
      .def_rw("mode", &RopeShape::mode)
      .def_rw("theta", &RopeShape::theta)
      .def_rw("freq_scale", &RopeShape::freq_scale)
      .def("__repr__", [](const RopeShape& r) {
        return "kvq.RopeShape(mode=" + std::to_string(static_cast<int>(r.mode)) +
               ", theta=" + std::to_string(r.theta) +
               ", freq_scale=" + std::to_string(r.freq_scale) + ")";
      });
  nb::class_<LayerShape>(m, "LayerShape", "Shape of one attention layer.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](LayerShape* self, int n_kv_heads, int head_dim, int n_q_heads, RopeShape rope) {
            new (self) LayerShape{n_kv_heads, head_dim, n_q_heads, rope};
          },
          "n_kv_heads"_a, "head_dim"_a, "n_q_heads"_a = 0, "rope"_a = RopeShape{})
      .def_rw("n_kv_heads", &LayerShape::n_kv_heads)
      .def_rw("head_dim", &LayerShape::head_dim)
      .def_rw("n_q_heads", &LayerShape::n_q_heads,
              "Query heads, a multiple of n_kv_heads (GQA); 0 means n_kv_heads.")
      .def_rw("rope", &LayerShape::rope)
      .def("__repr__", [](const LayerShape& s) {
        return "kvq.LayerShape(n_kv_heads=" + std::to_string(s.n_kv_heads) +
               ", head_dim=" + std::to_string(s.head_dim) +
               ", n_q_heads=" + std::to_string(s.n_q_heads) + ")";
      });

  nb::class_<ModelShape>(m, "ModelShape",
                         "Shape of a model's attention layers: one LayerShape for every layer, or "
                         "one per layer.")
      .def(
          "__init__",
          [](ModelShape* self, int n_layers, int n_kv_heads, int head_dim, int n_q_heads,
             RopeShape rope) {
            new (self)
                ModelShape(ModelShape::uniform(n_layers, n_kv_heads, head_dim, n_q_heads, rope));
          },
          "n_layers"_a, "n_kv_heads"_a, "head_dim"_a, "n_q_heads"_a = 0, "rope"_a = RopeShape{},
          "Every layer of the same shape.")
      .def(
          "__init__",
          [](ModelShape* self, const std::vector<LayerShape>& per_layer) {
            new (self) ModelShape();
            self->n_layers = static_cast<int>(per_layer.size());
            if (!per_layer.empty()) self->layer = per_layer.front();
            self->per_layer = per_layer;
          },
          "per_layer"_a, "One LayerShape per layer.")
      .def_rw("n_layers", &ModelShape::n_layers)
      .def_rw("layer", &ModelShape::layer)
      .def_rw("per_layer", &ModelShape::per_layer)
      .def(
          "at",
          [](const ModelShape& s, int i) {
            if (i < 0 || i >= s.n_layers ||
                (!s.per_layer.empty() && i >= static_cast<int>(s.per_layer.size()))) {
              PyErr_SetString(PyExc_IndexError, "layer index out of range");
              throw nb::python_error();
            }
            return s.at(i);
          },
          "i"_a, "Layer i's shape.");

  nb::class_<CacheBytes>(
      m, "CacheBytes", "What a cache holds, in bytes, by kind; every byte is in exactly one field.")
      .def_ro("key_codes", &CacheBytes::key_codes, "Packed (or entropy-coded) key codes.")
      .def_ro("value_codes", &CacheBytes::value_codes, "Packed (or entropy-coded) value codes.")
      .def_ro("params", &CacheBytes::params, "Scales and zero points (fp16).")
      .def_ro("residual", &CacheBytes::residual, "The fp16 residual window (pages, K and V).")
      .def_ro("meta", &CacheBytes::meta, "Masks, coder tables, stream headers, probes, ...")
      .def_ro("tables", &CacheBytes::tables,
              "Lookup tables derived from the shape (kvq's RoPE angles): held, never stored.")
      .def_ro("elements", &CacheBytes::elements, "K and V elements represented.")
      .def_prop_ro("total", &CacheBytes::total, "Every byte held.")
      .def_prop_ro("stored", &CacheBytes::stored, "The stored format's bytes (total - tables).")
      .def_prop_ro("fp16_bytes", &CacheBytes::fp16_bytes, "What an fp16 cache would hold.")
      .def_prop_ro("bits_per_element", &CacheBytes::bits_per_element,
                   "All-in bits per element (every stored byte / elements represented).")
      .def_prop_ro("compression_ratio", &CacheBytes::compression_ratio,
                   "fp16 bytes / bytes held (0 when empty).")
      .def("as_dict",
           [](const CacheBytes& b) {
             nb::dict d;
             d["key_codes"] = b.key_codes;
             d["value_codes"] = b.value_codes;
             d["params"] = b.params;
             d["residual"] = b.residual;
             d["meta"] = b.meta;
             d["tables"] = b.tables;
             d["elements"] = b.elements;
             d["total"] = b.total();
             d["bits_per_element"] = b.bits_per_element();
             return d;
           })
      .def("__repr__", [](const CacheBytes& b) {
        return "<kvq.CacheBytes total=" + std::to_string(b.total()) +
               " elements=" + std::to_string(b.elements) + ">";
      });

  // ---- the cache ----
  nb::class_<PyLayer>(m, "LayerCache",
                      "The cache of one attention layer (kvq::LayerCache); keeps its ModelCache "
                      "alive. K/V/Q are logical [B, H, S, D] of float32, float16 or bfloat16, any "
                      "strides (torch's [B, H, S, D] and views of [B, S, H, D] alike).")
      .def(
          "append",
          [](const PyLayer& l, const InArray& k, const InArray& v, std::optional<InArray> q) {
            const TensorView kv = in_view(k, "k"), vv = in_view(v, "v");
            TensorView qv;
            if (q) qv = in_view(*q, "q");
            check(
                run_exclusive(*l.model, [&] { return l.get().append(kv, vv, q ? &qv : nullptr); }));
          },
          "k"_a, "v"_a, "q"_a = nb::none(),
          "Appends keys and values of S_new tokens, [B, H_kv, S_new, D]; `q`: their queries "
          "[B, H_q, S_new, D] after RoPE, for methods that rank tokens by attention. On error "
          "nothing changes.")
      .def(
          "attend",
          [](const PyLayer& l, const InArray& q, float scale, nb::object out, int kv_head_begin,
             int kv_head_end) {
            const TensorView qv = in_view(q, "q");
            if (out.is_none()) {
              // The default output is a numpy array: host memory, for host queries only.
              check(require_device(qv, Device::cpu(), "q (with `out` omitted)"));
              out = new_f32_array(qv.shape[0], qv.shape[1], qv.shape[2], qv.shape[3]);
            }
            OutArray oh;
            const MutTensorView ov = out_view(out, oh, "out");
            check(run_shared(*l.model, [&] {
              return l.get().attend(qv, scale, ov, kv_head_begin, kv_head_end);
            }));
            return out;
          },
          "q"_a, "scale"_a, "out"_a = nb::none(), "kv_head_begin"_a = 0, "kv_head_end"_a = -1,
          "Causal attention of the newest T = q.shape[2] tokens' queries [B, H_q, T, D] against "
          "everything held, dequantizing inside the dot products, under the per-query semantics "
          "(query t at position offset - T + t sees the blocks sealed by then, dequantized, and "
          "every newer token exact). `out`: float32 [B, H_q, T, D], any strides (omitted: a new "
          "numpy array, for CPU queries); returned.")
      .def(
          "read",
          [](const PyLayer& l, int64_t t0, int64_t n, nb::object k_out, nb::object v_out) {
            return read_tokens(l, false, t0, n, std::move(k_out), std::move(v_out));
          },
          "t0"_a, "n"_a, "k_out"_a = nb::none(), "v_out"_a = nb::none(),
          nb::sig("def read(self, t0: int, n: int, k_out: object | None = None, "
                  "v_out: object | None = None) -> tuple[object, object]"),
          "Keys and values of tokens [t0, t0 + n) as stored (sealed blocks dequantized), into "
          "k_out, v_out [B, H_kv, n, D] of any float dtype and strides, or into new float32 numpy "
          "arrays. Returns (k_out, v_out).")
      .def(
          "read_exact",
          [](const PyLayer& l, int64_t t0, int64_t n, nb::object k_out, nb::object v_out) {
            return read_tokens(l, true, t0, n, std::move(k_out), std::move(v_out));
          },
          "t0"_a, "n"_a, "k_out"_a = nb::none(), "v_out"_a = nb::none(),
          nb::sig("def read_exact(self, t0: int, n: int, k_out: object | None = None, "
                  "v_out: object | None = None) -> tuple[object, object]"),
          "Exact values (as the window stores them) of tokens [t0, t0 + n), t0 >= exact_begin; "
          "outputs as read().")
      .def(
          "sealed_tokens_for_query",
          [](const PyLayer& l, int64_t p) {
            std::shared_lock lock(l.model->mu);
            const LayerCache& c = l.get();
            if (p < 0 || p >= c.offset())
              raise_status(out_of_range("query position " + std::to_string(p) +
                                        " outside the tokens held [0, " +
                                        std::to_string(c.offset()) + ")"));
            return c.sealed_tokens_for_query(p);
          },
          "p"_a,
          "The seal boundary the query at position p sees: tokens below it come from read(), "
          "tokens from it to p from read_exact().")
      .def(
          "trim",
          [](const PyLayer& l, int64_t n) {
            check(run_exclusive(*l.model, [&] { return l.get().trim(n); }));
          },
          "n"_a, "Removes the newest n tokens (0 <= n <= offset).")
      .def(
          "reset", [](const PyLayer& l) { run_exclusive(*l.model, [&] { l.get().reset(); }); },
          "Drops everything (the batch size may change on the next append).")
      .def(
          "bytes",
          [](const PyLayer& l) { return run_shared(*l.model, [&] { return l.get().bytes(); }); },
          "Accounting of everything held, by kind.")
      .def(
          "resident_bytes",
          [](const PyLayer& l) {
            return run_shared(*l.model, [&] { return l.get().resident_bytes(); });
          },
          "Bytes of the buffers allocated for K/V data, measured (== bytes().total).")
      .def(
          "workspace_bytes",
          [](const PyLayer& l) {
            return run_shared(*l.model, [&] { return l.get().workspace_bytes(); });
          },
          "Transient exact values kept for the last append's queries (not state).")
      .def_prop_ro("index", [](const PyLayer& l) { return l.index; })
      .def_prop_ro(
          "offset",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            return l.get().offset();
          },
          "Tokens held.")
      .def_prop_ro(
          "sealed_tokens",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            return l.get().sealed_tokens();
          },
          "Tokens [0, sealed_tokens) are held compressed; the rest in the fp16 window.")
      .def_prop_ro(
          "block_tokens",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            return l.get().block_tokens();
          },
          "Tokens per sealed block (T).")
      .def_prop_ro(
          "residual",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            return l.get().residual();
          },
          "The residual window (R): block i seals at offset (i + 1) T + R.")
      .def_prop_ro(
          "last_append_tokens",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            return l.get().last_append_tokens();
          },
          "Tokens of the last append (0 after trim, reset, load or clone).")
      .def_prop_ro(
          "exact_begin",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            return l.get().exact_begin();
          },
          "First token whose exact value the cache still holds.")
      .def_prop_ro(
          "batch",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            return l.get().batch();
          },
          "The batch size fixed by the first append (0 when empty).")
      .def_prop_ro(
          "n_blocks",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            return l.get().n_blocks();
          },
          "Sealed blocks held.")
      .def_prop_ro(
          "window_dtype",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            if (l.get().window_format() == WindowFormat::kQ8) return std::string("q8");
            return std::string(dtype_name(l.get().window_dtype()));
          },
          "'f16', 'bf16' when the first append was bfloat16, or 'q8' (8-bit rows with an fp16 "
          "scale per 32 values: kvq's window=q8).")
      .def_prop_ro(
          "shape", [](const PyLayer& l) { return l.get().shape(); }, "The layer's LayerShape.")
      .def_prop_ro(
          "spec", [](const PyLayer& l) { return l.get().spec(); },
          "The layer's canonical spec (after per-layer overrides).")
      .def(
          "stats",
          [](const PyLayer& l) {
            std::shared_lock lock(l.model->mu);
            return l.get().stats();
          },
          "Method-specific counters as 'key=value' lines.")
      .def("__repr__", [](const PyLayer& l) {
        std::shared_lock lock(l.model->mu);
        return "<kvq.LayerCache " + std::to_string(l.index) + " of " +
               l.model->cache.spec().method_name() + ", " + std::to_string(l.get().offset()) +
               " tokens>";
      });

  nb::class_<PyModel>(m, "ModelCache",
                      "One LayerCache per layer, built from a spec string and a model shape "
                      "(kvq::ModelCache).")
      .def("__init__", &create_model, "spec"_a, "shape"_a, "overrides"_a = LayerOverrides{},
           "device"_a = "cpu", "threads"_a = 1,
           "Builds every layer. `spec` may carry per-layer overrides after '@' "
           "('kivi:k_bits=2@0-3:k_bits=4'); `overrides` ({layer: 'k=v,...'}) apply after them. "
           "`device`: 'cpu' (kvq has no CUDA backend yet: other devices are refused). `threads`: "
           "threads for work inside a call (1: the calling thread only; 0: every hardware "
           "thread).")
      .def_prop_ro("n_layers", [](const PyModel& c) { return c.cache.n_layers(); })
      .def("__len__", [](const PyModel& c) { return c.cache.n_layers(); })
      .def(
          "layer",
          [](PyModel& c, int i) {
            check_layer_index(c, i);
            return PyLayer{&c, i};
          },
          "i"_a, nb::keep_alive<0, 1>(), "Layer i (negative counts from the end).")
      .def(
          "__getitem__",
          [](PyModel& c, int i) {
            check_layer_index(c, i);
            return PyLayer{&c, i};
          },
          "i"_a, nb::keep_alive<0, 1>())
      .def_prop_ro(
          "spec", [](const PyModel& c) { return c.cache.spec(); }, "The model's method Spec.")
      .def_prop_ro(
          "model_spec", [](const PyModel& c) { return c.cache.model_spec().to_string(); },
          "The canonical model spec, per-layer overrides included.")
      .def_prop_ro("shape", [](const PyModel& c) { return c.cache.shape(); })
      .def_prop_ro("device", [](const PyModel& c) { return device_name(c.cache.options().device); })
      .def_prop_ro("threads", [](const PyModel& c) { return c.pool ? c.pool->threads() : 1; })
      .def_prop_ro(
          "offset",
          [](const PyModel& c) {
            std::shared_lock lock(c.mu);
            return c.cache.offset();
          },
          "Tokens held by layer 0.")
      .def(
          "trim",
          [](PyModel& c, int64_t n) { check(run_exclusive(c, [&] { return c.cache.trim(n); })); },
          "n"_a, "Trims every layer by n tokens (validated for all layers before any changes).")
      .def(
          "reset", [](PyModel& c) { run_exclusive(c, [&] { c.cache.reset(); }); },
          "Drops everything in every layer.")
      .def(
          "clone",
          [](const PyModel& c) {
            return run_shared(c,
                              [&] { return std::make_unique<PyModel>(c.cache.clone(), c.pool); });
          },
          "A deep copy (shared state between layers copied once); shares the thread pool.")
      .def(
          "bytes", [](const PyModel& c) { return run_shared(c, [&] { return c.cache.bytes(); }); },
          "Accounting of everything held, summed over layers.")
      .def(
          "resident_bytes",
          [](const PyModel& c) { return run_shared(c, [&] { return c.cache.resident_bytes(); }); },
          "Bytes of the buffers allocated for K/V data, measured (== bytes().total).")
      .def(
          "workspace_bytes",
          [](const PyModel& c) { return run_shared(c, [&] { return c.cache.workspace_bytes(); }); })
      .def("__repr__", [](const PyModel& c) {
        std::shared_lock lock(c.mu);
        return "<kvq.ModelCache " + c.cache.model_spec().to_string() + ", " +
               std::to_string(c.cache.n_layers()) + " layers, " + std::to_string(c.cache.offset()) +
               " tokens>";
      });

  // ---- the .kvq container ----
  m.def(
      "save_cache",
      [](const PyModel& c, const std::filesystem::path& path,
         const ContainerAttributes& attributes) {
        const std::string p = path.string();
        check(run_shared(c, [&] { return save_cache(c.cache, p, attributes); }));
      },
      "cache"_a, "path"_a, "attributes"_a = ContainerAttributes{},
      "Writes the cache to a .kvq file atomically (a failure never replaces an existing file).");
  m.def(
      "load_cache",
      [](const std::filesystem::path& path) {
        const std::string p = path.string();
        Result<ModelCache> r = [&] {
          nb::gil_scoped_release release;
          return load_cache(p);
        }();
        return std::make_unique<PyModel>(unwrap(std::move(r)), nullptr);
      },
      "path"_a,
      "Reads a .kvq file (every byte validated) into a CPU cache with bit-identical contents; it "
      "runs on the calling thread (the container API builds caches with default options).");
  m.def(
      "serialize_cache",
      [](const PyModel& c, const ContainerAttributes& attributes) {
        std::vector<uint8_t> bytes =
            unwrap(run_shared(c, [&] { return serialize_cache(c.cache, attributes); }));
        return nb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      },
      "cache"_a, "attributes"_a = ContainerAttributes{}, "The .kvq file's bytes.");
  m.def(
      "parse_cache",
      [](nb::handle data) {
        Buffer buf(data);
        Result<ModelCache> r = [&] {
          nb::gil_scoped_release release;
          return parse_cache(buf.data(), buf.size());
        }();
        return std::make_unique<PyModel>(unwrap(std::move(r)), nullptr);
      },
      "data"_a, "Parses a .kvq file held in memory (any bytes-like object).");
  m.def(
      "hardware_threads", [] { return hardware_threads(); }, "The hardware's concurrency.");

  // ---- the prefix store (store_ext.cc) ----
  bind_store(m);
}
