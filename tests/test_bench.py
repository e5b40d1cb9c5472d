"""The benchmark harness's own logic (maxsim.bench, ``maxsim bench``), on CPU.

Covers the workload table, inputs, the fp32 reference and the correctness judge (FAIL marking, tie-robust
gradient check), the roofline and ratio arithmetic, the skipping of missing peers, the JSON schema and the
outputs, and the command line in-process on a tiny subset. The full ``--quick`` run is marked slow.

Ragged workloads (``varlen``, ``pairlist``): the table, the seeded length draws, the counts, the padded and
per-pair layouts other implementations run on (and the maps of their outputs back), the ragged fp32 reference,
the ``vs padded`` ratio, the schema's optional fields, and a ``--quick`` run through the real ragged functions on
the "torch" backend.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import maxsim
from maxsim import reference as ref_impl
from maxsim.bench import peers, ragged, report, runner, workloads
from maxsim.bench.peers import EagerImpl, Impl, MaxsimImpl, MaxsimPaddedImpl
from maxsim.bench.runner import Roofline, Row, compute_ratios, judge, make_call, roofline_floor
from maxsim.bench.workloads import Workload, make_inputs, select
from maxsim.cli import main

CPU = torch.device("cpu")


def _stand_in() -> MaxsimImpl:
    """This library's adapter on the plain-PyTorch reference: fast to run and independent of the kernels."""
    return MaxsimImpl(cross=ref_impl.maxsim, pairs=ref_impl.maxsim_pairs)


def _tiny(mode: str, layout: str) -> Workload:
    nd = 4 if layout == "pairs" else 5
    return Workload(mode=mode, layout=layout, nq=4, nd=nd, lq=6, ld=9, dim=16)


LAYOUTS = ("cross", "candidates", "pairs")


# ---- workload table ------------------------------------------------------------------------------------------
# (mode, layout, Nq, Nd or K or B, Lq, Ld, dim) exactly as issue 3 lists them.
ISSUE_3 = {
    ("infer", "cross", 32, 32, 32, 80, 128),
    ("infer", "cross", 1, 1000, 32, 300, 128),
    ("infer", "cross", 1, 1000, 32, 1024, 128),
    ("infer", "cross", 1, 10000, 32, 300, 128),
    ("infer", "cross", 32, 65536, 32, 256, 128),
    ("infer", "cross", 1, 500, 1024, 1024, 128),
    ("infer", "cross", 128, 128, 32, 300, 128),
    ("infer", "candidates", 32, 100, 32, 256, 128),
    ("infer", "candidates", 32, 50, 32, 180, 128),
    ("infer", "cross", 1, 4000, 32, 1024, 64),
    ("train", "cross", 32, 32, 32, 80, 128),
    ("train", "cross", 64, 64, 32, 128, 128),
    ("train", "cross", 256, 256, 32, 300, 128),
    ("train", "cross", 64, 64, 32, 1024, 128),
    ("train", "candidates", 64, 32, 32, 180, 128),
    ("train", "candidates", 256, 16, 32, 300, 128),
    ("train", "cross", 32, 32, 1024, 1024, 128),
    ("train", "pairs", 512, 512, 32, 300, 128),
}


# design.md §7's H100 table adds one row to issue 3's matrix.
DESIGN_H100 = {("infer", "cross", 1, 1000, 32, 1024, 48)}
# Issue 5's shapes off the matrix (dim 48/96, Lq 23, Ld 333, K 7, Nq 7), where the margins must hold too.
OFF_MATRIX = {
    ("infer", "cross", 7, 1000, 23, 333, 96),
    ("infer", "candidates", 32, 7, 23, 333, 48),
    ("train", "cross", 64, 64, 23, 333, 96),
    ("train", "candidates", 64, 7, 23, 333, 48),
}


# Issue 5's launch-overhead target: a forward call on cross 4x4 Lq8 Ld8, timed as host time per call.
LAUNCH = {("infer", "cross", 4, 4, 8, 8, 128)}


def test_workload_table_matches_issue():
    dense = [w for w in workloads.WORKLOADS if not w.ragged]
    got = {(w.mode, w.layout, w.nq, w.nd, w.lq, w.ld, w.dim) for w in dense}
    assert got == ISSUE_3 | DESIGN_H100 | OFF_MATRIX | LAUNCH
    assert len(dense) == len(ISSUE_3) + len(DESIGN_H100) + len(OFF_MATRIX) + len(LAUNCH)
    host = {(w.mode, w.layout, w.nq, w.nd, w.lq, w.ld, w.dim) for w in workloads.WORKLOADS if w.timing == "host"}
    assert host == LAUNCH
    assert all(w.note == "off-matrix" for w in dense if (w.mode, w.layout, w.nq, w.nd, w.lq, w.ld, w.dim) in OFF_MATRIX)
    keys = [w.key for w in workloads.WORKLOADS]
    assert len(set(keys)) == len(keys)
    assert all(w.note for w in workloads.WORKLOADS)


def test_workload_names_and_shapes():
    w = Workload("infer", "candidates", 32, 100, 32, 256)
    assert w.name == "cand-32x100-lq32-ld256"
    assert w.shape() == {"Nq": 32, "K": 100, "Lq": 32, "Ld": 256, "dim": 128}
    assert w.d_shape() == (32, 100, 256, 128) and w.out_shape() == (32, 100)
    p = Workload("train", "pairs", 512, 512, 32, 300)
    assert p.name == "pairs-512-lq32-ld300" and p.shape()["B"] == 512 and p.out_shape() == (512,)
    e = Workload("infer", "cross", 1, 4000, 32, 1024, dim=64)
    assert e.name == "cross-1x4000-lq32-ld1024-d64" and e.d_shape() == (4000, 1024, 64)
    with pytest.raises(ValueError, match="layout"):
        Workload("infer", "ragged", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="pairs"):
        Workload("train", "pairs", 4, 5, 1, 1)


def test_off_matrix_sweep_is_off_the_matrix():
    """tools/offmatrix.py's shapes: unique keys, none of them a matrix row, and the issue's off-matrix sizes (dim
    48 and 96, Lq 23, Ld 333, K 7, Nq 7) each in both modes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from offmatrix import OFF_MATRIX

    keys = [w.key for w in OFF_MATRIX]
    assert len(set(keys)) == len(keys)
    assert not set(keys) & {w.key for w in workloads.WORKLOADS}
    for mode in ("infer", "train"):
        rows = [w for w in OFF_MATRIX if w.mode == mode]
        assert {48, 96} <= {w.dim for w in rows}
        assert any(w.lq == 23 for w in rows) and any(w.ld == 333 for w in rows)
        assert any(w.layout == "candidates" and w.nd == 7 for w in rows) and any(w.nq == 7 for w in rows)
        assert {w.layout for w in rows} == set(workloads.LAYOUTS)


def test_counts_per_layout():
    c = Workload("infer", "cross", 3, 5, 7, 11, dim=8)
    assert (c.n_pairs(), c.q_tokens(), c.d_tokens(), c.pair_rows(), c.sims()) == (15, 21, 55, 105, 1155)
    k = Workload("infer", "candidates", 3, 5, 7, 11, dim=8)
    assert (k.n_pairs(), k.q_tokens(), k.d_tokens()) == (15, 21, 165)
    p = Workload("infer", "pairs", 3, 3, 7, 11, dim=8)
    assert (p.n_pairs(), p.q_tokens(), p.d_tokens(), p.sims()) == (3, 21, 33, 231)


def test_quick_keeps_names_and_shrinks():
    full = select("all")
    quick = select("all", quick=True)
    assert [w.key for w in quick] == [w.key for w in full]
    for f, q in zip(full, quick, strict=True):
        assert (q.mode, q.layout, q.dim) == (f.mode, f.layout, f.dim)
        assert q.sims() <= f.sims() and q.sims() <= 4 * 16 * 256 * 128
        assert q.lq <= f.lq and q.ld <= f.ld


def test_select_modes_patterns_and_errors():
    assert {w.mode for w in select("infer")} == {"infer"}
    # issue 3's matrix + design.md's H100 row + off-matrix + ragged (+ issue 5's launch-overhead row)
    assert len(select("train")) == 8 + 2 + 3 and len(select("infer")) == 10 + 1 + 2 + 4 + 1
    both = select("all", ["cross-32x32-lq32-ld80"])
    assert [w.key for w in both] == ["infer/cross-32x32-lq32-ld80", "train/cross-32x32-lq32-ld80"]
    assert [w.key for w in select("all", ["train/cross-32x32-lq32-ld80"])] == ["train/cross-32x32-lq32-ld80"]
    assert {w.layout for w in select("all", ["cand-*"])} == {"candidates"}
    with pytest.raises(ValueError, match="nope"):
        select("all", ["nope"])
    with pytest.raises(ValueError, match="pairs"):
        select("infer", ["pairs-*"])  # the pairs workload is training-only
    with pytest.raises(ValueError, match="mode"):
        select("both")


def test_inputs_shapes_dtype_norm_and_determinism():
    w = _tiny("train", "candidates")
    a = make_inputs(w, CPU, torch.bfloat16, seed=3)
    b = make_inputs(w, CPU, torch.bfloat16, seed=3)
    c = make_inputs(w, CPU, torch.bfloat16, seed=4)
    assert a.Q.shape == w.q_shape() and a.D.shape == w.d_shape() and a.grad_out.shape == w.out_shape()
    assert a.Q.dtype == a.D.dtype == torch.bfloat16 and a.grad_out.dtype == torch.float32
    assert torch.equal(a.Q, b.Q) and torch.equal(a.D, b.D) and not torch.equal(a.Q, c.Q)
    norms = a.D.float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    assert a.grad_out.abs().min() > 0


# ---- reference and correctness judge -------------------------------------------------------------------------
def _float64_truth(w: Workload, inp):
    Q = inp.Q.double().requires_grad_()
    D = inp.D.double().requires_grad_()
    fn = ref_impl.maxsim_pairs if w.layout == "pairs" else ref_impl.maxsim
    s = fn(Q, D)
    dQ, dD = torch.autograd.grad(s, (Q, D), inp.grad_out.double())
    return s, dQ, dD


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("budget", [None, 1])  # budget 1 byte: one document (or query) per chunk
def test_reference_matches_float64_truth(layout, budget):
    w = _tiny("train", layout)
    inp = make_inputs(w, CPU, torch.float32)
    ref = runner.reference(w, inp, need_grad=True, budget=budget)
    s, dQ, dD = _float64_truth(w, inp)
    torch.testing.assert_close(ref.scores.double(), s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref.dQ.double(), dQ, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref.dD.double(), dD, rtol=1e-5, atol=1e-6)
    # the identity targets equal <dQ_i, q_i> and sum_j <dD_j, d_j> of the true gradients
    torch.testing.assert_close(ref.q_identity.double(), (dQ * inp.Q.double()).sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref.d_identity.double(), (dD * inp.D.double()).sum((-1, -2)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["infer", "train"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_eager_and_maxsim_pass_the_judge(mode, layout):
    w = _tiny(mode, layout)
    inp = make_inputs(w, CPU, torch.float32)
    ref = runner.reference(w, inp, need_grad=mode == "train")
    for impl in (EagerImpl(), MaxsimImpl()):
        out = make_call(w, impl.scorer(w, CPU, torch.float32), inp)()
        check = judge(w, out, ref, inp, runner.TOLERANCE[torch.float32])
        assert check.ok, (impl.name, check)
        assert check.rel_err < 1e-5
        if mode == "train":
            assert check.grad_err is not None and check.grad_err < 1e-5


def test_judge_fails_wrong_scores_nan_and_shape():
    w = _tiny("infer", "cross")
    inp = make_inputs(w, CPU, torch.float32)
    ref = runner.reference(w, inp, need_grad=False)
    good = (ref.scores.clone(),)
    assert judge(w, good, ref, inp, 1e-4).ok
    assert not judge(w, (ref.scores * 1.01,), ref, inp, 1e-4).ok
    nan = ref.scores.clone()
    nan[0, 0] = float("nan")
    assert not judge(w, (nan,), ref, inp, 1e-4).ok
    assert not judge(w, (ref.scores.t(),), ref, inp, 1e-4).ok


def test_judge_gradients_tie_robust_but_strict():
    """bf16 eager picks other near-tied maxima (its similarities are rounded to bf16): accepted through the
    identity check with a note. Gradients sent to the wrong tokens or scaled wrongly are FAIL."""
    w = Workload("train", "cross", 8, 16, 32, 300, dim=128)
    inp = make_inputs(w, CPU, torch.bfloat16)
    ref = runner.reference(w, inp, need_grad=True)
    tol = runner.TOLERANCE[torch.bfloat16]
    s, dQ, dD = make_call(w, EagerImpl().scorer(w, CPU, torch.bfloat16), inp)()
    check = judge(w, (s, dQ, dD), ref, inp, tol)
    assert check.ok, check
    assert check.grad_identity_err is not None and check.grad_identity_err < tol
    if check.grad_err > tol:
        assert check.reason and "near-tied maxima" in check.reason
    # exact gradients pass without a note
    exact = judge(w, (ref.scores, ref.dQ, ref.dD), ref, inp, tol)
    assert exact.ok and exact.reason is None
    # wrong: document tokens of the gradient rolled (sent to the wrong tokens), or scaled
    assert not judge(w, (ref.scores, ref.dQ, ref.dD.roll(1, dims=1)), ref, inp, tol).ok
    assert not judge(w, (ref.scores, ref.dQ * 1.2, ref.dD), ref, inp, tol).ok
    assert not judge(w, (ref.scores, torch.zeros_like(ref.dQ), ref.dD), ref, inp, tol).ok
    assert not judge(w, (ref.scores,), ref, inp, tol).ok


# ---- a wrong implementation is FAIL, a crashing one is error, missing peers are skipped -------------------------
class _Wrong(Impl):
    name = "wrong"

    def scorer(self, w, device, dtype):
        return lambda Q, D: eager_fn(w)(Q, D) * 1.1


class _WrongGrad(Impl):
    """Right scores, gradient of dQ zero."""

    name = "wronggrad"

    def scorer(self, w, device, dtype):
        def fn(Q, D):
            return eager_fn(w)(Q.detach() + 0 * Q, D)  # dQ comes back zero

        return fn


class _Crash(Impl):
    name = "crash"

    def scorer(self, w, device, dtype):
        def fn(Q, D):
            raise RuntimeError("kernel exploded")

        return fn


class _NotForPairs(Impl):
    name = "nopairs"

    def unsupported(self, w, device, dtype):
        return "no pairs layout" if w.layout == "pairs" else None

    def scorer(self, w, device, dtype):
        return eager_fn(w)


def eager_fn(w):
    return lambda Q, D: peers.eager_scores(w.layout, Q, D).float()


def _run(ws, impls, **kw):
    return runner.run(ws, impls, device=CPU, dtype=torch.float32, warmup_ms=0, rep_ms=1, progress=False, **kw)


class _Logged(Impl):
    """Eager scores; every call appends the implementation's name to ``log``."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def scorer(self, w, device, dtype):
        def fn(Q, D):
            self.log.append(self.name)
            return eager_fn(w)(Q, D)

        return fn


def test_run_times_implementations_in_interleaved_rounds():
    calls: list[str] = []
    res = _run([_tiny("infer", "cross")], [_Logged("a", calls), _Logged("b", calls)], rounds=3)
    runs = [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]
    # one checked call each, then three rounds of a's timing followed by b's
    assert runs == ["a", "b"] * 4, runs
    assert res.meta["rounds"] == 3
    assert all(r.status == "ok" and r.ms is not None and r.ms > 0 for r in res.rows)
    with pytest.raises(ValueError, match="rounds"):
        _run([_tiny("infer", "cross")], [_Logged("a", calls)], rounds=0)


def test_run_marks_fail_error_na_and_skips():
    ws = [_tiny("infer", "cross"), _tiny("train", "pairs")]
    impls = [_stand_in(), EagerImpl(), _Wrong(), _WrongGrad(), _Crash(), _NotForPairs(), peers.LikImpl()]
    logs: list[str] = []
    res = _run(ws, impls, log=logs.append)
    rows = {(r.mode, r.impl): r for r in res.rows}
    assert len(res.rows) == len(ws) * len(impls)
    for mode in ("infer", "train"):
        assert rows[(mode, "maxsim")].status == "ok"
        assert rows[(mode, "eager")].status == "ok"
        assert rows[(mode, "wrong")].status == "FAIL" and "scores" in rows[(mode, "wrong")].reason
        assert rows[(mode, "wrong")].vs_best_peer is None and rows[(mode, "wrong")].vs_eager is None
        assert rows[(mode, "crash")].status == "error" and "kernel exploded" in rows[(mode, "crash")].reason
        assert rows[(mode, "lik")].status == "skipped" and "CUDA" in rows[(mode, "lik")].reason
    assert rows[("infer", "wronggrad")].status == "ok"  # inference has no gradient to get wrong
    assert rows[("train", "wronggrad")].status == "FAIL" and "gradient" in rows[("train", "wronggrad")].reason
    assert rows[("train", "nopairs")].status == "n/a" and rows[("train", "nopairs")].reason == "no pairs layout"
    assert rows[("infer", "nopairs")].status == "ok"
    assert any(line.startswith("lik: skipped") for line in logs)
    # the wrong implementation was timed but never ranked as the best peer
    ours = rows[("infer", "maxsim")]
    ok_peers = [r.ms for r in res.rows if r.mode == "infer" and r.impl != "maxsim" and r.status == "ok"]
    assert ours.vs_best_peer == pytest.approx(min(ok_peers) / ours.ms)


def test_explicit_skip_and_unimportable_peer():
    res = _run([_tiny("infer", "cross")], [_stand_in(), EagerImpl()], skip={"eager": "left out"})
    eager = next(r for r in res.rows if r.impl == "eager")
    assert eager.status == "skipped" and eager.reason == "left out" and eager.ms is None

    class Missing(peers._ImportedPeer):
        name = "missing"
        module = "maxsim_no_such_module_xyz"
        distribution = "no-such-dist"

    assert "not importable" in Missing().unavailable(torch.device("cuda"))
    assert "needs CUDA" in Missing().unavailable(CPU)
    assert Missing().version() is None
    for impl in (peers.LikImpl(), peers.FlashImpl()):
        assert "needs CUDA" in impl.unavailable(CPU)
    assert peers.default_skips(CPU).keys() == {"compile"}
    assert peers.default_skips(torch.device("cuda")) == {}


def test_maxsim_unavailable_is_reported(monkeypatch):
    monkeypatch.delattr(maxsim, "maxsim")
    assert "not importable" in MaxsimImpl().unavailable(CPU)


def test_make_impls_order_and_errors():
    assert [i.name for i in peers.make_impls(["flash", "maxsim", "eager"])] == ["maxsim", "eager", "flash"]
    with pytest.raises(ValueError, match="unknown"):
        peers.make_impls(["fast"])


# ---- eager baseline --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_eager_chunking_is_exact(layout):
    w = _tiny("infer", layout)
    inp = make_inputs(w, CPU, torch.float32)
    whole = peers.eager_scores(layout, inp.Q, inp.D)
    for chunks in (2, 3, 100):
        got = peers.chunked_over_documents(layout, lambda Q, D: peers.eager_scores(layout, Q, D), chunks)(inp.Q, inp.D)
        torch.testing.assert_close(got, whole)


def test_eager_chunk_count_and_memory_guard(monkeypatch):
    w = Workload("infer", "cross", 32, 65536, 32, 256)
    sim = w.sims() * 2
    assert peers.eager_chunks(w, 2, sim) == 1
    assert peers.eager_chunks(w, 2, sim // 3) == 4
    assert peers.eager_chunks(w, 2, 1) == w.nd
    t = Workload("train", "cross", 256, 256, 32, 300)
    monkeypatch.setattr(peers, "free_memory", lambda device: 1 << 30)
    assert "GiB" in EagerImpl().unsupported(t, CPU, torch.bfloat16)
    assert EagerImpl().unsupported(w, CPU, torch.bfloat16) is None  # inference chunks instead
    monkeypatch.setattr(peers, "free_memory", lambda device: 1 << 40)
    assert EagerImpl().unsupported(t, CPU, torch.bfloat16) is None


def test_eager_keeps_input_dtype():
    w = _tiny("infer", "cross")
    inp = make_inputs(w, CPU, torch.bfloat16)
    out = make_call(w, EagerImpl().scorer(w, CPU, torch.bfloat16), inp)()
    assert out[0].dtype == torch.bfloat16


# ---- roofline and ratios ---------------------------------------------------------------------------------------
def test_roofline_floor_arithmetic():
    roof = Roofline(bandwidth=1e12, matmul_rate=1e15)
    w = Workload("infer", "cross", 2, 3, 4, 5, dim=8)
    flops, nbytes, floor = roofline_floor(w, 2, roof)
    assert flops == 2 * 6 * 4 * 5 * 8
    assert nbytes == (2 * 4 + 3 * 5) * 8 * 2 + 4 * 6
    assert floor == pytest.approx(max(flops / 1e15, nbytes / 1e12) * 1e3)
    t = Workload("train", "cross", 2, 3, 4, 5, dim=8)
    tflops, tbytes, tfloor = roofline_floor(t, 2, roof)
    assert tflops == flops + 4 * 24 * 8  # gathers: one multiply-add per element for dQ and for dD
    extra = 2 * 2 * 24 + 4 * 6 + 2 * 24 * 8 * 2 + (2 * 4 + 3 * 5) * 8 * 2  # int16 argmax, grad_out, gathers, grads
    assert tbytes == nbytes + extra
    assert tfloor == pytest.approx(max(tflops / 1e15, tbytes / 1e12) * 1e3)
    # compute-bound corpus scan: ~5.6 ms on an H200 (design.md §7: 790 TF/s, 4.3 TB/s)
    corpus = Workload("infer", "cross", 32, 65536, 32, 256)
    _, _, f = roofline_floor(corpus, 2, Roofline(bandwidth=4.3e12, matmul_rate=790e12))
    assert f == pytest.approx(5.57, rel=0.02)
    # design.md §7 training floor of the 64×64 Lq32 Ld1024 step on an H200: ~0.05 ms
    colpali = Workload("train", "cross", 64, 64, 32, 1024)
    _, _, f = roofline_floor(colpali, 2, Roofline(bandwidth=4.3e12, matmul_rate=790e12))
    assert f == pytest.approx(0.05, rel=0.2)
    assert roofline_floor(w, 2, Roofline())[2] is None


def _row(impl, ms, status="ok", mode="infer", workload="w", floor=0.5):
    return Row(
        workload=workload, mode=mode, layout="cross", note="", shape={}, dtype="bfloat16", impl=impl,
        card="h100", status=status, ms=ms, floor_ms=floor,
    )  # fmt: skip


def test_ratio_arithmetic_and_fail_not_ranked():
    rows = [
        _row("maxsim", 1.0),
        _row("eager", 8.0),
        _row("compile", 4.0),
        _row("lik", 2.0),
        _row("flash", 0.1, status="FAIL"),  # fastest but wrong: never the best peer
        _row("maxsim", 3.0, workload="v"),
        _row("eager", None, status="n/a", workload="v"),
        _row("lik", 1.5, workload="v", floor=None),
    ]
    compute_ratios(rows)
    ours, eager, compile_, lik, flash = rows[:5]
    assert ours.vs_eager == pytest.approx(8.0) and ours.vs_best_peer == pytest.approx(2.0)
    assert ours.floor_frac == pytest.approx(0.5)
    assert eager.vs_eager == pytest.approx(1.0) and eager.vs_best_peer == pytest.approx(0.25)
    assert compile_.vs_best_peer == pytest.approx(0.5) and lik.vs_best_peer == pytest.approx(1.0)
    assert flash.vs_eager is None and flash.vs_best_peer is None and flash.floor_frac is None
    v_ours, v_eager, v_lik = rows[5:]
    assert v_ours.vs_eager is None and v_ours.vs_best_peer == pytest.approx(0.5)
    assert v_eager.vs_best_peer is None and v_lik.floor_frac is None
    assert runner.best_peer(rows[:5]) is lik


def test_host_timed_workloads_are_named_and_validated():
    w = Workload("infer", "cross", 4, 4, 8, 8, timing="host")
    assert w.name == "cross-4x4-lq8-ld8-host" and w.quick().name == w.name and w.quick().timing == "host"
    assert Workload("infer", "cross", 4, 4, 8, 8).name == "cross-4x4-lq8-ld8"
    with pytest.raises(ValueError, match="timing"):
        Workload("infer", "cross", 4, 4, 8, 8, timing="wall")


def test_host_timer_times_back_to_back_calls_and_syncs_between_batches():
    events: list[str] = []

    def call():
        events.append("call")
        t_end = time.perf_counter() + 2e-4
        while time.perf_counter() < t_end:
            pass

    ms = runner._host_ms(call, warmup_ms=0, rep_ms=0, sync=lambda: events.append("sync"), batch=4)
    assert 0.2 <= ms < 2.0
    # one warm-up call, a sync, then batches of 4 calls each followed by a sync (outside the timed span)
    assert events[:2] == ["call", "sync"]
    batches = "".join("c" if e == "call" else "s" for e in events[2:]).split("s")[:-1]
    assert len(batches) >= 5 and all(b == "cccc" for b in batches)


def test_run_times_host_workloads_on_the_host_without_a_floor(monkeypatch):
    used: list[str] = []
    real_host, real_dev = runner.make_host_timer, runner.make_timer

    def host_timer(*a):
        timer = real_host(*a)
        return lambda fn: used.append("host") or timer(fn)

    def dev_timer(*a):
        timer = real_dev(*a)
        return lambda fn: used.append("device") or timer(fn)

    monkeypatch.setattr(runner, "make_host_timer", host_timer)
    monkeypatch.setattr(runner, "make_timer", dev_timer)
    monkeypatch.setattr(runner, "host_probe", lambda *a: {"autograd_grad_us": 1.0, "eager_op_us": 1.0})  # (own timers)
    host = Workload("infer", "cross", 4, 4, 8, 8, dim=16, timing="host")
    res = _run([host, _tiny("infer", "cross")], [_stand_in()], rounds=2)
    assert used == ["host", "host", "device", "device"]
    by_name = {r.workload: r for r in res.rows}
    assert by_name[host.name].status == "ok" and by_name[host.name].ms > 0
    assert by_name[host.name].floor_ms is None and by_name[host.name].floor_frac is None


def test_cpu_timer_and_card_slug(monkeypatch):
    calls = []
    ms = runner._cpu_ms(lambda: calls.append(time.sleep(0.001)), warmup_ms=0, rep_ms=0, min_reps=5)
    assert ms >= 1.0 and len(calls) >= 6
    assert runner.card_slug(CPU) == "cpu"
    cuda = torch.device("cuda", 0)
    for name, slug in [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert runner.card_slug(cuda) == slug


# ---- outputs -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_result():
    ws = [_tiny("infer", "cross"), _tiny("infer", "candidates"), _tiny("train", "pairs")]
    res = _run(ws, [_stand_in(), EagerImpl(), _Wrong(), peers.FlashImpl()])
    # pretend a roofline so that the chart's second panel and the floor columns are exercised
    for r in res.rows:
        r.floor_ms = 0.001
    compute_ratios(res.rows)
    return res


def test_json_schema(small_result):
    doc = report.to_json(small_result)
    report.validate_json(doc)
    text = json.dumps(doc, allow_nan=False)
    back = json.loads(text)
    report.validate_json(back)
    row = back["rows"][0]
    for key in ("workload", "mode", "shape", "dtype", "impl", "ms", "peak_mib", "rel_err", "floor_ms", "card"):
        assert key in row
    for key in ("torch", "triton", "cuda", "git_commit"):
        assert key in row and key in back["meta"]
    assert back["meta"]["card"] == "cpu" and back["meta"]["quick"] is False
    assert {r["status"] for r in back["rows"]} == {"ok", "FAIL", "skipped"}
    assert [r.impl for r in report.rows_from_json(back)] == [r.impl for r in small_result.rows]
    bad = json.loads(text)
    del bad["rows"][0]["ms"]
    bad["rows"][1]["status"] = "great"
    bad["rows"][2]["rel_err"] = "small"
    with pytest.raises(ValueError) as e:
        report.validate_json(bad)
    assert "missing 'ms'" in str(e.value) and "great" in str(e.value) and "rel_err" in str(e.value)


def test_nan_error_is_written_as_null(small_result):
    doc = report.to_json(small_result)
    row = dict(doc["rows"][0])
    row["rel_err"] = float("nan")
    assert report._clean(row)["rel_err"] is None


def test_terminal_and_markdown(small_result):
    table = report.terminal_table(small_result)
    assert "infer/cross-4x5-lq6-ld9-d16" in table and "FAIL" in table
    assert "flash: skipped" in table
    md = report.markdown(small_result)
    assert "## Inference (forward)" in md and "## Training (forward + backward)" in md
    assert "| workload | shape | floor ms | maxsim | eager | flash | wrong | vs best peer | % floor |" in md
    assert "FAIL" in md and "`flash` not available" in md


def test_write_outputs_creates_card_files(small_result, tmp_path):
    out = tmp_path / "benchmarks" / "results"
    paths = report.write_outputs(small_result, out, log=lambda s: None)
    names = sorted(p.name for p in paths)
    assert names == ["cpu.json", "cpu.md", "cpu.png"]
    report.validate_json(json.loads((out / "cpu.json").read_text()))
    assert (out / "cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_from_json_rerenders_markdown_and_chart(small_result, tmp_path, capsys):
    report.write_outputs(small_result, tmp_path, log=lambda s: None)
    saved = (tmp_path / "cpu.json").read_text()
    (tmp_path / "cpu.md").unlink()
    (tmp_path / "cpu.png").unlink()
    assert main(["bench", "--from-json", str(tmp_path / "cpu.json")]) == 0
    assert (tmp_path / "cpu.md").read_text() == report.markdown(small_result)
    assert (tmp_path / "cpu.png").exists() and (tmp_path / "cpu.json").read_text() == saved
    assert "FAIL" in capsys.readouterr().out
    assert main(["bench", "--from-json", str(tmp_path / "missing.json")]) == 2


def test_from_json_merges_runs_of_one_card(small_result, tmp_path, capsys):
    import copy

    a = report.Result(meta=dict(small_result.meta, git_commit="aaa"), rows=small_result.rows[:2])
    later = copy.deepcopy(small_result.rows)
    later[0].ms = 123.0  # the same (mode, workload, impl) again: the later run's row wins
    b = report.Result(meta=dict(small_result.meta, git_commit="bbb"), rows=later)
    report.write_outputs(a, tmp_path / "a", log=lambda s: None)
    report.write_outputs(b, tmp_path / "b", log=lambda s: None)
    out = tmp_path / "merged"
    assert main(["bench", "--from-json", str(tmp_path / "a" / "cpu.json"), str(tmp_path / "b" / "cpu.json"),
                 "--out", str(out)]) == 0  # fmt: skip
    merged = report.load(out / "cpu.json")
    assert len(merged.rows) == len(small_result.rows) and merged.rows[0].ms == 123.0
    assert merged.meta["git_commit"] == "aaa+bbb" and len(merged.meta["parts"]) == 2
    assert "Run 2 of 2: commit bbb" in (out / "cpu.md").read_text()
    # merging a merged report again keeps every run
    report.write_outputs(report.Result(meta=dict(small_result.meta, git_commit="ccc"), rows=small_result.rows[:1]),
                         tmp_path / "c0", log=lambda s: None)  # fmt: skip
    assert main(["bench", "--from-json", str(out / "cpu.json"), str(tmp_path / "c0" / "cpu.json"), "--out",
                 str(tmp_path / "again")]) == 0  # fmt: skip
    again = report.load(tmp_path / "again" / "cpu.json")
    assert again.meta["git_commit"] == "aaa+bbb+ccc" and len(again.meta["parts"]) == 3
    other = report.Result(meta=dict(small_result.meta, card="h100"), rows=small_result.rows)
    report.write_outputs(other, tmp_path / "c", log=lambda s: None)
    capsys.readouterr()
    assert main(["bench", "--from-json", str(tmp_path / "a" / "cpu.json"), str(tmp_path / "c" / "h100.json")]) == 2
    assert "different card" in capsys.readouterr().err


def test_png_without_matplotlib(small_result, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    logs: list[str] = []
    paths = report.write_outputs(small_result, tmp_path, log=logs.append)
    assert sorted(p.name for p in paths) == ["cpu.json", "cpu.md"]
    assert logs and "matplotlib" in logs[0]


# ---- command line ------------------------------------------------------------------------------------------------
def test_cli_list_and_bad_only(capsys):
    assert main(["bench", "--list", "--mode", "train"]) == 0
    out = capsys.readouterr().out
    assert "train/pairs-512-lq32-ld300" in out and "infer/" not in out
    assert main(["bench", "--only", "no-such-workload"]) == 2


def test_cli_quick_subset_in_process(tmp_path, capsys):
    """A tiny ``--quick`` run through the real command (and the real maxsim), writing the three files."""
    rc = main(
        [
            "bench", "--quick", "--device", "cpu", "--no-progress", "--only", "cross-32x32-lq32-ld80",
            "pairs-*", "--rep-ms", "5", "--warmup-ms", "1", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "infer/cross-32x32-lq32-ld80" in out and "train/pairs-512-lq32-ld300" in out
    assert "compile: skipped" in out and "lik: skipped" in out and "flash: skipped" in out
    doc = json.loads((tmp_path / "cpu.json").read_text())
    report.validate_json(doc)
    assert doc["meta"]["quick"] is True and doc["meta"]["dtype"] == "float32"
    ran = {(r["mode"], r["workload"], r["impl"]): r for r in doc["rows"]}
    for key in [
        ("infer", "cross-32x32-lq32-ld80"),
        ("train", "cross-32x32-lq32-ld80"),
        ("train", "pairs-512-lq32-ld300"),
    ]:
        assert ran[(*key, "maxsim")]["status"] == "ok" and ran[(*key, "eager")]["status"] == "ok"
        assert ran[(*key, "maxsim")]["ms"] > 0 and ran[(*key, "maxsim")]["floor_ms"] is None
    assert (tmp_path / "cpu.md").exists() and (tmp_path / "cpu.png").exists()


def test_cli_impl_subset_runs_only_those(tmp_path, capsys):
    rc = main(
        [
            "bench", "--quick", "--device", "cpu", "--no-progress", "--mode", "infer", "--only",
            "cross-32x32-lq32-ld80", "--impl", "eager", "maxsim", "--rep-ms", "2", "--warmup-ms", "1",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "compile" not in out.split("card cpu")[-1].split("vs eager /")[0]


def test_cli_exit_code_when_maxsim_is_wrong(monkeypatch, capsys):
    class WrongMaxsim(_Wrong):
        name = "maxsim"

    monkeypatch.setitem(peers._FACTORIES, "maxsim", WrongMaxsim)
    argv = ["bench", "--quick", "--device", "cpu", "--no-progress", "--mode", "infer", "--rep-ms", "1"]
    rc = main([*argv, "--only", "cross-32x32-lq32-ld80", "--impl", "maxsim", "eager"])
    assert rc == 1 and "FAIL" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_full_quick_run_under_two_minutes(tmp_path, capsys):
    """Issue 3: ``maxsim bench --quick`` on a 2-core CPU finishes in under 2 minutes, maxsim against eager."""
    t0 = time.perf_counter()
    rc = main(["bench", "--quick", "--device", "cpu", "--no-progress", "--out", str(tmp_path)])
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads((tmp_path / "cpu.json").read_text())
    ours = [r for r in doc["rows"] if r["impl"] == "maxsim"]
    assert len(ours) == len(workloads.WORKLOADS) and all(r["status"] == "ok" for r in ours)
    assert all(r["vs_eager"] is not None and math.isfinite(r["vs_eager"]) for r in ours)
    padded = [r for r in doc["rows"] if r["impl"] == "maxsim-padded"]  # ragged workloads only
    assert len(padded) == sum(w.ragged for w in workloads.WORKLOADS) and all(r["status"] == "ok" for r in padded)
    assert all(r["vs_padded"] > 0 for r in ours if r["layout"] in workloads.RAGGED_LAYOUTS)
    assert elapsed < 120, f"--quick took {elapsed:.0f} s"


@pytest.mark.cuda
def test_cli_quick_on_gpu(tmp_path, capsys):
    """On a GPU: roofline measured, floors and peak memory filled in, peers run or are skipped with a reason."""
    rc = main(
        [
            "bench", "--quick", "--device", "cuda", "--no-progress", "--only", "cross-32x32-lq32-ld80",
            "cand-32x50-lq32-ld180", "pairs-*", "cross-4x4-lq8-ld8-host", "--impl", "maxsim", "eager", "lik",
            "flash", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    jsons = list(tmp_path.glob("*.json"))
    assert len(jsons) == 1
    card = jsons[0].stem
    assert card != "cpu" and (tmp_path / f"{card}.md").exists()
    doc = json.loads(jsons[0].read_text())
    assert doc["meta"]["card"] == card
    report.validate_json(doc)
    assert doc["meta"]["copy_bandwidth_gbps"] > 100 and doc["meta"]["matmul_tflops"] > 10
    assert any(r["workload"].endswith("-host") for r in doc["rows"])
    for r in doc["rows"]:
        host = r["workload"].endswith("-host")  # (host time per call: no roofline)
        assert (r["floor_ms"] is None) if host else (r["floor_ms"] is not None and r["floor_ms"] > 0)
        if r["status"] == "ok":
            assert r["peak_mib"] is not None and (r["floor_frac"] is None) == host
        else:
            assert r["reason"]
    ours = [r for r in doc["rows"] if r["impl"] == "maxsim"]
    assert all(r["status"] == "ok" for r in ours)


# ---- ragged workloads ----------------------------------------------------------------------------------------------
# (mode, layout, Nq, Nd or K, Lq min, Lq max, Ld min, Ld max, pool): 0 = fixed length / dense-equivalent pool.
RAGGED_TABLE = {
    ("infer", "varlen", 64, 256, 8, 32, 20, 1000, 0),
    ("infer", "varlen", 32, 8192, 8, 32, 20, 1000, 0),
    ("infer", "pairlist", 32, 100, 0, 32, 0, 256, 0),
    ("infer", "pairlist", 32, 100, 8, 32, 20, 1000, 2048),
    ("train", "varlen", 64, 256, 8, 32, 20, 1000, 0),
    ("train", "pairlist", 64, 32, 0, 32, 0, 180, 0),
    ("train", "pairlist", 64, 32, 8, 32, 20, 1000, 1024),
}


def _ragged_stand_in() -> MaxsimImpl:
    """The ragged entry points on the reference loops (they take no ``max_seqlen_*``)."""

    def varlen(Q, D, cu_q, cu_d, *, max_seqlen_q, max_seqlen_d):
        return ref_impl.maxsim_varlen(Q, D, cu_q, cu_d)

    def pairs_varlen(Q, D, cu_q, cu_d, pair_q, pair_d, *, max_seqlen_q, max_seqlen_d):
        return ref_impl.maxsim_pairs_varlen(Q, D, cu_q, cu_d, pair_q, pair_d)

    return MaxsimImpl(cross=ref_impl.maxsim, pairs=ref_impl.maxsim_pairs, varlen=varlen, pairs_varlen=pairs_varlen)


def _tiny_ragged(mode: str, layout: str, skewed: bool = True) -> Workload:
    """varlen 3x5; pairlist 3 queries x 4 candidates from a pool of 6 (skewed) or 12 (dense-equivalent)."""
    nd = 5 if layout == "varlen" else 4
    kw = {"lq_min": 2, "ld_min": 3} if skewed else {}
    if layout == "pairlist" and skewed:
        kw["pool"] = 6
    return Workload(mode=mode, layout=layout, nq=3, nd=nd, lq=6, ld=9, dim=16, **kw)


RAGGED_CASES = [("varlen", True), ("pairlist", True), ("pairlist", False)]


def test_ragged_workload_table():
    ws = [w for w in workloads.WORKLOADS if w.ragged]
    got = {(w.mode, w.layout, w.nq, w.nd, w.lq_min, w.lq, w.ld_min, w.ld, w.pool) for w in ws}
    assert got == RAGGED_TABLE and len(ws) == len(RAGGED_TABLE)
    names = {(w.mode, w.name) for w in workloads.WORKLOADS}
    for w in ws:
        assert w.note and w.dim == 128
        if w.layout == "pairlist" and not w.lq_min:  # dense-equivalent: its candidates row is in the table
            assert (w.mode, w.name.replace("pairlist", "cand")) in names
    assert {w.name for w in select("all", ["varlen-*"])} == {
        "varlen-64x256-lq8-32-ld20-1000",
        "varlen-32x8192-lq8-32-ld20-1000",
    }


def test_ragged_names_shapes_and_validation():
    v = Workload("train", "varlen", 64, 256, 32, 1000, lq_min=8, ld_min=20)
    assert v.name == "varlen-64x256-lq8-32-ld20-1000" and v.ragged
    assert v.shape() == {"Nq": 64, "Nd": 256, "Lq_min": 8, "Lq_max": 32, "Ld_min": 20, "Ld_max": 1000, "dim": 128}
    assert v.shape_str() == "Nq=64 Nd=256 Lq=8..32 Ld=20..1000 dim=128"
    s = ragged.structure(v)
    assert v.q_shape() == (int(s.q_lens.sum()), 128) and v.d_shape() == (int(s.d_lens.sum()), 128)
    assert v.out_shape() == (64, 256)
    p = Workload("infer", "pairlist", 32, 100, 32, 256)
    assert p.name == "pairlist-32x100-lq32-ld256"
    assert p.shape() == {"Nq": 32, "K": 100, "pool": 3200, "P": 3200, "Lq": 32, "Ld": 256, "dim": 128}
    assert p.out_shape() == (3200,) and p.d_shape() == (3200 * 256, 128)
    q = Workload("infer", "pairlist", 32, 100, 32, 1000, lq_min=8, ld_min=20, pool=2048)
    assert q.name == "pairlist-32x100-lq8-32-ld20-1000-pool2048" and q.shape()["pool"] == 2048
    assert not Workload("infer", "cross", 2, 2, 4, 4).ragged
    for bad in (
        {"layout": "cross", "lq_min": 2},  # ragged fields on a dense layout
        {"layout": "varlen", "lq_min": 40},  # min above max
        {"layout": "varlen", "pool": 8},  # pool on varlen
        {"layout": "pairlist", "pool": 3},  # pool smaller than K
    ):
        with pytest.raises(ValueError):
            Workload(mode="infer", nq=4, nd=5, lq=32, ld=64, **bad)


def test_length_distribution_is_skewed_and_clipped():
    lens = ragged.draw_lengths(100_000, 20, 1000, torch.Generator().manual_seed(0)).double()
    assert lens.min() == 20 and lens.max() == 1000 and torch.equal(lens, lens.round())
    assert 74 <= lens.median() <= 84  # median 20 * 50^0.35 = 79
    assert 110 <= lens.mean() <= 140  # mean well above the median: a long right tail
    assert 0.05 < (lens == 20).double().mean() < 0.11 and 0.002 < (lens == 1000).double().mean() < 0.01
    fixed = ragged.draw_lengths(7, 0, 256, torch.Generator())
    assert torch.equal(fixed, torch.full((7,), 256))


def test_ragged_lengths_seeded_by_name_and_deterministic():
    full = {w.key: w for w in workloads.WORKLOADS if w.ragged}
    v = full["train/varlen-64x256-lq8-32-ld20-1000"]
    s = ragged.structure(v)
    assert s.q_lens.min() >= 8 and s.q_lens.max() <= 32 and s.d_lens.min() >= 20 and s.d_lens.max() <= 1000
    assert s.d_lens.double().median() < s.d_lens.double().mean() < 0.3 * s.d_lens.max()
    assert v.ragged_stats()["padding"] > 3  # padding to the batch maximum multiplies the work
    ragged.structure.cache_clear()  # recomputed from the seed: identical
    again = ragged.structure(v)
    assert again is not s and torch.equal(again.q_lens, s.q_lens) and torch.equal(again.d_lens, s.d_lens)
    same_in_infer = ragged.structure(full["infer/varlen-64x256-lq8-32-ld20-1000"])
    assert torch.equal(same_in_infer.d_lens, s.d_lens)  # the same case in both modes
    other = ragged.structure(full["infer/varlen-32x8192-lq8-32-ld20-1000"])
    assert not torch.equal(other.d_lens[:256], s.d_lens)
    # pair lists: a shuffled permutation of the (query, candidate) slots, K distinct candidates per query
    for key in ("infer/pairlist-32x100-lq32-ld256", "train/pairlist-64x32-lq8-32-ld20-1000-pool1024"):
        w = full[key]
        p = ragged.structure(w)
        n = w.nq * w.nd
        assert torch.equal(p.slot.sort().values, torch.arange(n)) and not torch.equal(p.slot, torch.arange(n))
        assert torch.equal(p.pair_q, p.slot // w.nd) and torch.equal(p.pair_d, p.cand.reshape(-1)[p.slot])
        assert all(len(set(row)) == w.nd for row in p.cand.tolist())
        if w.pool:  # a shared pool: documents recur across queries
            assert len(p.d_lens) == w.pool and len(set(p.pair_d.tolist())) < n
        else:  # dense-equivalent: every document is exactly one pair's
            assert torch.equal(p.pair_d.sort().values, torch.arange(n)) and set(p.d_lens.tolist()) == {w.ld}


def test_ragged_counts_by_brute_force():
    for layout, skewed in RAGGED_CASES:
        w = _tiny_ragged("infer", layout, skewed)
        s = ragged.structure(w)
        if layout == "varlen":
            pairs = [(i, j) for i in range(w.nq) for j in range(w.nd)]
        else:
            pairs = list(zip(s.pair_q.tolist(), s.pair_d.tolist(), strict=True))
        lq, ld = s.q_lens.tolist(), s.d_lens.tolist()
        used = sorted({j for _, j in pairs})
        assert w.n_pairs() == len(pairs) == math.prod(w.out_shape())
        assert w.sims() == sum(lq[i] * ld[j] for i, j in pairs)
        assert w.pair_rows() == sum(lq[i] for i, _ in pairs)
        assert w.q_tokens() == sum(lq) and w.d_tokens() == sum(ld[j] for j in used)
        assert w.padded_sims() == w.nq * w.nd * max(lq) * max(ld[j] for j in used)
        stats = w.ragged_stats()
        assert stats["padding"] == pytest.approx(w.padded_sims() / w.sims(), rel=1e-3)
        assert stats["dist"] == ("lognormal" if skewed else "fixed")


def test_ragged_quick_shapes():
    for w in (w for w in workloads.WORKLOADS if w.ragged):
        q = w.quick()
        assert (q.key, q.layout, q.dim) == (w.key, w.layout, w.dim)
        assert q.nq <= 4 and q.nd <= 16 and q.lq <= 8 and q.ld <= 125 and q.padded_sims() <= 4 * 16 * 8 * 125
        assert bool(q.lq_min) == bool(w.lq_min) and bool(q.pool) == bool(w.pool)
        assert q.pool == 0 or q.nd <= q.pool < q.n_pairs()  # still a shared pool with recurring documents
        s = ragged.structure(q)
        assert s.q_lens.max() <= q.lq and s.d_lens.max() <= q.ld and s.q_lens.min() >= max(1, q.lq_min)


def test_ragged_inputs():
    w = _tiny_ragged("train", "pairlist")
    a = make_inputs(w, CPU, torch.bfloat16, seed=3)
    b = make_inputs(w, CPU, torch.bfloat16, seed=3)
    c = make_inputs(w, CPU, torch.bfloat16, seed=4)
    s, r = ragged.structure(w), a.ragged
    assert a.Q.shape == w.q_shape() and a.D.shape == w.d_shape() and a.grad_out.shape == (12,)
    assert a.Q.dtype == torch.bfloat16 and a.grad_out.dtype == torch.float32
    assert r.cu_seqlens_q.dtype == r.cu_seqlens_d.dtype == r.pair_q.dtype == r.pair_d.dtype == torch.int32
    assert r.cu_seqlens_q.tolist() == [0, *s.q_lens.cumsum(0).tolist()]
    assert r.cu_seqlens_d[-1] == a.D.shape[0] and r.max_seqlen_d == int(s.d_lens.max())
    assert isinstance(r.max_seqlen_q, int) and r.pair_q.tolist() == s.pair_q.tolist()
    assert r.doc_of_token.tolist() == [j for j, n in enumerate(s.d_lens.tolist()) for _ in range(n)]
    assert torch.equal(a.Q, b.Q) and torch.equal(a.D, b.D) and not torch.equal(a.Q, c.Q)
    assert torch.equal(c.ragged.cu_seqlens_d, r.cu_seqlens_d)  # --seed changes tokens, not lengths
    v = make_inputs(_tiny_ragged("infer", "varlen"), CPU, torch.float32)
    assert v.ragged.pair_q is None and v.grad_out.shape == (3, 5)


def _ragged_truth(w: Workload, inp):
    r = inp.ragged
    Q = inp.Q.double().requires_grad_()
    D = inp.D.double().requires_grad_()
    if w.layout == "varlen":
        s = ref_impl.maxsim_varlen(Q, D, r.cu_seqlens_q, r.cu_seqlens_d)
    else:
        s = ref_impl.maxsim_pairs_varlen(Q, D, r.cu_seqlens_q, r.cu_seqlens_d, r.pair_q, r.pair_d)
    dQ, dD = torch.autograd.grad(s, (Q, D), inp.grad_out.double())
    return s, dQ, dD


@pytest.mark.parametrize(("layout", "skewed"), RAGGED_CASES)
@pytest.mark.parametrize("budget", [None, 1])  # budget 1 byte: one document (or pair) per chunk
def test_ragged_reference_matches_float64_truth(layout, skewed, budget):
    w = _tiny_ragged("train", layout, skewed)
    inp = make_inputs(w, CPU, torch.float32)
    ref = runner.reference(w, inp, need_grad=True, budget=budget)
    s, dQ, dD = _ragged_truth(w, inp)
    close = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(ref.scores.double(), s, **close)
    torch.testing.assert_close(ref.dQ.double(), dQ, **close)
    torch.testing.assert_close(ref.dD.double(), dD, **close)
    torch.testing.assert_close(ref.q_identity.double(), (dQ * inp.Q.double()).sum(-1), **close)
    per_doc = ragged.doc_identity(inp, dD.float()).double()
    torch.testing.assert_close(ref.d_identity.double(), per_doc, **close)
    inf = runner.reference(dataclasses.replace(w, mode="infer"), inp, need_grad=False, budget=budget)
    torch.testing.assert_close(inf.scores.double(), s, **close)
    assert inf.dQ is None


@pytest.mark.parametrize(("layout", "skewed"), RAGGED_CASES)
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_ragged_impls_map_back_and_pass_the_judge(layout, skewed, mode):
    """maxsim (stand-in), maxsim-padded (dense reference on padded data) and eager (padded data, masked): their
    outputs, mapped back to the packed layout, match the reference."""
    w = _tiny_ragged(mode, layout, skewed)
    inp = make_inputs(w, CPU, torch.float32)
    ref = runner.reference(w, inp, need_grad=mode == "train")
    for impl in (_ragged_stand_in(), MaxsimPaddedImpl(dense=ref_impl.maxsim), EagerImpl()):
        fn, ops = impl.prepare(w, inp, CPU, torch.float32)
        out = make_call(w, fn, ops)()
        if isinstance(ops, ragged.Operands):
            out = ops.back(out)
        check = judge(w, out, ref, inp, runner.TOLERANCE[torch.float32])
        assert check.ok and check.rel_err < 1e-5, (impl.name, check)
        assert mode == "infer" or check.grad_err < 1e-5
    ops = ragged.padded_operands(w, inp)
    assert ops is EagerImpl().prepare(w, inp, CPU, torch.float32)[1]  # one padded copy, shared
    r = inp.ragged
    if layout == "varlen":
        assert ops.Q.shape == (3, r.max_seqlen_q, 16) and ops.D.shape == (5, r.max_seqlen_d, 16)
    else:
        assert ops.D.shape[:2] == (3, 4) and ops.D.dim() == 4  # candidates [Nq, K, Ld*, dim]
    s = r.structure
    used = s.d_lens if layout == "varlen" else s.d_lens[s.cand.reshape(-1)]
    assert (ops.d_mask is None) == (not skewed) == (len(set(used.tolist())) == 1)
    assert (ops.q_mask is None) == (len(set(s.q_lens.tolist())) == 1)  # masks only where something is padded


def test_pair_packed_operands_for_aligned_pair_kernels():
    """flash-maxsim's layout: pair p = query segment p against document segment p, gathered before timing."""
    w = _tiny_ragged("train", "pairlist")
    inp = make_inputs(w, CPU, torch.float64)
    ops = ragged.pair_packed_operands(w, inp)
    x, P = ops.extra, w.n_pairs()
    aligned = torch.arange(P)
    got = ref_impl.maxsim_pairs_varlen(ops.Q, ops.D, x["cu_seqlens_q"], x["cu_seqlens_d"], aligned, aligned)
    s, dQ, dD = _ragged_truth(w, inp)
    torch.testing.assert_close(got, s)
    # the gradient maps back to the packed tokens, summed over a document's copies
    Qg, Dg = ops.Q.clone().requires_grad_(), ops.D.clone().requires_grad_()
    sg = ref_impl.maxsim_pairs_varlen(Qg, Dg, x["cu_seqlens_q"], x["cu_seqlens_d"], aligned, aligned)
    gq, gd = torch.autograd.grad(sg, (Qg, Dg), inp.grad_out.double())
    torch.testing.assert_close(ops.dQ_back(gq).double(), dQ)
    torch.testing.assert_close(ops.dD_back(gd).double(), dD)
    assert x["max_seqlen_d"] == int(ragged.structure(w).d_lens[ragged.structure(w).pair_d].max())


def test_peers_ragged_entry_points_and_forward_only_flash():
    infer, train = _tiny_ragged("infer", "varlen"), _tiny_ragged("train", "pairlist")
    flash = peers.FlashImpl()
    assert flash.ragged and peers.LikImpl().ragged and EagerImpl().ragged and peers.CompileImpl().ragged
    assert flash.unsupported(infer, CPU, torch.bfloat16) is None
    assert "forward-only" in flash.unsupported(train, CPU, torch.bfloat16)
    assert flash.unsupported(_tiny("train", "cross"), CPU, torch.bfloat16) is None
    assert MaxsimPaddedImpl.ragged_only and not MaxsimImpl.ragged_only
    assert peers.IMPL_NAMES[:2] == peers.OURS == ("maxsim", "maxsim-padded")
    assert [i.name for i in peers.make_impls(["eager", "maxsim-padded"])] == ["maxsim-padded", "eager"]


class _WrongRagged(MaxsimImpl):
    name = "wrongragged"

    def prepare_ragged(self, w, inp, device, dtype):
        fn, ops = _ragged_stand_in().prepare_ragged(w, inp, device, dtype)
        return (lambda Q, D: fn(Q, D) * 1.1), ops


@pytest.fixture(scope="module")
def ragged_result():
    ws = [_tiny("infer", "cross"), _tiny_ragged("infer", "varlen"), _tiny_ragged("train", "pairlist")]
    impls = [_ragged_stand_in(), MaxsimPaddedImpl(dense=ref_impl.maxsim), EagerImpl(), _Wrong(), _WrongRagged()]
    res = _run(ws, [*impls, peers.FlashImpl()])
    for r in res.rows:
        r.floor_ms = 0.001
    compute_ratios(res.rows)
    return res


def test_run_with_ragged_workloads(ragged_result):
    rows = {(r.layout, r.impl): r for r in ragged_result.rows}
    assert len(ragged_result.rows) == 3 * 6 - 1  # no maxsim-padded row for the dense workload
    assert ("cross", "maxsim-padded") not in rows
    for layout in ("varlen", "pairlist"):
        ours, padded = rows[(layout, "maxsim")], rows[(layout, "maxsim-padded")]
        assert ours.status == padded.status == rows[(layout, "eager")].status == "ok"
        assert rows[(layout, "wrong")].status == "n/a" and "ragged" in rows[(layout, "wrong")].reason
        assert rows[(layout, "wrongragged")].status == "FAIL"
        assert rows[(layout, "flash")].status == "skipped"
        assert ours.vs_padded == pytest.approx(padded.ms / ours.ms) and padded.vs_padded == pytest.approx(1.0)
        assert ours.ragged["pairs"] == ours.shape["Nq"] * (ours.shape.get("Nd") or ours.shape["K"])
        assert ours.shape.get("Lq_min") == 2
    assert rows[("varlen", "maxsim")].grad_err is None and rows[("pairlist", "maxsim")].grad_err < 1e-5
    assert rows[("cross", "maxsim")].ragged is None and rows[("cross", "maxsim")].vs_padded is None
    assert rows[("cross", "wrongragged")].status == "ok"  # its dense path is MaxsimImpl's: the real maxsim.maxsim


def test_vs_padded_and_best_peer_exclude_our_padded_path():
    rows = [
        _row("maxsim", 1.0),
        _row("maxsim-padded", 0.5),  # ours: never the best peer even when fastest
        _row("eager", 4.0),
        _row("lik", 2.0),
    ]
    compute_ratios(rows)
    ours, padded, eager, lik = rows
    assert runner.best_peer(rows) is lik
    assert ours.vs_best_peer == pytest.approx(2.0) and ours.vs_padded == pytest.approx(0.5)
    assert padded.vs_best_peer == pytest.approx(4.0) and eager.vs_padded == pytest.approx(0.125)
    dense = [_row("maxsim", 1.0, workload="v"), _row("eager", 2.0, workload="v")]
    compute_ratios(dense)
    assert dense[0].vs_padded is None


def test_ragged_json_markdown_terminal_and_chart(ragged_result, tmp_path):
    doc = report.to_json(ragged_result)
    report.validate_json(doc)
    back = json.loads(json.dumps(doc, allow_nan=False))
    report.validate_json(back)
    by = {(r["layout"], r["impl"]): r for r in back["rows"]}
    assert by[("varlen", "maxsim")]["ragged"]["padding"] >= 1 and by[("cross", "maxsim")]["ragged"] is None
    assert by[("varlen", "maxsim")]["vs_padded"] > 0
    loaded = report.rows_from_json(back)
    assert [r.vs_padded for r in loaded] == [r.vs_padded for r in ragged_result.rows]
    # files written before the ragged fields stay valid; a wrong type is not
    old = json.loads(json.dumps(doc))
    for row in old["rows"]:
        del row["vs_padded"], row["ragged"]
    report.validate_json(old)
    assert report.rows_from_json(old)[0].ragged is None
    old["rows"][0]["ragged"] = "skewed"
    with pytest.raises(ValueError, match="ragged"):
        report.validate_json(old)
    md = report.markdown(ragged_result)
    assert "## Ragged inference (forward)" in md and "## Ragged training (forward + backward)" in md
    dense_header = "| workload | shape | floor ms | maxsim | eager | flash | wrong | wrongragged | vs best peer |"
    assert dense_header in md  # no maxsim-padded column in the dense tables
    ragged_header = "| workload | shape | lengths (mean/max) | floor ms | maxsim | maxsim-padded | eager |"
    assert ragged_header in md and "vs padded | vs best peer | % floor |" in md
    assert "Lq=2..6 Ld=3..9" in md and ", pad " in md
    table = report.terminal_table(ragged_result)
    assert "vs padded" in table.splitlines()[2] and "maxsim-padded" in table
    assert "vs padded" not in report.terminal_table(runner.Result(meta={}, rows=ragged_result.rows[:5]))
    paths = report.write_outputs(ragged_result, tmp_path, log=lambda s: None)
    assert (tmp_path / "cpu.png").read_bytes()[:4] == b"\x89PNG" and len(paths) == 3


def test_committed_results_still_load():
    """Outputs written before the ragged fields (benchmarks/results) still validate and render."""
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("*.json"))
    for f in files:
        res = report.load(f)
        assert res.rows and report.markdown(res)


def test_cli_ragged_quick_through_real_functions(tmp_path, capsys):
    """``--quick`` ragged rows through maxsim's own ragged functions on the "torch" backend (the CPU path)."""
    argv = ["bench", "--quick", "--device", "cpu", "--no-progress", "--rep-ms", "2", "--warmup-ms", "1"]
    only = ["--only", "train/varlen-64x256-lq8-32-ld20-1000", "infer/pairlist-32x100-lq8-32-ld20-1000-pool2048"]
    with maxsim.backend("torch"):
        rc = main([*argv, *only, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "vs padded" in out and "train/varlen-64x256-lq8-32-ld20-1000" in out
    doc = json.loads((tmp_path / "cpu.json").read_text())
    report.validate_json(doc)
    ran = {(r["mode"], r["workload"], r["impl"]): r for r in doc["rows"]}
    assert len(ran) == 2 * 6  # compile, lik, flash skipped on CPU
    for (mode, name, impl), r in ran.items():
        if impl in ("maxsim", "maxsim-padded", "eager"):
            assert r["status"] == "ok" and r["ms"] > 0 and r["vs_padded"] > 0, (mode, name, impl, r["reason"])
            assert r["ragged"]["pairs"] > 0
        else:
            assert r["status"] == "skipped"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat")
def test_the_host_probe_sees_another_process_keep_a_cpu_busy():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # (past the interpreter's start)
        probe = runner.host_probe(torch.device("cpu"), warmup_ms=20, rep_ms=300)
    finally:
        spin.kill()
        spin.wait()
    assert 0.6 <= probe["others_busy_cpus"] <= (os.cpu_count() or 1) + 1, probe
    assert probe["steal_cpus"] >= 0


def test_the_host_probe_counts_no_more_cpus_than_there_are(monkeypatch):
    """/proc/stat's counters tick every 10 ms on each CPU, so over a short probe on a busy host their deltas can sum to
    more CPU time than the host has (run 90: this file's host-state test failed in a shard of 16 on a 16-CPU host,
    and passed alone); the probe's counts stay within the CPUs there are, and at or above zero."""
    cpus = os.cpu_count() or 1
    readings = iter([(0.0, 0.0, 0.0, 0.0), (10.0 * cpus, 5.0 * cpus, 0.0, 1.0)])
    monkeypatch.setattr(runner, "_cpu_counters", lambda: next(readings))
    monkeypatch.setattr(runner, "thread_cpu_seconds", lambda: {})
    probe = runner.host_probe(torch.device("cpu"), warmup_ms=1, rep_ms=2)
    assert probe["others_busy_cpus"] == cpus and probe["steal_cpus"] == cpus, probe
    readings = iter([(5.0, 3.0, 0.0, 0.0), (5.0, 2.0, 1.0, 1.0)])  # (this process busier than all: none for others)
    monkeypatch.setattr(runner, "_cpu_counters", lambda: next(readings))
    probe = runner.host_probe(torch.device("cpu"), warmup_ms=1, rep_ms=2)
    assert probe["others_busy_cpus"] == 0 and probe["steal_cpus"] == 0, probe


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc/self/task")
def test_the_host_probe_sees_a_thread_of_its_own_process_keep_a_cpu_busy():
    # (a thread that spins without the GIL: a sleep-free native loop is what a busy helper thread looks like)
    stop = threading.Event()

    def spin() -> None:
        x = torch.ones(256, 256)
        while not stop.is_set():
            torch.mm(x, x)

    idle = runner.host_probe(torch.device("cpu"), warmup_ms=20, rep_ms=200)
    t = threading.Thread(target=spin, name="spinner", daemon=True)
    t.start()
    try:
        time.sleep(0.1)
        busy = runner.host_probe(torch.device("cpu"), warmup_ms=20, rep_ms=300)
    finally:
        stop.set()
        t.join()
    assert busy["stray_threads_cpus"] >= 0.3, busy
    assert idle["stray_threads_cpus"] < busy["stray_threads_cpus"], (idle, busy)


def test_run_records_the_hosts_state_at_its_start_and_end(small_result, tmp_path):
    # (the kernel's release names the lent host's runtime: its state is part of a host-bound row's result)
    assert small_result.meta["os"] == platform.platform() and platform.release() in small_result.meta["os"]
    host = small_result.meta["host_us"]
    assert list(host) == ["start", "end"]
    linux = Path("/proc/stat").exists()
    keys = {"autograd_grad_us", "eager_op_us", "autograd_grad_timed_us", "eager_op_timed_us"}
    keys |= {"others_busy_cpus", "steal_cpus", "stray_threads_cpus"} if linux else set()
    for probe in host.values():
        assert set(probe) == keys
        assert all(math.isfinite(v) and 0 < v < 1e5 for k, v in probe.items() if k.endswith("_us"))
        # CPUs kept busy by others: between none and every CPU there is (a little slack for the counters' ticks)
        assert all(0 <= v <= (os.cpu_count() or 1) + 1 for k, v in probe.items() if k.endswith("_cpus"))
    note = runner.host_note(host)
    assert note.count("autograd.grad") == 2 and note.startswith("start: a bare autograd.grad ")
    end = host["end"]
    grad, op = end["autograd_grad_us"], end["eager_op_us"]
    timed = f"(as rows are timed: {end['autograd_grad_timed_us']:.1f} and {end['eager_op_timed_us']:.1f} µs)"
    assert f"; end: a bare autograd.grad {grad:.1f} µs, an eager op {op:.1f} µs {timed}" in note
    if linux:
        busy, steal = end["others_busy_cpus"], end["steal_cpus"]
        stray = end["stray_threads_cpus"]
        assert note.endswith(
            f"{timed} (other processes busy {busy:.1f} CPUs, steal {steal:.1f})"
            f" (this process's other threads busy {stray:.1f} CPUs)"
        )
    # each workload's rows carry the host's state just before their timing: one probe a workload, taken after
    # the run's start and before its end
    by_workload: dict = {}
    for r in small_result.rows:
        if r.status in ("ok", "FAIL"):
            assert r.host_us is not None and set(r.host_us) == keys
            by_workload.setdefault((r.mode, r.workload), []).append(r.host_us)
    assert len(by_workload) == 3 and all(len({tuple(p.values()) for p in ps}) == 1 for ps in by_workload.values())
    assert len({tuple(ps[0].values()) for ps in by_workload.values()}) == 3
    assert all(r.host_us is None for r in small_result.rows if r.status == "skipped")
    doc = report.to_json(small_result)
    report.validate_json(doc)
    assert [r["host_us"] for r in doc["rows"]] == [r.host_us for r in small_result.rows]
    assert [r.host_us for r in report.rows_from_json(doc)] == [r.host_us for r in small_result.rows]
    md = report.markdown(small_result)
    assert f"Host state (calls no implementation takes part in, host time per call): {note}." in md
    doc = report.to_json(small_result)
    assert doc["meta"]["host_us"] == host
    # merged runs name each run's host state in its own line; a file written before the probe has none
    old = report.Result(meta={k: v for k, v in small_result.meta.items() if k != "host_us"}, rows=small_result.rows)
    merged = report.merge([old, small_result])
    md = report.markdown(merged)
    assert "Host state" not in md and md.count("Host: ") == 1 and f"Host: {note}." in md
    assert "Host" not in report.markdown(old)
