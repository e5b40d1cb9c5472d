"""A configuration whose row block ``TQ`` is shorter than the queries (a tuning configuration) splits each query
over programs and sums their partial scores; it computes what the launch table's configuration computes, where one
block holds a whole query: the same scores (integer-valued inputs: exact sums in any order) and argmax, with masks,
ties, partial tiles and packed queries."""

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
@pytest.mark.parametrize("layout", ["cross", "cross-packed", "candidates"])
def test_split_rows_match_launch_table(argmax, masks, layout, device):
    Nq, K, Lq, Ld, dim = 3, 3, 40, 37, 16
    shared = layout != "candidates"
    Q = int_grid((Nq, Lq, dim), seed=3, dtype=torch.bfloat16, device=device)
    D = int_grid((1 if shared else Nq, K, Ld, dim), seed=4, dtype=torch.bfloat16, device=device)  # ties: few values
    qm = rand_mask(Q.shape[:2], seed=5, device=device) if masks else None
    dm = rand_mask(D.shape[:3], seed=6, device=device) if masks else None
    table = launch.forward(Q, D, qm, dm, False, argmax)
    bq = 2 if layout == "cross-packed" else 1  # two queries a program, each split into 3 row blocks
    split = launch.forward(Q, D, qm, dm, False, argmax, cfg=ForwardConfig(16, bq, 16, 16, 1, 4, 2))
    torch.testing.assert_close(split[0], table[0], rtol=0, atol=0)
    if argmax:
        assert torch.equal(split[1], table[1])
