"""Zeroed CPU gradient buffers (maxsim.cpu_memory): zeros as torch.zeros makes them, large ones advised huge."""

from __future__ import annotations

import pytest
import torch

from maxsim import cpu_memory


def _vm_flags(address: int) -> list[str] | None:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (Linux), else None."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


SHAPES = [((3, 5), torch.float32), ((2, (40 << 20) // 16), torch.float64), ((0, 7), torch.bfloat16)]


@pytest.mark.parametrize("shape, dtype", SHAPES, ids=["small", "large", "empty"])
def test_zeros_are_torch_zeros(shape, dtype):
    out = cpu_memory.zeros(shape, dtype, torch.device("cpu"))
    assert out.shape == torch.Size(shape) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, torch.zeros(shape, dtype=dtype))
    strided = torch.ones(shape[::-1], dtype=dtype).T  # (zeros_like's result is contiguous whatever x's strides)
    like = cpu_memory.zeros_like(strided)
    assert like.shape == strided.shape and like.is_contiguous() and not like.any()


def test_only_large_cpu_buffers_are_advised(monkeypatch):
    """The whole 2 MB pages inside a buffer of at least HUGE_PAGES_MIN_BYTES, and nothing for a smaller one; where no
    advice is available the buffer is zeroed all the same."""
    calls = []
    monkeypatch.setattr(cpu_memory, "_madvise", lambda: lambda start, length: calls.append((start, length)) or 0)
    small = cpu_memory.zeros((cpu_memory.HUGE_PAGES_MIN_BYTES // 4 - 1,), torch.float32, torch.device("cpu"))
    assert not calls and not small.any()
    big = cpu_memory.zeros((cpu_memory.HUGE_PAGES_MIN_BYTES // 4 + 1000,), torch.float32, torch.device("cpu"))
    ((start, length),) = calls
    lo, hi = big.data_ptr(), big.data_ptr() + big.numel() * 4
    assert start % (2 << 20) == 0 and length % (2 << 20) == 0 and lo <= start and start + length <= hi
    assert hi - (start + length) < (2 << 20) and start - lo < (2 << 20) and not big.any()
    monkeypatch.setattr(cpu_memory, "_madvise", lambda: None)
    assert not cpu_memory.zeros(big.shape, torch.float32, torch.device("cpu")).any()


def test_the_advice_reaches_the_mapping():
    if cpu_memory._madvise() is None:
        pytest.skip("transparent huge pages are not granted on request here")
    big = cpu_memory.zeros(((40 << 20) // 4,), torch.float32, torch.device("cpu"))
    flags = _vm_flags(big.data_ptr() + (4 << 20))
    if flags is None:
        pytest.skip("no /proc/self/smaps")
    assert "hg" in flags  # (MADV_HUGEPAGE on the buffer's mapping)


def test_the_environment_turns_the_advice_off(monkeypatch):
    monkeypatch.setenv("MAXSIM_CPU_HUGE_PAGES", "0")
    cpu_memory._madvise.cache_clear()
    try:
        assert cpu_memory._madvise() is None
        assert not cpu_memory.zeros(((40 << 20) // 4,), torch.float32, torch.device("cpu")).any()
    finally:
        monkeypatch.delenv("MAXSIM_CPU_HUGE_PAGES")
        cpu_memory._madvise.cache_clear()
