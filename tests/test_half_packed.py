"""Scores-only forwards of packed 256-row query blocks against shared documents that fit a few L2s run 128-row
blocks in 4 warps, two persistent programs a multiprocessor (``launch_settings.PACKED_SCORES_HALF_L2``,
``configs.half_packed_config``): chosen where the rule says, and computing what the 256-row blocks compute, bit for
bit on integer data, with masks (holes, fully masked documents), NaN, packed 23-token queries and a last block of
fewer queries."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    H100,
    H200,
    INTERPRET,
    alternate_under_interpreter,
    assert_plans_agree,
    forward_launches,
    kernels_on,
    plan_on_card,
    poisoned_documents,
)

from maxsim import maxsim
from maxsim.kernels import device_info, launch_forward

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

DTYPE = torch.bfloat16 if torch.cuda.is_available() and not INTERPRET else torch.float16


@pytest.fixture
def card(monkeypatch):
    """``card(name, l2_bytes)``: plans as if on that card, with that L2, on 2 multiprocessors (so that the programs
    walk several documents); plans cleared before and after."""
    monkeypatch.setattr(device_info, "sm_count", lambda device: 2)
    yield lambda name, l2_bytes: plan_on_card(monkeypatch, name, l2_bytes)
    launch_forward.plans.clear()


def _launch(monkeypatch, call) -> list[tuple]:
    """``(BQ, num_warps, PERSIST)`` of every forward launch ``call`` makes (recorded, not run)."""
    return forward_launches(monkeypatch, call, lambda c, warps, stages: (c["BQ"], warps, c["PERSIST"]))


RULE_CASES = {
    # name: (card, D's size in L2s, the call's kind, expected (BQ, num_warps, PERSIST))
    "H200, documents in the L2": (H200, 0.5, "scores", (4, 4, True)),
    "H200, documents of four L2s": (H200, 4.0, "scores", (4, 4, True)),
    "H200, masked": (H200, 0.5, "masked", (4, 4, True)),
    "H200, normalized": (H200, 0.5, "normalized", (4, 4, True)),
    "H200, documents past four L2s": (H200, 4.5, "scores", (8, 8, True)),
    "H200, training forward": (H200, 0.5, "argmax", (8, 8, True)),
    "H200, fp32 tokens": (H200, 0.5, "fp32", None),
    "H100 (not measured)": (H100, 0.5, "scores", (8, 8, True)),
    "H200, one block of 256 rows": (H200, 0.5, "one block", (8, 8, True)),
}


@pytest.mark.parametrize("case", list(RULE_CASES), ids=list(RULE_CASES))
def test_half_packed_blocks_where_the_rule_says(case, card, device, monkeypatch, any_size):
    name, l2s, kind, expected = RULE_CASES[case]
    dtype = torch.float32 if kind == "fp32" else DTYPE
    Q = torch.randn(8 if kind == "one block" else 16, 32, 128, dtype=dtype, device=device)
    D = torch.randn(24, 40, 128, dtype=dtype, device=device)
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool, device=device) if kind == "masked" else None
    card(name, int(D.numel() * D.element_size() / l2s))
    kernels_on(device)
    seen = _launch(monkeypatch, lambda: maxsim(Q, D, d_mask=d_mask, normalize=kind == "normalized",
                                               return_argmax=kind == "argmax"))  # fmt: skip
    half = (4, 4, True)
    if expected is None:  # (fp32 tokens plan their own blocks: whatever they are, not halved)
        assert seen[-1] != half
    else:
        assert seen[-1] == expected


CASES = {
    # name: (Q shape, D shape): 32-token queries in slots, 23-token ones packed at their own length, a last block
    # of fewer queries, long documents (several tiles a document, a partial last one)
    "12 queries of 32 tokens": ((12, 32, 64), (6, 70, 64)),
    "packed 23-token queries": ((13, 23, 64), (5, 50, 64)),
    "a short last block": ((9, 30, 96), (4, 129, 96)),
}


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_half_packed_blocks_compute_what_full_blocks_compute(case, masked, card, device, monkeypatch, any_size):
    """The same scores with 128-row and 256-row blocks, bit for bit (integer tokens: every sum exact), and the
    reference's; NaN in a masked token never read, NaN in a valid one poisons its document's scores."""
    alternate_under_interpreter(list(CASES).index(case), masked, device)
    q_shape, d_shape = CASES[case]
    Q, D, d_mask = poisoned_documents(q_shape, d_shape, dtype=DTYPE, device=device, masked=masked)
    kernels_on(device)
    assert_plans_agree(
        monkeypatch, "PACKED_SCORES_HALF_L2", {True: ((H200, 4.0),), False: ()},
        lambda call: _launch(monkeypatch, call)[-1][1] == 4, Q, D, d_mask, prepare=lambda: card(H200, 1 << 30),
    )  # fmt: skip
