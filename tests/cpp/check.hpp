// A minimal test harness for the C++ tests (no external dependency).
//   PA_TEST(name) { PA_CHECK(cond); PA_CHECK_EQ(a, b); PA_CHECK_THROWS(expr, Type); }
//   int main() { return pagedattn_test::run_all(); }
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace pagedattn_test {

struct Case {
  const char* name;
  std::function<void()> fn;
};
inline std::vector<Case>& registry() {
  static std::vector<Case> r;
  return r;
}
struct Registrar {
  Registrar(const char* name, std::function<void()> fn) { registry().push_back({name, std::move(fn)}); }
};
struct Failure : std::exception {
  std::string msg;
  explicit Failure(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
};

inline int run_all() {
  int failed = 0;
  for (const auto& c : registry()) {
    try {
      c.fn();
      std::printf("[ ok ] %s\n", c.name);
    } catch (const std::exception& e) {
      ++failed;
      std::printf("[FAIL] %s: %s\n", c.name, e.what());
    }
  }
  std::printf("%d passed, %d failed\n", static_cast<int>(registry().size()) - failed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace pagedattn_test

#define PA_CAT2(a, b) a##b
#define PA_CAT(a, b) PA_CAT2(a, b)
#define PA_TEST(name)                                                                     \
  static void PA_CAT(pa_test_, name)();                                                   \
  static ::pagedattn_test::Registrar PA_CAT(pa_reg_, name)(#name, PA_CAT(pa_test_, name)); \
  static void PA_CAT(pa_test_, name)()

#define PA_FAIL_AT(msg)                                                        \
  do {                                                                         \
    std::ostringstream pa_os_;                                                 \
    pa_os_ << __FILE__ << ":" << __LINE__ << ": " << msg;                      \
    throw ::pagedattn_test::Failure(pa_os_.str());                             \
  } while (0)
#define PA_CHECK(cond) \
  do {                 \
    if (!(cond)) PA_FAIL_AT("check failed: " #cond); \
  } while (0)
#define PA_CHECK_EQ(a, b)                                                                 \
  do {                                                                                    \
    const auto& pa_a_ = (a);                                                              \
    const auto& pa_b_ = (b);                                                              \
    if (!(pa_a_ == pa_b_)) PA_FAIL_AT(#a " == " #b " failed: " << pa_a_ << " vs " << pa_b_); \
  } while (0)
#define PA_CHECK_THROWS(expr, Type)                                              \
  do {                                                                           \
    bool pa_thrown_ = false;                                                     \
    try {                                                                        \
      expr;                                                                      \
    } catch (const Type&) {                                                      \
      pa_thrown_ = true;                                                         \
    }                                                                            \
    if (!pa_thrown_) PA_FAIL_AT(#expr " did not throw " #Type);                   \
  } while (0)
