"""Public functions for ragged batches: packed sequences with offsets, pair lists, padded candidates with lengths.

They describe the layout (:class:`maxsim.layout.Ragged`) and run the same registered op and kernel core as
:func:`maxsim.maxsim`; nothing is padded or copied on the GPU path. Offsets follow flash-attn: ``cu_seqlens`` of
``N + 1`` int32/int64 entries, starting at 0, non-decreasing, ending at the row count.

Syncs: with ``max_seqlen_q`` and ``max_seqlen_d`` given, none. Without them, exactly one (the longest lengths are
read back from the device), and the offsets are validated in the same read-back. Unvalidated bad offsets, lengths or
pair ids never make a kernel touch memory outside its inputs: the affected scores come out NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from . import validate as check_arg
from .backend import choose_impl
from .functional import _deterministic
from .layout import Ragged, Views
from .ops import maxsim_canonical

Result = Tensor | tuple[Tensor, Tensor]


def _common(Q: Tensor, D: Tensor, normalize: bool, backward: str, return_argmax: bool) -> None:
    check_arg.same_kind(Q, D)
    check_arg.flag("normalize", normalize)
    check_arg.flag("return_argmax", return_argmax)
    check_arg.backward_mode(backward)


def _repeat(
    function: str, Q: object, D: object, segments: tuple, maxima: tuple | None, normalize: object, backward: object,
    return_argmax: object, validate: object,
) -> tuple[tuple | None, Tensor | None]:  # fmt: skip
    """``(signature, scores)`` of a call of ``function`` (:func:`maxsim.ops.ragged_repeat_key`, before any check):
    the scores where an earlier call filed the signature, else None (and a None signature where the call is not one
    to repeat). ``maxima``: as given; None for a padded call, whose shapes hold them."""
    given = (0, 0) if maxima is None else maxima
    key = ops.ragged_repeat_key(function, Q, D, segments, *given, normalize, backward, return_argmax, validate)
    if key is None:
        return None, None
    if maxima is None and (Q.dim() != 3 or D.dim() != 4):
        return None, None  # (no maxima to read off these shapes: the checks say what is wrong)
    rg = Ragged(*segments, *((Q.shape[1], D.shape[2]) if maxima is None else maxima))
    return key, ops.run_repeat(key, Q, D, rg=rg)


def _run(
    Q: Tensor, D: Tensor, normalize: bool, backward: str, rg: Ragged, return_argmax: bool, views: Views | None,
    repeat: tuple | None, segments: tuple,
) -> Result:  # fmt: skip
    """The checked call through the registered op's route; with ``repeat`` (:func:`maxsim.ops.ragged_repeat_key`),
    its plan filed for repeats after it, where ``rg`` holds the caller's ``segments`` themselves (a non-contiguous
    offsets tensor, say, was copied: a repeat would read the caller's)."""
    det = _deterministic(backward)
    out = maxsim_canonical(Q, D, None, None, normalize, choose_impl(Q), det, rg, return_argmax, views)
    if repeat is not None and all(a is b for a, b in zip(rg[:4], segments, strict=True)):
        ops.keep_repeat(repeat, Q, D, normalize, views, det, rg=rg)
    return out


def _lengths_of(cu: Tensor) -> Tensor:
    return (cu[1:] - cu[:-1]).long()


def _read_back(
    cu_q: Tensor,
    cu_d: Tensor,
    rows_q: int,
    rows_d: int,
    pairs: tuple[Tensor, Tensor] | None,
    max_q: int | None,
    max_d: int | None,
    check: bool,
) -> tuple[int, int]:
    """The longest query and document (where not given) and, with ``check``, the validity of the offsets and pair
    ids: everything in one device→host read-back."""
    zero = torch.zeros((), dtype=torch.long, device=cu_q.device)
    lq, ld = _lengths_of(cu_q), _lengths_of(cu_d)
    stats = [lq.max() if lq.numel() else zero, ld.max() if ld.numel() else zero]
    names: list[str] = []
    if check:
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_d", cu_d)):
            lens = _lengths_of(cu)
            stats += [cu[0].long(), cu[-1].long(), lens.min() if lens.numel() else zero]
            names.append(name)
        if pairs is not None:
            for p in pairs:
                stats += [p.min().long() if p.numel() else zero, p.max().long() if p.numel() else zero]
    values = torch.stack(stats).tolist()  # the one documented sync (maxima omitted or validate=True)
    longest_q, longest_d = values[0], values[1]
    if check:
        it = iter(values[2:])
        for name, rows in zip(names, (rows_q, rows_d), strict=True):
            first, last, min_len = next(it), next(it), next(it)
            if first != 0:
                raise ValueError(f"{name}: expected offsets starting at 0, got {first}")
            if min_len < 0:
                raise ValueError(f"{name}: expected non-decreasing offsets, found a step of {min_len}")
            if last != rows:
                raise ValueError(
                    f"{name}: expected the last offset to equal the number of token rows ({rows}), got {last}"
                )
        if pairs is not None:
            for name, n in (("pair_q", cu_q.shape[0] - 1), ("pair_d", cu_d.shape[0] - 1)):
                lo, hi = next(it), next(it)
                if pairs[0].numel() and (lo < 0 or hi >= n):
                    raise ValueError(f"{name}: expected ids in [0, {n}), got values in [{lo}, {hi}]")
        for name, given, longest in (("max_seqlen_q", max_q, longest_q), ("max_seqlen_d", max_d, longest_d)):
            if given is not None and longest > given:
                raise ValueError(f"{name}: the longest sequence has {longest} tokens, more than {name}={given}")
    return (longest_q if max_q is None else max_q), (longest_d if max_d is None else max_d)


def _packed_args(Q, D, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, validate_):
    check_arg.tensor("Q", Q, (2,))
    check_arg.tensor("D", D, (2,))
    cu_q = check_arg.offsets("cu_seqlens_q", cu_seqlens_q, Q.device)
    cu_d = check_arg.offsets("cu_seqlens_d", cu_seqlens_d, Q.device)
    max_q = check_arg.max_length("max_seqlen_q", max_seqlen_q)
    max_d = check_arg.max_length("max_seqlen_d", max_seqlen_d)
    check = check_arg.optional_flag("validate", validate_)
    return cu_q, cu_d, max_q, max_d, check


def maxsim_varlen(
    Q: Tensor,
    D: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    normalize: bool = False,
    backward: str = "auto",
    return_argmax: bool = False,
    validate: bool | None = None,
) -> Result:
    """Every packed query against every packed document: ``Q [ΣLq, dim]``, ``D [ΣLd, dim]`` -> ``[Nq, Nd]``.

    Args:
        cu_seqlens_q: int32/int64 ``[Nq + 1]``: query ``i`` is rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of Q.
        cu_seqlens_d: int32/int64 ``[Nd + 1]``, the same for D.
        max_seqlen_q, max_seqlen_d: the longest query / document. Given: no host↔device sync. Omitted: one sync.
        normalize, backward: as :func:`maxsim.maxsim`.
        return_argmax: also return the int32 argmax ``[Nq, Nd, max_seqlen_q]``: per query token, the winning token's
            index inside its document, -1 past the query's end or where the document is empty.
        validate: check the offsets (start at 0, non-decreasing, end at the row count) and the given maximum
            lengths, raising ``ValueError``. ``None`` (default): only when the maxima are omitted (the read-back
            happens anyway); ``True``: always (one sync); ``False``: never.

    Returns:
        float32 scores (float64 for float64 inputs); empty sequences score 0 and get zero gradient.
    """
    cu_q, cu_d, max_q, max_d, check = cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, validate
    segments = (cu_q, cu_d, None, None)
    repeat, scores = _repeat("varlen", Q, D, segments, (max_q, max_d), normalize, backward, return_argmax, check)
    if scores is not None:
        return scores
    if not check_arg.packed_call(Q, D, cu_q, cu_d, None, None, max_q, max_d, normalize, backward, return_argmax, check):
        cu_q, cu_d, max_q, max_d, check = _packed_args(Q, D, cu_q, cu_d, max_q, max_d, check)
        _common(Q, D, normalize, backward, return_argmax)
    if max_q is None or max_d is None or check:
        max_q, max_d = _read_back(cu_q, cu_d, Q.shape[0], D.shape[0], None, max_q, max_d, check is not False)
    rg = Ragged(cu_q, cu_d, None, None, max_q, max_d)
    return _run(Q, D, normalize, backward, rg, return_argmax, None, repeat, segments)


def maxsim_pairs_varlen(
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
    backward: str = "auto",
    return_argmax: bool = False,
    validate: bool | None = None,
) -> Result:
    """Only the listed pairs: score ``p`` is query ``pair_q[p]`` against document ``pair_d[p]`` -> ``[P]``.

    ``Q``, ``D``, offsets, maxima, ``normalize``, ``backward`` and ``validate`` as :func:`maxsim_varlen` (validation
    also checks that pair ids are in range). ``pair_q``, ``pair_d``: int32/int64 ``[P]``, any order, repeats
    allowed. The cost is proportional to the pairs listed, not to ``Nq × Nd``. ``return_argmax`` adds the int32
    argmax ``[P, max_seqlen_q]``. The backward groups the pairs by query and by document on the device (a sort;
    no sync) and is deterministic.
    """
    cu_q, cu_d, pq, pd = cu_seqlens_q, cu_seqlens_d, pair_q, pair_d
    max_q, max_d, check = max_seqlen_q, max_seqlen_d, validate
    segments = (cu_q, cu_d, pq, pd)
    repeat, scores = _repeat("pairs", Q, D, segments, (max_q, max_d), normalize, backward, return_argmax, check)
    if scores is not None:
        return scores
    if pq is None or not check_arg.packed_call(
        Q, D, cu_q, cu_d, pq, pd, max_q, max_d, normalize, backward, return_argmax, check
    ):  # (the checks in turn, for their messages)
        cu_q, cu_d, max_q, max_d, check = _packed_args(Q, D, cu_q, cu_d, max_q, max_d, check)
        _common(Q, D, normalize, backward, return_argmax)
        pq = check_arg.index_tensor("pair_q", pq, 1, Q.device)
        pd = check_arg.index_tensor("pair_d", pd, 1, Q.device)
        if pq.shape != pd.shape:
            raise ValueError(f"pair_d: expected as many entries as pair_q ({pq.shape[0]}), got {pd.shape[0]}")
    if max_q is None or max_d is None or check:
        max_q, max_d = _read_back(cu_q, cu_d, Q.shape[0], D.shape[0], (pq, pd), max_q, max_d, check is not False)
    rg = Ragged(cu_q, cu_d, pq, pd, max_q, max_d)
    # The [1, P] grid comes back as [P].
    return _run(Q, D, normalize, backward, rg, return_argmax, Views((), (), (pq.shape[0],)), repeat, segments)


def maxsim_padded(
    queries: Tensor,
    documents: Tensor,
    query_lengths: Tensor,
    doc_lengths: Tensor,
    *,
    normalize: bool = False,
    backward: str = "auto",
    return_argmax: bool = False,
    validate: bool = False,
) -> Result:
    """Reranking layout with lengths instead of masks: ``queries [B, Lq, dim]``, ``documents [B, K, Ld, dim]``
    -> ``[B, K]``.

    Args:
        query_lengths: int32/int64 ``[B]``: query ``b`` is its first ``query_lengths[b]`` tokens.
        doc_lengths: int32/int64 ``[B, K]``: document ``(b, k)`` is its first ``doc_lengths[b, k]`` tokens.
        validate: check ``0 <= lengths <= Lq / Ld`` (one sync), raising ``ValueError``. Without it, an
            out-of-range length gives a NaN score.
        normalize, backward: as :func:`maxsim.maxsim`; ``return_argmax`` adds the int32 argmax ``[B, K, Lq]``.

    No copy of the documents is made, and no sync happens (unless ``validate``).
    """
    segments = (query_lengths, doc_lengths, None, None)
    repeat, scores = _repeat("padded", queries, documents, segments, None, normalize, backward, return_argmax, validate)
    if scores is not None:
        return scores
    check_arg.tensor("queries", queries, (3,))
    check_arg.tensor("documents", documents, (4,))
    _common(queries, documents, normalize, backward, return_argmax)
    B, Lq = queries.shape[:2]
    K, Ld = documents.shape[1:3]
    if documents.shape[0] != B:
        raise ValueError(f"documents: expected shape[0] == B = {B} ([B, K, Ld, dim]), got {tuple(documents.shape)}")
    ql = check_arg.index_tensor("query_lengths", query_lengths, 1, queries.device)
    dl = check_arg.index_tensor("doc_lengths", doc_lengths, 2, queries.device)
    if tuple(ql.shape) != (B,):
        raise ValueError(f"query_lengths: expected shape ({B},), got {tuple(ql.shape)}")
    if tuple(dl.shape) != (B, K):
        raise ValueError(f"doc_lengths: expected shape ({B}, {K}), got {tuple(dl.shape)}")
    check_arg.flag("validate", validate)
    if validate:
        zero = torch.zeros((), dtype=torch.long, device=ql.device)
        ends = [(t.min().long(), t.max().long()) if t.numel() else (zero, zero) for t in (ql, dl)]
        lo_q, hi_q, lo_d, hi_d = torch.stack([v for pair in ends for v in pair]).tolist()  # validate=True: one sync
        if lo_q < 0 or hi_q > Lq:
            raise ValueError(f"query_lengths: expected values in [0, {Lq}], got values in [{lo_q}, {hi_q}]")
        if lo_d < 0 or hi_d > Ld:
            raise ValueError(f"doc_lengths: expected values in [0, {Ld}], got values in [{lo_d}, {hi_d}]")
    rg = Ragged(ql, dl, None, None, Lq, Ld)
    return _run(queries, documents, normalize, backward, rg, return_argmax, None, repeat, segments)
