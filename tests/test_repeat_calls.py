"""Repeated calls of ``maxsim.maxsim`` and ``maxsim.maxsim_pairs`` (``ops.repeat_key``): a scores-only call whose
signature an earlier call had goes straight to that call's launch plan (a training call: to its forward plan and its
backward plan, through one autograd Function), masks read where the caller holds them. It must give what the full
path gives, take the full path whenever anything the plans depend on differs, and never skip a check that the call
would fail."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import int_grid, rand_mask, spy, triton_usable

import maxsim
from maxsim import ops
from maxsim.reference import maxsim as maxsim_reference
from maxsim.reference import maxsim_pairs as pairs_reference


def _inputs(device, nq=3, nd=4, lq=5, ld=9, dim=16, dtype=torch.float16, seed=1):
    # (small integers: every path sums them exactly, so results compare bit for bit)
    Q = int_grid((nq, lq, dim), seed=seed, dtype=dtype, device=device)
    D = int_grid((nd, ld, dim), seed=seed + 1, dtype=dtype, device=device)
    return Q, D


def test_a_repeat_call_skips_to_the_plan_and_scores_the_same(triton_only, plan_keys, device):
    Q, D = _inputs(device)
    first = maxsim.maxsim(Q, D)
    assert len(plan_keys) == 2  # (the forward's lookup, then filing it for repeats)
    Q2, D2 = _inputs(device, seed=5)  # (other tensors, other values, the same signature)
    again = maxsim.maxsim(Q2, D2)
    assert len(plan_keys) == 2
    torch.testing.assert_close(first, maxsim_reference(Q, D).float(), rtol=0, atol=0)
    torch.testing.assert_close(again, maxsim_reference(Q2, D2).float(), rtol=0, atol=0)


@pytest.mark.parametrize("shape", ["cross", "candidates", "one query", "one document", "one of each"])
def test_repeats_of_every_dense_shape_score_as_the_reference(shape, triton_only, plan_keys, device):
    """The repeat's result comes in the caller's shape (the plan's), squeezed axes included."""
    for seed in (1, 5):
        Q, D = _inputs(device, seed=seed)
        if shape == "candidates":
            D = torch.stack([D, D.flip(0), D * 2])  # [Nq = 3, K = 4, Ld, dim]
        Q = Q[0] if shape in ("one query", "one of each") else Q
        D = D[1] if shape in ("one document", "one of each") else D
        out = maxsim.maxsim(Q, D)
        want = maxsim_reference(Q, D).float()
        assert out.shape == want.shape
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert len(plan_keys) == 2  # (the first call's lookup and filing; the second call is a repeat)


def test_a_repeated_pair_call_skips_to_the_plan_and_scores_the_same(triton_only, plan_keys, device):
    Q, D = _inputs(device, nd=3)
    first = maxsim.maxsim_pairs(Q, D)
    assert len(plan_keys) == 2
    Q2, D2 = _inputs(device, nd=3, seed=5)
    again = maxsim.maxsim_pairs(Q2, D2)
    assert len(plan_keys) == 2
    torch.testing.assert_close(first, pairs_reference(Q, D).float(), rtol=0, atol=0)
    torch.testing.assert_close(again, pairs_reference(Q2, D2).float(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_pairs_and_cross_products_of_one_shape_never_share_a_repeat(backend, device):
    """``maxsim(Q [B, Lq, dim], D [B, Ld, dim])`` is a ``[B, B]`` cross product, ``maxsim_pairs`` of the same tensors
    ``B`` pairs: their signatures differ by the function, so neither repeats the other's call."""
    if backend == "triton" and not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    if backend == "triton":
        ops._triton_path()  # (before a first Triton call nothing is filed)
    Q, D = _inputs(device, nd=3)
    with maxsim.backend(backend), torch.no_grad():
        for _ in range(2):
            cross, pairs = maxsim.maxsim(Q, D), maxsim.maxsim_pairs(Q, D)
            torch.testing.assert_close(cross, maxsim_reference(Q, D).float(), rtol=0, atol=0)
            torch.testing.assert_close(pairs, pairs_reference(Q, D).float(), rtol=0, atol=0)


def _changed_call(change: str, Q: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``Q`` and the keyword arguments of a call that differs from a plain one by ``change`` (the changes that are
    options, a gradient or a squeezed axis; others leave both as they are)."""
    kw: dict = {}
    if change == "normalize":
        kw["normalize"] = True
    elif change == "masks":
        kw["d_mask"] = torch.ones(D.shape[:-1], dtype=torch.bool, device=D.device)
    elif change == "argmax":
        kw["return_argmax"] = True
    elif change == "grad":
        Q = Q.clone().requires_grad_()
    elif change == "squeezed":
        Q = Q[0]
    return Q, kw


@pytest.mark.parametrize(
    "change",
    ["shape", "strides", "dtype", "normalize", "backend", "masks", "argmax", "grad", "squeezed"],
)
def test_anything_the_plan_depends_on_takes_the_full_path(change, triton_only, plan_keys, device):
    Q, D = _inputs(device)
    maxsim.maxsim(Q, D)
    n = len(plan_keys)
    if change == "shape":
        Q, D = _inputs(device, nd=5)
    elif change == "strides":
        D = _inputs(device, nd=8)[1][::2]
    elif change == "dtype":
        Q, D = _inputs(device, dtype=torch.float32)
    Q, kw = _changed_call(change, Q, D)
    if change == "backend":
        with maxsim.backend("torch"):
            out = maxsim.maxsim(Q, D)
        assert len(plan_keys) == n  # (the PyTorch path: no plan at all)
    else:
        out = maxsim.maxsim(Q, D, **kw)
        assert len(plan_keys) > n
    want = maxsim_reference(Q.detach(), D, normalize=kw.get("normalize", False)).float()
    scores = out[0] if change == "argmax" else out
    tol = 2e-3 if change == "normalize" else 0  # (normalized fp16 tokens are rounded; integers are not)
    torch.testing.assert_close(scores.detach(), want, rtol=tol, atol=tol)


def test_a_repeated_signature_still_checks_the_options(triton_only, plan_keys, device):
    Q, D = _inputs(device)
    maxsim.maxsim(Q, D)
    with pytest.raises(TypeError, match="normalize"):
        maxsim.maxsim(Q, D, normalize=1)
    with pytest.raises(ValueError, match="backward"):
        maxsim.maxsim(Q, D, backward="fastest")
    with pytest.raises(TypeError, match="return_argmax"):
        maxsim.maxsim(Q, D, return_argmax=0)


def test_repeat_entries_go_with_the_plans(triton_only, plan_keys, device):
    """Whatever clears the plans (a change of the launch settings must) clears the repeat entries with them."""
    from maxsim.kernels import launch_forward

    Q, D = _inputs(device)
    maxsim.maxsim(Q, D)
    assert ops.repeat_key(Q, D, False, "auto") in launch_forward.plans
    launch_forward.plans.clear()
    n = len(plan_keys)
    maxsim.maxsim(Q, D)
    assert len(plan_keys) == n + 2


# ---- the CPU: the PyTorch path's one-block forward, its decisions taken once ----------------------------------------


@pytest.fixture
def full_path(monkeypatch):
    """Counts the calls that take the full path (a repeat skips the checks)."""
    from maxsim import validate

    return spy(monkeypatch, validate, "call")


def _cpu_inputs(shape: str, dtype=torch.float32, seed=1, nq=3, lq=5, ld=9, dim=16):
    Q, D = _inputs("cpu", nq=nq, lq=lq, ld=ld, dim=dim, dtype=dtype, seed=seed)
    if shape == "candidates":
        D = torch.stack([D.roll(i, 0) for i in range(nq)])  # [Nq, K = 4, Ld, dim]
    Q = Q[0] if shape in ("one query", "one of each") else Q
    D = D[1] if shape in ("one document", "one of each") else D
    return Q, D


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "sizes",
    [dict(), dict(nq=4, lq=8, ld=40, dim=64), dict(lq=8, ld=120, dim=64), dict(nq=2, lq=24, ld=40, dim=64)],
    ids=["small", "4x8", "3x8", "2x24"],
)
@pytest.mark.parametrize("shape", ["cross", "candidates", "one query", "one document", "one of each"])
def test_cpu_repeats_score_as_the_full_path(shape, sizes, dtype, full_path):
    """A repeated signature skips the full path and scores bit for bit as it (and, on integer data, as the
    reference), in the caller's shape, through each of :func:`maxsim.cpu.plain_scores`'s functions (which sizes
    take which: ``test_cpu_plain_scores_decisions``)."""
    Q, D = _cpu_inputs(shape, dtype, **sizes)
    with torch.no_grad():
        first = maxsim.maxsim(Q, D)
        assert len(full_path) == 1
        Q2, D2 = _cpu_inputs(shape, dtype, seed=5, **sizes)  # (other values, the same signature)
        again = maxsim.maxsim(Q2, D2)
        assert len(full_path) == 1, "the repeat took the full path"
        ops._cpu_repeats.clear()
        full = maxsim.maxsim(Q2, D2)
        assert len(full_path) == 2
    assert again.shape == full.shape and again.dtype == full.dtype and again.is_contiguous()
    assert torch.equal(again, full)
    # (integer tokens: exact in fp32 sums; the reference in float64, as bf16 sums would round)
    torch.testing.assert_close(first.double(), maxsim_reference(Q.double(), D.double()), rtol=0, atol=0)
    torch.testing.assert_close(again.double(), maxsim_reference(Q2.double(), D2.double()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("sizes", [dict(), dict(nq=16, lq=8, ld=41, dim=96), dict(nq=2, lq=32, ld=40, dim=64)])
def test_cpu_pair_repeats_score_as_the_full_path(sizes, dtype, full_path):
    """``maxsim_pairs``: a repeated signature skips the full path and scores bit for bit as it, ``[B]``."""
    Q, D = _inputs("cpu", nd=sizes.get("nq", 3), dtype=dtype, **sizes)
    with torch.no_grad():
        first = maxsim.maxsim_pairs(Q, D)
        Q2, D2 = _inputs("cpu", nd=sizes.get("nq", 3), dtype=dtype, seed=5, **sizes)
        again = maxsim.maxsim_pairs(Q2, D2)
        assert len(full_path) == 1, "the repeat took the full path"
        ops._cpu_repeats.clear()
        full = maxsim.maxsim_pairs(Q2, D2)
    assert again.shape == full.shape == (Q.shape[0],) and again.dtype == full.dtype and torch.equal(again, full)
    torch.testing.assert_close(first.double(), pairs_reference(Q.double(), D.double()), rtol=0, atol=0)
    torch.testing.assert_close(again.double(), pairs_reference(Q2.double(), D2.double()), rtol=0, atol=0)


def test_cpu_repeats_propagate_nan():
    Q, D = _cpu_inputs("cross")
    with torch.no_grad():
        maxsim.maxsim(Q, D)
        D2 = D.clone()
        D2[1, 3, 0] = float("nan")
        D2[2, 0, :] = float("-inf")
        again = maxsim.maxsim(Q, D2)
        ops._cpu_repeats.clear()
        full = maxsim.maxsim(Q, D2)
    assert torch.equal(again.isnan(), full.isnan()) and torch.equal(again.nan_to_num(), full.nan_to_num())
    assert bool(again[:, 1].isnan().all()) and not bool(again[:, 0].isnan().any())


@pytest.mark.parametrize(
    "change",
    ["shape", "strides", "dtype", "normalize", "masks", "argmax", "grad", "squeezed", "settings", "blocks"],
)
def test_cpu_anything_the_plan_depends_on_takes_the_full_path(change, full_path, monkeypatch):
    from maxsim import cpu

    Q, D = _cpu_inputs("cross")
    if change == "blocks":  # (a problem of several blocks is never kept)
        monkeypatch.setattr(cpu, "BLOCK_BYTES", 4 * 9 * (5 + 16) * 4)
    with torch.no_grad():
        maxsim.maxsim(Q, D)
    if change == "shape":
        Q, D = _cpu_inputs("cross", ld=10)
    elif change == "strides":
        D = torch.cat([D, D]).clone()[::2]
    elif change == "dtype":
        Q, D = Q.double(), D.double()
    elif change == "settings":
        monkeypatch.setattr(cpu, "DOCUMENTS_FIRST_MIN_SIMS", 0)
    Q, kw = _changed_call(change, Q, D)
    for _ in range(2):
        with torch.no_grad() if change != "grad" else torch.enable_grad():
            out = maxsim.maxsim(Q, D, **kw)
    # (never kept: both full; a training call is kept as a step, a repeat of its own)
    repeats = 1 if change in ("normalize", "masks", "argmax", "blocks") else 0
    assert len(full_path) == 2 + repeats, f"{change}: {len(full_path)} full-path calls"
    want = maxsim_reference(Q.detach(), D, normalize=kw.get("normalize", False)).float()
    scores = out[0] if change == "argmax" else out
    tol = 1e-6 if change == "normalize" else 0
    torch.testing.assert_close(scores.detach().to(want.dtype), want, rtol=tol, atol=tol)


def _int_grad(shape):
    """An upstream gradient of small integers (never all ones): every sum of the step exact."""
    return torch.randint(-3, 4, tuple(shape), generator=torch.Generator().manual_seed(2)).float()


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", ["cross", "candidates", "one query", "one document", "one of each", "pairs"])
def test_cpu_training_repeats_step_as_the_full_path(shape, dtype, normalize, full_path):
    """A repeated training signature of the PyTorch path (:class:`maxsim.ops.CpuStep`) skips the full path and gives
    its scores and gradients bit for bit (on integer tokens, the reference's), in the caller's shapes; the upstream
    gradient both as a tensor and as ``scores.sum()``'s expanded one."""
    fn = maxsim.maxsim_pairs if shape == "pairs" else maxsim.maxsim
    Q, D = _cpu_inputs("cross" if shape == "pairs" else shape, dtype)
    Q2, D2 = _cpu_inputs("cross" if shape == "pairs" else shape, dtype, seed=5)
    if shape == "pairs":  # (as many documents as queries)
        D, D2 = D[:3], D2[:3]
    g = _int_grad(fn(Q, D).shape)
    ops._cpu_repeats.clear()  # (that inference call's)
    first = _train(fn, Q, D, g, normalize=normalize)
    n = len(full_path)
    assert [type(v) for v in ops._cpu_repeats.values()] == [ops.CpuStep]
    again = [_train(fn, Q2, D2, g, normalize=normalize), _train(fn, Q2, D2, None, normalize=normalize)]
    assert len(full_path) == n, "the repeat took the full path"
    ops._cpu_repeats.clear()
    full = [_train(fn, Q2, D2, g, normalize=normalize), _train(fn, Q2, D2, None, normalize=normalize)]
    for a, b in zip(again, full, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
    if not normalize:  # (integer tokens: exact sums)
        ref = pairs_reference if shape == "pairs" else maxsim_reference
        _assert_step_equal(first, _reference_train(ref, Q, D, g))
        _assert_step_equal(again[0], _reference_train(ref, Q2, D2, g))


def test_cpu_training_repeats_of_tokens_that_are_not_finite():
    """A repeated step whose tokens hold NaN or inf takes the link list in its backward, as the full path does."""
    Q, D = _cpu_inputs("cross")
    g = _int_grad((3, 4))
    _train(maxsim.maxsim, Q, D, g)
    D2 = D.clone()
    D2[1, 3, 0] = float("nan")
    D2[2, 0, :] = float("inf")
    again = _train(maxsim.maxsim, Q, D2, g)
    ops._cpu_repeats.clear()
    full = _train(maxsim.maxsim, Q, D2, g)
    for x, y in zip(again, full, strict=True):
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())


@pytest.mark.parametrize("change", ["settings", "too large", "masks"])
def test_cpu_training_calls_that_the_step_does_not_take_are_not_kept(change, full_path, monkeypatch):
    """Steps the full path takes another way (its step's bound, a mask) are never kept; a change of the setting the
    choice reads is a new signature."""
    from maxsim import cpu

    Q, D = _cpu_inputs("cross")
    g = _int_grad((3, 4))
    kw = {}
    if change == "settings":
        _train(maxsim.maxsim, Q, D, g)
        monkeypatch.setattr(cpu, "DENSE_BACKWARD_MAX", 0)
        monkeypatch.setattr(cpu, "STEP_MAX_LD", 0)
    elif change == "too large":
        monkeypatch.setattr(cpu, "DENSE_BACKWARD_MAX", 0)
        monkeypatch.setattr(cpu, "STEP_MAX_LD", 0)
    else:
        kw = dict(zip(("q_mask", "d_mask"), _masks(Q, D, 3), strict=True))
    n = len(full_path)
    for _ in range(2):
        got = _train(maxsim.maxsim, Q, D, g, **kw)
    assert len(full_path) == n + 2
    assert all(not isinstance(v, ops.CpuStep) for k, v in ops._cpu_repeats.items() if k[-1] == cpu.step_settings())
    _assert_step_equal(got, _reference_train(functools.partial(maxsim_reference, **kw), Q, D, g))


def test_cpu_repeats_are_bounded(monkeypatch):
    monkeypatch.setattr(ops, "CPU_REPEATS_MAX", 2)
    with torch.no_grad():
        for ld in (7, 8, 9):
            maxsim.maxsim(*_cpu_inputs("cross", ld=ld))
    assert len(ops._cpu_repeats) == 1  # (the third signature found the store full and started it over)


@pytest.mark.parametrize(
    "sizes, name",
    [((3, 5, 16, 1, 4, 9), "queries_first"), ((4, 8, 64, 1, 4, 40), "documents_first_shared"),
     ((3, 8, 64, 1, 4, 120), "documents_first"), ((2, 24, 64, 2, 4, 40), "documents_first"),
     ((2, 32, 64, 2, 4, 40), "documents_first"), ((2, 8, 64, 2, 4, 40), "queries_first")],
)  # fmt: skip
def test_cpu_plain_scores_decisions(sizes, name):
    """Which function :func:`maxsim.cpu.plain_scores` picks (q, Lq, dim, b, k, Ld): documents first for 32 query rows
    a GEMM (shared documents: without padding or a slice), padded from 23 at 64 dims, else queries first; each scores
    as the reference."""
    from maxsim import cpu

    q, Lq, dim, b, k, Ld = sizes
    fn = cpu.plain_scores(q, Lq, dim, b, k, Ld, torch.float32, torch.float32)
    assert fn.__name__ == name
    Q = int_grid((q, Lq, dim), seed=3)
    D = int_grid((b, k, Ld, dim), seed=4)
    torch.testing.assert_close(fn(Q, D), maxsim_reference(Q, D if b > 1 else D[0]), rtol=0, atol=0)


# ---- repeated training calls of the Triton path: one autograd Function over the kept plans (v118) ----------------


def _train(fn, Q, D, g=None, **kw):
    """Scores and the gradients of ``(scores * g).sum()`` (``g`` None: of ``scores.sum()``, an expanded upstream
    gradient) through ``fn``, on fresh leaves."""
    Qg, Dg = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
    s = fn(Qg, Dg, **kw)
    dQ, dD = torch.autograd.grad(s.sum(), (Qg, Dg)) if g is None else torch.autograd.grad(s, (Qg, Dg), g)
    return s.detach(), dQ, dD


def _reference_train(fn, Q, D, g, normalize=False):
    """:func:`_train` of the reference in float64."""
    Qr, Dr = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    s = fn(Qr, Dr, normalize=normalize)
    dQ, dD = torch.autograd.grad(s, (Qr, Dr), g.double())
    return s, dQ, dD


def _assert_step_equal(got, want, tol=0.0):
    for name, a, b in zip(("scores", "dQ", "dD"), got, want, strict=True):
        assert a.shape == b.shape, f"{name}: {tuple(a.shape)} against {tuple(b.shape)}"
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def test_a_repeated_training_call_skips_to_the_plans(triton_only, plan_keys, backward_plans, device):
    """The second step of a signature builds no forward key, the third no backward key either; every step is the
    reference's, exactly (integer tokens)."""
    for i, seed in enumerate((1, 5, 9)):
        Q, D = _inputs(device, seed=seed)
        g = int_grid((3, 4), seed=seed + 2, device=device)
        got = _train(maxsim.maxsim, Q, D, g)
        assert len(plan_keys) == 2, f"step {i}: the forward built its key"
        assert len(backward_plans) == min(i + 1, 2), f"step {i}: backward keys {len(backward_plans)}"
        _assert_step_equal(got, _reference_train(maxsim_reference, Q, D, g))


@pytest.mark.parametrize("shape", ["cross", "candidates", "one query", "one document", "one of each", "pairs"])
def test_repeated_steps_of_every_dense_shape_train_as_the_reference(shape, triton_only, plan_keys, device):
    """In the caller's shapes (squeezed axes included), through the views the first call kept."""
    fn, ref = (maxsim.maxsim_pairs, pairs_reference) if shape == "pairs" else (maxsim.maxsim, maxsim_reference)
    for seed in (1, 5):
        Q, D = _inputs(device, nd=3 if shape == "pairs" else 4, seed=seed)
        if shape == "candidates":
            D = torch.stack([D, D.flip(0), D * 2])  # [Nq = 3, K = 4, Ld, dim]
        Q = Q[0] if shape in ("one query", "one of each") else Q
        D = D[1] if shape in ("one document", "one of each") else D
        want = _reference_train(ref, Q, D, int_grid(ref(Q.double(), D.double()).shape, seed=seed, device=device))
        g = int_grid(want[0].shape, seed=seed, device=device)
        _assert_step_equal(_train(fn, Q, D, g), want)
    assert len(plan_keys) == 2  # (the first call's lookup and filing; the second call is a repeat)


def test_a_repeated_step_takes_any_upstream_gradient(triton_only, plan_keys, backward_plans, device):
    """A contiguous, an expanded (``scores.sum()``) and a transposed upstream gradient: each its own backward plan,
    filed once, each as the reference."""
    from maxsim.kernels import launch_backward, launch_forward

    Q, D = _inputs(device)
    g = int_grid((3, 4), seed=3, device=device)
    layouts = (g, None, g.t().contiguous().t())  # (contiguous, expanded, transposed)
    for _ in range(2):
        for gl in layouts:
            want = _reference_train(maxsim_reference, Q, D, torch.ones(3, 4, device=device) if gl is None else gl)
            _assert_step_equal(_train(maxsim.maxsim, Q, D, gl), want)
    (step,) = [plan for key, plan in launch_forward.plans.items() if key[0] == "step"]
    assert sorted(step.backward_keys) == [(0, 0), (1, 3), (4, 1)]
    assert len(launch_backward.plans) == 3  # (each plan once: the step holds its key)


@pytest.mark.parametrize("change", ["shape", "dtype", "normalize", "deterministic", "auto deterministic"])
def test_a_step_that_differs_takes_the_full_path(change, triton_only, plan_keys, device):
    from maxsim.kernels import launch_forward

    Q, D = _inputs(device)
    g = int_grid((3, 4), seed=3, device=device)
    _train(maxsim.maxsim, Q, D, g)
    n = len(plan_keys)
    kw: dict = {}
    if change == "shape":
        Q, D = _inputs(device, nd=5)
        g = int_grid((3, 5), seed=3, device=device)
    elif change == "dtype":
        Q, D = _inputs(device, dtype=torch.float32)
    elif change == "normalize":
        kw["normalize"] = True
    elif change == "deterministic":
        kw["backward"] = "deterministic"
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        if change == "auto deterministic":
            torch.use_deterministic_algorithms(True)
        for _ in range(2):
            got = _train(maxsim.maxsim, Q, D, g, **kw)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert len(plan_keys) == n + 2, f"{change}: {len(plan_keys) - n} forward keys for two steps"
    steps = [plan for key, plan in launch_forward.plans.items() if key[0] == "step"]
    assert len(steps) == 2
    assert steps[1].deterministic == change.endswith("deterministic")
    tol = 1e-3 if change == "normalize" else 0.0  # (normalized fp16 tokens are rounded; integers are not)
    want = _reference_train(maxsim_reference, Q, D, g, normalize=kw.get("normalize", False))
    _assert_step_equal(got, want, tol)


def test_a_repeated_normalized_step_keeps_the_inverse_norms(triton_only, device):
    Q = torch.randn(3, 5, 16, device=device)
    D = torch.randn(4, 9, 16, device=device)
    g = torch.randn(3, 4, device=device)
    for _ in range(2):
        got = _train(maxsim.maxsim, Q, D, g, normalize=True)
    _assert_step_equal(got, _reference_train(maxsim_reference, Q, D, g, normalize=True), 1e-4)


@pytest.mark.parametrize("needs", ["Q", "D"])
def test_a_repeated_step_of_one_input_that_requires_grad(needs, triton_only, plan_keys, device):
    Q, D = _inputs(device)
    g = int_grid((3, 4), seed=3, device=device)
    want = _reference_train(maxsim_reference, Q, D, g)
    for _ in range(2):
        x = (Q if needs == "Q" else D).clone().requires_grad_()
        s = maxsim.maxsim(x, D) if needs == "Q" else maxsim.maxsim(Q, x)
        (grad,) = torch.autograd.grad(s, x, g)
    assert len(plan_keys) == 2
    torch.testing.assert_close(grad.double(), want[1 if needs == "Q" else 2], rtol=0, atol=0)


def test_repeated_steps_in_one_graph(triton_only, plan_keys, device):
    """Two repeated calls in one loss, its backward run twice (retain_graph): each call keeps its own argmax."""
    Q, D = _inputs(device)
    Q2, D2 = _inputs(device, seed=5)
    g = int_grid((3, 4), seed=3, device=device)
    _train(maxsim.maxsim, Q, D, g)
    leaves = [x.clone().requires_grad_() for x in (Q, D, Q2, D2)]
    loss = (maxsim.maxsim(leaves[0], leaves[1]) * g).sum() + (maxsim.maxsim(leaves[2], leaves[3]) * g).sum()
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    assert len(plan_keys) == 2
    want = _reference_train(maxsim_reference, Q, D, g)[1:] + _reference_train(maxsim_reference, Q2, D2, g)[1:]
    for a, b, w in zip(first, second, want, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), w, rtol=0, atol=0)


def _leftover_wrapper(x):
    """``x`` as a torch.func wrapper that outlived its transform (a closure kept it): it requires grad, and has no
    storage of its own (the plain tensor under it has)."""
    kept = []

    def f(t):
        kept.append(t)
        return t.sum()

    torch.func.grad(f)(x.detach().clone().requires_grad_())
    assert torch._C._functorch.is_functorch_wrapped_tensor(kept[0])
    return kept[0]


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_a_repeated_step_of_a_leftover_torch_func_wrapper_trains_as_the_plain_tensor(path, plan_keys, device):
    """A repeated step launches through the C ``apply`` (``ops._direct_apply``), which does not unwrap tensors left
    over from a finished transform: those take ``Function.apply``, which does (the kernels cannot read a wrapper)."""
    if path == "triton" and not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    if path == "cpu" and torch.device(device).type != "cpu":
        pytest.skip("the PyTorch path's repeated step is a CPU one")
    Q, D = _inputs(device, dtype=torch.float32)
    g = int_grid((3, 4), seed=3, device=device)
    with maxsim.backend(path if path == "triton" else "torch"):
        for _ in range(2):
            _train(maxsim.maxsim, Q, D, g)  # (the signature filed, then repeated)
        W, Dg = _leftover_wrapper(Q), D.clone().requires_grad_()
        s = maxsim.maxsim(W, Dg)
        # (Function.apply records the unwrapped tensor as the input, as for any autograd.Function)
        dW, dD = torch.autograd.grad(s, (torch._C._functorch.get_unwrapped(W), Dg), g)
    _assert_step_equal((s.detach(), dW, dD), _reference_train(maxsim_reference, Q, D, g))


def test_step_entries_go_with_the_plans(triton_only, plan_keys, backward_plans, device):
    """Clearing the forward plans clears the step entries; clearing the backward plans, their backward plans."""
    from maxsim.kernels import launch_backward, launch_forward

    Q, D = _inputs(device)
    g = int_grid((3, 4), seed=3, device=device)
    for _ in range(2):
        _train(maxsim.maxsim, Q, D, g)
    assert (len(plan_keys), len(backward_plans)) == (2, 2)
    launch_backward.plans.clear()
    _train(maxsim.maxsim, Q, D, g)
    assert (len(plan_keys), len(backward_plans)) == (2, 3)
    launch_forward.plans.clear()
    got = _train(maxsim.maxsim, Q, D, g)
    assert len(plan_keys) == 4
    _assert_step_equal(got, _reference_train(maxsim_reference, Q, D, g))


def test_no_grad_calls_of_leaves_that_require_grad_repeat_as_inference(triton_only, device):
    Q, D = (x.requires_grad_() for x in _inputs(device))
    with torch.no_grad():
        maxsim.maxsim(Q, D)
        assert ops.repeat_key(Q, D, False, "auto")[0] == "repeat"
    assert ops.repeat_key(Q, D, False, "auto")[0] == "step"
    with maxsim.backend("torch"):
        assert ops.repeat_key(Q.cpu(), D.cpu(), False, "auto")[0] == "step"  # (the PyTorch path's: CpuStep)


# ---- masks: their shapes, strides, dtypes and devices in the signature, their values read by the launch -------------


def _masks(Q, D, seed):
    """A query mask and a document mask with holes (every query and document keeps a token: the reference's
    fully masked rows are tested elsewhere)."""
    q_mask = rand_mask(Q.shape[:-1], seed=seed, device=Q.device)
    d_mask = rand_mask(D.shape[:-1], seed=seed + 1, device=D.device)
    q_mask[..., 0] = True
    d_mask[..., -1] = True
    return q_mask, d_mask


@pytest.mark.parametrize("shape", ["cross", "candidates", "one query", "one document", "pairs"])
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_masked_calls_repeat_with_their_own_mask_values(shape, mode, triton_only, plan_keys, device):
    """The second call of a masked signature skips to the plan with other tokens and other mask values, and is the
    reference's (exactly, integer tokens) in both modes."""
    fn, ref = (maxsim.maxsim_pairs, pairs_reference) if shape == "pairs" else (maxsim.maxsim, maxsim_reference)
    for seed in (1, 5):
        Q, D = _inputs(device, nd=3 if shape == "pairs" else 4, seed=seed)
        if shape == "candidates":
            D = torch.stack([D, D.flip(0), D * 2])
        Q = Q[0] if shape == "one query" else Q
        D = D[1] if shape == "one document" else D
        q_mask, d_mask = _masks(Q, D, seed)
        kw = dict(q_mask=q_mask, d_mask=d_mask)
        g = int_grid(ref(Q.double(), D.double()).shape, seed=seed, device=device)
        want = _reference_train(functools.partial(ref, **kw), Q, D, g)
        if mode == "infer":
            with torch.no_grad():
                got = fn(Q, D, **kw)
            torch.testing.assert_close(got.double(), want[0], rtol=0, atol=0)
        else:
            _assert_step_equal(_train(functools.partial(fn, **kw), Q, D, g), want)
    assert len(plan_keys) == 2  # (the first call's lookup and filing only)


@pytest.mark.parametrize("change", ["strides", "only d_mask", "dtype"])
def test_a_mask_that_differs_takes_the_full_path(change, triton_only, plan_keys, device):
    Q, D = _inputs(device)
    q_mask, d_mask = _masks(Q, D, 3)
    with torch.no_grad():
        maxsim.maxsim(Q, D, q_mask=q_mask, d_mask=d_mask)
        n = len(plan_keys)
        if change == "strides":  # (the same values, every other column of a wider mask)
            wide = torch.zeros(4, 18, dtype=torch.bool, device=device)
            wide[:, ::2] = d_mask
            d_mask = wide[:, ::2]
        elif change == "only d_mask":
            q_mask = None
        if change == "dtype":
            with pytest.raises((TypeError, ValueError), match="d_mask"):
                maxsim.maxsim(Q, D, q_mask=q_mask, d_mask=d_mask.to(torch.uint8))
            return
        got = maxsim.maxsim(Q, D, q_mask=q_mask, d_mask=d_mask)
    assert len(plan_keys) > n
    torch.testing.assert_close(got.double(), maxsim_reference(Q.double(), D.double(), q_mask, d_mask), rtol=0, atol=0)


def test_masked_cpu_calls_are_never_repeated():
    Q, D = _cpu_inputs("cross")
    q_mask, d_mask = _masks(Q, D, 3)
    with torch.no_grad():
        assert ops.repeat_key(Q, D, False, "auto", "maxsim", q_mask, d_mask) is None
        for _ in range(2):
            got = maxsim.maxsim(Q, D, q_mask=q_mask, d_mask=d_mask)
    assert not ops._cpu_repeats
    torch.testing.assert_close(got.double(), maxsim_reference(Q.double(), D.double(), q_mask, d_mask), rtol=0, atol=0)
