#include "thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pagedattn/errors.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define PAGEDATTN_HAVE_ATFORK 1
#endif

namespace pagedattn::cpu {
namespace {

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
    for (auto& w : workers_) w.detach();  // the pool lives for the whole process
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(std::int64_t n, const std::function<void(std::int64_t)>& fn) {
    std::lock_guard<std::mutex> call_lock(call_mutex_);
    {
      std::lock_guard<std::mutex> lk(m_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      error_ = nullptr;
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(m_);
    done_cv_.wait(lk, [this] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    for (;;) {
      const std::int64_t i = next_.fetch_add(1);
      if (i >= n_) return;
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(m_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_);  // stop handing out work
      }
    }
  }

  void worker_loop() {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
      }
      work();
      {
        std::lock_guard<std::mutex> lk(m_);
        --active_;
      }
      done_cv_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;
  std::mutex m_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  const std::function<void(std::int64_t)>* fn_ = nullptr;
  std::int64_t n_ = 0;
  std::atomic<std::int64_t> next_{0};
  std::exception_ptr error_;
  int active_ = 0;
  std::uint64_t generation_ = 0;
};

constexpr int kMaxThreads = 256;

// PAGEDATTN_NUM_THREADS: a whole number from 1 up (more than kMaxThreads means
// kMaxThreads); unset or empty: one thread per hardware thread. Anything else is refused
// rather than silently ignored.
int configured_threads() {
  const char* env = std::getenv("PAGEDATTN_NUM_THREADS");
  if (env != nullptr && *env != '\0') {
    const std::string text(env);
    std::size_t i = 0;
    while (i < text.size() && text[i] == ' ') ++i;
    std::size_t digits = 0;
    long long v = 0;
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i, ++digits)
      v = std::min<long long>(v * 10 + (text[i] - '0'), 1000000);
    while (i < text.size() && text[i] == ' ') ++i;
    if (digits == 0 || i != text.size() || v < 1)
      fail<InvalidArgument>("PAGEDATTN_NUM_THREADS: expected a whole number of threads (1 or more; at most ",
                            kMaxThreads, " are used), got '", text, "'");
    return static_cast<int>(std::min<long long>(v, kMaxThreads));
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(std::min<unsigned>(hw, kMaxThreads));
}

// The pool is built on first use. A fork() leaves the child with only the forking
// thread: the workers do not follow, and the pool's mutexes may be held by threads that
// no longer exist (a fork while another thread is inside parallel_for). So the child
// abandons the inherited pool (never destroyed: a mutex held by a vanished thread
// cannot be) and builds a fresh one on its first call. The creation mutex itself is
// taken around fork() so that it is never inherited locked.
std::mutex g_create_mutex;
std::atomic<Pool*> g_pool{nullptr};

#ifdef PAGEDATTN_HAVE_ATFORK
void before_fork() { g_create_mutex.lock(); }
void after_fork_in_parent() { g_create_mutex.unlock(); }
void after_fork_in_child() {
  g_pool.store(nullptr, std::memory_order_relaxed);
  g_create_mutex.unlock();  // held by this very thread since before_fork
}

// Registered when the library is loaded, before any thread of it can exist.
[[maybe_unused]] const bool g_fork_handlers = [] {
  return pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child) == 0;
}();
#endif

Pool& pool() {
  if (Pool* p = g_pool.load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> lk(g_create_mutex);
  Pool* p = g_pool.load(std::memory_order_relaxed);
  if (!p) {
    p = new Pool(configured_threads());  // intentionally never destroyed
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace

int num_threads() { return pool().size(); }

void parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || pool().size() == 1) {
    for (std::int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  pool().run(n, fn);
}

}  // namespace pagedattn::cpu
