"""The per-token kernels of ``normalize=True``'s backward (inverse norms, and the chain rule through the
normalization) against the PyTorch formulas of the CPU path, on the rows that make them differ if anything is off:
zero and sub-eps norms, NaN and inf tokens that received no gradient (exact zeros), a NaN gradient, dims that are
not a power of two or need two steps, and inputs whose rows are not contiguous."""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPES, GRAD_TOL, triton_usable

pytest.importorskip("triton")

from maxsim.cpu import project_normalized_grad  # noqa: E402
from maxsim.kernels import normalize as nk  # noqa: E402
from maxsim.layout import NORM_EPS  # noqa: E402


def _inputs(dtype: torch.dtype, dim: int, device: str):
    g = torch.Generator().manual_seed(dim)
    Q = torch.randn(3, 5, dim, generator=g).to(dtype)
    D = torch.randn(1, 4, 7, dim, generator=g).to(dtype)
    gQ = torch.randn(3, 5, dim, generator=g)
    gD = torch.randn(1, 4, 7, dim, generator=g)
    Q[0, 1] = 0  # zero norm, with a gradient
    Q[0, 2] = 1e-3 * NORM_EPS  # below eps, with a gradient
    D[0, 1, 2, 3] = float("nan")  # NaN / inf tokens that no query chose: exactly zero gradient
    D[0, 2, 1] = float("inf")
    gD[0, 1, 2] = 0
    gD[0, 2, 1] = 0
    gQ[1, 1] = 0  # a finite token without gradient
    gQ[2, 3, 5] = float("nan")  # a NaN gradient propagates to its token only
    return [t.to(device) for t in (Q, D, gQ, gD)]


def _expected(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    return project_normalized_grad(g, x.float() / norm.clamp_min(NORM_EPS)[..., None], norm)


@pytest.mark.parametrize("dim", [128, 48, 200, 96])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_kernels_match_the_torch_formulas(dtype, dim, device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    dt = DTYPES[dtype]
    Q, D, gQ, gD = _inputs(dt, dim, device)
    inv_q, inv_d = nk.inverse_norms(Q, D)
    for x, inv in ((Q, inv_q), (D, inv_d)):
        norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
        assert inv.dtype == torch.float32 and inv.shape == x.shape[:-1]
        torch.testing.assert_close(inv, 1 / norm.clamp_min(NORM_EPS), rtol=1e-6, atol=0, equal_nan=True)

    dQ, dD = nk.project(gQ, Q, gD, D)
    for x, g, out in ((Q, gQ, dQ), (D, gD, dD)):
        assert out.dtype == dt and out.shape == x.shape
        tol = GRAD_TOL[dt]
        torch.testing.assert_close(out.float(), _expected(x, g).to(dt).float(), rtol=tol, atol=1e-5, equal_nan=True)
    assert (dD[0, 1, 2] == 0).all() and (dD[0, 2, 1] == 0).all()  # NaN / inf tokens without gradient
    assert (dQ[1, 1] == 0).all()
    assert dQ[2, 3].isnan().all() and not dQ[2, 2].isnan().any()
    assert not dQ[0, 1].isnan().any()  # a zero token: g / eps (inf in fp16), no NaN


def test_rows_at_a_stride_and_empty_tensors(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(6, 2, 64, generator=g).to(device)
    Q = wide[:, 0]  # rows 128 elements apart
    D = torch.randn(2, 3, 64, generator=g).to(device).transpose(0, 1)  # leading dims that do not collapse
    gQ, gD = torch.randn(6, 64, generator=g).to(device), torch.randn(3, 2, 64, generator=g).to(device)
    dQ, dD = nk.project(gQ, Q, gD, D)
    torch.testing.assert_close(dQ, _expected(Q, gQ), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dD, _expected(D, gD), rtol=1e-5, atol=1e-6)

    empty = torch.zeros(0, 5, 64, device=device)
    inv_e, inv_q = nk.inverse_norms(empty, Q)
    assert inv_e.shape == (0, 5)
    torch.testing.assert_close(inv_q, 1 / torch.linalg.vector_norm(Q, dim=-1).clamp_min(NORM_EPS))
