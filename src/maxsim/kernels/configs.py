"""Launch configurations: a fixed heuristic keyed by coarse shape buckets, never a call-time autotune sweep.

Only ``Lq``, ``dim``, whether tokens are fp32 (their own table) and, for the packing factor, ``Nq`` below 128 / TQ
(64 / TQ for fp32) pick a variant; ``Nq``, ``Nd``, ``K`` and ``Ld`` are runtime arguments of every kernel, so new
batch sizes or document lengths never compile anything new.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class ForwardConfig:
    TQ: int  # query-token rows per query per block (power of two, >= 16)
    BQ: int  # queries packed into one program (shared documents only)
    BLOCK_N: int  # document tokens per tile
    BLOCK_K: int  # dim chunk per MMA
    NUM_K: int  # dim chunks
    num_warps: int
    num_stages: int
    # Programs per multiprocessor a persistent launch plans for (0: one program per document). Persistent programs
    # walk several shared dense documents each, for a row block that fits one program (launch_forward.py decides).
    persist: int = 0
    # Register cap per thread (ptxas .maxnreg; 0: none): more resident programs at the price of a few spills.
    maxnreg: int = 0


@dataclass(frozen=True)
class BackwardConfig:
    BT: int  # query tokens per dQ program
    DIM_P: int  # padded dim for the gather (one row load)
    TQ: int  # query tokens per one-hot MMA step (deterministic dD)
    BN: int  # document tokens owned by one deterministic dD program
    BLOCK_K: int  # dim chunk owned by one deterministic dD program
    num_warps: int


def _dim_split(dim: int) -> tuple[int, int]:
    dim_p = max(16, next_pow2(dim))
    block_k = min(dim_p, 128)
    return block_k, dim_p // block_k


def _fewest_slots(Nq: int, cap: int) -> int:
    """The number of queries a block packs, a power of two up to ``cap``, that leaves the fewest empty query slots
    in the last block; ties go to the larger block (fewer reads of each document)."""
    sizes = [cap >> i for i in range(cap.bit_length())]
    return min(sizes, key=lambda b: (-(-Nq // b) * b, -b))


# The long queries' (Lq > 128) tiles at dims up to 128, warps and stages, and the stages of their scores-only
# forward (module settings, for tools/knobs.py; see scores_only_config).
LONG_QUERY_BLOCK_N, LONG_QUERY_NUM_WARPS, LONG_QUERY_STAGES = 64, 4, 3
LONG_QUERY_SCORES_STAGES = 4
LONG_QUERY_SCORES_PERSIST = 2


# Tokens wider than this many dims (the padded width) run the forward's pipelined dim loop (forward.py's
# UNROLLED_DIM_CHUNKS: more than two chunks), in WIDE_BLOCK_K-wide chunks: a query chunk and a tile chunk a stage,
# where the unrolled loop holds every chunk of the query block and of the tiles in flight.
UNROLLED_MAX_DIM = 256
UNROLLED_DIM_CHUNKS = 2  # (forward.py's constant of the same name)
WIDE_BLOCK_K = 64


def wide(dim: int) -> bool:
    """Whether ``dim``-wide tokens take the forward's dim loop."""
    return max(16, next_pow2(dim)) > UNROLLED_MAX_DIM


def _wide_config(Lq: int, dim: int, Nq: int, shared_docs: bool, itemsize: int) -> ForwardConfig:
    """The dim loop's configuration (see :data:`WIDE_BLOCK_K`). H200, ``tools/tune.py --wide`` (docs/performance.md
    v123; ms, the best against the first guess of 64-token tiles in 3 stages): 16-bit blocks of 256 rows (packed
    queries) keep 64-token tiles in 4 stages (cross 32x256 Lq32 Ld180 d1024 0.224 against 0.252, d768 0.180 against
    0.201; 128-dim chunks 0.289), 128-row blocks (long queries) 128-token tiles in 4 stages (8x64 Lq256 Ld512
    d1024 0.231 against 0.316). Thin blocks (memory-bound scans) take 64-token tiles in 4 stages: a document's last
    tile runs whole however few tokens it holds, and 128-token tiles left a 300-token document 22 % of empty slots
    (v126: 1x1000 Ld300 d768 0.142 -> 0.124, Ld300 d1024 0.183 -> 0.159, Ld180 d768 0.097 -> 0.081, candidates
    32x100 Ld180 d768 0.265 -> 0.228; where 128-token tiles fill, even: 1x1000 Ld512 d1024 0.253 -> 0.252,
    candidates 32x100 Ld256 d1024 0.389 -> 0.391). fp32 tokens (``tf32x3``: split operands) take blocks
    of at most 128 rows against 64-token tiles in 3 stages (cross 32x256 Lq32 Ld180 d384: 128 rows 0.564, 64 rows
    against 32-token tiles 0.805; candidates 32x16 Ld256 d512 0.133 against 0.241)."""
    num_k = -(-dim // WIDE_BLOCK_K)
    most_rows = 256 if itemsize == 2 else 128
    TQ = min(128, max(16, next_pow2(Lq)))  # (longer queries: one program a 128-row block)
    BQ = max(1, min(most_rows // TQ, next_pow2(Nq))) if shared_docs and Lq <= TQ else 1
    if TQ >= PACK_TRIM_MIN_TQ:
        BQ = _fewest_slots(Nq, BQ)
    rows = BQ * TQ
    warps = 8 if rows >= 128 else 4
    if itemsize == 4:
        return ForwardConfig(TQ, BQ, 64, WIDE_BLOCK_K, num_k, warps, 3)
    return ForwardConfig(TQ, BQ, 128 if rows == 128 else 64, WIDE_BLOCK_K, num_k, warps, 4)


@lru_cache(maxsize=256)
def forward_config(Lq: int, dim: int, Nq: int, shared_docs: bool, fp32: bool = False) -> ForwardConfig:
    """Pick the forward variant (the same with or without the argmax). ``shared_docs``: every query sees the same
    documents (cross product); ``fp32``: 4-byte tokens (see :func:`_fp32_config`)."""
    itemsize = 4 if fp32 else 2
    if wide(dim):
        return fit_tiles(_wide_config(Lq, dim, Nq, shared_docs, itemsize), dim, itemsize)
    if fp32:
        return _fp32_config(Lq, dim, Nq, shared_docs)
    return fit_tiles(_bf16_config(Lq, dim, Nq, shared_docs), dim, 2)


def _bf16_config(Lq: int, dim: int, Nq: int, shared_docs: bool) -> ForwardConfig:
    """:func:`forward_config` of 16-bit tokens, before :func:`fit_tiles`."""
    # Measured on an H200 (tools/tune.py, bf16, dim 128; runs 3-5 in docs/performance.md): packing 8 queries of 32
    # tokens (256 rows) against one document tile wins every compute-bound cross-product shape; single thin
    # queries are memory-bound and prefer 4 warps; long queries (Lq > 128) run one 128-row block per program.
    block_k, num_k = _dim_split(dim)
    if Lq > 128:
        # One 128-row block per program, 64-token tiles, uncapped: the argmax forward fits 244 registers without
        # spills since its tile loads lost their row predicate and the row-block loop its nest (H100,
        # docs/performance.md v34: training step of 32x32 Lq1024 Ld1024 830 -> 766 us against 32-token tiles capped
        # at 128 registers, which v20 had preferred when the 64-token loop spilled).
        bn = 32 if num_k > 1 else LONG_QUERY_BLOCK_N
        return ForwardConfig(128, 1, bn, block_k, num_k, LONG_QUERY_NUM_WARPS, LONG_QUERY_STAGES)
    TQ = max(16, next_pow2(Lq))
    BQ = max(1, min(256 // TQ, next_pow2(Nq))) if shared_docs else 1
    if num_k > 1:
        BQ = max(1, BQ // 2)  # keep the accumulator tiles in registers at dim >= 256
    if TQ >= PACK_TRIM_MIN_TQ:
        # Blocks of 128-row queries are compute-bound, and an empty query slot costs what a full one does (H200,
        # in-process, cross 3x777 Lq100 Ld333 dim 96: two queries a block 85.3 us, one 72.1).
        BQ = _fewest_slots(Nq, BQ)
    rows = BQ * TQ
    if num_k > 1:
        block_n = 32
    elif rows <= 32:
        # Independent of shared_docs on purpose: a batch of one (pairs B=1, candidates Nq=1) is also "shared".
        block_n = 128 if dim <= 64 else 32
    else:
        block_n = 64
    num_warps = 8 if rows >= 128 else 4
    # Persistent programs pay off where several queries are packed against shared documents (H100, fwd_probe:
    # 256x256 Lq32 Ld300 0.45 -> 0.36 ms, corpus scan 12.1 -> 8.7 ms); for single thin queries and row-split long
    # ones the one-program-per-document launch stays faster (1x10000 Ld300 0.26 vs 0.29, ColPali 0.24 vs 0.27 ms).
    # A query's candidates are walked by one program too, planned 4 to a multiprocessor (105 registers a thread
    # at 4 warps): training forward of candidates 64x32 Ld180 0.050 -> 0.047 ms, 256x16 Ld300 0.130 -> 0.126 ms,
    # inference within 1 %.
    persist = (1 if BQ > 1 and num_warps == 8 else 0) if shared_docs else (4 if num_k == 1 and BQ == 1 else 0)
    return ForwardConfig(TQ, BQ, block_n, block_k, num_k, num_warps, 3, persist=persist)


# Shared memory a forward program of 16-bit tokens may fill with its query block (BQ x TQ rows) and its document tiles
# in flight (stages x BLOCK_N tokens), every dim chunk of both, at the padded dim (forward_shared_bytes). sm_90 gives a
# program 227 KB, of which the barriers and the epilogue's scratch take a few. H200, at the first launch (Triton's
# OutOfResources otherwise): a 768-dim block of 4 x 32 rows against 32-token tiles in 3 stages asked for 448 KB,
# (128 + 96) x 2 KB; 64 rows against 16-token tiles in 3 stages 228 KB, 224 KB of blocks and tiles (found by
# tests/test_cranfield.py's real 384-dim tokens, then tests/test_wide_tokens.py). The table fits it up to 256 dims
# (at most 112 KB), and the dim loop of wider tokens, a chunk of both a stage, at most 160 KB; fit_tiles would shrink
# a configuration that did not (fewer packed queries, then shorter tiles, then fewer stages, then fewer rows a
# block). fp32 tokens of at most 256 dims size their own blocks (see _fp32_config); tf32x3's split operands take more
# than this count, so tests/test_kernel_front_end.py compiles the wide fp32 variants through ptxas.
FORWARD_SHARED_BYTES = 216 << 10
MIN_TILE_N, MIN_STAGES, MIN_TQ = 16, 2, 16
# The widest tokens the kernels take, by bytes a value (wider ones run the PyTorch path: backend.choose_impl).
WIDEST_DIM = {2: 1024, 4: 512}


def forward_shared_bytes(cfg: ForwardConfig, dim: int, itemsize: int) -> int:
    """What :data:`FORWARD_SHARED_BYTES` bounds: the query block and the tiles in flight, at the padded dim; in the
    dim loop (:func:`wide`), a chunk of both a stage."""
    rows = cfg.BQ * cfg.TQ
    if cfg.NUM_K > UNROLLED_DIM_CHUNKS:
        return cfg.num_stages * (rows + cfg.BLOCK_N) * cfg.BLOCK_K * itemsize
    return (rows + cfg.num_stages * cfg.BLOCK_N) * max(16, next_pow2(dim)) * itemsize


def fit_tiles(cfg: ForwardConfig, dim: int, itemsize: int) -> ForwardConfig:
    """``cfg`` shrunk until :func:`forward_shared_bytes` fits; unchanged where it fits (the table up to 256 dims)."""
    steps = (("BQ", 1), ("BLOCK_N", MIN_TILE_N), ("num_stages", MIN_STAGES), ("TQ", MIN_TQ))
    for field, least in steps:
        while forward_shared_bytes(cfg, dim, itemsize) > FORWARD_SHARED_BYTES and getattr(cfg, field) > least:
            value = getattr(cfg, field)
            cfg = replace(cfg, **{field: value - 1 if field == "num_stages" else value // 2})
    return cfg


def _fp32_config(Lq: int, dim: int, Nq: int, shared_docs: bool) -> ForwardConfig:
    """fp32 tokens go through the tensor cores as ``tf32x3`` (launch_args.py's ``dot_precision``), whose split operands
    take twice the shared memory and registers of 16-bit ones: the 16-bit table's 256-row blocks and 128-row long
    queries would need 260-390 KB of shared memory (sm_90 has 227 KB) and spill. Blocks of at most 64 rows (longer
    queries split into 64-row blocks), one program per document (a persistent plan would count on residents that
    this shared memory does not allow). Measured on an H100 (`.devdata` sweep, forward without / with the argmax,
    us): 64-row blocks against 32-token tiles in two stages (128x128 Lq32 Ld300 846 / 853, 32x32 Lq200 Ld300
    427 / 442; three stages 1120 / 1166 and 561 / 576, 64-token tiles 920 / 1038), a single query's 32 rows
    against 64-token tiles in three stages (1x1000 Ld300 76 / 91, candidates 64x32 Ld180 93 / 118; 16-token tiles
    128 / 130 and 164 / 170, 128-token 211 / 205)."""
    block_k, num_k = _dim_split(dim)  # (at most 2 chunks: wider tokens take _wide_config)
    TQ = min(64, max(16, next_pow2(Lq)))
    BQ = max(1, min(64 // TQ, next_pow2(Nq))) if shared_docs else 1
    if num_k > 1:
        BQ = max(1, BQ // 2)
    if BQ * TQ >= 64:
        return ForwardConfig(TQ, BQ, 32, block_k, num_k, 4, 2)
    return ForwardConfig(TQ, BQ, 64, block_k, num_k, 4, 3)


def streaming_config(cfg: ForwardConfig) -> ForwardConfig:
    """``cfg`` for the forward's register-prefetched tile loop (``STREAM_D``; launch_forward decides): one program per
    document, 64-token tiles at 128 dims and 32-token ones at 64 (H100, in-process, 1x1000 Lq32 Ld300: 64-token
    tiles 36.8 us, 32-token 47.1, persistent 36.5; candidates 32x100 Ld256 83.9 against 87.0 for the table's
    persistent 32-token walk; 1x1000 Ld1024 dim 48: 32-token tiles 44.7, 64 48.2, 128 46.9). Queries of 64 rows take
    32-token tiles at any width (H100, candidates 64x20 Lq64 Ld300: 16-token tiles 51.8 us, 32 45.4, 64 48.2; 16x100
    Lq64 Ld512 dim 64: 56.1, 45.1, 48.3). Scans of at most 64 dims run 2 warps, below the 4 that Hopper's
    warpgroup MMA needs, so their small tiles go through the register MMA without a trip through shared memory
    (H200, in-process: 1x1000 Ld1024 dim 48 39.3 -> 35.4 us, candidates 16x100 Lq23 Ld333 dim 48 0.85x; H100: all
    such rows 1.00-1.01x) if their queries fill at most 32 rows; wider scans keep 4 (64-row queries at 128 dims
    with 2 warps: H200 1.41x slower), and so do 64-row queries at any width: their row sums, spread over 2 warps
    instead of the pipelined loop's 4, would add in another order (H200: scores 1 ulp apart, normalized)."""
    thin = cfg.BQ * cfg.TQ <= 32
    bn = STREAM_WIDE_BLOCK_N if cfg.BLOCK_K >= 128 and thin else STREAM_NARROW_BLOCK_N
    warps = STREAM_NARROW_NUM_WARPS if cfg.BLOCK_K < 128 and thin else STREAM_NUM_WARPS
    return replace(cfg, BLOCK_N=bn, num_warps=warps, persist=STREAM_PERSIST, maxnreg=STREAM_MAXNREG)


# Module settings, for tools/knobs.py. H100 (docs/performance.md v50): 128-token tiles at 128 dims 1x1000 Ld300 37.5 ->
# 43.1 us, candidates 32x50 37.7 -> 46.2, candidates 32x100 84.1 -> 84.2; 8 warps 1.07-1.15x slower; narrow
# (<= 64 dims) 64- or 128-token tiles: candidates 128x7 Ld1024 dim 64 50.7 -> 54.0 / 54.3, 1x1000 Ld1024 dim 48
# 45.2 -> 48.4 / 47.2; persistent streaming programs (STREAM_PERSIST 2 / 4 / 8 a multiprocessor): candidates 32x100
# 83.8 -> 87.3 / 106.7 / 94.5 us, 32x50 37.6 -> 36.9 / 38.2 / 39.5, 1x1000 Ld300 37.0 -> 36.5 / 44.1 / 37.2,
# candidates 128x7 Ld1024 dim 64 50.6 -> 92.3 / 60.2 / 50.6. H200 (v62): 32-token tiles at 128 dims 1.17-1.57x
# slower, 2 warps at 128 dims 0.99-1.01x, register caps (STREAM_MAXNREG 96 / 80) 1.25-2.19x slower (spills), 8 warps
# 1.12-1.24x; narrow scans with 1 warp behind 2 on both dim-48 rows (37.8 against 35.4 us, 28.7 against 27.7).
# Query rows (TQ) from which blocks pack the queries that leave the fewest empty slots, not the most that fit (64-row
# queries, whose blocks of 4 are memory-bound as often as not, were not measured).
PACK_TRIM_MIN_TQ = 128
STREAM_WIDE_BLOCK_N = 64
STREAM_NARROW_BLOCK_N = 32
STREAM_NUM_WARPS = 4
STREAM_NARROW_NUM_WARPS = 2
STREAM_PERSIST = 0
STREAM_MAXNREG = 0


def once_read_config(cfg: ForwardConfig, Ld: int, masked: bool = False) -> ForwardConfig:
    """``cfg`` for a large once-read scan that runs the table's pipelined loop instead of the stream (launch_forward's
    ONCE_READ_TABLE_L2, dense unmasked documents, one dim chunk of 128): one program per document, asynchronous
    copies in stages. H200, in-process against the stream (docs/performance.md v73; one 32-row query or a query's
    own candidates): candidates 32x100 Ld256 66.2 -> 63.1 us with 64-token tiles in 3 stages (128-token in 2: 62.0,
    but 1x2000 Ld300 1.07x slower), 1x10000 Ld300 190.3 -> 184.5 (against the table's 32-token tiles), 1x1000
    Ld1024 75.6 -> 74.1 with 128-token tiles in 2 stages (64-token tiles 77.0; 32-token 74.5). Queries of 33-64
    rows: 32-token tiles in 4 stages, 1x5000 Lq64 Ld180 75.7 -> 69.8, candidates 64x40 Lq64 Ld300 68.3 -> 63.1
    (64-token tiles in 2 stages 73.9 / 64.4, 8 warps 87.1 / 71.0). Blocks of 33-64 rows are planned persistent,
    ``ONCE_READ_WIDE_PERSIST`` programs a multiprocessor, each walking consecutive documents with its tiles in
    flight across their boundaries (a 180-token document is under six tiles, about the pipeline's fill): H200,
    in-process (docs/performance.md v95), 1x5000 Lq64 Ld180 69.6 -> 67.3 us (kernel 62.9 -> 56.1), candidates
    32x100 Lq48 Ld256 64.2 -> 63.7; 32-row blocks gain nothing (1x10000 Ld300 1.00x at 4 a multiprocessor,
    1x1000 Ld1024 1.03-1.38x slower: a document or two a program; again in DOC_ROWS, v133's run: 2 / 4 a
    multiprocessor 1.01 / 1.15x, 1.01 / 1.14x, candidates 32x100 Ld256 1.04 / 1.22x; 4 stages (3 for the long
    tiles) 0.99-1.01x; 128-token tiles in 2 stages 1.00-1.10x).

    The long tiles of an unmasked scan come in 3 stages (two programs a multiprocessor instead of three, a third
    32 KB tile in flight each), those of a ``masked`` one (a normalized scan with a document mask: launch_forward's
    ONCE_READ_TABLE_MASKED_SUMS) in 2. H200, in-process (docs/performance.md v158, run 85, 11-21 rounds), 2 -> 3
    stages: 1x1000 Ld1024 73.1 / 73.6 -> 72.4 / 72.0 us (two pairs), candidates 8x100 Ld1024 66.6 -> 61.4, 1x2000
    Ld512 72.6 -> 72.2, normalized 1x1000 Ld1024 75.8 -> 75.9, masked (holes) and normalized 82.1 -> 86.7."""
    persist = 0
    if cfg.BQ * cfg.TQ > 32:
        bn, stages, persist = ONCE_READ_WIDE_BLOCK_N, ONCE_READ_WIDE_STAGES, ONCE_READ_WIDE_PERSIST
    elif Ld >= ONCE_READ_LONG_LD:
        bn, stages = ONCE_READ_LONG_BLOCK_N, ONCE_READ_LONG_MASKED_STAGES if masked else ONCE_READ_LONG_STAGES
    else:
        bn, stages = ONCE_READ_BLOCK_N, ONCE_READ_STAGES
    return replace(cfg, BLOCK_N=bn, num_stages=stages, num_warps=4, persist=persist, maxnreg=0)


# once_read_config's tiles (module settings, for tools/knobs.py): 32-row blocks, the same from documents of
# ONCE_READ_LONG_LD tokens (a plan-time bucket: two variants), and blocks of 33-64 rows (WIDE).
ONCE_READ_BLOCK_N, ONCE_READ_STAGES = 64, 3
ONCE_READ_LONG_LD = 512
ONCE_READ_LONG_BLOCK_N, ONCE_READ_LONG_STAGES, ONCE_READ_LONG_MASKED_STAGES = 128, 3, 2
ONCE_READ_WIDE_BLOCK_N, ONCE_READ_WIDE_STAGES = 32, 4
# Persistent programs a multiprocessor for the 33-64-row blocks (0: one program a document). H200 (v95): 3 and 4 alike
# (1x5000 Lq64 Ld180 0.97 / 0.98x), 6 and 8 fit fewer residents than they plan for (4 stages of 8 KB tiles and a
# 16 KB query block a program: 1.20 / 0.99x, candidates 32x100 Lq48 1.25 / 1.08x), 4 with 5 stages 1.33x.
ONCE_READ_WIDE_PERSIST = 3


def scores_only_config(cfg: ForwardConfig, Lq: int, normalize: bool) -> ForwardConfig:
    """``cfg`` for a forward without the argmax, whose running indices would otherwise hold the registers: long
    queries (``Lq > 128``: 128-row blocks of 16-bit tokens, one 128-wide dim chunk) keep a fourth tile in flight,
    where the argmax forward keeps three (the same tiles in the same order: the same scores). H200, in-process
    (docs/performance.md v76), 3 -> 4 stages: ColPali 1x500 Lq1024 Ld1024 0.94x, 1x300 Lq256 Ld700 0.91x, 1x16
    Lq1024 Ld1024 0.86x; the argmax forward of the 32x32 Lq1024 Ld1024 training step 1.01x (so it keeps 3).

    Without ``normalize``, their row blocks are planned as persistent programs, ``LONG_QUERY_SCORES_PERSIST`` a
    multiprocessor, each walking consecutive documents against its block, where documents are short
    (launch_settings' LONG_QUERY_PERSIST_MAX_TILES decides at plan time): a program's query load and pipeline fill,
    paid once a document otherwise, then fall on its walk. H200, in-process (docs/performance.md v142), one program
    a document -> persistent: cross 4x200 Lq300 Ld192 51.6 -> 39.7 us, Ld256 58.4 -> 48.4, Ld384 71.3 -> 65.3, Ld512
    84.1 -> 82.4, Ld640 96.5 -> 99.8; 8x100 Lq1024 Ld300 160.5 -> 135.6, Ld768 275.9 -> 279.0; ColPali 1x500 Lq1024
    Ld1024 221.8 -> 238.6; masked (holes) 0.80-0.90x. Normalized, the walk ran slower (8x100 Lq1024 Ld300 193.4 ->
    319.9 us, 2x1000 Lq160 Ld180 dim 96 107.3 -> 153.9), and so does the argmax forward's against long documents
    (training forward kernel, 16x16 Lq512 Ld256 0.94x, Ld512 1.05x, 32x32 Lq1024 Ld1024 1.16x): those keep one
    program a document."""
    if Lq > 128 and cfg.TQ == 128 and cfg.BQ == 1 and cfg.BLOCK_K == 128 and cfg.NUM_K == 1:
        persist = 0 if normalize else LONG_QUERY_SCORES_PERSIST
        return replace(cfg, num_stages=LONG_QUERY_SCORES_STAGES, persist=persist)
    return cfg


def half_packed_config(cfg: ForwardConfig) -> ForwardConfig | None:
    """A scores-only forward's packed block of 256 rows (8 warps, one persistent program a multiprocessor) as two
    blocks of 128 rows in 4 warps, two programs a multiprocessor (``PACKED_HALF_PERSIST``), or None where ``cfg`` is
    not such a block. A program's tile loop issues its MMA and waits for it before the tile's max and select, and the
    8 warps of one program wait together; two programs of one warpgroup each run out of step, one's ALU work beside
    the other's MMA (see launch_settings.PACKED_SCORES_HALF_L2 for what that costs and saves)."""
    if cfg.BQ < 2 or cfg.BQ * cfg.TQ != 256 or cfg.num_warps != 8 or cfg.NUM_K != 1 or not cfg.persist:
        return None
    return replace(cfg, BQ=cfg.BQ // 2, num_warps=4, persist=PACKED_HALF_PERSIST)


#: Persistent programs a multiprocessor for :func:`half_packed_config` (H200, in-process, h200-run69.txt's
#: call 5: one document a program instead, 128x128 Lq32 Ld300 104.6 against 86.3 us, 200x200 Ld128 152.8 / 91.2).
PACKED_HALF_PERSIST = 2


def deep_pipeline_config(cfg: ForwardConfig) -> ForwardConfig:
    """``cfg`` for a launch of fewer programs than multiprocessors, each alone on its multiprocessor (launch_forward's
    DEEP_PIPELINE): the pipelined tile loop with 128-token tiles in 4 stages, 128 KB of a document in flight per
    program at 128 dims. H100, in-process, pairs 64 Lq32 Ld2048 inference / training forward (us): 22.0 / 23.1
    against the streaming loop's 33.0 and the table's 41.2; 128-token tiles in 3 stages 24.8 / 25.9, 6 stages
    23.3 / 24.0; 64-token tiles in 6 stages 23.4 / 26.5."""
    return replace(cfg, BLOCK_N=128, num_stages=4, num_warps=4, persist=0)


CANDIDATE_OWNER_BLOCK_K = 64  # dims per dD owner program of a candidate document (see backward_config)
WIDE_CANDIDATE_OWNER_BLOCK_K = 256  # the same for tokens of more than UNROLLED_MAX_DIM dims
# Document tokens per dD owner program, and the backward launch's warps (module settings, for tools/knobs.py). H200,
# in-process, cross product 256x256 Lq32 Ld300 with the owner forced (docs/performance.md v59): backward GPU time
# 1.44 ms; 128 tokens 1.98 ms, 128 tokens in 8 warps 1.69 ms. (64x64 Ld1024: 261, 320, 247 us.)
OWNER_BLOCK_N = 64
BACKWARD_NUM_WARPS = 4


@lru_cache(maxsize=256)
def backward_config(
    Lq: int, dim: int, candidates: bool = False, normalize: bool = False, fp32: bool = False
) -> BackwardConfig:
    """``candidates``: every document is scored by one query, dense (per-query candidates, aligned pairs);
    ``normalize``: owners of whole rows (up to 128 dims) chain their gradient through the normalization in place;
    ``fp32``: 4-byte tokens."""
    dim_p = max(16, next_pow2(dim))
    # 16 tokens per dQ program at dim 128: twice the programs of 32, which the gather's latency-bound walk needs
    # (H100, fwd_probe --backward: 256x256 Lq32 Ld300 backward 0.57 -> 0.48 ms, 64x64 Ld128 0.084 -> 0.061 ms).
    bt = max(16, min(64, 2048 // dim_p))
    bt = min(bt, max(16, next_pow2(Lq)))
    tq = min(64, max(16, next_pow2(Lq)))
    # The dD owner of a candidate document holds a 64x64 accumulator: 115 registers instead of 224 at 64x128, twice
    # the programs resident (H100: candidates 256x16 Ld300 269 -> 253 us); with the document walk of backward.py's
    # _dd_program (DOC_WALK), 86 registers; 128 dims no better (training step 256x16 1.02x). A shared document's owner
    # walks every query, and re-reading them for a second dim block costs more (256x256 Ld300 1.34 -> 1.47 ms); a
    # pair list's owners would scan its pair ids twice as often. With normalize, whole rows let the owner apply the
    # chain rule itself instead of writing an fp32 buffer for a pass afterwards.
    block_k = min(dim_p, CANDIDATE_OWNER_BLOCK_K if candidates and not normalize else 128)
    if candidates and not normalize and dim_p > UNROLLED_MAX_DIM and not fp32:
        # Wide 16-bit tokens: 256-dim blocks, a quarter of the programs each loading the query again (H200, .devdata
        # sweep, docs/performance.md v125: pairs 256 Lq32 Ld300 d1024 backward 0.088 -> 0.066 ms in both modes; 128
        # dims 0.073). fp32 blocks of 256 dims ask for 232 KB of shared memory at Lq 200 (237576 bytes on the H200).
        block_k = WIDE_CANDIDATE_OWNER_BLOCK_K
    return BackwardConfig(bt, dim_p, tq, OWNER_BLOCK_N, block_k, BACKWARD_NUM_WARPS)
