"""The dD owner's walk over the queries of a shared document takes one step a query when every query fits one
token block (``ONE_TQ``: ``Lq <= TQ``, no division per step) and ``ceil(Lq / TQ)`` steps otherwise: the flag
follows the query length, and the gradients match the float64 reference on both sides of the bound (64 tokens),
with masks with holes, in both backward modes."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRET, rand_mask, randn

import maxsim
from maxsim import reference
from maxsim.kernels import launch_backward
from maxsim.kernels.configs import backward_config

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)


def _owner_grads(Q, D, qm, dm, g, mode):
    """The Triton path's gradients and the owner plans it used (``ONE_TQ`` of each)."""
    launch_backward.plans.clear()
    Qg, Dg = Q.detach().requires_grad_(), D.detach().requires_grad_()
    with maxsim.backend("triton"):
        out = torch.autograd.grad(maxsim.maxsim(Qg, Dg, qm, dm, backward=mode), (Qg, Dg), g)
    flags = [p.main[2]["ONE_TQ"] for p in launch_backward.plans.values() if p.main[2]["DD_OWNED"]]
    launch_backward.plans.clear()
    return out, flags


@pytest.mark.parametrize("mode", ["fast", "deterministic"])
@pytest.mark.parametrize("Lq", [23, 64, 65, 130])
def test_owner_walk_on_both_sides_of_one_token_block(Lq, mode, device):
    Q = randn((3, Lq, 16), seed=1, device=device)
    D = randn((4, 9, 16), seed=2, device=device)
    qm = rand_mask((3, Lq), seed=3, device=device)
    dm = rand_mask((4, 9), seed=4, device=device)
    dm[1] = False  # a document of no tokens
    g = randn((3, 4), seed=5, device=device)
    (dQ, dD), flags = _owner_grads(Q, D, qm, dm, g, mode)
    Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
    rdQ, rdD = torch.autograd.grad(reference.maxsim(Qr, Dr, qm, dm), (Qr, Dr), g.double())
    torch.testing.assert_close(dQ.double(), rdQ, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dD.double(), rdD, rtol=1e-4, atol=1e-4)
    assert flags == [Lq <= backward_config(Lq, 16).TQ] and flags[0] == (Lq <= 64)
