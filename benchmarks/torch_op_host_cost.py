"""Host cost of the torch operators against the plain calls, eager, on the same tensors.

    python3 benchmarks/torch_op_host_cost.py [--calls N] [--rounds R] [--device cpu|cuda|all] [--json [PATH]]

For a tiny decode (so the kernel costs little next to the call) and for an empty batch (no
kernel at all), the median microseconds per call of:

- plain:            pagedattn.paged_attention(q, ...)                  (allocates the output)
- plain out=:       pagedattn.paged_attention(q, ..., out=out)
- op:               torch.ops.pagedattn.paged_attention(q, ...)
- op .out:          torch.ops.pagedattn.paged_attention.out(q, ..., out=out)
- wrapper out=:     pagedattn.torch.paged_attention(q, ..., out=out)

each under torch.inference_mode() (how engines run) and with grad mode on. The methods are
timed in turn, round after round, so drift of the machine touches them alike; each figure is
the median over rounds of a round's mean. On CUDA the GPU is kept busy by a long spin between
batches of calls, so a launch never waits for the device and only the host's work is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import pagedattn
import pagedattn.torch as pt


def _tensors(device: str, num_seqs: int):
    h, k, d, b = 4, 2, 64, 16
    kc, vc = (c.normal_() for c in pt.empty_kv_cache(max(num_seqs, 1), b, k, d, torch.float16, device=device))
    q = torch.randn(num_seqs, h, d, dtype=torch.float16, device=device)
    bt = torch.arange(num_seqs, dtype=torch.int32, device=device).view(num_seqs, 1)
    sl = torch.full((num_seqs,), b, dtype=torch.int32, device=device)
    return (q, kc, vc, bt, sl), torch.empty_like(q)


def _methods(args, out):
    op, op_out = torch.ops.pagedattn.paged_attention.default, torch.ops.pagedattn.paged_attention.out
    return {
        "plain": lambda: pagedattn.paged_attention(*args),
        "plain out=": lambda: pagedattn.paged_attention(*args, out=out),
        "op": lambda: op(*args),
        "op .out": lambda: op_out(*args, out=out),
        "wrapper out=": lambda: pt.paged_attention(*args, out=out),
    }


def _time(methods, calls: int, rounds: int, device: str) -> dict:
    busy = (lambda: torch.cuda._sleep(2_000_000)) if device == "cuda" else (lambda: None)
    for fn in methods.values():  # warm-up
        for _ in range(50):
            fn()
    per_round: dict = {name: [] for name in methods}
    batch = 50
    for _ in range(rounds):
        for name, fn in methods.items():
            spent = 0.0
            for _ in range(calls // batch):
                busy()  # keep the GPU busy: the launch queue never blocks a call
                t0 = time.perf_counter()
                for _ in range(batch):
                    fn()
                spent += time.perf_counter() - t0
            per_round[name].append(spent / (calls // batch * batch) * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in per_round.items()}


def run(device: str, calls: int, rounds: int) -> list:
    rows = []
    for case, num_seqs in (("decode S=1", 1), ("empty S=0", 0)):
        args, out = _tensors(device, num_seqs)
        methods = _methods(args, out)
        for mode, ctx in (("inference_mode", torch.inference_mode), ("grad on", contextlib.nullcontext)):
            with ctx():
                us = _time(methods, calls, rounds, device)
            rows.append({"device": device, "case": case, "mode": mode, "us_per_call": us})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per method and round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", choices=("cpu", "cuda", "all"), default="all")
    ap.add_argument("--json", nargs="?", const="-", help="the rows as JSON: to PATH, or printed without one")
    a = ap.parse_args()
    devices = ["cpu", "cuda"] if a.device == "all" else [a.device]
    if "cuda" in devices and not (torch.cuda.is_available() and pagedattn.built_with_cuda()):
        if a.device == "cuda":
            raise SystemExit("--device cuda: no CUDA device, or pagedattn built without CUDA")
        devices.remove("cuda")
    rows = [r for dev in devices for r in run(dev, a.calls, a.rounds)]
    if a.json == "-":
        print(json.dumps(rows, indent=1))
        return
    if a.json:  # the file, and the table below
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"torch {torch.__version__}, pagedattn {pagedattn.__version__}; microseconds per call (median of rounds)")
    names = list(rows[0]["us_per_call"])
    print(f"{'device':6} {'case':11} {'mode':15} " + " ".join(f"{n:>13}" for n in names) + f" {'op - plain':>11}")
    for r in rows:
        us = r["us_per_call"]
        line = f"{r['device']:6} {r['case']:11} {r['mode']:15} " + " ".join(f"{us[n]:13.2f}" for n in names)
        print(line + f" {us['op'] - us['plain']:11.2f}")


if __name__ == "__main__":
    main()
