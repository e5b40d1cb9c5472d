"""The backward kernels: gradients from the saved argmax alone (``[Nq, K, Lq]`` int32, -1 = no contribution).

With ``a = argmax[q, k, t]`` and ``g = grad[q, k]``:

    dQ[q, t]        += g · D[doc(q, k), a]       (gather: one program per query-token block, summing over k)
    dD[doc(q,k), a] += g · Q[q, t]               (scatter)

The scatter comes in two flavours sharing the same inputs:

* ``maxsim_bwd_dd_scatter_kernel`` (fast): one program per (pair, token block), fp32 atomics into a zeroed buffer;
* ``maxsim_bwd_dd_owned_kernel`` (deterministic): each program owns a block of document tokens and walks the queries
  that scored that document in a fixed order, selecting their tokens with a one-hot MMA
  (``onehot[BN, TQ] @ Q[TQ, dim]``), so the sum order never changes and no atomics are used.

With ``normalize=True`` the kernels produce gradients w.r.t. the normalized tokens (they scale by the saved-free
inverse norms); the per-token projection back to the raw tokens happens once per token afterwards.

Sizes are not specialized (no recompile for new shapes); strides are, so that loads stay 16 bytes wide.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["Nq", "K", "Lq", "si_b", "si_k", "n_tb"])
def maxsim_bwd_dq_kernel(
    G, ARG, D, INV_D, DQ,
    Nq, K, Lq, dim,
    sd_b, sd_k, sd_l,
    si_b, si_k,
    n_tb,
    BT: tl.constexpr, DIM_P: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    q = (pid // n_tb).to(tl.int64)
    t = (pid % n_tb) * BT + tl.arange(0, BT)
    t_ok = t < Lq
    kd = tl.arange(0, DIM_P)
    kd_ok = kd < dim
    acc = tl.zeros([BT, DIM_P], dtype=tl.float32)
    # Pointers advance by one document per step (64-bit pointer arithmetic: no int32 offset overflow).
    arg_ptr = ARG + q * K * Lq + t
    g_ptr = G + q * K
    d_ptr = D + q * sd_b
    inv_ptr = INV_D + q * si_b
    for _ in range(0, K):
        a = tl.load(arg_ptr, mask=t_ok, other=-1)
        hit = a >= 0
        w = tl.load(g_ptr) + tl.zeros([BT], dtype=tl.float32)
        if NORMALIZE:
            w = w * tl.load(inv_ptr + a, mask=hit, other=0.0)
        rows = tl.load(d_ptr + a[:, None] * sd_l + kd[None, :], mask=hit[:, None] & kd_ok[None, :], other=0.0)
        acc += rows.to(tl.float32) * w[:, None]
        arg_ptr += Lq
        g_ptr += 1
        d_ptr += sd_k
        inv_ptr += si_k
    out = DQ + (q * Lq + t[:, None]) * dim + kd[None, :]
    tl.store(out, acc.to(DQ.dtype.element_ty), mask=t_ok[:, None] & kd_ok[None, :])


@triton.jit(do_not_specialize=["K", "Lq", "n_tb"])
def maxsim_bwd_dd_scatter_kernel(
    G, ARG, Q, INV_Q, GD,
    K, Lq, dim,
    sq_n, sq_l,
    sgd_b, sgd_k, sgd_l,
    n_tb,
    BT: tl.constexpr, DIM_P: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pair = (pid // n_tb).to(tl.int64)
    q = pair // K
    kk = pair % K
    t = (pid % n_tb) * BT + tl.arange(0, BT)
    t_ok = t < Lq
    kd = tl.arange(0, DIM_P)
    kd_ok = kd < dim
    a = tl.load(ARG + pair * Lq + t, mask=t_ok, other=-1)
    hit = a >= 0
    w = tl.load(G + pair) + tl.zeros([BT], dtype=tl.float32)
    if NORMALIZE:
        w = w * tl.load(INV_Q + q * Lq + t, mask=t_ok, other=0.0)
    mask = hit[:, None] & kd_ok[None, :]
    rows = tl.load(Q + q * sq_n + t[:, None] * sq_l + kd[None, :], mask=mask, other=0.0)
    tl.atomic_add(
        GD + q * sgd_b + kk * sgd_k + a[:, None] * sgd_l + kd[None, :],
        rows.to(tl.float32) * w[:, None],
        mask=mask,
        sem="relaxed",
    )


@triton.jit(do_not_specialize=["Nq", "K", "Lq", "Ld", "n_jb", "n_kb"])
def maxsim_bwd_dd_owned_kernel(
    G, ARG, Q, INV_Q, GD,
    Nq, K, Lq, Ld, dim,
    sq_n, sq_l,
    sgd_b, sgd_k, sgd_l,
    n_jb, n_kb,
    TQ: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr,
    SHARED_DOCS: tl.constexpr, NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kb = pid % n_kb
    jb = (pid // n_kb) % n_jb
    doc = (pid // (n_kb * n_jb)).to(tl.int64)
    b = doc // K
    kk = doc % K
    if SHARED_DOCS:
        q_lo = b * 0
        q_hi = Nq
    else:
        q_lo = b
        q_hi = b + 1
    j = jb * BN + tl.arange(0, BN)
    kd = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    kd_ok = kd < dim
    acc = tl.zeros([BN, BLOCK_K], dtype=tl.float32)
    arg_q = ARG + (q_lo * K + kk) * Lq
    g_q = G + q_lo * K + kk
    q_rows = Q + q_lo * sq_n
    inv_q = INV_Q + q_lo * Lq
    for _ in range(q_lo, q_hi):
        g = tl.load(g_q)
        for t0 in range(0, Lq, TQ):
            t = t0 + tl.arange(0, TQ)
            t_ok = t < Lq
            a = tl.load(arg_q + t, mask=t_ok, other=-1)
            hit = a[None, :] == j[:, None]  # [BN, TQ]; a == -1 never matches
            # Unchosen tokens are not loaded: a masked query token may hold NaN, and 0 * NaN is NaN in the MMA.
            qt = tl.load(q_rows + t[:, None] * sq_l + kd[None, :], mask=(a >= 0)[:, None] & kd_ok[None, :], other=0.0)
            if NORMALIZE:
                w = g * tl.load(inv_q + t, mask=t_ok, other=0.0)
                sel = tl.where(hit, w[None, :], 0.0)
                acc += tl.dot(sel, qt.to(tl.float32), input_precision="ieee")
            else:
                if UPCAST:
                    qt = qt.to(tl.float32)
                # A 0/1 selector is exact in any dtype, so the MMA returns the chosen rows exactly.
                acc += g * tl.dot(hit.to(qt.dtype), qt, input_precision=DOT_PRECISION)
        arg_q += K * Lq
        g_q += K
        q_rows += sq_n
        inv_q += Lq
    out = GD + b * sgd_b + kk * sgd_k + j[:, None] * sgd_l + kd[None, :]
    tl.store(out, acc.to(GD.dtype.element_ty), mask=(j[:, None] < Ld) & kd_ok[None, :])
