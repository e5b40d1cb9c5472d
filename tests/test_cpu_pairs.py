"""The CPU path of pair lists (``maxsim.maxsim_pairs_varlen`` on CPU tensors, PyTorch backend): the pairs regrouped
by query into candidate blocks (:func:`maxsim.cpu_ragged._pairs_by_query`, rows from
:func:`maxsim.cpu_ragged._pair_rows`) and the link-list backward in blocks of links.

* random pair lists (any order, repeats, queries with no pair or with many more than others, empty sequences,
  every dtype, ``normalize``, ``max_seqlen_*`` above the longest) against the float64 reference: scores, argmax,
  dQ and dD (:func:`test_ragged.check_ragged`), with the block budgets at their defaults and forced small (many
  blocks, a query's pairs split over several rows, rows in several count classes) and with the pairs grouped by
  document length class;
* exact ties (integer tokens): scores, argmax and gradients equal, bitwise, to those of the checked path (the
  per-pair blocks that the regrouping replaced on the CPU), which the CUDA tensors of the PyTorch path still take;
* NaN in a document, a NaN upstream gradient, and what never takes the regrouped path (ids or offsets out of range,
  tensors off the CPU).

These cases are small: the small-problem path (:mod:`maxsim.cpu_small`, tested in ``test_cpu_small.py``) would take
them, so every test here that looks at the general path's own pieces sends its calls past it
(:func:`helpers.general_cpu_path_only`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import general_cpu_path_only, spy
from test_ragged import Ragged, build, check_ragged, lib_call, ref_call

import maxsim
from maxsim import cpu_by_document, cpu_ragged, reference
from maxsim.layout import Ragged as Layout

# ----------------------------------------------------------------------------------------------------
# random pair lists


def _random_case(seed: int) -> Ragged:
    """A pair list with skewed lengths (zeros included) and skewed pairs per query: some queries have none, one
    has many (repeats included), the pairs come shuffled."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int, hi: int) -> tuple[int, ...]:
        lens = torch.randint(0, hi + 1, (n,), generator=g)
        lens[torch.rand(n, generator=g) < 0.15] = 0
        return tuple(lens.tolist())

    n_q, n_d = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    q_lens, d_lens = draw(n_q, 20), draw(n_d, 70)
    counts = torch.randint(0, 5, (n_q,), generator=g)
    counts[int(torch.randint(0, n_q, (1,), generator=g))] += int(torch.randint(0, 12, (1,), generator=g))
    if int(counts.sum()) == 0:
        counts[0] = 1
    pq = torch.repeat_interleave(torch.arange(n_q), counts)
    pd = torch.randint(0, n_d, (pq.shape[0],), generator=g)
    perm = torch.randperm(pq.shape[0], generator=g)
    pairs = tuple(zip(pq[perm].tolist(), pd[perm].tolist(), strict=True))
    dtype = ("fp32", "fp16", "bf16", "fp64")[seed % 4]
    return Ragged(
        q_lens, d_lens, pairs=pairs, dim=(8, 16, 48)[seed % 3], dtype=dtype, normalize=seed % 5 == 1,
        index=("int32", "int64")[seed % 2], max_seqlen=("given", "bound")[seed % 7 == 3], seed=seed + 1,
    )  # fmt: skip


RANDOM_SEEDS = list(range(24))


@pytest.fixture(autouse=True)
def _no_by_document(monkeypatch):
    """Lists that the by-document path would take stay on the paths tested here (that path:
    tests/test_cpu_by_document.py)."""
    monkeypatch.setattr(cpu_by_document, "MAX_VALUES", -1)


# (PAIR_BLOCK_BYTES, BY_LENGTH_MIN_WORK, LINK_BLOCK_BYTES)
SETTINGS = {
    "defaults": None,
    # a few slots per block: many blocks, queries with many pairs split over several rows, several count classes,
    # and the backward's links in blocks of one pair
    "small-blocks": (1 << 12, None, 1),
    # pairs grouped by their document's length class first
    "length-classes": (None, 0, None),
}


@pytest.fixture
def taken(monkeypatch) -> list[bool]:
    """Records whether each call took the regrouped path (it returns None where it does not apply)."""
    return spy(monkeypatch, cpu_ragged, "_pairs_by_query", lambda args, out: out is not None)


def _apply(monkeypatch, setting: str) -> None:
    general_cpu_path_only(monkeypatch)
    values = SETTINGS[setting]
    if values is None:
        return
    for name, value in zip(("PAIR_BLOCK_BYTES", "BY_LENGTH_MIN_WORK", "LINK_BLOCK_BYTES"), values, strict=True):
        if value is not None:
            monkeypatch.setattr(cpu_ragged, name, value)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_pair_lists_match_the_reference(seed, setting, monkeypatch, taken):
    case = _random_case(seed)
    _apply(monkeypatch, setting)
    with maxsim.backend("torch"):
        check_ragged(case, "cpu", any_ties=True)
    assert taken and all(taken), "the call did not take the regrouped path"


# ----------------------------------------------------------------------------------------------------
# against the checked path, bitwise (exact ties)


def _results(case: Ragged, regroup: bool, monkeypatch) -> tuple[torch.Tensor, ...]:
    """Scores, argmax, dQ and dD of the PyTorch path, regrouped by query or through the checked per-pair path."""
    with monkeypatch.context() as m:
        general_cpu_path_only(m)
        if not regroup:
            m.setattr(cpu_ragged, "_pairs_by_query", lambda *args: None)
        b = build(case, "cpu")
        Q, D = b.Q.detach().clone().requires_grad_(), b.D.detach().clone().requires_grad_()
        with maxsim.backend("torch"):
            s, arg = lib_call(case, b, Q, D)
        s.backward(torch.arange(s.shape[0], dtype=s.dtype) % 5 - 2)  # exact weights
        return s.detach(), arg, Q.grad, D.grad


EXACT_CASES = [
    # every query with its candidates, shuffled: one block, no slot unused, no mask
    Ragged((6, 6, 6), (9, 9, 9, 9), pairs=((2, 1), (0, 0), (1, 3), (0, 2), (2, 0), (1, 1), (0, 1), (1, 2), (2, 3))),
    # repeats, an empty query and an empty document, 3 and 4 pairs per query (one class, unused slots)
    Ragged((3, 0, 7), (5, 0, 11), pairs=((2, 0), (0, 1), (2, 0), (1, 0), (0, 2), (2, 2), (0, 0), (2, 1), (1, 1))),
    # one query with many pairs, others with one (several classes), documents of skewed lengths
    Ragged((4, 9, 2), (1, 33, 6, 17, 2), pairs=tuple((0, d % 5) for d in range(13)) + ((1, 3), (2, 1))),
]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("case", EXACT_CASES, ids=range(len(EXACT_CASES)))
def test_exact_ties_equal_the_checked_path(case, dtype, setting, monkeypatch):
    """Integer tokens (exact products and sums, ties between document tokens): the regrouped path gives the checked
    path's scores, argmax (lowest tied index) and gradients exactly, and the reference's."""
    case = dataclasses.replace(case, dim=8, exact=True, dtype=dtype)
    _apply(monkeypatch, setting)
    fast, checked = _results(case, True, monkeypatch), _results(case, False, monkeypatch)
    for name, x, y in zip(("scores", "argmax", "dQ", "dD"), fast, checked, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{name}: regrouped {x.tolist()} != checked {y.tolist()}"
    b = build(case, "cpu")
    rs, rarg = ref_call(case, b, b.Q.double(), b.D.double())
    assert torch.equal(fast[0].double(), rs) and torch.equal(fast[1].long(), rarg)


@pytest.mark.parametrize("d_lens", [(9, 9, 9, 9), (9, 4, 9, 2), (9, 9, 9, 2)], ids=["uniform", "skewed", "short-last"])
def test_documents_copied_as_slabs(d_lens, monkeypatch):
    """Documents whose ``[Ld, dim]`` slab lies within D are copied whole (an overlapping view of D's rows), the
    others (a short document at D's very end) row by row: the checked path's results either way, bitwise."""
    general_cpu_path_only(monkeypatch)
    windows = []
    real = cpu_ragged._windows
    monkeypatch.setattr(cpu_ragged, "_windows", lambda *args: windows.append(args[1]) or real(*args))
    case = Ragged((6, 6, 6), d_lens, pairs=EXACT_CASES[0].pairs, dim=8, exact=True)
    fast, checked = _results(case, True, monkeypatch), _results(case, False, monkeypatch)
    for name, x, y in zip(("scores", "argmax", "dQ", "dD"), fast, checked, strict=True):
        assert torch.equal(x, y), f"{name}: regrouped {x.tolist()} != checked {y.tolist()}"
    assert windows == ([] if d_lens[-1] < 9 else [9]), windows


# ----------------------------------------------------------------------------------------------------
# NaN


def test_nan_in_a_document_and_in_the_upstream_gradient():
    """A NaN token makes the scores of its document's pairs NaN and is their argmax (as ``torch.max``); a NaN
    upstream gradient reaches only the tokens its pair's links chose (each query token's chosen document token)."""
    case = Ragged((5, 3), (4, 6, 2), pairs=((0, 1), (1, 0), (0, 0), (1, 1), (0, 2), (1, 2)), dim=8)
    b = build(case, "cpu")
    b.D = b.D.clone()
    b.D[4 + 3] = float("nan")  # token 3 of document 1
    Q, D = b.Q.clone().requires_grad_(), b.D.clone().requires_grad_()
    with maxsim.backend("torch"):
        s, arg = lib_call(case, b, Q, D)
    rs, rarg = ref_call(case, b, b.Q.double(), b.D.double())
    nan = torch.isnan(rs)
    assert torch.equal(torch.isnan(s), nan) and bool(nan.any())
    torch.testing.assert_close(s[~nan].double(), rs[~nan], rtol=1e-5, atol=1e-5)
    assert torch.equal(arg.long(), rarg)
    assert bool((arg[nan][:, :3] == 3).all())  # the NaN token, for every real query token
    Q, D = b.Q.clone().requires_grad_(), build(case, "cpu").D.requires_grad_()  # (D without the NaN)
    with maxsim.backend("torch"):
        s, arg = lib_call(case, b, Q, D)
    grad = torch.zeros_like(s)
    grad[2] = float("nan")  # pair (0, 0)
    s.backward(grad)
    rows_q = torch.isnan(Q.grad).any(dim=1).nonzero().squeeze(1)
    rows_d = torch.isnan(D.grad).any(dim=1).nonzero().squeeze(1)
    assert rows_q.tolist() == list(range(5)), "dQ: NaN outside the rows of query 0"
    assert rows_d.tolist() == sorted(set(arg[2, :5].tolist())), "dD: NaN outside the chosen tokens of document 0"
    assert not bool(torch.isnan(Q.grad[5:]).any() or torch.isnan(D.grad[4:]).any())


# ----------------------------------------------------------------------------------------------------
# the rows


@pytest.mark.parametrize("cap", [1, 3, 4, 100])
@pytest.mark.parametrize("counts", [(4, 4, 4), (3, 4, 0, 4), (1, 13, 0, 2, 7), (9,), (0, 0, 5)])
def test_pair_rows_cover_every_pair_once(counts, cap):
    """Every pair in exactly one slot of one row; a row holds one query's pairs in pair order, at most ``cap`` of
    them; a class's unused slots are fewer than its used ones."""
    g = torch.Generator().manual_seed(sum(counts) * 31 + cap)
    n_q = len(counts)
    pair_q = torch.repeat_interleave(torch.arange(n_q), torch.tensor(counts))
    pair_q = pair_q[torch.randperm(pair_q.shape[0], generator=g)]
    seen = []
    for order, row_q, slot, k, row_end in cpu_ragged._pair_rows(pair_q, n_q, cap):
        n_rows = n_q if row_q is None else row_q.shape[0]
        row_q = torch.arange(n_q) if row_q is None else row_q
        slot = torch.arange(order.shape[0]) if slot is None else slot
        assert k <= cap and order.shape == slot.shape
        assert slot.unique().shape == slot.shape and int(slot.max()) < n_rows * k
        assert 2 * order.shape[0] > n_rows * k, "more unused slots than used ones"
        row = torch.div(slot, k, rounding_mode="floor")
        assert torch.equal(pair_q[order], row_q[row]), "a pair in another query's row"
        for r in range(n_rows):
            in_row = order[row == r]
            assert in_row.shape[0] >= 1 and bool((in_row[1:] > in_row[:-1]).all()), "a row out of pair order"
            cols = slot[row == r] - r * k
            assert torch.equal(cols, torch.arange(in_row.shape[0])), "a row's pairs not in its first slots"
        if row_end is not None:
            assert row_end[-1] == order.shape[0]
        seen.append(order)
    seen = torch.cat(seen)
    assert torch.equal(seen.sort().values, torch.arange(pair_q.shape[0])), "a pair missing or repeated"


# ----------------------------------------------------------------------------------------------------
# what never takes the regrouped path


def test_out_of_range_ids_or_offsets_take_the_checked_path(taken):
    """Unvalidated ids or offsets out of range: the checked path, whose scores are NaN for those pairs only."""
    Q, D = torch.randn(10, 8), torch.randn(12, 8)
    cu_q, pq, pd = torch.tensor([0, 4, 10]), torch.tensor([0, 1, 1, 0]), torch.tensor([1, 0, 2, 0])
    kw = dict(max_seqlen_q=6, max_seqlen_d=8, validate=False)
    with maxsim.backend("torch"):
        s = maxsim.maxsim_pairs_varlen(Q, D, cu_q, torch.tensor([0, 5, 12]), pq, pd, **kw)
        bad_offset = maxsim.maxsim_pairs_varlen(Q, D, cu_q, torch.tensor([0, 5, 13]), pq[:2], pd[:2], **kw)
    assert taken == [False, False]
    assert torch.isnan(s).tolist() == [False, False, True, False]
    assert torch.isnan(bad_offset).tolist() == [True, False]
    expected = reference.maxsim_pairs_varlen(Q.double(), D.double(), cu_q, torch.tensor([0, 5, 12]), pq[[0, 1, 3]],
                                             pd[[0, 1, 3]])  # fmt: skip
    torch.testing.assert_close(s[[0, 1, 3]].double(), expected, rtol=1e-5, atol=1e-5)


def test_tensors_off_the_cpu_are_never_read():
    """Off the CPU the regrouping would read values back (a sync): ``meta`` tensors, which have no values, are
    turned down before any read."""
    meta = dict(device="meta")
    rg = Layout(
        torch.zeros(3, dtype=torch.int32, **meta), torch.zeros(3, dtype=torch.int32, **meta),
        torch.zeros(4, dtype=torch.int64, **meta), torch.zeros(4, dtype=torch.int64, **meta), 4, 5,
    )  # fmt: skip
    assert cpu_ragged._pairs_by_query(torch.empty(6, 8, **meta), torch.empty(7, 8, **meta), False, True, rg) is None


# ----------------------------------------------------------------------------------------------------
# the backward in blocks of links


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("fn", ["varlen", "pairs"])
def test_link_blocks_do_not_change_the_gradients(fn, normalize, monkeypatch):
    """The packed backward adds its links block after block in link order: blocks of one pair's links give the
    gradients of a single block, bitwise (many pairs share query and document tokens)."""
    general_cpu_path_only(monkeypatch)
    pairs = None if fn == "varlen" else tuple((i % 3, (5 * i) % 4) for i in range(14))
    case = Ragged((17, 5, 33), (40, 1, 16, 70), pairs=pairs, dim=32, normalize=normalize, return_argmax=False)
    b = build(case, "cpu")
    grads = []
    for budget in (1 << 30, 1):
        monkeypatch.setattr(cpu_ragged, "LINK_BLOCK_BYTES", budget)
        Q, D = b.Q.detach().clone().requires_grad_(), b.D.detach().clone().requires_grad_()
        with maxsim.backend("torch"):
            s = lib_call(case, b, Q, D)
        s.backward(torch.linspace(-1, 2, s.numel()).view(s.shape))
        grads.append((Q.grad, D.grad))
    for name, x, y in zip(("dQ", "dD"), grads[0], grads[1], strict=True):
        assert torch.equal(x, y), f"{name}: blocks of links change it (max |diff| {(x - y).abs().max()})"


@pytest.mark.parametrize(
    "cu_d,pair_q,pair_d",
    [((0, 5, 12), (0, 1, 1, 0), (1, 0, 1, 0)), ((0, 5, 12), (0, 2, 1, 0), (1, 0, 1, 0)),
     ((0, 5, 12), (0, 1, -1, 0), (1, 0, 1, 0)), ((0, 5, 12), (0, 1, 1, 0), (1, 0, 2, 0)),
     ((-2, 5, 12), (0, 1, 1, 0), (1, 0, 1, 0)), ((0, 5, 13), (0, 1, 1, 0), (1, 0, 1, 0)),
     ((0, 9, 5), (0, 1, 1, 0), (1, 0, 1, 0)), ((0, 5, 12), None, None), ((-2, 5, 13), None, None)],
    ids=["in-range", "query-id-too-large", "query-id-negative", "document-id-too-large", "negative-offset",
         "offset-past-the-rows", "decreasing-offsets", "varlen", "varlen-bad-offsets"],
)  # fmt: skip
def test_backward_without_checks_only_where_they_change_nothing(cu_d, pair_q, pair_d, monkeypatch):
    """The packed backward skips its clamps and its filter of pairs with ids out of range only when every offset
    and id is in range: its gradients equal those of the checked backward, bitwise, with ids or offsets out of
    range too (unvalidated inputs: the pairs concerned score NaN)."""
    general_cpu_path_only(monkeypatch)
    g = torch.Generator().manual_seed(11)
    Q, D = torch.randn(10, 8, generator=g), torch.randn(12, 8, generator=g)
    cu_q, cu_d = torch.tensor([0, 4, 10]), torch.tensor(cu_d)
    kw = dict(max_seqlen_q=6, max_seqlen_d=9, validate=False)
    grads = []
    for checked in (False, True):
        if checked:
            monkeypatch.setattr(cpu_ragged, "_in_range", lambda *args: False)
        q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
        with maxsim.backend("torch"):
            if pair_q is None:
                s = maxsim.maxsim_varlen(q, d, cu_q, cu_d, **kw)
            else:
                s = maxsim.maxsim_pairs_varlen(q, d, cu_q, cu_d, torch.tensor(pair_q), torch.tensor(pair_d), **kw)
        s.backward(torch.linspace(-1, 2, s.numel()).view(s.shape))
        grads.append((q.grad, d.grad))
    for name, x, y in zip(("dQ", "dD"), grads[0], grads[1], strict=True):
        assert torch.equal(x, y), f"{name}: differs from the checked backward (max |diff| {(x - y).abs().max()})"
    if pair_q is not None and cu_d[0] == 0 and cu_d[-1] == 12:
        # a pair with an id out of range contributes nothing: the gradients of the other pairs alone
        keep = torch.tensor([0 <= i < 2 and 0 <= j < 2 for i, j in zip(pair_q, pair_d, strict=True)])
        q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
        pq, pd = torch.tensor(pair_q)[keep], torch.tensor(pair_d)[keep]
        with maxsim.backend("torch"):
            s = maxsim.maxsim_pairs_varlen(q, d, cu_q, cu_d, pq, pd, **kw)
        s.backward(torch.linspace(-1, 2, len(pair_q))[keep])
        assert torch.equal(q.grad, grads[0][0]) and torch.equal(d.grad, grads[0][1])


def test_pair_rows_refuses_ids_off_the_cpu():
    """``_pair_rows`` reads counts and row ends back as Python values: free on the CPU, a sync anywhere else, so it
    refuses ids on another device instead of syncing (its caller never hands it any)."""
    with pytest.raises(RuntimeError, match="CPU pair ids only"):
        next(cpu_ragged._pair_rows(torch.zeros(4, dtype=torch.int64, device="meta"), 2, 8))
