"""Randomized differential test: one random call per seed, against the float64 reference.

Each seed draws one case: the entry point (``maxsim.maxsim`` on a cross product with 3-D or 2-D ``Q``/``D`` or on
per-query candidates, ``maxsim_with_argmax``, ``maxsim_pairs``, ``maxsim_varlen``, ``maxsim_pairs_varlen``,
``maxsim_padded``), small shapes with empty batches and sequences, masks with holes and fully masked sequences, shuffled
and repeated pair ids, and the other choices of :data:`CHOICES`: dtype, ``normalize``, the data (Gaussian, integers with
exact ties, token norms over four decades, duplicated or zero tokens), NaN/±inf in masked or scored positions,
non-contiguous arguments, which inputs need a gradient, the backward mode and, on the PyTorch backend, a patch of the
CPU thresholds (:data:`PATCHES`) so that small problems take the internal paths of large ones. Scores, argmax and
gradients are compared with :mod:`maxsim.reference` in float64 on the same rounded inputs: the other tests pin each
rule down on chosen inputs, this one tries their combinations.

Beyond ``helpers.py``: a score's tolerance has a floor of a few ulps of ``Σ_i ||q_i|| max_j ||d_j||`` (a score near 0
by cancellation cannot be matched relative to itself); ±inf scores must be equal; a row whose max is NaN may choose any
valid token (±inf: one at the max); gradients are compared on the tokens of unambiguous rows, not at all with NaN/inf in
a scored position, and a token that no score uses gets exactly zero. The Triton interpreter runs a subset of the seeds
with tiny shapes. ``MAXSIM_FUZZ_SEEDS=N`` runs seeds ``0..N-1`` (a longer local run); a failure prints its case.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from dataclasses import dataclass

import pytest
import torch
from helpers import (
    DTYPES,
    FULL_INTERPRETER,
    GAP_TOL,
    GRAD_TOL,
    SCORE_TOL,
    _describe_worst,
    assert_same_nan,
    int_grid,
    interpreted,
    keep_under_interpreter,
    rand_mask,
    randn,
    score_dtype,
    upstream_grad,
)
from torch import Tensor

import maxsim
from maxsim import cpu, cpu_by_document, cpu_memory, cpu_ragged, cpu_small, layout, reference

SEEDS = list(range(int(os.environ.get("MAXSIM_FUZZ_SEEDS", 400))))
INTERPRETER_SEEDS = set(SEEDS[::4])
ALL_DTYPES = DTYPES | {"fp64": torch.float64}


def _reference_pairs(Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, normalize: bool):
    """(scores [B], argmax [B, Lq]) of aligned pairs: each query with one candidate."""
    d_mask = None if d_mask is None else d_mask[:, None]
    s, arg = reference.maxsim_with_argmax(Q, D[:, None], q_mask, d_mask, normalize=normalize)
    return s[:, 0], arg[:, 0]


# entry point -> (the library's function, the reference's (scores, argmax) one); ``Case.args`` are their keywords
KINDS = {
    "cross": (maxsim.maxsim, reference.maxsim_with_argmax),
    "candidates": (maxsim.maxsim, reference.maxsim_with_argmax),
    "pairs": (maxsim.maxsim_pairs, _reference_pairs),
    "padded": (maxsim.maxsim_padded, reference.maxsim_padded_with_argmax),
    "varlen": (maxsim.maxsim_varlen, reference.maxsim_varlen_with_argmax),
    "pairs_varlen": (maxsim.maxsim_pairs_varlen, reference.maxsim_pairs_varlen_with_argmax),
}
CHOICES = {  # each case draws one value of each (a repeated value is likelier)
    "kind": tuple(KINDS),
    "dtype": ("fp32", "fp32", "bf16", "fp16", "fp64"),
    "dim": (1, 3, 8, 16, 33, 64),
    "data": ("randn", "randn", "int", "scaled", "dup", "zeros"),
    "normalize": (False, False, True),
    "poison": (None, None, None, "masked", "masked", "scored"),  # NaN / ±inf in masked or in scored tokens
    "value": ("nan", "inf", "-inf"),
    "noncontig": (None, None, "T", "slice"),
    "grad": ("QD", "QD", "QD", "Q", "D", ""),  # the inputs that require a gradient
    "backward": ("auto", "fast", "deterministic"),
    "argmax": (False, True),
    "argmax_fn": (False, False, True),  # maxsim_with_argmax instead of return_argmax=True (cross, candidates)
    "patched": (0.0, 0.15, 0.3, 0.5),  # the share of PATCHES applied
}
MODULES = {m.__name__.split(".")[-1]: m for m in (cpu, cpu_small, cpu_by_document, cpu_ragged, layout, cpu_memory)}
# CPU thresholds -> values that send small problems down the paths of large ones (True/False: replaces a predicate)
# fmt: off
PATCHES = {
    "cpu.BLOCK_BYTES": (64, 512, 4096), "cpu.DENSE_BACKWARD_MAX": (-1, 1 << 40), "cpu.STEP_MAX_LD": (-1, 4, 1 << 20),
    "cpu.DOCUMENTS_FIRST_MIN_SIMS": (0,), "cpu.DOCUMENTS_FIRST_MIN_ARGMAX_SIMS": (0,),
    "cpu.PROJECT_BLOCK_BYTES": (8, 64), "cpu.DOCUMENTS_FIRST_WIDTH": (4, 8), "cpu.DOCUMENTS_FIRST_MIN_ROWS": (1, 3),
    "cpu.DOCUMENTS_FIRST_MIN_DIM": (1,), "cpu.MASKED_PRODUCT_MIN_ROWS": (0,),
    "cpu_small.MAX_PAIR_SIMS": (-1, 64), "cpu_small.MAX_CROSS_SIMS": (-1, 64),
    "cpu_small.MAX_VALUES": (-1, 4), "cpu_small._cross_product_pays": (True, False),
    "cpu_small.CROSS_FORWARD_MEAN_LD": (-1, 1 << 30), "cpu_small._products_pay": (True, False),
    "cpu_by_document.MAX_VALUES": (-1,), "cpu_by_document.BLOCK_BYTES": (1, 256),
    "cpu_by_document.STEP_MAX_WEIGHTS": (-1, 1 << 40),
    "cpu_ragged.PACKED_ARGMAX_MAX_SIMS": (0, 50), "cpu_ragged.BY_LENGTH_MIN_WORK": (0, 100),
    "cpu_ragged.PAIR_BLOCK_BYTES": (16, 256), "cpu_ragged.LINK_BLOCK_BYTES": (8, 256),
    "cpu_ragged.PACKED_QUERY_ROWS": (1, 3), "cpu_ragged.PER_DOCUMENT_MIN_SIMS": (0, 16),
    "layout.ARGMAX_INT16_MAX_LD": (0, 3), "cpu_memory.HUGE_PAGES_MIN_BYTES": (0,),
}
# fmt: on


@dataclass
class Case:
    """One drawn call. ``Q``/``D``: the library's tokens (poison included); ``Q_ref``/``D_ref``: the reference's (a
    poison in masked positions left out: its value must not matter). ``q_rows [G, Wq]``/``d_rows [G, Wd]``: per score
    (row-major), the flat token row of ``Q``/``D`` at each query / document position, -1 where there is none."""

    Q: Tensor
    D: Tensor
    Q_ref: Tensor
    D_ref: Tensor
    args: dict  # the other arguments, by keyword
    q_rows: Tensor
    d_rows: Tensor
    flags: dict  # CHOICES' draws, the patches, and "exact" (integer data, no normalize: ties are exact)

    def __str__(self) -> str:
        args = {k: tuple(v.shape) if isinstance(v, Tensor) and v.numel() > 12 else v for k, v in self.args.items()}
        return f"Q{tuple(self.Q.shape)} D{tuple(self.D.shape)} {self.flags} {args}"


def _flat(x: Tensor) -> Tensor:
    """``[..., L]`` -> ``[n, L]`` (``n`` may be 0)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _rows(valid: Tensor, packed: bool = False) -> Tensor:
    """``[..., L]`` validity -> ``[n, L]``: each valid token's row in the flat (or packed: valid tokens only) tokens,
    -1 elsewhere."""
    v = _flat(valid)
    rows = v.reshape(-1).cumsum(0) - 1 if packed else torch.arange(v.numel())
    return rows.reshape(v.shape).masked_fill(~v, -1)


def _marked(n: int, rows: Tensor) -> Tensor:
    """``[n]`` bools, True at ``rows`` (a -1 there marks nothing)."""
    out = torch.zeros(n + 1, dtype=torch.bool)
    out[rows] = True
    return out[:-1]


def _draw(seed: int, tiny: bool, triton: bool) -> Case:
    """The case of ``seed`` (tiny shapes for the Triton interpreter; no float64 for Triton: it goes to PyTorch)."""
    rng = random.Random(seed)
    f = {k: rng.choice(v) for k, v in CHOICES.items()}
    if triton and f["dtype"] == "fp64":  # (float64 takes the PyTorch path whatever the backend)
        f["dtype"] = "fp32"
    f["dim"] = min(f["dim"], 33) if tiny else f["dim"]
    kind, dim = f["kind"], f["dim"]
    n_max, lq_max, ld_max = (3, 6, 20) if tiny else (5, 13, 40)

    def size(hi: int) -> int:
        return 0 if rng.random() < 0.08 else rng.randint(1, hi)

    if kind in ("cross", "candidates", "pairs", "padded"):
        nq, m, lq, ld = size(n_max), size(n_max + 2), size(lq_max), size(ld_max)
        q2d, d2d = (kind == "cross" and rng.random() < 0.15 for _ in range(2))
        q_seq = (lq,) if q2d else (nq, lq)
        d_seq = (ld,) if d2d else {"cross": (m, ld), "pairs": (nq, ld)}.get(kind, (nq, m, ld))
        if kind == "padded":
            ql = torch.tensor([rng.choice((0, lq, rng.randint(0, lq))) for _ in range(nq)], dtype=torch.long)
            dl = torch.tensor([rng.choice((0, ld, rng.randint(0, ld))) for _ in range(nq * m)], dtype=torch.long)
            args = {"query_lengths": ql, "doc_lengths": dl.reshape(nq, m), "validate": rng.random() < 0.3}
            valid = [torch.arange(lq) < ql[:, None], torch.arange(ld) < dl.reshape(nq, m, 1)]
        else:
            args, valid = {}, []
            for name, shape in (("q_mask", q_seq), ("d_mask", d_seq)):
                p_valid, mask = rng.choice((0.3, 0.7, 0.95)), None
                if rng.random() < 0.65:
                    mask = rand_mask(shape, seed=rng.randrange(2**31), p_valid=p_valid)
                    if mask.numel() and rng.random() < 0.3:  # a fully masked query / document
                        _flat(mask)[rng.randrange(len(_flat(mask)))] = False
                args[name] = mask
                valid.append(torch.ones(shape, dtype=torch.bool) if mask is None else mask)
        qi, di = _rows(valid[0]), _rows(valid[1])
        if kind == "cross":
            pq, pd = torch.arange(len(qi)).repeat_interleave(len(di)), torch.arange(len(di)).repeat(len(qi))
        else:  # pairs, candidates: document sequence i belongs to query i // (nd / nq)
            pq, pd = torch.arange(len(di)) // max(1, len(di) // max(1, len(qi))), torch.arange(len(di))
        q_shape, d_shape = (*q_seq, dim), (*d_seq, dim)
    else:
        q_lens = [size(lq_max) for _ in range(size(n_max + 1))]
        d_lens = [size(ld_max) if rng.random() < 0.7 else 0 for _ in range(size(n_max + 3))]
        d_lens = [size(ld_max)] * len(d_lens) if rng.random() < 0.3 else d_lens  # (documents of one length)
        index, given = rng.choice((torch.int32, torch.int64)), rng.random() < 0.5  # given: max_seqlen_* passed
        wq = max(q_lens, default=0) + given * rng.choice((0, 1, 3))
        wd = max(d_lens, default=0) + given * rng.choice((0, 2))
        cu = [torch.tensor([0, *itertools.accumulate(lens)], dtype=index) for lens in (q_lens, d_lens)]
        args = {"cu_seqlens_q": cu[0], "cu_seqlens_d": cu[1], "max_seqlen_q": wq if given else None}
        args |= {"max_seqlen_d": wd if given else None, "validate": rng.choice((None, True, False))}
        lengths = [torch.tensor(lens, dtype=torch.long)[:, None] for lens in (q_lens, d_lens)]
        qi, di = _rows(torch.arange(wq) < lengths[0], packed=True), _rows(torch.arange(wd) < lengths[1], packed=True)
        pq, pd = torch.arange(len(qi)).repeat_interleave(len(di)), torch.arange(len(di)).repeat(len(qi))
        if kind == "pairs_varlen":  # none, every pair once (shuffled or by document), or drawn with repeats
            g, mode = torch.Generator().manual_seed(seed), rng.choice(("none", "all", "by_doc", "random", "random"))
            n = {"none": 0, "random": 1 + 3 * max(len(qi), len(di))}.get(mode, len(pq)) if len(pq) else 0
            pick = (
                torch.randint(0, max(1, len(pq)), (n,), generator=g)
                if mode == "random"
                else torch.randperm(n, generator=g)
            )
            pick = pick[pd[pick].argsort(stable=True)] if mode == "by_doc" else pick
            pq, pd = pq[pick], pd[pick]
            args |= {"pair_q": pq.to(index), "pair_d": pd.to(index)}
        q_shape, d_shape = (sum(q_lens), dim), (sum(d_lens), dim)
    tokens, poisoned = [], False
    for shape, table in ((q_shape, qi), (d_shape, di)):
        s, data = rng.randrange(2**31), f["data"]
        x = (int_grid if data == "int" else randn)(shape, seed=s, dtype=torch.float64)
        g = torch.Generator().manual_seed(s)
        if data == "scaled":  # token norms from 0.01 to 100
            x *= 10 ** (torch.rand(shape[:-1], generator=g, dtype=torch.float64)[..., None] * 4 - 2)
        elif data == "zeros":
            x *= (torch.rand(shape[:-1], generator=g) < 0.7)[..., None]
        elif data == "dup" and x.numel():  # exact copies of other tokens
            flat = _flat(x)
            flat[torch.randint(0, len(flat), (len(flat) // 2,), generator=g)] = flat[: len(flat) // 2].clone()
        tokens.append(x.clone())
        scored = _marked(len(_flat(x)), table)
        rows = (scored if f["poison"] == "scored" else ~scored).nonzero().squeeze(1).tolist()
        for r in rng.sample(rows, min(len(rows), 2)) if f["poison"] else ():
            _flat(x)[r, rng.randrange(dim) if rng.random() < 0.5 else slice(None)] = float(f["value"])
            poisoned = True
        tokens.append(x)
    f["poison"] = f["poison"] if poisoned else None
    f["exact"] = f["data"] == "int" and not f["normalize"]
    share = f.pop("patched")
    f["patches"] = {k: rng.choice(v) for k, v in PATCHES.items() if rng.random() < share}
    clean_q, Q, clean_d, D = (x.to(ALL_DTYPES[f["dtype"]]) for x in tokens)
    refs = (Q, D) if f["poison"] == "scored" else (clean_q, clean_d)
    return Case(Q, D, *refs, args, qi[pq], di[pd], f)


def _on(x, device: str, how: str | None):
    """``x`` on ``device``, made non-contiguous by ``how``: its axes reversed in memory ("T"), or every other element
    of a buffer whose gaps hold NaN, -1 or True ("slice": a read outside the view shows)."""
    if not isinstance(x, Tensor):
        return x
    x, axes = x.to(device), list(reversed(range(x.dim())))
    if how is None or x.numel() == 0 or (how == "T" and x.dim() < 2):
        return x
    if how == "T":
        return x.permute(axes).contiguous().permute(axes)
    idx = (slice(None, None, 2),) + (slice(None),) * (x.dim() - 2) + (slice(None, None, 2),) * (x.dim() > 1)
    shape = [2 * n if i in (0, x.dim() - 1) else n for i, n in enumerate(x.shape)]
    big = torch.full(shape, math.nan if x.is_floating_point() else -1, dtype=x.dtype, device=device)
    big[idx] = x
    return big[idx]


def _grid(case: Case) -> tuple[Tensor, Tensor, Tensor]:
    """float64 similarities ``[G, Wq, Wd]`` of the reference's tokens (-inf where there is no document token), the
    scored query positions ``[G, Wq]``, and per score the rounding floor ``4 dim Σ_i ||q_i|| max_j ||d_j||``."""
    q, d = (torch.nn.functional.pad(_flat(x.double()), (0, 0, 0, 1)) for x in (case.Q_ref, case.D_ref))
    if case.flags["normalize"]:
        q, d = reference._normalize(q), reference._normalize(d)
    q, d = q[case.q_rows], d[case.d_rows]  # (-1: the zero row padded on)
    sims = torch.einsum("gid,gjd->gij", q, d).masked_fill((case.d_rows < 0)[:, None, :], -math.inf)
    rows = (case.q_rows >= 0) & (case.d_rows >= 0).any(-1, keepdim=True)
    norm_q, norm_d = (torch.linalg.vector_norm(x, dim=-1).nan_to_num(0.0, posinf=0.0) for x in (q, d))
    d_max = torch.cat([norm_d, norm_d.new_zeros(len(norm_d), 1)], 1).amax(1, keepdim=True)
    return sims, rows, 4 * q.shape[-1] * (norm_q * d_max * rows).sum(-1)


def _near_ties(sims: Tensor, rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``close [G, Wq, Wd]``: the document positions within the near-tie gap of their row's max; ``near [G, Wq]``:
    the scored rows with more than one."""
    finite = torch.isfinite(sims)
    scale = float(sims[finite].abs().max()) if finite.any() else 1.0
    close = finite & (sims >= (sims.amax(-1, keepdim=True) if sims.shape[-1] else sims) - GAP_TOL[dtype] * scale)
    return close, rows & (close.sum(-1) > 1)


def _check_scores(s: Tensor, rs: Tensor, rows: Tensor, sims: Tensor, floor: Tensor, dtype: torch.dtype) -> None:
    """Scores: shape, dtype, NaN and ±inf as the reference's; finite ones within ``tol · (|s| + Σ_i |max_j s_ij|)``
    plus the floor each, and within ``tol`` in whole-tensor relative error."""
    assert s.shape == rs.shape and s.dtype == score_dtype(dtype), f"scores {s.shape} {s.dtype}, expected {rs.shape}"
    a, e = s.detach().cpu().double().reshape(-1), rs.reshape(-1)
    assert_same_nan(a, e, "scores")
    inf = torch.isinf(a) | torch.isinf(e)
    assert torch.equal(a[inf], e[inf]), f"infinite scores differ: {a[inf].tolist()} != {e[inf].tolist()}"
    best = sims.amax(-1) if sims.shape[-1] else torch.zeros(rows.shape, dtype=torch.float64)
    magnitude = (best.abs().nan_to_num(0.0, posinf=0.0) * rows).sum(-1)
    tol, fin, floor = SCORE_TOL[dtype], torch.isfinite(e), floor * (2.0**-52 if dtype == torch.float64 else 2.0**-23)
    a, e, bound = a[fin], e[fin], (tol * (e.abs() + magnitude) + floor + 1e-30)[fin]
    assert bool(((a - e).abs() <= bound).all()), "scores: " + _describe_worst(a, e, bound)
    assert (a - e).norm() <= tol * e.norm() + floor[fin].norm(), f"scores: relative error {(a - e).norm() / e.norm()}"


def _check_argmax(case: Case, arg: Tensor, rarg: Tensor, sims: Tensor, rows: Tensor, dtype: torch.dtype) -> None:
    """The argmax: int32, the reference's shape, -1 pattern and tokens, up to the freedom of near-tied rows (none with
    exact data: ties go to the lowest index) and of rows whose max is not finite."""
    assert arg.dtype == torch.int32 and arg.shape == rarg.shape, f"argmax {arg.dtype} {arg.shape}, not {rarg.shape}"
    a, e = arg.cpu().long().reshape(case.q_rows.shape), rarg.reshape(case.q_rows.shape)
    assert torch.equal(a < 0, e < 0), f"argmax -1 at {(a < 0).nonzero().tolist()}, not {(e < 0).nonzero().tolist()}"
    ok, width = a == e, sims.shape[-1]
    if width:
        pick = a.clamp(0, width - 1)
        in_doc = (a >= 0) & (a < width) & (case.d_rows.gather(1, pick) >= 0)
        best, picked = sims.amax(-1), sims.gather(2, pick[..., None])[..., 0]
        close, near = _near_ties(sims, rows, dtype)
        if not case.flags["exact"]:
            ok |= near & in_doc & close.gather(2, pick[..., None])[..., 0]
        ok |= rows & in_doc & ~torch.isfinite(best) & (best.isnan() | picked.isnan() | (picked == best))
    bad = (~ok).nonzero().tolist()
    assert not bad, f"argmax at (score, token) {bad[:4]}: {[(a[i, t].item(), e[i, t].item()) for i, t in bad[:4]]}"


def _check_grads(case: Case, grads: list, ref_grads: list, sims: Tensor, rows: Tensor, grad: Tensor) -> None:
    """dQ and dD (where asked for): the inputs' shapes and dtype, finite where they fit the dtype, exactly zero on the
    tokens that no score uses, and on the tokens of unambiguous rows (all, with exact data) within ``tol · (|expected|
    + max |expected| of the token + floor)``, the floor rounding's scale: ``g / ||x||`` for a normalized token, else
    ``g · max ||other token||``."""
    dtype = ALL_DTYPES[case.flags["dtype"]]
    close, near = _near_ties(sims, rows, dtype)
    tied = (case.q_rows[near], case.d_rows[:, None, :].expand_as(close)[near[..., None] & close])
    norms = [torch.linalg.vector_norm(_flat(x.double()), dim=-1)[:, None] for x in (case.Q_ref, case.D_ref)]
    used = [_marked(len(norms[0]), case.q_rows[rows]), _marked(len(norms[1]), case.d_rows[rows.any(1)])]
    g_max = float(grad.abs().max()) if grad.numel() else 0.0
    for i, (name, got, want) in enumerate(zip(("dQ", "dD"), grads, ref_grads, strict=True)):
        if got is None:
            continue
        assert got.shape == want.shape and got.dtype == dtype, f"{name}: {got.shape} {got.dtype}, not {want.shape}"
        a, e = _flat(got.detach().cpu().double()), _flat(want)
        fits = (e.abs() <= torch.finfo(dtype).max / 2).all(1)  # (beyond fp16's range a gradient is inf, rightly)
        assert bool(torch.isfinite(a[fits]).all()), f"{name}: non-finite at {(~torch.isfinite(a)).nonzero().tolist()}"
        assert not bool(a[~used[i]].any()), f"{name}: unused tokens got {a[~used[i] & (a != 0).any(1)].tolist()[:2]}"
        other = norms[1 - i][used[1 - i]]
        floor = torch.full_like(norms[i], g_max * float(other.max()) if other.numel() else 0.0)
        floor = g_max / norms[i].clamp_min(1e-12) if case.flags["normalize"] else floor
        keep = (~_marked(len(a), tied[i]) | case.flags["exact"]) & fits
        a, e, floor = a[keep], e[keep], floor[keep]
        bound = GRAD_TOL[dtype] * (e.abs() + e.abs().amax(1, keepdim=True) + floor) + 1e-30
        assert bool(((a - e).abs() <= bound).all()), f"{name}: " + _describe_worst(a, e, bound)


def _library(case: Case, device: str, seed: int) -> tuple[Tensor, Tensor | None, Tensor, list[Tensor | None]]:
    """The library's scores, argmax (None unless asked for), the upstream gradient (float64, CPU) and [dQ, dD]."""
    f = case.flags
    Q, D = (_on(x, device, f["noncontig"]).detach() for x in (case.Q, case.D))
    Q.requires_grad_("Q" in f["grad"]), D.requires_grad_("D" in f["grad"])
    args = {k: _on(v, device, f["noncontig"]) for k, v in case.args.items()}
    kw = {"normalize": f["normalize"], "backward": f["backward"]}
    if f["argmax"] and f["argmax_fn"] and f["kind"] in ("cross", "candidates"):
        out = maxsim.maxsim_with_argmax(Q, D, **args, **kw)
    else:
        out = KINDS[f["kind"]][0](Q, D, **args, **kw, return_argmax=f["argmax"])
    assert isinstance(out, tuple) == f["argmax"], f"return_argmax={f['argmax']} returned a {type(out)}"
    s, arg = out if isinstance(out, tuple) else (out, None)
    grad = upstream_grad(s.shape, seed=seed, device=s.device)
    leaves = [x for x in (Q, D) if x.requires_grad]
    grads = iter(torch.autograd.grad(s, leaves, grad, allow_unused=True) if leaves else ())
    return s, arg, grad.cpu().double(), [next(grads) if x.requires_grad else None for x in (Q, D)]


def _reference(case: Case, grad: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The float64 reference's scores, argmax and [dQ, dD]."""
    Q, D = (x.detach().double().requires_grad_() for x in (case.Q_ref, case.D_ref))
    args = {k: v for k, v in case.args.items() if k != "validate"}
    s, arg = KINDS[case.flags["kind"]][1](Q, D, **args, normalize=case.flags["normalize"])
    grads = torch.autograd.grad(s, (Q, D), grad, allow_unused=True) if s.requires_grad else (None, None)
    return s.detach(), arg, [torch.zeros_like(x) if g is None else g for g, x in zip(grads, (Q, D), strict=True)]


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed-{s}")
def test_random_case_matches_reference(seed: int, backend: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One random case, called twice: scores, argmax and gradients of the library against the float64 reference."""
    keep_under_interpreter(seed in INTERPRETER_SEEDS, backend, device)
    case = _draw(seed, tiny=interpreted(backend, device) and not FULL_INTERPRETER, triton=backend == "triton")
    for key, value in case.flags["patches"].items() if backend == "torch" else ():
        module, name = key.split(".")
        monkeypatch.setattr(MODULES[module], name, (lambda *_, v=value: v) if isinstance(value, bool) else value)
    print(f"seed {seed}, {backend}: {case}")  # (shown with a failure)
    dtype = ALL_DTYPES[case.flags["dtype"]]
    sims, rows, floor = _grid(case)
    reference = None
    for _ in range(2):  # (the second call: a repeat, where its signature allows one)
        s, arg, grad, grads = _library(case, device, seed)
        reference = reference or _reference(case, grad)
        rs, rarg, ref_grads = reference
        _check_scores(s, rs, rows, sims, floor, dtype)
        if arg is not None:
            _check_argmax(case, arg, rarg, sims, rows, dtype)
        if case.flags["poison"] != "scored":  # (NaN / inf in a scored token: no gradient to compare)
            _check_grads(case, grads, ref_grads, sims, rows, grad)
