"""Whether a masked scan waits on its mask's loads (GPU): the same call without a mask, with an all-true mask of its
own a document, and with one all-true row read by every document (stride 0, so it stays cached). If the cached
mask is no faster than the own one, the mask's loads are not what a masked scan pays for.

Usage (GPU): python tools/mask_cache_probe.py   (medians after the bench's L2 flush, the best of 3, µs)
"""

from __future__ import annotations

import torch

import maxsim
from maxsim.bench.runner import make_timer

#: (Nq, K, Lq, Ld, dim, candidates): the masked rows of tools/variant_probe.py and ColPali
SHAPES = (
    (1, 5000, 64, 180, 128, False),
    (64, 20, 64, 300, 128, True),
    (128, 128, 32, 300, 128, False),
    (1, 500, 1024, 1024, 128, False),
    (7, 1000, 23, 333, 96, False),
    (32, 100, 32, 256, 128, True),
)


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    timer = make_timer(dev, 25, 200)
    for nq, k, lq, ld, dim, cand in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        Q = torch.randn(nq, lq, dim, device=dev, dtype=dt, generator=g)
        D = torch.randn(*((nq, k) if cand else (k,)), ld, dim, device=dev, dtype=dt, generator=g)
        masks = {
            "none": None,
            "own": torch.ones(D.shape[:-1], dtype=torch.bool, device=dev),
            "cached": torch.ones(ld, dtype=torch.bool, device=dev).expand(D.shape[:-1]),
        }
        for norm in (False, True):
            times = {}
            for name, m in masks.items():

                def call(m=m):
                    return maxsim.maxsim(Q, D, d_mask=m, normalize=norm)

                call()
                times[name] = min(timer(call) for _ in range(3)) * 1000
            cols = "  ".join(f"{name} {t:.1f} us" for name, t in times.items())
            print(f"{nq}x{k} lq{lq} ld{ld} cand={cand} norm={norm}: {cols}", flush=True)


if __name__ == "__main__":
    main()
