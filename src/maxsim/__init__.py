"""maxsim: exact, fused, memory-efficient MaxSim (late-interaction) scoring.

``score(q, d) = Σ_i max_j <q_i, d_j>`` for ColBERT / ColPali-style training and retrieval: Triton kernels on GPU,
a blockwise PyTorch path everywhere else, identical semantics (see :mod:`maxsim.reference`).
"""

from . import reference
from .backend import backend, get_backend, set_backend
from .functional import maxsim, maxsim_pairs, maxsim_with_argmax
from .module import MaxSim
from .ragged import maxsim_padded, maxsim_pairs_varlen, maxsim_varlen

__version__ = "0.1.0"

__all__ = [
    "MaxSim",
    "backend",
    "get_backend",
    "maxsim",
    "maxsim_padded",
    "maxsim_pairs",
    "maxsim_pairs_varlen",
    "maxsim_varlen",
    "maxsim_with_argmax",
    "reference",
    "set_backend",
]
