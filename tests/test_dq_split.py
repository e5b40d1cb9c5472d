"""The split dQ walk (few queries against many documents: each query's pairs summed in slices by several programs,
then the slices summed in order; see ``launch_settings.DQ_SPLIT_*``) gives the gradient of the plain walk: bitwise on
integer data, whose sums are exact in fp32, and within tolerance of the float64 reference otherwise."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRET, int_grid, randn

import maxsim
from maxsim import reference
from maxsim.kernels import device_info, launch_backward, launch_settings

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)


def _split(monkeypatch, on: bool) -> None:
    """Every walk of at least 4 pairs split into slices of at least 2 pairs (``on``: 11 pairs in 5 slices, the
    last one shorter), or never split."""
    monkeypatch.setattr(launch_settings, "DQ_SPLIT_MIN_K", 4 if on else 1 << 40)
    monkeypatch.setattr(launch_settings, "DQ_SPLIT_MIN_PAIRS", 2)
    monkeypatch.setattr(launch_settings, "DQ_SPLIT_PROGRAMS_PER_SM", 64)


def _grads(monkeypatch, on: bool, call, Q, D, g):
    _split(monkeypatch, on)
    launch_backward.plans.clear()
    Qg, Dg = Q.detach().requires_grad_(), D.detach().requires_grad_()
    dQ, dD = torch.autograd.grad(call(Qg, Dg), (Qg, Dg), g)
    splits = [p.dq_splits for p in launch_backward.plans.values()]
    launch_backward.plans.clear()
    return dQ, dD, splits


def _layouts(device, dtype, data):
    """name -> (Q, D, call, reference call, upstream gradient): 11 documents or candidates per query."""
    Q = data((2, 5, 16), seed=1, dtype=dtype, device=device)
    D = data((11, 6, 16), seed=2, dtype=dtype, device=device)
    Dc = data((2, 11, 6, 16), seed=3, dtype=dtype, device=device)
    lens = torch.tensor([6, 0, 3, 5, 1, 6, 2, 0, 4, 6, 5])
    cu_d = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32).to(device)
    cu_q = torch.tensor([0, 5, 5, 9], dtype=torch.int32, device=device)  # (an empty query)
    Qp = data((9, 16), seed=4, dtype=dtype, device=device)
    Dp = data((int(lens.sum()), 16), seed=5, dtype=dtype, device=device)

    def varlen(f):
        return lambda q, d, **kw: f(q, d, cu_q, cu_d, **kw)

    return {
        "cross": (Q, D, maxsim.maxsim, reference.maxsim, (2, 11)),
        "candidates": (Q, Dc, maxsim.maxsim, reference.maxsim, (2, 11)),
        "varlen": (Qp, Dp, varlen(maxsim.maxsim_varlen), varlen(reference.maxsim_varlen), (3, 11)),
    }


@pytest.mark.parametrize("mode", ["fast", "deterministic"])
@pytest.mark.parametrize("layout", ["cross", "candidates", "varlen"])
def test_split_walk_equals_plain_walk_on_exact_data(layout, mode, device, monkeypatch):
    if INTERPRET:
        maxsim.set_backend("triton")
    dtype = torch.float32 if INTERPRET else torch.bfloat16  # (the interpreter: fp32 is quicker, as exact on ints)
    Q, D, call, _, gshape = _layouts(device, dtype, int_grid)[layout]
    g = int_grid(gshape, seed=9, dtype=torch.float32, device=device)
    g[0, 3] = float("nan")  # a NaN upstream gradient reaches the tokens its pair's argmax chose, in either walk

    def f(q, d):
        return call(q, d, backward=mode)

    dQ, dD, plain = _grads(monkeypatch, False, f, Q, D, g)
    dQ_s, dD_s, split = _grads(monkeypatch, True, f, Q, D, g)
    assert plain == [1] and split and split[0] > 1
    torch.testing.assert_close(dQ_s, dQ, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dD_s, dD, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(dQ_s[:5] if layout == "varlen" else dQ_s[0]).any()


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("layout", ["cross", "candidates", "varlen"])
def test_split_walk_matches_reference(layout, normalize, device, monkeypatch):
    if INTERPRET:
        maxsim.set_backend("triton")
    Q, D, call, ref, gshape = _layouts(device, torch.float32, randn)[layout]
    g = randn(gshape, seed=9, device=device)
    dQ, dD, split = _grads(monkeypatch, True, lambda q, d: call(q, d, normalize=normalize), Q, D, g)
    assert split and split[0] > 1
    Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
    rdQ, rdD = torch.autograd.grad(ref(Qr, Dr, normalize=normalize), (Qr, Dr), g.double())
    torch.testing.assert_close(dQ.double(), rdQ, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dD.double(), rdD, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("layout", ["cross", "varlen"])
def test_split_walk_sums_its_slices_in_its_own_launch(layout, normalize, device, monkeypatch):
    """FUSED_DQ_SUM_MAX_SLICES: beside the cross product's atomics (over all documents) the last program of each
    query-token block of a walk in at most that many slices sums the block's slices into dQ in slice order, as the
    slice-sum launch does, which is then not made: the same bits on integer data (a NaN upstream gradient, an empty
    query, empty documents), and each plan says which. A walk in more slices than the bound takes the launch."""
    if INTERPRET:
        maxsim.set_backend("triton")
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    Q, D, call, _, gshape = _layouts(device, dtype, int_grid)[layout]
    g = int_grid(gshape, seed=9, dtype=torch.float32, device=device)
    g[0, 3] = float("nan")
    sums = []
    monkeypatch.setattr(launch_backward, "_sum_slices", _counting(launch_backward._sum_slices, sums))
    results = []

    def run(bound: int):
        monkeypatch.setattr(launch_settings, "FUSED_DQ_SUM_MAX_SLICES", bound)
        sums.clear()
        _split(monkeypatch, True)
        launch_backward.plans.clear()
        Qg, Dg = Q.detach().requires_grad_(), D.detach().requires_grad_()
        results.append(torch.autograd.grad(call(Qg, Dg, normalize=normalize, backward="fast"), (Qg, Dg), g))
        (plan,) = launch_backward.plans.values()
        launch_backward.plans.clear()
        assert plan.dq_splits > 1 and not plan.dd_owned
        return plan.dq_splits, plan.sum_counters > 0, len(sums)

    splits, fused, launched = run(1 << 10)
    assert (fused, launched) == (True, 0)
    assert run(splits) == (splits, True, 0)
    assert run(splits - 1) == (splits, False, 1)
    assert run(0) == (splits, False, 1)
    for grads in results:
        for fused_grad, launched_grad in zip(grads, results[-1], strict=True):
            torch.testing.assert_close(fused_grad, launched_grad, rtol=0, atol=0, equal_nan=True)


def _counting(launch, calls: list):
    def counted(*args, **kwargs):
        calls.append(args[0])
        return launch(*args, **kwargs)

    return counted


def test_split_count_follows_programs_and_pairs(monkeypatch):
    """Splits only long walks of few programs, into slices of at least DQ_SPLIT_MIN_PAIRS pairs, enough for
    DQ_SPLIT_PROGRAMS_PER_SM programs a multiprocessor."""
    monkeypatch.setattr(device_info, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    assert launch_backward.dq_split_count(4, launch_settings.DQ_SPLIT_MIN_K - 1, dev) == 1
    assert (
        launch_backward.dq_split_count(4, 1000, dev) == 1000 // launch_settings.DQ_SPLIT_MIN_PAIRS
    )  # (1 query, Lq 64: 4 programs)
    assert launch_backward.dq_split_count(64, 1000, dev) == 5  # 64 programs: 5 slices fill 2 a multiprocessor
    assert launch_backward.dq_split_count(512, 1000, dev) == 1  # the GPU already full


def test_few_query_cross_products_own_their_documents():
    """The fast backward of a cross product owns dD for at most SHARED_OWNER_MAX_ROWS query rows, however large D is
    (the atomics would zero and cast an fp32 buffer of D's size), and by total work otherwise."""
    from maxsim.kernels.configs import backward_config

    cfg = backward_config(64, 128)
    assert launch_backward.shared_owned(1, 64, 1000, 300, 128, cfg)  # 64 rows against 1000 long documents
    assert launch_backward.shared_owned(2, 64, 10**6, 300, 128, cfg)  # 128 rows
    assert not launch_backward.shared_owned(3, 64, 1000, 300, 128, cfg)
    assert launch_backward.shared_owned(64, 32, 64, 128, 128, backward_config(32, 128))  # small work (2^31)
    assert not launch_backward.shared_owned(64, 32, 64, 1024, 128, backward_config(32, 128))
