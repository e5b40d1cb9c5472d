"""Python side of the Triton path: the same two functions as :mod:`maxsim.cpu`, launching the kernels.

Inputs are the canonical layout (:mod:`maxsim.layout`), already validated. The forward's and the backward's plans
and launches are in :mod:`.launch_forward` and :mod:`.launch_backward` (their settings in :mod:`.launch_settings`);
here are the entry points :mod:`maxsim.ops` calls, and the plans of repeated training calls, which hold both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..layout import Ragged, Views
from . import launch_backward, launch_forward
from .launch_args import segment_pointers, shape_key
from .launch_backward import backward, csr
from .launch_forward import ForwardPlan, documents_key, forward_keeping_norms, keep_repeat, run_repeat

__all__ = [
    "StepPlan", "backward", "csr", "documents_key", "forward", "forward_keeping_norms", "keep_repeat", "keep_step",
    "run_repeat", "shape_key", "step_backward", "step_forward", "step_plan",
]  # fmt: skip


class StepPlan:
    """A repeated training call's plans (:func:`keep_step`): the forward's, which saves the argmax, the options the
    backward takes, and the full keys of its backward plans by the upstream gradient's strides (the plans stay among
    the backward plans, so that whatever clears those clears them for the step too)."""

    __slots__ = ("forward", "normalize", "deterministic", "views", "backward_keys")

    def __init__(self, forward: ForwardPlan, normalize: bool, deterministic: bool, views: Views | None) -> None:
        self.forward, self.normalize, self.deterministic, self.views = forward, normalize, deterministic, views
        self.backward_keys: dict[tuple, tuple] = {}


def keep_step(
    key: tuple, Q: Tensor, D: Tensor, normalize: bool, deterministic: bool, views: Views | None,
    q_mask: Tensor | None = None, d_mask: Tensor | None = None, rg: Ragged | None = None,
) -> None:  # fmt: skip
    """As :func:`keep_repeat`, for a training call whose forward (with the argmax) has just kept its plan: a repeat
    of the call then runs :func:`step_forward` and :func:`step_backward`."""
    plan = launch_forward.plans.get(launch_forward.plan_key(Q, D, q_mask, d_mask, normalize, True, rg, views))
    if plan is not None:
        launch_forward.plans[key] = StepPlan(plan, normalize, deterministic, views)


def step_plan(key: tuple) -> StepPlan | None:
    """The step plan filed under ``key`` by :func:`keep_step`, or None."""
    return launch_forward.plans.get(key)


def step_forward(
    step: StepPlan, Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, rg: Ragged | None = None
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """Scores, argmax and inverse norms (as :func:`forward_keeping_norms`) of a repeated training call: the
    forward plan's allocations and launches only (the masks and ``rg`` as in :func:`run_repeat`)."""
    if step.forward.lean is not None:
        return (*launch_forward.run_lean(step.forward, Q, D, q_mask, d_mask, True), None)
    segs = (Q, Q, Q, Q) if rg is None else segment_pointers(Q, rg)
    return launch_forward.run_forward(step.forward, Q, D, q_mask, d_mask, segs, True)


def step_backward(
    step: StepPlan, grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, norms: tuple[Tensor, Tensor] | None,
    rg: Ragged | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`backward` after :func:`step_forward` (``rg``: the forward's): the backward plan of these gradient
    strides by the key an earlier step built for them (``grad`` fp32; else the full :func:`backward`)."""
    if grad.dtype != torch.float32:
        return backward(grad, Q, D, argmax, step.normalize, step.deterministic, rg, norms, step.views)
    strides = grad.stride()
    key = step.backward_keys.get(strides)
    plan = None if key is None else launch_backward.plans.get(key)
    if plan is None:
        # (Q and D are last-dim contiguous, as the forward files no plan for others, and the problem is not empty;
        # a ragged signature's plans hold its segments' shapes and maxima, which a step's key holds too)
        key, plan = launch_backward.backward_plan_of(grad, Q, D, step.normalize, step.deterministic, rg, step.views)
        step.backward_keys[strides] = key
    return launch_backward.run_backward(plan, grad, Q, D, argmax, step.normalize, rg, norms)


def forward(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """Scores and argmax: :func:`forward_keeping_norms` (same arguments) without the inverse norms."""
    scores, argmax, _norms = forward_keeping_norms(*args, **kwargs)
    return scores, argmax
