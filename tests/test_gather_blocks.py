"""Short token blocks for a gather short of programs (``launch_settings.FEW_GATHER_BT``): where a fast cross product's
dQ gather has at most one program a multiprocessor and the dD atomics share its launch (no owner), the gather and the
atomics take blocks of 8 query tokens. The gradients are those of the table's blocks, bit for bit on integer data (each
row sums its pairs in the same order; the atomics' sums of integers are exact in any order), and the float64
reference's, with masks with holes, an empty query, a NaN upstream gradient, ragged queries and ``normalize``."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRET, check_parity, int_grid, kernels_on, make_inputs

import maxsim
from maxsim.kernels import device_info, launch_backward, launch_settings

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

DTYPE = torch.bfloat16 if torch.cuda.is_available() and not INTERPRET else torch.float16


@pytest.fixture(autouse=True)
def _atomics(monkeypatch):
    """dD of every cross product by the atomics (no owner) on a GPU of 132 multiprocessors; fresh plans."""
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(device_info, "sm_count", lambda device: 132)
    launch_backward.plans.clear()
    yield
    launch_backward.plans.clear()


def _blocks() -> list[int]:
    """The token block (BT) of each backward planned since the plans were cleared."""
    return [p.main[2]["BT"] for p in launch_backward.plans.values()]


def _step(Q, D, g, backward="fast", **kw):
    Qg, Dg = Q.detach().requires_grad_(), D.detach().requires_grad_()
    return torch.autograd.grad(maxsim.maxsim(Qg, Dg, backward=backward, **kw), (Qg, Dg), g)


def test_the_rule(device, monkeypatch):
    """Short blocks for few gather programs beside the atomics; not for more programs than multiprocessors, not beside
    the owner (the deterministic backward's), not when switched off."""
    kernels_on(device)
    Q = int_grid((3, 23, 16), seed=1, dtype=DTYPE, device=device)
    D = int_grid((5, 29, 16), seed=2, dtype=DTYPE, device=device)
    g = torch.ones(3, 5, device=device)
    _step(Q, D, g)
    assert _blocks() == [8]  # (16 dims: the table's blocks are of 32 tokens for these queries)
    launch_backward.plans.clear()
    _step(Q, D, g, backward="deterministic")
    assert _blocks() == [32]
    launch_backward.plans.clear()
    _step(Q[:, :16], D, g)
    assert _blocks() == [8]
    launch_backward.plans.clear()
    monkeypatch.setattr(device_info, "sm_count", lambda device: 2)  # 3 queries x 1 block of 32 > 2
    _step(Q, D, g)
    assert _blocks() == [32]
    launch_backward.plans.clear()
    monkeypatch.setattr(device_info, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch_settings, "FEW_GATHER_BT", 0)
    _step(Q, D, g)
    assert _blocks() == [32]


def _short_and_table(monkeypatch, call):
    """``call()`` with the rule's short blocks, then the table's (FEW_GATHER_BT = 0), fresh plans each; the blocks."""
    short = call()
    blocks = _blocks()
    launch_backward.plans.clear()
    with monkeypatch.context() as m:
        m.setattr(launch_settings, "FEW_GATHER_BT", 0)
        table = call()
        blocks += _blocks()
    return short, table, blocks


@pytest.mark.parametrize("Lq", [23, 5, 40, 32])
def test_short_blocks_give_the_table_blocks_gradients_bitwise(Lq, device, monkeypatch):
    kernels_on(device)
    Q = int_grid((4, Lq, 16), seed=3, dtype=DTYPE, device=device)
    D = int_grid((6, 19, 16), seed=4, dtype=DTYPE, device=device)
    q_mask = torch.rand(4, Lq, generator=torch.Generator().manual_seed(5)) > 0.3
    q_mask[1] = False  # an empty query
    q_mask = q_mask.to(device)
    g = int_grid((4, 6), seed=6, dtype=torch.float32, device=device)
    g[2, 3] = float("nan")  # reaches the tokens its pair's argmax chose, in either
    (short, table, blocks) = _short_and_table(monkeypatch, lambda: _step(Q, D, g, q_mask=q_mask))
    assert blocks == [8, max(16, 1 << (Lq - 1).bit_length())]  # (16 dims: the table's blocks, up to 64 tokens)
    for a, b, name in zip(short, table, ("dQ", "dD"), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")
    assert torch.isnan(short[0][2]).any()


def test_ragged_queries(device, monkeypatch):
    """Packed queries of 17-23 tokens and an empty one against shared documents (varlen)."""
    kernels_on(device)
    lens = [23, 17, 0, 20, 21]
    cu_q = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_d = torch.tensor([0, 7, 19, 30], dtype=torch.int32, device=device)
    Qp = int_grid((sum(lens), 16), seed=7, dtype=DTYPE, device=device)
    Dp = int_grid((30, 16), seed=8, dtype=DTYPE, device=device)
    g = int_grid((5, 3), seed=9, dtype=torch.float32, device=device)

    def step():
        Qg, Dg = Qp.detach().requires_grad_(), Dp.detach().requires_grad_()
        return torch.autograd.grad(maxsim.maxsim_varlen(Qg, Dg, cu_q, cu_d, backward="fast"), (Qg, Dg), g)

    short, table, blocks = _short_and_table(monkeypatch, step)
    assert blocks == [8, 32]
    for a, b in zip(short, table, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
def test_beside_the_sorted_gather(normalize, device, monkeypatch):
    """The deterministic backward of a large cross product (dD by the sorted gather, the dQ gather alone in its
    launch) takes the short blocks too, with the same gradients."""
    kernels_on(device)
    monkeypatch.setattr(launch_settings, "SORTED_DD_MIN_LINKS", 0)
    Q = int_grid((3, 23, 16), seed=10, dtype=DTYPE, device=device)
    D = int_grid((4, 17, 16), seed=11, dtype=DTYPE, device=device)
    g = int_grid((3, 4), seed=12, dtype=torch.float32, device=device)
    short, table, blocks = _short_and_table(
        monkeypatch, lambda: _step(Q, D, g, backward="deterministic", normalize=normalize)
    )
    assert blocks == [8, 32]
    assert all(p.dd_sorted is not None for p in launch_backward.plans.values())
    for a, b in zip(short, table, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
def test_short_blocks_match_the_reference(normalize, device):
    kernels_on(device)
    inp = make_inputs("cross", 3, 4, 23, 21, 16, dtype=DTYPE, device=device, seed=13, masks="holes")
    check_parity(inp, normalize=normalize, backward="fast", seed=13)
    assert _blocks() == [8]
