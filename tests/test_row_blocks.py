"""A program that walks several row blocks of its queries (a tuning configuration: ``TQ`` below ``Lq`` without a
split over programs) computes what the launch table's configuration computes, where every program holds one row
block: the same scores (integer-valued inputs: exact sums in any order) and argmax, with masks, ties and partial
tiles."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRET, int_grid, rand_mask

from maxsim.kernels import launch
from maxsim.kernels.configs import ForwardConfig

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)


@pytest.mark.parametrize("argmax", [False, True], ids=["scores", "argmax"])
@pytest.mark.parametrize("masks", [False, True], ids=["dense", "masked"])
@pytest.mark.parametrize("shared", [True, False], ids=["cross", "candidates"])
def test_row_block_walk_matches_launch_table(argmax, masks, shared, device):
    Nq, K, Lq, Ld, dim = 2, 3, 40, 37, 16
    Q = int_grid((Nq, Lq, dim), seed=3, dtype=torch.bfloat16, device=device)
    D = int_grid((1 if shared else Nq, K, Ld, dim), seed=4, dtype=torch.bfloat16, device=device)  # ties: few values
    qm = rand_mask(Q.shape[:2], seed=5, device=device) if masks else None
    dm = rand_mask(D.shape[:3], seed=6, device=device) if masks else None
    table = launch.forward(Q, D, qm, dm, False, argmax)
    walk = launch.forward(Q, D, qm, dm, False, argmax, cfg=ForwardConfig(16, 1, 16, 16, 1, 4, 2))  # 3 row blocks
    torch.testing.assert_close(walk[0], table[0], rtol=0, atol=0)
    if argmax:
        assert torch.equal(walk[1], table[1])
