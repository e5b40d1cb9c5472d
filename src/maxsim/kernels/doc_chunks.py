"""The last step of a forward whose documents were scanned in chunks (forward.py's ``DOC_SPLIT``).

A launch of few long documents has fewer programs than the GPU has multiprocessors, each streaming a whole document;
scanning each document in chunks by programs of their own fills the GPU, and each chunk leaves its rows' maxima
behind. Here they are folded in chunk order, as the one-program scan folds its tiles: a chunk replaces the running
argmax only with a strictly larger value (an earlier token keeps a tie; NaN never replaces, but propagates into the
max), and a row no chunk saw a valid token in contributes 0 with argmax -1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import chunk_tokens, nan_max


@triton.jit(do_not_specialize=["n_pairs", "Lq", "n_chunks"])
def combine_chunks_kernel(
    ROWS, OUT, ARG, n_pairs, Lq, n_chunks, LQ_BLOCK: tl.constexpr, SAVE_ARGMAX: tl.constexpr
):  # fmt: skip
    """``OUT[p] += Σ_t max_c PV[c, p, t]`` over the live rows of pair ``p`` (a flattened ``(query, document)``),
    and with ``SAVE_ARGMAX`` ``ARG[p, t]``, the chunk's token ``PA[c, p, t]`` that holds the max (-1 where no chunk
    is live). ``ROWS`` (contiguous, fp32) holds ``PV [n_chunks, n_pairs, Lq]``, then ``PA`` of that shape as int32
    (:func:`.forward.chunk_tokens`); a row is live in chunk ``c`` where ``PA[c, p, t] >= 0``. One program per pair,
    ``LQ_BLOCK`` rows at a time."""
    p = tl.program_id(0).to(tl.int64)
    PV = ROWS
    PA = chunk_tokens(ROWS, (p * 0 + n_chunks) * n_pairs * Lq)  # (int64)
    total = tl.zeros([LQ_BLOCK], dtype=tl.float32)
    for t0 in range(0, Lq, LQ_BLOCK):
        t = t0 + tl.arange(0, LQ_BLOCK)
        in_q = t < Lq
        best = tl.full([LQ_BLOCK], float("-inf"), dtype=tl.float32)
        arg = tl.full([LQ_BLOCK], -1, dtype=tl.int32)
        for c in range(0, n_chunks):
            at = (c * n_pairs + p) * Lq + t
            v = tl.load(PV + at, mask=in_q, other=0.0)
            a = tl.load(PA + at, mask=in_q, other=-1)
            ok = a >= 0
            arg = tl.where(ok & ((arg < 0) | (v > best)), a, arg)
            best = tl.where(ok, nan_max(best, v), best)
        total += tl.where(arg >= 0, best, 0.0)
        if SAVE_ARGMAX:
            tl.store(ARG + p * Lq + t, arg, mask=in_q)
    tl.store(OUT + p, tl.load(OUT + p) + tl.sum(total, axis=0))
