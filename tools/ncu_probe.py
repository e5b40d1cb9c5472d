"""One scores-only ``maxsim.maxsim`` launch per shape inside a CUDA profiler range, for Nsight Compute (GPU only).

Each shape is called a few times first (compiles and plans outside the range), then once inside it, so ncu with
``--profile-from-start off`` sees exactly one forward per shape, in the order given. docs/performance.md v71 ran:

    ncu --profile-from-start off --clock-control none --cache-control all \\
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python tools/ncu_probe.py 1x10000x32x300 1x1000x32x300 1x5000x64x180

A shape is ``NQxNDxLQxLD`` (cross product, bf16, dim 128) or ``NQxKxLQxLD:cand`` (each query's own candidates);
``--dim`` changes the token dimension.
"""

from __future__ import annotations

import argparse

import torch

import maxsim


def parse_shape(text: str) -> tuple[int, int, int, int, bool]:
    """``NQxNDxLQxLD[:cand]`` -> ``(nq, nd, lq, ld, candidates)``."""
    dims, _, kind = text.partition(":")
    if kind not in ("", "cand"):
        raise SystemExit(f"shape {text!r}: the suffix must be ':cand' or nothing")
    parts = dims.split("x")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise SystemExit(f"shape {text!r}: expected NQxNDxLQxLD, e.g. 1x1000x32x300")
    nq, nd, lq, ld = (int(p) for p in parts)
    return nq, nd, lq, ld, kind == "cand"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="+", help="NQxNDxLQxLD[:cand]")
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    calls = []
    for text in args.shapes:
        nq, nd, lq, ld, cand = parse_shape(text)
        Q = torch.randn(nq, lq, args.dim, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(*((nq,) if cand else ()), nd, ld, args.dim, device="cuda", dtype=torch.bfloat16)
        calls.append((text, Q, D))
    with torch.no_grad():
        for _text, Q, D in calls:
            for _ in range(3):
                maxsim.maxsim(Q, D)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for text, Q, D in calls:
            torch.cuda.nvtx.range_push(text)
            maxsim.maxsim(Q, D)
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
