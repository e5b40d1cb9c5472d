"""The CPU blocks computed documents first (``D·Qᵀ``, query rows padded to 32: maxsim.cpu.DOCUMENTS_FIRST_WIDTH).

* the rule: 32 query rows per GEMM (a query's own, or every query's against shared documents), 23-31 rows from 64
  dims, and only blocks of DOCUMENTS_FIRST_MIN_SIMS similarities or more (keeping the argmax:
  DOCUMENTS_FIRST_MIN_ARGMAX_SIMS);
* every such block, cross product and candidates, with masks with holes, a document without a valid token, NaN and
  inf tokens (masked and not), ties (integer tokens), normalize (both ways of applying the documents' norms) and
  non-contiguous tokens: scores as the queries-first path's and the reference's, argmax equal to both (ties to the
  lowest index);
* the training step's sum of similarities (forward_for_step) leaves the padding columns out: finite where every token
  is, and the gradients through it equal the queries-first path's;
* pair lists grouped by document (maxsim.cpu_by_document, whose GEMMs hold a document's pairs' query rows): the same
  rule, scores and argmax equal, bitwise, to the queries-first product's and the reference's, short queries and
  normalize included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import spy
from test_cpu_by_document import _scores_and_argmax
from test_ragged import Ragged, build, check_ragged, ref_call

import maxsim
from maxsim import cpu, reference


def _ints(shape, seed: int) -> torch.Tensor:
    """Integer-valued tokens: every similarity and every sum exact, with ties between document tokens."""
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


def _queries_first(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "DOCUMENTS_FIRST_WIDTH", -1)  # (no block has -1 rows, nor 23..-2)


def _any_size(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "DOCUMENTS_FIRST_MIN_SIMS", 0)
    monkeypatch.setattr(cpu, "DOCUMENTS_FIRST_MIN_ARGMAX_SIMS", 0)


def _run(Q, D, q_mask, d_mask, normalize, need_argmax, index_dtype=torch.int32):
    return cpu._forward(Q, D, q_mask, d_mask, normalize, need_argmax, index_dtype, sum_sims=True)


def test_rule():
    first = cpu._documents_first
    assert first(32, 16, 1 << 12, False)  # 32 rows: any width
    assert first(32, 128, 1 << 15, True)
    assert not first(32, 128, (1 << 12) - 1, False)  # a tiny block: its views cost more than the product saves
    assert not first(32, 128, (1 << 15) - 1, True)  # (keeping the argmax: more views)
    assert first(23, 64, 1 << 20, True) and first(31, 96, 1 << 20, False)
    assert not first(23, 48, 1 << 20, False)  # narrow tokens: the padding costs more
    assert not first(22, 128, 1 << 20, False) and not first(16, 128, 1 << 20, False)
    assert not first(33, 128, 1 << 20, False) and not first(64, 128, 1 << 20, False)


# (Q shape, D shape, taken documents first): shared documents with 1 x 32, 2 x 16 and 1 x 25 rows (dim 64);
# a query's own candidates of 32 and 24 rows; 16 rows (not taken: the comparison still holds)
SHAPES = [
    ((1, 32, 16), (1, 5, 9, 16), True),
    ((2, 16, 16), (1, 4, 7, 16), True),
    ((1, 25, 64), (1, 3, 6, 64), True),
    ((3, 32, 16), (3, 4, 7, 16), True),
    ((2, 24, 64), (2, 3, 5, 64), True),
    ((1, 16, 16), (1, 4, 7, 16), False),
]


def _masks(Q, D, seed):
    g = torch.Generator().manual_seed(seed)
    q_mask = torch.rand(Q.shape[:2], generator=g) > 0.3
    d_mask = torch.rand(D.shape[:3], generator=g) > 0.4
    d_mask[0, 1] = False  # a document without a valid token
    return q_mask, d_mask


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("need_argmax", [False, True])
def test_equals_queries_first_and_reference_with_ties(shape, masked, need_argmax, monkeypatch):
    q_shape, d_shape, taken = shape
    Q, D = _ints(q_shape, 1), _ints(d_shape, 2)
    q_mask, d_mask = _masks(Q, D, 3) if masked else (None, None)
    _any_size(monkeypatch)
    calls = spy(monkeypatch, cpu, "_block_documents_first")
    s, a, total = _run(Q, D, q_mask, d_mask, False, need_argmax)
    assert bool(calls) == taken
    ref_s, ref_a = reference.scores_and_argmax(Q.double(), D.double(), q_mask, d_mask)
    torch.testing.assert_close(s, ref_s.float(), rtol=0, atol=0)  # integer tokens: exact in any order
    with monkeypatch.context() as m:
        _queries_first(m)
        s0, a0, total0 = _run(Q, D, q_mask, d_mask, False, need_argmax)
    torch.testing.assert_close(s, s0, rtol=0, atol=0)
    torch.testing.assert_close(total, total0, rtol=0, atol=0)
    if need_argmax:
        assert a.dtype == torch.int32 and a.is_contiguous()
        assert torch.equal(a.long(), ref_a) and torch.equal(a, a0)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a non-contiguous layout (tokens along the last dimension in memory)."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_random_tokens_match_the_reference(shape, normalize, contiguous, monkeypatch):
    q_shape, d_shape, _ = shape
    g = torch.Generator().manual_seed(5)
    Q, D = torch.randn(q_shape, generator=g), torch.randn(d_shape, generator=g)
    if not contiguous:
        Q, D = _strided(Q), _strided(D)
    q_mask, d_mask = _masks(Q, D, 6)
    _any_size(monkeypatch)
    calls = spy(monkeypatch, cpu, "_block_documents_first")
    s, a, _ = _run(Q, D, q_mask, d_mask, normalize, True)
    assert calls
    ref_s, ref_a = reference.scores_and_argmax(Q.double(), D.double(), q_mask, d_mask, normalize=normalize)
    torch.testing.assert_close(s.double(), ref_s, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.long(), ref_a)


@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: f"{s[0]}-{s[1]}")
def test_nan_and_inf_tokens(shape, monkeypatch):
    """A NaN or inf token that is masked stays out; an unmasked one propagates as in the reference (the padding
    columns it turns NaN are never read)."""
    q_shape, d_shape, _ = shape
    Q, D = _ints(q_shape, 7), _ints(d_shape, 8)
    q_mask, d_mask = _masks(Q, D, 9)
    D[0, 0, 0] = float("nan")
    D[0, 0, 1] = float("inf")
    D[-1, 2, 0] = float("-inf")
    d_mask[-1, 2, 0] = False  # masked: stays out
    d_mask[0, 0, :2] = True  # unmasked: propagates
    _any_size(monkeypatch)
    calls = spy(monkeypatch, cpu, "_block_documents_first")
    s, a, _ = _run(Q, D, q_mask, d_mask, False, True)
    assert calls
    ref_s, ref_a = reference.scores_and_argmax(Q.double(), D.double(), q_mask, d_mask)
    torch.testing.assert_close(s.double(), ref_s, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(a.long(), ref_a)


def test_step_sum_and_gradients(monkeypatch):
    """The public training call on a block taken documents first (forward_for_step): int64 argmax view, the sum of
    the similarities finite, gradients equal to the queries-first path's (integer tokens: exact)."""
    Q, D = _ints((1, 32, 16), 10), _ints((12, 96, 16), 11)  # 32 x 12 x 96 >= 2^15 similarities, Ld <= STEP_MAX_LD

    def step():
        q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
        scores, argmax = maxsim.maxsim(q, d, return_argmax=True)
        g = torch.randint(-4, 5, scores.shape, generator=torch.Generator().manual_seed(12)).float()
        return (scores, argmax, *torch.autograd.grad(scores, (q, d), g))

    sums = spy(monkeypatch, cpu, "forward_for_step", record=lambda args, out: out[2])
    calls = spy(monkeypatch, cpu, "_block_documents_first")
    new = step()
    assert calls and sums and bool(torch.isfinite(sums[0]))
    with monkeypatch.context() as m:
        _queries_first(m)
        old = step()
    for x, y in zip(new, old, strict=True):
        assert torch.equal(x, y)
    D_inf = D.clone()
    D_inf[3, 5, 2] = float("inf")
    sums.clear()
    s, _ = maxsim.maxsim(Q.clone().requires_grad_(), D_inf.clone().requires_grad_(), return_argmax=True)
    assert sums and not bool(torch.isfinite(sums[0]))


# pair lists over documents of one length: m pairs a document of queries up to lq rows (a GEMM of m·lq rows)
BY_DOCUMENT = [
    Ragged((32, 20, 32), (9,) * 4, pairs=((2, 1), (0, 0), (1, 3), (0, 2))),  # m 1, lq 32
    Ragged((16, 5, 16), (7,) * 3, pairs=((2, 0), (0, 1), (2, 2), (1, 0), (0, 2), (1, 1))),  # m 2, lq 16
    Ragged((12, 9), (6,) * 2, pairs=((0, 1), (1, 0), (0, 0), (1, 1)), dim=64),  # m 2, lq 12: 24 rows padded
]


@pytest.mark.parametrize("case", BY_DOCUMENT, ids=range(len(BY_DOCUMENT)))
def test_by_document_equals_queries_first_and_reference(case, monkeypatch):
    case = dataclasses.replace(case, dim=max(case.dim, 16), exact=True)
    _any_size(monkeypatch)
    chosen = spy(monkeypatch, cpu, "_documents_first", lambda args, out: out)
    new = _scores_and_argmax(case, "document", monkeypatch)
    assert chosen and all(chosen)
    with monkeypatch.context() as m:
        _queries_first(m)
        old = _scores_and_argmax(case, "document", monkeypatch)
    for x, y in zip(new, old, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    b = build(case, "cpu")
    rs, rarg = ref_call(case, b, b.Q.double(), b.D.double())
    assert torch.equal(new[0].double(), rs) and torch.equal(new[1].long(), rarg)


@pytest.mark.parametrize("normalize", [False, True])
def test_by_document_random_tokens_match_the_reference(normalize, monkeypatch):
    _any_size(monkeypatch)
    chosen = spy(monkeypatch, cpu, "_documents_first", lambda args, out: out)
    case = dataclasses.replace(BY_DOCUMENT[1], normalize=normalize, seed=4)
    with maxsim.backend("torch"):
        check_ragged(case, "cpu", any_ties=True)
    assert chosen and all(chosen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: float64 CUDA tensors take the PyTorch path")
@pytest.mark.parametrize("need_grad", [False, True])
def test_float64_on_cuda(need_grad, monkeypatch):
    """float64 CUDA tensors run this PyTorch path on the GPU: documents first there too, scores, argmax and
    gradients as the reference's, with masks."""
    _any_size(monkeypatch)
    calls = spy(monkeypatch, cpu, "_block_documents_first")
    Q, D = _ints((2, 32, 16), 13).double().cuda(), _ints((3, 4, 9, 16), 14).double().cuda()
    q_mask, d_mask = (m.cuda() for m in _masks(Q, D, 15))
    D = D.requires_grad_(need_grad)
    s, a = maxsim.maxsim(Q, D[:2], q_mask, d_mask[:2], return_argmax=True)  # (each query's own 4 candidates)
    assert calls
    ref_s, ref_a = reference.scores_and_argmax(Q, D[:2].detach(), q_mask, d_mask[:2])
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    assert torch.equal(a.long(), ref_a)
    if need_grad:
        (g,) = torch.autograd.grad(s.sum(), D)
        D_ref = D.detach().clone().requires_grad_()
        (g_ref,) = torch.autograd.grad(reference.scores_and_argmax(Q, D_ref[:2], q_mask, d_mask[:2])[0].sum(), D_ref)
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
