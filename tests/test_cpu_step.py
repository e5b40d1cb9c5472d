"""The CPU training step of small unmasked problems (maxsim.cpu.step_fits): the forward keeps max's own int64 argmax
and the sum of its similarities; the backward scatters one-hot weights where that sum says every token is finite,
else takes the link list.

* the rule: masks, normalize, size, empty problems and tensors off the CPU keep the general path;
* every dense layout the public functions take (cross, candidates, pairs, a 2-D query or document) takes the step,
  and with exact ties (integer tokens) its scores, argmax and gradients equal, bitwise, the general path's;
* a token holding inf or NaN, or similarities that overflow, send the backward to the link list (the one-hot
  products would turn 0 · inf into NaN), and the gradients stay the reference's;
* the argmax returned beside a gradient is int32 and contiguous.
"""

from __future__ import annotations

import pytest
import torch
from helpers import spy

import maxsim
from maxsim import cpu, reference

LAYOUTS = {
    "cross": ((3, 5, 16), (4, 6, 16)),
    "candidates": ((3, 5, 16), (3, 4, 6, 16)),
    "pairs": ((3, 5, 16), (3, 6, 16)),
    "one query": ((5, 16), (4, 6, 16)),
    "one document": ((3, 5, 16), (6, 16)),
}


def _ints(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Integer-valued tokens: exact in every dtype, with ties between document tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def _upstream(shape) -> torch.Tensor:
    """Integer-valued loss weights: with integer tokens every sum is exact, in any order."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(9)).float()


def _step(layout: str, Q: torch.Tensor, D: torch.Tensor):
    """Scores, argmax and gradients of one public training call."""
    fn = maxsim.maxsim_pairs if layout == "pairs" else maxsim.maxsim
    q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
    scores, argmax = fn(q, d, return_argmax=True)
    g = _upstream(scores.shape)
    dq, dd = torch.autograd.grad(scores, (q, d), g)
    return scores, argmax, dq, dd


@pytest.fixture
def general_only(monkeypatch):
    """The general path: no problem fits the step."""

    def run(layout, Q, D):
        with monkeypatch.context() as m:
            m.setattr(cpu, "DENSE_BACKWARD_MAX", 0)
            m.setattr(cpu, "STEP_MAX_LD", 0)
            steps = spy(m, cpu, "forward_for_step")
            out = _step(layout, Q, D)
            assert not steps
            return out

    return run


def test_the_rule():
    Q, D = torch.ones(2, 3, 8), torch.ones(1, 4, 5, 8)
    assert cpu.step_fits(Q, D, None, None, False)
    assert not cpu.step_fits(Q, D, torch.ones(2, 3, dtype=torch.bool), None, False)
    assert not cpu.step_fits(Q, D, None, torch.ones(1, 4, 5, dtype=torch.bool), False)
    assert cpu.step_fits(Q, D, None, None, True)  # (normalize: the products with the normalized tokens)
    assert not cpu.step_fits(Q[:, :0], D, None, None, False)
    assert not cpu.step_fits(Q, D[:, :, :0], None, None, False)
    assert not cpu.step_fits(Q.to("meta"), D.to("meta"), None, None, False)
    longest = cpu.DENSE_BACKWARD_MAX // (2 * 3 * 4)  # (Nq = 2, Lq = 3, K = 4: the longest documents that fit)
    assert cpu.step_fits(Q, torch.ones(1, 4, longest, 8), None, None, False)
    assert not cpu.step_fits(Q, torch.ones(1, 4, longest + 1, 8), None, None, False)
    # beyond those entries: short documents only, at any size
    short = cpu.STEP_MAX_LD
    assert 2 * 3 * 4 * short <= cpu.DENSE_BACKWARD_MAX < 1000 * 3 * 4 * short
    assert cpu.step_fits(torch.ones(1000, 3, 8), torch.ones(1, 4, short, 8), None, None, False)
    assert not cpu.step_fits(torch.ones(1000, 3, 8), torch.ones(1, 4, short + 1, 8), None, None, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_takes_the_step_and_matches_the_general_path_bitwise(layout, dtype, monkeypatch, general_only):
    q_shape, d_shape = LAYOUTS[layout]
    Q, D = _ints(q_shape, 1, dtype), _ints(d_shape, 2, dtype)
    want = general_only(layout, Q, D)
    forwards = spy(monkeypatch, cpu, "forward_for_step")
    backwards = spy(monkeypatch, cpu, "backward_for_step")
    links = spy(monkeypatch, cpu, "_backward_links")
    got = _step(layout, Q, D)
    assert len(forwards) == len(backwards) == 1 and not links
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    assert got[1].dtype == torch.int32 and got[1].is_contiguous()
    ref_scores, ref_argmax = reference.scores_and_argmax(*_canonical(layout, Q.double(), D.double()))
    assert torch.equal(got[0].double().reshape(ref_scores.shape), ref_scores)
    assert torch.equal(got[1].long().reshape(ref_argmax.shape), ref_argmax)  # (ties: the lowest token)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_normalized_one_hot_matches_the_link_list_and_the_reference(layout, masked, monkeypatch, general_only):
    """normalize=True: the products with the normalized tokens and the chain rule through the normalization (the step
    unmasked, the general backward masked), against the link list and the float64 reference; a zero document token
    and a query token whose norm is below eps are among them."""
    q_shape, d_shape = LAYOUTS[layout]
    g = torch.Generator().manual_seed(5)
    Q, D = torch.randn(q_shape, generator=g), torch.randn(d_shape, generator=g)
    D[..., 0, 1, :] = 0.0
    Q[0, 0] *= 1e-14  # (a norm below eps: a plain scaling by 1 / eps, no projection)
    fn = maxsim.maxsim_pairs if layout == "pairs" else maxsim.maxsim
    masks = {}
    if masked:
        q_mask, d_mask = torch.rand(Q.shape[:-1], generator=g) > 0.2, torch.rand(D.shape[:-1], generator=g) > 0.3
        q_mask[0, 0] = True
        masks = dict(q_mask=q_mask, d_mask=d_mask)
    w = torch.randn(fn(Q, D, **masks).shape, generator=g)

    def grads(Q, D):
        q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
        return torch.autograd.grad(fn(q, d, normalize=True, **masks), (q, d), w.to(Q.dtype))

    one_hot, real = [], cpu._backward_one_hot_normalized
    monkeypatch.setattr(cpu, "_backward_one_hot_normalized", lambda *a, **k: one_hot.append(a) or real(*a, **k))
    got = grads(Q, D)
    assert len(one_hot) == 1
    with monkeypatch.context() as m:
        m.setattr(cpu, "DENSE_BACKWARD_MAX", 0)
        m.setattr(cpu, "STEP_MAX_LD", 0)
        links = grads(Q, D)
    qr, dr = Q.double().requires_grad_(), D.double().requires_grad_()
    ref_fn = reference.maxsim_pairs if layout == "pairs" else reference.maxsim
    ref = torch.autograd.grad(ref_fn(qr, dr, normalize=True, **masks), (qr, dr), w.double())
    for a, b, r in zip(got, links, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-6)


def _canonical(layout: str, Q: torch.Tensor, D: torch.Tensor):
    Q = Q[None] if Q.dim() == 2 else Q
    if layout == "pairs":
        return Q, D[:, None]
    return Q, (D[None, None] if D.dim() == 2 else D[None] if D.dim() == 3 else D)


@pytest.mark.parametrize("poison", ["inf document token", "nan query token", "-inf document token", "overflow"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_tokens_that_are_not_finite_take_the_link_list(layout, poison, monkeypatch, general_only):
    """A token no query token chooses still meets every one in the one-hot products: 0 · inf would be NaN there,
    where the link list reads only the chosen tokens (the library's gradient: design.md §1)."""
    q_shape, d_shape = LAYOUTS[layout]
    Q, D = _ints(q_shape, 1), _ints(d_shape, 2)
    if poison == "inf document token":
        D[..., 0, 2, 0] = float("inf")
    elif poison == "-inf document token":  # (-inf similarities: never chosen, yet in every product)
        Q[..., 0] = 1.0
        D[..., 0, 2, :] = 0.0
        D[..., 0, 2, 0] = float("-inf")
    elif poison == "nan query token":
        Q[1, 2, 3] = float("nan")
    else:  # finite tokens whose similarities overflow float32
        Q, D = Q * 1e20, D * 1e20
    want = general_only(layout, Q, D)
    backwards = spy(monkeypatch, cpu, "backward_for_step")
    links = spy(monkeypatch, cpu, "_backward_links")
    got = _step(layout, Q, D)
    assert len(backwards) == 1 and len(links) == 1
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    dd = got[3]
    if poison in ("inf document token", "-inf document token"):
        # the poisoned token's document: only gradients the chosen links carry, none NaN from 0 · inf
        assert not got[2].isnan().any() and not dd.isnan().any()
    if poison == "nan query token":
        assert got[2][[0, 2]].isfinite().all()  # (the other queries' gradients stay finite)


def test_a_nan_upstream_gradient_stays_on_its_links():
    Q, D = torch.randn(3, 5, 16), torch.randn(4, 6, 16)
    q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
    s = maxsim.maxsim(q, d)
    g = torch.ones_like(s)
    g[1, 2] = float("nan")
    dq, dd = torch.autograd.grad(s, (q, d), g)
    assert dq[1].isnan().all(dim=-1).all() and not dq[[0, 2]].isnan().any()
    assert dd[2].isnan().any() and not dd[[0, 1, 3]].isnan().any()


def test_the_state_of_the_step_is_small_and_the_argmax_a_view():
    Q, D = torch.randn(3, 5, 16), torch.randn(1, 4, 6, 16)
    scores, argmax, total = cpu.forward_for_step(Q, D, False, torch.int16)
    assert argmax.dtype == torch.int64 and argmax.shape == (3, 4, 5) and total.shape == ()
    assert argmax._base is not None  # (max's own indices, viewed)
    assert torch.equal(argmax, cpu.forward(Q, D, None, None, False, True)[1].long())
    assert torch.equal(scores, cpu.forward(Q, D, None, None, False, False)[0])


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_blocks_of_a_large_step_match_the_general_path_bitwise(layout, strided, monkeypatch, general_only):
    """Above one block (BLOCK_BYTES shrunk here) the step saves the rule's dtype and its backward builds W a block of
    queries at a time, summing a shared document's gradient over the blocks: the same values as the general path's
    link list (integer data: every sum exact), for inputs given as transposed views too."""
    Q = _ints((9, 5, 16), 1)
    D = _ints((4, 6, 16) if layout == "cross" else (9, 4, 6, 16), 2)
    if strided:  # (the same values, in views whose last two axes are swapped in memory)
        Q, D = Q.transpose(-1, -2).contiguous().transpose(-1, -2), D.transpose(-1, -2).contiguous().transpose(-1, -2)
    want = general_only(layout, Q, D)
    monkeypatch.setattr(cpu, "BLOCK_BYTES", 1500)  # (W of 3 queries a block: 5 x 4 x 6 x 4 bytes each)
    blocks = spy(monkeypatch, cpu, "_one_hot_weights")
    saved = spy(monkeypatch, cpu, "forward_for_step", lambda args, out: out[1].dtype)
    got = _step(layout, Q, D)
    assert saved == [torch.int16] and len(blocks) > 2
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with monkeypatch.context() as m:  # (a non-finite token: the link list, whole)
        m.setattr(cpu, "BLOCK_BYTES", 1500)
        D[..., 1, 2, 3] = float("inf")
        links = spy(m, cpu, "_backward_links")
        _step(layout, Q, D)
        assert len(links) == 1
