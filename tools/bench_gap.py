"""Where a training row's bench time goes beyond its GPU time, one process, several ways of timing the same call.

Run 92's lead (docs/performance.md): the bench timed the 64 x 64 Lq32 Ld1024 training step at 0.317 ms (run 90's
record) and 0.357 ms (run 92), `tools/ab_steps.py` at ~0.141 ms (run 90, do_bench with the same flush, unpinned),
while the 64 x 64 Ld128 step, whose host path differs by one memset, measures ~0.1 ms in the bench. For each workload
and implementation this prints, in ms a call:

- ``bench``: the bench's timer (``runner.make_timer``: do_bench with its L2 flush, the median), the threads pinned to
  one CPU as the bench pins them (``affinity.OneCpu``); ``free``: the same timer unpinned (as ab_steps times);
- ``no-flush``: CUDA events around 50 back-to-back calls, no flush (the GPU pipelined, host hidden where it can be);
- ``serial``: wall time of a call followed by a synchronize (host path and GPU work one after the other);
- ``issue``: wall time per call without any synchronize over 50 calls (the host's issue rate, GPU queue permitting);
- ``gpu``: the kernels' own GPU time per call (torch.profiler, 10 calls).

Usage (on the GPU; peers from the carried wheels on PYTHONPATH):
  PYTHONPATH=/tmp/site:src:tools python tools/bench_gap.py [--only KEY ...] [--impl maxsim lik flash] [--rounds 5]

Written in run 92; first run on an H200 in run 93 (`benchmarks/results/partial/h200-run93-bench-gap-5f8ce03.txt`):
the Ld1024 step's bench time is its GPU time on a fast host, the rest host time (docs/performance.md, run 93).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from maxsim.bench.affinity import OneCpu
from maxsim.bench.peers import make_impls
from maxsim.bench.runner import make_call, make_timer
from maxsim.bench.workloads import make_inputs, seed_of, select

DEFAULT_ROWS = ("train/cross-64x64-lq32-ld1024", "train/cross-64x64-lq32-ld128")


def _no_flush_ms(call: Callable[[], object], n: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _serial_ms(call: Callable[[], object], n: int = 50) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _issue_ms(call: Callable[[], object], n: int = 50) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    return elapsed


def _gpu_ms(call: Callable[[], object], n: int = 10, table: bool = False) -> float:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    if table:  # which kernels the GPU time goes to, per call
        for e in sorted(averages, key=lambda e: -e.self_device_time_total):
            if e.self_device_time_total > 0:
                print(f"    {e.self_device_time_total / n:9.2f} us  x{e.count // n}  {e.key[:90]}", flush=True)
    total_us = sum(e.self_device_time_total for e in averages)
    return total_us / 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", default=list(DEFAULT_ROWS), metavar="KEY")
    ap.add_argument("--impl", nargs="+", default=["maxsim", "lik", "flash"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernels", action="store_true", help="print each call's kernels and their GPU time")
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    timer = make_timer(device, 25 / 3, 100 / 3)  # (one of the bench's three rounds)
    impls = make_impls(args.impl)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for w in select("all", args.only):
        inp = make_inputs(w, device, dtype, seed_of(w))
        calls = {}
        for impl in impls:
            why = impl.unavailable(device) or impl.unsupported(w, device, dtype)
            if why:
                print(f"{w.key} {impl.name}: skipped ({why})", flush=True)
                continue
            fn, operands = impl.prepare(w, inp, device, dtype)
            calls[impl.name] = make_call(w, fn, operands)
            calls[impl.name]()  # (compiles, autotunes)
        got: dict[str, dict[str, list[float]]] = {n: {} for n in calls}
        for r in range(args.rounds):
            for name, call in calls.items() if r % 2 == 0 else reversed(calls.items()):
                with OneCpu(device) as one:
                    got[name].setdefault("bench", []).append(timer(call))
                    got[name].setdefault("serial", []).append(_serial_ms(call))
                    got[name].setdefault("issue", []).append(_issue_ms(call))
                got[name].setdefault("free", []).append(timer(call))
                got[name].setdefault("no-flush", []).append(_no_flush_ms(call))
        for name, call in calls.items():
            got[name]["gpu"] = [_gpu_ms(call, table=args.kernels)]
            cols = "  ".join(f"{k} {statistics.median(v):.4f}" for k, v in got[name].items())
            print(f"{w.key:40s} {name:7s} {cols}  (pinned to CPU {one.cpu})", flush=True)
        del inp, calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
