"""Public functions: validate, describe the layout, call the registered op.

Every function returns float32 scores (float64 for float64 inputs) and supports autograd; gradients come back in
the inputs' dtype. The forward saves only the argmax per query token and pair for the backward (int16 for documents
of up to 32768 tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops, validate
from .backend import choose_impl
from .layout import canonical_dense, canonical_pairs


def _deterministic(mode: str) -> bool:
    if mode == "auto":
        return torch.are_deterministic_algorithms_enabled()
    return mode == "deterministic"


def _repeat(
    function: str, Q: Tensor, D: Tensor, q_mask: object, d_mask: object, normalize: bool, backward: str,
    return_argmax: bool,
) -> tuple[tuple | None, Tensor | None]:  # fmt: skip
    """``(signature, scores)`` of a scores-only call of ``function`` (:func:`maxsim.ops.repeat_key`): the scores
    where an earlier call filed that signature, else None (and a None signature where the call is not one to
    repeat). Before any check: a repeat is a signature that passed them."""
    if return_argmax is not False:
        return None, None
    key = ops.repeat_key(Q, D, normalize, backward, function, q_mask, d_mask)
    return key, (None if key is None else ops.run_repeat(key, Q, D, q_mask, d_mask))


def _run(
    Q: Tensor, D: Tensor, canonical: tuple, normalize: bool, backward: str, return_argmax: bool,
    repeat: tuple | None = None,
):  # fmt: skip
    """The caller's ``Q``, ``D`` and the :func:`canonical_dense` description of them -> scores (and argmax); with
    ``repeat``, the call's signature, filed for repeats after it."""
    views, q_mask, d_mask = canonical
    impl, det = choose_impl(Q), _deterministic(backward)
    out = ops.maxsim_canonical(Q, D, q_mask, d_mask, normalize, impl, det, None, return_argmax, views)
    if repeat is not None:
        ops.keep_repeat(repeat, Q, D, normalize, views, det, q_mask, d_mask)
    return out


def maxsim(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str = "auto",
    return_argmax: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Late-interaction scores ``Σ_i max_j <q_i, d_j>`` without materializing the similarity tensor.

    Shapes (``dim`` shared; fp32, fp16, bf16 or fp64; Q and D on one device with one dtype):

    * ``Q [Nq, Lq, dim]``, ``D [Nd, Ld, dim]`` -> ``[Nq, Nd]`` (cross product: in-batch negatives, corpus scan);
    * ``Q [Nq, Lq, dim]``, ``D [Nq, K, Ld, dim]`` -> ``[Nq, K]`` (each query against its own K candidates);
    * a 2-D ``Q [Lq, dim]`` or ``D [Ld, dim]`` drops that axis from the result.

    Args:
        q_mask: bool ``[Nq, Lq]`` (``[Lq]`` for 2-D Q), True = valid token. Masked query tokens contribute 0.
        d_mask: bool ``[Nd, Ld]`` / ``[Nq, K, Ld]`` (``[Ld]`` for 2-D D), any pattern. Masked document tokens are
            excluded from the max; a query token with no valid document token contributes 0 and gets no gradient.
        normalize: score L2-normalized tokens (``x / max(||x||, 1e-12)``), fused into the kernels.
        backward: ``"fast"`` (fp32 atomics in dD), ``"deterministic"`` (bitwise reproducible, no atomics) or
            ``"auto"`` (deterministic when ``torch.are_deterministic_algorithms_enabled()``, else fast).
        return_argmax: also return the int32 argmax ``[..., Lq]`` (the score's shape plus the query tokens): the
            winning document token per query token, -1 where the token is masked or sees no valid document token.

    Returns:
        float32 scores (float64 for float64 inputs). Ties in the max go to the lowest token index; a NaN among a
        pair's valid tokens makes its score NaN. No host↔device synchronization.
    """
    repeat, scores = _repeat("maxsim", Q, D, q_mask, d_mask, normalize, backward, return_argmax)
    if scores is not None:
        return scores
    validate.call(Q, D, (2, 3), (2, 3, 4), normalize, backward, return_argmax)
    if D.dim() == 4:
        if Q.dim() != 3:
            raise ValueError(
                f"D: a 4-D D [Nq, K, Ld, dim] (per-query candidates) needs a 3-D Q [Nq, Lq, dim], got Q shape "
                f"{tuple(Q.shape)}"
            )
        if D.shape[0] != Q.shape[0]:
            raise ValueError(
                f"D: expected D.shape[0] == Nq = {Q.shape[0]} for per-query candidates [Nq, K, Ld, dim], got "
                f"shape {tuple(D.shape)}"
            )
    if q_mask is not None:  # (shapes and devices cost host time; most calls have no masks)
        validate.mask("q_mask", q_mask, Q.shape[:-1], Q.device)
    if d_mask is not None:
        validate.mask("d_mask", d_mask, D.shape[:-1], Q.device)
    return _run(Q, D, canonical_dense(Q, D, q_mask, d_mask), normalize, backward, return_argmax, repeat)


def maxsim_with_argmax(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str = "auto",
) -> tuple[Tensor, Tensor]:
    """:func:`maxsim` plus, per query token, the int32 index of its winning document token (-1 where none):
    ``(scores, argmax [..., Lq])`` — e.g. ``[Nq, Nd, Lq]`` for the cross product. For alignment inspection and
    visualization; the scores stay differentiable."""
    return maxsim(Q, D, q_mask, d_mask, normalize=normalize, backward=backward, return_argmax=True)


def maxsim_pairs(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str = "auto",
    return_argmax: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scores of aligned pairs: ``Q [B, Lq, dim]``, ``D [B, Ld, dim]`` -> ``[B]`` (query b against document b).

    Masks: ``q_mask [B, Lq]``, ``d_mask [B, Ld]``; everything else as :func:`maxsim` (``return_argmax`` adds the
    int32 argmax ``[B, Lq]``).
    """
    repeat, scores = _repeat("maxsim_pairs", Q, D, q_mask, d_mask, normalize, backward, return_argmax)
    if scores is not None:
        return scores
    validate.call(Q, D, (3,), (3,), normalize, backward, return_argmax)
    if D.shape[0] != Q.shape[0]:
        raise ValueError(f"D: expected as many documents as queries (B = {Q.shape[0]}), got shape {tuple(D.shape)}")
    if q_mask is not None:  # (shapes and devices cost host time; most calls have no masks)
        validate.mask("q_mask", q_mask, Q.shape[:-1], Q.device)
    if d_mask is not None:
        validate.mask("d_mask", d_mask, D.shape[:-1], Q.device)
    return _run(Q, D, canonical_pairs(Q, D, q_mask, d_mask), normalize, backward, return_argmax, repeat)
