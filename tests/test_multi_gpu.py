"""Tensors on a GPU other than the current one (``cuda:1`` while ``cuda:0`` is current, as in a process that never
calls ``set_device``): Triton compiles for and launches on the *current* device, so every launch must run under
the tensors' device. Scores and gradients must match the reference, the current device must be left as it was,
and plans filed for one device must never serve the other. Skipped without two CUDA devices."""

from __future__ import annotations

import pytest
import torch
from helpers import check_parity, int_grid, make_inputs
from test_ragged import Ragged, check_ragged

import maxsim
from maxsim.reference import maxsim as maxsim_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

OTHER = "cuda:1"


@pytest.fixture
def current_is_zero():
    """cuda:0 is current throughout the test, and still is after it."""
    before = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield
    assert torch.cuda.current_device() == 0, "a call left another device current"
    torch.cuda.set_device(before)


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("masks", [None, "holes"], ids=["unmasked", "masked"])
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_dense_calls_on_another_gpu_match_the_reference(layout, masks, normalize, backward, current_is_zero):
    inp = make_inputs(layout, 5, 6, 19, 70, 64, dtype=torch.bfloat16, device=OTHER, masks=masks, seed=3)
    for _ in range(2):  # (the second call: the repeat, where the signature allows one)
        s, dQ, dD = check_parity(inp, normalize=normalize, backward=backward)
        assert s.device == dQ.device == dD.device == torch.device(OTHER)


@pytest.mark.parametrize("pairs", [None, ((0, 1), (2, 0), (2, 2), (1, 1))], ids=["varlen", "pair list"])
def test_ragged_calls_on_another_gpu_match_the_reference(pairs, current_is_zero):
    case = Ragged(q_lens=(3, 17, 40), d_lens=(70, 0, 33), pairs=pairs, dtype="bf16")
    for _ in range(2):
        s, _arg, dQ, dD = check_ragged(case, torch.device(OTHER))
        assert s.device == dQ.device == torch.device(OTHER)


def test_one_signature_on_both_gpus_gives_each_its_own_plans(current_is_zero):
    """The same shapes on cuda:0, then cuda:1, then cuda:0 again (training steps, repeats included): every result
    is the reference's, bit for bit on integer tokens, whichever device came first."""
    for device in ("cuda:0", OTHER, "cuda:0", OTHER):
        Q = int_grid((4, 9, 32), seed=1, dtype=torch.float16, device=device).requires_grad_()
        D = int_grid((6, 21, 32), seed=2, dtype=torch.float16, device=device).requires_grad_()
        s = maxsim.maxsim(Q, D)
        s.backward(torch.ones_like(s))
        Qr, Dr = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
        r = maxsim_reference(Qr, Dr)
        r.backward(torch.ones_like(r))
        torch.testing.assert_close(s.detach().double(), r.detach(), rtol=0, atol=0)
        torch.testing.assert_close(Q.grad.double(), Qr.grad, rtol=0, atol=0)
        torch.testing.assert_close(D.grad.double(), Dr.grad, rtol=0, atol=0)


def test_calls_on_another_gpu_inside_its_stream(current_is_zero):
    """Under ``torch.cuda.stream`` of cuda:1 (which makes cuda:1 current), the work is ordered on that stream."""
    stream = torch.cuda.Stream(device=OTHER)
    Q = int_grid((3, 8, 16), seed=4, dtype=torch.float16, device=OTHER)
    D = int_grid((5, 12, 16), seed=5, dtype=torch.float16, device=OTHER)
    stream.wait_stream(torch.cuda.current_stream(OTHER))
    with torch.cuda.stream(stream):
        s = maxsim.maxsim(Q, D)
    torch.cuda.current_stream(OTHER).wait_stream(stream)
    torch.testing.assert_close(s.double(), maxsim_reference(Q.double(), D.double()), rtol=0, atol=0)


def test_compiled_call_on_another_gpu(current_is_zero):
    Q = int_grid((3, 8, 16), seed=6, dtype=torch.float16, device=OTHER).requires_grad_()
    D = int_grid((5, 12, 16), seed=7, dtype=torch.float16, device=OTHER).requires_grad_()
    s = torch.compile(maxsim.maxsim, fullgraph=True)(Q, D)
    s.sum().backward()
    Qr, Dr = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    maxsim_reference(Qr, Dr).sum().backward()
    torch.testing.assert_close(s.detach().double(), maxsim_reference(Qr, Dr).detach(), rtol=0, atol=0)
    torch.testing.assert_close(Q.grad.double(), Qr.grad, rtol=0, atol=0)
    torch.testing.assert_close(D.grad.double(), Dr.grad, rtol=0, atol=0)
