"""A configuration whose row block ``TQ`` is shorter than the queries (a tuning configuration) splits each query
over programs and sums their partial scores; it computes what the launch table's configuration computes, where one
block holds a whole query: the same scores (integer-valued inputs: exact sums in any order) and argmax, with masks,
ties, partial tiles and packed queries."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRET, forward_launches, int_grid, rand_mask

from maxsim.kernels import configs, launch, launch_settings
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


@pytest.mark.parametrize(
    "Lq, dim, stages",
    [
        (129, 128, (configs.LONG_QUERY_SCORES_STAGES, configs.LONG_QUERY_STAGES)),
        (300, 96, (configs.LONG_QUERY_SCORES_STAGES, configs.LONG_QUERY_STAGES)),  # (one 128-wide chunk, padded)
        (128, 128, (3, 3)),  # not a long query: one 128-row block holds it
        (300, 64, (configs.LONG_QUERY_STAGES, configs.LONG_QUERY_STAGES)),  # (narrow chunks: not measured)
    ],
)
def test_long_query_scores_only_forward_keeps_one_more_stage(Lq, dim, stages, device, monkeypatch):
    """Long queries' forward without the argmax keeps ``LONG_QUERY_SCORES_STAGES`` tiles in flight, the argmax one
    ``LONG_QUERY_STAGES`` (recorded launches, not run; the few-program launch shapes off)."""
    monkeypatch.setattr(launch_settings, "DEEP_PIPELINE", 0)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_PROGRAMS_PER_SM", 0)
    Q = torch.randn(2, Lq, dim, dtype=torch.float16, device=device)
    D = torch.randn(200, 64, dim, dtype=torch.float16, device=device)
    got = []
    for argmax in (False, True):
        seen = forward_launches(
            monkeypatch, lambda a=argmax: launch.forward(Q, D[None], None, None, False, a), lambda c, w, s: s
        )
        got.append(seen[0])
    assert tuple(got) == stages
    assert configs.LONG_QUERY_SCORES_STAGES != configs.LONG_QUERY_STAGES  # (else this test could not fail)


@pytest.mark.parametrize("masks", [False, True], ids=["dense", "masked"])
def test_long_query_scores_match_the_argmax_forward(masks, device):
    """The scores-only forward of long queries (its own pipeline depth) gives the argmax forward's scores bit for bit
    (integer-valued inputs: every partial sum exact), with masks and a partial last tile."""
    Nq, K, Lq, Ld, dim = 2, 3, 150, 70, 128
    Q = int_grid((Nq, Lq, dim), seed=7, dtype=torch.bfloat16, device=device)
    D = int_grid((1, K, Ld, dim), seed=8, dtype=torch.bfloat16, device=device)
    qm = rand_mask(Q.shape[:2], seed=9, device=device) if masks else None
    dm = rand_mask(D.shape[:3], seed=10, device=device) if masks else None
    scores, _ = launch.forward(Q, D, qm, dm, False, False)
    with_argmax, _argmax = launch.forward(Q, D, qm, dm, False, True)
    torch.testing.assert_close(scores, with_argmax, rtol=0, atol=0)
