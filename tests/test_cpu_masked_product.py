"""CPU blocks against shared documents with a document mask, masked inside their product (maxsim.cpu._masked_product:
one GEMM of one more dimension, ``[Q, 1] · [D·valid, bias]ᵀ``) from MASKED_PRODUCT_MIN_ROWS query rows a token
dimension: scores and argmax as the masked fill's and the reference's, with ties, garbage (NaN, inf) under the mask,
non-finite tokens that count, documents without a valid token, half-precision inputs and the public training call;
a query holding a non-finite element (``inf · 0`` would be NaN) keeps the masked fill."""

from __future__ import annotations

import pytest
import torch
from helpers import spy

import maxsim
from maxsim import cpu, reference


def _ints(shape, seed: int) -> torch.Tensor:
    """Integer-valued tokens: every similarity and every sum exact, with ties between document tokens."""
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


def _d_mask(shape, seed: int) -> torch.Tensor:
    m = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.3
    m[..., 1, :] = False  # (a document without a valid token: its query tokens add 0 and choose -1)
    m[..., 0, :2] = True
    return m


def _both_ways(monkeypatch, *args):
    """``cpu._forward``'s (scores, argmax) masked in the product (asserting that it was), then by the fill."""
    calls = spy(monkeypatch, cpu, "_masked_product")
    with monkeypatch.context() as m:
        m.setattr(cpu, "MASKED_PRODUCT_MIN_ROWS", 0)
        got = cpu._forward(*args)[:2]
    assert calls, "the masked product was not taken"
    with monkeypatch.context() as m:
        m.setattr(cpu, "MASKED_PRODUCT_MIN_ROWS", 1 << 40)
        fill = cpu._forward(*args)[:2]
    return got, fill


@pytest.mark.parametrize("q_masked", [False, True], ids=["d_mask", "both masks"])
@pytest.mark.parametrize("need_argmax", [False, True], ids=["scores", "argmax"])
def test_equals_the_masked_fill_and_the_reference(q_masked, need_argmax, monkeypatch):
    Q, D = _ints((3, 5, 16), 1), _ints((1, 6, 9, 16), 2)
    d_mask = _d_mask((1, 6, 9), 3)
    q_mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(4)) > 0.3 if q_masked else None
    D[0, 2, ~d_mask[0, 2]] = float("nan")  # (garbage under the mask)
    D[0, 3, ~d_mask[0, 3]] = float("-inf")
    (s, a), (s0, a0) = _both_ways(monkeypatch, Q, D, q_mask, d_mask, False, need_argmax, torch.int32)
    ref_s, ref_a = reference.scores_and_argmax(Q.double(), D.double(), q_mask, d_mask)
    torch.testing.assert_close(s, ref_s.float(), rtol=0, atol=0)
    assert torch.equal(s, s0)
    if need_argmax:
        assert torch.equal(a.long(), ref_a) and torch.equal(a, a0)


def test_non_finite_tokens_that_count(monkeypatch):
    """An unmasked NaN or inf document token propagates as in the reference."""
    Q, D = _ints((3, 5, 16), 5), _ints((1, 6, 9, 16), 6)
    d_mask = _d_mask((1, 6, 9), 7)
    d_mask[0, 0, :3] = True
    D[0, 0, 0, 0] = float("nan")
    D[0, 0, 1, 1] = float("inf")
    D[0, 0, 2, 2] = float("-inf")
    (s, a), (s0, a0) = _both_ways(monkeypatch, Q, D, None, d_mask, False, True, torch.int32)
    ref_s, ref_a = reference.scores_and_argmax(Q.double(), D.double(), None, d_mask)
    torch.testing.assert_close(s.double(), ref_s, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(s, s0, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(a.long(), ref_a) and torch.equal(a, a0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_query_that_is_not_finite_keeps_the_masked_fill(bad, monkeypatch):
    Q, D = _ints((3, 5, 16), 8), _ints((1, 6, 9, 16), 9)
    d_mask = _d_mask((1, 6, 9), 10)
    Q[2, 1, 3] = bad
    monkeypatch.setattr(cpu, "MASKED_PRODUCT_MIN_ROWS", 0)
    calls = spy(monkeypatch, cpu, "_masked_product")
    s, a = cpu._forward(Q, D, None, d_mask, False, True, torch.int32)[:2]
    assert not calls
    ref_s, ref_a = reference.scores_and_argmax(Q.double(), D.double(), None, d_mask)
    torch.testing.assert_close(s.double(), ref_s, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_and_random_tokens(dtype, monkeypatch):
    g = torch.Generator().manual_seed(11)
    Q, D = torch.randn(4, 7, 24, generator=g).to(dtype), torch.randn(1, 5, 13, 24, generator=g).to(dtype)
    d_mask = _d_mask((1, 5, 13), 12)
    (s, a), (s0, a0) = _both_ways(monkeypatch, Q, D, None, d_mask, False, True, torch.int32)
    ref_s, ref_a = reference.scores_and_argmax(Q.double(), D.double(), None, d_mask)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(s.double(), ref_s, rtol=tol, atol=tol)
    torch.testing.assert_close(s, s0, rtol=tol, atol=tol)
    assert torch.equal(a.long(), ref_a)


def test_not_taken_with_normalize_candidates_or_few_rows(monkeypatch):
    Q, D = _ints((3, 5, 16), 13), _ints((1, 6, 9, 16), 14)
    d_mask = _d_mask((1, 6, 9), 15)
    calls = spy(monkeypatch, cpu, "_masked_product")
    monkeypatch.setattr(cpu, "MASKED_PRODUCT_MIN_ROWS", 0)
    cpu._forward(Q, D, None, d_mask, True, False, torch.int32)  # normalize
    cpu._forward(Q, D.expand(3, 6, 9, 16), None, d_mask.expand(3, 6, 9), False, False, torch.int32)  # candidates
    monkeypatch.setattr(cpu, "MASKED_PRODUCT_MIN_ROWS", 1)
    cpu._forward(Q, D, None, d_mask, False, False, torch.int32)  # 15 rows < 16 dims
    assert not calls
    cpu._forward(_ints((16, 1, 16), 20), D, None, d_mask, False, False, torch.int32)  # 16 rows
    assert len(calls) == 1


def test_public_training_call(monkeypatch):
    """``maxsim.maxsim`` with a ``d_mask`` (the general path's forward, with the argmax) trains as the reference."""
    monkeypatch.setattr(cpu, "MASKED_PRODUCT_MIN_ROWS", 0)
    calls = spy(monkeypatch, cpu, "_masked_product")
    Q = _ints((3, 5, 16), 16).requires_grad_()
    D = _ints((6, 9, 16), 17).requires_grad_()
    d_mask = _d_mask((1, 6, 9), 18)[0]
    grad = _ints((3, 6), 19)
    s = maxsim.maxsim(Q, D, d_mask=d_mask)
    dQ, dD = torch.autograd.grad(s, (Q, D), grad)
    assert calls
    Qr, Dr = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    r = reference.maxsim(Qr, Dr, None, d_mask)
    rQ, rD = torch.autograd.grad(r, (Qr, Dr), grad.double())
    torch.testing.assert_close(s.detach().double(), r.detach(), rtol=0, atol=0)
    torch.testing.assert_close(dQ.double(), rQ, rtol=0, atol=0)
    torch.testing.assert_close(dD.double(), rD, rtol=0, atol=0)
