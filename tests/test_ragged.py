"""Parity of the ragged API with the float64 reference: scores, gradients (dQ, dD) and argmax.

Covers ``maxsim.maxsim_varlen``, ``maxsim.maxsim_pairs_varlen``, ``maxsim.maxsim_padded`` and
``maxsim.maxsim_with_argmax`` (and ``return_argmax=True`` of ``maxsim.maxsim`` / ``maxsim.maxsim_pairs``) against
:mod:`maxsim.reference` evaluated in float64 on the same rounded inputs (design.md §5), on every usable backend.

* random ragged batches come from ``hypothesis``, derandomized (CI sees the same examples on every run): lengths
  around the tile sizes 16/32/64/128 and 0/1, unsorted and repeated pair lists, every dtype, int32/int64 offsets,
  ``max_seqlen_*`` given or omitted, ``validate`` None/True/False, every ``backward`` mode;
* hand-picked edge cases (empty sequences and batches, exact ties, non-contiguous tokens, ``max_seqlen_*`` above the
  longest sequence) are parametrized, as are bad inputs (a ``ValueError``/``TypeError`` naming the argument);
* under the Triton interpreter (CPU) the shapes stay small and only a subset runs (``MAXSIM_TEST_FULL_INTERPRETER=1``
  runs it all).

Near-ties: gradients are compared only on tokens whose argmax is unambiguous, and an argmax in a near-tied row may be
any of the near-maximal document tokens; everywhere else the argmax must equal the reference's exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import pytest
import torch
from helpers import (
    DTYPES,
    FULL_INTERPRETER,
    GAP_TOL,
    Inputs,
    assert_grads_close,
    assert_rejected,
    assert_same_nan,
    assert_scores_close,
    general_cpu_path_only,
    int_grid,
    interpreted,
    keep_under_interpreter,
    make_inputs,
    randn,
    score_magnitude,
    seed_of,
    similarities,
    spy,
    triton_usable,
    unambiguous_tokens,
    upstream_grad,
    word,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import maxsim
from maxsim import layout, reference

INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
ALL_DTYPES = {**DTYPES, "fp64": torch.float64}
# 0/1 and both sides of the tile sizes 16/32/64/128
TILE_LENGTHS = (0, 1, 2, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)


# ----------------------------------------------------------------------------------------------------
# one ragged call


@dataclass(frozen=True)
class Ragged:
    """One call of ``maxsim_varlen`` (``pairs is None``) or ``maxsim_pairs_varlen`` and its inputs."""

    q_lens: tuple[int, ...]
    d_lens: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...] | None = None
    dim: int = 16
    dtype: str = "fp32"
    normalize: bool = False
    index: str = "int32"  # dtype of the offsets and pair ids
    max_seqlen: str = "given"  # "given" (the longest length), "bound" (given, above the longest) or "omitted"
    validate: bool | None = None  # None: not passed (the default)
    backward: str = "auto"
    return_argmax: bool = True
    exact: bool = False  # integer-valued tokens: exact ties in every dtype, every gradient entry compared
    noncontig: bool = False  # Q, D, the offsets and the pair ids as strided views
    seed: int = 0

    def __repr__(self) -> str:  # short ids / hypothesis reports: only what differs from the defaults
        parts = [f"q_lens={self.q_lens}", f"d_lens={self.d_lens}"]
        for name, default in _DEFAULTS.items():
            if getattr(self, name) != default:
                parts.append(f"{name}={getattr(self, name)!r}")
        return f"Ragged({', '.join(parts)})"

    @property
    def torch_dtype(self) -> torch.dtype:
        return ALL_DTYPES[self.dtype]

    def width_q(self) -> int:
        """The argmax's last dimension: ``max_seqlen_q`` when given, else the longest query."""
        return max(self.q_lens, default=0) + (3 if self.max_seqlen == "bound" else 0)

    def width_d(self) -> int:
        return max(self.d_lens, default=0) + (3 if self.max_seqlen == "bound" else 0)


_DEFAULTS = {
    "pairs": None,
    "dim": 16,
    "dtype": "fp32",
    "normalize": False,
    "index": "int32",
    "max_seqlen": "given",
    "validate": None,
    "backward": "auto",
    "return_argmax": True,
    "exact": False,
    "noncontig": False,
    "seed": 0,
}


def offsets(lens, index: str, device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=INDEX_DTYPES[index], device=device)


def packed_tokens(n: int, case: Ragged, *, seed: int, device) -> torch.Tensor:
    draw = int_grid if case.exact else randn
    if case.noncontig:  # every other column of a wider buffer
        base = draw((n, 2 * case.dim), seed=seed, dtype=case.torch_dtype, device=device)
        return base[:, 1::2]
    return draw((n, case.dim), seed=seed, dtype=case.torch_dtype, device=device)


@dataclass
class Built:
    Q: torch.Tensor
    D: torch.Tensor
    cu_q: torch.Tensor
    cu_d: torch.Tensor
    pair_q: torch.Tensor | None
    pair_d: torch.Tensor | None


def build(case: Ragged, device) -> Built:
    seed = case.seed or seed_of(case)
    Q = packed_tokens(sum(case.q_lens), case, seed=seed, device=device)
    D = packed_tokens(sum(case.d_lens), case, seed=seed + 1, device=device)
    cu_q, cu_d = offsets(case.q_lens, case.index, device), offsets(case.d_lens, case.index, device)
    pq = pd = None
    if case.pairs is not None:
        pairs = torch.tensor(case.pairs, dtype=INDEX_DTYPES[case.index], device=device).view(-1, 2)
        pq, pd = pairs[:, 0], pairs[:, 1]  # columns of a [P, 2] tensor: strided
        if not case.noncontig:
            pq, pd = pq.contiguous(), pd.contiguous()
    if case.noncontig:  # offsets as the first column of a two-column buffer (the other column: garbage)
        cu_q, cu_d = (torch.stack([cu, -7 - cu], dim=1)[:, 0] for cu in (cu_q, cu_d))
    return Built(Q, D, cu_q, cu_d, pq, pd)


def lib_call(case: Ragged, b: Built, Q=None, D=None):
    Q = b.Q if Q is None else Q
    D = b.D if D is None else D
    kw = dict(normalize=case.normalize, backward=case.backward, return_argmax=case.return_argmax)
    if case.validate is not None:
        kw["validate"] = case.validate
    if case.max_seqlen != "omitted":
        kw["max_seqlen_q"] = case.width_q()
        kw["max_seqlen_d"] = case.width_d()
    if case.pairs is None:
        return maxsim.maxsim_varlen(Q, D, b.cu_q, b.cu_d, **kw)
    return maxsim.maxsim_pairs_varlen(Q, D, b.cu_q, b.cu_d, b.pair_q, b.pair_d, **kw)


def steps_without_and_with_argmax(case: Ragged, b: Built, Q, D) -> list[tuple[torch.Tensor, ...]]:
    """``(scores, dQ, dD)`` of the PyTorch path's training step of ``case`` on tokens ``Q``, ``D``, without the
    argmax returned (where a ragged CPU path keeps its own state for the backward) and with it, under integer upstream
    weights."""
    out = []
    for return_argmax in (False, True):
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        with maxsim.backend("torch"):
            res = lib_call(dataclasses.replace(case, return_argmax=return_argmax), b, Qg, Dg)
        s = res[0] if return_argmax else res
        weights = (torch.arange(s.numel(), dtype=s.dtype) % 5 - 2).view(s.shape)
        out.append((s.detach(), *torch.autograd.grad(s, (Qg, Dg), weights)))
    return out


def ref_call(case: Ragged, b: Built, Q, D):
    """float64 (scores, argmax int64) of the reference, argmax padded to ``width_q``."""
    kw = dict(max_seqlen_q=case.width_q(), max_seqlen_d=case.width_d(), normalize=case.normalize)
    if case.pairs is None:
        return reference.maxsim_varlen_with_argmax(Q, D, b.cu_q, b.cu_d, **kw)
    return reference.maxsim_pairs_varlen_with_argmax(Q, D, b.cu_q, b.cu_d, b.pair_q, b.pair_d, **kw)


def dense_view(case: Ragged, b: Built) -> tuple[Inputs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same call as dense masked inputs (for tolerances / near-ties), in the inputs' dtype.

    Returns ``(inputs, q_rows, q_valid, d_rows, d_valid)``: ``q_rows [M, Lq]`` is the packed row of each dense query
    slot (``q_valid`` where it is a real token), likewise for documents; the cross product uses layout "cross", the
    pair list layout "pairs" (one dense row per pair).
    """
    Qp, qm = reference._pad_packed(b.Q.detach(), b.cu_q, case.width_q())
    Dp, dm = reference._pad_packed(b.D.detach(), b.cu_d, case.width_d())
    q_rows = b.cu_q[:-1].long().cpu()[:, None] + torch.arange(Qp.shape[1])
    d_rows = b.cu_d[:-1].long().cpu()[:, None] + torch.arange(Dp.shape[1])
    if case.pairs is None:
        return Inputs("cross", Qp, Dp, qm, dm), q_rows, qm.cpu(), d_rows, dm.cpu()
    pq, pd = b.pair_q.long(), b.pair_d.long()
    inp = Inputs("pairs", Qp[pq], Dp[pd], qm[pq], dm[pd])
    pq, pd = pq.cpu(), pd.cpu()
    return inp, q_rows[pq], qm.cpu()[pq], d_rows[pd], dm.cpu()[pd]


def packed_keep(keep_dense: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, n_rows: int) -> torch.Tensor:
    """A packed token is compared iff it is unambiguous in every dense slot (every pair) it appears in."""
    ambiguous = torch.zeros(n_rows, dtype=torch.bool)
    ambiguous[rows[valid & ~keep_dense.reshape(valid.shape)]] = True
    return ~ambiguous


def assert_argmax_matches(arg, rarg, inp: Inputs, *, normalize: bool, exact: bool, what="argmax"):
    """int32, the reference's shape, and equal to the reference where the max is unambiguous (everywhere if
    ``exact``); in a near-tied row, any of the near-maximal valid document tokens."""
    assert arg is not None, f"{what}: missing"
    assert arg.dtype == torch.int32, f"{what}: dtype {arg.dtype}, expected torch.int32"
    assert tuple(arg.shape) == tuple(rarg.shape), f"{what}: shape {tuple(arg.shape)} != {tuple(rarg.shape)}"
    sim, row_valid = similarities(inp, normalize)  # [M, K, Lq, Ld]
    sim, row_valid = sim.cpu(), row_valid.cpu()
    a = arg.detach().long().cpu().reshape(sim.shape[:-1])
    e = rarg.detach().long().cpu().reshape(sim.shape[:-1])
    ok = a == e
    ld = sim.shape[-1]
    if not exact and ld > 0 and sim.numel() > 0:
        finite = torch.isfinite(sim)
        scale = float(sim[finite].abs().max()) if finite.any() else 1.0
        close = finite & (sim >= sim.amax(-1, keepdim=True) - GAP_TOL[inp.dtype] * scale)
        near = row_valid & (close.sum(-1) > 1)
        picked = close.gather(-1, a.clamp(0, ld - 1)[..., None])[..., 0] & (a >= 0) & (a < ld)
        ok |= near & picked
    if not bool(ok.all()):
        bad = (~ok).nonzero().tolist()
        first = tuple(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)}/{ok.numel()} entries differ from the reference; first at (row, k, token) {first}: "
            f"got {int(a[first])}, expected {int(e[first])}; others at {bad[1:6]}"
        )


def compare_grads(actual, expected, *, dtype, keep, any_ties: bool, what: str):
    """:func:`assert_grads_close` on the unambiguous entries. ``any_ties``: random data may be mostly near-tied (a
    long query against a two-token document), so there the kept subset may be small or empty."""
    if keep is None or not any_ties:
        assert_grads_close(actual, expected, dtype=dtype, keep=keep, what=what)
        return
    assert actual is not None, f"{what}: no gradient (None)"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected the input dtype {dtype}"
    assert bool(torch.isfinite(actual).all()), f"{what}: non-finite values"
    k = keep.to(actual.device)
    assert_grads_close(actual[k], expected[k], dtype=dtype, what=what)


def check_ragged(
    case: Ragged, device, *, any_ties: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Library against the float64 reference: scores, dQ, dD and (if asked) argmax. Returns (s, argmax, dQ, dD).

    any_ties: do not insist that most tokens be unambiguous (random cases); hand-picked cases do.
    """
    b = build(case, device)
    dtype = case.torch_dtype
    Q = b.Q.detach().requires_grad_()
    D = b.D.detach().requires_grad_()
    out = lib_call(case, b, Q, D)
    if case.return_argmax:
        assert isinstance(out, tuple) and len(out) == 2, f"return_argmax=True returned {type(out)}"
        s, arg = out
    else:
        assert isinstance(out, torch.Tensor), f"return_argmax=False returned {type(out)}"
        s, arg = out, None
    n_q, n_d = len(case.q_lens), len(case.d_lens)
    expected_shape = (n_q, n_d) if case.pairs is None else (len(case.pairs),)
    assert tuple(s.shape) == expected_shape, f"scores shape {tuple(s.shape)}, expected {expected_shape}"
    grad = upstream_grad(s.shape, seed=seed_of(case, "grad"), device=s.device)
    if s.numel() > 0:
        assert s.requires_grad, "scores do not require grad"
        s.backward(grad)

    Qr = b.Q.detach().double().requires_grad_()
    Dr = b.D.detach().double().requires_grad_()
    rs, rarg = ref_call(case, b, Qr, Dr)
    if rs.numel() > 0:
        rs.backward(grad.double())
    rdQ = torch.zeros_like(Qr) if Qr.grad is None else Qr.grad
    rdD = torch.zeros_like(Dr) if Dr.grad is None else Dr.grad

    inp, q_rows, q_valid, d_rows, d_valid = dense_view(case, b)
    mag = score_magnitude(inp, case.normalize, rs.shape)
    assert_scores_close(s.detach(), rs.detach(), dtype=dtype, magnitude=mag)
    if s.numel() == 0:
        for name, g in (("dQ", Q.grad), ("dD", D.grad)):
            assert g is None or not bool(g.any()), f"{name}: non-zero gradient of an empty output"
        dQ = torch.zeros_like(Q) if Q.grad is None else Q.grad
        dD = torch.zeros_like(D) if D.grad is None else D.grad
    else:
        dQ, dD = Q.grad, D.grad
        q_keep = d_keep = None
        if not case.exact:
            qk, dk = unambiguous_tokens(inp, case.normalize, GAP_TOL[dtype])
            q_keep = packed_keep(qk, q_rows, q_valid, Q.shape[0])[:, None].expand(Q.shape)
            d_keep = packed_keep(dk, d_rows, d_valid, D.shape[0])[:, None].expand(D.shape)
        compare_grads(dQ, rdQ, dtype=dtype, keep=q_keep, any_ties=any_ties, what="dQ")
        compare_grads(dD, rdD, dtype=dtype, keep=d_keep, any_ties=any_ties, what="dD")
    if case.return_argmax:
        assert arg.device == s.device, f"argmax on {arg.device}, scores on {s.device}"
        assert_argmax_matches(arg, rarg, inp, normalize=case.normalize, exact=case.exact)
    return s.detach(), arg, dQ, dD


# ----------------------------------------------------------------------------------------------------
# hypothesis: random ragged batches

# Under the Triton interpreter every (query, document) pair costs about a second: few, small examples there; the
# PyTorch path on CPU gets more, the GPU the most.
EXAMPLES = {"interpreter": 3, "cpu": 15, "cuda": 40}


def _size(backend: str, device) -> str:
    if interpreted(backend, device) and not FULL_INTERPRETER:
        return "interpreter"
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def _settings(size: str) -> settings:
    slow = size == "interpreter"
    return settings(
        max_examples=EXAMPLES[size],
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        # shrinking re-runs the kernels many times: not under the interpreter (the failing example is printed)
        phases=(Phase.explicit, Phase.generate) if slow else (Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _lengths(draw, n_max: int, budget: int) -> tuple[int, ...]:
    """1..n_max lengths, each either near a tile size or small, in total at most ``budget``."""
    out = []
    for _ in range(draw(st.integers(1, n_max))):
        left = budget - sum(out)
        tile = [x for x in TILE_LENGTHS if x <= left]
        out.append(draw(st.one_of(st.sampled_from(tile), st.integers(0, min(left, 40)))))
    return tuple(out)


@st.composite
def ragged_cases(draw, *, pairs: bool, size: str) -> Ragged:
    # (max sequences per side, query token budget, document token budget, dims, max pairs)
    n_max, q_budget, d_budget, dims, max_pairs = {
        "interpreter": (2, 140, 200, (8, 16, 32, 64), 3),  # dim <= 64, at most 4 (query, document) pairs
        "cpu": (4, 200, 300, (8, 16, 48, 64, 100), 12),
        "cuda": (6, 400, 700, (8, 16, 48, 64, 100, 128, 256), 32),
    }[size]
    q_lens = _lengths(draw, n_max, q_budget)
    d_lens = _lengths(draw, n_max, d_budget)
    dim = draw(st.sampled_from(dims))
    pair_list = None
    if pairs:  # any order, repeats allowed
        one = st.tuples(st.integers(0, len(q_lens) - 1), st.integers(0, len(d_lens) - 1))
        pair_list = tuple(draw(st.lists(one, min_size=1, max_size=max_pairs)))
    return Ragged(
        q_lens=q_lens,
        d_lens=d_lens,
        pairs=pair_list,
        dim=dim,
        dtype=draw(st.sampled_from(tuple(DTYPES))),
        normalize=draw(st.booleans()),
        index=draw(st.sampled_from(tuple(INDEX_DTYPES))),
        max_seqlen=draw(st.sampled_from(("given", "omitted"))),
        validate=draw(st.sampled_from((None, True, False))),
        backward=draw(st.sampled_from(("auto", "fast", "deterministic"))),
        return_argmax=draw(st.booleans()),
        seed=draw(st.integers(1, 2**20)),
    )


@pytest.mark.parametrize("pairs", [False, True], ids=["varlen", "pairs_varlen"])
def test_random_ragged_batches(pairs, backend, device):
    size = _size(backend, device)

    @_settings(size)
    @given(case=ragged_cases(pairs=pairs, size=size))
    def run(case):
        check_ragged(case, device, any_ties=True)

    run()


# ----------------------------------------------------------------------------------------------------
# hand-picked cases (kept: True = also under the interpreter)

# Under the interpreter every (query, document) pair costs about a second: the kept cases have few pairs.
VARLEN_CASES = [
    (Ragged((0, 17), (33, 0), dim=16), True),  # an empty query and an empty document
    (Ragged((129,), (65, 128), dim=16, dtype="fp16", normalize=True, index="int64", max_seqlen="omitted"), True),
    (Ragged((7,), (9, 12), dim=8, exact=True), True),  # exact ties: lowest index, every gradient entry compared
    (Ragged((9,), (11,), dim=32, noncontig=True, validate=True, backward="fast"), True),
    (Ragged((17,), (0, 33), dim=16, max_seqlen="bound", validate=False), True),  # max_seqlen above the longest
    (Ragged((1, 0, 17), (0, 33, 1, 16), dim=16), False),  # empty query and document, single tokens
    (Ragged((64, 63, 127), (31, 32, 129), dim=48, dtype="bf16", backward="deterministic"), False),
    (Ragged((5, 7, 0), (9, 3, 12), dim=8, dtype="fp16", exact=True, max_seqlen="omitted"), False),
    (Ragged((6, 9), (4, 11, 0), dim=16, dtype="bf16", exact=True, backward="deterministic"), False),
    (Ragged((3, 0, 9), (4, 11), dim=32, dtype="bf16", noncontig=True, validate=True, normalize=True), False),
    (Ragged((17, 4), (33, 0, 2), dim=16, dtype="fp16", max_seqlen="bound", index="int64"), False),
    (Ragged((0, 0), (0, 5), dim=8), False),  # every query empty (max_seqlen_q = 0)
    (Ragged((4, 1), (0, 0), dim=8, max_seqlen="omitted"), False),  # every document empty
    (Ragged((), (3, 2), dim=8), False),  # no query
    (Ragged((3,), (), dim=8), False),  # no document
    (Ragged((), (), dim=8, max_seqlen="omitted"), False),
]

PAIR_CASES = [
    # unsorted, repeated pairs, an empty query and an empty document
    (Ragged((3, 0, 17), (33, 0), pairs=((2, 0), (0, 1), (2, 0), (1, 0))), True),
    (Ragged((129,), (64, 65), pairs=((0, 1), (0, 1)), dtype="bf16", normalize=True, index="int64"), True),
    (Ragged((5, 8), (7, 3), pairs=((1, 1), (1, 1)), dim=8, exact=True, max_seqlen="omitted"), True),
    (Ragged((3, 0, 17), (33, 0, 1), pairs=((2, 0), (0, 2), (2, 0), (1, 0), (0, 1), (2, 2), (2, 0))), False),
    (Ragged((129, 3), (64, 65), pairs=((0, 1), (1, 0), (0, 0), (0, 1)), dtype="fp16", index="int64"), False),
    (Ragged((5, 8), (7, 3), pairs=((1, 1), (0, 0), (1, 1), (0, 1)), dim=8, dtype="bf16", exact=True), False),
    (Ragged((16, 32, 2), (64, 15), pairs=((2, 1), (0, 0), (1, 1), (1, 0)), dim=32, noncontig=True), True),
    (Ragged((17, 4), (9, 33), pairs=((1, 0), (0, 1)), max_seqlen="bound", dtype="fp16", validate=True), False),
    (Ragged((4, 2), (3,), pairs=(), dim=8), False),  # no pair
    (Ragged((0, 0), (0, 3), pairs=((1, 0), (0, 1), (0, 1)), dim=8), False),
]


def _case_ids(cases):
    return [f"{i}-{c.dtype}{'-exact' if c.exact else ''}" for i, (c, _) in enumerate(cases)]


@pytest.mark.parametrize("dd", ["owned", "atomics"])
@pytest.mark.parametrize("case,keep", VARLEN_CASES, ids=_case_ids(VARLEN_CASES))
def test_varlen_cases(case, keep, dd, backend, device, monkeypatch):
    """``dd``: the Triton backward owns dD (small cross products, the default at these sizes) or adds it with
    atomics into a zeroed fp32 buffer (large ones; forced here)."""
    keep_under_interpreter(keep, backend, device)
    if dd == "atomics":
        if backend != "triton":
            pytest.skip("the owner/atomics choice is the Triton backward's")
        from maxsim.kernels import launch_settings

        monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)  # (a plan key: no stale plan is reused)

        monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    check_ragged(case, device)


@pytest.mark.parametrize("case,keep", VARLEN_CASES + PAIR_CASES, ids=_case_ids(VARLEN_CASES + PAIR_CASES))
def test_cases_by_length_class(case, keep, monkeypatch):
    """The CPU path with documents grouped by length class (large padded problems; forced here, and the packed
    path's argmax bound set below every problem) matches the reference like the single padded call, for the varlen
    cross product and for pair lists."""
    from maxsim import cpu_ragged

    general_cpu_path_only(monkeypatch)
    monkeypatch.setattr(cpu_ragged, "BY_LENGTH_MIN_WORK", 0)
    monkeypatch.setattr(cpu_ragged, "PACKED_ARGMAX_MAX_SIMS", -1)
    with maxsim.backend("torch"):
        check_ragged(case, "cpu")


@pytest.mark.parametrize("reduction", ["segments", "per-document"])
@pytest.mark.parametrize("grad", [False, True], ids=["scores", "argmax-and-grads"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-block", "chunked"])
@pytest.mark.parametrize("case,keep", VARLEN_CASES, ids=_case_ids(VARLEN_CASES))
def test_packed_cpu_path(case, keep, chunked, grad, reduction, monkeypatch):
    """A packed varlen batch on the CPU is scored from GEMMs of the real tokens, without padding (``chunked``:
    blocks of a few rows forced), each document's maxima found as segments of ``Q·Dᵀ`` or by a reduction a document
    (``reduction``, forced either way): the reference's scores without a gradient, and its scores, argmax and
    gradients with one."""
    from maxsim import cpu, cpu_ragged

    general_cpu_path_only(monkeypatch)  # (with the argmax, small batches take the small-problem path)
    monkeypatch.setattr(cpu_ragged, "PER_DOCUMENT_MIN_SIMS", 0 if reduction == "per-document" else 1 << 62)
    if chunked:
        monkeypatch.setattr(cpu, "BLOCK_BYTES", 256)
        monkeypatch.setattr(cpu_ragged, "PACKED_QUERY_ROWS", 8)
    taken = spy(monkeypatch, cpu_ragged, "_packed_cross")
    if grad:
        with maxsim.backend("torch"):
            check_ragged(case, "cpu")
    else:
        case = dataclasses.replace(case, return_argmax=False)
        b = build(case, "cpu")
        with maxsim.backend("torch"), torch.no_grad():
            s = lib_call(case, b)
        rs, _ = ref_call(case, b, b.Q.double(), b.D.double())
        inp = dense_view(case, b)[0]
        assert_scores_close(s, rs, dtype=case.torch_dtype, magnitude=score_magnitude(inp, case.normalize, rs.shape))
    assert taken, "the call did not take the packed path"


def test_packed_path_never_reads_offsets_off_the_cpu():
    """The packed path's read-back of offsets happens on CPU tensors only: offsets elsewhere (a ``meta`` tensor here,
    which has no values to read) send the call to the padded path instead of syncing."""
    from maxsim import cpu_ragged

    assert cpu_ragged._well_formed(torch.zeros(3, dtype=torch.int32, device="meta"), 10, 5) is None
    assert cpu_ragged._well_formed(torch.tensor([0, 3, 5], dtype=torch.int32), 10, 5) == ([0, 3, 5], [3, 2])


@pytest.mark.parametrize("path", ["small", "packed", "packed-per-document"])
def test_packed_cpu_path_nan_argmax(path, monkeypatch):
    """A document holding NaN: its scores are NaN and each query token's argmax is the document's first NaN token,
    as ``torch.max`` (the reference) picks it; the other documents keep their argmax. On the small-problem path
    (:mod:`maxsim.cpu_small`, which takes this batch with its argmax) and on the packed one, with either reduction."""
    from maxsim import cpu_ragged

    if path != "small":
        general_cpu_path_only(monkeypatch)
        monkeypatch.setattr(cpu_ragged, "PER_DOCUMENT_MIN_SIMS", 0 if path == "packed-per-document" else 1 << 62)
    gen = torch.Generator().manual_seed(9)
    Q, D = torch.randn(7, 8, generator=gen), torch.randn(15, 8, generator=gen)
    D[6, 3] = D[8, 0] = float("nan")  # tokens 2 and 4 of document 1 (rows 4..10)
    cu_q, cu_d = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 11, 15], dtype=torch.int32)
    with maxsim.backend("torch"), torch.no_grad():
        s, arg = maxsim.maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=4, max_seqlen_d=7, return_argmax=True)
    rs, rarg = reference.maxsim_varlen_with_argmax(Q.double(), D.double(), cu_q, cu_d, max_seqlen_q=4, max_seqlen_d=7)
    assert_same_nan(s, rs, "scores")
    assert bool(torch.isnan(s[:, 1]).all()) and not bool(torch.isnan(s[:, [0, 2]]).any())
    assert torch.equal(arg.long(), rarg), f"argmax {arg.tolist()} != reference {rarg.tolist()}"
    assert bool((arg[:, 1][rarg[:, 1] >= 0] == 2).all()), "the first NaN token is not the argmax"


@pytest.mark.parametrize(
    "cu_d,max_d,bad_doc",
    [((0, 5, 13), 8, 1), ((0, 7, 12), 6, 0), ((0, 9, 5), 12, 1), ((-2, 5, 12), 8, 0)],
    ids=["past-the-rows", "longer-than-max_seqlen", "decreasing", "negative"],
)
@pytest.mark.parametrize("grad", [False, True], ids=["scores", "with-grad"])
def test_packed_cpu_path_bad_offsets(cu_d, max_d, bad_doc, grad):
    """Unvalidated offsets out of range or a segment longer than its ``max_seqlen``: the packed CPU path hands the
    call to the padded one, whose scores are NaN for the document concerned and the reference's for the other; with
    gradients (an upstream weight on the good document only), the reference's gradients for that document and
    exact zeros on every other document row."""
    gen = torch.Generator().manual_seed(5)
    Q, D = torch.randn(10, 8, generator=gen), torch.randn(12, 8, generator=gen)
    cu_q, cu_d_t = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor(cu_d, dtype=torch.int32)
    Qg, Dg = Q.clone().requires_grad_(grad), D.clone().requires_grad_(grad)
    with maxsim.backend("torch"), torch.set_grad_enabled(grad):
        s = maxsim.maxsim_varlen(Qg, Dg, cu_q, cu_d_t, max_seqlen_q=6, max_seqlen_d=max_d, validate=False)
    good = 1 - bad_doc
    g0, g1 = cu_d[good], cu_d[good + 1]
    Qr, Dr = Q.double().requires_grad_(grad), D[g0:g1].double().requires_grad_(grad)
    expected = reference.maxsim_varlen(Qr, Dr, cu_q, torch.tensor([0, g1 - g0]))[:, 0]
    assert bool(torch.isnan(s[:, bad_doc]).all()), f"document {bad_doc}: expected NaN scores, got {s[:, bad_doc]}"
    torch.testing.assert_close(s[:, good].detach().double(), expected.detach(), rtol=1e-5, atol=1e-5)
    if grad:
        upstream = torch.zeros_like(s)
        upstream[:, good] = 1.0
        dQ, dD = torch.autograd.grad(s, (Qg, Dg), upstream)
        rQ, rD = torch.autograd.grad(expected.sum(), (Qr, Dr))
        torch.testing.assert_close(dQ.double(), rQ, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dD[g0:g1].double(), rD, rtol=1e-5, atol=1e-5)
        others = torch.ones(12, dtype=torch.bool)
        others[g0:g1] = False
        assert bool((dD[others] == 0).all()), "rows outside the good document got gradient"


@pytest.mark.parametrize(
    "pair_q,pair_d,cu_d",
    [((0, 2, 1), (1, 0, 1), (0, 5, 12)), ((0, -1, 1), (1, 0, 1), (0, 5, 12)), ((0, 1, 1), (2, 0, 1), (0, 5, 12)),
     ((0, 1, 1), (1, 0, 1), (0, 5, 13))],
    ids=["query-id-too-large", "query-id-negative", "document-id-too-large", "offset-past-the-rows"],
)  # fmt: skip
@pytest.mark.parametrize("grad", [False, True], ids=["scores", "with-grad"])
def test_pairs_on_cpu_with_bad_ids(pair_q, pair_d, cu_d, grad):
    """Unvalidated pair ids or offsets out of range on the CPU: the pairs concerned score NaN (the checked path),
    the others the reference's scores (the pairs with good ids alone, through the fast path)."""
    gen = torch.Generator().manual_seed(3)
    Q, D = torch.randn(10, 8, generator=gen), torch.randn(12, 8, generator=gen)
    cu_q, cu_d_t = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor(cu_d, dtype=torch.int32)
    pq, pd = torch.tensor(pair_q), torch.tensor(pair_d)
    kw = dict(max_seqlen_q=6, max_seqlen_d=8, validate=False)
    with maxsim.backend("torch"), torch.set_grad_enabled(grad):
        s = maxsim.maxsim_pairs_varlen(Q.clone().requires_grad_(grad), D, cu_q, cu_d_t, pq, pd, **kw).detach()
    rows_d = cu_d[-1] <= D.shape[0]
    good = (pq >= 0) & (pq < 2) & (pd >= 0) & (pd < 2) & ((pd == 0) | rows_d)
    assert bool(torch.isnan(s[~good]).all()) and not bool(good.all()), f"expected NaN where {~good}, got {s}"
    keep = good.nonzero().squeeze(1)
    with maxsim.backend("torch"), torch.no_grad():
        expected = maxsim.maxsim_pairs_varlen(Q, D, cu_q, cu_d_t.clamp(max=12), pq[keep], pd[keep], **kw)
    ref = reference.maxsim_pairs_varlen(Q.double(), D.double(), cu_q, cu_d_t.clamp(max=12), pq[keep], pd[keep])
    torch.testing.assert_close(expected.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s[keep], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("index", ["scan", "csr"])
@pytest.mark.parametrize("case,keep", PAIR_CASES, ids=_case_ids(PAIR_CASES))
def test_pairs_varlen_cases(case, keep, index, backend, device, monkeypatch):
    """``index``: the Triton backward finds each query's and document's pairs by scanning the ids (short lists, the
    default at these sizes) or through CSR indexes (long lists; forced here)."""
    keep_under_interpreter(keep, backend, device)
    if index == "csr":
        if backend != "triton":
            pytest.skip("the CSR/scan choice is the Triton backward's")
        from maxsim.kernels import launch_settings

        monkeypatch.setattr(launch_settings, "PAIR_SCAN_MAX_WORK", 0)
    check_ragged(case, device)


def test_float64_inputs(device):
    """fp64 tokens give fp64 scores and gradients at fp64 accuracy (PyTorch path)."""
    with maxsim.backend("torch"):
        for pairs in (None, ((1, 0), (0, 2), (1, 0))):
            case = Ragged((5, 17), (9, 0, 33), pairs=pairs, dtype="fp64", normalize=True, max_seqlen="omitted")
            s, _, dQ, dD = check_ragged(case, device)
            assert s.dtype == dQ.dtype == dD.dtype == torch.float64


@pytest.mark.parametrize("fn", ["varlen", "pairs"])
def test_deterministic_backward_is_bitwise_reproducible(fn, backend, device):
    """backward="deterministic": scores, dQ and dD equal bitwise run to run (many pairs share tokens).

    Not under the interpreter (sequential there); the parity cases run backward="deterministic" on it too."""
    keep_under_interpreter(False, backend, device)
    pairs = None if fn == "varlen" else tuple((i % 3, (5 * i) % 4) for i in range(14))
    case = Ragged((17, 5, 33), (40, 1, 16, 70), pairs=pairs, dim=32, backward="deterministic", return_argmax=False)
    b = build(case, device)
    runs = []
    for _ in range(2):
        Q = b.Q.detach().clone().requires_grad_()
        D = b.D.detach().clone().requires_grad_()
        s = lib_call(case, b, Q, D)
        s.backward(upstream_grad(s.shape, seed=3, device=s.device))
        runs.append((s.detach(), Q.grad, D.grad))
    for name, x, y in zip(("scores", "dQ", "dD"), runs[0], runs[1], strict=True):
        assert torch.equal(x, y), f"{name} differs between two deterministic runs (max |diff| {(x - y).abs().max()})"


def _grads_by_scan_then_index(case: Ragged, b: Built, grad: torch.Tensor, monkeypatch) -> list[tuple]:
    """``[(dQ, dD)]`` of the Triton pair-list backward finding the pairs by scanning the ids, then by the index."""
    from maxsim.kernels import launch_settings

    grads = []
    with maxsim.backend("triton"):
        for limit in (launch_settings.PAIR_SCAN_MAX_WORK, 0):
            monkeypatch.setattr(launch_settings, "PAIR_SCAN_MAX_WORK", limit)
            Q = b.Q.detach().clone().requires_grad_()
            D = b.D.detach().clone().requires_grad_()
            lib_call(case, b, Q, D).backward(grad)
            grads.append((Q.grad, D.grad))
    return grads


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_pair_scan_and_index_agree_bitwise(backward, device, monkeypatch):
    """The Triton pair-list backward walks each query's / document's pairs in pair order whether it finds them by
    scanning the ids or through the CSR index: dD (and dQ where both gather) are bitwise equal."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    # every query 3 or 4 times; documents 0 and 1 three times (the one token of document 1 chosen by every query
    # token: three partial sums whose order shows in the rounding)
    pairs = tuple((i % 3, (5 * i) % 4) for i in range(10))
    case = Ragged((9, 3, 17), (20, 1, 8, 33), pairs=pairs, dim=16, backward=backward, return_argmax=False)
    b = build(case, device)
    grads = _grads_by_scan_then_index(case, b, upstream_grad((len(pairs),), seed=3, device=device), monkeypatch)
    assert torch.equal(grads[0][1], grads[1][1]), "dD: scan and index differ"
    if backward == "deterministic":  # (fast mode with the index adds dQ by atomics: another summation order)
        assert torch.equal(grads[0][0], grads[1][0]), "dQ: scan and index differ"
    else:
        torch.testing.assert_close(grads[0][0], grads[1][0])


@pytest.mark.parametrize("size", ["short", "across-chunks"])
def test_pair_scan_dq_walk_in_groups_matches_one_pair_at_a_time(size, device, monkeypatch):
    """The scanning dQ walk picks its query's pairs out ``PAIR_SCAN_DQ_UNROLL`` at a time: dQ bitwise equal to the
    walk of one pair at a time (the same pair order), with pair counts that are no multiple of the group (1 to 9 a
    query), a query in no pair, a NaN upstream gradient on one pair, a document token that every token of a query
    chooses (its partial sums' order shows in the rounding) and, past ``SCAN`` pair ids, a query whose pairs lie in
    two chunks of the scan; and the reference's gradients."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    keep_under_interpreter(size == "short", "triton", device)  # (over a thousand pairs: minutes interpreted)
    from maxsim.kernels import backward as backward_kernels
    from maxsim.kernels import launch_backward, launch_forward, launch_settings

    counts = (1, 2, 0, 3, 4, 5, 9)  # pairs of queries 0..6 (query 2 in none)
    pairs = [(q, (3 * q + i) % 4) for q, n in enumerate(counts) for i in range(n)]
    if size == "across-chunks":  # query 0 again after SCAN other pairs, its pairs now in both chunks
        pairs += [(1 + i % 6, i % 4) for i in range(backward_kernels.SCAN - len(pairs) + 3)] + [(0, 1), (0, 3)]
    pairs = tuple(pairs[i] for i in itertools.chain(range(1, len(pairs), 2), range(0, len(pairs), 2)))  # (shuffled)
    case = Ragged((9, 3, 17, 1, 12, 30, 5), (20, 1, 8, 33), pairs=pairs, dim=16, backward="deterministic",
                  return_argmax=False)  # fmt: skip
    b = build(case, device)
    grad = upstream_grad((len(pairs),), seed=7, device=device)
    grad[len(pairs) // 2] = float("nan")
    grads, unrolls = [], []
    with maxsim.backend("triton"):
        for unroll in (1, launch_settings.PAIR_SCAN_DQ_UNROLL):
            monkeypatch.setattr(launch_settings, "PAIR_SCAN_DQ_UNROLL", unroll)
            launch_forward.plans.clear()  # (a repeated step keeps its backward's plan: start afresh)
            launch_backward.plans.clear()
            Q, D = b.Q.detach().clone().requires_grad_(), b.D.detach().clone().requires_grad_()
            lib_call(case, b, Q, D).backward(grad)
            grads.append((Q.grad, D.grad))
            (plan,) = launch_backward.plans.values()
            assert plan.main[2]["SCAN_Q"], "the case must take the scanning dQ walk"
            unrolls.append(plan.main[2]["UNROLL"])
    assert unrolls[0] == 1 < unrolls[1]
    # (wider query rows walk one pair at a time: grouped, they spilled)
    wide = torch.zeros(int(b.cu_q[-1]), 300, dtype=torch.bfloat16, device=device)
    rg = layout.Ragged(b.cu_q, b.cu_q, b.pair_q, b.pair_q, max(case.q_lens), max(case.q_lens))
    _key, plan = launch_backward.backward_plan_of(grad.float(), wide, wide, False, True, rg, None)
    assert plan.main[2]["SCAN_Q"] and plan.main[2]["UNROLL"] == 1
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=0, equal_nan=True)
    assert grads[1][0].isnan().any() and not grads[1][0].isnan().all()  # (the NaN pair's query rows only)
    with maxsim.backend("triton"):
        check_ragged(case, device)  # (the grouped walk against the float64 reference)


@pytest.mark.parametrize("listed", [8, 9, 13])
def test_pair_scan_walk_past_its_held_pairs(listed, device, monkeypatch):
    """A scanning walk keeps the ids of a document's first ``HELD`` (8) pairs from one scan and scans again per
    token block for the rest: documents listed 8, 9 and 13 times (one of 70 tokens, one of a single token chosen
    by every query token, where the order of the partial sums shows in the rounding) get dD bitwise equal to the
    index's walk, and the reference's gradients."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    from maxsim.kernels import backward as backward_kernels
    from maxsim.kernels import launch_backward

    assert backward_kernels.HELD == 8
    pairs = ((1, 2), *((i % 3, d) for i in range(listed) for d in (0, 1)))
    case = Ragged((9, 3, 17), (70, 1, 8), pairs=pairs, dim=16, return_argmax=False)
    launch_backward.plans.clear()
    with maxsim.backend("triton"):
        check_ragged(case, device)
    (plan,) = launch_backward.plans.values()
    assert plan.main[2]["SCAN_D"] and plan.main[2]["DOC_WALK"], "the case must take the scanning walk"
    b = build(case, device)
    grads = _grads_by_scan_then_index(case, b, upstream_grad((len(pairs),), seed=5, device=device), monkeypatch)
    assert torch.equal(grads[0][1], grads[1][1]), "dD: scan and index differ"


@pytest.mark.parametrize("normalize", [False, True])
def test_pair_walk_leaves_unlisted_documents_alone(normalize, device, monkeypatch):
    """Through the CSR index, a document that no pair lists still gets its owner program, which reads the entry at
    the document's position (another document's first pair) in its place: neither that pair's NaN upstream
    gradient nor an inf in its query's tokens may reach the unlisted document, whose gradient stays 0, bitwise as
    the scan gives it."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    pairs = ((0, 0), (1, 2), (0, 2), (1, 3))  # document 1 in no pair; entry 1 of the index is pair 1
    case = Ragged((9, 17), (20, 8, 33, 5), pairs=pairs, normalize=normalize, return_argmax=False)
    b = build(case, device)
    g = upstream_grad((len(pairs),), seed=3, device=device)
    g[1] = float("nan")
    b.Q = b.Q.clone()
    b.Q[9 + 4, 0] = float("inf")  # token 4 of query 1 (pairs 1 and 3), chosen wherever it lands
    grads = _grads_by_scan_then_index(case, b, g, monkeypatch)
    assert torch.equal(grads[1][1][20:28], torch.zeros_like(grads[1][1][20:28])), "unlisted document's dD"
    # (with normalize the two owner loops are compiled differently: equal to fp32 rounding, not bitwise)
    exact = {} if normalize else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(grads[1][1], grads[0][1], equal_nan=True, **exact)


@pytest.mark.parametrize("q_lens,walks", [((9, 17), True), ((9, 65), False)], ids=["short", "long"])
@pytest.mark.parametrize("index", ["scan", "csr", "bound"])
def test_pair_list_documents_walk_where_queries_are_short(q_lens, walks, index, device, monkeypatch):
    """The Triton backward owns a pair list's documents with one program per (document, dim block) walking its token
    blocks where every query fits one ``TQ`` block (at most 64 tokens), by the scan or the index alike; longer
    queries keep a program per (document, token block, dim block). Gradients match the reference either way.
    The scan's bound counts one scan per program: at (programs x pairs) of the walk, the walk scans and the
    per-block layout (more programs) takes the index."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    from maxsim.kernels import configs, launch_backward, launch_settings

    case = Ragged(q_lens, (20, 8, 70), pairs=((0, 0), (1, 2), (0, 2), (1, 1)), return_argmax=False)
    cfg = configs.backward_config(max(q_lens), case.dim, False, False)
    assert cfg.BN < 70, "the longest document must span several token blocks"
    if index != "scan":
        n_kb = -(-case.dim // cfg.BLOCK_K)
        monkeypatch.setattr(launch_settings, "PAIR_SCAN_MAX_WORK", 0 if index == "csr" else 3 * n_kb * len(case.pairs))
    launch_backward.plans.clear()
    with maxsim.backend("triton"):
        check_ragged(case, device)
    (plan,) = launch_backward.plans.values()
    n_programs, _ints, constexprs = plan.main
    scans = index == "scan" or (index == "bound" and walks)
    assert constexprs["DOC_WALK"] is walks and constexprs["SCAN_D"] is scans
    n_dq = 0 if plan.dq_scatter else len(q_lens) * -(-max(q_lens) // constexprs["BT"])
    blocks = 1 if walks else -(-70 // constexprs["BN"])  # (the longest document: 70 tokens)
    assert n_programs == n_dq + 3 * blocks * -(-case.dim // constexprs["BLOCK_K"])


@pytest.mark.parametrize("fn", ["varlen", "pairs"])
def test_nan_propagates(fn, backend, device):
    """A NaN in a document token makes its scores NaN (for non-empty queries); nothing else is touched."""
    keep_under_interpreter(fn == "varlen", backend, device)
    case = Ragged((3, 0), (4, 5), pairs=None if fn == "varlen" else ((0, 1), (1, 1), (1, 0), (0, 1), (0, 0)))
    b = build(case, device)
    D = b.D.clone()
    D[4 + 2] = float("nan")  # token 2 of document 1
    b.D = D
    s, arg = lib_call(case, b)
    rs, _ = ref_call(case, b, b.Q.double(), D.double())
    assert_same_nan(s, rs, "scores")
    keep = ~torch.isnan(rs)
    torch.testing.assert_close(s[keep].double(), rs[keep], rtol=1e-5, atol=1e-5)
    assert bool(torch.isnan(rs).any())  # the case really has a NaN score
    assert arg.shape[-1] == case.width_q()


# ----------------------------------------------------------------------------------------------------
# maxsim_padded

# (B, K, Lq, Ld, dim, dtype, normalize, index), lengths drawn with zeros, ones and the full width
PADDED_CASES = [
    ((2, 2, 33, 65, 16, "fp16", True, "int32"), True),
    ((2, 3, 7, 5, 8, "fp32", False, "int64"), False),
    ((1, 4, 17, 129, 32, "bf16", False, "int64"), False),
    ((2, 2, 130, 16, 48, "fp32", True, "int32"), False),
]


def padded_inputs(case, device):
    B, K, Lq, Ld, dim, dt, _, index = case
    seed = seed_of(case)
    dtype = DTYPES[dt]
    queries = randn((B, Lq, dim), seed=seed, dtype=dtype, device=device)
    documents = randn((B, K, Ld, dim), seed=seed + 1, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed + 2)
    ql = torch.randint(0, Lq + 1, (B,), generator=g)
    dl = torch.randint(0, Ld + 1, (B, K), generator=g)
    ql[0] = Lq  # a full query
    dl.view(-1)[0] = Ld  # a full document
    dl.view(-1)[-1] = 0  # an empty document
    if B > 1:
        ql[-1] = 0  # an empty query
    if B * K > 2:
        dl.view(-1)[1] = 1
    idx = INDEX_DTYPES[index]
    return queries, documents, ql.to(device=device, dtype=idx), dl.to(device=device, dtype=idx)


@pytest.mark.parametrize("case,keep", PADDED_CASES, ids=[f"{i}" for i in range(len(PADDED_CASES))])
def test_padded(case, keep, backend, device):
    keep_under_interpreter(keep, backend, device)
    B, K, Lq, Ld, dim, dt, normalize, _ = case
    dtype = DTYPES[dt]
    queries, documents, ql, dl = padded_inputs(case, device)
    Q = queries.detach().requires_grad_()
    D = documents.detach().requires_grad_()
    s, arg = maxsim.maxsim_padded(Q, D, ql, dl, normalize=normalize, return_argmax=True)
    assert tuple(s.shape) == (B, K)
    grad = upstream_grad(s.shape, seed=seed_of(case, "grad"), device=s.device)
    s.backward(grad)

    Qr = queries.detach().double().requires_grad_()
    Dr = documents.detach().double().requires_grad_()
    rs, rarg = reference.maxsim_padded_with_argmax(Qr, Dr, ql, dl, normalize=normalize)
    rs.backward(grad.double())
    q_mask = torch.arange(Lq, device=device) < ql.long()[:, None]
    d_mask = torch.arange(Ld, device=device) < dl.long()[..., None]
    inp = Inputs("candidates", queries, documents, q_mask, d_mask)
    assert_scores_close(s.detach(), rs.detach(), dtype=dtype, magnitude=score_magnitude(inp, normalize, (B, K)))
    qk, dk = unambiguous_tokens(inp, normalize, GAP_TOL[dtype])
    # padding gets exactly zero gradient; real tokens match the reference
    for name, g in (("dQ", Q.grad), ("dD", D.grad)):
        assert g is not None, f"{name}: no gradient"
    pad_q, pad_d = ~q_mask.cpu(), ~d_mask.cpu()
    assert not bool(Q.grad.cpu()[pad_q].any()), "dQ: non-zero gradient on query padding"
    assert not bool(D.grad.cpu()[pad_d].any()), "dD: non-zero gradient on document padding"
    assert_grads_close(Q.grad, Qr.grad, dtype=dtype, keep=qk[..., None].expand(Q.shape), what="dQ")
    assert_grads_close(D.grad, Dr.grad, dtype=dtype, keep=dk[..., None].expand(D.shape), what="dD")
    assert_argmax_matches(arg, rarg, inp, normalize=normalize, exact=False)

    # the padding's values do not matter
    noise = randn(queries.shape, seed=seed_of(case, "noise"), dtype=dtype, device=device) * 10
    q2 = torch.where(q_mask[..., None], queries, noise)
    d2 = torch.where(d_mask[..., None], documents, noise[:, None, :1].expand_as(documents))
    with torch.no_grad():
        s2 = maxsim.maxsim_padded(q2, d2, ql, dl, normalize=normalize)
    torch.testing.assert_close(s2, s.detach(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# maxsim_with_argmax (dense layouts) and return_argmax=True of maxsim / maxsim_pairs

# (layout, n, m, Lq, Ld, dim, masks, normalize, dtype)
ARGMAX_CASES = [
    (("cross", 1, 3, 7, 33, 16, "empty", False, "fp32"), True),
    (("pairs", 2, 0, 33, 16, 8, None, False, "bf16"), True),
    (("cross", 2, 3, 7, 33, 16, "empty", False, "fp32"), False),
    (("candidates", 2, 2, 17, 65, 32, "holes", True, "fp16"), False),
    (("cross", 1, 2, 129, 5, 16, "holes", True, "bf16"), False),
    (("candidates", 3, 1, 1, 1, 64, "empty", False, "fp32"), False),
]


def _argmax_call(layout, Q, D, q_mask, d_mask, *, normalize, via):
    if via == "with_argmax":
        if layout == "pairs":  # maxsim_with_argmax has maxsim's layouts: pairs go through maxsim_pairs
            return maxsim.maxsim_pairs(Q, D, q_mask, d_mask, normalize=normalize, return_argmax=True)
        return maxsim.maxsim_with_argmax(Q, D, q_mask, d_mask, normalize=normalize)
    fn = maxsim.maxsim_pairs if layout == "pairs" else maxsim.maxsim
    return fn(Q, D, q_mask, d_mask, normalize=normalize, return_argmax=True)


@pytest.mark.parametrize("case,keep", ARGMAX_CASES, ids=[f"{c[0][0]}-{c[0][-1]}" for c in ARGMAX_CASES])
def test_with_argmax(case, keep, backend, device):
    keep_under_interpreter(keep, backend, device)
    layout, n, m, lq, ld, dim, masks, normalize, dt = case
    dtype = DTYPES[dt]
    inp = make_inputs(layout, n, m, lq, ld, dim, dtype=dtype, device=device, masks=masks, seed=seed_of(case))
    Q = inp.Q.detach().requires_grad_()
    D = inp.D.detach().requires_grad_()
    s, arg = _argmax_call(layout, Q, D, inp.q_mask, inp.d_mask, normalize=normalize, via="with_argmax")
    grad = upstream_grad(s.shape, seed=seed_of(case, "grad"), device=s.device)
    s.backward(grad)
    Qr = inp.Q.detach().double().requires_grad_()
    Dr = inp.D.detach().double().requires_grad_()
    if layout == "pairs":
        dm = None if inp.d_mask is None else inp.d_mask[:, None]
        rs, rarg = reference.scores_and_argmax(Qr, Dr[:, None], inp.q_mask, dm, normalize=normalize)
        rs, rarg = rs[:, 0], rarg[:, 0]
    else:
        rs, rarg = reference.maxsim_with_argmax(Qr, Dr, inp.q_mask, inp.d_mask, normalize=normalize)
    rs.backward(grad.double())
    assert_scores_close(s.detach(), rs.detach(), dtype=dtype, magnitude=score_magnitude(inp, normalize, rs.shape))
    qk, dk = unambiguous_tokens(inp, normalize, GAP_TOL[dtype])
    assert_grads_close(Q.grad, Qr.grad, dtype=dtype, keep=qk[..., None].expand(Q.shape), what="dQ")
    assert_grads_close(D.grad, Dr.grad, dtype=dtype, keep=dk[..., None].expand(D.shape), what="dD")
    assert_argmax_matches(arg, rarg, inp, normalize=normalize, exact=False)
    if layout != "pairs" and not interpreted(backend, device):
        # maxsim(..., return_argmax=True) is the same function
        s2, arg2 = _argmax_call(layout, inp.Q, inp.D, inp.q_mask, inp.d_mask, normalize=normalize, via="kwarg")
        assert torch.equal(arg2, arg), "maxsim(return_argmax=True) and maxsim_with_argmax disagree on the argmax"
        torch.testing.assert_close(s2, s.detach(), rtol=0, atol=0)


def test_with_argmax_exact_ties_squeezed(backend, device):
    """Integer-valued tokens (exact ties -> lowest index) with a 2-D query: argmax ``[Nd, Lq]``."""
    inp = make_inputs("cross", 1, 2, 9, 12, 4, device=device, masks="holes", exact=True, seed=11)
    D, d_mask = inp.D.clone(), inp.d_mask.clone()
    D[:, 7], d_mask[:, 3], d_mask[:, 7] = D[:, 3], True, True  # a planted duplicate on top of the natural ties
    inp = inp.with_(Q=inp.Q[0], q_mask=inp.q_mask[0], D=D, d_mask=d_mask)
    s, arg = maxsim.maxsim_with_argmax(inp.Q, inp.D, inp.q_mask, inp.d_mask)
    rs, rarg = reference.maxsim_with_argmax(inp.Q.double(), inp.D.double(), inp.q_mask, inp.d_mask)
    assert tuple(arg.shape) == (2, 9)
    torch.testing.assert_close(s.double(), rs, rtol=0, atol=0)
    assert_argmax_matches(arg, rarg, inp, normalize=False, exact=True)
    sim, _ = similarities(inp, False)
    best = sim.amax(-1, keepdim=True)
    assert bool(((sim == best).sum(-1) > 1).any()), "the case has no exact tie"


# ----------------------------------------------------------------------------------------------------
# bad inputs

DIM = 8


def _error_cases(device):
    """name -> (callable, accepted exception types, regexes that must all be in the message)."""
    Q = randn((5, DIM), seed=1, device=device)
    D = randn((7, DIM), seed=2, device=device)

    def t(v, dtype=torch.int32):
        return torch.tensor(v, dtype=dtype, device=device)

    cq, cd = t([0, 2, 5]), t([0, 3, 3, 7])
    pq, pd = t([1, 0, 1]), t([2, 2, 0])

    def vl(cu_q=cq, cu_d=cd, **kw):
        return lambda: maxsim.maxsim_varlen(Q, D, cu_q, cu_d, **kw)

    def pv(pair_q=pq, pair_d=pd, cu_q=cq, cu_d=cd, **kw):
        return lambda: maxsim.maxsim_pairs_varlen(Q, D, cu_q, cu_d, pair_q, pair_d, **kw)

    given = dict(max_seqlen_q=3, max_seqlen_d=4)
    V, T = (ValueError,), (TypeError, ValueError)
    queries = randn((2, 4, DIM), seed=3, device=device)
    documents = randn((2, 3, 6, DIM), seed=4, device=device)
    ql, dl = t([4, 1]), t([[6, 0, 2], [1, 6, 3]])

    def pd_(q_len=ql, d_len=dl):
        return lambda: maxsim.maxsim_padded(queries, documents, q_len, d_len)

    cases = {
        # dtypes / ranks of the offsets (no sync needed: always checked)
        "cu_seqlens_q-float": (vl(cu_q=cq.float(), **given), T, [word("cu_seqlens_q")]),
        "cu_seqlens_d-float": (vl(cu_d=cd.double(), **given), T, [word("cu_seqlens_d")]),
        "cu_seqlens_q-2d": (vl(cu_q=cq[None], **given), V, [word("cu_seqlens_q")]),
        "cu_seqlens_d-0d": (vl(cu_d=cd[0], **given), V, [word("cu_seqlens_d")]),
        "pairs-cu_seqlens_q-float": (pv(cu_q=cq.float(), **given), T, [word("cu_seqlens_q")]),
        # offsets' values, validate=True
        "cu_seqlens_q-start": (vl(cu_q=t([1, 2, 5]), validate=True, **given), V, [word("cu_seqlens_q")]),
        "cu_seqlens_q-decreasing": (vl(cu_q=t([0, 3, 2, 5]), validate=True, **given), V, [word("cu_seqlens_q")]),
        "cu_seqlens_q-end-short": (vl(cu_q=t([0, 2, 4]), validate=True, **given), V, [word("cu_seqlens_q")]),
        "cu_seqlens_q-end-long": (vl(cu_q=t([0, 2, 6], torch.int64), validate=True), V, [word("cu_seqlens_q")]),
        "cu_seqlens_d-start": (vl(cu_d=t([2, 3, 3, 7]), validate=True, **given), V, [word("cu_seqlens_d")]),
        "cu_seqlens_d-decreasing": (vl(cu_d=t([0, 4, 3, 7]), validate=True), V, [word("cu_seqlens_d")]),
        "cu_seqlens_d-end": (vl(cu_d=t([0, 3, 3, 6]), validate=True, **given), V, [word("cu_seqlens_d")]),
        # validate=None validates when max_seqlen_* are omitted (the sync happens anyway)
        "cu_seqlens_q-default-validate": (vl(cu_q=t([0, 3, 2, 5])), V, [word("cu_seqlens_q")]),
        "pairs-cu_seqlens_d-end": (pv(cu_d=t([0, 3, 3, 8]), validate=True, **given), V, [word("cu_seqlens_d")]),
        # pair ids
        "pair_q-out-of-range": (pv(pair_q=t([0, 2, 1]), validate=True, **given), V, [word("pair_q")]),
        "pair_d-out-of-range": (pv(pair_d=t([0, 3, 1]), validate=True, **given), V, [word("pair_d")]),
        "pair_d-negative": (pv(pair_d=t([0, -1, 1], torch.int64), validate=True), V, [word("pair_d")]),
        "pair-lengths-differ": (pv(pair_d=t([0, 1]), **given), V, [r"pair_q|pair_d"]),
        "pair_q-float": (pv(pair_q=pq.float(), **given), T, [word("pair_q")]),
        "pair_d-2d": (pv(pair_d=pd[None], **given), V, [word("pair_d")]),
        # tokens
        "varlen-Q-3d": (lambda: maxsim.maxsim_varlen(Q[None], D, cq, cd, **given), V, [word("Q")]),
        "varlen-dim": (
            lambda: maxsim.maxsim_varlen(Q, randn((7, 16), seed=5, device=device), cq, cd, **given),
            V,
            [word("16"), word("8")],
        ),
        # lengths of maxsim_padded
        "query_lengths-shape": (pd_(q_len=t([4, 1, 2])), V, [word("query_lengths")]),
        "query_lengths-2d": (pd_(q_len=ql[:, None]), V, [word("query_lengths")]),
        "doc_lengths-1d": (pd_(d_len=t([6, 1])), V, [word("doc_lengths")]),
        "doc_lengths-shape": (pd_(d_len=t([[6, 0, 2, 1], [1, 6, 3, 1]])), V, [word("doc_lengths")]),
        "query_lengths-float": (pd_(q_len=ql.float()), T, [word("query_lengths")]),
    }
    return cases


ERROR_NAMES = list(_error_cases("cpu"))


@pytest.mark.parametrize("name", ERROR_NAMES)
def test_bad_input_is_rejected(name, backend, device):
    assert_rejected(*_error_cases(device)[name])


# ----------------------------------------------------------------------------------------------------
# the reference itself: the ragged references agree with per-pair dense reference calls


def test_reference_ragged_matches_dense_loops():
    g = torch.Generator().manual_seed(5)
    q_lens, d_lens = (3, 0, 7, 1), (0, 5, 2, 9)
    cq, cd = offsets(q_lens, "int64", "cpu"), offsets(d_lens, "int32", "cpu")
    Q = torch.randn(sum(q_lens), 6, generator=g, dtype=torch.float64, requires_grad=True)
    D = torch.randn(sum(d_lens), 6, generator=g, dtype=torch.float64, requires_grad=True)
    pairs = [(2, 3), (0, 1), (2, 3), (1, 0), (3, 2), (0, 0)]
    pq, pd = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    cql, cdl = cq.tolist(), cd.tolist()
    for normalize in (False, True):
        s, arg = reference.maxsim_varlen_with_argmax(Q, D, cq, cd, max_seqlen_q=9, normalize=normalize)
        ps, parg = reference.maxsim_pairs_varlen_with_argmax(Q, D, cq, cd, pq, pd, normalize=normalize)
        assert arg.shape == (4, 4, 9) and parg.shape == (6, 7)
        for i, j in itertools.product(range(4), range(4)):
            qi, dj = Q[cql[i] : cql[i + 1]], D[cdl[j] : cdl[j + 1]]
            es, ea = reference.maxsim_with_argmax(qi, dj[None], normalize=normalize)
            torch.testing.assert_close(s[i, j], es[0])
            assert arg[i, j, : q_lens[i]].tolist() == ea[0].tolist()
            assert (arg[i, j, q_lens[i] :] == -1).all()
            if d_lens[j] == 0:
                assert s[i, j] == 0 and (arg[i, j] == -1).all()
        for p, (i, j) in enumerate(pairs):
            torch.testing.assert_close(ps[p], s[i, j])
            assert torch.equal(parg[p], arg[i, j, :7])
        # gradients: the pair list equals the matching weighted sum of the cross product
        w = torch.randn(len(pairs), generator=g, dtype=torch.float64)
        gq, gd = torch.autograd.grad((ps * w).sum(), (Q, D))
        wc = torch.zeros(4, 4, dtype=torch.float64).index_put_((pq, pd), w, accumulate=True)
        eq, ed = torch.autograd.grad((s * wc).sum(), (Q, D))
        torch.testing.assert_close(gq, eq)
        torch.testing.assert_close(gd, ed)
    # padded = masked dense
    qs = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    ds = torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64)
    ql, dl = torch.tensor([4, 0]), torch.tensor([[5, 0, 2], [1, 5, 3]])
    s, arg = reference.maxsim_padded_with_argmax(qs, ds, ql, dl)
    es, ea = reference.maxsim_with_argmax(qs, ds, torch.arange(4) < ql[:, None], torch.arange(5) < dl[..., None])
    torch.testing.assert_close(s, es)
    assert torch.equal(arg, ea)
    assert (s[1] == 0).all() and (s[:, 1][:1] == 0).all()


# ----------------------------------------------------------------------------------------------------
# CUDA: no hidden host syncs when max_seqlen_* are given


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["fast", "deterministic"])
@pytest.mark.parametrize("fn", ["varlen", "pairs"])
def test_ragged_no_host_sync(fn, mode):
    """Forward + backward with ``max_seqlen_*`` given and ``validate`` left default never synchronize."""
    pairs = None if fn == "varlen" else tuple(((3 * i) % 5, (7 * i) % 6) for i in range(20))
    lens = dict(q_lens=(17, 0, 33, 129, 5), d_lens=(64, 1, 0, 200, 31, 16))
    case = Ragged(**lens, pairs=pairs, dim=128, dtype="bf16", backward=mode, return_argmax=False)
    b = build(case, "cuda")
    Q = b.Q.detach().requires_grad_()
    D = b.D.detach().requires_grad_()
    shape = lib_call(case, b).shape
    grad = upstream_grad(shape, seed=2, device="cuda")
    for _ in range(2):  # warm-up: compilation, caches
        lib_call(case, b, Q, D).backward(grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the detector is on: a real sync is caught
            torch.ones(1, device="cuda").item()
        s = lib_call(case, b, Q, D)
        s.backward(grad)
        with torch.no_grad():
            lib_call(case, b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
