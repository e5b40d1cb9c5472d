"""Tokens wider than the matrix's 128 dims: MiniLM's 384, BERT's 768, BGE-M3's 1024.

Up to 256 dims the forward keeps every dim chunk of its query block and of the document tiles in flight in shared
memory (``configs.fit_tiles`` shrinks what would not fit); wider tokens run its pipelined dim loop, a chunk of both
a stage (``configs.wide``). Up to ``configs.WIDEST_DIM`` (1024 dims of 16-bit values, 512 of fp32) the kernels take
them; wider tokens run the PyTorch path under ``backend="auto"`` and are refused by name under ``"triton"``.
(Before: 384-dim fp32 and 768-dim bf16 calls failed at their first launch on an H200 with Triton's OutOfResources,
found by tests/test_cranfield.py.)
"""

from __future__ import annotations

import pytest
import torch
from helpers import alternate_under_interpreter, check_parity, make_inputs, randn, triton_usable

import maxsim
from maxsim import reference
from maxsim.backend import choose_impl
from maxsim.kernels import configs, launch_backward, launch_settings

LAYOUTS = ["cross", "candidates", "pairs"]


@pytest.mark.parametrize("fp32", [False, True])
def test_the_forward_tiles_fit_shared_memory_up_to_the_widest_tokens(fp32):
    itemsize = 4 if fp32 else 2
    dims = [d for d in (1, 8, 48, 96, 100, 128, 129, 200, 256, 257, 300, 384, 512, 513, 768, 1000, 1024)
            if d <= configs.WIDEST_DIM[itemsize]]  # fmt: skip
    for dim in dims:
        for lq in (1, 7, 23, 32, 33, 64, 100, 129, 200, 1024):
            for nq in (1, 3, 8, 64):
                for shared in (False, True):
                    cfg = configs.forward_config(lq, dim, nq, shared, fp32)
                    where = f"dim {dim}, Lq {lq}, Nq {nq}, shared {shared}: {cfg}"
                    assert cfg.BLOCK_N >= configs.MIN_TILE_N and cfg.num_stages >= configs.MIN_STAGES, where
                    assert cfg.TQ >= configs.MIN_TQ, where
                    if configs.wide(dim):  # (the loop's chunks cover the dims, and only them)
                        assert cfg.NUM_K > configs.UNROLLED_DIM_CHUNKS, where
                        assert (cfg.NUM_K - 1) * cfg.BLOCK_K < dim <= cfg.NUM_K * cfg.BLOCK_K, where
                        if fp32:  # (tf32x3's split operands: the blocks measured on the H200)
                            assert cfg.BQ * cfg.TQ <= 128 and cfg.BLOCK_N <= 64, where
                    if not fp32 or configs.wide(dim):
                        assert configs.forward_shared_bytes(cfg, dim, itemsize) <= configs.FORWARD_SHARED_BYTES, where


def test_the_table_below_256_dims_is_unchanged():
    """fit_tiles only shrinks what does not fit: the measured table entries up to 256 dims stay as they were."""
    for fp32 in (False, True):
        for dim in (48, 64, 96, 128, 256):
            for lq in (8, 32, 64, 200):
                cfg = configs.forward_config(lq, dim, 8, True, fp32)
                raw = (configs._fp32_config if fp32 else configs._bf16_config)(lq, dim, 8, True)
                assert cfg == raw, (dim, lq, fp32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wider_tokens_are_refused_by_name_under_the_triton_backend(dtype):
    widest = configs.WIDEST_DIM[torch.empty(0, dtype=dtype).element_size()]
    Q = randn((2, 3, widest + 1), seed=1, dtype=dtype)
    D = randn((2, 4, widest + 1), seed=2, dtype=dtype)
    with maxsim.backend("triton"), pytest.raises(ValueError) as err:
        maxsim.maxsim(Q, D)
    assert "triton" in str(err.value) and str(widest) in str(err.value) and str(widest + 1) in str(err.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wider_tokens_run_the_pytorch_path_under_auto(dtype, device):
    """On the GPU too: the reference's scores and gradients, through the PyTorch path."""
    widest = configs.WIDEST_DIM[torch.empty(0, dtype=dtype).element_size()]
    inputs = make_inputs("cross", 3, 4, 5, 9, widest + 1, dtype=dtype, device=device, seed=3, masks="holes")
    assert choose_impl(inputs.Q) == "torch"
    check_parity(inputs)


WIDE = [(torch.float32, 300), (torch.float32, 384), (torch.float32, 512), (torch.bfloat16, 384),
        (torch.bfloat16, 768), (torch.bfloat16, 1000), (torch.bfloat16, 1024)]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("lq", [23, 64, 200])
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
@pytest.mark.parametrize(("dtype", "dim"), WIDE, ids=[f"{str(d)[6:]}-{n}" for d, n in WIDE])
def test_the_kernels_take_wide_tokens(dtype, dim, layout, lq, normalize, device):
    inputs = make_inputs(layout, 5, 3, lq, 70, dim, dtype=dtype, device=device, seed=dim + lq, masks="holes")
    with maxsim.backend("triton"):
        check_parity(inputs, normalize=normalize)
        check_parity(inputs, normalize=normalize, backward="deterministic")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtype", "dim", "lq"), [(torch.bfloat16, 300, 23), (torch.float32, 384, 130)])
def test_the_dim_loop_matches_the_reference(dtype, dim, lq, layout, device):
    """The wide tokens' loop under the interpreter too (CI): masks with holes, long queries split into row blocks,
    the normalized scores with the tiles' own norms, both backwards."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    alternate_under_interpreter(LAYOUTS.index(layout), dtype == torch.float32, device)
    assert configs.wide(dim)
    inputs = make_inputs(layout, 3, 2, lq, 70, dim, dtype=dtype, device=device, seed=dim + lq, masks="holes")
    with maxsim.backend("triton"):
        check_parity(inputs)
        check_parity(inputs, normalize=True, backward="deterministic")


@pytest.mark.parametrize(("dtype", "dim"), [(torch.bfloat16, 300), (torch.float32, 384)])
def test_the_wide_atomics_take_their_own_token_blocks(dtype, dim, monkeypatch, device):
    """The fast cross product's dQ gather and dD atomics of wide tokens in blocks of WIDE_ATOMICS_BT query tokens
    (the owners forced off, as beyond their bound): a query of 23 tokens in 6 blocks, masks with holes; packed."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    inputs = make_inputs("cross", 3, 2, 23, 70, dim, dtype=dtype, device=device, seed=dim + 1, masks="holes")
    launch_backward.plans.clear()
    with maxsim.backend("triton"):
        check_parity(inputs, backward="fast")
    # A varlen cross product (packed tokens, documents by offsets) takes them too.
    cu_q = torch.tensor([0, 9, 10, 33], dtype=torch.int32, device=device)
    cu_d = torch.tensor([0, 40, 41, 70, 70, 95], dtype=torch.int32, device=device)
    Qp = randn((33, dim), seed=dim + 2, dtype=dtype, device=device).requires_grad_()
    Dp = randn((95, dim), seed=dim + 3, dtype=dtype, device=device).requires_grad_()
    w = randn((3, 5), seed=dim + 4, device=device)
    with maxsim.backend("triton"):
        s = maxsim.maxsim_varlen(Qp, Dp, cu_q, cu_d, max_seqlen_q=23, max_seqlen_d=40, backward="fast")
        dQ, dD = torch.autograd.grad((s * w).sum(), (Qp, Dp))
    Qr, Dr = (x.detach().double().requires_grad_() for x in (Qp, Dp))
    r = reference.maxsim_varlen(Qr, Dr, cu_q, cu_d)
    rdQ, rdD = torch.autograd.grad((r * w.double()).sum(), (Qr, Dr))
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(s.double(), r, rtol=tol, atol=tol)
    torch.testing.assert_close(dQ.double(), rdQ, rtol=tol, atol=tol)
    torch.testing.assert_close(dD.double(), rdD, rtol=tol, atol=tol)
    plans = list(launch_backward.plans.values())
    assert len(plans) == 2 and all(p.main[2]["BT"] == launch_settings.WIDE_ATOMICS_BT < 16 for p in plans)
    assert all(p.main[2]["DD_SCATTER"] or p.dd_sc is not None for p in plans)  # (the atomics, not an owner)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "dim"), WIDE, ids=[f"{str(d)[6:]}-{n}" for d, n in WIDE])
def test_the_ragged_kernels_take_wide_tokens(dtype, dim, device):
    lengths_q, lengths_d = torch.tensor([5, 40, 1, 23]), torch.tensor([70, 3, 130, 1, 64])
    cu_q = torch.nn.functional.pad(lengths_q.cumsum(0), (1, 0)).int().to(device)
    cu_d = torch.nn.functional.pad(lengths_d.cumsum(0), (1, 0)).int().to(device)
    Q = randn((int(lengths_q.sum()), dim), seed=5, dtype=dtype, device=device).requires_grad_()
    D = randn((int(lengths_d.sum()), dim), seed=6, dtype=dtype, device=device).requires_grad_()
    with maxsim.backend("triton"):
        s = maxsim.maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=40, max_seqlen_d=130, normalize=True)
        dQ, dD = torch.autograd.grad(s.sum(), (Q, D))
    Qr, Dr = (x.detach().double().requires_grad_() for x in (Q, D))
    r = reference.maxsim_varlen(Qr, Dr, cu_q, cu_d, normalize=True)
    rdQ, rdD = torch.autograd.grad(r.sum(), (Qr, Dr))
    torch.testing.assert_close(s.double(), r, rtol=1e-3 if dtype != torch.float32 else 1e-5, atol=1e-3)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(dQ.double(), rdQ, rtol=tol, atol=tol)
    torch.testing.assert_close(dD.double(), rdD, rtol=tol, atol=tol)
