"""The persistent forward (programs that walk several shared documents in one flattened tile loop) computes exactly
what the one-document-per-program launch computes: same scores and argmax, bit for bit, on every case the
semantics name (masks with holes, NaN, ties, normalization, long queries split over programs, partial tiles)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import INTERPRET, int_grid, rand_mask, randn

from maxsim.kernels import device_info, launch, launch_forward
from maxsim.kernels.configs import forward_config
from maxsim.kernels.sizes import cdiv

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)


def _both(monkeypatch, Q, D, qm, dm, normalize, argmax):
    """(one document per program, persistent with a single multiprocessor's worth of programs), whatever the
    launch table would pick for the shape."""
    Nq, Lq, dim = Q.shape
    cfg = forward_config(Lq, dim, Nq, D.shape[0] == 1)
    plain = launch.forward(Q, D, qm, dm, normalize, argmax, cfg=dataclasses.replace(cfg, persist=0))
    monkeypatch.setattr(device_info, "sm_count", lambda device: 1)
    persistent = launch.forward(Q, D, qm, dm, normalize, argmax, cfg=dataclasses.replace(cfg, persist=1))
    grid = cdiv(Nq, cfg.BQ) * cdiv(Lq, cfg.TQ)  # (cfg.BQ = 1
    # for candidates: a program walks one query's documents)
    tiles = cdiv(D.shape[2], cfg.BLOCK_N)
    assert launch_forward.docs_per_program(grid, D.shape[1], 1, tiles) > 1  # the case really walks several documents
    return plain, persistent


def _assert_bitwise(plain, persistent):
    torch.testing.assert_close(persistent[0], plain[0], rtol=0, atol=0, equal_nan=True)
    if plain[1] is not None:
        assert torch.equal(persistent[1], plain[1])


CASES = {
    # name: (Nq, Nd, Lq, Ld, dim)
    "packed queries, partial last tile": (3, 5, 12, 37, 16),
    "one query, many documents": (1, 9, 8, 16, 16),
    "long queries split over programs": (1, 3, 130, 9, 16),
}


@pytest.mark.parametrize("argmax", [False, True], ids=["scores", "argmax"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_persistent_matches_plain_launch(case, argmax, device, monkeypatch):
    Nq, Nd, Lq, Ld, dim = CASES[case]
    Q = randn((Nq, Lq, dim), seed=1, dtype=torch.bfloat16, device=device)
    D = randn((1, Nd, Ld, dim), seed=2, dtype=torch.bfloat16, device=device)
    _assert_bitwise(*_both(monkeypatch, Q, D, None, None, False, argmax))


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
def test_persistent_masks_nan_and_ties(normalize, device, monkeypatch):
    Nq, Nd, Lq, Ld, dim = 3, 6, 10, 40, 16
    # Integer data: exact ties everywhere, so the lowest-index rule is what is compared.
    Q = int_grid((Nq, Lq, dim), seed=3, dtype=torch.float32, device=device)
    D = int_grid((1, Nd, Ld, dim), seed=4, dtype=torch.float32, device=device)
    D[0, 2, 5, 0] = float("nan")  # one valid token with NaN: its document's scores are NaN
    D[0, 4, 7, 1] = float("nan")  # the same, but masked below: must not matter
    qm = rand_mask((Nq, Lq), seed=5, device=device)
    qm[1] = False  # a query with no valid token
    dm = rand_mask((1, Nd, Ld), seed=6, device=device)
    dm[0, 2, 5] = True
    dm[0, 4, 7] = False
    dm[0, 3] = False  # a document with no valid token
    plain, persistent = _both(monkeypatch, Q, D, qm, dm, normalize, True)
    _assert_bitwise(plain, persistent)
    assert torch.isnan(plain[0][[0, 2], 2]).all() and not torch.isnan(plain[0][:, 4]).any()
    assert (plain[0][1] == 0).all()
    assert (plain[1][:, 3] == -1).all()


def test_persistent_candidates(device, monkeypatch):
    """Candidates: a program walks several documents of its own query (batch row), masks per row."""
    Nq, K, Lq, Ld, dim = 3, 5, 9, 20, 16
    Q = randn((Nq, Lq, dim), seed=7, dtype=torch.bfloat16, device=device)
    D = randn((Nq, K, Ld, dim), seed=8, dtype=torch.bfloat16, device=device)
    qm = rand_mask((Nq, Lq), seed=9, device=device)
    dm = rand_mask((Nq, K, Ld), seed=10, device=device)
    dm[1, 2] = False
    plain, persistent = _both(monkeypatch, Q, D, qm, dm, False, True)
    _assert_bitwise(plain, persistent)
    assert (plain[1][1, 2] == -1).all() and (plain[0][1, 2] == 0)
