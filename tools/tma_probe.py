"""Would Hopper's tensor-memory accelerator (TMA) loads help the once-read inference scans? (GPU only.)

The forward's streaming loop (``STREAM_D``) prefetches each document tile into registers one tile ahead, so a
program keeps 16 KB in flight and four programs fit on a multiprocessor (docs/performance.md v62, v63). A TMA load
puts a tile into shared memory without registers, and Triton's pipeliner keeps ``num_stages`` of them in flight.
This probe times a minimal scores-only MaxSim of 32-row queries over dense documents, its tiles read through a host
tensor descriptor, against ``maxsim.maxsim`` and a read-only stream of the same bytes, timed as the bench times
(``make_timer``: ``do_bench``'s L2 flush). TMA loads carry no evict-first hint (Triton's descriptor loads take none).

Usage: python tools/tma_probe.py [--rep MS]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from sol_probe import stream_variants  # tools/ is on sys.path when this runs as a script
from triton.tools.tensor_descriptor import TensorDescriptor

import maxsim
from maxsim.bench.runner import make_timer
from maxsim.bench.workloads import WORKLOADS, make_inputs

ROWS = ("infer/cand-32x50-lq32-ld180", "infer/cand-32x100-lq32-ld256", "infer/cross-1x1000-lq32-ld1024")
# (BLOCK_N, num_stages, num_warps)
VARIANTS = ((64, 2, 4), (64, 3, 4), (64, 4, 4), (128, 2, 4), (128, 3, 4), (128, 2, 8), (32, 4, 4), (32, 6, 4))


@triton.jit
def _tma_maxsim_kernel(
    Q, d_desc, OUT, K, Ld, sq_n, SHARED: tl.constexpr, LQ: tl.constexpr, DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """``OUT[p]`` for document ``p`` of ``D [n_docs * Ld, DIM]`` (flattened), scored against query ``p // K`` (or
    query 0 when ``SHARED``); rows past a document's end belong to the next one and are masked out."""
    p = tl.program_id(0)
    q = 0 if SHARED else p // K
    r = tl.arange(0, LQ)
    kd = tl.arange(0, DIM)
    qt = tl.load(Q + q.to(tl.int64) * sq_n + r[:, None] * DIM + kd[None, :])
    row0 = p * Ld
    m = tl.full([LQ], float("-inf"), dtype=tl.float32)
    for n0 in tl.range(0, Ld, BLOCK_N, num_stages=STAGES):
        dt = d_desc.load([row0 + n0, 0])
        s = tl.dot(qt, tl.trans(dt))
        cols = n0 + tl.arange(0, BLOCK_N)
        s = tl.where((cols < Ld)[None, :], s, float("-inf"))
        m = tl.maximum(m, tl.max(s, axis=1))
    tl.store(OUT + p, tl.sum(m, axis=0))


def tma_scorer(Q: torch.Tensor, D: torch.Tensor, shared: bool, block_n: int, stages: int, warps: int):
    Ld, dim = D.shape[-2], D.shape[-1]
    flat = D.reshape(-1, dim)
    n_docs = flat.shape[0] // Ld
    desc = TensorDescriptor.from_tensor(flat, [block_n, dim])
    K = n_docs if shared else n_docs // Q.shape[0]

    def run():
        out = torch.empty(n_docs, device=D.device, dtype=torch.float32)
        _tma_maxsim_kernel[(n_docs,)](
            Q, desc, out, K, Ld, Q.stride(0), SHARED=shared, LQ=Q.shape[1], DIM=dim, BLOCK_N=block_n,
            STAGES=stages, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rep", type=float, default=200.0, help="ms of repeats per timing (the bench's default)")
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    timer = make_timer(dev, 25.0, args.rep)
    print(torch.cuda.get_device_name(), flush=True)
    by_key = {w.key: w for w in WORKLOADS}
    for key in ROWS:
        w = by_key[key]
        inp = make_inputs(w, dev, dtype)
        Q, D = inp.Q.contiguous(), inp.D.contiguous()
        shared = w.layout == "cross"
        with torch.no_grad():
            ref = maxsim.maxsim(Q, D).reshape(-1)
            ours = timer(lambda Q=Q, D=D: maxsim.maxsim(Q, D))
        streams = {name: timer(fn) for name, fn in stream_variants(D).items() if "evict" in name and "b4096" in name}
        best = min(streams, key=streams.get)
        print(f"{key}: maxsim {ours * 1e3:.1f} us, stream {streams[best] * 1e3:.1f} ({best})", flush=True)
        for bn, stages, warps in VARIANTS:
            try:
                fn = tma_scorer(Q, D, shared, bn, stages, warps)
                err = (fn() - ref).abs().max().item()
                t = timer(fn)
                print(f"    TMA BLOCK_N {bn:3d} stages {stages} warps {warps}: {t * 1e3:6.1f} us "
                      f"({t / ours:.2f}x maxsim) max|diff| {err:.2g}", flush=True)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
                print(f"    TMA BLOCK_N {bn} stages {stages} warps {warps}: failed {repr(e)[:160]}", flush=True)
        del inp, Q, D
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
