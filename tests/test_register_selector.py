"""The dD owner's selector built in the MMA's registers (``REG_SEL``, REGISTER_SELECTOR): the rule picks it
for document walks of raw 16-bit tokens and for walks over the queries at 128-wide dim blocks of at most 32 tokens;
where it is picked, the gradients are bitwise those of the selector through shared memory (the same 0/1 values
into the same MMA) and match the float64 reference, in both backward modes, with masks with holes and an empty
document."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRET, assert_matches_reference, lib_forward_backward, make_inputs

import maxsim
from maxsim.kernels import launch_backward, launch_settings
from maxsim.kernels.configs import backward_config

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

# (layout, Nq, Nd or K, Lq, Ld, dim, normalize, backward mode, REG_SEL expected)
CASES = [
    ("cross", 5, 4, 32, 70, 128, False, "fast", True),  # a walk over the queries, 128 dims, 32 tokens
    ("cross", 5, 4, 20, 70, 128, True, "deterministic", True),  # (normalized too)
    ("candidates", 3, 4, 23, 70, 64, False, "fast", True),  # a document walk, raw tokens
    ("pairs", 6, 0, 32, 90, 96, False, "deterministic", True),
    ("candidates", 3, 4, 23, 70, 64, True, "fast", False),  # a normalized document walk: through shared memory
    ("cross", 5, 4, 23, 70, 48, False, "fast", False),  # 64-wide dim blocks
    ("cross", 3, 4, 64, 70, 128, False, "deterministic", False),  # 64 tokens
]


def _owner_run(inp, normalize, mode, setting, monkeypatch):
    """(scores, dQ, dD, upstream gradient) through the Triton path, and the REG_SEL flag of each owner plan."""
    monkeypatch.setattr(launch_settings, "REGISTER_SELECTOR", setting)
    launch_backward.plans.clear()
    with maxsim.backend("triton"):
        out = lib_forward_backward(inp, normalize=normalize, backward=mode)
    flags = [p.main[2]["REG_SEL"] for p in launch_backward.plans.values() if p.main[2]["DD_OWNED"]]
    launch_backward.plans.clear()
    return out, flags


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:-1])))
def test_register_selector_same_gradients(case, device, monkeypatch):
    layout, n, m, lq, ld, dim, normalize, mode, expected = case
    inp = make_inputs(layout, n, m, lq, ld, dim, dtype=torch.bfloat16, device=device, masks="empty", seed=11)
    (s, dQ, dD, g), flags = _owner_run(inp, normalize, mode, 1, monkeypatch)
    assert flags == [expected], f"owner plans' REG_SEL {flags}, expected [{expected}]"
    assert_matches_reference(inp, s, dQ, dD, g, normalize=normalize)
    (s0, dQ0, dD0, _), flags0 = _owner_run(inp, normalize, mode, 0, monkeypatch)
    assert flags0 == [False]
    for name, a, b in (("scores", s, s0), ("dQ", dQ, dQ0), ("dD", dD, dD0)):
        assert torch.equal(a, b), f"{name}: the register selector's differs from the shared-memory one's"


def test_register_selector_rule():
    """The rule itself: 16-bit tokens only; document walks unless normalized; query walks at 128 dims, <= 32 tokens."""
    rule = launch_backward.register_selector
    bf16, fp32 = torch.bfloat16, torch.float32
    assert rule(True, False, backward_config(32, 64, candidates=True), bf16)
    assert not rule(True, True, backward_config(32, 64, candidates=True, normalize=True), bf16)
    assert rule(False, False, backward_config(32, 128), bf16)
    assert rule(False, True, backward_config(16, 128), torch.float16)
    assert not rule(False, False, backward_config(64, 128), bf16)
    assert not rule(False, False, backward_config(32, 48), bf16)
    assert not rule(True, False, backward_config(32, 64, candidates=True), fp32)
    assert not rule(False, False, backward_config(32, 128), fp32)
