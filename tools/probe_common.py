"""What the GPU probing tools share: the cross-product training shapes they look at, and a per-kernel profile."""

from __future__ import annotations

from collections.abc import Callable

import torch

from maxsim.bench.workloads import Workload

#: name: (Nq, Nd, Lq, Ld, dim) of the cross-product training steps the tools break down (design.md §7's large steps,
#: the small contrastive ones, and issue 5's off-matrix shape).
TRAIN_CROSS_SHAPES = {
    "cross 32x32 Lq32 Ld80": (32, 32, 32, 80, 128),
    "cross 64x64 Lq32 Ld128": (64, 64, 32, 128, 128),
    "cross 256x256 Lq32 Ld300": (256, 256, 32, 300, 128),
    "cross 64x64 Lq32 Ld1024": (64, 64, 32, 1024, 128),
    "cross 32x32 Lq1024 Ld1024": (32, 32, 1024, 1024, 128),
    "cross 64x64 Lq23 Ld333 d96 (off-matrix)": (64, 64, 23, 333, 96),
    "cross 128x128 Lq23 Ld333 (off-matrix)": (128, 128, 23, 333, 128),
}


def kernel_table(label: str, step: Callable[[], object], host: bool = False, rows: int = 8) -> None:
    """Time per kernel over 10 calls of ``step`` after 5 warm-up calls (torch.profiler); ``host`` adds the host
    ops."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if host:
        activities.insert(0, torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(f"profile of 10 calls, {label}:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))


#: Document masks the probes can pass: every token kept (a padded batch of equal lengths), a kept prefix of half to
#: all of each document's tokens (padding only), or that prefix less about 10 % holes (PyLate's skiplist tokens).
MASK_KINDS = ("all", "prefix", "holes")


def document_mask(shape: tuple[int, ...], kind: str, device: torch.device | str, seed: int = 0) -> torch.Tensor:
    """A bool ``d_mask`` of token shape ``shape`` (``[..., Ld]``) of one of :data:`MASK_KINDS`; each document keeps
    its first token, so no document is empty."""
    if kind not in MASK_KINDS:
        raise ValueError(f"mask kind: expected one of {MASK_KINDS}, got {kind!r}")
    ld = shape[-1]
    if kind == "all":
        return torch.ones(shape, dtype=torch.bool, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    lengths = torch.randint(ld // 2, ld + 1, shape[:-1], device=device, generator=gen)
    mask = torch.arange(ld, device=device) < lengths[..., None]
    if kind == "holes":
        mask &= torch.rand(shape, device=device, generator=gen) >= 0.1
    mask[..., 0] = True
    return mask


def parse_shape(mode: str, text: str) -> Workload:
    """``LAYOUT:NQxNDxLQxLD[xDIM]`` (a dense layout: cross, candidates, pairs) -> a workload of ``mode``."""
    layout, _, dims = text.partition(":")
    parts = dims.split("x")
    if layout not in ("cross", "candidates", "pairs") or len(parts) not in (4, 5) or not all(map(str.isdigit, parts)):
        raise SystemExit(f"--shape {text!r}: expected cross|candidates|pairs:NQxNDxLQxLD[xDIM]")
    return Workload(mode, layout, *map(int, parts))
