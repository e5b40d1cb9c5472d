"""The call surface of ``erikkaum/maxsim`` (a CUDA/Metal extension distributed through Hugging Face ``kernels``) on
top of :mod:`maxsim`.

Usage — replace the kernel load, keep the calls::

    # maxsim = kernels.get_kernel("erikkaum/maxsim", version=2, trust_remote_code=True)
    from maxsim.compat import erikkaum as maxsim

    scores = maxsim.score_candidates_padded(queries, documents, query_lengths, doc_lengths)  # [B, K] fp32
    scores = maxsim.score_contrastive_train(queries, documents, document_offsets)  # [Nq, Nb] fp32, differentiable

Three layouts, each as inference, ``_with_argmax`` and ``_train`` functions with the same argument names, order,
shapes and return types as that library (its version 2 Python package):

==========================  ============================================================  =====================
function family             inputs                                                        scores (fp32)
==========================  ============================================================  =====================
``score_candidates_padded`` ``queries [B, Lq, dim]``, ``documents [B, K, Ld, dim]``,         ``[B, K]``
                            ``query_lengths [B]``, ``doc_lengths [B, K]``
``score_contrastive``       ``queries [Nq, Lq, dim]`` (every row valid), packed              ``[Nq, Nb]``
                            ``documents [ΣLd, dim]``, ``document_offsets [Nb + 1]``
``score_pairs_packed``      packed ``queries [ΣLq, dim]`` + ``query_offsets [Nq + 1]``,      ``[num_pairs]``
                            packed ``documents`` + ``document_offsets``, ``pair_query_ids``,
                            ``pair_document_ids [num_pairs]``; keyword ``max_q_len``
==========================  ============================================================  =====================

Implemented on :func:`maxsim.maxsim_padded`, :func:`maxsim.maxsim_varlen` and :func:`maxsim.maxsim_pairs_varlen`
(``return_argmax=True`` for the ``_with_argmax`` variants). Token tensors: fp32 / fp16 / bf16 (fp64 also accepted,
with fp64 scores), one dtype and device; lengths, offsets and pair ids: int32 or int64 on the same device. Offsets
follow the CSR / flash-attn convention (start at 0, non-decreasing, end at the row count).

Deliberate differences from ``erikkaum/maxsim`` (all are relaxations or semantics of :mod:`maxsim`):

* Every function is differentiable, the inference and ``_with_argmax`` ones included (the ``_train`` names are
  kept for compatibility; they return the same scores tensor). Gradients come back in the inputs' dtype, as
  ``.grad`` does there.
* Zero-length queries / documents are allowed (a zero-length segment scores 0) instead of raising.
  ``score_candidates_padded*`` do not check that lengths lie in ``[0, Lq]`` / ``[0, Ld]`` (that check would need a
  device->host sync): an out-of-range length gives a NaN score instead of an exception.
* The packed functions validate offsets, pair ids and ``max_q_len`` in the one sync they make; errors are
  ``ValueError`` / ``TypeError`` worded with :mod:`maxsim`'s argument names (``Q``, ``D``, ``cu_seqlens_d``,
  ``pair_q``, ``max_seqlen_q``, ...), where that library raised ``RuntimeError`` for bad packed offsets.
* ``score_contrastive*`` take fp32 on CUDA too (that library documents fp16/bf16 there) and any ``Lq`` / ``dim``
  (its CUDA training kernel expected multiples of 16).
* The ``*_reference`` functions of that package are not mirrored; use :mod:`maxsim.reference`.

Host<->device synchronization:

* ``score_candidates_padded*``: none.
* ``score_contrastive*``: one (the longest document, computed from ``document_offsets``; the offsets are validated
  by the same sync). ``max_seqlen_q`` is ``Lq`` from the shape, with no sync.
* ``score_pairs_packed*``: one (longest query and document from the offsets, validated by the same sync), also when
  ``max_q_len`` is given, since that API has no argument for the document length.

Argmax convention (as that library): int32 document-token index relative to the document's first token; slots of
query positions past a query's length are 0 (:mod:`maxsim` itself writes -1 there; the wrappers map -1 to 0).
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

import maxsim as _maxsim

__all__ = [
    "score_candidates_padded",
    "score_candidates_padded_train",
    "score_candidates_padded_with_argmax",
    "score_contrastive",
    "score_contrastive_train",
    "score_contrastive_with_argmax",
    "score_pairs_packed",
    "score_pairs_packed_train",
    "score_pairs_packed_with_argmax",
]


def _argmax_out(argmax: Tensor) -> Tensor:
    """:mod:`maxsim`'s argmax (-1 = no winner) in that library's convention (0 = no winner), int32."""
    return argmax.clamp_min(0).to(torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# padded candidates: [B, Lq, dim] queries, [B, K, Ld, dim] candidates, real lengths


def _padded(queries: Tensor, documents: Tensor, query_lengths: Tensor, doc_lengths: Tensor, return_argmax: bool):
    return _maxsim.maxsim_padded(queries, documents, query_lengths, doc_lengths, return_argmax=return_argmax)


def score_candidates_padded(
    queries: Tensor,
    documents: Tensor,
    query_lengths: Tensor,
    doc_lengths: Tensor,
) -> Tensor:
    """MaxSim of each query against its own ``K`` padded candidates.

    Args:
        queries: ``[B, Lq, dim]``; token ``t`` of query ``b`` is used iff ``t < query_lengths[b]``.
        documents: ``[B, K, Ld, dim]``, same dtype and device; token ``j`` of candidate ``(b, k)`` is used iff
            ``j < doc_lengths[b, k]``.
        query_lengths: ``[B]`` int32 / int64.
        doc_lengths: ``[B, K]`` int32 / int64.

    Returns:
        ``[B, K]`` float32 scores. No host<->device sync.
    """
    return _padded(queries, documents, query_lengths, doc_lengths, False)


def score_candidates_padded_with_argmax(
    queries: Tensor,
    documents: Tensor,
    query_lengths: Tensor,
    doc_lengths: Tensor,
) -> tuple[Tensor, Tensor]:
    """:func:`score_candidates_padded` plus the winning candidate token per query token.

    Returns:
        ``(scores [B, K] float32, argmax [B, K, Lq] int32)``; ``argmax[b, k, t]`` indexes ``documents[b, k]``
        (lowest index on ties), 0 for ``t >= query_lengths[b]``. No host<->device sync.
    """
    scores, argmax = _padded(queries, documents, query_lengths, doc_lengths, True)
    return scores, _argmax_out(argmax)


def score_candidates_padded_train(
    queries: Tensor,
    documents: Tensor,
    query_lengths: Tensor,
    doc_lengths: Tensor,
) -> Tensor:
    """:func:`score_candidates_padded` for training: ``[B, K]`` float32 scores with gradients to ``queries`` and
    ``documents`` (in their dtype). The forward keeps only an argmax per query token for the backward.
    No host<->device sync.
    """
    return _padded(queries, documents, query_lengths, doc_lengths, False)


# ---------------------------------------------------------------------------------------------------------------
# contrastive: rectangular [Nq, Lq, dim] queries against every packed document


def _contrastive(queries: Tensor, documents: Tensor, document_offsets: Tensor, return_argmax: bool):
    if not isinstance(queries, Tensor) or queries.dim() != 3:
        got = tuple(queries.shape) if isinstance(queries, Tensor) else type(queries).__name__
        raise ValueError(f"queries: expected a 3-D tensor [Nq, Lq, dim], got {got}")
    nq, lq, dim = queries.shape
    # Every query is a segment of exactly Lq rows: offsets 0, Lq, 2 Lq, ... built on the device, no sync.
    index_dtype = torch.int32 if nq * lq < 2**31 else torch.int64
    cu_seqlens_q = torch.arange(nq + 1, device=queries.device, dtype=index_dtype) * lq
    return _maxsim.maxsim_varlen(
        queries.reshape(nq * lq, dim),
        documents,
        cu_seqlens_q,
        document_offsets,
        max_seqlen_q=lq,
        return_argmax=return_argmax,
    )


def score_contrastive(
    queries: Tensor,
    documents: Tensor,
    document_offsets: Tensor,
) -> Tensor:
    """Every query against every document (in-batch contrastive scores).

    Args:
        queries: ``[Nq, Lq, dim]``; all ``Lq`` tokens of every query are used (no query lengths).
        documents: ``[total_d_tokens, dim]``, the documents' tokens one after the other; same dtype and device.
        document_offsets: ``[Nb + 1]`` int32 / int64; document ``i`` is
            ``documents[document_offsets[i]:document_offsets[i + 1]]``.

    Returns:
        ``[Nq, Nb]`` float32 scores. One host<->device sync (the longest document, from ``document_offsets``,
        which are validated by it).
    """
    return _contrastive(queries, documents, document_offsets, False)


def score_contrastive_with_argmax(
    queries: Tensor,
    documents: Tensor,
    document_offsets: Tensor,
) -> tuple[Tensor, Tensor]:
    """:func:`score_contrastive` plus the winning document token per query token.

    Returns:
        ``(scores [Nq, Nb] float32, argmax [Nq, Nb, Lq] int32)``; ``argmax[q, i, t]`` counts from the first token
        of document ``i`` (lowest index on ties; 0 for an empty document). One host<->device sync.
    """
    scores, argmax = _contrastive(queries, documents, document_offsets, True)
    return scores, _argmax_out(argmax)


def score_contrastive_train(
    queries: Tensor,
    documents: Tensor,
    document_offsets: Tensor,
) -> Tensor:
    """:func:`score_contrastive` for training: ``[Nq, Nb]`` float32 scores (e.g. logits of an InfoNCE loss with
    diagonal targets) with gradients to ``queries`` and ``documents`` in their dtype. One host<->device sync.
    """
    return _contrastive(queries, documents, document_offsets, False)


# ---------------------------------------------------------------------------------------------------------------
# packed pairs: ragged queries and documents, an explicit list of (query id, document id) pairs


def _pairs(
    queries: Tensor,
    query_offsets: Tensor,
    documents: Tensor,
    document_offsets: Tensor,
    pair_query_ids: Tensor,
    pair_document_ids: Tensor,
    max_q_len: int | None,
    return_argmax: bool,
):
    if max_q_len is not None:
        try:
            max_q_len = operator.index(max_q_len)
        except TypeError:
            raise TypeError(f"max_q_len: expected an int or None, got {type(max_q_len).__name__}") from None
        if max_q_len <= 0:
            raise ValueError(f"max_q_len: expected a positive int, got {max_q_len}")
    return _maxsim.maxsim_pairs_varlen(
        queries,
        documents,
        query_offsets,
        document_offsets,
        pair_query_ids,
        pair_document_ids,
        max_seqlen_q=max_q_len,
        return_argmax=return_argmax,
    )


def score_pairs_packed(
    queries: Tensor,
    query_offsets: Tensor,
    documents: Tensor,
    document_offsets: Tensor,
    pair_query_ids: Tensor,
    pair_document_ids: Tensor,
    *,
    max_q_len: int | None = None,
) -> Tensor:
    """MaxSim of chosen (query, document) pairs over ragged, packed inputs.

    Args:
        queries: ``[total_q_tokens, dim]``; query ``i`` is ``queries[query_offsets[i]:query_offsets[i + 1]]``.
        query_offsets: ``[num_queries + 1]`` int32 / int64.
        documents: ``[total_d_tokens, dim]``, same dtype and device; segments given by ``document_offsets``.
        document_offsets: ``[num_documents + 1]`` int32 / int64.
        pair_query_ids, pair_document_ids: ``[num_pairs]`` int32 / int64; pair ``p`` scores query
            ``pair_query_ids[p]`` against document ``pair_document_ids[p]`` (any order, repeats allowed).
        max_q_len: the longest query (or more), if known; it sets the argmax width of the ``_with_argmax``
            variant. A value below the longest query raises ``ValueError`` (naming ``max_seqlen_q``).

    Returns:
        ``[num_pairs]`` float32 scores. One host<->device sync (longest query and document from the offsets,
        which are validated by it).
    """
    return _pairs(
        queries, query_offsets, documents, document_offsets, pair_query_ids, pair_document_ids, max_q_len, False
    )


def score_pairs_packed_with_argmax(
    queries: Tensor,
    query_offsets: Tensor,
    documents: Tensor,
    document_offsets: Tensor,
    pair_query_ids: Tensor,
    pair_document_ids: Tensor,
    *,
    max_q_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`score_pairs_packed` plus the winning document token per query token.

    Returns:
        ``(scores [num_pairs] float32, argmax [num_pairs, W] int32)`` with ``W = max_q_len`` if given, else the
        longest query; ``argmax[p, t]`` counts from the first token of document ``pair_document_ids[p]`` (lowest
        index on ties), 0 past the query's length. One host<->device sync.
    """
    scores, argmax = _pairs(
        queries, query_offsets, documents, document_offsets, pair_query_ids, pair_document_ids, max_q_len, True
    )
    return scores, _argmax_out(argmax)


def score_pairs_packed_train(
    queries: Tensor,
    query_offsets: Tensor,
    documents: Tensor,
    document_offsets: Tensor,
    pair_query_ids: Tensor,
    pair_document_ids: Tensor,
    *,
    max_q_len: int | None = None,
) -> Tensor:
    """:func:`score_pairs_packed` for training: ``[num_pairs]`` float32 scores with gradients to ``queries`` and
    ``documents`` in their dtype (offsets and ids get none). One host<->device sync.
    """
    return _pairs(
        queries, query_offsets, documents, document_offsets, pair_query_ids, pair_document_ids, max_q_len, False
    )
