"""The long-query forward's tile loop with Triton's automatic warp specialization: tiles read through host tensor
descriptors (TMA) and the loop as ``tl.range(..., warp_specialize=True)``. On Hopper, Triton 3.6 then splits a
program into a producer warpgroup (the tile loads) and two consumer warpgroups of 64 query rows each (its own MMA and
fold), so one group's argmax fold can run under the other's MMA (the overlap v166 tried inside one warpgroup, and v93
asked of pointer loads, which Triton does not specialize). Timed against the same loop unspecialized, against
``tools/tile_loop_probe.py``'s pointer-load loop and against ``maxsim.maxsim`` on the same tensors.

Usage (on the GPU): ``PYTHONPATH=src:tools python tools/ws_probe.py``. Offline, the compile alone (registers, spills,
shared memory, whether the loop was specialized) with Triton's wheel on a machine without a GPU:
``PYTHONPATH=/tmp/triton36:src:tools python tools/ws_probe.py --compile``.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from tile_loop_probe import _fold, _program_block, _store_rows


@triton.jit
def ws_fwd(
    Q,
    d_desc,
    M_OUT,
    A_OUT,
    Nq,
    Nd,
    Lq,
    Ld,
    BM: tl.constexpr,
    BN: tl.constexpr,
    ARGMAX: tl.constexpr,
    WS: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Dense queries ``[Nq·Lq, 128]`` against dense documents ``[Nd·Ld, 128]`` (Lq a multiple of BM, Ld of BN): each
    program one BM-row block of one query against one document, the row maxima (and lowest-index argmax) stored."""
    q, d, rb, r = _program_block(Nq, Lq, BM)
    # Q's descriptor made here, not on the host: Triton 3.6's Hopper data partitioning splits the load of Q in two
    # 64-row halves, and from a host descriptor each half still copies its 128-row box, past its shared buffer (an
    # illegal address on the H200)
    qt = tl.make_tensor_descriptor(Q, [Nq * Lq, 128], [128, 1], [BM, 128]).load([q * Lq + rb * BM, 0])
    m2 = tl.full([BM, BN], float("-inf"), tl.float32)
    a2 = tl.zeros([BM, BN] if ARGMAX else [1, 1], tl.float32)  # (no argmax: a one-element stand-in)
    for n0 in tl.range(0, Ld, BN, num_stages=STAGES, warp_specialize=WS):
        dt = d_desc.load([d * Ld + n0, 0])
        s = tl.dot(qt, dt.T)
        m2, a2 = _fold(s, m2, a2, BN, ARGMAX)
    _store_rows(m2, a2, M_OUT, A_OUT, (q * Nd + d) * Lq + r, Ld, BN, ARGMAX)


VARIANTS = {  # name: (BM, BN, warps, warp_specialize, stages); Q through a device-side descriptor
    "tma-128x64-w4-s3": (128, 64, 4, False, 3),
    "tma-128x64-w8-s3": (128, 64, 8, False, 3),
    "ws-128x64-w4-s2": (128, 64, 4, True, 2),
    "ws-128x64-w4-s3": (128, 64, 4, True, 3),
    "ws-128x64-w4-s4": (128, 64, 4, True, 4),
    "ws-256x64-w4-s3": (256, 64, 4, True, 3),
    "ws-128x128-w4-s3": (128, 128, 4, True, 3),
}


def compile_offline(argmax: bool = True) -> None:
    """Each variant compiled for sm_90 without a GPU: specialized or not, warps, registers, spills, shared memory."""
    import compile_check
    from triton.compiler import ASTSource

    for name, (bm, bn, warps, ws, stages) in VARIANTS.items():
        sig = {"Q": "*bf16", "d_desc": f"tensordesc<bf16[{bn}, 128]>",
               "M_OUT": "*fp32", "A_OUT": "*i32", "Nq": "i32", "Nd": "i32", "Lq": "i32", "Ld": "i32"}  # fmt: skip
        consts = {"BM": bm, "BN": bn, "ARGMAX": argmax, "WS": ws, "STAGES": stages}
        sig.update(dict.fromkeys(consts, "constexpr"))
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, *range(6, 12))}  # (a descriptor takes 5 slots)
        k = triton.compile(ASTSource(ws_fwd, sig, consts, attrs), target=compile_check.TARGET,
                           options={"num_warps": warps})  # fmt: skip
        print(f"{name:22s} specialized {'ttg.warp_specialize' in k.asm['ttgir']}, {k.metadata.num_warps} warps, "
              f"{compile_check.ptxas_usage(k.asm['ptx'])}, {k.metadata.shared} bytes shared", flush=True)  # fmt: skip


def _launch(Q2, D2, M, A, Nq, Nd, Lq, Ld, spec, argmax):
    """One variant's launch as a closure over its own arguments (see tile_loop_probe._launch)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, warps, ws, stages = spec
    dd = TensorDescriptor.from_tensor(D2, [bn, 128])
    grid = (Nq * Nd * (Lq // bm),)

    def launch():
        return ws_fwd[grid](Q2, dd, M, A, Nq, Nd, Lq, Ld, BM=bm, BN=bn, ARGMAX=argmax, WS=ws, STAGES=stages,
                            num_warps=warps)  # fmt: skip

    return launch


def run(Nq: int, Nd: int, Lq: int, Ld: int, argmax: bool, rounds: int = 5) -> None:
    import tile_loop_probe
    from triton.testing import do_bench

    import maxsim

    torch.manual_seed(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    Q = torch.randn(Nq, Lq, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(Nd, Ld, 128, device="cuda", dtype=torch.bfloat16)
    flops = 2 * Nq * Nd * Lq * Ld * 128
    calls, outs = {}, {}
    for name, spec in VARIANTS.items():
        M = torch.empty(Nq, Nd, Lq, device="cuda")
        A = torch.empty(Nq, Nd, Lq, device="cuda", dtype=torch.int32)
        f = _launch(Q.view(-1, 128), D.view(-1, 128), M, A, Nq, Nd, Lq, Ld, spec, argmax)
        try:
            f()
            torch.cuda.synchronize()
        except Exception as e:  # (a variant past the registers or shared memory: reported, the others run)
            print(name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
            continue
        calls[name], outs[name] = f, (M.clone(), A.clone())
    M = torch.empty(Nq, Nd, Lq, device="cuda")
    A = torch.empty(Nq, Nd, Lq, device="cuda", dtype=torch.int32)
    pointer = tile_loop_probe._launch(
        (Nq * Nd * (Lq // 128),), Q, D, M, A, Nq, Nd, Lq, Ld, 128, 64, 0, argmax, 4, 3, {}
    )
    pointer()
    calls["pointer-loads-128x64-w4-s3"], outs["pointer-loads-128x64-w4-s3"] = pointer, (M, A)
    Qg = Q.clone().requires_grad_(argmax)

    def library():
        with torch.set_grad_enabled(argmax):
            return maxsim.maxsim(Qg, D)

    library()
    calls["library"] = library
    torch.cuda.synchronize()
    times = {n: [] for n in calls}
    for _ in range(rounds):
        for n, f in calls.items():
            times[n].append(do_bench(f, warmup=25, rep=200))
    ref_m = (Q.float() @ D.float().flatten(0, 1).T).view(Nq, Lq, Nd, Ld).amax(-1).permute(0, 2, 1)
    base_m, base_a = outs["pointer-loads-128x64-w4-s3"]
    for n in calls:
        t = sorted(times[n])[len(times[n]) // 2]
        extra = ""
        if n in outs:
            m, a = outs[n]
            same_a = bool(torch.equal(a, base_a)) if argmax else "-"
            err = float((m - ref_m).abs().max())
            extra = f"  max|m-ref| {err:.2e}, as pointer loads: m {torch.equal(m, base_m)} a {same_a}"
        print(f"  {n:28s} {t * 1000:8.1f} us  {flops / t / 1e9:6.1f} TF/s{extra}", flush=True)


if __name__ == "__main__":
    if "--compile" in sys.argv:
        compile_offline()
        raise SystemExit(0)
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    print("argmax forward, 32x32 Lq1024 Ld1024 (the long-query training step's)", flush=True)
    run(32, 32, 1024, 1024, True)
    print("scores only, ColPali 1x500 Lq1024 Ld1024", flush=True)
    run(1, 500, 1024, 1024, False)
