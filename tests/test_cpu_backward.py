"""The CPU backward's two formulations: the link list (any size, any values) and, for small problems with finite
tokens, products with one-hot weights (maxsim.cpu.DENSE_BACKWARD_MAX). Same terms, another summation order."""

from __future__ import annotations

import pytest
import torch

from maxsim import cpu


def _case(layout: str, dtype: torch.dtype, masked: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    Nq, K, Lq, Ld, dim = 3, 5, 7, 9, 24
    Q = torch.randint(-3, 4, (Nq, Lq, dim), generator=g).to(dtype)  # integer data: ties between document tokens
    D = torch.randint(-3, 4, (Nq if layout == "candidates" else 1, K, Ld, dim), generator=g).to(dtype)
    q_mask = torch.rand((Nq, Lq), generator=g) > 0.3 if masked else None
    d_mask = torch.rand(D.shape[:-1], generator=g) > 0.3 if masked else None
    _s, argmax = cpu.forward(Q, D, q_mask, d_mask, False, True)
    grad = torch.randn((Nq, K), generator=g)
    return grad, Q, D, argmax


@pytest.mark.parametrize("layout", ["cross", "candidates"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("masked", [False, True])
def test_one_hot_products_match_the_link_list(layout, dtype, masked):
    grad, Q, D, argmax = _case(layout, dtype, masked)
    assert (argmax == -1).any() == masked
    one_hot = cpu._backward_one_hot(grad, Q, D, argmax)
    links = cpu._backward_links(grad, Q, D, argmax, False)
    for a, b in zip(one_hot, links, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_one_hot_in_blocks_of_queries_matches_the_link_list(layout, monkeypatch):
    """Masked, W built a block of queries at a time (BLOCK_BYTES shrunk: one query a block here), a shared
    document's gradient summed over the blocks: the link list's values (integer data: exact sums)."""
    grad, Q, D, argmax = _case(layout, torch.float32, True)
    grad = grad.round()
    links = cpu._backward_links(grad, Q, D, argmax, False)
    monkeypatch.setattr(cpu, "BLOCK_BYTES", 7 * 5 * 9 * 4)
    blocks = []
    real = cpu._one_hot_weights
    monkeypatch.setattr(cpu, "_one_hot_weights", lambda *a: blocks.append(a) or real(*a))
    one_hot = cpu._backward_one_hot(grad, Q, D, argmax)
    assert len(blocks) == 3
    for a, b in zip(one_hot, links, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["cross", "candidates"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
def test_link_list_in_blocks_of_queries_matches_one_block(layout, normalize, monkeypatch):
    """The link list a block of queries at a time (``cpu.BLOCK_BYTES`` shrunk: one query a block) adds the same
    links in the same order as one block: the same bits, a shared document's gradient included."""
    grad, Q, D, argmax = _case(layout, torch.float32, True)
    one = cpu._backward_links(grad, Q, D, argmax, normalize)
    monkeypatch.setattr(cpu, "BLOCK_BYTES", 5 * 7 * 24 * 4 * 4)
    adds = []
    real = cpu.add_links
    monkeypatch.setattr(cpu, "add_links", lambda *a, **k: adds.append(1) or real(*a, **k))
    blocks = cpu._backward_links(grad, Q, D, argmax, normalize)
    assert len(adds) == 3
    for a, b in zip(blocks, one, strict=True):
        assert torch.equal(a, b)


def test_one_hot_keeps_nan_upstream_gradients_on_their_links():
    grad, Q, D, argmax = _case("cross", torch.float32, True)
    grad[1, 2] = float("nan")
    one_hot = cpu._backward_one_hot(grad, Q, D, argmax)
    links = cpu._backward_links(grad, Q, D, argmax, False)
    for a, b in zip(one_hot, links, strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-5, atol=1e-5)


def test_the_rule_small_and_finite_only(monkeypatch):
    grad, Q, D, argmax = _case("cross", torch.float32, True)
    assert cpu._one_hot_worthwhile(Q, D)
    poisoned = D.clone()
    poisoned[0, 0, 0, 0] = float("inf")  # (a masked token may hold anything)
    assert not cpu._one_hot_worthwhile(Q, poisoned)
    assert not cpu._one_hot_worthwhile(Q.clone().fill_(float("nan")), D)
    monkeypatch.setattr(cpu, "DENSE_BACKWARD_MAX", 3 * 5 * 7 * 9 - 1)  # (one entry short)
    assert cpu._one_hot_worthwhile(Q, D)  # (documents of 9 tokens: short enough at any size)
    monkeypatch.setattr(cpu, "STEP_MAX_LD", 8)
    assert not cpu._one_hot_worthwhile(Q, D)
    calls = []
    monkeypatch.setattr(cpu, "_backward_one_hot", lambda *a: calls.append(a))
    cpu.backward(grad, Q, D, argmax, False)  # too large now: the link list
    assert not calls


def test_a_poisoned_masked_token_takes_the_link_list():
    """inf in a masked document token never reaches a gradient (the one-hot product would make NaN of it)."""
    g = torch.Generator().manual_seed(1)
    Q, D = torch.randn((2, 4, 16), generator=g), torch.randn((1, 3, 6, 16), generator=g)
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool)
    d_mask[0, 1, 2] = False
    D[0, 1, 2] = float("inf")
    _s, argmax = cpu.forward(Q, D, None, d_mask, False, True)
    dQ, dD = cpu.backward(torch.ones(2, 3), Q, D, argmax, False)
    assert torch.isfinite(dQ).all() and torch.isfinite(dD).all()


@pytest.mark.parametrize("poison", [False, True], ids=["finite", "nan-and-inf"])
def test_normalized_projection_in_blocks_matches_one_block(poison, monkeypatch):
    """The normalized link backward projects the document rows the links touched a block of rows at a time on the
    CPU (``cpu.PROJECT_BLOCK_BYTES``, shrunk here to two rows): the values of one block, bit for bit (per-row
    arithmetic), and the float64 reference's. Poisoned: NaN and inf in rows no link chose (their gradient stays
    exactly zero), and a chosen row whose links all weigh zero (zero too, though it holds NaN)."""
    g = torch.Generator().manual_seed(5)
    Nq, K, Lq, Ld, dim = 3, 5, 7, 40, 24  # (600 document rows, at most 105 touched: the sparse projection)
    Q = torch.randn((Nq, Lq, dim), generator=g)
    D = torch.randn((Nq, K, Ld, dim), generator=g)
    grad = torch.randn((Nq, K), generator=g)
    _s, argmax = cpu.forward(Q, D, None, None, True, True)
    if poison:
        chosen = torch.zeros(D.shape[:-1], dtype=torch.bool)
        chosen.scatter_(2, argmax.long(), True)  # [Nq, K, Ld]: the rows some link chose
        free = (~chosen).nonzero()
        D[tuple(free[0])] = float("nan")
        D[tuple(free[-1])] = float("inf")
        grad[1, 2] = 0.0  # (pair (1, 2)'s chosen rows: touched, zero gradient; one of them poisoned below)
        D[1, 2, int(argmax[1, 2, 0]), 0] = float("nan")
    monkeypatch.setattr(cpu, "PROJECT_BLOCK_BYTES", 1 << 30)
    one = cpu._backward_links(grad, Q, D, argmax, True)
    calls = []
    real = cpu.project_normalized_grad
    monkeypatch.setattr(cpu, "project_normalized_grad", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(cpu, "PROJECT_BLOCK_BYTES", 2 * dim * 4)
    blocks = cpu._backward_links(grad, Q, D, argmax, True)
    assert calls[0] == Nq * Lq and len(calls) > 10 and max(calls[1:]) == 2  # (dQ's rows at once; D's touched: pairs)
    for a, b in zip(blocks, one, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    dD = blocks[1]
    if poison:
        assert torch.equal(dD[tuple(free[0])], torch.zeros(dim)) and torch.equal(dD[tuple(free[-1])], torch.zeros(dim))
        assert torch.equal(dD[1, 2, int(argmax[1, 2, 0])], torch.zeros(dim))
    else:
        from maxsim import reference

        Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
        ref = torch.autograd.grad(reference.maxsim(Qr, Dr, normalize=True), (Qr, Dr), grad.double())
        for a, r in zip(blocks, ref, strict=True):
            torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-5)
