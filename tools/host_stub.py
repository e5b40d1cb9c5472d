"""Host time of maxsim's own Python, without a GPU: the Triton path on ``meta`` tensors, launches stubbed at Triton's
compiled-kernel call (our launcher's Python still runs), against the least a custom-kernel ``autograd.Function`` can
do (allocate its outputs). The lent GPU hosts move 2x between calls; this machine does not, so host-path changes are
measured here first (docs/performance.md v40), then in-process on a GPU (`tools/ab_steps.py`).

Usage: python tools/host_stub.py [--profile]    (CPU machine; min over 5 repeats of N calls, µs per call)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable

import torch

import maxsim
from maxsim.kernels import device_info, launch_backward, launch_forward, launcher

DEV = "meta"  # (allocations cost what an allocator's bookkeeping costs; no memset, no cast work)


class _Compiled:
    function = 0
    packed_metadata = None

    @staticmethod
    def run(*args) -> None:  # Triton's own launcher (C) is not ours to trim
        return None


class _FakeKernel:
    def __init__(self, kernel) -> None:
        self.arg_names, self.constexprs = kernel.arg_names, kernel.constexprs

    def __getitem__(self, grid):
        return lambda *a, **k: _Compiled()


def stub_gpu() -> None:
    """Route every call to the Triton path and make its launches no-ops (one process only: nothing is restored)."""
    torch._C._cuda_getDevice = lambda: -1  # (the meta tensors' get_device(): the launches' device check passes)
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    device_info.sm_count = lambda device: 132
    device_info.l2_bytes = lambda device: 50 * 2**20
    for mod in (launch_forward, launch_backward, sys.modules["maxsim.kernels.normalize"]):
        for v in list(vars(mod).values()):
            if isinstance(v, launcher.Launcher):
                v.kernel = _FakeKernel(v.kernel)
                v._names = [v.kernel.arg_names[i] for i in v.kernel.constexprs]
    triton_first = lambda x: "triton" if x.dtype != torch.float64 else "torch"  # noqa: E731
    for name in ("maxsim.functional", "maxsim.ragged", "maxsim.ops"):
        sys.modules[name].choose_impl = triton_first


def us_per_call(fn: Callable[[], object], n: int = 2000, repeats: int = 5) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


class Floor(torch.autograd.Function):
    """A custom-kernel function that only allocates: scores, an int32 argmax it saves, and the two gradients."""

    @staticmethod
    def forward(ctx, Q, D):
        s = torch.empty((Q.shape[0], D.shape[-3]), device=Q.device)
        a = torch.empty((Q.shape[0], D.shape[-3], Q.shape[1]), device=Q.device, dtype=torch.int32)
        ctx.save_for_backward(Q, D, a)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(a)
        return s, a

    @staticmethod
    def backward(ctx, g, _):
        Q, D, _a = ctx.saved_tensors
        dQ = torch.empty(Q.shape, dtype=Q.dtype, device=Q.device)
        return dQ, torch.empty(D.shape, dtype=D.dtype, device=D.device)


def dense_case(
    nq: int, nd: int, lq: int, ld: int, dim: int = 128, candidates: bool = False, masked: bool = False
) -> dict:
    """``masked``: with a document mask (a padded batch)."""
    bf16 = torch.bfloat16
    Q = torch.randn(nq, lq, dim, dtype=bf16, device=DEV)
    D = torch.randn(*((nq,) if candidates else ()), nd, ld, dim, dtype=bf16, device=DEV)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    g = torch.randn(nq, nd, device=DEV)
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool, device=DEV) if masked else None

    def infer():
        with torch.no_grad():
            return maxsim.maxsim(Q, D, d_mask=d_mask)

    def step():
        return torch.autograd.grad(maxsim.maxsim(Qg, Dg, d_mask=d_mask), (Qg, Dg), g)

    def floor():
        return torch.autograd.grad(Floor.apply(Qg, Dg)[0], (Qg, Dg), g)

    return {"infer": infer, "train step": step, "floor step": floor}


def pairs_case(b: int, lq: int, ld: int, dim: int = 128) -> dict:
    """Aligned pairs (:func:`maxsim.maxsim_pairs`): ``[B]`` scores, the caller's shape of a ``[B, 1]`` grid."""
    Q = torch.randn(b, lq, dim, dtype=torch.bfloat16, device=DEV)
    D = torch.randn(b, ld, dim, dtype=torch.bfloat16, device=DEV)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    g = torch.randn(b, device=DEV)

    def infer():
        with torch.no_grad():
            return maxsim.maxsim_pairs(Q, D)

    return {"infer": infer, "train step": lambda: torch.autograd.grad(maxsim.maxsim_pairs(Qg, Dg), (Qg, Dg), g)}


def pair_list_case(nq: int, k: int, lq: int, ld: int, dim: int = 128, pool: int | None = None) -> dict:
    """``nq`` queries with ``k`` candidates each, from a pool of ``pool`` documents (``nq * k``: each used once)."""
    n_docs = nq * k if pool is None else pool
    Q = torch.randn(nq * lq, dim, dtype=torch.bfloat16, device=DEV).requires_grad_()
    D = torch.randn(n_docs * ld, dim, dtype=torch.bfloat16, device=DEV).requires_grad_()
    cu_q = torch.arange(0, (nq + 1) * lq, lq, dtype=torch.int32, device=DEV)
    cu_d = torch.arange(0, (n_docs + 1) * ld, ld, dtype=torch.int32, device=DEV)
    pq = torch.arange(nq, device=DEV, dtype=torch.int32).repeat_interleave(k)
    pd = torch.arange(nq * k, device=DEV, dtype=torch.int32) % n_docs
    g = torch.randn(nq * k, device=DEV)

    def call():
        return maxsim.maxsim_pairs_varlen(Q, D, cu_q, cu_d, pq, pd, max_seqlen_q=lq, max_seqlen_d=ld)

    def infer():
        with torch.no_grad():
            return call()

    return {"infer": infer, "train step": lambda: torch.autograd.grad(call(), (Q, D), g)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--profile",
        nargs="?",
        const="cross 32x32 Lq32 Ld80",
        default=None,
        metavar="CASE",
        help="cProfile of a case's training step (default: cross 32x32 Lq32 Ld80)",
    )
    args = ap.parse_args()
    stub_gpu()
    cases = {
        "cross 4x4 Lq8 Ld8": dense_case(4, 4, 8, 8),
        "cross 32x32 Lq32 Ld80": dense_case(32, 32, 32, 80),
        "cross 32x32 Ld80 d_mask": dense_case(32, 32, 32, 80, masked=True),
        "cross 64x64 Lq23 Ld333 d96": dense_case(64, 64, 23, 333, 96),
        "cross 1x8 Ld8192 (chunked)": dense_case(1, 8, 32, 8192),  # (8 programs: documents scanned in chunks)
        "cross 64x64 Lq32 Ld1024": dense_case(64, 64, 32, 1024),  # (dD by atomics into a 32 MiB fp32 buffer: one chunk)
        "cross 256x256 Lq32 Ld300": dense_case(256, 256, 32, 300),
        "candidates 64x32 Ld180": dense_case(64, 32, 32, 180, candidates=True),
        "pairs 512 Lq32 Ld300": pairs_case(512, 32, 300),
        "pair list 64x32 Ld180": pair_list_case(64, 32, 32, 180),
        "pair list pool 1024 Ld1000": pair_list_case(64, 32, 32, 1000, pool=1024),
    }
    for name, fns in cases.items():
        cols = "   ".join(f"{k} {us_per_call(f, 3000 if k == 'infer' else 1000):6.1f} us" for k, f in fns.items())
        print(f"{name:28s} {cols}", flush=True)
    if args.profile:
        step = cases[args.profile]["train step"]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3000):
            step()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
