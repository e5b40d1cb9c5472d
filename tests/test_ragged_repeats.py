"""Repeated calls of the ragged functions (``maxsim_varlen``, ``maxsim_pairs_varlen``, ``maxsim_padded``;
``ops.ragged_repeat_key``): on the Triton path, a call whose signature an earlier call had (shapes, strides, dtypes
and devices of every tensor, offsets and pair ids included, the maxima as given, the options) goes straight to that
call's launch plan, reading this call's offsets, lengths and pair ids. It must give what the full path gives (their
values differ from call to call: a plan never reads them), take the full path whenever the signature differs or
the call asks for what a plan cannot know (maxima to read back, ``validate=True``, the argmax), and never skip a
check that the call would fail."""

from __future__ import annotations

import pytest
import torch
from helpers import int_grid

import maxsim
from maxsim import ops
from maxsim import reference as ref

MAX_Q, MAX_D = 6, 10
# Per call: lengths of one signature (the same counts and row totals), different values.
Q_LENGTHS = [(5, 3, 4), (4, 4, 4), (6, 0, 6)]
D_LENGTHS = [(7, 0, 9, 4), (10, 10, 0, 0), (1, 10, 3, 6)]
PAIRS = [([0, 1, 2, 2, 0], [3, 0, 1, 2, 2]), ([2, 2, 2, 2, 2], [0, 1, 2, 3, 0]), ([1, 0, 1, 0, 2], [1, 1, 3, 3, 0])]
FUNCTIONS = ["varlen", "pairs", "padded"]


def _offsets(lengths, dtype, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype, device=device)


def _call_args(function: str, i: int, device, dtype=torch.float16, index_dtype=torch.int32, dim=16):
    """``(args, kwargs)`` of the ``i``-th call of ``function``'s signature: integer tokens (every path sums them
    exactly), the ``i``-th lengths and pair ids."""
    if function == "padded":
        B, K, Lq, Ld = 3, 4, MAX_Q, MAX_D
        Q = int_grid((B, Lq, dim), seed=10 + i, dtype=dtype, device=device)
        D = int_grid((B, K, Ld, dim), seed=20 + i, dtype=dtype, device=device)
        ql = torch.tensor(Q_LENGTHS[i], dtype=index_dtype, device=device)
        dl = torch.tensor([D_LENGTHS[i]] * B, dtype=index_dtype, device=device).clamp(max=Ld).roll(i, 1)
        return (Q, D, ql, dl), {}
    Q = int_grid((sum(Q_LENGTHS[0]), dim), seed=10 + i, dtype=dtype, device=device)
    D = int_grid((sum(D_LENGTHS[0]), dim), seed=20 + i, dtype=dtype, device=device)
    cu_q, cu_d = _offsets(Q_LENGTHS[i], index_dtype, device), _offsets(D_LENGTHS[i], index_dtype, device)
    kw = dict(max_seqlen_q=MAX_Q, max_seqlen_d=MAX_D)
    if function == "varlen":
        return (Q, D, cu_q, cu_d), kw
    pq, pd = (torch.tensor(p, dtype=index_dtype, device=device) for p in PAIRS[i])
    return (Q, D, cu_q, cu_d, pq, pd), kw


def _reference(function: str, args: tuple, normalize: bool = False) -> torch.Tensor:
    """The reference's scores of a call's arguments (``args``' tokens as given: float64 ones give float64)."""
    fn = {"varlen": ref.maxsim_varlen, "pairs": ref.maxsim_pairs_varlen, "padded": ref.maxsim_padded}[function]
    return fn(*args, normalize=normalize)


LIB = {"varlen": maxsim.maxsim_varlen, "pairs": maxsim.maxsim_pairs_varlen, "padded": maxsim.maxsim_padded}


def _filed(function: str) -> list:
    from maxsim.kernels import launch_forward

    return [k for k in launch_forward.plans if k[:2] in (("repeat", function), ("step", function))]


@pytest.mark.parametrize("function", FUNCTIONS)
def test_a_repeated_ragged_call_skips_to_the_plan_and_scores_the_same(function, triton_only, plan_keys, device):
    for i in range(3):
        args, kw = _call_args(function, i, device)
        with torch.no_grad():
            out = LIB[function](*args, **kw)
        assert len(plan_keys) == 2, f"call {i}: the forward built its key ({len(plan_keys)} keys)"
        want = _reference(function, args).float()
        assert out.shape == want.shape
        torch.testing.assert_close(out, want, rtol=0, atol=0, msg=lambda m, i=i: f"call {i}: {m}")
    assert len(_filed(function)) == 1


def _train(function: str, args: tuple, kw: dict, g: torch.Tensor, **options):
    Qg, Dg = args[0].detach().clone().requires_grad_(), args[1].detach().clone().requires_grad_()
    s = LIB[function](Qg, Dg, *args[2:], **kw, **options)
    dQ, dD = torch.autograd.grad(s, (Qg, Dg), g)
    return s, dQ, dD


# (the backward options whose plans differ at these sizes: a pair list's and a padded call's are one plan)
@pytest.mark.parametrize(
    "function, backward", [("varlen", "fast"), ("varlen", "deterministic"), ("pairs", "auto"), ("padded", "auto")]
)
def test_repeated_ragged_steps_train_as_the_reference(function, backward, triton_only, plan_keys, backward_plans,
                                                      device):  # fmt: skip
    """The second step of a signature builds no forward key, the third no backward key either (the step holds it);
    every step is the float64 reference's, exactly (integer tokens and upstream gradients)."""
    for i in range(3):
        args, kw = _call_args(function, i, device)
        Qr, Dr = (x.detach().double().requires_grad_() for x in args[:2])
        want_s = _reference(function, (Qr, Dr, *args[2:]))
        g = int_grid(want_s.shape, seed=30 + i, device=device)
        want = (want_s, *torch.autograd.grad(want_s, (Qr, Dr), g.double()))
        s, dQ, dD = _train(function, args, kw, g, backward=backward)
        assert type(s.grad_fn).__name__ == ("_MaxSimFunctionBackward" if i == 0 else "_RepeatedStepBackward")
        assert len(plan_keys) == 2, f"step {i}: the forward built its key"
        assert len(backward_plans) == min(i + 1, 2), f"step {i}: backward keys {len(backward_plans)}"
        for name, a, b in zip(("scores", "dQ", "dD"), (s, dQ, dD), want, strict=True):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a.double(), b, rtol=0, atol=0, msg=lambda m, n=name, i=i: f"{i} {n}: {m}")


@pytest.mark.parametrize("function", FUNCTIONS)
def test_a_repeated_normalized_ragged_call_scores_as_the_full_path(function, triton_only, plan_keys, device):
    """``normalize=True``, scores and a step: a repeat gives the full path's numbers bit for bit."""
    for i in range(2):
        args, kw = _call_args(function, i, device, dtype=torch.float32)
        g = int_grid((5,) if function == "pairs" else (3, 4), seed=i, device=device)
        with torch.no_grad():
            repeated = LIB[function](*args, **kw, normalize=True)
        step = _train(function, args, kw, g, normalize=True)
        if i == 0:
            continue  # (the calls that file the signatures)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ops, "ragged_repeat_key", lambda *a: None)
            with torch.no_grad():
                full = LIB[function](*args, **kw, normalize=True)
            full_step = _train(function, args, kw, g, normalize=True)
        torch.testing.assert_close(repeated, full, rtol=0, atol=0)
        for a, b in zip(step, full_step, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(_filed(function)) == 2  # (a scores-only signature and a step's)


def _changed(change: str, function: str, device):
    """The arguments of a call that differs from :func:`_call_args`'s signature by ``change``, or None where the
    change does not apply to ``function``."""
    args, kw = _call_args(function, 1, device)
    args = list(args)
    if change == "maxima":
        if function == "padded":
            return None
        kw["max_seqlen_d"] = MAX_D + 1
    elif change == "maxima omitted":
        if function == "padded":
            return None
        del kw["max_seqlen_q"]
    elif change == "validate":
        kw["validate"] = True
    elif change == "argmax":
        kw["return_argmax"] = True
    elif change == "index dtype":
        args = list(_call_args(function, 1, device, index_dtype=torch.int64)[0])
    elif change == "fewer pairs":
        if function != "pairs":
            return None
        args[4], args[5] = args[4][:3], args[5][:3]
    elif change == "more rows":
        if function == "padded":
            return None
        args[1] = torch.cat([args[1], args[1][:2]])
        args[3] = torch.cat([args[3], args[3][-1:] + 2])
    elif change == "strided ids":  # (the full path reads contiguous copies; a repeat would read the caller's)
        args[2] = torch.stack([args[2], args[2]], 1)[:, 0]
        assert not args[2].is_contiguous()
    return tuple(args), kw


CHANGES = ["maxima", "maxima omitted", "validate", "argmax", "index dtype", "fewer pairs", "more rows", "strided ids"]


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("function", FUNCTIONS)
def test_a_ragged_call_that_differs_takes_the_full_path(function, change, triton_only, plan_keys, device):
    """Twice: a change that a signature holds is filed once, then repeats; one that none may hold never is."""
    changed = _changed(change, function, device)
    if changed is None:
        pytest.skip(f"{function} has no {change}")
    args, kw = _call_args(function, 0, device)
    with torch.no_grad():
        LIB[function](*args, **kw)
    args, kw = changed
    for attempt in range(2):
        n = len(plan_keys)
        with torch.no_grad():
            out = LIB[function](*args, **kw)
        never = change in ("maxima omitted", "validate", "argmax", "strided ids")
        if attempt == 0 or never:
            assert len(plan_keys) > n, f"attempt {attempt}: a repeat"
        else:
            assert len(plan_keys) == n, f"attempt {attempt}: the full path again"
        scores = out[0] if change == "argmax" else out
        torch.testing.assert_close(scores, _reference(function, args).float(), rtol=0, atol=0)
    assert len(_filed(function)) == (1 if never else 2)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_a_repeated_ragged_signature_still_checks_its_arguments(function, triton_only, plan_keys, device):
    args, kw = _call_args(function, 0, device)
    with torch.no_grad():
        LIB[function](*args, **kw)
        LIB[function](*args, **kw)
    assert len(_filed(function)) == 1
    with pytest.raises(TypeError, match="normalize"):
        LIB[function](*args, **kw, normalize=1)
    with pytest.raises(ValueError, match="backward"):
        LIB[function](*args, **kw, backward="fastest")
    with pytest.raises(TypeError, match="validate"):
        LIB[function](*args, **kw, validate=0)
    with pytest.raises(TypeError, match="return_argmax"):
        LIB[function](*args, **kw, return_argmax=0)
    if function != "padded":
        with pytest.raises(TypeError, match="max_seqlen_q"):
            LIB[function](*args, **{**kw, "max_seqlen_q": float(MAX_Q)})
        with pytest.raises(TypeError, match="cu_seqlens_d"):
            LIB[function](args[0], args[1], args[2], args[3].tolist(), *args[4:], **kw)
    else:
        with pytest.raises(TypeError, match="doc_lengths"):
            LIB[function](*args[:3], args[3].float(), **kw)
        with pytest.raises(ValueError, match="documents"):
            LIB[function](args[0], args[1][0, 0], *args[2:], **kw)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_repeated_ragged_calls_of_bad_values_score_as_the_full_path(function, triton_only, plan_keys, device):
    """Unvalidated bad values (a pair id past the documents, a length past its rows) reach a repeat as they reach
    the full path: the same scores, NaN where the full path's are NaN (no kernel reads outside its inputs)."""
    args, kw = _call_args(function, 0, device)
    with torch.no_grad():
        LIB[function](*args, **kw)
    args = list(_call_args(function, 1, device)[0])
    if function == "pairs":
        args[5] = args[5].clone()
        args[5][1] = 7  # (4 documents)
    elif function == "varlen":
        args[3] = args[3].clone()
        args[3][2] = 99  # (a document longer than the rows and the maximum)
    else:
        args[3] = args[3].clone()
        args[3][0, 1] = MAX_D + 5
    n = len(plan_keys)
    with torch.no_grad():
        repeated = LIB[function](*args, **kw)
        assert len(plan_keys) == n  # (a repeat)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ops, "ragged_repeat_key", lambda *a: None)
            full = LIB[function](*args, **kw)
    assert full.isnan().any()
    torch.testing.assert_close(repeated, full, rtol=0, atol=0, equal_nan=True)


def test_ragged_calls_of_the_pytorch_path_are_never_kept(device, monkeypatch):
    from maxsim.kernels import launch_forward

    ops._triton_path()
    monkeypatch.setattr(launch_forward, "plans", {})
    with maxsim.backend("torch"), torch.no_grad():
        for function in FUNCTIONS:
            for i in range(2):
                args, kw = _call_args(function, i, device)
                want = _reference(function, args).float()
                torch.testing.assert_close(LIB[function](*args, **kw), want, rtol=0, atol=0)
    assert launch_forward.plans == {}
    assert ops._cpu_repeats == {}


# ---- batches of other token totals (v145): packed rows enter plans by their specialization class -----------------

# Lengths within the maxima; token totals 12/20, 15/23, 18/39: none a multiple of 16 (one class), each larger than
# the last (a launch given a stale count would see valid offsets past its rows and score NaN).
BATCHES = [((5, 3, 4), (7, 0, 9, 4)), ((5, 6, 4), (7, 2, 9, 5)), ((6, 6, 6), (10, 10, 9, 10))]
OTHER_CLASS = ((5, 3, 4), (8, 8, 8, 8))  # (32 document rows: divisible by 16)


def _batch(function: str, lengths: tuple, seed: int, device) -> tuple:
    lq, ld = lengths
    Q = int_grid((sum(lq), 16), seed=seed, dtype=torch.float16, device=device)
    D = int_grid((sum(ld), 16), seed=seed + 1, dtype=torch.float16, device=device)
    cu_q, cu_d = _offsets(lq, torch.int32, device), _offsets(ld, torch.int32, device)
    if function == "varlen":
        return Q, D, cu_q, cu_d
    return (Q, D, cu_q, cu_d, *(torch.tensor(p, dtype=torch.int32, device=device) for p in PAIRS[0]))


@pytest.mark.parametrize(
    "function, mode", [("pairs", "scores"), ("pairs", "step"), ("varlen", "step"), ("varlen", "scores")]
)
def test_batches_of_other_token_totals_share_the_plans(function, mode, triton_only, plan_keys, backward_plans,
                                                       device):  # fmt: skip
    """A pair list's calls, a scores-only cross product's (its documents' bytes on one side of every bound here)
    and a training step's repeat across batches whose packed token totals differ: one plan forward, one backward,
    each launch passed its call's counts; a total of another class plans anew. Every result the reference's,
    exactly."""
    from maxsim.kernels import launch_backward

    kw = dict(max_seqlen_q=MAX_Q, max_seqlen_d=MAX_D)
    for i, lengths in enumerate([*BATCHES, OTHER_CLASS]):
        args = _batch(function, lengths, seed=40 + i, device=device)
        n = len(plan_keys)
        if mode == "scores":
            with torch.no_grad():
                got = (LIB[function](*args, **kw),)
            want = (_reference(function, args),)
        else:
            Qr, Dr = (x.double().requires_grad_() for x in args[:2])
            want_s = _reference(function, (Qr, Dr, *args[2:]))
            g = int_grid(want_s.shape, seed=i, device=device)
            want = (want_s, *torch.autograd.grad(want_s, (Qr, Dr), g.double()))
            got = _train(function, args, kw, g)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=0, msg=lambda m, i=i: f"batch {i}: {m}")
        if i == 0:
            continue
        repeated = i < len(BATCHES)
        assert (len(plan_keys) == n) == repeated, f"batch {i}: {len(plan_keys) - n} plan keys built"
    if mode == "step":
        assert len(launch_backward.plans) == 2


def test_scores_only_batches_plan_anew_where_their_bytes_cross_a_bound(triton_only, plan_keys, device, monkeypatch):
    """A scores-only cross product chooses its scan by its documents' bytes in L2 sizes (here, an L2 of 1400 bytes:
    the first batch's 640 bytes of documents lie below the stream's range, the other two's 736 and 1248 bytes in it):
    the batches on one side of every bound share a plan, the one across a bound plans its own scan. Every result
    the reference's, exactly."""
    from maxsim.kernels import device_info, launch_forward

    monkeypatch.setattr(device_info, "l2_bytes", lambda device: 1400)
    kw = dict(max_seqlen_q=MAX_Q, max_seqlen_d=MAX_D)
    built = []
    for i, lengths in enumerate(BATCHES):
        args = _batch("varlen", lengths, seed=60 + i, device=device)
        n = len(plan_keys)
        with torch.no_grad():
            got = maxsim.maxsim_varlen(*args, **kw)
        torch.testing.assert_close(got.double(), _reference("varlen", args).double(), rtol=0, atol=0)
        built.append(len(plan_keys) > n)
    assert built == [True, True, False]
    plans = {id(p): p for p in launch_forward.plans.values()}.values()  # (a repeat's entry is its plan again)
    assert sorted(p.constexprs["STREAM_D"] for p in plans) == [False, True]
