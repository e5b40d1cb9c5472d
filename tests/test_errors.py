"""Bad inputs fail up front with a ValueError / TypeError whose message names the argument, the expected and the
actual value (design.md §4), before any kernel runs, on every backend."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import assert_rejected, randn, word

import maxsim

NQ, LQ, ND, LD, K, DIM = 3, 5, 4, 6, 2, 8


def _shape_re(*shape) -> str:
    """The actual shape as any of (3, 6) / [3, 6] / torch.Size([3, 6]) print it."""
    return re.escape(", ".join(str(s) for s in shape))


def _other_device(device: str) -> str:
    return "cpu" if device == "cuda" else "meta"


def _cases(device):
    """name -> (callable, exception type, regexes that must all be found in the message)."""
    f32 = dict(device=device)
    Q = randn((NQ, LQ, DIM), seed=1, **f32)
    D = randn((ND, LD, DIM), seed=2, **f32)
    Dc = randn((NQ, K, LD, DIM), seed=3, **f32)
    qm = torch.ones(NQ, LQ, dtype=torch.bool, device=device)
    dm = torch.ones(ND, LD, dtype=torch.bool, device=device)
    other = _other_device(device)
    ms, mp = maxsim.maxsim, maxsim.maxsim_pairs
    Qp, Dp = Q, randn((NQ, LD, DIM), seed=4, **f32)
    return {
        # ranks
        "Q-1d": (lambda: ms(randn((13,), seed=5, **f32), D), ValueError, [word("Q"), word("13")]),
        "Q-4d": (lambda: ms(randn((2, 3, 5, DIM), seed=5, **f32), D), ValueError, [word("Q"), _shape_re(2, 3, 5, 8)]),
        "D-1d": (lambda: ms(Q, randn((17,), seed=5, **f32)), ValueError, [word("D"), word("17")]),
        "D-5d": (lambda: ms(Q, randn((NQ, 2, 2, 7, DIM), seed=5, **f32)), ValueError, [word("D"), _shape_re(2, 2, 7)]),
        # dim
        "dim-mismatch": (
            lambda: ms(Q, randn((ND, LD, 16), seed=5, **f32)),
            ValueError,
            [r"(?<![A-Za-z_])D(?![A-Za-z_])|dim", word("16"), word("8")],
        ),
        "dim-mismatch-candidates": (
            lambda: ms(Q, randn((NQ, K, LD, 12), seed=5, **f32)),
            ValueError,
            [word("12"), word("8")],
        ),
        "dim-zero": (
            lambda: ms(randn((NQ, LQ, 0), seed=5, **f32), randn((ND, LD, 0), seed=6, **f32)),
            ValueError,
            [word("Q"), "at least 1", _shape_re(NQ, LQ, 0)],
        ),
        # candidates: the leading dim of a 4-D D must be Nq
        "candidates-Nq": (lambda: ms(Q, randn((5, K, LD, DIM), seed=5, **f32)), ValueError, [word("D"), word("5")]),
        # mask shapes
        "q_mask-shape": (
            lambda: ms(Q, D, torch.ones(NQ, LQ + 1, dtype=torch.bool, device=device)),
            ValueError,
            [word("q_mask"), _shape_re(3, 6)],
        ),
        "q_mask-rank": (
            lambda: ms(Q, D, torch.ones(NQ, LQ, 1, dtype=torch.bool, device=device)),
            ValueError,
            [word("q_mask"), _shape_re(3, 5, 1)],
        ),
        "d_mask-shape": (
            lambda: ms(Q, D, qm, torch.ones(ND, LD + 1, dtype=torch.bool, device=device)),
            ValueError,
            [word("d_mask"), _shape_re(4, 7)],
        ),
        "d_mask-shape-candidates": (
            lambda: ms(Q, Dc, qm, torch.ones(NQ, LD, dtype=torch.bool, device=device)),
            ValueError,
            [word("d_mask"), _shape_re(3, 6)],
        ),
        "q_mask-squeezed-Q": (
            lambda: ms(Q[0], D, qm[:1]),
            ValueError,
            [word("q_mask"), _shape_re(1, 5)],
        ),
        # mask dtypes
        "q_mask-float": (lambda: ms(Q, D, qm.float(), dm), TypeError, [word("q_mask"), "float32"]),
        "d_mask-int64": (lambda: ms(Q, D, qm, dm.long()), TypeError, [word("d_mask"), "int64"]),
        "d_mask-uint8": (lambda: ms(Q, D, None, dm.to(torch.uint8)), TypeError, [word("d_mask"), "uint8"]),
        # input dtypes
        "mixed-dtypes": (lambda: ms(Q, D.bfloat16()), TypeError, ["bfloat16", "float32"]),
        "mixed-fp64": (lambda: ms(Q.double(), D), TypeError, ["float64", "float32"]),
        "integer-tensors": (lambda: ms(Q.long(), D.long()), TypeError, [word("Q"), "int64"]),
        "integer-D": (lambda: ms(Q, D.to(torch.int32)), TypeError, [word("D"), "int32"]),
        "bool-tensors": (lambda: ms(Q.bool(), D.bool()), TypeError, [word("Q"), "bool"]),
        # devices
        "mixed-devices": (lambda: ms(Q, D.to(other)), ValueError, [word("D"), other]),
        "q_mask-device": (lambda: ms(Q, D, qm.to(other), dm), ValueError, [word("q_mask"), other]),
        "d_mask-device": (lambda: ms(Q, D, qm, dm.to(other)), ValueError, [word("d_mask"), other]),
        # options
        "backward-nonsense": (lambda: ms(Q, D, backward="nonsense"), ValueError, [word("backward"), "nonsense"]),
        "module-backward": (
            lambda: maxsim.MaxSim(backward="nonsense")(Q, D),
            ValueError,
            [word("backward"), "nonsense"],
        ),
        # pairs
        "pairs-B-mismatch": (
            lambda: mp(Q, randn((NQ + 1, LD, DIM), seed=6, **f32)),
            ValueError,
            [word("4"), word("3")],
        ),
        "pairs-Q-2d": (lambda: mp(Q[0], Dp), ValueError, [word("Q")]),
        "pairs-D-4d": (lambda: mp(Qp, Dc), ValueError, [word("D")]),
        "pairs-dim": (lambda: mp(Qp, randn((NQ, LD, 16), seed=6, **f32)), ValueError, [word("16")]),
        "pairs-d_mask-shape": (
            lambda: mp(Qp, Dp, None, torch.ones(NQ, LD + 2, dtype=torch.bool, device=device)),
            ValueError,
            [word("d_mask"), _shape_re(3, 8)],
        ),
        "pairs-q_mask-dtype": (lambda: mp(Qp, Dp, qm.int()), TypeError, [word("q_mask"), "int32"]),
        "pairs-mixed-dtypes": (lambda: mp(Qp.half(), Dp), TypeError, ["float16", "float32"]),
        "pairs-backward": (lambda: mp(Qp, Dp, backward="nonsense"), ValueError, [word("backward"), "nonsense"]),
    }


CASE_NAMES = list(_cases("cpu"))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_is_rejected(name, backend, device):
    assert_rejected(*_cases(device)[name])


def _slow_packed_checks(Q, D, cu_q, cu_d, pq, pd, max_q, max_d, normalize, backward, return_argmax, validate):
    """The packed functions' checks in turn (what runs when the one-expression check says no)."""
    from maxsim import ragged
    from maxsim import validate as check_arg

    ragged._packed_args(Q, D, cu_q, cu_d, max_q, max_d, validate)
    ragged._common(Q, D, normalize, backward, return_argmax)
    if pq is not None:
        pq = check_arg.index_tensor("pair_q", pq, 1, Q.device)
        pd = check_arg.index_tensor("pair_d", pd, 1, Q.device)
        if pq.shape != pd.shape:
            raise ValueError("pair_d")


def test_packed_one_expression_check_passes_only_calls_the_checks_pass():
    """``validate.packed_call`` (the well-formed packed call's shortcut) says yes only where every check in turn
    passes, and yes for the well-formed calls themselves (strided index tensors go the long way: made contiguous)."""
    from maxsim import validate as check_arg

    Q, D = torch.randn(9, 16), torch.randn(12, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    pq = torch.tensor([0, 1, 1])
    good = dict(Q=Q, D=D, cu_q=cu, cu_d=cu.long(), pq=pq, pd=pq.int(), max_q=5, max_d=None, normalize=False,
                backward="auto", return_argmax=True, validate=None)  # fmt: skip
    bad = {
        "Q": [Q.double(), Q.int(), Q[None], torch.randn(9, 8), "Q", torch.randn(9, 0)],
        "D": [D.half(), D[:, :8], D[None], None],
        "cu_q": [cu.float(), cu[None], cu[:0], cu.tolist(), torch.tensor([0, 9, 9, 9])[::2]],
        "cu_d": [cu.double(), torch.zeros(0, dtype=torch.int32)],
        "pq": [pq[:2], pq.float(), pq[None], torch.tensor([0, 0, 1, 1, 1, 1])[::2]],
        "pd": [pq[:1], pq.double()],
        "max_q": [-1, 5.0, True, "5"],
        "max_d": [-2, 3.5, False],
        "normalize": [1, None, "yes"],
        "backward": ["slow", None, 0],
        "return_argmax": [0, None],
        "validate": [1, "no"],
    }
    args = list(good)
    assert check_arg.packed_call(*good.values())
    assert check_arg.packed_call(*{**good, "pq": None, "pd": None}.values())
    for name, values in bad.items():
        for value in values:
            case = {**good, name: value}
            fast = check_arg.packed_call(*(case[a] for a in args))
            try:
                _slow_packed_checks(*(case[a] for a in args))
                slow = True
            except (TypeError, ValueError):
                slow = False
            assert not fast or slow, (name, value)
            assert fast == (slow and name not in ("cu_q", "pq")), (name, value)  # (strided: the long way)


def test_packed_calls_reject_a_non_tensor_as_such():
    """A non-tensor Q or D of a packed call is a TypeError naming it (the checks of tensors come first)."""
    Q, D = torch.randn(9, 16), torch.randn(12, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    pq = torch.tensor([0, 1])
    for name, args in (("Q", ("Q", D)), ("D", (Q, [1.0]))):
        with pytest.raises(TypeError, match=f"^{name}: expected a torch.Tensor"):
            maxsim.maxsim_varlen(*args, cu, cu)
        with pytest.raises(TypeError, match=f"^{name}: expected a torch.Tensor"):
            maxsim.maxsim_pairs_varlen(*args, cu, cu, pq, pq)
