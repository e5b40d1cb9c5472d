"""The split dQ walk's last step: its fp32 slices summed in slice order and rounded once into dQ's dtype.

``torch.sum(slices, 0, out=dQ)`` does the same in two launches (a reduction into an fp32 temporary, then a cast copy)
and twice the host time of one; a small training step is made of host time.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 256  # elements per program (a few query rows: 1 query of 64 x 128 is 32 programs)


@triton.jit(do_not_specialize=["n", "n_slices"])
def sum_slices_kernel(PARTS, OUT, n, n_slices, BLOCK: tl.constexpr):
    """``OUT[i] = Σ_s PARTS[s * n + i]`` for ``i`` in this program's block, summed in increasing ``s`` (fp32), stored
    in ``OUT``'s dtype. ``PARTS``: ``n_slices`` contiguous fp32 slices of ``n`` elements; ``OUT``: ``n``
    contiguous elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, n_slices):
        acc += tl.load(PARTS + s * n + offs, mask=ok, other=0.0)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)
