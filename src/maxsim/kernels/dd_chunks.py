"""The chunked atomics of a large cross product's dD: which documents each chunk sums in which fp32 buffer, the
launches that add and cast them, and the cast: a chunk's fp32 buffer rounded into dD, and cleared for the next chunk.

A large cross product's dD is summed a chunk of documents at a time (launch_settings.SCATTER_BUFFER_MAX_BYTES), so each
chunk ends with the cast. One launch reads the buffer once and writes both the result and the zeros; a cast copy
and a memset would be two launches and a second read of the buffer's lines. Where consecutive chunks add into
different buffers (chunk_plan alternates them), this pass runs inside the next chunk's atomics launch
instead, whose atomics leave the memory system's plain reads and writes idle.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 4096  # elements per program
NUM_WARPS = 8
FUSED_BLOCK = 2048  # elements per program inside an atomics launch (of its 4 warps)


def chunk_plan(K: int, docs: int) -> tuple[tuple[tuple[int, int, bool], ...], int]:
    """The chunks ``(first document, documents, in dD)`` of a chunked dD of ``K`` documents, and the documents of
    the chunks' own fp32 buffer (0: none), whose chunks hold ``docs`` documents at most.

    dD's own storage holds half the chunks' fp32 buffers: while documents ``[0, R)`` are not summed yet, their
    16-bit rows (2 bytes per element of a row) can hold the fp32 sums (4 bytes) of the last ``R // 3`` of them at
    their front, which then overlap neither those documents' rows, where the cast writes them, nor the rows of the
    chunk before (a chunk of the own buffer, above them). The chunks alternate between the two buffers, each taking
    its documents from the end of those left: a third of them in dD (the first, the largest, shares the dQ
    gather's launch), then ``docs`` in the own buffer, and so on. So each chunk's cast can run in the launch of the
    next chunk's atomics (``chunk_steps``), and the own buffer is never more than ``docs`` documents."""
    chunks, left, in_dd = [], K, True
    while left:
        n = left // 3 if in_dd and left >= 3 else min(docs, left)
        chunks.append((left - n, n, in_dd and left >= 3))
        left -= n
        in_dd = not chunks[-1][2]
    tail = max((n for _, n, in_dd in chunks if not in_dd), default=0)
    return tuple(chunks), tail


def chunk_steps(chunks: tuple, fused_first: bool) -> tuple[tuple[int | None, int | None, int], ...]:
    """The launches that sum ``chunks`` after the main launch (which adds the first one when ``fused_first``):
    ``(chunk whose atomics it runs, chunk it casts, documents its cast clears)``, either of the first two None.

    A chunk's cast runs in the next chunk's atomics launch when the two chunks use different buffers (else in a
    launch of its own, before it); it clears the documents of the next chunk to use its buffer, which always adds
    in a later launch. The last chunk's cast is a launch of its own."""

    def clear(j: int) -> int:
        later = [n for _k0, n, in_dd in chunks[j + 1 :] if in_dd == chunks[j][2]]
        return later[0] if later else 0

    steps = []
    for i in range(len(chunks)):
        prev = i - 1 if i else None
        fuse = prev is not None and chunks[prev][2] != chunks[i][2]
        if prev is not None and not fuse:
            steps.append((None, prev, clear(prev)))
        scatter = None if i == 0 and fused_first else i
        if scatter is not None or fuse:
            steps.append((scatter, prev if fuse else None, clear(prev) if fuse else 0))
    steps.append((None, len(chunks) - 1, 0))
    return tuple(steps)


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
    # Every element's load before any element's clear: the compiler lays the load out as the 16-bit store (8 elements
    # a thread) and the clear as an fp32 store (4), so an element is read by one warp and cleared by another, which
    # may run ahead of it (Triton 3.6 and 3.9 alike; on an H200 under 3.9 that zeroed 487 of a 256 x 256 Ld300
    # step's 9.8M dD elements, test_cuda.py's chunked-atomics test).
    tl.debug_barrier()
    tl.store(BUF + offs, tl.zeros_like(x), mask=offs < n_clear)
