#include "call_options.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include <nanobind/stl/string.h>

#include "pagedattn/errors.hpp"

namespace pagedattn::py {
namespace {

const char* type_of(nb::handle v) { return Py_TYPE(v.ptr())->tp_name; }

// "float inf", "str 'abc'": a value's type and (shortened) repr, for messages.
std::string what_is(nb::handle v) {
  std::string r;
  try {
    r = nb::cast<std::string>(nb::repr(v));
  } catch (const nb::python_error&) {
    r = "?";
  }
  if (r.size() > 60) r = r.substr(0, 57) + "...";
  return detail::concat(type_of(v), " ", r);
}

}  // namespace

// A number as the float32 the options hold. A number float32 cannot hold is refused rather
// than changed in meaning: an int past the double range, or a nonzero value that would
// round to 0 (a soft cap of 1e-50 would silently turn the cap off). Past the float32 range
// it becomes inf, which the option's own check refuses ("must be finite").
float float_arg(nb::handle v, const char* name) {
  if (!PyBool_Check(v.ptr()) && (PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr()) || PyNumber_Check(v.ptr()))) {
    const double d = PyFloat_AsDouble(v.ptr());
    if (!(d == -1.0 && PyErr_Occurred())) {
      const float f = static_cast<float>(d);
      if (f == 0.0f && d != 0.0)
        fail<InvalidArgument>(name, ": ", what_is(v), " is too small for float32 (it would round to 0)");
      return f;
    }
    if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
      PyErr_Clear();
      fail<InvalidArgument>(name, ": ", what_is(v), " is outside the float32 range (magnitude at most ",
                            std::numeric_limits<float>::max(), ")");
    }
    PyErr_Clear();
  }
  fail<TypeMismatch>(name, ": expected a float, got ", what_is(v));
}

namespace {

bool as_bool(nb::handle v, const char* name) {
  if (PyBool_Check(v.ptr())) return v.ptr() == Py_True;
  if (std::strcmp(type_of(v), "numpy.bool") == 0 || std::strcmp(type_of(v), "numpy.bool_") == 0)
    return PyObject_IsTrue(v.ptr()) == 1;
  fail<TypeMismatch>(name, ": expected True or False, got ", what_is(v));
}

struct Keyword {
  const char* name;
  unsigned sets;
  const char* type;  // in the generated signature
  const char* default_value;
  const char* doc;
  void (*set)(CallKeywords& k, nb::handle v, const char* name);
};

constexpr unsigned kAll = kDecodeCall | kDecodeQuery | kCacheWrite;
constexpr unsigned kDecode = kDecodeCall | kDecodeQuery;

// The one table of keyword options.
const Keyword kKeywords[] = {
    {"out", kDecodeCall, "Any", "None", "output array [S, H, D] to write (default: a new array like query)",
     [](CallKeywords& k, nb::handle v, const char*) { k.out = v; }},
    {"scale", kDecode, "float | None", "None", "softmax scale (default 1 / sqrt(head_size))",
     [](CallKeywords& k, nb::handle v, const char* n) {
       k.options.scale = v.is_none() ? std::nullopt : std::optional<float>(float_arg(v, n));
     }},
    {"alibi_slopes", kDecodeCall, "Any", "None", "float32 [H]: adds slope[h] * (t - seq_len + 1) to token t's logit",
     [](CallKeywords& k, nb::handle v, const char*) { k.alibi_slopes = v; }},
    {"kv_cache_dtype", kAll, "str", "'auto'",
     "'auto' (the caches hold the query's dtype), 'fp8_e4m3' or 'fp8_e5m2' (uint8 caches)",
     [](CallKeywords& k, nb::handle v, const char* n) {
       k.options.kv_cache_dtype = parse_kv_cache_dtype(str_arg(v, n), n);
     }},
    {"k_scale", kAll, "float", "1.0", "fp8 caches: real key = stored value * k_scale",
     [](CallKeywords& k, nb::handle v, const char* n) { k.options.k_scale = float_arg(v, n); }},
    {"v_scale", kAll, "float", "1.0", "fp8 caches: real value = stored value * v_scale",
     [](CallKeywords& k, nb::handle v, const char* n) { k.options.v_scale = float_arg(v, n); }},
    {"kernel", kDecode, "str", "'auto'", "CUDA decode kernel: 'auto', 'single_pass' or 'partitioned'",
     [](CallKeywords& k, nb::handle v, const char* n) { k.options.kernel = parse_decode_kernel(str_arg(v, n), n); }},
    {"partition_size", kDecode, "int", "0", "CUDA, partitioned kernel: tokens per partition (0: the planner's)",
     [](CallKeywords& k, nb::handle v, const char* n) { k.options.partition_size = int_arg(v, n); }},
    {"workspace", kDecodeCall, "Any", "None",
     "CUDA scratch for the partitioned kernel (decode_workspace_size bytes; default: a pool per stream)",
     [](CallKeywords& k, nb::handle v, const char*) { k.workspace = v; }},
    {"check_block_tables", kDecode, "bool", "False", "CUDA: raise on out-of-range block ids (synchronises)",
     [](CallKeywords& k, nb::handle v, const char* n) { k.options.check_block_tables = as_bool(v, n); }},
    {"query_start_loc", kDecodeCall, "Any", "None",
     "int32 [S + 1]: varlen queries (chunked prefill, mixed batches); query and out are then [T, H, D] and "
     "sequence i owns rows query_start_loc[i] .. query_start_loc[i + 1], its last tokens (causal)",
     [](CallKeywords& k, nb::handle v, const char*) { k.query_start_loc = v; }},
    {"max_query_len", kDecodeCall, "int | None", "None",
     "with query_start_loc: a host-side bound on every sequence's query rows (1 with T = S: the decode kernels; "
     "sizes the CUDA-core kernel's grid; default T)",
     [](CallKeywords& k, nb::handle v, const char* n) {
       k.options.max_query_len = v.is_none() ? std::nullopt : std::optional<int>(int_arg(v, n));
     }},
    {"sliding_window", kDecode, "int", "0",
     "tokens (0 = off): the query at position p attends to keys max(0, p - W + 1) .. p; earlier blocks are not read",
     [](CallKeywords& k, nb::handle v, const char* n) { k.options.sliding_window = int_arg(v, n); }},
    {"soft_cap", kDecode, "float", "0.0",
     "logit soft-capping (0 = off): logit = soft_cap * tanh(scale * q.k / soft_cap), before ALiBi",
     [](CallKeywords& k, nb::handle v, const char* n) { k.options.soft_cap = float_arg(v, n); }},
    {"sinks", kDecodeCall, "Any", "None",
     "float32 [H] attention sinks: exp(sinks[h]) joins head h's softmax denominator (-inf: none)",
     [](CallKeywords& k, nb::handle v, const char*) { k.sinks = v; }},
    {"layout", kDecodeCall | kCacheWrite, "str | None", "None",
     "cache layout: 'vllm', 'nhd' or 'hnd' (default: 'vllm' for rank-5 key caches, 'nhd' for rank-4 ones; an "
     "'hnd' cache must be named)",
     [](CallKeywords& k, nb::handle v, const char* n) {
       k.options.layout = v.is_none() ? std::nullopt : std::optional<CacheLayout>(parse_layout(str_arg(v, n), n));
     }},
    {"stream", kDecodeCall | kCacheWrite, "Any", "None",
     "CUDA stream: an int handle or an object with __cuda_stream__ (default: the arrays' framework's current one)",
     [](CallKeywords& k, nb::handle v, const char*) { k.stream = v; }},
};

}  // namespace

std::int64_t int64_arg(nb::handle v, const char* name) {
  if (!PyBool_Check(v.ptr())) {
    nb::object i = nb::steal(PyNumber_Index(v.ptr()));
    if (i.is_valid()) {
      int overflow = 0;
      const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
      if (overflow == 0 && !(x == -1 && PyErr_Occurred())) return x;
      PyErr_Clear();
      fail<InvalidArgument>(name, ": ", nb::cast<std::string>(nb::repr(v)), " is outside the int64 range");
    }
    PyErr_Clear();
  }
  fail<TypeMismatch>(name, ": expected an integer, got ", what_is(v));
}

int int_arg(nb::handle v, const char* name) {
  const std::int64_t x = int64_arg(v, name);
  if (x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
    fail<InvalidArgument>(name, ": ", x, " is outside the int32 range");
  return static_cast<int>(x);
}

const char* str_arg(nb::handle v, const char* name) {
  if (PyUnicode_Check(v.ptr())) {
    const char* s = PyUnicode_AsUTF8(v.ptr());
    if (s != nullptr) return s;
    PyErr_Clear();
  }
  fail<TypeMismatch>(name, ": expected a str, got ", what_is(v));
}

void set_keyword(const char* fn, unsigned set, PyObject* key, nb::handle value, CallKeywords* out) {
  const char* name = PyUnicode_AsUTF8(key);
  if (name == nullptr) {
    PyErr_Clear();
    fail<TypeMismatch>(fn, "(): keywords must be strings");
  }
  for (const Keyword& k : kKeywords)
    if (std::strcmp(k.name, name) == 0 && (k.sets & set) != 0) {
      k.set(*out, value, k.name);
      return;
    }
  fail<TypeMismatch>(fn, "() got an unexpected keyword argument '", name, "'");
}

void parse_keywords(const char* fn, unsigned set, nb::handle kwargs, CallKeywords* out) {
  if (!kwargs.is_valid() || kwargs.is_none()) return;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kwargs.ptr(), &pos, &key, &value)) set_keyword(fn, set, key, nb::handle(value), out);
}

std::string keyword_text_signature(unsigned set) {
  std::string s = "*";
  for (const Keyword& k : kKeywords)
    if (k.sets & set) s += detail::concat(", ", k.name, "=", k.default_value);
  return s;
}

std::string keyword_signature(unsigned set) {
  std::string s = "*";
  for (const Keyword& k : kKeywords)
    if (k.sets & set) s += detail::concat(", ", k.name, ": ", k.type, " = ", k.default_value);
  return s;
}

std::string keyword_docs(unsigned set) {
  std::string s;
  for (const Keyword& k : kKeywords)
    if (k.sets & set) s += detail::concat("    ", k.name, ": ", k.doc, "\n");
  return s;
}

}  // namespace pagedattn::py
