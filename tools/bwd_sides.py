"""The backward kernel of a training step, its two sides timed apart (GPU).

``maxsim_bwd_kernel`` runs the dQ gather (programs ``[0, n_dq)``) and the owned dD (the rest) in one launch, so a
profile shows one time for both. Here the launch of one bench step is captured and replayed three ways on the same
tensors: whole, its dQ programs alone (the grid cut to ``n_dq``) and its dD programs alone (``n_dq`` passed as 0, the
grid less ``n_dq``; an integer Triton does not specialize on, so the same compiled variant). Tells which side is a
step's long pole. Times are ``triton.testing.do_bench`` medians (L2 flushed before each launch), in rounds.

Usage: python tools/bwd_sides.py WORKLOAD [WORKLOAD ...] [--rounds N] [--variant label:NAME=VALUE,... ...]
  e.g. python tools/bwd_sides.py pairlist-64x32-lq32-ld180 cand-64x32-lq32-ld180
A ragged workload is run as maxsim's own layout and as its padded twin (``maxsim-padded``, under the first
variant only).
``--variant`` (as tools/knobs.py's): each variant's launches are captured under its settings, then all are timed
interleaved in one process.
"""

from __future__ import annotations

import argparse

import torch
from knobs import _owner, apply, parse_variant  # tools/ is on sys.path when this runs as a script
from offmatrix import OFF_MATRIX, WIDE
from triton.testing import do_bench

from maxsim.bench import peers, runner, workloads
from maxsim.kernels import launch_backward
from maxsim.kernels.backward import maxsim_bwd_kernel

N_DQ_AT = -6  # (the main launch's integers end with n_dq, dq_splits, ks_len, Q.numel(), sc_lo, sc_n)


def capture(call) -> tuple:
    """The arguments of the last main backward launch of ``call()``."""
    seen: list[tuple] = []
    real = launch_backward._bwd

    def spy(grid, tensors, ints, constexprs, *rest, **kw):
        seen.append((grid, tensors, ints, constexprs, rest, kw))
        return real(grid, tensors, ints, constexprs, *rest, **kw)

    launch_backward._bwd = spy
    try:
        call()
        torch.cuda.synchronize()
    finally:
        launch_backward._bwd = real
    if not seen:
        raise SystemExit("no main backward launch was made")
    return seen[-1]


def sides(launch: tuple, maxnreg: int = 0) -> dict:
    """``name: thunk`` of the whole launch and of each side that it holds (``maxnreg``: compiled under that
    register cap instead)."""
    grid, tensors, ints, constexprs, rest, kw = launch
    kw = {k: v for k, v in kw.items() if k != "plan_cache"}
    if maxnreg:
        kw["maxnreg"] = maxnreg
    rest = rest[:1]  # (num_stages; no plan cache: the cut launches are other integer signatures)
    n_dq = ints[N_DQ_AT]
    if constexprs["DQ_GATHER"] != (n_dq > 0) or not 0 <= n_dq <= grid:  # (the integers' layout has moved)
        raise SystemExit(f"n_dq at {N_DQ_AT} reads {n_dq}: not the launch's dQ program count (grid {grid})")
    if constexprs.get("FUSED_CAST"):  # (replayed, its casters would find their counts full and not wait)
        raise SystemExit("a launch that casts dD itself (FUSED_CAST) spends its counters in one run: replay it with "
                         "--variant off:FUSED_CAST_MAX_PROGRAMS=0")  # fmt: skip
    if constexprs.get("SUM_LAST"):  # (replayed, no program would find itself the last of its block: no sums)
        raise SystemExit("a launch that sums its split walk's slices itself (SUM_LAST) spends its counters in one "
                         "run: replay it with --variant off:FUSED_DQ_SUM_MAX_SLICES=0")  # fmt: skip

    def run(g: int, i: tuple):
        return lambda: launch_backward._bwd(g, tensors, i, constexprs, *rest, **kw)

    out = {"whole": run(grid, ints)}
    if 0 < n_dq < grid:
        out["dQ only"] = run(n_dq, ints)
        no_dq = list(ints)
        no_dq[N_DQ_AT] = 0
        out["dD only"] = run(grid - n_dq, tuple(no_dq))
    return out


def print_registers(kernel) -> None:
    """Registers and spills of each compiled variant of ``kernel`` (its constexprs that tell them apart)."""
    names = ("UNROLL", "SCAN_Q", "SCAN_D", "DOC_WALK", "DD_SCAN", "DD_SCAN_Q", "DQ_GATHER", "DD_OWNED", "BLOCK_K")
    for entry in getattr(kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for compiled in cache.values():
            try:
                items = compiled.src.constants.items()
                consts = {kernel.arg_names[k[0] if isinstance(k, tuple) else k]: v for k, v in items}
                tag = {n: consts[n] for n in names if n in consts}
                print(f"registers {compiled.n_regs:4d} spills {compiled.n_spills:4d} "
                      f"warps {compiled.metadata.num_warps} maxnreg {compiled.metadata.maxnreg} {tag}")  # fmt: skip
            except Exception as exc:  # (another Triton's layout of its caches: say so, go on)
                print(f"registers: not read ({type(exc).__name__}: {exc})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+", help="training workload names or patterns")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], help="label:NAME=VALUE,... (tools/knobs.py's)")
    ap.add_argument("--maxnreg", type=int, action="append", default=[], help="each side again under this cap too")
    args = ap.parse_args()
    variants = dict(parse_variant(v) for v in args.variant) or {"": {}}
    defaults = {n: getattr(*_owner(n)) for s in variants.values() for n in s}
    dev, dt = torch.device("cuda"), torch.bfloat16
    runs = {}
    for w in workloads.select("train", args.workloads, table=workloads.WORKLOADS + OFF_MATRIX + WIDE):
        inp = workloads.make_inputs(w, dev, dt)
        impls = (peers.MaxsimImpl(), peers.MaxsimPaddedImpl()) if w.ragged else (peers.MaxsimImpl(),)
        for impl in impls:
            for label, settings in variants.items():
                if impl.name != "maxsim" and label != next(iter(variants)):
                    continue  # (the padded twin under the first variant only)
                apply(settings, defaults)
                fn, operands = impl.prepare(w, inp, dev, dt)
                call = runner.make_call(w, fn, operands)
                for _ in range(3):
                    call()
                launch = capture(call)
                grid, _t, ints, constexprs, _r, _k = launch
                keys = ("SCAN_Q", "SCAN_D", "DOC_WALK", "UNROLL", "BT", "BN", "BLOCK_K")
                flags = {k: v for k, v in constexprs.items() if k in keys}
                name = f"{w.key} {impl.name}{' ' + label if label else ''}"
                print(f"{name}: grid {grid}, n_dq {ints[N_DQ_AT]}, {flags}", flush=True)
                for cap in (0, *args.maxnreg):
                    for side, thunk in sides(launch, cap).items():
                        thunk()
                        runs[f"{name} {side}{f' r{cap}' if cap else ''}"] = thunk
    apply({}, defaults)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for label, thunk in runs.items():
            times[label].append(do_bench(thunk, warmup=25, rep=100) * 1e3)
    for label, ts in times.items():
        print(f"{label:70s} " + " ".join(f"{t:7.1f}" for t in ts) + f"   min {min(ts):7.1f} us", flush=True)
    print_registers(maxsim_bwd_kernel)


if __name__ == "__main__":
    main()
