"""Repeated inference calls of ``maxsim.maxsim`` (``ops.repeat_key``): a mask-free scores-only call whose signature
an earlier call had goes straight to that call's launch plan. It must give what the full path gives, take the full
path whenever anything the plan depends on differs, and never skip a check that the call would fail."""

from __future__ import annotations

import pytest
import torch
from helpers import int_grid, spy, triton_usable

import maxsim
from maxsim import ops
from maxsim.reference import maxsim as maxsim_reference


@pytest.fixture
def triton_only(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    with maxsim.backend("triton"):
        yield


@pytest.fixture
def plan_keys(monkeypatch):
    """Counts how often the forward builds a plan's full key (what a repeat call does without)."""
    from maxsim.kernels import launch

    ops._triton_path()  # (before a first Triton call nothing is filed: repeat_key is None)
    monkeypatch.setattr(launch, "_plans", {})
    return spy(monkeypatch, launch, "_plan_key")


def _inputs(device, nq=3, nd=4, lq=5, ld=9, dim=16, dtype=torch.float16, seed=1):
    # (small integers: every path sums them exactly, so results compare bit for bit)
    Q = int_grid((nq, lq, dim), seed=seed, dtype=dtype, device=device)
    D = int_grid((nd, ld, dim), seed=seed + 1, dtype=dtype, device=device)
    return Q, D


def test_a_repeat_call_skips_to_the_plan_and_scores_the_same(triton_only, plan_keys, device):
    Q, D = _inputs(device)
    first = maxsim.maxsim(Q, D)
    assert len(plan_keys) == 2  # (the forward's lookup, then filing it for repeats)
    Q2, D2 = _inputs(device, seed=5)  # (other tensors, other values, the same signature)
    again = maxsim.maxsim(Q2, D2)
    assert len(plan_keys) == 2
    torch.testing.assert_close(first, maxsim_reference(Q, D).float(), rtol=0, atol=0)
    torch.testing.assert_close(again, maxsim_reference(Q2, D2).float(), rtol=0, atol=0)


@pytest.mark.parametrize("shape", ["cross", "candidates", "one query", "one document", "one of each"])
def test_repeats_of_every_dense_shape_score_as_the_reference(shape, triton_only, plan_keys, device):
    """The repeat's result comes in the caller's shape (the plan's), squeezed axes included."""
    for seed in (1, 5):
        Q, D = _inputs(device, seed=seed)
        if shape == "candidates":
            D = torch.stack([D, D.flip(0), D * 2])  # [Nq = 3, K = 4, Ld, dim]
        Q = Q[0] if shape in ("one query", "one of each") else Q
        D = D[1] if shape in ("one document", "one of each") else D
        out = maxsim.maxsim(Q, D)
        want = maxsim_reference(Q, D).float()
        assert out.shape == want.shape
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert len(plan_keys) == 2  # (the first call's lookup and filing; the second call is a repeat)


@pytest.mark.parametrize(
    "change",
    ["shape", "strides", "dtype", "normalize", "backend", "masks", "argmax", "grad", "squeezed"],
)
def test_anything_the_plan_depends_on_takes_the_full_path(change, triton_only, plan_keys, device):
    Q, D = _inputs(device)
    maxsim.maxsim(Q, D)
    n = len(plan_keys)
    kw: dict = {}
    if change == "shape":
        Q, D = _inputs(device, nd=5)
    elif change == "strides":
        D = _inputs(device, nd=8)[1][::2]
    elif change == "dtype":
        Q, D = _inputs(device, dtype=torch.float32)
    elif change == "normalize":
        kw["normalize"] = True
    elif change == "masks":
        kw["d_mask"] = torch.ones(D.shape[:-1], dtype=torch.bool, device=device)
    elif change == "argmax":
        kw["return_argmax"] = True
    elif change == "grad":
        Q = Q.clone().requires_grad_()
    elif change == "squeezed":
        Q = Q[0]
    if change == "backend":
        with maxsim.backend("torch"):
            out = maxsim.maxsim(Q, D)
        assert len(plan_keys) == n  # (the PyTorch path: no plan at all)
    else:
        out = maxsim.maxsim(Q, D, **kw)
        assert len(plan_keys) > n
    want = maxsim_reference(Q.detach(), D, normalize=kw.get("normalize", False)).float()
    scores = out[0] if change == "argmax" else out
    tol = 2e-3 if change == "normalize" else 0  # (normalized fp16 tokens are rounded; integers are not)
    torch.testing.assert_close(scores.detach(), want, rtol=tol, atol=tol)


def test_a_repeated_signature_still_checks_the_options(triton_only, plan_keys, device):
    Q, D = _inputs(device)
    maxsim.maxsim(Q, D)
    with pytest.raises(TypeError, match="normalize"):
        maxsim.maxsim(Q, D, normalize=1)
    with pytest.raises(ValueError, match="backward"):
        maxsim.maxsim(Q, D, backward="fastest")
    with pytest.raises(TypeError, match="return_argmax"):
        maxsim.maxsim(Q, D, return_argmax=0)


def test_repeat_entries_go_with_the_plans(triton_only, plan_keys, device):
    """Whatever clears the plans (a change of the launch settings must) clears the repeat entries with them."""
    from maxsim.kernels import launch

    Q, D = _inputs(device)
    maxsim.maxsim(Q, D)
    assert ops.repeat_key(Q, D, False, "auto") in launch._plans
    launch._plans.clear()
    n = len(plan_keys)
    maxsim.maxsim(Q, D)
    assert len(plan_keys) == n + 2
