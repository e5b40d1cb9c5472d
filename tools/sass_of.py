"""The forward kernels one call would launch, compiled for sm_90 on a machine without a GPU: their constexprs,
registers, spills, shared memory and the SASS instructions of their tile loops (what ``tools/compile_check.py``
reports for every variant, here for one shape), with the launch rules of a card named on the command line.

Usage:
  python tools/sass_of.py NQ K LQ LD DIM [--candidates] [--masked] [--normalize] [--argmax] [--card "NVIDIA H200"]
                          [--l2-mib 50] [--sms 132] [--set NAME=VALUE ...] [--dump DIR]

``--candidates``: ``D [NQ, K, LD, DIM]`` (each query's own documents), else ``[1, K, LD, DIM]`` shared; ``--masked``:
an all-true document mask; ``--set``: launch settings (``launch_settings.NAME``), as tools/knobs.py takes them;
``--dump``: each kernel's TTGIR, PTX and SASS written to DIR (``k<i>.{ttgir,ptx,sass}``, in launch order).

The device's compiler: the lent GPUs run Triton 3.6, whose registers differ from this machine's 3.9 (the masked and
normalized 1x5000 Lq64 forward: 168 there, 128 here). Its wheel compiles here too, and then agrees with ncu on the
device (168, 159, 225 and 198 registers for docs/performance.md v137-v138's four kernels):

  pip download --no-deps triton==3.6.0 -d /tmp/triton36-wheel
  pip install --no-deps --target /tmp/triton36 /tmp/triton36-wheel/triton-3.6.0-*.whl
  PYTHONPATH=/tmp/triton36:src:tools python tools/sass_of.py 1 5000 64 180 128 --masked --normalize

(``/tmp``: the checkout's ignored folders travel to the device, within 64 MiB.) compile_check.py takes it the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.argv, _argv = sys.argv[:1] + ["--sass"], sys.argv  # (compile_check reads its mode from the command line)
import compile_check  # noqa: E402  (tools/ is on sys.path when this runs as a script)

sys.argv = _argv

from maxsim.kernels import device_info, launch, launch_args, launch_settings, launcher  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("nq", "k", "lq", "ld", "dim"):
        ap.add_argument(name, type=int)
    ap.add_argument("--candidates", action="store_true")
    ap.add_argument("--masked", action="store_true")
    ap.add_argument("--normalize", action="store_true")
    ap.add_argument("--argmax", action="store_true", help="the training forward (with the argmax)")
    ap.add_argument("--card", default="NVIDIA H200", help="the card name the launch rules see")
    ap.add_argument("--l2-mib", type=float, default=50.0, help="the L2 size the launch rules see")
    ap.add_argument("--sms", type=int, default=132, help="the multiprocessors the launch rules see")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--dump", type=Path, help="write each kernel's TTGIR, PTX and SASS here")
    args = ap.parse_args()

    for assign in args.set:
        name, value = assign.split("=", 1)
        if not hasattr(launch_settings, name):
            raise SystemExit(f"no launch setting {name!r}")
        setattr(launch_settings, name, int(value, 0))
    launcher.Launcher.__call__ = compile_check.fake_call
    launcher.INTERPRETER = launch_args.INTERPRETER = False
    device_info.INTERPRETER_SMS = args.sms
    device_info.card_name = lambda device: args.card
    device_info.l2_bytes = lambda device: int(args.l2_mib * 2**20)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        compile_fn, count = triton.compile, [0]

        def dumping(src, target=None, options=None):
            compiled = compile_fn(src, target=target, options=options)
            count[0] += 1
            stem = args.dump / f"k{count[0]}"
            stem.with_suffix(".ttgir").write_text(compiled.asm["ttgir"])
            stem.with_suffix(".ptx").write_text(compiled.asm["ptx"])
            stem.with_suffix(".sass").write_text(compile_check.disassemble(compiled.asm["cubin"]))
            return compiled

        triton.compile = dumping

    dt = torch.bfloat16
    Q = torch.randn(args.nq, args.lq, args.dim, dtype=dt)
    D = torch.randn(args.nq if args.candidates else 1, args.k, args.ld, args.dim, dtype=dt)  # (the canonical layout)
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool) if args.masked else None
    launch.forward(Q, D, None, d_mask, args.normalize, args.argmax)
    if compile_check.failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
