"""Scores-only forwards of thin row blocks put the document's tokens in the MMA's rows (forward.py's ``DOC_ROWS``,
``launch_settings.DOC_ROWS*``): chosen where the rule says, and computing what the other orientation computes on
every layout, with masks with holes, empty documents, NaN and infinite tokens, with and without ``normalize``."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRET, forward_launches, int_grid, kernels_on, rand_mask

from maxsim import maxsim, maxsim_padded, maxsim_pairs, maxsim_pairs_varlen, maxsim_varlen, reference
from maxsim.kernels import launch_forward, launch_settings

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

DTYPE = torch.bfloat16 if torch.cuda.is_available() and not INTERPRET else torch.float16


def _doc_rows(monkeypatch, call) -> list[bool]:
    return forward_launches(monkeypatch, call, lambda c, warps, stages: c["DOC_ROWS"])


def _blocks(monkeypatch, call) -> list[tuple[int, int]]:
    """``(query rows a block, BLOCK_N)`` of every forward launch ``call`` makes."""
    return forward_launches(monkeypatch, call, lambda c, warps, stages: (c["BQ"] * c["TQ"], c["BLOCK_N"]))


RULE_CASES = {
    # name: (Q shape, D shape, dtype, normalize, argmax, DOC_ROWS setting, expected)
    "thin, 128-token tiles": ((1, 32, 64), (40, 70, 64), DTYPE, False, False, 2, True),
    "thin, normalized": ((1, 32, 64), (40, 70, 64), DTYPE, True, False, 2, True),
    "candidates": ((2, 20, 48), (2, 9, 70, 48), DTYPE, False, False, 2, True),
    "with the argmax": ((1, 32, 64), (40, 70, 64), DTYPE, False, True, 2, False),
    "fp32 tokens": ((1, 32, 64), (40, 70, 64), torch.float32, False, False, 2, False),
    "64-row queries": ((1, 48, 64), (40, 70, 64), DTYPE, False, False, 2, False),
    "thin, 128 dims (tiles widened)": ((1, 32, 128), (40, 70, 128), DTYPE, True, False, 2, True),
    "setting 1, plain": ((1, 32, 64), (40, 70, 64), DTYPE, False, False, 1, False),
    "setting 1, normalized": ((1, 32, 64), (40, 70, 64), DTYPE, True, False, 1, True),
    "setting 0": ((1, 32, 64), (40, 70, 64), DTYPE, True, False, 0, False),
}


@pytest.mark.parametrize("case", list(RULE_CASES), ids=list(RULE_CASES))
def test_doc_rows_chosen_where_the_rule_says(case, device, monkeypatch):
    """Scores only, 16-bit tokens in one dim chunk, at most DOC_ROWS_MAX_ROWS query rows a block against tiles of
    at least DOC_ROWS_MIN_BLOCK_N tokens; setting 1 only where a normalized forward sums its tiles' squares.
    (Small documents, so none of these scans streams: the table's tiles, 128 tokens at 64 dims, 32 at 128 widened
    to 64.)"""
    q_shape, d_shape, dtype, normalize, argmax, level, expected = RULE_CASES[case]
    monkeypatch.setattr(launch_settings, "DOC_ROWS", level)
    Q = torch.randn(q_shape, dtype=dtype, device=device)
    D = torch.randn(d_shape, dtype=dtype, device=device)
    kernels_on(device)
    assert _doc_rows(monkeypatch, lambda: maxsim(Q, D, normalize=normalize, return_argmax=argmax)) == [expected]
    rows, block_n = _blocks(monkeypatch, lambda: maxsim(Q, D, normalize=normalize, return_argmax=argmax))[0]
    eligible = rows <= launch_settings.DOC_ROWS_MAX_ROWS and block_n >= launch_settings.DOC_ROWS_MIN_BLOCK_N
    assert expected <= eligible


def test_thin_normalized_table_sums_its_tiles_in_doc_rows(device, monkeypatch):
    """The thin once-read table loop took the pre-pass for normalize=True (its tile sums cost more than a second
    read of D in the other orientation); in DOC_ROWS it sums its tiles' squares: no pre-pass launch."""
    monkeypatch.setattr(launch_forward, "once_read_scan", lambda *args: "table")
    Q = torch.randn(2, 32, 128, dtype=DTYPE, device=device)
    D = torch.randn(2, 5, 70, 128, dtype=DTYPE, device=device)
    kernels_on(device)
    seen = forward_launches(
        monkeypatch, lambda: maxsim(Q, D, normalize=True), lambda c, w, s: (c["DOC_ROWS"], c["NORMS_GIVEN"])
    )
    assert seen == [(True, False)]
    monkeypatch.setattr(launch_settings, "DOC_ROWS", 0)
    seen = forward_launches(
        monkeypatch, lambda: maxsim(Q, D, normalize=True), lambda c, w, s: (c["DOC_ROWS"], c["NORMS_GIVEN"])
    )
    assert seen == [(False, True)]


def _poisoned(shape, seed, device):
    """Integer data (exact products, exact ties) with a NaN and an infinite token."""
    X = int_grid(shape, seed=seed, dtype=DTYPE, device=device)
    flat = X.view(-1, shape[-1])
    flat[-1, 0] = float("nan")
    flat[flat.shape[0] // 2, 1] = float("inf")
    return X


def _calls(layout: str, device: str):
    """``(library call, float64 reference call)`` of a small problem of ``layout`` (no arguments: the settings in
    force decide the launch)."""
    dim = 48 if layout in ("candidates", "varlen") else 128
    if layout == "cross, one query":
        Q, D = _poisoned((1, 23, dim), 1, device), _poisoned((9, 70, dim), 2, device)
        dm = rand_mask((9, 70), seed=3, device=device)
        dm[4] = False  # (a document with no valid token)
        return (lambda n: maxsim(Q, D, None, dm, normalize=n)), (
            lambda n: reference.maxsim(Q.double(), D.double(), None, dm, normalize=n)
        )
    if layout == "candidates":
        Q, D = _poisoned((3, 20, dim), 4, device), _poisoned((3, 5, 130, dim), 5, device)
        qm = rand_mask((3, 20), seed=6, device=device)
        dm = rand_mask((3, 5, 130), seed=7, device=device)
        return (lambda n: maxsim(Q, D, qm, dm, normalize=n)), (
            lambda n: reference.maxsim(Q.double(), D.double(), qm, dm, normalize=n)
        )
    if layout == "pairs":
        Q, D = _poisoned((6, 30, dim), 8, device), _poisoned((6, 100, dim), 9, device)
        return (lambda n: maxsim_pairs(Q, D, normalize=n)), (
            lambda n: reference.maxsim_pairs(Q.double(), D.double(), normalize=n)
        )
    if layout == "padded":
        Q, D = _poisoned((2, 16, dim), 10, device), _poisoned((2, 4, 90, dim), 11, device)
        ql = torch.tensor([16, 7], device=device)
        dl = torch.tensor([[90, 0, 33, 64], [1, 65, 90, 12]], device=device)
        return (lambda n: maxsim_padded(Q, D, ql, dl, normalize=n)), (
            lambda n: reference.maxsim_padded(Q.double(), D.double(), ql, dl, normalize=n)
        )
    cu_q = torch.tensor([0, 20, 29], device=device)
    cu_d = torch.tensor([0, 70, 70, 199, 230], device=device)  # (an empty document)
    Q, D = _poisoned((29, dim), 12, device), _poisoned((230, dim), 13, device)
    if layout == "varlen":
        return (lambda n: maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=20, max_seqlen_d=129, normalize=n)), (
            lambda n: reference.maxsim_varlen(Q.double(), D.double(), cu_q, cu_d, normalize=n)
        )
    assert layout == "pair list", layout
    pq, pd = torch.tensor([1, 0, 1, 1], device=device), torch.tensor([2, 3, 1, 2], device=device)

    def lib(n: bool):
        return maxsim_pairs_varlen(Q, D, cu_q, cu_d, pq, pd, max_seqlen_q=20, max_seqlen_d=129, normalize=n)

    return lib, lambda n: reference.maxsim_pairs_varlen(Q.double(), D.double(), cu_q, cu_d, pq, pd, normalize=n)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("layout", ["cross, one query", "candidates", "pairs", "padded", "varlen", "pair list"])
def test_doc_rows_computes_what_the_other_orientation_does(layout, normalize, device, monkeypatch):
    """Every scores-only forward of these layouts in DOC_ROWS (the bounds lifted, so the 32-token tiles' loops and
    blocks of several queries run it too) against the same forward without it: bit for bit on integer data,
    normalized within 2 ulp (the squares summed in another order), NaN where the reference has it, and the float64
    reference's scores."""
    monkeypatch.setattr(launch_settings, "DOC_ROWS_MIN_BLOCK_N", 0)
    monkeypatch.setattr(launch_settings, "DOC_ROWS_MAX_ROWS", 1 << 10)
    kernels_on(device)
    lib, ref = _calls(layout, device)
    runs = {}
    for level in (2, 0):
        monkeypatch.setattr(launch_settings, "DOC_ROWS", level)
        assert set(_doc_rows(monkeypatch, lambda: lib(normalize))) == {level > 0}
        launch_forward.plans.clear()
        runs[level] = lib(normalize)
    torch.testing.assert_close(runs[2], runs[0], rtol=2.5e-7 if normalize else 0, atol=0, equal_nan=True)
    expected = ref(normalize)
    torch.testing.assert_close(runs[2].double(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(runs[2]).any(), "the NaN token reached a score"


@pytest.mark.parametrize("scan", ["stream", "table"])
@pytest.mark.parametrize(
    "dim, normalize, expected",
    [
        (128, True, (64, True)),  # widened, in DOC_ROWS
        (128, False, (32, False)),  # plain: the 32-token tiles, as planned
        (64, True, (32, False)),  # narrow tokens: not widened
    ],
)
def test_normalized_64_row_scans_widen_their_tiles(scan, dim, normalize, expected, device, monkeypatch):
    """Once-read scans of 33-64-row blocks at 128 dims sum their tiles' squares in DOC_ROWS with 64-token tiles
    where normalized (launch_settings.DOC_ROWS_SUMS_MAX_ROWS); plain ones and narrower tokens keep their tiles."""
    monkeypatch.setattr(launch_forward, "once_read_scan", lambda *args: scan)
    Q = torch.randn(2, 48, dim, dtype=DTYPE, device=device)
    D = torch.randn(2, 5, 70, dim, dtype=DTYPE, device=device)
    kernels_on(device)
    seen = forward_launches(
        monkeypatch, lambda: maxsim(Q, D, normalize=normalize), lambda c, w, s: (c["BLOCK_N"], c["DOC_ROWS"])
    )
    assert seen == [expected]


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "masked"])
def test_masked_normalized_64_row_scans_leave_the_stream(masked, device, monkeypatch):
    """A masked, normalized once-read scan of a 64-row block that would stream (with its tiles widened for
    DOC_ROWS) runs the pipelined loop in DOC_ROWS instead; unmasked, it streams."""
    monkeypatch.setattr(launch_forward, "once_read_scan", lambda *args: "stream")
    Q = torch.randn(2, 48, 128, dtype=DTYPE, device=device)
    D = torch.randn(2, 5, 70, 128, dtype=DTYPE, device=device)
    dm = rand_mask((2, 5, 70), seed=1, device=device) if masked else None
    kernels_on(device)
    seen = forward_launches(
        monkeypatch,
        lambda: maxsim(Q, D, d_mask=dm, normalize=True),
        lambda c, w, s: (c["STREAM_D"], c["BLOCK_N"], c["DOC_ROWS"]),
    )
    assert seen == [(not masked, 64, True)]


@pytest.mark.parametrize(
    "dtype, normalize, widen, expected",
    [
        (DTYPE, True, 1, (64, True)),
        (DTYPE, False, 1, (32, False)),  # (level 1: normalized forwards only)
        (DTYPE, False, 2, (64, True)),
        (DTYPE, True, 0, (32, False)),
        (torch.float32, False, 2, None),  # fp32 tokens: the table's tiles as they are
    ],
)
def test_thin_table_tiles_widen_for_doc_rows(dtype, normalize, widen, expected, device, monkeypatch):
    """A thin block with the launch table's 32-token tiles at 128 dims (here a pair list, which never takes a
    once-read scan) runs in DOC_ROWS with 64-token tiles, per DOC_ROWS_WIDEN_THIN's level."""
    monkeypatch.setattr(launch_settings, "DOC_ROWS_WIDEN_THIN", widen)
    Q, D = torch.randn(29, 128, dtype=dtype, device=device), torch.randn(230, 128, dtype=dtype, device=device)
    cu_q = torch.tensor([0, 20, 29], device=device)
    cu_d = torch.tensor([0, 70, 70, 199, 230], device=device)
    pq, pd = torch.tensor([1, 0, 1], device=device), torch.tensor([2, 3, 1], device=device)
    kernels_on(device)
    seen = forward_launches(
        monkeypatch,
        lambda: maxsim_pairs_varlen(Q, D, cu_q, cu_d, pq, pd, normalize=normalize),
        lambda c, w, s: (c["BLOCK_N"], c["DOC_ROWS"]),
    )
    if expected is None:
        monkeypatch.setattr(launch_settings, "DOC_ROWS_WIDEN_THIN", 0)
        expected = forward_launches(
            monkeypatch,
            lambda: maxsim_pairs_varlen(Q, D, cu_q, cu_d, pq, pd, normalize=normalize),
            lambda c, w, s: (c["BLOCK_N"], c["DOC_ROWS"]),
        )[0]
    assert seen == [expected]
