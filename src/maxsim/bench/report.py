"""Outputs of a run: the terminal table, and with ``--out DIR`` the files ``<card>.json``, ``<card>.md`` and
``<card>.png``.

JSON schema (``"schema": "maxsim-bench/1"``)::

    {"schema": ..., "meta": {card, device, device_name, dtype, torch, triton, cuda, python, os, git_commit,
                             git_dirty, date, cpu_threads, copy_bandwidth_gbps, matmul_tflops,
                             matmul_dtype, impl_versions, tolerance, argv, quick, host_us, pinned_cpu},
     "rows": [{workload, mode, layout, note, shape, dtype, impl, card, status, reason, ms, peak_mib,
               rel_err, grad_err, grad_identity_err, flops, bytes, floor_ms, floor_frac, vs_eager,
               vs_best_peer, vs_padded, ragged, torch, triton, cuda, git_commit}, ...]}

``status`` is ``ok``, ``FAIL`` (wrong result: not ranked), ``n/a`` (the implementation does not cover the
workload), ``skipped`` (implementation unavailable) or ``error`` (it raised). Each row repeats the versions
and the commit so rows stay readable on their own.

Ragged workloads (``layout`` ``varlen`` or ``pairlist``) were added compatibly: ``vs_padded`` (the
``maxsim-padded`` row's ms over this row's: >1 = faster than this library's dense path on the padded data) and
``ragged`` (the drawn lengths: ``{dist, lq_mean, lq_max, ld_mean, ld_max, pairs, q_tokens, d_tokens, sims,
padded_sims, padding}``, ``padding`` = ``padded_sims / sims``; null for dense rows) are :data:`OPTIONAL_ROW_FIELDS`,
absent from files written before them. A ragged ``shape`` names ranges as ``Lq_min``/``Lq_max``
(``Ld_min``/``Ld_max``) and a pair list adds ``pool`` and ``P``. The meta's ``host_us`` (the host's state at the
run's start and end, :func:`~maxsim.bench.runner.host_probe`) and a row's (just before its workload's timing) are
absent from files written before them, as is ``partial`` (``"k of n workloads"`` in the JSON a run saves after
each workload, gone once it finishes) and ``pinned_cpu`` (the CPU a GPU run's timing was pinned to,
:mod:`~maxsim.bench.affinity`; null: not pinned).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .peers import IMPL_NAMES
from .runner import Result, Row, best_peer, group_rows, host_note
from .workloads import RAGGED_LAYOUTS, format_shape

SCHEMA = "maxsim-bench/1"
_ROW_PROVENANCE = ("torch", "triton", "cuda", "git_commit")

#: Field -> accepted JSON types, for every row (``None`` allowed where listed).
ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "workload": (str,),
    "mode": (str,),
    "layout": (str,),
    "note": (str,),
    "shape": (dict,),
    "dtype": (str,),
    "impl": (str,),
    "card": (str,),
    "status": (str,),
    "reason": (str, type(None)),
    "ms": (float, int, type(None)),
    "peak_mib": (float, int, type(None)),
    "rel_err": (float, int, type(None)),
    "grad_err": (float, int, type(None)),
    "grad_identity_err": (float, int, type(None)),
    "flops": (float, int, type(None)),
    "bytes": (float, int, type(None)),
    "floor_ms": (float, int, type(None)),
    "floor_frac": (float, int, type(None)),
    "vs_eager": (float, int, type(None)),
    "vs_best_peer": (float, int, type(None)),
    "torch": (str,),
    "triton": (str, type(None)),
    "cuda": (str, type(None)),
    "git_commit": (str, type(None)),
}
#: Fields added later (ragged workloads; the host's state before a workload's timing): always written, but absent
#: from older files.
OPTIONAL_ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "vs_padded": (float, int, type(None)),
    "ragged": (dict, type(None)),
    "host_us": (dict, type(None)),
}
META_FIELDS = (
    "card", "device", "device_name", "dtype", "torch", "triton", "cuda", "git_commit", "date",
    "copy_bandwidth_gbps", "matmul_tflops", "impl_versions", "quick",
)  # fmt: skip
STATUSES = ("ok", "FAIL", "n/a", "skipped", "error")


# ---- JSON --------------------------------------------------------------------------------------------------
def _clean(x: Any) -> Any:
    """Strict JSON has no NaN/inf: write them as null (the row's ``reason`` names the value)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def to_json(result: Result) -> dict[str, Any]:
    """The JSON document of a run (see the module docstring)."""
    rows = []
    for r in result.rows:
        d = r.to_dict()
        for key in _ROW_PROVENANCE:
            d[key] = result.meta.get(key)
        rows.append(_clean(d))
    return {"schema": SCHEMA, "meta": _clean(result.meta), "rows": rows}


def validate_json(doc: dict[str, Any]) -> None:
    """Raise ``ValueError`` listing every way ``doc`` departs from the schema."""
    problems: list[str] = []
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema: expected {SCHEMA!r}, got {doc.get('schema')!r}")
    meta = doc.get("meta")
    if not isinstance(meta, dict):
        problems.append("meta: missing or not an object")
    else:
        problems += [f"meta: missing {k!r}" for k in META_FIELDS if k not in meta]
    rows = doc.get("rows")
    if not isinstance(rows, list):
        problems.append("rows: missing or not a list")
        rows = []
    for i, row in enumerate(rows):
        for key, types in {**ROW_FIELDS, **OPTIONAL_ROW_FIELDS}.items():
            if key not in row:
                if key in ROW_FIELDS:
                    problems.append(f"rows[{i}]: missing {key!r}")
            elif not isinstance(row[key], types) or isinstance(row[key], bool):
                want = [t.__name__ for t in types]
                problems.append(f"rows[{i}].{key}: {type(row[key]).__name__} is not one of {want}")
        extra = set(row) - set(ROW_FIELDS) - set(OPTIONAL_ROW_FIELDS)
        if extra:
            problems.append(f"rows[{i}]: unknown fields {sorted(extra)}")
        if row.get("status") not in STATUSES:
            problems.append(f"rows[{i}].status: {row.get('status')!r} not in {STATUSES}")
        if row.get("status") == "ok" and row.get("ms") is None:
            problems.append(f"rows[{i}]: status ok without ms")
    if problems:
        raise ValueError("invalid benchmark JSON:\n  " + "\n  ".join(problems))


def rows_from_json(doc: dict[str, Any]) -> list[Row]:
    """Rows back from a JSON document (provenance fields dropped; optional fields default to None)."""
    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in r.items() if k in fields}) for r in doc["rows"]]


# ---- formatting --------------------------------------------------------------------------------------------
def fmt_ms(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def fmt_err(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def fmt_mib(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _impls(rows: Iterable[Row]) -> list[str]:
    present = {r.impl for r in rows}
    return [n for n in IMPL_NAMES if n in present] + sorted(present - set(IMPL_NAMES))


def _cell(r: Row | None) -> str:
    if r is None:
        return ""
    if r.status == "ok":
        return fmt_ms(r.ms)
    return {"skipped": "—"}.get(r.status, r.status)


def _table(header: list[str], body: list[list[str]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(header)))
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in pairs)

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, body)])


# ---- terminal ----------------------------------------------------------------------------------------------
def _is_ragged(r: Row) -> bool:
    return r.layout in RAGGED_LAYOUTS


def terminal_table(result: Result) -> str:
    """One line per (workload, implementation); skipped implementations are listed once below. A ``vs padded``
    column appears when the run has ragged workloads."""
    padded = any(_is_ragged(r) for r in result.rows)
    header = ["workload", "impl", "ms", "peak MiB", "rel err", "vs eager", "vs best"]
    header += ["vs padded"] if padded else []
    header += ["% floor", "status"]
    body: list[list[str]] = []
    skipped: dict[str, str] = {}
    for (mode, name), group in group_rows(result.rows).items():
        first = True
        for r in group:
            if r.status == "skipped":
                skipped.setdefault(r.impl, r.reason or "")
                continue
            label = f"{mode}/{name}" if first else ""
            first = False
            err = r.rel_err if r.grad_err is None else max(r.rel_err or 0.0, r.grad_err)
            cells = [
                label, r.impl, fmt_ms(r.ms), fmt_mib(r.peak_mib), fmt_err(err), fmt_ratio(r.vs_eager),
                fmt_ratio(r.vs_best_peer),
            ]  # fmt: skip
            cells += [fmt_ratio(r.vs_padded)] if padded else []
            body.append([*cells, fmt_pct(r.floor_frac), r.status])
    m = result.meta
    lines = [f"card {m.get('card')} ({m.get('device_name')}), {m.get('dtype')}, torch {m.get('torch')}"]
    if m.get("copy_bandwidth_gbps"):
        lines.append(
            f"roofline: copy {m['copy_bandwidth_gbps']:.0f} GB/s, {m.get('matmul_dtype')} matmul "
            f"{m['matmul_tflops']:.0f} TFLOP/s"
        )
    lines += ["", _table(header, body, right=set(range(2, len(header) - 1)))]
    if skipped:
        lines += ["", *(f"{k}: skipped ({v})" for k, v in skipped.items())]
    notes = [f"{r.mode}/{r.workload} {r.impl}: {r.status}: {r.reason}" for r in result.rows
             if r.reason and r.status != "skipped"]  # fmt: skip
    if notes:
        lines += ["", *notes]
    lines.append("")
    lines.append("vs eager / vs best: speed-up over eager / over the fastest other implementation (>1 = faster)")
    if padded:
        lines.append("vs padded: speed-up over maxsim-padded (maxsim.maxsim on the same tokens padded, with masks)")
    lines.append("rel err: max of scores and gradients vs the fp32 reference; % floor: roofline floor / time")
    return "\n".join(lines)


# ---- Markdown ----------------------------------------------------------------------------------------------
def _lengths_cell(r: Row) -> str:
    """``"Lq 14.3/23, Ld 138/1000, pad 11.7x"``: mean/max drawn lengths and the padding factor."""
    g = r.ragged or {}
    if not g:
        return "-"

    def num(x: Any) -> str:
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    return (
        f"Lq {num(g.get('lq_mean'))}/{g.get('lq_max')}, Ld {num(g.get('ld_mean'))}/{g.get('ld_max')}, "
        f"pad {g.get('padding', 0):.1f}x"
    )


def _mode_tables(
    out: list[str], groups: dict[tuple[str, str], list[Row]], keys: list[tuple[str, str]], title: str, label: str
) -> None:
    """One table (and its peak-memory table) of the workloads ``keys``; ragged ones get the lengths and
    ``vs padded`` columns."""
    ragged = any(_is_ragged(groups[k][0]) for k in keys)
    rows = [r for k in keys for r in groups[k]]
    impls = _impls(rows)
    header = ["workload", "shape", *(["lengths (mean/max)"] if ragged else []), "floor ms", *impls]
    header += [*(["vs padded"] if ragged else []), "vs best peer", "% floor"]
    out += ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in keys:
        group = groups[key]
        by_impl = {r.impl: r for r in group}
        first = group[0]
        ours = by_impl.get("maxsim")
        name = f"{first.workload} ({first.note})" if first.note else first.workload
        cells = [name, format_shape(first.shape), *([_lengths_cell(first)] if ragged else [])]
        cells += [fmt_ms(first.floor_ms), *(_cell(by_impl.get(i)) for i in impls)]
        if ragged:
            cells.append(fmt_ratio(ours.vs_padded) if ours is not None else "-")
        if ours is not None:
            cells += [fmt_ratio(ours.vs_best_peer), fmt_pct(ours.floor_frac)]
        else:
            cells += ["-", "-"]
        out.append("| " + " | ".join(cells) + " |")
    if any(r.peak_mib is not None for r in rows):
        out += ["", f"Peak extra memory, MiB ({label}):", ""]
        out += ["| workload | " + " | ".join(impls) + " |", "|" + "---|" * (len(impls) + 1)]
        for key in keys:
            by_impl = {r.impl: r for r in groups[key]}
            cells = [fmt_mib(by_impl[i].peak_mib) if i in by_impl and by_impl[i].status == "ok" else "" for i in impls]
            out.append(f"| {key[1]} | " + " | ".join(cells) + " |")


def _rounds_note(meta: dict) -> str:
    rounds = meta.get("rounds") or 1
    if rounds == 1:
        return ""
    return f"; each workload's implementations timed in {rounds} interleaved rounds, the median of their medians"


def markdown(result: Result) -> str:
    """Per mode, one table of median ms per implementation, with maxsim's speed-up and roofline fraction; ragged
    workloads in tables of their own, with the drawn lengths and maxsim's speed-up over ``maxsim-padded``."""
    m = result.meta
    commit = "+".join(c[:12] for c in (m.get("git_commit") or "unknown").split("+"))
    commit += " (dirty)" if m.get("git_dirty") else ""
    out = [
        f"# maxsim bench — {m.get('card')}",
        "",
        f"{m.get('device_name')}; {m.get('dtype')}; torch {m.get('torch')}, triton {m.get('triton')}, "
        f"CUDA {m.get('cuda')}; commit {commit}; {m.get('date')}.",
    ]
    if m.get("quick"):
        out.append("`--quick` run: tiny shapes under the full-size names (the shape column gives the real ones).")
    if m.get("partial"):
        out.append(f"Partial run: saved after {m['partial']}; the run did not finish.")
    for i, part in enumerate(m.get("parts") or []):
        args = " ".join(part.get("argv") or [])
        out.append(
            f"Run {i + 1} of {len(m['parts'])}: commit {part.get('git_commit')}, {part.get('date')}, `{args}`; "
            f"copy {part.get('copy_bandwidth_gbps') or 0:.0f} GB/s, matmul {part.get('matmul_tflops') or 0:.0f} "
            "TFLOP/s (each workload's rows come from one run)."
            + (f" Host: {host_note(part['host_us'])}." if part.get("host_us") else "")
            + (f" Timed on CPU {part['pinned_cpu']}." if part.get("pinned_cpu") is not None else "")
        )
    if m.get("copy_bandwidth_gbps"):
        out.append(
            f"Measured roofline: copy {m['copy_bandwidth_gbps']:.0f} GB/s, {m.get('matmul_dtype')} matmul "
            f"{m['matmul_tflops']:.0f} TFLOP/s."
        )
    if m.get("pinned_cpu") is not None and not m.get("parts"):
        out.append(
            f"Timed with the calling thread and the autograd engine's threads on one CPU ({m['pinned_cpu']}; "
            "`--no-pin`: wherever the scheduler puts them)."
        )
    if m.get("host_us") and not m.get("parts"):
        out.append(
            f"Host state (calls no implementation takes part in, host time per call): {host_note(m['host_us'])}."
        )
    out += [
        "",
        f"Median ms (lower is better){_rounds_note(m)}. `vs best peer`: the fastest other implementation's time "
        "over maxsim's (>1 = maxsim faster). `% floor`: roofline floor / maxsim's time. Rows named `...-host`: "
        "the calling thread's time per call, calls back to back (launch overhead), not device time. FAIL = wrong "
        "result (not ranked); "
        "n/a = not covered by that implementation; — = implementation not available.",
    ]
    groups = group_rows(result.rows)
    titles = {"infer": "Inference (forward)", "train": "Training (forward + backward)"}
    for mode in ("infer", "train"):
        keys = [k for k in groups if k[0] == mode and not _is_ragged(groups[k][0])]
        if keys:
            _mode_tables(out, groups, keys, titles[mode], mode)
    ragged_keys = [k for k in groups if _is_ragged(groups[k][0])]
    if ragged_keys:
        out += [
            "",
            "Ragged workloads: packed tokens with offsets (`varlen`: every query against every document; "
            "`pairlist`: a shuffled list of (query, document) pairs, each query with K candidates from a pool). "
            "`maxsim` = `maxsim.maxsim_varlen` / `maxsim.maxsim_pairs_varlen` on the packed tokens; "
            "`maxsim-padded` = `maxsim.maxsim` with masks on the same tokens padded to the batch maxima (cross "
            "for varlen, candidates for pair lists; the padded copy is made before timing); eager and compile run "
            "on that padded copy; peers use their ragged entry points. `lengths`: mean/max drawn lengths and "
            "`pad` = padded similarities / real ones. `vs padded`: maxsim-padded's time over maxsim's (>1 = the "
            "ragged path is faster); on a dense-equivalent pair list maxsim-padded is the dense candidates path.",
        ]
    for mode in ("infer", "train"):
        keys = [k for k in ragged_keys if k[0] == mode]
        if keys:
            _mode_tables(out, groups, keys, f"Ragged {titles[mode][0].lower()}{titles[mode][1:]}", f"ragged {mode}")
    notes = [r for r in result.rows if r.reason and r.status != "skipped"]
    skipped = {r.impl: r.reason for r in result.rows if r.status == "skipped"}
    if notes or skipped:
        out += ["", "## Notes", ""]
        out += [f"- `{k}` not available: {v}" for k, v in skipped.items()]
        out += [f"- `{r.mode}/{r.workload}` {r.impl}: {r.status}: {r.reason}" for r in notes]
    return "\n".join(out) + "\n"


# ---- chart -------------------------------------------------------------------------------------------------
def _log2_ticks(lo: float, hi: float, most: int = 8) -> list[float]:
    """Powers of two within ``[lo, hi]``, 1 always among them, thinned to at most ``most``."""
    k_lo, k_hi = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
    step = max(1, math.ceil((k_hi - k_lo + 1) / most))
    return [2.0**k for k in range(k_lo, k_hi + 1) if k % step == 0]


def write_png(result: Result, path: Path) -> str | None:
    """Speed-up of maxsim over the best peer per workload, and the fraction of the roofline floor reached by
    maxsim and the best peer. Ragged workloads come last, below a dashed line, with a black diamond at maxsim's
    speed-up over ``maxsim-padded`` (the same data padded, on the dense path). Returns None, or why no chart
    was written (matplotlib missing, no maxsim rows)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib not importable ({e}); install maxsim[bench]"
    groups = list(group_rows(result.rows).items())
    if not any(r.impl == "maxsim" for _, g in groups for r in g):
        return "no maxsim rows to chart"
    groups = [g for g in groups if not _is_ragged(g[1][0])] + [g for g in groups if _is_ragged(g[1][0])]
    n_dense = sum(not _is_ragged(g[0]) for _, g in groups)
    labels, speedups, ours_frac, peer_frac, peer_names, vs_padded = [], [], [], [], [], []
    for (mode, name), group in groups:
        ours = next((r for r in group if r.impl == "maxsim"), None)
        best = best_peer(group)
        labels.append(f"{mode}/{name}")
        vs_padded.append(ours.vs_padded if ours and ours.vs_padded else None)
        speedups.append(ours.vs_best_peer if ours and ours.vs_best_peer else None)
        ours_frac.append(ours.floor_frac if ours and ours.floor_frac else None)
        peer_frac.append(best.floor_frac if best and best.floor_frac else None)
        peer_names.append(best.impl if best else "")
    has_floor = any(x is not None for x in ours_frac + peer_frac)
    height = max(3.0, 0.32 * len(labels) + 1.2)
    fig, axes = plt.subplots(1, 2, figsize=(14, height), sharey=True)
    ys = list(range(len(labels)))[::-1]
    ax = axes[0]
    ranked = [v for v in speedups + vs_padded if v is not None]
    lo = min([1.0, *ranked]) / 1.6
    hi = max([1.0, *ranked]) * 1.6
    for y, v in zip(ys, speedups, strict=True):
        if v is not None:  # a bar from 1 to the speed-up, on a log axis
            ax.barh(y, v - 1.0, left=1.0, color="tab:green" if v >= 1 else "tab:red")
    ax.set_xscale("log")
    ax.set_xlim(lo, hi * 2.5)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    ax.xaxis.set_minor_locator(NullLocator())  # minor log labels overlap
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_major_locator(FixedLocator(_log2_ticks(lo, hi * 2.5)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if v >= 1 else f"1/{1 / v:g}x"))
    ax.tick_params(axis="x", labelsize=8)
    ax.axvline(1.0, color="black", lw=1)
    for y, v, peer, pad in zip(ys, speedups, peer_names, vs_padded, strict=True):
        text = f" {v:.2f}x vs {peer}" if v is not None else " maxsim not ranked (FAIL/n/a/error)"
        if pad is not None:
            text += f"; {pad:.2f}x vs padded"
        ax.text(max(v, 1.0) if v is not None else 1.0, y, text, va="center", fontsize=7)
    pads = [(y, v) for y, v in zip(ys, vs_padded, strict=True) if v is not None]
    if pads:
        ax.plot([v for _, v in pads], [y for y, _ in pads], "D", color="black", ms=4)
    if 0 < n_dense < len(labels):
        for a in axes:
            a.axhline(ys[n_dense - 1] - 0.5, color="gray", lw=0.8, ls="--")
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xlabel("maxsim speed-up over the best peer (bars) and over maxsim-padded (◆) (log scale, >1 = faster)")
    ax = axes[1]
    if has_floor:
        h = 0.4
        ax.barh([y + h / 2 for y in ys], [v or 0.0 for v in ours_frac], height=h, label="maxsim")
        ax.barh([y - h / 2 for y in ys], [v or 0.0 for v in peer_frac], height=h, label="best peer")
        ax.set_xlim(0, max([1.0, *(v or 0 for v in ours_frac + peer_frac)]) * 1.05)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xlabel("fraction of the roofline floor (floor ms / ms)")
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no roofline floor on this device", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
    m = result.meta
    fig.suptitle(f"maxsim bench — {m.get('card')} ({m.get('device_name')}), {m.get('dtype')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def save_json(result: Result, out_dir: Path | str) -> Path:
    """Write ``<card>.json`` into ``out_dir`` (created if needed) through a temporary file and a rename, so that a
    run killed while writing leaves the previous file whole; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = to_json(result)
    validate_json(doc)
    path = out / f"{result.meta.get('card') or 'unknown'}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def write_outputs(result: Result, out_dir: Path | str, log=print, write_json: bool = True) -> list[Path]:
    """Write ``<card>.json``, ``<card>.md`` and ``<card>.png`` into ``out_dir`` (created if needed).

    ``write_json=False`` re-renders only the Markdown and the chart (from a saved JSON: see :func:`load`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = str(result.meta.get("card") or "unknown")
    paths: list[Path] = []
    if write_json:
        paths.append(save_json(result, out))
    paths.append(out / f"{stem}.md")
    paths[-1].write_text(markdown(result))
    png = out / f"{stem}.png"
    why = write_png(result, png)
    if why is None:
        paths.append(png)
    else:
        log(f"no chart: {why}")
    return paths


def merge(results: list[Result]) -> Result:
    """One report of several runs on the same card and dtype (e.g. inference and training run as two device calls):
    rows of later runs replace the same (mode, workload, implementation) of earlier ones. Each row keeps its own
    provenance, and every workload's implementations come from one run, so ratios stay within a run; the meta data
    lists the runs under ``parts``."""
    first = results[0].meta
    for r in results[1:]:
        for key in ("card", "dtype", "quick"):
            if r.meta.get(key) != first.get(key):
                raise ValueError(f"cannot merge runs with different {key}: {first.get(key)!r} vs {r.meta.get(key)!r}")
    rows: dict[tuple, Row] = {}
    for r in results:
        for row in r.rows:
            rows[(row.mode, row.workload, row.impl)] = row
    keys = ("git_commit", "date", "argv", "copy_bandwidth_gbps", "matmul_tflops", "host_us", "pinned_cpu")
    parts = [part for r in results for part in (r.meta.get("parts") or [{k: r.meta.get(k) for k in keys}])]
    meta = dict(first)
    meta["git_commit"] = "+".join(dict.fromkeys(str(p.get("git_commit")) for p in parts))
    meta["parts"] = parts
    return Result(meta=meta, rows=list(rows.values()))


def load(path: Path | str) -> Result:
    """A run back from its JSON file (validated), e.g. to draw the chart on a machine with matplotlib."""
    doc = json.loads(Path(path).read_text())
    validate_json(doc)
    return Result(meta=doc["meta"], rows=rows_from_json(doc))
