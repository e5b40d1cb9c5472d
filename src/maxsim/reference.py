"""Plain-PyTorch ground truth for every maxsim function.

It materializes the full ``[..., Lq, Ld]`` similarity tensor, so it is only for tests, small inputs and reading: it
defines the semantics that every fast path must reproduce (design.md §1):

* masks are boolean, ``True`` = valid; a masked document token is excluded from the max (``-inf`` before the max);
* a query token that is masked, or that sees no valid document token, contributes 0 and gets zero gradient;
* ties in the max go to the lowest document-token index (``torch.max``), so gradients are well defined;
* a NaN among a pair's valid tokens makes that score NaN;
* ``normalize=True`` scores ``x / max(||x||, 1e-12)`` per token (as ``torch.nn.functional.normalize``).

Computation happens in the dtype the inputs are given in (pass float64 for ground truth); autograd through these
functions gives the reference gradients. This module imports nothing else from the package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

NORM_EPS = 1e-12


def _normalize(x: Tensor) -> Tensor:
    return F.normalize(x, p=2.0, dim=-1, eps=NORM_EPS)


def scores_and_argmax(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
) -> tuple[Tensor, Tensor]:
    """Scores and winning token indices in the canonical candidates form.

    Args:
        Q: ``[Nq, Lq, dim]``.
        D: ``[Bd, K, Ld, dim]`` with ``Bd`` either ``Nq`` (per-query candidates) or 1 (every query sees the same
            ``K`` documents: the cross product).
        q_mask: ``[Nq, Lq]`` bool or None.
        d_mask: ``[Bd, K, Ld]`` bool or None.

    Returns:
        ``(scores [Nq, K], argmax [Nq, K, Lq] int64)``; argmax is -1 where the query token is masked or the document
        has no valid token. Scores are in the inputs' dtype and differentiable.
    """
    if normalize:
        Q, D = _normalize(Q), _normalize(D)
    Nq, Lq, _ = Q.shape
    Bd, K, Ld, _ = D.shape
    D = D.expand(Nq, K, Ld, D.shape[-1])
    sim = torch.einsum("qid,qkjd->qkij", Q, D)  # [Nq, K, Lq, Ld]
    if d_mask is not None:
        dm = d_mask.expand(Nq, K, Ld)
        sim = sim.masked_fill(~dm[:, :, None, :], float("-inf"))
        doc_has_valid = dm.any(dim=-1)  # [Nq, K]
    else:
        doc_has_valid = torch.full((Nq, K), Ld > 0, dtype=torch.bool, device=Q.device)
    if Ld == 0:
        best = sim.new_zeros((Nq, K, Lq))
        arg = torch.full((Nq, K, Lq), -1, dtype=torch.long, device=Q.device)
    else:
        best, arg = sim.max(dim=-1)  # ties -> lowest index, NaN propagates
    row_valid = doc_has_valid[:, :, None].expand(Nq, K, Lq)
    if q_mask is not None:
        row_valid = row_valid & q_mask[:, None, :]
    # torch.where (not a product) so that NaN or -inf in an excluded row cannot leak into the sum.
    contrib = torch.where(row_valid, best, torch.zeros((), dtype=best.dtype, device=best.device))
    arg = torch.where(row_valid, arg, torch.full_like(arg, -1))
    return contrib.sum(dim=-1), arg


def _as_canonical(Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None):
    squeeze_q = Q.dim() == 2
    squeeze_d = D.dim() == 2
    if squeeze_q:
        Q = Q.unsqueeze(0)
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
    if squeeze_d:
        D = D.unsqueeze(0)
        d_mask = None if d_mask is None else d_mask.unsqueeze(0)
    if D.dim() == 3:  # cross product: every query against every document
        D = D.unsqueeze(0)
        d_mask = None if d_mask is None else d_mask.unsqueeze(0)
    return Q, D, q_mask, d_mask, squeeze_q, squeeze_d


def maxsim(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
) -> Tensor:
    """Reference of :func:`maxsim.maxsim`.

    ``Q [Nq, Lq, dim]`` with ``D [Nd, Ld, dim]`` gives ``[Nq, Nd]``; with ``D [Nq, K, Ld, dim]`` it gives ``[Nq, K]``;
    a 2-D ``Q [Lq, dim]`` or ``D [Ld, dim]`` drops that axis of the result.
    """
    Qc, Dc, qm, dm, squeeze_q, squeeze_d = _as_canonical(Q, D, q_mask, d_mask)
    scores, _ = scores_and_argmax(Qc, Dc, qm, dm, normalize=normalize)
    if squeeze_d:
        scores = scores[:, 0]
    if squeeze_q:
        scores = scores[0]
    return scores


def maxsim_with_argmax(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
) -> tuple[Tensor, Tensor]:
    """Like :func:`maxsim`, plus the winning document-token index per query token (``[..., Lq]``, -1 if none)."""
    Qc, Dc, qm, dm, squeeze_q, squeeze_d = _as_canonical(Q, D, q_mask, d_mask)
    scores, arg = scores_and_argmax(Qc, Dc, qm, dm, normalize=normalize)
    if squeeze_d:
        scores, arg = scores[:, 0], arg[:, 0]
    if squeeze_q:
        scores, arg = scores[0], arg[0]
    return scores, arg


def maxsim_pairs(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
) -> Tensor:
    """Reference of :func:`maxsim.maxsim_pairs`: ``Q [B, Lq, dim]``, ``D [B, Ld, dim]`` -> ``[B]``."""
    dm = None if d_mask is None else d_mask[:, None]
    scores, _ = scores_and_argmax(Q, D[:, None], q_mask, dm, normalize=normalize)
    return scores[:, 0]


def maxsim_varlen(
    Q: Tensor,
    D: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    *,
    normalize: bool = False,
) -> Tensor:
    """Reference of the ragged cross product: packed ``Q [ΣLq, dim]``, ``D [ΣLd, dim]`` -> ``[Nq, Nd]``."""
    cq = cu_seqlens_q.tolist()
    cd = cu_seqlens_d.tolist()
    rows = []
    for i in range(len(cq) - 1):
        qi = Q[cq[i] : cq[i + 1]]
        row = [maxsim(qi, D[cd[j] : cd[j + 1]], normalize=normalize) for j in range(len(cd) - 1)]
        rows.append(torch.stack(row) if row else Q.new_zeros(0))
    return torch.stack(rows) if rows else Q.new_zeros((0, len(cd) - 1))


def maxsim_pairs_varlen(
    Q: Tensor,
    D: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    pair_q: Tensor,
    pair_d: Tensor,
    *,
    normalize: bool = False,
) -> Tensor:
    """Reference of the pair list: score ``(query pair_q[p], document pair_d[p])`` for each ``p``."""
    cq = cu_seqlens_q.tolist()
    cd = cu_seqlens_d.tolist()
    out = [
        maxsim(Q[cq[i] : cq[i + 1]], D[cd[j] : cd[j + 1]], normalize=normalize)
        for i, j in zip(pair_q.tolist(), pair_d.tolist(), strict=True)
    ]
    return torch.stack(out) if out else Q.new_zeros(0)
