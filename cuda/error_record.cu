// The per-device pool of decode error records and their messages (cuda/error_record.cuh).
#include "cuda/error_record.cuh"

#include <map>
#include <mutex>
#include <vector>

#include "cuda/common.cuh"

namespace pagedattn::cuda_backend {
namespace {

// Free records per device. A record is allocated when a checked call finds none free,
// so the pool holds as many records as checked calls have ever run at once.
struct RecordPool {
  std::mutex mu;
  std::map<int, std::vector<DeviceErrorRecord*>> free;
};
RecordPool& record_pool() {
  static RecordPool pool;
  return pool;
}

}  // namespace

ErrorRecordLease::ErrorRecordLease(int device) : device_(device) {
  RecordPool& pool = record_pool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    std::vector<DeviceErrorRecord*>& free = pool.free[device];
    if (!free.empty()) {
      rec_ = free.back();
      free.pop_back();
      return;
    }
  }
  void* ptr = nullptr;
  check_cuda(cudaMalloc(&ptr, sizeof(DeviceErrorRecord)), "cudaMalloc (decode error record)");
  rec_ = static_cast<DeviceErrorRecord*>(ptr);
}

void ErrorRecordLease::zero(cudaStream_t stream) {
  check_cuda(cudaMemsetAsync(rec_, 0, sizeof(DeviceErrorRecord), stream), "cudaMemsetAsync");
}

DeviceErrorRecord ErrorRecordLease::take(cudaStream_t stream) {
  DeviceErrorRecord rec{};
  check_cuda(cudaMemcpyAsync(&rec, rec_, sizeof rec, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  RecordPool& pool = record_pool();
  std::lock_guard<std::mutex> lock(pool.mu);
  pool.free[device_].push_back(rec_);
  rec_ = nullptr;
  return rec;
}

void raise_recorded_error(const DeviceErrorRecord& rec, const DecodeParams& p) {
  switch (static_cast<DecodeErrorFlag>(rec.flag)) {
    case DecodeErrorFlag::kNone: return;
    case DecodeErrorFlag::kBlockId:
      fail<OutOfRange>("block_tables[", rec.seq, ", ", rec.index, "] = ", rec.value,
                       " is outside [0, num_blocks = ", p.num_blocks, ") (the affected outputs were set to NaN)");
    case DecodeErrorFlag::kSeqLen:
      fail<OutOfRange>("seq_lens[", rec.seq, "] = ", rec.value, " is outside [0, max_blocks_per_seq * block_size = ",
                       static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size,
                       "] (the affected outputs were set to NaN)");
    case DecodeErrorFlag::kQueryStart:
      fail<InvalidArgument>("query_start_loc[", rec.seq, "] = ", rec.index, ", query_start_loc[", rec.seq + 1,
                            "] = ", rec.value, " is not a row range inside the query's num_tokens ", p.num_tokens,
                            " (the affected outputs were set to NaN)");
    case DecodeErrorFlag::kQueryRows:
      fail<InvalidArgument>("query_start_loc: sequence ", rec.seq, " has ", rec.index, " query rows but seq_lens[",
                            rec.seq, "] = ", rec.value,
                            p.max_query_len >= 0 ? detail::concat(" and max_query_len = ", p.max_query_len) : "",
                            "; at most that many are allowed (the affected outputs were set to NaN)");
  }
  fail<CudaError>("paged_attention: the kernels left an unknown error flag ", rec.flag);
}

}  // namespace pagedattn::cuda_backend
