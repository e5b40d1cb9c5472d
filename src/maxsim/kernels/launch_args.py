"""How the canonical tensors become kernel arguments, for both directions: segment descriptions of ragged layouts,
strides, the dot products' precision, and what a plan's key holds of a ragged description (never values)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..layout import Ragged
from .launcher import INTERPRETER

DENSE, OFFSETS, LENGTHS = 0, 1, 2  # segment kinds, as in kernels/segments.py
MAX_PLANS = 4096  # entries of each plan cache (cleared whole when full)


def dot_precision(dtype: torch.dtype) -> str:
    """The forward's similarity products for ``dtype``: fp32 inputs get fp32 accuracy through the tensor cores
    (``tf32x3``: three TF32 products per term, the operands split into a high and a low part; ~1e-7 relative
    error, where TF32 alone gives ~1e-3 and IEEE products run as FMA loops) unless the user opted into TF32 via
    torch's matmul precision. (The interpreter computes any precision in fp32.)"""
    if dtype != torch.float32 or INTERPRETER:
        return "ieee"
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def upcast(dtype: torch.dtype) -> bool:
    """Triton's interpreter gets bf16 ``tl.dot`` wrong (design.md §5): operands are upcast there, and only there
    (for every dtype: the normalize owner makes bf16 operands of fp32 inputs too, see backward._dd_add)."""
    return INTERPRETER


def last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class Segs(NamedTuple):
    """Kernel-facing view of a :class:`~maxsim.layout.Ragged` description: kinds, pointers, counts, strides
    (absent pointers are a dummy tensor; they are never read)."""

    q_kind: int
    d_kind: int
    pairs: bool
    qseg: Tensor
    dseg: Tensor
    pq: Tensor
    pd: Tensor
    n_q: int  # packed queries: number of sequences and of token rows
    rows_q: int
    n_d: int
    rows_d: int
    sqs: int  # stride of query lengths
    sds_b: int  # strides of document lengths
    sds_k: int


def ragged_plan_key(rg: Ragged | None) -> tuple | None:
    """What a plan depends on in a ragged description: which tensors are given, their shapes, strides and dtypes
    (never their values), and the maximum lengths."""
    if rg is None:
        return None
    q, d, pq, pd = rg.q_seg, rg.d_seg, rg.pair_q, rg.pair_d
    # (written out: a generator here cost a pair-list step ~3 µs of host time)
    return (
        None if q is None else (q.shape, q.stride(), q.dtype),
        None if d is None else (d.shape, d.stride(), d.dtype),
        None if pq is None else (pq.shape, pq.stride(), pq.dtype),
        None if pd is None else (pd.shape, pd.stride(), pd.dtype),
        rg.max_q,
        rg.max_d,
    )


def rows_class(x: Tensor) -> tuple:
    """What Triton specializes a launch's integers derived from a packed tensor's row count on (the count and the
    tensor's elements: a value of 1, divisibility by 16, the 32-bit range): the plans of packed layouts hold this
    instead of the count, so the batches of a training loop, whose token totals differ, share their plans and the
    launcher's compiled variants, each call passing its own counts (:func:`with_rows`)."""
    n, e = x.shape[0], x.numel()
    return ("rows", n == 1, n % 16 == 0, e == 1, e % 16 == 0, e < 2**31)


def with_rows(ints: tuple, at: int, packed: tuple[bool, bool], Q: Tensor, D: Tensor) -> tuple:
    """``ints`` with this call's packed row counts: ``ints[at]`` is the queries' (``packed[0]``: Q is packed) and
    ``ints[at + 2]`` the documents' (``packed[1]``), as :class:`Segs`' ``rows_q`` and ``rows_d`` follow ``n_q`` and
    ``n_d``."""
    q_rows = Q.shape[0] if packed[0] else ints[at]
    d_rows = D.shape[0] if packed[1] else ints[at + 2]
    return (*ints[:at], q_rows, ints[at + 1], d_rows, *ints[at + 3 :])


def shape_key(x: Tensor, packed: bool) -> tuple:
    """``x``'s shape as a plan key holds it: a packed tensor's row count by its :func:`rows_class`."""
    return (rows_class(x), *x.shape[1:]) if packed else tuple(x.shape)


def packed_sides(Q: Tensor, D: Tensor, rg: Ragged | None) -> tuple[bool, bool]:
    """Whether ``Q`` and ``D`` are packed token rows (``[rows, dim]`` with offsets) under ``rg``."""
    if rg is None:
        return False, False
    return rg.q_seg is not None and Q.dim() == 2, rg.d_seg is not None and D.dim() == 2


def segment_pointers(Q: Tensor, rg: Ragged | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernels' four segment pointers (:class:`Segs`' ``qseg, dseg, pq, pd``) without the rest of it: what a
    call on a cached plan needs."""
    if rg is None:
        return Q, Q, Q, Q
    pairs = rg.pair_q is not None
    return (
        Q if rg.q_seg is None else rg.q_seg,
        Q if rg.d_seg is None else rg.d_seg,
        rg.pair_q if pairs else Q,
        rg.pair_d if pairs else Q,
    )


def segments_of(Q: Tensor, D: Tensor, rg: Ragged | None) -> Segs:
    if rg is None:
        return Segs(DENSE, DENSE, False, Q, Q, Q, Q, 0, 0, 0, 0, 0, 0, 0)
    pairs = rg.pair_q is not None
    if rg.q_seg is None:
        q = (DENSE, Q, 0, 0, 0)
    elif Q.dim() == 2:
        q = (OFFSETS, rg.q_seg, rg.q_seg.shape[0] - 1, Q.shape[0], 0)
    else:
        q = (LENGTHS, rg.q_seg, 0, 0, rg.q_seg.stride(0))
    if rg.d_seg is None:
        d = (DENSE, Q, 0, 0, 0, 0)
    elif D.dim() == 2:
        d = (OFFSETS, rg.d_seg, rg.d_seg.shape[0] - 1, D.shape[0], 0, 0)
    else:
        d = (LENGTHS, rg.d_seg, 0, 0, *rg.d_seg.stride())
    return Segs(
        q[0], d[0], pairs, q[1], d[1], rg.pair_q if pairs else Q, rg.pair_d if pairs else Q,
        q[2], q[3], d[2], d[3], q[4], d[4], d[5],
    )  # fmt: skip


def query_strides(x: Tensor) -> tuple[int, int]:
    """(sequence stride, token stride) of a dense ``[N, L, dim]`` or packed ``[rows, dim]`` token tensor."""
    return (0, x.stride(0)) if x.dim() == 2 else (x.stride(0), x.stride(1))


def document_strides(x: Tensor, shared: bool) -> tuple[int, int, int]:
    """(batch, document, token) strides of a dense ``[Bd, K, Ld, dim]`` or packed ``[rows, dim]`` tensor."""
    if x.dim() == 2:
        return 0, 0, x.stride(0)
    return (0 if shared else x.stride(0)), x.stride(1), x.stride(2)
