"""The forward kernel: one Triton core for every layout.

A program owns ``BQ`` queries (``BQ * TQ`` rows of the MMA's M dimension) and one document (or, for a pair list,
one listed pair). Where the tokens live — dense, packed with offsets, padded with lengths — is resolved by
:mod:`.segments`; the loop below does not know the layout. It streams the
document in ``BLOCK_N``-token tiles, keeps a running row max (and, for training, its argmax) in registers, and never
writes the ``[Lq, Ld]`` similarity block anywhere. Packing several queries into M (only where they share the document,
i.e. the cross product, ``Bd == 1``) lets one loaded document tile serve all of them. Queries longer than ``TQ`` rows
are walked in ``TQ``-row blocks by the same program, so the per-query sum stays in registers (deterministic, no
atomics).

Semantics (design.md §1) live here and nowhere else on the GPU: masked document tokens are ``-inf`` before the max; a
query row that is masked or sees no valid document token contributes 0 and argmax -1; ties go to the lowest index
(strict ``>`` across tiles, ``tie_break_left`` within one); NaN propagates through the max.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .segments import doc_segment, query_segment

NORM_EPS: tl.constexpr = tl.constexpr(1e-12)


@triton.jit
def nan_max(a, b):
    """``max`` that propagates NaN (``tl.max`` ignores it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _argmax_combine(v1, i1, v2, i2):
    """Larger value wins; equal values go to the lower token index (as ``torch.max``)."""
    take2 = (v2 > v1) | ((v2 == v1) & (i2 < i1))
    return tl.where(take2, v2, v1), tl.where(take2, i2, i1)


@triton.jit
def _load_q_chunk(q_rows, row_ok, kc, dim, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    kd = kc * BLOCK_K + tl.arange(0, BLOCK_K)
    qt = tl.load(q_rows[:, None] + kd[None, :], mask=row_ok[:, None] & (kd[None, :] < dim), other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    return qt


# Sizes are runtime values (no recompile for a new Nq, K, Lq or Ld); strides stay specialized, because their
# divisibility by 16 is what lets loads be 16 bytes wide (a stride that changes with Ld costs at most one more
# variant). Mask and length strides change with Ld but only feed narrow loads, so they are not specialized either.
@triton.jit(
    do_not_specialize=[
        "Nq", "K", "Lq", "Ld", "n_qseq", "n_qrows", "n_dseq", "n_drows", "sqm_n", "sdm_b", "sdm_k", "sqs",
        "sds_b", "sds_k", "n_qblocks", "n_rsplit", "rows_per_prog",
    ]
)  # fmt: skip
def maxsim_fwd_kernel(
    Q, D, QM, DM, QSEG, DSEG, PQ, PD, OUT, ARG,
    Nq, K, Lq, Ld, dim,
    n_qseq, n_qrows, n_dseq, n_drows,
    sq_n, sq_l,
    sd_b, sd_k, sd_l,
    sqm_n, sqm_l,
    sdm_b, sdm_k, sdm_l,
    sqs, sds_b, sds_k,
    n_qblocks, n_rsplit, rows_per_prog,
    TQ: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    Q_KIND: tl.constexpr, D_KIND: tl.constexpr, PAIR_LIST: tl.constexpr,
    HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr, NORMALIZE: tl.constexpr, SAVE_ARGMAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Scores ``OUT [n_rsplit, Nq, K]`` and argmax ``ARG [Nq, K, Lq]``; a pair list runs as ``Nq = 1``, ``K`` =
    number of pairs, query and document of pair ``k`` read from ``PQ[k]``, ``PD[k]``."""
    BLOCK_M: tl.constexpr = BQ * TQ
    pid = tl.program_id(0)
    # Query blocks, then row splits vary fastest, so programs that run together share a document through L2.
    qb = pid % n_qblocks
    rs = (pid // n_qblocks) % n_rsplit
    kk = (pid // (n_qblocks * n_rsplit)).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    q_out = qb * BQ + r // TQ  # output row of each MMA row
    q_in = q_out < Nq
    if PAIR_LIST:
        q_src = tl.load(PQ + kk).to(tl.int64) + tl.zeros([BLOCK_M], dtype=tl.int64)
        doc = tl.load(PD + kk).to(tl.int64)
        b = doc * 0
    else:
        q_src = q_out.to(tl.int64)
        doc = kk
        b = (qb * BQ).to(tl.int64)  # BQ > 1 only when documents are shared (sd_b == 0)
    q_base, _q_tok0, q_len, q_bad = query_segment(Q, QSEG, q_src, q_in, Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, Q_KIND)
    d_base, _d_tok0, d_len, d_bad = doc_segment(
        D, DSEG, b, doc, K, Ld, n_dseq, n_drows, sd_b, sd_k, sd_l, sds_b, sds_k, D_KIND
    )
    d_len = d_len.to(tl.int32)  # the tile loop's index feeds the int32 argmax
    dm_doc = DM + b * sdm_b + kk * sdm_k
    cols0 = tl.arange(0, BLOCK_N)

    score = tl.zeros([BQ], dtype=tl.float32)
    # Long queries are split over programs in blocks of rows_per_prog rows; each writes a partial score. Rows past
    # the longest query of the block are not computed (only their argmax slots are written, below).
    r_lo = rs * rows_per_prog
    r_hi = tl.minimum(Lq, r_lo + rows_per_prog)
    r_end = tl.minimum(r_hi, tl.max(tl.where(q_in, q_len, 0), axis=0))
    for t0 in range(r_lo, r_end, TQ):
        t = t0 + r % TQ
        row_ok = q_in & (t < q_len) & (t < r_hi)
        if HAS_QMASK:
            row_ok = row_ok & (tl.load(QM + q_out * sqm_n + t * sqm_l, mask=row_ok, other=0) != 0)
        q_rows = q_base + t * sq_l
        if NUM_K == 1:
            qt = _load_q_chunk(q_rows, row_ok, 0, dim, BLOCK_K, UPCAST)

        # Running max per (row, column slot) across tiles: one max (and one select for the argmax) per element
        # per tile; the cross-lane row reduction happens once per row block instead of once per tile.
        m2 = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
        if SAVE_ARGMAX:
            a2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        any_valid = tl.zeros([BLOCK_N], dtype=tl.int32)
        for n0 in range(0, d_len, BLOCK_N):
            cols = n0 + cols0
            in_doc = cols < d_len
            col_ok = in_doc
            if HAS_DMASK:
                col_ok = col_ok & (tl.load(dm_doc + cols * sdm_l, mask=in_doc, other=0) != 0)
            s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if NORMALIZE:
                sumsq = tl.zeros([BLOCK_N], dtype=tl.float32)
            for kc in tl.static_range(NUM_K):
                if NUM_K > 1:
                    qt = _load_q_chunk(q_rows, row_ok, kc, dim, BLOCK_K, UPCAST)
                kd = kc * BLOCK_K + tl.arange(0, BLOCK_K)
                # Masked document tokens are not read (they may hold NaN/inf, and their bytes are not needed).
                dt = tl.load(
                    d_base + cols[:, None] * sd_l + kd[None, :],
                    mask=col_ok[:, None] & (kd[None, :] < dim),
                    other=0.0,
                )  # [BLOCK_N, BLOCK_K], contiguous along dim
                if NORMALIZE:
                    dtf = dt.to(tl.float32)
                    sumsq += tl.sum(dtf * dtf, axis=1)
                if UPCAST:
                    dt = dt.to(tl.float32)
                s = tl.dot(qt, tl.trans(dt), s, input_precision=DOT_PRECISION)
            if NORMALIZE:
                s = s * (1.0 / tl.maximum(tl.sqrt(sumsq), NORM_EPS))[None, :]
            s = tl.where(col_ok[None, :], s, float("-inf"))
            if SAVE_ARGMAX:
                a2 = tl.where(s > m2, n0, a2)  # strict: an earlier tile keeps a tie
            m2 = nan_max(m2, s)
            any_valid = tl.maximum(any_valid, col_ok.to(tl.int32))
        m = tl.reduce(m2, 1, nan_max)
        if SAVE_ARGMAX:
            _m, a = tl.reduce((m2, a2 + cols0[None, :]), 1, _argmax_combine)

        if NORMALIZE:
            # The query's norm is a positive per-row factor: it scales the max without moving the argmax.
            sumsq_q = tl.zeros([BLOCK_M], dtype=tl.float32)
            for kc in tl.static_range(NUM_K):
                if NUM_K > 1:
                    qt = _load_q_chunk(q_rows, row_ok, kc, dim, BLOCK_K, UPCAST)
                qf = qt.to(tl.float32)
                sumsq_q += tl.sum(qf * qf, axis=1)
            m = m * (1.0 / tl.maximum(tl.sqrt(sumsq_q), NORM_EPS))
        row_live = row_ok & (tl.zeros([BLOCK_M], dtype=tl.int32) + tl.max(any_valid, axis=0) > 0)
        row_val = tl.where(row_live, m, 0.0)
        score += tl.sum(tl.reshape(row_val, [BQ, TQ]), axis=1)
        if SAVE_ARGMAX:
            tl.store(
                ARG + (q_out.to(tl.int64) * K + kk) * Lq + t,
                tl.where(row_live, a, -1),
                mask=q_in & (t < r_hi),
            )
    if SAVE_ARGMAX:
        # Slots past the end of every query of the block: no token, argmax -1.
        t_tail = r_lo + tl.cdiv(tl.maximum(r_end - r_lo, 0), TQ) * TQ
        for t0 in range(t_tail, r_hi, TQ):
            t = t0 + r % TQ
            tl.store(
                ARG + (q_out.to(tl.int64) * K + kk) * Lq + t,
                tl.full([BLOCK_M], -1, dtype=tl.int32),
                mask=q_in & (t < r_hi),
            )

    # Out-of-range offsets, lengths or pair ids poison their scores instead of passing as plausible numbers.
    bad = tl.reshape(q_bad.to(tl.int32), [BQ, TQ])
    score = tl.where((tl.max(bad, axis=1) > 0) | d_bad, float("nan"), score)
    q_first = qb * BQ + tl.arange(0, BQ)
    tl.store(OUT + (rs.to(tl.int64) * Nq + q_first) * K + kk, score, mask=q_first < Nq)
