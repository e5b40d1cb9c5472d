"""One ``maxsim.maxsim`` call per shape inside a CUDA profiler range, for Nsight Compute (GPU only).

Each shape is called a few times first (compiles and plans outside the range), then once inside it, so ncu with
``--profile-from-start off`` sees exactly one call per shape, in the order given. docs/performance.md v71 ran:

    ncu --profile-from-start off --clock-control none --cache-control all \\
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python tools/ncu_probe.py 1x10000x32x300 1x1000x32x300 1x5000x64x180

A shape is ``NQxNDxLQxLD`` (cross product, bf16, dim 128) or ``NQxKxLQxLD:cand`` (each query's own candidates);
``--dim`` changes the token dimension; ``--masked [KIND]`` adds a document mask (probe_common.MASK_KINDS; by default
a kept prefix of half to all the tokens, less 10 % holes), ``--normalize`` passes ``normalize=True``. ``--train``: a
training step per shape instead (the argmax forward and the backward, with a random upstream gradient), e.g. the
backward kernel of the small steps (docs/performance.md v77-v80):

    ncu --profile-from-start off --kernel-name maxsim_bwd_kernel --section WarpStateStats \
        --section SchedulerStats --section SourceCounters python tools/ncu_probe.py --train 32x32x32x80
"""

from __future__ import annotations

import argparse

import torch
from probe_common import MASK_KINDS, document_mask  # (tools/ is on sys.path when this runs as a script)

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
    ap.add_argument("--train", action="store_true", help="a training step per shape (forward and backward)")
    ap.add_argument(
        "--masked", nargs="?", const="holes", choices=MASK_KINDS, help="a document mask (default: a prefix with holes)"
    )
    ap.add_argument("--normalize", action="store_true", help="normalize=True")
    args = ap.parse_args()
    calls = []
    for text in args.shapes:
        nq, nd, lq, ld, cand = parse_shape(text)
        Q = torch.randn(nq, lq, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=args.train)
        D = torch.randn(*((nq,) if cand else ()), nd, ld, args.dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=args.train)  # fmt: skip
        g = torch.randn(nq, nd, device="cuda")
        mask = document_mask(D.shape[:-1], args.masked, "cuda") if args.masked else None
        calls.append((text, Q, D, g, mask))

    def call(Q, D, g, mask) -> None:
        kw = dict(d_mask=mask, normalize=args.normalize)
        if args.train:
            torch.autograd.grad(maxsim.maxsim(Q, D, **kw), (Q, D), g)
        else:
            with torch.no_grad():
                maxsim.maxsim(Q, D, **kw)

    for _text, *inputs in calls:
        for _ in range(3):
            call(*inputs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for text, *inputs in calls:
        torch.cuda.nvtx.range_push(text)
        call(*inputs)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
