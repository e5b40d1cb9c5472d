"""Second-order gradients (a gradient of maxsim differentiated again, as a gradient penalty does). The PyTorch path
computes its gradients with differentiable ops at the forward's argmax, so they match the reference's; the Triton
path's kernels record no graph, so a second-order term through them raises instead of being silently dropped, and a
``create_graph=True`` backward that is not differentiated again gives the plain gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import keep_under_interpreter, rand_mask, triton_usable

import maxsim
from maxsim import reference


def _cases(device, dtype):
    """``(name, library function, reference function, Q, D)``: the four layouts, dense ones with masks."""
    g = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    Q, D, Dc = randn(3, 5, 16), randn(4, 9, 16), randn(3, 4, 9, 16)
    q_mask, d_mask = rand_mask((3, 5), seed=1, device=device), rand_mask((4, 9), seed=2, device=device)
    d_mask[:, 0] = True
    cu_q = torch.tensor([0, 3, 8, 12], dtype=torch.int32, device=device)
    cu_d = torch.tensor([0, 6, 7, 16, 20], dtype=torch.int32, device=device)
    pq = torch.tensor([0, 2, 1, 2, 0], dtype=torch.int32, device=device)
    pd = torch.tensor([3, 0, 1, 1, 2], dtype=torch.int32, device=device)
    Qp, Dp = randn(12, 16), randn(20, 16)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_d=cu_d)
    return [
        ("cross", maxsim.maxsim, reference.maxsim, Q, D, {}),
        ("one query", maxsim.maxsim, reference.maxsim, Q[1], D, {}),
        ("masked cross", maxsim.maxsim, reference.maxsim, Q, D, dict(q_mask=q_mask, d_mask=d_mask)),
        ("candidates", maxsim.maxsim, reference.maxsim, Q, Dc, {}),
        ("one document", maxsim.maxsim, reference.maxsim, Q, D[2], {}),
        ("pairs", maxsim.maxsim_pairs, reference.maxsim_pairs, Q, D[:3], {}),
        ("varlen", maxsim.maxsim_varlen, reference.maxsim_varlen, Qp, Dp, varlen),
        ("pair list", maxsim.maxsim_pairs_varlen, reference.maxsim_pairs_varlen, Qp, Dp, dict(**varlen, pair_q=pq,
                                                                                             pair_d=pd)),
    ]  # fmt: skip


CASES = ["cross", "one query", "masked", "candidates", "one document", "pairs", "varlen", "pair list"]


def _penalty_grads(fn, Q, D, kw):
    """``d/d(Q, D)`` of ``Σ scores + |∂(Σ scores)/∂Q|²``."""
    Q, D = Q.clone().requires_grad_(), D.clone().requires_grad_()
    s = fn(Q, D, **kw)
    (dQ,) = torch.autograd.grad(s.sum(), Q, create_graph=True)
    return torch.autograd.grad(s.sum() + (dQ**2).sum(), (Q, D))


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_the_pytorch_path_has_the_references_second_order_gradients(case):
    name, fn, ref, Q, D, kw = _cases("cpu", torch.float64)[case]
    want = _penalty_grads(ref, Q, D, kw)
    with maxsim.backend("torch"):
        for _ in range(2):  # (the second call: a repeated step, where the signature allows one)
            got = _penalty_grads(fn, Q, D, kw)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_the_triton_path_refuses_second_order_gradients(case, device):
    """Twice: the full path, then (dense layouts) a repeated call of the same signature."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    name, fn, _ref, Q, D, kw = _cases(device, torch.float32)[case]
    with maxsim.backend("triton"):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="not differentiable"):
                _penalty_grads(fn, Q, D, kw)
            Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
            recorded = torch.autograd.grad(fn(Qg, Dg, **kw).sum(), (Qg, Dg), create_graph=True)
            plain = torch.autograd.grad(fn(Qg, Dg, **kw).sum(), (Qg, Dg))
            for a, b in zip(recorded, plain, strict=True):
                assert a.requires_grad and torch.equal(a.detach(), b), name


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_compiled_calls_refuse_second_order_gradients(case, backend, device):
    """Under ``torch.compile`` the op's backward is PyTorch's compiled one, which refuses a second differentiation
    only through the inputs its graph saved as they came: the caller's ``Q`` and ``D`` must reach the op as given
    (a 3-D ``D``, a 2-D query or document, the pairs' ``D`` are viewed inside it), or a term through ``D`` would be
    dropped silently. First-order gradients of a ``create_graph=True`` backward are the plain ones."""
    keep_under_interpreter(CASES[case] in ("cross", "pairs"), backend, device)
    name, fn, _ref, Q, D, kw = _cases(device, torch.float64 if backend == "torch" else torch.float32)[case]
    if "cu_seqlens_q" in kw:  # (compiled ragged calls take the longest lengths: no data-dependent shapes)
        kw = dict(kw, max_seqlen_q=5, max_seqlen_d=9)
    torch.compiler.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    s = compiled(Qg, Dg, **kw)
    recorded = torch.autograd.grad(s.sum(), (Qg, Dg), create_graph=True)
    plain = torch.autograd.grad(fn(Qg, Dg, **kw).sum(), (Qg, Dg))
    for a, b in zip(recorded, plain, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for wrt in (Qg, Dg):
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad((recorded[0] ** 2).sum(), wrt, retain_graph=True)
