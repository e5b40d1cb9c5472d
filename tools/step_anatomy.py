"""Anatomy of a training step on the GPU: host time and GPU time of each piece, dense vs pair list.

Usage: python tools/step_anatomy.py [--out FILE] [--kernels] [--cross]. For every piece, ``host`` is perf_counter per
call without synchronizing (what the Python side costs) and ``gpu`` is triton's do_bench (what a stream of such calls
costs end to end: whichever of host and device is slower). A step is host-bound where host ≈ gpu. ``--kernels`` also
prints the GPU time per kernel of the large training steps (design.md §7), the GPU-bound ones; ``--cross`` times the
pieces of those cross-product steps too (which of them are host-bound).
"""

from __future__ import annotations

import argparse
import json

import torch
from host_profile import host_us
from probe_common import TRAIN_CROSS_SHAPES, kernel_table
from triton.testing import do_bench

import maxsim
from maxsim.kernels import launch
from maxsim.layout import Ragged


def pieces(label: str, fwd, Q: torch.Tensor, D: torch.Tensor, rg: Ragged | None) -> dict:
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    s = fwd(Qg, Dg)
    grad = torch.ones_like(s)
    Qc, Dc = Q, (D[None] if rg is None and D.dim() == 3 else D)  # canonical layout (layout.py)
    with torch.no_grad():
        _, argmax = launch.forward(Qc, Dc, None, None, False, True, rg)
    g2 = torch.ones(argmax.shape[:2], device="cuda")
    fns = {
        "train step": lambda: torch.autograd.grad(fwd(Qg, Dg).sum(), (Qg, Dg)),
        "forward, grad on": lambda: fwd(Qg, Dg),
        "forward, no grad": lambda: fwd(Q, D),
        "backward only (retain_graph)": lambda: torch.autograd.grad(s, (Qg, Dg), grad, retain_graph=True),
        "launch.backward fast": lambda: launch.backward(g2, Qc, Dc, argmax, False, False, rg),
        "launch.backward deterministic": lambda: launch.backward(g2, Qc, Dc, argmax, False, True, rg),
    }
    if rg is not None:
        n_d = rg.d_seg.shape[0] - 1
        fns["csr (by document)"] = lambda: launch.csr(rg.pair_d, n_d)
        fns["torch.sort stable"] = lambda: torch.sort(rg.pair_d, stable=True)
        fns["torch.sort unstable"] = lambda: torch.sort(rg.pair_d)
        fns["zeros like Q fp32"] = lambda: torch.zeros(Q.shape, dtype=torch.float32, device="cuda")
    x = torch.randn(8, 8, device="cuda", requires_grad=True)
    fns["autograd.grad of (x*2).sum() (engine floor)"] = lambda: torch.autograd.grad((x * 2).sum(), (x,))
    out = {}
    for name, fn in fns.items():
        h = host_us(fn, 300)
        g = do_bench(fn, warmup=20, rep=100) * 1e3
        out[name] = {"host_us": h, "wall_us": g}
        print(f"{label:34s} {name:46s} host {h:8.1f} us   stream {g:8.1f} us")
    return out


def large_steps() -> None:
    dt = torch.bfloat16
    for label, (nq, nd, lq, ld, dim) in TRAIN_CROSS_SHAPES.items():
        Q = torch.randn(nq, lq, dim, device="cuda", dtype=dt, requires_grad=True)
        D = torch.randn(nd, ld, dim, device="cuda", dtype=dt, requires_grad=True)
        w = torch.randn(nq, nd, device="cuda")
        kernel_table(label, lambda Q=Q, D=D, w=w: torch.autograd.grad((maxsim.maxsim(Q, D) * w).sum(), (Q, D)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--cross", action="store_true")
    args = ap.parse_args()
    if args.kernels:
        large_steps()
    dt = torch.bfloat16
    res = {}
    if args.cross:
        for label, (nq, nd, lq, ld, dim) in TRAIN_CROSS_SHAPES.items():
            Q = torch.randn(nq, lq, dim, device="cuda", dtype=dt)
            D = torch.randn(nd, ld, dim, device="cuda", dtype=dt)
            res[label] = pieces(label, lambda q, d: maxsim.maxsim(q, d), Q, D, None)
    B, K, Lq, Ld, dim = 64, 32, 32, 180, 128
    Q = torch.randn(B, Lq, dim, device="cuda", dtype=dt)
    D = torch.randn(B, K, Ld, dim, device="cuda", dtype=dt)
    res["candidates 64x32"] = pieces("candidates 64x32 Lq32 Ld180", lambda q, d: maxsim.maxsim(q, d), Q, D, None)
    cu_q = torch.arange(0, (B + 1) * Lq, Lq, device="cuda", dtype=torch.int32)
    cu_d = torch.arange(0, (B * K + 1) * Ld, Ld, device="cuda", dtype=torch.int32)
    perm = torch.randperm(B * K, device="cuda")
    pq, pd = (perm // K).to(torch.int32), perm.to(torch.int32)
    Qp, Dp = Q.reshape(-1, dim), D.reshape(-1, dim)
    rg = Ragged(cu_q, cu_d, pq, pd, Lq, Ld)
    res["pair list 2048"] = pieces(
        "pair list 2048 (same data)",
        lambda q, d: maxsim.maxsim_pairs_varlen(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=Lq, max_seqlen_d=Ld),
        Qp, Dp, rg,
    )  # fmt: skip
    Qt = torch.randn(4, 8, dim, device="cuda", dtype=dt)
    Dt = torch.randn(4, 8, dim, device="cuda", dtype=dt)
    res["tiny 4x4"] = pieces("tiny cross 4x4 Lq8 Ld8", lambda q, d: maxsim.maxsim(q, d), Qt, Dt, None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
