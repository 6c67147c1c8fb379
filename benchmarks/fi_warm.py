"""Compiles FlashInfer's decode kernels for the benchmark shapes ahead of the timed run
(its JIT takes about a minute per module); runs in the background during the tests.
`python fi_warm.py fp8` compiles those fp8_decode_bench.py uses instead (bf16 and
fp8_e4m3 caches, GQA 32/8 d128)."""

import sys

import flashinfer
import torch

if sys.argv[1:] == ["fp8"]:
    e4m3 = torch.float8_e4m3fn
    CASES = ((torch.bfloat16, torch.bfloat16, 32, 8, 128), (torch.bfloat16, e4m3, 32, 8, 128))
else:
    SHAPES = ((torch.bfloat16, 32, 8, 128), (torch.float16, 12, 12, 64), (torch.float16, 56, 56, 128))
    CASES = tuple((dt, dt, h, k, d) for dt, h, k, d in SHAPES)

for dt, kv_dt, heads, kv, d in CASES:
    for tc in (False, True):
        try:
            ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            indptr = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
            ids = torch.arange(4, dtype=torch.int32, device="cuda")
            last = torch.tensor([16], dtype=torch.int32, device="cuda")
            w.plan(indptr, ids, last, heads, kv, d, 16, q_data_type=dt, kv_data_type=kv_dt)
            k = torch.randn(4, 16, kv, d, dtype=dt, device="cuda").to(kv_dt)
            w.run(torch.randn(1, heads, d, dtype=dt, device="cuda"), (k, k))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a module that does not build must not stop the others
            print("failed", dt, kv_dt, heads, kv, d, "tc" if tc else "cc", type(e).__name__, flush=True)
            continue
        print("compiled", dt, kv_dt, heads, kv, d, "tc" if tc else "cc", flush=True)
