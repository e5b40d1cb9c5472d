"""The registered operators ``maxsim::forward`` / ``maxsim::backward``, and the autograd glue around them.

Both ops take the canonical layout (:mod:`maxsim.layout`) and an ``impl`` string (``"triton"`` or ``"torch"``)
chosen in Python beforehand, so ``torch.compile(fullgraph=True)`` sees one opaque call on every device. Autograd
saves the int32 argmax only (never the similarity tensor).

Eager calls skip the dispatcher: :func:`maxsim_canonical` runs the same implementation functions through a plain
``autograd.Function`` (the custom-op machinery costs ~100 µs of host time per call, more than a small training step's
GPU work); under ``torch.compile`` it calls the registered ops instead. Both routes share every line of math.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu
from .layout import accum_dtype


def _triton_path():
    from .kernels import launch  # imported lazily: the torch path must work without triton

    return launch


def forward_impl(
    Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, normalize: bool, need_argmax: bool, impl: str
) -> tuple[Tensor, Tensor]:
    if impl == "triton":
        return _triton_path().forward(Q, D, q_mask, d_mask, normalize, need_argmax)
    return cpu.forward(Q, D, q_mask, d_mask, normalize, need_argmax)


def backward_impl(
    grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, normalize: bool, deterministic: bool, impl: str
) -> tuple[Tensor, Tensor]:
    if impl == "triton":
        return _triton_path().backward(grad, Q, D, argmax, normalize, deterministic)
    return cpu.backward(grad, Q, D, argmax, normalize, deterministic)


@torch.library.custom_op("maxsim::forward", mutates_args=())
def forward(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    normalize: bool,
    need_argmax: bool,
    impl: str,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, K]`` (fp32; fp64 for fp64 inputs) and argmax ``[Nq, K, Lq]`` int32 (``[0]`` if not asked).

    ``Q [Nq, Lq, dim]``, ``D [Bd, K, Ld, dim]`` (``Bd`` = 1 or ``Nq``), ``q_mask [Nq, Lq]``, ``d_mask [Bd, K, Ld]``.
    ``deterministic`` only matters to the backward (it is recorded here for autograd).
    """
    return forward_impl(Q, D, q_mask, d_mask, normalize, need_argmax, impl)


@forward.register_fake
def _forward_fake(Q, D, q_mask, d_mask, normalize, need_argmax, impl, deterministic=False):
    Nq, Lq, _ = Q.shape
    K = D.shape[1]
    scores = Q.new_empty((Nq, K), dtype=accum_dtype(Q.dtype))
    argmax = Q.new_empty((Nq, K, Lq) if need_argmax else (0,), dtype=torch.int32)
    return scores, argmax


@torch.library.custom_op("maxsim::backward", mutates_args=())
def backward(
    grad: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    normalize: bool,
    deterministic: bool,
    impl: str,
) -> tuple[Tensor, Tensor]:
    """``(dQ like Q, dD like D)`` from ``grad [Nq, K]`` and the forward's ``argmax [Nq, K, Lq]``."""
    return backward_impl(grad, Q, D, argmax, normalize, deterministic, impl)


@backward.register_fake
def _backward_fake(grad, Q, D, argmax, normalize, deterministic, impl):
    return Q.new_empty(Q.shape), D.new_empty(D.shape)


def _setup_context(ctx, inputs, output) -> None:
    Q, D, _q_mask, _d_mask, normalize, need_argmax, impl, *rest = inputs
    _scores, argmax = output
    ctx.save_for_backward(Q, D, argmax)
    ctx.normalize = normalize
    ctx.need_argmax = need_argmax
    ctx.impl = impl
    ctx.deterministic = bool(rest[0]) if rest else False


def _backward(ctx, grad_scores: Tensor, _grad_argmax: Tensor | None):
    Q, D, argmax = ctx.saved_tensors
    if not ctx.need_argmax:
        raise RuntimeError(
            "maxsim: backward through a forward that was called with need_argmax=False; the public functions set it "
            "whenever an input requires grad"
        )
    dQ, dD = backward(grad_scores, Q, D, argmax, ctx.normalize, ctx.deterministic, ctx.impl)
    return dQ, dD, None, None, None, None, None, None


torch.library.register_autograd("maxsim::forward", _backward, setup_context=_setup_context)


class _MaxSimFunction(torch.autograd.Function):
    """Eager twin of ``maxsim::forward`` + its registered autograd (same implementation functions)."""

    @staticmethod
    def forward(ctx, Q, D, q_mask, d_mask, normalize, impl, deterministic):
        scores, argmax = forward_impl(Q, D, q_mask, d_mask, normalize, True, impl)
        ctx.save_for_backward(Q, D, argmax)
        ctx.normalize, ctx.impl, ctx.deterministic = normalize, impl, deterministic
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        Q, D, argmax = ctx.saved_tensors
        dQ, dD = backward_impl(grad_scores, Q, D, argmax, ctx.normalize, ctx.deterministic, ctx.impl)
        return dQ, dD, None, None, None, None, None


def maxsim_canonical(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    normalize: bool,
    impl: str,
    deterministic: bool,
) -> Tensor:
    """Scores ``[Nq, K]`` of canonical inputs, differentiable; the argmax is computed only when a grad is needed."""
    need_argmax = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    if torch.compiler.is_compiling():
        return forward(Q, D, q_mask, d_mask, normalize, need_argmax, impl, deterministic)[0]
    if need_argmax:
        return _MaxSimFunction.apply(Q, D, q_mask, d_mask, normalize, impl, deterministic)
    return forward_impl(Q, D, q_mask, d_mask, normalize, False, impl)[0]
