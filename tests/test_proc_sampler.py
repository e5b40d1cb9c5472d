"""``tools/proc_sampler.py``: it names a process that keeps a CPU busy, with the machine's busy CPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "proc_sampler.py"

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc")


def test_the_sampler_names_a_busy_process_once_a_sample(tmp_path):
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
    try:
        out = tmp_path / "samples"
        # (--gpu: GPU 0's clocks where NVML is, said once and left out where it is not)
        cmd = [sys.executable, str(TOOL), str(out), "--seconds", "1.2", "--interval", "0.4", "--gpu"]
        subprocess.run(cmd, check=True)
    finally:
        spin.kill()
        spin.wait()
    lines = out.read_text().splitlines()
    assert len(lines) == 3  # (one line a sample: the spinner's multi-line -c code comes out on one)
    for line in lines:
        head, *procs = line.split(" | ")
        t, sys_, busy_, busy, steal_, steal = head.split()
        assert (sys_, busy_, steal_) == ("sys", "busy", "steal") and float(t) > 0 and float(steal) >= 0
        assert float(busy) >= 0.5
        if procs and procs[0].startswith("gpu sm "):
            _, _, mhz, unit, _, util, pct = procs.pop(0).split()
            assert int(mhz) >= 0 and unit == "MHz" and 0 <= int(util) <= 100 and pct == "%"
        mine = [p for p in procs if p.startswith(f"{spin.pid}:")]
        assert len(mine) == 1 and float(mine[0].split(":")[2]) >= 30, line  # (shares 2 CPUs with the suite)
