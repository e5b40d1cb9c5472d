"""A few-op PyTorch path for small ragged problems on the CPU: pair lists and varlen cross products.

A small problem's time on the CPU is the number of PyTorch ops it runs (3-10 µs of host time each on this 2-core
machine, more once a training step's other ops have taken the caches), not its arithmetic. The general path of
:mod:`.cpu_ragged` checks offsets and ids with tensor reductions, regroups a pair list by query and classes lengths:
44 to 72 ops for the forward of 64 pairs (``--quick`` bench shapes), ~45 for its backward. Here the offsets and pair
ids are read back once as Python lists (CPU tensors only: a copy of CPU memory, never a device sync) and checked in
Python, and a pair list is one block ``[P, lq, ld]`` padded to the longest query ``lq`` and document ``ld``: 10 to 25
ops forward, ~20 backward.

* Pair lists' similarities (:func:`_similarities`): where the cross product of every packed query token with every
  packed document token holds no more similarities than the padded block (a pool of documents shared by the pairs),
  that one GEMM (no copy of D), and each pair's ``[lq, ld]`` window of it; else each pair's query and document rows
  gathered, and one batched GEMM. Without the argmax, such a cross product is reduced as segments instead
  (:func:`_pair_scores_by_segments`: no padded block at all).
* Varlen cross products: the GEMM of every packed token, each document's max as a segment of its columns without the
  argmax (:func:`_cross_scores_by_segments`), with it each document's window padded to the longest document
  (:func:`_cross_forward`, documents of up to :data:`CROSS_FORWARD_MEAN_LD` tokens on average; longer ones take the
  packed path, :func:`maxsim.cpu_ragged._packed_cross`).
* The scores are the same bitwise with or without the argmax (the same GEMM, exact maxima, the same sums).
* The padded blocks are masked as in :func:`maxsim.cpu.forward`: document tokens past the end ``-inf``, query tokens
  past the end (and those of a pair whose document has no token) add 0 and choose -1; NaN among a pair's real tokens
  propagates; ties go to the lowest index (``torch.max``).
* Backward (:func:`backward`, pair lists and varlen cross products): the chosen links, either as two products with a
  dense ``[rows_q, rows_d]`` matrix of their weights (few weights a link, :data:`PRODUCTS_PER_LINK`, and every token
  of the scored rows finite: a product multiplies every token, and 0 · inf is NaN) or row by row, in link order,
  through :func:`maxsim.cpu.add_links`.
* A varlen training step whose caller does not read the argmax (:func:`cross_forward_for_step`,
  :func:`cross_backward_for_step`): the forward keeps each packed query row's choices ``[rows_q, Nd]`` and the sum
  of its similarities instead of building the argmax grid, and the backward scatters the weights straight into the
  products' matrix (``--quick`` varlen step on this 2-core CPU: 476 -> 315 µs, eager 355).

Anything else (another device, an offset, length or id out of range, which the checked path scores NaN, or a
problem above the bounds below) returns None and takes the general path.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from . import cpu
from .layout import Ragged, accum_dtype

MAX_PAIR_SIMS = 1 << 18
"""Padded similarities ``P·max_q·max_d`` up to which a pair list on the CPU takes this path. This 2-core CPU, fp32,
dim 128, pairs shuffled, against the general path (min of 3 interleaved rounds; inference / training step): every
query with its own documents, ``P x Lq x Ld`` = 64 x 8 x 32 (16K similarities) 130 / 453 against 231 / 636 µs,
256 x 16 x 32 (131K) 0.47 / 2.3 against 0.92 / 3.3 ms, 512 x 16 x 64 (524K) 2.2 / 7.6 against 3.9 / 10.4 ms; 1M:
either way (512 x 32 x 64: 3.4 against 4.9 ms; 1024 x 32 x 32: 5.8 against 3.8), 2M: 1.2-3x slower in inference;
skewed documents from a shared pool, 256 x 15 x 240 (922K) 2.9 / 4.6 against 10.2 / 12.9 ms, 2M: 1.4x slower."""

MAX_CROSS_SIMS = 1 << 16
"""Padded similarities ``Nq·Nd·max_q·max_d`` up to which the backward of a varlen cross product on the CPU takes this
path (its links in one block; the general path adds them in cache-sized blocks). Training step, skewed lengths,
fp32, dim 128, against the general path's backward: 10K similarities 461 against 515 µs, 45K 558 against 596,
129K-451K 0.98-1.00x, 2M 2.2x slower."""

PRODUCTS_PER_LINK = 48
"""Weights per link (``rows_q·rows_d`` over the links that chose a token) up to which the backward adds its links as
two products with a dense matrix of their weights (:func:`_products_pay`), else row by row. Either way it is a few
ops; the products stream every token once, where each link gathers and adds a row. This 2-core CPU, fp32, dim 128,
training step (interleaved, medians), links -> products: varlen 16 x 16 of Lq / Ld 2..16 1.91 -> 1.30 ms (about 9
weights a link), fixed 4 x 64 of 16 / 16 2.58 -> 1.70 (16); pair lists of 32 x 32 from a pool of 128 (16 / 16, 36
weights a link) 6.9 -> 5.0 ms; 4 x 16 from a pool of 32 documents of 15..125 tokens (140) 1.15 -> 1.35 ms, 16 x 16
from 64 of 8..64 (144) 3.42 -> 3.72."""

CROSS_FORWARD_MEAN_LD = 32
"""Mean document length up to which a varlen cross product's forward with the argmax takes :func:`_cross_forward`
(every document padded to the longest in one block), else the packed path's segment reductions
(:func:`maxsim.cpu_ragged._packed_cross`); the scores alone always take the latter (fewer ops). This 2-core CPU,
fp32, dim 128, training step with the products backward, packed -> padded forward: 4 x 16 of Lq 1..8, Ld 5..40
0.96 -> 0.89 ms, 4 x 32 of 2..16 / 4..32 1.36 -> 1.29, 16 x 16 of 2..16 / 2..16 1.54 -> 1.31; Ld 15..125 (mean ~70)
1.51 -> 1.69."""

MAX_VALUES = 1 << 13
"""Offsets and pair ids (``Nq + Nd + P``) up to which they are read back as lists here (a large pool of documents
with few pairs: reading every offset would cost more than the ops saved)."""


class _Plan(NamedTuple):
    """A checked small problem: packed rows, the longest query and document, and which masks and clamps it needs."""

    rows_q: int
    rows_d: int
    lq: int  # longest query: the block's width (at most max_seqlen_q)
    ld: int  # longest document
    q_short: bool  # some query shorter than lq: its padding rows are masked
    d_short: bool  # some document shorter than ld: its padding columns are masked
    d_empty: bool  # some document without tokens: its pairs' rows score 0 and choose nothing
    q_fits: bool  # every query's first lq rows lie within Q (a window view of Q needs no clamp)
    d_fits: bool  # every document's first ld rows lie within D
    cross: bool  # the similarities come from the cross product of every packed token (:func:`_similarities`)
    q_rows: tuple[int, int]  # the first and last offset of the queries
    d_rows: tuple[int, int]  # the first and last offset of the documents


def plan(Q: Tensor, D: Tensor, rg: Ragged) -> _Plan | None:
    """The plan of packed ``Q [rows_q, dim]`` and ``D [rows_d, dim]`` with offsets (and a pair list) ``rg``, or None
    when this path does not apply: a tensor off the CPU (reading values there would sync), a dense side, a problem
    above :data:`MAX_PAIR_SIMS` / :data:`MAX_CROSS_SIMS` (by the given maxima) or :data:`MAX_VALUES`, nothing to
    score, or an offset, length or pair id out of range (the checked path scores those NaN)."""
    if Q.dim() != 2 or D.dim() != 2 or rg.q_seg is None or rg.d_seg is None:
        return None
    pairs = rg.pair_q is not None
    tensors = (Q, D, rg.q_seg, rg.d_seg, *((rg.pair_q, rg.pair_d) if pairs else ()))
    if not all(t.is_cpu for t in tensors):
        return None
    n_q, n_d = rg.q_seg.shape[0] - 1, rg.d_seg.shape[0] - 1
    grid = rg.pair_q.shape[0] if pairs else n_q * n_d
    if grid == 0 or n_q == 0 or n_d == 0 or n_q + n_d + (grid if pairs else 0) > MAX_VALUES:
        return None  # (nothing to score, or pair ids that cannot be in range: the checked path)
    if grid * max(rg.max_q, 1) * max(rg.max_d, 1) > (MAX_PAIR_SIMS if pairs else MAX_CROSS_SIMS):
        return None
    # Python lists, not tensor reductions: each op costs more than these few hundred values in Python.
    q_off, d_off = rg.q_seg.tolist(), rg.d_seg.tolist()  # (CPU values, checked above: no sync)
    (q_lo, lq), (d_lo, ld) = _shortest_longest(q_off), _shortest_longest(d_off)
    rows_q, rows_d = Q.shape[0], D.shape[0]
    if min(q_off[0], d_off[0], q_lo, d_lo) < 0 or q_off[-1] > rows_q or d_off[-1] > rows_d:
        return None
    if lq > rg.max_q or ld > rg.max_d:
        return None
    if pairs:
        pq, pd = rg.pair_q.tolist(), rg.pair_d.tolist()  # (CPU values: no sync)
        if min(pq) < 0 or min(pd) < 0 or max(pq) >= n_q or max(pd) >= n_d:
            return None
    cross = _cross_product_pays(rows_q, rows_d, grid * lq * ld)
    return _Plan(
        rows_q, rows_d, lq, ld, q_lo < lq, d_lo < ld, d_lo == 0, q_off[-2] + lq <= rows_q, d_off[-2] + ld <= rows_d,
        cross, (q_off[0], q_off[-1]), (d_off[0], d_off[-1]),
    )  # fmt: skip


def _cross_product_pays(rows_q: int, rows_d: int, padded: int) -> bool:
    """Whether the similarities come from the cross product of every packed token (``rows_q·rows_d`` of them): where
    it holds no more than the padded block (``padded``), that one GEMM and a gather beat gathering the rows of each
    pair (a copy of ``[P, ld, dim]``) and a batched GEMM. (A function: the tests force either choice.)"""
    return rows_q * rows_d <= padded


def _shortest_longest(offsets: list[int]) -> tuple[int, int]:
    """The shortest and the longest segment of ``offsets`` (``N + 1 >= 2`` entries; negative: decreasing)."""
    lengths = list(map(operator.sub, offsets[1:], offsets[:-1]))
    return min(lengths), max(lengths)


# ----------------------------------------------------------------------------------------------------
# forward


class _Pairs(NamedTuple):
    """Each pair's query and document as first packed row and length (``[P]`` each; lengths None where the plan
    needs no mask)."""

    q_start: Tensor
    d_start: Tensor | None  # (None: not needed, see :func:`_pairs`)
    q_len: Tensor | None
    d_len: Tensor | None


def _pairs(rg: Ragged, p: _Plan, documents: bool = True) -> _Pairs:
    """The pairs' rows and lengths; without ``documents``, the documents' lengths only where one is empty (their
    first rows are not needed: :func:`_pair_scores_by_segments`)."""
    pq, pd = rg.pair_q, rg.pair_d
    q_start = rg.q_seg[:-1].index_select(0, pq)
    q_len = rg.q_seg.diff().index_select(0, pq) if p.q_short else None
    d_start = rg.d_seg[:-1].index_select(0, pd) if documents else None
    d_len = rg.d_seg.diff().index_select(0, pd) if p.d_short and (documents or p.d_empty) else None
    return _Pairs(q_start, d_start, q_len, d_len)


def forward(Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged) -> tuple[Tensor, Tensor] | None:
    """As :func:`maxsim.cpu_ragged.forward`: for a pair list, scores ``[1, P]`` (fp32, fp64 for fp64 inputs) and, if
    asked, the argmax ``[1, P, max_q]`` int32 (else ``[0]``); for a varlen cross product, ``[Nq, Nd]`` and
    ``[Nq, Nd, max_q]``. None where this path does not apply (:func:`plan`)."""
    p = plan(Q, D, rg)
    if p is None:
        return None
    grid = (1, rg.pair_q.shape[0]) if rg.pair_q is not None else (rg.q_seg.shape[0] - 1, rg.d_seg.shape[0] - 1)
    if p.lq == 0 or p.ld == 0:  # no query or no document token anywhere: every score 0, nothing chosen
        scores = torch.zeros(grid, dtype=accum_dtype(Q.dtype))
        return scores, torch.full((*grid, rg.max_q) if need_argmax else (0,), -1, dtype=torch.int32)
    if rg.pair_q is None:
        if not need_argmax:
            return _cross_scores_by_segments(Q, D, normalize, rg, p), torch.empty((0,), dtype=torch.int32)
        if p.d_rows[1] - p.d_rows[0] > CROSS_FORWARD_MEAN_LD * grid[1]:
            return None
        return _cross_forward(Q, D, normalize, need_argmax, rg, p)
    P = rg.pair_q.shape[0]
    if p.cross and not need_argmax:
        g = _pairs(rg, p, documents=False)
        return _pair_scores_by_segments(Q, D, normalize, p, g, rg).view(1, P), torch.empty((0,), dtype=torch.int32)
    g = _pairs(rg, p)
    sim = _similarities(Q, D, normalize, p, g)
    scores, argmax = _reduce(sim, p, g, need_argmax)
    if need_argmax:
        if p.lq < rg.max_q:  # the argmax is max_q wide: no query token there
            argmax = torch.nn.functional.pad(argmax, (0, rg.max_q - p.lq), value=-1)
        argmax = argmax.view(1, P, rg.max_q)
    return scores.view(1, P), argmax


def _cross_scores_by_segments(Q: Tensor, D: Tensor, normalize: bool, rg: Ragged, p: _Plan) -> Tensor:
    """The scores ``[Nq, Nd]`` of a varlen cross product without the argmax: the GEMM of every packed token (real
    similarities only), each document's max as a segment of its columns, each query's sum as a segment of rows
    (a document without tokens adds 0; a query without tokens scores 0)."""
    acc = accum_dtype(Q.dtype)
    (q0, q1), (d0, d1) = p.q_rows, p.d_rows
    Qa, Da = cpu._as(Q[q0:q1], acc), cpu._as(D[d0:d1], acc)
    if normalize:
        Qa, Da = Qa * cpu._inv_norm(Qa)[:, None], Da * cpu._inv_norm(Da)[:, None]
    d_len = rg.d_seg.diff()
    best = torch.segment_reduce(Qa @ Da.T, "max", lengths=d_len.expand(q1 - q0, -1), axis=1, unsafe=True)
    if p.d_empty:  # (-inf there)
        best = torch.where(d_len > 0, best, 0.0)
    return torch.segment_reduce(best, "sum", lengths=rg.q_seg.diff(), axis=0, unsafe=True)


def _cross_forward(
    Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged, p: _Plan
) -> tuple[Tensor, Tensor]:
    """A varlen cross product: scores ``[Nq, Nd]`` and, if asked, the argmax ``[Nq, Nd, max_q]`` int32 (else ``[0]``)
    (:func:`_cross_maxima`, its argmax put into the grid of query tokens)."""
    scores, arg, q_len, _d_start, _sims_sum = _cross_maxima(Q, D, normalize, need_argmax, rg, p)
    if arg is None:
        return scores, torch.empty((0,), dtype=torch.int32)
    return scores, _argmax_grid(arg, q_len, rg, p)


def _cross_maxima(
    Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged, p: _Plan, keep_sum: bool = False
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor | None]:
    """A varlen cross product's scores ``[Nq, Nd]``, and ``arg [rows_q, Nd]`` int64 (None unless ``need_argmax``):
    the token each packed query row chose in each document, as an offset into it (-1 for a document without
    tokens). Also the query lengths ``[Nq]``, each document's first column ``[Nd]`` (relative to its first
    row) and, with ``keep_sum``, the sum of every similarity (a 0-d tensor; else None).

    One GEMM of every packed query token against every packed document token (``[rows_q, rows_d]``: the real
    similarities, no padding of the queries), then each document's window of its columns, padded to the longest
    document (``[rows_q, Nd, ld]``; -inf past a document's end), its max over the tokens, and a segment sum over
    each query's rows. A document without tokens adds 0 and chooses -1; ties go to the lowest token and NaN
    propagates (``torch.max``); a query without tokens scores 0 (an empty segment)."""
    acc = accum_dtype(Q.dtype)
    (q0, q1), (d0, d1) = p.q_rows, p.d_rows
    rq, rd = q1 - q0, d1 - d0
    Qa, Da = cpu._as(Q[q0:q1], acc), cpu._as(D[d0:d1], acc)
    if normalize:
        Qa, Da = Qa * cpu._inv_norm(Qa)[:, None], Da * cpu._inv_norm(Da)[:, None]
    # (slack after the product: a window may run past its row, the last row's into the slack; those columns are
    # masked. Windows start at columns 0..rd: an empty document at the end starts at rd.)
    buf = torch.empty(rq * rd + p.ld, dtype=acc)
    torch.mm(Qa, Da.T, out=buf[: rq * rd].view(rq, rd))
    # (finite exactly when every scored token is: see maxsim.cpu.forward_for_step; read while the product is warm)
    sims_sum = buf[: rq * rd].sum() if keep_sum else None
    d_start = rg.d_seg[:-1] if d0 == 0 else rg.d_seg[:-1] - d0
    sim = buf.as_strided((rq, rd + 1, p.ld), (rd, 1, 1)).index_select(1, d_start)  # [rows_q, Nd, ld]
    d_len = rg.d_seg.diff() if p.d_short else None
    if d_len is not None:
        sim.masked_fill_(torch.arange(p.ld) >= d_len[:, None], float("-inf"))
    best, arg = sim.max(dim=-1) if need_argmax else (sim.amax(dim=-1), None)  # [rows_q, Nd]
    if p.d_empty:  # (an empty document is a short one: d_len is known)
        has_tokens = d_len > 0
        best = torch.where(has_tokens, best, 0.0)
        if arg is not None:
            arg.masked_fill_(~has_tokens, -1)
    q_len = rg.q_seg.diff()
    scores = torch.segment_reduce(best, "sum", lengths=q_len, axis=0, unsafe=True)  # [Nq, Nd]
    return scores, arg, q_len, d_start, sims_sum


def _argmax_grid(arg: Tensor, q_len: Tensor, rg: Ragged, p: _Plan) -> Tensor:
    """:func:`_cross_maxima`'s ``arg [rows_q, Nd]`` as the argmax ``[Nq, Nd, max_q]`` int32 (-1 past a query's
    end): each packed query row's slot (query, token) of the ``[Nq, max_q, Nd]`` grid."""
    (q0, q1), n_q, n_d = p.q_rows, rg.q_seg.shape[0] - 1, arg.shape[1]
    rq = q1 - q0
    q_of_row = torch.repeat_interleave(torch.arange(n_q), q_len, output_size=rq)
    q_start = rg.q_seg[:-1] if q0 == 0 else rg.q_seg[:-1] - q0
    slot = torch.arange(rq).add_(q_of_row, alpha=rg.max_q).sub_(q_start.index_select(0, q_of_row))
    grid = torch.full((n_q * rg.max_q, n_d), -1, dtype=arg.dtype).index_copy_(0, slot, arg)
    return grid.view(n_q, rg.max_q, n_d).transpose(1, 2).to(torch.int32, memory_format=torch.contiguous_format)


class CrossStep(NamedTuple):
    """What a varlen cross product's training forward keeps for its backward (:func:`cross_forward_for_step`)."""

    plan: _Plan
    arg: Tensor  # [rows_q, Nd] int64: each packed query row's chosen token in each document (an offset into it)
    q_len: Tensor  # [Nq]
    d_start: Tensor  # [Nd]: each document's first column of the [rows_q, rows_d] product
    sims_sum: Tensor  # 0-d: finite exactly when every scored token is


def cross_forward_for_step(Q: Tensor, D: Tensor, normalize: bool, rg: Ragged) -> tuple[Tensor, CrossStep] | None:
    """The forward of a training step of a small varlen cross product on the CPU whose caller does not read the
    argmax: the scores ``[Nq, Nd]`` and what :func:`cross_backward_for_step` needs, without the argmax grid the
    public layout would take (a few ops on each side of the step). Taken where :func:`forward` takes
    :func:`_cross_forward` and the backward's products pay, with every document holding tokens (each packed query
    row then chooses one token in each document); else None, and the caller takes :func:`forward`."""
    if rg.pair_q is not None:
        return None
    p = plan(Q, D, rg)
    if p is None or p.lq == 0 or p.ld == 0 or p.d_empty:
        return None
    (q0, q1), (d0, d1), n_d = p.q_rows, p.d_rows, rg.d_seg.shape[0] - 1
    if d1 - d0 > CROSS_FORWARD_MEAN_LD * n_d or not _products_pay(q1 - q0, d1 - d0, (q1 - q0) * n_d):
        return None
    scores, arg, q_len, d_start, sims_sum = _cross_maxima(Q, D, normalize, True, rg, p, keep_sum=True)
    return scores, CrossStep(p, arg, q_len, d_start, sims_sum)


def _pair_scores_by_segments(Q: Tensor, D: Tensor, normalize: bool, p: _Plan, g: _Pairs, rg: Ragged) -> Tensor:
    """Scores ``[P]`` of a pair list without the argmax, from the cross product of every packed token: the max over
    each document's tokens for every query token (a segment reduction of ``Q·Dᵀ``, ``[rows_q, Nd]``: the padded
    block's per-element passes run over the real similarities only), then each pair's query tokens picked from it
    and summed. A document without tokens has a max of -inf there: its pairs' tokens add 0 instead, as a query
    token past its query's end does."""
    acc = accum_dtype(Q.dtype)
    d0, d1 = p.d_rows  # (the documents tile D's rows d0..d1: a segment reduction's columns)
    Qa, Da = cpu._as(Q, acc), cpu._as(D[d0:d1], acc)
    if normalize:
        Qa, Da = Qa * cpu._inv_norm(Qa)[:, None], Da * cpu._inv_norm(Da)[:, None]
    lengths = rg.d_seg.diff()
    best = torch.segment_reduce(Qa @ Da.T, "max", lengths=lengths.expand(p.rows_q, -1), axis=1, unsafe=True)
    t = torch.arange(p.lq)
    rows = g.q_start[:, None] + t  # [P, lq]: each pair's query tokens
    if not p.q_fits:
        rows = rows.clamp_(max=p.rows_q - 1)  # (past the end: masked below)
    best = best.view(-1).index_select(0, torch.add(rg.pair_d[:, None], rows, alpha=lengths.shape[0]).view(-1))
    best = best.view(rows.shape)
    valid = None
    if g.q_len is not None:
        valid = t < g.q_len[:, None]
    if p.d_empty:
        has_tokens = (g.d_len > 0)[:, None]
        valid = has_tokens if valid is None else valid & has_tokens
    if valid is not None:
        best = torch.where(valid, best, 0.0)
    return best.sum(dim=-1)


def _similarities(Q: Tensor, D: Tensor, normalize: bool, p: _Plan, g: _Pairs) -> Tensor:
    """The padded similarities ``[P, lq, ld]`` in the accumulation dtype: query token ``i`` of each pair's query
    against document token ``j`` of its document (rows past a sequence's end: whatever follows it, to be masked).

    Where the cross product of every packed token holds no more similarities than the padded pairs (``p.cross``):
    that GEMM, and each pair's window ``[lq, ld]`` of it. Else each pair's rows gathered (``[P, lq, dim]`` and
    ``[P, ld, dim]``) and one batched GEMM."""
    if p.cross:
        return _cross_windows(Q, D, normalize, p, g).view(-1, p.lq, p.ld)
    acc = accum_dtype(Q.dtype)
    Qp, Dp = _slabs(Q, g.q_start, p.lq, p.q_fits), _slabs(D, g.d_start, p.ld, p.d_fits)
    Qp, Dp = cpu._as(Qp, acc), cpu._as(Dp, acc)
    if normalize:
        Qp, Dp = Qp * cpu._inv_norm(Qp)[..., None], Dp * cpu._inv_norm(Dp)[..., None]
    return torch.bmm(Qp, Dp.transpose(1, 2))


def _cross_windows(Q: Tensor, D: Tensor, normalize: bool, p: _Plan, g: _Pairs) -> Tensor:
    """``S = Q·Dᵀ [rows_q, rows_d]`` of every packed token, in a buffer with zeroed slack after it, and for each pair
    the window ``S[q_start + i, d_start + j]``, ``i < lq, j < ld`` (``[P, lq, ld]``): a gather of rows of a view
    whose first index is a window's first element in the flat buffer. A window that runs past a row of S reads the
    next row (padding, masked); the slack covers the windows of sequences that start at the very end of their rows,
    so no index is clamped."""
    acc = accum_dtype(Q.dtype)
    Qa, Da = cpu._as(Q, acc), cpu._as(D, acc)
    if normalize:
        Qa, Da = Qa * cpu._inv_norm(Qa)[:, None], Da * cpu._inv_norm(Da)[:, None]
    n = p.rows_q * p.rows_d
    # windows start at most at q_start·rows_d + d_start <= n + rows_d and span (lq - 1)·rows_d + ld elements
    buf = torch.empty(n + (p.lq + 1) * p.rows_d + p.ld, dtype=acc)
    torch.mm(Qa, Da.T, out=buf[:n].view(p.rows_q, p.rows_d))
    buf[n:].zero_()
    windows = buf.as_strided((n + p.rows_d + 1, p.lq, p.ld), (1, p.rows_d, 1))
    start = torch.add(g.d_start, g.q_start, alpha=p.rows_d)  # flat index of each window's first element
    return windows.index_select(0, start)


def _slabs(x: Tensor, start: Tensor, width: int, fits: bool) -> Tensor:
    """Rows ``start[p] .. start[p] + width`` of ``x [rows, dim]`` -> ``[P, width, dim]``: whole slabs of an
    overlapping view where every slab lies within ``x``, else row by row, clamped to the last row (padding)."""
    if fits:
        rows, dim = x.shape
        windows = x.as_strided((rows - width + 1, width, dim), (x.stride(0), x.stride(0), x.stride(1)))
        return windows.index_select(0, start)
    idx = (start[:, None] + torch.arange(width)).clamp_(max=x.shape[0] - 1)
    return x.index_select(0, idx.view(-1)).view(start.shape[0], width, x.shape[1])


def _reduce(sim: Tensor, p: _Plan, g: _Pairs, need_argmax: bool) -> tuple[Tensor, Tensor]:
    """Masked row maxima of ``sim [P, lq, ld]`` summed over the query tokens: ``(scores [P], argmax [P, lq] int32 or
    [0])``. Document tokens past their end are ``-inf``; a query token past its end, or of a pair whose document has
    no token, adds 0 and chooses -1 (``torch.where``, not a product: its max may be -inf or NaN)."""
    t = torch.arange(max(p.lq, p.ld))
    if g.d_len is not None:
        sim.masked_fill_((t[: p.ld] >= g.d_len[:, None]).unsqueeze(1), float("-inf"))
    best, arg = sim.max(dim=-1) if need_argmax else (sim.amax(dim=-1), None)  # ties: lowest index; NaN propagates
    valid = None  # [P, lq]: query tokens that count
    if g.q_len is not None:
        valid = t[: p.lq] < g.q_len[:, None]
    if p.d_empty:
        has_tokens = (g.d_len > 0)[:, None]  # (d_len is known: an empty document is a short one)
        valid = has_tokens if valid is None else valid & has_tokens
    if valid is not None:
        best = torch.where(valid, best, 0.0)
    scores = best.sum(dim=-1)
    if not need_argmax:
        return scores, torch.empty((0,), dtype=torch.int32)
    if valid is not None:
        arg = torch.where(valid, arg, -1)
    return scores, arg.to(torch.int32)


# ----------------------------------------------------------------------------------------------------
# backward


def backward(
    grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, normalize: bool, rg: Ragged
) -> tuple[Tensor, Tensor] | None:
    """As :func:`maxsim.cpu_ragged.backward` (gradients in Q's and D's packed layout), or None where this path does
    not apply (:func:`plan`). The links that chose a token (query token ``i`` of a score's query chose document token
    ``argmax[..., i]`` of its document), in link order, go to :func:`maxsim.cpu.add_links` (only chosen rows are
    read: a masked token holding NaN or inf never reaches a gradient; ``index_add_`` adds in order on the CPU:
    deterministic). With offsets and ids checked, a chosen link's rows lie within Q and D: no clamp."""
    p = plan(Q, D, rg)
    if p is None:
        return None
    return _gradients(Q, D, normalize, lambda Qa, Da: _link_gradients(grad, Qa, Da, argmax, rg, p))


def _link_gradients(
    grad: Tensor, Qa: Tensor, Da: Tensor, argmax: Tensor, rg: Ragged, p: _Plan
) -> tuple[Tensor, Tensor]:
    """:func:`backward`'s gradients of the tokens ``Qa``, ``Da`` (accumulation dtype; normalized if asked)."""
    width = argmax.shape[-1]
    if not (p.lq and p.ld and width):
        return torch.zeros_like(Qa), torch.zeros_like(Da)
    links = argmax.reshape(-1)
    chosen = (links >= 0).nonzero().squeeze(1)
    score = torch.div(chosen, width, rounding_mode="floor")  # flat index of the link's score
    if rg.pair_q is None:  # score = query · Nd + document
        n_d = rg.d_seg.shape[0] - 1
        q, d = torch.div(score, n_d, rounding_mode="floor"), score % n_d
    else:
        q, d = rg.pair_q.index_select(0, score), rg.pair_d.index_select(0, score)
    rows_q = rg.q_seg.index_select(0, q) + (chosen - score * width)
    rows_d = rg.d_seg.index_select(0, d) + links.index_select(0, chosen)
    w = cpu._as(grad, Qa.dtype).reshape(-1).index_select(0, score)
    (q0, q1), (d0, d1) = p.q_rows, p.d_rows
    if _products_pay(q1 - q0, d1 - d0, chosen.shape[0]) and cpu.all_finite(Qa[q0:q1], Da[d0:d1]):
        weights = torch.zeros((q1 - q0, d1 - d0), dtype=Qa.dtype)
        weights.index_put_((rows_q - q0 if q0 else rows_q, rows_d - d0 if d0 else rows_d), w, accumulate=True)
        return _products(weights, Qa, Da, p)
    dQ, dD = torch.zeros_like(Qa), torch.zeros_like(Da)
    cpu.add_links(dQ, dD, Qa, Da, rows_q, rows_d, w)
    return dQ, dD


def cross_backward_for_step(
    grad: Tensor, Q: Tensor, D: Tensor, normalize: bool, rg: Ragged, step: CrossStep
) -> tuple[Tensor, Tensor]:
    """The backward after :func:`cross_forward_for_step`: as :func:`backward` (the same weights, products and
    gradients, bitwise), the weights put straight into their ``[rows_q, rows_d]`` matrix from the kept choices
    (row ``r``, column ``d_start[d] + arg[r, d]``: one per document in each row, so no two land on one entry). Where
    some scored token is not finite (the kept sum, a CPU scalar read: not a sync), the links row by row."""
    p = step.plan
    if not math.isfinite(float(step.sims_sum)):
        return backward(grad, Q, D, _argmax_grid(step.arg, step.q_len, rg, p), normalize, rg)

    def products(Qa: Tensor, Da: Tensor) -> tuple[Tensor, Tensor]:
        (q0, q1), (d0, d1) = p.q_rows, p.d_rows
        w = torch.repeat_interleave(cpu._as(grad, Qa.dtype), step.q_len, dim=0, output_size=q1 - q0)  # [rows_q, Nd]
        weights = torch.zeros((q1 - q0, d1 - d0), dtype=Qa.dtype).scatter_(1, step.arg + step.d_start, w)
        return _products(weights, Qa, Da, p)

    return _gradients(Q, D, normalize, products)


def _gradients(
    Q: Tensor, D: Tensor, normalize: bool, of_tokens: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
) -> tuple[Tensor, Tensor]:
    """``(dQ, dD)`` in Q's and D's dtypes from ``of_tokens(Qa, Da)``, the gradients of the tokens in the accumulation
    dtype (normalized with ``normalize``: then projected back through the normalization)."""
    acc = accum_dtype(Q.dtype)
    Qa, Da = cpu._as(Q, acc), cpu._as(D, acc)
    if normalize:
        norm_q, norm_d = torch.linalg.vector_norm(Qa, dim=-1), torch.linalg.vector_norm(Da, dim=-1)
        Qa, Da = Qa * cpu._inv_norm(Qa)[:, None], Da * cpu._inv_norm(Da)[:, None]
    dQ, dD = of_tokens(Qa, Da)
    if normalize:
        dQ, dD = cpu.project_normalized_grad(dQ, Qa, norm_q), cpu.project_normalized_grad(dD, Da, norm_d)
    return cpu._as(dQ, Q.dtype), cpu._as(dD, D.dtype)


def _products(weights: Tensor, Qa: Tensor, Da: Tensor, p: _Plan) -> tuple[Tensor, Tensor]:
    """``dQ = weights·D`` and ``dD = weightsᵀ·Q`` over the scored rows, as gradients of all of ``Qa`` and ``Da``
    (zero outside those rows)."""
    (q0, q1), (d0, d1) = p.q_rows, p.d_rows
    dQ = _rows_of(weights @ Da[d0:d1], q0, Qa.shape[0])
    dD = _rows_of(weights.T @ Qa[q0:q1], d0, Da.shape[0])
    return dQ, dD


def _products_pay(rows_q: int, rows_d: int, n_links: int) -> bool:
    """Whether the backward adds its links as two products with a dense ``[rows_q, rows_d]`` matrix of their weights
    (one GEMM each for dQ and dD, no zero-filled gradient to add rows into) rather than row by row
    (:func:`maxsim.cpu.add_links`). (A function: the tests force either choice.)"""
    return rows_q * rows_d <= PRODUCTS_PER_LINK * n_links


def _rows_of(g: Tensor, first: int, rows: int) -> Tensor:
    """``g [n, dim]`` as rows ``first .. first + n`` of a ``[rows, dim]`` gradient, zero elsewhere."""
    if first == 0 and g.shape[0] == rows:
        return g
    out = g.new_zeros((rows, g.shape[1]))
    out[first : first + g.shape[0]] = g
    return out
