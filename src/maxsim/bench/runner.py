"""Running the matrix: correctness first, then time and memory, plus the roofline floor of every workload.

Per (workload, implementation) the runner

1. builds the implementation's scorer (and, for a ragged workload, the layout it runs on: padded, per-pair
   segments; built before timing) and runs it once; the scores (and, in training, ``dQ``, ``dD``), mapped back
   to the workload's layout, are compared with an fp32 reference computed here by chunked fp32 einsum (never by
   the implementation under test); a wrong row is marked ``FAIL`` and not ranked;
2. measures the peak extra memory of one call (GPU only: ``max_memory_allocated`` minus what was allocated
   before the call, so the inputs are excluded and the outputs included);
3. times it: on a GPU ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls, median), on a CPU
   ``time.perf_counter`` over enough repeats (median).

A training call is ``s = scorer(Q, D)`` followed by ``torch.autograd.grad(s, (Q, D), g)``: the backward of the
random linear loss ``sum(g * s)``, without gradient accumulation into ``.grad``.
"""

from __future__ import annotations

import datetime
import gc
import inspect
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..layout import argmax_dtype
from . import ragged
from .affinity import OneCpu, stray_thread_seconds, thread_cpu_seconds
from .peers import OURS, Impl, free_memory
from .ragged import Operands
from .workloads import Inputs, Workload, make_inputs

#: Relative-error tolerance of scores and gradients by input dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float64: 1e-10}
#: A gradient that differs from the fp32 reference by more than the tolerance is still accepted when it passes
#: the tie-robust identity check (see :func:`judge`) and differs by less than this.
GRAD_SANITY = 0.5
#: fp32 reference: one similarity chunk may use this fraction of the free memory (at most REF_CHUNK_MAX
#: bytes).
REF_MEMORY_FRACTION = 0.15
REF_CHUNK_MAX = 2 << 30

STATUSES = ("ok", "FAIL", "n/a", "skipped", "error")


# ---- rows --------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One (workload, implementation) result; the JSON schema of :mod:`maxsim.bench.report` is its fields."""

    workload: str
    mode: str
    layout: str
    note: str
    shape: dict[str, int]
    dtype: str
    impl: str
    card: str
    status: str = "ok"
    reason: str | None = None
    ms: float | None = None
    peak_mib: float | None = None
    rel_err: float | None = None
    grad_err: float | None = None
    grad_identity_err: float | None = None
    flops: float | None = None
    bytes: float | None = None
    floor_ms: float | None = None
    floor_frac: float | None = None
    vs_eager: float | None = None
    vs_best_peer: float | None = None
    vs_padded: float | None = None
    ragged: dict[str, Any] | None = None
    host_us: dict[str, float] | None = None  # (:func:`host_probe` just before the workload's timing)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Result:
    """A whole run: provenance in ``meta`` and one :class:`Row` per (workload, implementation)."""

    meta: dict[str, Any]
    rows: list[Row] = field(default_factory=list)


# ---- device facts ------------------------------------------------------------------------------------------
def card_slug(device: torch.device) -> str:
    """Short name of the card: ``h100``, ``h200``, another GPU's sanitized name, or ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for known in ("h100", "h200", "b200", "a100", "l40s", "l4"):
        if known in name:
            return known
    words = [w for w in "".join(c if c.isalnum() else " " for c in name).split() if w != "nvidia"]
    return "-".join(words) or "gpu"


def git_commit(path: Path | None = None) -> tuple[str | None, bool | None]:
    """``(HEAD commit, working tree dirty)`` of the repository holding this file; ``(None, None)`` without
    git."""
    if os.environ.get("MAXSIM_GIT_COMMIT"):  # a copy of the tree without .git (e.g. a remote GPU run)
        return os.environ["MAXSIM_GIT_COMMIT"], None
    where = str(path or Path(__file__).resolve().parent)

    def git(*args: str) -> str:
        cmd = ["git", "-C", where, *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
        return done.stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head or None, bool(dirty)


@dataclass
class Roofline:
    """Measured copy bandwidth (bytes/s, read + write counted) and matmul rate (flop/s) of the card."""

    bandwidth: float | None = None
    matmul_rate: float | None = None
    matmul_dtype: str | None = None


Timer = Callable[[Callable[[], Any]], float]


def _time_copy(nbytes: int, device: torch.device, timer: Timer) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def _time_matmul(n: int, device: torch.device, dtype: torch.dtype, timer: Timer) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return timer(lambda: torch.mm(a, b))


def measure_roofline(device: torch.device, dtype: torch.dtype, timer: Timer | None = None) -> Roofline:
    """Copy bandwidth (a 1 GiB device-to-device copy) and the matmul rate of an 8192³ product in ``dtype``
    (bf16 in a default GPU run), timed with 25 ms warm-up and 200 ms of repeats unless ``timer`` is given.
    Nothing on a CPU: no floor there."""
    if device.type != "cuda":
        return Roofline()
    timer = timer or make_timer(device, 25.0, 200.0)
    nbytes = min(1 << 30, free_memory(device) // 8)
    n = 8192
    copy_ms = _time_copy(nbytes, device, timer)
    mm_ms = _time_matmul(n, device, dtype, timer)
    torch.cuda.empty_cache()
    return Roofline(
        bandwidth=2 * nbytes / (copy_ms * 1e-3),
        matmul_rate=2 * n**3 / (mm_ms * 1e-3),
        matmul_dtype=str(dtype).removeprefix("torch."),
    )


def roofline_floor(w: Workload, itemsize: int, roof: Roofline) -> tuple[float, float, float | None]:
    """``(flops, bytes, floor_ms)`` of workload ``w``; ``floor_ms = max(flops / rate, bytes / bandwidth)``.

    Forward (inference):

    * flops = 2 · Σ_pairs Lq·Ld · dim (every similarity is one dot product);
    * bytes = Q and D read once (distinct tokens × dim × itemsize) + fp32 scores written once.

    Training adds the backward of the linear loss, as the saved-argmax backward of design.md §1 does it:

    * flops: 4 · Σ_pairs Lq · dim (``dQ_i += g · d_{a_i}`` and ``dD_{a_i} += g · q_i``, one multiply-add per
      element each). The backward is counted as gathers, not as a second similarity pass: a floor must be a
      lower bound, and this count reproduces the training floors of design.md §7 (e.g. ~0.05 ms for the
      64×64 Lq32 Ld1024 step on an H200). Counting the backward as another forward would double the
      compute-bound training floors;
    * bytes: the argmax written by the forward and read by the backward (2 × 2 B per pair and query token: int16,
      as maxsim saves it for documents of up to 32768 tokens; 2 × 4 B beyond), the fp32 upstream gradient read
      (4 B per pair), the gather of ``d_{a_i}`` for ``dQ`` and of ``q_i`` for ``dD`` once per pair and query token
      (2 × dim × itemsize each), and ``dQ``, ``dD`` written
      once in the input dtype (distinct tokens × dim × itemsize).

    Ragged workloads count their real lengths (Σ over pairs of Lq·Ld, tokens of the documents some pair uses):
    the floor of the useful work, the same for the ragged and the padded implementations.
    """
    tokens = w.q_tokens() + w.d_tokens()
    flops = 2.0 * w.sims() * w.dim
    nbytes = float(tokens * w.dim * itemsize + 4 * w.n_pairs())
    if w.mode == "train":
        flops += 4.0 * w.pair_rows() * w.dim
        nbytes += 2 * argmax_dtype(w.ld).itemsize * w.pair_rows() + 4 * w.n_pairs()
        nbytes += 2 * w.pair_rows() * w.dim * itemsize
        nbytes += tokens * w.dim * itemsize
    if roof.bandwidth is None or roof.matmul_rate is None:
        return flops, nbytes, None
    return flops, nbytes, max(flops / roof.matmul_rate, nbytes / roof.bandwidth) * 1e3


# ---- timing and memory -------------------------------------------------------------------------------------
def _do_bench() -> Callable[..., float] | None:
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    params = inspect.signature(do_bench).parameters
    if not {"warmup", "rep", "return_mode"} <= set(params):
        return None
    return do_bench


def _cuda_events_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> float:
    """Median of CUDA-event timings, L2 flushed before each timed call (as ``do_bench``): the fallback when
    triton's ``do_bench`` is missing or has another signature."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(1, int(rep_ms / est))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _cpu_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, min_reps: int = 5, max_reps: int = 10000):
    """Median wall time of ``fn`` with ``time.perf_counter``: warm-up, then at least ``min_reps`` calls and at
    least ``rep_ms`` of calls."""
    t_end = time.perf_counter() + warmup_ms * 1e-3
    fn()
    while time.perf_counter() < t_end:
        fn()
    times: list[float] = []
    t_end = time.perf_counter() + rep_ms * 1e-3
    while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _host_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, sync: Callable[[], None], batch: int = 50):
    """Median over batches of the calling thread's time per call, ``batch`` calls back to back with nothing in
    between (no flush, no sync: a tiny call's device work is shorter than its launch path, so this is the host
    path's cost); the device is synchronized between batches, outside the timed span, so that its queue never
    fills and throttles the host."""
    t_end = time.perf_counter() + warmup_ms * 1e-3
    fn()
    while time.perf_counter() < t_end:
        fn()
    sync()
    times: list[float] = []
    t_end = time.perf_counter() + rep_ms * 1e-3
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 1000):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch * 1e3)
        sync()
    return statistics.median(times)


def make_host_timer(device: torch.device, warmup_ms: float, rep_ms: float) -> Callable[[Callable[[], Any]], float]:
    """``timer(fn) -> median ms`` of host time per call (see :func:`_host_ms`): the timer of ``timing="host"``
    workloads."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return lambda fn: _host_ms(fn, warmup_ms, rep_ms, sync)


def host_probe(device: torch.device, warmup_ms: float, rep_ms: float) -> dict[str, float]:
    """Host time per call, µs (:func:`_host_ms`), of two calls that no implementation under test takes part in: a
    bare ``autograd.grad`` of ``(x * 2).sum()`` (the autograd engine's own cost, which every training row pays) and
    one eager op into a preallocated output (a dispatch and a launch). A run records them before its first workload,
    before each workload's timing (``Row.host_us``) and after its last: the lent GPU hosts move by 2x within minutes,
    and host-bound rows (tiny calls, small training steps, every peer's included) move with them, so a result carries
    the state its host was in. The same two calls are also timed as the rows are (``make_timer``: on a GPU, the
    device's time from the end of an L2 flush to the end of the call), ``*_timed_us``: a step that back-to-back host
    timing finds fast can still measure slow there (run 83: a small step 0.10-0.45 ms on one host within minutes while
    the host-timed ``autograd.grad`` stayed at 95-127 µs), and the eager op's kernel, too short to be host-bound
    there, moves with the device's clocks. Where ``/proc/stat`` exists the probe also says how many CPUs other
    processes kept busy meanwhile (``others_busy_cpus``: a compile worker, a neighbour), how many a hypervisor took
    (``steal_cpus``) and how many this process's own threads kept busy beside the probe's and the autograd engine's
    (``stray_threads_cpus``), averaged over the probe's span. Syncs: between batches of calls, outside the timed
    span (as the host timer does), and the row timer's own."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timer = make_timer(device, warmup_ms, rep_ms)
    x = torch.randn(1024, device=device, requires_grad=True)
    xd, out = x.detach(), torch.empty(1024, device=device)

    def grad() -> tuple[Tensor, ...]:
        return torch.autograd.grad((x * 2).sum(), (x,))

    def op() -> Tensor:
        return torch.neg(xd, out=out)

    before, threads_before = _cpu_counters(), thread_cpu_seconds()
    probe = {
        "autograd_grad_us": _host_ms(grad, warmup_ms, rep_ms, sync) * 1e3,
        "eager_op_us": _host_ms(op, warmup_ms, rep_ms, sync) * 1e3,
        "autograd_grad_timed_us": timer(grad) * 1e3,
        "eager_op_timed_us": timer(op) * 1e3,
    }
    after, threads_after = _cpu_counters(), thread_cpu_seconds()
    if before is not None and after is not None:
        wall = after[3] - before[3]
        # (the counters tick every 10 ms on each CPU: over a short probe on a busy host their sum can pass the CPUs
        # there are, which the counts are clamped to)
        cpus = float(os.cpu_count() or 1)
        probe["others_busy_cpus"] = min(cpus, max(0.0, (after[0] - before[0]) - (after[2] - before[2])) / wall)
        probe["steal_cpus"] = min(cpus, max(0.0, after[1] - before[1]) / wall)
        if threads_after:
            probe["stray_threads_cpus"] = min(cpus, stray_thread_seconds(threads_before, threads_after) / wall)
    return probe


def _cpu_counters() -> tuple[float, float, float, float] | None:
    """(every CPU's busy seconds, their stolen seconds, this process's CPU seconds, wall seconds) from
    ``/proc/stat``; None where there is none (not Linux). Busy counts user, nice, system, irq and softirq time; steal
    (a hypervisor running another guest on this one's CPU) is kept apart: both tell a slow host from slow code."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks + [0] * (8 - len(ticks))
    busy = (user + nice + system + irq + softirq) / hz
    return busy, steal / hz, time.process_time(), time.perf_counter()


def make_timer(device: torch.device, warmup_ms: float, rep_ms: float) -> Callable[[Callable[[], Any]], float]:
    """``timer(fn) -> median ms`` for ``device``."""
    if device.type == "cuda":
        bench = _do_bench()
        if bench is not None:
            return lambda fn: float(bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        return lambda fn: _cuda_events_ms(fn, warmup_ms, rep_ms)
    return lambda fn: _cpu_ms(fn, warmup_ms, rep_ms)


def peak_extra_mib(call: Callable[[], Any], device: torch.device) -> float | None:
    """Peak memory one call allocates beyond what existed before it (GPU only; None on a CPU). The allocator's cache
    is emptied first: a cached block it hands out whole (up to 1 MiB larger than asked for) would count its slack,
    which depends on what ran before, not on the call."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return peak / 2**20


# ---- reference and correctness -----------------------------------------------------------------------------
@dataclass
class Reference:
    """fp32 ground truth of one workload (see :func:`reference`)."""

    scores: Tensor
    dQ: Tensor | None = None
    dD: Tensor | None = None
    q_identity: Tensor | None = None
    d_identity: Tensor | None = None


def reference(w: Workload, inp: Inputs, need_grad: bool, budget: int | None = None) -> Reference:
    """fp32 scores (and gradients of ``sum(grad_out * scores)``) by chunked fp32 einsum and ``max``.

    Chunks run over documents (cross) or queries (candidates, pairs) so one fp32 similarity chunk stays within
    ``budget`` bytes. TF32 is switched off meanwhile. With ``need_grad`` it also returns the targets of the
    tie-robust identity check: per query token ``Σ_docs g · max_j <q_i, d_j>`` (= ``<dQ_i, q_i>`` for any
    valid choice of maxima) and per document ``Σ_queries g · S`` (= ``Σ_j <dD_j, d_j>``). Ragged workloads:
    masked einsum over chunks of documents or pairs of similar length (:func:`.ragged.reference`), gradients
    and query identities on the packed tokens.
    """
    device = inp.Q.device
    if budget is None:
        budget = min(REF_CHUNK_MAX, int(REF_MEMORY_FRACTION * free_memory(device)))
    if w.ragged:
        prev_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            scores_r, dQ_r, dD_r, q_id_r, d_id_r = ragged.reference(w, inp, need_grad, budget)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32
        return Reference(scores=scores_r, dQ=dQ_r, dD=dD_r, q_identity=q_id_r, d_identity=d_id_r)
    per_row = w.lq * max(w.ld, w.dim) * 4 * 3  # fp32 similarities, their gradient, a gather: per (query, doc)
    g = inp.grad_out
    Q = inp.Q.float()
    if w.layout == "cross":
        D4, axis = inp.D.unsqueeze(0), 1
        rows_per_step = max(1, budget // (per_row * w.nq))
    elif w.layout == "candidates":
        D4, axis = inp.D, 0
        rows_per_step = max(1, budget // (per_row * w.nd))
    else:
        D4, axis = inp.D.unsqueeze(1), 0
        g = g.unsqueeze(1)
        rows_per_step = max(1, budget // per_row)
    n = D4.shape[axis]
    scores = torch.empty(g.shape, dtype=torch.float32, device=device)
    dQ = torch.zeros_like(Q) if need_grad else None
    dD = torch.empty(D4.shape, dtype=torch.float32, device=device) if need_grad else None
    q_id = torch.zeros(w.nq, w.lq, dtype=torch.float32, device=device) if need_grad else None
    d_id = torch.zeros(D4.shape[:2], dtype=torch.float32, device=device) if need_grad else None
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for s in range(0, n, rows_per_step):
            e = min(n, s + rows_per_step)
            if axis == 1:  # cross: a slice of the documents against every query
                qsl, gsl = slice(None), (slice(None), slice(s, e))
                qs, ds, spec = Q, D4[0, s:e], "qid,kjd->qkij"
            else:  # candidates / pairs: a slice of the queries with their own documents
                qsl, gsl = slice(s, e), (slice(s, e), slice(None))
                qs, ds, spec = Q[s:e], D4[s:e], "qid,qkjd->qkij"
            qs = qs.detach().requires_grad_(need_grad)
            ds = ds.float().requires_grad_(need_grad)
            with torch.set_grad_enabled(need_grad):
                best = torch.einsum(spec, qs, ds).max(dim=-1).values  # [q, k, Lq]
                sc = best.sum(dim=-1)
            scores[gsl] = sc.detach()
            if need_grad:
                assert dQ is not None and dD is not None and q_id is not None and d_id is not None
                gq, gd = torch.autograd.grad(sc, (qs, ds), g[gsl])
                dQ[qsl] += gq
                q_id[qsl] += (g[gsl].unsqueeze(-1) * best.detach()).sum(dim=1)
                contrib = g[gsl] * sc.detach()
                if axis == 1:
                    dD[0, s:e] = gd
                    d_id[0, s:e] = contrib.sum(dim=0)
                else:
                    dD[s:e] = gd
                    d_id[s:e] = contrib
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    if w.layout == "pairs":
        scores = scores[:, 0]
    if not need_grad:
        return Reference(scores=scores)
    assert dD is not None and d_id is not None
    if w.layout == "cross":
        dD, d_id = dD[0], d_id[0]
    elif w.layout == "pairs":
        dD, d_id = dD[:, 0], d_id[:, 0]
    return Reference(scores=scores, dQ=dQ, dD=dD, q_identity=q_id, d_identity=d_id)


def rel_err(out: Tensor, ref: Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp32 (inf for a shape mismatch, nan when ``out`` holds NaN)."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf
    diff = torch.linalg.vector_norm(out.float() - ref.float()).item()
    den = torch.linalg.vector_norm(ref.float()).item()
    return diff / den if den > 0 else diff


@dataclass
class Check:
    ok: bool
    rel_err: float
    grad_err: float | None = None
    grad_identity_err: float | None = None
    reason: str | None = None


def judge(w: Workload, out: tuple[Tensor, ...], ref: Reference, inp: Inputs, tol: float) -> Check:
    """Compare one call's outputs with the reference.

    Scores pass when their relative error is at most ``tol``. Gradients pass when ``max(rel err dQ, rel err
    dD)`` is at most ``tol``, or — because an implementation that rounds similarities to the input dtype
    (eager bf16) legitimately picks another of two near-tied maxima — when the tie-robust identities hold
    within ``tol`` and the plain error stays below :data:`GRAD_SANITY`. The identities: for every query token
    ``<dQ_i, q_i> = Σ_docs g · max_j <q_i, d_j>`` and for every document ``Σ_j <dD_j, d_j> = Σ_queries g · S``
    (true for any valid choice of maxima, since the score is linear in the chosen tokens).
    """
    scores = out[0]
    err = rel_err(scores, ref.scores)
    if not err <= tol:  # also catches NaN
        return Check(False, err, reason=f"scores rel. error {err:.2e} > {tol:.0e}")
    if w.mode != "train":
        return Check(True, err)
    assert ref.dQ is not None and ref.dD is not None
    assert ref.q_identity is not None and ref.d_identity is not None
    if len(out) < 3:
        return Check(False, err, reason="no gradients returned")
    dQ, dD = out[1], out[2]
    gerr = max(rel_err(dQ, ref.dQ), rel_err(dD, ref.dD))
    if tuple(dQ.shape) != tuple(inp.Q.shape) or tuple(dD.shape) != tuple(inp.D.shape):
        return Check(False, err, gerr, reason="gradient shapes differ from the inputs'")
    q_id = (dQ.float() * inp.Q.float()).sum(dim=-1)
    d_id = ragged.doc_identity(inp, dD) if w.ragged else (dD.float() * inp.D.float()).sum(dim=(-1, -2))
    ierr = max(rel_err(q_id, ref.q_identity), rel_err(d_id, ref.d_identity))
    if gerr <= tol:
        return Check(True, err, gerr, ierr)
    if ierr <= tol and gerr <= GRAD_SANITY:
        note = f"gradient error {gerr:.1e} from near-tied maxima at input precision (identity error {ierr:.1e})"
        return Check(True, err, gerr, ierr, reason=note)
    return Check(False, err, gerr, ierr, reason=f"gradient rel. error {gerr:.2e}, identity error {ierr:.2e}")


# ---- the run -----------------------------------------------------------------------------------------------
def make_call(w: Workload, fn: Callable[[Tensor, Tensor], Tensor], inp: Inputs | Operands) -> Callable[[], tuple]:
    """The timed unit: inference under ``no_grad``; training as forward plus ``autograd.grad`` of the loss.

    ``inp`` is the workload's :class:`Inputs` or the :class:`~.ragged.Operands` an implementation prepared
    (``Q``, ``D`` and the loss weights ``grad_out`` in its own layout)."""
    if w.mode == "infer":
        Q, D = inp.Q, inp.D

        def infer() -> tuple[Tensor, ...]:
            with torch.no_grad():
                return (fn(Q, D),)

        return infer
    Qg = inp.Q.detach().requires_grad_(True)
    Dg = inp.D.detach().requires_grad_(True)
    weights: dict[torch.dtype, Tensor] = {}

    def train() -> tuple[Tensor, ...]:
        s = fn(Qg, Dg)
        g = weights.get(s.dtype)
        if g is None:
            g = weights.setdefault(s.dtype, inp.grad_out.to(s.dtype))
        dQ, dD = torch.autograd.grad(s, (Qg, Dg), g)
        return s, dQ, dD

    return train


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(device: torch.device, dtype: torch.dtype, roof: Roofline, impls: Iterable[Impl]) -> dict:
    """Everything a number needs to be read later: card, versions, commit, date, measured roofline."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    commit, dirty = git_commit()
    return {
        "card": card_slug(device),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "os": platform.platform(),  # (the kernel's release tells the lent hosts' runtimes apart: gVisor, Firecracker)
        "git_commit": commit,
        "git_dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_threads": torch.get_num_threads(),
        "copy_bandwidth_gbps": None if roof.bandwidth is None else roof.bandwidth / 1e9,
        "matmul_tflops": None if roof.matmul_rate is None else roof.matmul_rate / 1e12,
        "matmul_dtype": roof.matmul_dtype,
        "impl_versions": {i.name: i.version() for i in impls},
        "tolerance": TOLERANCE.get(dtype),
        "argv": sys.argv[1:],
    }


class _Progress:
    """tqdm (one step per row) on a terminal when installed, else one printed line per workload."""

    def __init__(self, total_rows: int, n_workloads: int, enabled: bool, log: Callable[[str], None]) -> None:
        self.n_workloads, self.k, self.enabled, self.log = n_workloads, 0, enabled, log
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total_rows, unit="row", dynamic_ncols=True, leave=False, file=sys.stderr)
            except ImportError:
                self.bar = None

    def workload(self, key: str) -> None:
        self.k += 1
        if self.enabled and self.bar is None:
            print(f"[{self.k}/{self.n_workloads}] {key}", file=sys.stderr, flush=True)

    def step(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(label[:60])
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            self.log(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _free(device: torch.device, collect: bool = False) -> None:
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:240]}"


def _bench_one(
    row: Row, impl: Impl, w: Workload, inp: Inputs, ref: Reference | None, ctx: _Ctx
) -> Callable[[], tuple] | None:
    """Prepare, check against the reference and measure the peak memory of one implementation on one workload;
    returns the timed call (None where there is nothing to time: ``row`` then says why)."""
    if w.ragged and not impl.ragged:
        row.status, row.reason = "n/a", f"no entry point for the ragged layout {w.layout!r}"
        return None
    reason = impl.unsupported(w, ctx.device, ctx.dtype)
    if reason is not None:
        row.status, row.reason = "n/a", reason
        return None
    if ref is None:
        row.status, row.reason = "error", ctx.ref_error
        return None
    try:
        fn, operands = impl.prepare(w, inp, ctx.device, ctx.dtype)
        call = make_call(w, fn, operands)
        out = call()
        if isinstance(operands, Operands):
            out = operands.back(out)
        check = judge(w, out, ref, inp, ctx.tol)
        del out
        row.rel_err, row.grad_err = check.rel_err, check.grad_err
        row.grad_identity_err = check.grad_identity_err
        row.status, row.reason = ("ok" if check.ok else "FAIL"), check.reason
        row.peak_mib = peak_extra_mib(call, ctx.device)
        return call
    except Exception as e:  # one broken row must not end the run
        row.status, row.reason = "error", _short(e)
        row.ms = row.peak_mib = None
    return None


def _time_interleaved(timed: list[tuple[Row, Callable[[], Any]]], ctx: _Ctx, host: bool = False) -> None:
    """``row.ms`` of every prepared call of one workload (``host``: its host time per call): the median over
    ``ctx.rounds`` rounds, each round timing every implementation once, in turn. Interleaving spreads a drift of
    the machine (host clocks, GPU clocks, neighbours) over all implementations alike instead of charging it to
    whichever ran in the bad second."""
    times: dict[int, list[float]] = {id(row): [] for row, _ in timed}
    timer = ctx.host_timer if host else ctx.timer
    for _ in range(ctx.rounds):
        for row, call in timed:
            if row.status == "error":
                continue
            try:
                times[id(row)].append(timer(call))
            except Exception as e:
                row.status, row.reason = "error", _short(e)
    for row, _ in timed:
        row.ms = statistics.median(times[id(row)]) if row.status != "error" and times[id(row)] else None


@dataclass
class _Ctx:
    device: torch.device
    dtype: torch.dtype
    tol: float
    timer: Callable[[Callable[[], Any]], float]
    host_timer: Callable[[Callable[[], Any]], float]
    rounds: int = 1
    ref_error: str | None = None


def run(
    workloads: list[Workload],
    impls: list[Impl],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    seed: int = 0,
    rounds: int = 3,
    skip: dict[str, str] | None = None,
    quick: bool = False,
    progress: bool = True,
    pin: bool = True,
    on_workload: Callable[[Result], None] | None = None,
    log: Callable[[str], None] = print,
) -> Result:
    """Benchmark every implementation on every workload; returns rows with ratios and floors filled in.

    ``quick`` is recorded in the provenance (the workloads are already shrunk). ``skip`` maps implementation
    names to a reason for leaving them out (printed, and recorded as ``skipped``). Each workload's implementations
    are timed in ``rounds`` interleaved rounds of ``warmup_ms / rounds`` and ``rep_ms / rounds`` each (see
    :func:`_time_interleaved`); a row's time is the median of its rounds' medians. ``pin``: on a GPU, time (and
    probe the host) with the calling thread and the autograd engine's threads on one CPU (:mod:`.affinity`);
    ``meta["pinned_cpu"]`` says which (None: not pinned) and each host probe its CPU (``cpu``). ``on_workload``
    is called with the result so far (ratios filled in) after each workload, e.g. to save it: a run stopped midway
    (a time limit) then leaves the workloads it finished.
    """
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    device = torch.device(device)
    timer = make_timer(device, warmup_ms / rounds, rep_ms / rounds)
    roof = measure_roofline(device, dtype)
    meta = provenance(device, dtype, roof, impls)
    meta["quick"] = quick
    meta["rounds"] = rounds
    if roof.bandwidth is not None:
        log(
            f"{meta['device_name']}: copy {meta['copy_bandwidth_gbps']:.0f} GB/s, "
            f"{roof.matmul_dtype} matmul {meta['matmul_tflops']:.0f} TFLOP/s"
        )
    skipped = dict(skip or {})
    for impl in impls:
        if impl.name not in skipped:
            why = impl.unavailable(device)
            if why is not None:
                skipped[impl.name] = why
    for name, why in skipped.items():
        if any(i.name == name for i in impls):
            log(f"{name}: skipped ({why})")
    for impl in impls:
        expected = getattr(impl, "expected_version", "")
        if impl.name not in skipped and expected and meta["impl_versions"].get(impl.name) != expected:
            log(f"{impl.name}: version {meta['impl_versions'].get(impl.name)}, the design's numbers use {expected}")
    host_timer = make_host_timer(device, warmup_ms / rounds, rep_ms / rounds)
    ctx = _Ctx(
        device=device, dtype=dtype, tol=TOLERANCE.get(dtype, 1e-4), timer=timer, host_timer=host_timer, rounds=rounds
    )
    meta["pinned_cpu"] = None
    with OneCpu(device, pin) as one:
        meta["host_us"] = {"start": _probe_on(one, device, warmup_ms, rep_ms)}
        meta["pinned_cpu"] = one.cpu
    result = Result(meta=meta)
    plan = [(w, [i for i in impls if w.ragged or not i.ragged_only]) for w in workloads]
    bar = _Progress(sum(len(row_impls) for _, row_impls in plan), len(workloads), progress, log)
    try:
        for w, row_impls in plan:
            bar.workload(w.key)
            flops, nbytes, floor = roofline_floor(w, dtype.itemsize, roof)
            if w.timing == "host":
                floor = None  # (host time has no roofline)
            stats = w.ragged_stats()
            inp: Inputs | None = None
            ref: Reference | None = None
            ctx.ref_error = None
            try:
                inp = make_inputs(w, device, dtype, seed)
                ref = reference(w, inp, need_grad=w.mode == "train")
            except Exception as e:
                ctx.ref_error = f"inputs/reference failed: {_short(e)}"
            timed: list[tuple[Row, Callable[[], tuple]]] = []
            for impl in row_impls:
                row = Row(
                    workload=w.name,
                    mode=w.mode,
                    layout=w.layout,
                    note=w.note,
                    shape=w.shape(),
                    dtype=meta["dtype"],
                    impl=impl.name,
                    card=meta["card"],
                    flops=flops,
                    bytes=nbytes,
                    floor_ms=floor,
                    ragged=dict(stats) if stats is not None else None,
                )
                if impl.name in skipped:
                    row.status, row.reason = "skipped", skipped[impl.name]
                elif inp is None:
                    row.status, row.reason = "error", ctx.ref_error
                else:
                    call = _bench_one(row, impl, w, inp, ref, ctx)
                    if call is not None:
                        timed.append((row, call))
                    if row.status in ("FAIL", "error"):
                        bar.write(f"{w.key} {impl.name}: {row.status}: {row.reason}")
                result.rows.append(row)
                bar.step(f"{w.key} {impl.name}")
                _free(device)
            with OneCpu(device, pin) as one:
                if timed:  # (the host's state as this workload's timing starts: host-bound rows move with it)
                    probe = _probe_on(one, device, warmup_ms / rounds, rep_ms / rounds)
                    for row, _ in timed:
                        row.host_us = probe
                _time_interleaved(timed, ctx, host=w.timing == "host")
            del timed
            for impl in impls:
                impl.reset()
            del inp, ref
            _free(device, collect=True)
            if on_workload is not None:
                compute_ratios(result.rows)
                on_workload(result)
    finally:
        bar.close()
    with OneCpu(device, pin) as one:
        meta["host_us"]["end"] = _probe_on(one, device, warmup_ms, rep_ms)
    log(f"host: {host_note(meta['host_us'])}")
    compute_ratios(result.rows)
    return result


def _probe_on(one: OneCpu, device: torch.device, warmup_ms: float, rep_ms: float) -> dict[str, float]:
    """:func:`host_probe` under ``one``, with the CPU it pinned (``cpu``) where it pinned one."""
    probe = host_probe(device, warmup_ms, rep_ms)
    if one.cpu is not None:
        probe["cpu"] = one.cpu
    return probe


def host_note(host_us: dict) -> str:
    """``{when: host_probe(...)}`` (a run's ``meta["host_us"]``: its start and end) as one line."""
    return "; ".join(f"{when}: {_probe_note(p)}" for when, p in host_us.items() if p)


def _probe_note(p: dict) -> str:
    note = f"a bare autograd.grad {p['autograd_grad_us']:.1f} µs, an eager op {p['eager_op_us']:.1f} µs"
    if "autograd_grad_timed_us" in p:
        note += f" (as rows are timed: {p['autograd_grad_timed_us']:.1f} and {p['eager_op_timed_us']:.1f} µs)"
    if "others_busy_cpus" in p:
        note += f" (other processes busy {p['others_busy_cpus']:.1f} CPUs, steal {p['steal_cpus']:.1f})"
    if "stray_threads_cpus" in p:
        note += f" (this process's other threads busy {p['stray_threads_cpus']:.1f} CPUs)"
    if "cpu" in p:
        note += f" (pinned to CPU {p['cpu']})"
    return note


def best_peer(group: list[Row]) -> Row | None:
    """The fastest ``ok`` row of one workload among the implementations other than this library's (``maxsim``,
    ``maxsim-padded``)."""
    peers = [r for r in group if r.impl not in OURS and r.status == "ok" and r.ms is not None and r.ms > 0]
    return min(peers, key=lambda r: r.ms or math.inf) if peers else None


def group_rows(rows: list[Row]) -> dict[tuple[str, str], list[Row]]:
    """Rows by ``(mode, workload)``, in first-seen order."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.mode, r.workload), []).append(r)
    return groups


def compute_ratios(rows: list[Row]) -> None:
    """Fill ``vs_eager`` (eager ms / ms), ``vs_best_peer`` (best peer ms / ms), ``vs_padded`` (``maxsim-padded``
    ms / ms: ragged workloads) and ``floor_frac`` (floor / ms).

    Only ``ok`` rows are ranked. The best peer of a workload is the fastest ``ok`` implementation other than
    this library's (eager, compile, lik, flash); ratios above 1 mean faster than that reference.
    """
    for group in group_rows(rows).values():
        eager = next((r.ms for r in group if r.impl == "eager" and r.status == "ok" and r.ms), None)
        padded = next((r.ms for r in group if r.impl == "maxsim-padded" and r.status == "ok" and r.ms), None)
        best = best_peer(group)
        for r in group:
            r.vs_eager = r.vs_best_peer = r.vs_padded = r.floor_frac = None
            if r.status != "ok" or not r.ms:
                continue
            r.vs_eager = eager / r.ms if eager is not None else None
            r.vs_best_peer = best.ms / r.ms if best is not None and best.ms is not None else None
            r.vs_padded = padded / r.ms if padded is not None else None
            r.floor_frac = r.floor_ms / r.ms if r.floor_ms is not None else None
