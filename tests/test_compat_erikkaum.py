"""maxsim.compat.erikkaum: erikkaum/maxsim's call surface (names, order, shapes, dtypes, return types) on maxsim.

Every wrapper is compared with :mod:`maxsim.reference` evaluated in float64 on the same inputs: scores, gradients of
the ``_train`` variants, argmax of the ``_with_argmax`` variants (in that library's convention: int32, index inside
the document, 0 past a query's length). Runs on the "torch" backend (and on Triton too where CUDA is present).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import randn, seed_of

import maxsim
from maxsim import reference
from maxsim.compat import erikkaum as ek

# ----------------------------------------------------------------------------------------------------
# fixtures and builders


@pytest.fixture(params=["torch", "triton"])
def impl(request, device):
    """The "torch" backend everywhere; Triton only on CUDA tensors (never the slow CPU interpreter here)."""
    if request.param == "triton" and torch.device(device).type != "cuda":
        pytest.skip("Triton is exercised here on CUDA only")
    with maxsim.backend(request.param):
        yield request.param


def _offsets(lengths: list[int], dtype, device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype, device=device)


def _lengths_1d(n: int, low: int, high: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def _check_scores(actual, expected, dtype, what="scores"):
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}, expected float32"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    scale = expected.abs().max().item() + 1.0
    torch.testing.assert_close(actual.detach().double().cpu(), expected.detach().cpu(), rtol=tol, atol=tol * scale)


def _check_grad(actual, expected, dtype, what):
    assert actual is not None, f"{what}: no gradient"
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected the input dtype {dtype}"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double().cpu(), expected.cpu(), rtol=tol, atol=tol * scale)


def _grads(fn, leaves, upstream):
    """(scores, grads of the leaves) of ``fn(*leaves)`` with upstream gradient ``upstream``."""
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    s = fn(*leaves)
    s.backward(upstream.to(s.device, s.dtype))
    return s.detach(), [x.grad for x in leaves]


# ----------------------------------------------------------------------------------------------------
# problems: inputs in that library's layout + float64 reference results


def padded_problem(dtype, device, index_dtype=torch.int32, seed=0):
    B, K, Lq, Ld, dim = 3, 4, 7, 9, 16
    Q = randn((B, Lq, dim), seed=seed, dtype=dtype, device=device)
    D = randn((B, K, Ld, dim), seed=seed + 1, dtype=dtype, device=device)
    qlen = torch.tensor([7, 3, 5], dtype=index_dtype, device=device)
    dlen = torch.tensor(_lengths_1d(B * K, 1, Ld, seed + 2), dtype=index_dtype, device=device).reshape(B, K)
    return Q, D, qlen, dlen


def padded_reference(Q, D, qlen, dlen):
    Lq, Ld = Q.shape[1], D.shape[2]
    qm = torch.arange(Lq)[None] < qlen.cpu().long()[:, None]
    dm = torch.arange(Ld)[None, None] < dlen.cpu().long()[..., None]
    s, a = reference.maxsim_with_argmax(Q.detach().cpu().double(), D.detach().cpu().double(), qm, dm)
    return s, a.clamp_min(0).to(torch.int32), lambda q, d: reference.maxsim(q, d, qm, dm)


def contrastive_problem(dtype, device, index_dtype=torch.int32, seed=10):
    Nq, Lq, dim = 4, 5, 16
    doc_lens = [3, 11, 1, 6, 8]
    Q = randn((Nq, Lq, dim), seed=seed, dtype=dtype, device=device)
    D = randn((sum(doc_lens), dim), seed=seed + 1, dtype=dtype, device=device)
    return Q, D, _offsets(doc_lens, index_dtype, device)


def contrastive_reference(Q, D, offsets):
    Nq, Lq, dim = Q.shape
    cu_q = torch.arange(Nq + 1) * Lq
    cu_d = offsets.cpu().long()
    Qd, Dd = Q.detach().cpu().double(), D.detach().cpu().double()
    scores = reference.maxsim_varlen(Qd.reshape(Nq * Lq, dim), Dd, cu_q, cu_d)
    argmax = torch.zeros(Nq, len(cu_d) - 1, Lq, dtype=torch.int32)
    for i in range(len(cu_d) - 1):
        _, a = reference.maxsim_with_argmax(Qd, Dd[cu_d[i] : cu_d[i + 1]])
        argmax[:, i] = a.clamp_min(0).to(torch.int32)
    return scores, argmax, lambda q, d: reference.maxsim_varlen(q.reshape(Nq * Lq, dim), d, cu_q, cu_d)


def pairs_problem(dtype, device, index_dtype=torch.int32, seed=20):
    q_lens, d_lens, dim = [4, 1, 7, 3], [5, 9, 2], 16
    Q = randn((sum(q_lens), dim), seed=seed, dtype=dtype, device=device)
    D = randn((sum(d_lens), dim), seed=seed + 1, dtype=dtype, device=device)
    # unsorted, with a repeated pair, every query and document used
    pq = torch.tensor([2, 0, 3, 1, 2, 0, 2], dtype=index_dtype, device=device)
    pd = torch.tensor([1, 0, 2, 1, 1, 2, 0], dtype=index_dtype, device=device)
    return Q, _offsets(q_lens, index_dtype, device), D, _offsets(d_lens, index_dtype, device), pq, pd


def pairs_reference(Q, qoff, D, doff, pq, pd, width=None):
    cq, cd = qoff.cpu().long(), doff.cpu().long()
    pq, pd = pq.cpu().long(), pd.cpu().long()
    Qd, Dd = Q.detach().cpu().double(), D.detach().cpu().double()
    scores = reference.maxsim_pairs_varlen(Qd, Dd, cq, cd, pq, pd)
    width = int((cq[1:] - cq[:-1]).max()) if width is None else width
    argmax = torch.zeros(len(pq), width, dtype=torch.int32)
    for p, (i, j) in enumerate(zip(pq.tolist(), pd.tolist(), strict=True)):
        _, a = reference.maxsim_with_argmax(Qd[cq[i] : cq[i + 1]], Dd[cd[j] : cd[j + 1]])
        argmax[p, : a.numel()] = a.clamp_min(0).to(torch.int32)
    return scores, argmax, lambda q, d: reference.maxsim_pairs_varlen(q, d, cq, cd, pq, pd)


# ----------------------------------------------------------------------------------------------------
# the call surface itself


_SIGNATURES = {
    "score_candidates_padded": ["queries", "documents", "query_lengths", "doc_lengths"],
    "score_contrastive": ["queries", "documents", "document_offsets"],
    "score_pairs_packed": [
        "queries",
        "query_offsets",
        "documents",
        "document_offsets",
        "pair_query_ids",
        "pair_document_ids",
        "*max_q_len=None",
    ],
}


@pytest.mark.parametrize("family", sorted(_SIGNATURES))
@pytest.mark.parametrize("variant", ["", "_with_argmax", "_train"])
def test_signature(family, variant):
    """Argument names, order, kinds and defaults as erikkaum/maxsim (torch-ext/maxsim/__init__.py)."""
    fn = getattr(ek, family + variant)
    assert fn.__name__ == family + variant
    assert fn.__name__ in ek.__all__
    described = []
    for p in inspect.signature(fn).parameters.values():
        text = p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            text = "*" + text
        else:
            assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, (fn.__name__, p.name, p.kind)
        described.append(text)
    assert described == _SIGNATURES[family]
    assert fn.__doc__, fn.__name__


def test_compat_package_exports():
    import maxsim.compat

    assert maxsim.compat.erikkaum is ek
    assert len(ek.__all__) == 9


# ----------------------------------------------------------------------------------------------------
# padded candidates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_candidates_padded(impl, device, dtype, index_dtype):
    Q, D, qlen, dlen = padded_problem(dtype, device, index_dtype)
    ref_s, ref_a, _ = padded_reference(Q, D, qlen, dlen)
    # as the README shows it: positional
    s = ek.score_candidates_padded(Q, D, qlen, dlen)
    _check_scores(s, ref_s, dtype)
    # by keyword
    s_kw = ek.score_candidates_padded(queries=Q, documents=D, query_lengths=qlen, doc_lengths=dlen)
    torch.testing.assert_close(s_kw, s, rtol=0, atol=0)
    s2, a = ek.score_candidates_padded_with_argmax(queries=Q, documents=D, query_lengths=qlen, doc_lengths=dlen)
    _check_scores(s2, ref_s, dtype)
    assert a.dtype == torch.int32 and a.shape == (3, 4, 7)
    if dtype == torch.float32:  # bf16 data has exact ties whose winner depends on rounding of the sums
        assert torch.equal(a.cpu(), ref_a), (a.cpu(), ref_a)
    assert torch.equal(a[1, :, 3:].cpu(), torch.zeros(4, 4, dtype=torch.int32)), "slots past the length are 0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_candidates_padded_train(impl, device, dtype):
    Q, D, qlen, dlen = padded_problem(dtype, device, seed=3)
    _, _, ref_fn = padded_reference(Q, D, qlen, dlen)
    g = randn((3, 4), seed=seed_of("padded-train"), device=device) + 0.5
    s, (dQ, dD) = _grads(lambda q, d: ek.score_candidates_padded_train(q, d, qlen, dlen), [Q, D], g)
    rs, (rdQ, rdD) = _grads(ref_fn, [Q.cpu().double(), D.cpu().double()], g.cpu().double())
    _check_scores(s, rs, dtype)
    _check_grad(dQ, rdQ, dtype, "dQ")
    _check_grad(dD, rdD, dtype, "dD")


# ----------------------------------------------------------------------------------------------------
# contrastive


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_contrastive(impl, device, dtype, index_dtype):
    Q, D, off = contrastive_problem(dtype, device, index_dtype)
    ref_s, ref_a, _ = contrastive_reference(Q, D, off)
    s = ek.score_contrastive(Q, D, off)
    _check_scores(s, ref_s, dtype)
    s_kw = ek.score_contrastive(queries=Q, documents=D, document_offsets=off)
    torch.testing.assert_close(s_kw, s, rtol=0, atol=0)
    s2, a = ek.score_contrastive_with_argmax(queries=Q, documents=D, document_offsets=off)
    _check_scores(s2, ref_s, dtype)
    assert a.dtype == torch.int32 and a.shape == (4, 5, 5)
    if dtype == torch.float32:
        assert torch.equal(a.cpu(), ref_a), (a.cpu(), ref_a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_contrastive_train(impl, device, dtype):
    Q, D, off = contrastive_problem(dtype, device, seed=13)
    _, _, ref_fn = contrastive_reference(Q, D, off)
    g = randn((4, 5), seed=seed_of("contrastive-train"), device=device) + 0.5
    s, (dQ, dD) = _grads(lambda q, d: ek.score_contrastive_train(q, d, off), [Q, D], g)
    rs, (rdQ, rdD) = _grads(ref_fn, [Q.cpu().double(), D.cpu().double()], g.cpu().double())
    _check_scores(s, rs, dtype)
    _check_grad(dQ, rdQ, dtype, "dQ")
    _check_grad(dD, rdD, dtype, "dD")


def test_contrastive_readme_training_step(impl, device):
    """The README's training step: pack documents with a cumsum of lengths, cross-entropy on diagonal targets."""
    Nb, Ld, dim = 4, 6, 16
    queries = randn((Nb, 5, dim), seed=31, device=device).requires_grad_()
    doc_emb = randn((Nb, Ld, dim), seed=32, device=device).requires_grad_()
    doc_lengths = torch.tensor([6, 2, 4, 5], device=device)
    documents = torch.cat([doc_emb[i, : doc_lengths[i]] for i in range(Nb)], dim=0)
    document_offsets = torch.zeros(Nb + 1, dtype=torch.int32, device=device)
    document_offsets[1:] = doc_lengths.cumsum(0)
    scores = ek.score_contrastive_train(queries, documents, document_offsets)
    loss = torch.nn.functional.cross_entropy(scores, torch.arange(Nb, device=device))
    loss.backward()

    q64 = queries.detach().cpu().double().requires_grad_()
    d64 = doc_emb.detach().cpu().double().requires_grad_()
    dm = torch.arange(Ld)[None] < doc_lengths.cpu()[:, None]
    ref = torch.nn.functional.cross_entropy(reference.maxsim(q64, d64, None, dm), torch.arange(Nb))
    ref.backward()
    torch.testing.assert_close(loss.detach().double().cpu(), ref.detach(), rtol=1e-5, atol=1e-6)
    _check_grad(queries.grad, q64.grad, torch.float32, "queries.grad")
    _check_grad(doc_emb.grad, d64.grad, torch.float32, "doc_emb.grad")


# ----------------------------------------------------------------------------------------------------
# packed pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_pairs_packed(impl, device, dtype, index_dtype):
    Q, qoff, D, doff, pq, pd = pairs_problem(dtype, device, index_dtype)
    ref_s, ref_a, _ = pairs_reference(Q, qoff, D, doff, pq, pd)
    s = ek.score_pairs_packed(Q, qoff, D, doff, pq, pd)
    _check_scores(s, ref_s, dtype)
    s_kw = ek.score_pairs_packed(
        queries=Q,
        query_offsets=qoff,
        documents=D,
        document_offsets=doff,
        pair_query_ids=pq,
        pair_document_ids=pd,
        max_q_len=7,
    )
    torch.testing.assert_close(s_kw, s, rtol=0, atol=0)
    s2, a = ek.score_pairs_packed_with_argmax(Q, qoff, D, doff, pq, pd)
    _check_scores(s2, ref_s, dtype)
    assert a.dtype == torch.int32 and a.shape == (7, 7)
    if dtype == torch.float32:
        assert torch.equal(a.cpu(), ref_a), (a.cpu(), ref_a)


def test_pairs_packed_argmax_width(impl, device):
    """``max_q_len`` larger than the longest query widens the argmax; the extra slots are 0."""
    Q, qoff, D, doff, pq, pd = pairs_problem(torch.float32, device)
    ref_s, ref_a, _ = pairs_reference(Q, qoff, D, doff, pq, pd, width=10)
    s, a = ek.score_pairs_packed_with_argmax(Q, qoff, D, doff, pq, pd, max_q_len=10)
    _check_scores(s, ref_s, torch.float32)
    assert a.dtype == torch.int32 and a.shape == (7, 10)
    assert torch.equal(a.cpu(), ref_a), (a.cpu(), ref_a)


@pytest.mark.parametrize(
    ("dtype", "max_q_len"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 9)], ids=str
)
def test_pairs_packed_train(impl, device, dtype, max_q_len):
    Q, qoff, D, doff, pq, pd = pairs_problem(dtype, device, seed=23)
    _, _, ref_fn = pairs_reference(Q, qoff, D, doff, pq, pd)
    g = randn((7,), seed=seed_of("pairs-train"), device=device) + 0.5

    def fn(q, d):
        return ek.score_pairs_packed_train(q, qoff, d, doff, pq, pd, max_q_len=max_q_len)

    s, (dQ, dD) = _grads(fn, [Q, D], g)
    rs, (rdQ, rdD) = _grads(ref_fn, [Q.cpu().double(), D.cpu().double()], g.cpu().double())
    _check_scores(s, rs, dtype)
    _check_grad(dQ, rdQ, dtype, "dQ")
    _check_grad(dD, rdD, dtype, "dD")


# ----------------------------------------------------------------------------------------------------
# every variant: the same scores; _train returns one differentiable tensor


def test_variants_agree_and_train_returns_a_tensor(impl, device):
    cases = {
        "score_candidates_padded": padded_problem(torch.float32, device),
        "score_contrastive": contrastive_problem(torch.float32, device),
        "score_pairs_packed": pairs_problem(torch.float32, device),
    }
    for family, args in cases.items():
        leaves = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
        plain = getattr(ek, family)(*args)
        scores, _ = getattr(ek, family + "_with_argmax")(*args)
        trained = getattr(ek, family + "_train")(*leaves)
        assert isinstance(trained, torch.Tensor) and trained.requires_grad, family
        torch.testing.assert_close(scores, plain, rtol=0, atol=0)
        torch.testing.assert_close(trained.detach(), plain, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# documented differences and errors


def test_empty_segments_score_zero(impl, device):
    """A documented relaxation: empty documents / zero lengths score 0 (erikkaum/maxsim raised)."""
    Q, D, qlen, dlen = padded_problem(torch.float32, device)
    dlen = dlen.clone()
    dlen[0, 1] = 0
    s, a = ek.score_candidates_padded_with_argmax(Q, D, qlen, dlen)
    assert s[0, 1].item() == 0.0 and bool((a[0, 1] == 0).all())
    Qc, Dc, _ = contrastive_problem(torch.float32, device)
    off = _offsets([3, 0, 11, 1, 6, 8], torch.int32, device)  # the same 29 rows with an empty document inserted
    s = ek.score_contrastive(Qc, Dc, off)
    assert s.shape == (4, 6) and bool((s[:, 1] == 0).all())


def test_errors(device):
    Q, qoff, D, doff, pq, pd = pairs_problem(torch.float32, device)
    with pytest.raises(ValueError, match="max_q_len"):
        ek.score_pairs_packed(Q, qoff, D, doff, pq, pd, max_q_len=0)
    with pytest.raises(TypeError, match="max_q_len"):
        ek.score_pairs_packed(Q, qoff, D, doff, pq, pd, max_q_len=2.5)
    with pytest.raises(TypeError):
        ek.score_pairs_packed(Q, qoff, D, doff, pq, pd, 7)  # max_q_len is keyword-only, as there
    with pytest.raises(ValueError, match="max_seqlen_q"):  # below the longest query (7): caught in the one sync
        ek.score_pairs_packed_with_argmax(Q, qoff, D, doff, pq, pd, max_q_len=6)
    with pytest.raises(ValueError, match="pair_d"):
        ek.score_pairs_packed(Q, qoff, D, doff, pq, pd + 3)
    Qc, Dc, off = contrastive_problem(torch.float32, device)
    with pytest.raises(ValueError, match="queries"):
        ek.score_contrastive(Qc[0], Dc, off)
    with pytest.raises(ValueError, match="cu_seqlens_d"):  # the last offset must be the number of document rows
        ek.score_contrastive(Qc, Dc[:-1], off)


def test_padded_out_of_range_length_is_nan(device):
    """Documented: lengths are not checked (no sync); a length past the padded extent gives NaN, not a number."""
    Q, D, qlen, dlen = padded_problem(torch.float32, device)
    dlen = dlen.clone()
    dlen[2, 3] = D.shape[2] + 1
    s = ek.score_candidates_padded(Q, D, qlen, dlen)
    assert torch.isnan(s[2, 3]) and not torch.isnan(s[:2]).any()


@pytest.mark.cuda
def test_padded_has_no_host_sync():
    Q, D, qlen, dlen = padded_problem(torch.bfloat16, "cuda")
    ek.score_candidates_padded(Q, D, qlen, dlen)  # warm-up (compilation, lazy init)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ek.score_candidates_padded(Q, D, qlen, dlen)
        ek.score_candidates_padded_with_argmax(Q, D, qlen, dlen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
