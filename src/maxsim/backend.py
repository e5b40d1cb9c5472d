"""Which implementation runs a call: the Triton kernels or the blockwise PyTorch path.

``"auto"`` (default) runs Triton on CUDA tensors and PyTorch elsewhere. ``"triton"`` forces the kernels; on CPU
tensors that needs Triton's interpreter (``TRITON_INTERPRET=1`` set before import), which is how CI tests them.
``"torch"`` runs the PyTorch path everywhere. float64 inputs always take the PyTorch path, and so do tokens wider
than the kernels take (``kernels.configs.WIDEST_DIM``: 1024 dims of 16-bit values, 512 of fp32) under ``"auto"``.
The choice is made in Python before the registered op is called, from devices, dtypes and shapes only (no sync).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .kernels.configs import WIDEST_DIM  # (plain Python: no triton import)

BACKENDS = ("auto", "triton", "torch")
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
_backend = os.environ.get("MAXSIM_BACKEND", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"MAXSIM_BACKEND: expected one of {BACKENDS}, got {_backend!r}")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_HAS_TRITON = _triton_importable()


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
                f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors) and an importable "
                f"triton; got a tensor on {x.device} with triton {'present' if _HAS_TRITON else 'missing'}"
            )
        return "triton"
    return "triton" if (_HAS_TRITON and x.is_cuda) else "torch"
