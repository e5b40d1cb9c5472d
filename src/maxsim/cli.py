"""The ``maxsim`` command line (``maxsim bench ...`` or ``python -m maxsim bench ...``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _parser() -> argparse.ArgumentParser:
    from .bench.peers import IMPL_NAMES

    parser = argparse.ArgumentParser(prog="maxsim", description="Exact fused MaxSim kernels: tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="time maxsim against eager PyTorch, torch.compile and the peer libraries",
        description=(
            "Run the named workloads in inference (forward, no grad) and training (forward + backward of "
            "a random linear loss) mode for every available implementation: correctness against an fp32 "
            "reference first (wrong rows are marked FAIL and not ranked), then median time, peak extra "
            "memory and, on a GPU, the fraction of the roofline floor measured at start. Ragged workloads "
            "(varlen-*, pairlist-*: packed tokens with skewed lengths) also run maxsim-padded, this library's "
            "dense path on the same tokens padded to the batch maxima, and report the speed-up over it."
        ),
    )
    b.add_argument("--only", nargs="+", metavar="NAME", help="workload names, mode/name keys, shell patterns")
    b.add_argument("--mode", choices=("infer", "train", "all"), default="all")
    b.add_argument("--dtype", choices=tuple(DTYPES), help="input dtype (default: bf16 on GPU, fp32 on CPU)")
    b.add_argument("--quick", action="store_true", help="tiny shapes (same names), for CPU and CI")
    b.add_argument("--full", action="store_true", help="full-size shapes even on CPU (default there: --quick)")
    b.add_argument("--impl", nargs="+", choices=IMPL_NAMES, metavar="IMPL", help=f"any of {', '.join(IMPL_NAMES)}")
    b.add_argument("--out", metavar="DIR", help="write <card>.json, <card>.md and <card>.png into DIR")
    b.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    b.add_argument("--warmup-ms", type=float, help="warm-up ms per row (GPU 25, CPU 20, CPU --quick 10)")
    b.add_argument("--rep-ms", type=float, help="timed ms per row (GPU 100, CPU 200, CPU --quick 50)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--rounds", type=int, default=3, help="interleaved timing rounds per workload (median of their medians)"
    )
    b.add_argument("--list", action="store_true", help="list the selected workloads and exit")
    b.add_argument(
        "--from-json",
        metavar="FILE",
        nargs="+",
        help="run nothing: re-render the table, <card>.md and <card>.png of a saved JSON (into --out, default "
        "the JSON's folder), e.g. where matplotlib is installed; several JSONs of one card are merged into one "
        "report (and <card>.json), later runs replacing the same workloads of earlier ones",
    )
    b.add_argument(
        "--no-pin",
        action="store_true",
        help="on a GPU, time with the threads wherever the scheduler puts them (default: the calling thread and the "
        "autograd engine's threads on one CPU while rows are timed; see maxsim.bench.affinity)",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import report
    from .bench.peers import IMPL_NAMES, OURS, default_skips, make_impls
    from .bench.runner import run
    from .bench.workloads import select

    if args.from_json:
        return _render(args.from_json, args.out)
    if not args.quick and not args.full and not torch.cuda.is_available() and args.device != "cuda":
        print("maxsim bench: no CUDA device, running the --quick (CPU-sized) shapes; --full forces full size")
        args.quick = True
    try:
        workloads = select(args.mode, args.only, args.quick)
    except ValueError as e:
        print(f"maxsim bench: {e}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"maxsim bench: --rounds must be at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    if args.list:
        kw = max((len(w.key) for w in workloads), default=0)
        sw = max((len(w.shape_str()) for w in workloads), default=0)
        for w in workloads:
            print(f"{w.key:{kw}s}  {w.shape_str():{sw}s}  {w.note}")
        return 0
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif args.device == "cuda" and not torch.cuda.is_available():
        print("maxsim bench: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = getattr(torch, DTYPES[dtype_name])
    names = list(args.impl) if args.impl else list(IMPL_NAMES)
    skip = {} if args.impl else default_skips(device)
    gpu = device.type == "cuda"
    warmup = args.warmup_ms if args.warmup_ms is not None else (25.0 if gpu else 10.0 if args.quick else 20.0)
    rep = args.rep_ms if args.rep_ms is not None else (100.0 if gpu else 50.0 if args.quick else 200.0)
    print(f"maxsim bench: {len(workloads)} workloads x {len(names)} implementations, {device}, {dtype_name}")
    save_partial = None
    if args.out:
        print(f"maxsim bench: {args.out} gets the JSON after every workload, the report at the end")

        def save_partial(res) -> None:
            done = len({(r.mode, r.workload) for r in res.rows})
            meta = {**res.meta, "partial": f"{done} of {len(workloads)} workloads"}
            report.save_json(type(res)(meta=meta, rows=res.rows), args.out)

    t0 = time.perf_counter()
    result = run(
        workloads,
        make_impls(names),
        device=device,
        dtype=dtype,
        warmup_ms=warmup,
        rep_ms=rep,
        seed=args.seed,
        rounds=args.rounds,
        skip=skip,
        quick=args.quick,
        progress=not args.no_progress,
        pin=not args.no_pin,
        on_workload=save_partial,
    )
    print()
    print(report.terminal_table(result))
    print(f"\nfinished in {time.perf_counter() - t0:.1f} s")
    if args.out:
        for path in report.write_outputs(result, args.out):
            print(f"wrote {path}")
    broken = [r for r in result.rows if r.impl in OURS and r.status in ("FAIL", "error")]
    return 1 if broken else 0


def _render(paths: list[str], out: str | None) -> int:
    from pathlib import Path

    from .bench import report

    try:
        results = [report.load(path) for path in paths]
        result = results[0] if len(results) == 1 else report.merge(results)
    except (OSError, ValueError) as e:
        print(f"maxsim bench: --from-json {' '.join(paths)}: {e}", file=sys.stderr)
        return 2
    print(report.terminal_table(result))
    merged = len(results) > 1
    for written in report.write_outputs(result, out or Path(paths[0]).parent, write_json=merged):
        print(f"wrote {written}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``maxsim`` console script. ``bench`` exits 1 when a maxsim (or maxsim-padded) row is FAIL
    or error."""
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
