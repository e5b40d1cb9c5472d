"""The named benchmark workloads and their inputs.

A :class:`Workload` is one layout at one shape in one mode (``"infer"``: forward under ``no_grad``;
``"train"``: forward plus the backward of a random linear loss on the scores). Names are derived from layout
and shape, e.g. ``cross-32x32-lq32-ld80`` or ``cand-32x100-lq32-ld256``; the same name may exist in both
modes.

Layouts (design.md §2): ``cross`` (``Q [Nq, Lq, dim]`` vs ``D [Nd, Ld, dim]`` -> ``[Nq, Nd]``), ``candidates``
(``D [Nq, K, Ld, dim]`` -> ``[Nq, K]``) and ``pairs`` (``D [B, Ld, dim]`` -> ``[B]``). The counting methods
used by the roofline (:meth:`Workload.n_pairs`, :meth:`Workload.sims`, ...) are written per layout so that
ragged layouts (``varlen``, pair lists) can be added later by extending :data:`LAYOUTS`, the counts and
:func:`make_inputs`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

MODES = ("infer", "train")
LAYOUTS = ("cross", "candidates", "pairs")
_PREFIX = {"cross": "cross", "candidates": "cand", "pairs": "pairs"}


@dataclass(frozen=True)
class Workload:
    """One benchmark case.

    Attributes:
        mode: ``"infer"`` or ``"train"``.
        layout: one of :data:`LAYOUTS`.
        nq: ``Nq`` (cross, candidates) or ``B`` (pairs).
        nd: ``Nd`` (cross), ``K`` (candidates); equal to ``nq`` for pairs.
        lq, ld, dim: query tokens, document tokens, embedding width.
        note: what the shape stands for (``"ColPali"``, ``"distillation"``, ...).
        name: the workload's name; derived from layout and shape when empty, and kept by :meth:`quick`.
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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "pairs" and self.nd != self.nq:
            raise ValueError(f"pairs: nd must equal nq (= B), got nq={self.nq}, nd={self.nd}")
        if min(self.nq, self.nd, self.lq, self.ld, self.dim) < 1:
            raise ValueError(f"all sizes must be >= 1, got {self}")
        if not self.name:
            object.__setattr__(self, "name", self.default_name())

    # ---- naming --------------------------------------------------------------------------------------------
    def default_name(self) -> str:
        """Layout-and-shape name, shared by both modes (``cross-32x32-lq32-ld80``)."""
        n = f"{self.nq}" if self.layout == "pairs" else f"{self.nq}x{self.nd}"
        suffix = "" if self.dim == 128 else f"-d{self.dim}"
        return f"{_PREFIX[self.layout]}-{n}-lq{self.lq}-ld{self.ld}{suffix}"

    @property
    def key(self) -> str:
        """Unique key ``mode/name``."""
        return f"{self.mode}/{self.name}"

    def shape(self) -> dict[str, int]:
        """The shape with the layout's own axis names (``Nq, Nd`` / ``Nq, K`` / ``B``)."""
        if self.layout == "cross":
            head = {"Nq": self.nq, "Nd": self.nd}
        elif self.layout == "candidates":
            head = {"Nq": self.nq, "K": self.nd}
        else:
            head = {"B": self.nq}
        return {**head, "Lq": self.lq, "Ld": self.ld, "dim": self.dim}

    def shape_str(self) -> str:
        """``"Nq=32 Nd=32 Lq=32 Ld=80 dim=128"``."""
        return " ".join(f"{k}={v}" for k, v in self.shape().items())

    # ---- tensor shapes -------------------------------------------------------------------------------------
    def q_shape(self) -> tuple[int, ...]:
        return (self.nq, self.lq, self.dim)

    def d_shape(self) -> tuple[int, ...]:
        if self.layout == "candidates":
            return (self.nq, self.nd, self.ld, self.dim)
        return (self.nd, self.ld, self.dim)

    def out_shape(self) -> tuple[int, ...]:
        return (self.nq,) if self.layout == "pairs" else (self.nq, self.nd)

    # ---- counts for the roofline ---------------------------------------------------------------------------
    def n_pairs(self) -> int:
        """Number of (query, document) scores."""
        return self.nq if self.layout == "pairs" else self.nq * self.nd

    def q_tokens(self) -> int:
        """Distinct query tokens held in memory."""
        return self.nq * self.lq

    def d_tokens(self) -> int:
        """Distinct document tokens held in memory."""
        per = self.nq * self.nd if self.layout == "candidates" else self.nd
        return per * self.ld

    def pair_rows(self) -> int:
        """Σ over pairs of Lq: query tokens that each pick one maximum (argmax entries)."""
        return self.n_pairs() * self.lq

    def sims(self) -> int:
        """Σ over pairs of Lq·Ld: similarities (each a dot product of length ``dim``)."""
        return self.n_pairs() * self.lq * self.ld

    # ---- variants ------------------------------------------------------------------------------------------
    def quick(self) -> Workload:
        """The tiny version used by ``--quick`` (same name, CPU-sized shapes, same layout and mode)."""
        nq = min(self.nq, 16) if self.layout == "pairs" else min(self.nq, 4)
        nd = nq if self.layout == "pairs" else min(self.nd, 16)
        return dataclasses.replace(self, nq=nq, nd=nd, lq=max(8, self.lq // 4), ld=max(8, self.ld // 8))


def _w(mode: str, layout: str, nq: int, nd: int, lq: int, ld: int, dim: int = 128, note: str = ""):
    return Workload(mode=mode, layout=layout, nq=nq, nd=nd, lq=lq, ld=ld, dim=dim, note=note)


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
    # training
    _w("train", "cross", 32, 32, 32, 80, note="contrastive step"),
    _w("train", "cross", 64, 64, 32, 128, note="contrastive step"),
    _w("train", "cross", 256, 256, 32, 300, note="large in-batch"),
    _w("train", "cross", 64, 64, 32, 1024, note="ColPali"),
    _w("train", "candidates", 64, 32, 32, 180, note="distillation"),
    _w("train", "candidates", 256, 16, 32, 300, note="hard negatives"),
    _w("train", "cross", 32, 32, 1024, 1024, note="long queries"),
    _w("train", "pairs", 512, 512, 32, 300, note="positives"),
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
    the random linear loss ``sum(grad_out * scores)`` (its gradient with respect to the scores)."""

    Q: Tensor
    D: Tensor
    grad_out: Tensor


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
    """Random inputs for ``w``, generated directly on ``device`` in ``dtype`` (never zeros)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_of(w, seed))
    Q = _random_tokens(w.q_shape(), dtype, device, gen)
    D = _random_tokens(w.d_shape(), dtype, device, gen)
    grad_out = torch.randn(w.out_shape(), generator=gen, device=device, dtype=torch.float32)
    return Inputs(Q=Q, D=D, grad_out=grad_out)
