"""Forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``) and ``torch.func.vmap`` of calls whose inputs
do not require grad. The PyTorch path computes with differentiable, batchable PyTorch ops, so its tangents and
batched scores are the reference's (where an op has no forward AD, PyTorch raises); the Triton kernels propagate no
tangent, so a dual input raises there instead of giving scores whose tangent is silently zero."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import triton_usable
from test_second_order import CASES, _cases

import maxsim


def _tangent(fn, Q, D, kw, tQ, tD):
    with fwAD.dual_level():
        s = fn(fwAD.make_dual(Q, tQ), fwAD.make_dual(D, tD), **kw)
        primal, tangent = fwAD.unpack_dual(s)
        return primal, tangent


def _directions(Q, D):
    g = torch.Generator().manual_seed(11)
    return (torch.randn(Q.shape, generator=g, dtype=torch.float64).to(Q),
            torch.randn(D.shape, generator=g, dtype=torch.float64).to(D))  # fmt: skip


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_the_pytorch_path_has_the_references_tangents(case):
    name, fn, ref, Q, D, kw = _cases("cpu", torch.float64)[case]
    tQ, tD = _directions(Q, D)
    if name == "varlen":  # (a small varlen batch reduces with segment_reduce, which has no forward AD: it says so)
        with maxsim.backend("torch"), pytest.raises(NotImplementedError, match="forward AD"):
            _tangent(fn, Q, D, kw, tQ, tD)
        return
    with maxsim.backend("torch"):
        for _ in range(2):  # (the second call: a repeat, where the signature allows one)
            got = _tangent(fn, Q, D, kw, tQ, tD)
            want = _tangent(ref, Q, D, kw, tQ, tD)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
        _, jvp = torch.func.jvp(lambda q, d: fn(q, d, **kw), (Q, D), (tQ, tD))
    torch.testing.assert_close(jvp, want[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_the_triton_path_refuses_tangents(case, device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    name, fn, _ref, Q, D, kw = _cases(device, torch.float32)[case]
    tQ, tD = _directions(Q, D)
    with maxsim.backend("triton"):
        scores = fn(Q, D, **kw)  # (a plain call first: the dual calls must not take its repeat)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="forward-mode AD tangent"):
                _tangent(fn, Q, D, kw, tQ, tD)
        with pytest.raises(RuntimeError, match="forward-mode AD tangent"):
            torch.func.jvp(lambda q: fn(q, D, **kw), (Q,), (tQ,))
        assert torch.equal(fn(Q, D, **kw), scores), name  # (the plain call still repeats as before)


def test_the_pytorch_path_under_vmap_is_the_references():
    """``vmap`` over a leading batch of query sets (the PyTorch path's ops are batched by the transform)."""
    name, fn, ref, Q, D, kw = _cases("cpu", torch.float64)[0]
    Qs = torch.stack([Q, Q.flip(0), 2 * Q])
    with maxsim.backend("torch"):
        got = torch.func.vmap(lambda q: fn(q, D))(Qs)
    torch.testing.assert_close(got, torch.stack([ref(q, D) for q in Qs]), rtol=1e-12, atol=1e-12)


def test_the_triton_path_refuses_vmap(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    name, fn, _ref, Q, D, kw = _cases(device, torch.float32)[0]
    with maxsim.backend("triton"):
        fn(Q, D)  # (filed for repeats: a batched call must not take the repeat)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="torch.func transform"):
                torch.func.vmap(lambda q: fn(q, D))(torch.stack([Q, Q]))
