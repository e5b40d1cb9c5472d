"""Python side of the Triton path: the same two functions as :mod:`maxsim.cpu`, launching the kernels.

Inputs are the canonical layout (:mod:`maxsim.layout`), already validated. Nothing here reads a tensor's values on
the host: grids and variants come from shapes only, so calls are free of host↔device syncs and CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..cpu import project_normalized_grad
from ..layout import NORM_EPS
from .backward import maxsim_bwd_dd_owned_kernel, maxsim_bwd_dd_scatter_kernel, maxsim_bwd_dq_kernel
from .configs import ForwardConfig, backward_config, forward_config
from .forward import maxsim_fwd_kernel

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
"""Kernels run on CPU tensors under Triton's interpreter (CI). Its bf16 ``tl.dot`` is wrong, so operands are
upcast there — and only there."""


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get IEEE fp32 products unless the user opted into TF32 via torch's matmul precision."""
    if dtype == torch.float32 and not INTERPRETER and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _upcast(dtype: torch.dtype) -> bool:
    return INTERPRETER and dtype != torch.float32


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _mask_u8(mask: Tensor | None, like: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """A bool mask viewed as uint8 (no copy) and its strides; a dummy pointer when absent."""
    if mask is None:
        return like, (0,) * 3
    return mask.view(torch.uint8), mask.stride()


def forward(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    normalize: bool,
    need_argmax: bool,
    cfg: ForwardConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, K]`` fp32 and argmax ``[Nq, K, Lq]`` int32 (or an empty int32 tensor).

    ``cfg`` overrides the launch table (offline tuning only)."""
    Nq, Lq, dim = Q.shape
    Bd, K, Ld, _ = D.shape
    scores = torch.empty((Nq, K), dtype=torch.float32, device=Q.device)
    argmax = torch.empty((Nq, K, Lq) if need_argmax else (0,), dtype=torch.int32, device=Q.device)
    if scores.numel() == 0:
        return scores, argmax
    if Lq == 0 or Ld == 0:
        return scores.zero_(), argmax.fill_(-1)
    Q, D = _last_dim_contiguous(Q), _last_dim_contiguous(D)
    shared = Bd == 1
    cfg = cfg or forward_config(Lq, dim, Nq, shared, need_argmax)
    qm, sqm = _mask_u8(q_mask, Q)
    dm, sdm = _mask_u8(d_mask, Q)
    n_qblocks = triton_cdiv(Nq, cfg.BQ)
    # Queries longer than one row block: one program per row block (more programs, shorter ones), partial scores
    # summed afterwards in a fixed order.
    n_rsplit = triton_cdiv(Lq, cfg.TQ) if (cfg.BQ == 1 and cfg.SPLIT_ROWS) else 1
    rows_per_prog = cfg.TQ if n_rsplit > 1 else Lq
    out = scores if n_rsplit == 1 else torch.empty((n_rsplit, Nq, K), dtype=torch.float32, device=Q.device)
    maxsim_fwd_kernel[(n_qblocks * n_rsplit * K,)](
        Q, D, qm, dm, out, argmax,
        Nq, K, Lq, Ld, dim,
        Q.stride(0), Q.stride(1),
        0 if shared else D.stride(0), D.stride(1), D.stride(2),
        sqm[0], sqm[1],
        0 if shared else sdm[0], sdm[1], sdm[2],
        n_qblocks, n_rsplit, rows_per_prog,
        TQ=cfg.TQ, BQ=cfg.BQ, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, NUM_K=cfg.NUM_K,
        HAS_QMASK=q_mask is not None, HAS_DMASK=d_mask is not None, NORMALIZE=normalize,
        SAVE_ARGMAX=need_argmax, DOT_PRECISION=_dot_precision(Q.dtype), UPCAST=_upcast(Q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if n_rsplit > 1:
        torch.sum(out, dim=0, out=scores)
    return scores, argmax


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _normalized_parts(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(||x|| fp32 [...], 1/max(||x||, eps) fp32 [...])`` per token: one pass, once per token (not per pair)."""
    norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    return norm, 1.0 / norm.clamp_min(NORM_EPS)


def backward(
    grad: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    normalize: bool,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """``(dQ like Q, dD like D)`` from the saved argmax; ``deterministic`` forbids atomics (bitwise reproducible)."""
    Nq, Lq, dim = Q.shape
    Bd, K, Ld, _ = D.shape
    shared = Bd == 1
    if Nq == 0 or K == 0 or Lq == 0 or Ld == 0:
        return torch.zeros_like(Q), torch.zeros_like(D)
    Q, D = _last_dim_contiguous(Q), _last_dim_contiguous(D)
    grad = grad.to(torch.float32).contiguous()
    cfg = backward_config(Lq, dim)
    if normalize:
        norm_q, inv_q = _normalized_parts(Q)
        norm_d, inv_d = _normalized_parts(D)
    else:
        inv_q = inv_d = grad  # unused pointers

    # dQ: gather, one program per (query, token block), summing over its documents in order (deterministic).
    # It is written straight in Q's dtype (fp32 when a normalize projection follows); splitting the documents
    # over more programs would need a partial-sum buffer of another dtype, i.e. a second variant compiled at a
    # data-dependent moment, which the launch table rules out.
    n_tb = triton_cdiv(Lq, cfg.BT)
    dQ = torch.empty((Nq, Lq, dim), dtype=torch.float32 if normalize else Q.dtype, device=Q.device)
    maxsim_bwd_dq_kernel[(Nq * n_tb,)](
        grad, argmax, D, inv_d, dQ,
        Nq, K, Lq, dim,
        0 if shared else D.stride(0), D.stride(1), D.stride(2),
        0 if (shared or not normalize) else inv_d.stride(0), inv_d.stride(1) if normalize else 0,
        n_tb,
        BT=cfg.BT, DIM_P=cfg.DIM_P, NORMALIZE=normalize,
        num_warps=cfg.num_warps,
    )  # fmt: skip

    # dD: documents scored by one query each (candidates, pairs) take the owner kernel, which is then also the
    # fastest (no zeroed fp32 buffer, no atomics, no cast); the cross product uses atomics unless asked not to.
    if deterministic or not shared:
        direct_d = not normalize
        gd = torch.empty((Bd, K, Ld, dim), dtype=D.dtype if direct_d else torch.float32, device=D.device)
        n_jb = triton_cdiv(Ld, cfg.BN)
        n_kb = triton_cdiv(dim, cfg.BLOCK_K)
        maxsim_bwd_dd_owned_kernel[(Bd * K * n_jb * n_kb,)](
            grad, argmax, Q, inv_q, gd,
            Nq, K, Lq, Ld, dim,
            Q.stride(0), Q.stride(1),
            gd.stride(0), gd.stride(1), gd.stride(2),
            n_jb, n_kb,
            TQ=cfg.TQ, BN=cfg.BN, BLOCK_K=cfg.BLOCK_K,
            SHARED_DOCS=shared, NORMALIZE=normalize, DOT_PRECISION=_dot_precision(Q.dtype),
            UPCAST=_upcast(Q.dtype),
            num_warps=cfg.num_warps,
        )  # fmt: skip
    else:
        direct_d = not normalize and D.dtype == torch.float32
        gd = torch.zeros((Bd, K, Ld, dim), dtype=torch.float32, device=D.device)
        maxsim_bwd_dd_scatter_kernel[(Nq * K * n_tb,)](
            grad, argmax, Q, inv_q, gd,
            K, Lq, dim,
            Q.stride(0), Q.stride(1),
            0 if shared else gd.stride(0), gd.stride(1), gd.stride(2),
            n_tb,
            BT=cfg.BT, DIM_P=cfg.DIM_P, NORMALIZE=normalize,
            num_warps=cfg.num_warps,
        )  # fmt: skip

    if normalize:
        dQ = project_normalized_grad(dQ, Q.float() * inv_q[..., None], norm_q)
        gd = project_normalized_grad(gd, D.float() * inv_d[..., None], norm_d)
        direct_d = False
    dD = gd if direct_d else gd.to(D.dtype)
    return dQ.to(Q.dtype), dD

