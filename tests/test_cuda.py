"""GPU-only checks (design.md §5): no hidden host syncs, CUDA-graph capture, bitwise determinism of the
deterministic backward, no Triton recompiles across Nd / Ld / K, and medium-size accuracy (bf16, and fp32 without
TF32). Every test here is marked ``cuda`` and skipped without a CUDA device."""

from __future__ import annotations

import gc
import importlib

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    Inputs,
    call_lib,
    check_parity,
    make_inputs,
    randn,
    rel_err,
    seed_of,
    upstream_grad,
)

import maxsim

pytestmark = pytest.mark.cuda

DEV = "cuda"


def _leaves(inp: Inputs):
    return inp.Q.detach().clone().requires_grad_(), inp.D.detach().clone().requires_grad_()


# ----------------------------------------------------------------------------------------------------
# no hidden synchronizations


@pytest.mark.parametrize("mode", ["fast", "deterministic"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_no_host_sync(layout, normalize, mode):
    """Forward + backward (and a no-grad forward) never synchronize with the host."""
    inp = make_inputs(layout, 8, 8, 32, 80, 128, dtype=torch.bfloat16, device=DEV, masks="holes", seed=1)
    Q, D = _leaves(inp)
    shape = call_lib(inp, normalize=normalize).shape
    grad = upstream_grad(shape, seed=2, device=DEV)
    for _ in range(2):  # warm-up: kernel compilation, caches
        call_lib(inp, Q, D, normalize=normalize, backward=mode).backward(grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = call_lib(inp, Q, D, normalize=normalize, backward=mode)
        s.backward(grad)
        with torch.no_grad():
            call_lib(inp, normalize=normalize)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------
# CUDA graphs


def _warm_up_on_side_stream(fn, n=3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(side)


@pytest.mark.parametrize("masks", ["holes", None], ids=["masked", "unmasked"])
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_cuda_graph_forward(layout, masks):
    """A captured forward replays on new data in the same buffers and equals eager calls bitwise (unmasked cross
    products and candidates: the capture takes the repeat path of ops.repeat_key, planned by the warm-up)."""
    inp = make_inputs(layout, 16, 16, 32, 80, 128, dtype=torch.bfloat16, device=DEV, masks=masks, seed=3)
    clone = lambda m: None if m is None else m.clone()  # noqa: E731
    Q, D, qm, dm = inp.Q.clone(), inp.D.clone(), clone(inp.q_mask), clone(inp.d_mask)
    static = Inputs(layout, Q, D, qm, dm)
    _warm_up_on_side_stream(lambda: call_lib(static, normalize=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call_lib(static, normalize=True)
    for trial in range(2):
        fresh = make_inputs(layout, 16, 16, 32, 80, 128, dtype=torch.bfloat16, device=DEV, masks=masks,
                            seed=10 + trial)  # fmt: skip
        Q.copy_(fresh.Q)
        D.copy_(fresh.D)
        if masks is not None:
            qm.copy_(fresh.q_mask)
            dm.copy_(fresh.d_mask)
        graph.replay()
        torch.cuda.synchronize()
        expected = call_lib(fresh, normalize=True)
        assert torch.equal(out, expected), (
            f"replay {trial} differs from eager (max |diff| {(out - expected).abs().max()})"
        )


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_cuda_graph_training_step(mode):
    """A captured training step (forward, cross-entropy, backward) replays like eager steps."""
    nq, nd, lq, ld, dim = 16, 16, 32, 80, 128
    Q = randn((nq, lq, dim), seed=4, dtype=torch.bfloat16, device=DEV).requires_grad_()
    D = randn((nd, ld, dim), seed=5, dtype=torch.bfloat16, device=DEV).requires_grad_()
    qm = torch.rand(nq, lq, device=DEV) < 0.8
    dm = torch.rand(nd, ld, device=DEV) < 0.8
    labels = torch.arange(nq, device=DEV)

    def step(Q, D):
        s = maxsim.maxsim(Q, D, qm, dm, normalize=True, backward=mode)
        loss = F.cross_entropy(s / 0.05, labels)
        loss.backward()
        return loss

    def warm():
        Q.grad = D.grad = None
        step(Q, D)

    _warm_up_on_side_stream(warm)
    Q.grad = D.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(Q, D)
    static_dQ, static_dD = Q.grad, D.grad
    for trial in range(2):
        with torch.no_grad():
            Q.copy_(randn(Q.shape, seed=20 + trial, dtype=Q.dtype, device=DEV))
            D.copy_(randn(D.shape, seed=30 + trial, dtype=D.dtype, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        Qe = Q.detach().clone().requires_grad_()
        De = D.detach().clone().requires_grad_()
        loss = step(Qe, De)
        if mode == "deterministic":
            assert torch.equal(static_loss, loss)
            assert torch.equal(static_dQ, Qe.grad)
            assert torch.equal(static_dD, De.grad)
        else:
            torch.testing.assert_close(static_loss, loss, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(static_dQ, Qe.grad, rtol=1e-2, atol=1e-2 * float(Qe.grad.abs().max()))
            torch.testing.assert_close(static_dD, De.grad, rtol=1e-2, atol=1e-2 * float(De.grad.abs().max()))


# ----------------------------------------------------------------------------------------------------
# determinism


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_deterministic_backward_is_bitwise_reproducible(layout):
    nq, m = (64, 64) if layout == "cross" else (64, 16)
    inp = make_inputs(layout, nq, m, 32, 128, 128, dtype=torch.bfloat16, device=DEV, masks="holes", seed=6)
    grad = upstream_grad(call_lib(inp).shape, seed=7, device=DEV)
    runs = []
    for _ in range(3):
        Q, D = _leaves(inp)
        s = call_lib(inp, Q, D, normalize=True, backward="deterministic")
        s.backward(grad)
        runs.append((s.detach(), Q.grad, D.grad))
    for i in (1, 2):
        for name, a, b in zip(("scores", "dQ", "dD"), runs[0], runs[i], strict=True):
            assert torch.equal(a, b), f"{name} of run {i} differs bitwise from run 0"
    # and the fast backward agrees within bf16 tolerance
    Q, D = _leaves(inp)
    call_lib(inp, Q, D, normalize=True, backward="fast").backward(grad)
    for name, a, b in (("dQ", Q.grad, runs[0][1]), ("dD", D.grad, runs[0][2])):
        assert rel_err(a, b) < 1e-2, f"fast vs deterministic {name}: rel err {rel_err(a, b):.3g}"


# ----------------------------------------------------------------------------------------------------
# compile count


def _jit_functions() -> dict:
    """Every ``@triton.jit`` function of the kernel modules (unwrapping autotuner / heuristics wrappers)."""
    from triton.runtime.jit import JITFunction

    found = {}
    for modname in ("maxsim.kernels.forward", "maxsim.kernels.backward"):
        mod = importlib.import_module(modname)
        for name, obj in vars(mod).items():
            fn, depth = obj, 0
            while not isinstance(fn, JITFunction) and hasattr(fn, "fn") and depth < 5:
                fn, depth = fn.fn, depth + 1
            if isinstance(fn, JITFunction):
                found[f"{modname}.{name}"] = fn
    assert found, "no @triton.jit function found in maxsim.kernels.forward / maxsim.kernels.backward"
    return found


def _compiled_keys(fn) -> set:
    """Keys of the compiled variants of a JITFunction (triton 3.x: ``device_caches[dev][0]`` is the cache)."""
    keys = set()
    caches = getattr(fn, "device_caches", None)
    if caches is None:  # older triton
        caches = {dev: (c,) for dev, c in getattr(fn, "cache", {}).items()}
    for dev, entry in caches.items():
        cache = entry[0] if isinstance(entry, tuple) else entry
        keys |= {(dev, str(k)) for k in cache}
    return keys


def _fwd_bwd(layout, n, m, ld, *, seed):
    inp = make_inputs(layout, n, m, 32, ld, 128, dtype=torch.bfloat16, device=DEV, masks="holes", seed=seed)
    Q, D = _leaves(inp)
    s = call_lib(inp, Q, D)
    s.backward(torch.ones_like(s))
    with torch.no_grad():
        call_lib(inp)  # the no-argmax inference variant too


def test_no_recompile_across_nd_ld_k():
    """After one warm-up per layout, new Nq / Nd / Ld / K compile no new kernel variant (fixed Lq, dim, dtype)."""
    for layout in ("cross", "candidates", "pairs"):
        _fwd_bwd(layout, 4, 16, 64, seed=0)
    torch.cuda.synchronize()
    kernels = _jit_functions()
    before = {name: _compiled_keys(fn) for name, fn in kernels.items()}
    assert any(before.values()), "the warm-up compiled nothing: cannot find the kernels' caches"
    for i, (nd, ld, k) in enumerate([(1, 80, 1), (7, 96, 3), (33, 128, 5), (64, 200, 8), (100, 300, 16)]):
        _fwd_bwd("cross", 4, nd, ld, seed=i + 1)
        _fwd_bwd("candidates", 3 + i, k, ld, seed=i + 1)
        _fwd_bwd("pairs", nd, 0, ld, seed=i + 1)
    torch.cuda.synchronize()
    new = {name: _compiled_keys(fn) - before[name] for name, fn in kernels.items()}
    new = {name: keys for name, keys in new.items() if keys}
    assert not new, f"new kernel variants compiled for new Nq/Nd/Ld/K: { {n: len(k) for n, k in new.items()} }"


def _ragged_fwd_bwd(lengths_q, lengths_d, pairs, *, seed):
    """Forward + backward of maxsim_varlen and maxsim_pairs_varlen with the maxima passed (no sync)."""
    g = torch.Generator().manual_seed(seed)
    cu_q = F.pad(torch.tensor(lengths_q).cumsum(0), (1, 0)).to(torch.int32).to(DEV)
    cu_d = F.pad(torch.tensor(lengths_d).cumsum(0), (1, 0)).to(torch.int32).to(DEV)
    Q = torch.randn(sum(lengths_q), 64, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    D = torch.randn(sum(lengths_d), 64, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    lengths = dict(max_seqlen_q=max(lengths_q), max_seqlen_d=max(lengths_d))
    maxsim.maxsim_varlen(Q, D, cu_q, cu_d, **lengths).sum().backward()
    pq = torch.tensor([p[0] for p in pairs], device=DEV)
    pd = torch.tensor([p[1] for p in pairs], device=DEV)
    maxsim.maxsim_pairs_varlen(Q, D, cu_q, cu_d, pq, pd, **lengths).sum().backward()


def test_no_recompile_across_ragged_lengths():
    """Ragged calls: new numbers of documents, new document lengths (and maxima), new pair lists, new query lengths
    within the longest query's power-of-two bucket compile nothing new. (The number of queries keeps to one
    packing bucket, 5..8: below 8 queries the cross product packs fewer per program, a bounded set of variants.
    Launches of few programs against long documents take the few-program variants: chunked documents
    (DOC_SPLIT_*), and for thin row blocks (a pair list) the deep pipeline (DEEP_PIPELINE) with and
    without chunks; the warm-up compiles each of them once.)"""
    lq = [5, 20, 32, 9, 11]
    _ragged_fwd_bwd(lq, [40, 7, 300], [(0, 1), (2, 2), (1, 0)], seed=0)
    _ragged_fwd_bwd(lq, [40, 2000], [(0, 1), (1, 1)], seed=0)  # (chunked; pairs: deep, 4 chunks of 512 tokens)
    _ragged_fwd_bwd(lq, [40, 520], [(0, 1)], seed=0)  # (pairs: deep, 5 tiles: no two chunks of 4)
    torch.cuda.synchronize()
    kernels = _jit_functions()
    before = {name: _compiled_keys(fn) for name, fn in kernels.items()}
    assert any(before.values()), "the warm-up compiled nothing: cannot find the kernels' caches"
    cases = [
        ([17, 30, 4, 6, 8, 2], [1000, 3], [(0, 0), (1, 1), (1, 0), (5, 1)]),
        ([32, 1, 9, 25, 18, 3, 3], [64, 65, 129, 2, 513, 77], [(4, 5), (0, 0)]),
        ([20] * 8, [5000], [(0, 0)] * 7),
    ]
    for i, (lq, ld, pairs) in enumerate(cases):
        _ragged_fwd_bwd(lq, ld, pairs, seed=i + 1)
    torch.cuda.synchronize()
    new = {name: _compiled_keys(fn) - before[name] for name, fn in kernels.items()}
    new = {name: keys for name, keys in new.items() if keys}
    assert not new, f"new kernel variants for new ragged lengths: { {n: len(k) for n, k in new.items()} }"


# ----------------------------------------------------------------------------------------------------
# medium-size accuracy


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_medium_parity(layout, dtype, normalize):
    """32 x 64 queries/documents, Lq 32, Ld 300, dim 128 with masks: bf16 within its tolerance; fp32 inputs
    within 1e-5 relative error (IEEE fp32 dot products, no silent TF32)."""
    n, m = {"cross": (32, 64), "candidates": (32, 16), "pairs": (64, 0)}[layout]
    seed = seed_of("medium", layout, str(dtype), normalize)
    inp = make_inputs(layout, n, m, 32, 300, 128, dtype=dtype, device=DEV, masks="holes", seed=seed)
    with maxsim.backend("triton"):
        check_parity(inp, normalize=normalize, seed=seed)


def test_fp32_is_not_tf32():
    """Large-magnitude fp32 inputs: TF32 (10-bit mantissa) would give ~1e-3 relative error, IEEE gives ~1e-7."""
    inp = make_inputs("cross", 16, 16, 32, 128, 256, device=DEV, seed=8)
    s = maxsim.maxsim(inp.Q, inp.D)
    ref = maxsim.reference.maxsim(inp.Q.double(), inp.D.double())
    assert rel_err(s, ref) < 1e-5


# ----------------------------------------------------------------------------------------------------
# peak memory of a training step


def requested_peak(call):
    """``(result, bytes)``: ``call()``'s result and the most bytes it held requested at once beyond those live before
    it. PyTorch's requested bytes, not its allocated ones: a cached block handed out whole counts up to 1 MiB more
    than asked for in allocated bytes, depending on what ran before in the process (run 79: a step read 300 KiB and
    another 1.07 MiB over their need after other tests, and passed in other shards)."""
    gc.collect()  # (objects left in reference cycles by earlier calls, freed during the step, would lower its peak)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    return out, torch.cuda.memory_stats()["requested_bytes.all.peak"] - base


def test_training_peak_is_the_gradients_and_the_atomics_buffer():
    """A fast step of a large cross product whose dQ walk is split (128 queries against 128 documents: fp32 slices of
    Q's size, twice) peaks at the cast of dD: scores, argmax, dQ, the fp32 buffer and dD, nothing else alive (the
    slices are freed before it)."""
    from maxsim.kernels import launch_backward

    Q = randn((128, 23, 128), seed=1, dtype=torch.bfloat16, device=DEV).requires_grad_()
    D = randn((128, 333, 128), seed=2, dtype=torch.bfloat16, device=DEV).requires_grad_()
    g = upstream_grad((128, 128), seed=3, device=DEV)
    launch_backward.plans.clear()
    torch.autograd.grad(maxsim.maxsim(Q, D), (Q, D), g)
    assert [(p.dq_splits > 1, p.dd_owned) for p in launch_backward.plans.values()] == [(True, False)], (
        "not the split walk"
    )
    grads, peak = requested_peak(lambda: torch.autograd.grad(maxsim.maxsim(Q, D), (Q, D), g))
    need = 128 * 128 * 4 + 128 * 128 * 23 * 2 + Q.numel() * 2 + D.numel() * (4 + 2)  # (the argmax: int16)
    assert need <= peak <= need + 2**18, f"peak {peak / 2**20:.3f} MiB, needed {need / 2**20:.3f} MiB"
    del grads


def test_fused_cast_step_peaks_at_the_gradients_and_the_atomics_buffer():
    """A fast step whose atomics' launch casts dD itself (launch_settings.FUSED_CAST_MAX_PROGRAMS: 64 queries against
    64 documents, dim 96, the bench's off-matrix step) peaks where one with a cast launch does: scores, the int16
    argmax, dQ, the fp32 buffer (and its counters) and dD, nothing else."""
    from maxsim.kernels import launch_backward

    Q = randn((64, 23, 96), seed=7, dtype=torch.bfloat16, device=DEV).requires_grad_()
    D = randn((64, 333, 96), seed=8, dtype=torch.bfloat16, device=DEV).requires_grad_()
    g = upstream_grad((64, 64), seed=9, device=DEV)
    launch_backward.plans.clear()
    torch.autograd.grad(maxsim.maxsim(Q, D), (Q, D), g)
    assert [p.cast_counters for p in launch_backward.plans.values()] == [32], "not the fused cast"
    grads, peak = requested_peak(lambda: torch.autograd.grad(maxsim.maxsim(Q, D), (Q, D), g))
    need = 64 * 64 * 4 + 64 * 64 * 23 * 2 + Q.numel() * 2 + D.numel() * (4 + 2)
    assert need <= peak <= need + 2**18, f"peak {peak / 2**20:.3f} MiB, needed {need / 2**20:.3f} MiB"
    del grads
    launch_backward.plans.clear()


def test_chunked_atomics_peak_at_the_gradients_and_the_last_chunks(monkeypatch):
    """A fast step whose fp32 dD buffer would exceed launch_settings.SCATTER_BUFFER_MAX_BYTES (256 queries against 256
    documents of 300 tokens: 37.5 MiB) sums dD a chunk at a time, the first chunks in dD's own storage: it peaks at
    scores, the int16 argmax, dQ, dD and the last chunks' buffer, and its gradients are an unchunked step's (dQ
    bitwise: the same gather; dD up to the atomics' order)."""
    from maxsim.kernels import launch_backward, launch_settings

    Q = randn((256, 32, 128), seed=4, dtype=torch.bfloat16, device=DEV).requires_grad_()
    D = randn((256, 300, 128), seed=5, dtype=torch.bfloat16, device=DEV).requires_grad_()
    g = upstream_grad((256, 256), seed=6, device=DEV)
    launch_backward.plans.clear()
    torch.autograd.grad(maxsim.maxsim(Q, D), (Q, D), g)
    plans = list(launch_backward.plans.values())
    assert len(plans) == 1 and plans[0].dd_chunks and plans[0].dd_chunks[0][2], "not chunked in dD"
    (dQ, dD), peak = requested_peak(lambda: torch.autograd.grad(maxsim.maxsim(Q, D), (Q, D), g))
    need = 256 * 256 * 4 + 256 * 256 * 32 * 2 + Q.numel() * 2 + D.numel() * 2 + plans[0].dd_tail * 300 * 128 * 4
    assert need <= peak <= need + 2**18, f"peak {peak / 2**20:.3f} MiB, needed {need / 2**20:.3f} MiB"
    monkeypatch.setattr(launch_settings, "SCATTER_BUFFER_MAX_BYTES", 1 << 40)
    launch_backward.plans.clear()
    dQ1, dD1 = torch.autograd.grad(maxsim.maxsim(Q, D), (Q, D), g)
    assert [p.dd_chunks for p in launch_backward.plans.values()] == [()]
    launch_backward.plans.clear()
    assert torch.equal(dQ, dQ1)
    torch.testing.assert_close(dD, dD1, rtol=1e-2, atol=1e-2 * float(dD1.abs().max()))
