"""The forward's streaming tile loop (``STREAM_D``: document tiles read by one program alone, prefetched into
registers with an evict-first hint) computes exactly what the pipelined loop computes, bit for bit (normalized
scores within 2 ulp: their rows' sum follows the tile's layout), and is chosen only where the rule says (see
``launch_settings.STREAM_ONCE_READ``, launch_forward.once_read_scan)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import INTERPRET, alternate_under_interpreter, forward_launches, int_grid, rand_mask, randn

from maxsim import maxsim, maxsim_varlen, reference, set_backend
from maxsim.kernels import configs, device_info, launch, launch_forward, launch_settings
from maxsim.kernels.configs import forward_config

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

# (the interpreter's bf16 dot is unreliable: fp16 is the 16-bit type there)
DTYPE = torch.bfloat16 if torch.cuda.is_available() and not INTERPRET else torch.float16


def _forward(Q, D, d_mask, normalize, stream: int, cfg, monkeypatch):
    monkeypatch.setattr(launch_settings, "STREAM_ONCE_READ", stream)
    launch_forward.plans.clear()
    return launch.forward(Q, D, None, d_mask, normalize, False, cfg=cfg)


def _assert_bitwise(a, b, normalize: bool = False):
    """Scores (and argmax) bit for bit; ``normalize``: scores within 2 ulp. Normalized row maxima are not integers,
    and the rows' sum runs in the order of the MMA tile's layout, which the loops' tile widths set (H200: 64-row
    queries, 32-token streamed tiles against the persistent table's 64: 4 of 6 scores 1 ulp apart)."""
    torch.testing.assert_close(a[0], b[0], rtol=2.5e-7 if normalize else 0, atol=0, equal_nan=True)
    if a[1] is not None:
        assert torch.equal(a[1], b[1])


CASES = {
    # name: (Q shape, D shape): one query against shared documents, or each query against its own candidates
    "one query, partial last tile": ((1, 9, 64), (1, 7, 45, 64)),
    "one query, documents of one token": ((1, 5, 32), (1, 4, 1, 32)),
    "candidates": ((3, 12, 32), (3, 4, 70, 32)),
    "candidates, queries of 64 rows": ((2, 40, 32), (2, 3, 70, 32)),
    "one query of 64 rows": ((1, 40, 32), (1, 4, 70, 32)),
    "candidates, 128 dims": ((2, 12, 128), (2, 3, 70, 128)),  # (the wide loop: 64-token tiles, 4 warps)
}


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "mask"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_streaming_matches_pipelined_loop(case, normalize, masked, device, monkeypatch, any_size):
    alternate_under_interpreter(list(CASES).index(case), masked, device)  # (both normalize values a shape)
    q_shape, d_shape = CASES[case]
    # Integer data: exact ties everywhere (the lowest index must win in both loops); one NaN token.
    Q = int_grid(q_shape, seed=1, dtype=DTYPE, device=device)
    D = int_grid(d_shape, seed=2, dtype=DTYPE, device=device)
    D[0, -1, 0, 0] = float("nan")
    d_mask = None
    if masked:  # holes, a fully masked document, and NaN/inf in masked tokens (never read)
        d_mask = rand_mask(d_shape[:-1], seed=3, p_valid=0.6, device=device)
        d_mask[0, -1, 0] = True
        d_mask[0, 0] = False
        D[0, 0, 0, 0] = float("nan")
        D[-1, 1, d_mask[-1, 1].logical_not().nonzero()[:1, 0], 1] = float("inf")
    table = forward_config(q_shape[1], q_shape[2], q_shape[0], d_shape[0] == 1)
    for cfg in (None, dataclasses.replace(table, persist=0), dataclasses.replace(table, persist=2)):
        monkeypatch.setattr(device_info, "sm_count", lambda device: 1)  # (persist=2: programs walk several documents)
        plain = _forward(Q, D, d_mask, normalize, 0, cfg, monkeypatch)
        streamed = _forward(Q, D, d_mask, normalize, 1, cfg, monkeypatch)
        _assert_bitwise(plain, streamed, normalize)
        assert _stream_flags(
            monkeypatch, lambda cfg=cfg: launch.forward(Q, D, None, d_mask, normalize, False, cfg=cfg)
        ) == [True]
    assert torch.isnan(plain[0][0, -1])
    if masked:
        assert plain[0][0, 0] == 0 and not torch.isinf(plain[0]).any()


def test_streaming_varlen_with_empty_documents(device, monkeypatch, any_size):
    """Packed documents of one query, two of them empty (their first tile is never read), against the reference."""
    set_backend("triton")  # (CPU tensors under the interpreter; the conftest restores the backend)
    lens = [5, 0, 33, 1, 0, 17]
    cu_d = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    cu_q = torch.tensor([0, 7], dtype=torch.int32, device=device)
    Q = randn((7, 32), seed=3, dtype=DTYPE, device=device)
    D = randn((sum(lens), 32), seed=4, dtype=DTYPE, device=device)
    s = maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=7, max_seqlen_d=33)
    assert _stream_flags(monkeypatch, lambda: maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=7, max_seqlen_d=33)) == [
        True
    ]
    ref = reference.maxsim_varlen(Q.double(), D.double(), cu_q, cu_d)
    torch.testing.assert_close(s.double(), ref, rtol=1e-3, atol=1e-3)
    assert (s[0, [1, 4]] == 0).all()


def _stream_flags(monkeypatch, call, warps: bool = False) -> list:
    """The ``STREAM_D`` flag of every forward launch ``call`` makes (launches recorded, not run); ``warps``: pairs
    ``(STREAM_D, num_warps)``."""
    return forward_launches(
        monkeypatch, call, lambda c, num_warps, _stages: (c["STREAM_D"], num_warps) if warps else c["STREAM_D"]
    )


@pytest.mark.parametrize(
    "what, streams",
    [
        ("one query, shared documents", True),
        ("candidates", True),
        ("candidates, queries of 64 rows", True),
        ("one query of 64 rows, shared documents", True),  # (H100 / H200 1x5000 Lq64 Ld180: 0.98x / 0.97x)
        ("document mask", True),
        ("document mask, 64 dims", True),  # (the mask's bits: STREAM_MASK_BITS)
        ("fp32", False),  # (two fp32 tiles in registers spill)
        ("several query blocks", False),  # (each tile is read by every block)
        ("long query", False),  # (rows split over programs read each tile once per split)
        ("default byte range", False),  # (a scan far below the L2's size)
        ("training forward", False),  # (the argmax loop ran slower streamed)
    ],
)
def test_streaming_chosen_where_the_rule_says(what, streams, monkeypatch):
    if what != "default byte range":
        monkeypatch.setattr(launch_settings, "STREAM_L2_RANGE", (0.0, math.inf))
    dtype = torch.float32 if what == "fp32" else torch.float16
    Nq = 40 if what == "several query blocks" else 2 if what == "candidates, queries of 64 rows" else 1
    Lq = 200 if what == "long query" else 48 if "64 rows" in what else 32
    dim = 128 if what == "document mask" else 64
    Q = torch.randn(Nq, Lq, dim, dtype=dtype)
    own = what.startswith("candidates")
    D = torch.randn(Nq, 3, 50, dim, dtype=dtype) if own else torch.randn(6, 50, dim, dtype=dtype)
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool) if what.startswith("document mask") else None
    if INTERPRET:
        set_backend("triton")
    else:
        Q, D = Q.cuda(), D.cuda()
        d_mask = None if d_mask is None else d_mask.cuda()
    if what == "training forward":
        flags = _stream_flags(monkeypatch, lambda: maxsim(Q, D, return_argmax=True))
    else:
        flags = _stream_flags(monkeypatch, lambda: maxsim(Q, D, d_mask=d_mask))
    assert flags == [streams]


@pytest.mark.parametrize(
    "dim, n_q, lq, warps",
    [
        (48, 1, 32, configs.STREAM_NARROW_NUM_WARPS),  # (one dim chunk of 64: 32-token tiles)
        (64, 2, 32, configs.STREAM_NARROW_NUM_WARPS),
        (128, 2, 32, configs.STREAM_NUM_WARPS),
        (128, 2, 48, configs.STREAM_NUM_WARPS),  # (64-row queries: 32-token tiles, but 128 dims)
        (32, 2, 40, configs.STREAM_NUM_WARPS),  # (64-row queries: their row sums in the pipelined loop's order)
    ],
)
def test_streaming_warps_follow_the_width(dim, n_q, lq, warps, monkeypatch):
    """Streamed scans of at most 64 dims and 32 query rows run ``STREAM_NARROW_NUM_WARPS`` warps, the others
    ``STREAM_NUM_WARPS`` (H200: 2 warps took dim 48 from 39.3 to 35.4 us, but 64-row queries at 128 dims from 65
    to 92, and 64-row ones at 32 dims summed their rows in another order than the pipelined loop)."""
    monkeypatch.setattr(launch_settings, "STREAM_L2_RANGE", (0.0, math.inf))
    Q = torch.randn(n_q, lq, dim, dtype=torch.float16)
    D = torch.randn(n_q, 3, 50, dim, dtype=torch.float16)
    if INTERPRET:
        set_backend("triton")
    else:
        Q, D = Q.cuda(), D.cuda()
    assert _stream_flags(monkeypatch, lambda: maxsim(Q, D), warps=True) == [(True, warps)]
