"""A bench run saves its JSON after every workload, so that a run stopped midway leaves what it finished."""

from __future__ import annotations

import json

import pytest

from maxsim.bench import report, runner
from maxsim.cli import main

ARGV = ["bench", "--quick", "--device", "cpu", "--no-progress", "--rep-ms", "2", "--warmup-ms", "1"]
ONLY = ["--only", "infer/cross-32x32-lq32-ld80", "train/cross-32x32-lq32-ld80", "--impl", "maxsim", "eager"]


def test_a_run_stopped_after_its_first_workload_leaves_that_workloads_rows(tmp_path, monkeypatch, capsys):
    saved = report.save_json
    calls = []

    def save_then_stop(result, out):
        path = saved(result, out)
        calls.append(json.loads(path.read_text()))
        raise KeyboardInterrupt  # (the time limit's kill, after the first save)

    monkeypatch.setattr(report, "save_json", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        main([*ARGV, *ONLY, "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "cpu.json").read_text())
    assert doc == calls[0] and len(calls) == 1
    report.validate_json(doc)
    assert doc["meta"]["partial"] == "1 of 2 workloads"
    assert {(r["mode"], r["workload"], r["impl"]) for r in doc["rows"]} == {
        ("infer", "cross-32x32-lq32-ld80", "maxsim"),
        ("infer", "cross-32x32-lq32-ld80", "eager"),
    }
    ours = next(r for r in doc["rows"] if r["impl"] == "maxsim")
    assert ours["status"] == "ok" and ours["ms"] > 0 and ours["vs_eager"] > 0  # (ratios filled in)
    assert not (tmp_path / "cpu.md").exists() and not list(tmp_path.glob("*.tmp"))
    # the saved rows render as a report that says the run did not finish
    monkeypatch.setattr(report, "save_json", saved)
    assert main(["bench", "--from-json", str(tmp_path / "cpu.json")]) == 0
    assert "Partial run: saved after 1 of 2 workloads; the run did not finish." in (tmp_path / "cpu.md").read_text()


def test_a_finished_run_saves_after_each_workload_and_ends_whole(tmp_path, monkeypatch, capsys):
    saved = report.save_json
    seen = []

    def spy(result, out):
        seen.append((result.meta.get("partial"), len(result.rows)))
        return saved(result, out)

    monkeypatch.setattr(report, "save_json", spy)
    assert main([*ARGV, *ONLY, "--out", str(tmp_path)]) == 0
    assert seen == [("1 of 2 workloads", 2), ("2 of 2 workloads", 4), (None, 4)]
    doc = json.loads((tmp_path / "cpu.json").read_text())
    assert "partial" not in doc["meta"] and len(doc["rows"]) == 4
    assert "Partial run" not in (tmp_path / "cpu.md").read_text()


def test_save_json_replaces_the_file_whole(tmp_path):
    rows = [runner.Row("w", "infer", "cross", "", {"Nq": 1}, "bf16", "maxsim", "h200", ms=0.1)]
    meta = {k: None for k in report.META_FIELDS} | {"card": "h200", "dtype": "bf16", "quick": False, "torch": "2.x"}
    path = report.save_json(runner.Result(meta=meta, rows=rows), tmp_path / "new")
    assert path == tmp_path / "new" / "h200.json" and report.load(path).rows[0].ms == 0.1
    bad = runner.Result(meta={"card": "h200"}, rows=rows)  # (not a valid document: the old file stays)
    with pytest.raises(ValueError):
        report.save_json(bad, tmp_path / "new")
    assert report.load(path).rows[0].ms == 0.1 and not list((tmp_path / "new").glob("*.tmp"))
