"""The forward kernel: one Triton core for every layout.

A program owns ``BQ`` queries (``BQ * TQ`` rows of the MMA's M dimension) and one document (or, for a pair list,
one listed pair). Where the tokens live — dense, packed with offsets, padded with lengths — is resolved by
:mod:`.segments`; the loop below does not know the layout. It streams the
document in ``BLOCK_N``-token tiles, keeps a running row max (and, for training, its argmax) in registers, and never
writes the ``[Lq, Ld]`` similarity block anywhere. A tile's product unrolls its dim chunks (up to
``UNROLLED_DIM_CHUNKS``, 256 dims); wider tokens run a pipelined loop over 64-dim chunks instead. Packing several
queries into M (only where they share the document, i.e. the cross product, ``Bd == 1``) lets one loaded document
tile serve all of them; they take ``TQ``-row slots, or (``PACKED``) follow each other at their own length.
Queries longer than ``TQ`` rows are split into ``TQ``-row blocks, one program each; their partial scores are summed
afterwards in a fixed order (deterministic, no atomics). A launch of a handful of long documents may split each
document's tokens over programs too (``DOC_SPLIT``), whose row maxima :mod:`.doc_chunks` folds. Thin
scores-only blocks turn the product around (``DOC_ROWS``): the tile's tokens fill the MMA's rows, the query rows its
columns, and the running max is kept transposed.

Semantics (design.md §1) live here and, for chunked documents, in the fold that keeps them: masked document tokens
are ``-inf`` before the max; a query row that is masked or sees no valid document token contributes 0 and argmax -1;
ties go to the lowest index (strict ``>`` across tiles, ``tie_break_left`` within one); NaN propagates through the
max.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .segments import doc_segment, query_segment

NORM_EPS: tl.constexpr = tl.constexpr(1e-12)
# Dim chunks a tile's product unrolls (every chunk's loads in flight together); more run as a pipelined loop.
UNROLLED_DIM_CHUNKS: tl.constexpr = tl.constexpr(2)


@triton.jit
def nan_max(a, b):
    """``max`` that propagates NaN (``tl.max`` ignores it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def chunk_tokens(ROWS, n_rows):
    """The int32 half of a chunked scan's row buffer (doc_chunks): ``n_rows`` fp32 maxima, then as many tokens. One
    allocation of host time instead of two."""
    return (ROWS + n_rows).to(tl.pointer_type(tl.int32), bitcast=True)


@triton.jit
def _load_q_chunk(q_rows, row_ok, kc, dim, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    kd = kc * BLOCK_K + tl.arange(0, BLOCK_K)
    qt = tl.load(q_rows[:, None] + kd[None, :], mask=row_ok[:, None] & (kd[None, :] < dim), other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    return qt


@triton.jit
def _tile_ok(dm_doc, n0, d_len, sdm_l, BLOCK_N: tl.constexpr, HAS_DMASK: tl.constexpr):
    """``[BLOCK_N]``: which columns of the tile ``[n0, n0 + BLOCK_N)`` hold a valid token (in the document and,
    with a mask, unmasked)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    ok = cols < d_len
    if HAS_DMASK:
        ok = ok & (tl.load(dm_doc + cols * sdm_l, mask=ok, other=0) != 0)
    return ok


@triton.jit
def _tile_bits(dm_doc, n0, d_len, sdm_l, BLOCK_N: tl.constexpr):
    """:func:`_tile_ok` of a masked tile as one integer, bit ``c`` for column ``c`` (int32 for tiles of up to 32
    tokens, int64 up to 64). A stream carries its tiles' masks from their loads to their selects two tiles later:
    as flags, each tile held a predicate a column in every thread and packed them into registers and out again
    (112 registers against the unmasked loop's 79 for 64-row blocks: two programs fewer a multiprocessor); as
    bits, one register, and the load's columns are gathered by one warp reduction. A pipelined loop reads its
    next tile's bits during this one (its flags, read in the tile's own iteration, each took a byte load, its
    address and two compares a column in every thread, and the loads' latency in front of the select)."""
    tl.static_assert(BLOCK_N <= 64, "a tile's mask bits fit one int64")
    if BLOCK_N > 32:  # (two 32-column halves: a warp's reduction each, where 64 columns went through shared memory)
        lo = _tile_bits(dm_doc, n0, d_len, sdm_l, 32).to(tl.int64) & 0xFFFFFFFF
        hi = _tile_bits(dm_doc, n0 + 32, d_len, sdm_l, 32).to(tl.int64)
        return lo | (hi << 32)
    else:
        ok = _tile_ok(dm_doc, n0, d_len, sdm_l, BLOCK_N, True)
        return tl.sum(ok.to(tl.int32) << tl.arange(0, BLOCK_N), axis=0)  # (distinct bits: the sum is their OR)


@triton.jit
def _raw_flags(dm_doc, n0, d_len, sdm_l, BLOCK_N: tl.constexpr):
    """The loaded flags of :func:`_tile_bits`, as int32 in 32-column halves ``(lo, hi)`` (``hi`` a stand-in for tiles
    of up to 32 tokens): the argmax's pipelined loop carries them to the next tile, which reduces them
    (:func:`_raw_bits`), the loads' latency passing behind a tile's product. (:func:`_tile_bits` keeps its own
    order, each half's load then its reduction: the loops that carry bits were measured with it.)"""
    tl.static_assert(BLOCK_N <= 64, "a tile's mask bits fit one int64")
    W: tl.constexpr = 32 if BLOCK_N > 32 else BLOCK_N
    lo = _tile_ok(dm_doc, n0, d_len, sdm_l, W, True).to(tl.int32)
    if BLOCK_N > 32:
        hi = _tile_ok(dm_doc, n0 + 32, d_len, sdm_l, 32, True).to(tl.int32)
    else:
        hi = tl.zeros([W], dtype=tl.int32)
    return lo, hi


@triton.jit
def _raw_bits(lo, hi, BLOCK_N: tl.constexpr):
    """:func:`_tile_bits`'s integer from :func:`_raw_flags`' halves."""
    W: tl.constexpr = 32 if BLOCK_N > 32 else BLOCK_N
    b_lo = tl.sum(lo << tl.arange(0, W), axis=0)
    if BLOCK_N > 32:
        b_hi = tl.sum(hi << tl.arange(0, W), axis=0)
        return (b_lo.to(tl.int64) & 0xFFFFFFFF) | (b_hi.to(tl.int64) << 32)
    else:
        return b_lo


@triton.jit
def _bits_ok(bits, BLOCK_N: tl.constexpr):
    """``[BLOCK_N]`` column flags of :func:`_tile_bits`'s integer, in whatever layout their use asks for."""
    return ((bits >> tl.arange(0, BLOCK_N).to(bits.dtype)) & 1) != 0


@triton.jit
def _ahead_ok(dm_doc, n0, d_len, sdm_l, BLOCK_N: tl.constexpr, MASK_AHEAD: tl.constexpr, MASK_BITS: tl.constexpr):
    """A tile's valid columns as a stream carries them to its select: :func:`_tile_bits`'s integer (``MASK_BITS``)
    or :func:`_tile_ok`'s flags (the mask read where ``MASK_AHEAD``)."""
    if MASK_BITS:
        return _tile_bits(dm_doc, n0, d_len, sdm_l, BLOCK_N)
    else:
        return _tile_ok(dm_doc, n0, d_len, sdm_l, BLOCK_N, MASK_AHEAD)


@triton.jit
def _stream_tile(d_base, n0, d_len, sd_l, dim, live, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The document tile ``[n0, n0 + BLOCK_N)``, loaded into registers as the first lines to leave the L2
    (``evict_first``): no other program reads it, and a pass over a corpus then replaces its own lines instead of
    the queries or lines another kernel left dirty, whose write-back would take HBM bandwidth in the middle of the
    pass. (Triton 3.6 drops the hint from the asynchronous copies of its pipeliner, so these loads are plain ones,
    issued one tile ahead by the caller; 3.9 keeps it there at PTX ISA 9.4: ``EVICT_D``.) Nothing is read where
    ``live`` is false; rows past ``d_len`` read its last token (no row predicate), and masked tokens are read too
    (the select after the product drops their columns, as :func:`_chunk_product`'s): the loads need not wait for
    the tile's mask."""
    rows = tl.minimum(n0 + tl.arange(0, BLOCK_N), d_len - 1)
    kd = tl.arange(0, BLOCK_K)
    ptrs = d_base + rows[:, None] * sd_l + kd[None, :]
    lim = dim * live.to(tl.int32)  # (a scalar folded into the column bound: no predicate of its own)
    return tl.load(ptrs, mask=kd[None, :] < lim, other=0.0, eviction_policy="evict_first")


@triton.jit
def _next_tile(j, n0, d_len, BLOCK_N: tl.constexpr):
    """The tile after tile ``n0`` of a walk's document ``j`` (dense documents of ``d_len`` tokens): ``(j, n0)`` of
    the next one, the next document's first tile past the last."""
    n_next = n0 + BLOCK_N
    wrap = n_next >= d_len
    return j + wrap.to(j.dtype), tl.where(wrap, 0, n_next)


@triton.jit
def _first_tile(
    d_base, d_len, sd_l, dim, live, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STREAM_D: tl.constexpr
):  # fmt: skip
    """The first tile a ``STREAM_D`` tile loop scans (:func:`_stream_tile`); zeros, never read, otherwise."""
    if STREAM_D:
        return _stream_tile(d_base, 0, d_len, sd_l, dim, live, BLOCK_N, BLOCK_K)
    else:
        return tl.zeros([BLOCK_N, BLOCK_K], dtype=d_base.dtype.element_ty)


@triton.jit
def _argmax_slots(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SAVE_ARGMAX: tl.constexpr):
    """The running argmax's tile offsets ``[rows, BLOCK_N]`` (fp32, relative to the next tile: see
    :func:`_scan_tile`), or a one-element stand-in when none is kept (so a loop that resets it costs no registers)."""
    if SAVE_ARGMAX:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        return tl.zeros([1, 1], dtype=tl.float32)


@triton.jit
def _chunk_product(
    s, sumsq, qt, q_rows, row_ok, d_base, cols, d_len, dim, sd_l, kc, dt_pre, BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr, SUMSQ: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    STREAM_D: tl.constexpr, EVICT_D: tl.constexpr, DOC_ROWS: tl.constexpr,
):  # fmt: skip
    """Dim chunk ``kc`` of a tile's similarities added into ``s [rows, BLOCK_N]`` (``DOC_ROWS``: ``[BLOCK_N,
    rows]``, ``qt`` then the query block transposed) and its tokens' squares into ``sumsq [BLOCK_N]`` where
    ``SUMSQ``. With one chunk, ``qt`` is the query block; ``STREAM_D``: ``dt_pre`` is the tile."""
    if NUM_K > 1:
        qt = _load_q_chunk(q_rows, row_ok, kc, dim, BLOCK_K, UPCAST)
    kd = kc * BLOCK_K + tl.arange(0, BLOCK_K)
    if STREAM_D:
        dt = dt_pre
    else:
        # Rows past the document's end read its last token instead (their columns become -inf after the max's
        # select): loads without a row predicate, which every tile paid (H100: long-query training step 793 ->
        # 766 us, ColPali inference 243 -> 229 us; memory-bound rows unchanged). Masked tokens are read too: the
        # select that follows the product replaces their columns (NaN or inf included, each column being one token's
        # own products), where a predicate on the mask held the tile's loads behind the mask's.
        rows = tl.minimum(cols, d_len - 1)
        d_ptrs = d_base + rows[:, None] * sd_l + kd[None, :]
        if EVICT_D:  # (a once-read scan's tiles: see _stream_tile; the pipeliner keeps the hint from Triton 3.9)
            dt = tl.load(d_ptrs, mask=(kd[None, :] < dim), other=0.0, eviction_policy="evict_first")
        else:
            dt = tl.load(d_ptrs, mask=(kd[None, :] < dim), other=0.0)
    if SUMSQ:
        dtf = dt.to(tl.float32)
        sumsq += tl.sum(dtf * dtf, axis=1)
    if UPCAST:
        dt = dt.to(tl.float32)
    if DOC_ROWS:
        s = tl.dot(dt, qt, s, input_precision=DOT_PRECISION)
    else:
        s = tl.dot(qt, tl.trans(dt), s, input_precision=DOT_PRECISION)
    return s, sumsq


@triton.jit
def _per_token(v, DOC_ROWS: tl.constexpr):
    """``v [BLOCK_N]`` (one value a document token) broadcast against a tile's similarities: a row ``[1, BLOCK_N]``,
    or (``DOC_ROWS``) a column ``[BLOCK_N, 1]``."""
    if DOC_ROWS:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def _fresh_max(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOC_ROWS: tl.constexpr):
    """The running max before a row block's first tile: ``[BLOCK_M, BLOCK_N]`` of -inf (``DOC_ROWS``: transposed)."""
    if DOC_ROWS:
        return tl.full([BLOCK_N, BLOCK_M], float("-inf"), dtype=tl.float32)
    else:
        return tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)


@triton.jit
def _scan_tile(
    qt, q_rows, row_ok, d_base, dm_doc, inv_doc, n0, d_len, dim, sd_l, sdm_l, sid_l, m2, a2, any_valid, dt_pre,
    ok_pre, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, HAS_DMASK: tl.constexpr,
    NORMALIZE: tl.constexpr, NORMS_GIVEN: tl.constexpr, SAVE_ARGMAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EARLY_NORMS: tl.constexpr, STREAM_D: tl.constexpr, EVICT_D: tl.constexpr,
    DOC_ROWS: tl.constexpr, MASK_BITS: tl.constexpr,
):  # fmt: skip
    """One document tile ``[n0, n0 + BLOCK_N)`` folded into the running max ``m2`` (and argmax ``a2``) of shape
    ``[rows, BLOCK_N]``; ``any_valid [BLOCK_N]`` remembers whether a column slot ever held a valid token.
    ``STREAM_D`` (one dim chunk): the tile is ``dt_pre`` and its valid columns ``ok_pre``, loaded by the caller
    (``_stream_tile``, ``_tile_ok``).

    ``DOC_ROWS`` (one dim chunk, no argmax): the document's tokens are the MMA's rows, ``s`` and ``m2`` are
    ``[BLOCK_N, rows]`` and ``qt`` is the query block transposed. A token's inverse norm then scales a row of
    ``s``, which the registers that sum its squares already hold in the product's row layout: normalizing costs
    the squares only, not a layout change of the norms through shared memory each tile."""
    cols = n0 + tl.arange(0, BLOCK_N)
    in_doc = cols < d_len
    col_ok = in_doc
    if MASK_BITS:
        col_ok = _bits_ok(ok_pre, BLOCK_N)
    elif STREAM_D:
        col_ok = ok_pre
    elif HAS_DMASK:  # (written out, not _tile_ok: the call cost a masked persistent variant 12 registers)
        col_ok = col_ok & (tl.load(dm_doc + cols * sdm_l, mask=in_doc, other=0) != 0)
    if DOC_ROWS:
        s = tl.zeros([BLOCK_N, qt.shape[1]], dtype=tl.float32)
    else:
        s = tl.zeros([qt.shape[0], BLOCK_N], dtype=tl.float32)
    SUMSQ: tl.constexpr = NORMALIZE and not NORMS_GIVEN
    sumsq = tl.zeros([BLOCK_N if SUMSQ else 1], dtype=tl.float32)  # (without SUMSQ, a stand-in passed along)
    if NORMALIZE and NORMS_GIVEN and EARLY_NORMS:  # (BLOCK_N floats, loaded before the MMA: it hides their latency)
        inv_cols = tl.load(inv_doc + cols * sid_l, mask=col_ok, other=0.0)
    if NUM_K > UNROLLED_DIM_CHUNKS:
        # Wide tokens: a loop the compiler pipelines chunk by chunk (one query chunk and one tile chunk a stage),
        # where the unrolled loop below keeps every chunk of both in flight (768 dims: 448 KB of shared memory).
        for kc in range(NUM_K):
            s, sumsq = _chunk_product(
                s, sumsq, qt, q_rows, row_ok, d_base, cols, d_len, dim, sd_l, kc, dt_pre, BLOCK_K, NUM_K, SUMSQ,
                DOT_PRECISION, UPCAST, STREAM_D, EVICT_D, DOC_ROWS,
            )  # fmt: skip
    else:
        for kc in tl.static_range(NUM_K):
            s, sumsq = _chunk_product(
                s, sumsq, qt, q_rows, row_ok, d_base, cols, d_len, dim, sd_l, kc, dt_pre, BLOCK_K, NUM_K, SUMSQ,
                DOT_PRECISION, UPCAST, STREAM_D, EVICT_D, DOC_ROWS,
            )  # fmt: skip
    if NORMALIZE:
        if SUMSQ:  # (a layout round trip through shared memory a tile, but in DOC_ROWS: see above)
            inv_cols = 1.0 / tl.maximum(tl.sqrt(sumsq), NORM_EPS)
        elif not EARLY_NORMS:
            # Masked tokens' norms are read too (the select below drops their columns): predicated on the mask, the
            # load was scheduled after the MMA's wait instead of during it (H200, masked and normalized: ColPali
            # 1x500 678 -> 365 us; the early load above keeps its predicate: 128x128 Lq32 151.7 -> 159.1 without).
            inv_cols = tl.load(inv_doc + cols * sid_l, mask=in_doc, other=0.0)
        s = s * _per_token(inv_cols, DOC_ROWS)
    # The running max costs ALU instructions per element that the MMA does not hide; a full tile of a document
    # without a mask has nothing to mask, so only a document's last tile (or a masked document) pays the select.
    if MASK_BITS == 2 or (MASK_BITS == 1 and STREAM_D):
        # The same for a masked tile whose bits are all set (every column in the document and kept: the usual tile
        # of a padded batch); one compare of a uniform integer chooses. Not where a pipelined loop reduces the next
        # tile's flags to bits in this tile's iteration (MASK_BITS 1 without STREAM_D): the branch held that
        # reduction, and the flags' load latency, in front of the MMA.
        FULL: tl.constexpr = -1 if BLOCK_N >= 32 else (1 << BLOCK_N) - 1
        if ok_pre != FULL:
            s = tl.where(_per_token(col_ok, DOC_ROWS), s, float("-inf"))
    elif HAS_DMASK:
        s = tl.where(_per_token(col_ok, DOC_ROWS), s, float("-inf"))
    elif n0 + BLOCK_N > d_len:
        s = tl.where(_per_token(in_doc, DOC_ROWS), s, float("-inf"))
    if SAVE_ARGMAX:
        # a2 is the winning tile's offset minus the next tile's (an integer in fp32, exact below 2^24): a tile
        # that does not beat the running max (strict: an earlier tile keeps a tie; NaN never beats) keeps the
        # offset, one that does resets it, and either way it moves one tile further back. One compare and one
        # multiply-add, where a select of the tile offset took two instructions of the ALU pipe (the busiest).
        keep = (~(s > m2)).to(tl.float32)
        a2 = a2 * keep - BLOCK_N
    m2 = nan_max(m2, s)
    any_valid = tl.maximum(any_valid, col_ok.to(tl.int32))
    return m2, a2, any_valid


@triton.jit
def _finish_rows(
    m2, a2, n_end, any_valid, q_scale, inv_rows, row_ok,
    BLOCK_N: tl.constexpr, NORMALIZE: tl.constexpr, NORMS_GIVEN: tl.constexpr, SAVE_ARGMAX: tl.constexpr,
    DOC_ROWS: tl.constexpr,
):  # fmt: skip
    """Row maxima of one row block after its last tile: ``(value [rows] (0 where the row is not live), argmax
    [rows] (-1 there), live [rows])``; the cross-lane reduction happens here, once per row block. ``q_scale``: the
    rows' inverse norms of :func:`_query_inv_norms` (``NORMALIZE`` without ``NORMS_GIVEN``; else unused)."""
    m = tl.reduce(m2, 0 if DOC_ROWS else 1, nan_max)
    a = tl.zeros([row_ok.shape[0]], dtype=tl.int32)  # (unused when no argmax is kept)
    if SAVE_ARGMAX:
        # Each slot's winning token (tile offsets from the end of the last tile scanned, n_end; integers in fp32,
        # exact below 2^24); the row's is the first slot holding its max (a NaN row: its first NaN). One compare,
        # select and min an element, and a conversion a row, where a reduction of (value, token) pairs took two
        # compares, an integer compare, two selects and a conversion an element.
        tok = a2 + (n_end + tl.arange(0, BLOCK_N)).to(tl.float32)[None, :]
        first = (m2 == m[:, None]) | (m2 != m2)
        a = tl.min(tl.where(first, tok, float("inf")), axis=1).to(tl.int32)
    if NORMALIZE and NORMS_GIVEN:
        m = m * tl.load(inv_rows, mask=row_ok, other=0.0)
    elif NORMALIZE:  # (a positive per-row factor: it scales the max without moving the argmax)
        m = m * q_scale
    row_live = row_ok & (tl.zeros([row_ok.shape[0]], dtype=tl.int32) + tl.max(any_valid, axis=0) > 0)
    return tl.where(row_live, m, 0.0), tl.where(row_live, a, -1), row_live


@triton.jit
def _query_inv_norms(
    qt, q_rows, row_ok, dim, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, NORMALIZE: tl.constexpr,
    NORMS_GIVEN: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``[rows]`` inverse norms of the query block's rows (``qt``: its first dim chunk as loaded), for
    :func:`_finish_rows`; computed before the tile loop, so that ``qt`` need not stay in registers through it (the
    tile product reads the block from shared memory). Zeros where unused (no ``NORMALIZE``, or ``NORMS_GIVEN``)."""
    if NORMALIZE and not NORMS_GIVEN:
        sumsq_q = tl.zeros([qt.shape[0]], dtype=tl.float32)
        for kc in tl.static_range(NUM_K):
            if NUM_K > 1:
                qt = _load_q_chunk(q_rows, row_ok, kc, dim, BLOCK_K, UPCAST)
            qf = qt.to(tl.float32)
            sumsq_q += tl.sum(qf * qf, axis=1)
        return 1.0 / tl.maximum(tl.sqrt(sumsq_q), NORM_EPS)
    else:
        return tl.zeros([qt.shape[0]], dtype=tl.float32)


@triton.jit
def _mma_queries(qt, DOC_ROWS: tl.constexpr):
    """The query block as the tile product takes it: ``[rows, BLOCK_K]``, or transposed for ``DOC_ROWS`` (once,
    before the tile loop)."""
    if DOC_ROWS:
        return tl.trans(qt)
    else:
        return qt


@triton.jit
def _query_block(
    t0, tok, q_in, q_len, r_hi, q_out, QM, sqm_n, sqm_l, q_base, sq_l, dim,
    BLOCK_K: tl.constexpr, HAS_QMASK: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """The rows ``t0 + tok`` of a program's queries (``tok [rows]``: each row's token within its query's slot):
    ``(token index t, row_ok, row pointers, first dim chunk [rows, BLOCK_K])``."""
    t = t0 + tok
    row_ok = q_in & (t < q_len) & (t < r_hi)
    if HAS_QMASK:
        row_ok = row_ok & (tl.load(QM + q_out * sqm_n + t * sqm_l, mask=row_ok, other=0) != 0)
    q_rows = q_base + t * sq_l
    return t, row_ok, q_rows, _load_q_chunk(q_rows, row_ok, 0, dim, BLOCK_K, UPCAST)


@triton.jit
def _slot_sums(v, slot, SLOTS: tl.constexpr, TQ: tl.constexpr, PACKED: tl.constexpr):
    """``[SLOTS]``: the sum of ``v [rows]`` over each query slot's rows (``slot [rows]``); without ``PACKED`` the
    slots are consecutive ``TQ``-row blocks."""
    if PACKED:
        own = slot[:, None] == tl.arange(0, SLOTS)[None, :]
        return tl.sum(tl.where(own, v[:, None], tl.zeros_like(v)[:, None]), axis=0)
    else:
        return tl.sum(tl.reshape(v, [SLOTS, TQ]), axis=1)


@triton.jit
def _row_block(
    t0, tok, q_in, q_len, r_hi, q_out, QM, sqm_n, sqm_l, q_base, sq_l, iq_base, siq_l, d_base, dm_doc, inv_doc, d_len,
    dim, sd_l, sdm_l, sid_l,
    TQ: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr, NORMALIZE: tl.constexpr, NORMS_GIVEN: tl.constexpr,
    SAVE_ARGMAX: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EARLY_NORMS: tl.constexpr,
    STREAM_D: tl.constexpr, EVICT_D: tl.constexpr, DOC_ROWS: tl.constexpr, MASK_BITS: tl.constexpr,
):  # fmt: skip
    """Rows ``t0 .. t0 + TQ`` of the program's packed queries against one document: ``(token index t, value
    [rows] (0 where a row is not live), argmax [rows] (-1 there; unset without SAVE_ARGMAX), live [rows])``."""
    BLOCK_M: tl.constexpr = BQ * TQ
    t, row_ok, q_rows, qt = _query_block(
        t0, tok, q_in, q_len, r_hi, q_out, QM, sqm_n, sqm_l, q_base, sq_l, dim, BLOCK_K, HAS_QMASK, UPCAST
    )
    # Running max per (row, column slot) across tiles: one max (and one select for the argmax) per element
    # per tile; the cross-lane row reduction happens once per row block instead of once per tile.
    m2 = _fresh_max(BLOCK_M, BLOCK_N, DOC_ROWS)
    a2 = _argmax_slots(BLOCK_M, BLOCK_N, SAVE_ARGMAX)
    any_valid = tl.zeros([BLOCK_N], dtype=tl.int32)
    q_op = _mma_queries(qt, DOC_ROWS)
    if not STREAM_D:  # (the stream's thin block costs few registers: its norms wait until its loads are out)
        q_scale = _query_inv_norms(qt, q_rows, row_ok, dim, BLOCK_K, NUM_K, NORMALIZE, NORMS_GIVEN, UPCAST)
    # STREAM_D: a tile's tokens one tile ahead of their MMA, its mask (for the select after it) one tile further;
    # the pipelined loop's tiles come through the copies' stages, and MASK_BITS carries their masks a tile ahead.
    MASK_AHEAD: tl.constexpr = HAS_DMASK and STREAM_D
    ok = _ahead_ok(dm_doc, 0, d_len, sdm_l, BLOCK_N, MASK_AHEAD, MASK_BITS)
    dt = _first_tile(d_base, d_len, sd_l, dim, d_len > 0, BLOCK_N, BLOCK_K, STREAM_D)
    ok_next = _ahead_ok(dm_doc, BLOCK_N, d_len, sdm_l, BLOCK_N, MASK_AHEAD, MASK_BITS)
    if MASK_BITS == 2:  # (the argmax's pipelined loop: the next tile's loaded flags, see _raw_flags)
        raw_lo, raw_hi = _raw_flags(dm_doc, 0, d_len, sdm_l, BLOCK_N)
    for n0 in range(0, d_len, BLOCK_N):
        dt_pre, ok_pre = dt, ok
        if STREAM_D:  # the next tile's loads in flight during this one's MMA
            dt = _stream_tile(d_base, n0 + BLOCK_N, d_len, sd_l, dim, n0 + BLOCK_N < d_len, BLOCK_N, BLOCK_K)
            ok = ok_next
            ok_next = _ahead_ok(dm_doc, n0 + 2 * BLOCK_N, d_len, sdm_l, BLOCK_N, MASK_AHEAD, MASK_BITS)
        elif MASK_BITS == 1:  # (two tiles ahead, its load stopped Triton's pipeliner from staging the copies at all)
            ok = _tile_bits(dm_doc, n0 + BLOCK_N, d_len, sdm_l, BLOCK_N)
        elif MASK_BITS == 2:
            ok_pre = _raw_bits(raw_lo, raw_hi, BLOCK_N)
            raw_lo, raw_hi = _raw_flags(dm_doc, n0 + BLOCK_N, d_len, sdm_l, BLOCK_N)
        m2, a2, any_valid = _scan_tile(
            q_op, q_rows, row_ok, d_base, dm_doc, inv_doc, n0, d_len, dim, sd_l, sdm_l, sid_l, m2, a2,
            any_valid, dt_pre, ok_pre, BLOCK_N, BLOCK_K, NUM_K, HAS_DMASK, NORMALIZE, NORMS_GIVEN, SAVE_ARGMAX,
            DOT_PRECISION, UPCAST, EARLY_NORMS, STREAM_D, EVICT_D, DOC_ROWS, MASK_BITS,
        )  # fmt: skip
    if STREAM_D:
        q_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    row_val, a, live = _finish_rows(
        m2, a2, tl.cdiv(d_len, BLOCK_N) * BLOCK_N, any_valid, q_scale, iq_base + t * siq_l, row_ok,
        BLOCK_N, NORMALIZE, NORMS_GIVEN, SAVE_ARGMAX, DOC_ROWS,
    )  # fmt: skip
    if STREAM_D and NORMALIZE and not NORMS_GIVEN:
        # The select, as in _finish_rows, keeps the product out of an FMA with the caller's row sum: the scores
        # round as the table's do.
        q_scale = _query_inv_norms(qt, q_rows, row_ok, dim, BLOCK_K, NUM_K, NORMALIZE, NORMS_GIVEN, UPCAST)
        row_val = tl.where(live, row_val * q_scale, 0.0)
    return t, row_val, a, live


# Sizes are runtime values (no recompile for a new Nq, K, Lq or Ld); strides stay specialized, because their
# divisibility by 16 is what lets loads be 16 bytes wide (a stride that changes with Ld costs at most one more
# variant). Mask and length strides change with Ld but only feed narrow loads, so they are not specialized either.
@triton.jit(
    do_not_specialize=[
        "Nq", "K", "Lq", "Ld", "n_qseq", "n_qrows", "n_dseq", "n_drows", "sqm_n", "sdm_b", "sdm_k", "sqs",
        "sds_b", "sds_k", "n_qblocks", "n_rsplit", "rows_per_prog", "docs_per_prog", "n_dsplit", "chunk_len",
    ]
)  # fmt: skip
def maxsim_fwd_kernel(
    Q, D, QM, DM, QSEG, DSEG, PQ, PD, OUT, ARG, INV_Q, INV_D, ROWS,
    Nq, K, Lq, Ld, dim,
    n_qseq, n_qrows, n_dseq, n_drows,
    sq_n, sq_l,
    sd_b, sd_k, sd_l,
    siq_n, siq_l,
    sid_b, sid_k, sid_l,
    sqm_n, sqm_l,
    sdm_b, sdm_k, sdm_l,
    sqs, sds_b, sds_k,
    n_qblocks, n_rsplit, rows_per_prog, docs_per_prog, n_dsplit, chunk_len,
    TQ: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    Q_KIND: tl.constexpr, D_KIND: tl.constexpr, PAIR_LIST: tl.constexpr,
    HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr, NORMALIZE: tl.constexpr, SAVE_ARGMAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PERSIST: tl.constexpr, NORMS_GIVEN: tl.constexpr,
    EARLY_NORMS: tl.constexpr, STREAM_D: tl.constexpr, EVICT_D: tl.constexpr, DOC_SPLIT: tl.constexpr,
    PACKED: tl.constexpr, DOC_ROWS: tl.constexpr, MASK_BITS: tl.constexpr,
):  # fmt: skip
    """Scores ``OUT [n_rsplit, Nq, K]`` and argmax ``ARG [Nq, K, Lq]``; a pair list runs as ``Nq = 1``, ``K`` =
    number of pairs, query and document of pair ``k`` read from ``PQ[k]``, ``PD[k]``.

    ``NORMALIZE``: tokens scored as ``x / max(||x||, eps)``, from the inverse norms ``INV_Q``, ``INV_D`` (fp32, laid
    out as the tokens, with strides ``siq_*``, ``sid_*``) where ``NORMS_GIVEN``, else from the tiles themselves.

    ``PERSIST``: the program walks ``docs_per_prog`` consecutive dense documents of its batch row (shared ones, or
    one query's candidates; ``rows_per_prog <= TQ``, ``NUM_K == 1``) in one flattened tile loop: its queries are
    loaded once, and the tile pipeline runs on across document boundaries instead of draining and refilling per
    document.

    ``STREAM_D`` (``NUM_K == 1``): every document tile is read by this program only; it is loaded one tile ahead
    with an evict-first hint (``_stream_tile``), its mask two tiles ahead. ``EVICT_D`` (the pipelined loop of a
    once-read scan): its tiles' copies carry that hint, where Triton keeps it. ``MASK_BITS`` (a document mask, tiles of
    at most 64 tokens): the mask carried as one integer a tile (:func:`_tile_bits`), read a tile ahead in the
    pipelined loops too.

    ``DOC_SPLIT`` (not with ``PERSIST``): each document is scanned in ``n_dsplit`` chunks of ``chunk_len`` tokens (a
    multiple of ``BLOCK_N``) by programs of their own, for launches that would otherwise leave multiprocessors idle
    (few long documents). A program writes its rows' maxima and where they are to ``ROWS`` (see
    :mod:`.doc_chunks`: fp32 maxima ``[n_dsplit, Nq, K, Lq]``, then their int32 tokens, -1 where the row saw no valid
    token in the chunk); ``OUT [Nq, K]`` gets 0, or NaN for an out-of-range segment, to which
    :func:`.doc_chunks.combine_chunks_kernel` adds the rows' sum.

    ``PACKED`` (shared documents, ``Lq < TQ``, one row block a query): the block's ``BQ * TQ`` rows hold
    ``min(BQ * TQ // Lq, 2 * BQ)`` queries back to back, ``Lq`` rows each, instead of ``BQ`` queries in ``TQ``-row
    slots (23-token queries: 11 a 256-row block instead of 8), and ``n_qblocks`` counts such blocks.

    ``DOC_ROWS`` (``NUM_K == 1``, no argmax): the tile product puts the document's tokens in the MMA's rows and the
    query rows in its columns (see :func:`_scan_tile`).

    Every program holds one block of ``rows_per_prog <= TQ`` query rows (``rs``-th of ``n_rsplit``)."""
    BLOCK_M: tl.constexpr = BQ * TQ
    pid = tl.program_id(0)
    # Query blocks, then row splits (then document chunks) vary fastest, so programs that run together share a
    # document through L2.
    qb = pid % n_qblocks
    rs = (pid // n_qblocks) % n_rsplit
    kk = (pid // (n_qblocks * n_rsplit)).to(tl.int64)
    chunk = 0
    if DOC_SPLIT:
        chunk = kk % n_dsplit
        kk = kk // n_dsplit
    r = tl.arange(0, BLOCK_M)
    # Each MMA row's query slot in the block and token in that slot: TQ-row slots, or (PACKED) queries back to back
    # at their own length Lq, up to SLOTS of them (Lq > TQ / 2 puts fewer than 2 * BQ in a block).
    SLOTS: tl.constexpr = 2 * BQ if PACKED else BQ
    if PACKED:
        per_block = tl.minimum(BLOCK_M // Lq, SLOTS)
        slot, tok = r // Lq, r % Lq
    else:
        per_block = BQ
        slot, tok = r // TQ, r % TQ
    q_out = qb * per_block + slot  # output row of each MMA row
    q_in = (q_out < Nq) & (slot < per_block)
    js = tl.arange(0, SLOTS)
    q_first = qb * per_block + js
    first_ok = (q_first < Nq) & (js < per_block)
    if PAIR_LIST:
        q_src = tl.load(PQ + kk).to(tl.int64) + tl.zeros([BLOCK_M], dtype=tl.int64)
        doc = tl.load(PD + kk).to(tl.int64)
        b = doc * 0
    else:
        q_src = q_out.to(tl.int64)
        doc = kk
        b = (qb * per_block).to(tl.int64)  # per_block > 1 only when documents are shared (sd_b == 0)
    q_base, _q_tok0, q_len, q_bad = query_segment(Q, QSEG, q_src, q_in, Lq, n_qseq, n_qrows, sq_n, sq_l, sqs, Q_KIND)
    iq_base = INV_Q
    if NORMS_GIVEN:  # (the inverse norms have the tokens' layout: the same segments, with their own strides)
        iq_base, _iq_tok0, _iq_len, _iq_bad = query_segment(
            INV_Q, QSEG, q_src, q_in, Lq, n_qseq, n_qrows, siq_n, siq_l, sqs, Q_KIND
        )
    q_bad_blk = _slot_sums(q_bad.to(tl.int32), slot, SLOTS, TQ, PACKED) > 0
    r_lo = rs * rows_per_prog
    r_hi = tl.minimum(Lq, r_lo + rows_per_prog)

    if PERSIST:
        # Dense documents: every document has Ld tokens and no bad segment.
        t, row_ok, q_rows, qt = _query_block(
            r_lo, tok, q_in, q_len, r_hi, q_out, QM, sqm_n, sqm_l, q_base, sq_l, dim, BLOCK_K, HAS_QMASK, UPCAST
        )
        n_tiles = tl.cdiv(Ld, BLOCK_N)
        k_lo = kk * docs_per_prog
        n_it = ((tl.minimum(K, k_lo + docs_per_prog) - k_lo) * n_tiles).to(tl.int32)  # int32 tile offsets
        m2 = _fresh_max(BLOCK_M, BLOCK_N, DOC_ROWS)
        a2 = _argmax_slots(BLOCK_M, BLOCK_N, SAVE_ARGMAX)
        any_valid = tl.zeros([BLOCK_N], dtype=tl.int32)
        q_op = _mma_queries(qt, DOC_ROWS)
        q_scale = _query_inv_norms(qt, q_rows, row_ok, dim, BLOCK_K, NUM_K, NORMALIZE, NORMS_GIVEN, UPCAST)
        # STREAM_D: tile it + 2's mask and tile it + 1's tokens in flight during tile it's MMA (of this document
        # or the next ones); a tile past the program's last one has no columns (nothing is read).
        MASK_AHEAD: tl.constexpr = HAS_DMASK and STREAM_D
        dm_row = DM + b * sdm_b + k_lo * sdm_k
        ok = _ahead_ok(dm_row, 0, tl.where(n_it > 0, Ld, 0), sdm_l, BLOCK_N, MASK_AHEAD, MASK_BITS)
        dt = _first_tile(D + b * sd_b + k_lo * sd_k, Ld, sd_l, dim, n_it > 0, BLOCK_N, BLOCK_K, STREAM_D)
        # The walk's position: document k_lo + j, tile offset n0, stepped a tile an iteration. (Derived from `it`,
        # each tile paid a division by n_tiles for itself and each tile ahead: 367 -> 330 instructions a warp a tile.)
        j = k_lo * 0
        n0 = j.to(tl.int32)
        j1, n1 = _next_tile(j, n0, Ld, BLOCK_N)
        ok_next = _ahead_ok(dm_row + j1 * sdm_k, n1, tl.where(n_it > 1, Ld, 0), sdm_l, BLOCK_N, MASK_AHEAD, MASK_BITS)
        if MASK_BITS == 2:
            raw_lo, raw_hi = _raw_flags(dm_row, 0, tl.where(n_it > 0, Ld, 0), sdm_l, BLOCK_N)
        for it in range(0, n_it):
            k = k_lo + j
            j1, n1 = _next_tile(j, n0, Ld, BLOCK_N)
            dt_pre, ok_pre = dt, ok
            if STREAM_D:
                d_next = D + b * sd_b + (k_lo + j1) * sd_k
                dt = _stream_tile(d_next, n1, Ld, sd_l, dim, it + 1 < n_it, BLOCK_N, BLOCK_K)
                ok = ok_next
                j2, n2 = _next_tile(j1, n1, Ld, BLOCK_N)
                ok_next = _ahead_ok(
                    dm_row + j2 * sdm_k, n2, tl.where(it + 2 < n_it, Ld, 0), sdm_l, BLOCK_N, MASK_AHEAD, MASK_BITS
                )
            elif MASK_BITS:  # (the pipelined loop: the next tile's mask bits, as _row_block's)
                dm_next = dm_row + j1 * sdm_k
                n_next = n1
                if MASK_BITS == 1:
                    ok = _tile_bits(dm_next, n_next, tl.where(it + 1 < n_it, Ld, 0), sdm_l, BLOCK_N)
                else:
                    ok_pre = _raw_bits(raw_lo, raw_hi, BLOCK_N)
                    raw_lo, raw_hi = _raw_flags(dm_next, n_next, tl.where(it + 1 < n_it, Ld, 0), sdm_l, BLOCK_N)
            m2, a2, any_valid = _scan_tile(
                q_op, q_rows, row_ok, D + b * sd_b + k * sd_k, DM + b * sdm_b + k * sdm_k,
                INV_D + b * sid_b + k * sid_k, n0, Ld, dim, sd_l, sdm_l, sid_l, m2, a2, any_valid, dt_pre, ok_pre,
                BLOCK_N, BLOCK_K, NUM_K, HAS_DMASK, NORMALIZE, NORMS_GIVEN, SAVE_ARGMAX, DOT_PRECISION, UPCAST,
                EARLY_NORMS, STREAM_D, EVICT_D, DOC_ROWS, MASK_BITS,
            )  # fmt: skip
            if n0 + BLOCK_N >= Ld:  # the document's last tile: its scores, then a fresh running max
                row_val, a, _live = _finish_rows(
                    m2, a2, n0 + BLOCK_N, any_valid, q_scale, iq_base + t * siq_l, row_ok, BLOCK_N, NORMALIZE,
                    NORMS_GIVEN, SAVE_ARGMAX, DOC_ROWS,
                )  # fmt: skip
                if SAVE_ARGMAX:
                    tl.store(ARG + (q_out.to(tl.int64) * K + k) * Lq + t, a, mask=q_in & (t < r_hi))
                score = _slot_sums(row_val, slot, SLOTS, TQ, PACKED)
                score = tl.where(q_bad_blk, float("nan"), score)
                tl.store(OUT + (rs.to(tl.int64) * Nq + q_first) * K + k, score, mask=first_ok)
                m2 = _fresh_max(BLOCK_M, BLOCK_N, DOC_ROWS)
                a2 = _argmax_slots(BLOCK_M, BLOCK_N, SAVE_ARGMAX)
                any_valid = tl.zeros([BLOCK_N], dtype=tl.int32)
            j, n0 = j1, n1
    else:
        d_base, _d_tok0, d_len, d_bad = doc_segment(
            D, DSEG, b, doc, K, Ld, n_dseq, n_drows, sd_b, sd_k, sd_l, sds_b, sds_k, D_KIND
        )
        d_len = d_len.to(tl.int32)  # the tile loop's index feeds the argmax (int32 here)
        dm_doc = DM + b * sdm_b + kk * sdm_k
        inv_doc = INV_D
        if NORMS_GIVEN:
            inv_doc, _id_tok0, _id_len, _id_bad = doc_segment(
                INV_D, DSEG, b, doc, K, Ld, n_dseq, n_drows, sid_b, sid_k, sid_l, sds_b, sds_k, D_KIND
            )

        # A program holds one block of rows_per_prog <= TQ rows (longer queries are split over programs, each
        # writing a partial score). Rows past the longest query of the block are not computed (only their argmax
        # slots are written, below).
        r_end = tl.minimum(r_hi, tl.max(tl.where(q_in, q_len, 0), axis=0))
        if DOC_SPLIT:
            # This program scans tokens [c0, c0 + chunk_len) of the document and leaves each row's max (and where
            # it is, or -1 where the row saw no valid token) to doc_chunks.combine_chunks_kernel.
            c0 = (chunk * chunk_len).to(tl.int32)
            d_base += c0.to(tl.int64) * sd_l
            dm_doc += c0.to(tl.int64) * sdm_l
            inv_doc += c0.to(tl.int64) * sid_l
            t = r_lo + tok
            pv = tl.zeros([BLOCK_M], dtype=tl.float32)
            pa = tl.full([BLOCK_M], -1, dtype=tl.int32)
            if r_lo < r_end:
                t, pv, a, live = _row_block(
                    r_lo, tok, q_in, q_len, r_hi, q_out, QM, sqm_n, sqm_l, q_base, sq_l, iq_base, siq_l, d_base,
                    dm_doc, inv_doc, tl.minimum(tl.maximum(d_len - c0, 0), chunk_len), dim, sd_l, sdm_l, sid_l,
                    TQ, BQ, BLOCK_N, BLOCK_K, NUM_K, HAS_QMASK, HAS_DMASK, NORMALIZE, NORMS_GIVEN, SAVE_ARGMAX,
                    DOT_PRECISION, UPCAST, EARLY_NORMS, STREAM_D, EVICT_D, DOC_ROWS, MASK_BITS,
                )  # fmt: skip
                pa = tl.where(live, a + c0, -1)
            at = ((chunk * Nq + q_out.to(tl.int64)) * K + kk) * Lq + t
            tl.store(ROWS + at, pv, mask=q_in & (t < r_hi))
            tl.store(chunk_tokens(ROWS, (chunk * 0 + n_dsplit) * Nq * K * Lq) + at, pa, mask=q_in & (t < r_hi))
            # The combine adds the rows' sum to this: NaN for an out-of-range segment, as below.
            base = tl.where(q_bad_blk | d_bad, float("nan"), 0.0)
            # (one program per query block and document writes it: the first chunk of the first row block)
            tl.store(OUT + q_first * K + kk, base, mask=first_ok & (q_first < tl.where(chunk + rs == 0, Nq, 0)))
        else:
            score = tl.zeros([SLOTS], dtype=tl.float32)
            # (an if, not a loop over row blocks: a tile loop nested in another one is compiled with the nest's
            # bookkeeping in every tile)
            if r_lo < r_end:
                t, row_val, a, _live = _row_block(
                    r_lo, tok, q_in, q_len, r_hi, q_out, QM, sqm_n, sqm_l, q_base, sq_l, iq_base, siq_l, d_base, dm_doc,
                    inv_doc, d_len, dim, sd_l, sdm_l, sid_l,
                    TQ, BQ, BLOCK_N, BLOCK_K, NUM_K, HAS_QMASK, HAS_DMASK, NORMALIZE, NORMS_GIVEN, SAVE_ARGMAX,
                    DOT_PRECISION, UPCAST, EARLY_NORMS, STREAM_D, EVICT_D, DOC_ROWS, MASK_BITS,
                )  # fmt: skip
                if SAVE_ARGMAX:
                    tl.store(ARG + (q_out.to(tl.int64) * K + kk) * Lq + t, a, mask=q_in & (t < r_hi))
                score += _slot_sums(row_val, slot, SLOTS, TQ, PACKED)
            if SAVE_ARGMAX:
                # Slots past the end of every query of the block: no token, argmax -1.
                t_tail = r_lo + tl.cdiv(tl.maximum(r_end - r_lo, 0), TQ) * TQ
                for t0 in range(t_tail, r_hi, TQ):
                    t = t0 + tok
                    tl.store(
                        ARG + (q_out.to(tl.int64) * K + kk) * Lq + t,
                        tl.full([BLOCK_M], -1, dtype=tl.int32),
                        mask=q_in & (t < r_hi),
                    )

            # Out-of-range offsets, lengths or pair ids poison their scores instead of passing as plausible numbers.
            score = tl.where(q_bad_blk | d_bad, float("nan"), score)
            tl.store(OUT + (rs.to(tl.int64) * Nq + q_first) * K + kk, score, mask=first_ok)
