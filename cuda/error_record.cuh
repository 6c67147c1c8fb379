// The index error record of a decode call: what a kernel found wrong in block_tables or
// seq_lens (the first finding only), with named flags. Kernels write it when the call
// passes one (check_block_tables=True); unchecked calls pass none and only mark the
// affected outputs with NaN.
//
// Each checked call borrows its own record from a per-device pool for the duration of
// the call (a checked call waits for its stream before it returns), so calls on different
// streams, or threads, never reset or read each other's record.
#pragma once

#include <cuda_runtime.h>

#include "params.hpp"

namespace pagedattn::cuda_backend {

enum class DecodeErrorFlag : int {
  kNone = 0,
  kBlockId = 1,  // block_tables[seq, index] = value is outside [0, num_blocks)
  kSeqLen = 2,   // seq_lens[seq] = value is outside [0, max_blocks_per_seq * block_size]
  kQueryStart = 3,  // varlen: query_start_loc[seq], [seq + 1] = index, value is not a row range of the query
  kQueryRows = 4,   // varlen: sequence seq has index query rows, more than seq_lens[seq] = value or max_query_len
};

// Device global memory, zeroed before the kernels run.
struct DeviceErrorRecord {
  int flag;   // a DecodeErrorFlag
  int seq;    // the sequence
  int index;  // the block-table column (kBlockId), else -1
  int value;  // the offending value
};

// Records the first error only; later ones are dropped. No-op without a record.
__device__ __forceinline__ void record_error(DeviceErrorRecord* e, DecodeErrorFlag flag, int seq, int index,
                                             int value) {
  if (e && atomicCAS(&e->flag, 0, static_cast<int>(flag)) == 0) {
    e->seq = seq;
    e->index = index;
    e->value = value;
  }
}

// A record lent to one checked call: zero it on the call's stream before the kernels,
// then take() it after them. A lease dropped without take() (the call failed part way,
// so a kernel may still write to the record) leaves its 16 bytes out of the pool.
class ErrorRecordLease {
 public:
  explicit ErrorRecordLease(int device);  // the current device
  ErrorRecordLease(const ErrorRecordLease&) = delete;
  ErrorRecordLease& operator=(const ErrorRecordLease&) = delete;

  DeviceErrorRecord* get() const { return rec_; }
  void zero(cudaStream_t stream);
  // Waits for `stream` (the host synchronisation of a checked call), hands the record
  // back to the pool and returns what the kernels wrote into it. Once per lease.
  DeviceErrorRecord take(cudaStream_t stream);

 private:
  int device_;
  DeviceErrorRecord* rec_ = nullptr;
};

// Throws OutOfRange naming the entry a record points at; returns when it holds none.
void raise_recorded_error(const DeviceErrorRecord& rec, const DecodeParams& p);

}  // namespace pagedattn::cuda_backend
