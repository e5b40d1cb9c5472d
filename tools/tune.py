"""Offline launch-config tuning on a GPU (never at call time).

``python tools/tune.py [--quick]`` sweeps forward-kernel configurations over named shapes, times each variant with
CUDA events (median), times the backward pieces separately, and measures the host overhead of each API layer. It
prints what it finds and writes ``$OUT/tune.json`` (or ``./tune.json``); the winners are then written by hand into
the heuristic in ``maxsim/kernels/configs.py`` (keyed by coarse shape buckets). ``--wide [--jobs N]`` sweeps the
dim loop of tokens wider than 256 dims instead (``WIDE_SHAPES``; N processes compile the variants first);
``--wide-backward`` the query tokens a block of the wide cross products' fast backward (``WIDE_BACKWARD_SHAPES``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
from host_profile import host_us  # tools/ is on sys.path when this runs as a script

import maxsim
from maxsim import ops
from maxsim.kernels import configs, launch, launch_settings
from maxsim.kernels.configs import ForwardConfig, forward_config

SHAPES = {
    # name: (Nq, K, Lq, Ld, dim, shared_docs, need_argmax)
    "cross 32x32 Lq32 Ld80": (32, 32, 32, 80, 128, True, False),
    "cross 1x1000 Lq32 Ld1024": (1, 1000, 32, 1024, 128, True, False),
    "cross 32x65536 Lq32 Ld256": (32, 65536, 32, 256, 128, True, False),
    "cross 1x500 Lq1024 Ld1024": (1, 500, 1024, 1024, 128, True, False),
    "cand B32 K100 Lq32 Ld256": (32, 100, 32, 256, 128, False, False),
    "train-fwd cand B64 K32 Lq32 Ld180": (64, 32, 32, 180, 128, False, True),
    "cross 1x1000 Lq32 Ld1024 d48": (1, 1000, 32, 1024, 48, True, False),
    "cross 128x128 Lq32 Ld300": (128, 128, 32, 300, 128, True, False),
    "train-fwd cross 256x256 Lq32 Ld300": (256, 256, 32, 300, 128, True, True),
    "train-fwd cross 32x32 Lq1024 Ld1024": (32, 32, 1024, 1024, 128, True, True),
}


# Tokens wider than 256 dims (the forward's dim loop: configs.wide), 16-bit unless named fp32: BGE-M3's 1024-dim
# multi-vectors, BERT's 768, MiniLM's 384. name: (Nq, K, Lq, Ld, dim, shared_docs, need_argmax, dtype)
WIDE_SHAPES = {
    "cross 32x256 Lq32 Ld180 d1024": (32, 256, 32, 180, 1024, True, False, torch.bfloat16),
    "train-fwd cross 32x256 Lq32 Ld180 d1024": (32, 256, 32, 180, 1024, True, True, torch.bfloat16),
    "cross 32x256 Lq32 Ld180 d768": (32, 256, 32, 180, 768, True, False, torch.bfloat16),
    "cand B32 K100 Lq32 Ld256 d1024": (32, 100, 32, 256, 1024, False, False, torch.bfloat16),
    "cross 1x1000 Lq32 Ld512 d1024": (1, 1000, 32, 512, 1024, True, False, torch.bfloat16),
    "cross 1x1000 Lq32 Ld300 d768": (1, 1000, 32, 300, 768, True, False, torch.bfloat16),
    "cross 1x1000 Lq32 Ld300 d1024": (1, 1000, 32, 300, 1024, True, False, torch.bfloat16),
    "cross 1x1000 Lq32 Ld180 d768": (1, 1000, 32, 180, 768, True, False, torch.bfloat16),
    "cand B32 K100 Lq32 Ld180 d768": (32, 100, 32, 180, 768, False, False, torch.bfloat16),
    "cross 8x64 Lq256 Ld512 d1024": (8, 64, 256, 512, 1024, True, False, torch.bfloat16),
    "cross 128x128 Lq32 Ld300 d384": (128, 128, 32, 300, 384, True, False, torch.bfloat16),
    "train-fwd cross 128x128 Lq32 Ld180 d384": (128, 128, 32, 180, 384, True, True, torch.bfloat16),
    "cross 32x256 Lq32 Ld180 d512": (32, 256, 32, 180, 512, True, False, torch.bfloat16),
    "cross 32x256 Lq32 Ld180 d384 fp32": (32, 256, 32, 180, 384, True, False, torch.float32),
    "train-fwd cand B32 K16 Lq32 Ld256 d512 fp32": (32, 16, 32, 256, 512, False, True, torch.float32),
}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def candidates(Lq: int, dim: int, Nq: int, shared: bool, quick: bool):
    block_k = min(max(16, triton.next_power_of_2(dim)), 128)
    num_k = max(16, triton.next_power_of_2(dim)) // block_k
    tq_opts = sorted({min(256, max(16, triton.next_power_of_2(Lq))), min(128, max(16, triton.next_power_of_2(Lq)))})
    if Lq > 128:
        tq_opts = [64, 128, 256]
    for tq, rows, bn, nw, ns in itertools.product(tq_opts, (32, 64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4, 5)):
        if rows < tq or (not shared and rows != tq):
            continue
        if quick and ns != 3 and rows > 32:
            continue
        bq = rows // tq
        if shared and bq > max(1, triton.next_power_of_2(Nq)):
            continue
        if rows * bn > 256 * 64 or (rows >= 256 and nw == 4):
            continue
        yield ForwardConfig(tq, bq, bn, block_k, num_k, nw, ns)  # (Lq > tq: one program per row block)


def time_configs(name: str, Q: torch.Tensor, D: torch.Tensor, need_arg: bool, cfgs: list) -> list:
    """``[(ms, cfg)]`` of the forward of ``Q``, ``D`` at each configuration, fastest first; one that fails to
    compile is reported and skipped."""
    rows = []
    for cfg in cfgs:
        try:
            ms = bench(lambda cfg=cfg: launch.forward(Q, D, None, None, False, need_arg, cfg=cfg))
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is just skipped
            print(f"  {name}: {cfg} failed: {repr(e)[:120]}")
            continue
        rows.append((ms, cfg))
    return sorted(rows, key=lambda r: r[0])


def wide_candidates(Lq: int, dim: int, Nq: int, shared: bool, itemsize: int):
    """Dim-loop configurations: rows, tiles, chunk widths, stages (warps follow the rows) within shared memory."""
    tq = min(128, max(16, triton.next_power_of_2(Lq)))
    for rows, bn, bk, ns in itertools.product((32, 64, 128, 256), (32, 64, 128), (32, 64, 128), (2, 3, 4)):
        if bk == 32 and itemsize == 2:
            continue
        if rows < tq or ((not shared or Lq > tq) and rows != tq) or rows // tq > max(1, triton.next_power_of_2(Nq)):
            continue
        if rows * bn > 256 * 64 or (itemsize == 4 and (rows > 128 or bn > 64)):
            continue
        for nw in (4, 8) if itemsize == 4 and rows < 128 else (8 if rows >= 128 else 4,):
            cfg = ForwardConfig(tq, rows // tq, bn, bk, -(-dim // bk), nw, ns)
            if cfg.NUM_K > 2 and configs.forward_shared_bytes(cfg, dim, itemsize) <= configs.FORWARD_SHARED_BYTES:
                yield cfg


def _wide_inputs(name: str) -> tuple:
    Nq, K, Lq, Ld, dim, shared, need_arg, dtype = WIDE_SHAPES[name]
    Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=dtype)
    D = torch.randn(1 if shared else Nq, K, Ld, dim, device="cuda", dtype=dtype)
    return Q, D, [forward_config(Lq, dim, Nq, shared, dtype == torch.float32),
                  *wide_candidates(Lq, dim, Nq, shared, Q.element_size())]  # fmt: skip


def _compile_wide(job: tuple[int, int, list[str]]) -> int:
    """A worker's share (every ``n``-th configuration from ``i``) compiled into Triton's cache by one launch each."""
    i, n, names = job
    count = 0
    for name in names:
        Q, D, cfgs = _wide_inputs(name)
        for cfg in cfgs[i::n]:
            try:
                launch.forward(Q, D, None, None, False, WIDE_SHAPES[name][6], cfg=cfg)
                count += 1
            except Exception:  # noqa: BLE001 - reported when the timing loop meets it again
                pass
        del Q, D
    torch.cuda.synchronize()
    return count


def sweep_wide(only: str | None = None, jobs: int = 1) -> dict:
    """Each wide shape: the table's configuration, the best of :func:`wide_candidates`, and eager PyTorch's
    materialized similarities for scale. ``jobs`` processes compile the variants first (Triton's cache), so the
    timing loop, alone on the GPU, loads them."""
    names = [n for n in WIDE_SHAPES if not only or any(part in n for part in only.split(","))]
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            print(f"compiled {sum(pool.map(_compile_wide, [(i, jobs, names) for i in range(jobs)]))} variants",
                  flush=True)  # fmt: skip
    results = {}
    for name in names:
        Nq, K, Lq, Ld, dim, shared, need_arg, dtype = WIDE_SHAPES[name]
        Q, D, cfgs = _wide_inputs(name)
        eq = "qid,kjd->qkij" if shared else "qid,qkjd->qkij"
        Dx = D[0] if shared else D
        eager = bench(lambda: torch.einsum(eq, Q, Dx).amax(-1).sum(-1))
        default = cfgs[0]
        rows = time_configs(name, Q, D, need_arg, cfgs)
        d_ms = next((ms for ms, c in rows if c == default), float("nan"))
        print(f"{name}: eager {eager:.4f} ms, default {d_ms:.4f} ms {default}", flush=True)
        for ms, cfg in rows[:6]:
            print(f"    {ms:.4f} ms {cfg}", flush=True)
        results[name] = {"eager_ms": eager, "default_ms": d_ms, "best": [(ms, cfg.__dict__) for ms, cfg in rows[:8]]}
        torch.cuda.empty_cache()
    return results


#: name: (Nq, K, Lq, Ld, dim, dtype) of wide cross products whose fast backward adds dD by atomics (beyond the owners'
#: bound), for the sweep of ``launch_settings.WIDE_ATOMICS_BT`` (docs/performance.md v128).
WIDE_BACKWARD_SHAPES = {
    "cross 128x128 Lq32 Ld180 d384": (128, 128, 32, 180, 384, torch.bfloat16),
    "cross 64x64 Lq32 Ld300 d768": (64, 64, 32, 300, 768, torch.bfloat16),
    "cross 32x32 Lq32 Ld180 d1024": (32, 32, 32, 180, 1024, torch.bfloat16),
    "cross 8x64 Lq256 Ld512 d1024": (8, 64, 256, 512, 1024, torch.bfloat16),
    "cross 32x32 Lq32 Ld180 d384 fp32": (32, 32, 32, 180, 384, torch.float32),
    "cross 64x64 Lq200 Ld300 d512 fp32": (64, 64, 200, 300, 512, torch.float32),
}


def sweep_wide_backward(only: str | None = None, blocks: tuple[int, ...] = (16, 8, 4)) -> dict:
    """The fast backward of each wide cross product (:data:`WIDE_BACKWARD_SHAPES`) with ``WIDE_ATOMICS_BT`` query
    tokens a program of its dQ gather and dD atomics, ms (the setting is in the backward plan's key)."""
    results = {}
    default = launch_settings.WIDE_ATOMICS_BT
    for name, (Nq, K, Lq, Ld, dim, dtype) in WIDE_BACKWARD_SHAPES.items():
        if only and not any(part in name for part in only.split(",")):
            continue
        Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=dtype)
        D = torch.randn(1, K, Ld, dim, device="cuda", dtype=dtype)
        _, arg = launch.forward(Q, D, None, None, False, True)
        g = torch.randn(Nq, K, device="cuda")
        row = {}
        try:
            for bt in blocks:
                launch_settings.WIDE_ATOMICS_BT = bt
                row[bt] = bench(lambda Q=Q, D=D, arg=arg: launch.backward(g, Q, D, arg, False, False))
        finally:
            launch_settings.WIDE_ATOMICS_BT = default
        times = ", ".join(f"{b}: {ms:.4f}" for b, ms in row.items())
        print(f"{name}: fast backward ms by query tokens a block {times}", flush=True)
        results[name] = row
        del Q, D, arg
        torch.cuda.empty_cache()
    return results


def sweep_forward(quick: bool, only: str | None = None) -> dict:
    results = {}
    for name, (Nq, K, Lq, Ld, dim, shared, need_arg) in SHAPES.items():
        if only and not any(part in name for part in only.split(",")):
            continue
        Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(1 if shared else Nq, K, Ld, dim, device="cuda", dtype=torch.bfloat16)
        default = forward_config(Lq, dim, Nq, shared)
        rows = time_configs(name, Q, D, need_arg, [default, *candidates(Lq, dim, Nq, shared, quick)])
        d_ms = next(ms for ms, c in rows if c == default)
        print(f"{name}: default {d_ms:.4f} ms {default}")
        for ms, cfg in rows[:4]:
            print(f"    {ms:.4f} ms {cfg}")
        results[name] = {"default_ms": d_ms, "best": [(ms, cfg.__dict__) for ms, cfg in rows[:8]]}

        torch.cuda.empty_cache()
    return results


def host_overhead() -> dict:
    """Host-side microseconds per call of each layer, on a tiny input (the GPU is not the bottleneck)."""
    Q = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    Qc, Dc = Q, D.unsqueeze(0)
    Qg = Q.clone().requires_grad_()
    Dg = D.clone().requires_grad_()

    s, arg = launch.forward(Qc, Dc, None, None, False, True)
    g = torch.ones_like(s)
    out = {
        "launch.forward": host_us(lambda: launch.forward(Qc, Dc, None, None, False, False)),
        "ops.forward": host_us(lambda: ops.forward(Qc, Dc, None, None, False, False, "triton")),
        "maxsim.maxsim (no grad)": host_us(lambda: maxsim.maxsim(Q, D)),
        "launch.backward fast": host_us(lambda: launch.backward(g, Qc, Dc, arg, False, False)),
        "launch.backward det": host_us(lambda: launch.backward(g, Qc, Dc, arg, False, True)),
        "train step": host_us(lambda: torch.autograd.grad(maxsim.maxsim(Qg, Dg).sum(), (Qg, Dg))),
        "empty kernel-free torch.empty": host_us(lambda: torch.empty(4, 4, device="cuda")),
    }
    for k, v in out.items():
        print(f"host overhead {k:32s} {v:8.1f} us")
    return out


def backward_pieces() -> dict:
    res = {}
    for name, (Nq, K, Lq, Ld, dim, cand) in {
        "cross 32x32 Lq32 Ld80": (32, 32, 32, 80, 128, False),
        "cross 256x256 Lq32 Ld300": (256, 256, 32, 300, 128, False),
        "cand B64 K32 Lq32 Ld180": (64, 32, 32, 180, 128, True),
        "cross 32x32 Lq1024 Ld1024": (32, 32, 1024, 1024, 128, False),
        "cross 64x64 Lq32 Ld1024": (64, 64, 32, 1024, 128, False),
    }.items():
        Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(Nq if cand else 1, K, Ld, dim, device="cuda", dtype=torch.bfloat16)
        s, arg = launch.forward(Q, D, None, None, False, True)
        g = torch.randn_like(s)
        r = {
            "fwd_noarg": bench(lambda: launch.forward(Q, D, None, None, False, False)),
            "fwd_arg": bench(lambda: launch.forward(Q, D, None, None, False, True)),
            "bwd_fast": bench(lambda: launch.backward(g, Q, D, arg, False, False)),
            "bwd_det": bench(lambda: launch.backward(g, Q, D, arg, False, True)),
        }
        print(f"pieces {name:30s} " + " ".join(f"{k}={v:.4f}" for k, v in r.items()))
        res[name] = r
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-backward", action="store_true")
    ap.add_argument("--shapes", help="comma-separated substrings of shape names to sweep")
    ap.add_argument("--wide", action="store_true", help="sweep the dim loop's shapes (WIDE_SHAPES) instead")
    ap.add_argument("--jobs", type=int, default=1, help="processes that compile the wide sweep's variants first")
    ap.add_argument("--wide-backward", action="store_true",
                    help="sweep the wide cross products' atomics blocks (WIDE_BACKWARD_SHAPES) instead")  # fmt: skip
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    out = {"device": torch.cuda.get_device_name()}
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):  # bring the clocks up before timing anything
        warm @ warm
    torch.cuda.synchronize()
    out["host_us"] = host_overhead()
    if not a.skip_backward:
        out["backward"] = backward_pieces()
    if a.wide_backward:
        out["wide_backward"] = sweep_wide_backward(a.shapes)
    elif a.wide:
        out["wide"] = sweep_wide(a.shapes, a.jobs)
    elif not a.skip_sweep:
        out["forward"] = sweep_forward(a.quick, a.shapes)
    path = os.path.join(os.environ.get("OUT", "."), "tune.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
