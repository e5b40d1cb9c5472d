"""The backward kernels: gradients from the saved argmax alone (``[Nq, K, Lq]`` int16 or int32, -1 = no
contribution; read as int32).

With ``a = argmax[q, k, t]`` and ``g = grad[q, k]`` (read as ``G[(q * K + k) * sg]``: a contiguous grid, ``sg = 1``,
or the expanded scalar of a ``.sum()`` loss, ``sg = 0``, without a copy):

    dQ[q, t]        += g · D[doc(q, k), a]       (gather: one program per query-token block, summing over its pairs)
    dD[doc(q,k), a] += g · Q[q, t]               (scatter)

Two kernels:

* ``maxsim_bwd_kernel``: the gather (dQ, one program per query-token block, summing over the query's pairs in
  order) and the owner (dD: each program owns a block of document tokens and walks the queries that scored that
  document in a fixed order, selecting their tokens with a one-hot MMA ``onehot[BN, TQ] @ Q[TQ, dim]``), both in
  one launch; no atomics, the same bits on every run;
* ``maxsim_bwd_scatter_kernel``: one program per (pair, token block), fp32 atomics into a zeroed buffer, for dD of
  large cross products (``backward="fast"``) and dQ of long pair lists (whose queries repeat in any order).

Layouts are resolved by :mod:`.segments` exactly as in the forward. A pair list (``PAIR_LIST``) walks its pairs
through two CSR indexes built on the device (pairs grouped by query for dQ, by document for dD); a short one
(``PAIR_SCAN``, chosen from shapes) finds each query's or document's pairs by scanning all pair ids instead, which
visits the same pairs in the same order without building an index (no extra launches: small pair-list steps are
bound by host time, not by the GPU).

Known deviation: without ``normalize``, a non-finite upstream gradient ``g`` of a pair reaches every token of the
owned blocks of its document (``g · 0`` of the unchosen rows of the one-hot product is NaN), where the reference and
the atomics put it on the chosen tokens only. Finite gradients are exact.

With ``normalize=True`` the kernels produce gradients w.r.t. the normalized tokens (they scale by the inverse norms,
per-token arrays) and chain them back to the raw tokens once per token: in the program that holds a whole row of the
gradient (the gather; the owner when one dim block spans ``dim``: ``PROJECT_Q``, ``PROJECT_D``), else afterwards
(:func:`.normalize.project`).

Sizes are not specialized (no recompile for new shapes); strides are, so that loads stay 16 bytes wide.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..layout import NORM_EPS as NORM_EPS_VALUE
from .dd_chunks import cast_clear_block
from .normalize import project_rows
from .segments import OFFSETS, doc_segment, query_segment

NORM_EPS: tl.constexpr = tl.constexpr(NORM_EPS_VALUE)
SCAN = tl.constexpr(1024)  # pair ids compared per step when a short pair list is scanned (PAIR_SCAN)
HELD = tl.constexpr(8)  # pair ids of a document a scanning walk keeps in registers (see _dd_program)
WALK_QUERIES: tl.constexpr = tl.constexpr(0)  # how a dD walk finds its entries (see _dd_load)
WALK_CSR: tl.constexpr = tl.constexpr(1)
WALK_PAIRS: tl.constexpr = tl.constexpr(2)
# Elements of dD each cast program of a FUSED_CAST launch rounds, in steps of 4 loads of 16 bytes a thread of 4
# warps: registers within those of the atomics' programs beside them (8192 at once: 66 registers against 40 for
# the atomics alone, 7 programs a multiprocessor instead of 12).
FUSED_CAST_BLOCK = tl.constexpr(2048)
FUSED_CAST_STEPS = tl.constexpr(4)


@triton.jit
def _pair(q, e, K, PERM, PD, PAIR_LIST: tl.constexpr):
    """``(pair id, document)`` of entry ``e`` of query ``q``'s pairs."""
    if PAIR_LIST:
        p = tl.load(PERM + e).to(tl.int64)
        return p, tl.load(PD + p).to(tl.int64)
    else:
        return q * K + e, q * 0 + e


@triton.jit
def _dq_add(
    acc, p, doc, b, t, t_ok, kd, kd_ok, G, ARG, D, INV_D, DSEG,
    K, Lq, Ld, n_dseq, n_drows, sd_b, sd_k, sd_l, sds_b, sds_k, sg,
    live, BT: tl.constexpr, D_KIND: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    """``acc [BT, DIM_P]`` plus pair ``p``'s share of dQ for query tokens ``t``: ``g · D[doc, argmax]`` (nothing,
    not even a NaN of ``g``, where ``live`` is false)."""
    d_base, d_tok0, _d_len, _d_bad = doc_segment(
        D, DSEG, b, doc, K, Ld, n_dseq, n_drows, sd_b, sd_k, sd_l, sds_b, sds_k, D_KIND
    )
    # (tl.where, not `t_ok & live`: the interpreter gives `&` of a block and a scalar a non-boolean dtype)
    a = tl.load(ARG + p * Lq + t, mask=tl.where(live, t_ok, False), other=-1).to(tl.int32)
    hit = a >= 0
    w = tl.where(live, tl.load(G + p * sg), 0.0) + tl.zeros([BT], dtype=tl.float32)  # (p is a real pair)
    if NORMALIZE:
        w = w * tl.load(INV_D + d_tok0 + a, mask=hit, other=0.0)
    w = tl.where(hit, w, 0.0)  # (a token that chose nothing gets no NaN of g: 0 · NaN is NaN)
    rows = tl.load(d_base + a[:, None] * sd_l + kd[None, :], mask=hit[:, None] & kd_ok[None, :], other=0.0)
    return acc + rows.to(tl.float32) * w[:, None]


@triton.jit
def _dq_program(
    pid, G, ARG, Q, D, INV_D, DQ, DQ_OUT, COUNTERS, QSEG, DSEG, PQ, PD, QOFF, QPERM,
    K, Lq, Ld, dim,
    n_qseq, n_qrows, n_dseq, n_drows,
    sq_n, sq_l,
    sd_b, sd_k, sd_l,
    sdq_n, sdq_l,
    sqs, sds_b, sds_k, sg,
    n_tb, n_ks, ks_len, sdq_s,
    BT: tl.constexpr, DIM_P: tl.constexpr, UNROLL: tl.constexpr,
    Q_KIND: tl.constexpr, D_KIND: tl.constexpr, PAIR_LIST: tl.constexpr, SHARED_DOCS: tl.constexpr,
    NORMALIZE: tl.constexpr, PAIR_SCAN: tl.constexpr, PROJECT: tl.constexpr, SPLIT: tl.constexpr,
    SUM_LAST: tl.constexpr,
):  # fmt: skip
    """dQ of one (query, token block): a gather over the query's pairs (``K`` of them: its documents, or a pair
    list's ``P`` entries), summed in pair order (``PROJECT``: chained through the normalization of Q's rows).

    ``SPLIT`` (documents and candidates only, never a pair list): program ``pid`` sums pairs
    ``[s * ks_len, (s + 1) * ks_len)`` of its query, ``s = pid % n_ks``, into slice ``s`` of an fp32 ``DQ`` of
    ``n_ks`` slices ``sdq_s`` elements apart (summed in order afterwards). A constexpr, not ``n_ks == 1``: the
    plain walk's variants keep their registers (the runtime split cost the normalized gather 40 more).

    ``SUM_LAST`` (with ``SPLIT``): the last of a block's ``n_ks`` programs to finish sums the block's slices in
    slice order and stores them in ``DQ_OUT`` (dQ, Q's layout and dtype), as ``slices.sum_slices_kernel`` would in a
    launch after: each program counts itself done in ``COUNTERS[q * n_tb + block]`` (int32 zeros), after a barrier
    and with release semantics; the last acquires the count and reads the other slices from L2 (``.cg``)."""
    split = 0
    if SPLIT:
        split = pid % n_ks
        pid = pid // n_ks
        DQ = DQ + split.to(tl.int64) * sdq_s
    q = (pid // n_tb).to(tl.int64)
    t = (pid % n_tb) * BT + tl.arange(0, BT)
    # DQ has Q's layout: its row pointer comes from the same segment description (with DQ's strides).
    dq_base, _dq_tok0, q_len, _q_bad = query_segment(
        DQ, QSEG, q, q >= 0, Lq, n_qseq, n_qrows, sdq_n, sdq_l, sqs, Q_KIND
    )
    t_ok = t < q_len
    kd = tl.arange(0, DIM_P)
    kd_ok = kd < dim
    acc = tl.zeros([BT, DIM_P], dtype=tl.float32)
    b = q * 0 if SHARED_DOCS else q
    # A block of query tokens past the query's end has nothing to gather (its rows, if stored, are zeros).
    if (pid % n_tb) * BT < q_len:
        if PAIR_SCAN:  # a short pair list: find this query's pairs by scanning all P = K of them, in pair order
            for c0 in range(0, K, SCAN):
                cols = c0 + tl.arange(0, SCAN)
                mine = tl.load(PQ + cols, mask=cols < K, other=-1) == q
                n_mine = tl.sum(mine.to(tl.int32), 0)
                if n_mine > 0:  # most chunks hold none of this query's pairs: skip the scan and the extraction
                    rank = tl.cumsum(mine.to(tl.int32), 0)
                    if UNROLL == 1:
                        for h in range(0, n_mine):
                            p = tl.sum(tl.where(mine & (rank == h + 1), cols, 0), 0).to(tl.int64)
                            acc = _dq_add(
                                acc, p, tl.load(PD + p).to(tl.int64), b, t, t_ok, kd, kd_ok, G, ARG, D, INV_D,
                                DSEG, K, Lq, Ld, n_dseq, n_drows, sd_b, sd_k, sd_l, sds_b, sds_k, sg, p >= 0, BT,
                                D_KIND, NORMALIZE,
                            )  # fmt: skip
                    else:
                        # UNROLL pairs a step, their ids picked out by one reduction and their documents by one
                        # load, so that their loads are in flight together (one at a time, each pair waited for
                        # its pick, its document id, its offsets and its rows in turn). The same pair order.
                        slots = tl.arange(0, UNROLL)
                        for h0 in range(0, n_mine, UNROLL):
                            pick = mine[None, :] & (rank[None, :] == h0 + 1 + slots[:, None])
                            ps = tl.sum(tl.where(pick, cols[None, :], 0), 1)  # (0, a real pair, past n_mine)
                            docs = tl.load(PD + ps)
                            for j in tl.static_range(UNROLL):
                                p = tl.sum(tl.where(slots == j, ps, 0), 0).to(tl.int64)
                                doc = tl.sum(tl.where(slots == j, docs, 0), 0).to(tl.int64)
                                acc = _dq_add(
                                    acc, p, doc, b, t, t_ok, kd, kd_ok, G, ARG, D, INV_D, DSEG, K, Lq, Ld,
                                    n_dseq, n_drows, sd_b, sd_k, sd_l, sds_b, sds_k, sg, h0 + j < n_mine, BT,
                                    D_KIND, NORMALIZE,
                                )  # fmt: skip
        else:
            if PAIR_LIST:
                e_lo = tl.load(QOFF + q).to(tl.int64)
                e_hi = tl.load(QOFF + q + 1).to(tl.int64)
            elif SPLIT:
                e_lo = q * 0 + split * ks_len
                e_hi = tl.minimum(e_lo + ks_len, K)
            else:
                e_lo = q * 0
                e_hi = q * 0 + K
            # UNROLL pairs per step: their loads do not depend on each other, so they are in flight together (one
            # pair at a time, the walk waits for two dependent memory round trips per pair). Same order of the sum.
            for e0 in range(e_lo, e_hi, UNROLL):
                for j in tl.static_range(UNROLL):
                    e = e0 + j
                    live = e < e_hi
                    p, doc = _pair(q, tl.minimum(e, e_hi - 1), K, QPERM, PD, PAIR_LIST)
                    acc = _dq_add(
                        acc, p, doc, b, t, t_ok, kd, kd_ok, G, ARG, D, INV_D, DSEG,
                        K, Lq, Ld, n_dseq, n_drows, sd_b, sd_k, sd_l, sds_b, sds_k, sg, live, BT, D_KIND, NORMALIZE,
                    )  # fmt: skip
    if PROJECT:
        q_base, _tok0, _len, _bad = query_segment(Q, QSEG, q, q >= 0, Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, Q_KIND)
        x = tl.load(q_base + t[:, None] * sq_l + kd[None, :], mask=t_ok[:, None] & kd_ok[None, :], other=0.0)
        acc = project_rows(acc, x.to(tl.float32), NORM_EPS)
    # Padded rows (past a query's length, inside its padding) are written too: their gradient is zero.
    t_store = t_ok if Q_KIND == OFFSETS else t < Lq
    rows = t[:, None] * sdq_l + kd[None, :]
    tl.store(dq_base + rows, acc.to(DQ.dtype.element_ty), mask=t_store[:, None] & kd_ok[None, :])
    if SUM_LAST:
        tl.debug_barrier()
        if tl.atomic_add(COUNTERS + pid, 1, sem="acq_rel", scope="gpu") == n_ks - 1:
            first = dq_base - split.to(tl.int64) * sdq_s
            total = tl.zeros([BT, DIM_P], dtype=tl.float32)
            for s in range(0, n_ks):
                slice_s = tl.load(first + s * sdq_s + rows, mask=t_store[:, None] & kd_ok[None, :], other=0.0,
                                  cache_modifier=".cg")  # fmt: skip
                total += slice_s
            out_base, _tok0, _len, _bad = query_segment(
                DQ_OUT, QSEG, q, q >= 0, Lq, n_qseq, n_qrows, sdq_n, sdq_l, sqs, Q_KIND
            )
            tl.store(out_base + rows, total.to(DQ_OUT.dtype.element_ty), mask=t_store[:, None] & kd_ok[None, :])


@triton.jit
def _pair_members(pair, K, PQ, PD, PAIR_LIST: tl.constexpr, SHARED_DOCS: tl.constexpr):
    """``(query, document, batch row of the document)`` of pair ``pair``."""
    if PAIR_LIST:
        return tl.load(PQ + pair).to(tl.int64), tl.load(PD + pair).to(tl.int64), pair * 0
    else:
        q = pair // K
        return q, pair % K, (q * 0 if SHARED_DOCS else q)


@triton.jit(
    do_not_specialize=[
        "Nq", "K", "Lq", "Ld", "n_qseq", "n_qrows", "n_dseq", "n_drows", "sqs", "sds_b", "sds_k", "sg", "n_tb",
        "k_lo", "K_c", "n_cast", "n_clear", "cast_programs",
    ]
)  # fmt: skip
def maxsim_bwd_scatter_kernel(
    G, ARG, QT, DT, INV, QSEG, DSEG, PQ, PD, CAST_BUF, CAST_OUT,
    Nq, K, Lq, Ld, dim,
    n_qseq, n_qrows, n_dseq, n_drows,
    sq_n, sq_l,
    sd_b, sd_k, sd_l,
    sqs, sds_b, sds_k, sg,
    n_tb, k_lo, K_c, n_cast, n_clear, cast_programs,
    BT: tl.constexpr, DIM_P: tl.constexpr,
    Q_KIND: tl.constexpr, D_KIND: tl.constexpr, PAIR_LIST: tl.constexpr, SHARED_DOCS: tl.constexpr,
    TO_Q: tl.constexpr, NORMALIZE: tl.constexpr, DOCS: tl.constexpr, CAST: tl.constexpr, CAST_BLOCK: tl.constexpr,
):  # fmt: skip
    """fp32 atomics. ``TO_Q``: one program per (pair, query-token block) reads document rows ``DT[a]`` and adds
    them into ``QT[t]`` (dQ, used for pair lists); else one per (query-token block, ``DOCS`` documents) reads query
    rows ``QT[t]`` and adds them into ``DT[a]`` (dD). ``INV`` holds the inverse norms of the side that is read.
    Documents ``[k_lo, k_lo + K_c)`` of a cross product only (all of them: ``k_lo = 0``, ``K_c = K``), added into
    ``DT``'s documents ``[0, K_c)``: the dD of a large cross product is summed a chunk of documents at a time, in
    an fp32 buffer of the chunk's size. ``CAST``: programs ``[0, cast_programs)`` cast the chunk before
    (``dd_chunks.cast_clear_block`` of ``CAST_BUF`` into ``CAST_OUT``, ``n_cast`` elements, the first ``n_clear``
    cleared), the rest add this chunk."""
    pid = tl.program_id(0)
    if CAST:
        if pid < cast_programs:
            cast_clear_block(pid, CAST_BUF, CAST_OUT, n_cast, n_clear, CAST_BLOCK)
            return
        pid -= cast_programs
    _scatter_program(
        pid, G, ARG, QT, DT, INV, QSEG, DSEG, PQ, PD, K, Lq, Ld, dim, n_qseq, n_qrows, n_dseq, n_drows,
        sq_n, sq_l, sd_b, sd_k, sd_l, sqs, sds_b, sds_k, sg, n_tb, k_lo, K_c, BT, DIM_P, Q_KIND, D_KIND, PAIR_LIST,
        SHARED_DOCS, TO_Q, NORMALIZE, DOCS,
    )  # fmt: skip


@triton.jit
def _scatter_program(
    pid, G, ARG, QT, DT, INV, QSEG, DSEG, PQ, PD, K, Lq, Ld, dim, n_qseq, n_qrows, n_dseq, n_drows,
    sq_n, sq_l, sd_b, sd_k, sd_l, sqs, sds_b, sds_k, sg, n_tb, k_lo, K_c,
    BT: tl.constexpr, DIM_P: tl.constexpr, Q_KIND: tl.constexpr, D_KIND: tl.constexpr, PAIR_LIST: tl.constexpr,
    SHARED_DOCS: tl.constexpr, TO_Q: tl.constexpr, NORMALIZE: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    """Program ``pid`` of :func:`maxsim_bwd_scatter_kernel` (also run inside :func:`maxsim_bwd_kernel`, with
    ``k_lo = 0``, ``K_c = K``)."""
    if not TO_Q:
        _dd_atomics_program(
            pid, G, ARG, QT, DT, INV, QSEG, DSEG, K, Lq, Ld, dim, n_qseq, n_qrows, n_dseq, n_drows,
            sq_n, sq_l, sd_b, sd_k, sd_l, sqs, sds_b, sds_k, sg, n_tb, k_lo, K_c, BT, DIM_P, Q_KIND, D_KIND,
            NORMALIZE, DOCS,
        )  # fmt: skip
        return
    pair_c = (pid // n_tb).to(tl.int64)
    pair = (pair_c // K_c) * K + k_lo + pair_c % K_c
    t = (pid % n_tb) * BT + tl.arange(0, BT)
    q, doc, b = _pair_members(pair, K, PQ, PD, PAIR_LIST, SHARED_DOCS)
    q_base, q_tok0, q_len, _q_bad = query_segment(QT, QSEG, q, q >= 0, Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, Q_KIND)
    d_base, d_tok0, _d_len, _d_bad = doc_segment(
        DT, DSEG, b, doc, K, Ld, n_dseq, n_drows, sd_b, sd_k, sd_l, sds_b, sds_k, D_KIND
    )
    d_base -= k_lo * sd_k  # (the chunk's buffer)
    t_ok = t < q_len
    kd = tl.arange(0, DIM_P)
    kd_ok = kd < dim
    a = tl.load(ARG + pair * Lq + t, mask=t_ok, other=-1).to(tl.int32)
    hit = a >= 0
    w = tl.load(G + pair * sg) + tl.zeros([BT], dtype=tl.float32)
    if NORMALIZE:
        if TO_Q:
            w = w * tl.load(INV + d_tok0 + a, mask=hit, other=0.0)
        else:
            w = w * tl.load(INV + q_tok0 + t, mask=t_ok, other=0.0)
    mask = hit[:, None] & kd_ok[None, :]
    q_ptrs = q_base + t[:, None] * sq_l + kd[None, :]
    d_ptrs = d_base + a[:, None] * sd_l + kd[None, :]
    rows = tl.load(d_ptrs, mask=mask, other=0.0)
    tl.atomic_add(q_ptrs, rows.to(tl.float32) * w[:, None], mask=mask, sem="relaxed")


@triton.jit
def _dd_atomics_program(
    pid, G, ARG, Q, GD, INV_Q, QSEG, DSEG, K, Lq, Ld, dim, n_qseq, n_qrows, n_dseq, n_drows,
    sq_n, sq_l, sgd_b, sgd_k, sgd_l, sqs, sds_b, sds_k, sg, n_tb, k_lo, K_c,
    BT: tl.constexpr, DIM_P: tl.constexpr, Q_KIND: tl.constexpr, D_KIND: tl.constexpr, NORMALIZE: tl.constexpr,
    DOCS: tl.constexpr,
):  # fmt: skip
    """dD of the cross product by fp32 atomics: program ``pid`` adds the weighted rows of one block of ``BT``
    tokens of one query into the rows its tokens chose in ``DOCS`` consecutive documents of ``[k_lo, k_lo + K_c)``
    (buffer ``GD`` holds documents ``[k_lo, ...)`` from its start). The query rows are loaded once for the
    ``DOCS`` documents, with every document's argmax and weight before the first atomic: one round trip of loads
    per program instead of two dependent ones per document, and ``DOCS`` times fewer reads of the query rows."""
    n_grp = tl.cdiv(K_c, DOCS)
    pair_c = (pid // n_tb).to(tl.int64)
    q = pair_c // n_grp
    k0 = (pair_c % n_grp) * DOCS  # (the group's first document, in the chunk)
    kk = k0 + tl.arange(0, DOCS)
    k_ok = kk < K_c
    t = (pid % n_tb) * BT + tl.arange(0, BT)
    q_base, q_tok0, q_len, _q_bad = query_segment(Q, QSEG, q, q >= 0, Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, Q_KIND)
    t_ok = t < q_len
    kd = tl.arange(0, DIM_P)
    kd_ok = kd < dim
    pairs = q * K + k_lo + kk
    a_all = tl.load(ARG + pairs[:, None] * Lq + t[None, :], mask=k_ok[:, None] & t_ok[None, :], other=-1)
    a_all = a_all.to(tl.int32)
    w_all = tl.load(G + pairs * sg, mask=k_ok, other=0.0)
    # (a token that chose nothing adds nothing: its row, NaN or not, is masked out of the atomics)
    rows = tl.load(q_base + t[:, None] * sq_l + kd[None, :], mask=t_ok[:, None] & kd_ok[None, :], other=0.0)
    rows = rows.to(tl.float32)
    inv = tl.load(INV_Q + q_tok0 + t, mask=t_ok, other=0.0) if NORMALIZE else tl.full([BT], 1.0, tl.float32)
    slot = tl.arange(0, DOCS)
    for i in tl.static_range(DOCS):
        pick = slot == i
        a = tl.sum(tl.where(pick[:, None], a_all, 0), 0)
        w = tl.sum(tl.where(pick, w_all, 0.0), 0) * inv  # (as g * inv, then times the row: the rounding of
        # the one-document programs)
        doc = k_lo + tl.minimum(k0 + i, K_c - 1)  # (past the chunk: every token's argmax is -1, nothing added)
        d_base, _d_tok0, _d_len, _d_bad = doc_segment(
            GD, DSEG, 0, doc, K, Ld, n_dseq, n_drows, sgd_b, sgd_k, sgd_l, sds_b, sds_k, D_KIND
        )
        d_base -= k_lo * sgd_k  # (the chunk's buffer)
        mask = (a >= 0)[:, None] & kd_ok[None, :]
        tl.atomic_add(d_base + a[:, None] * sgd_l + kd[None, :], rows * w[:, None], mask=mask, sem="relaxed")


@triton.jit
def _scatter_and_cast(
    pid, G, ARG, Q, GD, GD_OUT, INV_Q, QSEG, DSEG, Nq, K, Lq, Ld, dim, n_qseq, n_qrows, n_dseq, n_drows,
    sq_n, sq_l, sgd_b, sgd_k, sgd_l, sqs, sds_b, sds_k, sg, n_tb,
    BT: tl.constexpr, DIM_P: tl.constexpr, Q_KIND: tl.constexpr, D_KIND: tl.constexpr, NORMALIZE: tl.constexpr,
    DOCS: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    """Program ``pid`` of a dense cross product's dD atomics over all ``K`` documents (``GD`` a fresh contiguous
    fp32 buffer) followed, in the same launch, by programs that cast the sums into ``GD_OUT`` (D's dtype,
    contiguous): no cast launch after the backward's.

    Programs ``[0, Nq * n_tb * cdiv(K, DOCS))`` are the atomics' (:func:`_dd_atomics_program`); each then counts itself
    done in its group of ``DOCS`` documents (int32 counters after the buffer's ``K * Ld * dim`` elements, in its zeroed
    allocation). The rest cast ``STEPS`` blocks of ``BLOCK`` elements of one group each, once the group's ``Nq * n_tb``
    programs have counted. A caster waits only for programs of lower ids, which the GPU starts before it (the order a
    single-pass scan's look-back relies on too), so none waits for a program that cannot start. Ordering, as in a
    split-K semaphore: a program's atomics precede the barrier, then its count is released (gpu scope); a caster
    acquires the count, then reads the sums from L2 (``.cg``: another group's rows in the same lines may sit in its
    L1)."""
    n_grp = tl.cdiv(K, DOCS)
    group_programs = Nq * n_tb
    counters = (GD + K.to(tl.int64) * Ld * dim).to(tl.pointer_type(tl.int32))
    if pid < n_grp * group_programs:
        _dd_atomics_program(
            pid, G, ARG, Q, GD, INV_Q, QSEG, DSEG, K, Lq, Ld, dim, n_qseq, n_qrows, n_dseq, n_drows,
            sq_n, sq_l, sgd_b, sgd_k, sgd_l, sqs, sds_b, sds_k, sg, n_tb, 0, K, BT, DIM_P, Q_KIND, D_KIND,
            NORMALIZE, DOCS,
        )  # fmt: skip
        tl.debug_barrier()
        tl.atomic_add(counters + (pid // n_tb) % n_grp, 1, sem="release", scope="gpu")
    else:
        doc_elems = Ld.to(tl.int64) * dim
        per_group = tl.cdiv(DOCS * doc_elems, BLOCK * STEPS)
        c = (pid - n_grp * group_programs).to(tl.int64)
        grp = c // per_group
        start = grp * DOCS * doc_elems + (c % per_group) * (BLOCK * STEPS)
        end = tl.minimum(grp * DOCS + DOCS, K) * doc_elems
        done = tl.atomic_add(counters + grp, 0, sem="acquire", scope="gpu")
        while done < group_programs:
            done = tl.atomic_add(counters + grp, 0, sem="acquire", scope="gpu")
        for i in range(STEPS):  # (a loop, not unrolled: the cast's registers stay under the atomics' programs')
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            ok = offs < end
            x = tl.load(GD + offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(GD_OUT + offs, x.to(GD_OUT.dtype.element_ty), mask=ok)


@triton.jit
def _dd_load(
    s, n_tq, K, kk, G, ARG, Q, INV_Q, QSEG, PQ, DPERM,
    Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, sg, kd, kd_ok,
    TQ: tl.constexpr, Q_KIND: tl.constexpr, WALK: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    """Operands of step ``s`` of a document's walk (entry ``e = s // n_tq``, its query tokens ``TQ`` at a time):
    ``(argmax [TQ], query rows [TQ, BLOCK_K], weight)``, the weight a scalar (``[TQ]`` with ``NORMALIZE``).
    Entries (``WALK``): the queries of the document (``WALK_QUERIES``: pair ``e * K + kk``), the CSR order of a pair
    list (``WALK_CSR``) or a pair id (``WALK_PAIRS``)."""
    e = s // n_tq
    t0 = (s - e * n_tq) * TQ
    if WALK == WALK_QUERIES:
        q = e
        p = e * K + kk
    else:
        p = tl.load(DPERM + e).to(tl.int64) if WALK == WALK_CSR else e
        q = tl.load(PQ + p).to(tl.int64)
    q_base, q_tok0, q_len, _q_bad = query_segment(Q, QSEG, q, q >= 0, Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, Q_KIND)
    t = t0 + tl.arange(0, TQ)
    t_ok = t < q_len
    a = tl.load(ARG + p * Lq + t, mask=t_ok, other=-1).to(tl.int32)
    # Unchosen tokens are not loaded: a masked query token may hold NaN, and 0 * NaN is NaN in the MMA.
    qt = tl.load(q_base + t[:, None] * sq_l + kd[None, :], mask=(a >= 0)[:, None] & kd_ok[None, :], other=0.0)
    w = tl.load(G + p * sg)
    if NORMALIZE:
        w = w * tl.load(INV_Q + q_tok0 + t, mask=t_ok, other=0.0)
    return a, qt, w


@triton.jit
def _selector_anchor(BN: tl.constexpr, TQ: tl.constexpr, dtype: tl.constexpr):
    """Zeros ``[BN, TQ]`` (fp32) in the layout of an MMA's result, for :func:`_dd_add`'s ``REG_SEL``: a selector
    taken from them (``where(hit, 1, anchor)``) is built in that layout, which the next MMA reads as its register
    operand as it stands; one built in a load's layout goes through shared memory (a 16-bit store per element, a
    barrier, then ``ldmatrix``). Computed once per program, before its walk."""
    return tl.dot(tl.zeros([BN, 16], dtype=dtype), tl.zeros([16, TQ], dtype=dtype))


@triton.jit
def _dd_add(
    acc, a, qt, w, j, anchor,
    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, REG_SEL: tl.constexpr,
):  # fmt: skip
    """``acc [BN, BLOCK_K]`` plus one step's share of dD for document tokens ``j``: the rows ``qt`` of the query
    tokens whose argmax ``a`` is in ``j``, times their weights ``w``. ``REG_SEL``: the 0/1 selector is built from
    ``anchor`` (:func:`_selector_anchor`) in the MMA's register layout, 16-bit tokens only (the same values, the
    same MMA: the same sums)."""
    hit = a[None, :] == j[:, None]  # [BN, TQ]; a == -1 never matches
    in_regs: tl.constexpr = REG_SEL and qt.dtype != tl.float32
    if NORMALIZE or qt.dtype == tl.float32:
        # fp32 rows (weighted, each token by its own weight with NORMALIZE), split into three bf16 terms whose
        # sum is exactly the fp32 value (8 + 8 + 8 significant bits), go through the tensor cores with the 0/1
        # selector (exact products, fp32 sums) instead of an IEEE fp32 product, which Triton emits as FMA loops
        # (an fp32 owner of 64 x 128 blocks spilled ~20 KB a thread; H100, fp32 backward GPU time of 1024 pairs,
        # Lq 100 Ld 300: 757 -> 362 us; candidates 64x16 Lq100 Ld300 436 -> 303 us).
        # (a token that chose nothing weighs 0: its inverse norm may be NaN, if it was masked and poisoned)
        wq = qt.to(tl.float32) * tl.where(a >= 0, w, 0.0)[:, None]
        hi = wq.to(tl.bfloat16).to(tl.float32)
        rest = tl.where(hi == wq, 0.0, wq - hi)  # (an infinite row is its high term alone, not inf - inf)
        mid = rest.to(tl.bfloat16).to(tl.float32)
        lo = rest - mid  # (8 significant bits at most: a bf16 value)
        sel = tl.where(hit, 1.0, anchor) if in_regs else hit.to(tl.float32)
        if not UPCAST:  # (the interpreter's bf16 products are wrong: it multiplies the same exact terms in fp32)
            sel, hi, mid, lo = sel.to(tl.bfloat16), hi.to(tl.bfloat16), mid.to(tl.bfloat16), lo.to(tl.bfloat16)
        acc += tl.dot(sel, hi, input_precision="ieee")
        acc += tl.dot(sel, mid, input_precision="ieee")
        acc += tl.dot(sel, lo, input_precision="ieee")
    else:
        if UPCAST:
            qt = qt.to(tl.float32)
        # A 0/1 selector is exact in any dtype, so the MMA returns the chosen rows exactly (a step's tokens belong
        # to one query: one weight).
        sel = tl.where(hit, 1.0, anchor) if in_regs else hit
        acc += w * tl.dot(sel.to(qt.dtype), qt, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _projected(acc, d_base, j, d_len, kd, kd_ok, sd_l):
    """``acc`` (the gradient of the document rows ``j`` w.r.t. their normalized values) chained back to the rows."""
    x = tl.load(d_base + j[:, None] * sd_l + kd[None, :], mask=(j < d_len)[:, None] & kd_ok[None, :], other=0.0)
    return project_rows(acc, x.to(tl.float32), NORM_EPS)


@triton.jit
def _dd_program(
    pid, G, ARG, Q, D, INV_Q, GD, QSEG, DSEG, PQ, PD, DOFF, DPERM,
    Nq, K, P, Lq, Ld, dim,
    n_qseq, n_qrows, n_dseq, n_drows,
    sq_n, sq_l,
    sd_b, sd_k, sd_l,
    sgd_b, sgd_k, sgd_l,
    sqs, sds_b, sds_k, sg,
    n_jb, n_kb,
    TQ: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr,
    Q_KIND: tl.constexpr, D_KIND: tl.constexpr, PAIR_LIST: tl.constexpr, SHARED_DOCS: tl.constexpr,
    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PAIR_SCAN: tl.constexpr,
    DOC_WALK: tl.constexpr, PROJECT: tl.constexpr, ONE_TQ: tl.constexpr, REG_SEL: tl.constexpr,
):  # fmt: skip
    """dD of one (document, token block, dim block), owned: no atomics, a fixed order of the sum (``PROJECT``: the
    block spans ``dim``, and is chained through the normalization of D's rows before it is stored).

    ``DOC_WALK``: the document was scored by queries of at most ``TQ`` tokens, by one (per-query candidates,
    aligned pairs) or by the pairs of a pair list that name it; the program owns the whole (document, dim block):
    it loads the (first) query's argmax and rows once, then writes the document's token blocks in turn, an MMA and
    a store each (one more MMA per further pair of the document, whose loads are repeated per block). One program
    per token block spent most of its life waiting on those loads (H100, backward of candidates 256x16 Lq32 Ld300
    244 -> 118 us; of a pair list of 2048 pairs from a pool of 1024, Lq 8-32 Ld 20-1000, 126 -> 90 us). A scanning
    walk (``PAIR_SCAN``) keeps the ids of the document's first ``HELD`` pairs from its one scan, so that the scan
    stays cheaper than building the index for lists whose documents recur (the same pool: the index's 22 us launch
    gone and the backward 90 -> 73 us; a list of one pair per document 70 -> 73 us)."""
    kb = pid % n_kb
    if DOC_WALK:
        doc = (pid // n_kb).to(tl.int64)
    else:
        jb = (pid // (n_kb)) % n_jb
        doc = (pid // (n_kb * n_jb)).to(tl.int64)
    b = doc // K
    kk = doc % K
    gd_base, _gd_tok0, d_len, _d_bad = doc_segment(
        GD, DSEG, b, kk, K, Ld, n_dseq, n_drows, sgd_b, sgd_k, sgd_l, sds_b, sds_k, D_KIND
    )
    if not DOC_WALK:
        j = jb * BN + tl.arange(0, BN)
    kd = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    kd_ok = kd < dim
    d_base = D
    anchor = _selector_anchor(BN, TQ, Q.dtype.element_ty) if REG_SEL else 0.0
    if PROJECT:
        d_base, _d_tok0, _d_len, _d_bad = doc_segment(
            D, DSEG, b, kk, K, Ld, n_dseq, n_drows, sd_b, sd_k, sd_l, sds_b, sds_k, D_KIND
        )
    if DOC_WALK:
        # A pair list's document: its pairs in pair order, from the CSR index by document or (PAIR_SCAN) one scan of
        # the pair ids. The first one's operands are loaded once; further ones (a document listed for several
        # queries) are loaded again for each token block, their ids read from the index or held from the scan.
        if PAIR_LIST:
            if PAIR_SCAN:
                # One scan keeps the document's first HELD pair ids (in pair order) in registers for every block;
                # only a document listed more often scans again per block for the rest.
                slots = tl.arange(0, HELD)
                held = tl.zeros([HELD], dtype=tl.int64) + P
                n_listed = tl.full([], 0, tl.int32)
                for c0 in range(0, P, SCAN):
                    cols = c0 + tl.arange(0, SCAN)
                    mine = tl.load(PD + cols, mask=cols < P, other=-1) == kk
                    n_mine = tl.sum(mine.to(tl.int32), 0)
                    n_keep = tl.minimum(n_mine, tl.maximum(HELD - n_listed, 0))
                    # (the chunk's first pair by a min, as cheap as the count; a rank only for more of them)
                    p0 = tl.min(tl.where(mine, cols, P), 0).to(tl.int64)
                    held = tl.where((slots == n_listed) & (n_keep > 0), p0, held)
                    if n_keep > 1:
                        rank = tl.cumsum(mine.to(tl.int32), 0)
                        for h in range(1, n_keep):
                            p = tl.sum(tl.where(mine & (rank == h + 1), cols, 0), 0).to(tl.int64)
                            held = tl.where(slots == n_listed + h, p, held)
                    n_listed += n_mine
                listed = n_listed > 0
                first = tl.min(held, 0)
            else:
                e_lo = tl.load(DOFF + kk).to(tl.int64)
                e_hi = tl.load(DOFF + kk + 1).to(tl.int64)
                listed = e_hi > e_lo
                first = e_lo
            first = tl.minimum(first, P - 1)  # (P >= 1 here; a document in no pair reads a valid entry, unused)
            walk: tl.constexpr = WALK_PAIRS if PAIR_SCAN else WALK_CSR
        else:
            first = b
            walk: tl.constexpr = WALK_QUERIES
        a, qt, w = _dd_load(
            first, 1, K, kk, G, ARG, Q, INV_Q, QSEG, PQ, DPERM,
            Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, sg, kd, kd_ok, TQ, Q_KIND, walk, NORMALIZE,
        )  # fmt: skip
        if PAIR_LIST:  # a document in no pair: zeros (0 * an inf row or a NaN weight of that pair would be NaN)
            qt = tl.where(listed, qt, tl.zeros_like(qt))
            w = tl.where(listed, w, tl.zeros_like(w))
        n_stored = tl.cdiv(d_len, BN) if D_KIND == OFFSETS else n_jb  # padding rows get their (zero) gradient too
        for jb in range(0, n_stored):
            j = jb * BN + tl.arange(0, BN)
            acc = tl.zeros([BN, BLOCK_K], dtype=tl.float32)
            if jb * BN < d_len:  # (past the document's end: chosen by no token, and no NaN of w spread there)
                acc = _dd_add(acc, a, qt, w, j, anchor, NORMALIZE, DOT_PRECISION, UPCAST, REG_SEL)
                if PAIR_LIST:
                    if PAIR_SCAN:
                        if n_listed > 1:
                            # (not software-pipelined: a document has few pairs, and the pipeline's prologue
                            # cost every block of a one-pair document; H100, 2048 pairs on their own documents,
                            # Lq 32 Ld 180: backward 93 us pipelined, 73 not)
                            for h in tl.range(1, tl.minimum(n_listed, HELD), num_stages=1):
                                p = tl.sum(tl.where(slots == h, held, 0), 0)
                                a_e, qt_e, w_e = _dd_load(
                                    p, 1, K, kk, G, ARG, Q, INV_Q, QSEG, PQ, DPERM, Lq, n_qseq, n_qrows,
                                    sq_n, sq_l, sqs, sg, kd, kd_ok, TQ, Q_KIND, WALK_PAIRS, NORMALIZE,
                                )  # fmt: skip
                                acc = _dd_add(acc, a_e, qt_e, w_e, j, anchor, NORMALIZE, DOT_PRECISION, UPCAST, REG_SEL)
                        if n_listed > HELD:  # the pairs past the held ones, in pair order
                            seen = tl.full([], 0, tl.int32)
                            for c0 in range(0, P, SCAN):
                                cols = c0 + tl.arange(0, SCAN)
                                mine = tl.load(PD + cols, mask=cols < P, other=-1) == kk
                                late = mine & (seen + tl.cumsum(mine.to(tl.int32), 0) > HELD)
                                seen += tl.sum(mine.to(tl.int32), 0)
                                n_late = tl.sum(late.to(tl.int32), 0)
                                if n_late > 0:
                                    rank = tl.cumsum(late.to(tl.int32), 0)
                                    for h in range(0, n_late):
                                        p = tl.sum(tl.where(late & (rank == h + 1), cols, 0), 0).to(tl.int64)
                                        a_e, qt_e, w_e = _dd_load(
                                            p, 1, K, kk, G, ARG, Q, INV_Q, QSEG, PQ, DPERM, Lq, n_qseq, n_qrows,
                                            sq_n, sq_l, sqs, sg, kd, kd_ok, TQ, Q_KIND, WALK_PAIRS, NORMALIZE,
                                        )  # fmt: skip
                                        acc = _dd_add(
                                            acc, a_e, qt_e, w_e, j, anchor, NORMALIZE, DOT_PRECISION, UPCAST, REG_SEL
                                        )
                    else:
                        for e in range(e_lo + 1, e_hi):
                            a_e, qt_e, w_e = _dd_load(
                                e, 1, K, kk, G, ARG, Q, INV_Q, QSEG, PQ, DPERM, Lq, n_qseq, n_qrows,
                                sq_n, sq_l, sqs, sg, kd, kd_ok, TQ, Q_KIND, WALK_CSR, NORMALIZE,
                            )  # fmt: skip
                            acc = _dd_add(acc, a_e, qt_e, w_e, j, anchor, NORMALIZE, DOT_PRECISION, UPCAST, REG_SEL)
            if PROJECT:
                acc = _projected(acc, d_base, j, d_len, kd, kd_ok, sd_l)
            j_store = j < d_len if D_KIND == OFFSETS else j < Ld
            out = gd_base + j[:, None] * sgd_l + kd[None, :]
            tl.store(out, acc.to(GD.dtype.element_ty), mask=j_store[:, None] & kd_ok[None, :])
    else:
        acc = tl.zeros([BN, BLOCK_K], dtype=tl.float32)
        # Queries of one token block (ONE_TQ: Lq <= TQ, a constexpr) make each step's entry the step itself: the
        # 64-bit division and its address arithmetic were a third of the walk's instructions (sm_90 SASS: 357 -> 250
        # a step at 128 dims), which a program running alone on its scheduler issues one every ~5 cycles (H200,
        # backward GPU time of the cross products 32x32 Lq32 Ld80 22.7 -> 17.4 us, 64x64 Ld128 46.5 -> 40.5 us).
        n_tq = 1 if ONE_TQ else tl.cdiv(Lq, TQ)
        # A block of document tokens past the document's end was chosen by no query token: skip the pair walk.
        if jb * BN < d_len:
            # Which pairs scored this document, in a fixed order: every query (shared documents), its one query
            # (per-query candidates), or the pairs listed for it (pair list: found by a scan of all P pair ids when
            # the list is short, else through the CSR index by document).
            if PAIR_SCAN:
                for c0 in range(0, P, SCAN):
                    cols = c0 + tl.arange(0, SCAN)
                    mine = tl.load(PD + cols, mask=cols < P, other=-1) == kk
                    n_mine = tl.sum(mine.to(tl.int32), 0)
                    if n_mine > 0:
                        rank = tl.cumsum(mine.to(tl.int32), 0)
                        for h in range(0, n_mine):
                            p = tl.sum(tl.where(mine & (rank == h + 1), cols, 0), 0).to(tl.int64)
                            for s in range(p * n_tq, (p + 1) * n_tq):
                                a, qt, w = _dd_load(
                                    s, n_tq, K, kk, G, ARG, Q, INV_Q, QSEG, PQ, DPERM,
                                    Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, sg, kd, kd_ok, TQ, Q_KIND, WALK_PAIRS,
                                    NORMALIZE,
                                )  # fmt: skip
                                acc = _dd_add(acc, a, qt, w, j, anchor, NORMALIZE, DOT_PRECISION, UPCAST, REG_SEL)
            else:
                if PAIR_LIST:
                    e_lo = tl.load(DOFF + kk).to(tl.int64)
                    e_hi = tl.load(DOFF + kk + 1).to(tl.int64)
                elif SHARED_DOCS:
                    e_lo = b * 0
                    e_hi = b * 0 + Nq
                else:
                    e_lo = b
                    e_hi = b + 1
                # One flat loop over (entry, query-token block) steps, nothing nested, so that the compiler pipelines it
                # (it prefetches the argmax of the next steps).
                for s in range(e_lo * n_tq, e_hi * n_tq):
                    a, qt, w = _dd_load(
                        s, n_tq, K, kk, G, ARG, Q, INV_Q, QSEG, PQ, DPERM,
                        Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, sg, kd, kd_ok, TQ, Q_KIND,
                        WALK_CSR if PAIR_LIST else WALK_QUERIES, NORMALIZE,
                    )  # fmt: skip
                    acc = _dd_add(acc, a, qt, w, j, anchor, NORMALIZE, DOT_PRECISION, UPCAST, REG_SEL)
        if PROJECT:
            acc = _projected(acc, d_base, j, d_len, kd, kd_ok, sd_l)
        j_store = j < d_len if D_KIND == OFFSETS else j < Ld  # padding rows get their (zero) gradient too
        out = gd_base + j[:, None] * sgd_l + kd[None, :]
        tl.store(out, acc.to(GD.dtype.element_ty), mask=j_store[:, None] & kd_ok[None, :])


@triton.jit(
    do_not_specialize=[
        "n_queries", "Nq", "K", "K_dd", "P", "Lq", "Ld", "n_qseq", "n_qrows", "n_dseq", "n_drows", "sqs", "sds_b",
        "sds_k", "sg", "n_tb", "n_jb", "n_kb", "n_dq", "n_ks", "ks_len", "sdq_s", "sc_lo", "sc_n",
    ]
)  # fmt: skip
def maxsim_bwd_kernel(
    G, ARG, Q, D, INV_Q, INV_D, DQ, GD, GD_OUT, DQ_OUT, QSEG, DSEG, PQ, PD, QOFF, QPERM, DOFF, DPERM,
    n_queries, Nq, K, K_dd, P, Lq, Ld, dim,
    n_qseq, n_qrows, n_dseq, n_drows,
    sq_n, sq_l,
    sd_b, sd_k, sd_l,
    sdq_n, sdq_l,
    sgd_b, sgd_k, sgd_l,
    sqs, sds_b, sds_k, sg,
    n_tb, n_jb, n_kb, n_dq, n_ks, ks_len, sdq_s, sc_lo, sc_n,
    BT: tl.constexpr, DIM_P: tl.constexpr, UNROLL: tl.constexpr, TQ: tl.constexpr, BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    Q_KIND: tl.constexpr, D_KIND: tl.constexpr, PAIR_LIST: tl.constexpr, SHARED_DOCS: tl.constexpr,
    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    DQ_GATHER: tl.constexpr, DD_OWNED: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_D: tl.constexpr,
    DOC_WALK: tl.constexpr, DD_SCATTER: tl.constexpr, PROJECT_Q: tl.constexpr, PROJECT_D: tl.constexpr,
    DQ_SPLIT: tl.constexpr, SCATTER_DOCS: tl.constexpr, ONE_TQ: tl.constexpr, REG_SEL: tl.constexpr,
    FUSED_CAST: tl.constexpr, SUM_LAST: tl.constexpr,
):  # fmt: skip
    """The gather-and-own backward in one launch: programs ``[0, n_dq)`` compute dQ by the gather (``DQ_GATHER``),
    the rest own blocks of dD (``DD_OWNED``); either side may be absent (a long pair list's dQ and the fast cross
    product's dD use :func:`maxsim_bwd_scatter_kernel` instead). One launch rather than two: a small training step
    is made of host time, and each launch is several microseconds of it.

    Pair-grid sizes: ``K`` is the score grid's (a pair list: ``P``) for the gather; ``Nq``, ``K_dd`` (documents of
    a pair list) and ``P`` for the owner. ``DOC_WALK``: every query has at most ``TQ`` tokens and every
    document was scored by one of them (candidates, aligned pairs) or is found by the pair list's scan or index;
    its owner programs are one per (document, dim block), see :func:`_dd_program`. ``ONE_TQ``: ``Lq <= TQ`` (each
    query's tokens are one step of the owner's walk). ``REG_SEL``: the owner builds its selector in the MMA's
    registers (see :func:`_dd_add`). ``FUSED_CAST`` (with ``DD_SCATTER`` over all documents): the atomics' programs
    are followed by programs that round their fp32 sums into ``GD_OUT`` (see :func:`_scatter_and_cast`).
    ``SUM_LAST`` (a split walk beside those atomics, over all documents): the split walk's slices are summed into
    ``DQ_OUT`` by the last program of each block (see :func:`_dq_program`), its counters after dD's elements in
    ``GD``'s zeroed allocation."""
    pid = tl.program_id(0)
    # (a launch of one side tests nothing: the branch costs a dQ-only variant ~35 registers, a program per SM)
    gather = pid < n_dq if DQ_GATHER and (DD_OWNED or DD_SCATTER) else DQ_GATHER
    if gather:
        if DQ_GATHER:
            counters = GD
            if SUM_LAST:  # (after dD's elements: packed rows, or the shared documents)
                d_elems = n_drows.to(tl.int64) * dim if D_KIND == OFFSETS else K.to(tl.int64) * Ld * dim
                counters = (GD + d_elems).to(tl.pointer_type(tl.int32))
            _dq_program(
                pid, G, ARG, Q, D, INV_D, DQ, DQ_OUT, counters, QSEG, DSEG, PQ, PD, QOFF, QPERM,
                K, Lq, Ld, dim, n_qseq, n_qrows, n_dseq, n_drows, sq_n, sq_l, sd_b, sd_k, sd_l, sdq_n, sdq_l,
                sqs, sds_b, sds_k, sg, n_tb, n_ks, ks_len, sdq_s, BT, DIM_P, UNROLL, Q_KIND, D_KIND, PAIR_LIST,
                SHARED_DOCS, NORMALIZE, SCAN_Q, PROJECT_Q, DQ_SPLIT, SUM_LAST,
            )  # fmt: skip
    else:
        if DD_OWNED:
            _dd_program(
                pid - n_dq, G, ARG, Q, D, INV_Q, GD, QSEG, DSEG, PQ, PD, DOFF, DPERM,
                Nq, K_dd, P, Lq, Ld, dim, n_qseq, n_qrows, n_dseq, n_drows, sq_n, sq_l, sd_b, sd_k, sd_l,
                sgd_b, sgd_k, sgd_l, sqs, sds_b, sds_k, sg, n_jb, n_kb, TQ, BN, BLOCK_K, Q_KIND, D_KIND, PAIR_LIST,
                SHARED_DOCS, NORMALIZE, DOT_PRECISION, UPCAST, SCAN_D, DOC_WALK, PROJECT_D, ONE_TQ, REG_SEL,
            )  # fmt: skip
        if DD_SCATTER:  # dD by fp32 atomics into GD (zeroed), beside the gather's programs (documents
            # [sc_lo, sc_lo + sc_n): all, or a chunked dD's first chunk)
            if FUSED_CAST:
                _scatter_and_cast(
                    pid - n_dq, G, ARG, Q, GD, GD_OUT, INV_Q, QSEG, DSEG, Nq, K, Lq, Ld, dim, n_qseq, n_qrows,
                    n_dseq, n_drows, sq_n, sq_l, sgd_b, sgd_k, sgd_l, sqs, sds_b, sds_k, sg, n_tb, BT, DIM_P, Q_KIND,
                    D_KIND, NORMALIZE, SCATTER_DOCS, FUSED_CAST_BLOCK, FUSED_CAST_STEPS,
                )  # fmt: skip
            else:
                _scatter_program(
                    pid - n_dq, G, ARG, Q, GD, INV_Q, QSEG, DSEG, PQ, PD, K, Lq, Ld, dim, n_qseq, n_qrows, n_dseq,
                    n_drows, sq_n, sq_l, sgd_b, sgd_k, sgd_l, sqs, sds_b, sds_k, sg, n_tb, sc_lo, sc_n, BT, DIM_P,
                    Q_KIND, D_KIND, PAIR_LIST, SHARED_DOCS, False, NORMALIZE, SCATTER_DOCS,
                )  # fmt: skip
