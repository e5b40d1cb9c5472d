"""``nn.Module`` wrapper around :func:`maxsim.maxsim`, for use inside models and losses."""

from __future__ import annotations

from torch import Tensor, nn

from . import validate
from .functional import maxsim


class MaxSim(nn.Module):
    """Late-interaction scoring layer: ``forward(Q, D, q_mask=None, d_mask=None)`` = :func:`maxsim.maxsim`.

    Args:
        normalize: score L2-normalized tokens.
        backward: ``"auto"``, ``"fast"`` or ``"deterministic"``.
    """

    def __init__(self, normalize: bool = False, backward: str = "auto") -> None:
        super().__init__()
        self.normalize = validate.flag("normalize", normalize)
        self.backward_mode = validate.backward_mode(backward)

    def forward(self, Q: Tensor, D: Tensor, q_mask: Tensor | None = None, d_mask: Tensor | None = None) -> Tensor:
        return maxsim(Q, D, q_mask, d_mask, normalize=self.normalize, backward=self.backward_mode)

    def extra_repr(self) -> str:
        return f"normalize={self.normalize}, backward={self.backward_mode!r}"
