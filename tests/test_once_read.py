"""Large once-read scans on cards that ``launch_settings.ONCE_READ_TABLE_L2`` names run the table's pipelined loop with
``configs.once_read_config``'s tiles instead of the stream: chosen where the rule says, and computing what the
stream computes (bit for bit on integer data; normalized scores within 2 ulp, their rows' sum following the tile's
layout)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import H100, H200, INTERPRET, forward_launches, int_grid, kernels_on, plan_on_card, rand_mask

from maxsim import maxsim, maxsim_pairs, reference
from maxsim.kernels import configs, device_info, launch_forward, launch_settings

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

DTYPE = torch.bfloat16 if torch.cuda.is_available() and not INTERPRET else torch.float16


@pytest.fixture
def card(monkeypatch):
    """``card(name, l2_bytes)``: plans as if on that card with that L2 (plans cleared before and after). The few
    programs of these small scans would take the deep pipeline or chunked documents on a GPU: both off."""
    monkeypatch.setattr(launch_settings, "DEEP_PIPELINE", 0)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_PROGRAMS_PER_SM", 0)

    yield lambda name, l2_bytes: plan_on_card(monkeypatch, name, l2_bytes)
    launch_forward.plans.clear()


def _launches(monkeypatch, call) -> list[tuple]:
    """``(STREAM_D, BLOCK_N, num_stages, num_warps, PERSIST)`` of every forward launch ``call`` makes (recorded,
    not run)."""
    return forward_launches(
        monkeypatch, call, lambda c, warps, stages: (c["STREAM_D"], c["BLOCK_N"], stages, warps, c["PERSIST"])
    )


def _inputs(nq: int, lq: int, nd: int, ld: int, dim: int, own: bool, device: str):
    Q = torch.randn(nq, lq, dim, dtype=torch.float16, device=device)
    D = torch.randn(*((nq,) if own else ()), nd, ld, dim, dtype=torch.float16, device=device)
    return Q, D


TABLE_64 = (False, 64, 3, 4, False)  # (64-token tiles, 3 stages, 4 warps, one program a document)
TABLE_128 = (False, 128, 3, 4, False)
TABLE_128_MASKED = (False, 128, 2, 4, False)  # (configs.ONCE_READ_LONG_MASKED_STAGES)
TABLE_ROWS64 = (False, 32, 4, 4, False)  # (one program a document where there are few)


@pytest.mark.parametrize(
    "what, card_name, l2s, expected",
    [
        ("one query", H200, 3.0, TABLE_64),
        ("one query, long documents", H200, 3.0, TABLE_128),
        ("candidates", H200, 3.0, TABLE_64),
        ("one query of 64 rows", H200, 3.0, TABLE_ROWS64),
        ("candidates of 64-row queries", H200, 3.0, TABLE_ROWS64),
        ("one query of 64 rows", H200, 1.5, TABLE_ROWS64),  # (ONCE_READ_WIDE_TABLE_L2: from one L2)
        ("candidates of 64-row queries", H200, 1.5, TABLE_ROWS64),
        ("one query of 64 rows", H200, 0.8, "stream"),
        ("pairs of 64-row queries", H200, 1.5, "stream"),  # (one document a query: the 2 L2 bound)
        ("pairs of 64-row queries", H200, 3.0, TABLE_ROWS64),
        ("one query of 64 rows", H100, 1.5, "stream"),
        ("one query", H200, 1.5, "stream"),  # (under the card's bound: STREAM_L2_RANGE's rule)
        ("one query", H200, 10.0, TABLE_64),  # (past STREAM_L2_RANGE too)
        ("one query", H100, 3.0, "stream"),  # (a card the table does not name)
        ("one query", H100, 10.0, "table as it is"),
        ("one query, 64 dims", H200, 3.0, "stream"),  # (narrow scans keep the stream)
        ("one query, document mask", H200, 3.0, "stream"),
        ("one query, document mask, normalized", H200, 3.0, TABLE_64),  # (ONCE_READ_TABLE_MASKED_SUMS)
        ("one query, long documents, document mask, normalized", H200, 3.0, TABLE_128_MASKED),
        ("one query, long documents, normalized", H200, 3.0, TABLE_128),
        ("candidates, document mask, normalized", H200, 3.0, TABLE_64),
        ("one query of 64 rows, document mask, normalized", H200, 3.0, "pipelined"),
        ("one query of 64 rows, document mask, normalized, 64-row bound", H200, 3.0, (False, 64, 4, 4, False)),
        ("one query, document mask, normalized, rule off", H200, 3.0, "stream"),
        ("one query, rule off", H200, 3.0, "stream"),
        ("several query blocks", H200, 3.0, "table as it is"),  # (each tile read by every block)
        ("training forward", H200, 3.0, "table as it is"),
    ],
)
def test_once_read_table_chosen_where_the_rule_says(what, card_name, l2s, expected, card, device, monkeypatch):
    kernels_on(device)
    nq = 40 if what == "several query blocks" else 2 if what.startswith("candidates") else 1
    lq = 48 if "64 rows" in what or "64-row" in what else 32
    ld = 600 if "long documents" in what else 50
    dim = 64 if "64 dims" in what else 128
    Q, D = _inputs(nq, lq, 3, ld, dim, what.startswith("candidates"), device)
    if what.startswith("pairs"):  # (three queries, each against its own document: Q [3, Lq, dim], D [3, Ld, dim])
        Q, D = _inputs(3, lq, 3, ld, dim, False, device)
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool, device=device) if "mask" in what else None
    if what == "one query, rule off":
        monkeypatch.setattr(launch_settings, "ONCE_READ_TABLE", 0)
    elif what.endswith("rule off"):
        monkeypatch.setattr(launch_settings, "ONCE_READ_TABLE_MASKED_SUMS", 0)
    elif what.endswith("64-row bound"):  # (ONCE_READ_TABLE_MASKED_SUMS_MAX_ROWS: measured slower, see there)
        monkeypatch.setattr(launch_settings, "ONCE_READ_TABLE_MASKED_SUMS_MAX_ROWS", 64)
    card(card_name, int(D.numel() * D.element_size() / l2s))
    if what == "training forward":
        seen = _launches(monkeypatch, lambda: maxsim(Q, D, return_argmax=True))
    elif what.startswith("pairs"):
        seen = _launches(monkeypatch, lambda: maxsim_pairs(Q, D))
    else:
        seen = _launches(monkeypatch, lambda: maxsim(Q, D, d_mask=d_mask, normalize="normalized" in what))
    assert len(seen) == 1
    if expected == "stream":
        assert seen[0][0] is True
    elif expected == "pipelined":  # (masked, normalized 64-row blocks: forward_config's tiles, see test_doc_rows.py)
        assert seen[0][0] is False
    elif expected == "table as it is":
        cfg = configs.forward_config(lq, dim, nq, not what.startswith("candidates"))
        if what != "training forward":  # (packed blocks halved where the documents fit: tests/test_half_packed.py)
            cfg = launch_forward.half_packed_blocks(cfg, D) or cfg
        if what != "training forward" and launch_forward.widened_thin_for_doc_rows(cfg):
            # (a thin scores-only block takes 64-token tiles where the table gives 32: tests/test_doc_rows.py)
            cfg = dataclasses.replace(cfg, BLOCK_N=launch_settings.DOC_ROWS_MIN_BLOCK_N)
        assert seen[0][0] is False and seen[0][1:4] == (cfg.BLOCK_N, cfg.num_stages, cfg.num_warps)
    else:  # (whether 64-row blocks persist depends on the documents a multiprocessor: the test after next)
        assert seen[0] == expected if expected[1:3] != TABLE_ROWS64[1:3] else seen[0][:4] == expected[:4]


CASES = {
    # name: (Q shape, D shape): one query against shared documents, or each query against its own candidates
    "one query, partial last tile": ((1, 9, 128), (1, 5, 45, 128)),
    "one query, long documents": ((1, 20, 96), (1, 2, 530, 96)),  # (128-token tiles: 5 of them, the last partial)
    "candidates": ((3, 12, 128), (3, 2, 70, 128)),
    "one query of 64 rows": ((1, 40, 96), (1, 3, 70, 96)),
    "candidates, queries of 64 rows": ((2, 48, 128), (2, 2, 33, 128)),
}


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_once_read_table_matches_the_stream(case, normalize, card, device, monkeypatch):
    """Integer data (exact ties everywhere: the lowest index wins in both loops), a NaN token and an infinite
    one: the table's scores equal the stream's, and the float64 reference's."""
    q_shape, d_shape = CASES[case]
    Q = int_grid(q_shape, seed=1, dtype=DTYPE, device=device)
    D = int_grid(d_shape, seed=2, dtype=DTYPE, device=device)
    D[0, -1, -1, 0] = float("nan")
    D[-1, 0, 3, 1] = float("inf")
    shared = d_shape[0] == 1
    Dc = D[0] if shared else D
    nbytes = Dc.numel() * Dc.element_size()
    monkeypatch.setattr(launch_settings, "STREAM_L2_RANGE", (0.0, math.inf))
    kernels_on(device)
    runs = {}
    for name, l2s in (("stream", 1.0), ("table", 3.0)):
        card(H200, int(nbytes / l2s))
        expected = name == "stream"
        assert [s[0] for s in _launches(monkeypatch, lambda: maxsim(Q, Dc, normalize=normalize))] == [expected]
        runs[name] = maxsim(Q, Dc, normalize=normalize)
    torch.testing.assert_close(runs["table"], runs["stream"], rtol=2.5e-7 if normalize else 0, atol=0, equal_nan=True)
    ref = reference.maxsim(Q.double(), Dc.double(), normalize=normalize)
    torch.testing.assert_close(runs["table"].double(), ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(runs["table"][0, -1])


WIDE_CASES = {
    # name: (Q shape, D shape, documents a program with one multiprocessor): partial last tiles, several documents
    # a program, and a program whose last document ends the scan early
    "one query of 64 rows": ((1, 40, 96), (1, 13, 70, 96)),
    "candidates, queries of 64 rows": ((2, 48, 128), (2, 11, 33, 128)),
}


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("case", list(WIDE_CASES), ids=list(WIDE_CASES))
def test_once_read_wide_blocks_walk_documents_persistent(case, normalize, card, device, monkeypatch):
    """Blocks of 33-64 rows take persistent programs (``configs.ONCE_READ_WIDE_PERSIST`` a multiprocessor; here one
    multiprocessor, so each walks several documents, its tiles in flight across their boundaries): the scores of
    one program a document, bit for bit on integer data with a NaN and an infinite token (normalized within 2 ulp),
    and the float64 reference's."""
    q_shape, d_shape = WIDE_CASES[case]
    Q = int_grid(q_shape, seed=7, dtype=DTYPE, device=device)
    D = int_grid(d_shape, seed=8, dtype=DTYPE, device=device)
    D[0, 4, -1, 0] = float("nan")
    D[-1, -2, 5, 1] = float("inf")
    Dc = D[0] if d_shape[0] == 1 else D
    monkeypatch.setattr(device_info, "sm_count", lambda device: 1)
    kernels_on(device)
    card(H200, Dc.numel() * Dc.element_size() // 3)
    assert configs.ONCE_READ_WIDE_PERSIST > 0
    runs = {}
    for persist in (configs.ONCE_READ_WIDE_PERSIST, 0):
        monkeypatch.setattr(configs, "ONCE_READ_WIDE_PERSIST", persist)
        # (normalized: 64-token tiles, in DOC_ROWS; launch_settings.DOC_ROWS_SUMS_MAX_ROWS)
        block_n = 64 if normalize else 32
        assert _launches(monkeypatch, lambda: maxsim(Q, Dc, normalize=normalize)) == [
            (False, block_n, 4, 4, persist > 0)
        ]
        runs[persist] = maxsim(Q, Dc, normalize=normalize)
    one_each = runs.pop(0)
    (walked,) = runs.values()
    torch.testing.assert_close(walked, one_each, rtol=2.5e-7 if normalize else 0, atol=0, equal_nan=True)
    ref = reference.maxsim(Q.double(), Dc.double(), normalize=normalize)
    torch.testing.assert_close(walked.double(), ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(walked[0, 4]) and torch.isinf(walked[-1, -2]) == (not normalize)


def test_once_read_thin_blocks_keep_one_program_a_document(card, device, monkeypatch):
    """32-row blocks keep one program a document whatever the persistent setting of the wide ones (they gained
    nothing from it: configs.once_read_config)."""
    Q, D = _inputs(1, 32, 13, 70, 128, False, device)
    monkeypatch.setattr(device_info, "sm_count", lambda device: 1)
    kernels_on(device)
    card(H200, D.numel() * D.element_size() // 3)
    assert _launches(monkeypatch, lambda: maxsim(Q, D)) == [TABLE_64]


def test_once_read_table_with_a_query_mask(card, device, monkeypatch):
    """A query mask does not change the choice (the documents' bytes do): masked query tokens add 0 in the table's
    loop too."""
    Q = int_grid((2, 12, 128), seed=4, dtype=DTYPE, device=device)
    D = int_grid((2, 3, 70, 128), seed=5, dtype=DTYPE, device=device)
    q_mask = rand_mask((2, 12), seed=6, p_valid=0.6, device=device)
    kernels_on(device)
    card(H200, D.numel() * D.element_size() // 3)
    seen = _launches(monkeypatch, lambda: maxsim(Q, D, q_mask=q_mask))
    assert seen == [TABLE_64]
    out = maxsim(Q, D, q_mask=q_mask)
    torch.testing.assert_close(out.double(), reference.maxsim(Q.double(), D.double(), q_mask=q_mask), rtol=0, atol=0)


@pytest.mark.parametrize(
    "what, l2s, setting, expected",
    [
        ("one query", 3.0, {}, ("table", True)),  # (the once-read table: the hint on its tiles)
        ("candidates", 3.0, {}, ("table", True)),
        ("one query of 64 rows", 3.0, {}, ("table", True)),
        ("one query", 3.0, {"ONCE_READ_EVICT": 0}, ("table", False)),
        ("one query", 10.0, {}, ("table", False)),  # (past STREAM_L2_RANGE: the hint measured slower there)
        ("one query", 1.5, {}, ("stream", False)),  # (the stream's own loads carry it: forward._stream_tile)
        ("one query", 1.5, {"STREAM_AS_TABLE": 1}, ("table", True)),
        ("candidates", 1.5, {"STREAM_AS_TABLE": 1}, ("table", True)),
        ("one query, 64 dims", 3.0, {"STREAM_AS_TABLE": 1}, ("table", True)),
        ("one query, document mask", 1.5, {"STREAM_AS_TABLE": 1}, ("stream", False)),  # (the table's masks: below)
        ("one query, 64 dims", 3.0, {}, ("stream", False)),
        ("several query blocks", 3.0, {"STREAM_AS_TABLE": 1}, ("table as it is", False)),  # (read by every block)
        ("training forward", 3.0, {"STREAM_AS_TABLE": 1}, ("table as it is", False)),
    ],
)
def test_once_read_tiles_carry_the_evict_first_hint(what, l2s, setting, expected, card, device, monkeypatch):
    """``EVICT_D`` (the once-read table's tile loads with ``evict_first``, which Triton 3.9 keeps on its
    asynchronous copies) is set on the once-read table's launches only: not on the stream (whose register loads
    carry it anyway), not on a scan whose tiles several programs read, not on a training forward.
    ``STREAM_AS_TABLE`` sends the scans the rule would stream (dense documents) to that table."""
    kernels_on(device)
    for name, value in setting.items():
        monkeypatch.setattr(launch_settings, name, value)
    nq = 40 if what == "several query blocks" else 2 if what.startswith("candidates") else 1
    lq = 48 if "64 rows" in what else 32
    dim = 64 if "64 dims" in what else 128
    Q, D = _inputs(nq, lq, 3, 50, dim, what.startswith("candidates"), device)
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool, device=device) if "mask" in what else None
    card(H200, int(D.numel() * D.element_size() / l2s))
    need_argmax = what == "training forward"
    seen = forward_launches(
        monkeypatch,
        lambda: maxsim(Q, D, d_mask=d_mask, return_argmax=need_argmax),
        lambda c, warps, stages: (c["STREAM_D"], c["EVICT_D"], c["BLOCK_N"], stages),
    )
    assert len(seen) == 1
    stream, evict, block_n, stages = seen[0]
    kind, hinted = expected
    assert stream is (kind == "stream") and evict is hinted
    if kind == "table":  # (once_read_config's tiles, not the table's as it is)
        assert (block_n, stages) in ((configs.ONCE_READ_BLOCK_N, configs.ONCE_READ_STAGES), (32, 4))


@pytest.mark.parametrize("dim", [128, 64])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
def test_stream_as_table_matches_the_stream(normalize, dim, card, device, monkeypatch):
    """A scan the rule streams, run by the hinted once-read table instead (``STREAM_AS_TABLE``), on integer data
    with a NaN and an infinite token: the stream's scores (bit for bit raw, within 2 ulp normalized), narrow
    tokens too (64 dims, which the stream takes in 32-token tiles with 2 warps)."""
    Q = int_grid((3, 12, dim), seed=11, dtype=DTYPE, device=device)
    D = int_grid((3, 2, 70, dim), seed=12, dtype=DTYPE, device=device)
    D[0, -1, -1, 0] = float("nan")
    D[-1, 0, 3, 1] = float("inf")
    kernels_on(device)
    card(H200, int(D.numel() * D.element_size() / 1.5))
    runs = {}
    for as_table in (0, 1):
        monkeypatch.setattr(launch_settings, "STREAM_AS_TABLE", as_table)
        assert [s[0] for s in _launches(monkeypatch, lambda: maxsim(Q, D, normalize=normalize))] == [not as_table]
        runs[as_table] = maxsim(Q, D, normalize=normalize)
    torch.testing.assert_close(runs[1], runs[0], rtol=2.5e-7 if normalize else 0, atol=0, equal_nan=True)
    assert torch.isnan(runs[1][0, -1])
