"""``torch.func``'s reverse-mode transforms (``grad``, ``grad_and_value``, ``vjp``) of calls that differentiate maxsim,
as functional training loops (``torch.func.functional_call``) use them. The PyTorch path's gradients there are the
reference's, and differentiable again (a transform of a transform); the Triton path's are the eager call's bit for
bit, once: a second level raises instead of dropping the second-order term, as in eager calls. ``vmap`` of a
gradient (``jacrev``, per-sample gradients) is refused by PyTorch, by name."""

from __future__ import annotations

import pytest
import torch
from helpers import keep_under_interpreter, triton_usable
from test_second_order import CASES, _cases

import maxsim


def _weights(fn, Q, D, kw):
    """Distinct upstream weights for the scores (so every score's gradient counts, each differently)."""
    n = fn(Q, D, **kw).numel()
    return torch.linspace(0.5, 2.0, n, dtype=torch.float64).to(Q).view(fn(Q, D, **kw).shape)


def _loss(fn, kw, w):
    return lambda q, d: (fn(q, d, **kw) * w).sum()


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_the_pytorch_path_under_torch_func_grad_has_the_references_gradients(case):
    name, fn, ref, Q, D, kw = _cases("cpu", torch.float64)[case]
    w = _weights(ref, Q, D, kw)
    want = torch.func.grad(_loss(ref, kw, w), argnums=(0, 1))(Q, D)
    with maxsim.backend("torch"):
        got = torch.func.grad(_loss(fn, kw, w), argnums=(0, 1))(Q, D)
        (got_q, got_d), value = torch.func.grad_and_value(_loss(fn, kw, w), argnums=(0, 1))(Q, D)
        scores, pullback = torch.func.vjp(lambda q, d: fn(q, d, **kw), Q, D)
        pulled = pullback(w)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(value, (ref(Q, D, **kw) * w).sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close((got_q, got_d), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pulled, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(scores, ref(Q, D, **kw), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_the_pytorch_path_differentiates_twice_under_torch_func(case):
    """A gradient penalty written with transforms: ``grad`` of ``|grad(Σ scores)|²`` is the reference's."""
    name, fn, ref, Q, D, kw = _cases("cpu", torch.float64)[case]

    def penalty(f):
        return lambda q, d: (torch.func.grad(lambda q2: f(q2, d, **kw).sum())(q) ** 2).sum() + f(q, d, **kw).sum()

    want = torch.func.grad(penalty(ref), argnums=(0, 1))(Q, D)
    with maxsim.backend("torch"):
        got = torch.func.grad(penalty(fn), argnums=(0, 1))(Q, D)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_the_triton_path_under_torch_func_grad_is_the_eager_calls(case, backward, device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    keep_under_interpreter(CASES[case] in ("masked", "candidates", "pair list") or backward == "fast", "triton", device)
    name, fn, _ref, Q, D, kw = _cases(device, torch.float32)[case]
    kw = dict(kw, backward=backward)
    with maxsim.backend("triton"):
        w = _weights(fn, Q, D, kw)
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        want = torch.autograd.grad((fn(Qg, Dg, **kw) * w).sum(), (Qg, Dg))
        for _ in range(2):  # (the second: after the eager call filed its repeat, which a transform must not take)
            got = torch.func.grad(_loss(fn, kw, w), argnums=(0, 1))(Q, D)
            for a, b in zip(got, want, strict=True):
                assert not a.requires_grad and torch.equal(a, b), name
        scores, pullback = torch.func.vjp(lambda q, d: fn(q, d, **kw), Q, D)
        assert torch.equal(scores, fn(Q, D, **kw)), name
        for a, b in zip(pullback(w), want, strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_the_triton_path_refuses_a_second_differentiation_under_torch_func(case, device):
    """A transform of a transform, and regular autograd through a transform's gradient of inputs that require
    grad (``functional_call`` of parameters not detached): both raise, where the term would otherwise be dropped."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    keep_under_interpreter(CASES[case] in ("cross", "pair list"), "triton", device)
    name, fn, _ref, Q, D, kw = _cases(device, torch.float32)[case]
    with maxsim.backend("triton"):
        with pytest.raises(RuntimeError, match="not differentiable"):
            torch.func.grad(lambda q: (torch.func.grad(lambda q2: fn(q2, D, **kw).sum())(q) ** 2).sum())(Q)
        Qg, Qe = Q.clone().requires_grad_(), Q.clone().requires_grad_()
        g = torch.func.grad(lambda q: (fn(q, D, **kw) ** 2).sum())(Qg)
        (want,) = torch.autograd.grad((fn(Qe, D, **kw) ** 2).sum(), Qe)
        assert g.requires_grad and torch.equal(g.detach(), want), name
        with pytest.raises(RuntimeError, match="not differentiable"):
            g.sum().backward()


def test_vmap_of_a_gradient_is_refused_by_name():
    name, fn, _ref, Q, D, kw = _cases("cpu", torch.float64)[0]
    with maxsim.backend("torch"), pytest.raises(RuntimeError, match="vmap"):
        torch.func.vmap(torch.func.grad(lambda q: fn(q, D).sum()))(torch.stack([Q, 2 * Q]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_masks_and_offsets_made_inside_the_transform(backend, device):
    """A document mask and packed offsets computed inside the transformed function (the transform's own tensors)."""
    if backend == "triton" and not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    dtype = torch.float64 if backend == "torch" else torch.float32
    g = torch.Generator().manual_seed(5)
    Q = torch.randn(3, 4, 16, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    D = torch.randn(5, 6, 16, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    D[1, 4:] = 0
    Qp, Dp = Q.reshape(12, 16), D.reshape(30, 16)
    lq, ld = torch.tensor([3, 5, 4], device=device), torch.tensor([6, 1, 9, 4, 10], device=device)

    def masked(q, d):
        return (maxsim.maxsim(q, d, d_mask=d.abs().sum(-1) > 0) ** 2).sum()

    def packed(q, d):
        cu_q = torch.nn.functional.pad(lq.cumsum(0), (1, 0)).int() + (q.sum() * 0).int()
        cu_d = torch.nn.functional.pad(ld.cumsum(0), (1, 0)).int()
        return (maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=5, max_seqlen_d=10) ** 2).sum()

    with maxsim.backend(backend):
        for loss, q, d in ((masked, Q, D), (packed, Qp, Dp)):
            got = torch.func.grad(loss, argnums=(0, 1))(q, d)
            qg, dg = q.clone().requires_grad_(), d.clone().requires_grad_()
            want = torch.autograd.grad(loss(qg, dg), (qg, dg))
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
