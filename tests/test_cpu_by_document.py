"""Pair lists on the CPU grouped by document (:mod:`maxsim.cpu_by_document`): documents of one length, each listed
the same number of times, read in place while each pair's query rows are gathered.

* random lists (shuffled or in document order, 1-3 pairs per document, queries of skewed lengths with empty ones,
  every dtype, ``normalize``, offsets not starting at row 0, ``max_seqlen_*`` above the longest) against the float64
  reference: scores, argmax, dQ and dD (the backward is the link list's);
* exact ties (integer tokens): scores and argmax equal, bitwise, to the other paths' (the small path's padded block
  and the general path's regrouped blocks), in one block and in many;
* NaN and inf in the rows after a short query (another query's, listed in no pair) stay out; NaN in a document makes
  its pairs' scores NaN;
* a training step whose caller does not read the argmax keeps its query rows and choices for a backward of one-hot
  products by document: against the link list's (exactly on integer tokens) and the reference, with short queries,
  offsets past row 0, a token that is not finite (the link list then), a second backward; never kept with
  ``normalize``, above its bound, or when the argmax is returned;
* what this path leaves to the others: documents of several lengths, documents listed unevenly, gaps between
  documents, ids or offsets out of range, nothing to score.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_same_nan, assert_scores_close, score_magnitude, spy
from test_ragged import (
    Ragged,
    build,
    check_ragged,
    dense_view,
    lib_call,
    ref_call,
    steps_without_and_with_argmax,
)

import maxsim
from maxsim import cpu_by_document, cpu_ragged, cpu_small
from maxsim.layout import Ragged as Layout


@pytest.fixture
def taken(monkeypatch) -> list[bool]:
    """Whether each plan of this path took its call."""
    return spy(monkeypatch, cpu_by_document, "plan", lambda args, out: out is not None)


def _by_document_case(seed: int) -> Ragged:
    """Documents of one length, each listed ``m`` times (1-3), queries of skewed lengths (zeros included, some in no
    pair), the pairs shuffled or in document order."""
    g = torch.Generator().manual_seed(500 + seed)
    n_q, n_d, m = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 6), (1, 9), (1, 4)))
    ld = int(torch.randint(1, 41, (1,), generator=g))
    q_lens = torch.randint(0, 13, (n_q,), generator=g)
    q_lens[torch.rand(n_q, generator=g) < 0.2] = 0
    q_lens[int(torch.randint(0, n_q, (1,), generator=g))] = int(torch.randint(1, 13, (1,), generator=g))
    pd = torch.arange(n_d).repeat(m)
    pq = torch.randint(0, n_q, (pd.shape[0],), generator=g)
    order = torch.randperm(pd.shape[0], generator=g) if seed % 3 else torch.argsort(pd, stable=True)
    pairs = tuple(zip(pq[order].tolist(), pd[order].tolist(), strict=True))
    return Ragged(
        tuple(q_lens.tolist()), (ld,) * n_d, pairs=pairs, dim=(8, 16, 48)[seed % 3],
        dtype=("fp32", "fp16", "bf16", "fp64")[seed % 4], normalize=seed % 5 == 1, index=("int32", "int64")[seed % 2],
        max_seqlen=("given", "bound")[seed % 7 == 3], noncontig=seed % 6 == 5, seed=seed + 1,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(30))
def test_random_lists_match_the_reference(seed, taken):
    with maxsim.backend("torch"):
        check_ragged(_by_document_case(seed), "cpu", any_ties=True)
    assert taken and taken[0], "the pair list did not take the by-document path"


def test_offsets_not_starting_at_row_zero(taken):
    """Documents that start past D's first row (rows before and after them belong to no document; offsets that do
    not start at 0 pass unvalidated only)."""
    g = torch.Generator().manual_seed(3)
    Q, D = torch.randn(9, 16, generator=g), torch.randn(40, 16, generator=g)
    cu_q = torch.tensor([1, 4, 9])
    cu_d = torch.tensor([5, 12, 19, 26])
    pq, pd = torch.tensor([1, 0, 0, 1, 1, 0]), torch.tensor([2, 0, 1, 1, 0, 2])
    with maxsim.backend("torch"):
        s, arg = maxsim.maxsim_pairs_varlen(
            Q, D, cu_q, cu_d, pq, pd, max_seqlen_q=5, max_seqlen_d=7, validate=False, return_argmax=True
        )
    rs, rarg = maxsim.reference.maxsim_pairs_varlen_with_argmax(
        Q.double(), D.double(), cu_q, cu_d, pq, pd, max_seqlen_q=5, max_seqlen_d=7
    )
    torch.testing.assert_close(s.double(), rs, rtol=1e-6, atol=1e-6)
    assert torch.equal(arg.long(), rarg)
    assert taken == [True]


# ----------------------------------------------------------------------------------------------------
# exact ties: bitwise the other paths


def _scores_and_argmax(case: Ragged, path: str, monkeypatch) -> tuple[torch.Tensor, ...]:
    """Scores, argmax and the scores without the argmax, by this path (``"document"``, ``"blocks"``: one document
    a block), the small path's padded block (``"small"``) or the general path's regrouped blocks (``"general"``). This
    path's scores without the argmax are its own too, not the by-query grouping's (tested below, ``by_query``)."""
    with monkeypatch.context() as m:
        m.setattr(cpu_by_document, "BY_QUERY_MAX_PAIR_SIMS", 0)
        if path != "document" and path != "blocks":
            m.setattr(cpu_by_document, "plan", lambda *args: None)
        if path == "blocks":
            m.setattr(cpu_by_document, "BLOCK_BYTES", 1)
        if path == "general":
            m.setattr(cpu_small, "MAX_PAIR_SIMS", -1)
        b = build(case, "cpu")
        with maxsim.backend("torch"), torch.no_grad():
            s, arg = lib_call(case, b)
            plain = lib_call(dataclasses.replace(case, return_argmax=False), b)
        return s, arg, plain


EXACT = [
    Ragged((6, 6, 6), (9, 9, 9, 9), pairs=((2, 1), (0, 0), (1, 3), (0, 2))),
    Ragged((3, 0, 7), (5, 5, 5), pairs=((2, 0), (0, 1), (2, 2), (1, 0), (0, 2), (2, 1))),
    Ragged((4, 9, 2), (12, 12), pairs=((0, 1), (1, 0), (2, 1), (0, 0), (2, 0), (1, 1))),
    Ragged((1, 5), (1, 1, 1), pairs=((1, 0), (1, 1), (0, 2))),
]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("case", EXACT, ids=range(len(EXACT)))
def test_exact_ties_equal_the_other_paths(case, dtype, monkeypatch):
    """Integer tokens (exact products and sums, ties between document tokens): scores and argmax (the lowest tied
    index) of this path, in one block and a document a block, equal the small and the general path's, bitwise, and
    the reference's; the scores without the argmax are the same."""
    bound = ("given", "bound")[len(case.q_lens) % 2]
    case = dataclasses.replace(case, dim=8, exact=True, dtype=dtype, max_seqlen=bound)
    b = build(case, "cpu")
    plan = cpu_by_document.plan(b.Q, b.D, Layout(b.cu_q, b.cu_d, b.pair_q, b.pair_d, case.width_q(), case.width_d()))
    assert plan is not None
    results = {p: _scores_and_argmax(case, p, monkeypatch) for p in ("document", "blocks", "small", "general")}
    for path in ("blocks", "small", "general"):
        for name, x, y in zip(("scores", "argmax", "plain scores"), results["document"], results[path], strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), f"{name}: by document {x.tolist()} != {path} {y.tolist()}"
    rs, rarg = ref_call(case, b, b.Q.double(), b.D.double())
    s, arg, plain = results["document"]
    assert torch.equal(s.double(), rs) and torch.equal(arg.long(), rarg) and torch.equal(plain, s)


def test_one_block_a_document_is_taken(monkeypatch):
    """With a budget of one byte every document is a block of its own (the blocks test above compares them)."""
    blocks = spy(monkeypatch, torch, "bmm", lambda args, out: tuple(args[1].shape))
    monkeypatch.setattr(cpu_by_document, "BLOCK_BYTES", 1)
    case = dataclasses.replace(EXACT[1], dim=8)
    b = build(case, "cpu")
    with maxsim.backend("torch"), torch.no_grad():
        lib_call(case, b)
    assert blocks == [(1, 8, 5)] * 3, blocks


# ----------------------------------------------------------------------------------------------------
# NaN and inf


@pytest.mark.parametrize("normalize", [False, True])
def test_a_short_querys_padding_stays_out(normalize, taken):
    """Query 0 (2 tokens) is read as a slab of 5 rows, the next 3 of which are query 1's, here NaN and inf (query 1
    is in no pair): no score, argmax or gradient sees them (the backward: the link list's)."""
    case = Ragged((2, 5), (4, 4, 4), pairs=((0, 2), (0, 0), (0, 1)), dim=8, max_seqlen="bound", normalize=normalize)
    b = build(case, "cpu")
    Q = b.Q.clone()
    Q[2:7] = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0] * 2)
    Qg, Dg = Q.clone().requires_grad_(), b.D.clone().requires_grad_()
    with maxsim.backend("torch"):
        s, arg = lib_call(case, b, Qg, Dg)
    Qr, Dr = Q.double().requires_grad_(), b.D.double().requires_grad_()
    rs, rarg = ref_call(case, b, Qr, Dr)
    assert bool(torch.isfinite(s).all()), f"scores {s.tolist()}"
    torch.testing.assert_close(s.detach().double(), rs.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(arg.long(), rarg)
    dQ, dD = torch.autograd.grad(s, (Qg, Dg), torch.ones_like(s))
    rdQ, rdD = torch.autograd.grad(rs, (Qr, Dr), torch.ones_like(rs))
    assert bool(torch.isfinite(dQ).all() and torch.isfinite(dD).all()), "a poisoned row reached a gradient"
    torch.testing.assert_close(dD.double(), rdD, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dQ.double(), rdQ, rtol=1e-5, atol=1e-5)
    assert taken[0]


def test_nan_in_a_document_makes_its_pairs_nan(taken):
    case = Ragged((3, 3), (4, 4, 4), pairs=((0, 1), (1, 0), (1, 2), (0, 0), (0, 2), (1, 1)), dim=8)
    b = build(case, "cpu")
    D = b.D.clone()
    D[5, 3] = float("nan")  # document 1, token 1
    with maxsim.backend("torch"), torch.no_grad():
        s = maxsim.maxsim_pairs_varlen(b.Q, D, b.cu_q, b.cu_d, b.pair_q, b.pair_d)
    assert torch.isnan(s).tolist() == [True, False, False, False, False, True]
    assert taken[0]


# ----------------------------------------------------------------------------------------------------
# what the other paths take


@pytest.mark.parametrize(
    "case",
    [
        Ragged((3, 3), (4, 5), pairs=((0, 0), (1, 1))),  # documents of two lengths
        Ragged((3, 3), (4, 4), pairs=((0, 0), (1, 1), (0, 1))),  # document 1 listed twice, document 0 once
        Ragged((3, 3), (4, 4, 4), pairs=((0, 0), (1, 1))),  # document 2 listed in no pair
        Ragged((3, 3), (4, 4), pairs=((0, 0), (1, 0), (0, 0), (1, 1))),  # 3 and 1 (4 pairs, 2 documents)
        Ragged((3, 3), (4, 4, 4), pairs=((0, 0), (1, 0), (0, 1), (1, 1), (0, 0), (1, 1))),  # 2, 2 (+2) and 0
        Ragged((3, 3), (0, 0), pairs=((0, 0), (1, 1))),  # documents without tokens
        Ragged((0, 0), (4, 4), pairs=((0, 0), (1, 1))),  # queries without tokens
    ],
)
def test_other_lists_take_other_paths(case, taken):
    with maxsim.backend("torch"):
        check_ragged(case, "cpu", any_ties=True)
    assert taken and not any(taken)


def test_gaps_and_ids_out_of_range_are_declined():
    Q, D = torch.randn(6, 8), torch.randn(20, 8)
    cu_q = torch.tensor([0, 3, 6])
    pq, pd = torch.tensor([0, 1]), torch.tensor([1, 0])

    def plan(cu_d, pq=pq, pd=pd, rows_q=6):
        return cpu_by_document.plan(Q[:rows_q], D, Layout(cu_q, cu_d, pq, pd, 3, 8))

    assert plan(torch.tensor([0, 4, 8])) is not None
    assert plan(torch.tensor([2, 6, 10])) is not None
    assert plan(torch.tensor([0, 4, 9])) is None  # a gap: two lengths
    assert plan(torch.tensor([0, 4, 8]), pd=torch.tensor([1, 2])) is None  # id out of range
    assert plan(torch.tensor([0, 4, 8]), pq=torch.tensor([0, -1])) is None
    assert plan(torch.tensor([0, 4, 8]), rows_q=5) is None  # query 1 runs past Q
    assert plan(torch.tensor([18, 22, 26])) is None  # documents past D
    assert plan(torch.tensor([0, 9, 18])) is None  # longer than max_seqlen_d
    assert cpu_ragged.forward is not None


@pytest.mark.parametrize("off_cpu", ["Q", "D", "cu_q", "cu_d", "pair_q", "pair_d"])
def test_tensors_off_the_cpu_are_declined_before_any_read(off_cpu):
    """The plan reads offsets and ids back as lists (free on the CPU only): a tensor anywhere else is declined before
    any value is read. Meta tensors hold no values, so any read of one would raise."""
    t = {
        "Q": torch.randn(6, 8), "D": torch.randn(8, 8), "cu_q": torch.tensor([0, 3, 6]),
        "cu_d": torch.tensor([0, 4, 8]), "pair_q": torch.tensor([0, 1]), "pair_d": torch.tensor([1, 0]),
    }  # fmt: skip
    assert cpu_by_document.plan(t["Q"], t["D"], Layout(t["cu_q"], t["cu_d"], t["pair_q"], t["pair_d"], 3, 4))
    t[off_cpu] = t[off_cpu].to("meta")
    assert cpu_by_document.plan(t["Q"], t["D"], Layout(t["cu_q"], t["cu_d"], t["pair_q"], t["pair_d"], 3, 4)) is None


def test_the_general_path_keeps_its_own_tests_when_disabled(monkeypatch):
    """``general_cpu_path_only`` (tests/helpers.py) turns this path off too."""
    from helpers import general_cpu_path_only

    general_cpu_path_only(monkeypatch)
    case = dataclasses.replace(EXACT[0], dim=8)
    b = build(case, "cpu")
    assert cpu_by_document.plan(b.Q, b.D, Layout(b.cu_q, b.cu_d, b.pair_q, b.pair_d, 6, 9)) is None


# ----------------------------------------------------------------------------------------------------
# a training step without the argmax returned: the query rows and choices kept for one-hot products


@pytest.fixture
def kept(monkeypatch) -> list[bool]:
    """Whether each step of this path kept its state."""
    return spy(monkeypatch, cpu_by_document, "forward_for_step", lambda args, out: out is not None)


@pytest.mark.parametrize("seed", range(30))
def test_random_steps_keep_their_choices(seed, kept):
    """Random lists (every dtype, short and empty queries, 1-3 pairs a document, shuffled), trained without the
    argmax returned: the products' gradients are the link list's, exactly on integer tokens (the same terms; a
    query's rows add in another order otherwise), and the float64 reference's; ``normalize`` keeps nothing."""
    case = dataclasses.replace(_by_document_case(seed), exact=seed % 2 == 0, noncontig=False)
    b = build(case, "cpu")
    step, links = steps_without_and_with_argmax(case, b, b.Q, b.D)
    for name, x, y in zip(("scores", "dQ", "dD"), step, links, strict=True):
        if case.exact:
            assert x.dtype == y.dtype and torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()}"
        else:
            tol = 1e-2 if case.dtype in ("fp16", "bf16") else 1e-5
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    assert kept == [not case.normalize], (kept, case)
    with maxsim.backend("torch"):
        check_ragged(dataclasses.replace(case, return_argmax=False), "cpu", any_ties=True)


def test_steps_keep_their_choices_past_the_first_row(kept):
    """Documents that start past D's first row, a short query last (its slab runs past Q's end: clamped rows, zero
    weights), rows before and after that no sequence holds: gradients exact on integer tokens, zero outside."""
    case = Ragged((5, 3), (4, 4, 4), pairs=((1, 2), (0, 0), (1, 1), (0, 2), (1, 0), (0, 1)), dim=8, exact=True)
    b = build(case, "cpu")
    nan = torch.full((2, 8), float("nan"))
    shifted = dataclasses.replace(b, cu_d=b.cu_d + 2)
    D = torch.cat([nan, b.D, nan])
    step, links = steps_without_and_with_argmax(case, shifted, b.Q, D)
    for name, x, y in zip(("scores", "dQ", "dD"), step, links, strict=True):
        assert torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()}"
    assert not bool(step[2][:2].any()) and not bool(step[2][-2:].any())
    assert kept[0] is True, kept


@pytest.mark.parametrize("shift", [0, 2])
@pytest.mark.parametrize("pairs_a_document", [1, 2])
def test_a_step_over_queries_of_one_length_adds_whole_query_slabs(shift, pairs_a_document, kept):
    """Queries of one length back to back (a dense batch, packed), with rows before and after that no query holds:
    each pair's query gradient is added as its query's slab, exactly the link list's on integer tokens, and zero on
    the rows outside."""
    n_q, n_d, lq = 3, 4, 4
    g = torch.Generator().manual_seed(10 * shift + pairs_a_document)
    docs = torch.arange(n_d).repeat(pairs_a_document)
    queries = torch.randint(0, n_q, (len(docs),), generator=g)
    order = torch.randperm(len(docs), generator=g)
    pairs = tuple(zip(queries[order].tolist(), docs[order].tolist(), strict=True))
    case = Ragged((lq,) * n_q, (5,) * n_d, pairs=pairs, dim=8, exact=True)
    b = build(case, "cpu")
    nan = torch.full((shift, 8), float("nan"))
    step, links = steps_without_and_with_argmax(case, dataclasses.replace(b, cu_q=b.cu_q + shift),
                                                torch.cat([nan, b.Q, nan]), b.D)  # fmt: skip
    for name, x, y in zip(("scores", "dQ", "dD"), step, links, strict=True):
        assert torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()}"
    assert not bool(step[1][:shift].any()) and not bool(step[1][len(step[1]) - shift :].any())
    assert kept[0] is True, kept


def test_a_token_that_is_not_finite_takes_the_link_list(kept):
    """-inf in a document token that no query chose: a product would multiply it by 0 (NaN); the kept sum of the
    similarities is not finite, so the backward adds the links row by row: exactly the link list's."""
    case = Ragged((3, 4), (5, 5), pairs=((0, 0), (1, 1), (1, 0), (0, 1)), dim=8, exact=True)
    b = build(case, "cpu")
    Q, D = b.Q.abs() + 1, b.D.clone()  # (positive query tokens: a -inf component makes a similarity -inf)
    D[1, 0] = float("-inf")
    step, links = steps_without_and_with_argmax(case, b, Q, D)
    for name, x, y in zip(("scores", "dQ", "dD"), step, links, strict=True):
        assert torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()}"
    assert bool(torch.isfinite(step[1]).all() and torch.isfinite(step[2]).all())
    assert kept[0] is True, kept


def test_a_kept_pair_step_backward_runs_twice(kept):
    case = Ragged((3, 4), (5, 5, 5), pairs=((0, 0), (1, 1), (1, 2)), dim=8)
    b = build(case, "cpu")
    Q, D = b.Q.clone().requires_grad_(), b.D.clone().requires_grad_()
    with maxsim.backend("torch"):
        s = lib_call(dataclasses.replace(case, return_argmax=False), b, Q, D)
    first = torch.autograd.grad(s.sum(), (Q, D), retain_graph=True)
    second = torch.autograd.grad(s.sum(), (Q, D))
    assert kept == [True] and all(torch.equal(x, y) for x, y in zip(first, second, strict=True))


def test_steps_above_the_bound_or_with_the_argmax_keep_nothing(kept, monkeypatch):
    case = Ragged((3, 4), (5, 5, 5), pairs=((0, 0), (1, 1), (1, 2)), dim=8)
    monkeypatch.setattr(cpu_by_document, "STEP_MAX_WEIGHTS", 3 * 4 * 5 - 1)  # (one weight short)
    b = build(case, "cpu")
    step, links = steps_without_and_with_argmax(case, b, b.Q, b.D)
    assert kept == [False]  # (the step with the argmax returned never asks)
    for x, y in zip(step, links, strict=True):
        assert torch.equal(x, y)


# Scores-only lists whose queries each have the same number of pairs, small pairs: grouped by query instead
# (cpu_by_document._by_query: the documents gathered as candidates, one GEMM a query).


@pytest.fixture
def by_query(monkeypatch) -> list[bool]:
    """Whether each try of the by-query grouping took its call."""
    return spy(monkeypatch, cpu_by_document, "_by_query", lambda args, out: out is not None)


def _by_query_case(seed: int) -> Ragged:
    """``K`` pairs a query (1-4), every document (one length) listed once, shuffled; queries of skewed lengths,
    empty ones included."""
    g = torch.Generator().manual_seed(900 + seed)
    n_q, k = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    ld = int(torch.randint(1, 41, (1,), generator=g))
    q_lens = torch.randint(0, 13, (n_q,), generator=g)
    q_lens[torch.rand(n_q, generator=g) < 0.2] = 0
    q_lens[int(torch.randint(0, n_q, (1,), generator=g))] = int(torch.randint(1, 13, (1,), generator=g))
    pq = torch.arange(n_q).repeat_interleave(k)
    pd = torch.randperm(n_q * k, generator=g)
    order = torch.randperm(n_q * k, generator=g)
    pairs = tuple(zip(pq[order].tolist(), pd[order].tolist(), strict=True))
    return Ragged(
        tuple(q_lens.tolist()), (ld,) * (n_q * k), pairs=pairs, dim=(8, 16, 48)[seed % 3],
        dtype=("fp32", "fp16", "bf16", "fp64")[seed % 4], normalize=seed % 5 == 1, index=("int32", "int64")[seed % 2],
        max_seqlen=("given", "bound")[seed % 7 == 3], noncontig=seed % 6 == 5, return_argmax=False, seed=seed + 1,
    )  # fmt: skip


def _scores(case: Ragged, b, Q=None, D=None) -> torch.Tensor:
    with maxsim.backend("torch"), torch.no_grad():
        return lib_call(case, b, Q, D)


@pytest.mark.parametrize("seed", range(24))
def test_scores_only_lists_of_equal_pairs_a_query_match_the_reference(seed, by_query):
    case = _by_query_case(seed)
    b = build(case, "cpu")
    s = _scores(case, b)
    rs, _ = ref_call(case, b, b.Q.double(), b.D.double())
    inp = dense_view(case, b)[0]
    assert_scores_close(s, rs, dtype=case.torch_dtype, magnitude=score_magnitude(inp, case.normalize, rs.shape))
    assert by_query == [True], "the list was not grouped by query"


@pytest.mark.parametrize("seed", range(6))
def test_grouping_by_query_gives_the_by_document_scores_bitwise_on_integer_tokens(seed, by_query, monkeypatch):
    case = dataclasses.replace(_by_query_case(seed), dtype="fp32", normalize=False, exact=True)
    b = build(case, "cpu")
    grouped = _scores(case, b)
    monkeypatch.setattr(cpu_by_document, "BY_QUERY_MAX_PAIR_SIMS", 0)
    assert torch.equal(grouped, _scores(case, b)), "grouped by query and by document differ"
    assert by_query == [True, False]


def test_nan_after_a_short_query_stays_out_and_nan_in_a_document_spreads(by_query):
    """A short query's slab reads the next query's rows (masked: NaN there adds nothing); a NaN token of a document
    makes its pair's score NaN, and only its pair's."""
    case = Ragged((2, 5, 3), (4,) * 6, pairs=((1, 0), (0, 1), (2, 2), (0, 3), (1, 4), (2, 5)), dim=8,
                  return_argmax=False)  # fmt: skip
    b = build(case, "cpu")
    Q, D = b.Q.clone(), b.D.clone()
    Q[2] = float("nan")  # (the second query's first row: in the first query's slab, past its end)
    D[4 * 3 + 1, 0] = float("nan")  # (document 3, paired with query 0 only)
    s = _scores(case, b, Q, D)
    rs, _ = ref_call(case, b, Q.double(), D.double())
    assert_same_nan(s, rs, "scores")
    assert torch.isnan(s).tolist() == [True, False, False, True, True, False]  # (query 1's pairs: its NaN row)
    assert by_query == [True]


def test_what_is_not_grouped_by_query(by_query, monkeypatch):
    """With the argmax, queries of unequal pair counts, pairs above the bound: the by-document path, as before."""
    base = Ragged((3, 4), (5,) * 4, pairs=((0, 0), (1, 1), (1, 2), (0, 3)), dim=8, return_argmax=False)
    for case in (
        dataclasses.replace(base, return_argmax=True),
        dataclasses.replace(base, pairs=((0, 0), (1, 1), (1, 2), (1, 3))),
    ):
        b = build(case, "cpu")
        _scores(case, b)
    monkeypatch.setattr(cpu_by_document, "BY_QUERY_MAX_PAIR_SIMS", 4 * 5 - 1)  # (one similarity short)
    _scores(base, b := build(base, "cpu"))
    assert by_query == [False, False], by_query
