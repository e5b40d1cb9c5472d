"""The long-query forward's tile loop alone, as a standalone kernel: a block of query rows against one document's
64- or 128-token tiles, the running max (and argmax) folded per column slot as ``forward._scan_tile`` does, with
each tile's MMA issued before the previous tile's fold (``ahead``) or after it (``plain``), in several block, tile,
warp and stage shapes, timed against ``maxsim.maxsim`` on the same tensors (docs/performance.md v166).

Usage (on the GPU): ``PYTHONPATH=src python tools/tile_loop_probe.py``. Prints each variant's median time (µs, do_bench
with its flush, 5 interleaved rounds), its rate and its row maxima against an fp32 product (and, bit for bit, against
the first variant's maxima and argmax). Run 91's call 1 timed every variant with the last one's launch (a lambda
bound late in the loop, since fixed): its times are that last variant's, 780 µs with the argmax (the library's
forward 564) and 238 without (the library's 237). This version ran in run 92
(``benchmarks/results/partial/h200-run92-tile-loop-probes.txt``).
"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def _fold(s, m2, a2, BN: tl.constexpr, ARGMAX: tl.constexpr):
    if ARGMAX:
        keep = (~(s > m2)).to(tl.float32)
        a2 = a2 * keep - BN
    m2 = tl.maximum(m2, s, propagate_nan=tl.PropagateNan.ALL)
    return m2, a2


@triton.jit
def _program_block(Nq, Lq, BM: tl.constexpr):
    """This program's query ``q``, document ``d``, row block ``rb`` and its query rows ``r``: the row blocks of one
    (query, document) pair are consecutive programs, then the queries, so consecutive programs share a document."""
    pid = tl.program_id(0)
    n_rb = tl.cdiv(Lq, BM)
    rb = pid % n_rb
    qd = pid // n_rb
    return qd % Nq, qd // Nq, rb, rb * BM + tl.arange(0, BM)


@triton.jit
def _store_rows(m2, a2, M_OUT, A_OUT, out, Ld, BN: tl.constexpr, ARGMAX: tl.constexpr):
    """Each row's maximum over its column slots, stored at ``out``, and (``ARGMAX``) its lowest winning token: the
    first slot holding the maximum (or a NaN), its token rebuilt from the offset ``_fold`` kept."""
    m = tl.max(m2, axis=1)
    tl.store(M_OUT + out, m)
    if ARGMAX:
        tok = a2 + (tl.cdiv(Ld, BN) * BN + tl.arange(0, BN)).to(tl.float32)[None, :]
        first = (m2 == m[:, None]) | (m2 != m2)
        a = tl.min(tl.where(first, tok, float("inf")), axis=1).to(tl.int32)
        tl.store(A_OUT + out, a)


@triton.jit
def probe_fwd(
    Q,
    D,
    M_OUT,
    A_OUT,
    Nq,
    Nd,
    Lq,
    Ld,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    AHEAD: tl.constexpr,
    ARGMAX: tl.constexpr,
    UP: tl.constexpr = False,
):
    q, d, rb, r = _program_block(Nq, Lq, BM)
    c = tl.arange(0, BN)
    k = tl.arange(0, BK)
    qt = tl.load(Q + (q * Lq + r)[:, None] * BK + k[None, :])
    if UP:
        qt = qt.to(tl.float32)
    d_base = D + d * Ld * BK
    m2 = tl.full([BM, BN], float("-inf"), tl.float32)
    a2 = tl.zeros([BM, BN] if ARGMAX else [1, 1], tl.float32)  # (no argmax: a one-element stand-in)
    if AHEAD:
        dt = tl.load(d_base + c[:, None] * BK + k[None, :])
        if UP:
            dt = dt.to(tl.float32)
        s = tl.dot(qt, tl.trans(dt))
        for n0 in range(BN, Ld, BN):
            dt = tl.load(d_base + (n0 + c)[:, None] * BK + k[None, :])
            if UP:
                dt = dt.to(tl.float32)
            s_next = tl.dot(qt, tl.trans(dt))
            m2, a2 = _fold(s, m2, a2, BN, ARGMAX)
            s = s_next
        m2, a2 = _fold(s, m2, a2, BN, ARGMAX)
    else:
        for n0 in range(0, Ld, BN):
            dt = tl.load(d_base + (n0 + c)[:, None] * BK + k[None, :])
            if UP:
                dt = dt.to(tl.float32)
            s = tl.dot(qt, tl.trans(dt))
            m2, a2 = _fold(s, m2, a2, BN, ARGMAX)
    _store_rows(m2, a2, M_OUT, A_OUT, (q * Nd + d) * Lq + r, Ld, BN, ARGMAX)


def _launch(grid, Q, D, M, A, Nq, Nd, Lq, Ld, BM, BN, ahead, argmax, warps, stages, cap):
    """One variant's launch as a closure over its own arguments (a lambda in the caller's loop would launch the
    loop's last variant when timed later: run 91's call 1 did, see the module docstring)."""

    def launch():
        return probe_fwd[grid](
            Q, D, M, A, Nq, Nd, Lq, Ld, BM=BM, BN=BN, BK=128, AHEAD=ahead, ARGMAX=argmax, num_warps=warps,
            num_stages=stages, **cap,
        )  # fmt: skip

    return launch


def run(Nq, Nd, Lq, Ld, argmax, variants, rounds=5):
    torch.manual_seed(0)
    Q = torch.randn(Nq, Lq, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(Nd, Ld, 128, device="cuda", dtype=torch.bfloat16)
    flops = 2 * Nq * Nd * Lq * Ld * 128
    res = {}
    outs = {}
    for name, spec in variants.items():
        BM, BN, ahead, warps, stages = spec[:5]
        cap = {"maxnreg": spec[5]} if len(spec) > 5 else {}
        M = torch.empty(Nq, Nd, Lq, device="cuda")
        A = torch.empty(Nq, Nd, Lq, device="cuda", dtype=torch.int32)
        grid = (Nq * Nd * triton.cdiv(Lq, BM),)
        f = _launch(grid, Q, D, M, A, Nq, Nd, Lq, Ld, BM, BN, ahead, argmax, warps, stages, cap)
        try:
            f()
            torch.cuda.synchronize()
        except Exception as e:  # (a variant past the registers or shared memory: reported, the others run)
            print(name, "FAILED", type(e).__name__, str(e)[:200])
            continue
        res[name] = f
        outs[name] = (M.clone(), A.clone())
    import maxsim

    Qg = Q.clone().requires_grad_(argmax)

    def prod():
        with torch.set_grad_enabled(argmax):
            return maxsim.maxsim(Qg, D)

    prod()
    torch.cuda.synchronize()
    res["library"] = prod
    times = {n: [] for n in res}
    for _ in range(rounds):
        for n, f in res.items():
            times[n].append(do_bench(f, warmup=25, rep=200))
    ref_m = (Q.float() @ D.float().flatten(0, 1).T).view(Nq, Lq, Nd, Ld).amax(-1).permute(0, 2, 1)
    base = next(iter(outs.values()))
    for n in res:
        t = sorted(times[n])[len(times[n]) // 2]
        extra = ""
        if n in outs:
            M, A = outs[n]
            err = float((M - ref_m).abs().max())
            same_a = bool(torch.equal(A, base[1])) if argmax else "-"
            extra = f" max|m-ref| {err:.2e} same-as-first m {bool(torch.equal(M, base[0]))} a {same_a}"
        print(f"  {n:28s} {t * 1000:8.1f} us  {flops / t / 1e9:6.1f} TF/s{extra}", flush=True)


def variants(*specs: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Each ``(BM, BN, ahead, warps, stages[, maxnreg])`` named by its values, e.g. ``ahead-128x64-w8-s3-r128``."""
    named = {}
    for spec in specs:
        bm, bn, ahead, warps, stages = spec[:5]
        cap = f"-r{spec[5]}" if len(spec) > 5 else ""
        named[f"{('plain', 'ahead')[ahead]}-{bm}x{bn}-w{warps}-s{stages}{cap}"] = spec
    return named


if __name__ == "__main__":
    V = variants(
        (128, 64, 0, 4, 3), (128, 64, 1, 4, 3), (128, 64, 0, 8, 3), (128, 64, 1, 8, 3), (128, 64, 1, 8, 4),
        (64, 64, 1, 4, 3), (64, 64, 0, 4, 3), (128, 128, 1, 8, 3), (128, 128, 0, 8, 3), (256, 64, 1, 8, 3),
        (128, 64, 1, 8, 3, 128), (128, 64, 0, 8, 3, 128), (64, 64, 1, 4, 4), (64, 128, 1, 4, 3),
    )  # fmt: skip
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    print("argmax forward, 32x32 Lq1024 Ld1024 (the long-query training step's)", flush=True)
    run(32, 32, 1024, 1024, True, V)
    print("scores only, ColPali 1x500 Lq1024 Ld1024", flush=True)
    run(1, 500, 1024, 1024, False, V | variants((128, 64, 0, 4, 4), (128, 64, 1, 4, 4)))
