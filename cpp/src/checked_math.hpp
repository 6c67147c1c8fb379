// Overflow-checked int64 arithmetic, shared by the validation pass and the block
// manager's output checks.
#pragma once

#include <cstdint>
#include <limits>

namespace pagedattn::detail {

// a * b and a + b, or false on int64 overflow (GCC and Clang: one flag test, no division).
inline bool mul_ok(std::int64_t a, std::int64_t b, std::int64_t* r) {
#if defined(__GNUC__) || defined(__clang__)
  return !__builtin_mul_overflow(a, b, r);
#else
  const std::int64_t m = std::numeric_limits<std::int64_t>::max();
  if (a != 0 && (b == std::numeric_limits<std::int64_t>::min() || (b < 0 ? -b : b) > m / (a < 0 ? -a : a)))
    return false;
  *r = a * b;
  return true;
#endif
}
inline bool add_ok(std::int64_t a, std::int64_t b, std::int64_t* r) {
#if defined(__GNUC__) || defined(__clang__)
  return !__builtin_add_overflow(a, b, r);
#else
  if ((b > 0 && a > std::numeric_limits<std::int64_t>::max() - b) ||
      (b < 0 && a < std::numeric_limits<std::int64_t>::min() - b))
    return false;
  *r = a + b;
  return true;
#endif
}

}  // namespace pagedattn::detail
