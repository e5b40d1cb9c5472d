"""Integer helpers for launch sizes, in plain Python.

Triton's own ``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction`` objects in recent Triton
releases: callable from Python, but at ~2 µs a call on a fast CPU (the lent GPU hosts run Python ~4x slower), which
a small training step, bound by host time, pays several times per call.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
