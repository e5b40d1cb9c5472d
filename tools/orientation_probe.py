"""Standalone prototypes of a thin once-read scan (one query block of 32 rows a document), plain and with
``normalize=True``, against the library and late-interaction-kernels: the probe behind forward.py's ``DOC_ROWS``
(docs/performance.md v132).

* ``reg``: ``s = q @ d^T [TQ, BN]``, the library's orientation before DOC_ROWS; ``tr``: ``s^T = d @ q^T [BN, TQ]``,
  the document's tokens in the MMA's rows.
* Modes: ``m0`` plain; ``m1`` each tile's sums of squares; ``m3`` an in-program pass over the document that writes
  its inverse norms to a scratch, then the scan with the norms loaded (the other lead for the normalized scans).
* Every output is checked against a float64 reference first; times are ``do_bench`` medians of 5 rounds.

Usage (GPU; on the CPU with TRITON_INTERPRET=1 it runs two tiny shapes for their errors only):
  python tools/orientation_probe.py [SHAPE_SUBSTRING ...]
"""

from __future__ import annotations

import functools
import statistics
import sys

import torch
import triton
import triton.language as tl

EPS = 1e-12


@triton.jit
def _qblock(Q, n, sq_n, sq_l, Lq, dim, TQ: tl.constexpr, BK: tl.constexpr):
    r = tl.arange(0, TQ)
    kd = tl.arange(0, BK)
    ok = r < Lq
    qt = tl.load(Q + n * sq_n + r[:, None] * sq_l + kd[None, :], mask=ok[:, None] & (kd < dim)[None, :], other=0.0)
    return qt, ok


@triton.jit
def _norm_pass(d_base, INVS, Ld, sd_l, dim, BN1: tl.constexpr, BK: tl.constexpr):
    kd = tl.arange(0, BK)
    for n0 in range(0, Ld, BN1):
        rows = n0 + tl.arange(0, BN1)
        ok = rows < Ld
        x = tl.load(
            d_base + rows[:, None] * sd_l + kd[None, :],
            mask=ok[:, None] & (kd < dim)[None, :],
            other=0.0,
            eviction_policy="evict_last",
        ).to(tl.float32)
        inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)
        tl.store(INVS + rows, inv, mask=ok)
    tl.debug_barrier()


@triton.jit
def _per_token(v, TR: tl.constexpr):
    """A document token's value against the tile's similarities: a column (``TR``: a row) of them."""
    if TR:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def proto_kernel(
    Q, D, INVS, OUT, K, Ld, Lq, dim, sq_n, sq_l, sd_b, sd_k, sd_l, ld_pad,
    TQ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr, NORM: tl.constexpr, TR: tl.constexpr,
):  # fmt: skip
    """One program a (query, document) pair; ``TR``: the product transposed (document tokens as the MMA's rows)."""
    pid = tl.program_id(0)
    n = pid // K
    k = pid % K
    qt, qok = _qblock(Q, n, sq_n, sq_l, Lq, dim, TQ, BK)
    d_base = D + n.to(tl.int64) * sd_b + k.to(tl.int64) * sd_k
    inv_base = INVS + pid.to(tl.int64) * ld_pad
    if MODE == 3:
        _norm_pass(d_base, inv_base, Ld, sd_l, dim, BN, BK)
    kd = tl.arange(0, BK)
    if TR:
        q_op = tl.trans(qt)
        m2 = tl.full([BN, TQ], float("-inf"), dtype=tl.float32)
    else:
        q_op = qt
        m2 = tl.full([TQ, BN], float("-inf"), dtype=tl.float32)
    for n0 in range(0, Ld, BN):
        cols = n0 + tl.arange(0, BN)
        rows = tl.minimum(cols, Ld - 1)
        if MODE == 3:
            inv = tl.load(inv_base + cols, mask=cols < Ld, other=0.0)
        dt = tl.load(d_base + rows[:, None] * sd_l + kd[None, :], mask=(kd < dim)[None, :], other=0.0)
        if TR:  # noqa: SIM108 (a constexpr branch: the other product's shapes do not match)
            s = tl.dot(dt, q_op)
        else:
            s = tl.dot(q_op, tl.trans(dt))
        if NORM:
            if MODE == 1:
                dtf = dt.to(tl.float32)
                inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(dtf * dtf, axis=1)), 1e-12)
            s = s * _per_token(inv, TR)
        if n0 + BN > Ld:
            s = tl.where(_per_token(cols < Ld, TR), s, float("-inf"))
        m2 = tl.maximum(m2, s)
    m = tl.max(m2, axis=0 if TR else 1)
    if NORM:
        qf = qt.to(tl.float32)
        m = m / tl.maximum(tl.sqrt(tl.sum(qf * qf, axis=1)), 1e-12)
    tl.store(OUT + pid, tl.sum(tl.where(qok, m, 0.0), axis=0))


def run_proto(tr, Q, D, shared, mode, norm, BN=64, warps=4, stages=3, invs=None):
    Nq, Lq, dim = Q.shape
    K, Ld = D.shape[-3], D.shape[-2]
    out = torch.empty(Nq * K, device=Q.device, dtype=torch.float32)
    ld_pad = triton.cdiv(Ld, BN) * BN
    if invs is None:
        invs = torch.empty(Nq * K * ld_pad if mode == 3 else 1, device=Q.device, dtype=torch.float32)
    sd = D.stride()
    args = (Q, D, invs, out, K, Ld, Lq, dim, Q.stride(0), Q.stride(1), 0 if shared else sd[0], sd[1], sd[2], ld_pad)
    consts = dict(TQ=32, BN=BN, BK=triton.next_power_of_2(dim), MODE=mode, NORM=norm, TR=tr)
    proto_kernel[(Nq * K,)](*args, **consts, num_warps=warps, num_stages=stages)
    return out.view(Nq, K)


def reference(Q, D, norm):
    q, d = Q.double(), D.double()
    if norm:
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(EPS)
        d = d / d.norm(dim=-1, keepdim=True).clamp_min(EPS)
    s = torch.einsum("nid,kjd->nkij", q, d[0]) if d.shape[0] == 1 else torch.einsum("nid,nkjd->nkij", q, d)
    return s.amax(-1).sum(-1)


SHAPES = [  # name, Nq, K, Lq, Ld, dim, shared documents
    ("cand-32x100-lq32-ld256", 32, 100, 32, 256, 128, False),
    ("rerank-1x1000-lq32-ld300", 1, 1000, 32, 300, 128, True),
    ("cand-32x50-lq32-ld180", 32, 50, 32, 180, 128, False),
    ("rerank-1x1000-lq32-ld1024", 1, 1000, 32, 1024, 128, True),
]
SMALL_SHAPES = [("small-cand", 2, 3, 32, 70, 128, False), ("small-shared", 1, 4, 20, 90, 96, True)]


def _prototypes(Q, D, shared: bool, norm: bool, small: bool) -> dict:
    """label -> call of every prototype variant."""
    calls = {}
    for kname, tr in (("reg", False), ("tr", True)):
        for mode in (1, 3) if norm else (0,):
            label = f"{kname}-m{mode}" + ("-norm" if norm else "")
            calls[label] = functools.partial(run_proto, tr, Q, D, shared, mode, norm)
            if kname == "tr" and not small:
                calls[label + "-bn128"] = functools.partial(run_proto, tr, Q, D, shared, mode, norm, BN=128, stages=2)
                calls[label + "-s4"] = functools.partial(run_proto, tr, Q, D, shared, mode, norm, BN=64, stages=4)
    return calls


def _library(Q, D, norm: bool, small: bool) -> dict:
    """label -> call of the library (and, with ``norm``, of it with the pre-pass off) and of LIK."""
    import maxsim
    from maxsim.kernels import launch_settings

    def lib_sums():
        old = launch_settings.PRENORM_UNSHARED
        launch_settings.PRENORM_UNSHARED = 0
        try:
            return maxsim.maxsim(Q, D, normalize=True)
        finally:
            launch_settings.PRENORM_UNSHARED = old

    tag = "-norm" if norm else ""
    calls = {"lib" + tag: functools.partial(maxsim.maxsim, Q, D, normalize=norm)}
    if norm:
        calls["lib-sums-norm"] = lib_sums
    if not small:
        try:
            import late_interaction_kernels as lik
        except ImportError:
            return calls
        calls["lik" + tag] = functools.partial(lik.maxsim, Q, D, normalize=norm)
    return calls


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    small = dev == "cpu"
    only = sys.argv[1:]
    from maxsim.kernels import launch_forward

    for name, Nq, K, Lq, Ld, dim, shared in SMALL_SHAPES if small else SHAPES:
        if only and not any(o in name for o in only):
            continue
        g = torch.Generator(device="cpu").manual_seed(0)
        dt = torch.float16 if small else torch.bfloat16
        Q = (torch.randn(Nq, Lq, dim, generator=g) * 0.7).to(dev, dt)
        D = (torch.randn(1 if shared else Nq, K, Ld, dim, generator=g) * 1.3).to(dev, dt)
        calls, errs = {}, {}
        for norm in (False, True):
            ref = reference(Q, D, norm)
            found = {**_prototypes(Q, D, shared, norm, small), **_library(Q, D[0] if shared else D, norm, small)}
            for label, fn in found.items():
                try:
                    got = fn().double().reshape(ref.shape)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not timed
                    print(name, label, "FAILED", repr(e)[:300])
                    continue
                calls[label], errs[label] = fn, ((got - ref).abs().max() / ref.abs().max()).item()
        if small:
            for label, err in errs.items():
                print(f"{name:28s} {label:16s} err {err:.2e}")
            continue
        from triton.testing import do_bench

        times = {k: [] for k in calls}
        for _ in range(5):
            for label, fn in calls.items():
                times[label].append(do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3)
        for label, err in errs.items():
            print(f"{name:28s} {label:16s} {statistics.median(times[label]):8.1f} us  err {err:.2e}", flush=True)
        launch_forward.plans.clear()


if __name__ == "__main__":
    main()
