"""Where the autograd engine's thread sits against the calling thread, and what it costs a host-bound step.

A CUDA backward hands its graph to the engine's device thread (``pt_autograd_<n>``) and the caller sleeps until it
is done. This pins the calling thread and the engine's threads in several ways, in one process, and times under
each, in interleaved rounds: a bare ``autograd.grad`` (host-timed and timed as the bench times rows), an eager op,
the tiny call's host time (maxsim and eager) and the two smallest training steps of the matrix (maxsim and eager),
with the bench's own timers. ``free`` also prints where the scheduler had put the two threads (their last CPUs).

Usage (GPU machine): ``PYTHONPATH=src python tools/pin_probe.py [--rounds 5]``. Run 84's output (H200):
``benchmarks/results/partial/h200-run84-pin-probe.txt``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from maxsim.bench.affinity import engine_threads
from maxsim.bench.peers import EagerImpl, MaxsimImpl
from maxsim.bench.runner import _host_ms, make_call, make_timer
from maxsim.bench.workloads import make_inputs, select


def last_cpu(tid: int) -> int:
    return int(Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[36])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    timer = make_timer(dev, 25, 100)
    calls = {}
    for w in select("train", ["cross-32x32-lq32-ld80", "cross-64x64-lq32-ld128"]):
        inp = make_inputs(w, dev, torch.bfloat16)
        for impl in (MaxsimImpl(), EagerImpl()):
            calls[f"{impl.name}:{w.name}"] = make_call(w, impl.scorer(w, dev, torch.bfloat16), inp)
    tiny_w = select("infer", ["cross-4x4-lq8-ld8-host"])[0]
    tiny_in = make_inputs(tiny_w, dev, torch.bfloat16)
    impls = (MaxsimImpl(), EagerImpl())
    tiny = {i.name: make_call(tiny_w, i.scorer(tiny_w, dev, torch.bfloat16), tiny_in) for i in impls}
    x = torch.randn(1024, device=dev, requires_grad=True)
    xd, out = x.detach(), torch.empty(1024, device=dev)

    def grad():
        return torch.autograd.grad((x * 2).sum(), (x,))

    def op():
        return torch.neg(xd, out=out)

    for c in calls.values():
        c()
    grad()
    sync()
    main_tid, engine = threading.get_native_id(), engine_threads()
    allowed = sorted(os.sched_getaffinity(0))
    print(f"calling thread {main_tid}, engine threads {engine}, CPUs {allowed}")

    def cpu(i: int) -> set[int]:
        return {allowed[i % len(allowed)]}

    configs = {
        "free": (set(allowed), set(allowed)),
        "same2": (cpu(2), cpu(2)),
        "apart2-3": (cpu(2), cpu(3)),
        "apart2-10": (cpu(2), cpu(10)),
        "same9": (cpu(9), cpu(9)),
    }
    results: dict[str, dict[str, list]] = {k: {} for k in configs}
    for rnd in range(args.rounds):
        order = list(configs.items())
        for name, (caller, eng) in order if rnd % 2 == 0 else order[::-1]:
            os.sched_setaffinity(0, caller)
            for tid in engine:
                os.sched_setaffinity(tid, eng)
            time.sleep(0.05)
            r = results[name]
            r.setdefault("grad_host", []).append(_host_ms(grad, 25, 100, sync) * 1e3)
            r.setdefault("grad_timed", []).append(timer(grad) * 1e3)
            r.setdefault("op_timed", []).append(timer(op) * 1e3)
            for impl, call in tiny.items():
                r.setdefault(f"{impl}:tiny_host", []).append(_host_ms(call, 25, 100, sync) * 1e3)
            for key, call in calls.items():
                r.setdefault(key, []).append(timer(call) * 1e3)
            if name == "free":
                r.setdefault("last CPUs (caller, engine)", []).append((last_cpu(main_tid), *map(last_cpu, engine)))
    os.sched_setaffinity(0, set(allowed))
    for tid in engine:
        os.sched_setaffinity(tid, set(allowed))
    for name, r in results.items():
        print(f"== {name}")
        for key, values in r.items():
            if key.startswith("last"):
                print(f"   {key}: {values}")
            else:
                rounds = " ".join(f"{v:7.1f}" for v in values)
                print(f"   {key:40s} median {statistics.median(values):8.1f} µs  rounds {rounds}")


if __name__ == "__main__":
    main()
