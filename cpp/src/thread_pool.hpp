// A small persistent thread pool for the CPU backend.
#pragma once

#include <cstdint>
#include <functional>

namespace pagedattn::cpu {

// Number of threads parallel_for uses (the calling thread included). Defaults to the
// hardware concurrency; the environment variable PAGEDATTN_NUM_THREADS overrides it.
int num_threads();

// Runs fn(i) for every i in [0, n), spread over the pool's threads (the caller works
// too). Items are handed out one at a time, so uneven items balance. The first
// exception thrown by fn is rethrown here after all workers have stopped.
// Concurrent calls from several host threads are serialised. Usable after fork():
// a child process (even one forked while another thread was inside parallel_for)
// builds its own pool on its first call.
void parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn);

}  // namespace pagedattn::cpu
