"""The chunked atomics' cast: a chunk of documents' fp32 dD buffer rounded into dD, and cleared for the next chunk.

A large cross product's dD is summed a chunk of documents at a time (launch.py's SCATTER_BUFFER_MAX_BYTES), so each
chunk ends with this pass. One launch reads the buffer once and writes both the result and the zeros; a cast copy
and a memset would be two launches and a second read of the buffer's lines. Where consecutive chunks add into
different buffers (launch.py's _dd_chunks alternates them), this pass runs inside the next chunk's atomics launch
instead, whose atomics leave the memory system's plain reads and writes idle.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 4096  # elements per program
NUM_WARPS = 8
FUSED_BLOCK = 2048  # elements per program inside an atomics launch (of its 4 warps)


@triton.jit(do_not_specialize=["n", "n_clear"])
def cast_clear_kernel(BUF, OUT, n, n_clear, BLOCK: tl.constexpr):
    """``OUT[i] = BUF[i]`` in ``OUT``'s dtype for the ``n`` contiguous elements of both, and ``BUF[i] = 0`` for the
    first ``n_clear`` of them (what the next chunk adds into)."""
    cast_clear_block(tl.program_id(0), BUF, OUT, n, n_clear, BLOCK)


@triton.jit
def cast_clear_block(pid, BUF, OUT, n, n_clear, BLOCK: tl.constexpr):
    """Block ``pid`` of :func:`cast_clear_kernel` (also run by the programs of a chunk's atomics launch that cast
    the chunk before it: backward.py's ``maxsim_bwd_scatter_kernel``)."""
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(BUF + offs, mask=ok, other=0.0)
    tl.store(OUT + offs, x.to(OUT.dtype.element_ty), mask=ok)
    tl.store(BUF + offs, tl.zeros_like(x), mask=offs < n_clear)
