"""The small-problem CPU path (:mod:`maxsim.cpu_small`): pair lists as one padded block, and the backward of pair lists
and varlen cross products, the offsets and ids read back as lists.

* random pair lists and varlen batches (empty sequences, every dtype, ``normalize``, ``max_seqlen_*`` above the
  longest) against the float64 reference: scores, argmax, dQ and dD, with the similarities taken either way (the
  cross product of every packed token, or each pair's rows gathered), and the scores alone (no argmax: a pair list's
  cross product reduced as segments);
* exact ties (integer tokens): scores, argmax and gradients equal, bitwise, to those of the general path's checked
  per-pair blocks (a pair list) and padded block (a varlen batch), and scores equal with and without the argmax;
* padding never leaks: NaN and inf in the rows that follow a short query or document (which the padded block reads:
  another sequence, or rows after the last one) change no score, argmax or gradient;
* the varlen forward with the argmax (every document padded to the longest in one block, or the packed path) and
  without it (segments of the GEMM's columns; bitwise the scores with the argmax), and the backward's links added
  row by row or as products with a dense matrix of their weights, which falls back to the rows where a token in
  range is not finite;
* a varlen training step without the argmax returned, whose forward keeps its choices for the backward: bitwise the
  step with the argmax (random batches, sequences past the first row, a token that is not finite, a second
  backward), and never taken where the caller reads the argmax;
* what never takes this path: ids or offsets out of range, tensors off the CPU, problems above the bounds, a varlen
  forward with the argmax of long documents.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import general_cpu_path_only, spy
from test_cpu_pairs import EXACT_CASES, _random_case
from test_ragged import Ragged, build, check_ragged, lib_call, ref_call, steps_without_and_with_argmax

import maxsim
from maxsim import cpu_by_document, cpu_small
from maxsim.layout import Ragged as Layout

PRODUCTS = ["auto", "cross", "gather"]
BACKWARDS = ["links", "products"]


@pytest.fixture(autouse=True)
def _no_by_document(monkeypatch):
    """Lists that the by-document path would take stay on the paths tested here (that path:
    tests/test_cpu_by_document.py)."""
    monkeypatch.setattr(cpu_by_document, "MAX_VALUES", -1)


@pytest.fixture
def taken(monkeypatch) -> list[tuple[str, bool]]:
    """Records, for every forward and backward of the small path, whether it took the call (None: it did not)."""
    calls: list[tuple[str, bool]] = []
    for name in ("forward", "backward"):
        spy(monkeypatch, cpu_small, name, lambda args, out, name=name: (name, out is not None), into=calls)
    return calls


def _force(monkeypatch, product: str, backward: str | None = None) -> None:
    """The similarities from the cross product of every packed token, or from each pair's gathered rows; the
    backward's links row by row or as products (None: as the bounds choose)."""
    if product != "auto":
        monkeypatch.setattr(cpu_small, "_cross_product_pays", lambda *args: product == "cross")
    if backward is not None:
        monkeypatch.setattr(cpu_small, "_products_pay", lambda *args: backward == "products")


def _varlen_forward(monkeypatch, forward: str) -> None:
    """A varlen forward with the argmax through this path's padded block, or through the packed path."""
    monkeypatch.setattr(cpu_small, "CROSS_FORWARD_MEAN_LD", 1 << 30 if forward == "padded" else -1)


def _random_varlen(seed: int) -> Ragged:
    """A varlen batch with skewed lengths, zeros included."""
    g = torch.Generator().manual_seed(1000 + seed)

    def draw(n: int, hi: int) -> tuple[int, ...]:
        lens = torch.randint(0, hi + 1, (n,), generator=g)
        lens[torch.rand(n, generator=g) < 0.15] = 0
        return tuple(lens.tolist())

    n_q, n_d = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    return Ragged(
        draw(n_q, 12), draw(n_d, 40), dim=(8, 16, 48)[seed % 3], dtype=("fp32", "fp16", "bf16", "fp64")[seed % 4],
        normalize=seed % 5 == 1, index=("int32", "int64")[seed % 2], max_seqlen=("given", "bound")[seed % 7 == 3],
        seed=seed + 1,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# random cases against the reference


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("seed", range(24))
def test_random_pair_lists_match_the_reference(seed, product, backward, monkeypatch, taken):
    _force(monkeypatch, product, backward)
    with maxsim.backend("torch"):
        check_ragged(_random_case(seed), "cpu", any_ties=True)
    assert taken == [("forward", True), ("backward", True)], taken


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("forward", ["padded", "packed"])
@pytest.mark.parametrize("seed", range(24))
def test_random_varlen_batches_match_the_reference(seed, forward, backward, monkeypatch, taken):
    """A varlen cross product: the forward through this path's padded block or the packed path, the backward's
    links either way."""
    _varlen_forward(monkeypatch, forward)
    _force(monkeypatch, "auto", backward)
    case = _random_varlen(seed)
    with maxsim.backend("torch"):
        check_ragged(case, "cpu", any_ties=True)
    no_token = not any(case.q_lens) or not any(case.d_lens)  # (scores 0 without a block: taken either way)
    assert taken == [("forward", forward == "padded" or no_token), ("backward", True)], taken


def _check_scores_without_the_argmax(case: Ragged):
    """The scores of ``case`` (called without the argmax) are those of the call with it, bitwise, and the float64
    reference's within the inputs' precision. Returns the built inputs."""
    b = build(case, "cpu")
    with maxsim.backend("torch"), torch.no_grad():
        s = lib_call(case, b)
        with_argmax, _ = lib_call(dataclasses.replace(case, return_argmax=True), b)
    assert torch.equal(s, with_argmax), f"{s.tolist()} != {with_argmax.tolist()} (with the argmax)"
    rs, _ = ref_call(case, b, b.Q.double(), b.D.double())
    tol = {"fp32": 1e-5, "fp64": 1e-9}.get(case.dtype, 2e-2)  # (bf16 / fp16 inputs: rounded tokens, fp32 sums)
    torch.testing.assert_close(s.double(), rs, rtol=tol, atol=tol * max(1.0, float(rs.abs().max())))
    return b


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("seed", range(24))
def test_random_pair_list_scores_without_the_argmax(seed, product, monkeypatch, taken):
    """No gradient, no argmax: a pair list whose cross product pays is reduced as segments of it; the scores are
    those of the call with the argmax, bitwise (the same GEMM, exact maxima, the same sums)."""
    _force(monkeypatch, product)
    segments = []
    real = cpu_small._pair_scores_by_segments
    monkeypatch.setattr(cpu_small, "_pair_scores_by_segments", lambda *args: segments.append(1) or real(*args))
    case = dataclasses.replace(_random_case(seed), return_argmax=False)
    b = _check_scores_without_the_argmax(case)
    assert taken == [("forward", True), ("forward", True)], taken
    p = cpu_small.plan(b.Q, b.D, Layout(b.cu_q, b.cu_d, b.pair_q, b.pair_d, case.width_q(), case.width_d()))
    assert p.cross == (product == "cross") or product == "auto"
    assert segments == ([1] if p.cross and p.lq and p.ld else []), "the cross product was not reduced as segments"


@pytest.mark.parametrize("seed", range(24))
def test_random_varlen_scores_without_the_argmax(seed, monkeypatch, taken):
    """No gradient, no argmax: a varlen cross product's maxima as segments of the GEMM's columns; the scores are those
    of the call with the argmax (the padded block), bitwise (the same GEMM, exact maxima, the same sums)."""
    _varlen_forward(monkeypatch, "padded")
    _check_scores_without_the_argmax(dataclasses.replace(_random_varlen(seed), return_argmax=False))
    assert taken == [("forward", True), ("forward", True)], taken


# ----------------------------------------------------------------------------------------------------
# exact ties: bitwise the general path's results


def _results(case: Ragged, small: bool, monkeypatch) -> tuple[torch.Tensor, ...]:
    """Scores, argmax, dQ, dD and the scores without argmax, of the small path or of the general path's checked
    blocks (a pair list: the per-pair blocks that any device takes; a varlen batch: the padded block)."""
    from maxsim import cpu_ragged

    with monkeypatch.context() as m:
        if not small:
            general_cpu_path_only(m)
            m.setattr(cpu_ragged, "_pairs_by_query", lambda *args: None)
            m.setattr(cpu_ragged, "_packed_cross", lambda *args: None)
        b = build(case, "cpu")
        Q, D = b.Q.detach().clone().requires_grad_(), b.D.detach().clone().requires_grad_()
        with maxsim.backend("torch"):
            s, arg = lib_call(case, b, Q, D)
            with torch.no_grad():
                plain = lib_call(dataclasses.replace(case, return_argmax=False), b)
        s.backward((torch.arange(s.numel(), dtype=s.dtype) % 5 - 2).view(s.shape))  # exact weights
        return s.detach(), arg, Q.grad, D.grad, plain


EXACT_VARLEN = [
    Ragged((6, 6, 6), (9, 9, 9, 9)),
    Ragged((3, 0, 7), (5, 0, 11)),
    Ragged((4, 9, 2), (1, 33, 6, 17, 2)),
]


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("case", EXACT_CASES + EXACT_VARLEN, ids=range(len(EXACT_CASES + EXACT_VARLEN)))
def test_exact_ties_equal_the_general_path(case, dtype, product, backward, monkeypatch):
    """Integer tokens (exact products and sums, ties between document tokens, repeats, empty sequences): the small
    path's scores, argmax (lowest tied index) and gradients are the general path's, bitwise, and the reference's
    (a varlen forward with the argmax: this path's padded block)."""
    if case.pairs is None and product == "gather":
        pytest.skip("a varlen batch always takes the cross product")
    bound = ("given", "bound")[len(case.d_lens) % 2]  # (some cases with max_seqlen above the longest)
    case = dataclasses.replace(case, dim=8, exact=True, dtype=dtype, max_seqlen=bound)
    _force(monkeypatch, product, backward)
    _varlen_forward(monkeypatch, "padded")
    small, general = _results(case, True, monkeypatch), _results(case, False, monkeypatch)
    for name, x, y in zip(("scores", "argmax", "dQ", "dD", "scores without argmax"), small, general, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{name}: small {x.tolist()} != general {y.tolist()}"
    b = build(case, "cpu")
    rs, rarg = ref_call(case, b, b.Q.double(), b.D.double())
    assert torch.equal(small[0].double(), rs) and torch.equal(small[1].long(), rarg)


# ----------------------------------------------------------------------------------------------------
# padding never leaks


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("fn", ["pairs", "varlen"])
def test_nan_and_inf_in_the_padding_stay_out(fn, product, backward, monkeypatch, taken):
    """The padded block reads the rows after a short query or document, up to and past the last one: NaN and inf
    there (in a sequence no pair scores, and in rows after the last sequence) change no score, argmax or gradient
    (the products fall back to the rows: a poisoned sequence lies among the scored rows)."""
    if fn == "varlen" and product == "gather":
        pytest.skip("a varlen batch always takes the cross product")
    _force(monkeypatch, product, backward)
    _varlen_forward(monkeypatch, "padded")
    if fn == "pairs":  # query 1 and document 1 (poisoned) are in no pair; query 0 and documents 0, 2 are short
        case = Ragged((2, 5, 3), (2, 6, 1), pairs=((0, 0), (2, 2), (0, 2), (2, 0), (0, 0)), dim=8, max_seqlen="bound")
    else:
        case = Ragged((2, 3, 3), (2, 4, 1), dim=8, max_seqlen="bound")
    b = build(case, "cpu")
    poison = torch.tensor([float("nan"), float("inf"), float("-inf")]).repeat(3)[:8]
    Q, D = torch.cat([b.Q, poison[None]]), torch.cat([b.D, poison[None], poison.flip(0)[None]])
    if fn == "pairs":
        Q[2:7], D[2:8] = poison, poison.flip(0)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    with maxsim.backend("torch"):
        s, arg = lib_call(case, b, Qg, Dg)
    Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
    rs, rarg = ref_call(case, b, Qr, Dr)
    assert bool(torch.isfinite(s).all()), f"scores {s.tolist()}"
    torch.testing.assert_close(s.detach().double(), rs.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(arg.long(), rarg)
    upstream = torch.linspace(-1, 2, s.numel()).view(s.shape)
    dQ, dD = torch.autograd.grad(s, (Qg, Dg), upstream)
    rdQ, rdD = torch.autograd.grad(rs, (Qr, Dr), upstream.double())
    assert bool(torch.isfinite(dQ).all() and torch.isfinite(dD).all()), "a poisoned row reached a gradient"
    torch.testing.assert_close(dQ.double(), rdQ, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dD.double(), rdD, rtol=1e-5, atol=1e-5)
    assert taken == [("forward", True), ("backward", True)], taken


@pytest.mark.parametrize(
    "case",
    [Ragged((0, 0), (3, 0), pairs=((0, 0), (1, 1), (0, 1))), Ragged((2, 3), (0, 0), pairs=((1, 0), (0, 1))),
     Ragged((0, 0), (3, 4)), Ragged((2, 3), (0, 0, 0))],
    ids=["no-query-token", "no-document-token", "varlen-no-query-token", "varlen-no-document-token"],
)  # fmt: skip
def test_no_token_at_all(case, taken):
    """Every query (or every document) without tokens: scores 0, argmax -1, zero gradients."""
    case = dataclasses.replace(case, max_seqlen="bound")
    s, arg, dQ, dD = check_ragged(case, "cpu")
    assert not bool(s.any()) and bool((arg == -1).all())
    assert not bool(dQ.any()) and not bool(dD.any())
    assert taken == [("forward", True), ("backward", True)], taken


@pytest.mark.parametrize("fn", ["pairs", "varlen"])
def test_products_fall_back_to_the_rows_for_a_token_that_is_not_finite(fn, monkeypatch):
    """A token of a scored sequence holding inf or NaN that no query token chose: a product with the weights would
    multiply it by 0 (NaN in every gradient row); the backward adds the links row by row instead, and its gradients
    are those of the row-by-row backward, bitwise (finite where that token was not chosen)."""
    pairs = ((0, 0), (1, 1), (1, 0)) if fn == "pairs" else None  # (query 0 meets document 0 only)
    case = Ragged((3, 4), (5, 3), pairs=pairs, dim=8, exact=True, max_seqlen="bound")
    b = build(case, "cpu")
    Q, D = b.Q.abs() + 1, b.D.clone()  # (positive query tokens: a -inf component makes a similarity -inf)
    D[1, 0] = float("-inf")  # (document 0's second token: never the max)
    D[6, 3] = float("nan")  # (document 1's second token: a NaN similarity, chosen: its scores are NaN)
    grads = {}
    for backward in BACKWARDS:
        _force(monkeypatch, "auto", backward)
        _varlen_forward(monkeypatch, "padded")
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        with maxsim.backend("torch"):
            s, _ = lib_call(case, b, Qg, Dg)
        grads[backward] = torch.autograd.grad(s, (Qg, Dg), torch.ones_like(s))
    for x, y in zip(grads["products"], grads["links"], strict=True):
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
    dQ, dD = grads["products"]
    assert bool(torch.isfinite(dD[:5]).all()), f"document 0's gradient: {dD[:5].tolist()}"
    if fn == "pairs":
        assert bool(torch.isfinite(dQ[:3]).all()), "query 0, which meets only document 0, got a NaN gradient"
    assert not bool(torch.isfinite(dQ[3:]).all()), "query 1 chose the NaN token: its gradient should hold NaN"


# ----------------------------------------------------------------------------------------------------
# a varlen training step whose caller does not read the argmax: the choices kept between its two passes


def _steps(case: Ragged, b, Q: torch.Tensor, D: torch.Tensor, monkeypatch) -> tuple[list, list]:
    """:func:`steps_without_and_with_argmax` (the kept choices, where :func:`cpu_small.cross_forward_for_step` takes
    the call, and the argmax grid with its links), and whether the kept path took each call."""
    kept = spy(monkeypatch, cpu_small, "cross_forward_for_step", lambda args, out: out is not None)
    return steps_without_and_with_argmax(case, b, Q, D), kept


def _same(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """Equal bitwise, NaN where the other has NaN."""
    same = x.dtype == y.dtype and torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
    assert same, f"{name}: {x.tolist()} != {y.tolist()}"


@pytest.mark.parametrize("seed", range(24))
def test_varlen_steps_keep_their_choices(seed, monkeypatch):
    """Random varlen batches (every dtype, ``normalize``, integer tokens with ties in some), trained without the
    argmax returned: the forward keeps each packed query row's choices and the backward puts their weights straight
    into the products' matrix. Scores and gradients are those of the same step with the argmax returned, bitwise,
    and the float64 reference's; a batch with an empty document keeps nothing (the general forward)."""
    case = dataclasses.replace(_random_varlen(seed), exact=seed % 3 == 0)
    if seed % 4:  # (an empty document in the rest, some of them)
        case = dataclasses.replace(case, d_lens=tuple(max(1, n) for n in case.d_lens))
    b = build(case, "cpu")
    (step, full), kept = _steps(case, b, b.Q, b.D, monkeypatch)
    for name, x, y in zip(("scores", "dQ", "dD"), step, full, strict=True):
        _same(name, x, y)
    expected = min(case.d_lens) > 0 and max(case.q_lens) > 0
    assert kept == [expected], (kept, case)
    with maxsim.backend("torch"):
        check_ragged(dataclasses.replace(case, return_argmax=False), "cpu", any_ties=True)


def test_varlen_steps_keep_their_choices_past_the_first_row(monkeypatch):
    """Sequences that start past the first packed row (NaN rows before them): the kept choices count columns from
    the first document's row and weights from the first query's. Bitwise the step with the argmax; zero gradients
    on the rows before."""
    case = Ragged((3, 0, 5), (4, 2, 1, 6), dim=8, exact=True, max_seqlen="bound")
    b = build(case, "cpu")
    nan = torch.full((3, 8), float("nan"))
    shifted = dataclasses.replace(b, cu_q=b.cu_q + 3, cu_d=b.cu_d + 3)
    (step, full), kept = _steps(case, shifted, torch.cat([nan, b.Q]), torch.cat([nan, b.D]), monkeypatch)
    (unshifted, _), _ = _steps(case, b, b.Q, b.D, monkeypatch)
    for name, x, y, z in zip(("scores", "dQ", "dD"), step, full, unshifted, strict=True):
        _same(name, x, y)
        _same(name, x if name == "scores" else x[3:], z)
    assert not bool(step[1][:3].any()) and not bool(step[2][:3].any())
    assert kept[:1] == [True], kept


def test_varlen_steps_fall_back_to_the_links_for_a_token_that_is_not_finite(monkeypatch):
    """A scored token holding -inf (never chosen) or NaN (chosen): the kept sum of the similarities is not finite,
    so the backward adds the links row by row (a product would multiply the -inf by 0: NaN in every row). Bitwise
    the step with the argmax, NaN only in the gradient of the query that chose the NaN token."""
    case = Ragged((3, 4), (5, 3), dim=8, exact=True, max_seqlen="bound")
    b = build(case, "cpu")
    Q, D = b.Q.abs() + 1, b.D.clone()  # (positive query tokens: a -inf component makes a similarity -inf)
    D[1, 0] = float("-inf")
    D[6, 3] = float("nan")
    (step, full), kept = _steps(case, b, Q, D, monkeypatch)
    for name, x, y in zip(("scores", "dQ", "dD"), step, full, strict=True):
        _same(name, x, y)
    assert kept == [True], kept
    assert bool(torch.isfinite(step[2][:5]).all()), f"document 0's gradient: {step[2][:5].tolist()}"
    assert not bool(torch.isfinite(step[1]).all()), "the query that chose the NaN token should have NaN in dQ"


def test_a_kept_step_backward_runs_twice(monkeypatch):
    """``retain_graph=True``: a second backward through the same kept choices gives the same gradients."""
    kept = spy(monkeypatch, cpu_small, "cross_forward_for_step", lambda args, out: out is not None)
    case = Ragged((3, 5), (4, 2, 7), dim=8)
    b = build(case, "cpu")
    Q, D = b.Q.clone().requires_grad_(), b.D.clone().requires_grad_()
    with maxsim.backend("torch"):
        s = maxsim.maxsim_varlen(Q, D, b.cu_q, b.cu_d, max_seqlen_q=5, max_seqlen_d=7)
    first = torch.autograd.grad(s.sum(), (Q, D), retain_graph=True)
    second = torch.autograd.grad(s.sum(), (Q, D))
    assert kept == [True] and all(torch.equal(x, y) for x, y in zip(first, second, strict=True))


def test_a_returned_argmax_is_never_kept_in_its_place(monkeypatch):
    """A step whose caller reads the argmax takes the general forward: the argmax comes back in its layout."""
    kept = spy(monkeypatch, cpu_small, "cross_forward_for_step", lambda args, out: out is not None)
    with maxsim.backend("torch"):
        s, arg, _, _ = check_ragged(Ragged((3, 5), (4, 2, 7), dim=8), "cpu")
    assert kept == [] and arg.shape == (2, 3, 5)


# ----------------------------------------------------------------------------------------------------
# what never takes this path


def _layout(cu_q, cu_d, pq=None, pd=None, max_q=6, max_d=8) -> Layout:
    t = torch.tensor
    return Layout(t(cu_q), t(cu_d), None if pq is None else t(pq), None if pd is None else t(pd), max_q, max_d)


@pytest.mark.parametrize(
    "rg",
    [_layout((0, 4, 10), (0, 5, 12), (0, 2), (1, 0)), _layout((0, 4, 10), (0, 5, 12), (0, -1), (1, 0)),
     _layout((0, 4, 10), (0, 5, 12), (0, 1), (2, 0)), _layout((0, 4, 10), (0, 5, 13), (0, 1), (1, 0)),
     _layout((0, 4, 10), (-2, 5, 12), (0, 1), (1, 0)), _layout((0, 4, 10), (0, 9, 5), (0, 1), (1, 0)),
     _layout((0, 4, 10), (0, 5, 12), (0, 1), (1, 0), max_d=6), _layout((0, 4, 10), (0, 5, 13)),
     _layout((0, 4, 10), (0, 5, 12), max_q=5)],
    ids=["query-id-too-large", "query-id-negative", "document-id-too-large", "offset-past-the-rows",
         "negative-offset", "decreasing-offsets", "longer-than-max_seqlen", "varlen-offset-past-the-rows",
         "varlen-longer-than-max_seqlen"],
)  # fmt: skip
def test_out_of_range_ids_or_offsets_are_not_taken(rg):
    """Unvalidated ids, offsets or lengths out of range: the general path's checked blocks score those NaN."""
    Q, D = torch.randn(10, 8), torch.randn(12, 8)
    assert cpu_small.plan(Q, D, rg) is None
    assert cpu_small.forward(Q, D, False, True, rg) is None
    argmax = torch.zeros((1, 2, 6) if rg.pair_q is not None else (2, 2, 6), dtype=torch.int32)
    assert cpu_small.backward(torch.ones(argmax.shape[:-1]), Q, D, argmax, False, rg) is None


def test_tensors_off_the_cpu_are_never_read():
    """Off the CPU the read-back of offsets and ids would be a sync: ``meta`` tensors (no values to read) are turned
    down before any read, whichever of them is off the CPU."""
    meta = dict(device="meta")
    Q, D = torch.randn(6, 8), torch.randn(7, 8)
    cu_q, cu_d = torch.tensor([0, 2, 6]), torch.tensor([0, 3, 7])
    pq, pd = torch.tensor([0, 1, 1]), torch.tensor([1, 0, 1])
    assert cpu_small.plan(Q, D, Layout(cu_q, cu_d, pq, pd, 4, 4)) is not None
    for i in range(6):
        tensors = [Q, D, cu_q, cu_d, pq, pd]
        tensors[i] = torch.empty(tensors[i].shape, dtype=tensors[i].dtype, **meta)
        rg = Layout(*tensors[2:], 4, 4)
        assert cpu_small.plan(tensors[0], tensors[1], rg) is None


def test_bounds():
    """Problems above the bounds (by the given maxima), and varlen forwards with the argmax of documents longer than
    :data:`maxsim.cpu_small.CROSS_FORWARD_MEAN_LD` on average, take the general path."""
    Q, D = torch.randn(6, 8), torch.randn(7, 8)
    cu_q, cu_d = torch.tensor([0, 2, 6]), torch.tensor([0, 3, 7])
    pq, pd = torch.tensor([0, 1, 1]), torch.tensor([1, 0, 1])
    assert cpu_small.plan(Q, D, Layout(cu_q, cu_d, pq, pd, 4, 4)) is not None
    big = cpu_small.MAX_PAIR_SIMS // (3 * 4) + 1  # 3 pairs x max_q 4 x max_d `big`: just above the bound
    assert cpu_small.plan(Q, D, Layout(cu_q, cu_d, pq, pd, 4, big)) is None
    assert cpu_small.plan(Q, D, Layout(cu_q, cu_d, None, None, 4, 4)) is not None
    assert cpu_small.plan(Q, D, Layout(cu_q, cu_d, None, None, 4, cpu_small.MAX_CROSS_SIMS // 16 + 1)) is None
    varlen = Layout(cu_q, cu_d, None, None, 4, 4)
    assert cpu_small.forward(Q, D, False, False, varlen) is not None
    assert cpu_small.forward(Q, D, False, True, varlen) is not None
    D_long = torch.randn(2 * cpu_small.CROSS_FORWARD_MEAN_LD + 1, 8)
    cu_long = torch.tensor([0, cpu_small.CROSS_FORWARD_MEAN_LD, D_long.shape[0]])
    long = Layout(cu_q, cu_long, None, None, 4, D_long.shape[0])
    assert cpu_small.plan(Q, D_long, long) is not None
    assert cpu_small.forward(Q, D_long, False, True, long) is None
    assert cpu_small.forward(Q, D_long, False, False, long) is not None  # (the scores alone: segments)


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("fn", ["pairs", "varlen"])
def test_offsets_that_start_past_the_first_row(fn, backward, monkeypatch, taken):
    """Sequences that start past the first packed row (rows before them, NaN here, belong to no sequence): the
    padded block's windows and the products' weights count from the first sequence's row. Scores and argmax as
    those of the same tokens packed from row 0, bitwise; gradients the same rows of theirs, zero on the rows
    before."""
    _force(monkeypatch, "cross", backward)
    _varlen_forward(monkeypatch, "padded")
    pairs = ((0, 1), (1, 0), (1, 2), (0, 0)) if fn == "pairs" else None
    case = Ragged((3, 0, 5), (4, 2, 0, 6), pairs=pairs, dim=8, exact=True, max_seqlen="bound")
    b = build(case, "cpu")
    results = []
    for skip in (0, 3):
        nan = torch.full((skip, 8), float("nan"))
        Q, D = torch.cat([nan, b.Q]).requires_grad_(), torch.cat([nan, b.D]).requires_grad_()
        shifted = dataclasses.replace(b, cu_q=b.cu_q + skip, cu_d=b.cu_d + skip)
        with maxsim.backend("torch"):
            s, arg = lib_call(case, shifted, Q, D)
        weights = (torch.arange(s.numel(), dtype=s.dtype) % 3 - 1).view(s.shape)
        dQ, dD = torch.autograd.grad(s, (Q, D), weights)
        assert not bool(dQ[:skip].any()) and not bool(dD[:skip].any())
        results.append((s, arg, dQ[skip:], dD[skip:]))
    for name, x, y in zip(("scores", "argmax", "dQ", "dD"), *results, strict=True):
        assert torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()} (from row 0)"
    assert taken == [("forward", True), ("backward", True)] * 2, taken
