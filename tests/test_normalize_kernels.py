"""The per-token kernels of ``normalize=True``'s backward (inverse norms, and the chain rule through the
normalization) against the PyTorch formulas of the CPU path, on the rows that make them differ if anything is off:
zero and sub-eps norms, NaN and inf tokens that received no gradient (exact zeros), a NaN gradient, dims that are
not a power of two or need two steps, and inputs whose rows are not contiguous."""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPES, GRAD_TOL, check_pointers, triton_usable

pytest.importorskip("triton")

from maxsim.cpu import project_normalized_grad  # noqa: E402
from maxsim.kernels import normalize as nk  # noqa: E402
from maxsim.layout import NORM_EPS  # noqa: E402


def _inputs(dtype: torch.dtype, dim: int, device: str):
    g = torch.Generator().manual_seed(dim)
    Q = torch.randn(3, 5, dim, generator=g).to(dtype)
    D = torch.randn(1, 4, 7, dim, generator=g).to(dtype)
    gQ = torch.randn(3, 5, dim, generator=g)
    gD = torch.randn(1, 4, 7, dim, generator=g)
    Q[0, 1] = 0  # zero norm, with a gradient
    Q[0, 2] = 1e-3 * NORM_EPS  # below eps, with a gradient
    D[0, 1, 2, 3] = float("nan")  # NaN / inf tokens that no query chose: exactly zero gradient
    D[0, 2, 1] = float("inf")
    gD[0, 1, 2] = 0
    gD[0, 2, 1] = 0
    gQ[1, 1] = 0  # a finite token without gradient
    gQ[2, 3, 5] = float("nan")  # a NaN gradient propagates to its token only
    return [t.to(device) for t in (Q, D, gQ, gD)]


def _expected(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    return project_normalized_grad(g, x.float() / norm.clamp_min(NORM_EPS)[..., None], norm)


@pytest.mark.parametrize("dim", [128, 48, 200, 96])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_kernels_match_the_torch_formulas(dtype, dim, device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    dt = DTYPES[dtype]
    Q, D, gQ, gD = _inputs(dt, dim, device)
    inv_q, inv_d = nk.inverse_norms(Q, D)
    for x, inv in ((Q, inv_q), (D, inv_d)):
        norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
        assert inv.dtype == torch.float32 and inv.shape == x.shape[:-1]
        torch.testing.assert_close(inv, 1 / norm.clamp_min(NORM_EPS), rtol=1e-6, atol=0, equal_nan=True)

    dQ, dD = nk.project(gQ, Q, gD, D)
    for x, g, out in ((Q, gQ, dQ), (D, gD, dD)):
        assert out.dtype == dt and out.shape == x.shape
        tol = GRAD_TOL[dt]
        torch.testing.assert_close(out.float(), _expected(x, g).to(dt).float(), rtol=tol, atol=1e-5, equal_nan=True)
    assert (dD[0, 1, 2] == 0).all() and (dD[0, 2, 1] == 0).all()  # NaN / inf tokens without gradient
    assert (dQ[1, 1] == 0).all()
    assert dQ[2, 3].isnan().all() and not dQ[2, 2].isnan().any()
    assert not dQ[0, 1].isnan().any()  # a zero token: g / eps (inf in fp16), no NaN


def test_rows_at_a_stride_and_empty_tensors(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(6, 2, 64, generator=g).to(device)
    Q = wide[:, 0]  # rows 128 elements apart
    D = torch.randn(2, 3, 64, generator=g).to(device).transpose(0, 1)  # leading dims that do not collapse
    gQ, gD = torch.randn(6, 64, generator=g).to(device), torch.randn(3, 2, 64, generator=g).to(device)
    dQ, dD = nk.project(gQ, Q, gD, D)
    torch.testing.assert_close(dQ, _expected(Q, gQ), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dD, _expected(D, gD), rtol=1e-5, atol=1e-6)

    empty = torch.zeros(0, 5, 64, device=device)
    inv_e, inv_q = nk.inverse_norms(empty, Q)
    assert inv_e.shape == (0, 5)
    torch.testing.assert_close(inv_q, 1 / torch.linalg.vector_norm(Q, dim=-1).clamp_min(NORM_EPS))


def test_one_side_projects_alone(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    Q, D, gQ, gD = _inputs(torch.float32, 48, device)
    none, dD = nk.project(None, Q, gD, D)
    assert none is None
    torch.testing.assert_close(dD, _expected(D, gD), rtol=1e-5, atol=1e-5, equal_nan=True)
    dQ, none = nk.project(gQ, Q, None, D)
    assert none is None
    torch.testing.assert_close(dQ, _expected(Q, gQ), rtol=1e-5, atol=1e-5, equal_nan=True)


def test_batches_of_other_row_counts_share_a_launch_plan(monkeypatch):
    """Packed tokens of each batch of a ragged layout come in other row counts, which the kernels do not specialize
    on: both launches keep one plan for them all (Launcher's ``plan_cache``: later launches skip Triton's path),
    another for what Triton does specialize on (dim, a row stride, dtypes), and name the tensors whose alignment they
    read (the inputs and gradients; the rest are their fresh outputs)."""
    from maxsim.kernels import launcher

    caches: list = []

    def record(self, grid, tensors, ints, constexprs, num_warps, num_stages=3, plan_cache=None, maxnreg=0,
               foreign=None, pointers=None):  # fmt: skip
        check_pointers(tensors, pointers)
        named = {id(t) for t in foreign}
        outputs = [i for i, t in enumerate(tensors) if id(t) not in named]
        caches.append((self.kernel.__name__, id(plan_cache), outputs))

    monkeypatch.setattr(launcher.Launcher, "__call__", record)
    monkeypatch.setattr(nk, "_plans", {})
    for rows_q, rows_d, dim, dtype in [(9, 40, 16, torch.float16), (13, 71, 16, torch.float16),
                                       (130, 2, 16, torch.float16), (9, 40, 24, torch.float16),
                                       (9, 40, 16, torch.float32)]:  # fmt: skip
        Q, D = torch.randn(rows_q, dim, dtype=dtype), torch.randn(rows_d, dim, dtype=dtype)
        nk.inverse_norms(Q, D)
        nk.project(torch.randn(rows_q, dim), Q, torch.randn(rows_d, dim), D)
    nk.inverse_norms(torch.randn(40, 32, dtype=torch.float16)[:, :16], torch.randn(5, 16, dtype=torch.float16))
    norms = [c for c in caches if c[0] == "inverse_norms_kernel"]
    projects = [c for c in caches if c[0] == "project_kernel"]
    assert [c[2] for c in norms] == [[1, 3]] * 6 and [c[2] for c in projects] == [[2, 5]] * 5
    # (the first three batches share; another dim, another dtype, another row stride each plan apart)
    assert len({c[1] for c in norms[:3]}) == 1 and len({c[1] for c in norms}) == 4
    assert len({c[1] for c in projects[:3]}) == 1 and len({c[1] for c in projects}) == 3


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_batches_of_other_row_counts_compute_their_own_rows(dtype, device):
    """One launch plan, many row counts (see above): each launch norms and projects all its rows and no more (on a
    GPU the later launches are the plan's direct ones; rows past a stale count would come back uninitialized)."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(3)
    for rows_q, rows_d in [(9, 40), (75, 310), (33, 17), (1, 1000)]:
        Q, D = (torch.randn(n, 48, generator=g).to(dt).to(device) for n in (rows_q, rows_d))
        gQ, gD = (torch.randn(n, 48, generator=g).to(device) for n in (rows_q, rows_d))
        inv_q, inv_d = nk.inverse_norms(Q, D)
        dQ, dD = nk.project(gQ, Q, gD, D)
        for x, inv, gx, out in ((Q, inv_q, gQ, dQ), (D, inv_d, gD, dD)):
            norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
            torch.testing.assert_close(inv, 1 / norm.clamp_min(NORM_EPS), rtol=1e-6, atol=0)
            tol = GRAD_TOL[dt]
            torch.testing.assert_close(out.float(), _expected(x, gx).to(dt).float(), rtol=tol, atol=1e-5)


@pytest.mark.parametrize(
    "case, fused_q, fused_d",
    [
        ("cross, owned dD", True, True),
        ("candidates", True, True),
        ("cross, atomics", True, False),  # dD in an fp32 buffer: projected by a launch after
        ("dim 256", True, False),  # the owner holds half a row
        ("long pair list", False, True),  # dQ by atomics
    ],
)
def test_backward_programs_project_the_rows_they_hold(case, fused_q, fused_d, monkeypatch):
    """With normalize, the dQ gather and a dD owner of whole rows apply the chain rule before storing; what they do
    not hold goes through one projection launch (and nothing else runs: no casts, no PyTorch passes)."""
    from maxsim.kernels import launch, launch_backward, launch_settings
    from maxsim.layout import Ragged

    launches = _recorded_launches(monkeypatch)
    dim = 256 if case == "dim 256" else 64
    Q, D, rg = torch.randn(4, 8, dim), torch.randn(1, 5, 40, dim), None
    if case == "candidates":
        D = torch.randn(4, 3, 40, dim)
    if case == "cross, atomics":
        monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
        monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    if case == "long pair list":
        monkeypatch.setattr(launch_settings, "PAIR_SCAN_MAX_WORK", 0)
        cu_q, cu_d = torch.tensor([0, 3, 8]), torch.tensor([0, 5, 40, 47])
        Q, D = torch.randn(8, dim), torch.randn(47, dim)
        rg = Ragged(cu_q, cu_d, torch.tensor([0, 1, 1]), torch.tensor([2, 0, 2]), 5, 35)
    grid = (1, 3) if rg is not None else (Q.shape[0], D.shape[1])
    arg = torch.zeros(*grid, 8 if rg is None else 5, dtype=torch.int32)
    launch_backward.plans.clear()
    dQ, dD = launch.backward(torch.ones(grid), Q, D, arg, True, False, rg)
    launch_backward.plans.clear()
    assert dQ.dtype == Q.dtype and dD.dtype == D.dtype
    main = [c for name, c in launches if name == "maxsim_bwd_kernel"]
    assert len(main) == 1
    assert main[0]["DQ_GATHER"] == (case != "long pair list")
    assert main[0]["DD_OWNED"] == (case != "cross, atomics")
    assert main[0]["PROJECT_Q"] == (fused_q and main[0]["DQ_GATHER"])
    assert main[0]["PROJECT_D"] == (fused_d and main[0]["DD_OWNED"])
    names = [name for name, _ in launches]
    assert names.count("project_kernel") == (0 if fused_q and fused_d else 1)
    assert names.count("inverse_norms_kernel") == 1


def _recorded_launches(monkeypatch) -> list:
    """``(kernel name, constexprs)`` of every launch from here on, none of them run (launches planned as on a GPU)."""
    from maxsim.kernels import launch_args, launcher

    launches: list = []

    def record(
        self, grid, tensors, ints, constexprs, num_warps, num_stages=3, plan_cache=None, maxnreg=0, foreign=None,
        pointers=None,
    ):  # fmt: skip
        check_pointers(tensors, pointers)
        launches.append((self.kernel.__name__, constexprs))

    monkeypatch.setattr(launcher.Launcher, "__call__", record)
    monkeypatch.setattr(launch_args, "INTERPRETER", False)
    return launches


def _norm_case(layout: str, Lq: int):
    """``(Q, D, ragged description or None)`` of a small fp32 problem of ``layout``, dim 64."""
    from maxsim.layout import Ragged

    Q, D, rg = torch.randn(40 if "40" in layout else 2, Lq, 64), torch.randn(1, 3, 40, 64), None
    if layout == "candidates":
        D = torch.randn(2, 3, 40, 64)
    if layout == "pair list":
        Q, D = torch.randn(2 * Lq, 64), torch.randn(47, 64)
        cu_q, cu_d = torch.tensor([0, Lq, 2 * Lq]), torch.tensor([0, 5, 40, 47])
        rg = Ragged(cu_q, cu_d, torch.tensor([0, 1, 1]), torch.tensor([2, 0, 2]), Lq, 35)
    return Q, D, rg


@pytest.mark.parametrize(
    "layout, Lq, normalize, given",
    [
        ("cross", 200, True, True),  # split into row blocks: each would sum the same tiles
        ("cross", 32, True, False),  # one block of packed queries reads each tile once: the tiles' sums of squares
        ("cross, 40 queries", 32, True, True),  # several blocks would each sum the same tiles
        ("cross", 200, False, False),
        ("candidates", 32, True, True),  # documents read by one program: the pre-pass
        ("pair list", 32, True, True),
    ],
)
def test_forward_reads_inverse_norms_from_a_pre_pass(layout, Lq, normalize, given, monkeypatch):
    """Where several programs read each document tile (split queries, several blocks of packed queries) and where
    documents are scored by one query (candidates, pairs, pair lists), the forward takes the tokens' inverse norms
    from one pre-pass launch, and a training step hands them on to the backward (no second pre-pass); one block of
    queries against shared documents sums each tile's squares as it goes (see launch_settings.PRENORM_*)."""
    from maxsim import ops
    from maxsim.kernels import launch_backward, launch_forward

    launches = _recorded_launches(monkeypatch)
    Q, D, rg = _norm_case(layout, Lq)
    launch_forward.plans.clear()
    launch_backward.plans.clear()
    s, arg, norms = ops.forward_impl(Q, D, None, None, normalize, True, "triton", rg)
    assert (norms is not None) == given
    names = [name for name, _ in launches]
    assert names.count("inverse_norms_kernel") == int(given)
    fwd = [c for name, c in launches if name == "maxsim_fwd_kernel"]
    assert len(fwd) == 1 and fwd[0]["NORMS_GIVEN"] == given and fwd[0]["NORMALIZE"] == normalize
    assert fwd[0]["EARLY_NORMS"] == given  # (a training forward: the early load of the norms)
    launches.clear()
    ops.backward_impl(torch.ones(s.shape), Q, D, arg, normalize, False, "triton", rg, norms)
    launch_forward.plans.clear()
    launch_backward.plans.clear()
    names = [name for name, _ in launches]
    assert names.count("inverse_norms_kernel") == int(normalize and not given), "the backward's own norms"


@pytest.mark.parametrize(
    "layout, Lq, case, given",
    [
        ("candidates", 32, "plain", False),  # each tile read once: the tiles' own sums of squares
        ("pair list", 32, "plain", False),
        ("candidates", 32, "setting", True),  # PRENORM_UNSHARED_SCORES = 1: the pre-pass, as for training
        ("candidates", 32, "thin table", True),  # 32-row blocks in the once-read table loop keep the pre-pass
        ("candidates", 64, "wide table", False),  # 64-row blocks there sum their tiles
        ("candidates", 32, "deep pipeline", True),  # fewer programs than multiprocessors keep the pre-pass
        ("candidates", 32, "document chunks", True),
        ("cross", 200, "plain", True),  # split queries: several programs read each tile (PRENORM_MIN_ROW_BLOCKS)
    ],
)
def test_scores_only_forward_of_unshared_documents_sums_its_tiles(layout, Lq, case, given, monkeypatch):
    """Inference with ``normalize=True`` over documents scored by one query each reads every tile once: it sums the
    tiles' squares instead of a pre-pass over D, except where launch_settings.PRENORM_UNSHARED_SCORES says the
    pre-pass measured faster (a thin block in the once-read table loop, few programs) or asks for it."""
    from maxsim import ops
    from maxsim.kernels import launch_forward, launch_settings

    launches = _recorded_launches(monkeypatch)
    if case == "setting":
        monkeypatch.setattr(launch_settings, "PRENORM_UNSHARED_SCORES", 1)
    if case.endswith("table"):
        monkeypatch.setattr(launch_forward, "once_read_scan", lambda *args: "table")
    if case == "deep pipeline":
        monkeypatch.setattr(launch_forward, "deep_pipelined", lambda *args: True)
    if case == "document chunks":
        monkeypatch.setattr(launch_forward, "document_chunks", lambda *args: (2, 32))
    Q, D, rg = _norm_case(layout, Lq)
    launch_forward.plans.clear()
    _s, _arg, norms = ops.forward_impl(Q, D, None, None, True, False, "triton", rg)
    launch_forward.plans.clear()
    assert (norms is not None) == given
    names = [name for name, _ in launches]
    assert names.count("inverse_norms_kernel") == int(given)
    fwd = [c for name, c in launches if name == "maxsim_fwd_kernel"]
    assert len(fwd) == 1 and fwd[0]["NORMALIZE"] and fwd[0]["NORMS_GIVEN"] == given
