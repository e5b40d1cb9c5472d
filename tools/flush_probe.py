"""What the bench's L2 flush costs a memory-bound forward (GPU only).

``triton.testing.do_bench`` zeroes a 256 MB buffer before every timed call, leaving the L2 full of dirty lines that
the timed kernel's reads must evict (a write-back that takes HBM bandwidth). This times the same forwards after that
flush, after a read-only pass over the buffer (a clean L2 of other data), after both, and with no flush.

Usage: python tools/flush_probe.py
"""

from __future__ import annotations

import statistics

import torch

import maxsim

SHAPES = {  # name: (Nq, documents, Lq, Ld, dim, cross product?)
    "cross 1x1000 Lq32 Ld300": (1, 1000, 32, 300, 128, True),
    "cand 32x50 Lq32 Ld180": (32, 50, 32, 180, 128, False),
    "cand 32x100 Lq32 Ld256": (32, 100, 32, 256, 128, False),
    "cross 1x10000 Lq32 Ld300": (1, 10000, 32, 300, 128, True),
}


def median_us(fn, flush, n: int = 200) -> float:
    for _ in range(20):
        fn()
    events = []
    for _ in range(n):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def main() -> None:
    torch.manual_seed(0)
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    flushes = {
        "zero_ (do_bench: dirty L2)": lambda: cache.zero_(),
        "read-only sum (clean L2)": lambda: cache.sum(),
        "zero_ then sum": lambda: (cache.zero_(), cache.sum()),
        "none": lambda: None,
    }
    print(torch.cuda.get_device_name())
    for name, (nq, k, lq, ld, dim, cross) in SHAPES.items():
        Q = torch.randn(nq, lq, dim, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(*((k,) if cross else (nq, k)), ld, dim, device="cuda", dtype=torch.bfloat16)
        mb = D.numel() * D.element_size() / 1e6
        row = [f"{name:26s} D {mb:6.1f} MB"]
        for label, flush in flushes.items():
            us = median_us(lambda: maxsim.maxsim(Q, D), flush)
            row.append(f"{label}: {us:6.1f} us ({mb / us:4.2f} TB/s)")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
