"""A thinner way to launch a ``@triton.jit`` kernel whose compiled variant is already known.

``kernel[grid](...)`` re-derives the specialization of every argument, formats a cache key and builds launch
metadata on each call: about 20 µs of host time on an H200's host, more than the GPU work of a small call. Here the
first launch of a given argument signature goes through Triton (which compiles or finds the variant); later launches
with the same signature call the compiled kernel directly (about 6 µs).

The signature is exact, not a guess: sizes and strides are part of it as values, tensors by dtype and 16-byte
alignment, which is everything Triton specializes on. A new size is therefore one slow launch (Triton finds the
variant it already compiled; nothing is recompiled), then fast. Profiling hooks (``knobs.runtime.launch_*_hook``)
and the interpreter always take Triton's own path.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ENTRIES = 1024
#: Options every compile asks for. Fused multiply-adds: the kernels were measured, and their rounding compared from
#: one variant to another, with them. They were Triton's default through 3.9 (which warns that the default is
#: unset); 3.10 turns them off unless asked.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def _hooked(hook: Any) -> bool:
    """A launch hook is installed: a callable, or a non-empty ``HookChain`` (newer Triton never holds None)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def current_device() -> int:
    # torch.cuda.current_device() without its lazy-init check (~2 µs): a launch only follows CUDA tensors, so
    # CUDA is initialized.
    return torch._C._cuda_getDevice()


def _device_of(t: torch.Tensor) -> int:
    return t.get_device()


def hooks_installed() -> bool:
    """A launch hook is installed (a profiler's): launches must then take Triton's own path, which calls it."""
    rt = _runtime_knobs()
    return rt is not None and (_hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook))


def _runtime_knobs() -> Any:
    global _RUNTIME
    if _RUNTIME is None and not INTERPRETER:
        from triton import knobs

        _RUNTIME = knobs.runtime
    return _RUNTIME


_RUNTIME: Any = None


def current_stream(device: int) -> int:
    """The raw CUDA stream current on ``device`` (what Triton's launches take)."""
    return torch._C._cuda_getCurrentRawStream(device)


class Launcher:
    """``Launcher(kernel)(grid, tensors, ints, constexprs, num_warps, num_stages, maxnreg=...)`` ≡
    ``kernel[(grid,)](*tensors, *ints, **constexprs, num_warps=..., num_stages=..., maxnreg=...)``, for kernels whose
    parameters are pointers, then integers, then constexprs (``maxnreg`` 0: no register cap)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # (Under the interpreter the kernel is an InterpretedFunction, launched the plain way only.)
        self._names = [] if INTERPRETER else [kernel.arg_names[i] for i in kernel.constexprs]
        self._known: OrderedDict[tuple, tuple] = OrderedDict()
        self._runtime_knobs = None
        if not INTERPRETER:
            from triton import knobs  # (once here, not per launch)

            self._runtime_knobs = knobs.runtime

    def __call__(
        self,
        grid: int,
        tensors: tuple,
        ints: tuple,
        constexprs: dict,
        num_warps: int,
        num_stages: int = 3,
        plan_cache: dict | None = None,
        maxnreg: int = 0,
        foreign: tuple | None = None,
        pointers: tuple | None = None,
    ) -> None:
        """``plan_cache``: a dict owned by a caller whose launches always pass the same constexprs, options and
        tensor dtypes, and integers that Triton specializes alike (the same values but for packed row counts of one
        :func:`~.launch_args.rows_class`): a launch plan; its entries are keyed by the device and the tensors'
        alignments only, which is most of the host time a launch saves. ``foreign``: with a plan cache, the tensors
        among ``tensors`` whose alignment is not known (the caller's); the others must be fresh allocations of PyTorch's
        caching allocator, whose blocks are 512-byte aligned, or repeats of foreign ones (each ``data_ptr`` read
        costs ~0.1 µs of host time; a launch passes up to 17 pointers). ``pointers``: the ``data_ptr()`` of each of
        ``tensors``, read by a caller that knows which of them are one tensor passed again (unused slots hold a
        placeholder), so that it reads each pointer once."""
        if INTERPRETER:  # (which has no registers to cap)
            self.kernel[(grid,)](*tensors, *ints, **constexprs, num_warps=num_warps, num_stages=num_stages)
            return
        device = _device_of(tensors[0])
        if device != current_device() and device >= 0:  # (a CPU or meta tensor's -1: no device to switch to)
            # Triton compiles for, and launches on, the current device; tensors on another GPU (cuda:1 while cuda:0
            # is current) would get device 0's kernel run on device 1's pointers. Rare, so a guard only here.
            with torch.cuda.device(device):
                self(grid, tensors, ints, constexprs, num_warps, num_stages, plan_cache, maxnreg, foreign, pointers)
            return
        rt = self._runtime_knobs
        hooks = _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook)
        if plan_cache is None:
            short_key = None
        else:
            short_key = (device, *[t.data_ptr() & 15 for t in (tensors if foreign is None else foreign)])
        hit = None if hooks or short_key is None else plan_cache.get(short_key)
        if hit is None:
            # Everything Triton specializes on: integer values (a superset of "== 1" and "divisible by 16"), tensor
            # dtypes and 16-byte alignment, the constexprs and the launch options.
            key = (
                device, num_warps, num_stages, maxnreg, ints, tuple(constexprs.values()),
                tuple([(t.dtype, t.data_ptr() & 15) for t in tensors]),
            )  # fmt: skip
            hit = None if hooks else self._known.get(key)
            if hit is None:
                cap = {"maxnreg": maxnreg} if maxnreg else {}
                compiled = self.kernel[(grid,)](
                    *tensors, *ints, **constexprs, num_warps=num_warps, num_stages=num_stages, **cap,
                    **COMPILE_OPTIONS,
                )  # fmt: skip
                if hooks or compiled is None:
                    return
                values = tuple(constexprs[name] for name in self._names)
                hit = self._known[key] = (compiled.run, compiled.function, compiled.packed_metadata, values)
                if len(self._known) > MAX_ENTRIES:
                    self._known.popitem(last=False)
                if plan_cache is not None:
                    plan_cache[short_key] = hit
                return
            if plan_cache is not None:
                plan_cache[short_key] = hit
        run, function, metadata, values = hit
        # Pointers as integers: given a tensor, Triton's launcher reads its pointer and has the driver check it
        # (cuPointerGetAttribute), ~0.15 µs an argument on an H200's host, against ~0.08 for data_ptr() here.
        if pointers is None:
            pointers = [t.data_ptr() for t in tensors]
        run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(device), function, metadata, None, None, None,
            *pointers, *ints, *values)  # fmt: skip

    @staticmethod
    def lean_entry(plan_cache: dict, short_key: tuple, ints: tuple) -> tuple | None:
        """``(run, function, metadata, tail)`` of the launch that ``plan_cache`` (see :meth:`__call__`) holds under
        ``short_key`` (the device and the foreign tensors' alignments), ``tail`` being what follows the pointers in
        its call (``ints``, then the constexprs' values) as one tuple; None if it holds none. For callers that
        repeat one launch of fixed integers and check :func:`hooks_installed` and the current device themselves:
        ``run(grid, 1, 1, current_stream(device), function, metadata, None, None, None, *pointers, *tail)``."""
        hit = plan_cache.get(short_key)
        return None if hit is None else (hit[0], hit[1], hit[2], (*ints, *hit[3]))
