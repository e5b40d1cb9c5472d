"""Every dense layout as one canonical form: ``Q [Nq, Lq, dim]`` against ``D [Bd, K, Ld, dim]``.

* cross (in-batch, corpus scan): ``D [Nd, Ld, dim]`` becomes ``[1, Nd, Ld, dim]`` — ``Bd = 1``, every query sees the
  same ``K = Nd`` documents, so the kernels may pack several queries against one document tile;
* per-query candidates: ``D [Nq, K, Ld, dim]`` is already canonical — ``Bd = Nq``;
* pairs: ``D [B, Ld, dim]`` becomes ``[B, 1, Ld, dim]`` — candidates with ``K = 1``.

Scores come out as ``[Nq, K]``; the functional layer views them back. All conversions here are views (no copies,
no device syncs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

NORM_EPS = 1e-12
"""``normalize=True`` divides each token by ``max(||x||, NORM_EPS)``, as ``torch.nn.functional.normalize``."""


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and accumulators: fp32 for fp32/fp16/bf16 inputs, fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


ARGMAX_INT16_MAX_LD = 1 << 15  # documents of at most this many tokens save their argmax as int16


def argmax_dtype(Ld: int) -> torch.dtype:
    """The dtype the forward saves the argmax in for the backward: int16 when every document token index fits
    (``Ld`` at most ARGMAX_INT16_MAX_LD; -1 = none), else int32. Half the bytes of int32: the saved argmax is most of
    what a training step keeps between its forward and backward, and the backward's peak memory holds it beside the
    gradients. The public functions return it as int32."""
    return torch.int16 if Ld <= ARGMAX_INT16_MAX_LD else torch.int32


class Views(NamedTuple):
    """How a caller's ``Q`` and ``D`` are seen in canonical form: the unit axes to insert into each (in order) to get
    ``[Nq, Lq, dim]`` and ``[Bd, K, Ld, dim]``, and the shape the ``[Nq, K]`` result is viewed as, without the axes
    the caller did not have (None: unchanged). Only what changes is touched: a view costs ~2 µs of host time."""

    q: tuple[int, ...]
    d: tuple[int, ...]
    out: tuple[int, ...] | None


def canonical_dense(
    Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None
) -> tuple[Views, Tensor | None, Tensor | None]:
    """:func:`maxsim.maxsim`'s arguments (a 2-D ``Q [Lq, dim]`` is one query, a 2-D ``D [Ld, dim]`` one document,
    a 3-D ``D [Nd, Ld, dim]`` shared documents, a 4-D one per-query candidates): their views, and the masks as
    canonical ``[Nq, Lq]`` / ``[Bd, K, Ld]`` views."""
    squeeze_q, squeeze_d = Q.dim() == 2, D.dim() == 2
    if squeeze_q or squeeze_d:
        out = (() if squeeze_q else (Q.shape[0],)) + (() if squeeze_d else (D.shape[-3],))
        views = Views((0,) if squeeze_q else (), (0,) * (4 - D.dim()), out)
    else:
        views = _CROSS if D.dim() == 3 else _CANDIDATES  # (no per-call construction on the common paths)
    if q_mask is not None and squeeze_q:
        q_mask = q_mask[None]
    if d_mask is not None and views.d:
        d_mask = d_mask.view((1,) * len(views.d) + tuple(d_mask.shape))
    return views, q_mask, d_mask


_CROSS = Views((), (0,), None)
_CANDIDATES = Views((), (), None)


def canonical_pairs(
    Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None
) -> tuple[Views, Tensor | None, Tensor | None]:
    """``Q [B, Lq, dim]``, ``D [B, Ld, dim]`` as candidates with ``K = 1``; the result is ``[B]``."""
    return Views((), (1,), (Q.shape[0],)), q_mask, None if d_mask is None else d_mask.unsqueeze(1)


def view_as_canonical(x: Tensor, axes: tuple[int, ...]) -> Tensor:
    for a in axes:
        x = x.unsqueeze(a)
    return x


def view_as_given(x: Tensor, axes: tuple[int, ...]) -> Tensor:
    """The inverse of :func:`view_as_canonical` (a gradient back in its input's shape): ``squeeze`` of the inserted
    unit axes, ~1 µs of host time each against ~2.5 for a ``view`` to a shape."""
    for a in reversed(axes):
        x = x.squeeze(a)
    return x


class Ragged(NamedTuple):
    """Where ragged sequences live, on top of the canonical form (all tensors on the data's device):

    * ``q_seg``: None (dense queries), offsets ``[Nq + 1]`` when ``Q`` is packed ``[rows, dim]``, or lengths
      ``[Nq]`` when ``Q`` is ``[Nq, Lq, dim]``;
    * ``d_seg``: None, offsets ``[Nd + 1]`` when ``D`` is packed, or lengths ``[Bd, K]`` when ``D`` is 4-D;
    * ``pair_q``, ``pair_d``: ``[P]`` pair list (both packed), or None;
    * ``max_q``, ``max_d``: the longest sequence (the argmax and the work are sized by these).
    """

    q_seg: Tensor | None
    d_seg: Tensor | None
    pair_q: Tensor | None
    pair_d: Tensor | None
    max_q: int
    max_d: int


def dims(Q: Tensor, D: Tensor, rg: Ragged | None) -> tuple[int, int, int, int, int, int]:
    """``(Nq, Lq, Bd, K, Ld, dim)`` of the ``[Nq, K]`` score grid; a pair list is the grid ``[1, P]``."""
    dim = Q.shape[-1]
    if rg is None:
        return Q.shape[0], Q.shape[1], D.shape[0], D.shape[1], D.shape[2], dim
    Nq, Lq = (rg.q_seg.shape[0] - 1, rg.max_q) if Q.dim() == 2 else (Q.shape[0], Q.shape[1])
    Bd, K, Ld = (1, rg.d_seg.shape[0] - 1, rg.max_d) if D.dim() == 2 else (D.shape[0], D.shape[1], D.shape[2])
    if rg.pair_q is not None:
        return 1, Lq, 1, rg.pair_q.shape[0], Ld, dim
    return Nq, Lq, Bd, K, Ld, dim
