"""Blockwise PyTorch twin of the Triton kernels: the path for CPU tensors (and float64 anywhere).

Works on the canonical layout of :mod:`maxsim.layout`: ``Q [Nq, Lq, dim]`` against ``D [Bd, K, Ld, dim]`` where
``Bd`` is 1 (cross product) or ``Nq`` (per-query candidates). Scores are computed one block of (queries, documents)
at a time so that the similarity block never exceeds :data:`BLOCK_BYTES`; the argmax is the only state kept for the
backward, as in the kernels (plus, for the small unmasked training steps of :func:`step_fits`, one scalar). The
backward is the list of chosen links, or for small problems two products with one-hot weights: a tiny CPU step's time
is the number of PyTorch ops it runs (3-8 µs each here), not its arithmetic. Nothing here syncs with a device beyond
what the PyTorch ops themselves do.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
from torch import Tensor

from . import cpu_memory
from .layout import NORM_EPS, accum_dtype

BLOCK_BYTES = int(os.environ.get("MAXSIM_CPU_BLOCK_BYTES", 24 * 2**20))
"""Budget, in bytes, of one similarity block ``[nq, nk, Lq, Ld]`` (plus the upcast document block). Below glibc's
largest mmap threshold (32 MiB): a larger block is a fresh mapping at every allocation, whose pages the kernel faults
in and zeroes on first touch, block after block. This 2-core CPU, fp32, full-size shapes, in-process, 64 -> 24 MiB:
inference cross 128 x 128 Lq32 Ld300 274 -> 124 ms, ColPali 1 x 500 Lq1024 Ld1024 895 -> 382; training steps 256 x 256
Ld300 2038 -> 1164 ms, 64 x 64 Lq32 Ld1024 338 -> 184, 32 x 32 Lq1024 Ld1024 2260 -> 1325, candidates 256 x 16 Ld300
266 -> 265 (32 MiB: 148 and 380 ms; 16 MiB splits problems of 16-24 MiB, whose single block is faster: candidates
32 x 7 Lq23 Ld333 dim 48 1.02 -> 1.12 ms)."""

PROJECT_BLOCK_BYTES = 1 << 21
"""Rows of a gradient projected together on the CPU (:func:`project_chosen`), in bytes of one ``[rows, dim]``
temporary. This 2-core CPU, fp32, full size, normalized training steps (min of 5, in-process): candidates 64 x 32
Lq32 Ld180 (60,131 touched rows) 145.9 ms in one block, 121.4 / 118.2 / 119.1 / 121.6 / 123.2 in blocks of 256 KB /
1 / 2 / 4 / 8 MB; candidates 256 x 16 Ld300 423.8, 333.8 / 329.5 / 329.7 / 333.6 / 345.8."""

DENSE_BACKWARD_MAX = 1 << 16
"""A CPU backward whose one-hot weights ``[Nq, Lq, K, Ld]`` have at most this many entries runs as two products
with them (:func:`_backward_one_hot`): a handful of ops instead of the ~30 of the link list, which is what a tiny
step costs here (this 2-core machine, fp32, dim 128, ``Q [4, 8]`` tokens: cross against 16 documents of 10 tokens
215 -> 92 µs, candidates 4 x 16 of 22 tokens 231 -> 123 µs, 4 x 7 of 41 216 -> 106 µs, pairs 16 x Ld 37 180 ->
71 µs; at 4 x 16 x 37 (19,456 entries) both took ~215 µs). Long documents past :data:`STEP_MAX_LD`, training step,
links -> one-hot (eager): cross 4 x 16 of Lq 8, Ld 128 (65,536 entries) 881 -> 738 µs (783), candidates 4 x 16 of 8 x
128 1228 -> 970 (1104), cross 4 x 8 of 8 x 256 703 -> 690; masked, 0.93-1.05x; at 131,072 entries 0.96-1.05x, masked
1.24x: hence 2^16 (it was 2^14). So do backwards of documents of at most
:data:`STEP_MAX_LD` tokens at any size, masked ones included (full size, 20 % of the document tokens and 10 % of the
query tokens masked, link list -> one-hot, eager: cross 32 x 32 Lq32 Ld80 15.5 -> 11.6 ms (20.0), candidates 64 x 32
Lq32 Ld32 24.6 -> 13.7 (26.5); Ld 64 9.1 -> 9.2 (13.2); Ld 128 75 -> 93: not taken)."""

STEP_MAX_LD = 96
"""Backwards of documents of at most this many tokens take the one-hot products at any size (an unmasked training step
through :func:`step_fits`, others through :func:`_one_hot_worthwhile`), in blocks of :data:`BLOCK_BYTES` of weights:
the products do ``Ld`` times the link list's multiply-adds, in GEMMs, against its gathers and ``index_add_``. Step
times on this 2-core CPU, fp32, dim 128, link list -> one-hot (eager autograd), ``--quick`` sizes in µs: cross 4 x 16,
Lq 8, Ld 37 383 -> 218 (278); candidates 4 x 16 x 37 476 -> 348 (345); cross 8 x 16, Lq 16, Ld 32 734 -> 419 (461);
candidates 16 x 16, Lq 16, Ld 64 1897 -> 1557 (1945). Full sizes in ms: cross 32 x 32, Lq 32, Ld 64 11.6 -> 8.0
(11.0), Ld 80 14.4 -> 10.1 (13.8), Ld 96 17.0 -> 11.2 (16.3), Ld 112 13.8 -> 12.7 (18.0); candidates 64 x 32, Lq 32,
Ld 32 21.6 -> 13.7 (21.9), Ld 64 40.9 -> 37.9 (47.0); cross 128 x 128, Lq 32, Ld 32 136 -> 94 (158). Longer documents
keep the link list: cross 64 x 64, Lq 32, Ld 128 66 -> 88 ms, candidates 64 x 32, Ld 180 98 -> 135, and at
``--quick`` sizes Ld 256 961 -> 1183 µs."""


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)`` without the call when it is one already (a no-op ``to`` costs ~1.5 µs of host time, which
    tiny CPU calls feel)."""
    return x if x.dtype == dtype else x.to(dtype)


def _inv_norm(x: Tensor) -> Tensor:
    return 1.0 / torch.linalg.vector_norm(x, dim=-1).clamp_min(NORM_EPS)


def _normalized(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(x̂, ||x||)`` with ``x̂ = x / max(||x||, eps)``."""
    norm = torch.linalg.vector_norm(x, dim=-1)
    return x / norm.clamp_min(NORM_EPS)[..., None], norm


def _blocks(Nq: int, K: int, Lq: int, Ld: int, dim: int, itemsize: int, shared: bool) -> tuple[int, int]:
    """Queries and documents per block so that the similarity block (and, for per-query documents, the upcast
    document block) stays within :data:`BLOCK_BYTES`."""
    per_pair = max(1, Lq * Ld * itemsize)
    per_doc = max(1, Ld * dim * itemsize)
    nk = max(1, min(K, BLOCK_BYTES // (per_pair + per_doc)))
    nq = max(1, min(Nq, BLOCK_BYTES // ((per_pair + (0 if shared else per_doc)) * nk)))
    return nq, nk


def one_block(Q: Tensor, D: Tensor) -> bool:
    """Whether the whole problem is one block of :func:`_blocks` (its similarities and upcast documents within
    :data:`BLOCK_BYTES`), checked without its arithmetic (tiny calls feel it)."""
    Nq, Lq, dim = Q.shape
    _, K, Ld, _ = D.shape
    return Nq * K * Ld * (Lq + dim) * (8 if Q.dtype == torch.float64 else 4) <= BLOCK_BYTES


def forward(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    normalize: bool,
    need_argmax: bool,
    index_dtype: torch.dtype = torch.int32,
) -> tuple[Tensor, Tensor | None]:
    """Scores ``[Nq, K]`` (fp32, fp64 for fp64 inputs) and, if asked, argmax ``[Nq, K, Lq]`` in ``index_dtype``
    (int32 or int16; -1 = none), else None."""
    return _forward(Q, D, q_mask, d_mask, normalize, need_argmax, index_dtype)[:2]


def _forward(
    Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, normalize: bool, need_argmax: bool,
    index_dtype: torch.dtype, sum_sims: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """:func:`forward`, a block at a time, plus (``sum_sims``) the sum of the unmasked similarities; an int64
    ``index_dtype`` keeps ``max``'s own indices (a transposed view where the problem is one block)."""
    Nq, Lq, dim = Q.shape
    Bd, K, Ld, _ = D.shape
    acc = accum_dtype(Q.dtype)
    if Nq == 0 or K == 0 or Lq == 0 or Ld == 0:
        scores = torch.zeros((Nq, K), dtype=acc, device=Q.device)
        argmax = torch.full((Nq, K, Lq), -1, dtype=index_dtype, device=Q.device) if need_argmax else None
        return scores, argmax, scores.new_zeros(()) if sum_sims else None
    if one_block(Q, D):
        return _forward_block(Q, D, q_mask, d_mask, normalize, need_argmax, acc, index_dtype, sum_sims)
    nq, nk = _blocks(Nq, K, Lq, Ld, dim, 8 if acc == torch.float64 else 4, Bd == 1)
    scores = torch.empty((Nq, K), dtype=acc, device=Q.device)
    argmax = torch.empty((Nq, K, Lq), dtype=index_dtype, device=Q.device) if need_argmax else None
    total = scores.new_zeros(()) if sum_sims else None
    for q0 in range(0, Nq, nq):
        q1 = min(Nq, q0 + nq)
        b0, b1 = (0, 1) if Bd == 1 else (q0, q1)
        qm = None if q_mask is None else q_mask[q0:q1]
        for k0 in range(0, K, nk):
            k1 = min(K, k0 + nk)
            dm = None if d_mask is None else d_mask[b0:b1, k0:k1]
            s, a, t = _forward_block(
                Q[q0:q1], D[b0:b1, k0:k1], qm, dm, normalize, need_argmax, acc, index_dtype, sum_sims
            )  # fmt: skip
            scores[q0:q1, k0:k1] = s
            if need_argmax:
                argmax[q0:q1, k0:k1] = a
            if sum_sims:
                total += t
    return scores, argmax, total


def _forward_block(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    normalize: bool,
    need_argmax: bool,
    acc: torch.dtype,
    index_dtype: torch.dtype,
    sum_sims: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One block: ``Q [q, Lq, dim]`` against ``D [b, k, Ld, dim]`` (``b`` = 1 or ``q``) as a single GEMM / batched
    GEMM into ``[q, Lq, k, Ld]`` (contiguous along the reduced axis), then the row max; blocks of 32 query rows a GEMM
    take it documents first instead (:func:`_block_documents_first`, :data:`DOCUMENTS_FIRST_WIDTH`). Returns the
    scores, the argmax (``[q, k, Lq]``: contiguous in ``index_dtype``, or for int64 max's own indices as a view, no
    copy) and, with ``sum_sims``, the sum of the unmasked similarities (a 0-dim tensor, not read here)."""
    q, Lq, dim = Q.shape
    b, k, Ld, _ = D.shape
    if not (normalize or need_argmax or sum_sims) and q_mask is None and d_mask is None:
        return plain_scores(q, Lq, dim, b, k, Ld, acc, Q.dtype)(Q, D), None, None
    qb, db = _as(Q, acc), _as(D, acc)
    # normalize: the documents' inverse norms scale either D (a copy) or the similarity block, whichever is smaller
    # (each document token meets Lq query rows per query that scores it; a candidate's D is the larger one)
    scale_sim = normalize and (Lq if b != 1 else q * Lq) < dim
    inv_d = None
    if normalize:
        qb = qb * _inv_norm(qb)[..., None]
        inv_d = _inv_norm(db)
        if not scale_sim:
            db = db * inv_d[..., None]
    if _documents_first(q * Lq if b == 1 else Lq, dim, q * Lq * k * Ld, need_argmax):
        return _block_documents_first(qb, db, q_mask, d_mask, need_argmax, index_dtype, sum_sims, inv_d, scale_sim)
    masked = False  # (whether the product itself left the masked document tokens at -inf)
    if b == 1:
        rows = q * Lq
        if (
            d_mask is not None and not (normalize or sum_sims) and rows >= MASKED_PRODUCT_MIN_ROWS * dim
            and qb.device.type == "cpu"
        ):  # fmt: skip
            masked = math.isfinite(float(qb.sum()))  # (a CPU scalar: not a sync; float64 on a GPU never asks)
        if masked:
            sim = _masked_product(qb.reshape(rows, dim), db.reshape(k * Ld, dim), d_mask.reshape(k * Ld))
        else:
            sim = qb.reshape(rows, dim) @ db.reshape(k * Ld, dim).T
        sim = sim.view(q, Lq, k, Ld)
    else:
        sim = torch.bmm(qb, db.reshape(q, k * Ld, dim).transpose(1, 2)).view(q, Lq, k, Ld)
    if scale_sim:
        sim.mul_(inv_d[:, None, :, :])
    total = sim.sum() if sum_sims else None
    if d_mask is not None and not masked:
        sim.masked_fill_(~d_mask[:, None, :, :], float("-inf"))
    if need_argmax:
        best, arg = sim.max(dim=-1)  # [q, Lq, k]; ties -> lowest index; NaN propagates
    else:
        best, arg = sim.amax(dim=-1), None  # NaN propagates
    return _block_scores(best, arg, q_mask, d_mask, need_argmax, index_dtype, total)


MASKED_PRODUCT_MIN_ROWS = 4
"""Query rows a token dimension (``q·Lq >= MASKED_PRODUCT_MIN_ROWS · dim``) from which a block against shared documents
with a document mask masks inside its product (:func:`_masked_product`) instead of filling the similarities with -inf
afterwards: the similarities ``[q·Lq, k·Ld]`` are then written once, and only ``D`` is copied. This 2-core CPU, fp32,
product and row max, masked fill -> masked product, by rows and dim (k·Ld of 1280 and 5120): dim 128, 128 rows
1.22x / 2.27x, 256 rows 1.10x / 0.99x, 512 rows 0.90x / 0.81x, 1024 rows 0.76x / 0.75x; dim 64, 256 rows 0.98x / 0.85x,
512 rows 0.79x / 0.70x, 1024 rows 0.71x / 0.64x."""


def _masked_product(Q: Tensor, D: Tensor, valid: Tensor) -> Tensor:
    """``Q [rows, dim] · D [n, dim]ᵀ`` with the invalid document tokens (``valid [n]`` False) at -inf, as one GEMM of
    one more dimension: ``[Q, 1] · [D·valid, bias]ᵀ`` with ``bias`` 0 or -inf. A valid token's similarity gains an exact
    ``+0``; an invalid one is ``0 + -inf`` (its garbage, NaN included, zeroed first). Every element of ``Q`` must be
    finite (``inf · 0`` is NaN)."""
    rows, dim = Q.shape
    n = D.shape[0]
    Qa = torch.empty((rows, dim + 1), dtype=Q.dtype, device=Q.device)
    Qa[:, :dim] = Q
    Qa[:, dim] = 1.0
    Da = torch.empty((n, dim + 1), dtype=D.dtype, device=D.device)
    torch.where(valid[:, None], D, D.new_zeros(()), out=Da[:, :dim])
    torch.where(valid, D.new_zeros(()), D.new_full((), float("-inf")), out=Da[:, dim])
    return Qa @ Da.T


def plain_settings() -> tuple:
    """What :func:`plain_scores`'s decisions read besides the sizes (a repeated call's signature holds it)."""
    return (BLOCK_BYTES, DOCUMENTS_FIRST_WIDTH, DOCUMENTS_FIRST_MIN_ROWS, DOCUMENTS_FIRST_MIN_DIM,
            DOCUMENTS_FIRST_MIN_SIMS)  # fmt: skip


def step_settings() -> tuple:
    """What a training step's choice of :func:`forward_for_step` reads besides the sizes (:func:`step_fits`), with
    :func:`plain_settings` (a repeated step's signature holds it)."""
    return (*plain_settings(), DENSE_BACKWARD_MAX, STEP_MAX_LD)


def plain_scores(
    q: int, Lq: int, dim: int, b: int, k: int, Ld: int, acc: torch.dtype, dtype: torch.dtype
) -> Callable[[Tensor, Tensor], Tensor]:
    """The scores ``[q, k]`` (in ``acc``) of a block without masks, normalization or argmax, ``Q [q, Lq, dim]``
    against ``D [b, k, Ld, dim]`` in ``dtype`` (``b`` = 1: shared documents, else ``q``: each query's own), as a
    function of the two: every decision of :func:`_forward_block` for these sizes taken here, once. The function
    reads its arguments through reshapes only, so it takes any tensors holding those elements in that order (a 2-D
    ``Q`` or ``D``, or a 3-D ``D`` of shared documents, as the caller gave them): a repeated call of one signature
    runs its ops and nothing else (:func:`maxsim.ops.repeat_key`; each op here costs 1-4 µs of host time). NaN
    propagates through the row max; the scores sum in ``acc`` and come back contiguous."""
    rows = q * Lq if b == 1 else Lq
    cast = (lambda x: x.to(acc)) if dtype != acc else (lambda x: x)
    if not _documents_first(rows, dim, q * Lq * k * Ld, False):

        def queries_first(Q: Tensor, D: Tensor) -> Tensor:
            if b == 1:
                sim = cast(Q).reshape(q * Lq, dim) @ cast(D).reshape(k * Ld, dim).T
            else:
                sim = torch.bmm(cast(Q).reshape(q, Lq, dim), cast(D).reshape(q, k * Ld, dim).transpose(1, 2))
            return sim.view(q, Lq, k, Ld).amax(dim=-1).sum(dim=1)

        return queries_first
    width = DOCUMENTS_FIRST_WIDTH
    if b == 1 and rows == width:  # (the common shape: no padding, no slice)

        def documents_first_shared(Q: Tensor, D: Tensor) -> Tensor:
            sim = torch.bmm(cast(D).reshape(1, k * Ld, dim), cast(Q).reshape(1, rows, dim).transpose(1, 2))
            return sim.view(k, Ld, rows).amax(dim=1).view(k, q, Lq).permute(1, 2, 0).sum(dim=1)

        return documents_first_shared
    pad = (0, 0, 0, width - rows)

    def documents_first(Q: Tensor, D: Tensor) -> Tensor:
        qm = cast(Q).reshape(b, rows, dim)
        if rows < width:
            qm = torch.nn.functional.pad(qm, pad)
        sim = torch.bmm(cast(D).reshape(b, k * Ld, dim), qm.transpose(1, 2)).view(b, k, Ld, width)
        best = sim.amax(dim=2)  # [b, k, width]; its real columns as [q, Lq, k]:
        best = best[..., :rows].reshape(k, q, Lq).permute(1, 2, 0) if b == 1 else best[..., :Lq].transpose(1, 2)
        return best.sum(dim=1)

    return documents_first


def _block_scores(
    best: Tensor, arg: Tensor | None, q_mask: Tensor | None, d_mask: Tensor | None, need_argmax: bool,
    index_dtype: torch.dtype, total: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """A block's row maxima ``best [q, Lq, k]`` (and ``arg``, their indices) as :func:`_forward_block` returns
    them: masked rows add 0 and choose -1, summed over the query tokens."""
    valid = None  # [q or 1, Lq or 1, k or 1]: rows that count
    if d_mask is not None:
        valid = d_mask.any(dim=-1)[:, None, :]  # [b, 1, k]
    if q_mask is not None:
        qv = q_mask[:, :, None]
        valid = qv if valid is None else valid & qv
    if valid is not None:
        # torch.where, not a product: a row with no valid token holds -inf (or NaN from masked inputs).
        best = torch.where(valid, best, best.new_zeros(()))
    scores = best.sum(dim=1)  # [q, k]
    if not need_argmax:
        return scores, None, total
    if valid is not None:
        arg = torch.where(valid, arg, arg.new_full((), -1))
    if index_dtype == torch.int64:
        return scores, arg.transpose(1, 2), total
    # (one copy: the transpose and the narrowing of max's int64 indices together)
    return scores, arg.transpose(1, 2).to(index_dtype, memory_format=torch.contiguous_format), total


DOCUMENTS_FIRST_WIDTH = 32
"""Query rows of one GEMM (``q·Lq`` against shared documents, ``Lq`` against a query's own) for which a CPU block
computes its similarities documents first, ``D·Qᵀ`` (:func:`_block_documents_first`), instead of ``Q·Dᵀ``: MKL streams
the long document side much faster as the left operand of a skinny product, and the row maxima then run over the middle
axis of ``[k, Ld, 32]``, which PyTorch vectorizes across the 32 query columns (at other widths, 8-48, that reduction
measured 5-20x slower). Fewer rows, down to :data:`DOCUMENTS_FIRST_MIN_ROWS` at :data:`DOCUMENTS_FIRST_MIN_DIM` dims or
more, are padded to 32 with zero rows; narrower tokens or fewer rows keep ``Q·Dᵀ``, where the padding costs more than
the orientation gains. This 2-core CPU, fp32, blocks of 24 MiB, product and row max (without / with the indices),
``Q·Dᵀ`` -> documents first, per query's candidates (batched): dim 128, 32 rows 0.66-0.68x / 0.77-0.80x, 23 rows
0.80-0.82x / 0.90-0.93x, 16 rows 0.93-0.99x / 1.08-1.15x; dim 96, 32 rows 0.65-0.67x / 0.76-0.82x, 23 rows 0.78-0.84x /
0.94-0.96x; dim 48, 32 rows 0.72-0.80x / 0.92-0.94x, 23 rows 0.91-0.98x / 1.11-1.15x; shared documents, dim 128, 32 rows
0.59x / 0.77x, 8 rows 1.06x; 64 rows and more: within 5 % either way. Whole calls: docs/performance.md (v102)."""

DOCUMENTS_FIRST_MIN_ROWS = 23
DOCUMENTS_FIRST_MIN_DIM = 64
DOCUMENTS_FIRST_MIN_SIMS = 1 << 12
DOCUMENTS_FIRST_MIN_ARGMAX_SIMS = 1 << 15
"""Similarities of a block below which it stays queries first (without / with the argmax): there its few more view
ops (~3 µs here, ~8 with the argmax's) cost more than the product saves (the launch-overhead row, 4 x 4 Lq8 Ld8,
18.3 -> 21.7 µs of host time; 4 x 16 Lq8 Ld10: 24.8 -> 23.0 µs in inference, but a training step's forward 30.5 ->
38.2 µs and whole ``--quick`` steps 1.05-1.11x slower)."""


def _documents_first(rows: int, dim: int, sims: int, need_argmax: bool) -> bool:
    """Whether a block of ``sims`` similarities whose GEMMs have ``rows`` query rows of ``dim`` dims computes them
    documents first (:data:`DOCUMENTS_FIRST_WIDTH`)."""
    if sims < (DOCUMENTS_FIRST_MIN_ARGMAX_SIMS if need_argmax else DOCUMENTS_FIRST_MIN_SIMS):
        return False
    if rows == DOCUMENTS_FIRST_WIDTH:
        return True
    return DOCUMENTS_FIRST_MIN_ROWS <= rows < DOCUMENTS_FIRST_WIDTH and dim >= DOCUMENTS_FIRST_MIN_DIM


def _block_documents_first(
    qb: Tensor, db: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, need_argmax: bool,
    index_dtype: torch.dtype, sum_sims: bool, inv_d: Tensor | None, scale_sim: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """:func:`_forward_block` as ``D·Qᵀ`` (see :data:`DOCUMENTS_FIRST_WIDTH`): ``qb [q, Lq, dim]`` and ``db [b, k,
    Ld, dim]`` in the accumulation dtype (normalized, or with the documents' inverse norms ``inv_d [b, k, Ld]`` to
    scale the similarities by where ``scale_sim``). The similarities ``[b, k, Ld, width]`` hold one column per
    query row, padded with zero rows to ``width``; the padding columns (NaN where a document token is inf or NaN)
    are never read past the row max, and are left out of ``sum_sims``'s sum."""
    q, Lq, dim = qb.shape
    b, k, Ld, _ = db.shape
    width = DOCUMENTS_FIRST_WIDTH
    rows = q * Lq if b == 1 else Lq
    qm = qb.reshape(b, rows, dim)
    if rows < width:
        qm = torch.nn.functional.pad(qm, (0, 0, 0, width - rows))
    sim = torch.bmm(db.reshape(b, k * Ld, dim), qm.transpose(1, 2)).view(b, k, Ld, width)
    if scale_sim:
        sim.mul_(inv_d[..., None])
    total = sim[..., :rows].sum() if sum_sims else None
    if d_mask is not None:
        sim.masked_fill_(~d_mask[..., None], float("-inf"))
    # (ties -> lowest index, NaN propagates: as max over the last axis)
    best, arg = sim.max(dim=2) if need_argmax else (sim.amax(dim=2), None)  # [b, k, width]

    def queries_first(x: Tensor) -> Tensor:  # [b, k, width] -> a [q, Lq, k] view of its real columns
        return x[..., :rows].reshape(k, q, Lq).permute(1, 2, 0) if b == 1 else x[..., :Lq].transpose(1, 2)

    return _block_scores(
        queries_first(best), None if arg is None else queries_first(arg), q_mask, d_mask, need_argmax, index_dtype,
        total,
    )  # fmt: skip


def step_fits(Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, normalize: bool) -> bool:
    """Whether a training step on canonical ``Q``, ``D`` takes :func:`forward_for_step` and
    :func:`backward_for_step`: CPU tensors, no masks, nothing empty, and one-hot weights of at most
    :data:`DENSE_BACKWARD_MAX` entries or documents of at most :data:`STEP_MAX_LD` tokens."""
    Nq, Lq, _ = Q.shape
    _, K, Ld, _ = D.shape
    entries = Nq * K * Lq * Ld
    return (
        Q.device.type == "cpu" and q_mask is None and d_mask is None and entries > 0
        and (entries <= DENSE_BACKWARD_MAX or Ld <= STEP_MAX_LD)
    )  # fmt: skip


def forward_for_step(Q: Tensor, D: Tensor, normalize: bool, index_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The forward of a training step where :func:`step_fits`: the scores, the argmax ``[Nq, K, Lq]`` and the sum of
    every similarity. A problem of one block keeps ``max``'s own int64 indices (a transposed view: a conversion and a
    copy fewer on each side of the step, which a tiny step feels; a few KB at those sizes); a larger one saves
    ``index_dtype``. The sum is finite exactly when every token is (each token meets every token of the other side in
    a similarity; an overflow only errs on the safe side; with ``normalize``, of the normalized tokens), so
    :func:`backward_for_step` reads it instead of summing the tokens again."""
    return _forward(Q, D, None, None, normalize, True, torch.int64 if one_block(Q, D) else index_dtype, True)


def backward_for_step(
    grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, normalize: bool, sims_sum: Tensor
) -> tuple[Tensor, Tensor]:
    """The backward after :func:`forward_for_step`: the one-hot products where every token is finite, else the
    link list (reads a CPU scalar: not a sync)."""
    if math.isfinite(float(sims_sum)):
        if normalize:
            return _backward_one_hot_normalized(grad, Q, D, argmax, all_chosen=True)
        return _backward_one_hot(grad, Q, D, argmax, all_chosen=True)
    return _backward_links(grad, Q, D, _as(argmax, torch.int32), normalize)


def backward(
    grad: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    normalize: bool,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor]:
    """Gradients ``(dQ like Q, dD like D)`` from the saved argmax; masks are already folded into it (-1).

    On the CPU: two products with one-hot weights where :func:`_one_hot_worthwhile` (small problems and short
    documents, every token finite; with ``normalize``, of the normalized tokens, then the chain rule), else
    :func:`add_links` over the chosen links (``index_add_`` runs in index order there); both deterministic. On other
    devices ``index_add_`` uses atomics, so ``deterministic=True`` there selects the tokens with a one-hot product
    instead (fixed summation order).
    """
    if Q.numel() == 0 or D.numel() == 0:  # no token pair: nothing chosen (a one-hot of 0 tokens has no column)
        return torch.zeros_like(Q), torch.zeros_like(D)
    if Q.device.type == "cpu" and _one_hot_worthwhile(Q, D):
        if normalize:
            return _backward_one_hot_normalized(grad, Q, D, argmax)
        return _backward_one_hot(grad, Q, D, argmax)
    argmax = _as(argmax, torch.int32)  # (saved as int16 where the documents allow it)
    if Q.device.type == "cpu":
        return _backward_links(grad, Q, D, argmax, normalize)
    Nq, Lq, dim = Q.shape
    Bd, K, Ld, _ = D.shape
    acc = accum_dtype(Q.dtype)
    dQ = cpu_memory.zeros((Nq, Lq, dim), acc, Q.device)
    dD = cpu_memory.zeros((Bd, K, Ld, dim), acc, Q.device)
    if Nq == 0 or K == 0 or Lq == 0 or Ld == 0:
        return dQ.to(Q.dtype), dD.to(D.dtype)
    Qa, Da = Q.to(acc), D.to(acc)
    if normalize:
        (Qa, norm_q), (Da, norm_d) = _normalized(Qa), _normalized(Da)
    chosen = argmax >= 0  # [Nq, K, Lq]
    # (a select, not a product: a token that chose nothing gets no NaN of its pair's gradient)
    weight = torch.where(chosen, grad.to(acc)[:, :, None], 0.0)  # [Nq, K, Lq]
    idx = argmax.clamp_min(0).long()
    per_query = K * Lq * (2 * dim + (Ld if deterministic else 0)) * (torch.finfo(acc).bits // 8)
    nq = max(1, min(Nq, BLOCK_BYTES // per_query))
    dD_flat = dD.view(Bd * K * Ld, dim)
    for q0 in range(0, Nq, nq):
        q1 = min(Nq, q0 + nq)
        w, ix = weight[q0:q1], idx[q0:q1]  # [q, K, Lq]
        # Flat row index of the winning document token in D viewed as [Bd*K*Ld, dim].
        b = torch.zeros((q1 - q0, 1, 1), dtype=torch.long, device=Q.device)
        if Bd != 1:
            b = torch.arange(q0, q1, device=Q.device)[:, None, None]
        rows = (b * K + torch.arange(K, device=Q.device)[None, :, None]) * Ld + ix  # [q, K, Lq]
        hit = chosen[q0:q1, :, :, None]
        zero = Da.new_zeros(())
        # torch.where, not a product with 0: an unchosen (masked) token may hold NaN or inf.
        picked = torch.where(hit, Da.reshape(Bd * K * Ld, dim)[rows], zero)  # [q, K, Lq, dim]
        dQ[q0:q1] = torch.einsum("qkl,qkld->qld", w, picked)
        contrib = torch.where(hit, w[..., None] * Qa[q0:q1, None, :, :], zero)  # [q, K, Lq, dim]
        if deterministic and Q.device.type != "cpu":
            onehot = (ix[..., None] == torch.arange(Ld, device=Q.device)).to(acc)  # [q, K, Lq, Ld]
            per_query = torch.einsum("qklj,qkld->qkjd", onehot, contrib)  # [q, K, Ld, dim]
            if Bd == 1:
                dD[0] += per_query.sum(dim=0)
            else:
                dD[q0:q1] = per_query
        else:
            dD_flat.index_add_(0, rows.reshape(-1), contrib.reshape(-1, dim))
    if normalize:
        dQ = project_normalized_grad(dQ, Qa, norm_q)
        dD = project_normalized_grad(dD, Da, norm_d)
    return dQ.to(Q.dtype), dD.to(D.dtype)


def add_links(
    dQ: Tensor, dD: Tensor, Q: Tensor, D: Tensor, rows_q: Tensor, rows_d: Tensor, w: Tensor,
    scale_q: bool = False, scale_d: bool = False,
) -> None:  # fmt: skip
    """For every link ``i`` (query row ``rows_q[i]`` chose document row ``rows_d[i]``, upstream weight ``w[i]``):
    ``dQ[rows_q[i]] += w[i] · D[rows_d[i]]`` and ``dD[rows_d[i]] += w[i] · Q[rows_q[i]]``, on flat ``[rows, dim]``
    tensors. Only chosen rows are read, so a masked token holding NaN or inf never reaches a gradient. ``scale_q`` /
    ``scale_d`` (``normalize``, see :func:`normalized_rows`): the gathered rows are normalized as they are read."""
    d_rows = torch.index_select(D, 0, rows_d)
    q_rows = torch.index_select(Q, 0, rows_q)
    if scale_d:
        d_rows = d_rows * _inv_norm(d_rows)[:, None]
    if scale_q:
        q_rows = q_rows * _inv_norm(q_rows)[:, None]
    dQ.index_add_(0, rows_q, d_rows * w[:, None])
    dD.index_add_(0, rows_d, q_rows * w[:, None])


def normalized_rows(x: Tensor, n_links: int) -> tuple[Tensor, bool, Tensor | None, Tensor | None]:
    """For a backward over ``n_links`` links with normalize: ``(rows to gather, whether to normalize them as they
    are read, ||x||, 1 / max(||x||, eps))`` of the flat rows ``x``. A tensor with fewer rows than links is
    normalized once (a copy); one with more (a large D's candidates, most rows never chosen) is normalized link by
    link, and its norms are left to :func:`project_chosen` (None: only the rows it projects need them)."""
    if x.shape[0] > n_links:
        return x, True, None, None
    norm = torch.linalg.vector_norm(x, dim=-1)
    inv = 1.0 / norm.clamp_min(NORM_EPS)
    return x * inv[:, None], False, norm, inv


def project_chosen(
    g_hat: Tensor, x: Tensor, norm: Tensor | None, inv: Tensor | None, touched: Tensor | None = None
) -> Tensor:
    """:func:`project_normalized_grad` of the flat rows ``g_hat [rows, dim]`` (w.r.t. ``x̂``), given ``x``'s rows and
    their norms and inverse norms (None: computed here for the rows that need them). Where few rows received a
    gradient (a large D's candidates), only those are read and projected (a ``nonzero``: for the CPU path) and written
    back in place; the others stay exactly zero. ``touched [rows]`` (bool): the rows that links added to, which the
    caller knows, else found by a pass over ``g_hat`` (at full size that pass and its boolean copy cost more than the
    projection: candidates 64 x 32 Lq32 Ld180, normalized training step on this CPU, ~60 of ~240 ms)."""
    rows = (touched if touched is not None else (g_hat != 0).any(dim=-1)).nonzero().squeeze(1)
    if 2 * rows.shape[0] > g_hat.shape[0]:
        if norm is None:
            norm = torch.linalg.vector_norm(x, dim=-1)
            inv = 1.0 / norm.clamp_min(NORM_EPS)
        return project_normalized_grad(g_hat, x * inv[:, None], norm)
    # On the CPU, blocks of rows whose temporaries stay in the caches (and are reused by the allocator instead of
    # being fresh pages each): candidates 64 x 32 Lq32 Ld180, normalized training step, 60,131 rows in one block
    # spent ~45 ms in six passes over 31 MB temporaries.
    step = max(1, PROJECT_BLOCK_BYTES // (x.shape[1] * x.element_size())) if x.device.type == "cpu" else len(rows)
    for r0 in range(0, rows.shape[0], step):
        block = rows[r0 : r0 + step]
        x_rows = x.index_select(0, block)
        if norm is None:
            norm_rows = torch.linalg.vector_norm(x_rows, dim=-1)
            inv_rows = 1.0 / norm_rows.clamp_min(NORM_EPS)
        else:
            norm_rows, inv_rows = norm.index_select(0, block), inv.index_select(0, block)
        projected = project_normalized_grad(g_hat.index_select(0, block), x_rows * inv_rows[:, None], norm_rows)
        g_hat.index_copy_(0, block, projected)
    return g_hat  # (a row that nothing touched is zero already)


def _backward_links(grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, normalize: bool) -> tuple[Tensor, Tensor]:
    """CPU backward: the argmax as a list of links between flat token rows, a block of queries at a time (the
    gathered rows of a block stay within :data:`BLOCK_BYTES`)."""
    Nq, Lq, dim = Q.shape
    Bd, K, Ld, _ = D.shape
    acc = accum_dtype(Q.dtype)
    Qa, Da = _as(Q, acc), _as(D, acc)
    Qf, Df = Qa.reshape(Nq * Lq, dim), Da.reshape(Bd * K * Ld, dim)
    scale_q = scale_d = False
    if normalize:
        Qf, scale_q, norm_q, inv_q = normalized_rows(Qf, Nq * K * Lq)
        Df, scale_d, norm_d, inv_d = normalized_rows(Df, Nq * K * Lq)
    dQ, dD = cpu_memory.zeros_like(Qf), cpu_memory.zeros_like(Df)
    if normalize:  # the rows the links touch: the only ones to project
        touched_q, touched_d = dQ.new_zeros(dQ.shape[0], dtype=torch.bool), dD.new_zeros(dD.shape[0], dtype=torch.bool)
    if Nq and K and Lq and Ld:
        nq = max(1, min(Nq, BLOCK_BYTES // max(1, K * Lq * dim * Qf.element_size() * 4)))
        for q0 in range(0, Nq, nq):
            q1 = min(Nq, q0 + nq)
            a = argmax[q0:q1].reshape(-1)  # flat over [q, K, Lq]
            # Positions of the chosen links, then their rows by integer arithmetic (cheaper than masking several
            # [q, K, Lq] index tensors).
            f = (a >= 0).nonzero().squeeze(1)
            pair = f // Lq  # (query - q0) * K + k
            q = pair // K + q0
            doc = (q if Bd != 1 else 0) * K + pair % K  # row of document (b, k) in [Bd * K]
            w = _as(grad[q0:q1], acc).reshape(-1).index_select(0, pair)
            rows_q, rows_d = q * Lq + f % Lq, doc * Ld + a.index_select(0, f)
            add_links(dQ, dD, Qf, Df, rows_q, rows_d, w, scale_q, scale_d)
            if normalize:
                touched_q.index_fill_(0, _as(rows_q, torch.int64), True)
                touched_d.index_fill_(0, _as(rows_d, torch.int64), True)
    if normalize:
        dQ = project_chosen(dQ, Qa.reshape(Nq * Lq, dim), norm_q, inv_q, touched_q)
        dD = project_chosen(dD, Da.reshape(Bd * K * Ld, dim), norm_d, inv_d, touched_d)
    dQ, dD = dQ.view(Nq, Lq, dim), dD.view(Bd, K, Ld, dim)
    return _as(dQ, Q.dtype), _as(dD, D.dtype)


def _one_hot_worthwhile(Q: Tensor, D: Tensor) -> bool:
    """Small enough for :func:`_backward_one_hot` (:data:`DENSE_BACKWARD_MAX`) or of documents short enough
    (:data:`STEP_MAX_LD`, the products then in blocks), and every token finite: a product with one-hot weights
    multiplies every token by something (0 · inf is NaN), where the link list reads only the chosen ones. A sum is
    finite only if every term is (one that overflows sends the call to the link list, which is exact too). CPU
    tensors only: the sums are read as Python floats (a read of CPU memory, not a sync; ~2 µs against ~6 for
    ``isfinite`` on them)."""
    Nq, Lq, _ = Q.shape
    _, K, Ld, _ = D.shape
    if Nq * K * Lq * Ld > DENSE_BACKWARD_MAX and Ld > STEP_MAX_LD:
        return False
    return all_finite(Q, D)


def all_finite(Q: Tensor, D: Tensor) -> bool:
    """Whether every element of the CPU tensors ``Q`` and ``D`` is finite, as their sums: finite only if every term
    is (one that overflows answers False, and the caller takes its exact path for inf too). Reads the sums as Python
    floats: CPU tensors only (a read of CPU memory, not a sync; ~2 µs against ~6 for ``isfinite`` on them)."""
    acc = accum_dtype(Q.dtype)  # (a float64 sum of fp32 tokens costs 4x the fp32 one; isfinite().all() 24x)
    if torch.is_grad_enabled():  # (a backward that records its graph: the check is no part of it)
        Q, D = Q.detach(), D.detach()
    return math.isfinite(float(Q.sum(dtype=acc)) + float(D.sum(dtype=acc)))


def _backward_one_hot(
    grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, all_chosen: bool = False
) -> tuple[Tensor, Tensor]:
    """:func:`_backward_links` of a problem with finite tokens, as two products with the one-hot weights
    ``W[q, i, k, j] = grad[q, k]`` where query token ``i`` of pair ``(q, k)`` chose document token ``j`` (0 elsewhere,
    and for a token that chose nothing, -1): ``dQ = W · D`` and ``dD = Wᵀ · Q``, a block of queries at a time (W of at
    most :data:`BLOCK_BYTES`; a shared document's gradient summed over the blocks in order). The same terms as the
    link list, plus exact zeros, summed in another order. ``all_chosen``: no -1 in ``argmax`` (no masks), so W is a
    scatter."""
    Nq, Lq, dim = Q.shape
    Bd, K, Ld, _ = D.shape
    acc = accum_dtype(Q.dtype)
    Qa, Da = _as(Q, acc), _as(D, acc)
    grad = _as(grad, acc)
    n = K * Ld
    nq = max(1, min(Nq, BLOCK_BYTES // max(1, Lq * n * (8 if acc == torch.float64 else 4))))
    if nq == Nq:  # (one block: the fewest ops)
        w = _one_hot_weights(grad, argmax, Ld, all_chosen)
        if Bd == 1:
            w = w.reshape(Nq * Lq, n)
            dQ = (w @ Da.reshape(n, dim)).view(Nq, Lq, dim)
            dD = (w.T @ Qa.reshape(Nq * Lq, dim)).view(1, K, Ld, dim)
        else:
            w = w.reshape(Nq, Lq, n)
            dQ = torch.bmm(w, Da.reshape(Nq, n, dim))
            dD = torch.bmm(w.transpose(1, 2), Qa).view(Nq, K, Ld, dim)
        return _as(dQ, Q.dtype), _as(dD, D.dtype)
    dQ = torch.empty((Nq, Lq, dim), dtype=acc, device=Q.device)
    dD = (torch.zeros if Bd == 1 else torch.empty)((Bd, K, Ld, dim), dtype=acc, device=Q.device)
    for q0 in range(0, Nq, nq):
        q1 = min(Nq, q0 + nq)
        w = _one_hot_weights(grad[q0:q1], argmax[q0:q1], Ld, all_chosen)
        if Bd == 1:
            w = w.reshape((q1 - q0) * Lq, n)
            torch.mm(w, Da.reshape(n, dim), out=dQ[q0:q1].view(-1, dim))
            dD.view(n, dim).addmm_(w.T, Qa[q0:q1].reshape(-1, dim))
        else:
            w = w.reshape(q1 - q0, Lq, n)
            torch.bmm(w, Da[q0:q1].reshape(q1 - q0, n, dim), out=dQ[q0:q1])
            torch.bmm(w.transpose(1, 2), Qa[q0:q1], out=dD[q0:q1].view(q1 - q0, n, dim))
    return _as(dQ, Q.dtype), _as(dD, D.dtype)


def _backward_one_hot_normalized(
    grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, all_chosen: bool = False
) -> tuple[Tensor, Tensor]:
    """:func:`_backward_one_hot` of ``normalize=True`` (finite tokens): the products with the normalized tokens, then
    the chain rule through the normalization (:func:`project_normalized_grad`; a token that received no gradient
    gets exactly zero from the formula itself, its tokens being finite)."""
    acc = accum_dtype(Q.dtype)
    (Qh, norm_q), (Dh, norm_d) = _normalized(_as(Q, acc)), _normalized(_as(D, acc))
    dQh, dDh = _backward_one_hot(grad, Qh, Dh, argmax, all_chosen)
    dQ = project_normalized_grad(dQh, Qh, norm_q, finite=True)
    dD = project_normalized_grad(dDh, Dh, norm_d, finite=True)
    return _as(dQ, Q.dtype), _as(dD, D.dtype)


def _one_hot_weights(grad: Tensor, argmax: Tensor, Ld: int, all_chosen: bool) -> Tensor:
    """``W [q, Lq, K, Ld]`` of :func:`_backward_one_hot` from ``grad [q, K]`` (the accumulation dtype) and
    ``argmax [q, K, Lq]`` (any int dtype)."""
    q, K = grad.shape
    chosen = argmax.transpose(1, 2)  # [q, Lq, K]
    w = torch.zeros((*chosen.shape, Ld), dtype=grad.dtype, device=grad.device)
    if all_chosen:
        return w.scatter_(3, chosen.long().unsqueeze(-1), grad.view(q, 1, K, 1).expand(*chosen.shape, 1))
    # A token that chose nothing (-1) scatters 0 to token 0 (its row of W holds nothing else): the fix-ups touch the
    # [q, Lq, K] indices, not W.
    weight = torch.where(chosen >= 0, grad.view(q, 1, K), 0.0)
    return w.scatter_(3, chosen.long().clamp_min_(0).unsqueeze(-1), weight.unsqueeze(-1))


def project_normalized_grad(g_hat: Tensor, x_hat: Tensor, norm: Tensor, finite: bool = False) -> Tensor:
    """Chain a gradient w.r.t. ``x̂ = x / max(||x||, eps)`` back to ``x``: ``(ĝ − x̂ <x̂, ĝ>) / ||x||``.

    ``norm`` is the unclamped ``||x||``; below ``eps`` the normalization is a plain scaling by ``1/eps`` and the
    projection term vanishes. All tensors in the accumulation dtype; per token, O(tokens × dim).
    """
    # (three passes over the gradient: the radial part, with no projection where the norm is clamped, taken out of
    # ĝ and scaled in place; the per-token factors are small tensors)
    radial = torch.linalg.vecdot(x_hat, g_hat).masked_fill_(norm < NORM_EPS, 0.0).unsqueeze(-1)
    grad = torch.addcmul(g_hat, x_hat, radial, value=-1.0).mul_((1.0 / norm.clamp_min(NORM_EPS)).unsqueeze(-1))
    if not finite and norm.device.type == "cpu":
        # (a finite norm means a finite token; the per-token norms are read as a Python bool: CPU memory, no sync.
        # Full size, candidates 64 x 32 Lq32 Ld180, normalized training step on this CPU: the mask and its select
        # below were ~20 of ~160 ms)
        finite = bool(torch.isfinite(norm).all())
    if finite:  # (every token finite: where g_hat is zero the formula gives exactly zero)
        return grad
    # A token that received no gradient (masked, or never the max) gets exactly zero, even if it holds NaN/inf.
    return grad.masked_fill_(~(g_hat != 0).any(dim=-1, keepdim=True), 0.0)
