"""Grouping a pair list by id (the CSR index of the pair-list backward): the one-launch counting kernel and the
sort it replaces for short lists give the same groups, in increasing pair order, including out-of-range ids (in
no group), empty lists and zero groups."""

from __future__ import annotations

import pytest
import torch
from helpers import triton_usable

pytest.importorskip("triton")

from maxsim.kernels import csr as csr_kernel  # noqa: E402
from maxsim.kernels import launch  # noqa: E402

CASES = [  # (pairs, groups, lowest id, highest id + 1)
    (1, 1, 0, 1),
    (5, 3, 0, 3),
    (200, 7, 0, 7),  # long runs of one id, across several 128-wide chunks
    (300, 500, 0, 500),  # more groups than pairs: empty groups
    (129, 1, 0, 1),
    (130, 64, -3, 70),  # ids out of range on both sides
    (0, 4, 0, 4),
    (70, 0, 0, 1),  # no group at all: every id out of range
]


def groups(offsets: torch.Tensor, order: torch.Tensor, n: int) -> list[list[int]]:
    offsets, order = offsets.cpu().long(), order.cpu().long()
    return [order[offsets[i] : offsets[i + 1]].tolist() for i in range(n)]


@pytest.mark.parametrize("index", [torch.int32, torch.int64])
@pytest.mark.parametrize("P,n,lo,hi", CASES)
def test_counting_csr_matches_the_sort(P, n, lo, hi, index, device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    g = torch.Generator().manual_seed(P * 1000 + n)
    ids = torch.randint(lo, hi, (P,), generator=g).to(index).to(device)
    assert P * (P + n) <= csr_kernel.MAX_WORK  # the counting kernel, not the sort
    offsets, order = launch.csr(ids, n)
    expect = [[p for p in range(P) if int(ids[p]) == i] for i in range(n)]  # increasing pair order
    assert groups(offsets, order, n) == expect
    if bool(((ids >= 0) & (ids < n)).all()):  # every pair in a group: the same arrays as a stable sort
        ids_sorted, sort_order = torch.sort(ids, stable=True)
        assert torch.equal(order.long(), sort_order.long())
        bounds = torch.arange(n + 1, device=ids.device, dtype=ids.dtype)
        assert torch.equal(offsets.long(), torch.searchsorted(ids_sorted, bounds).long())


def test_long_lists_take_the_sort_with_the_same_groups(device, monkeypatch):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    ids = torch.tensor([4, -1, 2, 2, 9, 0, 4, 2], device=device)
    short = groups(*launch.csr(ids, 5), 5)
    monkeypatch.setattr(csr_kernel, "MAX_WORK", 0)
    assert groups(*launch.csr(ids, 5), 5) == short == [[5], [], [2, 3, 7], [], [0, 6]]
