"""Sample what the machine's CPUs do while something else runs (Linux, ``/proc``): every ``--interval`` seconds one
line with the epoch time, the CPUs busy and stolen since the last sample (``/proc/stat``) and every process that used
at least ``--min-pct`` % of a CPU meanwhile (``pid:comm:pct:cmdline``); with ``--gpu``, first GPU 0's SM clock and
utilization at that moment (NVML through ctypes; said once on stderr and left out where there is no NVML).

Made for the lent GPU hosts, whose host-bound rows (the tiny call, the small training step) move 2-4x within minutes:
run it beside a benchmark and line its samples up with the benchmark's timestamped progress lines, e.g.

    setsid python tools/proc_sampler.py $OUT/samples --gpu < /dev/null > /dev/null 2>&1 &  SP=$!
    python -m maxsim bench --mode all --out $OUT/run 2> >(while IFS= read -r l; do
        printf '%s %s\\n' "$EPOCHREALTIME" "$l"; done > $OUT/progress)
    kill -- -$SP

(its own cost: a read of every ``/proc/<pid>/stat`` a sample, a few ms of one CPU). Run 83 found with it that the
small step's slow patches come with no other process busy and no steal (docs/performance.md, run 83).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path


def cpu_seconds() -> tuple[float, float]:
    """(busy, stolen) seconds of all CPUs together since boot."""
    with open("/proc/stat") as f:
        t = [int(v) for v in f.readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    return (t[0] + t[1] + t[2] + t[5] + t[6]) / hz, t[7] / hz


def process_ticks() -> dict[int, tuple[str, int]]:
    """``pid -> (comm, user + system ticks)`` of every process readable now."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            text = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        end = text.rfind(")")  # (comm may hold spaces and parentheses)
        fields = text[end + 2 :].split()
        out[int(d)] = (text[text.find("(") + 1 : end], int(fields[11]) + int(fields[12]))
    return out


def cmdline(pid: int, width: int = 90) -> str:
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
    return " ".join(text.replace("\0", " ").split())[:width]  # (one line a sample: no newlines from ``-c`` code)


class GpuClock:
    """GPU 0's SM clock (MHz) and utilization (% of the last sample period NVML keeps) through NVML's C API;
    raises OSError where there is no NVML or no GPU."""

    SM = 1  # (nvmlClockType_t NVML_CLOCK_SM)

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlInit_v2() != 0 or self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)) != 0:
            raise OSError("NVML found no GPU 0")

    def sample(self) -> str:
        mhz, util = ctypes.c_uint(), (ctypes.c_uint * 2)()  # (nvmlUtilization_t: gpu, memory)
        self.lib.nvmlDeviceGetClockInfo(self.handle, self.SM, ctypes.byref(mhz))
        self.lib.nvmlDeviceGetUtilizationRates(self.handle, ctypes.byref(util))
        return f"gpu sm {mhz.value} MHz util {util[0]} % | "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="file the samples go to (one line each, flushed)")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--min-pct", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long (default: until killed)")
    ap.add_argument("--gpu", action="store_true", help="also GPU 0's SM clock and utilization (NVML)")
    a = ap.parse_args()
    gpu = None
    if a.gpu:
        try:
            gpu = GpuClock()
        except OSError as e:
            print(f"proc_sampler: no GPU clocks ({e})", file=sys.stderr)
    hz = os.sysconf("SC_CLK_TCK")
    prev, prev_cpu, prev_t = process_ticks(), cpu_seconds(), time.time()
    stop = None if a.seconds is None else prev_t + a.seconds
    with a.out.open("w") as log:
        while stop is None or time.time() < stop:
            time.sleep(a.interval)
            cur, cur_cpu, now = process_ticks(), cpu_seconds(), time.time()
            dt = now - prev_t
            busy = []
            for pid, (comm, ticks) in cur.items():
                pct = (ticks - prev[pid][1]) / hz / dt * 100 if pid in prev else 0.0
                if pct >= a.min_pct:
                    busy.append(f"{pid}:{comm}:{pct:.0f}:{cmdline(pid)}")
            cpus = (cur_cpu[0] - prev_cpu[0]) / dt, (cur_cpu[1] - prev_cpu[1]) / dt
            clocks = gpu.sample() if gpu is not None else ""
            log.write(f"{now:.2f} sys busy {cpus[0]:.1f} steal {cpus[1]:.1f} | {clocks}" + " | ".join(busy) + "\n")
            log.flush()
            prev, prev_cpu, prev_t = cur, cur_cpu, now


if __name__ == "__main__":
    main()
