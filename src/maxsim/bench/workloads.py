"""The named benchmark workloads and their inputs.

A :class:`Workload` is one layout at one shape in one mode (``"infer"``: forward under ``no_grad``;
``"train"``: forward plus the backward of a random linear loss on the scores). Names are derived from layout
and shape, e.g. ``cross-32x32-lq32-ld80`` or ``cand-32x100-lq32-ld256``; the same name may exist in both
modes.

Layouts (design.md §2): ``cross`` (``Q [Nq, Lq, dim]`` vs ``D [Nd, Ld, dim]`` -> ``[Nq, Nd]``), ``candidates``
(``D [Nq, K, Ld, dim]`` -> ``[Nq, K]``) and ``pairs`` (``D [B, Ld, dim]`` -> ``[B]``), and the ragged layouts
``varlen`` (packed ``Q [ΣLq, dim]`` vs packed ``D [ΣLd, dim]`` -> ``[Nq, Nd]``) and ``pairlist`` (``Nq`` queries
with ``K`` candidates each from a pool of packed documents, as a shuffled list of ``P = Nq·K`` pairs -> ``[P]``).
Ragged lengths run from ``lq_min``/``ld_min`` to ``lq``/``ld`` (a clipped log-normal, seeded by the name: see
:mod:`.ragged`); the counting methods used by the roofline (:meth:`Workload.n_pairs`, :meth:`Workload.sims`, ...)
use the drawn lengths.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ragged as _ragged

MODES = ("infer", "train")
LAYOUTS = ("cross", "candidates", "pairs", "varlen", "pairlist")
RAGGED_LAYOUTS = ("varlen", "pairlist")
TIMINGS = ("device", "host")
_PREFIX = {"cross": "cross", "candidates": "cand", "pairs": "pairs", "varlen": "varlen", "pairlist": "pairlist"}


@dataclass(frozen=True)
class Workload:
    """One benchmark case.

    Attributes:
        mode: ``"infer"`` or ``"train"``.
        layout: one of :data:`LAYOUTS`.
        nq: ``Nq`` (cross, candidates, varlen, pairlist) or ``B`` (pairs).
        nd: ``Nd`` (cross, varlen), ``K`` (candidates, pairlist: candidates per query); equal to ``nq`` for pairs.
        lq, ld, dim: query tokens, document tokens (ragged layouts: the largest length drawn), embedding width.
        note: what the shape stands for (``"ColPali"``, ``"distillation"``, ...).
        name: the workload's name; derived from layout and shape when empty, and kept by :meth:`quick`.
        lq_min, ld_min: ragged layouts only: the smallest length drawn (0: every length is ``lq`` / ``ld``).
        pool: ``pairlist`` only: documents in the pool, each query taking ``K`` distinct ones (0: ``Nq·K``
            documents, each the candidate of one pair: the dense-equivalent of ``candidates``).
        timing: ``"device"``: the call's time on the device (CUDA events, L2 flushed before each call: see
            :func:`maxsim.bench.runner.make_timer`); ``"host"``: the calling thread's time per call, calls back to
            back (launch overhead: what a tiny call costs whoever makes it). A host-timed workload's name ends in
            ``-host`` and it has no roofline floor.
    """

    mode: str
    layout: str
    nq: int
    nd: int
    lq: int
    ld: int
    dim: int = 128
    note: str = ""
    name: str = ""
    lq_min: int = 0
    ld_min: int = 0
    pool: int = 0
    timing: str = "device"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.timing not in TIMINGS:
            raise ValueError(f"timing: expected one of {TIMINGS}, got {self.timing!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "pairs" and self.nd != self.nq:
            raise ValueError(f"pairs: nd must equal nq (= B), got nq={self.nq}, nd={self.nd}")
        if min(self.nq, self.nd, self.lq, self.ld, self.dim) < 1:
            raise ValueError(f"all sizes must be >= 1, got {self}")
        if not self.ragged and (self.lq_min or self.ld_min or self.pool):
            raise ValueError(f"lq_min, ld_min, pool: only for the ragged layouts {RAGGED_LAYOUTS}, got {self}")
        if not (0 <= self.lq_min <= self.lq and 0 <= self.ld_min <= self.ld):
            raise ValueError(f"lq_min, ld_min: expected 0 <= min <= max, got {self}")
        if self.pool and (self.layout != "pairlist" or self.pool < self.nd):
            raise ValueError(f"pool: pairlist only, at least K = {self.nd} documents, got {self.pool}")
        if not self.name:
            object.__setattr__(self, "name", self.default_name())

    @property
    def ragged(self) -> bool:
        """A ragged layout (``varlen``, ``pairlist``): packed tokens with offsets."""
        return self.layout in RAGGED_LAYOUTS

    # ---- naming --------------------------------------------------------------------------------------------
    def default_name(self) -> str:
        """Layout-and-shape name, shared by both modes (``cross-32x32-lq32-ld80``, ``varlen-64x256-lq8-32-ld20-1000``,
        ``pairlist-32x100-lq32-ld256``)."""
        n = f"{self.nq}" if self.layout == "pairs" else f"{self.nq}x{self.nd}"
        lq = f"{self.lq_min}-{self.lq}" if self.lq_min not in (0, self.lq) else f"{self.lq}"
        ld = f"{self.ld_min}-{self.ld}" if self.ld_min not in (0, self.ld) else f"{self.ld}"
        pool = f"-pool{self.pool}" if self.pool else ""
        suffix = ("" if self.dim == 128 else f"-d{self.dim}") + ("-host" if self.timing == "host" else "")
        return f"{_PREFIX[self.layout]}-{n}-lq{lq}-ld{ld}{pool}{suffix}"

    @property
    def key(self) -> str:
        """Unique key ``mode/name``."""
        return f"{self.mode}/{self.name}"

    def shape(self) -> dict[str, int]:
        """The shape with the layout's own axis names (``Nq, Nd`` / ``Nq, K`` / ``B``; a pair list adds ``pool``
        and ``P``). Ragged lengths appear as ``Lq_min, Lq_max`` (``Ld_min, Ld_max``), fixed ones as ``Lq``
        (``Ld``)."""
        if self.layout in ("cross", "varlen"):
            head = {"Nq": self.nq, "Nd": self.nd}
        elif self.layout == "candidates":
            head = {"Nq": self.nq, "K": self.nd}
        elif self.layout == "pairlist":
            head = {"Nq": self.nq, "K": self.nd, "pool": self.pool_size(), "P": self.nq * self.nd}
        else:
            head = {"B": self.nq}

        def length(axis: str, lo: int, hi: int) -> dict[str, int]:
            return {axis: hi} if lo in (0, hi) else {f"{axis}_min": lo, f"{axis}_max": hi}

        return {**head, **length("Lq", self.lq_min, self.lq), **length("Ld", self.ld_min, self.ld), "dim": self.dim}

    def shape_str(self) -> str:
        """``"Nq=32 Nd=32 Lq=32 Ld=80 dim=128"``, ``"Nq=64 Nd=256 Lq=8..32 Ld=20..1000 dim=128"``."""
        return format_shape(self.shape())

    def pool_size(self) -> int:
        """``pairlist``: documents in the pool."""
        return self.pool or self.nq * self.nd

    # ---- tensor shapes -------------------------------------------------------------------------------------
    def q_shape(self) -> tuple[int, ...]:
        if self.ragged:
            return (int(_ragged.structure(self).q_lens.sum()), self.dim)
        return (self.nq, self.lq, self.dim)

    def d_shape(self) -> tuple[int, ...]:
        if self.ragged:
            return (int(_ragged.structure(self).d_lens.sum()), self.dim)
        if self.layout == "candidates":
            return (self.nq, self.nd, self.ld, self.dim)
        return (self.nd, self.ld, self.dim)

    def out_shape(self) -> tuple[int, ...]:
        if self.layout == "pairlist":
            return (self.nq * self.nd,)
        return (self.nq,) if self.layout == "pairs" else (self.nq, self.nd)

    # ---- counts for the roofline ---------------------------------------------------------------------------
    def n_pairs(self) -> int:
        """Number of (query, document) scores."""
        return self.nq if self.layout == "pairs" else self.nq * self.nd

    def q_tokens(self) -> int:
        """Distinct query tokens held in memory."""
        if self.ragged:
            return _ragged.counts(self)["q_tokens"]
        return self.nq * self.lq

    def d_tokens(self) -> int:
        """Distinct document tokens held in memory (a pair list: those of the documents some pair uses)."""
        if self.ragged:
            return _ragged.counts(self)["d_tokens"]
        per = self.nq * self.nd if self.layout == "candidates" else self.nd
        return per * self.ld

    def pair_rows(self) -> int:
        """Σ over pairs of Lq: query tokens that each pick one maximum (argmax entries)."""
        if self.ragged:
            return _ragged.counts(self)["pair_rows"]
        return self.n_pairs() * self.lq

    def sims(self) -> int:
        """Σ over pairs of Lq·Ld: similarities (each a dot product of length ``dim``)."""
        if self.ragged:
            return _ragged.counts(self)["sims"]
        return self.n_pairs() * self.lq * self.ld

    def padded_sims(self) -> int:
        """Similarities of the dense layout padded to the batch maxima (what padded implementations compute)."""
        if self.ragged:
            return _ragged.counts(self)["padded_sims"]
        return self.sims()

    def ragged_stats(self) -> dict | None:
        """Ragged layouts: the drawn lengths (means, maxima), pairs, tokens and the padding factor
        ``padded_sims / sims`` (see :func:`._ragged.stats`); None for dense layouts."""
        return _ragged.stats(self) if self.ragged else None

    # ---- variants ------------------------------------------------------------------------------------------
    def quick(self) -> Workload:
        """The tiny version used by ``--quick`` (same name, CPU-sized shapes, same layout and mode)."""
        nq = min(self.nq, 16) if self.layout == "pairs" else min(self.nq, 4)
        nd = nq if self.layout == "pairs" else min(self.nd, 16)
        lq, ld = max(8, self.lq // 4), max(8, self.ld // 8)
        if not self.ragged:
            return dataclasses.replace(self, nq=nq, nd=nd, lq=lq, ld=ld)
        lq_min = min(lq, max(1, self.lq_min // 4)) if self.lq_min else 0
        ld_min = min(ld, max(1, self.ld_min // 8)) if self.ld_min else 0
        pool = min(self.pool, 2 * nd) if self.pool else 0
        return dataclasses.replace(self, nq=nq, nd=nd, lq=lq, ld=ld, lq_min=lq_min, ld_min=ld_min, pool=pool)


def format_shape(shape: dict[str, int]) -> str:
    """``{"Lq_min": 8, "Lq_max": 32, ...}`` as ``"Lq=8..32 ..."``; other entries as ``key=value``."""
    parts: list[str] = []
    for k, v in shape.items():
        if k.endswith("_max") and f"{k[:-4]}_min" in shape:
            continue
        if k.endswith("_min") and f"{k[:-4]}_max" in shape:
            parts.append(f"{k[:-4]}={v}..{shape[k[:-4] + '_max']}")
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


def _w(mode: str, layout: str, nq: int, nd: int, lq: int, ld: int, dim: int = 128, note: str = "", **ragged_kw):
    return Workload(mode=mode, layout=layout, nq=nq, nd=nd, lq=lq, ld=ld, dim=dim, note=note, **ragged_kw)


#: Ragged length ranges: queries of 8..32 tokens, documents of 20..1000 (skewed: see :mod:`.ragged`).
_SKEWED = {"lq_min": 8, "ld_min": 20}


#: The workload matrix of issue 3. Order is the order of the report.
WORKLOADS: tuple[Workload, ...] = (
    # inference
    _w("infer", "cross", 32, 32, 32, 80, note="in-batch, short docs"),
    _w("infer", "cross", 1, 1000, 32, 300, note="rerank 1000"),
    _w("infer", "cross", 1, 1000, 32, 1024, note="rerank 1000 long docs"),
    _w("infer", "cross", 1, 10000, 32, 300, note="rerank 10k"),
    _w("infer", "cross", 32, 65536, 32, 256, note="corpus scan, compute-bound"),
    _w("infer", "cross", 1, 500, 1024, 1024, note="ColPali"),
    _w("infer", "cross", 128, 128, 32, 300, note="in-batch 128"),
    _w("infer", "candidates", 32, 100, 32, 256, note="padded rerank"),
    _w("infer", "candidates", 32, 50, 32, 180, note="padded rerank"),
    _w("infer", "cross", 1, 4000, 32, 1024, dim=64, note="edge model"),
    _w("infer", "cross", 1, 1000, 32, 1024, dim=48, note="rerank 1000, dim 48 (design.md §7, H100 table)"),
    # issue 5: "a forward call on a tiny input (cross 4x4 Lq8 Ld8) costs under 25 us of host time"
    _w("infer", "cross", 4, 4, 8, 8, note="launch overhead: host time per call", timing="host"),
    # training
    _w("train", "cross", 32, 32, 32, 80, note="contrastive step"),
    _w("train", "cross", 64, 64, 32, 128, note="contrastive step"),
    _w("train", "cross", 256, 256, 32, 300, note="large in-batch"),
    _w("train", "cross", 64, 64, 32, 1024, note="ColPali"),
    _w("train", "candidates", 64, 32, 32, 180, note="distillation"),
    _w("train", "candidates", 256, 16, 32, 300, note="hard negatives"),
    _w("train", "cross", 32, 32, 1024, 1024, note="long queries"),
    _w("train", "pairs", 512, 512, 32, 300, note="positives"),
    # off the matrix (issue 5: the margins must hold for shapes nobody tuned for): dim 48/96, Lq 23, Ld 333, K 7, Nq 7
    _w("infer", "cross", 7, 1000, 23, 333, dim=96, note="off-matrix"),
    _w("infer", "candidates", 32, 7, 23, 333, dim=48, note="off-matrix"),
    _w("train", "cross", 64, 64, 23, 333, dim=96, note="off-matrix"),
    _w("train", "candidates", 64, 7, 23, 333, dim=48, note="off-matrix"),
    # ragged (packed tokens with offsets): maxsim's ragged entry points against the padded dense path
    _w("infer", "varlen", 64, 256, 32, 1000, note="in-batch, skewed lengths", **_SKEWED),
    _w("infer", "varlen", 32, 8192, 32, 1000, note="corpus scan, skewed lengths", **_SKEWED),
    _w("infer", "pairlist", 32, 100, 32, 256, note="dense-equivalent of cand-32x100-lq32-ld256"),
    _w("infer", "pairlist", 32, 100, 32, 1000, note="rerank 100 from a shared pool, skewed", pool=2048, **_SKEWED),
    _w("train", "varlen", 64, 256, 32, 1000, note="contrastive step, skewed lengths", **_SKEWED),
    _w("train", "pairlist", 64, 32, 32, 180, note="dense-equivalent of cand-64x32-lq32-ld180"),
    _w("train", "pairlist", 64, 32, 32, 1000, note="distillation from a shared pool, skewed", pool=1024, **_SKEWED),
)


def select(
    mode: str = "all",
    only: list[str] | None = None,
    quick: bool = False,
    table: tuple[Workload, ...] = WORKLOADS,
) -> list[Workload]:
    """Workloads of ``mode`` (``"infer"``, ``"train"`` or ``"all"``) whose name or key matches ``only``.

    ``only`` entries are exact names, keys (``train/cross-32x32-lq32-ld80``) or shell patterns (``cand-*``).
    Raises ``ValueError`` naming the pattern when one matches nothing. ``quick`` shrinks every selected
    workload.
    """
    if mode not in (*MODES, "all"):
        raise ValueError(f"mode: expected 'infer', 'train' or 'all', got {mode!r}")
    chosen = [w for w in table if mode in ("all", w.mode)]
    if only:
        for pattern in only:
            if not any(_matches(w, pattern) for w in chosen):
                names = sorted({w.name for w in chosen})
                raise ValueError(f"--only: {pattern!r} matches no {mode} workload; known: {', '.join(names)}")
        chosen = [w for w in chosen if any(_matches(w, p) for p in only)]
    return [w.quick() for w in chosen] if quick else chosen


def _matches(w: Workload, pattern: str) -> bool:
    return fnmatch.fnmatchcase(w.name, pattern) or fnmatch.fnmatchcase(w.key, pattern)


# ---- inputs ------------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """The tensors of one workload: ``Q``, ``D`` in the benchmark dtype and the fp32 weights ``grad_out`` of
    the random linear loss ``sum(grad_out * scores)`` (its gradient with respect to the scores).

    Ragged workloads hold packed tokens (``Q [ΣLq, dim]``, ``D [ΣLd, dim]``) and their offsets and pair ids in
    ``ragged``; ``cache`` keeps the other layouts built from them (padded, per-pair packed) for the workload's
    lifetime, so that implementations sharing a layout share one copy."""

    Q: Tensor
    D: Tensor
    grad_out: Tensor
    ragged: _ragged.RaggedInputs | None = None
    cache: dict = field(default_factory=dict)


def seed_of(w: Workload, base: int = 0) -> int:
    """A stable per-workload seed (independent of Python's hash randomization)."""
    return (zlib.crc32(w.key.encode()) + base) % (2**31)


def _random_tokens(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """L2-normalized Gaussian tokens (as ColBERT embeddings are), drawn in fp32 in slices so that no fp32 copy
    of a large tensor ever exists, then stored in ``dtype``."""
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1, shape[-1])
    step = max(1, (1 << 24) // shape[-1])
    for start in range(0, flat.shape[0], step):
        rows = flat[start : start + step]
        x = torch.randn(rows.shape, generator=gen, device=device, dtype=torch.float32)
        rows.copy_(F.normalize(x, dim=-1))
    return out


def make_inputs(w: Workload, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> Inputs:
    """Random inputs for ``w``, generated directly on ``device`` in ``dtype`` (never zeros). Ragged lengths
    depend on the workload only (:func:`._ragged.structure`); ``seed`` changes the token values."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_of(w, seed))
    Q = _random_tokens(w.q_shape(), dtype, device, gen)
    D = _random_tokens(w.d_shape(), dtype, device, gen)
    grad_out = torch.randn(w.out_shape(), generator=gen, device=device, dtype=torch.float32)
    meta = _ragged.ragged_inputs(w, device) if w.ragged else None
    return Inputs(Q=Q, D=D, grad_out=grad_out, ragged=meta)
