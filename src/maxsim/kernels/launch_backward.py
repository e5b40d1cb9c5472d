"""The backward's launches: dQ and dD from the saved argmax, a plan per signature (as the forward's, see
:mod:`.launch_forward`), then each call's allocations and launches. Which kernels run: the dQ gather (or, for a long
pair list, atomics), and dD by the owner programs, fp32 atomics (whole, or a chunk of documents at a time) or the
sorted gather (``backward="deterministic"`` of large cross products); ``normalize=True`` chains through the
normalization in those programs where they hold whole rows, else in one launch after.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from ..layout import Ragged, Views, dims, view_as_canonical
from . import csr as csr_kernel
from . import dd_chunks, dd_gather, device_info, launcher, slices
from . import launch_settings as settings
from . import normalize as normalize_kernels
from .backward import FUSED_CAST_BLOCK, FUSED_CAST_STEPS, maxsim_bwd_kernel, maxsim_bwd_scatter_kernel
from .configs import BackwardConfig, backward_config, wide
from .dd_chunks import chunk_plan, chunk_steps
from .launch_args import (
    DENSE,
    MAX_PLANS,
    OFFSETS,
    Segs,
    document_strides,
    dot_precision,
    last_dim_contiguous,
    packed_sides,
    query_strides,
    ragged_plan_key,
    segment_pointers,
    segments_of,
    shape_key,
    upcast,
    with_rows,
)
from .launcher import Launcher
from .sizes import cdiv

_bwd = Launcher(maxsim_bwd_kernel)
_bwd_scatter = Launcher(maxsim_bwd_scatter_kernel)
_csr = Launcher(csr_kernel.csr_count_kernel)
_link_keys = Launcher(dd_gather.link_keys_kernel)
_dd_gather = Launcher(dd_gather.dd_gather_kernel)
_sum_slices = Launcher(slices.sum_slices_kernel)
_cast_clear = Launcher(dd_chunks.cast_clear_kernel)
_FUSED_CAST_BLOCK = dd_chunks.FUSED_BLOCK  # (dd_chunks is also a plan's name below)
# Where the packed queries' row count is among the integers of the main launch and of the scatter launches (the
# documents' two on; the main launch's Q.numel() third from its end): see launch_args.with_rows.
MAIN_ROWS_AT, SCATTER_ROWS_AT = 9, 6


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


class BackwardPlan(NamedTuple):
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
    packed: tuple[bool, bool]  # Q, D packed rows: their counts (and Q's elements) in the ints are each call's
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
    plain: bool  # dense, raw tokens, the main launch alone into dQ and dD allocated before it: _run_plain
    cast_counters: int  # > 0: the main launch casts its atomics' sums into dD (FUSED_CAST), this many counters
    sum_counters: int  # > 0: the main launch sums the split walk's slices into dQ (FUSED_DQ_SUM_*), this many counters
    lean: dict  # a plain plan's main launch by its short key (Launcher.lean_entry), for _run_plain's repeats


plans: dict[tuple, BackwardPlan] = {}


def register_selector(doc_walk: bool, normalize: bool, cfg: BackwardConfig, dtype: torch.dtype) -> bool:
    """Whether the dD owner builds its selector in the MMA's registers (``REG_SEL``) instead of passing it through
    shared memory. H200, backward GPU time (docs/performance.md v81): a document walk loads its query's argmax once
    for all its token blocks, and gains with raw tokens (candidates 64x7 Lq23 Ld333 dim 48 9.4 -> 8.1 us, 256x16 Ld300
    106.5 -> 99.3, 128x8 Lq64 Ld256 34.9 -> 31.8, pairs 512 17.7 -> 16.5) but not normalized ones (1.02-1.06x); a walk
    over the queries loads the argmax per step, in that layout 8 tokens a thread against 1, which pays at 128 dims
    and at most 32 tokens (cross products 64x64 Ld128 40.5 -> 35.9 us, 32x32 Ld80 17.3 -> 16.8, normalized 0.94-0.97x)
    but not at 64 dims (48x48 Lq23 dim 48 29.2 -> 33.5 us) or 64 tokens (16x16 Lq64 Ld512 16.4 -> 17.1). 16-bit
    tokens only (fp32 ones were not measured)."""
    if not settings.REGISTER_SELECTOR or dtype == torch.float32:
        return False
    return not normalize if doc_walk else (cfg.BLOCK_K == 128 and cfg.TQ <= 32)


def shared_owned(Nq: int, Lq: int, K: int, Ld: int, dim: int, cfg: BackwardConfig) -> bool:
    """Whether a fast backward of the cross product owns dD (see SHARED_OWNER_MAX_WORK)."""

    def padded(n: int, block: int) -> int:
        return cdiv(n, block) * block

    rows = Nq * padded(Lq, cfg.TQ)
    return (
        rows <= settings.SHARED_OWNER_MAX_ROWS
        or rows * K * padded(Ld, cfg.BN) * padded(dim, cfg.BLOCK_K) <= settings.SHARED_OWNER_MAX_WORK
    )


def dq_split_count(n_programs: int, K: int, device: torch.device) -> int:
    """Slices of each query's dQ walk over ``K`` pairs when the gather has ``n_programs`` (see DQ_SPLIT_*)."""
    if K < settings.DQ_SPLIT_MIN_K:
        return 1
    want = cdiv(settings.DQ_SPLIT_PROGRAMS_PER_SM * device_info.sm_count(device), n_programs)
    return max(1, min(want, K // settings.DQ_SPLIT_MIN_PAIRS))


def _grad_stride(grad: Tensor) -> int | None:
    """The stride ``s`` at which the kernels read element ``(q, k)`` of the ``[Nq, K]`` upstream gradient, at
    ``(q * K + k) * s`` (None: it must be made contiguous first). ``grad`` is ``[Nq, K]`` or the caller's view of it
    without its unit axes (``Views.out``: ``[Nq]``, ``[K]`` or a scalar), whose flat order is the same."""
    if grad.dim() == 2:
        return grad.stride(1) if grad.stride(0) == grad.stride(1) * grad.shape[1] else None
    return grad.stride(0) if grad.dim() == 1 else 1


def _backward_plan(
    grad: Tensor, Q: Tensor, D: Tensor, normalize: bool, deterministic: bool, rg: Ragged | None, sg: Segs
) -> BackwardPlan:
    Nq, Lq, Bd, K, Ld, dim = dims(Q, D, rg)
    shared = Bd == 1 and not sg.pairs
    cfg = backward_config(Lq, dim, not shared and not sg.pairs, normalize, Q.dtype == torch.float32)
    # dD: documents scored by one query each (candidates) and pair lists take the owner programs, which are then also
    # the fastest (no zeroed fp32 buffer, no atomics, no cast); so does the cross product up to a size (beyond it,
    # atomics, or where asked to be deterministic the owner, and from SORTED_DD_MIN_LINKS on the sorted gather).
    owned_small = shared and shared_owned(Nq, Lq, K, Ld, dim, cfg)
    n_links = Nq * K * Lq
    dense = sg.q_kind == DENSE and sg.d_kind == DENSE
    sorted_dd = deterministic and shared and dense and not owned_small and n_links >= settings.SORTED_DD_MIN_LINKS
    dd_owned = not sorted_dd and (deterministic or not shared or owned_small)
    if shared and not dd_owned and not sorted_dd and wide(dim):
        cfg = replace(cfg, BT=settings.WIDE_ATOMICS_BT)  # (see there)
    n_queries = sg.n_q if sg.q_kind == OFFSETS else Q.shape[0]
    few = settings.FEW_GATHER_BT
    if (
        few
        and shared
        and not dd_owned
        and few < cfg.BT
        and n_queries * cdiv(Lq, cfg.BT) <= device_info.sm_count(Q.device)
    ):
        cfg = replace(cfg, BT=few)  # (see there)
    grad_stride = _grad_stride(grad)
    grad_contiguous = grad_stride is None
    grad_stride = 1 if grad_stride is None else grad_stride
    n_docs = sg.n_d if sg.d_kind == OFFSETS else K
    seg_args = (sg.n_q, sg.rows_q, sg.n_d, sg.rows_d)
    seg_strides = (sg.sqs, sg.sds_b, sg.sds_k, grad_stride)
    kinds = dict(Q_KIND=sg.q_kind, D_KIND=sg.d_kind)
    n_tb = cdiv(Lq, cfg.BT)
    n_pairs = Nq * K  # the [Nq, K] score grid (a pair list: [1, P])
    q_fresh = query_strides(torch.empty(Q.shape, device="meta"))  # a fresh contiguous gradient's strides
    d_fresh = document_strides(torch.empty(D.shape, device="meta"), False)

    def scatter(to_q: bool, q_strides: tuple, d_strides: tuple) -> tuple:
        docs = 1 if to_q else settings.SCATTER_DOCS  # (dD: the grid of all K documents; a chunk's is _scatter_grid's)
        return (
            Nq * cdiv(K, docs) * n_tb if not sg.pairs else n_pairs * n_tb,
            (Nq, K, Lq, Ld, dim, *seg_args, *q_strides, *d_strides, *seg_strides, n_tb, 0, K, 0, 0, 0),
            dict(BT=cfg.BT, DIM_P=cfg.DIM_P, **kinds, PAIR_LIST=sg.pairs, SHARED_DOCS=shared, TO_Q=to_q,
                 NORMALIZE=normalize, DOCS=docs, CAST=False, CAST_BLOCK=_FUSED_CAST_BLOCK),
        )  # fmt: skip

    # A short pair list is scanned by each program instead of indexed (see backward.py): fewer launches.
    scan_q = sg.pairs and n_queries * n_tb * n_pairs <= settings.PAIR_SCAN_MAX_WORK
    # A long pair list's queries recur in any order: atomics into an fp32 buffer, one program per (pair, token
    # block). Walking each query's pairs instead is a chain of dependent index loads per step (latency-bound).
    # Otherwise dQ is a gather, one program per (query, token block), summing over its pairs in order
    # (deterministic), written straight in Q's dtype (fp32 when a normalize projection follows); splitting the pairs
    # over more programs would need a partial-sum buffer of another dtype, i.e. a second variant compiled at a
    # data-dependent moment, which the launch table rules out.
    dq_scatter = sg.pairs and not deterministic and not scan_q
    dq_splits = 1 if sg.pairs else dq_split_count(n_queries * n_tb, K, Q.device)
    ks_len = cdiv(K, dq_splits)
    dq_splits = cdiv(K, ks_len)  # (no empty slice)
    n_dq = 0 if dq_scatter else n_queries * n_tb * dq_splits
    dq_sc = scatter(True, q_fresh, document_strides(D, shared)) if dq_scatter else None

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
    scan_d = dd_owned and sg.pairs and scans * n_pairs <= settings.PAIR_SCAN_MAX_WORK
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
    if chunkable and K * doc_bytes > settings.SCATTER_BUFFER_MAX_BYTES and sg.d_kind != OFFSETS:
        docs = max(1, settings.SCATTER_CHUNK_BYTES // doc_bytes, cdiv(settings.SCATTER_CHUNK_MIN_LINKS, Nq * Lq))
        dd_chunks, dd_tail = chunk_plan(K, docs) if docs < K else ((), 0)
        if dd_tail * doc_bytes > max(settings.SCATTER_BUFFER_MAX_BYTES, settings.SCATTER_CHUNK_BYTES):
            dd_chunks, dd_tail = (), 0  # (chunks grown past the cap by SCATTER_CHUNK_MIN_LINKS: see there)
    fused_sc = not dd_owned and not sorted_dd and bool(settings.FUSED_SCATTER)
    sc_lo, sc_n = dd_chunks[0][:2] if dd_chunks else (0, K)  # (the main launch's atomics: all, or the first chunk)
    n_dsc = _scatter_grid(Nq, sc_n, n_tb) if fused_sc else 0
    # (not beside a split dQ walk: its fp32 slices would be alive with dD and its buffer, above a step's peak)
    fused_cast = (
        fused_sc and not dd_chunks and not direct_d and not normalize and sg.d_kind != OFFSETS
        and n_dsc <= settings.FUSED_CAST_MAX_PROGRAMS and dq_splits == 1
    )  # fmt: skip
    n_grp = cdiv(K, settings.SCATTER_DOCS)
    # (the split walk's slices summed by its own programs: counters in the atomics' zeroed buffer, after dD's)
    sum_last = 1 < dq_splits <= settings.FUSED_DQ_SUM_MAX_SLICES and fused_sc and not dd_chunks
    cast_elems = FUSED_CAST_BLOCK.value * FUSED_CAST_STEPS.value  # (a cast program's)
    n_cast = n_grp * cdiv(settings.SCATTER_DOCS * Ld * dim, cast_elems) if fused_cast else 0
    steps = chunk_steps(dd_chunks, fused_sc) if dd_chunks else ()
    dd_sc = (
        None
        if dd_owned or (fused_sc and not dd_chunks) or sorted_dd
        else scatter(False, query_strides(Q), document_strides(torch.empty(D.shape, device="meta"), shared))
    )
    dd_sorted = None
    if sorted_dd:
        ints_sorted = (K, Lq, Ld, dim, *query_strides(Q), *document_strides(D, shared)[1:], *d_fresh[1:], grad_stride)
        constexprs_sorted = dict(CHUNK=dd_gather.CHUNK, DIM_P=cfg.DIM_P, NORMALIZE=normalize)
        dd_sorted = (n_links, K, Lq, Ld, ints_sorted, constexprs_sorted, settings.SORTED_DD_WARPS)
    ints = (
        n_queries, Nq, K, n_docs if sg.pairs else K, n_pairs, Lq, Ld, dim, *seg_args,
        *query_strides(Q), *document_strides(D, shared), *q_fresh, *d_fresh, *seg_strides, n_tb, n_jb, n_kb,
    )  # fmt: skip
    constexprs = dict(
        BT=cfg.BT, DIM_P=cfg.DIM_P, TQ=cfg.TQ, BN=cfg.BN, BLOCK_K=cfg.BLOCK_K, **kinds,
        PAIR_LIST=sg.pairs, SHARED_DOCS=shared, NORMALIZE=normalize, DOT_PRECISION=dot_precision(Q.dtype),
        UPCAST=upcast(Q.dtype), SCAN_Q=scan_q, SCAN_D=scan_d, DOC_WALK=doc_walk,
    )  # fmt: skip
    # Both sides in one launch (H100, GPU time of the backward: candidates 64x32 Lq32 Ld180 100 -> 76 us, as fast as
    # two launches elsewhere), and one launch fewer of host time, which is what a small step is made of.
    # The dQ walk gathers UNROLL pairs per step (their loads in flight together: fewer round trips per program);
    # sharing a launch with the owner it takes one at a time. (H200, docs/performance.md v77, backward GPU time with
    # the owner, 4 pairs a step against 1: the cross products' owner is the longer walk, unchanged; candidates 64x32
    # 41.2 -> 37.5 us, 128x8 Lq64 35.3 -> 34.1, but aligned pairs 512 17.8 -> 19.8.)
    # The atomics' programs do not mind the gather's registers (H100, backward GPU time with the atomics in the
    # launch, UNROLL 4 vs 1: 256x256 Ld300 424 vs 458 us, 32x32 Lq1024 204 vs 202, 64x64 Ld1024 65 vs 56).
    unroll = settings.FUSED_DQ_UNROLL if n_dd else settings.DQ_UNROLL
    if scan_q:  # (the scanning walk picks its pairs out in groups: see backward.py)
        unroll = settings.PAIR_SCAN_DQ_UNROLL if cfg.DIM_P <= settings.PAIR_SCAN_DQ_UNROLL_MAX_DIM else 1
    main = (
        n_dq + n_dd + n_dsc + n_cast,
        (*ints, n_dq, dq_splits, ks_len, Q.numel(), sc_lo, sc_n),
        dict(constexprs, UNROLL=unroll, DQ_GATHER=n_dq > 0, DD_OWNED=n_dd > 0, DD_SCATTER=n_dsc > 0,
             PROJECT_Q=project_q, PROJECT_D=project_d, DQ_SPLIT=dq_splits > 1, SCATTER_DOCS=settings.SCATTER_DOCS,
             ONE_TQ=Lq <= cfg.TQ,  # (TQ follows Lq up to 64 tokens: one more variant for longer queries, once)
             REG_SEL=n_dd > 0 and register_selector(doc_walk, normalize, cfg, Q.dtype), FUSED_CAST=fused_cast,
             SUM_LAST=sum_last),
    )  # fmt: skip
    assert main[1][MAIN_ROWS_AT - 1 : MAIN_ROWS_AT + 3] == seg_args and main[1][-3] == Q.numel()  # (with_rows)
    assert all(sc is None or sc[1][SCATTER_ROWS_AT - 1 : SCATTER_ROWS_AT + 3] == seg_args for sc in (dq_sc, dd_sc))
    plain = (
        rg is None and not normalize and not grad_contiguous and not dq_scatter and dq_splits == 1
        and dd_sc is None and not dd_chunks and dd_sorted is None and main[0] > 0
    )  # fmt: skip
    return BackwardPlan(
        grad_contiguous, dq_scatter, dq_splits,
        torch.float32 if dq_scatter or (normalize and dq_splits > 1) else Q.dtype,
        sg.pairs and not scan_q and not dq_scatter, n_queries,
        dd_owned, D.dtype if direct_d else torch.float32, sg.pairs and dd_owned and not scan_d, n_docs,
        main, (sg.q_kind == OFFSETS, sg.d_kind == OFFSETS), dq_sc, dd_sc, dd_chunks, dd_tail, fused_sc, steps,
        [{} for _ in steps],
        direct_d, dd_sorted, project_q,
        project_d or (normalize and sorted_dd), cfg.num_warps, {}, {}, plain,
        n_grp if fused_cast else 0, n_queries * n_tb if sum_last else 0, {},
    )  # fmt: skip


def _scatter_grid(Nq: int, n_docs: int, n_tb: int) -> int:
    """Programs of the dD atomics into ``n_docs`` documents (``SCATTER_DOCS`` a program) from ``Nq`` queries of
    ``n_tb`` token blocks."""
    return Nq * cdiv(n_docs, settings.SCATTER_DOCS) * n_tb


def _front_buffer(gd: Tensor, chunk: tuple[int, int, bool]) -> Tensor:
    """The fp32 buffer of an in-dD chunk (``dd_chunks.chunk_plan``): the front of dD's (16-bit) storage, one
    chunk's size."""
    _k0, n, _in_dd = chunk
    row = gd.shape[-2] * gd.shape[-1]
    return gd.view(-1)[: 2 * n * row].view(torch.float32)


def _chunked_scatter(
    plan: BackwardPlan,
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
    Q, D = last_dim_contiguous(Q), last_dim_contiguous(D)
    if grad.dtype != torch.float32:
        grad = grad.to(torch.float32)
    _key, plan = backward_plan_of(grad, Q, D, normalize, deterministic, rg, views)
    if plan is None:
        return torch.zeros_like(Q), torch.zeros_like(D)
    return run_backward(plan, grad, Q, D, argmax, normalize, rg, norms)


def backward_plan_of(
    grad: Tensor, Q: Tensor, D: Tensor, normalize: bool, deterministic: bool, rg: Ragged | None,
    views: Views | None,
) -> tuple[tuple, BackwardPlan | None]:  # fmt: skip
    """The key and the backward plan of these arguments (:func:`backward`'s, ``grad`` fp32 and ``Q``, ``D`` last-dim
    contiguous), the plan made and filed on the first call of a key; None for a problem without work."""
    packed = packed_sides(Q, D, rg)  # (packed rows by their class: nothing the plan decides reads their count)
    key = (
        Q.device, shape_key(Q, packed[0]), Q.stride(), shape_key(D, packed[1]), D.stride(), Q.dtype, D.dtype,
        grad.shape, grad.stride(), views,
        normalize, deterministic, torch.get_float32_matmul_precision() if Q.dtype == torch.float32 else None,
        ragged_plan_key(rg), settings.PAIR_SCAN_MAX_WORK, settings.DQ_SPLIT_MIN_K, settings.DQ_SPLIT_MIN_PAIRS,
        settings.DQ_SPLIT_PROGRAMS_PER_SM, settings.SHARED_OWNER_MAX_WORK, settings.SHARED_OWNER_MAX_ROWS,
        settings.FUSED_SCATTER, settings.FUSED_CAST_MAX_PROGRAMS, settings.FUSED_DQ_SUM_MAX_SLICES,
        settings.SCATTER_BUFFER_MAX_BYTES, settings.SCATTER_CHUNK_BYTES, settings.SCATTER_CHUNK_MIN_LINKS,
        settings.SCATTER_DOCS, settings.SORTED_DD_MIN_LINKS, settings.SORTED_DD_WARPS, settings.WIDE_ATOMICS_BT,
        settings.PAIR_SCAN_DQ_UNROLL, settings.PAIR_SCAN_DQ_UNROLL_MAX_DIM, dd_gather.CHUNK,
    )  # fmt: skip
    plan = plans.get(key)
    if plan is None:
        Qc, Dc = (Q, D) if views is None else (view_as_canonical(Q, views.q), view_as_canonical(D, views.d))
        Nq, Lq, Bd, K, Ld, dim = dims(Qc, Dc, rg)
        if Nq == 0 or K == 0 or Lq == 0 or Ld == 0:
            return key, None
        plan = _backward_plan(grad, Qc, Dc, normalize, deterministic, rg, segments_of(Qc, Dc, rg))
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = plan
    return key, plan


def _ints_of(launch: tuple, plan: BackwardPlan, Q: Tensor, D: Tensor, at: int) -> tuple:
    """The integers of one of ``plan``'s launches (``(grid, ints, constexprs)``, its packed row counts at ``at``)
    for this call's ``Q`` and ``D``: a plan of packed rows serves every count of their class (plan keys hold
    :func:`~.launch_args.rows_class`)."""
    ints = launch[1]
    if plan.packed == (False, False):
        return ints
    ints = with_rows(ints, at, plan.packed, Q, D)
    return (*ints[:-3], Q.numel(), *ints[-2:]) if at == MAIN_ROWS_AT else ints


def _run_plain(plan: BackwardPlan, grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`run_backward` of a plain plan (:attr:`BackwardPlan.plain`: the small steps' plans): the same
    allocations, the same launch with the same tensors and pointers (tests/test_launcher.py holds them equal), without
    the branches and compositions the other plans need. This CPU, launches stubbed (docs/performance.md v151): the
    small step's backward call 8.9-9.9 -> 7.5 µs alone, 0.3-0.8 µs less of a whole step of 53-72. A repeat calls the
    compiled kernel as :func:`~.launch_forward.run_lean` does (``plan.lean``, v169: the launcher's call 1.9 -> 0.8 µs
    on this CPU). Syncs: none."""
    dQ = torch.empty(Q.shape, dtype=plan.dq_dtype, device=Q.device)
    g, a, q, d = grad.data_ptr(), argmax.data_ptr(), Q.data_ptr(), D.data_ptr()
    out, out_ptr = grad, g  # (unused slot)
    if plan.dd_owned:
        gd = torch.empty(D.shape, dtype=plan.dd_dtype, device=D.device)
    elif plan.cast_counters:  # (the atomics' fp32 buffer and counters; the launch casts it into dD)
        gd = torch.zeros(D.numel() + plan.cast_counters, dtype=torch.float32, device=D.device)
        out = torch.empty(D.shape, dtype=D.dtype, device=D.device)
        out_ptr = out.data_ptr()
    else:  # (the atomics' fp32 buffer, in the main launch)
        gd = torch.zeros(D.shape, dtype=torch.float32, device=D.device)
    # (the layout of run_backward's launch: no norms, no segments, no CSR indexes; those slots hold Q or grad)
    pointers = (g, a, q, d, g, g, dQ.data_ptr(), gd.data_ptr(), out_ptr, g, q, q, q, q, g, g, g, g)
    device = grad.get_device()  # (the launcher's, whose first tensor is the gradient)
    short_key = (device, g & 15, a & 15, q & 15, d & 15)  # (the launcher's plan-cache key: the foreign tensors')
    entry = plan.lean.get(short_key)
    if entry is None or device != launcher.current_device() or launcher.hooks_installed():
        grid, ints, constexprs = plan.main
        tensors = (grad, argmax, Q, D, grad, grad, dQ, gd, out, grad, Q, Q, Q, Q, grad, grad, grad, grad)
        _bwd(grid, tensors, ints, constexprs, plan.num_warps, 3, plan.launches, foreign=tensors[:4], pointers=pointers)
        if entry is None:
            entry = Launcher.lean_entry(plan.launches, short_key, ints)
            if entry is not None:
                plan.lean[short_key] = entry
    else:
        run, function, metadata, tail = entry
        run(plan.main[0], 1, 1, launcher.current_stream(device), function, metadata, None, None, None,
            *pointers, *tail)  # fmt: skip
    if plan.cast_counters:
        gd = out
    if gd.dtype != D.dtype:
        gd = gd.to(D.dtype)
    if dQ.dtype != Q.dtype:
        dQ = dQ.to(Q.dtype)
    return dQ, gd


def run_backward(
    plan: BackwardPlan, grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, normalize: bool, rg: Ragged | None,
    norms: tuple[Tensor, Tensor] | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`backward` with its plan: the allocations and launches."""
    if plan.plain:
        return _run_plain(plan, grad, Q, D, argmax)
    if plan.grad_contiguous:
        grad = grad.contiguous()
    if normalize:
        inv_q, inv_d = normalize_kernels.inverse_norms(Q, D) if norms is None else norms
    else:
        inv_q = inv_d = grad  # unused pointers
    segs = segment_pointers(Q, rg)
    nw = plan.num_warps
    if plan.dq_scatter:
        dQ = torch.zeros(Q.shape, dtype=torch.float32, device=Q.device)
        grid, _ints, constexprs = plan.dq_sc
        ints = _ints_of(plan.dq_sc, plan, Q, D, SCATTER_ROWS_AT)
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
    elif plan.cast_counters:  # the atomics' fp32 buffer and counters; the main launch casts it into dD
        gd = torch.zeros(D.numel() + plan.cast_counters, dtype=torch.float32, device=D.device)
    elif plan.sum_counters:  # the atomics' fp32 buffer and the split walk's counters
        gd = torch.zeros(D.numel() + plan.sum_counters, dtype=torch.float32, device=D.device)
    else:  # the atomics' fp32 buffer, zeroed before the launch that adds into it (main, or its own after it)
        gd = torch.zeros(D.shape, dtype=torch.float32, device=D.device) if plan.dd_sc is None else None
    out = torch.empty(D.shape, dtype=D.dtype, device=D.device) if plan.cast_counters else grad  # (else unused)
    q_off, q_order = csr(rg.pair_q, plan.n_queries) if plan.q_csr else (grad, grad)  # (else unused)
    d_off, d_order = csr(rg.pair_d, plan.n_docs) if plan.d_csr else (grad, grad)
    grid, _ints, constexprs = plan.main
    ints = _ints_of(plan.main, plan, Q, D, MAIN_ROWS_AT)
    tensors = None
    if grid:
        tensors = (grad, argmax, Q, D, inv_q, inv_d, dq_out, grad if gd is None else gd, out,
                   dQ if plan.sum_counters else grad, *segs, q_off, q_order, d_off, d_order)  # fmt: skip
        foreign = (grad, argmax, Q, D) if rg is None and not normalize else (grad, argmax, Q, D, inv_q, inv_d, *segs)
        # (each distinct tensor's pointer read once: unused segment slots hold Q, unused CSR slots the gradient)
        g, a, q = grad.data_ptr(), argmax.data_ptr(), Q.data_ptr()
        inv = (inv_q.data_ptr(), inv_d.data_ptr()) if normalize else (g, g)
        if rg is None:
            seg_ptrs = (q, q, q, q, g, g, g, g)
        else:
            seg_ptrs = (
                *[q if x is Q else x.data_ptr() for x in segs],
                *[g if x is grad else x.data_ptr() for x in (q_off, q_order, d_off, d_order)],
            )
        pointers = (
            g, a, q, D.data_ptr(), *inv, dq_out.data_ptr(), g if gd is None else gd.data_ptr(),
            g if out is grad else out.data_ptr(), dQ.data_ptr() if plan.sum_counters else g, *seg_ptrs,
        )  # fmt: skip
        _bwd(grid, tensors, ints, constexprs, nw, 3, plan.launches, foreign=foreign, pointers=pointers)
        if plan.cast_counters:
            gd = out
        elif plan.sum_counters:
            gd = gd[: D.numel()].view(D.shape)
    if plan.dq_splits > 1 and not plan.sum_counters:  # (in slice order, in fp32, rounded once into dQ's dtype)
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
        grid, _ints, constexprs = plan.dd_sc
        ints = _ints_of(plan.dd_sc, plan, Q, D, SCATTER_ROWS_AT)
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
