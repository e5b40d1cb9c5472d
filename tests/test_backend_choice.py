"""Which implementation runs a call (backend.py): a Triton too old for the kernels is treated as no Triton, loudly."""

from __future__ import annotations

import warnings
from importlib import import_module

import pytest
import torch

backend = import_module("maxsim.backend")  # (the module: ``maxsim.backend`` is its context manager)


class _CudaLike:
    """What ``choose_impl`` reads of a CUDA bf16 tensor [2, 8, 16], without a GPU."""

    dtype, shape, device, is_cuda = torch.bfloat16, (2, 8, 16), torch.device("cuda"), True

    def element_size(self) -> int:
        return 2


@pytest.mark.parametrize(
    ("version", "ok"),
    [("3.4.0", True), ("3.9.0", True), ("3.10.1", True), ("4.0.0+git1234", True), ("3.3.1", False), ("2.3.0", False),
     ("3", False), ("", False)],
)  # fmt: skip
def test_the_kernels_need_triton_3_4(version, ok):
    assert backend._at_least(version, backend.MIN_TRITON) is ok


def test_an_old_triton_sends_cuda_tensors_to_the_pytorch_path_with_one_warning(monkeypatch):
    """Triton 3.3 has no ``triton.knobs``, through which the kernels launch: under ``"auto"`` CUDA tensors take the
    PyTorch path (same results) with a warning naming both versions, once a process; ``"triton"`` is refused with
    a ValueError that says why; no Triton at all falls back without a warning."""
    monkeypatch.setattr(backend, "_TRITON_VERSION", "3.3.1")
    monkeypatch.setattr(backend, "_HAS_TRITON", False)
    monkeypatch.setattr(backend, "_warned_old_triton", False)
    with pytest.warns(RuntimeWarning, match=r"Triton >= 3\.4, this is 3\.3\.1"):
        assert backend.choose_impl(_CudaLike()) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.choose_impl(_CudaLike()) == "torch"  # (once a process)
        with backend.backend("triton"), pytest.raises(ValueError, match=r"Triton >= 3\.4.*triton 3\.3\.1"):
            backend.choose_impl(_CudaLike())
        monkeypatch.setattr(backend, "_TRITON_VERSION", None)
        monkeypatch.setattr(backend, "_warned_old_triton", False)
        assert backend.choose_impl(_CudaLike()) == "torch"
        with backend.backend("triton"), pytest.raises(ValueError, match=r"Triton >= 3\.4.*no triton"):
            backend.choose_impl(_CudaLike())
    assert backend.choose_impl(torch.ones(2, 8, 16)) == "torch"
