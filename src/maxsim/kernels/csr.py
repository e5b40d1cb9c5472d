"""Grouping a pair list by query or by document (a CSR index) in one kernel launch, for short lists.

The backward of a pair list needs, per document (and per query in deterministic mode), the pairs that scored it,
in increasing pair order: ``offsets [n + 1]`` and ``order [P]``, group ``i`` being ``order[offsets[i]:offsets[i+1]]``.
A stable ``torch.sort`` plus ``searchsorted`` builds it in five small launches (sort, its copies, two ``arange``s,
``searchsorted``): about 100 µs of host time, the largest part of a small pair-list training step, which is
host-bound. For short lists this kernel builds the same index in one launch by counting instead of sorting:

* pair ``p`` goes to position ``#{p' : id[p'] < id[p]} + #{p' < p : id[p'] == id[p]}`` (a stable counting sort);
* ``offsets[i] = #{p : id[p] < i}``.

That is ``P · (P + n)`` comparisons, a few microseconds of GPU time while it stays under :data:`MAX_WORK`; longer
lists take the sort. Both give the same groups in the same order, so the choice (made from shapes only) never
changes a result. Ids outside ``[0, n)`` belong to no group (the forward already gave their pairs a NaN score).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .sizes import cdiv

# P · (P + n) comparisons at most: with 64 x 128 tiles, at most ~4k tiles spread over the programs.
MAX_WORK = 1 << 25
BP, BC = 64, 128  # rows (pairs or offsets) per program, ids compared per step


@triton.jit
def _grouped(ids, n):
    """Ids as int32 group numbers; anything outside [0, n) becomes n (after every group)."""
    return tl.where((ids >= 0) & (ids < n), ids, n).to(tl.int32)


@triton.jit(do_not_specialize=["P", "n", "n_pblocks"])
def csr_count_kernel(IDS, OFFSETS, ORDER, P, n, n_pblocks, BP: tl.constexpr, BC: tl.constexpr):
    """Programs ``[0, n_pblocks)`` place ``BP`` pairs each in ``ORDER``; the rest write ``BP`` offsets each."""
    # Which half this program is in, as a vector: masks instead of branches keep one code path, and Triton's
    # interpreter rejects a scalar bool combined into a mask.
    pid = tl.program_id(0) + tl.zeros([BP], dtype=tl.int32)
    placing = pid < n_pblocks
    offsetting = pid >= n_pblocks
    row = tl.where(placing, pid, pid - n_pblocks) * BP + tl.arange(0, BP)
    pair_ok = placing & (row < P)
    offset_ok = offsetting & (row <= n)
    key = tl.where(placing, _grouped(tl.load(IDS + row, mask=pair_ok, other=0), n), row)
    count = tl.zeros([BP], dtype=tl.int32)
    for c0 in range(0, P, BC):
        col = c0 + tl.arange(0, BC)
        col_ok = col < P
        other = _grouped(tl.load(IDS + col, mask=col_ok, other=0), n)
        same_before = placing[:, None] & (other[None, :] == key[:, None]) & (col[None, :] < row[:, None])
        before = (other[None, :] < key[:, None]) | same_before
        count += tl.sum((before & col_ok[None, :]).to(tl.int32), axis=1)
    tl.store(ORDER + count, row, mask=pair_ok)
    tl.store(OFFSETS + row, count, mask=offset_ok)


def grid(P: int, n: int) -> tuple[int, int]:
    """``(programs, pair-placing programs)`` of :func:`csr_count_kernel` for ``P`` pairs and ``n`` groups."""
    n_pblocks = cdiv(P, BP)
    return n_pblocks + cdiv(n + 1, BP), n_pblocks
