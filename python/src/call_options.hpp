// The keyword options of the attention calls, bound to Python in one table
// (call_options.cpp): paged_attention, prepare_decode, the workspace and plan queries and
// reshape_and_cache all read their keywords through it, and their signatures and
// docstrings are generated from it. A new option is one row there, one field of
// AttentionOptions, its check in validate.cpp and its use in the kernels.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>

#include "pagedattn/attention.hpp"

namespace pagedattn::py {

namespace nb = nanobind;

// Which calls take a keyword.
enum KeywordSet : unsigned {
  kDecodeCall = 1u,  // paged_attention, prepare_decode
  kDecodeQuery = 2u, // decode_workspace_size, decode_plan (the options that do not name arrays)
  kCacheWrite = 4u,  // reshape_and_cache
};

struct CallKeywords {
  AttentionOptions options;
  // Array and stream keywords: converted by the caller (call_args.hpp), None when absent.
  nb::handle out = nb::none(), alibi_slopes = nb::none(), workspace = nb::none(), stream = nb::none(),
             query_start_loc = nb::none(), sinks = nb::none();
};

// Reads the keywords of a call of `fn` (a function of `set`) into `out`; an unknown or
// misplaced keyword is a TypeError naming it, a bad value an error naming the keyword.
void parse_keywords(const char* fn, unsigned set, nb::handle kwargs, CallKeywords* out);

// Scalar arguments, each with a typed error naming the argument (never nanobind's own).
std::int64_t int64_arg(nb::handle v, const char* name);
int int_arg(nb::handle v, const char* name);  // int32 range
// A float32, refusing a number it cannot hold (a nonzero one that rounds to 0, an int past
// the double range); past the float32 range it is inf, for the argument's own check.
float float_arg(nb::handle v, const char* name);
const char* str_arg(nb::handle v, const char* name);

// One keyword of a call of `fn` into `out` (the vectorcall form: no keyword dict).
void set_keyword(const char* fn, unsigned set, PyObject* key, nb::handle value, CallKeywords* out);
// "*, name=default, ...": the keywords of `set` for a __text_signature__.
std::string keyword_text_signature(unsigned set);

// "*, name: type = default, ..." for the keywords of `set`, and their documentation lines.
std::string keyword_signature(unsigned set);
std::string keyword_docs(unsigned set);

}  // namespace pagedattn::py
