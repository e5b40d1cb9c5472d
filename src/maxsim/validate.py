"""Argument checks for the public functions: shapes, dtypes and devices only, so they never sync with a device.

Every failure is a ``TypeError`` (wrong kind of thing: not a tensor, integer dtype, mixed dtypes) or a
``ValueError`` (wrong shape, device or option) whose message names the argument, what was expected and what came.
"""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
BACKWARD_MODES = ("auto", "fast", "deterministic")


def tensor(name: str, x: object, ndims: tuple[int, ...]) -> Tensor:
    """``x`` must be a floating tensor of one of the given ranks."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a floating tensor (float32, float16, bfloat16 or float64), got dtype {x.dtype}"
        )
    if x.dim() not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name}: expected a {want} tensor, got {x.dim()}-D with shape {tuple(x.shape)}")
    return x


_FLOAT_SET = frozenset(FLOAT_DTYPES)


def call(
    Q: object, D: object, q_ranks: tuple[int, ...], d_ranks: tuple[int, ...], normalize: object, backward: object,
    return_argmax: object,
) -> None:  # fmt: skip
    """:func:`tensor` of ``Q`` and ``D``, :func:`same_kind`, and the options ``normalize``, ``backward`` and
    ``return_argmax``: a well-formed call passes one expression (each check on its own costs a call, ~2 µs of host
    time for all of them on a tiny call); any other runs the checks in turn, for their messages."""
    if (
        isinstance(Q, Tensor) and isinstance(D, Tensor) and Q.dtype is D.dtype and Q.dtype in _FLOAT_SET
        and Q.dim() in q_ranks and D.dim() in d_ranks and Q.shape[-1] == D.shape[-1] and Q.shape[-1] != 0
        and Q.device == D.device and type(normalize) is bool and type(return_argmax) is bool
        and type(backward) is str and backward in BACKWARD_MODES
    ):  # fmt: skip
        return
    tensor("Q", Q, q_ranks)
    tensor("D", D, d_ranks)
    same_kind(Q, D)
    flag("normalize", normalize)
    backward_mode(backward)
    flag("return_argmax", return_argmax)


def same_kind(Q: Tensor, D: Tensor) -> None:
    """Q and D share a dtype, a device and the token dimension."""
    if Q.dtype != D.dtype:
        raise TypeError(f"D: expected the same dtype as Q ({Q.dtype}), got {D.dtype}")
    if Q.device != D.device:
        raise ValueError(f"D: expected the same device as Q ({Q.device}), got {D.device}")
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(
            f"D: expected token dim {Q.shape[-1]} (the last dim of Q), got {D.shape[-1]} "
            f"(Q shape {tuple(Q.shape)}, D shape {tuple(D.shape)})"
        )
    if Q.shape[-1] == 0:
        raise ValueError(f"Q: expected a token dim of at least 1, got shape {tuple(Q.shape)}")


def mask(name: str, m: object, shape: tuple[int, ...], device: torch.device) -> Tensor | None:
    """``m`` is None or a bool tensor of exactly ``shape`` on ``device``."""
    if m is None:
        return None
    if not isinstance(m, Tensor):
        raise TypeError(f"{name}: expected a bool torch.Tensor or None, got {type(m).__name__}")
    if m.dtype != torch.bool:
        raise TypeError(f"{name}: expected dtype torch.bool (True = valid token), got {m.dtype}")
    if tuple(m.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(m.shape)}")
    if m.device != device:
        raise ValueError(f"{name}: expected device {device} (as Q), got {m.device}")
    return m


def backward_mode(mode: object) -> str:
    if not isinstance(mode, str) or mode not in BACKWARD_MODES:
        raise ValueError(f"backward: expected one of {BACKWARD_MODES}, got {mode!r}")
    return mode


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


INDEX_DTYPES = (torch.int32, torch.int64)


def index_tensor(name: str, x: object, ndim: int, device: torch.device) -> Tensor:
    """An int32/int64 tensor of rank ``ndim`` on ``device`` (offsets, lengths, pair ids), made contiguous: the
    kernels read offsets and pair ids at unit stride (a column of a ``[P, 2]`` pair tensor is a strided view)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected an int32 or int64 torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected dtype torch.int32 or torch.int64, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got {x.dim()}-D with shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device} (as Q), got {x.device}")
    return x.contiguous()


_INDEX_SET = frozenset(INDEX_DTYPES)


def _index_ok(x: object, device: torch.device) -> bool:
    return isinstance(x, Tensor) and x.dtype in _INDEX_SET and x.dim() == 1 and x.device == device and x.is_contiguous()


def packed_call(
    Q: object, D: object, cu_q: object, cu_d: object, pair_q: object, pair_d: object, max_q: object, max_d: object,
    normalize: object, backward: object, return_argmax: object, validate_: object,
) -> bool:  # fmt: skip
    """Whether a packed call (``maxsim_varlen``; ``maxsim_pairs_varlen`` where ``pair_q`` is not None) is well formed,
    in one expression: :func:`call`'s checks of 2-D ``Q`` and ``D``, contiguous non-empty offsets and pair ids of
    one shape (:func:`offsets`, :func:`index_tensor`), maxima and ``validate`` of their types. Where it is not, the
    caller runs the checks in turn, for their messages (they cost ~4 µs of host time on a well-formed call)."""
    if not (isinstance(Q, Tensor) and isinstance(D, Tensor)):
        return False
    dev = Q.device
    return (
        Q.dtype is D.dtype and Q.dtype in _FLOAT_SET and Q.dim() == 2 and D.dim() == 2 and Q.shape[1] == D.shape[1]
        and Q.shape[1] != 0 and D.device == dev and type(normalize) is bool and type(return_argmax) is bool
        and type(backward) is str and backward in BACKWARD_MODES and (validate_ is None or type(validate_) is bool)
        and (max_q is None or (type(max_q) is int and max_q >= 0))
        and (max_d is None or (type(max_d) is int and max_d >= 0))
        and _index_ok(cu_q, dev) and cu_q.shape[0] > 0 and _index_ok(cu_d, dev) and cu_d.shape[0] > 0
        and (pair_q is None or (_index_ok(pair_q, dev) and _index_ok(pair_d, dev) and pair_q.shape == pair_d.shape))
    )  # fmt: skip


def offsets(name: str, x: object, device: torch.device) -> Tensor:
    """``cu_seqlens``-style offsets: 1-D int, at least one entry (``[N + 1]``)."""
    x = index_tensor(name, x, 1, device)
    if x.shape[0] == 0:
        raise ValueError(f"{name}: expected N + 1 >= 1 offsets (starting with 0), got an empty tensor")
    return x


def max_length(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value}")
    return value


def optional_flag(name: str, value: object) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool or None, got {type(value).__name__}")
    return value
