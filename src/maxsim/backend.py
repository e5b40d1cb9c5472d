"""Which implementation runs a call: the Triton kernels or the blockwise PyTorch path.

``"auto"`` (default) runs Triton on CUDA tensors and PyTorch elsewhere. ``"triton"`` forces the kernels; on CPU
tensors that needs Triton's interpreter (``TRITON_INTERPRET=1`` set before import), which is how CI tests them.
``"torch"`` runs the PyTorch path everywhere. float64 inputs always take the PyTorch path, and so do tokens wider
than the kernels take (``kernels.configs.WIDEST_DIM``: 1024 dims of 16-bit values, 512 of fp32) under ``"auto"``.
The choice is made in Python before the registered op is called, from devices, dtypes and shapes only (no sync).
A Triton older than ``MIN_TRITON`` counts as none: ``"auto"`` runs CUDA tensors on the PyTorch path (the same
results) and warns once; ``"triton"`` is refused.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator

import torch

from .kernels.configs import WIDEST_DIM  # (plain Python: no triton import)

BACKENDS = ("auto", "triton", "torch")
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
_backend = os.environ.get("MAXSIM_BACKEND", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"MAXSIM_BACKEND: expected one of {BACKENDS}, got {_backend!r}")


#: The oldest Triton the kernels run on: they launch through ``triton.knobs`` (3.4); the GPU suite ran on 3.6 and
#: 3.9 (docs/performance.md, run 90), and every kernel variant passes the front end of 3.4, 3.5, 3.6 and 3.9.
MIN_TRITON = (3, 4)


def _triton_version() -> str | None:
    """The importable Triton's version, None without one."""
    try:
        import triton
    except ImportError:
        return None
    return str(getattr(triton, "__version__", "0.0"))


def _at_least(version: str, minimum: tuple[int, int]) -> bool:
    parts = re.match(r"(\d+)\.(\d+)", version)
    return parts is not None and (int(parts[1]), int(parts[2])) >= minimum


_TRITON_VERSION = _triton_version()
_HAS_TRITON = _TRITON_VERSION is not None and _at_least(_TRITON_VERSION, MIN_TRITON)


def get_backend() -> str:
    """The backend in force: ``"auto"``, ``"triton"`` or ``"torch"``."""
    return _backend


def set_backend(name: str) -> None:
    """Set the backend for subsequent calls (process-wide)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    _backend = name


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run the enclosed calls with backend ``name``, then restore the previous one."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def choose_impl(x: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for inputs like ``x`` under the backend in force."""
    if x.dtype == torch.float64:
        return "torch"
    if _backend == "torch":
        return "torch"
    if x.shape[-1] > WIDEST_DIM.get(x.element_size(), 0):
        if _backend == "triton":
            raise ValueError(
                f"backend: 'triton' takes tokens of at most {WIDEST_DIM[x.element_size()]} dims in {x.dtype}, got "
                f"{x.shape[-1]} (the PyTorch path, maxsim.backend('auto') or 'torch', takes any width)"
            )
        return "torch"
    triton_ok = _HAS_TRITON and (x.is_cuda or _INTERPRETER)
    if _backend == "triton":
        if not triton_ok:
            raise ValueError(
                f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors) and Triton >= "
                f"{'.'.join(map(str, MIN_TRITON))}; got a tensor on {x.device} with {_triton_state()}"
            )
        return "triton"
    if _HAS_TRITON:
        return "triton" if x.is_cuda else "torch"
    if x.is_cuda and _TRITON_VERSION is not None:
        _warn_old_triton()
    return "torch"


def _triton_state() -> str:
    return "no triton" if _TRITON_VERSION is None else f"triton {_TRITON_VERSION}"


_warned_old_triton = False


def _warn_old_triton() -> None:
    """Once a process: CUDA tensors run the PyTorch path (the same results, slower) because Triton is too old."""
    global _warned_old_triton
    if not _warned_old_triton:
        _warned_old_triton = True
        warnings.warn(
            f"maxsim: the GPU kernels need Triton >= {'.'.join(map(str, MIN_TRITON))}, this is {_TRITON_VERSION}: CUDA "
            "tensors run the PyTorch path (the same results, slower). Upgrade Triton, or choose "
            "maxsim.backend('torch') to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
