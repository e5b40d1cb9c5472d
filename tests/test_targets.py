"""tools/targets.py: issue 5's rule on a saved bench document, time and (training) peak memory against the best
peer, the fastest other implementation that passed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from targets import history, table, targets  # noqa: E402


def _row(mode, name, impl, ms, mib=None, status="ok", floor=None):
    return {"mode": mode, "workload": name, "impl": impl, "ms": ms, "peak_mib": mib, "status": status,
            "floor_ms": floor}  # fmt: skip


def _doc(rows):
    return {"meta": {"device_name": "test card", "git_commit": "abc"}, "rows": rows}


def test_training_rows_need_time_and_memory():
    doc = _doc([
        _row("train", "fast-and-lean", "maxsim", 1.0, 10.0), _row("train", "fast-and-lean", "lik", 1.6, 10.0),
        _row("train", "fast-and-fat", "maxsim", 1.0, 67.0), _row("train", "fast-and-fat", "lik", 1.6, 29.0),
        _row("train", "fast-and-fat", "flash", 2.0, 20.0),  # (not the best peer: slower)
        _row("train", "slow", "maxsim", 1.2, 1.0), _row("train", "slow", "flash", 1.6, 2.0),
        _row("train", "peer-failed", "maxsim", 1.0, 50.0), _row("train", "peer-failed", "lik", 0.5, 1.0, "error"),
        _row("train", "peer-failed", "eager", 2.0, 90.0),
    ])  # fmt: skip
    got = {t["workload"]: (t["met"], t["time_met"], t["mem_met"]) for t in targets(doc)}
    assert got == {
        "fast-and-lean": (True, True, True),
        "fast-and-fat": (False, True, False),
        "slow": (False, False, True),
        "peer-failed": (True, True, True),
    }
    text = table(doc, markdown=True)
    assert "| 67.0 (29.0) | no (memory) |" in text and "| no (time) |" in text
    assert "2 of 4 maxsim rows meet their target (test card, commit abc)" in text


def test_inference_and_cpu_rows_ignore_memory():
    doc = _doc([
        _row("infer", "scan", "maxsim", 1.0, 500.0), _row("infer", "scan", "lik", 1.15, 1.0),
        _row("train", "cpu-step", "maxsim", 1.0), _row("train", "cpu-step", "eager", 1.5),
    ])  # fmt: skip
    assert [(t["met"], t["mib"]) for t in targets(doc)] == [(True, None), (True, None)]


def test_the_hosts_state_follows_the_table_where_the_run_recorded_it():
    rows = [_row("infer", "scan", "maxsim", 1.0), _row("infer", "scan", "lik", 1.15)]
    assert "host:" not in table(_doc(rows))
    doc = _doc(rows)
    probe = {"autograd_grad_us": 146.04, "eager_op_us": 8.21}
    doc["meta"]["host_us"] = {"start": probe, "end": dict(probe, autograd_grad_us=301.5)}
    last = table(doc, markdown=True).splitlines()[-1]
    assert last == ("host: start: a bare autograd.grad 146.0 µs, an eager op 8.2 µs; "
                    "end: a bare autograd.grad 301.5 µs, an eager op 8.2 µs")  # fmt: skip
    # the probe before a row with an absolute target (the tiny call, the small step) comes between them; other
    # rows' probes stay in the JSON
    tiny = [
        _row("infer", "cross-4x4-lq8-ld8-host", "maxsim", 0.03),
        _row("infer", "cross-4x4-lq8-ld8-host", "eager", 0.09),
    ]
    step = [_row("train", "cross-32x32-lq32-ld80", "maxsim", 0.3), _row("train", "cross-32x32-lq32-ld80", "lik", 0.9)]
    tiny[0]["host_us"] = {"autograd_grad_us": 120.0, "eager_op_us": 6.0}
    step[0]["host_us"] = {"autograd_grad_us": 200.0, "eager_op_us": 7.0}
    rows[0]["host_us"] = {"autograd_grad_us": 999.0, "eager_op_us": 9.0}
    doc = _doc(rows + tiny + step)
    doc["meta"]["host_us"] = {"start": probe, "end": probe}
    last = table(doc).splitlines()[-1]
    assert last == ("host: start: a bare autograd.grad 146.0 µs, an eager op 8.2 µs; "
                    "before infer/cross-4x4-lq8-ld8-host: a bare autograd.grad 120.0 µs, an eager op 6.0 µs; "
                    "before train/cross-32x32-lq32-ld80: a bare autograd.grad 200.0 µs, an eager op 7.0 µs; "
                    "end: a bare autograd.grad 146.0 µs, an eager op 8.2 µs")  # fmt: skip


def test_history_counts_each_rows_runs_met_and_names_the_commits_that_missed():
    def run(commit, scan_ms, step_ms):
        step = "cross-32x32-lq32-ld80"
        doc = _doc([
            _row("infer", "scan", "maxsim", scan_ms), _row("infer", "scan", "lik", 1.15),
            _row("train", step, "maxsim", step_ms), _row("train", step, "lik", 0.9),
        ])  # fmt: skip
        doc["meta"]["git_commit"] = commit
        return doc

    docs = [run("aaaaaaa111", 1.0, 0.15), run("bbbbbbb222", 1.0, 0.3), run("ccccccc333", 0.9, 0.25)]
    lines = history(docs).splitlines()
    scan = next(x for x in lines if x.startswith("infer") and " scan " in x)
    step = next(x for x in lines if "cross-32x32" in x)
    assert "3 of 3" in scan and "0.9 / 1 / 1" in scan and scan.rstrip().endswith("-")
    # the small step misses its absolute 0.2 ms in the two slower runs (a peer 3x slower does not save it)
    assert "1 of 3" in step and "0.15 / 0.25 / 0.3" in step and step.rstrip().endswith("bbbbbbb ccccccc")
    assert lines[-1] == "1 of 2 rows met in all 3 runs"
    md = history(docs, markdown=True).splitlines()
    assert md[0] == "| mode | workload | met | maxsim ms (min / median / max) | missed in |"
    assert "| train | cross-32x32-lq32-ld80 | 1 of 3 | 0.15 / 0.25 / 0.3 | bbbbbbb ccccccc |" in md
