"""The saved argmax is int16 for documents of up to 32768 tokens (layout.argmax_dtype), int32 beyond; the public
functions return it as int32 either way, and the backward reads either."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRET, randn, triton_usable, upstream_grad

import maxsim
from maxsim import layout, ops, reference


def test_the_rule():
    assert layout.argmax_dtype(1) == torch.int16
    assert layout.argmax_dtype(32768) == torch.int16  # (token 32767 is the largest index)
    assert layout.argmax_dtype(32769) == torch.int32


@pytest.mark.parametrize("limit", [layout.ARGMAX_INT16_MAX_LD, 4], ids=["int16", "int32"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_saved_in_the_rule_dtype_returned_as_int32_and_both_give_the_gradients(impl, limit, device, monkeypatch):
    """Both dtypes (the int32 one forced by a lower limit: documents of 6 tokens) through each path: the forward
    saves the rule's dtype, the public function returns int32 and the backward matches the reference."""
    if impl == "triton" and not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    monkeypatch.setattr(layout, "ARGMAX_INT16_MAX_LD", limit)
    if impl == "triton":
        from maxsim.kernels import launch_backward, launch_forward

        monkeypatch.setattr(launch_forward, "plans", {})  # (plans record the dtype)
        monkeypatch.setattr(launch_backward, "plans", {})
    dtype = torch.float32 if INTERPRET and impl == "triton" else torch.bfloat16
    Q = randn((3, 5, 16), seed=1, dtype=dtype, device=device)
    D = randn((4, 6, 16), seed=2, dtype=dtype, device=device)
    want = torch.int16 if limit >= 6 else torch.int32
    _scores, saved, _norms = ops.forward_impl(Q, D[None], None, None, False, True, impl)  # (canonical layout)
    assert saved.dtype == want
    g = upstream_grad((3, 4), seed=3, device=device)
    q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
    with maxsim.backend(impl):
        s, a = maxsim.maxsim_with_argmax(q, d)
        dq, dd = torch.autograd.grad(s, (q, d), g)
    assert a.dtype == torch.int32
    qr, dr = Q.double().requires_grad_(), D.double().requires_grad_()
    rs, ra = reference.scores_and_argmax(qr, dr[None])
    assert torch.equal(a.long(), ra)
    rq, rd = torch.autograd.grad(rs, (qr, dr), g.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(dq.double(), rq, rtol=tol, atol=tol * float(rq.abs().max()))
    torch.testing.assert_close(dd.double(), rd, rtol=tol, atol=tol * float(rd.abs().max()))
