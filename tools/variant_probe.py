"""PyLate-style calls against the peer that takes them: document masks with holes and ``normalize=True`` (GPU).

The bench's workloads are unmasked, unit-norm tokens. PyLate masks each document's padding and punctuation (a mask
with holes), and ColBERT-style models may ask the kernel to normalize the tokens. late-interaction-kernels' ``maxsim``
takes both (``d_mask``, ``normalize``); flash-maxsim takes lengths only and no normalization, so it is left out;
eager is PyLate's einsum with a masked fill (and ``F.normalize`` first). Every variant runs on the same tokens:
Gaussian, scaled per token by a factor in [0.5, 2] (so that normalizing changes them); masks keep a prefix of
each document (a third of it to all of it) less ~10 % of the tokens in it.

Each (shape, variant) checks every implementation against :mod:`maxsim.reference` (float64 on the same rounded
inputs; scores, and in training both gradients, as relative errors) before timing it as the bench times
(``runner.make_timer``: ``do_bench`` with its L2 flush, medians), in interleaved rounds, the median of the rounds'
medians; a training row also gives each implementation's peak extra memory (``runner.peak_extra_mib``). The
``vs best`` column is the fastest other implementation's time over maxsim's.

Usage (GPU): python tools/variant_probe.py [--rounds 3] [--only SUBSTR ...] [--variants plain mask norm mask+norm]
             [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import maxsim
from maxsim import reference
from maxsim.bench.runner import make_timer, peak_extra_mib

#: (mode, layout, Nq, Nd or K, Lq, Ld, dim): matrix shapes PyLate-style training and reranking use, and issue 5's
#: off-matrix sizes.
SHAPES: tuple[tuple[str, str, int, int, int, int, int], ...] = (
    ("infer", "cross", 1, 1000, 32, 300, 128),
    ("infer", "cross", 128, 128, 32, 300, 128),
    ("infer", "candidates", 32, 100, 32, 256, 128),
    ("infer", "cross", 7, 1000, 23, 333, 96),
    ("infer", "candidates", 32, 7, 23, 333, 48),
    ("train", "cross", 32, 32, 32, 80, 128),
    ("train", "cross", 64, 64, 32, 128, 128),
    ("train", "cross", 256, 256, 32, 300, 128),
    ("train", "candidates", 64, 32, 32, 180, 128),
    ("train", "cross", 64, 64, 23, 333, 96),
    ("train", "candidates", 64, 7, 23, 333, 48),
    # (after the first eleven, which keep their seeds: blocks of 64 query rows, and long documents)
    ("infer", "candidates", 64, 20, 64, 300, 128),
    ("infer", "cross", 1, 5000, 64, 180, 128),
    ("infer", "cross", 1, 1000, 32, 1024, 128),
)
VARIANTS = ("plain", "mask", "norm", "mask+norm")
HOLES = 0.1  # fraction of a document's kept prefix masked out (punctuation)


@dataclass
class Case:
    mode: str
    layout: str
    Q: Tensor
    D: Tensor
    d_mask: Tensor | None
    normalize: bool
    g: Tensor  # upstream gradient of the scores (the random linear loss)


def shape_name(shape: tuple) -> str:
    mode, layout, nq, nd, lq, ld, dim = shape
    head = "cross" if layout == "cross" else "cand"
    return f"{mode}/{head}-{nq}x{nd}-lq{lq}-ld{ld}" + ("" if dim == 128 else f"-d{dim}")


def make_case(shape: tuple, variant: str, device: torch.device, dtype: torch.dtype, seed: int) -> Case:
    mode, layout, nq, nd, lq, ld, dim = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def tokens(*lead: int) -> Tensor:
        x = torch.randn(*lead, dim, generator=gen, device=device)
        scale = 0.5 + 1.5 * torch.rand(*lead, 1, generator=gen, device=device)
        return (F.normalize(x, dim=-1) * scale).to(dtype)

    Q = tokens(nq, lq)
    docs = (nd,) if layout == "cross" else (nq, nd)
    D = tokens(*docs, ld)
    d_mask = None
    if "mask" in variant:
        keep = torch.randint(max(1, ld // 3), ld + 1, docs, generator=gen, device=device)
        prefix = torch.arange(ld, device=device) < keep[..., None]
        d_mask = prefix & (torch.rand(*docs, ld, generator=gen, device=device) >= HOLES)
        d_mask[..., 0] = True  # (every document keeps a token)
    g = torch.randn(nq, nd, generator=gen, device=device)
    return Case(mode, layout, Q, D, d_mask, "norm" in variant, g)


def _eager(Q: Tensor, D: Tensor, d_mask: Tensor | None, normalize: bool, cross: bool) -> Tensor:
    if normalize:
        Q, D = F.normalize(Q, dim=-1), F.normalize(D, dim=-1)
    sim = torch.einsum("qid,kjd->qkij" if cross else "qid,qkjd->qkij", Q, D)
    if d_mask is not None:
        sim = sim.masked_fill(~(d_mask[None, :, None, :] if cross else d_mask[:, :, None, :]), float("-inf"))
    return sim.amax(dim=-1).float().sum(dim=-1)


def scorers(case: Case, impls: list[str]) -> dict[str, Callable[[Tensor, Tensor], Tensor]]:
    cross, m, norm = case.layout == "cross", case.d_mask, case.normalize
    out: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}
    for name in impls:
        if name == "maxsim":
            out[name] = lambda Q, D: maxsim.maxsim(Q, D, d_mask=m, normalize=norm)
        elif name == "eager":
            out[name] = lambda Q, D: _eager(Q, D, m, norm, cross)
        elif name == "lik":
            lik = importlib.import_module("late_interaction_kernels")
            out[name] = lambda Q, D: lik.maxsim(Q, D, d_mask=m, normalize=norm)
        else:
            raise ValueError(f"--impl: unknown {name!r}")
    return out


def call_of(case: Case, fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[], tuple]:
    if case.mode == "infer":

        def infer() -> tuple:
            with torch.no_grad():
                return (fn(case.Q, case.D),)

        return infer
    Qg, Dg = case.Q.detach().requires_grad_(), case.D.detach().requires_grad_()

    def train() -> tuple:
        s = fn(Qg, Dg)
        return (s, *torch.autograd.grad(s, (Qg, Dg), case.g.to(s.dtype)))

    return train


def _rel(a: Tensor, b: Tensor) -> float:
    den = torch.linalg.vector_norm(b.double()).item()
    return torch.linalg.vector_norm(a.double() - b.double()).item() / max(den, 1e-30)


def reference_of(case: Case) -> tuple[Tensor, ...]:
    """float64 scores (and gradients) of the same rounded inputs, in slices of queries (a cross product's
    similarities in float64 would not fit at 256 x 256 otherwise)."""
    Q = case.Q.double().requires_grad_(case.mode == "train")
    D = case.D.double().requires_grad_(case.mode == "train")
    step = max(1, (1 << 27) // (Q.shape[1] * D.shape[-2] * (D.shape[0] if case.layout == "cross" else D.shape[1])))
    scores, dQ, dD = [], torch.zeros_like(Q), torch.zeros_like(D)
    for s in range(0, Q.shape[0], step):
        e = min(Q.shape[0], s + step)
        qs = Q[s:e].detach().requires_grad_(Q.requires_grad)
        ds = D if case.layout == "cross" else D[s:e]
        ds = ds.detach().requires_grad_(D.requires_grad)
        dm = case.d_mask if case.layout == "cross" or case.d_mask is None else case.d_mask[s:e]
        with torch.set_grad_enabled(Q.requires_grad):
            sc = reference.maxsim(qs, ds, d_mask=dm, normalize=case.normalize)
        scores.append(sc.detach())
        if Q.requires_grad:
            gq, gd = torch.autograd.grad(sc, (qs, ds), case.g[s:e].double())
            dQ[s:e] = gq
            if case.layout == "cross":
                dD += gd
            else:
                dD[s:e] = gd
    out = torch.cat(scores)
    return (out,) if case.mode == "infer" else (out, dQ, dD)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None, help="substrings of shape names (e.g. train/cross-64x64)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--impl", nargs="*", default=["maxsim", "lik", "eager"], choices=["maxsim", "lik", "eager"])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
    # (the CPU: a smoke run of the tool itself, fp32, without the peer; its times mean nothing here)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    impls = [n for n in args.impl if device.type == "cuda" or n != "lik"]
    timer = make_timer(device, 25.0, 100.0)
    rows = []
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{card}; {dtype}; maxsim at {os.environ.get('MAXSIM_GIT_COMMIT', '?')}")
    print(f"{'shape':34s} {'variant':10s} " + " ".join(f"{n:>16s}" for n in impls) + "  vs best   errors")
    for seed, shape in enumerate(SHAPES):
        name = shape_name(shape)
        if args.only and not any(s in name for s in args.only):
            continue
        for variant in args.variants:
            case = make_case(shape, variant, device, dtype, seed)
            ref = reference_of(case)
            calls, errs, mib = {}, {}, {}
            for impl, fn in scorers(case, impls).items():
                call = call_of(case, fn)
                try:
                    out = call()
                except Exception as e:  # a peer that refuses the call: reported, not timed
                    errs[impl] = f"{type(e).__name__}: {e}"[:80]
                    continue
                errs[impl] = max(_rel(o, r) for o, r in zip(out, ref, strict=True))
                calls[impl] = call
                peak = peak_extra_mib(call, device) if case.mode == "train" else None
                if peak is not None:
                    mib[impl] = peak
                del out
            times: dict[str, list[float]] = {k: [] for k in calls}
            for _ in range(args.rounds):
                for impl, call in calls.items():
                    times[impl].append(timer(call))
            med = {k: statistics.median(v) for k, v in times.items()}
            others = [v for k, v in med.items() if k != "maxsim"]
            ratio = min(others) / med["maxsim"] if others and "maxsim" in med else float("nan")
            cells = " ".join(
                f"{med[n]:10.4f} ms" + (f" {mib[n]:4.0f}M" if n in mib else "") if n in med else f"{'-':>16s}"
                for n in impls
            )
            err = " ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in errs.items())
            print(f"{name:34s} {variant:10s} {cells}  {ratio:6.2f}x  {err}", flush=True)
            rows.append({"shape": name, "variant": variant, "ms": med, "mib": mib, "errors": errs, "vs_best": ratio})
            del case, ref, calls
            torch.cuda.empty_cache()
    if args.out:
        meta = {"device": card, "dtype": str(dtype), "commit": os.environ.get("MAXSIM_GIT_COMMIT")}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
