"""The per-token pieces of ``normalize=True``: inverse norms (for the backward, and for the forwards of queries split
into row blocks and of documents scored by one query each, see ``launch_settings.PRENORM_*``, which hand them on to the
backward) and the chain rule that ends the backward.

The scores of normalized tokens depend on ``x̂ = x / max(||x||, eps)``. The backward kernels produce the gradient
with respect to ``x̂`` (in fp32) from the inverse norms; the gradient with respect to ``x`` is then, per token,
``(ĝ − x̂ <x̂, ĝ>) / max(||x||, eps)`` (just ``ĝ / eps`` where the norm is below ``eps``), and exactly zero for a token
whose ``ĝ`` is zero (masked, or never chosen), even when it holds NaN or inf.

Where a backward program holds whole rows of a gradient (the dQ gather, and the dD owner when one dim block covers
``dim``), it applies the chain rule itself before storing (:func:`project_rows`): no fp32 buffer, no extra pass.
The rest (fp32 atomics, dQ of long pair lists, dims split over programs) goes through :func:`project`.

Written as PyTorch ops that is a dozen passes over ``[tokens, dim]`` fp32 tensors and a dozen launches (6.6 ms of a
candidates 256×16 Ld300 training step on an H100, against ~0.5 ms without ``normalize``). Here each end is one
launch for Q and D together: a program owns ``BR`` rows of one of the two tensors, reads them once for the sums and
once more (from cache) to write the result in the input's dtype, which also absorbs the cast the plain path needs.

Tensors are read as ``[rows, dim]`` with a contiguous last dimension and rows at a fixed stride (any input whose
leading dimensions collapse into one, which the canonical layouts' tensors do; others are copied first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..layout import NORM_EPS
from .launch_args import MAX_PLANS
from .launcher import Launcher
from .sizes import cdiv, next_power_of_2

BR = 32  # rows per program
MAX_BD = 128  # dims per step


@triton.jit
def _row_sums(X, G, rows, ok, stride, dim, BR: tl.constexpr, BD: tl.constexpr, NUM_D: tl.constexpr,
              WITH_G: tl.constexpr):  # fmt: skip
    """Per row: ``(Σ x², Σ x·g, any g ≠ 0)`` in fp32 (the last two only ``WITH_G``)."""
    sq = tl.zeros([BR], dtype=tl.float32)
    xg = tl.zeros([BR], dtype=tl.float32)
    nz = tl.zeros([BR], dtype=tl.int32)
    for c in tl.static_range(NUM_D):
        cols = c * BD + tl.arange(0, BD)
        m = ok[:, None] & (cols < dim)[None, :]
        x = tl.load(X + rows[:, None] * stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
        if WITH_G:
            g = tl.load(G + rows[:, None] * dim + cols[None, :], mask=m, other=0.0).to(tl.float32)
            xg += tl.sum(x * g, axis=1)
            nz = tl.maximum(nz, tl.max((g != 0).to(tl.int32), axis=1))
    return sq, xg, nz


@triton.jit
def _clamped_norm(sq, EPS: tl.constexpr):
    # (a select, not tl.maximum: a NaN norm must stay NaN, as torch's clamp_min keeps it)
    norm = tl.sqrt(sq)
    return tl.where(norm < EPS, EPS, norm), norm < EPS


@triton.jit
def _chain(g, x, sq, xg, nz, EPS: tl.constexpr):
    """The chain rule for rows of ``g`` (w.r.t. ``x̂``) and ``x`` (fp32, any column block of the rows) from the rows'
    ``Σ x²``, ``Σ x·g`` and any-nonzero flags over all their columns."""
    norm, small = _clamped_norm(sq, EPS)
    inv = 1.0 / norm
    radial = xg * inv  # <x̂, ĝ>
    out = tl.where(small[:, None], g, g - (x * inv[:, None]) * radial[:, None]) / norm[:, None]
    return tl.where(nz[:, None] != 0, out, 0.0)


@triton.jit
def project_rows(g, x, EPS: tl.constexpr):
    """The chain rule for whole rows held in registers (``g``, ``x`` fp32 ``[rows, cols]``, zeros past ``dim``):
    what the backward kernels apply to the gradient blocks they own before storing them."""
    nz = tl.max((g != 0).to(tl.int32), axis=1)
    return _chain(g, x, tl.sum(x * x, axis=1), tl.sum(x * g, axis=1), nz, EPS)


@triton.jit
def _inverse_norm_rows(X, INV, n_rows, stride, dim, pid, BR: tl.constexpr, BD: tl.constexpr,
                       NUM_D: tl.constexpr, EPS: tl.constexpr):  # fmt: skip
    rows = pid * BR + tl.arange(0, BR)
    ok = rows < n_rows
    rows = rows.to(tl.int64)
    sq, _, _ = _row_sums(X, X, rows, ok, stride, dim, BR, BD, NUM_D, False)
    norm, _ = _clamped_norm(sq, EPS)
    tl.store(INV + rows, 1.0 / norm, mask=ok)


@triton.jit(do_not_specialize=["rows1", "rows2", "programs1"])
def inverse_norms_kernel(X1, INV1, X2, INV2, rows1, rows2, stride1, stride2, dim, programs1,
                         BR: tl.constexpr, BD: tl.constexpr, NUM_D: tl.constexpr, EPS: tl.constexpr):  # fmt: skip
    """``INV[r] = 1 / max(||X[r]||, eps)`` (fp32) for the rows of two tensors: programs ``[0, programs1)`` take
    ``X1``, the rest ``X2``."""
    pid = tl.program_id(0)
    if pid < programs1:
        _inverse_norm_rows(X1, INV1, rows1, stride1, dim, pid, BR, BD, NUM_D, EPS)
    else:
        _inverse_norm_rows(X2, INV2, rows2, stride2, dim, pid - programs1, BR, BD, NUM_D, EPS)


@triton.jit
def _project_rows(X, G, OUT, n_rows, stride, dim, pid, BR: tl.constexpr, BD: tl.constexpr, NUM_D: tl.constexpr,
                  EPS: tl.constexpr):  # fmt: skip
    rows = pid * BR + tl.arange(0, BR)
    ok = rows < n_rows
    rows = rows.to(tl.int64)
    sq, xg, nz = _row_sums(X, G, rows, ok, stride, dim, BR, BD, NUM_D, True)
    for c in tl.static_range(NUM_D):
        cols = c * BD + tl.arange(0, BD)
        m = ok[:, None] & (cols < dim)[None, :]
        x = tl.load(X + rows[:, None] * stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(G + rows[:, None] * dim + cols[None, :], mask=m, other=0.0).to(tl.float32)
        out = _chain(g, x, sq, xg, nz, EPS)
        tl.store(OUT + rows[:, None] * dim + cols[None, :], out.to(OUT.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["rows1", "rows2", "programs1"])
def project_kernel(X1, G1, OUT1, X2, G2, OUT2, rows1, rows2, stride1, stride2, dim, programs1,
                   BR: tl.constexpr, BD: tl.constexpr, NUM_D: tl.constexpr, EPS: tl.constexpr):  # fmt: skip
    """``OUT = (G − X̂ <X̂, G>) / max(||X||, eps)`` per row (``G / eps`` below eps; 0 where ``G`` is all zero) for
    two tensors: programs ``[0, programs1)`` take the first, the rest the second. ``G`` and ``OUT`` are
    contiguous ``[rows, dim]``; ``X`` has rows ``stride`` elements apart."""
    pid = tl.program_id(0)
    if pid < programs1:
        _project_rows(X1, G1, OUT1, rows1, stride1, dim, pid, BR, BD, NUM_D, EPS)
    else:
        _project_rows(X2, G2, OUT2, rows2, stride2, dim, pid - programs1, BR, BD, NUM_D, EPS)


_inverse_norms = Launcher(inverse_norms_kernel)
_project = Launcher(project_kernel)


# Launch plans (see Launcher's ``plan_cache``) by everything Triton specializes these launches on but the tensors'
# alignments: the tensors' dtypes and the integers but the row and program counts, which the kernels do not specialize
# on (but for their 32-bit range), so that the batches of a ragged layout, whose token totals differ, share them.
_plans: dict[tuple, dict] = {}


def _plan_cache(kind: str, tensors: tuple, ints: tuple) -> dict:
    rows1, rows2, stride1, stride2, dim, programs1 = ints
    key = (kind, *[t.dtype for t in tensors], stride1, stride2, dim, rows1 < 2**31, rows2 < 2**31, programs1 < 2**31)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = {}
    return plan


def _rows(x: Tensor) -> Tensor:
    """``x`` as ``[rows, dim]`` with a unit stride along dim: a view where the leading dimensions collapse."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dimensions that do not collapse (a caller's strided view): one copy
        return x.contiguous().view(-1, x.shape[-1])


def _constexprs(dim: int) -> dict:
    bd = min(next_power_of_2(max(dim, 16)), MAX_BD)
    return dict(BR=BR, BD=bd, NUM_D=cdiv(dim, bd), EPS=NORM_EPS)


def inverse_norms(Q: Tensor, D: Tensor) -> tuple[Tensor, Tensor]:
    """``1 / max(||x||, eps)`` per token of ``Q [..., dim]`` and ``D [..., dim]``: fp32 ``Q.shape[:-1]``,
    ``D.shape[:-1]``. One launch, no sync."""
    q, d = _rows(Q), _rows(D)
    inv_q = torch.empty(Q.shape[:-1], dtype=torch.float32, device=Q.device)
    inv_d = torch.empty(D.shape[:-1], dtype=torch.float32, device=D.device)
    p1 = cdiv(q.shape[0], BR)
    grid = p1 + cdiv(d.shape[0], BR)
    if grid:
        ints = (q.shape[0], d.shape[0], q.stride(0), d.stride(0), Q.shape[-1], p1)
        tensors = (q, inv_q, d, inv_d)
        plan = _plan_cache("norms", tensors, ints)
        _inverse_norms(grid, tensors, ints, _constexprs(Q.shape[-1]), 4, plan_cache=plan, foreign=(q, d))
    return inv_q, inv_d


def project(gQ: Tensor | None, Q: Tensor, gD: Tensor | None, D: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """Gradients with respect to ``Q`` and ``D`` (their shapes and dtypes) from ``gQ``, ``gD``, the gradients with
    respect to their normalized tokens (contiguous, fp32 or the inputs' dtype). A side given as None (the backward
    kernel projected it already) comes back None. One launch, no sync."""
    rows, outs = [], []
    for g, x in ((gQ, Q), (gD, D)):
        if g is not None:
            outs.append(torch.empty_like(x, memory_format=torch.contiguous_format))
            rows.append((_rows(x), g.contiguous().view(-1, x.shape[-1]), outs[-1].view(-1, x.shape[-1])))
    if not rows:
        return None, None
    (x1, g1, o1), (x2, g2, o2) = rows[0], rows[-1]  # (one side: the second is the first, with no programs)
    n2 = x2.shape[0] if len(rows) == 2 else 0
    p1 = cdiv(x1.shape[0], BR)
    grid = p1 + cdiv(n2, BR)
    if grid:
        ints = (x1.shape[0], n2, x1.stride(0), x2.stride(0), x1.shape[-1], p1)
        tensors = (x1, g1, o1, x2, g2, o2)
        plan = _plan_cache("project", tensors, ints)
        # (the gradients' alignment is read, not assumed: a caller may hand over views into a larger buffer)
        _project(grid, tensors, ints, _constexprs(x1.shape[-1]), 4, plan_cache=plan, foreign=(x1, g1, x2, g2))
    it = iter(outs)
    return (None if gQ is None else next(it)), (None if gD is None else next(it))
