"""What a ragged call costs when its token totals change from call to call, as they do between the batches of a
training loop (the packed rows ``ΣLq`` and ``ΣLd`` of each batch), against the same call on the same tensors.

A plan is keyed by shapes (never values), and the packed tensors' row counts are shapes: each new total plans the
forward and the backward again and launches through Triton's own path. Here both kinds of call run on one set of
layouts: the bench's pair list (64 queries x 32 candidates, Lq 32, Ld 180) and skewed varlen cross product
(64 x 256, Lq 8-32, Ld 20-1000), as inference and as training steps, each batch's lengths drawn anew (the pair
list's documents 120-180 tokens) and the maxima fixed, as a collate would hand them over; wall time per call over
``--calls`` calls, synchronized once at the end (host-bound calls: their host time).

Usage: python tools/ragged_totals_probe.py [--calls 200] [--normalize] [--stub]
    (on a GPU; ``--normalize``: the calls with normalize=True; ``--stub``: here, the Triton path on meta tensors with
    its launches stubbed, as tools/host_stub.py)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import maxsim


def _layout(name: str, seed: int, device: str) -> tuple:
    """``(Q, D, cu_q, cu_d, pair_q, pair_d, max_q, max_d)`` of a batch of layout ``name``, lengths drawn with
    ``seed`` (another seed: other token totals, the same counts and maxima)."""
    g = torch.Generator().manual_seed(seed)
    if name == "pair list":  # (queries of 32 tokens; each query's 32 candidates of 120-180 from a pool of 2048)
        nq, k, n_docs, max_q, max_d = 64, 32, 2048, 32, 180
        lq = torch.full((nq,), 32)
        ld = torch.randint(120, max_d + 1, (n_docs,), generator=g)
        pair_q = torch.arange(nq).repeat_interleave(k).int()
        pair_d = torch.randperm(n_docs, generator=g)[: nq * k].int()
    else:  # (the bench's skewed varlen cross product)
        nq, n_docs, max_q, max_d = 64, 256, 32, 1000
        lq = torch.randint(8, max_q + 1, (nq,), generator=g)
        ld = torch.randint(20, max_d + 1, (n_docs,), generator=g)
        pair_q = pair_d = None
    cu_q = torch.nn.functional.pad(lq.cumsum(0), (1, 0)).int()
    cu_d = torch.nn.functional.pad(ld.cumsum(0), (1, 0)).int()
    Q = torch.randn(int(lq.sum()), 128, dtype=torch.bfloat16, device=device).requires_grad_()
    D = torch.randn(int(ld.sum()), 128, dtype=torch.bfloat16, device=device).requires_grad_()
    if device == "meta":  # (index tensors' values are never read on the host: meta ones of the same shapes)
        return (
            Q,
            D,
            *(None if x is None else torch.empty_like(x, device="meta") for x in (cu_q, cu_d, pair_q, pair_d)),
            max_q,
            max_d,
        )
    return Q, D, *(None if x is None else x.to(device) for x in (cu_q, cu_d, pair_q, pair_d)), max_q, max_d


def _call(args: tuple, train: bool, normalize: bool = False) -> object:
    Q, D, cu_q, cu_d, pq, pd, max_q, max_d = args
    kw = dict(max_seqlen_q=max_q, max_seqlen_d=max_d, normalize=normalize)
    if not train:
        with torch.no_grad():
            if pq is None:
                return maxsim.maxsim_varlen(Q, D, cu_q, cu_d, **kw)
            return maxsim.maxsim_pairs_varlen(Q, D, cu_q, cu_d, pq, pd, **kw)
    s = (
        maxsim.maxsim_varlen(Q, D, cu_q, cu_d, **kw)
        if pq is None
        else maxsim.maxsim_pairs_varlen(Q, D, cu_q, cu_d, pq, pd, **kw)
    )
    return torch.autograd.grad(s.sum(), (Q, D))


def _us_per_call(fn: Callable[[tuple], object], batches: list[tuple], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    for b in batches:
        fn(b)
    sync()
    return (time.perf_counter() - t0) / len(batches) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--normalize", action="store_true", help="the calls with normalize=True")
    ap.add_argument("--stub", action="store_true", help="no GPU: launches stubbed on meta tensors (host time only)")
    args = ap.parse_args()
    if args.stub:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import host_stub

        host_stub.stub_gpu()
        device, sync = "meta", (lambda: None)
    else:
        device, sync = "cuda", torch.cuda.synchronize
    for name in ("pair list", "varlen"):
        same = _layout(name, 0, device)
        for mode in ("infer", "train"):
            train = mode == "train"
            call = lambda b, t=train: _call(b, t, args.normalize)  # noqa: E731
            for _ in range(20):
                call(same)
            t_same = _us_per_call(call, [same] * args.calls, sync)
            # (seeds of their own per row: totals that neither direction's plans have met)
            new = [_layout(name, (1 + train) * 100_000 + i, device) for i in range(args.calls)]
            t_new = _us_per_call(call, new, sync)
            norm = " normalized" if args.normalize else ""
            print(f"{name:9s} {mode:5s}{norm}  same tensors {t_same:7.1f} us   new totals each call {t_new:7.1f} us   "
                  f"ratio {t_new / t_same:4.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
