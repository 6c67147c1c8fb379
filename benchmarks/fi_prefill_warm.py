"""Compiles FlashInfer's paged prefill kernels (fa2 and fa3 backends) for the shapes of
prefill_bench.py ahead of the timed run: its JIT takes minutes per module, so a device
round runs this in the background while pagedattn builds and the GPU tests run."""

import time

import flashinfer
import torch

B = 16
for dt, heads, kv, d in ((torch.bfloat16, 32, 8, 128), (torch.float16, 12, 12, 64), (torch.float16, 32, 32, 128)):
    for backend in ("fa2", "fa3"):
        t0 = time.time()
        try:
            ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            i32 = dict(dtype=torch.int32, device="cuda")
            w.plan(torch.tensor([0, 16], **i32), torch.tensor([0, 2], **i32), torch.arange(2, **i32),
                   torch.tensor([B], **i32), heads, kv, d, B, causal=True, q_data_type=dt)  # fmt: skip
            k = torch.randn(2, B, kv, d, dtype=dt, device="cuda")
            w.run(torch.randn(16, heads, d, dtype=dt, device="cuda"), (k, k))
            torch.cuda.synchronize()
            print(f"compiled {dt} {heads}/{kv} d{d} {backend} in {time.time() - t0:.0f} s", flush=True)
        except Exception as e:  # report and go on: the benchmark marks the backend n/a
            print(f"failed {dt} {heads}/{kv} d{d} {backend}: {type(e).__name__}: {str(e)[:300]}", flush=True)
