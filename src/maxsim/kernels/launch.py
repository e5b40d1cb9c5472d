"""Python side of the Triton path: the same two functions as :mod:`maxsim.cpu`, launching the kernels.

Inputs are the canonical layout (:mod:`maxsim.layout`), already validated. Nothing here reads a tensor's values on
the host: grids and variants come from shapes and the caller's maximum lengths only, so calls are free of
host↔device syncs and CUDA-graph capturable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..layout import Ragged, Views, argmax_dtype, dims, view_as_canonical
from . import csr as csr_kernel
from . import dd_chunks, dd_gather, doc_chunks, slices
from . import normalize as normalize_kernels
from .backward import maxsim_bwd_kernel, maxsim_bwd_scatter_kernel
from .configs import (
    BackwardConfig,
    ForwardConfig,
    backward_config,
    deep_pipeline_config,
    forward_config,
    once_read_config,
    scores_only_config,
    streaming_config,
)
from .dd_chunks import chunk_plan, chunk_steps
from .forward import maxsim_fwd_kernel
from .launcher import INTERPRETER, Launcher
from .sizes import cdiv, next_power_of_2

_fwd = Launcher(maxsim_fwd_kernel)
_bwd = Launcher(maxsim_bwd_kernel)
_bwd_scatter = Launcher(maxsim_bwd_scatter_kernel)
_csr = Launcher(csr_kernel.csr_count_kernel)
_link_keys = Launcher(dd_gather.link_keys_kernel)
_dd_gather = Launcher(dd_gather.dd_gather_kernel)
_sum_slices = Launcher(slices.sum_slices_kernel)
_cast_clear = Launcher(dd_chunks.cast_clear_kernel)
_FUSED_CAST_BLOCK = dd_chunks.FUSED_BLOCK  # (dd_chunks is also a plan's name below)
_combine_chunks = Launcher(doc_chunks.combine_chunks_kernel)

DENSE, OFFSETS, LENGTHS = 0, 1, 2  # segment kinds, as in kernels/segments.py
# A pair list's backward scans the pair ids in each program (no index built) while programs x pairs stays under
# this (~64 MiB of L2-resident id reads): measured on an H100, the scan of 2048 pairs by 4096 programs costs less
# GPU time than the host time it saves; at 3200 pairs x 6400 programs it no longer does (the index is built then).
PAIR_SCAN_MAX_WORK = 1 << 24
# The cross product's dD is owned (in the launch of dQ, no zeroed fp32 buffer, no cast: 3 launches fewer;
# deterministic) up to this many one-hot multiply-adds, tiles padded; beyond it fp32 atomics cost less GPU time
# (backward="fast"). H100, GPU time of the backward, owned vs atomics: 32x32 Lq32 Ld80 (2^29) 19 vs 23 us, 64x64
# Lq32 Ld128 (2^31) 59 vs 53 us, 64x64 Lq23 Ld333 dim 96 (1.5 * 2^32) 114 vs 45 us, 256x256 Ld300 1.3 vs 0.53 ms.
SHARED_OWNER_MAX_WORK = 1 << 31
# So is it for at most this many query rows (queries x padded Lq) at any size: an owner program walks the queries,
# while the atomics zero and cast an fp32 buffer of D's size. H100, backward GPU time (gather, owner or atomics,
# zero-fill, cast, slice sum), owner vs atomics: 1x1000 Lq64 Ld300 (64 rows) 94 vs 187 us; 7x1000 Lq23 Ld333 dim
# 96 (224 rows) 235 vs 196 us (docs/performance.md v49).
SHARED_OWNER_MAX_ROWS = 128
# backward="deterministic" of a dense cross product of at least this many links (query tokens x documents) beyond
# the owner's size: dD by grouping the links by the document token they chose (a stable sort) and summing each
# token's links in one program (dd_gather.py) instead of the owner, whose programs each walk every query. H100,
# deterministic backward GPU time, owner -> sorted gather (one warp, 16 links a step; 4 warps were 1.3-1.4x slower):
# 32x32 Lq1024 Ld1024 (1M links) 1509 -> 331 us, 256x256 Lq32 Ld300 (2M) 1584 -> 678 us; below the bound the owner
# keeps the steps (64x64 Lq32 Ld1024, 131k links: backward 287 -> 231 us but the step 500 -> 651 us with the sort's
# launches; 64x64 Lq23 Ld333 dim 96: 122 -> 168 us).
SORTED_DD_MIN_LINKS = 1 << 19
SORTED_DD_WARPS = 1
# The fast cross product's dD atomics run as programs of the backward's main launch, beside the dQ gather (one
# launch fewer; the gather's loads and the atomics' traffic overlap), instead of a launch of their own after it.
# H100, backward GPU time (gather + atomics): 256x256 Ld300 484 -> 424 us, 32x32 Lq1024 Ld1024 220 -> 204 us,
# off-matrix dim 96 41 -> 34 us; training steps 0.95x, 0.98x, 0.94x, and 64x64 Ld1024 (host-bound) 0.87x.
FUSED_SCATTER = 1
# The fp32 buffer the fast cross product's dD atomics add into holds at most SCATTER_BUFFER_MAX_BYTES: beyond, dD is
# summed a chunk of documents at a time, in two fp32 buffers in turn: the front of dD's own storage, not yet written,
# and one of its own of at most SCATTER_CHUNK_BYTES (see dd_chunks.chunk_plan); each chunk's cast into dD runs in the
# next chunk's atomics launch (dd_chunks.chunk_steps), the first chunk's atomics in the dQ gather's launch. Chunking
# needs chunks of at least SCATTER_CHUNK_MIN_LINKS links (query tokens x documents) in the own buffer, to amortize the
# launches, and is dropped where that grows the own buffer past SCATTER_BUFFER_MAX_BYTES: few queries against many
# documents save little for the launches (H200, cross 7x1000 Lq23 Ld333 dim 96, a 128 MB buffer, 667 documents a chunk:
# step 390 -> 528 us for 183 -> 144 MiB; docs/performance.md v64). A large step's peak memory is then its gradients and
# saved argmax, not an fp32 copy of dD on top (twice dD's size). The chunks cost GPU time: most of their atomics run
# without the gather beside them. Training step 256x256 Lq32 Ld300 (a 37.5 MiB buffer; docs/performance.md v58, v61),
# in-process, unchunked -> chunked: H200 0.855 -> 0.931 ms, H100 0.958 -> 0.983 ms, peak 63.0 -> 27.9 MiB (v58's
# chunks, each cast in a launch of its own and the chunks in dD before those in their own buffer: H200 1.014 ms, H100
# 1.075 ms).
SCATTER_BUFFER_MAX_BYTES = 32 << 20
# Each program of the fast cross product's dD atomics adds one query-token block into this many documents (its
# query rows loaded once, every document's argmax and weight before the first atomic; backward.py's
# _dd_atomics_program). A power of two. H200, backward main launch (the gather and the atomics) GPU time, 1 -> 2 -> 4
# -> 8 documents: 64x64 Lq32 Ld1024 57.1 -> 36.4 -> 36.3 -> 36.6 us, 64x64 Lq23 Ld333 dim 96 32.1 -> 20.0 -> 22.1 ->
# 22.2 us, 256x256 Ld300 (with the first chunk) 213.6 -> 145.6 -> 148.2 -> 148.9 us; 32x32 Lq1024 Ld1024 unchanged
# (174.4 -> 173.4 -> 172.6 -> 171.8 us).
SCATTER_DOCS = 2
SCATTER_CHUNK_BYTES = 3 << 20
SCATTER_CHUNK_MIN_LINKS = 1 << 17
# A dQ gather of few programs over many pairs each (few queries against many documents or candidates: cross 1x1000
# Lq64 Ld300 trains in ~1 ms, nearly all of it 4 programs walking 1000 documents) splits each query's walk into
# slices of at least DQ_SPLIT_MIN_PAIRS pairs, enough of them for DQ_SPLIT_PROGRAMS_PER_SM programs a multiprocessor,
# each summing its slice into an fp32 buffer that one reduction sums in slice order (deterministic; the same slices
# in both backward modes). Only walks of at least DQ_SPLIT_MIN_K pairs: the reduction is a launch of host time more.
# (The split count and slice length are runtime integers: splitting compiles one more variant, an fp32 DQ, once.)
DQ_SPLIT_MIN_K = 128
DQ_SPLIT_MIN_PAIRS = 32
DQ_SPLIT_PROGRAMS_PER_SM = 2
# Pairs the dQ walk gathers per step when it has the launch to itself, and when it shares it with the owner or the
# atomics (see _backward_plan).
DQ_UNROLL = 4
FUSED_DQ_UNROLL = 1
# The dD owner builds its 0/1 selector in the MMA's register layout (backward.py's REG_SEL) where that measured faster
# (see _register_selector; 0: never, for tools/knobs.py and the tests).
REGISTER_SELECTOR = 1
# normalize=True: where a document tile is read by several programs (a query split into row blocks, or queries
# packed BQ to a program against shared documents, more than one block of them), each would sum the tile's squares
# again: those forwards read the tokens' inverse norms from a pre-pass (one launch over Q and D), loaded before the
# tile's MMA so that its latency hides theirs. H100, in-process against the tile sums: ColPali 1x500 Lq1024 Ld1024
# inference 608 -> 356 us, training 32x32 Lq1024 Ld1024 1356 -> 1271 us (then 1260 -> 1136 us with the early
# load); corpus scan 32x65536 16.3 -> 13.7 ms, cross 128x128 inference 171 -> 142 us, varlen 64x256 157 -> 109 us,
# training 256x256 Ld300 1.33 -> 1.23 ms (with a load after the MMA the packed loops lost instead: corpus scan
# 16.2 -> 27.6 ms). One block of queries reads each tile once: there the pre-pass is a second read of D (1x1000
# Ld300 inference 75 -> 89 us, 7x1000 dim 96 102 -> 116 us), and the tile sums stay. (A boolean of the query count:
# at most one more compiled variant, as PERSIST.)
PRENORM_MIN_ROW_BLOCKS = 2
PRENORM_MIN_QUERY_BLOCKS = 2
# Documents scored by one query each (candidates, pairs, pair lists) take the pre-pass too: one read of the tokens
# for the norms costs less GPU time than the forward's tile sums there, and a training step hands the norms on to
# the backward, which needs them anyway (same launches). H100, GPU time per call, in-process against the tile sums:
# candidates 32x50 Lq32 Ld180 inference 81 -> 54 us, candidates 32x7 dim 48 12 -> 8 us, training pairs 512 156 ->
# 125 us, candidates 256x16 Ld300 step 1.18 -> 0.90 ms.
PRENORM_UNSHARED = 1
# How much faster one-document programs run than a persistent plan of one program per multiprocessor counts them
# (two stay resident; see forward). Fitted to the H100 measurements there: any value in (1.13, 1.8) orders them.
ONE_DOC_GAIN = 1.3
# Document tiles that one program alone reads (one thin block of query rows against shared documents, or each
# query's own candidates), 16-bit, one dim chunk, are loaded into registers one tile ahead with an
# evict-first hint (forward.py's STREAM_D) instead of by the pipeliner's asynchronous copies, which drop the hint:
# the scan then replaces its own lines in the L2, not the lines other kernels left there (dirty ones cost a
# write-back in the middle of the scan). The register loop sustains a little less bandwidth than the pipelined one,
# so this pays where the scan's bytes are between STREAM_L2_RANGE times the L2's size. H100 under do_bench's flush
# (which leaves the L2 dirty), in-process (docs/performance.md v38): 1x1000 Lq32 Ld300 42.0 -> 36.8 us, candidates
# 32x50 Ld180 39.9 -> 37.8, candidates 32x100 Ld256 85.8 -> 83.9, 1x1000 Ld1024 dim 48 49.3 -> 44.7, 1x1000 Ld1024
# 102.0 -> 100.7; beyond: 1x4000 Ld1024 dim 64 (524 MB) 181.4 -> 187.7, 1x10000 Ld300 (768 MB) 264.2 -> 271.2;
# below: candidates 32x7 dim 48 (7 MB) 10.1 -> 11.1; 256-row blocks (7x1000 dim 96, 8 queries packed) 60.0 -> 68.8.
# Training forwards (the argmax loop) keep the pipelined loop: GPU time of the forward, candidates 64x32 Ld180
# 42.7 -> 43.6 us, pairs 512 Ld300 23.0 -> 25.1 us, candidates 256x16 Ld300 124.4 -> 126.9 us.
# With a document mask (v39: the mask of a tile is loaded a tile ahead of its tokens, whose loads it predicates):
# 1x1000 Ld300 40.2 -> 38.2 us, candidates 32x50 40.5 -> 37.8, 32x100 86.0 -> 79.8 (prefix masks), but dim 48 in
# 32-token tiles 48.9 -> 60.2 (a tile's work too short to hide the mask's latency): masked scans stream from
# STREAM_MASKED_MIN_BLOCK_K dims up. A query's own documents stream for queries of up to STREAM_UNSHARED_MAX_ROWS
# rows (33-64 tokens: 32-token tiles, configs.streaming_config), shared documents for STREAM_SHARED_MAX_ROWS. H100,
# in-process (`.devdata` sweep, docs/performance.md v49): candidates 64x20 Lq64 Ld300 53.2 -> 45.4 us, 32x100 Lq48
# Ld256 95.9 -> 82.2, 16x100 Lq64 Ld512 dim 64 60.5 -> 45.1, but pairs 1000 Lq64 Ld333 dim 96 42.0 -> 43.6; one
# query of 64 rows against shared documents gains less (1x1000 Ld300 41.2 -> 40.7, 1x5000 Ld180 93.0 -> 91.6, 2
# queries of 32 packed 41.7 -> 40.7; out of the byte range, where the rule does not stream, 1x2000 Lq48 Ld1024 179 ->
# 189), H200 (v66, tools/knobs.py): 1x5000 Ld180 78.4 -> 76.2 us, so shared documents stream for 64 rows too.
STREAM_UNSHARED_MAX_ROWS = 64
STREAM_SHARED_MAX_ROWS = 64
STREAM_ONCE_READ = 1
STREAM_L2_RANGE = (0.5, 7.0)
STREAM_MASKED_MIN_BLOCK_K = 128
# Per card (a substring of its name, first match): the L2 sizes beyond which a dense unmasked once-read scan of
# 16-bit tokens of 65-128 dims (one chunk of 128) runs the table's pipelined loop with
# configs.once_read_config's tiles instead of the stream, whatever STREAM_L2_RANGE says. On an H200 the stream's one
# register tile ahead falls behind the asynchronous copies' stages from about twice the L2 (in-process, stream ->
# table, docs/performance.md v73): candidates 32x75 Ld256 (2.5 L2) 53.6 -> 51.9 us, 32x100 (3.3) 66.2 -> 63.1,
# 1x1000 Ld1024 (4.2) 75.6 -> 74.1, 1x5000 Lq64 Ld180 (3.7) 75.7 -> 69.8, candidates 64x40 Lq64 (3.1) 68.3 -> 63.1;
# 1x2000 Ld300 (2.4) 52.4 -> 52.3; below, the stream wins: 1x1500 Ld300 (1.8) 41.7 against 44.1, candidates 64x20
# Lq64 (1.6) 37.5 against 41.1. Other cards (H100: v38's stream-over-table measurements) keep STREAM_L2_RANGE.
# ONCE_READ_TABLE = 0 turns the rule off (tools/knobs.py).
ONCE_READ_TABLE_L2: tuple[tuple[str, float], ...] = (("H200", 2.0),)
ONCE_READ_TABLE = 1
# On those cards, blocks of 33-64 rows take the table from ONCE_READ_WIDE_TABLE_L2 L2 sizes (its programs persistent,
# configs.ONCE_READ_WIDE_PERSIST: the stream's tiles were worth more than one-document table programs, not than
# persistent ones). H200, in-process, stream -> persistent table (docs/performance.md v96): 1x1000 Lq64 Ld300 (1.2
# L2) 35.4 -> 31.3 us, candidates 32x50 Lq64 Ld180 (1.2) 0.97x, 16x100 Lq64 Ld300 (1.95) 0.95x, 64x20 Lq64 Ld300
# (1.6) 1.00x, 32x30 Lq48 Ld256 (1.0) 0.99x; below one L2 the stream wins: 1x700 Lq64 Ld300 (0.85) 22.0 against
# 24.3, candidates 32x20 Lq64 Ld300 (0.78) 1.13x, 1x500 Lq64 Ld300 (0.61) 1.10x (but 1x800 Lq48 Ld200 (0.65) 0.90x).
# Aligned pairs (one document a query, which no program walks past) keep the 2 L2 bound: one-document table
# programs of 64-row blocks trailed the stream below it (candidates 64x20 Lq64 1.07x, 32x50 Lq64 1.05x).
ONCE_READ_WIDE_TABLE_L2 = 1.0
# A forward launch of fewer programs than the GPU has multiprocessors (few long documents: 64 pairs of 2048 tokens)
# is bound by how many bytes each program keeps in flight, one 16 KB tile in the streaming loop, 24 KB in the
# table's pipelined one: thin row blocks (<= 32 rows, one dim chunk, 16-bit) against documents of at least
# DEEP_PIPELINE_MIN_LD tokens then take configs.deep_pipeline_config (four 32 KB tiles in flight). H100,
# in-process (docs/performance.md v50): pairs 64 Lq32 Ld2048 inference 33.0 -> 22.0 us, training forward 41.2 ->
# 23.1; cross 1x64 and candidates 4x16 the same; pairs 128 Ld1024 training forward 29.6 -> 22.3.
# Only on GPUs whose programs may take DEEP_PIPELINE_MIN_SHARED bytes of shared memory (the variant takes up to
# ~130 KB: A100 164 KB, H100 / H200 227 KB; not the ~100 KB of consumer parts, where it would not launch).
DEEP_PIPELINE = 1
DEEP_PIPELINE_MIN_LD = 512
DEEP_PIPELINE_MIN_SHARED = 160 << 10
# A launch that fills at most 1 / DOC_SPLIT_BELOW of the multiprocessors (a handful of long documents) scans each
# document in chunks by programs of their own, enough for DOC_SPLIT_PROGRAMS_PER_SM programs a multiprocessor, each
# chunk at least DOC_SPLIT_MIN_TILES tiles; the chunks' row maxima are folded by one launch more
# (kernels/doc_chunks.py), which costs a launch and an allocation of host time. Not for persistent launches.
DOC_SPLIT_BELOW = 4
DOC_SPLIT_PROGRAMS_PER_SM = 1
DOC_SPLIT_MIN_TILES = 4
# Not for streamed scans of many short documents, whose last wave is ragged (candidates 32x50: 1600 programs of 3
# tiles on 528 slots): H200, in-process (docs/performance.md v63), 1-tile chunks by programs of their own 1.30-1.38x
# slower; persistent programs over even ranges of each row's tiles, the cut documents folded, 1.01x (1x1000 Ld1024
# 1.07x), i.e. the last wave's few programs take more than their share of the bandwidth, not a wave's time.


def _dot_precision(dtype: torch.dtype) -> str:
    """The forward's similarity products for ``dtype``: fp32 inputs get fp32 accuracy through the tensor cores
    (``tf32x3``: three TF32 products per term, the operands split into a high and a low part; ~1e-7 relative
    error, where TF32 alone gives ~1e-3 and IEEE products run as FMA loops) unless the user opted into TF32 via
    torch's matmul precision. (The interpreter computes any precision in fp32.)"""
    if dtype != torch.float32 or INTERPRETER:
        return "ieee"
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    """Triton's interpreter gets bf16 ``tl.dot`` wrong (design.md §5): operands are upcast there, and only there
    (for every dtype: the normalize owner makes bf16 operands of fp32 inputs too, see backward._dd_add)."""
    return INTERPRETER


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _Segs(NamedTuple):
    """Kernel-facing view of a :class:`~maxsim.layout.Ragged` description: kinds, pointers, counts, strides
    (absent pointers are a dummy tensor; they are never read)."""

    q_kind: int
    d_kind: int
    pairs: bool
    qseg: Tensor
    dseg: Tensor
    pq: Tensor
    pd: Tensor
    n_q: int  # packed queries: number of sequences and of token rows
    rows_q: int
    n_d: int
    rows_d: int
    sqs: int  # stride of query lengths
    sds_b: int  # strides of document lengths
    sds_k: int


def _ragged_key(rg: Ragged | None) -> tuple | None:
    """What a plan depends on in a ragged description: which tensors are given, their shapes, strides and dtypes
    (never their values), and the maximum lengths."""
    if rg is None:
        return None
    q, d, pq, pd = rg.q_seg, rg.d_seg, rg.pair_q, rg.pair_d
    # (written out: a generator here cost a pair-list step ~3 µs of host time)
    return (
        None if q is None else (q.shape, q.stride(), q.dtype),
        None if d is None else (d.shape, d.stride(), d.dtype),
        None if pq is None else (pq.shape, pq.stride(), pq.dtype),
        None if pd is None else (pd.shape, pd.stride(), pd.dtype),
        rg.max_q,
        rg.max_d,
    )


def _seg_tensors(Q: Tensor, rg: Ragged | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernels' four segment pointers (:class:`_Segs`' ``qseg, dseg, pq, pd``) without the rest of it: what a
    call on a cached plan needs."""
    if rg is None:
        return Q, Q, Q, Q
    pairs = rg.pair_q is not None
    return (
        Q if rg.q_seg is None else rg.q_seg,
        Q if rg.d_seg is None else rg.d_seg,
        rg.pair_q if pairs else Q,
        rg.pair_d if pairs else Q,
    )


def _segs(Q: Tensor, D: Tensor, rg: Ragged | None) -> _Segs:
    if rg is None:
        return _Segs(DENSE, DENSE, False, Q, Q, Q, Q, 0, 0, 0, 0, 0, 0, 0)
    pairs = rg.pair_q is not None
    if rg.q_seg is None:
        q = (DENSE, Q, 0, 0, 0)
    elif Q.dim() == 2:
        q = (OFFSETS, rg.q_seg, rg.q_seg.shape[0] - 1, Q.shape[0], 0)
    else:
        q = (LENGTHS, rg.q_seg, 0, 0, rg.q_seg.stride(0))
    if rg.d_seg is None:
        d = (DENSE, Q, 0, 0, 0, 0)
    elif D.dim() == 2:
        d = (OFFSETS, rg.d_seg, rg.d_seg.shape[0] - 1, D.shape[0], 0, 0)
    else:
        d = (LENGTHS, rg.d_seg, 0, 0, *rg.d_seg.stride())
    return _Segs(
        q[0], d[0], pairs, q[1], d[1], rg.pair_q if pairs else Q, rg.pair_d if pairs else Q,
        q[2], q[3], d[2], d[3], q[4], d[4], d[5],
    )  # fmt: skip


def _q_strides(x: Tensor) -> tuple[int, int]:
    """(sequence stride, token stride) of a dense ``[N, L, dim]`` or packed ``[rows, dim]`` token tensor."""
    return (0, x.stride(0)) if x.dim() == 2 else (x.stride(0), x.stride(1))


def _d_strides(x: Tensor, shared: bool) -> tuple[int, int, int]:
    """(batch, document, token) strides of a dense ``[Bd, K, Ld, dim]`` or packed ``[rows, dim]`` tensor."""
    if x.dim() == 2:
        return 0, 0, x.stride(0)
    return (0 if shared else x.stride(0)), x.stride(1), x.stride(2)


# Under the interpreter (CPU tensors): one, so that the tests of shared dense documents run persistent programs.
_INTERPRETER_SMS = 1
_device_values: dict[tuple[str, int], int] = {}


def _device_value(device: torch.device, name: str, read: Callable[[int], int], off_gpu: int) -> int:
    """``read(index)`` of a CUDA ``device``, once per device and ``name``; ``off_gpu`` where there is no GPU (the
    interpreter)."""
    if device.type != "cuda":
        return off_gpu
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _device_values.get((name, idx))
    if n is None:
        n = _device_values[name, idx] = int(read(idx))
    return n


def _l2_bytes(device: torch.device) -> int:
    """The L2 cache's size (an H100's 50 MiB where there is no GPU)."""
    return _device_value(device, "l2", lambda i: torch.cuda.get_device_properties(i).L2_cache_size, 50 << 20)


def _shared_bytes(device: torch.device) -> int:
    """The shared memory one program may use (opt-in maximum; an H100's where there is no GPU)."""

    def read(i: int) -> int:
        from triton.runtime import driver

        return driver.active.utils.get_device_properties(i)["max_shared_mem"]

    return _device_value(device, "shared", read, 227 << 10)


_card_names: dict[int, str] = {}


def _card_name(device: torch.device) -> str:
    """The CUDA ``device``'s name (``NVIDIA H200``), read once per device; empty where there is no GPU."""
    if device.type != "cuda":
        return ""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    name = _card_names.get(idx)
    if name is None:
        name = _card_names[idx] = torch.cuda.get_device_name(idx)
    return name


def _once_read_table_l2(device: torch.device) -> float:
    """The card's ONCE_READ_TABLE_L2 bound (infinite for a card the table does not name)."""
    name = _card_name(device)
    return next((bound for key, bound in ONCE_READ_TABLE_L2 if key in name), float("inf"))


def _sm_count(device: torch.device) -> int:
    return _device_value(
        device, "sms", lambda i: torch.cuda.get_device_properties(i).multi_processor_count, _INTERPRETER_SMS
    )


def _docs_per_program(base: int, K: int, slots: int, tiles: int, one_doc_gain: float = 1.0) -> int:
    """How many consecutive documents of ``tiles`` tiles each the ``base`` (query block, row split) programs of a
    persistent launch walk, for ``slots`` programs resident at once: the split that minimizes the busiest
    multiprocessor's load, waves x (tiles per program + 3), the 3 being what a program costs besides its tiles
    (query load, pipeline fill, in tiles; tools/fwd_probe.py on an H100). 1 means: no persistent launch, whose
    cost is divided by ``one_doc_gain`` where the hardware keeps more of those programs resident than ``slots``
    counts (they then overlap one's MMA with another's running max)."""
    best_cost, best_docs = None, 1
    for waves in [*range(1, 9), cdiv(base * K, slots)]:
        n_kprogs = max(1, min(K, waves * slots // base))
        docs = cdiv(K, n_kprogs)
        cost = cdiv(base * cdiv(K, docs), slots) * (docs * tiles + 3)
        if docs == 1:
            cost /= one_doc_gain
        if best_cost is None or cost < best_cost:
            best_cost, best_docs = cost, docs
    return best_docs


class _ForwardPlan(NamedTuple):
    """Everything a forward launch needs that depends only on shapes, strides and flags."""

    Nq: int
    K: int
    Lq: int
    out_shape: tuple[int, ...]  # the scores' shape: [Nq, K], or the caller's (Views.out)
    argmax_dtype: torch.dtype
    n_rsplit: int
    n_dsplit: int  # chunks each document is scanned in (see DOC_SPLIT_*)
    norms_given: bool  # normalize from a pre-pass's inverse norms (see PRENORM_*)
    grid: int
    ints: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    maxnreg: int
    launches: dict  # the launcher's plan cache (see Launcher)
    # The chunks' fold (n_dsplit > 1, else None): grid, the row buffer's fp32 elements, integers, constexprs.
    combine: tuple | None
    combine_launches: dict  # the launcher's plan cache of the fold


_plans: dict[tuple, _ForwardPlan] = {}
_MAX_PLANS = 4096


def _plan_key(
    Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, normalize: bool, need_argmax: bool,
    rg: Ragged | None, views: Views | None,
) -> tuple:  # fmt: skip
    """What a forward plan depends on: shapes, strides, dtypes, flags and the module settings (never values)."""
    return (
        Q.device, Q.shape, Q.stride(), D.shape, D.stride(), Q.dtype, views,
        None if q_mask is None else q_mask.stride(), None if d_mask is None else d_mask.stride(), normalize,
        need_argmax, torch.get_float32_matmul_precision() if Q.dtype == torch.float32 else None, _ragged_key(rg),
        PRENORM_MIN_ROW_BLOCKS, PRENORM_MIN_QUERY_BLOCKS, PRENORM_UNSHARED, STREAM_ONCE_READ, STREAM_L2_RANGE,
        STREAM_MASKED_MIN_BLOCK_K, STREAM_UNSHARED_MAX_ROWS, STREAM_SHARED_MAX_ROWS, ONCE_READ_TABLE_L2,
        ONCE_READ_TABLE, ONCE_READ_WIDE_TABLE_L2, DEEP_PIPELINE,
        DEEP_PIPELINE_MIN_LD, DOC_SPLIT_BELOW, DOC_SPLIT_PROGRAMS_PER_SM, DOC_SPLIT_MIN_TILES,
    )  # fmt: skip


def keep_repeat(
    key: tuple, Q: Tensor, D: Tensor, normalize: bool, views: Views | None, q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
) -> None:  # fmt: skip
    """File the plan that a scores-only forward of ``Q``, ``D`` (the caller's tensors, read through ``views``; the
    masks as canonical views) has just kept under ``key`` as well: a repeat of the call (see :func:`run_repeat`)
    then finds it without building the plan's key. Repeat entries live among the plans, so whatever clears the plans
    (a change of the module settings must) clears them too."""
    plan = _plans.get(_plan_key(Q, D, q_mask, d_mask, normalize, False, None, views))
    if plan is not None:
        _plans[key] = plan


def run_repeat(
    key: tuple, Q: Tensor, D: Tensor, q_mask: Tensor | None = None, d_mask: Tensor | None = None
) -> Tensor | None:
    """Scores of a call filed by :func:`keep_repeat` under ``key`` (None if there is no such entry): its
    allocations and launches only. The masks may be the caller's: a launch reads their pointers, which their
    canonical views share, and the signature holds their strides."""
    plan = _plans.get(key)
    if plan is None:
        return None
    return _run_forward(plan, Q, D, q_mask, d_mask, (Q, Q, Q, Q), False)[0]


class StepPlan:
    """A repeated training call's plans (:func:`keep_step`): the forward's, which saves the argmax, the options the
    backward takes, and the full keys of its backward plans by the upstream gradient's strides (the plans stay among
    the backward plans, so that whatever clears those clears them for the step too)."""

    __slots__ = ("forward", "normalize", "deterministic", "views", "backward_keys")

    def __init__(self, forward: _ForwardPlan, normalize: bool, deterministic: bool, views: Views | None) -> None:
        self.forward, self.normalize, self.deterministic, self.views = forward, normalize, deterministic, views
        self.backward_keys: dict[tuple, tuple] = {}


def keep_step(
    key: tuple, Q: Tensor, D: Tensor, normalize: bool, deterministic: bool, views: Views | None,
    q_mask: Tensor | None = None, d_mask: Tensor | None = None,
) -> None:  # fmt: skip
    """As :func:`keep_repeat`, for a training call whose forward (with the argmax) has just kept its plan: a repeat
    of the call then runs :func:`step_forward` and :func:`step_backward`."""
    plan = _plans.get(_plan_key(Q, D, q_mask, d_mask, normalize, True, None, views))
    if plan is not None:
        _plans[key] = StepPlan(plan, normalize, deterministic, views)


def step_plan(key: tuple) -> StepPlan | None:
    """The step plan filed under ``key`` by :func:`keep_step`, or None."""
    return _plans.get(key)


def step_forward(
    step: StepPlan, Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """Scores, argmax and inverse norms (as :func:`forward_keeping_norms`) of a repeated training call: the
    forward plan's allocations and launches only (the masks as in :func:`run_repeat`)."""
    return _run_forward(step.forward, Q, D, q_mask, d_mask, (Q, Q, Q, Q), True)


def step_backward(
    step: StepPlan, grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, norms: tuple[Tensor, Tensor] | None
) -> tuple[Tensor, Tensor]:
    """:func:`backward` after :func:`step_forward`: the backward plan of these gradient strides by the key an earlier
    step built for them (``grad`` fp32; else the full :func:`backward`)."""
    if grad.dtype != torch.float32:
        return backward(grad, Q, D, argmax, step.normalize, step.deterministic, None, norms, step.views)
    strides = grad.stride()
    key = step.backward_keys.get(strides)
    plan = None if key is None else _bplans.get(key)
    if plan is None:
        # (Q and D are last-dim contiguous, as the forward files no plan for others, and the problem is not empty)
        key, plan = _backward_plan_of(grad, Q, D, step.normalize, step.deterministic, None, step.views)
        step.backward_keys[strides] = key
    return _run_backward(plan, grad, Q, D, argmax, step.normalize, None, norms)


def forward(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """Scores and argmax: :func:`forward_keeping_norms` (same arguments) without the inverse norms."""
    scores, argmax, _norms = forward_keeping_norms(*args, **kwargs)
    return scores, argmax


def forward_keeping_norms(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    normalize: bool,
    need_argmax: bool,
    rg: Ragged | None = None,
    cfg: ForwardConfig | None = None,
    views: Views | None = None,
) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor] | None]:
    """Scores ``[Nq, K]`` fp32, argmax ``[Nq, K, Lq]`` (:func:`~maxsim.layout.argmax_dtype`; None unless
    ``need_argmax``) and the inverse norms
    ``(inv_q, inv_d)`` (fp32, the tokens' shapes without ``dim``) where the forward computed them in a pre-pass
    (``normalize=True``, see ``PRENORM_*``; else None), which a training step hands on to :func:`backward`.

    A pair list gives ``[1, P]`` and ``[1, P, Lq]``. ``cfg`` overrides the launch table (offline tuning only).
    ``views``: ``Q`` and ``D`` are the caller's tensors, to be read as ``view_as_canonical`` of them, and the results
    come in the caller's shape (``views.out``, ``[..., Lq]`` for the argmax: the layout of the canonical ones); a
    repeated call then makes no view at all, since a launch needs pointers only.
    Calls reuse a plan keyed by shapes, strides, flags and maximum lengths (never values), so a repeated call
    costs its allocations and a launch of host work."""
    key = None
    if cfg is None:
        key = _plan_key(Q, D, q_mask, d_mask, normalize, need_argmax, rg, views)
        plan = _plans.get(key)
        if plan is not None:
            return _run_forward(plan, Q, D, q_mask, d_mask, _seg_tensors(Q, rg), need_argmax)
    if views is not None:  # (a view shares its tensor's pointer: the plan serves the caller's tensors as given)
        Q, D = view_as_canonical(Q, views.q), view_as_canonical(D, views.d)
    Nq, Lq, Bd, K, Ld, dim = dims(Q, D, rg)
    if Nq == 0 or K == 0 or Lq == 0 or Ld == 0:
        out_shape = (Nq, K) if views is None or views.out is None else views.out
        scores = torch.zeros(out_shape, dtype=torch.float32, device=Q.device)
        argmax = torch.full((*out_shape, Lq), -1, dtype=argmax_dtype(Ld), device=Q.device) if need_argmax else None
        return scores, argmax, None
    if key is not None and (Q.stride(-1) != 1 or D.stride(-1) != 1):
        key = None  # the plan would describe the contiguous copies made below, not these tensors
    Q, D = _last_dim_contiguous(Q), _last_dim_contiguous(D)
    sg = _segs(Q, D, rg)
    shared = Bd == 1 and not sg.pairs
    from_table = cfg is None
    cfg = cfg or forward_config(Lq, dim, Nq, shared, Q.dtype == torch.float32)
    n_qblocks = cdiv(Nq, cfg.BQ)
    # Queries longer than one row block: one program per row block (more programs, shorter ones), partial scores
    # summed afterwards in a fixed order.
    n_rsplit = cdiv(Lq, cfg.TQ)
    n_programs = n_qblocks * n_rsplit * K  # (one per document and row block)
    stream = False
    if from_table and _deep_pipelined(n_programs, cfg, Ld, D):
        cfg = deep_pipeline_config(cfg)
    else:
        scan = None if need_argmax else _once_read_scan(sg, shared, n_qblocks, n_rsplit, cfg, D, d_mask is not None, K)
        stream = scan == "stream"
        if scan is not None and from_table:
            cfg = streaming_config(cfg) if stream else once_read_config(cfg, Ld)
        elif from_table and not need_argmax:
            cfg = scores_only_config(cfg, Lq)
    sqm = (0, 0) if q_mask is None else q_mask.stride()
    sdm = (0, 0, 0) if d_mask is None else ((0 if shared else d_mask.stride(0)),) + d_mask.stride()[1:]
    rows_per_prog = cfg.TQ if n_rsplit > 1 else Lq
    docs_per_prog = 1
    if cfg.persist and not sg.pairs and sg.d_kind == DENSE and cfg.NUM_K == 1:
        slots = _sm_count(Q.device) * cfg.persist
        # A persistent launch planned one program to a multiprocessor (packed queries) loses the two that the
        # hardware keeps resident when each program takes one document: H100, training forward of 64x64 Lq32 Ld1024
        # (4 documents of 16 tiles per persistent program) 0.103 ms, one document per program 0.095 ms; with short
        # documents persistence still wins (64x64 Ld128 0.025 against 0.032 ms, 256x256 Ld300 0.54 against 0.62).
        gain = ONE_DOC_GAIN if cfg.persist == 1 else 1.0
        docs_per_prog = _docs_per_program(n_qblocks * n_rsplit, K, slots, cdiv(Ld, cfg.BLOCK_N), gain)
    n_dsplit, chunk_len = 1, 0
    if docs_per_prog == 1:
        n_dsplit, chunk_len = _doc_chunks(n_programs, Ld, cfg.BLOCK_N, Q.device)
    norms_given = normalize and (
        n_rsplit >= PRENORM_MIN_ROW_BLOCKS
        or (n_qblocks >= PRENORM_MIN_QUERY_BLOCKS if shared else bool(PRENORM_UNSHARED))
    )
    combine = None
    if n_dsplit > 1:
        n_pairs = Nq * K
        combine = (
            n_pairs, 2 * n_dsplit * n_pairs * Lq, (n_pairs, Lq, n_dsplit),
            dict(LQ_BLOCK=min(128, next_power_of_2(Lq)), SAVE_ARGMAX=need_argmax),
        )  # fmt: skip
    inv_q_strides = _q_strides(torch.empty(Q.shape[:-1] + (1,), device="meta")) if norms_given else (0, 0)
    inv_d_strides = _d_strides(torch.empty(D.shape[:-1] + (1,), device="meta"), shared) if norms_given else (0, 0, 0)
    plan = _ForwardPlan(
        Nq, K, Lq, (Nq, K) if views is None or views.out is None else views.out, argmax_dtype(Ld), n_rsplit, n_dsplit,
        norms_given,
        n_qblocks * n_rsplit * n_dsplit * cdiv(K, docs_per_prog),
        (
            Nq, K, Lq, Ld, dim,
            sg.n_q, sg.rows_q, sg.n_d, sg.rows_d,
            *_q_strides(Q), *_d_strides(D, shared), *inv_q_strides, *inv_d_strides, *sqm, *sdm,
            sg.sqs, sg.sds_b, sg.sds_k,
            n_qblocks, n_rsplit, rows_per_prog, docs_per_prog, n_dsplit, chunk_len,
        ),
        dict(
            TQ=cfg.TQ, BQ=cfg.BQ, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, NUM_K=cfg.NUM_K,
            Q_KIND=sg.q_kind, D_KIND=sg.d_kind, PAIR_LIST=sg.pairs,
            HAS_QMASK=q_mask is not None, HAS_DMASK=d_mask is not None, NORMALIZE=normalize,
            SAVE_ARGMAX=need_argmax, DOT_PRECISION=_dot_precision(Q.dtype), UPCAST=_upcast(Q.dtype),
            PERSIST=docs_per_prog > 1, NORMS_GIVEN=norms_given,
            # (a split query's scores-only loop ran 5 % slower with the early load: ColPali 357 -> 376 us)
            EARLY_NORMS=norms_given and (need_argmax or n_rsplit == 1),
            STREAM_D=stream, DOC_SPLIT=n_dsplit > 1,
        ),
        cfg.num_warps,
        cfg.num_stages,
        cfg.maxnreg,
        {},
        combine,
        {},
    )  # fmt: skip
    if key is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return _run_forward(plan, Q, D, q_mask, d_mask, (sg.qseg, sg.dseg, sg.pq, sg.pd), need_argmax)


def _doc_chunks(n_programs: int, Ld: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """``(chunks, tokens per chunk)`` each document of a forward launch of ``n_programs`` programs (one per document
    and row block) is scanned in: ``(1, 0)`` unless the launch would leave multiprocessors idle (see DOC_SPLIT_*).
    Chunks are whole tiles of ``block_n`` tokens, from the longest document's ``Ld``."""
    sms = _sm_count(device)
    if not DOC_SPLIT_PROGRAMS_PER_SM or n_programs * DOC_SPLIT_BELOW > sms:
        return 1, 0
    tiles = cdiv(Ld, block_n)
    n = min(cdiv(DOC_SPLIT_PROGRAMS_PER_SM * sms, n_programs), tiles // max(1, DOC_SPLIT_MIN_TILES))
    if n < 2:
        return 1, 0
    chunk_tiles = cdiv(tiles, n)
    return cdiv(tiles, chunk_tiles), chunk_tiles * block_n


def _deep_pipelined(n_programs: int, cfg: ForwardConfig, Ld: int, D: Tensor) -> bool:
    """Whether a forward of ``n_programs`` programs (one per document and row block) takes
    ``deep_pipeline_config`` (see DEEP_PIPELINE)."""
    thin = cfg.BQ * cfg.TQ <= 32 and cfg.NUM_K == 1 and D.element_size() == 2
    if not (DEEP_PIPELINE and thin and Ld >= DEEP_PIPELINE_MIN_LD and n_programs < _sm_count(D.device)):
        return False
    return _shared_bytes(D.device) >= DEEP_PIPELINE_MIN_SHARED


def _once_read_scan(
    sg: _Segs, shared: bool, n_qblocks: int, n_rsplit: int, cfg: ForwardConfig, D: Tensor, masked: bool, K: int
) -> str | None:  # fmt: skip
    """How the scores-only forward reads ``D`` if every document tile is read by one program alone (a shared
    document by the only block of query rows, a query's own candidate by its only row split; a pair list may name a
    document twice), 16-bit tokens in one dim chunk, thin row blocks: ``"stream"`` (the ``STREAM_D`` loop; the
    loop keeps two tiles in registers) for a scan of STREAM_L2_RANGE times the L2's size (masked tokens included:
    the mask is not read on the host) with a document mask only with wide tiles (STREAM_MASKED_MIN_BLOCK_K),
    ``"table"`` (the pipelined loop with ``once_read_config``'s tiles) for a dense unmasked scan of one 128-wide
    chunk beyond the card's ONCE_READ_TABLE_L2 (blocks of 33-64 rows with ``K`` > 1 documents a query:
    ONCE_READ_WIDE_TABLE_L2 on those cards), else None (the table's configuration as it is)."""
    readers = n_qblocks * n_rsplit if shared else n_rsplit
    if readers != 1 or sg.pairs or D.element_size() != 2 or cfg.NUM_K != 1:
        return None
    rows = cfg.BQ * cfg.TQ
    if rows > (STREAM_SHARED_MAX_ROWS if shared else STREAM_UNSHARED_MAX_ROWS):
        return None
    l2s = D.numel() * D.element_size() / _l2_bytes(D.device)
    wide_dense = not masked and sg.d_kind == DENSE and cfg.BLOCK_K == 128
    bound = _once_read_table_l2(D.device)
    if rows > 32 and bound != math.inf and K > 1:  # (one document a query: nothing to walk, see there)
        bound = min(bound, ONCE_READ_WIDE_TABLE_L2)
    if ONCE_READ_TABLE and wide_dense and l2s > bound:
        return "table"
    if not STREAM_ONCE_READ or (masked and cfg.BLOCK_K < STREAM_MASKED_MIN_BLOCK_K):
        return None
    lo, hi = STREAM_L2_RANGE
    return "stream" if lo <= l2s <= hi else None


def _run_forward(
    plan: _ForwardPlan, Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, segs: tuple,
    need_argmax: bool,
) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor] | None]:  # fmt: skip
    device = Q.device
    # (allocated in the caller's shape, whose layout is the canonical one's: no view of the results)
    scores = torch.empty(plan.out_shape, dtype=torch.float32, device=device)
    # No argmax tensor at all when none is asked for (the registered op substitutes an empty one).
    argmax = torch.empty((*plan.out_shape, plan.Lq), dtype=plan.argmax_dtype, device=device) if need_argmax else None
    n_rsplit, n_dsplit = plan.n_rsplit, plan.n_dsplit
    # (chunked documents: the fold sums every row of a query, its row blocks' included)
    separate_rows = n_rsplit > 1 and n_dsplit == 1
    out = torch.empty((n_rsplit, *plan.out_shape), dtype=torch.float32, device=device) if separate_rows else scores
    qm = Q if q_mask is None else q_mask.view(torch.uint8)
    dm = Q if d_mask is None else d_mask.view(torch.uint8)
    arg = scores if argmax is None else argmax
    norms = normalize_kernels.inverse_norms(Q, D) if plan.norms_given else None
    # (chunked documents: each chunk's row maxima, then their tokens, in one allocation; see doc_chunks)
    rows = torch.empty(plan.combine[1], dtype=torch.float32, device=device) if n_dsplit > 1 else scores
    tensors = (Q, D, qm, dm, *segs, out, arg, *(norms or (Q, D)), rows)  # (Q, D, scores: unused pointers)
    dense = q_mask is None and d_mask is None and segs[0] is segs[1] is segs[2] is segs[3] is Q
    foreign = (Q, D) if dense else (Q, D, qm, dm, *segs)
    _fwd(
        plan.grid,
        tensors,
        plan.ints,
        plan.constexprs,
        plan.num_warps,
        plan.num_stages,
        plan.launches,
        plan.maxnreg,
        foreign=foreign,
    )
    if n_dsplit > 1:
        grid, _n, ints, constexprs = plan.combine
        _combine_chunks(grid, (rows, scores, arg), ints, constexprs, 4, 1, plan.combine_launches, foreign=())
    elif n_rsplit > 1:
        torch.sum(out, dim=0, out=scores)
    return scores, argmax, norms


def csr(ids: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Group pair indices by ``ids`` (values in ``[0, n)``) without a host sync: ``(offsets [n + 1], order [P])``;
    group ``i`` is ``order[offsets[i]:offsets[i + 1]]``, in increasing pair order. Short lists: one counting
    launch (:mod:`.csr`); long ones: a stable sort. Same groups either way (the choice depends on shapes only)."""
    P = ids.shape[0]
    if P * (P + n) <= csr_kernel.MAX_WORK:
        offsets = torch.empty(n + 1, dtype=torch.int32, device=ids.device)
        order = torch.empty(P, dtype=torch.int32, device=ids.device)
        programs, n_pblocks = csr_kernel.grid(P, n)
        _csr(programs, (ids, offsets, order), (P, n, n_pblocks), dict(BP=csr_kernel.BP, BC=csr_kernel.BC), 4)
        return offsets, order
    ids_sorted, order = torch.sort(ids, stable=True)
    bounds = torch.arange(n + 1, device=ids.device, dtype=ids.dtype)
    return torch.searchsorted(ids_sorted, bounds), order


def _sorted_dd(
    spec: tuple, grad: Tensor, Q: Tensor, D: Tensor, inv_q: Tensor, argmax: Tensor, gd: Tensor
) -> None:  # fmt: skip
    """dD into ``gd`` by the sorted gather of :mod:`.dd_gather` (``spec``: the plan's ``dd_sorted``)."""
    n_links, K, Lq, Ld, ints, constexprs, num_warps = spec
    keys = torch.empty(n_links, dtype=torch.int32, device=argmax.device)
    _link_keys(dd_gather.keys_grid(n_links), (argmax, keys), (n_links, K, Lq, Ld), dict(BL=dd_gather.BL), 4)
    offsets, order = csr(keys, K * Ld)
    _dd_gather(K * Ld, (grad, Q, inv_q, D, order, offsets, gd), ints, constexprs, num_warps)


class _BackwardPlan(NamedTuple):
    """Everything a backward needs that depends only on shapes, strides, dtypes and flags: which kernels run, their
    grids, integer arguments and constexprs (the tensors are filled in per call)."""

    grad_contiguous: bool  # the fp32 upstream gradient must be made contiguous first
    dq_scatter: bool  # dQ by atomics into a zeroed fp32 buffer (a long pair list) instead of the gather
    dq_splits: int  # slices of each query's dQ walk (> 1: an fp32 partial per slice, summed after; see DQ_SPLIT_*)
    dq_dtype: torch.dtype
    q_csr: bool  # the dQ gather walks a CSR index of the pairs by query
    n_queries: int
    dd_owned: bool  # dD by the owner programs (else atomics into a zeroed fp32 buffer)
    dd_dtype: torch.dtype
    d_csr: bool
    n_docs: int
    main: tuple  # (grid, ints, constexprs) of the maxsim_bwd_kernel launch: the dQ gather and/or the owned dD
    dq_sc: tuple | None  # the scatter launches (dQ of a long pair list, dD of a large fast cross product)
    dd_sc: tuple | None  # (None with the owner, or with the atomics in the main launch: FUSED_SCATTER)
    dd_chunks: tuple  # chunks of the atomics (see dd_chunks.chunk_plan; empty: all at once)
    dd_tail: int  # documents of the chunks' own buffer (0: none)
    fused_sc: bool  # the atomics (of the first chunk) run in the main launch
    chunk_steps: tuple  # the chunks' launches after the main one (see dd_chunks.chunk_steps)
    chunk_launches: list  # the launcher's plan cache of each of those launches
    direct_d: bool  # dD comes out in D's dtype without a cast
    dd_sorted: tuple | None  # (n_links, K, Lq, Ld, ints, constexprs, warps) of the sorted gather (dd_gather.py)
    project_q: bool  # normalize: the gather chains dQ through Q's normalization (else a launch after)
    project_d: bool  # normalize: the owner or the sorted gather chains dD through D's normalization (else a launch)
    num_warps: int
    launches: dict  # the launcher's plan cache of the main launch (see Launcher)
    sum_launches: dict  # the same, of the split walk's slice sum


_bplans: dict[tuple, _BackwardPlan] = {}


def _register_selector(doc_walk: bool, normalize: bool, cfg: BackwardConfig, dtype: torch.dtype) -> bool:
    """Whether the dD owner builds its selector in the MMA's registers (``REG_SEL``) instead of passing it through
    shared memory. H200, backward GPU time (docs/performance.md v81): a document walk loads its query's argmax once
    for all its token blocks, and gains with raw tokens (candidates 64x7 Lq23 Ld333 dim 48 9.4 -> 8.1 us, 256x16 Ld300
    106.5 -> 99.3, 128x8 Lq64 Ld256 34.9 -> 31.8, pairs 512 17.7 -> 16.5) but not normalized ones (1.02-1.06x); a walk
    over the queries loads the argmax per step, in that layout 8 tokens a thread against 1, which pays at 128 dims
    and at most 32 tokens (cross products 64x64 Ld128 40.5 -> 35.9 us, 32x32 Ld80 17.3 -> 16.8, normalized 0.94-0.97x)
    but not at 64 dims (48x48 Lq23 dim 48 29.2 -> 33.5 us) or 64 tokens (16x16 Lq64 Ld512 16.4 -> 17.1). 16-bit
    tokens only (fp32 ones were not measured)."""
    if not REGISTER_SELECTOR or dtype == torch.float32:
        return False
    return not normalize if doc_walk else (cfg.BLOCK_K == 128 and cfg.TQ <= 32)


def _shared_owned(Nq: int, Lq: int, K: int, Ld: int, dim: int, cfg: BackwardConfig) -> bool:
    """Whether a fast backward of the cross product owns dD (see SHARED_OWNER_MAX_WORK)."""

    def padded(n: int, block: int) -> int:
        return cdiv(n, block) * block

    rows = Nq * padded(Lq, cfg.TQ)
    return (
        rows <= SHARED_OWNER_MAX_ROWS
        or rows * K * padded(Ld, cfg.BN) * padded(dim, cfg.BLOCK_K) <= SHARED_OWNER_MAX_WORK
    )


def _dq_splits(n_programs: int, K: int, device: torch.device) -> int:
    """Slices of each query's dQ walk over ``K`` pairs when the gather has ``n_programs`` (see DQ_SPLIT_*)."""
    if K < DQ_SPLIT_MIN_K:
        return 1
    want = cdiv(DQ_SPLIT_PROGRAMS_PER_SM * _sm_count(device), n_programs)
    return max(1, min(want, K // DQ_SPLIT_MIN_PAIRS))


def _grad_stride(grad: Tensor) -> int | None:
    """The stride ``s`` at which the kernels read element ``(q, k)`` of the ``[Nq, K]`` upstream gradient, at
    ``(q * K + k) * s`` (None: it must be made contiguous first). ``grad`` is ``[Nq, K]`` or the caller's view of it
    without its unit axes (``Views.out``: ``[Nq]``, ``[K]`` or a scalar), whose flat order is the same."""
    if grad.dim() == 2:
        return grad.stride(1) if grad.stride(0) == grad.stride(1) * grad.shape[1] else None
    return grad.stride(0) if grad.dim() == 1 else 1


def _backward_plan(
    grad: Tensor, Q: Tensor, D: Tensor, normalize: bool, deterministic: bool, rg: Ragged | None, sg: _Segs
) -> _BackwardPlan:
    Nq, Lq, Bd, K, Ld, dim = dims(Q, D, rg)
    shared = Bd == 1 and not sg.pairs
    cfg = backward_config(Lq, dim, not shared and not sg.pairs, normalize)
    grad_stride = _grad_stride(grad)
    grad_contiguous = grad_stride is None
    grad_stride = 1 if grad_stride is None else grad_stride
    n_queries = sg.n_q if sg.q_kind == OFFSETS else Q.shape[0]
    n_docs = sg.n_d if sg.d_kind == OFFSETS else K
    seg_args = (sg.n_q, sg.rows_q, sg.n_d, sg.rows_d)
    seg_strides = (sg.sqs, sg.sds_b, sg.sds_k, grad_stride)
    kinds = dict(Q_KIND=sg.q_kind, D_KIND=sg.d_kind)
    n_tb = cdiv(Lq, cfg.BT)
    n_pairs = Nq * K  # the [Nq, K] score grid (a pair list: [1, P])
    q_fresh = _q_strides(torch.empty(Q.shape, device="meta"))  # a fresh contiguous gradient's strides
    d_fresh = _d_strides(torch.empty(D.shape, device="meta"), False)

    def scatter(to_q: bool, q_strides: tuple, d_strides: tuple) -> tuple:
        docs = 1 if to_q else SCATTER_DOCS  # (dD: the grid of all K documents; a chunk's is _scatter_grid's)
        return (
            Nq * cdiv(K, docs) * n_tb if not sg.pairs else n_pairs * n_tb,
            (Nq, K, Lq, Ld, dim, *seg_args, *q_strides, *d_strides, *seg_strides, n_tb, 0, K, 0, 0, 0),
            dict(BT=cfg.BT, DIM_P=cfg.DIM_P, **kinds, PAIR_LIST=sg.pairs, SHARED_DOCS=shared, TO_Q=to_q,
                 NORMALIZE=normalize, DOCS=docs, CAST=False, CAST_BLOCK=_FUSED_CAST_BLOCK),
        )  # fmt: skip

    # A short pair list is scanned by each program instead of indexed (see backward.py): fewer launches.
    scan_q = sg.pairs and n_queries * n_tb * n_pairs <= PAIR_SCAN_MAX_WORK
    # A long pair list's queries recur in any order: atomics into an fp32 buffer, one program per (pair, token
    # block). Walking each query's pairs instead is a chain of dependent index loads per step (latency-bound).
    # Otherwise dQ is a gather, one program per (query, token block), summing over its pairs in order
    # (deterministic), written straight in Q's dtype (fp32 when a normalize projection follows); splitting the pairs
    # over more programs would need a partial-sum buffer of another dtype, i.e. a second variant compiled at a
    # data-dependent moment, which the launch table rules out.
    dq_scatter = sg.pairs and not deterministic and not scan_q
    dq_splits = 1 if sg.pairs else _dq_splits(n_queries * n_tb, K, Q.device)
    ks_len = cdiv(K, dq_splits)
    dq_splits = cdiv(K, ks_len)  # (no empty slice)
    n_dq = 0 if dq_scatter else n_queries * n_tb * dq_splits
    dq_sc = scatter(True, q_fresh, _d_strides(D, shared)) if dq_scatter else None

    # dD: documents scored by one query each (candidates) and pair lists take the owner programs, which are then also
    # the fastest (no zeroed fp32 buffer, no atomics, no cast); so does the cross product up to a size (beyond it,
    # atomics, or where asked to be deterministic the owner, and from SORTED_DD_MIN_LINKS on the sorted gather).
    owned_small = shared and _shared_owned(Nq, Lq, K, Ld, dim, cfg)
    n_links = Nq * K * Lq
    dense = sg.q_kind == DENSE and sg.d_kind == DENSE
    sorted_dd = deterministic and shared and dense and not owned_small and n_links >= SORTED_DD_MIN_LINKS
    dd_owned = not sorted_dd and (deterministic or not shared or owned_small)
    n_jb = cdiv(Ld, cfg.BN)
    n_kb = cdiv(dim, cfg.BLOCK_K)
    n_owned = n_docs if sg.d_kind == OFFSETS else Bd * K
    # A document that one short query scored is owned by one program per dim block, walking its token blocks (a
    # block's work is one query's: a program per block would mostly wait on its loads). With longer queries the
    # walk would reload them per block (H100: candidates 64x8 Lq128 Ld300 backward 62 -> 69 us): a program each.
    # So does a pair list's document (its pairs found by the scan or the index; see _dd_program).
    doc_walk = not shared and Lq <= cfg.TQ
    # A walking program scans the pair ids once (the ids of a document's first HELD pairs stay in registers);
    # otherwise each (document, token block, dim block) program scans them. (H100, training step of 2048 pairs
    # from a pool of 1024 documents, Lq 8-32 Ld 20-1000: counted per block it took the index, whose counting
    # launch cost 22 us of GPU time and a launch of host time.)
    scans = n_owned * n_kb * (1 if doc_walk else n_jb)
    scan_d = dd_owned and sg.pairs and scans * n_pairs <= PAIR_SCAN_MAX_WORK
    n_dd = (n_owned * (1 if doc_walk else n_jb) * n_kb) if dd_owned else 0
    # With normalize, a program holding whole gradient rows chains them through the normalization itself (written
    # in the input's dtype: no fp32 buffer, no pass afterwards); the rest is projected by one launch after.
    project_q = normalize and n_dq > 0 and dq_splits == 1
    project_d = normalize and n_dd > 0 and n_kb == 1
    direct_d = (not normalize and (dd_owned or D.dtype == torch.float32)) or project_d or sorted_dd
    # (chunks: a dense cross product's buffer, in D's documents; with normalize the projection reads the whole buffer)
    doc_bytes = Ld * dim * 4
    dd_chunks, dd_tail = (), 0
    chunkable = shared and not dd_owned and not sorted_dd and not normalize and D.element_size() == 2
    if chunkable and K * doc_bytes > SCATTER_BUFFER_MAX_BYTES and sg.d_kind != OFFSETS:
        docs = max(1, SCATTER_CHUNK_BYTES // doc_bytes, cdiv(SCATTER_CHUNK_MIN_LINKS, Nq * Lq))
        dd_chunks, dd_tail = chunk_plan(K, docs) if docs < K else ((), 0)
        if dd_tail * doc_bytes > max(SCATTER_BUFFER_MAX_BYTES, SCATTER_CHUNK_BYTES):
            dd_chunks, dd_tail = (), 0  # (chunks grown past the cap by SCATTER_CHUNK_MIN_LINKS: see there)
    fused_sc = not dd_owned and not sorted_dd and bool(FUSED_SCATTER)
    sc_lo, sc_n = dd_chunks[0][:2] if dd_chunks else (0, K)  # (the main launch's atomics: all, or the first chunk)
    n_dsc = _scatter_grid(Nq, sc_n, n_tb) if fused_sc else 0
    steps = chunk_steps(dd_chunks, fused_sc) if dd_chunks else ()
    dd_sc = (
        None
        if dd_owned or (fused_sc and not dd_chunks) or sorted_dd
        else scatter(False, _q_strides(Q), _d_strides(torch.empty(D.shape, device="meta"), shared))
    )
    dd_sorted = None
    if sorted_dd:
        ints_sorted = (K, Lq, Ld, dim, *_q_strides(Q), *_d_strides(D, shared)[1:], *d_fresh[1:], grad_stride)
        constexprs_sorted = dict(CHUNK=dd_gather.CHUNK, DIM_P=cfg.DIM_P, NORMALIZE=normalize)
        dd_sorted = (n_links, K, Lq, Ld, ints_sorted, constexprs_sorted, SORTED_DD_WARPS)
    ints = (
        n_queries, Nq, K, n_docs if sg.pairs else K, n_pairs, Lq, Ld, dim, *seg_args,
        *_q_strides(Q), *_d_strides(D, shared), *q_fresh, *d_fresh, *seg_strides, n_tb, n_jb, n_kb,
    )  # fmt: skip
    constexprs = dict(
        BT=cfg.BT, DIM_P=cfg.DIM_P, TQ=cfg.TQ, BN=cfg.BN, BLOCK_K=cfg.BLOCK_K, **kinds,
        PAIR_LIST=sg.pairs, SHARED_DOCS=shared, NORMALIZE=normalize, DOT_PRECISION=_dot_precision(Q.dtype),
        UPCAST=_upcast(Q.dtype), SCAN_Q=scan_q, SCAN_D=scan_d, DOC_WALK=doc_walk,
    )  # fmt: skip
    # Both sides in one launch (H100, GPU time of the backward: candidates 64x32 Lq32 Ld180 100 -> 76 us, as fast as
    # two launches elsewhere), and one launch fewer of host time, which is what a small step is made of.
    # The dQ walk gathers UNROLL pairs per step (their loads in flight together: fewer round trips per program);
    # sharing a launch with the owner it takes one at a time. (H200, docs/performance.md v77, backward GPU time with
    # the owner, 4 pairs a step against 1: the cross products' owner is the longer walk, unchanged; candidates 64x32
    # 41.2 -> 37.5 us, 128x8 Lq64 35.3 -> 34.1, but aligned pairs 512 17.8 -> 19.8.)
    # The atomics' programs do not mind the gather's registers (H100, backward GPU time with the atomics in the
    # launch, UNROLL 4 vs 1: 256x256 Ld300 424 vs 458 us, 32x32 Lq1024 204 vs 202, 64x64 Ld1024 65 vs 56).
    unroll = FUSED_DQ_UNROLL if n_dd else DQ_UNROLL
    main = (
        n_dq + n_dd + n_dsc,
        (*ints, n_dq, dq_splits, ks_len, Q.numel(), sc_lo, sc_n),
        dict(constexprs, UNROLL=unroll, DQ_GATHER=n_dq > 0, DD_OWNED=n_dd > 0, DD_SCATTER=n_dsc > 0,
             PROJECT_Q=project_q, PROJECT_D=project_d, DQ_SPLIT=dq_splits > 1, SCATTER_DOCS=SCATTER_DOCS,
             ONE_TQ=Lq <= cfg.TQ,  # (TQ follows Lq up to 64 tokens: one more variant for longer queries, once)
             REG_SEL=n_dd > 0 and _register_selector(doc_walk, normalize, cfg, Q.dtype)),
    )  # fmt: skip
    return _BackwardPlan(
        grad_contiguous, dq_scatter, dq_splits,
        torch.float32 if dq_scatter or (normalize and dq_splits > 1) else Q.dtype,
        sg.pairs and not scan_q and not dq_scatter, n_queries,
        dd_owned, D.dtype if direct_d else torch.float32, sg.pairs and dd_owned and not scan_d, n_docs,
        main, dq_sc, dd_sc, dd_chunks, dd_tail, fused_sc, steps, [{} for _ in steps],
        direct_d, dd_sorted, project_q,
        project_d or (normalize and sorted_dd), cfg.num_warps, {}, {},
    )  # fmt: skip


def _scatter_grid(Nq: int, n_docs: int, n_tb: int) -> int:
    """Programs of the dD atomics into ``n_docs`` documents (``SCATTER_DOCS`` a program) from ``Nq`` queries of
    ``n_tb`` token blocks."""
    return Nq * cdiv(n_docs, SCATTER_DOCS) * n_tb


def _front_buffer(gd: Tensor, chunk: tuple[int, int, bool]) -> Tensor:
    """The fp32 buffer of an in-dD chunk (``dd_chunks.chunk_plan``): the front of dD's (16-bit) storage, one
    chunk's size."""
    _k0, n, _in_dd = chunk
    row = gd.shape[-2] * gd.shape[-1]
    return gd.view(-1)[: 2 * n * row].view(torch.float32)


def _chunked_scatter(
    plan: _BackwardPlan,
    gd: Tensor,
    own: Tensor | None,
    grad: Tensor,
    argmax: Tensor,
    Q: Tensor,
    inv_q: Tensor,
    segs: tuple,
) -> Tensor:
    """dD ``gd`` (16-bit, D's shape) of a dense cross product by the atomics, a chunk of documents at a time
    (``plan.dd_chunks``, launched as ``plan.chunk_steps``), each into a zeroed fp32 buffer (the front of ``gd``, or
    ``own``, made when first needed) and cast into its documents of ``gd``, which clears the buffer for the next
    chunk that uses it. With ``plan.fused_sc`` the first chunk's atomics ran in the main launch, into its zeroed
    buffer."""
    _grid, ints, constexprs = plan.dd_sc
    Nq, n_tb = ints[0], ints[-6]
    row = gd.shape[-2] * gd.shape[-1]
    flat = gd.view(-1)
    foreign = (grad, argmax, Q, inv_q, *segs)  # (the buffers and the slices of gd: fresh, at fixed offsets per chunk)

    def buffer(c: int) -> Tensor:
        nonlocal own
        if plan.dd_chunks[c][2]:
            return _front_buffer(gd, plan.dd_chunks[c])
        if own is None:
            own = torch.zeros(plan.dd_tail * row, dtype=torch.float32, device=gd.device)
        return own

    for (scatter, cast, clear), cache in zip(plan.chunk_steps, plan.chunk_launches, strict=True):
        if cast is not None:
            k0, kc, _in_dd = plan.dd_chunks[cast]
            n, n_clear = kc * row, clear * row
            cast_pair = (buffer(cast), flat[k0 * row : k0 * row + n])
        if scatter is None:
            _cast_clear(cdiv(n, dd_chunks.BLOCK), cast_pair, (n, n_clear), dict(BLOCK=dd_chunks.BLOCK),
                        dd_chunks.NUM_WARPS, 3, cache, foreign=())  # fmt: skip
            continue
        k0, kc, _in_dd = plan.dd_chunks[scatter]
        tensors = (grad, argmax, Q, buffer(scatter), inv_q, *segs)
        n_progs = cdiv(n, _FUSED_CAST_BLOCK) if cast is not None else 0
        cast_args = (n, n_clear, n_progs) if cast is not None else (0, 0, 0)
        _bwd_scatter(
            n_progs + _scatter_grid(Nq, kc, n_tb), (*tensors, *(cast_pair if cast is not None else (grad, grad))),
            (*ints[:-5], k0, kc, *cast_args), dict(constexprs, CAST=cast is not None), plan.num_warps, 3, cache,
            foreign=foreign,
        )  # fmt: skip
    return gd


def backward(
    grad: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    normalize: bool,
    deterministic: bool,
    rg: Ragged | None = None,
    norms: tuple[Tensor, Tensor] | None = None,
    views: Views | None = None,
) -> tuple[Tensor, Tensor]:
    """``(dQ like Q, dD like D)`` from the saved argmax; ``deterministic`` forbids atomics (bitwise reproducible).
    ``norms``: the inverse norms the forward computed (:func:`forward_keeping_norms`), else computed here.
    ``views``: ``Q`` and ``D`` are the caller's tensors, read as ``view_as_canonical`` of them, and ``grad`` and
    ``argmax`` may have the caller's result shape (``views.out``); the gradients come back in the caller's shapes
    (an allocation of that shape has the canonical view's layout).

    Calls reuse a plan keyed by shapes, strides, dtypes and flags (never values), like the forward."""
    Q, D = _last_dim_contiguous(Q), _last_dim_contiguous(D)
    if grad.dtype != torch.float32:
        grad = grad.to(torch.float32)
    _key, plan = _backward_plan_of(grad, Q, D, normalize, deterministic, rg, views)
    if plan is None:
        return torch.zeros_like(Q), torch.zeros_like(D)
    return _run_backward(plan, grad, Q, D, argmax, normalize, rg, norms)


def _backward_plan_of(
    grad: Tensor, Q: Tensor, D: Tensor, normalize: bool, deterministic: bool, rg: Ragged | None,
    views: Views | None,
) -> tuple[tuple, _BackwardPlan | None]:  # fmt: skip
    """The key and the backward plan of these arguments (:func:`backward`'s, ``grad`` fp32 and ``Q``, ``D`` last-dim
    contiguous), the plan made and filed on the first call of a key; None for a problem without work."""
    key = (
        Q.device, Q.shape, Q.stride(), D.shape, D.stride(), Q.dtype, D.dtype, grad.shape, grad.stride(), views,
        normalize, deterministic, torch.get_float32_matmul_precision() if Q.dtype == torch.float32 else None,
        _ragged_key(rg), PAIR_SCAN_MAX_WORK, DQ_SPLIT_MIN_K, DQ_SPLIT_MIN_PAIRS, DQ_SPLIT_PROGRAMS_PER_SM,
        SHARED_OWNER_MAX_WORK, SHARED_OWNER_MAX_ROWS, FUSED_SCATTER, SCATTER_BUFFER_MAX_BYTES, SCATTER_CHUNK_BYTES,
        SCATTER_CHUNK_MIN_LINKS, SCATTER_DOCS, SORTED_DD_MIN_LINKS,
        SORTED_DD_WARPS,
        dd_gather.CHUNK,
    )  # fmt: skip
    plan = _bplans.get(key)
    if plan is None:
        Qc, Dc = (Q, D) if views is None else (view_as_canonical(Q, views.q), view_as_canonical(D, views.d))
        Nq, Lq, Bd, K, Ld, dim = dims(Qc, Dc, rg)
        if Nq == 0 or K == 0 or Lq == 0 or Ld == 0:
            return key, None
        plan = _backward_plan(grad, Qc, Dc, normalize, deterministic, rg, _segs(Qc, Dc, rg))
        if len(_bplans) >= _MAX_PLANS:
            _bplans.clear()
        _bplans[key] = plan
    return key, plan


def _run_backward(
    plan: _BackwardPlan, grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, normalize: bool, rg: Ragged | None,
    norms: tuple[Tensor, Tensor] | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`backward` with its plan: the allocations and launches."""
    if plan.grad_contiguous:
        grad = grad.contiguous()
    if normalize:
        inv_q, inv_d = normalize_kernels.inverse_norms(Q, D) if norms is None else norms
    else:
        inv_q = inv_d = grad  # unused pointers
    segs = _seg_tensors(Q, rg)
    nw = plan.num_warps
    if plan.dq_scatter:
        dQ = torch.zeros(Q.shape, dtype=torch.float32, device=Q.device)
        grid, ints, constexprs = plan.dq_sc
        _bwd_scatter(grid, (grad, argmax, dQ, D, inv_d, *segs, grad, grad), ints, constexprs, nw)
    else:
        dQ = torch.empty(Q.shape, dtype=plan.dq_dtype, device=Q.device)
    # (the split walk's fp32 slices, every element written by the gather)
    dq_out = (
        dQ if plan.dq_splits == 1 else torch.empty((plan.dq_splits, *Q.shape), dtype=torch.float32, device=Q.device)
    )
    if plan.dd_owned or plan.dd_sorted:
        gd = torch.empty(D.shape, dtype=plan.dd_dtype, device=D.device)
    elif plan.dd_chunks:  # dD, and the first chunk's fp32 buffer: the front of dD's storage or one of its own
        gd_chunked = torch.empty(D.shape, dtype=D.dtype, device=D.device)
        own = None
        if not plan.dd_chunks[0][2]:
            own = torch.zeros(plan.dd_tail * D.shape[-2] * D.shape[-1], dtype=torch.float32, device=D.device)
        gd = own if own is not None else _front_buffer(gd_chunked, plan.dd_chunks[0]).zero_()
    else:  # the atomics' fp32 buffer, zeroed before the launch that adds into it (main, or its own after it)
        gd = torch.zeros(D.shape, dtype=torch.float32, device=D.device) if plan.dd_sc is None else None
    q_off, q_order = csr(rg.pair_q, plan.n_queries) if plan.q_csr else (grad, grad)  # (else unused)
    d_off, d_order = csr(rg.pair_d, plan.n_docs) if plan.d_csr else (grad, grad)
    grid, ints, constexprs = plan.main
    tensors = None
    if grid:
        tensors = (grad, argmax, Q, D, inv_q, inv_d, dq_out, grad if gd is None else gd, *segs, q_off, q_order, d_off,
                   d_order)  # fmt: skip
        foreign = (grad, argmax, Q, D) if rg is None and not normalize else (grad, argmax, Q, D, inv_q, inv_d, *segs)
        _bwd(grid, tensors, ints, constexprs, nw, 3, plan.launches, foreign=foreign)
    if plan.dq_splits > 1:  # (in slice order, in fp32, rounded once into dQ's dtype)
        n = dQ.numel()
        _sum_slices(cdiv(n, slices.BLOCK), (dq_out, dQ), (n, plan.dq_splits), dict(BLOCK=slices.BLOCK), 4, 3,
                    plan.sum_launches, foreign=())  # fmt: skip
    if plan.dd_chunks:
        gd = _chunked_scatter(plan, gd_chunked, own, grad, argmax, Q, inv_q, segs)
    if plan.dd_sorted:
        _sorted_dd(plan.dd_sorted, grad, Q, D, inv_q, argmax, gd)
    if gd is None:
        # (after the gather, whose argmax reads are still in L2 for the scatter: H100, 256x256 Ld300 training step
        # 1.079 ms with the scatter first, 1.060 ms after, in-process A/B against 50d67b8 at 1.041 / 1.061 ms)
        gd = torch.zeros(D.shape, dtype=torch.float32, device=D.device)
        grid, ints, constexprs = plan.dd_sc
        _bwd_scatter(grid, (grad, argmax, Q, gd, inv_q, *segs, grad, grad), ints, constexprs, nw)

    # The transients die before the casts below: a training step's peak memory is the cast of dD, its fp32 buffer
    # and its result side by side, and the split walk's slices (fp32, Q's size times the slices) or the pair lists'
    # indexes on top of those would raise it (H100, peak of the bench's step: varlen 64x256 28.9 -> 27.6 MiB, cross
    # 128x128 Lq23 Ld333 36.3 -> 33.4 MiB).
    tensors = dq_out = q_off = q_order = d_off = d_order = None
    if normalize and not (plan.project_q and plan.project_d):  # the chain rule for the rest, in the inputs' dtypes
        pq, pd = normalize_kernels.project(None if plan.project_q else dQ, Q, None if plan.project_d else gd, D)
        dQ, gd = (dQ if pq is None else pq), (gd if pd is None else pd)
    if gd.dtype != D.dtype:
        gd = gd.to(D.dtype)  # (the fp32 buffer goes with the rebinding, before dQ's cast)
    if dQ.dtype != Q.dtype:
        dQ = dQ.to(Q.dtype)
    return dQ, gd
