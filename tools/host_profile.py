"""Where the host time of a tiny maxsim call goes (GPU only): per-layer timings and a cProfile of the hot path.

Usage: python tools/host_profile.py [--out FILE]. Host time = perf_counter over many calls without synchronizing
(the GPU work of these shapes is shorter than the host path, so the queue never fills).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import maxsim
from maxsim import ops
from maxsim.kernels import launch, launch_forward
from maxsim.kernels.forward import maxsim_fwd_kernel


def host_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res: dict = {}
    for name, (nq, nd, lq, ld) in {"4x4 Lq8 Ld8": (4, 4, 8, 8), "32x32 Lq32 Ld80": (32, 32, 32, 80)}.items():
        Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16)
        Qc, Dc = Q, D[None]
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        r = {
            "maxsim.maxsim": host_us(lambda: maxsim.maxsim(Q, D)),
            "launch.forward": host_us(lambda: launch.forward(Qc, Dc, None, None, False, False)),
            "torch.empty x2": host_us(
                lambda: (torch.empty((nq, nd), device="cuda"), torch.empty((0,), dtype=torch.int32, device="cuda"))
            ),
            "train step (autograd.grad)": host_us(lambda: torch.autograd.grad(maxsim.maxsim(Qg, Dg).sum(), (Qg, Dg))),
        }
        cu_q = torch.arange(0, (nq + 1) * lq, lq, device="cuda", dtype=torch.int32)
        cu_d = torch.arange(0, (nd + 1) * ld, ld, device="cuda", dtype=torch.int32)
        Qp, Dp = Q.reshape(-1, 128), D.reshape(-1, 128)
        r["maxsim_varlen (max_seqlen given)"] = host_us(
            lambda: maxsim.maxsim_varlen(Qp, Dp, cu_q, cu_d, max_seqlen_q=lq, max_seqlen_d=ld)
        )
        # The raw Triton launch of the same kernel with precomputed arguments.
        captured = {}
        orig = maxsim_fwd_kernel.run

        def spy(*a, **kw):
            captured["a"], captured["kw"] = a, kw
            return orig(*a, **kw)

        maxsim_fwd_kernel.run = spy
        # so that the next launch goes through Triton's own path (plans keep their own table of launches too)
        launch_forward._fwd._known.clear()
        launch_forward.plans.clear()
        launch.forward(Qc, Dc, None, None, False, False)
        maxsim_fwd_kernel.run = orig
        a, kw = captured["a"], dict(captured["kw"])
        r["triton run (raw launch)"] = host_us(lambda: orig(*a, **kw))
        dev = torch.cuda.current_device()
        caches = maxsim_fwd_kernel.device_caches[dev]
        binder = caches[-1]
        kw2 = {k: v for k, v in kw.items() if k not in ("grid", "warmup")}
        kw2.setdefault("debug", False)
        try:
            r["triton binder only"] = host_us(lambda: binder(*a, **kw2))
        except Exception as e:  # noqa: BLE001
            r["triton binder only"] = repr(e)
        kernel = orig(*a, **kw)
        bound, _, _ = binder(*a, **kw2)
        vals = tuple(bound.values())
        stream = torch.cuda.current_stream().cuda_stream
        grid = kw["grid"]
        try:
            r["compiled.run direct"] = host_us(
                lambda: kernel.run(
                    grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *vals
                )
            )
        except Exception as e:  # noqa: BLE001
            r["compiled.run direct"] = repr(e)
        # Pointers given as ints skip the launcher's data_ptr() call and its cuPointerGetAttribute per argument;
        # the launcher reads them itself (Launcher's direct path). Interleaved rounds, the minimum of each.
        tensor_args = lambda: kernel.run(  # noqa: E731
            grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *vals
        )
        ptrs = [v for v in vals if isinstance(v, torch.Tensor)]
        n = len(ptrs)  # (the kernel's pointers come first)
        int_args = lambda: kernel.run(  # noqa: E731
            grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
            *[t.data_ptr() for t in vals[:n]], *vals[n:],
        )  # fmt: skip
        rounds = {"tensors": [], "ints": []}
        for _ in range(7):
            rounds["tensors"].append(host_us(tensor_args))
            rounds["ints"].append(host_us(int_args))
        r[f"compiled.run direct, {len(ptrs)} tensors (min of 7)"] = min(rounds["tensors"])
        r[f"compiled.run direct, {len(ptrs)} pointers read here (min of 7)"] = min(rounds["ints"])
        # Our Python alone: the plans' cached launches made no-ops.
        maxsim.maxsim(Q, D)  # (its plan, after the clear above)
        saved = {}
        for plan in launch_forward.plans.values():
            for k, hit in plan.launches.items():
                saved.setdefault((id(plan.launches), k), (plan.launches, k, hit))  # (repeat entries: same plans)
                plan.launches[k] = (lambda *a: None, *hit[1:])
        r["maxsim.maxsim, launch stubbed"] = host_us(lambda: maxsim.maxsim(Q, D))
        for launches, k, hit in saved.values():
            launches[k] = hit
        r["maxsim.maxsim again"] = host_us(lambda: maxsim.maxsim(Q, D))
        # The repeat path (ops.repeat_key) against the full one, interleaved.
        repeat_key, both = ops.repeat_key, {"repeat": [], "full": []}
        for _ in range(7):
            both["repeat"].append(host_us(lambda: maxsim.maxsim(Q, D)))
            ops.repeat_key = lambda *a: None
            both["full"].append(host_us(lambda: maxsim.maxsim(Q, D)))
            ops.repeat_key = repeat_key
        r["maxsim.maxsim, repeat path (min of 7)"] = min(both["repeat"])
        r["maxsim.maxsim, full path (min of 7)"] = min(both["full"])
        r["get_current_stream"] = host_us(lambda: torch.cuda.current_stream().cuda_stream)
        res[name] = r
        for k, v in r.items():
            print(f"{name:18s} {k:32s} {v if isinstance(v, str) else f'{v:8.2f} us'}")

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            maxsim.maxsim(Q, D)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())
        res[name]["profile"] = s.getvalue()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
