"""Does a once-read candidates scan lose time at the wave boundaries of its one-document programs? (GPU only.)

For query blocks of 32 rows against each query's own ``K`` documents of ``Ld`` tokens (the matrix's candidates
scans), over a sweep of ``K`` around the multiples of the resident programs (4 a multiprocessor for the stream:
113 registers), it times ``maxsim.maxsim`` after the bench's kind of L2 flush (a 256 MB zero: dirty lines) and after a
read-only pass (clean), beside two reads of the same bytes: the bare read of tools/flush_probe.py (equal contiguous
chunks, 8 programs of 8 warps a multiprocessor, ``evict_first``) and a one-program-a-document read (4 warps,
64-token tiles loaded as the stream loads them, no MMA, no prefetch, no barrier), which has the stream's program
granularity and residency without its per-tile work. Medians of ``--rounds`` CUDA-event timings each.

Usage: python tools/wave_probe.py [--rounds 60] [--ld 180 --ks 33,34,49,50] (default: run 87's sweep)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from flush_probe import median_us, read_max  # tools/ is on sys.path when this runs as a script

import maxsim

SWEEP = {180: (33, 34, 40, 48, 49, 50, 51, 55, 60, 66, 67, 80), 256: (82, 83, 98, 99, 100, 101)}


@triton.jit
def _doc_read(x_ptr, out_ptr, LD: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``p`` reads document ``p`` (``LD`` tokens of ``DIM`` dims) a tile at a time and writes its max."""
    base = tl.program_id(0).to(tl.int64) * LD * DIM
    acc = tl.full([BLOCK_N, DIM], float("-inf"), tl.float32)
    for n0 in range(0, LD, BLOCK_N):
        r = n0 + tl.arange(0, BLOCK_N)
        p = x_ptr + base + r[:, None] * DIM + tl.arange(0, DIM)[None, :]
        v = tl.load(p, mask=r[:, None] < LD, other=float("-inf"), eviction_policy="evict_first")
        acc = tl.maximum(acc, v.to(tl.float32))
    tl.store(out_ptr + tl.program_id(0), tl.max(tl.max(acc, 1), 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--ld", type=int, help="one document length (with --ks); default: the built-in sweep")
    ap.add_argument("--ks", help="comma-separated candidates a query, for --ld")
    args = ap.parse_args()
    sweep = {args.ld: tuple(int(k) for k in args.ks.split(","))} if args.ld else SWEEP
    torch.manual_seed(0)
    dt, nq, lq, dim = torch.bfloat16, 32, 32, 128
    Q = torch.randn(nq, lq, dim, device="cuda", dtype=dt)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    dirty, clean = buf.zero_, buf.sum
    print(f"{torch.cuda.get_device_name()}: {sms} multiprocessors; us after a dirty / a clean flush", flush=True)
    for ld, ks in sweep.items():
        for k in ks:
            D = torch.randn(nq, k, ld, dim, device="cuda", dtype=dt)
            out = torch.empty(nq * k, device="cuda")
            with torch.no_grad():
                times = []
                for fn in (
                    lambda: maxsim.maxsim(Q, D),
                    lambda: read_max(D, 8 * sms, True),
                    lambda: _doc_read[(nq * k,)](D, out, LD=ld, DIM=dim, BLOCK_N=64, num_warps=4),
                ):
                    times.append((median_us(fn, dirty, args.rounds), median_us(fn, clean, args.rounds)))
            (ours_d, ours_c), (bare_d, bare_c), (doc_d, doc_c) = times
            print(
                f"Ld{ld} K{k:4d} programs {nq * k:5d} waves@4 {nq * k / (4 * sms):5.2f} | maxsim {ours_d:6.2f} / "
                f"{ours_c:6.2f} | bare {bare_d:6.2f} / {bare_c:6.2f} | doc-read {doc_d:6.2f} / {doc_c:6.2f} | "
                f"ours/bare clean {ours_c / bare_c:5.3f} | MB {D.numel() * 2 / 1e6:6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
