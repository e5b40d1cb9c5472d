"""Parity of scores AND gradients with the float64 reference: layouts, dtypes, odd shapes, masks, normalize.

The shape lists cover dim 8/48/96/100/128/256, Lq 1/7/32/33/140/150/200 and Ld 1/5/80/300 without taking the
full product (the Triton interpreter on CPU is slow); every case runs in fp32, fp16 and bf16 on every usable backend.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DTYPES,
    Inputs,
    assert_grads_close,
    assert_scores_close,
    case_id,
    check_parity,
    keep_under_interpreter,
    make_inputs,
    randn,
    ref_forward_backward,
    score_magnitude,
    seed_of,
    upstream_grad,
)

import maxsim

DTYPE_LIST = list(DTYPES.values())
DTYPE_PARAMS = [pytest.param(v, id=k) for k, v in DTYPES.items()]


def _diagonal(cases, case, dtype) -> bool:
    """The interpreter subset: each case in two of the three dtypes, the dtypes spread evenly over the cases."""
    return (cases.index(case) + DTYPE_LIST.index(dtype)) % len(DTYPE_LIST) != 2


# (Nq, Nd, Lq, Ld, dim, masks, normalize)
CROSS_CASES = [
    (2, 3, 7, 5, 8, None, False),
    (3, 2, 1, 1, 48, "holes", True),
    (2, 2, 32, 80, 96, "empty", False),
    (1, 3, 33, 300, 100, "holes", False),
    (2, 2, 32, 80, 128, None, True),
    (1, 2, 7, 300, 256, "empty", True),
    (2, 2, 33, 5, 48, "holes", False),  # two 33-token queries packed into one block
    (3, 2, 7, 33, 128, "holes", True),  # three queries in a block of four
    (2, 3, 32, 1, 100, "empty", True),
    (1, 2, 200, 17, 16, "holes", False),  # long query: one program per 128-row block, partial scores summed
    (3, 2, 150, 9, 16, "holes", True),  # long queries in the cross product (packed blocks walk several rows)
    (3, 2, 100, 9, 96, "holes", False),  # three 100-token queries: one a block (no block of two half empty)
]

# (Nq, K, Lq, Ld, dim, masks, normalize)
CANDIDATE_CASES = [
    (2, 3, 7, 5, 8, "holes", False),
    (2, 2, 33, 80, 128, "empty", True),
    (1, 3, 32, 300, 48, None, False),
    (2, 1, 1, 1, 96, "holes", True),
    (2, 2, 140, 12, 16, None, False),  # long queries against their own candidates
    (2, 2, 140, 12, 16, "holes", True),  # (normalized: the forward reads the pre-pass's inverse norms)
]

# (B, Lq, Ld, dim, masks, normalize)
PAIR_CASES = [
    (3, 7, 5, 8, "holes", True),
    (3, 32, 80, 100, "empty", False),
    (1, 33, 300, 256, None, True),
    (2, 1, 1, 48, None, False),
]


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("case", CROSS_CASES, ids=case_id)
def test_cross(case, dtype, backend, device):
    keep_under_interpreter(_diagonal(CROSS_CASES, case, dtype), backend, device)
    nq, nd, lq, ld, dim, masks, normalize = case
    inp = make_inputs("cross", nq, nd, lq, ld, dim, dtype=dtype, device=device, masks=masks, seed=seed_of(case))
    s, _, _ = check_parity(inp, normalize=normalize, seed=seed_of(case))
    assert s.shape == (nq, nd)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("case", CANDIDATE_CASES, ids=case_id)
def test_candidates(case, dtype, backend, device):
    keep_under_interpreter(_diagonal(CANDIDATE_CASES, case, dtype), backend, device)
    nq, k, lq, ld, dim, masks, normalize = case
    inp = make_inputs("candidates", nq, k, lq, ld, dim, dtype=dtype, device=device, masks=masks, seed=seed_of(case))
    s, _, _ = check_parity(inp, normalize=normalize, seed=seed_of(case))
    assert s.shape == (nq, k)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("case", PAIR_CASES, ids=case_id)
def test_pairs(case, dtype, backend, device):
    keep_under_interpreter(_diagonal(PAIR_CASES, case, dtype), backend, device)
    b, lq, ld, dim, masks, normalize = case
    inp = make_inputs("pairs", b, 0, lq, ld, dim, dtype=dtype, device=device, masks=masks, seed=seed_of(case))
    s, _, _ = check_parity(inp, normalize=normalize, seed=seed_of(case))
    assert s.shape == (b,)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("squeeze", ["Q2D", "D2D", "both"])
def test_squeezed_shapes(squeeze, normalize, dtype, backend, device):
    """2-D Q [Lq, dim] and/or 2-D D [Ld, dim] (with masks [Lq] / [Ld]) drop that axis of the result."""
    subset = {("Q2D", False, torch.float32), ("D2D", True, torch.bfloat16), ("both", True, torch.float32)}
    keep_under_interpreter((squeeze, normalize, dtype) in subset, backend, device)
    full = make_inputs("cross", 3, 2, 7, 33, 48, dtype=dtype, device=device, masks="holes", seed=seed_of(squeeze))
    Q, qm, D, dm = full.Q, full.q_mask, full.D, full.d_mask
    if squeeze in ("Q2D", "both"):
        Q, qm = Q[1], qm[1]
    if squeeze in ("D2D", "both"):
        D, dm = D[1], dm[1]
    inp = Inputs("cross", Q, D, qm, dm)
    s, _, _ = check_parity(inp, normalize=normalize, seed=seed_of(squeeze, normalize))
    expected_shape = {"Q2D": (2,), "D2D": (3,), "both": ()}[squeeze]
    assert s.shape == expected_shape
    # the squeezed call agrees with the matching entry of the full cross call
    lib_full = maxsim.maxsim(full.Q, full.D, full.q_mask, full.d_mask, normalize=normalize)
    sel = {"Q2D": lib_full[1], "D2D": lib_full[:, 1], "both": lib_full[1, 1]}[squeeze]
    mag = score_magnitude(inp, normalize, s.shape)
    assert_scores_close(s, sel.double(), dtype=dtype, magnitude=mag, what="squeezed vs full")


def _noncontiguous(layout: str, dtype, device, seed: int) -> Inputs:
    """Inputs that are transposed / strided / sliced views (masks too); none of them is contiguous."""
    nq, m, lq, ld, dim = 2, 2, 7, 20, 24
    Qb = randn((lq, nq, 2 * dim), seed=seed, dtype=dtype, device=device)
    Q = Qb.transpose(0, 1)[..., ::2]  # [nq, lq, dim], strides (2dim, nq*2dim, 2)
    qm = (torch.rand((lq + 1, nq), generator=torch.Generator().manual_seed(seed + 1)) < 0.7).to(device)
    qm = qm[1:].t()
    if layout == "cross":
        Db = randn((ld + 2, m, dim), seed=seed + 2, dtype=dtype, device=device)
        D = Db.transpose(0, 1)[:, 1:-1]  # [m, ld, dim]
        dm = (torch.rand((ld, m), generator=torch.Generator().manual_seed(seed + 3)) < 0.7).to(device).t()
    elif layout == "candidates":
        Db = randn((m, nq, ld, dim + 5), seed=seed + 2, dtype=dtype, device=device)
        D = Db.transpose(0, 1)[..., 5:]  # [nq, m, ld, dim]
        dm = (torch.rand((m, nq, ld), generator=torch.Generator().manual_seed(seed + 3)) < 0.7).to(device)
        dm = dm.transpose(0, 1)
    else:
        Db = randn((nq, 2 * ld, dim), seed=seed + 2, dtype=dtype, device=device)
        D = Db[:, ::2]  # [nq, ld, dim]
        dm = (torch.rand((ld, nq), generator=torch.Generator().manual_seed(seed + 3)) < 0.7).to(device).t()
    for t in (Q, D, qm, dm):
        assert not t.is_contiguous()
    return Inputs(layout, Q, D, qm, dm)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_noncontiguous_inputs(layout, normalize, dtype, backend, device):
    subset = {("cross", True, torch.bfloat16), ("candidates", False, torch.float32), ("pairs", True, torch.float32)}
    keep_under_interpreter((layout, normalize, dtype) in subset, backend, device)
    inp = _noncontiguous(layout, dtype, device, seed_of(layout, normalize))
    s = check_parity(inp, normalize=normalize, seed=seed_of(layout))[0]
    # the same call on contiguous copies gives the same scores
    contiguous = inp.with_(
        Q=inp.Q.contiguous(),
        D=inp.D.contiguous(),
        q_mask=inp.q_mask.contiguous(),
        d_mask=inp.d_mask.contiguous(),
    )
    s2 = check_parity(contiguous, normalize=normalize, seed=seed_of(layout))[0]
    torch.testing.assert_close(s, s2, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
def test_expanded_candidates(normalize, backend, device):
    """Candidates given as a stride-0 ``expand`` of shared documents; the gradient reaches the shared base."""
    keep_under_interpreter(normalize, backend, device)
    nq, k, lq, ld, dim = 3, 2, 7, 20, 48
    seed = seed_of("expand", normalize)
    Q = randn((nq, lq, dim), seed=seed, device=device).requires_grad_()
    base = randn((k, ld, dim), seed=seed + 1, device=device).requires_grad_()
    dm = (torch.rand((k, ld), generator=torch.Generator().manual_seed(seed + 2)) < 0.7).to(device)
    D = base.expand(nq, k, ld, dim)
    s = maxsim.maxsim(Q, D, None, dm.expand(nq, k, ld), normalize=normalize)
    grad = upstream_grad(s.shape, seed=seed + 3, device=device)
    s.backward(grad)

    inp = Inputs("candidates", Q.detach(), base.detach().expand(nq, k, ld, dim), None, dm.expand(nq, k, ld))
    Qr = Q.detach().double().requires_grad_()
    Br = base.detach().double().requires_grad_()
    from maxsim import reference

    rs = reference.maxsim(Qr, Br.expand(nq, k, ld, dim), None, dm.expand(nq, k, ld), normalize=normalize)
    rs.backward(grad.double())
    assert_scores_close(
        s.detach(), rs.detach(), dtype=torch.float32, magnitude=score_magnitude(inp, normalize, (nq, k))
    )
    assert_grads_close(Q.grad, Qr.grad, dtype=torch.float32, what="dQ")
    assert_grads_close(base.grad, Br.grad, dtype=torch.float32, what="d(base of expanded D)")


def test_float64_inputs(device):
    """fp64 inputs give fp64 scores and gradients at fp64 accuracy (PyTorch path)."""
    with maxsim.backend("torch"):
        for layout, m in (("cross", 3), ("candidates", 2), ("pairs", 0)):
            inp = make_inputs(layout, 2, m, 7, 11, 16, dtype=torch.float64, device=device, masks="empty", seed=3)
            s, dQ, dD = check_parity(inp, normalize=True, seed=3)
            assert s.dtype == torch.float64 and dQ.dtype == torch.float64 and dD.dtype == torch.float64


@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_module_matches_functional(layout, backend, device):
    """``maxsim.MaxSim`` is a parameter-free ``nn.Module`` that calls the functional API with its settings."""
    inp = make_inputs(layout, 2, 3, 7, 9, 16, device=device, masks="holes", seed=seed_of("module", layout))
    mod = maxsim.MaxSim(normalize=True, backward="deterministic")
    assert isinstance(mod, torch.nn.Module)
    assert len(list(mod.parameters())) == 0
    if layout == "pairs":
        # the module covers maxsim.maxsim; pairs are the diagonal of the cross product
        s = mod(inp.Q, inp.D, inp.q_mask, inp.d_mask).diagonal()
    else:
        s = mod(inp.Q, inp.D, inp.q_mask, inp.d_mask)
    if layout == "pairs":
        expected = maxsim.maxsim_pairs(inp.Q, inp.D, inp.q_mask, inp.d_mask, normalize=True)
    else:
        expected = maxsim.maxsim(inp.Q, inp.D, inp.q_mask, inp.d_mask, normalize=True, backward="deterministic")
    torch.testing.assert_close(s, expected, rtol=1e-6, atol=1e-5)
    grad = upstream_grad(expected.shape, seed=1, device=device)
    rs, _, _ = ref_forward_backward(inp, grad, normalize=True)
    assert_scores_close(s.detach(), rs, dtype=torch.float32, magnitude=score_magnitude(inp, True, rs.shape))
