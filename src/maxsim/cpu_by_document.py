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
one-hot products grouped the same way measured slower (full 64 x 32 ``Lq 32 x Ld 180`` 102 against 71 ms).

Applies (:func:`plan`) to packed ``Q`` and ``D`` on the CPU whose offsets and pair ids are in range, documents all
of one length with consecutive offsets, and every document listed the same number of times; queries may have any
lengths (masked as elsewhere). Else None, and the caller takes another path. The values are read back as Python
lists: CPU tensors only, where that is a copy of CPU memory, never a device sync.

Semantics as every path: ties to the lowest index, NaN among a pair's real tokens propagates, a query token past its
query's end adds 0 and chooses -1; scores in the accumulation dtype.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import Tensor

from . import cpu, cpu_small
from .layout import Ragged, accum_dtype

MAX_VALUES = 1 << 16
"""Offsets and pair ids (``Nq + Nd + 2·P``) up to which :func:`plan` reads them back as lists (a few ms at most);
beyond, the other paths."""

BLOCK_BYTES = 4 << 20
"""Budget of one block of documents (its similarities, its query rows and its documents in the accumulation
dtype): kept in cache between the GEMM and the reduction (as :data:`maxsim.cpu_ragged.PAIR_BLOCK_BYTES`)."""


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
    return Plan(n_d, ld, d0, m, lq, q_lo < lq, q_off[-2] + lq <= Q.shape[0], in_order)


def forward(Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged, p: Plan) -> tuple[Tensor, Tensor]:
    """Scores ``[1, P]`` (fp32; fp64 for fp64 inputs) and, if asked, the argmax ``[1, P, max_q]`` int32 (else
    ``[0]``) of the pair list ``rg`` planned as ``p``."""
    P, dim, lq, ld, m = rg.pair_q.shape[0], Q.shape[1], p.lq, p.ld, p.m
    acc = accum_dtype(Q.dtype)
    order = None if p.sorted else torch.argsort(rg.pair_d, stable=True)
    pair_q = rg.pair_q if order is None else rg.pair_q.index_select(0, order)
    q_start = rg.q_seg[:-1].index_select(0, pair_q)  # [P] in document order
    q_len = rg.q_seg.diff().index_select(0, pair_q) if p.q_short else None
    docs = D[p.d0 : p.d0 + p.n_docs * ld].view(p.n_docs, ld, dim)
    itemsize = torch.finfo(acc).bits // 8
    per_doc = (m * lq * (ld + dim) + ld * dim) * itemsize
    step = max(1, min(p.n_docs, BLOCK_BYTES // per_doc))
    t = torch.arange(lq) if q_len is not None else None
    parts: list[tuple[Tensor, Tensor | None]] = []
    for j0 in range(0, p.n_docs, step):
        j1 = min(p.n_docs, j0 + step)
        p0, p1 = j0 * m, j1 * m
        Qs = cpu._as(cpu_small._slabs(Q, q_start[p0:p1], lq, p.q_fits), acc)  # [pairs, lq, dim]
        Ds = cpu._as(docs[j0:j1], acc)
        if normalize:
            Qs, Ds = Qs * cpu._inv_norm(Qs)[..., None], Ds * cpu._inv_norm(Ds)[..., None]
        best, arg = _row_max(Qs.view(j1 - j0, m * lq, dim), Ds, need_argmax)
        best, arg = best.reshape(p1 - p0, lq), None if arg is None else arg.reshape(p1 - p0, lq)
        if q_len is not None:  # a query token past its query's end adds 0 (where: its max may be NaN) and chose -1
            valid = t < q_len[p0:p1, None]
            best = torch.where(valid, best, 0.0)
            if need_argmax:
                arg = torch.where(valid, arg, -1)
        parts.append((best.sum(dim=-1), arg))
    scores = parts[0][0] if len(parts) == 1 else torch.cat([s for s, _ in parts])
    argmax = torch.empty((0,), dtype=torch.int32)
    if need_argmax:
        argmax = parts[0][1] if len(parts) == 1 else torch.cat([a for _, a in parts])
        argmax = argmax.to(torch.int32)
        if lq < rg.max_q:  # (the argmax is max_q wide: no query token there)
            argmax = torch.nn.functional.pad(argmax, (0, rg.max_q - lq), value=-1)
    if order is not None:  # back to the list's order
        scores = torch.empty_like(scores).index_copy_(0, order, scores)
        if need_argmax:
            argmax = torch.empty_like(argmax).index_copy_(0, order, argmax)
    return scores.view(1, P), (argmax.view(1, P, rg.max_q) if need_argmax else argmax)


def _row_max(Qs: Tensor, Ds: Tensor, need_argmax: bool) -> tuple[Tensor, Tensor | None]:
    """Each query row's max over its document's tokens, ``Qs [n, rows, dim]`` against ``Ds [n, ld, dim]`` ->
    ``([n, rows], indices [n, rows] int64 or None)``: documents first (``Ds·Qsᵀ``, the rows padded to
    :data:`maxsim.cpu.DOCUMENTS_FIRST_WIDTH`) where :func:`maxsim.cpu._documents_first` takes it (this 2-core CPU,
    fp32, 32 rows against 256-token documents, 23 and 100 documents: 0.85-0.86x, with the indices 0.90-0.91x), else
    ``Qs·Dsᵀ``. Ties go to the lowest index and NaN propagates either way."""
    n, rows, dim = Qs.shape
    ld = Ds.shape[1]
    if cpu._documents_first(rows, dim, n * rows * ld, need_argmax):
        width = cpu.DOCUMENTS_FIRST_WIDTH
        if rows < width:
            Qs = torch.nn.functional.pad(Qs, (0, 0, 0, width - rows))
        sim = torch.bmm(Ds, Qs.transpose(1, 2))  # [n, ld, width]; padding columns never read past the max
        best, arg = sim.max(dim=1) if need_argmax else (sim.amax(dim=1), None)
        return best[:, :rows], None if arg is None else arg[:, :rows]
    sim = torch.bmm(Qs, Ds.transpose(1, 2))
    return sim.max(dim=-1) if need_argmax else (sim.amax(dim=-1), None)
