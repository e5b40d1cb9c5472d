"""Quick GPU check while developing: parity on a spread of shapes, then timings of the design.md §7 workloads.

Run on the device machine: ``python tools/gpu_smoke.py [--no-time] [--only-time]``. Prints a table; not the
benchmark of record (that is ``maxsim bench``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import triton

import maxsim
from maxsim import reference as ref


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def parity() -> int:
    torch.manual_seed(0)
    bad = 0
    cases = [
        (3, 4, 7, 5, 8), (2, 3, 33, 80, 100), (5, 2, 32, 300, 128), (4, 6, 1, 1, 48), (2, 3, 1024, 200, 128),
        (7, 9, 23, 333, 96), (3, 2, 32, 70, 256), (2, 2, 16, 40, 512),
    ]  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for Nq, Nd, Lq, Ld, dim in cases if dtype != torch.float16 else cases[:3]:
            for normalize in (False, True):
                for layout in ("cross", "cand"):
                    Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=dtype)
                    if layout == "cross":
                        D = torch.randn(Nd, Ld, dim, device="cuda", dtype=dtype)
                        dm = torch.rand(Nd, Ld, device="cuda") > 0.3
                    else:
                        D = torch.randn(Nq, Nd, Ld, dim, device="cuda", dtype=dtype)
                        dm = torch.rand(Nq, Nd, Ld, device="cuda") > 0.3
                    qm = torch.rand(Nq, Lq, device="cuda") > 0.2
                    Q.requires_grad_()
                    D.requires_grad_()
                    out = {}
                    for mode in ("fast", "deterministic"):
                        s = maxsim.maxsim(Q, D, qm, dm, normalize=normalize, backward=mode)
                        g = torch.ones_like(s)
                        out[mode] = (s, *torch.autograd.grad(s, (Q, D), g))
                    Q64 = Q.detach().double().requires_grad_()
                    D64 = D.detach().double().requires_grad_()
                    r = ref.maxsim(Q64, D64, qm, dm, normalize=normalize)
                    rq, rd = torch.autograd.grad(r, (Q64, D64), torch.ones_like(r))
                    errs = []
                    for mode in ("fast", "deterministic"):
                        s, dq, dd = out[mode]
                        errs += [rel(s, r), rel(dq, rq), rel(dd, rd)]
                    tol_s = 2e-5 if dtype == torch.float32 else 2e-3
                    tol_g = 2e-5 if dtype == torch.float32 else 1e-2
                    ok = errs[0] < tol_s and errs[3] < tol_s and max(errs[1], errs[2], errs[4], errs[5]) < tol_g
                    bad += not ok
                    if not ok or Lq >= 1024:
                        print(
                            "PARITY", "ok " if ok else "BAD", dtype, (Nq, Nd, Lq, Ld, dim), layout, normalize,
                            " ".join(f"{e:.1e}" for e in errs),
                        )  # fmt: skip
    # determinism, sync-free, graphs
    Q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    D = torch.randn(64, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = []
    for _ in range(3):
        s = maxsim.maxsim(Q, D, backward="deterministic")
        grads.append(torch.autograd.grad(s, (Q, D), torch.ones_like(s)))
    det = all(torch.equal(grads[0][i], g[i]) for g in grads[1:] for i in range(2))
    print("deterministic bitwise:", det)
    bad += not det
    torch.cuda.synchronize()
    g = torch.ones(64, 64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = maxsim.maxsim(Q, D)
        torch.autograd.grad(s, (Q, D), g)
        print("sync-free: ok")
    except RuntimeError as e:
        print("sync-free: FAIL", e)
        bad += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return bad


def bench(fn, warmup=25, rep=100):
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def eager(Q, D):
    if D.dim() == 4:
        return torch.einsum("qid,qkjd->qkij", Q, D).amax(-1).sum(-1)
    return torch.einsum("qid,kjd->qkij", Q, D).amax(-1).sum(-1)


def peers():
    out = {}
    try:
        import late_interaction_kernels as lik

        out["lik"] = lambda Q, D: lik.maxsim(Q, D)
    except Exception as e:  # noqa: BLE001
        print("lik unavailable:", e)
    try:
        from flash_maxsim import flash_maxsim_batched
        from flash_maxsim.flash_maxsim_batched_train import flash_maxsim_batched_train

        def fl(Q, D):
            if torch.is_grad_enabled() and Q.requires_grad:
                return flash_maxsim_batched_train(Q, D, shared_docs=D.dim() == 3)
            return flash_maxsim_batched(Q, D, shared_docs=D.dim() == 3)

        out["flash"] = fl
    except Exception as e:  # noqa: BLE001
        print("flash unavailable:", e)
    return out


INFER = [
    ("cross 32x32 Lq32 Ld80", 32, 32, 32, 80, 128, False),
    ("cross 1x1000 Lq32 Ld1024", 1, 1000, 32, 1024, 128, False),
    ("cross 32x65536 Lq32 Ld256", 32, 65536, 32, 256, 128, False),
    ("cross 1x500 Lq1024 Ld1024", 1, 500, 1024, 1024, 128, False),
    ("cand B32 K100 Lq32 Ld256", 32, 100, 32, 256, 128, True),
    ("cross 1x1000 Lq32 Ld1024 d48", 1, 1000, 32, 1024, 48, False),
    ("cross 128x128 Lq32 Ld300", 128, 128, 32, 300, 128, False),
]
TRAIN = [
    ("cross 32x32 Lq32 Ld80", 32, 32, 32, 80, 128, False),
    ("cross 64x64 Lq32 Ld128", 64, 64, 32, 128, 128, False),
    ("cross 256x256 Lq32 Ld300", 256, 256, 32, 300, 128, False),
    ("cand B64 K32 Lq32 Ld180", 64, 32, 32, 180, 128, True),
    ("cross 64x64 Lq32 Ld1024", 64, 64, 32, 1024, 128, False),
    ("cross 32x32 Lq1024 Ld1024", 32, 32, 1024, 1024, 128, False),
]


def timings() -> None:
    impls = {"maxsim": maxsim.maxsim, "maxsim-det": None, "eager": eager, **peers()}
    dt = torch.bfloat16
    print(f"{'workload':34s} " + " ".join(f"{k:>10s}" for k in impls))
    for name, Nq, Nd, Lq, Ld, dim, cand in INFER:
        Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=dt)
        D = torch.randn(*((Nq,) if cand else ()), Nd, Ld, dim, device="cuda", dtype=dt)
        row = []
        for k, fn in impls.items():
            if fn is None or (k == "eager" and Nd * Nq * Lq * Ld > 2**31):
                row.append("-")
                continue
            try:
                with torch.no_grad():
                    row.append(f"{bench(lambda fn=fn: fn(Q, D)):.4f}")
            except Exception as e:  # noqa: BLE001
                row.append("ERR")
                print(k, name, repr(e)[:200])
        print(f"infer {name:28s} " + " ".join(f"{x:>10s}" for x in row), flush=True)

    for name, Nq, Nd, Lq, Ld, dim, cand in TRAIN:
        Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=dt, requires_grad=True)
        D = torch.randn(*((Nq,) if cand else ()), Nd, Ld, dim, device="cuda", dtype=dt, requires_grad=True)
        W = torch.randn(Nq, Nd, device="cuda")
        row = []
        for k, fn in impls.items():
            if k == "maxsim-det":
                fn = lambda Q, D: maxsim.maxsim(Q, D, backward="deterministic")  # noqa: E731

            def step(fn=fn):
                s = fn(Q, D)
                torch.autograd.grad((s * W).sum(), (Q, D))

            try:
                row.append(f"{bench(step):.4f}")
            except Exception as e:  # noqa: BLE001
                row.append("ERR")
                print(k, name, repr(e)[:200])
        print(f"train {name:28s} " + " ".join(f"{x:>10s}" for x in row), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--only-time", action="store_true")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    t0 = time.time()
    nbad = 0 if a.only_time else parity()
    print(f"parity failures: {nbad} ({time.time() - t0:.0f}s)")
    if not a.no_time:
        timings()
    sys.exit(1 if nbad else 0)
