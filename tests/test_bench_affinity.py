"""The bench's timing on one CPU (maxsim.bench.affinity): which threads it pins, to what, and that it puts them back."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from pathlib import Path

import pytest
import torch

from maxsim.bench import affinity, report, runner
from maxsim.bench.affinity import OneCpu, engine_threads

linux_affinity = pytest.mark.skipif(
    not (hasattr(os, "sched_setaffinity") and Path("/proc/self/task").is_dir()), reason="Linux thread affinity"
)


class _NamedThread:
    """A thread whose kernel name (``comm``, what :func:`engine_threads` reads) is ``name``, parked until closed."""

    def __init__(self, name: str) -> None:
        self.name, self.tid = name, None
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _main(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        assert libc.prctl(15, self.name.encode(), 0, 0, 0) == 0  # (15: PR_SET_NAME, the calling thread's comm)
        self.tid = threading.get_native_id()
        self._ready.set()
        self._stop.wait()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@linux_affinity
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPUs to tell the threads' masks apart")
def test_one_cpu_pins_the_caller_and_the_engines_threads_together_and_puts_them_back():
    allowed = sorted(os.sched_getaffinity(0))
    engine, other = _NamedThread("pt_autograd_7"), _NamedThread("some_worker")
    try:
        # the caller may run on its first CPU only and the engine's thread on another, so that pinning the engine's
        # thread shows, and restoring each thread's own mask is told from resetting both to one
        os.sched_setaffinity(0, {allowed[0]})
        os.sched_setaffinity(engine.tid, {allowed[-1]})
        other_mask = os.sched_getaffinity(other.tid)
        assert engine.tid in engine_threads() and other.tid not in engine_threads()
        with OneCpu(torch.device("cuda")) as one:
            assert one.cpu == allowed[0]
            assert os.sched_getaffinity(0) == {one.cpu} == os.sched_getaffinity(engine.tid)
            assert os.sched_getaffinity(other.tid) == other_mask  # (only the engine's threads go with the caller)
        assert os.sched_getaffinity(0) == {allowed[0]} and os.sched_getaffinity(engine.tid) == {allowed[-1]}
        assert os.sched_getaffinity(other.tid) == other_mask
    finally:
        os.sched_setaffinity(0, set(allowed))
        engine.close()
        other.close()


_INTERRUPTS = """\
           CPU0       CPU1       CPU2       CPU3
  1:          9          0          0          0  IO-APIC   1-edge      i8042
 31:          0          0          0      10976  PCI-MSIX-0000:00:01.0   1-edge      virtio0-req.0
 40:          0          0          5          0  PCI-MSIX-0000:00:05.0   0-edge      nvidia
NMI:          0          0          0          0   Non-maskable interrupts
LOC:      37824      14495      12285      99082   Local timer interrupts
CAL:      17294       7281       2863       1894   Function call interrupts
ERR:          0
"""


def test_quiet_cpu_takes_the_allowed_cpu_with_the_fewest_device_interrupts(tmp_path):
    path = tmp_path / "interrupts"
    path.write_text(_INTERRUPTS)
    # device lines only: CPU0 9, CPU1 0, CPU2 5, CPU3 10976 (the timer and function-call counts do not count)
    assert affinity.quiet_cpu({0, 1, 2, 3}, path) == 1
    assert affinity.quiet_cpu({0, 2, 3}, path) == 2
    assert affinity.quiet_cpu({3}, path) == 3
    path.write_text(_INTERRUPTS.replace("      0          5  ", "      0          0  "))
    assert affinity.quiet_cpu({0, 1, 2, 3}, path) == 2  # (ties: the highest-numbered)
    assert affinity.quiet_cpu({5, 7}, path) == 7  # (CPUs the file does not list: none served)
    assert affinity.quiet_cpu({0, 1, 2, 3}, tmp_path / "absent") == 3
    path.write_text("")
    assert affinity.quiet_cpu({0, 1}, path) == 1


@linux_affinity
def test_one_cpu_takes_the_quiet_cpu_of_those_the_caller_may_use(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    engine = _NamedThread("pt_autograd_3")
    picked = []
    monkeypatch.setattr(affinity, "quiet_cpu", lambda cpus: picked.append(set(cpus)) or min(cpus))
    try:
        for mask in (allowed, allowed[-2:], allowed[-1:]):
            os.sched_setaffinity(0, set(mask))
            with OneCpu(torch.device("cuda")) as one:
                assert picked[-1] == set(mask)
                assert one.cpu == mask[0] and os.sched_getaffinity(0) == {mask[0]}
            assert os.sched_getaffinity(0) == set(mask)
    finally:
        os.sched_setaffinity(0, set(allowed))
        engine.close()


def test_one_cpu_pins_nothing_on_a_cpu_device_or_when_disabled(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: calls.append(a), raising=False)
    for device, enabled in ((torch.device("cpu"), True), (torch.device("cuda"), False)):
        with OneCpu(device, enabled) as one:
            assert one.cpu is None
    assert calls == []


def test_engine_threads_reads_the_threads_names(tmp_path):
    for tid, name in ((11, "python"), (12, "pt_autograd_0"), (13, "pt_autograd_1"), (14, "pt_main_thread")):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "comm").write_text(name + "\n")
    (tmp_path / "15").mkdir()  # (a thread that ended between the listing and the read: no comm)
    assert engine_threads(tmp_path) == [12, 13]
    assert engine_threads(tmp_path / "absent") == []


def test_the_report_says_where_the_rows_were_timed():
    rows = [runner.Row("w", "infer", "cross", "", {"Nq": 1}, "bf16", "maxsim", "h200", ms=0.1)]
    meta = {"card": "h200", "dtype": "bf16", "quick": False, "pinned_cpu": 5}
    md = report.markdown(runner.Result(meta=meta, rows=rows))
    assert "Timed with the calling thread and the autograd engine's threads on one CPU (5; `--no-pin`" in md
    free = report.markdown(runner.Result(meta={**meta, "pinned_cpu": None}, rows=rows))
    assert "one CPU" not in free
    merged = report.markdown(report.merge([runner.Result(meta=meta, rows=rows), runner.Result(meta=meta, rows=rows)]))
    assert merged.count("Timed on CPU 5.") == 2 and "one CPU" not in merged


def test_cli_no_pin_reaches_the_runner(monkeypatch):
    from maxsim.cli import main

    seen = {}

    def fake_run(workloads, impls, **kw):
        seen.update(kw)
        return runner.Result(meta={"card": "cpu", "dtype": "fp32", "quick": True}, rows=[])

    monkeypatch.setattr(runner, "run", fake_run)
    for argv, pin in ((["--no-pin"], False), ([], True)):
        assert main(["bench", "--quick", "--device", "cpu", "--only", "infer/cross-32x32-lq32-ld80", *argv]) == 0
        assert seen["pin"] is pin


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@linux_affinity
def test_a_gpu_run_times_its_rows_with_the_engines_thread_on_the_callers_cpu(monkeypatch):
    from maxsim.bench.peers import EagerImpl
    from maxsim.bench.workloads import select

    device = torch.device("cuda", torch.cuda.current_device())
    seen, roofline = [], []
    timer, measure_roofline = runner.make_timer, runner.measure_roofline

    def spying_timer(*a, **kw):
        inner = timer(*a, **kw)

        def timed(fn):
            if not roofline:  # (the card's copy and matmul rates, measured before the run pins: not a row)
                seen.append((os.sched_getaffinity(0), [os.sched_getaffinity(t) for t in engine_threads()]))
            return inner(fn)

        return timed

    def spied_roofline(*a, **kw):
        roofline.append(True)
        try:
            return measure_roofline(*a, **kw)
        finally:
            roofline.pop()

    monkeypatch.setattr(runner, "make_timer", spying_timer)
    monkeypatch.setattr(runner, "measure_roofline", spied_roofline)
    before = os.sched_getaffinity(0)
    ws = select("train", ["cross-32x32-lq32-ld80"], quick=True)
    res = runner.run(ws, [EagerImpl()], device=device, dtype=torch.float32, warmup_ms=1, rep_ms=2, progress=False)
    cpu = res.meta["pinned_cpu"]
    assert cpu in before and res.rows[0].status == "ok" and res.rows[0].host_us["cpu"] == cpu
    rows_timed = [s for s in seen if s[1]]
    assert rows_timed and all(caller == {cpu} and all(m == {cpu} for m in eng) for caller, eng in rows_timed)
    assert os.sched_getaffinity(0) == before and all(os.sched_getaffinity(t) == before for t in engine_threads())
    free = runner.run(
        ws, [EagerImpl()], device=device, dtype=torch.float32, warmup_ms=1, rep_ms=2, progress=False, pin=False
    )
    assert free.meta["pinned_cpu"] is None and "cpu" not in free.rows[0].host_us


def test_thread_cpu_seconds_reads_each_threads_name_and_ticks(tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    rest = "S 1 1 1 0 -1 4194560 10 0 0 0 {u} {s} 0 0 20 0 9 0 100 0 0"
    for tid, comm, u, s in ((11, "python", 3 * hz, hz), (12, "pt_autograd_0", hz, 0), (13, "a (b) c", 0, hz // 2)):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "stat").write_text(f"{tid} ({comm}) " + rest.format(u=u, s=s))
    (tmp_path / "14").mkdir()  # (a thread that ended between the listing and the read)
    got = affinity.thread_cpu_seconds(tmp_path)
    assert got == {11: ("python", 4.0), 12: ("pt_autograd_0", 1.0), 13: ("a (b) c", 0.5)}


def test_stray_thread_seconds_leaves_out_the_caller_and_the_engines_threads():
    me = threading.get_native_id()
    before = {me: ("python", 1.0), 7: ("pt_autograd_0", 1.0), 8: ("pool", 2.0)}
    after = {me: ("python", 9.0), 7: ("pt_autograd_0", 5.0), 8: ("pool", 2.5), 9: ("new", 0.25)}
    assert affinity.stray_thread_seconds(before, after) == pytest.approx(0.75)
