"""Off-matrix check: the bench's peers and timing on shapes nobody tuned for.

Issue 5 asks that the margins hold off the matrix (dim 48/96, Lq 23, Ld 333, K 7, Nq 7 and their kin). The matrix
holds four such rows; this tool runs a fixed list of other combinations of those sizes with the other axes moved
too (long queries, short and long documents, many or few queries, every layout, both modes) through the bench's
own runner, then judges each row by issue 5's rule (`tools/targets.py`: inference R = 1.15, E = 0.85; training
R = 1.5, E = 0.70).

Usage (GPU):  python tools/offmatrix.py --out DIR [--mode infer|train|all] [--only PATTERN ...] [--impl ...]
              [--list] [--wide]
Writes DIR/<card>.json, .md, .png like `maxsim bench --out`; prints the target table. `compile` is left out unless
named in --impl (compiling each of these shapes would take most of a device call).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from maxsim.bench import report
from maxsim.bench.peers import make_impls
from maxsim.bench.runner import run
from maxsim.bench.workloads import Workload, select

sys.path.insert(0, str(Path(__file__).resolve().parent))
from targets import table  # noqa: E402

#: Ragged rows draw their lengths from 5 (queries) and 20 (documents) up to Lq / Ld.
_SKEWED = {"lq_min": 5, "ld_min": 20}


def _w(mode: str, layout: str, nq: int, nd: int, lq: int, ld: int, dim: int, pool: int = 0) -> Workload:
    ragged = dict(_SKEWED, pool=pool) if layout in ("varlen", "pairlist") else {}
    return Workload(mode=mode, layout=layout, nq=nq, nd=nd, lq=lq, ld=ld, dim=dim, note="off-matrix sweep", **ragged)


#: (mode, layout, rows of (Nq, Nd or K, Lq, Ld, dim[, pool])). Fixed, so that runs on different days compare. Sizes
#: mix the issue's off-matrix values (dim 48/96, Lq 23, Ld 333, K 7, Nq 7) with others the matrix does not hold
#: (dim 64 with short documents, Lq 64/100/256, Ld 64/512/700/2048, Nq 1/3/4/16/48/200, K 20/64/256).
_TABLE: tuple[tuple[str, str, tuple[tuple[int, ...], ...]], ...] = (
    ("infer", "cross", (
        (7, 1000, 23, 333, 48), (1, 1000, 23, 333, 96), (1, 5000, 64, 180, 128), (16, 2000, 32, 512, 64),
        (48, 48, 23, 333, 96), (200, 200, 32, 128, 128), (1, 300, 256, 700, 128), (3, 777, 100, 333, 96),
        (64, 64, 23, 64, 64), (1, 64, 32, 2048, 128), (1, 8, 32, 8192, 128), (8, 8, 32, 4096, 128),
        (1, 16, 1024, 1024, 128),
    )),
    ("infer", "candidates", (
        (7, 7, 23, 333, 96), (64, 20, 64, 300, 128), (16, 100, 23, 333, 48), (128, 7, 32, 1024, 64),
        (32, 100, 48, 256, 128), (4, 16, 32, 2048, 128),
    )),
    ("infer", "pairs", ((1000, 1000, 23, 333, 96), (64, 64, 32, 2048, 128))),
    ("infer", "varlen", ((7, 1000, 23, 333, 96),)),
    ("infer", "pairlist", ((48, 20, 23, 333, 48, 512),)),
    ("train", "cross", (
        (48, 48, 23, 333, 48), (16, 16, 64, 512, 128), (100, 100, 32, 180, 96), (128, 128, 23, 333, 128),
        (32, 32, 23, 64, 64), (7, 1000, 23, 333, 96), (1, 1000, 64, 300, 128),
    )),
    ("train", "candidates", (
        (32, 7, 23, 333, 96), (128, 8, 64, 256, 128), (16, 64, 32, 180, 64), (4, 256, 64, 180, 128),
    )),
    ("train", "pairs", ((256, 256, 23, 333, 48), (1000, 1000, 32, 180, 128), (64, 64, 32, 2048, 128))),
    ("train", "varlen", ((48, 96, 23, 333, 96),)),
    ("train", "pairlist", ((32, 7, 23, 333, 48, 128),)),
)  # fmt: skip
OFF_MATRIX: tuple[Workload, ...] = tuple(_w(mode, layout, *row) for mode, layout, rows in _TABLE for row in rows)

#: ``--wide``: tokens wider than 256 dims (the forward's dim loop): BGE-M3's 1024-dim multi-vectors, BERT's 768,
#: MiniLM's 384, in the layouts and sizes of the matrix's rows.
_WIDE_TABLE: tuple[tuple[str, str, tuple[tuple[int, ...], ...]], ...] = (
    ("infer", "cross", (
        (32, 256, 32, 180, 1024), (1, 1000, 32, 512, 1024), (1, 1000, 32, 300, 768), (128, 128, 32, 300, 384),
        (8, 64, 256, 512, 1024),
    )),
    ("infer", "candidates", ((32, 100, 32, 256, 1024),)),
    ("train", "cross", ((32, 32, 32, 180, 1024), (64, 64, 32, 300, 768), (128, 128, 32, 180, 384))),
    ("train", "candidates", ((64, 16, 32, 256, 1024),)),
    ("train", "pairs", ((256, 256, 32, 300, 1024),)),
)  # fmt: skip
WIDE: tuple[Workload, ...] = tuple(_w(mode, layout, *row) for mode, layout, rows in _WIDE_TABLE for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write <card>.json/.md/.png here")
    ap.add_argument("--mode", default="all", choices=("infer", "train", "all"))
    ap.add_argument("--only", nargs="+", metavar="PATTERN", help="names, keys or shell patterns")
    ap.add_argument("--impl", nargs="+", default=["maxsim", "eager", "lik", "flash"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    ap.add_argument("--wide", action="store_true", help="the wide tokens' table (WIDE) instead")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    workloads = select(args.mode, args.only, table=WIDE if args.wide else OFF_MATRIX)
    if args.list:
        for w in workloads:
            print(f"{w.key:50s} {w.shape_str()}")
        return 0
    if not torch.cuda.is_available():
        print("offmatrix: needs a CUDA device (the targets are GPU targets)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = run(
        workloads,
        make_impls(args.impl),
        device="cuda",
        dtype=torch.bfloat16,
        rounds=args.rounds,
        progress=not args.no_progress,
    )
    print(report.terminal_table(result))
    print(f"\nfinished in {time.perf_counter() - t0:.1f} s")
    if args.out:
        for path in report.write_outputs(result, args.out):
            print(f"wrote {path}")
    print(table(report.to_json(result), markdown=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
