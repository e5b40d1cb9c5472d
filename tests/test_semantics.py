"""The semantics of design.md §1 on every backend: masks, fully masked rows, NaN, ties, empty batches,
backward modes, normalization, and the backend switch."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    INTERPRET,
    Inputs,
    assert_matches_reference,
    assert_same_nan,
    assert_scores_close,
    call_lib,
    check_parity,
    int_grid,
    keep_under_interpreter,
    lib_forward_backward,
    make_inputs,
    randn,
    ref_forward_backward,
    score_magnitude,
    seed_of,
    shapes_of,
    similarities,
    triton_usable,
    upstream_grad,
)

import maxsim

LAYOUT_ARGS = {"cross": (2, 3), "candidates": (2, 2), "pairs": (3, 0)}  # (n, m) per layout
DT2 = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _inputs(layout, lq, ld, dim, *, dtype=torch.float32, device="cpu", masks=None, seed=0, exact=False):
    n, m = LAYOUT_ARGS[layout]
    return make_inputs(layout, n, m, lq, ld, dim, dtype=dtype, device=device, masks=masks, seed=seed, exact=exact)


# ----------------------------------------------------------------------------------------------------
# masks


@pytest.mark.parametrize("dtype", DT2)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_fully_masked_rows(layout, normalize, dtype, backend, device):
    """A fully masked query or document contributes exactly 0 and gets exactly zero gradient (so do masked
    tokens)."""
    subset = {("cross", True, torch.bfloat16), ("candidates", False, torch.float32), ("pairs", True, torch.float32)}
    keep_under_interpreter((layout, normalize, dtype) in subset, backend, device)
    inp = _inputs(layout, 7, 9, 16, dtype=dtype, device=device, masks="empty", seed=seed_of("fm", layout))
    s, dQ, dD = check_parity(inp, normalize=normalize, seed=seed_of("fm", layout, normalize))
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    assert torch.equal(s[0], torch.zeros_like(s[0])), f"fully masked query 0 scored {s[0]}"
    if layout == "cross":
        assert torch.equal(s[:, -1], torch.zeros_like(s[:, -1])), f"fully masked document scored {s[:, -1]}"
    elif layout == "candidates":
        assert s[-1, -1] == zero
    else:
        assert s[-1] == zero
    # masked query tokens and masked document tokens get exactly zero gradient
    assert bool((dQ[~inp.q_mask] == 0).all()), "masked query tokens got a gradient"
    assert bool((dD[~inp.d_mask] == 0).all()), "masked document tokens got a gradient"
    # a query token that sees only a fully masked document in pairs gets no gradient either
    if layout == "pairs":
        assert bool((dQ[-1] == 0).all())


@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_everything_masked(layout, backend, device):
    keep_under_interpreter(layout == "cross", backend, device)
    inp = _inputs(layout, 5, 6, 8, device=device, masks="holes", seed=1)
    for qm, dm in (
        (torch.zeros_like(inp.q_mask), inp.d_mask),
        (inp.q_mask, torch.zeros_like(inp.d_mask)),
    ):
        case = inp.with_(q_mask=qm, d_mask=dm)
        s, dQ, dD, _ = lib_forward_backward(case)
        assert torch.equal(s, torch.zeros_like(s))
        assert torch.equal(dQ, torch.zeros_like(dQ))
        assert torch.equal(dD, torch.zeros_like(dD))


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_masked_tokens_are_ignored(layout, poison, normalize, backend, device):
    """NaN / inf in masked query or document tokens change neither the scores nor the gradients."""
    subset = {("cross", "nan", False), ("cross", "inf", True), ("candidates", "nan", True), ("pairs", "inf", False)}
    keep_under_interpreter((layout, poison, normalize) in subset, backend, device)
    clean = _inputs(layout, 7, 40, 16, device=device, masks="holes", seed=seed_of("poison", layout))
    value = float("nan") if poison == "nan" else float("inf")
    Q = clean.Q.clone()
    D = clean.D.clone()
    Q[~clean.q_mask] = value
    D[~clean.d_mask] = value
    dirty = clean.with_(Q=Q, D=D)
    s, dQ, dD, grad = lib_forward_backward(dirty, normalize=normalize)
    assert_matches_reference(clean, s, dQ, dD, grad, normalize=normalize)
    assert bool((dQ[~clean.q_mask] == 0).all()), "masked (poisoned) query tokens got a gradient"
    assert bool((dD[~clean.d_mask] == 0).all()), "masked (poisoned) document tokens got a gradient"


# ----------------------------------------------------------------------------------------------------
# NaN


NAN_CASES = [  # (where, dtype)
    ("doc-first", torch.float32),
    ("doc-first", torch.bfloat16),
    ("doc-middle", torch.float32),
    ("doc-last", torch.bfloat16),
    ("query", torch.float32),
    ("query", torch.bfloat16),
]


@pytest.mark.parametrize(("where", "dtype"), NAN_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_nan_in_valid_token_propagates(layout, where, dtype, backend, device):
    """A NaN in a valid token makes the pair's score NaN (never skipped, wherever it sits in the document)."""
    keep_under_interpreter((NAN_CASES.index((where, dtype)) + (layout == "cross")) % 2 == 0, backend, device)
    ld = 200  # several document tiles: the NaN must survive later tiles with larger similarities
    inp = _inputs(layout, 5, ld, 16, dtype=dtype, device=device, masks="empty", seed=seed_of("nan", layout))
    Q, D = inp.Q.clone(), inp.D.clone()
    qm, dm = inp.q_mask.clone(), inp.d_mask.clone()
    if where == "query":
        Q[1, 2, 3] = float("nan")
        qm[1, 2] = True
    else:
        pos = {"doc-first": 0, "doc-middle": 100, "doc-last": ld - 1}[where]
        idx = (1, pos) if layout == "cross" else (1, 0, pos)
        D[idx + (5,)] = float("nan")
        dm[idx] = True
    case = inp.with_(Q=Q, D=D, q_mask=qm, d_mask=dm)
    s = maxsim.maxsim(case.Q, case.D, case.q_mask, case.d_mask)
    expected = maxsim.reference.maxsim(case.Q.double(), case.D.double(), case.q_mask, case.d_mask)
    assert bool(torch.isnan(expected).any())  # the test poisons a pair that counts
    assert_same_nan(s, expected, "scores")
    keep = ~torch.isnan(expected)
    mag = score_magnitude(case, False, expected.shape)
    assert_scores_close(s[keep], expected[keep], dtype=dtype, magnitude=mag[keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_nan_rows_argmax_is_a_valid_token(layout, dtype, backend, device):
    """A NaN in one valid document token: every live query row of that pair has a NaN max, and its argmax is a
    valid token of the document (which one is left unspecified: the reference's ``torch.max`` picks the NaN token,
    the kernels' running argmax keeps the last number each slot held), so the backward reads inside the document.
    The other pairs' argmax is the reference's."""
    ld = 200
    inp = _inputs(layout, 5, ld, 16, dtype=dtype, device=device, masks="holes", seed=seed_of("nan-arg", layout))
    D, dm = inp.D.clone(), inp.d_mask.clone()
    idx = (1, 130) if layout == "cross" else (1, 0, 130)  # (a token of a later tile)
    D[idx + (5,)] = float("nan")
    dm[idx] = True
    dm[idx[:-1] + (0,)] = False  # (a stray 0, e.g. an overflowed index truncated to 16 bits, points at a masked token)
    case = inp.with_(D=D, d_mask=dm)
    _s, arg = maxsim.maxsim(case.Q, case.D, case.q_mask, case.d_mask, return_argmax=True)
    _rs, rarg = maxsim.reference.maxsim_with_argmax(case.Q.double(), case.D.double(), case.q_mask, case.d_mask)
    arg = arg.long().cpu()
    rarg = rarg.cpu()
    nan_pair = torch.zeros(arg.shape[:-1], dtype=torch.bool)
    nan_pair[(slice(None), 1) if layout == "cross" else (1, 0)] = True
    live = rarg >= 0
    assert bool((live & nan_pair[..., None]).any()), "the NaN pair should have live rows"
    assert torch.equal(arg >= 0, live), "live rows differ from the reference's"
    doc_mask = case.d_mask.cpu()
    docs = doc_mask[None].expand(arg.shape[0], -1, -1) if layout == "cross" else doc_mask  # [Nq, K, Ld]
    chosen = torch.gather(docs, 2, arg.clamp(min=0))  # the chosen tokens' validity
    rows = live & nan_pair[..., None]
    assert bool(((arg < ld) & chosen)[rows].all()), f"NaN rows' argmax outside the valid tokens: {arg[rows].tolist()}"


# ----------------------------------------------------------------------------------------------------
# ties


def _planted_ties(layout, dtype, device, *, seed):
    """Integer data where query token i's best document token is duplicated at positions (lo_i, hi_i).

    dim 64. Query token i = 2 x (Hadamard row i) on coordinates 0..3 + ±1 noise on coordinates 4..51 (norm 8);
    a planted document token = Hadamard row i on coordinates 0..3 (norm 2); every other document token = ±1 on
    coordinates 4..7 (norm 2). The planted pair is the clear max (8 vs <= 4 raw, 0.5 vs <= 0.25 normalized) and
    every norm is a power of two, so raw and normalized similarities are exact in any summation order: the ties
    are exact ties for the library and for the float64 reference alike. Returns (inputs, [(lo, hi), ...]).
    Duplicates sit in one tile, in neighbouring tiles and at both ends.
    """
    lq, ld, dim = 4, 200, 64
    pairs = [(0, ld - 1), (5, 6), (70, 140), (100, 101)]
    inp = _inputs(layout, lq, ld, dim, dtype=torch.float32, device=device, seed=seed, exact=True)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    hadamard = torch.kron(h2, h2).to(device)  # 4 orthogonal ±1 rows
    D = torch.zeros(inp.D.shape, device=device)
    D[..., 4:8] = int_grid(inp.D.shape[:-1] + (4,), seed=seed + 5, high=1, device=device)
    for i, (lo, hi) in enumerate(pairs):
        D[..., lo, :] = 0
        D[..., hi, :] = 0
        D[..., lo, :4] = hadamard[i]
        D[..., hi, :4] = hadamard[i]
    Q = torch.zeros(inp.Q.shape, device=device)
    Q[..., :4] = 2 * hadamard
    Q[..., 4:52] = int_grid(inp.Q.shape[:-1] + (48,), seed=seed + 7, high=1, device=device)
    return inp.with_(Q=Q.to(dtype), D=D.to(dtype)), pairs


TIE_CASES = [  # (layout, dtype): every layout, every dtype, not the full product
    ("cross", torch.float32),
    ("cross", torch.bfloat16),
    ("cross", torch.float16),
    ("candidates", torch.bfloat16),
    ("candidates", torch.float32),
    ("pairs", torch.float16),
    ("pairs", torch.float32),
]


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize(("layout", "dtype"), TIE_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_ties_go_to_lowest_index(layout, dtype, normalize, backend, device):
    """Exact duplicates of the best document token: the gradient goes to the lowest index, as torch.max."""
    subset = {
        ("cross", torch.bfloat16, False),
        ("cross", torch.float32, True),
        ("candidates", torch.bfloat16, True),
        ("pairs", torch.float16, False),
    }
    keep_under_interpreter((layout, dtype, normalize) in subset, backend, device)
    inp, pairs = _planted_ties(layout, dtype, device, seed=seed_of("ties", layout))
    sim, _ = similarities(inp, normalize)
    best = sim.amax(-1, keepdim=True)
    for i, (lo, hi) in enumerate(pairs):  # the planted duplicates really are the (tied) max
        assert bool((sim[:, :, i, lo] == best[:, :, i, 0]).all()) and bool((sim[:, :, i, hi] == best[:, :, i, 0]).all())
    s, dQ, dD = check_parity(inp, normalize=normalize, exact=True)  # no near-tie exclusion: ties are exact
    for lo, hi in pairs:
        assert bool((dD[..., hi, :] == 0).all()), f"duplicate token {hi} (of {lo}) got a gradient"
        assert bool((dD[..., lo, :] != 0).any()), f"token {lo} got no gradient"

    # with the lower duplicate masked, the higher one wins
    dm = torch.ones(inp.D.shape[:-1], dtype=torch.bool, device=device)
    for lo, _ in pairs:
        dm[..., lo] = False
    masked = inp.with_(d_mask=dm)
    s, dQ, dD = check_parity(masked, normalize=normalize, exact=True)
    for lo, hi in pairs:
        assert bool((dD[..., lo, :] == 0).all())
        assert bool((dD[..., hi, :] != 0).any())


@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_natural_ties_integer_data(layout, backend, device):
    """Small-integer tokens (±1, dim 8) tie everywhere; exact arithmetic must resolve them like torch.max."""
    n, m = LAYOUT_ARGS[layout]
    qs, ds = shapes_of(layout, n, m, 9, 80, 8)
    seed = seed_of("natural", layout)
    Q = int_grid(qs, seed=seed, high=1, device=device)
    D = int_grid(ds, seed=seed + 1, high=1, device=device)
    dm = (torch.rand(ds[:-1], generator=torch.Generator().manual_seed(seed + 2)) < 0.8).to(device)
    inp = Inputs(layout, Q, D, None, dm)
    s = check_parity(inp, exact=True)[0]
    assert torch.equal(
        s.double(),
        maxsim.reference.maxsim_pairs(Q, D, None, dm) if layout == "pairs" else maxsim.reference.maxsim(Q, D, None, dm),
    ), "integer scores must be exact"


# ----------------------------------------------------------------------------------------------------
# backward modes


@pytest.mark.parametrize("dtype", DT2)
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_backward_modes_agree_and_deterministic_is_bitwise(layout, dtype, backend, device, monkeypatch):
    """Backward "fast" and "deterministic" give the same gradients; "deterministic" is bitwise reproducible. The
    Triton cross product's fast backward owns dD up to a size and uses fp32 atomics beyond it: both are checked."""
    subset = {("cross", torch.bfloat16), ("candidates", torch.float32), ("pairs", torch.bfloat16)}
    keep_under_interpreter((layout, dtype) in subset, backend, device)
    n, m = {"cross": (4, 3), "candidates": (3, 2), "pairs": (4, 0)}[layout]
    # few document tokens, many query tokens: many queries pick the same document token (contended scatter)
    inp = make_inputs(layout, n, m, 9, 6, 32, dtype=dtype, device=device, masks="holes", seed=seed_of("bw", layout))
    s_f, dQ_f, dD_f = check_parity(inp, normalize=True, backward="fast", seed=11)
    s_d, dQ_d, dD_d = check_parity(inp, normalize=True, backward="deterministic", seed=11)
    assert torch.equal(s_d, s_f), "scores depend on the backward mode"
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dQ_d, dQ_f, rtol=tol, atol=tol * float(dQ_f.abs().max()))
    torch.testing.assert_close(dD_d, dD_f, rtol=tol, atol=tol * float(dD_f.abs().max()))
    grad = upstream_grad(s_f.shape, seed=11 + 5, device=device)  # the upstream gradient check_parity used
    _, dQ2, dD2, _ = lib_forward_backward(inp, normalize=True, backward="deterministic", grad=grad)
    assert torch.equal(dQ_d, dQ2) and torch.equal(dD_d, dD2), "backward='deterministic' is not bitwise reproducible"
    if backend == "triton" and layout == "cross":
        from maxsim.kernels import launch_backward, launch_settings

        monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)  # the atomics path of large cross products

        monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
        for fused in (1, 0):  # the atomics in the gather's launch, then in a launch of their own
            monkeypatch.setattr(launch_settings, "FUSED_SCATTER", fused)
            launch_backward.plans.clear()
            _, dQ_a, dD_a = check_parity(inp, normalize=True, backward="fast", seed=11)
            plan = next(iter(launch_backward.plans.values()))
            assert not plan.dd_owned and (plan.dd_sc is None) == bool(fused)
            launch_backward.plans.clear()
            torch.testing.assert_close(dQ_a, dQ_d, rtol=tol, atol=tol * float(dQ_d.abs().max()))
            torch.testing.assert_close(dD_a, dD_d, rtol=tol, atol=tol * float(dD_d.abs().max()))


@pytest.mark.parametrize("dtype", DT2)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
def test_sorted_gather_backward_of_large_cross_products(normalize, dtype, device, monkeypatch):
    """The deterministic backward of large dense cross products gets dD by grouping the links by the chosen document
    token and summing each token's links (kernels/dd_gather.py): the same bits on every run, close to the float64
    reference, and a NaN upstream gradient only on the tokens its pair chose (as the reference; the owner spreads
    it). The PyTorch path on a GPU, and the dQ gather, keep a NaN off masked query tokens too."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    keep_under_interpreter(normalize != (dtype == torch.float32), "triton", device)
    from maxsim.kernels import launch_backward, launch_settings

    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)

    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    monkeypatch.setattr(launch_settings, "SORTED_DD_MIN_LINKS", 0)
    inp = make_inputs("cross", 5, 4, 9, 7, 32, dtype=dtype, device=device, masks="holes", seed=seed_of("sorted"))
    grad = upstream_grad(call_lib(inp).shape, seed=6, device=device)
    grad[1, 2] = float("nan")
    _, rQ, rD = ref_forward_backward(inp, grad, normalize=normalize)
    with maxsim.backend("torch"):  # ("fast": on a GPU the deterministic one-hot product spreads a NaN, as the owner)
        _, tQ, tD, _ = lib_forward_backward(inp, normalize=normalize, backward="fast", grad=grad)
    runs = []
    with maxsim.backend("triton"):
        for _ in range(2):
            launch_backward.plans.clear()
            runs.append(lib_forward_backward(inp, normalize=normalize, backward="deterministic", grad=grad))
            assert next(iter(launch_backward.plans.values())).dd_sorted is not None
    launch_backward.plans.clear()
    (_, dQ, dD, _), (_, _dQ2, dD2, _) = runs
    assert_same_nan(dD, dD2, "dD")
    assert torch.equal(dD.nan_to_num(), dD2.nan_to_num()), "the sorted gather is not the same on every run"
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, x, ref in (("dQ", dQ, rQ), ("dD", dD, rD), ("torch dQ", tQ, rQ), ("torch dD", tD, rD)):
        assert_same_nan(x, ref, name)
        x, ref = x.double().nan_to_num(), ref.nan_to_num()
        torch.testing.assert_close(x, ref, rtol=tol, atol=tol * float(ref.abs().max()), msg=name)


# ----------------------------------------------------------------------------------------------------
# empty batches

EMPTY_CASES = {
    # name: (Q shape, D shape, q_mask shape, d_mask shape, expected output shape, pairs?)
    "cross-Nq0": ((0, 5, 8), (3, 6, 8), (0, 5), (3, 6), (0, 3), False),
    "cross-Nd0": ((2, 5, 8), (0, 6, 8), (2, 5), (0, 6), (2, 0), False),
    "cross-both0": ((0, 5, 8), (0, 6, 8), (0, 5), (0, 6), (0, 0), False),
    "candidates-Nq0": ((0, 5, 8), (0, 3, 6, 8), (0, 5), (0, 3, 6), (0, 3), False),
    "candidates-K0": ((2, 5, 8), (2, 0, 6, 8), (2, 5), (2, 0, 6), (2, 0), False),
    "pairs-B0": ((0, 5, 8), (0, 6, 8), (0, 5), (0, 6), (0,), True),
    "Q2D-Nd0": ((5, 8), (0, 6, 8), (5,), (0, 6), (0,), False),
    "D2D-Nq0": ((0, 5, 8), (6, 8), (0, 5), (6,), (0,), False),
    # no query token or no document token (scores 0; a token dim of 0 is an error: test_errors.py)
    "cross-Lq0": ((2, 0, 8), (3, 6, 8), (2, 0), (3, 6), (2, 3), False),
    "cross-Ld0": ((2, 5, 8), (3, 0, 8), (2, 5), (3, 0), (2, 3), False),
    "candidates-Ld0": ((2, 5, 8), (2, 3, 0, 8), (2, 5), (2, 3, 0), (2, 3), False),
    "pairs-Ld0": ((2, 5, 8), (2, 0, 8), (2, 5), (2, 0), (2,), True),
    "Q2D-Ld0": ((5, 8), (3, 0, 8), (5,), (3, 0), (3,), False),
}


@pytest.mark.parametrize("with_masks", [False, True], ids=["nomask", "masks"])
@pytest.mark.parametrize("name", list(EMPTY_CASES))
def test_empty_batches(name, with_masks, backend, device):
    """Empty batches and empty sequences: the right shape and dtype, scores 0, zero gradients of the inputs'
    shapes (no crash in the backward)."""
    qs, ds, qms, dms, out_shape, pairs = EMPTY_CASES[name]
    Q = randn(qs, seed=1, device=device).requires_grad_()
    D = randn(ds, seed=2, device=device).requires_grad_()
    qm = torch.ones(qms, dtype=torch.bool, device=device) if with_masks else None
    dm = torch.ones(dms, dtype=torch.bool, device=device) if with_masks else None
    fn = maxsim.maxsim_pairs if pairs else maxsim.maxsim
    s = fn(Q, D, qm, dm)
    assert s.shape == out_shape and s.dtype == torch.float32 and s.device == Q.device
    assert bool((s == 0).all()), f"{name}: scores {s.tolist()}, expected 0 (no token pair to score)"
    s.sum().backward()
    for name_, x in (("Q", Q), ("D", D)):
        assert x.grad is not None, f"no gradient for {name_} with an empty batch"
        assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
        assert bool((x.grad == 0).all())


# ----------------------------------------------------------------------------------------------------
# normalization


def test_normalize_is_scale_invariant(backend, device):
    """normalize=True: scaling a token by c > 0 leaves the scores unchanged and divides its gradient by c."""
    inp = make_inputs("cross", 2, 2, 7, 20, 32, device=device, masks="holes", seed=5)
    cq = torch.rand(inp.Q.shape[:-1], generator=torch.Generator().manual_seed(6)).to(device)[..., None] * 4 + 0.25
    cd = torch.rand(inp.D.shape[:-1], generator=torch.Generator().manual_seed(7)).to(device)[..., None] * 4 + 0.25
    s, dQ, dD, grad = lib_forward_backward(inp, normalize=True)
    s2, dQ2, dD2, _ = lib_forward_backward(inp.with_(Q=inp.Q * cq, D=inp.D * cd), normalize=True, grad=grad)
    torch.testing.assert_close(s2, s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dQ2 * cq, dQ, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dD2 * cd, dD, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# backend switch


def test_backend_switch_api():
    maxsim.set_backend("auto")
    assert maxsim.get_backend() == "auto"
    maxsim.set_backend("torch")
    assert maxsim.get_backend() == "torch"
    with maxsim.backend("auto"):
        assert maxsim.get_backend() == "auto"
        with maxsim.backend("torch"):
            assert maxsim.get_backend() == "torch"
        assert maxsim.get_backend() == "auto"
    assert maxsim.get_backend() == "torch"
    with pytest.raises(RuntimeError), maxsim.backend("auto"):
        raise RuntimeError("boom")
    assert maxsim.get_backend() == "torch", "the context manager must restore the backend on error"
    maxsim.set_backend("auto")
    with pytest.raises(ValueError, match="nonsense"):
        maxsim.set_backend("nonsense")
    for bad in ("cuda", "Torch", ""):
        with pytest.raises(ValueError):
            maxsim.set_backend(bad)
        with pytest.raises(ValueError), maxsim.backend(bad):
            pass
    assert maxsim.get_backend() == "auto"


def test_auto_backend_is_the_device_default(device):
    """Backend "auto" = the Triton kernels on CUDA tensors, the PyTorch path on CPU tensors (bitwise)."""
    inp = make_inputs("cross", 2, 3, 7, 20, 32, device=device, masks="holes", seed=8)
    explicit = "triton" if device == "cuda" else "torch"
    with maxsim.backend("auto"):
        a = maxsim.maxsim(inp.Q, inp.D, inp.q_mask, inp.d_mask, normalize=True)
    with maxsim.backend(explicit):
        b = maxsim.maxsim(inp.Q, inp.D, inp.q_mask, inp.d_mask, normalize=True)
    assert torch.equal(a, b)


@pytest.mark.skipif(INTERPRET or torch.cuda.is_available(), reason="only without the interpreter, on CPU tensors")
def test_triton_backend_on_cpu_needs_the_interpreter():
    inp = make_inputs("cross", 2, 3, 7, 20, 32, seed=9)
    with pytest.raises(ValueError, match="(?i)triton|interpret"), maxsim.backend("triton"):
        maxsim.maxsim(inp.Q, inp.D)


def test_repeated_calls_follow_strides_masks_and_flags(backend, device):
    """The launch path reuses plans keyed by shapes, strides and flags: a second call with the same shapes but
    other strides, masks or flags must still compute its own result."""
    g = torch.Generator().manual_seed(11)
    Q = torch.randn(3, 5, 16, generator=g).to(device)
    D = torch.randn(4, 7, 16, generator=g).to(device)
    D_t = torch.randn(7, 4, 16, generator=g).to(device).transpose(0, 1)  # same shape as D, other strides
    dm = torch.rand(4, 7, generator=g).to(device) > 0.3
    dm[:, 0] = True
    with maxsim.backend(backend):
        for args, kwargs in [
            ((Q, D), {}),
            ((Q, D_t), {}),
            ((Q, D), {"normalize": True}),
            ((Q, D, None, dm), {}),
            ((Q, D, None, dm.t().contiguous().t()), {}),
            ((Q, D), {}),
        ]:
            got = maxsim.maxsim(*args, **kwargs)
            ref = maxsim.reference.maxsim(
                *(a.double() if a is not None and a.is_floating_point() else a for a in args), **kwargs
            )
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_gradient_of_an_expanded_upstream_grad(layout, backend, device):
    """``scores.sum().backward()`` hands the backward an expanded (stride-0) gradient, which the kernels read in
    place; a transposed upstream gradient is read through a copy. Both must give the reference gradients."""
    inp = make_inputs(layout, 3, 4, 5, 7, 16, device=device, seed=seed_of("expanded-grad", layout))
    with maxsim.backend(backend):
        Q, D = inp.Q.clone().requires_grad_(), inp.D.clone().requires_grad_()
        fn = maxsim.maxsim_pairs if layout == "pairs" else maxsim.maxsim
        s = fn(Q, D)
        s.sum().backward()
        Qr, Dr = inp.Q.double().requires_grad_(), inp.D.double().requires_grad_()
        ref_fn = maxsim.reference.maxsim_pairs if layout == "pairs" else maxsim.reference.maxsim
        ref_fn(Qr, Dr).sum().backward()
        torch.testing.assert_close(Q.grad.double(), Qr.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(D.grad.double(), Dr.grad, rtol=1e-5, atol=1e-5)
        if s.dim() == 2:  # a transposed (non-contiguous) upstream gradient
            Q.grad = D.grad = None
            g = torch.randn(s.shape[1], s.shape[0], device=device).t()
            s = fn(Q, D)
            gq, gd = torch.autograd.grad(s, (Q, D), g)
            rq, rd = torch.autograd.grad(ref_fn(Qr, Dr), (Qr, Dr), g.double())
            torch.testing.assert_close(gq.double(), rq, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gd.double(), rd, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_infinite_chosen_query_token_gives_its_document_token_an_infinite_gradient(backend, device):
    """fp32, no normalize: a query token holding +inf in one dim picks the first document token with a positive
    entry there; that token's dD row is ``g * q``: inf in that dim, finite in the others (the Triton owner splits
    fp32 rows into three bf16 terms: an infinite row must stay its high term, not become inf - inf = NaN)."""
    if backend == "triton" and not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    Q = torch.full((1, 2, 16), 0.25, device=device)
    Q[0, 0, 3] = float("inf")
    D = torch.linspace(-1.0, 1.0, 5 * 16, device=device).reshape(1, 5, 16)
    D[0, :, 3] = torch.tensor([-1.0, 0.5, 2.0, -0.5, 1.0])  # token 1: the first with a positive entry
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    with maxsim.backend(backend):
        s, arg = maxsim.maxsim(Qg, Dg, return_argmax=True)
        (dD,) = torch.autograd.grad(s, (Dg,), torch.full_like(s, 2.0))
    assert arg[0, 0, 0] == 1
    row = dD[0, 1]
    assert row[3] == float("inf")
    expected = torch.full_like(row, 0.5)
    expected[3] = row[3]
    # (the second query token's 0.5 lands on its own argmax row; token 1 may be it too)
    if arg[0, 0, 1] == 1:
        expected = expected + 0.5
        expected[3] = float("inf")
    torch.testing.assert_close(row, expected)
