"""A ragged training step against its padded twin, exactly as ``maxsim bench`` calls them (GPU).

For each named ragged workload, ``maxsim`` (``maxsim_varlen`` / ``maxsim_pairs_varlen`` on the packed tokens) and
``maxsim-padded`` (``maxsim.maxsim`` with masks on the same tokens padded) through the bench's own timed unit
(``runner.make_call``): host time per call without synchronizing, the stream's time (``do_bench``: whichever of host
and device is slower) in 3 interleaved rounds, then the GPU time of each kernel (torch.profiler, 10 calls). Tells a
ragged row that trails its padded twin by host time from one that trails by GPU work.

Usage: python tools/ragged_vs_padded.py [--mode train|infer] WORKLOAD [WORKLOAD ...]
  e.g. python tools/ragged_vs_padded.py pairlist-64x32-lq32-ld180 pairlist-64x32-lq8-32-ld20-1000-pool1024
"""

from __future__ import annotations

import argparse

import torch
from host_profile import host_us  # tools/ is on sys.path when this runs as a script
from probe_common import kernel_table
from triton.testing import do_bench

from maxsim.bench import peers, runner, workloads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+", help="ragged workload names or patterns (varlen-*, pairlist-*)")
    ap.add_argument("--mode", choices=workloads.MODES, default="train")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(16, device=dev, requires_grad=True)
    floor = host_us(lambda: torch.autograd.grad((x * 2).sum(), x), 1000)
    print(f"engine floor (autograd.grad of (x * 2).sum()): host {floor:.1f} us")
    calls = {}
    for w in workloads.select(args.mode, args.workloads):
        if not w.ragged:
            raise SystemExit(f"{w.key} is not a ragged workload")
        inp = workloads.make_inputs(w, dev, dt)
        for impl in (peers.MaxsimImpl(), peers.MaxsimPaddedImpl()):
            fn, operands = impl.prepare_ragged(w, inp, dev, dt)
            calls[f"{w.key} {impl.name}"] = runner.make_call(w, fn, operands)
    for rnd in range(args.rounds):
        for label, call in calls.items():
            host = host_us(call, 300)
            stream = do_bench(call, warmup=25, rep=100) * 1e3
            print(f"round {rnd} {label:64s} host {host:7.1f} us  stream {stream:7.1f} us", flush=True)
    for label, call in calls.items():
        kernel_table(label, call, host=True, rows=14)


if __name__ == "__main__":
    main()
