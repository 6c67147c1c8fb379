"""Summarises the per-instruction page of an Nsight Compute report of the Hopper varlen
kernel (device_profile_prefill.sh writes it as pf_source.csv.gz): executed instructions,
stall samples and their reasons, and the opcode mix, for the producer and the consumers
apart. The split is where the warpgroups' register moves are (USETMAXREG: the consumers'
increase comes first in the code, the producer's decrease opens its part); the retry loops
of the mbarrier waits that the compiler moved past the kernel's end are shown on their own.

    python3 benchmarks/ncu_source_summary.py pf_source.csv.gz
"""

import collections
import csv
import gzip
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(path):
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        lines = f.read().splitlines()
    rows = list(csv.DictReader(lines[1:]))  # the first line names the kernel
    alloc = next(i for i, r in enumerate(rows) if "USETMAXREG.TRY_ALLOC" in r["Source"])
    dealloc = next(i for i, r in enumerate(rows) if "USETMAXREG.DEALLOC" in r["Source"])
    end = max(i for i, r in enumerate(rows) if r["Source"].strip() == "EXIT")
    stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    parts = {"start": rows[:alloc], "consumers": rows[alloc:dealloc], "producer": rows[dealloc : end + 1],
             "wait loops after the end": rows[end + 1 :]}  # fmt: skip
    total = sum(num(r["Instructions Executed"]) for r in rows)
    for name, rs in parts.items():
        inst = sum(num(r["Instructions Executed"]) for r in rs)
        samples = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rs)
        why = collections.Counter({c[6:]: sum(num(r[c]) for r in rs) for c in stalls})
        ops = collections.Counter()
        for r in rs:
            src = r["Source"].strip()
            if src.startswith("@"):
                src = src.split(None, 1)[1]
            ops[src.split(".")[0].split()[0] if src else ""] += num(r["Instructions Executed"])
        print(f"{name}: {inst / 1e6:.1f} M warp instructions ({100 * inst / total:.0f}%), {samples:.0f} samples")
        print("  stalls: " + ", ".join(f"{k} {v:.0f}" for k, v in why.most_common(8) if v))
        print("  opcodes (M): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in ops.most_common(12) if v))


if __name__ == "__main__":
    main(sys.argv[1])
