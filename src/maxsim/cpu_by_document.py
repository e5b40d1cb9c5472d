"""Pair lists on the CPU grouped by document, where every document has one length and as many pairs as the others.

The other pair-list paths gather each pair's document rows (``[P, ld, dim]``: as large as ``D`` itself when each
document is listed once) and read them back for the GEMM. Here the pairs are sorted by document instead, so the
documents are read where they lie: with documents of one length ``ld`` packed back to back (fixed-length tokens,
such as ColPali's page patches) ``D`` is a ``[Nd, ld, dim]`` view, and only each pair's query rows are gathered
(``[P, lq, dim]``, small beside ``D`` when queries are shorter than documents). Each document's ``m`` pairs form one
GEMM of ``m·lq`` query rows against its ``ld`` tokens.

This 2-core CPU, fp32, dim 128, a shuffled list of every query's candidates (each document listed once), inference
(``maxsim bench``'s dense-equivalent pair list), against the paths it replaces: 3200 pairs of ``Lq 32 x Ld 256``
104 -> 60 ms (eager on the padded copy the bench makes before timing: 70 ms); 64 pairs of ``8 x 32``, the public call
121 -> 107 µs (eager 48 µs). The backward stays the link list's (:mod:`maxsim.cpu_small`, :mod:`maxsim.cpu_ragged`):
one-hot products grouped the same way measured slower (full 64 x 32 ``Lq 32 x Ld 180`` 102 against 71 ms). Where
every query has as many pairs and the pairs are small (:data:`BY_QUERY_MAX_PAIR_SIMS`), a scores-only list is grouped
by query instead, its documents copied as candidates (:func:`_by_query`).

Applies (:func:`plan`) to packed ``Q`` and ``D`` on the CPU whose offsets and pair ids are in range, documents all
of one length with consecutive offsets, and every document listed the same number of times; queries may have any
lengths (masked as elsewhere). Else None, and the caller takes another path. The values are read back as Python
lists: CPU tensors only, where that is a copy of CPU memory, never a device sync.

Semantics as every path: ties to the lowest index, NaN among a pair's real tokens propagates, a query token past its
query's end adds 0 and chooses -1; scores in the accumulation dtype.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch
from torch import Tensor

from . import cpu, cpu_small
from .layout import Ragged, accum_dtype

MAX_VALUES = 1 << 16
"""Offsets and pair ids (``Nq + Nd + 2·P``) up to which :func:`plan` reads them back as lists (a few ms at most);
beyond, the other paths."""

STEP_MAX_WEIGHTS = 1 << 15
"""One-hot weights ``P·lq·ld`` up to which a training step keeps its state for the products' backward
(:func:`forward_for_step`). This 2-core CPU, fp32, dim 128, training step, link list -> kept products, by queries x
query length x documents x document length x pairs a document: 4 x 8 x 64 x 22 x 1 (11K weights) 0.88x, 8 x 8 x 32 x
32 x 2 (16K) 0.84x, 32 x 8 x 256 x 8 (16K) 0.68x, 8 x 8 x 64 x 64 (32K) 0.79x, 4 x 16 x 32 x 64 (32K) 0.93x, 4 x 32 x
8 x 128 (32K) 1.00x, 4 x 32 x 16 x 128 (64K) 1.07x."""

BLOCK_BYTES = 4 << 20
"""Budget of one block of documents (its similarities, its query rows and its documents in the accumulation
dtype): kept in cache between the GEMM and the reduction (as :data:`maxsim.cpu_ragged.PAIR_BLOCK_BYTES`)."""


BY_QUERY_MAX_PAIR_SIMS = 1 << 10
"""Similarities a pair (``lq · ld``) up to which a scores-only pair list whose queries each have the same number of
pairs is grouped by query instead (:func:`_by_query`): its documents gathered into a candidates copy
``[n_q, K, ld, dim]`` and scored by :func:`maxsim.cpu.forward` in one GEMM a query, where grouping by document ran
one GEMM a pair, too small for the BLAS (64 products of 8 x 32 alone: 180-260 us, the gather 25 and the grouped
products 76). This 2-core CPU (a noisy host), fp32, dim 128, K = 16 pairs a query, the public call, by document ->
by query, in one process: lq x ld 8 x 32 0.86-0.94x, 16 x 64 0.81x, 32 x 32 0.76x, 8 x 128 0.99x, 32 x 32 with 32
queries 1.00x; past the bound 32 x 64 1.10x, 32 x 128 1.22x. 0: never."""


class Plan(NamedTuple):
    """A pair list that this path takes."""

    n_docs: int
    ld: int  # every document's length
    d0: int  # first row of the first document: the documents are D[d0 : d0 + n_docs * ld]
    m: int  # pairs per document
    lq: int  # longest query
    q_short: bool  # some query shorter than lq (its padding rows are masked)
    q_fits: bool  # every query's first lq rows lie within Q (its slab is a window view, no clamp)
    sorted: bool  # the pairs are already in document order (stable): no permutation
    q_uniform: bool  # every query lq rows long, back to back: Q's rows q0 .. q0 + n_q·lq as [n_q, lq, dim]
    q0: int  # first row of the first query


def plan(Q: Tensor, D: Tensor, rg: Ragged) -> Plan | None:
    """The plan of a pair list over packed ``Q [rows_q, dim]`` and ``D [rows_d, dim]``, or None where this path does
    not apply (see the module docstring)."""
    if rg.pair_q is None or Q.dim() != 2 or D.dim() != 2 or rg.q_seg is None or rg.d_seg is None:
        return None
    n_q, n_d, P = rg.q_seg.shape[0] - 1, rg.d_seg.shape[0] - 1, rg.pair_q.shape[0]
    if P == 0 or n_q <= 0 or n_d <= 0 or P % n_d or n_q + n_d + 2 * P > MAX_VALUES:
        return None
    # Every read-back below is of CPU memory (a copy, never a device sync): tensors elsewhere take the other paths.
    if not (Q.is_cpu and D.is_cpu and rg.q_seg.is_cpu and rg.d_seg.is_cpu and rg.pair_q.is_cpu and rg.pair_d.is_cpu):
        return None
    d_off = rg.d_seg.tolist()  # (CPU values, checked above: no sync)
    d0, ld = d_off[0], d_off[1] - d_off[0]
    if d0 < 0 or not 0 < ld <= rg.max_d or d_off[-1] != d0 + n_d * ld or d_off[-1] > D.shape[0]:
        return None  # (fails fast for documents of several lengths)
    if d_off != list(range(d0, d_off[-1] + 1, ld)):
        return None
    q_off = rg.q_seg.tolist()  # (CPU values, checked above: no sync)
    q_len = list(map(operator.sub, q_off[1:], q_off[:-1]))
    lq, q_lo = max(q_len), min(q_len)
    if q_off[0] < 0 or q_lo < 0 or q_off[-1] > Q.shape[0] or lq > rg.max_q or lq == 0:
        return None
    pq, pd = rg.pair_q.tolist(), rg.pair_d.tolist()  # (CPU values, checked above: no sync)
    if min(pq) < 0 or max(pq) >= n_q or min(pd) < 0 or max(pd) >= n_d:
        return None
    m = P // n_d
    counts = [0] * n_d
    for d in pd:
        counts[d] += 1
    if min(counts) != m:  # (then every count is m: they sum to P = m · n_d)
        return None
    in_order = all(map(operator.le, pd[:-1], pd[1:]))
    q_uniform = q_lo == lq and q_off == list(range(q_off[0], q_off[-1] + 1, lq))
    return Plan(n_d, ld, d0, m, lq, q_lo < lq, q_off[-2] + lq <= Q.shape[0], in_order, q_uniform, q_off[0])


class _Sorted(NamedTuple):
    """The pairs in document order: ``order [P]`` (None where the list is in it already), each pair's query
    ``pair_q [P]``, its first query row ``q_start [P]`` and, where some query is short, its length ``q_len [P]``."""

    order: Tensor | None
    pair_q: Tensor
    q_start: Tensor
    q_len: Tensor | None


def _sorted(rg: Ragged, p: Plan) -> _Sorted:
    order = None if p.sorted else torch.argsort(rg.pair_d, stable=True)
    pair_q = rg.pair_q if order is None else rg.pair_q.index_select(0, order)
    q_len = rg.q_seg.diff().index_select(0, pair_q) if p.q_short else None
    return _Sorted(order, pair_q, rg.q_seg[:-1].index_select(0, pair_q), q_len)


def _bytes_a_document(Q: Tensor, p: Plan) -> int:
    """What a document costs a block (:data:`BLOCK_BYTES`): its pairs' similarities and query rows, and its tokens,
    in the accumulation dtype."""
    dim, itemsize = Q.shape[1], torch.finfo(accum_dtype(Q.dtype)).bits // 8
    return (p.m * p.lq * (p.ld + dim) + p.ld * dim) * itemsize


def _documents(D: Tensor, p: Plan) -> Tensor:
    """The documents as ``[n_docs, ld, dim]`` (a view of ``D``)."""
    return D[p.d0 : p.d0 + p.n_docs * p.ld].view(p.n_docs, p.ld, D.shape[1])


def _block(
    Q: Tensor, docs: Tensor, normalize: bool, need_argmax: bool, p: Plan, s: _Sorted, j0: int, j1: int,
    keep_sum: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:  # fmt: skip
    """Documents ``j0 .. j1`` and their pairs (in document order): the pairs' scores ``[pairs]``, the argmax
    ``[pairs, lq]`` int64 (-1 past a query's end; None unless ``need_argmax``), the pairs' query rows ``Qs
    [pairs, lq, dim]`` in the accumulation dtype, and with ``keep_sum`` the sum of every similarity (else None)."""
    acc, lq, m = accum_dtype(Q.dtype), p.lq, p.m
    p0, p1 = j0 * m, j1 * m
    Qs = cpu._as(cpu_small._slabs(Q, s.q_start[p0:p1], lq, p.q_fits), acc)  # [pairs, lq, dim]
    Ds = cpu._as(docs[j0:j1], acc)
    if normalize:
        Qs, Ds = Qs * cpu._inv_norm(Qs)[..., None], Ds * cpu._inv_norm(Ds)[..., None]
    best, arg, sims_sum = _row_max(Qs.view(j1 - j0, m * lq, Q.shape[1]), Ds, need_argmax, keep_sum)
    best, arg = best.reshape(p1 - p0, lq), None if arg is None else arg.reshape(p1 - p0, lq)
    if s.q_len is not None:  # a query token past its query's end adds 0 (where: its max may be NaN) and chose -1
        valid = torch.arange(lq) < s.q_len[p0:p1, None]
        best = torch.where(valid, best, 0.0)
        if need_argmax:
            arg = torch.where(valid, arg, -1)
    return best.sum(dim=-1), arg, Qs, sims_sum


def _in_list_order(x: Tensor, order: Tensor | None) -> Tensor:
    """Rows in document order back to the list's order."""
    return x if order is None else torch.empty_like(x).index_copy_(0, order, x)


def _argmax_out(arg: Tensor, order: Tensor | None, rg: Ragged) -> Tensor:
    """The argmax ``[P, lq]`` in document order as the public ``[1, P, max_q]`` int32 (-1 past ``lq``)."""
    P, lq = arg.shape
    argmax = arg.to(torch.int32)
    if lq < rg.max_q:  # (the argmax is max_q wide: no query token there)
        argmax = torch.nn.functional.pad(argmax, (0, rg.max_q - lq), value=-1)
    return _in_list_order(argmax, order).view(1, P, rg.max_q)


def forward(Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged, p: Plan) -> tuple[Tensor, Tensor]:
    """Scores ``[1, P]`` (fp32; fp64 for fp64 inputs) and, if asked, the argmax ``[1, P, max_q]`` int32 (else
    ``[0]``) of the pair list ``rg`` planned as ``p``."""
    P = rg.pair_q.shape[0]
    if not need_argmax:
        scores = _by_query(Q, D, normalize, rg, p)
        if scores is not None:
            return scores, torch.empty((0,), dtype=torch.int32)
    s = _sorted(rg, p)
    docs = _documents(D, p)
    step = max(1, min(p.n_docs, BLOCK_BYTES // _bytes_a_document(Q, p)))
    parts = [
        _block(Q, docs, normalize, need_argmax, p, s, j0, min(p.n_docs, j0 + step)) for j0 in range(0, p.n_docs, step)
    ]
    scores = parts[0][0] if len(parts) == 1 else torch.cat([part[0] for part in parts])
    if not need_argmax:
        return _in_list_order(scores, s.order).view(1, P), torch.empty((0,), dtype=torch.int32)
    arg = parts[0][1] if len(parts) == 1 else torch.cat([part[1] for part in parts])
    return _in_list_order(scores, s.order).view(1, P), _argmax_out(arg, s.order, rg)


def _by_query(Q: Tensor, D: Tensor, normalize: bool, rg: Ragged, p: Plan) -> Tensor | None:
    """The scores ``[1, P]`` of a pair list planned as ``p`` whose every query has the same number ``K`` of pairs,
    small pairs (:data:`BY_QUERY_MAX_PAIR_SIMS`) and a candidates copy within :data:`BLOCK_BYTES`: the pairs sorted
    by query (stable), each query's documents gathered into ``[n_q, K, ld, dim]`` and its rows into ``[n_q, lq,
    dim]`` (a query's padding rows masked), scored as candidates by :func:`maxsim.cpu.forward` (the same semantics:
    masked rows add 0, NaN propagates); else None."""
    n_q, P, dim = rg.q_seg.shape[0] - 1, rg.pair_q.shape[0], Q.shape[1]
    itemsize = torch.finfo(accum_dtype(Q.dtype)).bits // 8
    if p.lq * p.ld > BY_QUERY_MAX_PAIR_SIMS or P % n_q or P * p.ld * dim * itemsize > BLOCK_BYTES:
        return None
    K = P // n_q
    pair_q = rg.pair_q.long()
    if torch.bincount(pair_q, minlength=n_q).min() != K:  # (CPU values: plan() read them; then every count is K)
        return None
    order = torch.argsort(pair_q, stable=True)
    docs = _documents(D, p).index_select(0, rg.pair_d.long().index_select(0, order)).view(n_q, K, p.ld, dim)
    q_start = rg.q_seg[:-1].long()
    Qs = cpu_small._slabs(Q, q_start, p.lq, p.q_fits)  # [n_q, lq, dim]
    q_mask = torch.arange(p.lq) < rg.q_seg.diff()[:, None] if p.q_short else None
    scores, _ = cpu.forward(Qs, docs, q_mask, None, normalize, False)
    return _in_list_order(scores.view(P), order).view(1, P)


class PairStep(NamedTuple):
    """What a pair list's training step keeps for its backward (:func:`forward_for_step`), in document order."""

    plan: Plan
    sorted: _Sorted
    Qs: Tensor  # [P, lq, dim]: each pair's query rows, in the accumulation dtype
    arg: Tensor  # [P, lq] int64: each query row's chosen token (-1 past its query's end)
    sims_sum: Tensor  # 0-d: finite exactly when every token of Qs and of the documents is


def forward_for_step(Q: Tensor, D: Tensor, normalize: bool, rg: Ragged) -> tuple[Tensor, PairStep] | None:
    """The forward of a training step of a pair list this path takes, whose caller does not read the argmax: the
    scores ``[1, P]`` and what :func:`backward_for_step` needs, where its one-hot weights ``[P, lq, ld]`` hold at
    most :data:`STEP_MAX_WEIGHTS` entries and its documents fit one block, without ``normalize``; else None (the
    caller takes :func:`forward` and the link list's backward)."""
    if normalize:
        return None
    p = plan(Q, D, rg)
    if p is None:
        return None
    P = rg.pair_q.shape[0]
    if P * p.lq * p.ld > STEP_MAX_WEIGHTS or p.n_docs * _bytes_a_document(Q, p) > BLOCK_BYTES:
        return None
    s = _sorted(rg, p)
    scores, arg, Qs, sims_sum = _block(Q, _documents(D, p), False, True, p, s, 0, p.n_docs, keep_sum=True)
    return _in_list_order(scores, s.order).view(1, P), PairStep(p, s, Qs, arg, sims_sum)


def step_argmax(step: PairStep, rg: Ragged) -> Tensor:
    """The public argmax ``[1, P, max_q]`` int32 of a kept step (for the link list's backward)."""
    return _argmax_out(step.arg, step.sorted.order, rg)


def backward_for_step(grad: Tensor, Q: Tensor, D: Tensor, rg: Ragged, step: PairStep) -> tuple[Tensor, Tensor] | None:
    """The backward after :func:`forward_for_step`: the one-hot weights ``W [P, lq, ld]`` (each query row's upstream
    weight at its chosen token), grouped by document as the forward's GEMMs were, ``dD = Wᵀ·Qs`` per document
    (written where the documents lie) and ``dQs = W·D``, added into each pair's query rows. None where some token is
    not finite (the kept sum, a CPU scalar read: not a sync): a product multiplies every token (0 · inf is NaN), so
    the caller adds the links row by row (:func:`step_argmax`)."""
    if not math.isfinite(float(step.sims_sum)):
        return None
    p, s, Qs, arg = step.plan, step.sorted, step.Qs, step.arg
    acc, (P, lq, dim), n = Qs.dtype, Qs.shape, p.n_docs
    w = cpu._as(grad, acc).reshape(-1)
    w = (w if s.order is None else w.index_select(0, s.order))[:, None, None].expand(P, lq, 1)
    if s.q_len is not None:  # (a row past its query's end chose nothing: weight 0 at token 0)
        chose = arg >= 0
        w, arg = torch.where(chose[..., None], w, 0.0), arg.clamp(min=0)
    W = torch.zeros((n, p.m * lq, p.ld), dtype=acc).scatter_(2, arg.view(n, p.m * lq, 1), w.reshape(n, p.m * lq, 1))
    dDs = torch.bmm(W.transpose(1, 2), Qs.view(n, p.m * lq, dim))  # [n_docs, ld, dim]
    dQs = torch.bmm(W, cpu._as(_documents(D, p), acc))  # [n_docs, m·lq, dim]
    dQ = torch.zeros((Q.shape[0], dim), dtype=acc)
    if p.q_uniform:  # (a pair's rows added as one slab of its query: the same sums, in the same order)
        n_q = rg.q_seg.shape[0] - 1
        dQ[p.q0 : p.q0 + n_q * lq].view(n_q, lq * dim).index_add_(0, s.pair_q, dQs.view(P, lq * dim))
    else:
        rows = (s.q_start[:, None] + torch.arange(lq)).view(-1)
        if not p.q_fits:
            rows = rows.clamp_(max=Q.shape[0] - 1)  # (past the end: zero rows, added to the last)
        dQ.index_add_(0, rows, dQs.view(P * lq, dim))
    dD = cpu_small._rows_of(dDs.view(n * p.ld, dim), p.d0, D.shape[0])
    return cpu._as(dQ, Q.dtype), cpu._as(dD, D.dtype)


def _row_max(
    Qs: Tensor, Ds: Tensor, need_argmax: bool, keep_sum: bool = False
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Each query row's max over its document's tokens, ``Qs [n, rows, dim]`` against ``Ds [n, ld, dim]`` ->
    ``([n, rows], indices [n, rows] int64 or None, the sum of every similarity (with keep_sum) or None)``:
    documents first (``Ds·Qsᵀ``, the rows padded to :data:`maxsim.cpu.DOCUMENTS_FIRST_WIDTH`, which add zeros to the
    sum) where :func:`maxsim.cpu._documents_first` takes it (this 2-core CPU, fp32, 32 rows against 256-token
    documents, 23 and 100 documents: 0.85-0.86x, with the indices 0.90-0.91x), else ``Qs·Dsᵀ``. Ties go to the
    lowest index and NaN propagates either way."""
    n, rows, dim = Qs.shape
    ld = Ds.shape[1]
    if cpu._documents_first(rows, dim, n * rows * ld, need_argmax):
        width = cpu.DOCUMENTS_FIRST_WIDTH
        if rows < width:
            Qs = torch.nn.functional.pad(Qs, (0, 0, 0, width - rows))
        sim = torch.bmm(Ds, Qs.transpose(1, 2))  # [n, ld, width]; padding columns never read past the max
        best, arg = sim.max(dim=1) if need_argmax else (sim.amax(dim=1), None)
        return best[:, :rows], None if arg is None else arg[:, :rows], sim.sum() if keep_sum else None
    sim = torch.bmm(Qs, Ds.transpose(1, 2))
    best, arg = sim.max(dim=-1) if need_argmax else (sim.amax(dim=-1), None)
    return best, arg, sim.sum() if keep_sum else None
