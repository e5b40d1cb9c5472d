"""Timing on one CPU: the calling thread and the autograd engine's device threads pinned together.

A training call on a GPU ends in ``torch.autograd.grad``, which hands the graph to the autograd engine's thread for
that device (``pt_autograd_<n>``) and sleeps until the thread is done: two thread hand-offs a step, whatever the
implementation. On the lent GPU hosts (KVM guests, 16 vCPUs) a hand-off to a thread that the scheduler placed on
another vCPU wakes that vCPU, and the scheduler moves the two threads about between calls; the same small step then
measures 0.10 to 0.45 ms within minutes (run 83). Run 84 (H200, one process, five rounds, medians): the small training
step 85 and 93 µs with both threads on one vCPU, 181 free, 181 and 213 on two vCPUs; eager's 290 and 346 against 548
free; a tiny call's host time 17 µs against 24 (``docs/performance.md``, run 84). So the bench times every row, and
its host probes, with the threads pinned to one CPU (:class:`OneCpu`), every implementation alike, and says so in
its results; ``maxsim bench --no-pin`` times them wherever the scheduler puts them.

Only the timing is pinned: preparing, checking and compiling (``torch.compile``'s worker processes inherit the
affinity of the thread that starts them) run on every CPU. Linux only (``os.sched_setaffinity`` and ``/proc``);
elsewhere :class:`OneCpu` does nothing and says so (``cpu`` is None).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import torch

#: Name prefix of the autograd engine's device threads (their ``comm`` under ``/proc``).
ENGINE_THREAD_PREFIX = "pt_autograd_"


def engine_threads(task_dir: Path = Path("/proc/self/task")) -> list[int]:
    """Thread ids of this process's autograd device threads (empty where there are none, or no ``/proc``)."""
    tids = []
    try:
        entries = list(task_dir.iterdir())
    except OSError:
        return []
    for entry in entries:
        try:
            if (entry / "comm").read_text().startswith(ENGINE_THREAD_PREFIX):
                tids.append(int(entry.name))
        except (OSError, ValueError):
            continue  # (a thread that ended meanwhile)
    return sorted(tids)


def thread_cpu_seconds(task_dir: Path = Path("/proc/self/task")) -> dict[int, tuple[str, float]]:
    """``tid -> (comm, user + system CPU seconds)`` of this process's threads (empty where there is no ``/proc``)."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    try:
        entries = list(task_dir.iterdir())
    except OSError:
        return {}
    for entry in entries:
        try:
            text = (entry / "stat").read_text()
            end = text.rfind(")")  # (comm may hold spaces and parentheses)
            fields = text[end + 2 :].split()
            out[int(entry.name)] = (text[text.find("(") + 1 : end], (int(fields[11]) + int(fields[12])) / hz)
        except (OSError, ValueError, IndexError):
            continue  # (a thread that ended meanwhile)
    return out


def stray_thread_seconds(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> float:
    """CPU seconds that this process's threads other than the calling one and the autograd engine's used between
    two :func:`thread_cpu_seconds` readings (a thread started meanwhile counts from zero): a compile pool's reader,
    a library's spinning helper, work the pinned timing competes with for the host although no other process does."""
    caller = threading.get_native_id()
    total = 0.0
    for tid, (comm, secs) in after.items():
        if tid == caller or comm.startswith(ENGINE_THREAD_PREFIX):
            continue
        total += max(0.0, secs - before.get(tid, (comm, 0.0))[1])
    return total


def quiet_cpu(allowed: set[int], interrupts: Path = Path("/proc/interrupts")) -> int:
    """The CPU of ``allowed`` that has served the fewest device interrupts since boot (the numbered lines of
    ``/proc/interrupts``), the highest-numbered among equals, or simply the highest where the file is unreadable.
    Run 84's second host (H200) sent every interrupt of its virtio queue to CPU 15, about 20 a second through a
    matrix run, and the highest-numbered CPU was where the first rule of this module had pinned the timing."""
    try:
        lines = interrupts.read_text().splitlines()
        cpus = [int(name.removeprefix("CPU")) for name in lines[0].split()]
    except (OSError, IndexError, ValueError):
        return max(allowed)
    served = dict.fromkeys(cpus, 0)
    for line in lines[1:]:
        label, _, rest = line.partition(":")
        if not label.strip().isdigit():
            continue  # (the per-CPU kinds: timer, rescheduling, function calls, TLB shootdowns)
        for cpu, count in zip(cpus, rest.split(), strict=False):
            if not count.isdigit():
                break  # (the line's counts end where its chip and name begin)
            served[cpu] += int(count)
    return min(allowed, key=lambda cpu: (served.get(cpu, 0), -cpu))


def _start_engine_threads(device: torch.device) -> None:
    """The engine starts its device threads at the first backward on a device; the pin must find them."""
    x = torch.ones(1, device=device, requires_grad=True)
    torch.autograd.grad(x.sum(), (x,))


class OneCpu:
    """``with OneCpu(device):`` pins the calling thread and the autograd engine's device threads to one CPU, the
    one the calling thread may use that has served the fewest device interrupts (:func:`quiet_cpu`), and restores
    each thread's own affinity on exit. ``cpu`` is
    the CPU chosen, None when nothing was pinned (``enabled`` False, a CPU device, whose PyTorch path runs on
    intra-op threads of its own, or no ``sched_setaffinity``). Syncs: on a GPU, one
    backward of a one-element tensor the first time the engine's threads do not exist yet."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled and device.type == "cuda" and hasattr(os, "sched_setaffinity")
        self.cpu: int | None = None
        self._saved: dict[int, set[int]] = {}

    def __enter__(self) -> OneCpu:
        if not self.enabled:
            return self
        threads = engine_threads()
        if not threads:
            _start_engine_threads(self.device)
            threads = engine_threads()
        self.cpu = quiet_cpu(os.sched_getaffinity(0))
        for tid in (0, *threads):  # (0: the calling thread; sched_setaffinity takes a thread's id on Linux)
            try:
                self._saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {self.cpu})
            except OSError:
                self._saved.pop(tid, None)  # (a thread that ended, or a mask this process may not set)
        return self

    def __exit__(self, *exc: object) -> None:
        for tid, mask in self._saved.items():
            with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
                os.sched_setaffinity(tid, mask)
        self._saved.clear()
