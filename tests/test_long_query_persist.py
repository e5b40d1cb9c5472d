"""Scores-only forwards of long queries (more than 128 tokens: one program a 128-row block) walk short shared
documents in persistent programs (``configs.scores_only_config``, ``launch_settings.LONG_QUERY_PERSIST_MAX_TILES``),
but not normalized: chosen where the rule says, and computing what one program a document computes, bit for bit,
with masks (holes, a fully masked document, NaN in masked and in valid tokens) and a last row block of few rows."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    INTERPRET,
    alternate_under_interpreter,
    assert_plans_agree,
    forward_launches,
    kernels_on,
    poisoned_documents,
)

from maxsim import maxsim
from maxsim.kernels import device_info, launch_forward, launch_settings

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

DTYPE = torch.bfloat16 if torch.cuda.is_available() and not INTERPRET else torch.float16


@pytest.fixture
def few_sms(monkeypatch):
    """Plans for 2 multiprocessors (so that a persistent program walks several documents); plans cleared before
    and after."""
    monkeypatch.setattr(device_info, "sm_count", lambda device: 2)
    launch_forward.plans.clear()
    yield
    launch_forward.plans.clear()


def _persistent(monkeypatch, call) -> bool:
    """Whether the last forward launch of ``call`` walks documents persistently (recorded, not run)."""
    seen = forward_launches(monkeypatch, call, lambda c, warps, stages: (c["TQ"], c["PERSIST"]))
    tq, persist = seen[-1]
    assert tq == 128  # (a long query's row blocks)
    return persist


RULE_CASES = {
    # name: (document tokens in tiles of the table's BLOCK_N, the call's kind, persistent)
    "short documents": (2, "scores", True),
    "documents of the bound": (None, "scores", True),
    "documents past the bound": (1, "scores", False),
    "masked": (2, "masked", True),
    "normalized": (2, "normalized", False),
    "training forward": (2, "argmax", False),
}


@pytest.mark.parametrize("case", list(RULE_CASES), ids=list(RULE_CASES))
def test_long_queries_walk_short_documents_persistently(case, few_sms, device, monkeypatch):
    tiles, kind, expected = RULE_CASES[case]
    bound = launch_settings.LONG_QUERY_PERSIST_MAX_TILES
    block_n = 64  # (the long queries' tiles at 128 dims)
    Ld = {2: 2 * block_n - 5, None: bound * block_n, 1: bound * block_n + 1}[tiles]
    Q = torch.randn(3, 200, 128, dtype=DTYPE, device=device)
    D = torch.randn(6, Ld, 128, dtype=DTYPE, device=device)
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool, device=device) if kind == "masked" else None
    kernels_on(device)
    call = lambda: maxsim(Q, D, d_mask=d_mask, normalize=kind == "normalized", return_argmax=kind == "argmax")  # noqa: E731
    assert _persistent(monkeypatch, call) == expected


CASES = {
    # name: (Q shape, D shape): two row blocks, the second of 72 rows; three, the last of 4 rows (queries of 65-128
    # dims: their 128-wide chunk is what the rule covers)
    "Lq 200, dim 80": ((2, 200, 80), (4, 70, 80)),
    "Lq 260, dim 96": ((2, 260, 96), (4, 129, 96)),
}


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_persistent_long_queries_compute_what_one_program_a_document_computes(
    case, masked, few_sms, device, monkeypatch
):
    """The same scores either way, bit for bit (the same tiles in the same order), and on integer tokens exactly the
    reference's; NaN in a masked token never read, NaN in a valid one poisons its document's scores."""
    alternate_under_interpreter(list(CASES).index(case), masked, device)
    q_shape, d_shape = CASES[case]
    Q, D, d_mask = poisoned_documents(q_shape, d_shape, dtype=DTYPE, device=device, masked=masked)
    kernels_on(device)
    assert_plans_agree(
        monkeypatch, "LONG_QUERY_PERSIST_MAX_TILES", {True: 1 << 20, False: 0},
        lambda call: _persistent(monkeypatch, call), Q, D, d_mask,
    )  # fmt: skip
