"""dD of a large cross product as a gather: the links grouped by the document token they chose, then summed per token.

A link is one query token's choice: link ``l = (q * K + k) * Lq + t`` of the argmax ``[Nq, K, Lq]`` chose document
token ``a = argmax[q, k, t]`` of document ``k`` (``-1``: none), and adds ``g[q, k] · Q[q, t]`` to ``dD[k, a]``. fp32
atomics do that in any order; the deterministic owner programs (backward.py) each walk every query for a block of
document tokens, which a 32×32 cross product of 1024-token queries and documents (a million links) turns into 1.5 ms
on an H100. Here:

1. :func:`link_keys_kernel` writes each link's destination row ``k * Ld + a`` (``-1`` where none);
2. ``launch.csr`` groups the links by destination row, in increasing link order (a stable sort);
3. :func:`dd_gather_kernel`, one program per document token, sums its links' weighted query rows in that order and
   writes the row once, in D's dtype (chained through the normalization with ``normalize``): no buffer, no cast,
   no atomics, and the same bits on every run.

Only ``backward="deterministic"`` of dense layouts (``Q [Nq, Lq, dim]``, ``D [1, K, Ld, dim]``) takes this path
(``launch_settings.SORTED_DD_MIN_LINKS``), where the owner programs (each walking every query) would cost more; the fast
backward keeps the atomics, which cost less GPU time than sort and gather together.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..layout import NORM_EPS as NORM_EPS_VALUE
from .normalize import project_rows
from .sizes import cdiv

NORM_EPS: tl.constexpr = tl.constexpr(NORM_EPS_VALUE)
BL = 1024  # links per program of link_keys_kernel
CHUNK = 16  # links gathered per step of a document token's sum (one warp: launch_settings.SORTED_DD_WARPS)


@triton.jit(do_not_specialize=["n_links", "K", "Lq", "Ld"])
def link_keys_kernel(ARG, KEYS, n_links, K, Lq, Ld, BL: tl.constexpr):
    """``KEYS[l] = k * Ld + argmax[l]`` for link ``l`` of document ``k``, ``-1`` where the token chose nothing."""
    link = tl.program_id(0).to(tl.int64) * BL + tl.arange(0, BL)
    ok = link < n_links
    a = tl.load(ARG + link, mask=ok, other=-1).to(tl.int32)
    doc = (link // Lq) % K
    tl.store(KEYS + link, tl.where(a >= 0, doc * Ld + a, -1).to(tl.int32), mask=ok)


@triton.jit(do_not_specialize=["K", "Lq", "Ld", "sg"])
def dd_gather_kernel(
    G, Q, INV_Q, D, ORDER, OFF, DD,
    K, Lq, Ld, dim,
    sq_n, sq_l, sd_k, sd_l, sdd_k, sdd_l, sg,
    CHUNK: tl.constexpr, DIM_P: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    """Program ``r = k * Ld + j`` writes ``dD[k, j] = Σ g[q, k] · Q[q, t]`` over the links ``ORDER[OFF[r]:OFF[r+1]]``
    (with ``NORMALIZE``: ``Q`` scaled by its inverse norms ``INV_Q [Nq * Lq]``, and the row chained through the
    normalization of ``D[k, j]`` before it is stored)."""
    r = tl.program_id(0).to(tl.int64)
    k = r // Ld
    j = r - k * Ld
    kd = tl.arange(0, DIM_P)
    kd_ok = kd < dim
    lo = tl.load(OFF + r)
    hi = tl.load(OFF + r + 1)
    acc = tl.zeros([DIM_P], dtype=tl.float32)
    for c0 in range(lo, hi, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        ok = idx < hi
        link = tl.load(ORDER + idx, mask=ok, other=0).to(tl.int64)
        p = link // Lq  # the pair q * K + k
        t = link - p * Lq
        q = p // K
        w = tl.load(G + p * sg, mask=ok, other=0.0)
        if NORMALIZE:
            w = w * tl.load(INV_Q + q * Lq + t, mask=ok, other=0.0)
        rows = tl.load(
            Q + q[:, None] * sq_n + t[:, None] * sq_l + kd[None, :], mask=ok[:, None] & kd_ok[None, :], other=0.0
        )
        acc += tl.sum(rows.to(tl.float32) * w[:, None], axis=0)
    if NORMALIZE:
        x = tl.load(D + k * sd_k + j * sd_l + kd, mask=kd_ok, other=0.0).to(tl.float32)
        acc = tl.reshape(project_rows(tl.reshape(acc, [1, DIM_P]), tl.reshape(x, [1, DIM_P]), NORM_EPS), [DIM_P])
    tl.store(DD + k * sdd_k + j * sdd_l + kd, acc.to(DD.dtype.element_ty), mask=kd_ok)


def keys_grid(n_links: int) -> int:
    return cdiv(n_links, BL)
