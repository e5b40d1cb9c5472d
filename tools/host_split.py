"""Where a tiny scores-only call's host time goes on a GPU host, by part, with the bench's host timer (batches of
50 calls back to back, the device synchronized between batches; median and minimum µs over 200 batches, 3 rounds).

Rows: the bench's tiny call (``no_grad`` + ``maxsim.maxsim`` of cross 4×4 Lq8 Ld8) and ``maxsim.maxsim`` alone; the
same with the compiled kernel's ``run`` made a no-op (our Python and the allocation only); a bare ``torch.empty`` of
the scores; a one-kernel torch op (``torch.neg(x, out=y)``); a 3-argument Triton kernel through ``kernel[grid]`` and
through its compiled ``run``, and a 36-argument one through ``run`` (what the launch's arguments cost). The lent
hosts move 1.5-2× between states, so only rows of one round compare (docs/performance.md v157).

Usage (GPU):  python tools/host_split.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import maxsim
from maxsim.kernels import launch_forward


def host_us(fn: Callable[[], object], batch: int = 50, reps: int = 200) -> tuple[float, float]:
    """(median, min) µs a call of ``fn`` over ``reps`` batches of ``batch`` calls (the bench's host timer)."""
    for _ in range(300):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times), min(times)


@triton.jit
def _copy16(X, Y, n):
    i = tl.arange(0, 16)
    tl.store(Y + i, tl.load(X + i, mask=i < n), mask=i < n)


@triton.jit
def _copy16_many(
    X, Y, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, d0, d1, d2, n,
):  # fmt: skip
    i = tl.arange(0, 16)
    tl.store(Y + i, tl.load(X + i, mask=i < n), mask=i < n)


def _launches_stubbed(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` with every kept forward launch's compiled ``run`` a no-op (the plans' caches and lean entries)."""

    def noop(*args: object) -> None:
        return None

    def stubbed() -> object:
        plans = {id(p): p for p in launch_forward.plans.values() if isinstance(p, launch_forward.ForwardPlan)}
        saved = []
        for p in plans.values():
            for cache in (p.launches, p.lean or {}):
                for key, hit in list(cache.items()):
                    saved.append((cache, key, hit))
                    cache[key] = (noop, *hit[1:])
        try:
            return host_us(call)
        finally:
            for cache, key, hit in saved:
                cache[key] = hit

    return stubbed


def main() -> None:
    dev = "cuda"
    Q = torch.randn(4, 8, 128, dtype=torch.bfloat16, device=dev)
    D = torch.randn(4, 8, 128, dtype=torch.bfloat16, device=dev)
    x = torch.randn(16, device=dev)
    y = torch.empty_like(x)

    def bench_call() -> torch.Tensor:
        with torch.no_grad():
            return maxsim.maxsim(Q, D)

    bench_call()
    k3 = _copy16[(1,)](x, y, 16)
    k36 = _copy16_many[(1,)](x, y, *range(3, 36), 16)
    xp, yp = x.data_ptr(), y.data_ptr()
    stream = torch.cuda.current_stream().cuda_stream
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(3):
        r = {"bench-style call (no_grad + maxsim)": host_us(bench_call)}
        with torch.no_grad():
            r["maxsim() inside no_grad"] = host_us(lambda: maxsim.maxsim(Q, D))
            r["maxsim() with the launch a no-op"] = _launches_stubbed(lambda: maxsim.maxsim(Q, D))()
        r["torch.empty((4, 4)) cuda"] = host_us(lambda: torch.empty((4, 4), dtype=torch.float32, device=dev))
        r["torch.neg(x, out=y)"] = host_us(lambda: torch.neg(x, out=y))
        r["tiny kernel[(1,)] (Triton's path)"] = host_us(lambda: _copy16[(1,)](x, y, 16))
        r["tiny compiled.run, 3 args"] = host_us(
            lambda: k3.run(1, 1, 1, stream, k3.function, k3.packed_metadata, None, None, None, xp, yp, 16)
        )
        args36 = (xp, yp, *range(3, 36), 16)
        r["tiny compiled.run, 36 args"] = host_us(
            lambda: k36.run(1, 1, 1, stream, k36.function, k36.packed_metadata, None, None, None, *args36)
        )
        for name, v in r.items():
            rows.setdefault(name, []).append(v)
    print(f"{torch.cuda.get_device_name()}: host time a call, median/min µs, 3 rounds")
    for name, vs in rows.items():
        print(f"{name:40s} " + "  ".join(f"{m:6.2f}/{mn:6.2f}" for m, mn in vs))


if __name__ == "__main__":
    main()
