"""Where the forward kernel's time goes, without hardware counters (GPU only).

Usage: python tools/fwd_probe.py [--out FILE] [--skip-scan] [--skip-configs] [--backward] [--only SUBSTR]

* Length scan: the cross product 256x256 Lq32 at several document lengths, with and without the argmax. The
  time's slope in document tiles is the cost of one tile (MMA + running max); its intercept is what every program
  pays once (query load, pipeline fill, row reduction, stores). Compared with the MMA's share of a tile at the
  measured matmul rate, it says which one to work on.
* Config table: hand-picked launch configurations on the shapes issue 5 names, with the compiled variant's
  registers and spills (from Triton's cache), so a config that spills is visible as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from probe_common import TRAIN_CROSS_SHAPES  # tools/ is on sys.path when this runs as a script
from triton.testing import do_bench

from maxsim.kernels import launch, launch_backward
from maxsim.kernels.configs import ForwardConfig, forward_config
from maxsim.kernels.forward import maxsim_fwd_kernel


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = ms(lambda: a @ a)
    return 2 * 8192**3 / t / 1e9


def compiled_stats() -> dict:
    """Registers and spills of every compiled forward variant, keyed by its constexprs."""
    out = {}
    for cache in getattr(maxsim_fwd_kernel, "device_caches", {}).values():
        for k in cache[0].values():
            try:
                k._init_handles()
                c = {n: v for n, v in k.src.constants.items() if isinstance(v, (int, bool, str))}
                key = " ".join(f"{n}={c.get(n)}" for n in ("TQ", "BQ", "BLOCK_N", "SAVE_ARGMAX", "NUM_K"))
                key += f" w={k.metadata.num_warps} s={k.metadata.num_stages}"
                out[key] = {"regs": k.n_regs, "spills": k.n_spills, "smem": k.metadata.shared}
            except Exception as e:  # noqa: BLE001 - Triton internals differ across versions; report what we can
                out[str(e)[:60]] = {}
    return out


def length_scan(tflops: float) -> dict:
    res = {}
    Nq, Nd, Lq, dim = 256, 256, 32, 128
    Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=torch.bfloat16)
    for arg in (False, True):
        pts = []
        for Ld in (64, 128, 256, 512, 1024):
            D = torch.randn(1, Nd, Ld, dim, device="cuda", dtype=torch.bfloat16)
            t = ms(lambda D=D: launch.forward(Q, D, None, None, False, arg))
            mma = 2 * Nq * Nd * Lq * Ld * dim / (tflops * 1e9)
            pts.append((Ld, t))
            print(f"scan argmax={arg!s:5} Ld={Ld:5d} {t:.4f} ms  (MMA at the matmul rate {mma:.4f} ms)", flush=True)
        # Least squares over the points: t = a + b * Ld.
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sum((p[0] - mx) ** 2 for p in pts)
        a = my - b * mx
        per_tok_mma = 2 * Nq * Nd * Lq * dim / (tflops * 1e9)
        print(f"scan argmax={arg}: intercept {a:.4f} ms, slope {b * 1e3:.4f} us per doc token "
              f"(MMA alone {per_tok_mma * 1e3:.4f})", flush=True)  # fmt: skip
        res[f"argmax={arg}"] = {"points": pts, "intercept_ms": a, "slope_ms_per_token": b, "mma_slope": per_tok_mma}
    return res


# fmt: off
CONFIGS = {
    # name: (Nq, K, Lq, Ld, dim, shared, argmax, [(TQ, BQ, BN, warps, stages, split, persist[, maxnreg]), ...]); the
    # default configuration is always timed first, and again with persist=0 where it is persistent.
    "train-fwd cross 256x256 Lq32 Ld300": (256, 256, 32, 300, 128, True, True, [
        (32, 8, 64, 8, 2, 1), (32, 4, 64, 4, 3, 1), (32, 4, 64, 8, 3, 1),
        (32, 4, 32, 4, 3, 1), (32, 8, 32, 8, 3, 1), (32, 4, 128, 8, 3, 1),
        (32, 8, 128, 8, 3, 1), (32, 4, 64, 4, 4, 1), (32, 2, 64, 4, 3, 1),
        (32, 4, 64, 4, 3, 2), (32, 4, 64, 8, 3, 2), (32, 4, 32, 4, 3, 2),
        (32, 8, 64, 8, 3, 2), (32, 8, 64, 8, 3, 3),
    ]),
    "train-fwd cross 64x64 Lq32 Ld1024": (64, 64, 32, 1024, 128, True, True, [
        (32, 4, 64, 4, 3, 1), (32, 4, 64, 8, 3, 1), (32, 4, 32, 4, 3, 1),
        (32, 8, 32, 8, 3, 1), (32, 4, 128, 8, 3, 1), (32, 2, 64, 4, 3, 1),
        (32, 4, 64, 4, 3, 2), (32, 4, 64, 8, 3, 2), (32, 8, 64, 8, 3, 2),
        (32, 8, 64, 8, 3, 3),
    ]),
    "fwd cross 128x128 Lq32 Ld300": (128, 128, 32, 300, 128, True, False, [
        (32, 8, 64, 8, 3, 2), (32, 8, 64, 8, 3, 3),
    ]),
    "train-fwd cross 64x64 Lq32 Ld128": (64, 64, 32, 128, 128, True, True, [(32, 8, 64, 8, 3, 2)]),
    "fwd corpus 32x65536 Lq32 Ld256": (32, 65536, 32, 256, 128, True, False, [
        (32, 8, 64, 8, 3, 2), (32, 8, 64, 8, 3, 3),
    ]),
    "train-fwd cross 32x32 Lq1024 Ld1024": (32, 32, 1024, 1024, 128, True, True, [
        (128, 1, 64, 4, 3, 0), (64, 1, 64, 4, 3, 0), (64, 1, 32, 4, 3, 0),
        (64, 1, 64, 4, 2, 0), (128, 1, 32, 8, 3, 0), (128, 1, 32, 4, 3, 2),
        (64, 1, 64, 4, 3, 3), (256, 1, 64, 8, 3, 0), (128, 2, 64, 8, 3, 0),
        (256, 1, 32, 8, 3, 0), (128, 2, 32, 8, 3, 0), (64, 4, 64, 8, 3, 0),
        (256, 1, 64, 8, 2, 0), (128, 2, 64, 8, 3, 1), (128, 2, 64, 8, 4, 0),
        (128, 1, 64, 8, 3, 0), (128, 1, 128, 8, 3, 0), (128, 1, 32, 8, 2, 0),
        (128, 1, 32, 8, 4, 0), (128, 1, 16, 4, 3, 0), (128, 1, 32, 4, 4, 0),
        (128, 1, 32, 4, 3, 0, 128), (128, 1, 32, 4, 2, 0, 168), (128, 1, 64, 4, 3, 0, 168),
        (128, 1, 64, 4, 3, 0),
    ]),
    "ColPali 1x500 Lq1024 Ld1024": (1, 500, 1024, 1024, 128, True, False, [
        (64, 1, 64, 4, 3, 0), (64, 1, 64, 4, 3, 3), (256, 1, 64, 8, 3, 0),
        (256, 1, 32, 8, 3, 0), (256, 1, 128, 8, 3, 0), (128, 1, 32, 8, 3, 0),
        (128, 1, 64, 8, 3, 0), (128, 1, 128, 8, 3, 0), (128, 1, 64, 4, 2, 0, 168),
        (128, 1, 32, 4, 2, 0, 128),
    ]),
    "cand 32x100 Lq32 Ld256": (32, 100, 32, 256, 128, False, False, [
        (32, 1, 32, 4, 3, 2), (32, 1, 32, 4, 3, 4), (32, 1, 64, 4, 3, 4),
        (32, 1, 32, 4, 4, 4), (32, 1, 32, 4, 3, 8), (32, 1, 64, 4, 3, 8),
        (32, 1, 64, 4, 4, 4), (32, 1, 128, 4, 3, 4), (32, 1, 128, 8, 3, 4),
        (32, 1, 64, 8, 3, 4), (32, 1, 32, 2, 3, 8), (32, 1, 32, 4, 5, 4),
        (32, 1, 64, 4, 5, 4), (64, 1, 64, 4, 3, 4), (32, 1, 256, 8, 2, 4),
    ]),
    "cand 32x50 Lq32 Ld180": (32, 50, 32, 180, 128, False, False, [
        (32, 1, 32, 4, 3, 2), (32, 1, 32, 4, 3, 4), (32, 1, 64, 4, 3, 4),
    ]),
    "fwd cross 1x10000 Lq32 Ld300": (1, 10000, 32, 300, 128, True, False, [
        (32, 1, 32, 4, 3, 4), (32, 1, 32, 4, 3, 2),
    ]),
    "fwd cross 1x1000 Lq32 Ld1024 d48": (1, 1000, 32, 1024, 48, True, False, [
        (32, 1, 128, 4, 3, 4), (32, 1, 128, 4, 3, 2),
    ]),
    "train-fwd cand 256x16 Lq32 Ld300": (256, 16, 32, 300, 128, False, True, [
        (32, 1, 32, 4, 3, 2), (32, 1, 32, 4, 3, 4),
    ]),
    "train-fwd cand 64x32 Lq32 Ld180": (64, 32, 32, 180, 128, False, True, [
        (32, 1, 32, 4, 3, 2), (32, 1, 32, 4, 3, 4),
    ]),
}
# fmt: on


def config_table(only: str | None = None) -> dict:
    res = {}
    for name, (Nq, K, Lq, Ld, dim, shared, arg, cfgs) in CONFIGS.items():
        if only and only not in name:
            continue
        Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(1 if shared else Nq, K, Ld, dim, device="cuda", dtype=torch.bfloat16)
        default = forward_config(Lq, dim, Nq, shared)
        ref = launch.forward(Q, D, None, None, False, arg)
        variants = [default]
        if default.persist:
            variants.append(dataclasses.replace(default, persist=0))
        variants += [ForwardConfig(c[0], c[1], c[2], default.BLOCK_K, default.NUM_K, *c[3:]) for c in cfgs]
        rows = []
        for cfg in variants:
            try:
                out = launch.forward(Q, D, None, None, False, arg, cfg=cfg)
                same = torch.equal(out[0], ref[0]) and (not arg or torch.equal(out[1], ref[1]))
                t = ms(lambda cfg=cfg, Q=Q, D=D: launch.forward(Q, D, None, None, False, arg, cfg=cfg))
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                print(f"{name}: {cfg} failed: {repr(e)[:160]}", flush=True)
                continue
            tag = "default " if cfg is default else ""
            print(f"{name:38s} {tag}{t:.4f} ms same={same} {cfg}", flush=True)
            rows.append({"ms": t, "same": same, "default": cfg is default, "cfg": cfg.__dict__})
        res[name] = rows
        torch.cuda.empty_cache()
    return res


def backward_table() -> dict:
    """launch.backward (dQ gather + dD) with the table's dQ token block and with half of it."""
    from maxsim.kernels.configs import backward_config

    res = {}
    for name, (Nq, Nd, Lq, Ld, dim) in TRAIN_CROSS_SHAPES.items():
        Q = torch.randn(Nq, Lq, dim, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(1, Nd, Ld, dim, device="cuda", dtype=torch.bfloat16)
        s, arg = launch.forward(Q, D, None, None, False, True)
        g = torch.randn_like(s)
        base = backward_config(Lq, dim)
        row = {}
        ref = None
        for bt in sorted({base.BT, max(16, base.BT // 2)}):
            launch_backward.backward_config = lambda lq, d, candidates=False, bt=bt: dataclasses.replace(base, BT=bt)
            launch_backward.plans.clear()  # backward plans hold the configuration they were built with
            try:
                out = launch.backward(g, Q, D, arg, False, False)
                ref = out[0] if ref is None else ref
                row[f"BT={bt}"] = ms(lambda: launch.backward(g, Q, D, arg, False, False))
                row[f"BT={bt} dQ equal"] = bool(torch.equal(out[0], ref))
            finally:
                launch_backward.backward_config = backward_config
        print(f"backward {name:30s} {row}", flush=True)
        res[name] = row
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-scan", action="store_true")
    ap.add_argument("--skip-configs", action="store_true")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--only", default=None, help="config-table rows whose name contains this")
    a = ap.parse_args()
    tf = matmul_tflops()
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {tf:.0f} TFLOP/s", flush=True)
    out: dict = {"device": torch.cuda.get_device_name(), "tflops": tf}
    if not a.skip_scan:
        out["scan"] = length_scan(tf)
    if a.backward:
        out["backward"] = backward_table()
    if not a.skip_configs:
        out["configs"] = config_table(a.only)
    out["compiled"] = compiled_stats()
    for k, v in out["compiled"].items():
        print(f"compiled {k}: {v}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
