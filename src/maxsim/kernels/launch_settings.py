"""The launch planning's tunable bounds, each with the measurements that set it.

Read at call time as ``launch_settings.NAME`` by :mod:`.launch_forward` and :mod:`.launch_backward`, whose plan keys
hold every one of them: setting one (``tools/knobs.py``, the tests) takes effect at the next call, with no stale
plan. GPU times are medians of the device tool's H100 / H200 (docs/performance.md names each run).
"""

from __future__ import annotations

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
# Those atomics, over all documents of a dense cross product in 16-bit tokens without normalize, are followed in
# their launch by programs that cast the fp32 sums into dD, each waiting for its document group's atomics
# (backward.py's _scatter_and_cast): the backward is its zero-fill and one launch, not a cast launch after it too,
# where the atomics are at most this many programs (0: never). Each of them then releases a count, which waits for
# its atomics to land: GPU time against a launch of host time. H200 (docs/performance.md v154), backward GPU time
# (main launch + cast launch -> main launch), then the training step's median (minimum) in-process, on a host where
# those steps are host-bound but the last: 64x64 Lq23 Ld333 dim 96 (6144 atomics programs) 16.0 + 3.8 -> 22.4 us,
# 1.10x (0.86x); 100x100 Lq32 Ld180 dim 96 (20000) 48.2 + 3.4 -> 50.5 us, 0.90x (1.01x); 32x32 Lq32 Ld180 dim 1024
# (23040) 42.4 + 8.6 -> 54.8 us, 0.91x (1.35x); 32x32 Lq1024 Ld1024 (65536, GPU-bound) 172.8 + 6.5 -> 193.3 us,
# 1.02x: not fused. Nor is it beside a split dQ walk, whose slices would then be alive with dD (128x128 Lq23 Ld333:
# peak 32.7 -> 35.6 MiB).
FUSED_CAST_MAX_PROGRAMS = 1 << 15
# A split dQ walk (DQ_SPLIT_*) of at most FUSED_DQ_SUM_MAX_SLICES slices beside those atomics, over all documents: the
# last program of each query-token block to finish sums the block's slices into dQ (backward.py's _dq_program,
# SUM_LAST; counters after dD's elements in the atomics' zeroed buffer), so no slice-sum launch follows (0: never).
# That program reads the slices one after another, so its sum is on the launch's tail. H200 (docs/performance.md
# v155), backward GPU time, main + slice-sum launch -> main launch: varlen 64x256 Lq8-32 Ld20-1000 training (3 slices)
# 64.9 + 1.4 -> 65.7 us; cross 128x128 Lq23 Ld333 (2) 62.5 + 2.1 -> 65.1; cross 7x1000 Lq23 Ld333 dim 96 (19)
# 59.2 + 2.0 -> 67.7, hence the bound.
FUSED_DQ_SUM_MAX_SLICES = 4
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
# Query tokens a program of the fast cross product's dQ gather and dD atomics takes (BackwardConfig.BT) for tokens of
# more than configs.UNROLLED_MAX_DIM dims: a block of 4 rows of up to 1024 dims instead of 16 (configs.backward_config,
# at most 2048 // padded dim, 16 at least), the atomics' programs 182 registers at 512 padded dims with 16 (ptxas).
# H200, backward GPU time, .devdata sweep (docs/performance.md v128), BT 16 -> 8 -> 4, ms: cross 128x128 Lq32 Ld180
# d384 0.413 -> 0.365 -> 0.336, 64x64 Ld300 d768 0.311 -> 0.248 -> 0.225, 32x32 Ld180 d1024 0.114 -> 0.071 -> 0.065,
# 8x64 Lq256 Ld512 d1024 0.524 -> 0.455 -> 0.420, fp32 32x32 Ld180 d384 0.058 -> 0.043 -> 0.032, fp32 64x64 Lq200
# Ld300 d512 0.868 -> 0.704 -> 0.658. Not where owners take dD: the deterministic backward was mixed at 4 (0.83x fp32
# Lq200 d512, 0.90x d384, but 1.03-1.11x d768, d1024, long queries, fp32 d384), candidates and pairs slower (1.07x;
# fp32 candidates 0.88x, not taken); nor at 256 dims and fewer (dim 128, 256x256 Ld300: 0.425 -> 0.447 -> 0.582).
WIDE_ATOMICS_BT = 4
# A cross product's dQ gather of at most one program a multiprocessor beside the dD atomics (no owner in the launch)
# is bound by each program's chain of loads over its pairs: it and the atomics take blocks of FEW_GATHER_BT query
# tokens instead (0: not), 2-4x the programs, and a query of 23 tokens pads 1 row where 16-token blocks padded 9. H200,
# backward GPU time, tools/knobs.py (docs/performance.md v130), 16 -> 8 tokens, us: cross 64x64 Lq23 Ld333 d96
# 20.3 -> 16.0, 7x1000 Lq23 d96 79.4 -> 60.7, 64x64 Lq32 Ld1024 36.1 -> 29.2, varlen 48x96 Lq5-23 d96 35.2 -> 19.7;
# 4 tokens slower (64x64 Lq23 d96 25.1, varlen 48x96 28.9). Not beside owners (candidates 32x7 Lq23 d96 8.4 -> 9.7,
# pairs 256 d48 6.6 -> 9.0, cross 48x48 d48 28.8 -> 32.2) nor for more programs (cross 128x128 Lq23, 256 of them:
# 63.0 -> 65.8).
FEW_GATHER_BT = 8
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
# Pairs a short pair list's scanning dQ walk (PAIR_SCAN) picks out and gathers per step (1: one at a time), for
# query rows of up to PAIR_SCAN_DQ_UNROLL_MAX_DIM dims (wider ones spill: ptxas, bf16 at 256 dims 0 -> 24 bytes,
# at 1024 dims 8 -> 888; at 64 and 128 dims the same registers).
PAIR_SCAN_DQ_UNROLL = 4
PAIR_SCAN_DQ_UNROLL_MAX_DIM = 128
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
# ... but a scores-only forward (inference) reads each of those tiles once: there the pre-pass is a second read of D
# and a launch more of host time, and the tiles' own sums of squares cost less, except for blocks of at most 32 rows
# in the once-read table loop (ONCE_READ_TABLE_L2), whose tiles carry half the product of a 64-row block's, and
# launches of fewer programs than multiprocessors (the deep pipeline, documents in chunks), whose tiles' latency the
# squares lengthen. H200, normalize=True, in one process against the pre-pass for all (tools/ab_steps.py infer
# --normalize, benchmarks/results/partial/h200-ab-masked-normalized.txt): candidates 64x20 Lq64 Ld300 (the
# table, 64 rows) 89.1 -> 60.0 us, 32x100 Lq48 Ld256 137.6 -> 101.6, 128x7 Lq32 Ld1024 dim 64 72.9 -> 43.8, 16x100
# Lq23 Ld333 dim 48 46.7 -> 30.4, 32x50 Lq32 Ld180 56.4 -> 50.9, 32x7 Lq23 Ld333 dim 48 55.3 -> 16.9 (host-bound),
# pairs 1000 Lq23 Ld333 dim 96 57.9 -> 51.8; the sums everywhere lost on candidates 32x100 Lq32 Ld256 (the table, 32
# rows: 118.4 -> 125.0 us, tools/knobs.py) and pairs 64 Lq32 Ld2048 (64 programs: 35.6 -> 63.2).
# 1: the pre-pass for every forward of unshared documents.
PRENORM_UNSHARED_SCORES = 0
# A scores-only forward of thin row blocks (at most DOC_ROWS_MAX_ROWS query rows, one dim chunk, 16-bit tokens) against
# tiles of at least DOC_ROWS_MIN_BLOCK_N tokens puts the document's tokens in the MMA's rows and the query rows in its
# columns (forward.py's DOC_ROWS). With normalize=True a token's inverse norm then scales a row of the product, in the
# layout in which its squares were summed, where the other orientation moved every tile's norms through shared memory
# into the columns' layout (or read D twice, for the pre-pass that the thin once-read table loop took instead). 1: the
# normalized forwards that sum their tiles' squares; 2: every eligible forward. Found with standalone prototypes
# (tools/orientation_probe.py, benchmarks/results/partial/h200-orientation-prototypes.txt). H200, in-process, off -> 1
# with normalize=True (tools/knobs.py, h200-knobs-doc-rows.txt's call A, docs/performance.md v132), us: 1x1000 Lq32
# Ld300 46.1 -> 37.7, 1x1000 Ld1024 165.9 -> 81.7, 1x10000 Ld300 439.8 -> 196.0, candidates 32x100 Ld256 118.3 -> 64.7,
# candidates 32x50 Ld180 51.2 -> 39.7, 1x4000 Ld1024 dim 64 (128-token tiles) 283.7 -> 140.3, 1x1000 Lq23 Ld333 dim 96
# 51.4 -> 40.2, pairs 1000 dim 96 52.3 -> 41.5, 1x64 Ld2048 (the deep pipeline) 62.0 -> 23.7; plain, off -> 2: 1x1000
# Ld300 30.1 -> 28.3, candidates 32x50 32.1 -> 29.3, 1x1000 Lq23 dim 96 30.3 -> 27.6, pairs 1000 dim 96 31.3 -> 28.2,
# candidates 32x100 63.9 -> 62.3, 1x1000 Ld1024 74.6 -> 73.9, 1x10000 187.4 -> 184.6. Not with 32-token tiles (the MMA's
# rows then fill half a warpgroup's 64), normalized: 1x1000 Ld1024 dim 48 44.4 -> 70.1, candidates 16x100 dim 48 30.8 ->
# 40.6, 128x7 dim 64 43.8 -> 69.4, pair list 32x100 179.3 -> 230.5, the 33-64-row blocks 3.7-3.9x slower (1x5000 Lq64
# Ld180, candidates 64x20 Lq64, 32x100 Lq48); plain, 64-row blocks 1.17-1.21x, 128x7 dim 64 1.02x.
DOC_ROWS = 2
DOC_ROWS_MAX_ROWS = 32
DOC_ROWS_MIN_BLOCK_N = 64
# Normalized forwards that sum their tiles' squares take DOC_ROWS for blocks of up to DOC_ROWS_SUMS_MAX_ROWS rows too,
# the once-read scans of 33-64-row blocks at 128 dims with their tiles widened from 32 tokens to DOC_ROWS_MIN_BLOCK_N
# (launch_forward.widened_for_doc_rows). H200, in-process, normalize=True, off -> DOC_ROWS with 64-token tiles
# (h200-knobs-doc-rows.txt, call B's "wide64"), us: candidates 64x20 Lq64 Ld300 60.4 -> 44.4, 32x100 Lq48 Ld256 102.7 ->
# 75.1, 1x5000 Lq64 Ld180 113.5 -> 84.7. Not plain (those three 1.30-1.35x slower with 64-token tiles), nor narrower
# tokens (dim 48 and 64 in 64-token tiles, 32-row blocks: 1.26-1.48x slower). With a document mask too, those blocks run
# the pipelined loop of configs.forward_config's tiles (64 tokens, in DOC_ROWS) instead of the stream, in which the
# mask's select cost more: H200, masked and normalized, stream in DOC_ROWS / stream as before / pipelined loop in
# DOC_ROWS (h200-knobs-doc-rows.txt, call D), us: 1x5000 Lq64 Ld180 158.7 / 141.4 / 131.5, candidates 64x20 Lq64 64.2 /
# 64.1 / 60.5, 32x100 Lq48 127.4 / 118.3 / 105.0 (32-row blocks lose in the pipelined loop: 1x1000 Ld300 40.3 / 53.1 /
# 111.0).
DOC_ROWS_SUMS_MAX_ROWS = 64
# Scores-only forwards of thin blocks that run the launch table's own tiles (no once-read scan: pair lists, small
# candidate sets, a query against few documents), 32 tokens at 128 dims, take DOC_ROWS_MIN_BLOCK_N-token tiles to run
# in DOC_ROWS (launch_forward.widened_thin_for_doc_rows): 1 normalized ones, 2 all. H200, in-process (tools/knobs.py,
# h200-knobs-doc-rows.txt's calls F and G), us, normalized, 0 -> 1: pair list 32x100 Lq32 Ld256 179.7 -> 65.2, skewed
# pair list 32x100 pool 2048 142.7 -> 57.0, candidates 7x7 Lq23 Ld333 dim 96 20.5 -> 11.0; plain, 1 -> 2: 65.0 ->
# 63.1, 44.9 -> 40.3, 11.5 -> 9.8 (candidates 32x100, a once-read scan, 1.00x in both).
DOC_ROWS_WIDEN_THIN = 2
# How much faster one-document programs run than a persistent plan of one program per multiprocessor counts them
# (two stay resident; see forward). Fitted to the H100 measurements there: any value in (1.13, 1.8) orders them.
ONE_DOC_GAIN = 1.3
# The long queries' scores-only row blocks (configs.scores_only_config; not normalized) walk documents persistently
# only where a document is at most this many tiles; a longer one amortizes its program's query load and pipeline
# fill itself, and the walk's own cost shows. H200, in-process (docs/performance.md v142), one program a document
# -> persistent, by tiles of 64 tokens: 3 tiles 0.77x, 4 0.83x, 5 0.84x, 6 0.92x, 7 0.95x, 8 0.93-0.98x, 10 1.03x,
# 12 1.01x, 16 1.08x.
LONG_QUERY_PERSIST_MAX_TILES = 8
# Document tiles that one program alone reads (one thin block of query rows against shared documents, or each
# query's own candidates), 16-bit, one dim chunk, are loaded into registers one tile ahead with an
# evict-first hint (forward.py's STREAM_D) instead of by the pipeliner's asynchronous copies, which dropped it:
# the scan then replaces its own lines in the L2, not the lines other kernels left there (dirty ones cost a
# write-back in the middle of the scan). The register loop sustains a little less bandwidth than the pipelined one,
# so this pays where the scan's bytes are between STREAM_L2_RANGE times the L2's size. H100 under do_bench's flush
# (which leaves the L2 dirty), in-process (docs/performance.md v38): 1x1000 Lq32 Ld300 42.0 -> 36.8 us, candidates
# 32x50 Ld180 39.9 -> 37.8, candidates 32x100 Ld256 85.8 -> 83.9, 1x1000 Ld1024 dim 48 49.3 -> 44.7, 1x1000 Ld1024
# 102.0 -> 100.7; beyond: 1x4000 Ld1024 dim 64 (524 MB) 181.4 -> 187.7, 1x10000 Ld300 (768 MB) 264.2 -> 271.2;
# below: candidates 32x7 dim 48 (7 MB) 10.1 -> 11.1; 256-row blocks (7x1000 dim 96, 8 queries packed) 60.0 -> 68.8.
# Training forwards (the argmax loop) keep the pipelined loop: GPU time of the forward, candidates 64x32 Ld180
# 42.7 -> 43.6 us, pairs 512 Ld300 23.0 -> 25.1 us, candidates 256x16 Ld300 124.4 -> 126.9 us.
# With a document mask (v39: the mask of a tile is loaded a tile ahead of its tokens, whose loads it predicated
# until v131): 1x1000 Ld300 40.2 -> 38.2 us, candidates 32x50 40.5 -> 37.8, 32x100 86.0 -> 79.8 (prefix masks), but
# dim 48 in 32-token tiles 48.9 -> 60.2 (a tile's work too short to hide the mask's latency), so narrow masked
# scans did not stream until v133. Its mask bits (STREAM_MASK_BITS) took them 0.64-1.00x (H200, in-process,
# h200-knobs-mask-bits.txt's call A, all-true masks, us, pipelined loop -> stream with bits: candidates 16x100 Lq23
# Ld333 dim 48 43.4 -> 27.6, 128x7 Ld1024 dim 64 48.7 -> 40.1, 1x1000 Ld1024 dim 48 41.4 -> 37.1, 1x4000 Ld1024 dim
# 64 139.9 -> 139.1, 16x2000 Ld512 dim 64 339.8 -> 340.7): masked scans stream at any width. A query's own
# documents stream for queries of up to
# STREAM_UNSHARED_MAX_ROWS rows (33-64 tokens: 32-token tiles, configs.streaming_config), shared documents for
# STREAM_SHARED_MAX_ROWS. H100,
# in-process (`.devdata` sweep, docs/performance.md v49): candidates 64x20 Lq64 Ld300 53.2 -> 45.4 us, 32x100 Lq48
# Ld256 95.9 -> 82.2, 16x100 Lq64 Ld512 dim 64 60.5 -> 45.1, but pairs 1000 Lq64 Ld333 dim 96 42.0 -> 43.6; one
# query of 64 rows against shared documents gains less (1x1000 Ld300 41.2 -> 40.7, 1x5000 Ld180 93.0 -> 91.6, 2
# queries of 32 packed 41.7 -> 40.7; out of the byte range, where the rule does not stream, 1x2000 Lq48 Ld1024 179 ->
# 189), H200 (v66, tools/knobs.py): 1x5000 Ld180 78.4 -> 76.2 us, so shared documents stream for 64 rows too.
STREAM_UNSHARED_MAX_ROWS = 64
STREAM_SHARED_MAX_ROWS = 64
STREAM_ONCE_READ = 1
STREAM_L2_RANGE = (0.5, 7.0)
# A masked stream's tiles of at most 64 tokens carry their masks as bits (forward.py's MASK_BITS, _tile_bits), not
# as a flag a column: 64-row blocks in 32-token tiles took 83 registers instead of 112 (6 programs a multiprocessor
# instead of 4). H200, in-process (tools/knobs.py infer --masked, h200-knobs-mask-bits.txt's calls A and C), us,
# flags -> bits: 1x5000 Lq64 Ld180 97.7 -> 78.9 (unmasked 67.1), candidates 64x20 Lq64 44.9 -> 39.4, 32x100 Lq48
# 82.8 -> 69.7; 32-row blocks 0.98-1.01x, normalized 0.94-1.00x (1x1000 Ld1024 101.2 -> 94.8).
STREAM_MASK_BITS = 1
# The once-read table loop's tile loads carry the stream's evict-first hint (forward.py's EVICT_D) for scans of at
# most STREAM_L2_RANGE's upper bound of L2 sizes. Triton 3.6 drops it from the pipeliner's asynchronous copies (its
# PTX is the same either way); Triton 3.9 keeps it (`cp.async.cg.shared.global.L2::cache_hint`) where it writes PTX
# ISA 9.4, with its wheel's own ptxas (CUDA 13.4), not with an older one. H200, Triton 3.9 and that ptxas, in-process
# (tools/knobs.py infer, 9 rounds, docs/performance.md's run 89), hinted -> not: candidates 64x20 Lq64 Ld300 34.2 ->
# 37.6 us, 32x100 Ld256 60.8 -> 61.2, the other tables 0.99-1.01x; past the range 1x10000 Ld300 189.8 -> 181.4 (so
# not there). STREAM_AS_TABLE: the scans the rule would stream (dense documents) run that hinted table instead;
# same run, stream -> table: candidates 16x100 Lq23 Ld333 dim 48 26.8 -> 24.0 us, the others 0.99-1.02x (1x1000
# Ld300 28.3 -> 28.7, candidates 32x50 28.6 -> 28.9); on Triton 3.9 with CUDA 13.0's ptxas (no hint) 1.07-1.15x
# slower. Off: the gain is one row's, on one toolchain.
ONCE_READ_EVICT = 1
STREAM_AS_TABLE = 0
# The pipelined loops (launch_forward.mask_bits) carry their masks a tile ahead: as bits for scores (PIPE_MASK_BITS =
# 1: the flags of a 64-token tile had taken a byte load, its address and two compares a column in every thread, in
# front of the select), as the next tile's loaded flags with the argmax (PIPE_MASK_BITS_ARGMAX = 2, reduced to bits
# at the tile: the argmax's loops sit at 255 registers, where bits spilled more, 28 bytes against 12 in 256-row blocks
# of 96 dims, 12 against none for 128-row blocks of 1024-token queries), in row blocks of PIPE_MASK_BITS_MIN_ROWS
# rows or more. Read in the tile's own iteration, bits had cost 1.10-1.52x (v133); read two tiles ahead, Triton's
# pipeliner staged no copies at all. H200, in-process (tools/knobs.py --masked, all-true masks;
# h200-knobs-pipe-bits.txt's calls K-M), us, flags -> v134: 128x128 Lq32 Ld300 151.0 -> 118.9, ColPali 1x500 350.5
# -> 273.8, 7x1000 Lq23 dim 96 86.6 -> 74.1; normalized: 128x128 176.5 -> 152.0, 1x5000 Lq64 Ld180 131.6 -> 124.4,
# candidates 64x20 Lq64 60.6 -> 54.2, 32x100 Lq48 104.5 -> 96.0; training steps 256x256 Ld300 1138.6 -> 1029.2 (bits
# for the argmax too: 1108, calls F and I), ColPali-sized 32x32 Lq1024 906.5 -> 865.9.
# Scores too since v140 (PIPE_MASK_BITS = 2), where a tile whose bits are all set skips the select (v138's branch,
# forward._scan_tile): with bits reduced in their own load's iteration the branch held that reduction, and the load's
# latency, in front of the MMA (ncu, 128x128 masked: 19 % of the warps' samples on the flags), and the skip ran 1.05-
# 1.16x slower than the select (h200-run69.txt, call 1). H200, in-process, v139's code, PIPE_MASK_BITS 1 -> 2
# (tools/knobs.py infer --masked KIND, h200-run69.txt's call 3), us: all kept 128x128 Lq32 Ld300 107.6 -> 96.4,
# ColPali 1x500 277.8 -> 252.1, corpus scan 32x65536 10060 -> 8535, 16x2000 Ld512 dim 64 233.3 -> 178.9, 3x777 Lq100
# dim 96 88.6 -> 74.9 (0.77-0.91x); kept prefixes 0.84-0.94x; prefixes with 10 % holes 0.94-0.99x; normalized, all
# kept, 0.91-0.98x.
# Thin blocks (<= 32 rows) too since v136; in persistent programs under a cap of PIPE_MASK_BITS_THIN_MAXNREG
# registers: the flags ahead took the argmax's persistent walk from 96 to 106 registers, a program fewer a
# multiprocessor, and fit 96 without spills. H200, in-process (h200-knobs-thin-bits.txt, calls B and C), forward GPU
# time of 10 training steps, flags -> uncapped -> capped, us: candidates 256x16 Ld300 1109 -> 1521 -> 978, 64x32
# Ld180 402 -> 521 -> 353; one document a program (pairs: 72 registers, no cap: a cap made it 76 and slower) pairs
# 512 Ld300 199 -> 176, 1000 Ld180 241 -> 217 (capped 255); inference scans 1x10000 Ld300 202.8 -> 185.0 us.
PIPE_MASK_BITS = 2
PIPE_MASK_BITS_ARGMAX = 2
PIPE_MASK_BITS_MIN_ROWS = 0
PIPE_MASK_BITS_THIN_MAXNREG = 96
# A register cap for pipelined DOC_ROWS programs that sum their tiles' squares, one document each (0: none): 64-row
# blocks of normalized scans took 236-242 registers there (164 in persistent walks), two programs a multiprocessor,
# and 165-167 without spills under this cap, three. H200, in-process (h200-knobs-thin-bits.txt, call C), masked and
# normalized 1x5000 Lq64 Ld180 124.3 -> 108.8 us (cap 152: 109.9); persistent rows unchanged.
# Off since v137: with the query's inverse norms computed before the tile loop these variants take 125-128 registers
# uncapped (4 programs a multiprocessor) and 159-167 under the cap; H200, in-process (h200-ab-query-norms.txt, call
# 1), the cap of 168 against none: masked and normalized 1x5000 Lq64 Ld180 103.0 against 101.3 us, candidates
# 32x100 Ld256 72.4 against 65.3, 1x1000 Ld1024 86.8 against 82.1.
DOC_ROWS_SUMS_MAXNREG = 0
# Per card (a substring of its name, first match): the L2 sizes beyond which a dense unmasked once-read scan of
# 16-bit tokens of 65-128 dims (one chunk of 128) runs the table's pipelined loop with
# configs.once_read_config's tiles instead of the stream, whatever STREAM_L2_RANGE says. On an H200 the stream's one
# register tile ahead falls behind the asynchronous copies' stages from about twice the L2 (in-process, stream ->
# table, docs/performance.md v73): candidates 32x75 Ld256 (2.5 L2) 53.6 -> 51.9 us, 32x100 (3.3) 66.2 -> 63.1,
# 1x1000 Ld1024 (4.2) 75.6 -> 74.1, 1x5000 Lq64 Ld180 (3.7) 75.7 -> 69.8, candidates 64x40 Lq64 (3.1) 68.3 -> 63.1;
# 1x2000 Ld300 (2.4) 52.4 -> 52.3; below, the stream wins: 1x1500 Ld300 (1.8) 41.7 against 44.1, candidates 64x20
# Lq64 (1.6) 37.5 against 41.1. Other cards (H100: v38's stream-over-table measurements) keep STREAM_L2_RANGE.
# ONCE_READ_TABLE = 0 turns the rule off (tools/knobs.py). With a document mask, normalized blocks of at most 32 rows
# take the table too (ONCE_READ_TABLE_MASKED_SUMS): H200, in-process (h200-knobs-mask-bits.txt's call B), us, stream
# with mask bits -> table: candidates 32x100 Lq32 Ld256 86.8 -> 72.0, 1x1000 Ld1024 95.1 -> 86.3, 1x10000 Ld300 and
# 1x4000 Ld1024 dim 64 1.00x; not plain ones (candidates 32x100 63.2 -> 67.5, the rest 0.99-1.01x) nor 64-row blocks
# (plain 1.26-1.44x slower, normalized 1.12-1.27x). Again after v137 (ONCE_READ_TABLE_MASKED_SUMS_MAX_ROWS = 64 against
# 32, h200-knobs-after-v137.txt, call 5: the persistent walk with mask bits against the one-document loop), masked
# and normalized 64-row blocks 1.15-1.37x slower: 1x5000 Lq64 Ld180 123.6 against 100.7 us, 1x2000 Ld300 86.7 / 63.4.
ONCE_READ_TABLE_L2: tuple[tuple[str, float], ...] = (("H200", 2.0),)
ONCE_READ_TABLE = 1
ONCE_READ_TABLE_MASKED_SUMS = 1
ONCE_READ_TABLE_MASKED_SUMS_MAX_ROWS = 32
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
# Queries shorter than their row slot (TQ, the next power of two) packed back to back into a shared-document block's
# rows at their own length (forward.py's PACKED) where that takes fewer blocks: 23-token queries 11 to a 256-row
# block instead of 8 in 32-row slots, so each tile of a document is multiplied by 253 live rows instead of 184.
# Not where the launch in slots is at most a wave (see launch_forward.packed_queries). Whether to pack is a boolean
# of the shapes (a constexpr, as PERSIST): at most one more compiled variant per query length, once. 1: 16-bit tokens,
# where it was measured (docs/performance.md v129; wide tokens v130: H200, GPU time, slots -> packed, cross 128x128
# Lq23 Ld300 d384 argmax forward 407 -> 308 us, 64x64 d768 157 -> 129, 32x256 Ld180 d1024 245 -> 198, though their
# packed argmax forwards spill more, ptxas 768 dims 88 -> 172 bytes); 2: fp32 tokens too, computed the same
# (tests/test_packed_rows.py) but not faster where timed (the fp32 table's 64-row blocks: 2 queries of 23 tokens
# either way; cross 128x128 Lq23 Ld333 and 64x64 d96 1.00x).
PACK_ROWS = 1
# Per card (a substring of its name, first match): scores-only forwards of packed 256-row blocks against shared
# documents of at most this many L2 sizes run 128-row blocks in 4 warps, two programs a multiprocessor
# (configs.half_packed_config), where one 8-warp program waited for each tile's MMA with all its warps. H200, in-process
# (tools/knobs.py, h200-run69.txt's call 5), 256 -> 128 rows, us: cross 128x128 Lq32 Ld300 91.2 -> 86.3 (masked
# 96.3 -> 90.6), 200x200 Ld128 102.2 -> 91.2, 48x48 Lq23 dim 96 22.5 -> 19.2, 16x2000 Ld512 dim 64 (131 MB, 2.6 L2)
# 169.2 -> 157.2, 7x1000 Lq23 dim 96 56.9 -> 55.7; but the corpus scan 32x65536 Ld256 (1 GB, 20 L2: each block reads
# the documents from HBM, twice the blocks twice the reads) 8299 -> 8461 (masked 8686 -> 9104). Nor where the 256 rows
# are one block (7x1000 Lq23 dim 96, normalized: the second block's norms pre-pass, 85.1 -> 98.2 us, call 6), nor
# training forwards: the argmax's 128-row blocks in 4 warps spill (36-80 bytes, ptxas) and ran slower (call 9, forward
# GPU time of 10 calls: 256x256 Ld300 452.8 -> 470.1 us, 128x128 Lq23 105.5 -> 113.5). Other cards keep 256 rows (not
# measured).
PACKED_SCORES_HALF_L2: tuple[tuple[str, float], ...] = (("H200", 4.0),)
