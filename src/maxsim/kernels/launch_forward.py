"""The forward's launches: a plan per signature (shapes, strides, dtypes, flags, the maximum lengths and the
launch settings; never values), made once and kept, then each call's allocations and launches.

Nothing here reads a tensor's values on the host: grids and variants come from shapes and the caller's maximum
lengths only, so calls are free of host↔device syncs and CUDA-graph capturable.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from ..layout import Ragged, Views, argmax_dtype, dims, view_as_canonical
from . import device_info, doc_chunks, launcher
from . import launch_settings as settings
from . import normalize as normalize_kernels
from .configs import (
    ForwardConfig,
    deep_pipeline_config,
    forward_config,
    half_packed_config,
    once_read_config,
    scores_only_config,
    streaming_config,
)
from .forward import maxsim_fwd_kernel
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
from .sizes import cdiv, next_power_of_2

_fwd = Launcher(maxsim_fwd_kernel)
ROWS_AT = 6  # where the packed queries' row count is among a forward plan's integers (the documents' two on)
_combine_chunks = Launcher(doc_chunks.combine_chunks_kernel)


def card_bound(table: tuple[tuple[str, float], ...], name: str, default: float) -> float:
    """The bound that a setting of ``(part of a card's name, bound)`` pairs gives the card ``name``, else
    ``default``."""
    for part, bound in table:
        if part in name:
            return bound
    return default


def once_read_table_l2(device: torch.device) -> float:
    """The card's ONCE_READ_TABLE_L2 bound (infinite for a card the table does not name)."""
    return card_bound(settings.ONCE_READ_TABLE_L2, device_info.card_name(device), math.inf)


def documents_key(D: Tensor, packed: bool, scan_by_bytes: bool) -> tuple:
    """``D``'s shape as a forward plan's key holds it: packed documents' row count by its
    :func:`~.launch_args.rows_class`, and where the forward may choose its scan by their bytes (``scan_by_bytes``: a
    scores-only cross product of packed documents; a pair list reads no scan by bytes, nor does a forward that saves
    the argmax) also which side of each bound those bytes lie (:func:`bytes_class`): a batch of other token totals
    shares the plan wherever the plan would come out the same."""
    if not packed:
        return tuple(D.shape)
    if not scan_by_bytes:
        return shape_key(D, True)
    return (*shape_key(D, True), bytes_class(D))


def bytes_class(D: Tensor) -> tuple[bool, ...]:
    """Which side of each bound in L2 sizes that :func:`half_packed_blocks` and :func:`once_read_scan` compare the
    documents' bytes with ``D``'s bytes lie, each compared as there: what of ``D``'s size a scores-only plan reads."""
    l2s = l2_sizes(D)  # (~1.5 us of host time in all, a repeated call's key included: the bounds are not cached,
    name = device_info.card_name(D.device)  # since tests and tuning change the settings and the card's stand-ins)
    half = card_bound(settings.PACKED_SCORES_HALF_L2, name, 0.0)
    table = card_bound(settings.ONCE_READ_TABLE_L2, name, math.inf)
    lo, hi = settings.STREAM_L2_RANGE
    return (l2s > half, l2s > table, l2s > min(table, settings.ONCE_READ_WIDE_TABLE_L2), lo <= l2s, l2s <= hi)


def l2_sizes(D: Tensor) -> float:
    """``D``'s bytes in sizes of its device's L2 (what the once-read scans' bounds are in)."""
    return D.numel() * D.element_size() / device_info.l2_bytes(D.device)


def half_packed_blocks(cfg: ForwardConfig, D: Tensor) -> ForwardConfig | None:
    """configs.half_packed_config's blocks for a scores-only forward against shared 16-bit documents ``D`` of at most
    the card's PACKED_SCORES_HALF_L2 L2 sizes, else None. (The caller asks only where the 256-row blocks are two or
    more: halving a single block adds a pass over the documents, and with normalize=True their norms' pre-pass.)"""
    if D.element_size() != 2:
        return None
    bound = card_bound(settings.PACKED_SCORES_HALF_L2, device_info.card_name(D.device), 0.0)
    if l2_sizes(D) > bound:
        return None
    return half_packed_config(cfg)


def docs_per_program(base: int, K: int, slots: int, tiles: int, one_doc_gain: float = 1.0) -> int:
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


class ForwardPlan(NamedTuple):
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
    packed: tuple[bool, bool]  # Q, D packed rows: their counts in ``ints`` are each call's (launch_args.with_rows)
    # A dense forward of one launch (no segments, norms' pre-pass, row split or chunks):
    # its repeats' launch entries by alignment (:func:`run_repeat`); None for every other plan.
    lean: dict | None


plans: dict[tuple, ForwardPlan] = {}  # by plan_key; also the repeats' entries (keep_repeat, launch.keep_step)


def plan_key(
    Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, normalize: bool, need_argmax: bool,
    rg: Ragged | None, views: Views | None,
) -> tuple:  # fmt: skip
    """What a forward plan depends on: shapes, strides, dtypes, flags and the module settings (never values). Packed
    rows enter by their :func:`~.launch_args.rows_class` (see :func:`documents_key` for a scores-only cross
    product's documents)."""
    q_shape, d_shape = Q.shape, D.shape
    if rg is not None:
        packed = packed_sides(Q, D, rg)
        q_shape = shape_key(Q, packed[0])
        d_shape = documents_key(D, packed[1], not need_argmax and rg.pair_q is None)
    return (
        Q.device, q_shape, Q.stride(), d_shape, D.stride(), Q.dtype, views,
        None if q_mask is None else q_mask.stride(), None if d_mask is None else d_mask.stride(), normalize,
        need_argmax, torch.get_float32_matmul_precision() if Q.dtype == torch.float32 else None, ragged_plan_key(rg),
        settings.PRENORM_MIN_ROW_BLOCKS, settings.PRENORM_MIN_QUERY_BLOCKS, settings.PRENORM_UNSHARED,
        settings.PRENORM_UNSHARED_SCORES,
        settings.STREAM_ONCE_READ, settings.STREAM_L2_RANGE, settings.STREAM_MASK_BITS, settings.PIPE_MASK_BITS,
        settings.PIPE_MASK_BITS_ARGMAX, settings.PIPE_MASK_BITS_MIN_ROWS, settings.PIPE_MASK_BITS_THIN_MAXNREG,
        settings.DOC_ROWS_SUMS_MAXNREG,
        settings.STREAM_UNSHARED_MAX_ROWS, settings.STREAM_SHARED_MAX_ROWS, settings.ONCE_READ_TABLE_L2,
        settings.ONCE_READ_TABLE, settings.ONCE_READ_TABLE_MASKED_SUMS, settings.ONCE_READ_WIDE_TABLE_L2,
        settings.DEEP_PIPELINE,
        settings.DEEP_PIPELINE_MIN_LD, settings.DOC_SPLIT_BELOW, settings.DOC_SPLIT_PROGRAMS_PER_SM,
        settings.DOC_SPLIT_MIN_TILES, settings.PACK_ROWS, settings.DOC_ROWS, settings.DOC_ROWS_MAX_ROWS,
        settings.DOC_ROWS_MIN_BLOCK_N, settings.DOC_ROWS_SUMS_MAX_ROWS, settings.DOC_ROWS_WIDEN_THIN,
        settings.LONG_QUERY_PERSIST_MAX_TILES, settings.ONCE_READ_EVICT, settings.STREAM_AS_TABLE,
    )  # fmt: skip


def keep_repeat(
    key: tuple, Q: Tensor, D: Tensor, normalize: bool, views: Views | None, q_mask: Tensor | None = None,
    d_mask: Tensor | None = None, rg: Ragged | None = None,
) -> None:  # fmt: skip
    """File the plan that a scores-only forward of ``Q``, ``D`` (the caller's tensors, read through ``views``; the
    masks as canonical views; ``rg`` the ragged description it planned with) has just kept under ``key`` as well: a
    repeat of the call (see :func:`run_repeat`) then finds it without building the plan's key. Repeat entries live
    among the plans, so whatever clears the plans (a change of the module settings must) clears them too."""
    plan = plans.get(plan_key(Q, D, q_mask, d_mask, normalize, False, rg, views))
    if plan is not None:
        plans[key] = plan


def run_repeat(
    key: tuple, Q: Tensor, D: Tensor, q_mask: Tensor | None = None, d_mask: Tensor | None = None,
    rg: Ragged | None = None,
) -> Tensor | None:  # fmt: skip
    """Scores of a call filed by :func:`keep_repeat` under ``key`` (None if there is no such entry): its
    allocations and launches only. The masks may be the caller's: a launch reads their pointers, which their
    canonical views share, and the signature holds their strides. ``rg``: this call's ragged description (its
    offsets, lengths and pair ids are read on the device; the signature holds their shapes and the maxima)."""
    plan = plans.get(key)
    if plan is None:
        return None
    if plan.lean is not None:
        return run_lean(plan, Q, D, q_mask, d_mask, False)[0]
    return run_forward(plan, Q, D, q_mask, d_mask, (Q, Q, Q, Q) if rg is None else segment_pointers(Q, rg), False)[0]


def run_lean(
    plan: ForwardPlan, Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, need_argmax: bool
) -> tuple[Tensor, Tensor | None]:
    """``(scores, argmax or None)``: :func:`run_forward` of a lean plan (:attr:`ForwardPlan.lean`) for a repeat
    (``need_argmax``: a training step's), its allocations and the launch's call, whose integers and constexpr
    values are one tuple kept by the launch's alignment and whose pointers are written out as :func:`run_forward`
    composes them (``tools/host_stub.py`` on the CPU machine: the tiny inference call 13.7-14.6 -> 10.5-11.0 µs).
    The masks are the caller's (a bool mask's pointer is its uint8 view's). The first call of an alignment, a call
    on a device other than the current one, and any call while a launch hook is installed take :func:`run_forward`.
    Syncs: none."""
    q, d = Q.data_ptr(), D.data_ptr()
    device = Q.get_device()
    if q_mask is None and d_mask is None:
        qm = dm = q
        short_key = (device, q & 15, d & 15)  # (the launcher's plan-cache key: the foreign tensors' alignments)
    else:
        qm = q if q_mask is None else q_mask.data_ptr()
        dm = q if d_mask is None else d_mask.data_ptr()
        short_key = (device, q & 15, d & 15, qm & 15, dm & 15, q & 15, q & 15, q & 15, q & 15)  # (and segments')
    entry = plan.lean.get(short_key)
    if entry is None or device != launcher.current_device() or launcher.hooks_installed():
        scores, argmax, _norms = run_forward(plan, Q, D, q_mask, d_mask, (Q, Q, Q, Q), need_argmax)
        if entry is None:
            entry = Launcher.lean_entry(plan.launches, short_key, plan.ints)
            if entry is not None:
                plan.lean[short_key] = entry
        return scores, argmax
    run, function, metadata, tail = entry
    scores = torch.empty(plan.out_shape, dtype=torch.float32, device=Q.device)
    s = scores.data_ptr()
    argmax = None
    a = s
    if need_argmax:
        argmax = torch.empty((*plan.out_shape, plan.Lq), dtype=plan.argmax_dtype, device=Q.device)
        a = argmax.data_ptr()
    # (run_forward's slots without segments or norms: Q, D, masks, segments, out, argmax, norms, rows; unused ones
    # hold Q's pointer, the outputs the scores')
    run(plan.grid, 1, 1, launcher.current_stream(device), function, metadata, None, None, None,
        q, d, qm, dm, q, q, q, q, s, a, q, d, s, *tail)  # fmt: skip
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
        key = plan_key(Q, D, q_mask, d_mask, normalize, need_argmax, rg, views)
        plan = plans.get(key)
        if plan is not None:
            return run_forward(plan, Q, D, q_mask, d_mask, segment_pointers(Q, rg), need_argmax)
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
    Q, D = last_dim_contiguous(Q), last_dim_contiguous(D)
    sg = segments_of(Q, D, rg)
    shared = Bd == 1 and not sg.pairs
    from_table = cfg is None
    cfg = cfg or forward_config(Lq, dim, Nq, shared, Q.dtype == torch.float32)
    per_block = packed_queries(cfg, Nq, Lq, K, shared, device_info.sm_count(Q.device), Q.element_size())
    n_qblocks = cdiv(Nq, per_block or cfg.BQ)
    half = half_packed_blocks(cfg, D) if from_table and not need_argmax and shared and n_qblocks > 1 else None
    if half is not None:
        cfg = half
        per_block = packed_queries(cfg, Nq, Lq, K, shared, device_info.sm_count(Q.device), Q.element_size())
        n_qblocks = cdiv(Nq, per_block or cfg.BQ)
    # Queries longer than one row block: one program per row block (more programs, shorter ones), partial scores
    # summed afterwards in a fixed order.
    n_rsplit = cdiv(Lq, cfg.TQ)
    n_programs = n_qblocks * n_rsplit * K  # (one per document and row block)
    deep = from_table and deep_pipelined(n_programs, cfg, Ld, D)
    scan = None
    if deep:
        cfg = deep_pipeline_config(cfg)
    elif not need_argmax:
        scan = once_read_scan(sg, shared, n_qblocks, n_rsplit, cfg, D, d_mask is not None, K, normalize)
        if scan == "stream" and normalize and d_mask is not None and widened_for_doc_rows(streaming_config(cfg)):
            scan = None  # (the pipelined loop, in DOC_ROWS: see DOC_ROWS_SUMS_MAX_ROWS)
        if from_table:
            cfg = scores_only_tiles(cfg, scan, normalize, Lq, Ld, D, d_mask is not None)
    stream = scan == "stream"
    # (the once-read table's tiles evict-first within the stream's byte range only: see ONCE_READ_EVICT)
    evict = scan == "table" and bool(settings.ONCE_READ_EVICT) and l2_sizes(D) <= settings.STREAM_L2_RANGE[1]
    sqm = (0, 0) if q_mask is None else q_mask.stride()
    sdm = (0, 0, 0) if d_mask is None else ((0 if shared else d_mask.stride(0)),) + d_mask.stride()[1:]
    rows_per_prog = cfg.TQ if n_rsplit > 1 else Lq
    docs_per_prog = 1
    long_docs = n_rsplit > 1 and cdiv(Ld, cfg.BLOCK_N) > settings.LONG_QUERY_PERSIST_MAX_TILES
    if cfg.persist and not sg.pairs and sg.d_kind == DENSE and cfg.NUM_K == 1 and not long_docs:
        slots = device_info.sm_count(Q.device) * cfg.persist
        # A persistent launch planned one program to a multiprocessor (packed queries) loses the two that the
        # hardware keeps resident when each program takes one document: H100, training forward of 64x64 Lq32 Ld1024
        # (4 documents of 16 tiles per persistent program) 0.103 ms, one document per program 0.095 ms; with short
        # documents persistence still wins (64x64 Ld128 0.025 against 0.032 ms, 256x256 Ld300 0.54 against 0.62).
        gain = settings.ONE_DOC_GAIN if cfg.persist == 1 else 1.0
        docs_per_prog = docs_per_program(n_qblocks * n_rsplit, K, slots, cdiv(Ld, cfg.BLOCK_N), gain)
    n_dsplit, chunk_len = 1, 0
    if docs_per_prog == 1:
        n_dsplit, chunk_len = document_chunks(n_programs, Ld, cfg.BLOCK_N, Q.device)
    may_doc_rows = doc_rows_eligible(cfg, need_argmax, D, settings.DOC_ROWS_MAX_ROWS)
    # (unshared documents: a training forward hands the norms on to the backward; a scores-only one sums its tiles'
    # squares, but for thin blocks in the once-read table loop and for few programs: see PRENORM_UNSHARED_SCORES)
    thin_table = scan == "table" and cfg.BQ * cfg.TQ <= 32 and not may_doc_rows
    prenorm_unshared = bool(settings.PRENORM_UNSHARED) and (
        need_argmax or thin_table or deep or n_dsplit > 1 or bool(settings.PRENORM_UNSHARED_SCORES)
    )
    norms_given = normalize and (
        n_rsplit >= settings.PRENORM_MIN_ROW_BLOCKS
        or (n_qblocks >= settings.PRENORM_MIN_QUERY_BLOCKS if shared else prenorm_unshared)
    )
    sums_squares = normalize and not norms_given
    row_bound = settings.DOC_ROWS_SUMS_MAX_ROWS if sums_squares else settings.DOC_ROWS_MAX_ROWS
    doc_rows = doc_rows_eligible(cfg, need_argmax, D, row_bound) and (settings.DOC_ROWS >= 2 or sums_squares)
    combine = None
    if n_dsplit > 1:
        n_pairs = Nq * K
        combine = (
            n_pairs, 2 * n_dsplit * n_pairs * Lq, (n_pairs, Lq, n_dsplit),
            dict(LQ_BLOCK=min(128, next_power_of_2(Lq)), SAVE_ARGMAX=need_argmax),
        )  # fmt: skip
    bits = mask_bits(cfg, d_mask is not None, stream, need_argmax)
    maxnreg = register_cap(cfg, bits, docs_per_prog > 1, doc_rows and sums_squares and not stream)
    inv_q_strides = query_strides(torch.empty(Q.shape[:-1] + (1,), device="meta")) if norms_given else (0, 0)
    inv_d_strides = (
        document_strides(torch.empty(D.shape[:-1] + (1,), device="meta"), shared) if norms_given else (0, 0, 0)
    )
    plan = ForwardPlan(
        Nq, K, Lq, (Nq, K) if views is None or views.out is None else views.out, argmax_dtype(Ld), n_rsplit, n_dsplit,
        norms_given,
        n_qblocks * n_rsplit * n_dsplit * cdiv(K, docs_per_prog),
        (
            Nq, K, Lq, Ld, dim,
            sg.n_q, sg.rows_q, sg.n_d, sg.rows_d,
            *query_strides(Q), *document_strides(D, shared), *inv_q_strides, *inv_d_strides, *sqm, *sdm,
            sg.sqs, sg.sds_b, sg.sds_k,
            n_qblocks, n_rsplit, rows_per_prog, docs_per_prog, n_dsplit, chunk_len,
        ),
        dict(
            TQ=cfg.TQ, BQ=cfg.BQ, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, NUM_K=cfg.NUM_K,
            Q_KIND=sg.q_kind, D_KIND=sg.d_kind, PAIR_LIST=sg.pairs,
            HAS_QMASK=q_mask is not None, HAS_DMASK=d_mask is not None, NORMALIZE=normalize,
            SAVE_ARGMAX=need_argmax, DOT_PRECISION=dot_precision(Q.dtype), UPCAST=upcast(Q.dtype),
            PERSIST=docs_per_prog > 1, NORMS_GIVEN=norms_given,
            # (a split query's scores-only loop ran 5 % slower with the early load: ColPali 357 -> 376 us)
            EARLY_NORMS=norms_given and (need_argmax or n_rsplit == 1),
            STREAM_D=stream, EVICT_D=evict, DOC_SPLIT=n_dsplit > 1,
            PACKED=per_block > 0, DOC_ROWS=doc_rows, MASK_BITS=bits,
        ),
        cfg.num_warps,
        cfg.num_stages,
        maxnreg,
        {},
        combine,
        {},
        (sg.q_kind == OFFSETS, sg.d_kind == OFFSETS),
        {} if rg is None and not norms_given and n_rsplit == 1 and n_dsplit == 1 else None,
    )  # fmt: skip
    assert plan.ints[ROWS_AT - 1 : ROWS_AT + 3] == (sg.n_q, sg.rows_q, sg.n_d, sg.rows_d)  # (with_rows' slots)
    if key is not None:
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = plan
    return run_forward(plan, Q, D, q_mask, d_mask, (sg.qseg, sg.dseg, sg.pq, sg.pd), need_argmax)


def scores_only_tiles(
    cfg: ForwardConfig, scan: str | None, normalize: bool, Lq: int, Ld: int, D: Tensor, masked: bool = False
) -> ForwardConfig:  # fmt: skip
    """The launch table's ``cfg`` for a scores-only forward: the stream's or the once-read table's tiles for a
    once-read ``scan`` (``masked``: with a document mask), else :func:`~.configs.scores_only_config`'s; either
    widened to DOC_ROWS_MIN_BLOCK_N tokens where that lets it run in DOC_ROWS (:func:`widened_for_doc_rows`,
    :func:`widened_thin_for_doc_rows`)."""
    if scan is not None:
        cfg = streaming_config(cfg) if scan == "stream" else once_read_config(cfg, Ld, masked)
        widen = normalize and widened_for_doc_rows(cfg)
    else:
        cfg = scores_only_config(cfg, Lq, normalize)
        level = 1 if normalize else 2  # (DOC_ROWS_WIDEN_THIN: 1 normalized forwards, 2 all)
        widen = level <= settings.DOC_ROWS_WIDEN_THIN and D.element_size() == 2 and widened_thin_for_doc_rows(cfg)
    return replace(cfg, BLOCK_N=settings.DOC_ROWS_MIN_BLOCK_N) if widen else cfg


def doc_rows_eligible(cfg: ForwardConfig, need_argmax: bool, D: Tensor, max_rows: int) -> bool:
    """Whether a forward of ``cfg`` may put the document's tokens in the MMA's rows (forward.py's ``DOC_ROWS``; see
    the DOC_ROWS setting): scores only, one dim chunk, 16-bit tokens, row blocks of at most ``max_rows`` rows
    against tiles of at least DOC_ROWS_MIN_BLOCK_N tokens."""
    rows = cfg.BQ * cfg.TQ
    return (
        settings.DOC_ROWS > 0
        and not need_argmax
        and cfg.NUM_K == 1
        and D.element_size() == 2
        and rows <= max_rows
        and cfg.BLOCK_N >= settings.DOC_ROWS_MIN_BLOCK_N
    )


def widened_for_doc_rows(cfg: ForwardConfig) -> bool:
    """Whether a normalized once-read scan of ``cfg`` (the stream's or the table's) takes DOC_ROWS_MIN_BLOCK_N-token
    tiles, to run in DOC_ROWS: blocks of more than DOC_ROWS_MAX_ROWS rows, up to DOC_ROWS_SUMS_MAX_ROWS, in one
    128-wide dim chunk, planned with shorter tiles (see DOC_ROWS_SUMS_MAX_ROWS). Such a scan keeps the wider tiles
    where it reads the norms from the pre-pass after all (documents in chunks, where their pre-pass is chosen)."""
    rows = cfg.BQ * cfg.TQ
    return (
        settings.DOC_ROWS > 0
        and settings.DOC_ROWS_MAX_ROWS < rows <= settings.DOC_ROWS_SUMS_MAX_ROWS
        and cfg.BLOCK_K == 128
        and cfg.BLOCK_N < settings.DOC_ROWS_MIN_BLOCK_N
    )


def widened_thin_for_doc_rows(cfg: ForwardConfig) -> bool:
    """Whether a scores-only forward of 16-bit tokens with the launch table's ``cfg`` (no once-read scan: pair
    lists, small candidate sets, a query against few documents) takes DOC_ROWS_MIN_BLOCK_N-token tiles, to run in
    DOC_ROWS: thin blocks (at most DOC_ROWS_MAX_ROWS rows) in one 128-wide dim chunk, which the table gives
    32-token tiles (see DOC_ROWS_WIDEN_THIN, whose level :func:`scores_only_tiles` checks)."""
    return (
        settings.DOC_ROWS > 0
        and cfg.BQ * cfg.TQ <= settings.DOC_ROWS_MAX_ROWS
        and cfg.BLOCK_K == 128
        and cfg.NUM_K == 1
        and cfg.BLOCK_N < settings.DOC_ROWS_MIN_BLOCK_N
    )


def packed_queries(cfg: ForwardConfig, Nq: int, Lq: int, K: int, shared: bool, sms: int, itemsize: int) -> int:
    """How many queries a row block of ``cfg`` holds back to back at their own length ``Lq`` (forward.py's
    ``PACKED``; see PACK_ROWS), or 0 where they keep their ``TQ``-row slots: documents not shared, one query a block,
    queries that fill their slots, no block fewer for ``Nq`` queries, a launch whose (block, document) programs in
    slots would all run at once on the ``sms`` multiprocessors (fewer of them finish no sooner, and each sums its
    rows per query in a longer epilogue: H200, cross 32x32 Lq23 Ld64 dim 64, 4 -> 3 blocks, scores 3.4 -> 4.2 us),
    or (PACK_ROWS = 1) fp32 tokens, on which it was not measured faster."""
    level, least = settings.PACK_ROWS, (1 if itemsize == 2 else 2)  # (least: the level that packs these)
    if level < least or not (shared and cfg.BQ > 1 and Lq < cfg.TQ):
        return 0
    if cdiv(Nq, cfg.BQ) * K <= sms:
        return 0
    per_block = min(cfg.BQ * cfg.TQ // Lq, 2 * cfg.BQ)
    return per_block if cdiv(Nq, per_block) < cdiv(Nq, cfg.BQ) else 0


def document_chunks(n_programs: int, Ld: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """``(chunks, tokens per chunk)`` each document of a forward launch of ``n_programs`` programs (one per document
    and row block) is scanned in: ``(1, 0)`` unless the launch would leave multiprocessors idle (see DOC_SPLIT_*).
    Chunks are whole tiles of ``block_n`` tokens, from the longest document's ``Ld``."""
    sms = device_info.sm_count(device)
    if not settings.DOC_SPLIT_PROGRAMS_PER_SM or n_programs * settings.DOC_SPLIT_BELOW > sms:
        return 1, 0
    tiles = cdiv(Ld, block_n)
    n = min(cdiv(settings.DOC_SPLIT_PROGRAMS_PER_SM * sms, n_programs), tiles // max(1, settings.DOC_SPLIT_MIN_TILES))
    if n < 2:
        return 1, 0
    chunk_tiles = cdiv(tiles, n)
    return cdiv(tiles, chunk_tiles), chunk_tiles * block_n


def deep_pipelined(n_programs: int, cfg: ForwardConfig, Ld: int, D: Tensor) -> bool:
    """Whether a forward of ``n_programs`` programs (one per document and row block) takes
    ``deep_pipeline_config`` (see DEEP_PIPELINE)."""
    thin = cfg.BQ * cfg.TQ <= 32 and cfg.NUM_K == 1 and D.element_size() == 2
    if not (
        settings.DEEP_PIPELINE
        and thin
        and Ld >= settings.DEEP_PIPELINE_MIN_LD
        and n_programs < device_info.sm_count(D.device)
    ):
        return False
    return device_info.shared_bytes(D.device) >= settings.DEEP_PIPELINE_MIN_SHARED


def mask_bits(cfg: ForwardConfig, masked: bool, stream: bool, need_argmax: bool) -> int:
    """How a masked scan carries its tiles' masks (forward.py's ``MASK_BITS``): 0, as a flag a column read in the
    tile's own iteration (or, in the stream, two tiles ahead); 1, as the bits of one integer, read ahead (the stream's
    two tiles, the pipelined loop's one); 2 (pipelined loops), as the flags the next tile's bits are reduced from,
    loaded a tile ahead. Bits need tiles of at most 64 tokens; a pipelined loop takes them (settings.PIPE_MASK_BITS
    for scores, PIPE_MASK_BITS_ARGMAX with the argmax) in row blocks of PIPE_MASK_BITS_MIN_ROWS rows or more (thin
    blocks of persistent walks under a register cap: :func:`register_cap`)."""
    if not masked or cfg.BLOCK_N > 64:
        return 0
    if stream:
        return int(bool(settings.STREAM_MASK_BITS))
    if cfg.BQ * cfg.TQ < settings.PIPE_MASK_BITS_MIN_ROWS:
        return 0
    return int(settings.PIPE_MASK_BITS_ARGMAX if need_argmax else settings.PIPE_MASK_BITS)


def register_cap(cfg: ForwardConfig, bits: int, persistent: bool, doc_rows_sums: bool) -> int:
    """The forward's ``maxnreg`` (0: none): ``cfg``'s, or a cap that keeps a program more a multiprocessor where a
    variant's registers were measured to cost one, without spills (see launch_settings): thin blocks of persistent
    walks that carry their masks read ahead (``bits``: :func:`mask_bits`), and DOC_ROWS programs that sum their
    tiles' squares (``doc_rows_sums``) one document each."""
    if bits and persistent and cfg.BQ * cfg.TQ <= 32 and settings.PIPE_MASK_BITS_THIN_MAXNREG:
        return settings.PIPE_MASK_BITS_THIN_MAXNREG
    if doc_rows_sums and not persistent and settings.DOC_ROWS_SUMS_MAXNREG:
        return settings.DOC_ROWS_SUMS_MAXNREG
    return cfg.maxnreg


def once_read_scan(
    sg: Segs, shared: bool, n_qblocks: int, n_rsplit: int, cfg: ForwardConfig, D: Tensor, masked: bool, K: int,
    normalize: bool,
) -> str | None:  # fmt: skip
    """How the scores-only forward reads ``D`` if every document tile is read by one program alone (a shared
    document by the only block of query rows, a query's own candidate by its only row split; a pair list may name a
    document twice), 16-bit tokens in one dim chunk, thin row blocks: ``"stream"`` (the ``STREAM_D`` loop; the
    loop keeps two tiles in registers) for a scan of STREAM_L2_RANGE times the L2's size (masked tokens included:
    the mask is not read on the host), ``"table"`` (the pipelined loop with ``once_read_config``'s tiles) for a
    dense scan of one 128-wide chunk beyond the card's ONCE_READ_TABLE_L2 (blocks of 33-64 rows with ``K`` > 1
    documents a query: ONCE_READ_WIDE_TABLE_L2 on those cards), unmasked or (ONCE_READ_TABLE_MASKED_SUMS)
    normalized blocks of at most 32 rows, else None (the table's configuration as it is)."""
    readers = n_qblocks * n_rsplit if shared else n_rsplit
    if readers != 1 or sg.pairs or D.element_size() != 2 or cfg.NUM_K != 1:
        return None
    rows = cfg.BQ * cfg.TQ
    if rows > (settings.STREAM_SHARED_MAX_ROWS if shared else settings.STREAM_UNSHARED_MAX_ROWS):
        return None
    l2s = l2_sizes(D)
    # (a document mask: normalized thin blocks only, see ONCE_READ_TABLE_MASKED_SUMS[_MAX_ROWS])
    masked_rows = settings.ONCE_READ_TABLE_MASKED_SUMS_MAX_ROWS
    table_mask = normalize and rows <= masked_rows and bool(settings.ONCE_READ_TABLE_MASKED_SUMS)
    wide_dense = (not masked or table_mask) and sg.d_kind == DENSE and cfg.BLOCK_K == 128
    bound = once_read_table_l2(D.device)
    if rows > 32 and bound != math.inf and K > 1:  # (one document a query: nothing to walk, see there)
        bound = min(bound, settings.ONCE_READ_WIDE_TABLE_L2)
    if settings.ONCE_READ_TABLE and wide_dense and l2s > bound:
        return "table"
    if not settings.STREAM_ONCE_READ:
        return None
    lo, hi = settings.STREAM_L2_RANGE
    if not lo <= l2s <= hi:
        return None
    return "table" if settings.STREAM_AS_TABLE and (not masked or table_mask) and sg.d_kind == DENSE else "stream"


def _unmasked_pointers(
    Q: Tensor, D: Tensor, segs: tuple, scores: Tensor, out: Tensor, arg: Tensor, norms: tuple[Tensor, Tensor] | None,
    rows: Tensor,
) -> tuple[int, ...]:  # fmt: skip
    """The pointers of :func:`run_forward`'s ``tensors`` for a problem without masks, each distinct tensor's read
    once: the mask slots are ``Q`` again, so are the segment slots that a layout does not use (all four for a dense
    problem), and up to three more slots the scores (host_stub's tiny inference: 15 ``data_ptr`` reads a launch
    become 5 with the plan cache's two)."""
    q, d, s = Q.data_ptr(), D.data_ptr(), scores.data_ptr()
    inv = (q, d) if norms is None else (norms[0].data_ptr(), norms[1].data_ptr())
    q_seg, d_seg, pair_q, pair_d = segs
    return (
        q, d, q, q,
        q if q_seg is Q else q_seg.data_ptr(), q if d_seg is Q else d_seg.data_ptr(),
        q if pair_q is Q else pair_q.data_ptr(), q if pair_d is Q else pair_d.data_ptr(),
        s if out is scores else out.data_ptr(), s if arg is scores else arg.data_ptr(),
        *inv,
        s if rows is scores else rows.data_ptr(),
    )  # fmt: skip


def run_forward(
    plan: ForwardPlan, Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, segs: tuple,
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
    ints = plan.ints if plan.packed == (False, False) else with_rows(plan.ints, ROWS_AT, plan.packed, Q, D)
    pointers = foreign = None
    if q_mask is None and d_mask is None:
        # (a plan's launches always pass one of these compositions: its key holds the masks and the segments)
        foreign = (Q, D) if segs[0] is segs[1] is segs[2] is segs[3] is Q else (Q, D, *segs)
        pointers = _unmasked_pointers(Q, D, segs, scores, out, arg, norms, rows)
    else:
        foreign = (Q, D, qm, dm, *segs)
    _fwd(
        plan.grid,
        tensors,
        ints,
        plan.constexprs,
        plan.num_warps,
        plan.num_stages,
        plan.launches,
        plan.maxnreg,
        foreign=foreign,
        pointers=pointers,
    )
    if n_dsplit > 1:
        grid, _n, ints, constexprs = plan.combine
        _combine_chunks(grid, (rows, scores, arg), ints, constexprs, 4, 1, plan.combine_launches, foreign=())
    elif n_rsplit > 1:
        torch.sum(out, dim=0, out=scores)
    return scores, argmax, norms
