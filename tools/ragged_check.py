"""GPU check of the ragged paths: parity with the reference, no host sync, and speed against the padded dense path.

Usage: python tools/ragged_check.py. Prints one line per check; exits non-zero on a parity failure.
"""

from __future__ import annotations

import sys

import torch
from probe_common import kernel_table  # tools/ is on sys.path when this runs as a script
from triton.testing import do_bench

import maxsim
from maxsim import reference as ref


def offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def parity(dt: torch.dtype, normalize: bool) -> bool:
    g = torch.Generator().manual_seed(0)
    lq = torch.tensor([3, 0, 17, 1, 40, 130, 64])
    ld = torch.tensor([5, 1, 0, 70, 33, 2, 300, 129])
    cu_q, cu_d = offsets(lq).cuda(), offsets(ld).cuda()
    Q = torch.randn(int(lq.sum()), 96, generator=g).to(dt).cuda().requires_grad_()
    D = torch.randn(int(ld.sum()), 96, generator=g).to(dt).cuda().requires_grad_()
    pq = torch.tensor([4, 0, 2, 2, 4, 1, 3, 5, 6, 6]).cuda()
    pd = torch.tensor([3, 0, 5, 5, 0, 2, 3, 6, 7, 4]).cuda()
    ok = True
    for name, fn, rfn in (
        ("varlen", lambda a, b, **k: maxsim.maxsim_varlen(a, b, cu_q, cu_d, **k),
         lambda a, b: ref.maxsim_varlen(a, b, cu_q, cu_d, normalize=normalize)),
        ("pairs_varlen", lambda a, b, **k: maxsim.maxsim_pairs_varlen(a, b, cu_q, cu_d, pq, pd, **k),
         lambda a, b: ref.maxsim_pairs_varlen(a, b, cu_q, cu_d, pq, pd, normalize=normalize)),
    ):  # fmt: skip
        for bwd in ("fast", "deterministic"):
            s = fn(Q, D, normalize=normalize, backward=bwd)
            w = torch.randn(s.shape, generator=g).cuda()
            gq, gd = torch.autograd.grad((s * w).sum(), (Q, D))
            Qd, Dd = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
            r = rfn(Qd, Dd)
            rq, rd = torch.autograd.grad((r * w.double()).sum(), (Qd, Dd))
            es = ((s.double() - r).abs().max() / r.abs().max().clamp_min(1)).item()
            eq = ((gq.double() - rq).abs().max() / rq.abs().max().clamp_min(1e-9)).item()
            ed = ((gd.double() - rd).abs().max() / rd.abs().max().clamp_min(1e-9)).item()
            tol = 1e-5 if dt == torch.float32 else 2e-2
            good = es < tol and eq < tol and ed < tol
            ok &= good
            print(f"parity {name:13s} {str(dt):15s} normalize={normalize!s:5s} {bwd:13s} score {es:.1e} dQ {eq:.1e} "
                  f"dD {ed:.1e} {'ok' if good else 'FAIL'}")  # fmt: skip
    return ok


def no_sync() -> None:
    lq = torch.tensor([3, 9, 32]).cuda()
    ld = torch.tensor([5, 100, 33, 2]).cuda()
    cu_q, cu_d = offsets(lq), offsets(ld)
    Q = torch.randn(44, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    D = torch.randn(140, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pq = torch.tensor([2, 0, 1], device="cuda")
    pd = torch.tensor([1, 3, 1], device="cuda")
    maxsim.maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=32, max_seqlen_d=100).sum().backward()
    maxsim.maxsim_pairs_varlen(Q, D, cu_q, cu_d, pq, pd, max_seqlen_q=32, max_seqlen_d=100).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        maxsim.maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=32, max_seqlen_d=100).sum().backward()
        maxsim.maxsim_pairs_varlen(Q, D, cu_q, cu_d, pq, pd, max_seqlen_q=32, max_seqlen_d=100).sum().backward()
        print("sync-debug error mode: ragged forward+backward ok")
    finally:
        torch.cuda.set_sync_debug_mode(0)


def race(label: str, ours, ref, ours_inputs: tuple, ref_inputs: tuple, to_ours=None) -> dict:
    """Time ``ours(*ours_inputs)`` against ``ref(*ref_inputs)`` (same data, another layout), inference and a
    training step; ``to_ours`` maps the reference's scores onto ours for the equality check. Returns the two
    training steps, for profiling."""
    with torch.no_grad():
        a, b = ours(*ours_inputs), ref(*ref_inputs)
        t_ours, t_ref = do_bench(lambda: ours(*ours_inputs)), do_bench(lambda: ref(*ref_inputs))
    b = b if to_ours is None else to_ours(b)
    print(f"speed {label}: ours {t_ours:.4f} ms, reference layout {t_ref:.4f} ms, ratio {t_ours / t_ref:.2f}, "
          f"max diff {(a - b).abs().max().item():.2e}")  # fmt: skip
    steps = {}
    for name, fn, (Q, D) in (("ours", ours, ours_inputs), ("reference layout", ref, ref_inputs)):
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        steps[name] = lambda fn=fn, Qg=Qg, Dg=Dg: torch.autograd.grad(fn(Qg, Dg).sum(), (Qg, Dg))
    t_ours, t_ref = do_bench(steps["ours"]), do_bench(steps["reference layout"])
    print(f"speed train {label}: ours {t_ours:.4f} ms, reference layout {t_ref:.4f} ms, ratio {t_ours / t_ref:.2f}")
    return steps


def profile(label: str, steps: dict) -> None:
    """Where a training step spends its time, kernel by kernel (GPU) and op by op (host)."""
    for name, step in steps.items():
        kernel_table(f"{label}, {name}", step, host=True, rows=14)


def speed() -> None:
    g = torch.Generator().manual_seed(1)
    dt = torch.bfloat16
    # varlen cross: 64 queries (8..32 tokens) x 256 documents (20..1000 tokens, log-normal), against the padded
    # dense call on the same tokens (padding done here, outside the timed region)
    lq = torch.randint(8, 33, (64,), generator=g)
    ld = torch.exp(torch.randn(256, generator=g) * 0.8 + 5.0).round().clamp(20, 1000).long()
    Q = torch.randn(int(lq.sum()), 128, generator=g).to(dt).cuda()
    D = torch.randn(int(ld.sum()), 128, generator=g).to(dt).cuda()
    cu_q, cu_d = offsets(lq).cuda(), offsets(ld).cuda()
    mq, md = int(lq.max()), int(ld.max())
    Qp = torch.zeros(64, mq, 128, dtype=dt, device="cuda")
    Dp = torch.zeros(256, md, 128, dtype=dt, device="cuda")
    qm = torch.arange(mq, device="cuda")[None] < lq.cuda()[:, None]
    dm = torch.arange(md, device="cuda")[None] < ld.cuda()[:, None]
    Qp[qm] = Q
    Dp[dm] = D
    race(
        f"varlen 64x256 (Lq 8..32, Ld 20..1000 mean {ld.float().mean():.0f}, max {md}) vs padded dense",
        lambda q, d: maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=mq, max_seqlen_d=md),
        lambda q, d: maxsim.maxsim(q, d, qm, dm),
        (Q, D),
        (Qp, Dp),
    )

    # pair list on dense-equivalent input (3200 shuffled pairs) vs candidates 32x100 Lq32 Ld256
    B, K, Lq, Ld = 32, 100, 32, 256
    Qc = torch.randn(B, Lq, 128, generator=g).to(dt).cuda()
    Dc = torch.randn(B, K, Ld, 128, generator=g).to(dt).cuda()
    cu_q = torch.arange(0, (B + 1) * Lq, Lq, device="cuda", dtype=torch.int32)
    cu_d = torch.arange(0, (B * K + 1) * Ld, Ld, device="cuda", dtype=torch.int32)
    perm = torch.randperm(B * K, generator=g).cuda()
    pq, pd = perm // K, perm
    steps = race(
        "pair list 3200 pairs vs candidates 32x100 Lq32 Ld256",
        lambda q, d: maxsim.maxsim_pairs_varlen(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=Lq, max_seqlen_d=Ld),
        maxsim.maxsim,
        (Qc.reshape(-1, 128), Dc.reshape(-1, 128)),
        (Qc, Dc),
        to_ours=lambda s: s.reshape(-1)[perm],
    )
    profile("pair list vs candidates", steps)


def main() -> None:
    ok = True
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for normalize in (False, True):
            ok &= parity(dt, normalize)
    no_sync()
    speed()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
