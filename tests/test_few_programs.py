"""Launches of few programs (``launch_settings.DEEP_PIPELINE``, ``DOC_SPLIT_*``) score exactly as the table's
launch. Documents scanned in chunks (each document split over several forward programs, their row maxima folded
afterwards): bitwise on integer data (scores, argmax and gradients, every layout, masks with holes, a chunk wholly
masked, empty documents and queries, ties across chunks, NaN), and within tolerance of the float64 reference
otherwise. The deep-pipelined configuration of thin row blocks: bitwise, chunked or not."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRET, int_grid, keep_under_interpreter, rand_mask, randn

import maxsim
from maxsim import reference
from maxsim.kernels import device_info, launch_forward, launch_settings

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

# (the interpreter's bf16 dot is unreliable: fp16 is the 16-bit type there)
DTYPE = torch.bfloat16 if torch.cuda.is_available() and not INTERPRET else torch.float16
LD = 300


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    if INTERPRET:
        maxsim.set_backend("triton")
    # Scans of any size stream where their layout allows (the rule would exclude every small test shape), so that
    # chunks are covered in both tile loops.
    monkeypatch.setattr(launch_settings, "STREAM_L2_RANGE", (0.0, float("inf")))
    launch_forward.plans.clear()
    yield
    launch_forward.plans.clear()


def _chunked(monkeypatch, tiles: int | None, deep: bool = False) -> None:
    """Documents scanned in chunks of ``tiles`` tiles (a GPU of 4096 multiprocessors wants as many as it can get),
    or (None) never chunked; ``deep``: thin row blocks of any document length take the deep-pipelined
    configuration (else never)."""
    monkeypatch.setattr(device_info, "sm_count", lambda device: 4096)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_MIN_TILES", tiles or 1)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_PROGRAMS_PER_SM", 0 if tiles is None else 2)
    monkeypatch.setattr(launch_settings, "DEEP_PIPELINE", int(deep))
    monkeypatch.setattr(launch_settings, "DEEP_PIPELINE_MIN_LD", 0)
    launch_forward.plans.clear()


def _lens_cu(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _layouts(device, dtype, data, nan: bool):
    """name -> (args, call, reference call): three or four documents of up to LD tokens, with masks with holes,
    a document whose second quarter is masked, an empty document or query where the layout has lengths, and
    tokens repeated in the first and last chunk."""
    Q = data((3, 5, 16), seed=1, dtype=dtype, device=device)
    D = data((3, LD, 16), seed=2, dtype=dtype, device=device)
    Dc = data((2, 3, LD, 16), seed=3, dtype=dtype, device=device)
    q_mask = rand_mask((3, 5), seed=4, p_valid=0.8, device=device)
    q_mask[1] = False  # (a query of no valid token scores 0)
    d_mask = rand_mask((3, LD), seed=5, p_valid=0.7, device=device)
    d_mask[1, LD // 4 : LD // 2] = False
    dc_mask = rand_mask((2, 3, LD), seed=6, p_valid=0.7, device=device)
    dc_mask[0, 2, LD // 4 :] = False
    lens_d = [LD, 0, 70, LD - 43]
    Dp = data((sum(lens_d), 16), seed=7, dtype=dtype, device=device)
    cu_d = _lens_cu(lens_d, device)
    cu_q = _lens_cu([5, 0, 3], device)
    Qp = data((8, 16), seed=8, dtype=dtype, device=device)
    pair_q = torch.tensor([0, 2, 2, 0, 1], dtype=torch.int32, device=device)
    pair_d = torch.tensor([3, 0, 3, 2, 1], dtype=torch.int32, device=device)
    q_len = torch.tensor([5, 2], dtype=torch.int32, device=device)
    d_len = torch.tensor([[LD, 0, 130], [1, LD - 1, 64]], dtype=torch.int32, device=device)
    # Ties across chunks: each document's last 44 tokens repeat its first 44 (rows whose max lies there tie).
    for x in (D, Dc):
        x[..., LD - 44 :, :] = x[..., :44, :]
    Dp[LD - 44 : LD] = Dp[:44]
    if nan:  # one valid token of a late chunk: NaN reaches the scores of its document only
        D[2, LD - 20, 3] = Dc[1, 1, LD - 30, 0] = Dp[LD + 70 + 200, 5] = float("nan")
        d_mask[2, LD - 20] = dc_mask[1, 1, LD - 30] = True

    def packed(f):
        return lambda q, d, **kw: f(q, d, cu_q, cu_d, max_seqlen_q=5, max_seqlen_d=LD, **kw)

    def pair_list(f):
        return lambda q, d, **kw: f(q, d, cu_q, cu_d, pair_q, pair_d, max_seqlen_q=5, max_seqlen_d=LD, **kw)

    def lengths(f):
        return lambda q, d, **kw: f(q, d, q_len, d_len, **kw)

    def masked(f, qm, dm):
        return lambda q, d, **kw: f(q, d, qm, dm, **kw)

    def ref_pairs(q, d, **kw):  # (aligned pairs: the candidates layout with one candidate each)
        s, a = reference.maxsim_with_argmax(q, d[:, None], q_mask, d_mask[:, None], **kw)
        return s[:, 0], a[:, 0]

    ref = reference
    return {
        "cross": (Q, D, masked(maxsim.maxsim, q_mask, d_mask), masked(ref.maxsim_with_argmax, q_mask, d_mask)),
        "candidates": (Q[:2], Dc, masked(maxsim.maxsim, None, dc_mask), masked(ref.maxsim_with_argmax, None, dc_mask)),
        "pairs": (Q, D, masked(maxsim.maxsim_pairs, q_mask, d_mask), ref_pairs),
        "varlen": (Qp, Dp, packed(maxsim.maxsim_varlen), packed(ref.maxsim_varlen_with_argmax)),
        "pair list": (Qp, Dp, pair_list(maxsim.maxsim_pairs_varlen), pair_list(ref.maxsim_pairs_varlen_with_argmax)),
        "padded": (Q[:2], Dc, lengths(maxsim.maxsim_padded), lengths(ref.maxsim_padded_with_argmax)),
    }


def _run(monkeypatch, tiles, call, Q, D, deep: bool = False):
    """Inference scores, scores and argmax, and the gradients of a training step (upstream gradient 1), with
    documents chunked per ``tiles`` (see :func:`_chunked`); and the chunk counts the forward plans used."""
    _chunked(monkeypatch, tiles, deep)
    with torch.no_grad():
        scores = call(Q, D)
    Qg, Dg = Q.detach().requires_grad_(), D.detach().requires_grad_()
    s_arg, arg = call(Qg, Dg, backward="deterministic", return_argmax=True)
    dQ, dD = torch.autograd.grad(s_arg, (Qg, Dg), torch.ones_like(s_arg))
    chunks = sorted({p.n_dsplit for p in launch_forward.plans.values()})
    return (scores, s_arg.detach(), arg, dQ, dD), chunks


LAYOUTS = ["cross", "candidates", "pairs", "varlen", "pair list", "padded"]


# (layout, NaN, tiles a chunk): every layout once; NaN and longer chunks (the last one partial, and the 64-token
# tiles of the scores-only scan in more chunks than the training forward's 128-token ones) on a few (the
# interpreter is slow)
EXACT_CASES = [
    *[(layout, False, 1) for layout in LAYOUTS],
    *[(layout, True, 1) for layout in ("cross", "candidates", "varlen")],
    ("cross", False, 2),
    ("padded", False, 2),
]
INTERPRETER_EXACT = {("candidates", True, 1), ("varlen", True, 1)}  # (left to the GPU run)
# Under the interpreter: each layout once, raw or normalized.
INTERPRETER_REF = {
    ("cross", False), ("cross", True), ("candidates", True), ("pairs", False), ("varlen", True), ("pair list", False),
    ("padded", True), ("cross, row blocks", True),
}  # fmt: skip


@pytest.mark.parametrize(("layout", "nan", "tiles"), EXACT_CASES, ids=lambda v: str(v))
def test_chunked_scan_equals_whole_scan_on_exact_data(layout, nan, tiles, device, monkeypatch):
    keep_under_interpreter((layout, nan, tiles) not in INTERPRETER_EXACT, "triton", device)
    Q, D, call, _ref = _layouts(device, DTYPE, int_grid, nan)[layout]
    whole, plain = _run(monkeypatch, None, call, Q, D)
    split, chunked = _run(monkeypatch, tiles, call, Q, D)
    assert plain == [1] and (min(chunked) if tiles == 1 else max(chunked)) > 1
    if nan:  # (which token a NaN row picks is not specified: argmax compared where the score is a number)
        assert torch.isnan(split[0]).any()
        finite = ~torch.isnan(whole[1])
        split, whole = (split[0], split[1], split[2][finite]), (whole[0], whole[1], whole[2][finite])
    for a, b in zip(split, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("layout", [*LAYOUTS, "cross, row blocks"])
def test_chunked_scan_matches_reference(layout, normalize, device, monkeypatch):
    keep_under_interpreter((layout, normalize) in INTERPRETER_REF, "triton", device)
    if layout == "cross, row blocks":  # (fp32 queries of 70 tokens: two row blocks of 64 rows each)
        Q, D = randn((2, 70, 16), seed=11, device=device), randn((2, 100, 16), seed=12, device=device)
        call, ref = maxsim.maxsim, reference.maxsim_with_argmax
    else:
        Q, D, call, ref = _layouts(device, torch.float32, randn, False)[layout]

    def f(q, d, **kw):
        return call(q, d, normalize=normalize, **kw)

    (scores, _s, arg, dQ, dD), chunked = _run(monkeypatch, 1, f, Q, D)
    assert min(chunked) > 1
    Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
    r_scores, r_arg = ref(Qr, Dr, normalize=normalize)
    rdQ, rdD = torch.autograd.grad(r_scores, (Qr, Dr), torch.ones_like(r_scores))
    torch.testing.assert_close(scores.double(), r_scores.detach(), rtol=1e-4, atol=1e-4)
    assert torch.equal(arg.long(), r_arg.long())
    torch.testing.assert_close(dQ.double(), rdQ, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dD.double(), rdD, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["candidates", "pairs", "pair list", "padded"])
def test_deep_pipeline_equals_table_launch_on_exact_data(layout, device, monkeypatch):
    """Thin row blocks in the deep-pipelined configuration (128-token tiles; here chunked too) score as the table's
    configuration, streaming or not."""
    keep_under_interpreter(layout in ("pairs", "padded"), "triton", device)
    Q, D, call, _ref = _layouts(device, DTYPE, int_grid, False)[layout]
    table, _ = _run(monkeypatch, None, call, Q, D)
    deep, chunked = _run(monkeypatch, 1, call, Q, D, deep=True)
    assert {(p.constexprs["BLOCK_N"], p.num_stages) for p in launch_forward.plans.values()} == {(128, 4)}
    assert min(chunked) > 1
    for a, b in zip(deep, table, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_few_program_rules(monkeypatch):
    """The deep pipeline for launches of fewer programs than multiprocessors, thin row blocks, one dim chunk,
    16-bit tokens and long documents. Chunks only for launches that fill at most 1 / DOC_SPLIT_BELOW of the
    multiprocessors, enough chunks for DOC_SPLIT_PROGRAMS_PER_SM programs a multiprocessor but none shorter than
    DOC_SPLIT_MIN_TILES tiles; chunks are whole tiles and cover the longest document."""
    from maxsim.kernels.configs import forward_config

    monkeypatch.setattr(device_info, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    D16, D32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    thin = forward_config(32, 128, 64, False)
    assert launch_forward.deep_pipelined(64, thin, 2048, D16)
    assert not launch_forward.deep_pipelined(132, thin, 2048, D16)  # the GPU already full
    assert not launch_forward.deep_pipelined(64, thin, 256, D16)  # short documents
    assert not launch_forward.deep_pipelined(64, thin, 2048, D32)
    assert not launch_forward.deep_pipelined(64, forward_config(64, 128, 64, False), 2048, D16)  # 64 rows
    assert not launch_forward.deep_pipelined(64, forward_config(32, 256, 64, False), 2048, D16)  # two dim chunks
    monkeypatch.setattr(device_info, "shared_bytes", lambda device: 99 << 10)  # (a consumer GPU's shared memory)
    assert not launch_forward.deep_pipelined(64, thin, 2048, D16)

    assert launch_forward.document_chunks(34, 8192, 128, dev) == (1, 0)  # more than a quarter of the multiprocessors
    assert launch_forward.document_chunks(33, 8192, 128, dev) == (4, 2048)  # 132 programs
    assert launch_forward.document_chunks(1, 2048, 128, dev) == (4, 512)  # no chunk under 4 tiles
    assert launch_forward.document_chunks(8, 128 * 7, 128, dev) == (1, 0)  # 7 tiles: no two chunks of 4
    assert launch_forward.document_chunks(16, 300 * 128, 128, dev) == (
        9,
        34 * 128,
    )  # 300 tiles: 9 chunks (the last of 28)
    n, length = launch_forward.document_chunks(10, 5000, 128, dev)  # 40 tiles: chunks of 4
    assert (n, length) == (10, 512) and n * length >= 5000 > (n - 1) * length
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_PROGRAMS_PER_SM", 0)
    assert launch_forward.document_chunks(1, 2048, 128, dev) == (1, 0)
