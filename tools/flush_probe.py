"""What the bench's L2 flush costs a memory-bound forward, and how close the forward comes to a bare read (GPU only).

``triton.testing.do_bench`` zeroes a 256 MB buffer before every timed call, leaving the L2 full of dirty lines that
the timed kernel's reads must evict (a write-back that takes HBM bandwidth). This times the same forwards after that
flush ("dirty"), after a read-only pass over the buffer ("clean": an L2 of other data, nothing to write back), and
with no flush ("none": back-to-back calls, which is host time where the call's host path is the longer one).

Beside maxsim (and late-interaction-kernels where it is installed) it times a bare read of the same bytes: a Triton
kernel that only loads the documents, in equal contiguous chunks of 2, 4 or 8 programs a multiprocessor of 8 warps,
with and without the ``evict_first`` hint, and keeps their max (the "read ceiling": no MMA, no document
boundaries, the hint where a scan can have it).

Run 94 added reads that keep more bytes in flight (``--reads BLOCKxUNROLL@PER_SM``: ``UNROLL`` loads of ``BLOCK``
elements a step, issued together; the first form is 4096x1, 8 KB of bf16 a step, whose time fell with every doubling
of the programs a multiprocessor up to the 8 that fit) and PyTorch's own ``amax`` of the documents, to tell a ceiling
of the read from a ceiling of one read kernel's bytes in flight.

Usage: python tools/flush_probe.py [--rounds N] [--only SUBSTRING ...] [--reads 4096x1@8 2048x8@4 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import triton
import triton.language as tl

import maxsim

SHAPES = {  # name: (Nq, documents, Lq, Ld, dim, cross product?)
    "cross 1x1000 Lq32 Ld300": (1, 1000, 32, 300, 128, True),
    "cand 32x50 Lq32 Ld180": (32, 50, 32, 180, 128, False),
    "cross 1x1000 Lq32 Ld1024 d48": (1, 1000, 32, 1024, 48, True),
    "cand 32x100 Lq32 Ld256": (32, 100, 32, 256, 128, False),
    "cross 1x1000 Lq32 Ld1024": (1, 1000, 32, 1024, 128, True),
    "cross 1x5000 Lq64 Ld180": (1, 5000, 64, 180, 128, True),
    "cross 1x10000 Lq32 Ld300": (1, 10000, 32, 300, 128, True),
}


@triton.jit
def _read_max(
    x_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr, EVICT_FIRST: tl.constexpr
):
    """Program ``p`` loads elements ``[p * CHUNK, (p + 1) * CHUNK)`` of ``x``, ``UNROLL`` independent loads of
    ``BLOCK`` elements a step (in flight together), and writes their max (so that the loads are not dead)."""
    base = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for off in range(0, CHUNK, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            idx = base + off + u * BLOCK + tl.arange(0, BLOCK)
            if EVICT_FIRST:
                v = tl.load(x_ptr + idx, mask=idx < n, other=float("-inf"), eviction_policy="evict_first")
            else:
                v = tl.load(x_ptr + idx, mask=idx < n, other=float("-inf"))
            acc = tl.maximum(acc, v.to(tl.float32))
    tl.store(out_ptr + tl.program_id(0), tl.max(acc, 0))


def read_max(x: torch.Tensor, programs: int, evict_first: bool, block: int = 4096, unroll: int = 1) -> torch.Tensor:
    """The bare read: ``x`` (any shape, contiguous) read once by ``programs`` programs of 8 warps."""
    n = x.numel()
    step = block * unroll
    chunk = triton.cdiv(triton.cdiv(n, programs), step) * step
    out = torch.empty(triton.cdiv(n, chunk), device=x.device, dtype=torch.float32)
    _read_max[(out.numel(),)](x, out, n, CHUNK=chunk, BLOCK=block, UNROLL=unroll, EVICT_FIRST=evict_first, num_warps=8)
    return out


def median_us(fn, flush, n: int) -> float:
    for _ in range(10):
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=150, help="timed calls per cell (median)")
    ap.add_argument("--only", nargs="*", default=[], help="shapes whose name contains one of these")
    ap.add_argument(
        "--reads",
        nargs="*",
        default=None,
        help="BLOCKxUNROLL@PER_SM bare reads with the hint (default: the first form's)",
    )
    args = ap.parse_args()
    os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
    try:
        import late_interaction_kernels as lik
    except ImportError:
        lik = None
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    flushes = {"dirty": lambda: cache.zero_(), "clean": lambda: cache.sum(), "none": lambda: None}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: median us of {args.rounds} calls after each flush ({', '.join(flushes)})")
    for name, (nq, k, lq, ld, dim, cross) in SHAPES.items():
        if args.only and not any(o in name for o in args.only):
            continue
        torch.manual_seed(0)
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, dim, device="cuda"), dim=-1).bfloat16()
        D = torch.randn(*((k,) if cross else (nq, k)), ld, dim, device="cuda")
        D = torch.nn.functional.normalize(D, dim=-1).bfloat16()
        mb = D.numel() * D.element_size() / 1e6
        impls = {"maxsim": lambda: maxsim.maxsim(Q, D)}
        if lik is not None:
            impls["late-interaction-kernels"] = lambda: lik.maxsim(Q, D)
        if args.reads is None:  # (the first form: 8 KB a step, 2, 4 and 8 programs a multiprocessor, hint or not)
            for per_sm in (2, 4, 8):
                for hint in (True, False):
                    label = f"bare read, {per_sm}/SM{', evict_first' if hint else ''}"
                    impls[label] = lambda p=per_sm * sms, h=hint: read_max(D, p, h)
        else:
            impls["torch amax"] = D.amax
            for spec in args.reads:
                shape, _, per_sm = spec.partition("@")
                block, unroll = (int(v) for v in shape.split("x"))
                kb = block * unroll * D.element_size() >> 10
                label = f"bare read, {per_sm}/SM, {unroll} x {block}, {kb} KB, evict_first"
                impls[label] = lambda p=int(per_sm) * sms, b=block, u=unroll: read_max(D, p, True, b, u)
        with torch.no_grad():
            for label, fn in impls.items():
                cells = "  ".join(f"{median_us(fn, flush, args.rounds):7.1f}" for flush in flushes.values())
                print(f"{name:30s} {mb:6.1f} MB  {label:46s} {cells}", flush=True)


if __name__ == "__main__":
    main()
