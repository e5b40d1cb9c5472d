"""PyTorch path for the ragged layouts: gather each segment into a padded block, run the dense twin (:mod:`.cpu`),
and route the gradients back to the packed rows.

The padded blocks are copies (``[Nq, max_q, dim]`` and ``[Nd, max_d, dim]``; for a pair list one block of pairs at
a time, within :data:`maxsim.cpu.BLOCK_BYTES`), which is fine off the GPU, where this path runs. Out-of-range
offsets, lengths or pair ids give NaN scores, as in the kernels. No host↔device sync beyond what PyTorch ops do,
except on CPU tensors, where reading values back is free: large skewed batches are grouped by length class there, a
varlen cross product with well-formed offsets needs no padding at all (:func:`_packed_cross`), and a pair list is
regrouped by query into candidate blocks (:func:`_pairs_by_query`). Small problems on the CPU, whose time is the
number of ops they run, take the few-op path of :mod:`.cpu_small` first (:func:`forward`, :func:`backward`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu, cpu_by_document, cpu_memory, cpu_small
from .layout import Ragged, accum_dtype


def _segment_rows(seg: Tensor, rows: int, max_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Offsets ``seg [N + 1]`` into ``rows`` packed rows as ``(row index [N, max_len] (clamped), valid
    [N, max_len], bad [N])``."""
    s0, s1 = seg[:-1].long(), seg[1:].long()
    bad = (s0 < 0) | (s1 < s0) | (s1 > rows) | (s1 - s0 > max_len)
    s0c = s0.clamp(0, rows)
    n = (s1.clamp(max=rows) - s0c).clamp(min=0)
    t = torch.arange(max_len, device=seg.device)
    valid = t[None, :] < n[:, None]
    idx = (s0c[:, None] + t[None, :]).clamp(max=max(rows - 1, 0))
    return idx, valid, bad


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    """``x [rows, dim]`` at ``idx [...]`` -> ``[..., dim]`` (zeros when ``x`` has no rows)."""
    if x.shape[0] == 0:
        return x.new_zeros((*idx.shape, x.shape[-1]))
    # index_select, not x[idx]: advanced indexing measured ~5x slower for these small gathers on CPU.
    return torch.index_select(x, 0, idx.reshape(-1)).view(*idx.shape, x.shape[-1])


def _packed(x: Tensor, seg: Tensor, max_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Packed ``x [rows, dim]`` with offsets ``seg [N + 1]`` as ``(padded [N, max_len, dim], valid [N, max_len],
    row index [N, max_len] (clamped), bad [N])``."""
    idx, valid, bad = _segment_rows(seg, x.shape[0], max_len)
    return _gather(x, idx), valid, idx, bad


def _lengths(lengths: Tensor, limit: int) -> tuple[Tensor, Tensor]:
    """``(valid [..., limit], bad [...])`` from per-sequence lengths."""
    t = torch.arange(limit, device=lengths.device)
    return t < lengths[..., None], (lengths < 0) | (lengths > limit)


class _Dense:
    """A ragged problem as dense blocks: ``Q [Nq, Lq, dim]``, ``D [Bd, K, Ld, dim]`` with masks and bad flags."""

    def __init__(self, Q: Tensor, D: Tensor, rg: Ragged) -> None:
        self.q_idx = self.d_idx = None
        self.Q, self.D = Q, D
        self.q_mask = self.d_mask = None
        self.q_bad = self.d_bad = None
        if rg.q_seg is not None:
            if Q.dim() == 2:
                self.Q, self.q_mask, self.q_idx, self.q_bad = _packed(Q, rg.q_seg, rg.max_q)
            else:
                self.q_mask, self.q_bad = _lengths(rg.q_seg, Q.shape[1])
        if rg.d_seg is not None:
            if D.dim() == 2:
                Dp, dm, self.d_idx, self.d_bad = _packed(D, rg.d_seg, rg.max_d)
                self.D, self.d_mask = Dp[None], dm[None]
            else:
                self.d_mask, self.d_bad = _lengths(rg.d_seg, D.shape[2])


def _pair_blocks(rg: Ragged, per_pair: int):
    P = rg.pair_q.shape[0]
    step = max(1, min(P, cpu.BLOCK_BYTES // max(1, per_pair)))
    for p0 in range(0, P, step):
        yield p0, min(P, p0 + step)


def _pair_ids(rg: Ragged, nq: int, nd: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pair ids clamped into range (for gathering) and the pairs whose ids were out of range."""
    pq, pd = rg.pair_q.long(), rg.pair_d.long()
    bad = (pq < 0) | (pq >= nq) | (pd < 0) | (pd >= nd)
    return pq.clamp(0, max(nq - 1, 0)), pd.clamp(0, max(nd - 1, 0)), bad


def forward(Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged) -> tuple[Tensor, Tensor]:
    """As :func:`maxsim.cpu.forward` for a ragged description: scores ``[Nq, K]`` (a pair list: ``[1, P]``)."""
    by_document = cpu_by_document.plan(Q, D, rg)  # (pair lists on the CPU over documents of one length; else None)
    if by_document is not None:
        return cpu_by_document.forward(Q, D, normalize, need_argmax, rg, by_document)
    out = cpu_small.forward(Q, D, normalize, need_argmax, rg)  # (small problems on the CPU; else None)
    if out is not None:
        return out
    if rg.pair_q is not None:
        return _forward_pairs(Q, D, normalize, need_argmax, rg)
    if _both_packed_on_cpu(Q, D, rg):
        out = _packed_cross(Q, D, normalize, need_argmax, rg)
        if out is not None:
            return out
    if _by_length_worthwhile(Q, D, rg):
        return _forward_by_length(Q, D, normalize, need_argmax, rg)
    dn = _Dense(Q, D, rg)
    scores, argmax = cpu.forward(dn.Q, dn.D, dn.q_mask, dn.d_mask, normalize, need_argmax)
    bad = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if dn.q_bad is not None:
        bad |= dn.q_bad[:, None]
    if dn.d_bad is not None:
        bad |= dn.d_bad if dn.d_bad.dim() == 2 else dn.d_bad[None, :]
    return scores.masked_fill(bad, float("nan")), argmax


STEPS = (cpu_small.CrossStep, cpu_by_document.PairStep)
"""What :func:`forward_for_step` keeps for :func:`backward_for_step`."""


def forward_for_step(Q: Tensor, D: Tensor, normalize: bool, rg: Ragged) -> tuple[Tensor, object] | None:
    """The forward of a training step whose caller does not read the argmax: the scores and a state of
    :data:`STEPS` for :func:`backward_for_step`, where a path keeps one (a small varlen cross product on the CPU,
    :func:`maxsim.cpu_small.cross_forward_for_step`; a pair list over documents of one length,
    :func:`maxsim.cpu_by_document.forward_for_step`); else None (the caller takes :func:`forward`)."""
    if rg.pair_q is None:
        return cpu_small.cross_forward_for_step(Q, D, normalize, rg)
    return cpu_by_document.forward_for_step(Q, D, normalize, rg)


def backward_for_step(
    grad: Tensor, Q: Tensor, D: Tensor, normalize: bool, deterministic: bool, rg: Ragged, step: object
) -> tuple[Tensor, Tensor]:
    """The backward after :func:`forward_for_step` (``step`` what it kept)."""
    if isinstance(step, cpu_small.CrossStep):
        return cpu_small.cross_backward_for_step(grad, Q, D, normalize, rg, step)
    out = cpu_by_document.backward_for_step(grad, Q, D, rg, step)
    if out is None:  # (a token that is not finite: the links row by row)
        return backward(grad, Q, D, cpu_by_document.step_argmax(step, rg), normalize, deterministic, rg)
    return out


def _forward_pairs(Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged) -> tuple[Tensor, Tensor]:
    """Pair lists. On the CPU with offsets and pair ids in range: the pairs regrouped by query
    (:func:`_pairs_by_query`). Elsewhere (other devices, or ids / offsets out of range, which score NaN), one block
    of pairs at a time, gathered straight from the packed rows (no padded copy of Q or D as a whole); large problems
    on the CPU group the pairs by their document's length class first, each group padded to its own longest
    document (see :func:`_forward_by_length`)."""
    out = _pairs_by_query(Q, D, normalize, need_argmax, rg)
    if out is not None:
        return out
    q_idx, q_valid, q_bad = _segment_rows(rg.q_seg, Q.shape[0], rg.max_q)
    d_idx, d_valid, d_bad = _segment_rows(rg.d_seg, D.shape[0], rg.max_d)
    pq, pd, bad = _pair_ids(rg, q_idx.shape[0], d_idx.shape[0])
    bad = bad | q_bad[pq] | d_bad[pd]
    P, Lq, Ld, dim = pq.shape[0], rg.max_q, rg.max_d, Q.shape[-1]

    def block(bq: Tensor, bd: Tensor, width: int) -> tuple[Tensor, Tensor]:
        return cpu.forward(
            _gather(Q, q_idx.index_select(0, bq)), _gather(D, d_idx[:, :width].index_select(0, bd))[:, None],
            q_valid.index_select(0, bq), d_valid[:, :width].index_select(0, bd)[:, None], normalize, need_argmax,
        )  # fmt: skip

    step = max(1, cpu.BLOCK_BYTES // max(1, (Lq + Ld) * dim * 8 + Lq * Ld * 8))
    if step >= P and not (Q.device.type == "cpu" and P * Lq * Ld >= BY_LENGTH_MIN_WORK):
        s, a = block(pq, pd, Ld)  # one block of every pair: its results are the answer
        scores, argmax = s.view(1, P), (a.view(1, P, Lq) if need_argmax else a)
    else:
        acc = torch.float64 if Q.dtype == torch.float64 else torch.float32
        scores = torch.empty((1, P), dtype=acc, device=Q.device)
        argmax = torch.empty((1, P, Lq) if need_argmax else (0,), dtype=torch.int32, device=Q.device)
        groups = [(torch.arange(P, device=Q.device), Ld)]
        if Q.device.type == "cpu" and P * Lq * Ld >= BY_LENGTH_MIN_WORK:
            groups = _length_classes(d_valid.sum(dim=1)[pd])
        for ids, width in groups:
            step = max(1, cpu.BLOCK_BYTES // max(1, (Lq + width) * dim * 8 + Lq * width * 8))
            for i0 in range(0, ids.shape[0], step):
                sel = ids[i0 : i0 + step]
                s, a = block(pq[sel], pd[sel], width)
                scores[0, sel] = s[:, 0]
                if need_argmax:
                    argmax[0, sel] = a[:, 0]
    return scores.masked_fill(bad[None, :], float("nan")), argmax


PAIR_BLOCK_BYTES = 4 << 20
"""Budget of one block of :func:`_pairs_by_query` (its similarities plus its copy of the documents, in the
accumulation dtype), below :data:`maxsim.cpu.BLOCK_BYTES`: the documents are gathered into the block and read back
by its GEMM at once, which is fastest while both stay in cache (this 2-core CPU, fp32, dim 128, 1024 pairs of
``Lq 32 x Ld 180``: budgets of 1/2/4/8/16/32 MiB took 40/33/31/33/42/42 ms, one thread)."""


def _pairs_by_query(
    Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged
) -> tuple[Tensor, Tensor] | None:
    """A pair list on the CPU, regrouped by query: each query's pairs become one row of a candidates block
    ``Q [rows, Lq, dim]`` against ``D [rows, k, Ld, dim]`` (:func:`maxsim.cpu.forward`: one batched GEMM of ``k·Ld``
    columns per query, the padded path's shape, and Q read once per query rather than copied once per pair), and
    the results go back to pair order. Returns scores ``[1, P]`` (fp32; fp64 for fp64 inputs) and argmax
    ``[1, P, max_q]`` int32 (``[0]`` if not asked for), or None (see below).

    Rows (:func:`_pair_rows`) hold at most a block's worth of pairs, and rows holding far fewer pairs than others
    go to blocks of their own, so unused slots never cost more than used ones; large problems first group the pairs
    by their document's length class (as :func:`_forward_by_length`). Each block is padded to its own longest query
    and document, and masked only where a sequence is shorter than that. A pair's score and argmax depend on its
    own tokens only, so they are those of one padded call over every pair.

    None when a tensor is not on the CPU, an offset or pair id is out of range (the checked path of
    :func:`_forward_pairs` gives those pairs NaN), or there is nothing to regroup: the values read back here are
    free to read on the CPU only."""
    if not (_both_packed_on_cpu(Q, D, rg) and rg.pair_q.device.type == "cpu" and rg.pair_d.device.type == "cpu"):
        return None
    # (int32 or int64 alike: every op below takes either, and no sum of them exceeds the offsets)
    q_seg, d_seg, pq, pd = rg.q_seg, rg.d_seg, rg.pair_q, rg.pair_d
    n_q, n_d, P = q_seg.shape[0] - 1, d_seg.shape[0] - 1, pq.shape[0]
    if P == 0 or n_q == 0 or n_d == 0:
        return None  # (no pair, or every id out of range)
    max_q, max_d, dim = rg.max_q, rg.max_d, Q.shape[1]
    q_len, d_len = q_seg.diff(), d_seg.diff()
    ends = [q_seg[0], q_seg[-1], *q_len.aminmax(), d_seg[0], d_seg[-1], *d_len.aminmax(), *pq.aminmax(), *pd.aminmax()]
    q0, q1, q_lo, q_hi, d0, d1, d_lo, d_hi, pq_lo, pq_hi, pd_lo, pd_hi = torch.stack(ends).tolist()  # (CPU: no sync)
    if min(q0, q_lo, d0, d_lo, pq_lo, pd_lo) < 0 or q1 > Q.shape[0] or d1 > D.shape[0]:
        return None
    if q_hi > max_q or d_hi > max_d or pq_hi >= n_q or pd_hi >= n_d:
        return None
    acc = accum_dtype(Q.dtype)
    scores = torch.empty(P, dtype=acc)
    argmax = torch.full((P, max_q) if need_argmax else (0,), -1, dtype=torch.int32)
    seq = _Sequences(Q, D, q_seg, q_len, d_seg, d_len, (q_lo, q_hi), (d_lo, d_hi))
    budget = min(cpu.BLOCK_BYTES, PAIR_BLOCK_BYTES)
    groups: list[tuple[Tensor | None, int]] = [(None, max_d)]
    if P * max_q * max_d >= BY_LENGTH_MIN_WORK:
        groups = _length_classes(d_len.index_select(0, pd))
    for ids, width in groups:
        gq, gd = (pq, pd) if ids is None else (pq.index_select(0, ids), pd.index_select(0, ids))
        # a slot (one pair) costs its similarities and its copy of the document
        per_slot = max(1, width * (max_q + dim) * (torch.finfo(acc).bits // 8))
        for order, row_q, slot, k, row_end in _pair_rows(gq, n_q, max(1, budget // per_slot)):
            docs = gd.index_select(0, order)
            pairs = order if ids is None else ids.index_select(0, order)
            n_rows = n_q if row_q is None else row_q.shape[0]
            step = max(1, budget // (per_slot * k))
            for r0 in range(0, n_rows, step):
                r1 = min(n_rows, r0 + step)
                # the block's pairs: a run of the sorted ones (its rows are consecutive)
                p0, p1 = (r0 * k, r1 * k) if row_end is None else (row_end[r0 - 1] if r0 else 0, row_end[r1 - 1])
                whole = p0 == 0 and p1 == docs.shape[0]  # (no slices to take: a few µs each)
                block_docs, block_pairs = (docs, pairs) if whole else (docs[p0:p1], pairs[p0:p1])
                sel = None
                if slot is not None:  # rows with fewer pairs than k: the unused slots score a document, unread
                    sel = slot[p0:p1] - r0 * k
                    grid = torch.full(((r1 - r0) * k,), int(block_docs[0]), dtype=block_docs.dtype)
                    block_docs = grid.index_copy_(0, sel, block_docs)
                rows = slice(r0, r1) if row_q is None else row_q[r0:r1]
                s, a = seq.score(rows, block_docs.view(r1 - r0, k), normalize, need_argmax)
                s = s.view(-1) if sel is None else s.view(-1).index_select(0, sel)
                scores.index_copy_(0, block_pairs, s)
                if need_argmax and a.shape[-1]:  # (a block of queries without tokens: -1 throughout, as filled)
                    lq = a.shape[-1]
                    a = a.view(-1, lq) if sel is None else a.view(-1, lq).index_select(0, sel)
                    argmax[:, :lq].index_copy_(0, block_pairs, a)
    return scores.view(1, P), (argmax.view(1, P, max_q) if need_argmax else argmax)


def _pair_rows(pair_q: Tensor, n_q: int, cap: int):
    """The pairs of ``pair_q [P]`` (query ids in ``[0, n_q)``, CPU) as rows of at most ``cap`` pairs of one
    query each, in pair order: one row per query when no query has more than ``cap`` pairs and each has more than
    half as many as the one with the most, else classes of rows holding ``(2^(c-1), 2^c]`` pairs.

    Yields per class ``(order, row_q, slot, k, row_end)``: ``order [n]`` the class's pairs (positions in
    ``pair_q``) row after row, ``row_q [R]`` each row's query (None: every query, in order), ``k`` the most pairs a
    row holds and, where some row holds fewer, ``slot [n]`` each pair's slot ``row · k + column`` in ``[R, k]`` and
    ``row_end`` (a list) where each row ends in ``order``; else None, None (pair ``order[i]`` is slot ``i``).

    Reads values back (counts, row ends, class sizes) as Python ints and lists, which is free for CPU tensors and
    a host sync for any other: hence CPU ids only (:func:`_pairs_by_query`, the one caller, checks every tensor's
    device first; a call with ids elsewhere is a bug and raises rather than syncing)."""
    if pair_q.device.type != "cpu":
        raise RuntimeError(f"_pair_rows: CPU pair ids only (its read-backs would sync), got {pair_q.device}")
    # (stable: a query's pairs stay in pair order, so the layout depends on the list alone; any order would score
    # the same, each pair's results going back to its own position)
    order = torch.argsort(pair_q, stable=True)
    counts = torch.bincount(pair_q, minlength=n_q)
    lo, hi = (int(x) for x in counts.aminmax())  # (CPU values: no sync)
    if lo == hi and hi <= cap:  # every query, with as many pairs each
        yield order, None, None, hi, None
        return
    queries = counts.nonzero().squeeze(1)
    per_query = counts.index_select(0, queries)
    lo = int(per_query.min())  # (CPU values: no sync)
    if hi <= cap and 2 * lo > hi:  # one row per query that has pairs
        first = torch.cumsum(per_query, 0) - per_query
        shift = torch.repeat_interleave(torch.arange(queries.shape[0]) * hi - first, per_query)
        row_q = None if queries.shape[0] == n_q else queries
        row_end = (first + per_query).tolist()  # (CPU values, see the docstring: no sync)
        yield order, row_q, torch.arange(order.shape[0]) + shift, hi, row_end
        return
    sq = pair_q.index_select(0, order)
    rank = torch.arange(order.shape[0]) - (torch.cumsum(counts, 0) - counts).index_select(0, sq)
    chunk = torch.div(rank, cap, rounding_mode="floor")
    in_row = (counts.index_select(0, sq) - chunk * cap).clamp(max=cap)  # pairs in the pair's row
    row_class = torch.ceil(torch.log2(in_row.double())).long()
    by_class = torch.argsort(row_class, stable=True)  # (stable: each row's pairs stay together, in pair order)
    order, sq, chunk, rank, in_row, row_class = (
        t.index_select(0, by_class) for t in (order, sq, chunk, rank, in_row, row_class)
    )
    new_row = torch.ones(order.shape[0], dtype=torch.bool)
    new_row[1:] = (sq[1:] != sq[:-1]) | (chunk[1:] != chunk[:-1])
    row_of = torch.cumsum(new_row, 0) - 1
    col = rank - chunk * cap
    row_q, row_n = sq[new_row], in_row[new_row]
    row_end = torch.cumsum(row_n, 0).tolist()  # (CPU values: no sync)
    r0 = 0
    class_sizes = torch.unique_consecutive(row_class[new_row], return_counts=True)[1].tolist()  # (CPU: no sync)
    for n_rows in class_sizes:
        r1 = r0 + n_rows
        p0, p1 = (row_end[r0 - 1] if r0 else 0), row_end[r1 - 1]
        lo, hi = (int(x) for x in row_n[r0:r1].aminmax())  # (CPU values: no sync)
        if lo == hi:
            yield order[p0:p1], row_q[r0:r1], None, hi, None
        else:
            ends = [e - p0 for e in row_end[r0:r1]]
            yield order[p0:p1], row_q[r0:r1], (row_of[p0:p1] - r0) * hi + col[p0:p1], hi, ends
        r0 = r1


class _Sequences:
    """Packed ``Q [rows_q, dim]`` and ``D [rows_d, dim]`` with their offsets (known to be in range), lengths, and the
    range ``(shortest, longest)`` of each side's lengths."""

    def __init__(
        self, Q: Tensor, D: Tensor, q_seg: Tensor, q_len: Tensor, d_seg: Tensor, d_len: Tensor,
        q_range: tuple[int, int], d_range: tuple[int, int],
    ) -> None:  # fmt: skip
        self.Q, self.D, self.q_seg, self.q_len, self.d_seg, self.d_len = Q, D, q_seg, q_len, d_seg, d_len
        self.q_range, self.d_range = q_range, d_range

    def score(self, rows: slice | Tensor, docs: Tensor, normalize: bool, need_argmax: bool) -> tuple[Tensor, Tensor]:
        """Query ``rows[r]`` (a slice of query ids or ``[R]`` ids) against documents ``docs[r, :]`` (``[R, k]``
        ids) as one candidates block padded to its longest query and document, masked only where some sequence is
        shorter: :func:`maxsim.cpu.forward`'s ``(scores [R, k], argmax [R, k, Lq])``."""
        flat = docs.view(-1)
        q_len = self.q_len[rows] if isinstance(rows, slice) else self.q_len.index_select(0, rows)
        d_len = None
        (q_lo, lq), (d_lo, ld) = self.q_range, self.d_range
        if q_lo < lq or d_lo < ld:  # lengths differ: the block's own range (when all are equal, it is known)
            d_len = self.d_len.index_select(0, flat).view(docs.shape)
            q_lo, lq, d_lo, ld = torch.stack([*q_len.aminmax(), *d_len.aminmax()]).tolist()  # (CPU: no sync)
        t = torch.arange(max(lq, ld))
        q_mask = d_mask = None
        if isinstance(rows, slice) and q_lo == lq:  # consecutive queries of one length: a view of their rows
            r0 = int(self.q_seg[rows.start])
            Qb = self.Q[r0 : r0 + q_len.shape[0] * lq].view(q_len.shape[0], lq, self.Q.shape[1])
        else:
            q_start = self.q_seg[rows] if isinstance(rows, slice) else self.q_seg.index_select(0, rows)
            q_rows = q_start[:, None] + t[:lq]
            if q_lo < lq:  # a shorter query's padding reads the rows after it (masked), up to the last row
                q_rows, q_mask = q_rows.clamp(max=self.Q.shape[0] - 1), t[:lq] < q_len[:, None]
            Qb = _gather(self.Q, q_rows)
        d_start = self.d_seg.index_select(0, flat)
        if d_lo < ld:  # a shorter document's padding is the rows after it (masked)
            d_mask = t[:ld] < d_len[..., None]
        # Whole [ld, dim] slabs where every document's slab lies within D (all but a short one at its very end).
        if ld and (d_lo == ld or int(d_start.max()) + ld <= self.D.shape[0]):  # (CPU values: no sync)
            Db = _windows(self.D, ld).index_select(0, d_start).view(*docs.shape, ld, self.D.shape[1])
        else:
            Db = _gather(self.D, (d_start.view(docs.shape)[..., None] + t[:ld]).clamp(max=self.D.shape[0] - 1))
        return cpu.forward(Qb, Db, q_mask, d_mask, normalize, need_argmax)


def _windows(x: Tensor, width: int) -> Tensor:
    """Every run of ``width`` consecutive rows of ``x [rows, dim]`` (``width <= rows``), as an overlapping view
    ``[rows - width + 1, width, dim]``: ``index_select`` of it copies whole slabs, faster than row by row."""
    rows, dim = x.shape
    return x.as_strided((rows - width + 1, width, dim), (x.stride(0), x.stride(0), x.stride(1)))


def _both_packed_on_cpu(Q: Tensor, D: Tensor, rg: Ragged) -> bool:
    return Q.device.type == "cpu" and Q.dim() == 2 and D.dim() == 2 and rg.q_seg is not None and rg.d_seg is not None


def _well_formed(seg: Tensor, rows: int, max_len: int) -> tuple[list[int], list[int]] | None:
    """``(offsets, lengths)`` as lists when every segment of ``seg [N + 1]`` lies within ``rows`` and holds at most
    ``max_len`` rows, else None. Offsets on a device other than the CPU give None too, so the caller takes the padded
    path: the one read-back here is free on the CPU only, and it never becomes a host sync."""
    if seg.device.type != "cpu":
        return None
    offsets = seg.tolist()  # CPU memory: a copy, not a device sync
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    if offsets[0] < 0 or offsets[-1] > rows or (lengths and (min(lengths) < 0 or max(lengths) > max_len)):
        return None
    return offsets, lengths


def _chunks(offsets: list[int], max_rows: int) -> list[tuple[int, int]]:
    """Runs ``[i0, i1)`` of consecutive segments spanning at most ``max_rows`` rows each (one segment at least)."""
    out, i0 = [], 0
    for i in range(1, len(offsets)):
        if i - 1 > i0 and offsets[i] - offsets[i0] > max_rows:
            out.append((i0, i - 1))
            i0 = i - 1
    if len(offsets) > 1:
        out.append((i0, len(offsets) - 1))
    return out


PACKED_QUERY_ROWS = 4096
"""Query rows per block of the packed path (documents then fill :data:`maxsim.cpu.BLOCK_BYTES`)."""


PACKED_ARGMAX_MAX_SIMS = 1 << 40
"""Similarities (query tokens × document tokens) up to which the packed path also finds the argmax (tests force the
padded paths by lowering it). With documents reduced one by one (:data:`PER_DOCUMENT_MIN_SIMS`) it measured at or
ahead of the padded paths at every size tried (this 2-core CPU, fp32, training step, skewed lengths Lq 8..32, Ld
20..1000: 64 x 256, 32M similarities, 164-176 against 210-225 ms; 128 x 512, 109M, 580-650 against 950-1020; 256 x
1024, 451M, 2.2 against 4.4 s; lengths alike, 256 x 256 Lq32 Ld300, 629M, 1.90-1.96 against 1.86-2.05 s); before it
the bound was 16M."""

PER_DOCUMENT_MIN_SIMS = 1 << 12
"""Similarities a document (a block's query rows × its documents' mean length) from which the packed path reduces
each document's tokens with a reduction of its own (:func:`_document_maxima`: one op a document, vectorized across
the query rows) instead of one segment reduction over the block (``segment_reduce``: 2-4 ns a similarity on this
CPU, one op for all documents). Inference, fp32, skewed lengths (segments against one by one): 32 rows against
documents of 53 tokens on average 170 against 180 ms, 58 rows x 53 tokens 25.5 against 31, 32 x 105 73 against 55,
32 x 219 75 against 46, 107 x 106 90 against 65; the bench's 64 x 256 (915 rows x 138) 134 against 44 ms."""


def _packed_cross(Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged) -> tuple[Tensor, Tensor] | None:
    """Varlen cross product on the CPU without padding: one GEMM of the packed tokens per block (``[query rows,
    document rows]``, real similarities only), the max over each document's tokens (:func:`_block_maxima`) and the
    sum over each query's rows as a segment reduction (a document without tokens contributes 0, as in every path;
    NaN propagates; the argmax is a document's lowest token holding its max, or its first NaN, as ``torch.max``).
    None when an offset is out of range or a segment is longer than its ``max_seqlen`` (the padded path gives those
    scores NaN), or, with the argmax, when positions would not be exact in fp32 or the problem is larger than
    :data:`PACKED_ARGMAX_MAX_SIMS`."""
    q = _well_formed(rg.q_seg, Q.shape[0], rg.max_q)
    d = _well_formed(rg.d_seg, D.shape[0], rg.max_d)
    if q is None or d is None or (need_argmax and rg.max_d >= 1 << 24):
        return None
    (q_off, q_len), (d_off, d_len) = q, d
    if need_argmax and (q_off[-1] - q_off[0]) * (d_off[-1] - d_off[0]) > PACKED_ARGMAX_MAX_SIMS:
        return None
    acc = torch.float64 if Q.dtype == torch.float64 else torch.float32
    n_q, n_d, max_q = len(q_len), len(d_len), rg.max_q
    scores = torch.zeros((n_q, n_d), dtype=acc)
    # argmax by document first, then (query, token) slot, so a block's slots are written in one index_copy_; -1 = no
    # document token
    arg_slots = torch.full((n_d, n_q * max_q) if need_argmax else (0,), -1, dtype=torch.int32)
    itemsize = torch.finfo(acc).bits // 8
    d_len_t, q_len_t = torch.tensor(d_len), torch.tensor(q_len)
    for qi0, qi1 in _chunks(q_off, PACKED_QUERY_ROWS):
        r0, r1 = q_off[qi0], q_off[qi1]
        if r1 == r0:
            continue  # queries without tokens score 0
        Qb = cpu._as(Q[r0:r1], acc)
        if normalize:
            Qb = Qb * cpu._inv_norm(Qb)[:, None]
        if need_argmax:  # the (query, token) slot of each packed query row
            lengths_q = q_len_t[qi0:qi1]
            q_of_row = torch.repeat_interleave(torch.arange(qi0, qi1), lengths_q, output_size=r1 - r0)
            slots = q_of_row * max_q + (torch.arange(r0, r1) - rg.q_seg.index_select(0, q_of_row))
        for di0, di1 in _chunks(d_off, max(1, cpu.BLOCK_BYTES // (itemsize * (r1 - r0)))):
            c0, c1 = d_off[di0], d_off[di1]
            if c1 == c0:
                continue  # documents without tokens: every query token contributes 0 and chose nothing
            Db = cpu._as(D[c0:c1], acc)
            if normalize:
                Db = Db * cpu._inv_norm(Db)[:, None]
            best, arg = _block_maxima(Qb, Db, d_off[di0 : di1 + 1], d_len_t[di0:di1], need_argmax)  # [docs, rows]
            per_query = torch.segment_reduce(best.T, "sum", lengths=q_len_t[qi0:qi1], axis=0, unsafe=True)
            scores[qi0:qi1, di0:di1] = per_query
            if need_argmax:
                arg_slots[di0:di1].index_copy_(1, slots, arg)
    if not need_argmax:
        return scores, arg_slots
    return scores, arg_slots.view(n_d, n_q, max_q).transpose(0, 1).contiguous()


def _block_maxima(
    Qb: Tensor, Db: Tensor, offsets: list[int], lengths: Tensor, need_argmax: bool
) -> tuple[Tensor, Tensor | None]:
    """Each query row's max over each document's tokens, ``Qb [rows, dim]`` against the documents packed in ``Db
    [cols, dim]`` at ``offsets`` (absolute, ``[docs + 1]``; ``lengths`` the same as a tensor): ``(best [docs, rows],
    argmax [docs, rows] int32 or None)``, a document without tokens 0 and -1 (it contributes nothing).

    Documents of :data:`PER_DOCUMENT_MIN_SIMS` similarities or more are reduced one by one
    (:func:`_document_maxima`); smaller ones as segments of ``Q·Dᵀ`` (``segment_reduce``; the argmax as the segment
    minimum of the positions holding the max or NaN)."""
    rows, cols, docs = Qb.shape[0], Db.shape[0], len(offsets) - 1
    if rows * cols >= PER_DOCUMENT_MIN_SIMS * docs:
        return _document_maxima(Db @ Qb.T, [o - offsets[0] for o in offsets], need_argmax)
    seg = lengths.expand(rows, -1)
    sim = Qb @ Db.T
    best = torch.segment_reduce(sim, "max", lengths=seg, axis=1, unsafe=True)  # [rows, docs]; empty: -inf
    has_tokens = lengths > 0
    arg = None
    if need_argmax:
        doc_of_col = torch.repeat_interleave(torch.arange(docs), lengths, output_size=cols)
        hit = (sim == best.index_select(1, doc_of_col)) | torch.isnan(sim)
        # each column's position in its document: its column less the document's first column
        starts = torch.tensor(offsets[:-1]) - offsets[0]
        in_doc = (torch.arange(cols) - starts.index_select(0, doc_of_col)).to(sim.dtype)
        first = torch.segment_reduce(torch.where(hit, in_doc, float("inf")), "min", lengths=seg, axis=1, unsafe=True)
        arg = torch.where(has_tokens, first, -1.0).to(torch.int32).T
    return torch.where(has_tokens, best, best.new_zeros(())).T, arg


def _document_maxima(sim_t: Tensor, offsets: list[int], need_argmax: bool) -> tuple[Tensor, Tensor | None]:
    """``sim_t [cols, rows]`` (documents first: each document's tokens are consecutive rows) reduced document by
    document over its rows ``offsets[i] .. offsets[i + 1]``: ``(best [docs, rows], argmax [docs, rows] int32 or
    None)``; a document without tokens gives 0 and -1. One op a document, each vectorized across the query rows (a
    segment reduction over the columns of ``Q·Dᵀ`` is not: this 2-core CPU, fp32, 915 query rows against 54
    documents of 20..1000 tokens, 15.8 ms against 1.5, with the argmax 4.6)."""
    docs, rows = len(offsets) - 1, sim_t.shape[1]
    empty = any(a == b for a, b in zip(offsets[:-1], offsets[1:], strict=True))
    best = (torch.zeros if empty else torch.empty)((docs, rows), dtype=sim_t.dtype)
    arg = None
    if need_argmax:
        arg = torch.full((docs, rows), -1, dtype=torch.int64) if empty else torch.empty((docs, rows), dtype=torch.int64)
    for i in range(docs):
        a, b = offsets[i], offsets[i + 1]
        if a == b:
            continue
        if arg is None:
            torch.amax(sim_t[a:b], 0, out=best[i])  # NaN propagates
        else:
            torch.max(sim_t[a:b], 0, out=(best[i], arg[i]))  # ties: lowest token; NaN: its first
    return best, None if arg is None else arg.to(torch.int32)


def _length_classes(lengths: Tensor) -> list[tuple[Tensor, int]]:
    """``(indices, longest)`` of each length class (lengths in ``(2^(c-1), 2^c]``; 0 and 1 share the first).

    CPU tensors only (every caller checks the device first): reading the classes and maxima back is free there,
    whereas on a GPU it would be a host sync per call."""
    length_class = torch.ceil(torch.log2(lengths.clamp(min=1).double())).long()
    groups = []
    for c in torch.unique(length_class).tolist():  # no sync: CPU tensors only (see above)
        ids = (length_class == c).nonzero().squeeze(1)
        groups.append((ids, max(1, int(lengths[ids].max()))))
    return groups


BY_LENGTH_MIN_WORK = 1 << 24
"""Padded similarities (``Nq·max_q·Nd·max_d``, or ``P·max_q·max_d`` for a pair list) from which the CPU path pads
each document only to the longest of its length class (:func:`_forward_by_length`) rather than to the batch
maximum."""


def _by_length_worthwhile(Q: Tensor, D: Tensor, rg: Ragged) -> bool:
    if Q.device.type != "cpu" or Q.dim() != 2 or D.dim() != 2 or rg.q_seg is None or rg.d_seg is None:
        return False  # (reading the lengths is free on the CPU only)
    n_q, n_d = rg.q_seg.shape[0] - 1, rg.d_seg.shape[0] - 1
    return n_q * rg.max_q * n_d * rg.max_d >= BY_LENGTH_MIN_WORK


def _forward_by_length(Q: Tensor, D: Tensor, normalize: bool, need_argmax: bool, rg: Ragged) -> tuple[Tensor, Tensor]:
    """Varlen cross product with documents grouped by length class (lengths in ``(2^(c-1), 2^c]``), each group
    padded to its own longest document: with skewed lengths (20..1000 tokens) padding to the batch maximum does
    several times the work. A document's score and argmax depend on its own tokens only, so the result is the one
    of the single padded call."""
    Qp, q_valid, _q_idx, q_bad = _packed(Q, rg.q_seg, rg.max_q)
    d_idx, d_valid, d_bad = _segment_rows(rg.d_seg, D.shape[0], rg.max_d)
    n_q, n_d = Qp.shape[0], d_idx.shape[0]
    scores = torch.empty((n_q, n_d), dtype=torch.float64 if Q.dtype == torch.float64 else torch.float32)
    argmax = torch.empty((n_q, n_d, rg.max_q) if need_argmax else (0,), dtype=torch.int32)
    for ids, width in _length_classes(d_valid.sum(dim=1)):
        rows, valid = d_idx[ids, :width], d_valid[ids, :width]
        s, a = cpu.forward(Qp, _gather(D, rows)[None], q_valid, valid[None], normalize, need_argmax)
        scores[:, ids] = s
        if need_argmax:
            argmax[:, ids] = a
    bad = q_bad[:, None] | d_bad[None, :]
    return scores.masked_fill(bad, float("nan")), argmax


def _to_packed(g_pad: Tensor, seg: Tensor, rows: int) -> Tensor:
    """Gradient of padded blocks back to packed rows: each row reads its own (sequence, token) slot — a gather, so
    no atomics and no device sync. Rows outside every segment (only with invalid offsets) read slot 0."""
    r = torch.arange(rows, device=g_pad.device)
    n, max_len = g_pad.shape[0], g_pad.shape[1]
    s = (torch.searchsorted(seg[1:].long(), r, right=True)).clamp(max=max(n - 1, 0))
    t = r - seg[:-1].long()[s]
    inside = (t >= 0) & (t < max_len)
    if n == 0 or max_len == 0:
        return g_pad.new_zeros((rows, g_pad.shape[-1]))
    picked = g_pad[s, t.clamp(0, max_len - 1)]
    return torch.where(inside[:, None], picked, picked.new_zeros(()))


def backward(
    grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, normalize: bool, deterministic: bool, rg: Ragged
) -> tuple[Tensor, Tensor]:
    """As :func:`maxsim.cpu.backward` for a ragged description; gradients in Q's and D's own (packed) layout."""
    out = cpu_small.backward(grad, Q, D, argmax, normalize, rg)  # (small problems on the CPU; else None)
    if out is not None:
        return out
    if Q.device.type == "cpu" and Q.dim() == 2 and D.dim() == 2 and rg.q_seg is not None and rg.d_seg is not None:
        return _packed_backward(grad, Q, D, argmax, normalize, rg)
    dn = _Dense(Q, D, rg)
    acc = torch.float64 if Q.dtype == torch.float64 else torch.float32
    # In the accumulation dtype throughout, rounded once at the end (as the kernels do).
    Qa, Da = dn.Q.to(acc), dn.D.to(acc)
    if rg.pair_q is None:
        dQ, dD = cpu.backward(grad, Qa, Da, argmax, normalize, deterministic)
    else:
        pq, pd, _ = _pair_ids(rg, Qa.shape[0], Da.shape[1])
        dQ, dD = cpu_memory.zeros_like(Qa), cpu_memory.zeros_like(Da)
        Lq, Ld, dim = Qa.shape[1], Da.shape[2], Q.shape[-1]
        for p0, p1 in _pair_blocks(rg, (Lq + Ld) * dim * 8 * 3):
            gq, gd = cpu.backward(
                grad[:, p0:p1].reshape(-1, 1), Qa[pq[p0:p1]], Da[0, pd[p0:p1]][:, None], argmax[0, p0:p1, None],
                normalize, deterministic,
            )  # fmt: skip
            _sum_into(dQ, pq[p0:p1], gq, deterministic)
            _sum_into(dD[0], pd[p0:p1], gd[:, 0], deterministic)
    if dn.q_idx is not None:
        dQ = _to_packed(dQ, rg.q_seg, Q.shape[0])
    if dn.d_idx is not None:
        dD = _to_packed(dD[0], rg.d_seg, D.shape[0])
    return dQ.to(Q.dtype), dD.to(D.dtype)


def _sum_into(out: Tensor, ids: Tensor, values: Tensor, deterministic: bool) -> None:
    """``out[ids[i]] += values[i]``; on CUDA with ``deterministic`` through a one-hot product (no atomics)."""
    if deterministic and out.device.type != "cpu":
        onehot = (ids[None, :] == torch.arange(out.shape[0], device=out.device)[:, None]).to(values.dtype)
        out += (onehot @ values.reshape(values.shape[0], -1)).view(out.shape)
    else:
        # index_put_ (not index_add_): sequential on CPU, sort-based on CUDA; index_add_ was measured at 50+ ms for
        # tiny inputs on a loaded 2-core CPU.
        out.index_put_((ids,), values, accumulate=True)


LINK_BLOCK_BYTES = 1 << 20
"""Budget of one block of links in :func:`_packed_backward` (the rows each link gathers, in the accumulation dtype),
below :data:`maxsim.cpu.BLOCK_BYTES`: a block's gathered and weighted rows are added into the gradients while
still in cache (this 2-core CPU, fp32, dim 128, one thread, the backward alone of 1024 pairs of ``Lq 32 x Ld 180``:
78 ms in blocks of a quarter of ``BLOCK_BYTES``, 52 ms in blocks of 1 MiB; 256 pairs of ``32 x 64``: 13.4 -> 4.2 ms)."""


def _in_range(rg: Ragged, rows_q: int, rows_d: int) -> bool:
    """A pair list whose offsets all lie within ``[0, rows]`` and whose pair ids all lie within ``[0, N)``, read in
    one go from CPU tensors (the caller's: the packed backward runs on the CPU only). Then a valid link of the
    argmax (a token before the end of its query, choosing one before the end of its document) lies within the rows,
    so no clamp is needed, and no pair scored NaN for an id out of range."""
    tensors = (rg.q_seg, rg.d_seg, rg.pair_q, rg.pair_d)
    if min(t.numel() for t in tensors) == 0:
        return False  # (nothing to read: the checked path)
    q_lo, q_hi, d_lo, d_hi, pq_lo, pq_hi, pd_lo, pd_hi = torch.stack(
        [x for t in tensors for x in t.aminmax()]
    ).tolist()  # (CPU values: no sync)
    if min(q_lo, d_lo, pq_lo, pd_lo) < 0 or q_hi > rows_q or d_hi > rows_d:
        return False
    return pq_hi < rg.q_seg.numel() - 1 and pd_hi < rg.d_seg.numel() - 1


def _packed_backward(
    grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, normalize: bool, rg: Ragged
) -> tuple[Tensor, Tensor]:
    """Packed ``Q [rows_q, dim]`` and ``D [rows_d, dim]`` on the CPU: the argmax's links added straight into the
    packed gradients (:func:`maxsim.cpu.add_links`; no padded copies, deterministic on the CPU). Pairs with
    out-of-range ids (NaN scores) contribute nothing."""
    acc = torch.float64 if Q.dtype == torch.float64 else torch.float32
    Qa, Da = Q.to(acc), D.to(acc)
    Qr, Dr, scale_q, scale_d = Qa, Da, False, False
    if normalize:
        Qr, scale_q, norm_q, inv_q = cpu.normalized_rows(Qa, argmax.numel())
        Dr, scale_d, norm_d, inv_d = cpu.normalized_rows(Da, argmax.numel())
    dQ, dD = cpu_memory.zeros_like(Qa), cpu_memory.zeros_like(Da)
    if normalize:  # the rows the links touch: the only ones to project
        touched_q, touched_d = dQ.new_zeros(dQ.shape[0], dtype=torch.bool), dD.new_zeros(dD.shape[0], dtype=torch.bool)
    rows_q, rows_d, Lq = Q.shape[0], D.shape[0], argmax.shape[-1]
    if rows_q and rows_d and argmax.numel():
        # (a pair list's only: the read costs more than the clamps it saves a varlen cross product)
        in_range = rg.pair_q is not None and _in_range(rg, rows_q, rows_d)
        # Segment starts clamped as in the forward's gathers (_segment_rows), so the rows are the ones it scored;
        # with offsets and ids in range the clamps and the filter below change nothing, and are skipped.
        start_q, start_d = rg.q_seg[:-1], rg.d_seg[:-1]
        if not in_range:
            start_q, start_d = start_q.long().clamp(0, rows_q), start_d.long().clamp(0, rows_d)
        links = argmax.reshape(-1, Lq)  # [G, Lq]: one row per scored (query, document) pair
        g = grad.to(acc).reshape(-1)
        if rg.pair_q is not None:
            qi, di, bad = (rg.pair_q, rg.pair_d, None) if in_range else _pair_ids(rg, len(start_q), len(start_d))
        else:
            qi = torch.arange(start_q.shape[0]).repeat_interleave(start_d.shape[0])
            di = torch.arange(start_d.shape[0]).repeat(start_q.shape[0])
            bad = None
        step = max(1, min(cpu.BLOCK_BYTES, LINK_BLOCK_BYTES) // max(1, Lq * Q.shape[1] * Qa.element_size()))
        for g0 in range(0, links.shape[0], step):
            a = links[g0 : g0 + step].reshape(-1)
            f = (a >= 0).nonzero().squeeze(1)  # chosen links, as in cpu._backward_links
            pair = f // Lq + g0
            if bad is not None:
                keep = ~bad.index_select(0, pair)
                f, pair = f[keep], pair[keep]
            rq = start_q.index_select(0, qi.index_select(0, pair)) + f % Lq
            rd = start_d.index_select(0, di.index_select(0, pair)) + a.index_select(0, f)
            if not in_range:
                rq, rd = rq.clamp(max=rows_q - 1), rd.clamp(0, rows_d - 1)
            cpu.add_links(dQ, dD, Qr, Dr, rq, rd, g.index_select(0, pair), scale_q, scale_d)
            if normalize:
                touched_q.index_fill_(0, cpu._as(rq, torch.int64), True)
                touched_d.index_fill_(0, cpu._as(rd, torch.int64), True)
    if normalize:
        dQ = cpu.project_chosen(dQ, Qa, norm_q, inv_q, touched_q)
        dD = cpu.project_chosen(dD, Da, norm_d, inv_d, touched_d)
    return dQ.to(Q.dtype), dD.to(D.dtype)
