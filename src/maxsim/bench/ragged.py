"""Ragged workloads: seeded length draws, packed inputs, the layouts other implementations are timed on, and the
fp32 reference.

Two ragged layouts (design.md §2):

* ``varlen`` — every query against every document: packed ``Q [ΣLq, dim]`` with ``cu_seqlens_q [Nq+1]``, packed
  ``D [ΣLd, dim]`` with ``cu_seqlens_d [Nd+1]`` -> ``[Nq, Nd]``;
* ``pairlist`` — ``Nq`` queries, each with ``K`` candidates taken from a pool of documents, scored as a shuffled
  list of ``P = Nq·K`` pairs (``pair_q``, ``pair_d``) -> ``[P]``. A pool of ``Nq·K`` documents, each used once,
  is the dense-equivalent of the candidates layout ``[Nq, K, Ld, dim]``; a smaller pool reuses documents.

Lengths are drawn from a clipped log-normal between a workload's minimum and maximum (equal bounds: a fixed
length), seeded by the workload's name only: the same case in both modes, on every card and for every ``--seed``
(which changes the token values). The draw is a host-side structure (:class:`Structure`), so the roofline counts
need no device.

Other implementations run on the same tokens in another layout (:class:`Operands`), built before timing:

* :func:`padded_operands` — the dense layout padded to the batch maxima, with boolean masks (``None`` where
  nothing is padded): cross ``Q [Nq, Lq*, dim]`` × ``D [Nd, Ld*, dim]`` for ``varlen``, candidates
  ``D [Nq, K, Ld*, dim]`` for ``pairlist``;
* :func:`pair_packed_operands` — a pair list gathered into aligned packed segments (pair ``p`` = query segment
  ``p`` against document segment ``p``), for peers whose pair entry point takes aligned segments only.

Each maps its outputs back (scores into the workload's order, gradients onto the packed tokens, summed over
copies) so that every implementation is judged against the one reference.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from .workloads import Inputs, Workload

#: Log-normal lengths between ``lo`` and ``hi``: median ``lo · (hi/lo)^LENGTH_MEDIAN_AT``, σ (of the log)
#: ``LENGTH_SIGMA · ln(hi/lo)``, rounded and clipped to ``[lo, hi]``. For documents of 20..1000 tokens: median 79,
#: mean ~125, 8% at 20 and ~0.5% at 1000 (a batch of 256 documents has a maximum near 1000).
LENGTH_MEDIAN_AT = 0.35
LENGTH_SIGMA = 0.25
LENGTH_DIST = "lognormal"


# ---- the host-side structure ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Structure:
    """Lengths and pairs of one ragged workload (CPU int64 tensors; treat as read-only).

    Attributes:
        q_lens: ``[Nq]`` query lengths.
        d_lens: ``[Nd]`` document lengths (``varlen``: the documents; ``pairlist``: the pool).
        cand: ``pairlist`` only: ``[Nq, K]`` pool index of query ``q``'s ``k``-th candidate (distinct per query).
        slot: ``pairlist`` only: ``[P]`` candidate slot ``q·K + k`` of pair ``p`` (a random permutation).
        pair_q, pair_d: ``pairlist`` only: ``[P]`` query and pool document of pair ``p``.
    """

    q_lens: Tensor
    d_lens: Tensor
    cand: Tensor | None = None
    slot: Tensor | None = None
    pair_q: Tensor | None = None
    pair_d: Tensor | None = None

    @property
    def pair_list(self) -> bool:
        return self.pair_q is not None


def draw_lengths(n: int, lo: int, hi: int, gen: torch.Generator) -> Tensor:
    """``n`` lengths from the clipped log-normal between ``lo`` and ``hi`` (all ``hi`` when ``lo`` is 0 or
    ``hi``)."""
    if lo in (0, hi):
        return torch.full((n,), hi, dtype=torch.int64)
    span = math.log(hi / lo)
    mu = math.log(lo) + LENGTH_MEDIAN_AT * span
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    return (mu + LENGTH_SIGMA * span * z).exp().round().clamp(lo, hi).to(torch.int64)


@functools.lru_cache(maxsize=256)
def structure(w: Workload) -> Structure:
    """The seeded lengths (and pair list) of ragged workload ``w``; cached per workload."""
    gen = torch.Generator()
    gen.manual_seed(zlib.crc32(f"lengths/{w.name}".encode()) % (2**31))
    q_lens = draw_lengths(w.nq, w.lq_min, w.lq, gen)
    if w.layout == "varlen":
        return Structure(q_lens=q_lens, d_lens=draw_lengths(w.nd, w.ld_min, w.ld, gen))
    n_pool = w.pool_size()
    d_lens = draw_lengths(n_pool, w.ld_min, w.ld, gen)
    if w.pool:  # each query takes K distinct documents of the pool; documents recur across queries
        cand = torch.stack([torch.randperm(n_pool, generator=gen)[: w.nd] for _ in range(w.nq)])
    else:  # dense-equivalent: every pool document is one candidate, in shuffled pool order
        cand = torch.randperm(n_pool, generator=gen).view(w.nq, w.nd)
    slot = torch.randperm(w.nq * w.nd, generator=gen)
    return Structure(
        q_lens=q_lens, d_lens=d_lens, cand=cand, slot=slot, pair_q=slot // w.nd, pair_d=cand.reshape(-1)[slot]
    )


def counts(w: Workload) -> dict[str, int]:
    """Pairs, tokens and similarities of ragged workload ``w`` (see :class:`~maxsim.bench.workloads.Workload`)."""
    s = structure(w)
    if not s.pair_list:
        q, d = int(s.q_lens.sum()), int(s.d_lens.sum())
        max_q, max_d = int(s.q_lens.max()), int(s.d_lens.max())
        return {
            "pairs": w.nq * w.nd,
            "q_tokens": q,
            "d_tokens": d,
            "pair_rows": q * w.nd,
            "sims": q * d,
            "padded_sims": w.nq * w.nd * max_q * max_d,
        }
    assert s.pair_q is not None and s.pair_d is not None
    lq, ld = s.q_lens[s.pair_q], s.d_lens[s.pair_d]
    used = torch.unique(s.pair_d)
    max_q, max_d = int(s.q_lens.max()), int(s.d_lens[used].max())
    return {
        "pairs": int(s.pair_q.numel()),
        "q_tokens": int(s.q_lens.sum()),
        "d_tokens": int(s.d_lens[used].sum()),
        "pair_rows": int(lq.sum()),
        "sims": int((lq * ld).sum()),
        "padded_sims": w.nq * w.nd * max_q * max_d,
    }


def stats(w: Workload) -> dict[str, float | int | str]:
    """What a report needs to read a ragged row: the drawn lengths and how much work padding adds."""
    s, c = structure(w), counts(w)
    d = s.d_lens if not s.pair_list else s.d_lens[torch.unique(s.pair_d)]
    fixed = w.lq_min in (0, w.lq) and w.ld_min in (0, w.ld)
    return {
        "dist": "fixed" if fixed else LENGTH_DIST,
        "lq_mean": round(float(s.q_lens.double().mean()), 2),
        "lq_max": int(s.q_lens.max()),
        "ld_mean": round(float(d.double().mean()), 2),
        "ld_max": int(d.max()),
        "pairs": c["pairs"],
        "q_tokens": c["q_tokens"],
        "d_tokens": c["d_tokens"],
        "sims": c["sims"],
        "padded_sims": c["padded_sims"],
        "padding": round(c["padded_sims"] / c["sims"], 3),
    }


# ---- packed inputs on the device -----------------------------------------------------------------------------
@dataclass
class RaggedInputs:
    """Device tensors of one ragged workload's structure (offsets and pair ids int32, as the kernels take them).

    ``max_seqlen_q`` / ``max_seqlen_d`` are Python ints, passed to every ragged entry point so that none of them
    syncs with the device to find them.
    """

    structure: Structure
    cu_seqlens_q: Tensor
    cu_seqlens_d: Tensor
    max_seqlen_q: int
    max_seqlen_d: int
    q_lens: Tensor
    d_lens: Tensor
    doc_of_token: Tensor
    pair_q: Tensor | None = None
    pair_d: Tensor | None = None


def _cu(lens: Tensor) -> Tensor:
    return torch.cat([lens.new_zeros(1), lens.cumsum(0)])


def ragged_inputs(w: Workload, device: torch.device) -> RaggedInputs:
    s = structure(w)
    i32 = {"device": device, "dtype": torch.int32}
    return RaggedInputs(
        structure=s,
        cu_seqlens_q=_cu(s.q_lens).to(**i32),
        cu_seqlens_d=_cu(s.d_lens).to(**i32),
        max_seqlen_q=int(s.q_lens.max()),
        max_seqlen_d=int(s.d_lens.max()),
        q_lens=s.q_lens.to(device),
        d_lens=s.d_lens.to(device),
        doc_of_token=torch.repeat_interleave(torch.arange(len(s.d_lens)), s.d_lens).to(device),
        pair_q=None if s.pair_q is None else s.pair_q.to(**i32),
        pair_d=None if s.pair_d is None else s.pair_d.to(**i32),
    )


# ---- other layouts of the same tokens ------------------------------------------------------------------------
def gather_segments(X: Tensor, starts: Tensor, lens: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows ``starts[n] .. starts[n] + lens[n]`` of ``X [rows, dim]`` as ``[n, width, dim]`` (zeros beyond a
    segment's length), with the validity mask ``[n, width]`` and the source row of every slot ``[n, width]`` (0
    where invalid)."""
    ar = torch.arange(width, device=X.device)
    mask = ar[None, :] < lens[:, None]
    idx = torch.where(mask, starts.long()[:, None] + ar[None, :], 0)
    out = X[idx.reshape(-1)].view(*idx.shape, X.shape[-1])
    out.masked_fill_(~mask[..., None], 0)
    return out, mask, idx


def segment_rows(starts: Tensor, lens: Tensor, total: int) -> Tensor:
    """Source rows of the concatenated segments ``starts[n] .. starts[n] + lens[n]`` (``total`` = Σ lens)."""
    offsets = lens.cumsum(0) - lens
    return torch.repeat_interleave(starts.long() - offsets, lens, output_size=total) + torch.arange(
        total, device=lens.device
    )


def _scatter_back(grad: Tensor, mask: Tensor | None, idx: Tensor, rows: int) -> Tensor:
    """Gradient of a gathered view back onto the ``rows`` packed tokens (fp32, summed over copies)."""
    g = grad.reshape(-1, grad.shape[-1]).float()
    flat = idx.reshape(-1)
    if mask is not None:
        keep = mask.reshape(-1)
        g, flat = g[keep], flat[keep]
    return torch.zeros(rows, grad.shape[-1], dtype=torch.float32, device=grad.device).index_add_(0, flat, g)


@dataclass
class Operands:
    """What one implementation is timed on: ``Q``, ``D`` (the differentiated tensors, in its layout), the weights
    of the linear loss in its output order, the masks and extra arguments its scorer closes over, and the maps
    of its outputs back to the workload's (applied after the call, outside the timed region)."""

    Q: Tensor
    D: Tensor
    grad_out: Tensor
    q_mask: Tensor | None = None
    d_mask: Tensor | None = None
    extra: dict = field(default_factory=dict)
    scores_back: Callable[[Tensor], Tensor] | None = None
    dQ_back: Callable[[Tensor], Tensor] | None = None
    dD_back: Callable[[Tensor], Tensor] | None = None

    def back(self, out: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """Scores (and gradients) in the workload's layout."""
        maps = (self.scores_back, self.dQ_back, self.dD_back)
        return tuple(t if f is None else f(t) for t, f in zip(out, maps, strict=False))


def _cached(inp: Inputs, key: str, build: Callable[[], Operands]) -> Operands:
    if key not in inp.cache:
        inp.cache[key] = build()
    return inp.cache[key]


def padded_operands(w: Workload, inp: Inputs) -> Operands:
    """The dense layout padded to the batch maxima (cross for ``varlen``, candidates for ``pairlist``) with
    masks, ``None`` where nothing is padded. Built once per workload and shared by every padded implementation."""
    return _cached(inp, "padded", lambda: _padded(w, inp))


def _padded(w: Workload, inp: Inputs) -> Operands:
    r = inp.ragged
    assert r is not None
    s = r.structure
    nq_tok, nd_tok = inp.Q.shape[0], inp.D.shape[0]
    Qp, q_mask, q_idx = gather_segments(inp.Q, r.cu_seqlens_q[:-1], r.q_lens, r.max_seqlen_q)
    if w.layout == "varlen":
        Dp, d_mask, d_idx = gather_segments(inp.D, r.cu_seqlens_d[:-1], r.d_lens, r.max_seqlen_d)
        grad_out, scores_back = inp.grad_out, None
    else:
        assert s.cand is not None and s.slot is not None
        cand = s.cand.reshape(-1).to(inp.D.device)
        width = int(s.d_lens[s.cand.reshape(-1)].max())
        Dp, d_mask, d_idx = gather_segments(inp.D, r.cu_seqlens_d[:-1][cand], r.d_lens[cand], width)
        Dp, d_mask, d_idx = (t.view(w.nq, w.nd, *t.shape[1:]) for t in (Dp, d_mask, d_idx))
        slot = s.slot.to(inp.D.device)
        grad_out = inp.grad_out.new_zeros(w.nq * w.nd).index_copy_(0, slot, inp.grad_out).view(w.nq, w.nd)

        def scores_back(out: Tensor) -> Tensor:
            return out.reshape(-1)[slot]

    qm = None if bool(q_mask.all()) else q_mask
    dm = None if bool(d_mask.all()) else d_mask
    return Operands(
        Q=Qp,
        D=Dp,
        grad_out=grad_out,
        q_mask=qm,
        d_mask=dm,
        scores_back=scores_back,
        dQ_back=lambda g: _scatter_back(g, qm, q_idx, nq_tok),
        dD_back=lambda g: _scatter_back(g, dm, d_idx, nd_tok),
    )


def pair_packed_operands(w: Workload, inp: Inputs) -> Operands:
    """A pair list as aligned packed segments: ``Q [Σ_p Lq(p), dim]``, ``D [Σ_p Ld(p), dim]`` with per-pair
    offsets in ``extra`` (``cu_seqlens_q``, ``cu_seqlens_d``, ``max_seqlen_q``, ``max_seqlen_d``)."""
    return _cached(inp, "pair_packed", lambda: _pair_packed(inp))


def _pair_packed(inp: Inputs) -> Operands:
    r = inp.ragged
    assert r is not None and r.pair_q is not None and r.pair_d is not None
    s = r.structure
    assert s.pair_q is not None and s.pair_d is not None
    lq, ld = r.q_lens[r.pair_q.long()], r.d_lens[r.pair_d.long()]
    q_rows = segment_rows(r.cu_seqlens_q[:-1][r.pair_q.long()], lq, int(s.q_lens[s.pair_q].sum()))
    d_rows = segment_rows(r.cu_seqlens_d[:-1][r.pair_d.long()], ld, int(s.d_lens[s.pair_d].sum()))
    nq_tok, nd_tok = inp.Q.shape[0], inp.D.shape[0]
    return Operands(
        Q=inp.Q[q_rows],
        D=inp.D[d_rows],
        grad_out=inp.grad_out,
        extra={
            "cu_seqlens_q": _cu(lq).to(torch.int32),
            "cu_seqlens_d": _cu(ld).to(torch.int32),
            "max_seqlen_q": int(s.q_lens[s.pair_q].max()),
            "max_seqlen_d": int(s.d_lens[s.pair_d].max()),
        },
        dQ_back=lambda g: _scatter_back(g, None, q_rows, nq_tok),
        dD_back=lambda g: _scatter_back(g, None, d_rows, nd_tok),
    )


# ---- eager baseline on padded data ---------------------------------------------------------------------------
def masked_eager_scores(Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None) -> Tensor:
    """PyLate-style MaxSim on padded data in the input dtype: similarities, padded document tokens set to
    ``-inf``, max over document tokens, padded query tokens set to 0, sum over query tokens. ``D`` 3-D: cross
    product ``[Nq, Nd]``; 4-D: per-query candidates ``[Nq, K]``."""
    cross = D.dim() == 3
    sim = torch.einsum("qid,njd->qnij" if cross else "qid,qnjd->qnij", Q, D)
    if d_mask is not None:
        dm = d_mask[None, :, None, :] if cross else d_mask[:, :, None, :]
        sim = sim.masked_fill(~dm, float("-inf"))
    best = sim.amax(dim=-1)
    if q_mask is not None:
        best = best.masked_fill(~q_mask[:, None, :], 0)
    return best.sum(dim=-1)


# ---- the fp32 reference --------------------------------------------------------------------------------------
def _chunks(order: list[int], cost: Callable[[int], int], budget: int) -> list[list[int]]:
    """Consecutive runs of ``order`` whose summed ``cost`` stays within ``budget`` (at least one item each)."""
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        c = cost(i)
        if cur and used + c > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += c
    if cur:
        out.append(cur)
    return out


def reference(
    w: Workload, inp: Inputs, need_grad: bool, budget: int
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """fp32 ``(scores, dQ, dD, q_identity, d_identity)`` of ragged workload ``w`` by masked fp32 einsum and
    ``max``, in chunks of documents (``varlen``) or pairs (``pairlist``) of similar length whose similarity
    tensors stay within ``budget`` bytes. Gradients are those of ``sum(grad_out * scores)`` on the packed tokens;
    the identity targets are per packed query token (``Σ g · max_j <q_i, d_j>``) and per document
    (``Σ g · S``), as :func:`maxsim.bench.runner.reference` gives them for the dense layouts."""
    r = inp.ragged
    assert r is not None
    s = r.structure
    Q, D, g = inp.Q.float(), inp.D.float(), inp.grad_out
    dev = Q.device
    cu_q, cu_d = r.cu_seqlens_q.long(), r.cu_seqlens_d.long()
    scores = torch.empty(g.shape, dtype=torch.float32, device=dev)
    dQ = torch.zeros_like(Q) if need_grad else None
    dD = torch.zeros_like(D) if need_grad else None
    q_id = torch.zeros(Q.shape[0], dtype=torch.float32, device=dev) if need_grad else None
    d_id = torch.zeros(len(s.d_lens), dtype=torch.float32, device=dev) if need_grad else None
    d_host = s.d_lens.tolist()
    if not s.pair_list:
        Qp, qm, q_idx = gather_segments(Q, cu_q[:-1], r.q_lens, r.max_seqlen_q)
        dQp = torch.zeros_like(Qp) if need_grad else None
        qid_p = torch.zeros(qm.shape, dtype=torch.float32, device=dev) if need_grad else None
        per = w.nq * r.max_seqlen_q * 12  # fp32 similarities, their gradient, a mask: per document token
        order = sorted(range(w.nd), key=d_host.__getitem__)
        for ids in _chunks(order, lambda j: per * d_host[j], budget):
            idt = torch.tensor(ids, device=dev)
            width = max(d_host[j] for j in ids)
            Dc, dm, d_idx = gather_segments(D, cu_d[:-1][idt], r.d_lens[idt], width)
            qs = Qp.detach().requires_grad_(need_grad)
            ds = Dc.requires_grad_(need_grad)
            with torch.set_grad_enabled(need_grad):
                sim = torch.einsum("qid,kjd->qkij", qs, ds).masked_fill(~dm[None, :, None, :], float("-inf"))
                valid = qm[:, None, :] & dm.any(dim=-1)[None, :, None]
                best = torch.where(valid, sim.max(dim=-1).values, 0.0)  # [Nq, c, Lq*]
                sc = best.sum(dim=-1)
            scores[:, idt] = sc.detach()
            if need_grad:
                assert dQp is not None and dD is not None and qid_p is not None and d_id is not None
                gc = g[:, idt]
                gq, gd = torch.autograd.grad(sc, (qs, ds), gc)
                dQp += gq
                dD.index_add_(0, d_idx[dm], gd[dm])
                qid_p += (gc[..., None] * best.detach()).sum(dim=1)
                d_id[idt] = (gc * sc.detach()).sum(dim=0)
        if need_grad:
            assert dQ is not None and dQp is not None and q_id is not None and qid_p is not None
            dQ.index_add_(0, q_idx[qm], dQp[qm])
            q_id.index_add_(0, q_idx[qm], qid_p[qm])
    else:
        assert s.pair_q is not None and s.pair_d is not None
        pq_host, pd_host = s.pair_q.tolist(), s.pair_d.tolist()
        per = r.max_seqlen_q * 12
        order = sorted(range(len(pq_host)), key=lambda p: d_host[pd_host[p]])
        for ids in _chunks(order, lambda p: per * d_host[pd_host[p]], budget):
            idt = torch.tensor(ids, device=dev)
            pq, pd = s.pair_q[ids].to(dev), s.pair_d[ids].to(dev)
            width = max(d_host[pd_host[p]] for p in ids)
            Qc, qm, q_idx = gather_segments(Q, cu_q[:-1][pq], r.q_lens[pq], r.max_seqlen_q)
            Dc, dm, d_idx = gather_segments(D, cu_d[:-1][pd], r.d_lens[pd], width)
            qs = Qc.requires_grad_(need_grad)
            ds = Dc.requires_grad_(need_grad)
            with torch.set_grad_enabled(need_grad):
                sim = torch.einsum("pid,pjd->pij", qs, ds).masked_fill(~dm[:, None, :], float("-inf"))
                valid = qm & dm.any(dim=-1)[:, None]
                best = torch.where(valid, sim.max(dim=-1).values, 0.0)  # [c, Lq*]
                sc = best.sum(dim=-1)
            scores[idt] = sc.detach()
            if need_grad:
                assert dQ is not None and dD is not None and q_id is not None and d_id is not None
                gc = g[idt]
                gq, gd = torch.autograd.grad(sc, (qs, ds), gc)
                dQ.index_add_(0, q_idx[qm], gq[qm])
                dD.index_add_(0, d_idx[dm], gd[dm])
                q_id.index_add_(0, q_idx[qm], (gc[:, None] * best.detach())[qm])
                d_id.index_add_(0, pd, gc * sc.detach())
    return scores, dQ, dD, q_id, d_id


def doc_identity(inp: Inputs, dD: Tensor) -> Tensor:
    """``Σ_j <dD_j, d_j>`` per document of a ragged workload (``dD`` on the packed tokens)."""
    r = inp.ragged
    assert r is not None
    per_token = (dD.float() * inp.D.float()).sum(dim=-1)
    n = len(r.structure.d_lens)
    return torch.zeros(n, dtype=torch.float32, device=dD.device).index_add_(0, r.doc_of_token, per_token)
