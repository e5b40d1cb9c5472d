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
        best = sim.sum(dim=-1)  # zeros (an empty sum), still attached to the graph: gradients flow (as zeros)
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


def _pad_packed(X: Tensor, cu_seqlens: Tensor, max_seqlen: int | None) -> tuple[Tensor, Tensor]:
    """Packed rows ``X [ΣL, dim]`` with offsets ``cu_seqlens [N+1]`` -> zero-padded ``[N, L, dim]`` and mask ``[N, L]``.

    ``L`` is ``max_seqlen`` when given (it must bound every length), else the longest sequence. Padding is zeros (not
    copies of real rows) so that no value of another sequence, NaN included, can reach a gradient through it.
    Differentiable: the gradient of a padded slot goes back to its packed row.
    """
    cu = cu_seqlens.detach().to(device=X.device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    width = longest if max_seqlen is None else int(max_seqlen)
    if width < longest:
        raise ValueError(f"max_seqlen {width} is smaller than the longest sequence ({longest})")
    N = lengths.numel()
    pos = torch.arange(width, device=X.device)
    mask = pos[None, :] < lengths[:, None]  # [N, L]
    flat = torch.zeros((N * width, X.shape[-1]), dtype=X.dtype, device=X.device)
    rows = (cu[:-1, None] + pos[None, :])[mask]  # packed row of each valid slot, in slot order
    slots = mask.reshape(-1).nonzero().squeeze(-1)
    flat = flat.index_put((slots,), X[rows])
    return flat.reshape(N, width, X.shape[-1]), mask


def _lengths_mask(lengths: Tensor, L: int) -> Tensor:
    """``mask[..., t] = t < lengths[...]`` for ``t`` in ``[0, L)``."""
    return torch.arange(L, device=lengths.device) < lengths.to(torch.long)[..., None]


def maxsim_varlen_with_argmax(
    Q: Tensor,
    D: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    normalize: bool = False,
) -> tuple[Tensor, Tensor]:
    """Ragged cross product with the winning token indices.

    Packed ``Q [ΣLq, dim]`` (offsets ``cu_seqlens_q [Nq+1]``) against packed ``D [ΣLd, dim]`` (``cu_seqlens_d
    [Nd+1]``): every query against every document.

    Returns:
        ``(scores [Nq, Nd], argmax [Nq, Nd, Lq] int64)`` with ``Lq`` = ``max_seqlen_q`` if given, else the longest
        query. ``argmax[i, j, t]`` is the winning token's index inside document ``j`` (0-based, relative to the
        document's first row); -1 for ``t`` beyond query ``i``'s length or when document ``j`` is empty.
    """
    Qp, q_mask = _pad_packed(Q, cu_seqlens_q, max_seqlen_q)
    Dp, d_mask = _pad_packed(D, cu_seqlens_d, max_seqlen_d)
    return scores_and_argmax(Qp, Dp[None], q_mask, d_mask[None], normalize=normalize)


def maxsim_varlen(
    Q: Tensor,
    D: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    *,
    normalize: bool = False,
) -> Tensor:
    """Reference of the ragged cross product: packed ``Q [ΣLq, dim]``, ``D [ΣLd, dim]`` -> ``[Nq, Nd]``."""
    return maxsim_varlen_with_argmax(Q, D, cu_seqlens_q, cu_seqlens_d, normalize=normalize)[0]


def maxsim_pairs_varlen_with_argmax(
    Q: Tensor,
    D: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    pair_q: Tensor,
    pair_d: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    normalize: bool = False,
) -> tuple[Tensor, Tensor]:
    """Pair list with the winning token indices: query ``pair_q[p]`` against document ``pair_d[p]`` for each ``p``.

    Pairs may come in any order and repeat (the gradient of a repeated pair is counted once per occurrence).

    Returns:
        ``(scores [P], argmax [P, Lq] int64)``, ``Lq`` and the argmax convention as in
        :func:`maxsim_varlen_with_argmax`.
    """
    Qp, q_mask = _pad_packed(Q, cu_seqlens_q, max_seqlen_q)
    Dp, d_mask = _pad_packed(D, cu_seqlens_d, max_seqlen_d)
    pq = pair_q.to(device=Q.device, dtype=torch.long)
    pd = pair_d.to(device=Q.device, dtype=torch.long)
    if pq.shape != pd.shape or pq.dim() != 1:
        raise ValueError(f"pair_q {tuple(pq.shape)} and pair_d {tuple(pd.shape)} must be 1-D of the same length")
    scores, arg = scores_and_argmax(Qp[pq], Dp[pd][:, None], q_mask[pq], d_mask[pd][:, None], normalize=normalize)
    return scores[:, 0], arg[:, 0]


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
    return maxsim_pairs_varlen_with_argmax(Q, D, cu_seqlens_q, cu_seqlens_d, pair_q, pair_d, normalize=normalize)[0]


def maxsim_padded_with_argmax(
    queries: Tensor,
    documents: Tensor,
    query_lengths: Tensor,
    doc_lengths: Tensor,
    *,
    normalize: bool = False,
) -> tuple[Tensor, Tensor]:
    """Padded per-query candidates given by lengths, with the winning token indices.

    ``queries [B, Lq, dim]``, ``documents [B, K, Ld, dim]``, ``query_lengths [B]``, ``doc_lengths [B, K]``: query
    ``b``'s token ``t`` is valid iff ``t < query_lengths[b]``, document ``(b, k)``'s token ``j`` iff
    ``j < doc_lengths[b, k]``; the padding's values never matter.

    Returns:
        ``(scores [B, K], argmax [B, K, Lq] int64)``, -1 where the query token is padding or the document is empty.
    """
    q_mask = _lengths_mask(query_lengths.to(queries.device), queries.shape[-2])
    d_mask = _lengths_mask(doc_lengths.to(queries.device), documents.shape[-2])
    # zero the padding (differentiably: its gradient is 0) so that its values, NaN included, cannot matter
    queries = queries.masked_fill(~q_mask[..., None], 0)
    documents = documents.masked_fill(~d_mask[..., None], 0)
    return scores_and_argmax(queries, documents, q_mask, d_mask, normalize=normalize)


def maxsim_padded(
    queries: Tensor,
    documents: Tensor,
    query_lengths: Tensor,
    doc_lengths: Tensor,
    *,
    normalize: bool = False,
) -> Tensor:
    """Reference of :func:`maxsim.maxsim_padded`: ``[B, Lq, dim]`` vs ``[B, K, Ld, dim]`` by lengths -> ``[B, K]``."""
    return maxsim_padded_with_argmax(queries, documents, query_lengths, doc_lengths, normalize=normalize)[0]
