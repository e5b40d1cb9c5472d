"""Interleaved A/B of this checkout's maxsim against an older commit's, in one process, on the bench's workloads
(and tools/offmatrix.py's).

Host-bound rows (small training steps, tiny inference) move by 2x between calls on the lent machines, so two runs of
``maxsim bench`` cannot tell a 10 % change from noise. Here both versions run in the same process, alternating (7
rounds, order reversed every other round, ``triton.testing.do_bench`` with its L2 flush, as the bench; host-timed
rows with the bench's host timer), and each row reports the median and the minimum of both.

Usage:
  python tools/ab_steps.py --make-old REV            # here: .devdata/oldpkg/maxsim_old from `git archive REV`
  PYTHONPATH=src:.devdata/oldpkg python tools/ab_steps.py train|infer [PATTERN ...] [--normalize]
                                                      [--masked [all|prefix|holes]] [--profile]
                                                      [--shape LAYOUT:NQxNDxLQxLD[xDIM]]  # GPU
                                                      # (carry .devdata)
  PYTHONPATH=src python tools/ab_steps.py train|infer [PATTERN ...] --normalize-cost   # normalize=True vs False
  PYTHONPATH=src:.devdata/oldpkg python tools/ab_steps.py train|infer [PATTERN ...] --cpu   # here: --quick shapes
                                                      # on the CPU, perf_counter medians, eager beside

The old copy is importable as ``maxsim_old``: its relative imports make it self-contained, and its operators are
registered as ``maxsim_old::*`` so that both versions coexist.
"""

from __future__ import annotations

import argparse
import functools
import io
import shutil
import statistics
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD = ROOT / ".devdata" / "oldpkg" / "maxsim_old"


def make_old(rev: str) -> None:
    data = subprocess.run(["git", "archive", rev, "src/maxsim"], cwd=ROOT, capture_output=True, check=True).stdout
    shutil.rmtree(OLD, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            if m.isfile():
                dest = OLD / Path(m.name).relative_to("src/maxsim")
                dest.parent.mkdir(parents=True, exist_ok=True)
                text = tar.extractfile(m).read()
                dest.write_bytes(text.replace(b'"maxsim::', b'"maxsim_old::') if dest.name == "ops.py" else text)
    print(f"wrote {OLD} from {rev}")


def _with_document_mask(fn, kind: str):
    """``fn`` called with a ``d_mask`` of ``D``'s token shape, of probe_common's ``kind`` (one mask per shape, made
    once, as a training loop's collate would hand it over; the same for both versions)."""
    masks: dict = {}

    def call(Q, D, **kw):
        mask = masks.get(D.shape[:-1])
        if mask is None:
            from probe_common import document_mask

            mask = masks[D.shape[:-1]] = document_mask(D.shape[:-1], kind, D.device)
        return fn(Q, D, d_mask=mask, **kw)

    return call


def _scorers(lib, normalize: bool, masked: str | None = None) -> tuple:
    """The library's four entry points for MaxsimImpl, with ``normalize`` set and, with ``masked`` (a mask kind),
    a document mask on the dense ones."""
    fns = (lib.maxsim, lib.maxsim_pairs, lib.maxsim_varlen, lib.maxsim_pairs_varlen)
    if masked:
        fns = (_with_document_mask(fns[0], masked), _with_document_mask(fns[1], masked), *fns[2:])
    return tuple(functools.partial(f, normalize=True) for f in fns) if normalize else fns


def compare(
    mode: str, patterns: list[str] | None, rounds: int, normalize: bool = False, plain: bool = False,
    profile: bool = False, cpu: bool = False, masked: str | None = None, shapes: list[str] | None = None,
) -> None:  # fmt: skip
    import torch
    from offmatrix import OFF_MATRIX  # (tools/ is on sys.path when this runs as a script)
    from probe_common import parse_shape
    from triton.testing import do_bench

    import maxsim
    from maxsim.bench.peers import EagerImpl, MaxsimImpl
    from maxsim.bench.runner import _cpu_ms, make_call, make_host_timer
    from maxsim.bench.workloads import RAGGED_LAYOUTS, WORKLOADS, make_inputs, seed_of, select

    dev, dt = (torch.device("cpu"), torch.float32) if cpu else (torch.device("cuda"), torch.bfloat16)
    if plain:  # "old" is this version without normalize: what normalize=True costs
        impls = {"new": MaxsimImpl(*_scorers(maxsim, True)), "old": MaxsimImpl(*_scorers(maxsim, False))}
    else:
        import maxsim_old

        impls = {
            "new": MaxsimImpl(*_scorers(maxsim, normalize, masked)),
            "old": MaxsimImpl(*_scorers(maxsim_old, normalize, masked)),
        }
    if cpu:  # (eager on the bench's padded copies for ragged rows: the CPU record's peer)
        impls["eager"] = EagerImpl()
    extra = [parse_shape(mode, text) for text in shapes or ()]
    chosen = select(mode=mode, only=patterns, quick=cpu, table=WORKLOADS + OFF_MATRIX) if patterns or not extra else []
    for w in chosen + extra:
        inp = make_inputs(w, dev, dt, seed_of(w))
        calls = {}
        for name, impl in impls.items():
            if w.layout in RAGGED_LAYOUTS:
                fn, operands = impl.prepare_ragged(w, inp, dev, dt)
            else:
                fn, operands = impl.scorer(w, dev, dt), inp
            calls[name] = make_call(w, fn, operands)
        times: dict[str, list[float]] = {n: [] for n in calls}
        # (a host-timed row, as the bench times it: the calling thread's time per call)
        timer = make_host_timer(dev, 10, 40) if w.timing == "host" else (lambda c: do_bench(c, warmup=10, rep=40))
        if cpu:
            timer = lambda c: _cpu_ms(c, 10, 50)  # noqa: E731
        for r in range(rounds):
            for n, c in calls.items() if r % 2 == 0 else reversed(calls.items()):
                times[n].append(timer(c) * 1e3)
        med = {n: statistics.median(v) for n, v in times.items()}
        print(
            f"{mode:5s} {w.name:45s} new {med['new']:8.1f} us  old {med['old']:8.1f} us  new/old "
            f"{med['new'] / med['old']:5.2f}   (min new {min(times['new']):7.1f} old {min(times['old']):7.1f})"
            + (f"  eager {med['eager']:8.1f} us" if "eager" in med else ""),
            flush=True,
        )
        if profile:
            from probe_common import kernel_table

            for n, c in calls.items():
                kernel_table(f"{w.name} {n}", c, rows=6)
        del inp, calls
        if not cpu:
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", choices=("train", "infer"))
    ap.add_argument("patterns", nargs="*")
    ap.add_argument("--make-old", metavar="REV")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--normalize", action="store_true", help="both versions called with normalize=True")
    ap.add_argument("--normalize-cost", action="store_true", help="this version with normalize=True against without")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel of both versions (torch.profiler)")
    ap.add_argument("--cpu", action="store_true", help="on this CPU, --quick shapes, fp32, eager beside")
    ap.add_argument(
        "--masked", nargs="?", const="all", choices=("all", "prefix", "holes"),
        help="dense calls of both versions with a d_mask: all True (the default), kept prefixes, prefixes with holes",
    )  # fmt: skip
    ap.add_argument("--shape", action="append", default=[], help="a shape of no table: LAYOUT:NQxNDxLQxLD[xDIM]")
    args = ap.parse_args()
    if args.make_old:
        make_old(args.make_old)
    if args.mode:
        compare(
            args.mode, args.patterns or None, args.rounds, args.normalize, args.normalize_cost, args.profile, args.cpu,
            args.masked, args.shape,
        )  # fmt: skip


if __name__ == "__main__":
    main()
