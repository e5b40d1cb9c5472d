"""Does an L2 access-policy window (streaming) over the documents shorten a large once-read scan? (GPU only.)

The bench's flush leaves the L2 full of dirty lines; a scan that allocates its own lines with the default policy
evicts them, and their write-back competes with its reads (tools/flush_probe.py: 3-8 % of a 200+ MB scan). The
streaming forward's loads carry ``evict_first``; the pipelined loop's asynchronous copies cannot. A stream's
access-policy window (``cuStreamSetAttribute``, CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW) marks every access to an
address range as streaming, whatever instruction makes it. This times the bench's scans under ``do_bench`` (its
flush) on a side stream, without and with a window over D (as large as the driver accepts), interleaved.

Usage: python tools/l2_policy_probe.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics

import torch
from triton.testing import do_bench

import maxsim

ATTR_ACCESS_POLICY_WINDOW = 1  # CUlaunchAttributeID / CUstreamAttrID
NORMAL, STREAMING = 0, 1  # CUaccessProperty


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]  # fmt: skip


class _Value(ctypes.Union):
    _fields_ = [("window", _Window), ("pad", ctypes.c_char * 64)]


_cuda = ctypes.CDLL("libcuda.so.1")


def set_window(stream: int, base: int, nbytes: int) -> int:
    """A streaming window over ``[base, base + nbytes)`` on ``stream`` (``nbytes`` 0: none); the driver's result."""
    v = _Value()
    v.window = _Window(base, nbytes, 1.0, STREAMING, NORMAL)
    return _cuda.cuStreamSetAttribute(ctypes.c_void_p(stream), ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(v))


SCANS = {  # name: (Q shape, D shape)
    "cand-32x100-lq32-ld256": ((32, 32, 128), (32, 100, 256, 128)),
    "cross-1x1000-lq32-ld1024": ((1, 32, 128), (1000, 1024, 128)),
    "cross-1x5000-lq64-ld180": ((1, 64, 128), (5000, 180, 128)),
    "cross-1x1000-lq32-ld300": ((1, 32, 128), (1000, 300, 128)),
    "cand-32x50-lq32-ld180": ((32, 32, 128), (32, 50, 180, 128)),
    "cross-1x10000-lq32-ld300": ((1, 32, 128), (10000, 300, 128)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.cuda.init()
    side = torch.cuda.Stream()
    handle = side.cuda_stream
    print(f"{torch.cuda.get_device_name()}; legacy stream accepts a window: "
          f"{set_window(0, 0, 0) == 0}", flush=True)  # fmt: skip
    for name, (qs, ds) in SCANS.items():
        Q = torch.randn(qs, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(ds, device="cuda", dtype=torch.bfloat16)
        nbytes = D.numel() * D.element_size()
        # the largest window the driver takes (its maximum is a device attribute; halve until accepted)
        win = nbytes
        while win and set_window(handle, D.data_ptr(), win) != 0:
            win //= 2
        set_window(handle, 0, 0)
        times: dict[str, list[float]] = {"plain": [], "window": []}
        with torch.cuda.stream(side), torch.no_grad():
            for r in range(args.rounds):
                for label in ("plain", "window") if r % 2 == 0 else ("window", "plain"):
                    set_window(handle, D.data_ptr(), win if label == "window" else 0)
                    times[label].append(do_bench(lambda: maxsim.maxsim(Q, D), warmup=10, rep=40) * 1e3)
            set_window(handle, 0, 0)
        plain, window = statistics.median(times["plain"]), statistics.median(times["window"])
        print(f"{name:28s} {nbytes / 2**20:6.0f} MiB  window {win / 2**20:6.0f} MiB  plain {plain:7.1f} us  "
              f"window {window:7.1f} us  x{window / plain:5.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
