"""What the launch planning reads of a GPU: its multiprocessors, L2 and shared memory sizes and name, read once per
device (a driver query costs microseconds; a launch must not); fixed stand-ins under the interpreter (CPU tensors)."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Under the interpreter (CPU tensors): one, so that the tests of shared dense documents run persistent programs.
INTERPRETER_SMS = 1
_device_values: dict[tuple[str, int], int] = {}


def _device_value(device: torch.device, name: str, read: Callable[[int], int], off_gpu: int) -> int:
    """``read(index)`` of a CUDA ``device``, once per device and ``name``; ``off_gpu`` where there is no GPU (the
    interpreter)."""
    if device.type != "cuda":
        return off_gpu
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _device_values.get((name, idx))
    if n is None:
        n = _device_values[name, idx] = int(read(idx))
    return n


def l2_bytes(device: torch.device) -> int:
    """The L2 cache's size (an H100's 50 MiB where there is no GPU)."""
    return _device_value(device, "l2", lambda i: torch.cuda.get_device_properties(i).L2_cache_size, 50 << 20)


def shared_bytes(device: torch.device) -> int:
    """The shared memory one program may use (opt-in maximum; an H100's where there is no GPU)."""

    def read(i: int) -> int:
        from triton.runtime import driver

        return driver.active.utils.get_device_properties(i)["max_shared_mem"]

    return _device_value(device, "shared", read, 227 << 10)


_card_names: dict[int, str] = {}


def card_name(device: torch.device) -> str:
    """The CUDA ``device``'s name (``NVIDIA H200``), read once per device; empty where there is no GPU."""
    if device.type != "cuda":
        return ""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    name = _card_names.get(idx)
    if name is None:
        name = _card_names[idx] = torch.cuda.get_device_name(idx)
    return name


def sm_count(device: torch.device) -> int:
    return _device_value(
        device, "sms", lambda i: torch.cuda.get_device_properties(i).multi_processor_count, INTERPRETER_SMS
    )
