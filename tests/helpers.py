"""Shared helpers of the test-suite: input builders, reference calls, tolerances and comparisons.

Conventions (design.md §5):

* random inputs come from seeded ``torch.Generator`` draws on the CPU (then moved), never zeros;
* the ground truth is :mod:`maxsim.reference` evaluated in float64 on the *same rounded* inputs
  (``Q.double()`` of the bf16 tensor), so the only error measured is the library's own;
* gradients are compared only where the argmax is unambiguous (see :func:`unambiguous_tokens`), except in the
  tests that build exact ties on purpose (integer-valued data, exact in every dtype).
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor

import maxsim
from maxsim import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LOW_PRECISION = (torch.float16, torch.bfloat16)

# Relative tolerances (design.md §5): scores are fp32-accumulated whatever the input dtype, so they are
# accurate against the float64 reference on the same rounded inputs; gradients come back in the input dtype.
SCORE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# Two document tokens whose similarities to a query token differ by less than this (relative to the largest
# |similarity|) are a near-tie: the library may legitimately pick either one, so their gradients are not
# compared.
GAP_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}

LAYOUTS = ("cross", "candidates", "pairs")


# ----------------------------------------------------------------------------------------------------
# backends / seeds


def triton_usable(device: str | torch.device) -> bool:
    """The Triton kernels run on CUDA tensors, and on CPU tensors only under the Triton interpreter."""
    dev = torch.device(device)
    return dev.type == "cuda" or (dev.type == "cpu" and INTERPRET)


def kernels_on(device: str | torch.device) -> None:
    """Route CPU tensors to the Triton kernels under the interpreter (the conftest restores the backend after each
    test); on a GPU the kernels take CUDA tensors anyway."""
    if INTERPRET and torch.device(device).type == "cpu":
        maxsim.set_backend("triton")


def backends_for(device: str | torch.device) -> list[str]:
    return ["torch", "triton"] if triton_usable(device) else ["torch"]


def interpreted(backend: str, device: str | torch.device) -> bool:
    """True when the Triton kernels run under the (slow) interpreter on CPU tensors."""
    return backend == "triton" and torch.device(device).type == "cpu"


FULL_INTERPRETER = os.environ.get("MAXSIM_TEST_FULL_INTERPRETER") == "1"


def keep_under_interpreter(keep: bool, backend: str, device: str | torch.device) -> None:
    """Under the Triton interpreter only a chosen subset of a parametrization runs (all of it on GPU / torch).

    ``MAXSIM_TEST_FULL_INTERPRETER=1`` runs every combination under the interpreter too (slow).
    """
    if interpreted(backend, device) and not keep and not FULL_INTERPRETER:
        pytest.skip("Triton interpreter: this combination is covered by the GPU run (CI keeps a subset)")


def alternate_under_interpreter(case: int, variant: int, device: str | torch.device) -> None:
    """Under the Triton interpreter, case ``case`` (an index) runs only the variants (an index into its flags'
    combinations) of its own parity, the parity alternating from case to case, so that each variant still runs on
    about half the cases; on a GPU every one runs (``keep_under_interpreter``'s rules)."""
    keep_under_interpreter((case + variant) % 2 == 0, "triton", device)


def general_cpu_path_only(monkeypatch) -> None:
    """Ragged CPU calls past the small-problem path (:mod:`maxsim.cpu_small`, its bounds set below every problem) and
    the by-document path (:mod:`maxsim.cpu_by_document`): for the tests of the general path's own pieces, whose cases
    those paths would otherwise take."""
    from maxsim import cpu_by_document, cpu_small

    monkeypatch.setattr(cpu_by_document, "MAX_VALUES", -1)
    monkeypatch.setattr(cpu_small, "MAX_PAIR_SIMS", -1)
    monkeypatch.setattr(cpu_small, "MAX_CROSS_SIMS", -1)


def spy(monkeypatch, owner, name: str, record=lambda args, out: args, into: list | None = None) -> list:
    """Wrap ``owner.name`` for the test's duration: each call still returns what the real one does, and appends
    ``record(args, result)`` to the list returned (``into``, if given, so that several spies share one)."""
    calls = [] if into is None else into
    real = getattr(owner, name)

    def wrapper(*args):
        out = real(*args)
        calls.append(record(args, out))
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def check_pointers(tensors: tuple, pointers: tuple | None) -> None:
    """A launch whose caller read its pointers itself (``Launcher``'s ``pointers``) passes each slot its own
    tensor's: for the fakes that record launches instead of running them."""
    assert pointers is None or list(pointers) == [t.data_ptr() for t in tensors]


def forward_launches(monkeypatch, call, pick, maxnreg: bool = False) -> list:
    """``pick(constexprs, num_warps, num_stages)`` (``maxnreg``: and the launch's register cap) of every
    forward-kernel launch that ``call`` makes under ``no_grad``, the launches recorded, not run (the interpreter's
    check off, so a CPU machine plans as a GPU would; plans cleared before and after)."""
    from maxsim.kernels import launch_args, launch_forward, launcher

    seen: list = []
    want_cap = maxnreg

    def record(
        self, grid, tensors, ints, constexprs, num_warps, num_stages=3, plan_cache=None, maxnreg=0, foreign=None,
        pointers=None,
    ):  # fmt: skip
        check_pointers(tensors, pointers)
        if self.kernel.__name__ == "maxsim_fwd_kernel":
            seen.append(pick(constexprs, num_warps, num_stages, *((maxnreg,) if want_cap else ())))

    with monkeypatch.context() as m:
        m.setattr(launcher.Launcher, "__call__", record)
        m.setattr(launch_args, "INTERPRETER", False)
        launch_forward.plans.clear()
        with torch.no_grad():
            call()
        launch_forward.plans.clear()
    return seen


#: Card names as torch reports them, for tests that plan launches as on those cards.
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


def plan_on_card(monkeypatch, name: str, l2_bytes: int) -> None:
    """Plan launches as if on the card ``name`` with an L2 of ``l2_bytes`` (the forward's plans cleared)."""
    from maxsim.kernels import device_info, launch_forward

    monkeypatch.setattr(device_info, "card_name", lambda device: name)
    monkeypatch.setattr(device_info, "l2_bytes", lambda device: l2_bytes)
    launch_forward.plans.clear()


def seed_of(*parts) -> int:
    """A stable seed derived from test parameters (not ``hash``, which is salted per process)."""
    return zlib.crc32(repr(parts).encode()) % (2**31)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, *, seed: int, dtype=torch.float32, device="cpu", scale: float = 1.0) -> Tensor:
    x = torch.randn(tuple(shape), generator=generator(seed), dtype=torch.float32) * scale
    return x.to(device=device, dtype=dtype)


def int_grid(shape, *, seed: int, dtype=torch.float32, device="cpu", high: int = 3) -> Tensor:
    """Non-zero ints in ``[-high, high]``: exact in fp16/bf16, products and sums exact in fp32."""
    g = generator(seed)
    mag = torch.randint(1, high + 1, tuple(shape), generator=g)
    sign = torch.randint(0, 2, tuple(shape), generator=g) * 2 - 1
    return (mag * sign).to(device=device, dtype=dtype)


def rand_mask(shape, *, seed: int, p_valid: float = 0.7, device="cpu") -> Tensor:
    return (torch.rand(tuple(shape), generator=generator(seed)) < p_valid).to(device)


def poisoned_documents(q_shape, d_shape, *, dtype, device, masked: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(Q, D, d_mask)`` of integer tokens (every sum exact) for tests of two launch plans that must agree bit for
    bit: the last document's first token is NaN (a valid token: its document's scores are NaN); ``masked`` adds a
    mask with holes, a fully masked document (0), a fully kept one (1), NaN in document 2's masked tokens (never
    read) and the last document's first token kept."""
    Q = int_grid(q_shape, seed=1, dtype=dtype, device=device)
    D = int_grid(d_shape, seed=2, dtype=dtype, device=device)
    d_mask = None
    if masked:
        d_mask = rand_mask(d_shape[:-1], seed=3, device=device)
        d_mask[0] = False
        d_mask[1, :] = True
        D[2][~d_mask[2]] = float("nan")
        d_mask[-1, 0] = True
    D[-1, 0, 0] = float("nan")
    return Q, D, d_mask


def assert_poisoned_scores(a: Tensor, b: Tensor, Q: Tensor, D: Tensor, d_mask: Tensor | None) -> None:
    """Two plans' scores of :func:`poisoned_documents` inputs: equal bit for bit, NaN in the last document's column
    only, and exactly the float64 reference's."""
    import maxsim.reference

    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(a[:, -1]).all() and not torch.isnan(a[:, :-1]).any()
    ref = maxsim.reference.maxsim(Q.double(), D.double(), d_mask=d_mask)
    torch.testing.assert_close(a.double(), ref, rtol=0, atol=0, equal_nan=True)


def assert_plans_agree(
    monkeypatch, setting: str, values: dict, uses_plan, Q: Tensor, D: Tensor, d_mask: Tensor | None, prepare=None
) -> None:
    """The scores of :func:`poisoned_documents` inputs under ``launch_settings.<setting>`` = ``values[True]`` (the
    plan under test) and ``values[False]`` (the plan without it), per :func:`assert_poisoned_scores`.
    ``uses_plan(call)`` says whether a call plans the one under test (checked for both values); ``prepare()`` runs
    after each setting (a card to plan for, say)."""
    from maxsim import maxsim
    from maxsim.kernels import launch_forward, launch_settings

    def call() -> Tensor:
        return maxsim(Q, D, d_mask=d_mask)

    runs = {}
    for on in (True, False):
        monkeypatch.setattr(launch_settings, setting, values[on])
        if prepare is not None:
            prepare()
        assert uses_plan(call) == on
        launch_forward.plans.clear()
        runs[on] = call()
    assert_poisoned_scores(runs[True], runs[False], Q, D, d_mask)


# ----------------------------------------------------------------------------------------------------
# inputs


@dataclass
class Inputs:
    """One call's arguments. ``layout``: "cross" (incl. squeezed 2-D Q/D), "candidates" or "pairs"."""

    layout: str
    Q: Tensor
    D: Tensor
    q_mask: Tensor | None = None
    d_mask: Tensor | None = None

    def with_(self, **kw) -> Inputs:
        return replace(self, **kw)

    @property
    def dtype(self) -> torch.dtype:
        return self.Q.dtype


def shapes_of(layout: str, n: int, m: int, lq: int, ld: int, dim: int):
    """(Q shape, D shape) for a layout; ``m`` is Nd (cross) or K (candidates) and ignored for pairs."""
    if layout == "cross":
        return (n, lq, dim), (m, ld, dim)
    if layout == "candidates":
        return (n, lq, dim), (n, m, ld, dim)
    if layout == "pairs":
        return (n, lq, dim), (n, ld, dim)
    raise AssertionError(layout)


def make_inputs(
    layout: str,
    n: int,
    m: int,
    lq: int,
    ld: int,
    dim: int,
    *,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
    masks: str | None = None,
    exact: bool = False,
) -> Inputs:
    """Random inputs for a layout.

    masks: None (no masks), "holes" (random holes, ~30% masked) or "empty" (holes, plus the first query and
    the last document fully masked, and an all-valid query/document elsewhere when there is room).
    exact: integer-valued data (exact products: ties are exact ties in every dtype).
    """
    qs, ds = shapes_of(layout, n, m, lq, ld, dim)
    draw = int_grid if exact else randn
    Q = draw(qs, seed=seed, dtype=dtype, device=device)
    D = draw(ds, seed=seed + 1, dtype=dtype, device=device)
    q_mask = d_mask = None
    if masks is not None:
        q_mask = rand_mask(qs[:-1], seed=seed + 2, device=device)
        d_mask = rand_mask(ds[:-1], seed=seed + 3, device=device)
        if masks == "empty":
            q_mask = q_mask.clone()
            d_mask = d_mask.clone()
            if n > 0:
                q_mask[0] = False
                if n > 1:
                    q_mask[-1] = True
            dm = d_mask.reshape(-1, ld)
            if dm.shape[0] > 0:
                dm[-1] = False
                if dm.shape[0] > 1:
                    dm[0] = True
        else:
            assert masks == "holes", masks
    return Inputs(layout, Q, D, q_mask, d_mask)


def canonical(inp: Inputs):
    """(Q [Nq, Lq, dim], D [Bd, K, Ld, dim], q_mask [Nq, Lq] | None, d_mask [Bd, K, Ld] | None), as views."""
    Q, D, qm, dm = inp.Q, inp.D, inp.q_mask, inp.d_mask
    if inp.layout == "pairs":
        return Q, D[:, None], qm, None if dm is None else dm[:, None]
    if Q.dim() == 2:
        Q, qm = Q[None], None if qm is None else qm[None]
    if D.dim() == 2:
        D, dm = D[None], None if dm is None else dm[None]
    if D.dim() == 3:
        D, dm = D[None], None if dm is None else dm[None]
    return Q, D, qm, dm


def similarities(inp: Inputs, normalize: bool):
    """float64 ``sim [Nq, K, Lq, Ld]`` (-inf at masked document tokens) and ``row_valid [Nq, K, Lq]``."""
    Q, D, qm, dm = canonical(inp)
    Q, D = Q.detach().double(), D.detach().double()
    if normalize:
        Q, D = reference._normalize(Q), reference._normalize(D)
    Nq, Lq, dim = Q.shape
    _, K, Ld, _ = D.shape
    sim = torch.einsum("qid,qkjd->qkij", Q, D.expand(Nq, K, Ld, dim))
    dmask = torch.ones(Nq, K, Ld, dtype=torch.bool, device=Q.device)
    if dm is not None:
        dmask = dmask & dm
    sim = sim.masked_fill(~dmask[:, :, None, :], float("-inf"))
    row_valid = dmask.any(-1)[:, :, None].expand(Nq, K, Lq).clone()
    if qm is not None:
        row_valid &= qm[:, None, :]
    return sim, row_valid


def score_magnitude(inp: Inputs, normalize: bool, shape) -> Tensor:
    """Per score ``sum_i |max_j sim_ij|`` over valid query tokens: the scale of the accumulation error."""
    sim, row_valid = similarities(inp, normalize)
    if sim.shape[-1] == 0:
        return torch.zeros(shape, dtype=torch.float64, device=sim.device)
    best = sim.amax(-1).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return (best * row_valid).sum(-1).reshape(shape)


def unambiguous_tokens(inp: Inputs, normalize: bool, rtol: float):
    """Boolean keep-masks (shaped like Q / D without ``dim``) of the tokens whose gradient is well defined.

    A valid (pair, query token) row is a near-tie when a second document token's similarity is within
    ``rtol * max|sim|`` of the max. Its query token and all its near-maximal document tokens are dropped from
    the gradient comparison (the library may pick any of them under rounding).
    """
    Q, D, _, _ = canonical(inp)
    sim, row_valid = similarities(inp, normalize)
    Nq, K, Lq, Ld = sim.shape
    if Ld == 0 or sim.numel() == 0:
        ones = torch.ones
        return ones(inp.Q.shape[:-1], dtype=torch.bool), ones(inp.D.shape[:-1], dtype=torch.bool)
    finite = torch.isfinite(sim)
    scale = sim[finite].abs().max() if finite.any() else sim.new_tensor(1.0)
    tol = rtol * float(scale)
    best = sim.amax(-1, keepdim=True)
    close = finite & (sim >= best - tol)
    near = row_valid & (close.sum(-1) > 1)
    q_amb = near.any(1)  # [Nq, Lq]
    d_amb = (close & near[..., None]).any(2)  # [Nq, K, Ld]
    if D.shape[0] == 1:
        d_amb = d_amb.any(0, keepdim=True)
    return (~q_amb).reshape(inp.Q.shape[:-1]).cpu(), (~d_amb).reshape(inp.D.shape[:-1]).cpu()


# ----------------------------------------------------------------------------------------------------
# calls


def call_lib(inp: Inputs, Q=None, D=None, **kw) -> Tensor:
    Q = inp.Q if Q is None else Q
    D = inp.D if D is None else D
    fn = maxsim.maxsim_pairs if inp.layout == "pairs" else maxsim.maxsim
    return fn(Q, D, inp.q_mask, inp.d_mask, **kw)


def call_ref(inp: Inputs, Q=None, D=None, *, normalize: bool = False) -> Tensor:
    Q = inp.Q if Q is None else Q
    D = inp.D if D is None else D
    fn = reference.maxsim_pairs if inp.layout == "pairs" else reference.maxsim
    return fn(Q, D, inp.q_mask, inp.d_mask, normalize=normalize)


def upstream_grad(shape, *, seed: int, device) -> Tensor:
    """A random fp32 upstream gradient (never all ones: a wrong routing must show)."""
    return randn(shape, seed=seed, dtype=torch.float32, device=device) + 0.5


def lib_forward_backward(inp: Inputs, *, normalize=False, backward="auto", grad: Tensor | None = None, seed=7):
    """(scores, dQ, dD) of the library. The leaves keep the inputs' strides (non-contiguous views stay so)."""
    Q = inp.Q.detach().requires_grad_()
    D = inp.D.detach().requires_grad_()
    s = call_lib(inp, Q, D, normalize=normalize, backward=backward)
    if grad is None:
        grad = upstream_grad(s.shape, seed=seed, device=s.device)
    s.backward(grad)
    return s.detach(), Q.grad, D.grad, grad


def ref_forward_backward(inp: Inputs, grad: Tensor, *, normalize=False):
    """float64 (scores, dQ, dD) of the reference on the same (rounded) inputs."""
    Q = inp.Q.detach().double().requires_grad_()
    D = inp.D.detach().double().requires_grad_()
    s = call_ref(inp, Q, D, normalize=normalize)
    if s.requires_grad:
        s.backward(grad.double())
    dQ = Q.grad if Q.grad is not None else torch.zeros_like(Q)
    dD = D.grad if D.grad is not None else torch.zeros_like(D)
    return s.detach(), dQ, dD


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------------
# comparisons


def rel_err(actual: Tensor, expected: Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``||a - b||`` when ``b`` is 0)."""
    a = actual.detach().double().cpu()
    b = expected.detach().double().cpu()
    num = (a - b).norm().item()
    den = b.norm().item()
    return num / den if den > 0 else num


def _describe_worst(a: Tensor, b: Tensor, bound: Tensor) -> str:
    excess = (a - b).abs() - bound
    idx = int(excess.reshape(-1).argmax())
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), a.shape)) if a.dim() else ()
    n_bad = int((excess > 0).sum())
    return (
        f"{n_bad}/{a.numel()} elements out of tolerance; worst at {pos}: "
        f"actual {a.reshape(-1)[idx].item()!r}, "
        f"expected {b.reshape(-1)[idx].item()!r}, allowed |diff| {bound.reshape(-1)[idx].item():.3g}"
    )


def assert_same_nan(actual: Tensor, expected: Tensor, what: str):
    an = torch.isnan(actual.detach().cpu())
    en = torch.isnan(expected.detach().cpu())
    if not torch.equal(an, en):
        raise AssertionError(
            f"{what}: NaN pattern differs: actual NaN at {an.nonzero().tolist()}, "
            f"expected NaN at {en.nonzero().tolist()}"
        )


def assert_scores_close(actual: Tensor, expected: Tensor, *, dtype, magnitude: Tensor, what="scores"):
    """Scores within ``tol * (|expected| + magnitude)`` elementwise and ``tol`` in whole-tensor rel. error."""
    tol = SCORE_TOL[dtype]
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == score_dtype(dtype), f"{what}: dtype {actual.dtype}, expected {score_dtype(dtype)}"
    a = actual.detach().double().cpu()
    b = expected.detach().double().cpu()
    assert_same_nan(a, b, what)
    keep = ~torch.isnan(b)
    a, b = a[keep], b[keep]
    bound = tol * (b.abs() + magnitude.detach().double().cpu()[keep]) + 1e-30
    if not bool(((a - b).abs() <= bound).all()):
        raise AssertionError(f"{what} ({dtype}): " + _describe_worst(a, b, bound))
    err = rel_err(a, b)
    assert err <= tol, f"{what} ({dtype}): relative error {err:.3g} > {tol:g}"


def assert_grads_close(actual: Tensor | None, expected: Tensor, *, dtype, keep: Tensor | None = None, what="grad"):
    """A gradient in the input dtype, within ``tol * (|expected| + max|expected|)`` (on ``keep``)."""
    tol = GRAD_TOL[dtype]
    assert actual is not None, f"{what}: no gradient (None)"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected the input dtype {dtype}"
    a = actual.detach().double().cpu()
    b = expected.detach().double().cpu()
    assert bool(torch.isfinite(a).all()), f"{what}: non-finite values at {(~torch.isfinite(a)).nonzero().tolist()[:8]}"
    if keep is not None:
        k = keep.cpu()
        assert bool(k.float().mean() > 0.5) or k.numel() < 4, f"{what}: too many near-ties to compare ({k.sum()})"
        a, b = a[k], b[k]
    amax = b.abs().max().item() if b.numel() else 0.0
    bound = tol * (b.abs() + amax) + 1e-30
    if not bool(((a - b).abs() <= bound).all()):
        raise AssertionError(f"{what} ({dtype}): " + _describe_worst(a, b, bound))
    err = rel_err(a, b)
    assert err <= tol, f"{what} ({dtype}): relative error {err:.3g} > {tol:g}"


def assert_matches_reference(inp: Inputs, s, dQ, dD, grad, *, normalize=False, exact=False, check_grads=True):
    """Library results (on ``inp``) against the float64 reference on ``inp``.

    exact: the data has exact ties on purpose (integer-valued), so every gradient entry is compared; otherwise
    the tokens of near-tied rows are left out of the gradient comparison (see :func:`unambiguous_tokens`).
    """
    rs, rdQ, rdD = ref_forward_backward(inp, grad, normalize=normalize)
    mag = score_magnitude(inp, normalize, rs.shape)
    assert_scores_close(s, rs, dtype=inp.dtype, magnitude=mag)
    if not check_grads:
        return
    q_keep = d_keep = None
    if not exact:
        q_keep, d_keep = unambiguous_tokens(inp, normalize, GAP_TOL[inp.dtype])
        q_keep = q_keep[..., None].expand(inp.Q.shape)
        d_keep = d_keep[..., None].expand(inp.D.shape)
    assert_grads_close(dQ, rdQ, dtype=inp.dtype, keep=q_keep, what="dQ")
    assert_grads_close(dD, rdD, dtype=inp.dtype, keep=d_keep, what="dD")


def check_parity(inp: Inputs, *, normalize=False, backward="auto", seed=0, exact=False, check_grads=True):
    """Scores and gradients of the library against the float64 reference; returns the library's results."""
    s, dQ, dD, grad = lib_forward_backward(inp, normalize=normalize, backward=backward, seed=seed + 5)
    assert_matches_reference(inp, s, dQ, dD, grad, normalize=normalize, exact=exact, check_grads=check_grads)
    return s, dQ, dD


def case_id(case) -> str:
    return "-".join(str(c) for c in case)


def assert_rejected(fn, exc: type[Exception], patterns: list[str]) -> None:
    """``fn()`` raises ``exc`` whose message matches every regular expression in ``patterns`` (argument name,
    expected and actual value)."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    missing = [p for p in patterns if not re.search(p, msg)]
    assert not missing, f"message {msg!r} lacks {missing}"


def word(s: str) -> str:
    """A regular expression for ``s`` as a whole word (an argument name inside an error message)."""
    return rf"(?<![A-Za-z0-9_]){re.escape(s)}(?![A-Za-z0-9_])"
