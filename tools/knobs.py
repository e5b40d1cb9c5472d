"""Interleaved A/B of launch settings (module constants of ``maxsim.kernels.launch``) in one process.

Each variant is a set of ``NAME=VALUE`` assignments; the bench's workloads (and tools/offmatrix.py's) run under
every variant in turn (plans cleared at each switch), 7 rounds by default, ``triton.testing.do_bench`` with its L2
flush, then each variant's peak extra memory (the bench's measure) and a per-kernel
GPU profile. Host-bound rows move by 2x between calls on the lent
machines: only variants timed side by side in one process are compared.

Usage (on the GPU):
  python tools/knobs.py train 'cross-64x64-lq23-ld333-d96' --variant base: \\
      --variant owner:SHARED_OWNER_MAX_WORK=0x10000000000
  python tools/knobs.py infer --shape cross:1x200x64x180 --shape candidates:2x50x64x300x96 --masked --normalize \\
      --variant new: --variant nocap:DOC_ROWS_SUMS_MAXNREG=0      (``--shape``: a dense shape of no table)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from ab_steps import _scorers  # tools/ is on sys.path when this runs as a script
from offmatrix import OFF_MATRIX, WIDE
from probe_common import MASK_KINDS, kernel_table, parse_shape
from triton.testing import do_bench

import maxsim
from maxsim import layout
from maxsim.bench.peers import MaxsimImpl
from maxsim.bench.runner import make_call, peak_extra_mib
from maxsim.bench.workloads import RAGGED_LAYOUTS, WORKLOADS, make_inputs, seed_of, select
from maxsim.kernels import configs, launch_backward, launch_forward, launch_settings

MODULES = {"launch_settings": launch_settings, "configs": configs, "layout": layout}


def _owner(name: str) -> tuple[object, str]:
    """``configs.X`` / ``layout.X`` -> (that module, ``X``); a bare name is ``launch_settings``'."""
    module, _, attr = name.rpartition(".")
    return MODULES[module or "launch_settings"], attr


def parse_variant(text: str) -> tuple[str, dict[str, float]]:
    """``label:NAME=VALUE,NAME=VALUE`` -> ``(label, {NAME: int(VALUE)})``; ``NAME`` is a launch setting or,
    written ``configs.NAME``, of the launch table (``layout.NAME``: of maxsim.layout)."""
    label, _, assigns = text.partition(":")
    settings = {}
    for a in filter(None, assigns.split(",")):
        name, value = a.split("=", 1)
        module, attr = _owner(name)
        if not hasattr(module, attr):
            raise SystemExit(f"no setting {name!r}")
        try:
            settings[name] = int(value, 0)
        except ValueError:  # (a float setting)
            settings[name] = float(value)
    return label, settings


def apply(settings: dict[str, int], defaults: dict[str, object]) -> None:
    for name, value in defaults.items():
        setattr(*_owner(name), value)
    for name, value in settings.items():
        setattr(*_owner(name), type(defaults[name])(value))
    configs.backward_config.cache_clear()
    configs.forward_config.cache_clear()
    launch_backward.plans.clear()
    launch_forward.plans.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("train", "infer"))
    ap.add_argument("patterns", nargs="*")
    ap.add_argument("--variant", action="append", required=True, help="label:NAME=VALUE,...")
    ap.add_argument("--shape", action="append", default=[], help="a shape of no table: LAYOUT:NQxNDxLQxLD[xDIM]")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--normalize", action="store_true", help="maxsim called with normalize=True")
    ap.add_argument(
        "--masked", nargs="?", const="all", choices=MASK_KINDS,
        help="maxsim called with a d_mask: all True (the default), kept prefixes, prefixes with holes",
    )  # fmt: skip
    args = ap.parse_args()
    variants = dict(parse_variant(v) for v in args.variant)
    names = {n for s in variants.values() for n in s}
    defaults = {n: getattr(*_owner(n)) for n in names}
    dev, dt = torch.device("cuda"), torch.bfloat16
    plain = not (args.normalize or args.masked)
    impl = MaxsimImpl() if plain else MaxsimImpl(*_scorers(maxsim, args.normalize, args.masked))
    table = WORKLOADS + OFF_MATRIX + WIDE
    shapes = [parse_shape(args.mode, text) for text in args.shape]
    chosen = select(mode=args.mode, only=args.patterns, table=table) if args.patterns or not shapes else []
    for w in chosen + shapes:
        inp = make_inputs(w, dev, dt, seed_of(w))
        if w.layout in RAGGED_LAYOUTS:
            fn, operands = impl.prepare_ragged(w, inp, dev, dt)
        else:
            fn, operands = impl.scorer(w, dev, dt), inp
        call = make_call(w, fn, operands)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            order = list(variants.items()) if r % 2 == 0 else list(reversed(variants.items()))
            for label, settings in order:
                apply(settings, defaults)
                times[label].append(do_bench(call, warmup=10, rep=40) * 1e3)
        base = statistics.median(next(iter(times.values())))
        for label, t in times.items():
            med = statistics.median(t)
            apply(variants[label], defaults)
            call()  # (compiled and planned before the memory is read)
            mib = peak_extra_mib(call, dev)
            print(f"{args.mode:5s} {w.name:45s} {label:12s} {med:8.1f} us  x{med / base:5.2f} of the first  "
                  f"(min {min(t):7.1f})  peak {mib:6.2f} MiB", flush=True)  # fmt: skip
        if not args.no_profile:
            for label, settings in variants.items():
                apply(settings, defaults)
                kernel_table(f"{w.name} {label}", call, rows=6)
        apply({}, defaults)
        del inp, call
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
