"""Queries packed at their own length against TQ-row slots (``launch_settings.PACK_ROWS``), GPU only.

Cross products whose query length is not a power of two, bf16, in one process: the forward with and without the
argmax, and the training step (forward + backward), each with packing on and off in interleaved rounds
(``triton.testing.do_bench`` medians with its L2 flush; the median over rounds is printed), then the GPU time of
each (the kernels' time per call, torch.profiler over 10 calls): a host-bound call's do_bench time is its host's.

Usage: python tools/pack_probe.py [--rounds N] [--only SUBSTR] [--shapes NQxNDxLQxLDxDIM ...] [--dtype fp32]
[--level 2]. ``--level``: the packing level compared against slots (2 packs fp32 tokens too).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench

import maxsim
from maxsim.kernels import launch_backward, launch_forward, launch_settings

# (Nq, Nd, Lq, Ld, dim) of each cross product, named by _name
SHAPES = [
    (128, 128, 23, 333, 128),
    (256, 256, 23, 300, 128),
    (64, 512, 20, 1024, 128),  # ColPali-like: short text queries against page patches
    (128, 128, 40, 300, 128),
    (256, 256, 12, 300, 128),
    (64, 64, 23, 333, 96),  # the matrix's training row cross-64x64-lq23-ld333-d96
    (48, 48, 23, 333, 96),
    (32, 32, 23, 64, 64),  # one wave in slots: not packed by the table (launch_forward.packed_queries)
]


def _name(Nq: int, Nd: int, Lq: int, Ld: int, dim: int) -> str:
    return f"cross {Nq}x{Nd} Lq{Lq} Ld{Ld}" + ("" if dim == 128 else f" d{dim}")


def _calls(Nq: int, Nd: int, Lq: int, Ld: int, dim: int, dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    Q = torch.randn(Nq, Lq, dim, device="cuda", generator=g).to(dtype)
    D = torch.randn(Nd, Ld, dim, device="cuda", generator=g).to(dtype)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    grad = torch.randn(Nq, Nd, device="cuda", generator=g)

    def scores():
        with torch.no_grad():
            return maxsim.maxsim(Q, D)

    def argmax():
        with torch.no_grad():
            return maxsim.maxsim(Q, D, return_argmax=True)

    def step():
        return torch.autograd.grad(maxsim.maxsim(Qg, Dg), (Qg, Dg), grad)

    return {"scores": scores, "argmax fwd": argmax, "train step": step}


def gpu_us(fn) -> float:
    """Kernel time per call of ``fn``, µs: the sum over 10 calls (after 3 warm-up calls) of every kernel's own
    device time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    total = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return total / 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default=None)
    ap.add_argument("--shapes", nargs="+", metavar="NQxNDxLQxLDxDIM", help="these cross products instead")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--level", type=int, default=1, help="PACK_ROWS of the packed side")
    args = ap.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    level = args.level
    for shape in shapes:
        name = _name(*shape) + ("" if dtype == torch.bfloat16 else f" {args.dtype}")
        if args.only and args.only not in name:
            continue
        calls = _calls(*shape, dtype)
        times: dict = {(k, p): [] for k in calls for p in (level, 0)}
        same = None
        for _ in range(args.rounds):
            for pack in (level, 0):
                launch_settings.PACK_ROWS = pack
                launch_forward.plans.clear()
                launch_backward.plans.clear()
                out = calls["argmax fwd"]()
                if same is None:
                    same = out
                else:  # (packing moves a score's row sum into another order: within a few ulp)
                    torch.testing.assert_close(out[0], same[0], rtol=1e-5, atol=1e-5)
                    assert torch.equal(out[1], same[1])
                for k, fn in calls.items():
                    times[(k, pack)].append(do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3)
        launch_settings.PACK_ROWS = 1
        cols = []
        for k in calls:
            on, off = statistics.median(times[(k, level)]), statistics.median(times[(k, 0)])
            cols.append(f"{k} {off:8.1f} -> {on:8.1f} us ({off / on:4.2f}x)")
        print(f"{name:28s} " + "   ".join(cols), flush=True)
        cols = []
        for k, fn in calls.items():
            gpu = {}
            for pack in (0, level):
                launch_settings.PACK_ROWS = pack
                launch_forward.plans.clear()
                launch_backward.plans.clear()
                gpu[pack] = gpu_us(fn)
            cols.append(f"{k} {gpu[0]:8.1f} -> {gpu[level]:8.1f} us ({gpu[0] / gpu[level]:4.2f}x)")
        launch_settings.PACK_ROWS = 1
        print(f"{'  GPU time':28s} " + "   ".join(cols), flush=True)


if __name__ == "__main__":
    main()
