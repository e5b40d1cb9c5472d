"""Offline launch-config tuning on a GPU (never at call time).

``python tools/tune.py [--quick]`` sweeps forward-kernel configurations over named shapes, times each variant with
CUDA events (median), times the backward pieces separately, and measures the host overhead of each API layer. It
prints what it finds and writes ``$OUT/tune.json`` (or ``./tune.json``); the winners are then written by hand into
the heuristic in ``maxsim/kernels/configs.py`` (keyed by coarse shape buckets).
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
from maxsim.kernels import launch
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


def sweep_forward(quick: bool, only: str | None = None) -> dict:
    results = {}
    for name, (Nq, K, Lq, Ld, dim, shared, need_arg) in SHAPES.items():
        if only and not any(part in name for part in only.split(",")):
            continue
        Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(1 if shared else Nq, K, Ld, dim, device="cuda", dtype=torch.bfloat16)
        default = forward_config(Lq, dim, Nq, shared)
        rows = []
        for cfg in [default, *candidates(Lq, dim, Nq, shared, quick)]:
            try:
                ms = bench(lambda cfg=cfg: launch.forward(Q, D, None, None, False, need_arg, cfg=cfg))
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is just skipped
                print(f"  {name}: {cfg} failed: {repr(e)[:120]}")
                continue
            rows.append((ms, cfg))
        rows.sort(key=lambda r: r[0])
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
    if not a.skip_sweep:
        out["forward"] = sweep_forward(a.quick, a.shapes)
    path = os.path.join(os.environ.get("OUT", "."), "tune.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
