"""How close the memory-bound inference rows are to what any kernel can do under the bench's method (GPU only).

The bench times with ``triton.testing.do_bench``, whose L2 flush (zeroing 256 MB) leaves the L2 full of dirty lines
that a timed kernel's reads must evict; the roofline floor (bytes / 1 GiB copy bandwidth) counts neither that
write-back nor a launch. Here, for each memory-bound inference row of the matrix, timed the bench's way in one
process:

* a read-only streaming kernel over the row's input bytes (the best of a few launch shapes: programs per
  multiprocessor, block size, warps), which does nothing but load every byte once: the speed of light of a kernel
  that must read the inputs, under this flush;
* ``torch.amax`` of the documents (PyTorch's own reduction, for a second opinion on the speed of light);
* maxsim and the peers (from the bench's adapters; peers skipped when not installed).

``--configs``: also every launch configuration of ``CONFIGS`` on its row (``launch.forward`` with the configuration
in place of the table's; scores compared with the table's), for a variant that closes the gap to the stream.

Usage: python tools/sol_probe.py [--out FILE] [--rep MS] [--configs]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from maxsim.bench.peers import FlashImpl, LikImpl, MaxsimImpl
from maxsim.bench.runner import make_timer, measure_roofline, roofline_floor
from maxsim.bench.workloads import WORKLOADS, make_inputs
from maxsim.kernels import launch
from maxsim.kernels.configs import ForwardConfig, forward_config

ROWS = (
    "infer/cross-1x1000-lq32-ld300",
    "infer/cand-32x50-lq32-ld180",
    "infer/cand-32x100-lq32-ld256",
    "infer/cross-1x1000-lq32-ld1024-d48",
    "infer/cross-1x4000-lq32-ld1024-d64",
    "infer/cross-1x10000-lq32-ld300",
    "infer/cross-1x1000-lq32-ld1024",
)

# row: [(BLOCK_N, BLOCK_K, NUM_K, num_warps, num_stages, persist), ...], every one at TQ = 32, BQ = 1
# fmt: off
CONFIGS = {
    "infer/cross-1x1000-lq32-ld1024-d48": [
        (64, 64, 1, 4, 3, 0), (256, 64, 1, 4, 3, 0), (256, 64, 1, 8, 3, 0), (128, 64, 1, 4, 2, 0),
        (128, 64, 1, 4, 4, 0), (128, 64, 1, 4, 5, 0), (128, 64, 1, 8, 3, 0), (64, 64, 1, 4, 5, 0),
        (128, 16, 3, 4, 3, 0), (256, 16, 3, 8, 3, 0), (64, 16, 3, 4, 4, 0), (128, 64, 1, 4, 3, 2),
        (128, 64, 1, 4, 3, 4), (64, 64, 1, 4, 4, 4),
    ],
    "infer/cand-32x100-lq32-ld256": [
        (32, 128, 1, 4, 3, 0), (32, 128, 1, 4, 3, 1), (32, 128, 1, 4, 3, 2), (32, 128, 1, 4, 3, 3),
        (32, 128, 1, 4, 3, 6), (32, 128, 1, 4, 4, 4), (32, 128, 1, 4, 4, 2), (64, 128, 1, 4, 3, 2),
        (64, 128, 1, 4, 4, 2), (64, 128, 1, 8, 3, 2), (16, 128, 1, 4, 4, 4), (16, 128, 1, 4, 6, 4),
        (32, 128, 1, 4, 2, 4), (32, 128, 1, 4, 2, 8),
    ],
    "infer/cand-32x50-lq32-ld180": [
        (32, 128, 1, 4, 3, 0), (32, 128, 1, 4, 3, 2), (32, 128, 1, 4, 4, 4), (64, 128, 1, 4, 3, 2),
        (16, 128, 1, 4, 4, 4), (32, 128, 1, 4, 2, 8),
    ],
    "infer/cross-1x1000-lq32-ld300": [
        (64, 128, 1, 4, 3, 0), (32, 128, 1, 4, 4, 0), (32, 128, 1, 4, 2, 0), (64, 128, 1, 8, 3, 0),
        (32, 128, 1, 4, 3, 2), (32, 128, 1, 4, 3, 4), (16, 128, 1, 4, 4, 0),
    ],
}
# fmt: on


def config_rows(w, inp, timer) -> dict[str, float]:
    """``launch.forward`` of ``w``'s inputs with the table's configuration and each of ``CONFIGS[w.key]``."""
    Q, D = inp.Q, (inp.D[None] if w.layout == "cross" else inp.D)
    table = forward_config(w.lq, w.dim, w.nq, w.layout == "cross")
    ref = launch.forward(Q, D, None, None, False, False)[0]
    out = {f"table {table}": timer(lambda: launch.forward(Q, D, None, None, False, False))}
    for bn, bk, nk, warps, stages, persist in CONFIGS.get(w.key, []):
        cfg = ForwardConfig(32, 1, bn, bk, nk, warps, stages, persist=persist)
        try:
            err = (launch.forward(Q, D, None, None, False, False, cfg=cfg)[0] - ref).abs().max().item()
            out[f"{cfg} max|diff| {err:.2g}"] = timer(
                lambda cfg=cfg: launch.forward(Q, D, None, None, False, False, cfg=cfg)
            )
        except Exception as e:  # noqa: BLE001 - a configuration that fails to compile is reported, not fatal
            out[f"{cfg} failed: {repr(e)[:120]}"] = float("nan")
    return out


@triton.jit
def _stream_max_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """Each program strides over ``x`` by the grid's width, keeping a running max (the load is the point);
    ``EVICT_FIRST``: loads hinted to leave the L2 first (as the forward's once-read document tiles)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        if EVICT_FIRST:
            x = tl.load(x_ptr + offs, mask=offs < n, other=float("-inf"), eviction_policy="evict_first")
        else:
            x = tl.load(x_ptr + offs, mask=offs < n, other=float("-inf"))
        acc = tl.maximum(acc, x.to(tl.float32))
    tl.store(out_ptr + pid, tl.max(acc, 0))


def stream_variants(x: torch.Tensor) -> dict[str, callable]:
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    flat = x.reshape(-1)
    n = flat.numel()
    out = torch.empty(sms * 64, device=x.device, dtype=torch.float32)
    variants = {}
    for per_sm in (2, 4, 8, 16, 0):  # 0: one block per program (no stride loop)
        for block, warps in ((2048, 4), (4096, 8), (8192, 8)):
            grid = triton.cdiv(n, block) if per_sm == 0 else min(sms * per_sm, triton.cdiv(n, block))
            if grid > out.numel() and per_sm:
                continue
            dst = out if grid <= out.numel() else torch.empty(grid, device=x.device, dtype=torch.float32)

            for evict_first in (False, True):

                def run(grid=grid, block=block, warps=warps, dst=dst, ef=evict_first):
                    _stream_max_kernel[(grid,)](flat, dst, n, BLOCK=block, EVICT_FIRST=ef, num_warps=warps)

                variants[f"{per_sm or 'all'}/SM b{block} w{warps}{' evict-first' if evict_first else ''}"] = run
    return variants


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", action="store_true", help="also time the launch configurations of CONFIGS")
    ap.add_argument("--rep", type=float, default=200.0, help="ms of repeats per timing (the bench's default)")
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    timer = make_timer(dev, 25.0, args.rep)
    roof = measure_roofline(dev, dtype, timer)
    print(f"{torch.cuda.get_device_name()}: copy {roof.bandwidth / 1e12:.2f} TB/s", flush=True)
    impls = [MaxsimImpl(), LikImpl(), FlashImpl()]
    impls = [i for i in impls if i.unavailable(dev) is None]
    res = {"device": torch.cuda.get_device_name(), "bandwidth": roof.bandwidth, "rows": {}}
    by_key = {w.key: w for w in WORKLOADS}
    for key in ROWS:
        w = by_key[key]
        inp = make_inputs(w, dev, dtype)
        _, nbytes, floor = roofline_floor(w, 2, roof)
        row = {"floor_ms": floor, "bytes": nbytes}
        streams = {name: timer(fn) for name, fn in stream_variants(inp.D).items()}
        plain = {k: v for k, v in streams.items() if "evict" not in k}
        best = min(plain, key=plain.get)
        best_ef = min(streams, key=streams.get)
        row["stream_best"] = (best, streams[best])
        row["stream_best_any_hint"] = (best_ef, streams[best_ef])
        row["torch_amax"] = timer(lambda D=inp.D: D.amax())
        with torch.no_grad():
            for impl in impls:
                fn = impl.scorer(w, dev, dtype)
                row[impl.name] = timer(lambda fn=fn, Q=inp.Q, D=inp.D: fn(Q, D))
        sol = streams[best]
        line = f"{key:38s} {nbytes / 1e6:6.1f} MB floor {floor * 1e3:6.1f} us | stream {sol * 1e3:6.1f} ({best})"
        line += f" | with hints {streams[best_ef] * 1e3:6.1f} ({best_ef}) | amax {row['torch_amax'] * 1e3:6.1f}"
        for impl in impls:
            line += f" | {impl.name} {row[impl.name] * 1e3:6.1f} ({row[impl.name] / sol:.2f}x stream)"
        print(line, flush=True)
        if args.configs and key in CONFIGS:
            row["configs"] = config_rows(w, inp, timer)
            for name, t in sorted(row["configs"].items(), key=lambda kv: kv[1]):
                print(f"    {t * 1e3:7.1f} us ({t / sol:.2f}x stream) {name}", flush=True)
        res["rows"][key] = row
        del inp
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
