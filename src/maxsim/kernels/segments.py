"""Where a query's or a document's tokens live: the one place the kernels learn a layout.

Every layout is a set of (query segment, document segment) pairs (design.md §2). A segment is described by a
compile-time kind and runtime data:

* ``DENSE``: token ``t`` of sequence ``i`` at ``base + i * stride_seq + t * stride_tok``, all of length ``L``;
* ``OFFSETS``: packed rows, flash-attn style ``cu_seqlens`` — sequence ``i`` is rows ``[cu[i], cu[i + 1])``;
* ``LENGTHS``: dense storage, but sequence ``i`` holds only its first ``lengths[i]`` tokens.

Offsets and lengths are clamped into the tensor they index, so unvalidated values can never make a kernel read or
write outside its inputs; a segment whose values were out of range is reported as ``bad`` and its scores become NaN
(never a plausible-looking wrong number).
"""

from __future__ import annotations

import triton
import triton.language as tl

DENSE: tl.constexpr = tl.constexpr(0)
OFFSETS: tl.constexpr = tl.constexpr(1)
LENGTHS: tl.constexpr = tl.constexpr(2)


@triton.jit
def packed_segment(SEG, i, n_seqs, n_rows, max_len, ok):
    """``(first row, length, bad)`` of packed sequence ``i`` (int64), from offsets ``SEG [n_seqs + 1]``; a
    sequence longer than the caller's ``max_len`` is bad too (the kernels size their work by it)."""
    i_ok = ok & (i >= 0) & (i < n_seqs)
    s0 = tl.load(SEG + i, mask=i_ok, other=0).to(tl.int64)
    s1 = tl.load(SEG + i + 1, mask=i_ok, other=0).to(tl.int64)
    bad = ok & ((i < 0) | (i >= n_seqs) | (s0 < 0) | (s1 < s0) | (s1 > n_rows) | (s1 - s0 > max_len))
    s0 = tl.minimum(tl.maximum(s0, 0), n_rows)
    s1 = tl.minimum(tl.maximum(s1, s0), n_rows)
    return s0, s1 - s0, bad


@triton.jit
def padded_length(LEN, offset, limit, ok):
    """``(length, bad)`` of a sequence stored padded to ``limit`` tokens, from a lengths tensor."""
    n = tl.load(LEN + offset, mask=ok, other=0).to(tl.int64)
    bad = ok & ((n < 0) | (n > limit))
    return tl.minimum(tl.maximum(n, 0), limit), bad


@triton.jit
def query_segment(Q, QSEG, q, ok, Lq, n_seqs, n_rows, sq_n, sq_l, sqs, KIND: tl.constexpr):
    """For query ``q`` (int64, scalar or vector): ``(pointer to token 0, row of token 0 in per-token arrays,
    length, bad)``. Per-token arrays (inverse norms) are ``[n_rows]`` for packed queries, ``[Nq, Lq]`` otherwise."""
    if KIND == OFFSETS:
        s0, n, bad = packed_segment(QSEG, q, n_seqs, n_rows, Lq, ok)
        return Q + s0 * sq_l, s0, n, bad
    else:
        zero = q * 0
        if KIND == LENGTHS:
            n, bad = padded_length(QSEG, q * sqs, Lq, ok)
        else:
            n = zero + Lq
            bad = zero != 0
        return Q + q * sq_n, q * Lq, n, bad


@triton.jit
def doc_segment(D, DSEG, b, k, K, Ld, n_seqs, n_rows, sd_b, sd_k, sd_l, sds_b, sds_k, KIND: tl.constexpr):
    """For document ``k`` of batch row ``b`` (``b`` = 0 when documents are shared or packed): ``(pointer to token 0,
    row of token 0 in per-token arrays, length, bad)``. Per-token arrays are ``[n_rows]`` for packed documents,
    ``[Bd, K, Ld]`` otherwise."""
    if KIND == OFFSETS:
        s0, n, bad = packed_segment(DSEG, k, n_seqs, n_rows, Ld, k >= 0)
        return D + s0 * sd_l, s0, n, bad
    else:
        if KIND == LENGTHS:
            n, bad = padded_length(DSEG, b * sds_b + k * sds_k, Ld, k >= 0)
        else:
            n = k * 0 + Ld
            bad = k < 0
        return D + b * sd_b + k * sd_k, (b * K + k) * Ld, n, bad
