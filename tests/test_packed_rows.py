"""Queries packed back to back at their own length into a shared-document block's rows (``launch_settings.PACK_ROWS``,
forward.py's ``PACKED``) compute what ``TQ``-row slots compute: the same scores (bit for bit on integer data, whose
sums are exact in any order) and the same argmax, on every path of the forward kernel (one program a document, the
persistent walk, documents in chunks, packed tokens with offsets), with masks with holes, NaN, ties, empty queries
and documents; and training through them matches the float64 reference. The table packs 16-bit tokens of any
width (PACK_ROWS = 1); the kernel's comparisons here switch it on for fp32 tokens too (PACK_ROWS = 2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import (
    INTERPRET,
    alternate_under_interpreter,
    check_parity,
    forward_launches,
    int_grid,
    kernels_on,
    make_inputs,
    rand_mask,
)

import maxsim
from maxsim import reference
from maxsim.kernels import device_info, launch, launch_forward, launch_settings
from maxsim.kernels.configs import forward_config

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

DTYPE = torch.bfloat16 if torch.cuda.is_available() and not INTERPRET else torch.float16

# name: (Nq, Lq, dim, queries a packed block holds, blocks packed / in slots)
CASES = {
    "23-token queries": (9, 23, 16, 11, (1, 2)),  # 32-row slots, 8 a block
    "12-token queries": (20, 12, 16, 21, (1, 2)),  # 16-row slots, 16 a block
    "5-token queries, capped": (40, 5, 16, 32, (2, 3)),  # 51 would fit: capped at twice the slots
    "40-token queries": (5, 40, 16, 6, (1, 2)),  # 64-row slots, 4 a block
    "23-token queries, 300 dims": (9, 23, 300, 11, (1, 2)),  # the dim loop of wide tokens (configs.wide)
}


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    """Fresh plans, on one multiprocessor (these small launches would all fit one wave of a GPU's: not packed)."""
    monkeypatch.setattr(device_info, "sm_count", lambda device: 1)
    launch_forward.plans.clear()
    yield
    launch_forward.plans.clear()


def _packed_and_slots(monkeypatch, call, planned=None):
    """``call()`` with packing on for every table (PACK_ROWS = 2: fp32 tokens too), then off (fresh plans
    each); the forward plans each ran are appended to ``planned`` (a list), packing's first."""
    run = launch_forward.run_forward

    def spy(plan, *args):
        if planned is not None:
            planned.append(plan)
        return run(plan, *args)

    results = []
    with monkeypatch.context() as m:
        m.setattr(launch_forward, "run_forward", spy)
        for pack in (2, 0):
            m.setattr(launch_settings, "PACK_ROWS", pack)
            launch_forward.plans.clear()
            results.append(call())
    return results


def _assert_bitwise(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0, equal_nan=True)
    if b[1] is not None:
        assert torch.equal(a[1], b[1])


def _exact_inputs(Nq, Lq, dim, Nd, Ld, device, seed):
    """Integer tokens with a NaN in one valid document token and one in a masked one; masks with holes, an empty
    query and an empty document."""
    Q = int_grid((Nq, Lq, dim), seed=seed, dtype=DTYPE, device=device)
    D = int_grid((1, Nd, Ld, dim), seed=seed + 1, dtype=DTYPE, device=device)
    qm = rand_mask((Nq, Lq), seed=seed + 2, device=device)
    dm = rand_mask((1, Nd, Ld), seed=seed + 3, device=device)
    qm[Nq // 2] = False
    dm[0, -1] = False
    D[0, 1, 3, 0] = float("nan")
    dm[0, 1, 3] = True
    D[0, 2, 4, 1] = float("nan")
    dm[0, 2, 4] = False
    return Q, D, qm, dm


def test_the_rule_packs_where_it_saves_blocks(monkeypatch):
    def pack(cfg, Nq, Lq, K, shared, sms, itemsize=2):
        return launch_forward.packed_queries(cfg, Nq, Lq, K, shared, sms, itemsize)

    for Nq, Lq, dim, per_block, _blocks in CASES.values():
        cfg = forward_config(Lq, dim, Nq, True)
        assert pack(cfg, Nq, Lq, 5, True, 1) == per_block
        assert pack(cfg, Nq, Lq, 5, False, 1) == 0  # (documents not shared)
    cfg = forward_config(23, 128, 128, True)
    assert pack(cfg, 128, 23, 128, True, 132) == 11  # 16 blocks a document in slots, 12 packed
    assert pack(cfg, 8, 23, 128, True, 132) == 0  # one block either way
    assert pack(forward_config(32, 128, 128, True), 128, 32, 128, True, 132) == 0  # slots full
    assert pack(forward_config(200, 128, 8, True), 8, 200, 128, True, 132) == 0  # row-split queries
    # 4 blocks in slots x 33 documents: one program more than the multiprocessors, then exactly as many
    assert pack(cfg, 32, 23, 33, True, 131) == 11 and pack(cfg, 32, 23, 33, True, 132) == 0
    # 16-bit wide tokens (the dim loop) pack from PACK_ROWS = 1, fp32 tokens only under PACK_ROWS = 2
    fp32, wide = forward_config(12, 128, 64, True, True), forward_config(23, 768, 128, True)
    assert pack(fp32, 64, 12, 128, True, 132, 4) == 0 and pack(wide, 128, 23, 128, True, 132) == 11
    monkeypatch.setattr(launch_settings, "PACK_ROWS", 2)
    assert pack(fp32, 64, 12, 128, True, 132, 4) == 5
    assert pack(cfg, 128, 23, 128, True, 132) == 11
    monkeypatch.setattr(launch_settings, "PACK_ROWS", 0)
    assert pack(cfg, 128, 23, 128, True, 132) == 0


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_packed_launch_takes_fewer_programs(case, device, monkeypatch):
    Nq, Lq, dim, _per_block, (packed_blocks, slot_blocks) = CASES[case]
    Q = torch.randn(Nq, Lq, dim, dtype=DTYPE, device=device)
    D = torch.randn(3, 20, dim, dtype=DTYPE, device=device)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_PROGRAMS_PER_SM", 0)
    grids = []
    orig = launch_forward.run_forward

    def spy(plan, *args):
        grids.append((plan.grid, plan.constexprs["PACKED"]))
        raise StopIteration

    monkeypatch.setattr(launch_forward, "run_forward", spy)
    for pack in (2, 0):
        monkeypatch.setattr(launch_settings, "PACK_ROWS", pack)
        launch_forward.plans.clear()
        cfg = dataclasses.replace(forward_config(Lq, dim, Nq, True), persist=0)
        with pytest.raises(StopIteration):
            launch.forward(Q, D[None], None, None, False, True, cfg=cfg)
    monkeypatch.setattr(launch_forward, "run_forward", orig)
    assert grids == [(packed_blocks * 3, True), (slot_blocks * 3, False)]


@pytest.mark.parametrize("argmax", [False, True], ids=["scores", "argmax"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_packed_rows_match_slots_bitwise(case, argmax, device, monkeypatch):
    """One program a document (the table's persistent plan off), masks with holes, NaN, ties, empty rows."""
    alternate_under_interpreter(list(CASES).index(case), argmax, device)
    Nq, Lq, dim, _per_block, _blocks = CASES[case]
    Q, D, qm, dm = _exact_inputs(Nq, Lq, dim, 4, 37, device, seed=len(case))
    cfg = dataclasses.replace(forward_config(Lq, dim, Nq, True), persist=0)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_PROGRAMS_PER_SM", 0)
    planned = []
    packed, slots = _packed_and_slots(
        monkeypatch, lambda: launch.forward(Q, D, qm, dm, False, argmax, cfg=cfg), planned
    )
    assert [p.constexprs["PACKED"] for p in planned] == [True, False]
    _assert_bitwise(packed, slots)
    ref, ref_arg = reference.scores_and_argmax(Q.double(), D.double(), qm, dm)
    torch.testing.assert_close(packed[0].double(), ref, rtol=0, atol=0, equal_nan=True)
    assert (packed[0][Nq // 2] == 0).all() and torch.isnan(packed[0][:, 1]).any()


@pytest.mark.parametrize("lq", [12, 19])
def test_packed_fp32_rows_match_slots_bitwise(lq, device, monkeypatch):
    """fp32 tokens (their own table: 64-row blocks, tf32x3 on a GPU): 12-token queries 5 to a block instead of 4,
    19-token ones 3 instead of 2."""
    Nq, dim = 20, 16
    Q, D, qm, dm = _exact_inputs(Nq, lq, dim, 3, 29, device, seed=lq)
    Q, D = Q.float(), D.float()
    cfg = forward_config(lq, dim, Nq, True, True)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_PROGRAMS_PER_SM", 0)
    planned = []
    packed, slots = _packed_and_slots(monkeypatch, lambda: launch.forward(Q, D, qm, dm, False, True, cfg=cfg), planned)
    assert [p.constexprs["PACKED"] for p in planned] == [True, False]
    _assert_bitwise(packed, slots)
    ref, _ref_arg = reference.scores_and_argmax(Q.double(), D.double(), qm, dm)
    torch.testing.assert_close(packed[0].double(), ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", ["23-token queries", "5-token queries, capped"])
def test_packed_rows_persistent_walk(case, device, monkeypatch):
    """Programs walking several documents (one multiprocessor's worth of programs), unmasked and masked."""
    Nq, Lq, dim, _per_block, _blocks = CASES[case]
    Q, D, qm, dm = _exact_inputs(Nq, Lq, dim, 3, 21, device, seed=11)
    monkeypatch.setattr(device_info, "sm_count", lambda device: 1)
    cfg = dataclasses.replace(forward_config(Lq, dim, Nq, True), persist=1)
    for masks in ((None, None), (qm, dm)):
        planned = []
        packed, slots = _packed_and_slots(
            monkeypatch, lambda masks=masks: launch.forward(Q, D, *masks, False, True, cfg=cfg), planned
        )
        _assert_bitwise(packed, slots)
        assert [(p.constexprs["PACKED"], p.constexprs["PERSIST"]) for p in planned] == [(True, True), (False, True)]


def test_packed_rows_in_document_chunks(device, monkeypatch):
    """Few long documents, each scanned in chunks by programs of their own (DOC_SPLIT), the chunks folded."""
    Nq, Lq, dim = 9, 23, 16
    Q, D, qm, dm = _exact_inputs(Nq, Lq, dim, 3, 100, device, seed=21)
    monkeypatch.setattr(device_info, "sm_count", lambda device: 64)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_MIN_TILES", 1)
    # (the table packs no launch this small on 64 multiprocessors: the kernel's chunked path is tested regardless)
    rule = launch_forward.packed_queries

    def on_no_multiprocessors(cfg, nq, lq, k, shared, sms, *rest):
        return rule(cfg, nq, lq, k, shared, 0, *rest)

    monkeypatch.setattr(launch_forward, "packed_queries", on_no_multiprocessors)
    monkeypatch.setattr(launch_settings, "DEEP_PIPELINE", 0)
    cfg = dataclasses.replace(forward_config(Lq, dim, Nq, True), persist=0)
    planned = []
    packed, slots = _packed_and_slots(monkeypatch, lambda: launch.forward(Q, D, qm, dm, False, True, cfg=cfg), planned)
    assert [(p.constexprs["PACKED"], p.n_dsplit > 1) for p in planned] == [(True, True), (False, True)]
    _assert_bitwise(packed, slots)


def test_packed_varlen_queries(device, monkeypatch):
    """Packed tokens with offsets: queries of 17-23 tokens, rows packed by the longest."""
    kernels_on(device)
    lens_q = [23, 17, 20, 23, 19, 21, 18, 22, 23, 17]
    lens_d = [30, 0, 12, 41]
    dim = 16
    Q = int_grid((sum(lens_q), dim), seed=31, dtype=DTYPE, device=device)
    D = int_grid((sum(lens_d), dim), seed=32, dtype=DTYPE, device=device)
    D[5, 0] = float("nan")
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_d = torch.tensor([0, *torch.tensor(lens_d).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def call():
        with torch.no_grad():
            return maxsim.maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=23, max_seqlen_d=41, return_argmax=True)

    planned = []
    packed, slots = _packed_and_slots(monkeypatch, call, planned)
    assert [p.constexprs["PACKED"] for p in planned] == [True, False]
    _assert_bitwise(packed, slots)
    ref, ref_arg = reference.maxsim_varlen_with_argmax(Q.double(), D.double(), cu_q, cu_d, max_seqlen_q=23)
    torch.testing.assert_close(packed[0].double(), ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
def test_packed_rows_training_matches_the_reference(normalize, device):
    """A training step through packed rows (the backward reads the argmax, whatever the forward's blocks were)."""
    kernels_on(device)
    inp = make_inputs("cross", 9, 5, 23, 29, 16, dtype=DTYPE, device=device, seed=41, masks="empty")
    cfg = forward_config(23, 16, 9, True)
    assert launch_forward.packed_queries(cfg, 9, 23, 5, True, 1, 2) == 11
    check_parity(inp, normalize=normalize, seed=41)
    assert any(p.constexprs["PACKED"] for p in launch_forward.plans.values() if hasattr(p, "constexprs"))


def test_the_table_plans_packed_rows(device, monkeypatch):
    """What the launch table plans for the off-matrix 128x128 Lq23 Ld333 step's forward: 11 queries a 256-row
    block, and 8 in 32-row slots for 32-token queries."""
    kernels_on(device)
    D = torch.randn(128, 333, 128, dtype=torch.float16, device=device)
    for lq, packed in ((23, True), (32, False)):
        Q = torch.randn(128, lq, 128, dtype=torch.float16, device=device)
        seen = forward_launches(
            monkeypatch, lambda Q=Q: maxsim.maxsim(Q, D, return_argmax=True), lambda c, w, s: (c["PACKED"], c["BQ"])
        )
        assert seen == [(packed, 8)]
