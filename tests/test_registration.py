"""The registered ops ``torch.ops.maxsim.forward`` / ``torch.ops.maxsim.backward``: opcheck, their own parity,
gradcheck through the public functions, and ``torch.compile(fullgraph=True)`` of code that calls ``maxsim``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    Inputs,
    assert_matches_reference,
    canonical,
    int_grid,
    keep_under_interpreter,
    make_inputs,
    rand_mask,
    randn,
    seed_of,
    similarities,
    upstream_grad,
)

import maxsim
from maxsim import reference


@pytest.fixture
def impl(backend):
    """The ``impl`` string of the ops, from the ``backend`` fixture (which skips where Triton cannot run)."""
    return backend


def op_call(op, **values):
    """(args, kwargs) for ``op`` from its schema's argument names, so the tests do not hard-code the order.

    Arguments with a default that are not in ``values`` are left to their default.
    """
    args, kwargs = [], {}
    for a in op._schema.arguments:
        if a.name in values:
            if a.kwarg_only:
                kwargs[a.name] = values[a.name]
            else:
                args.append(values[a.name])
        elif not a.has_default_value():
            raise AssertionError(f"{op}: no test value for argument {a.name!r}")
        else:
            break
    return tuple(args), kwargs


def _op_inputs(layout, *, device, masks=True, requires_grad=False, exact=False, seed=0, small=False):
    """Canonical inputs for the ops: ``Q [2, Lq, 8]``, ``D [Bd, K, Ld, 8]`` with ``Bd`` 1 (cross) or 2."""
    masks = "holes" if masks else None
    m, lq, ld = (1, 3, 4) if small else (2, 5, 7)
    inp = make_inputs(layout, 2, m, lq, ld, 8, device=device, masks=masks, seed=seed, exact=exact)
    Q, D, qm, dm = canonical(inp)
    Q, D = Q.contiguous(), D.contiguous()
    if requires_grad:
        Q.requires_grad_()
        D.requires_grad_()
    return Inputs("candidates" if D.shape[0] > 1 else "cross", Q, D, qm, dm)


FWD = torch.ops.maxsim.forward.default
BWD = torch.ops.maxsim.backward.default


def _forward_values(inp, *, normalize, need_argmax, impl, deterministic=False):
    return dict(
        Q=inp.Q,
        D=inp.D,
        q_mask=inp.q_mask,
        d_mask=inp.d_mask,
        normalize=normalize,
        need_argmax=need_argmax,
        impl=impl,
        deterministic=deterministic,
    )


def test_ops_are_registered():
    names = [a.name for a in FWD._schema.arguments]
    for name in ("Q", "D", "q_mask", "d_mask", "normalize", "need_argmax", "impl"):
        assert name in names, f"maxsim::forward lacks argument {name!r}: {FWD._schema}"
    names = [a.name for a in BWD._schema.arguments]
    for name in ("grad", "Q", "D", "argmax", "normalize", "deterministic", "impl"):
        assert name in names, f"maxsim::backward lacks argument {name!r}: {BWD._schema}"
    assert len(FWD._schema.returns) == 2 and len(BWD._schema.returns) == 2


# ----------------------------------------------------------------------------------------------------
# opcheck

OPCHECK_FWD = [  # (layout, masks, normalize, need_argmax)
    ("cross", True, False, True),
    ("cross", False, True, False),
    ("candidates", True, True, True),
    ("candidates", False, False, True),
]


@pytest.mark.parametrize("case", OPCHECK_FWD, ids=lambda c: "-".join(map(str, c)))
def test_opcheck_forward(case, impl, device):
    keep_under_interpreter(case in (OPCHECK_FWD[0], OPCHECK_FWD[2]), impl, device)
    layout, masks, normalize, need_argmax = case
    inp = _op_inputs(layout, device=device, masks=masks, requires_grad=need_argmax, seed=seed_of(case), small=True)
    args, kwargs = op_call(FWD, **_forward_values(inp, normalize=normalize, need_argmax=need_argmax, impl=impl))
    torch.library.opcheck(FWD, args, kwargs)


def _backward_values(inp, scores, argmax, *, normalize, deterministic, impl, seed):
    grad = upstream_grad(scores.shape, seed=seed, device=scores.device)
    values = dict(
        grad=grad,
        Q=inp.Q,
        D=inp.D,
        q_mask=inp.q_mask,
        d_mask=inp.d_mask,
        argmax=argmax,
        normalize=normalize,
        deterministic=deterministic,
        impl=impl,
    )
    return grad, op_call(BWD, **values)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_opcheck_backward(layout, deterministic, impl, device):
    keep_under_interpreter((layout == "cross") == deterministic, impl, device)
    inp = _op_inputs(layout, device=device, seed=seed_of(layout, deterministic), small=True)
    args, kwargs = op_call(FWD, **_forward_values(inp, normalize=True, need_argmax=True, impl=impl))
    scores, argmax = FWD(*args, **kwargs)
    _, (bargs, bkwargs) = _backward_values(
        inp, scores, argmax, normalize=True, deterministic=deterministic, impl=impl, seed=3
    )
    torch.library.opcheck(BWD, bargs, bkwargs)


# ----------------------------------------------------------------------------------------------------
# the ops themselves


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_forward_op_outputs_and_argmax(layout, normalize, impl, device):
    """scores [Nq, K] fp32; argmax [Nq, K, Lq] int32 equal to the reference's (ties -> lowest) where defined."""
    keep_under_interpreter((layout == "cross") == normalize, impl, device)
    inp = _op_inputs(layout, device=device, exact=True, seed=seed_of("argmax", layout))
    # exact ties: document token 5 duplicates token 3 (both valid) in every document
    D, dm = inp.D.clone(), inp.d_mask.clone()
    D[..., 5, :] = D[..., 3, :]
    dm[..., 3] = True
    dm[..., 5] = True
    inp = inp.with_(D=D, d_mask=dm)
    args, kwargs = op_call(FWD, **_forward_values(inp, normalize=normalize, need_argmax=True, impl=impl))
    scores, argmax = FWD(*args, **kwargs)
    Nq, Lq = inp.Q.shape[:2]
    K = inp.D.shape[1]
    assert scores.shape == (Nq, K) and scores.dtype == torch.float32
    assert argmax.shape == (Nq, K, Lq) and argmax.dtype == torch.int16  # (saved as int16: short documents)
    rs, ra = reference.scores_and_argmax(inp.Q.double(), inp.D.double(), inp.q_mask, inp.d_mask, normalize=normalize)
    torch.testing.assert_close(scores.double(), rs, rtol=1e-5, atol=1e-5)
    # rows whose only near-tie is the planted duplicate (or none) have a well-defined argmax
    sim, row_valid = similarities(inp, normalize)
    close = sim >= sim.amax(-1, keepdim=True) - 1e-6 * float(sim[torch.isfinite(sim)].abs().max())
    others = close.clone()
    others[..., 3] = False
    others[..., 5] = False
    planted = close[..., 3] & close[..., 5] & ~others.any(-1)
    defined = row_valid & ((close.sum(-1) == 1) | planted)
    assert bool(defined.float().mean() > 0.5)
    # (the float64 reference itself may split the planted tie by one ulp once normalized: expect the lower index)
    expected = torch.where(planted, torch.full_like(ra, 3), ra)
    arg = argmax.long().cpu()
    assert torch.equal(arg[defined.cpu()], expected[defined].cpu()), "argmax differs from torch.max's choice"
    assert not bool((arg == 5)[row_valid.cpu()].any()), "a tie went to the higher duplicate"
    assert bool((arg == 3)[row_valid.cpu()].any()), "the planted tie was never the max (test data)"

    args, kwargs = op_call(FWD, **_forward_values(inp, normalize=normalize, need_argmax=False, impl=impl))
    scores2, none = FWD(*args, **kwargs)
    assert none.numel() == 0 and none.dtype == torch.int32
    assert torch.equal(scores2, scores)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_backward_op_matches_reference(layout, normalize, deterministic, impl, device):
    subset = {("cross", True, False), ("cross", False, True), ("candidates", True, True)}
    keep_under_interpreter((layout, normalize, deterministic) in subset, impl, device)
    inp = _op_inputs(layout, device=device, seed=seed_of("bwd", layout, normalize))
    args, kwargs = op_call(FWD, **_forward_values(inp, normalize=normalize, need_argmax=True, impl=impl))
    scores, argmax = FWD(*args, **kwargs)
    grad, (bargs, bkwargs) = _backward_values(
        inp, scores, argmax, normalize=normalize, deterministic=deterministic, impl=impl, seed=4
    )
    dQ, dD = BWD(*bargs, **bkwargs)
    assert dQ.shape == inp.Q.shape and dD.shape == inp.D.shape
    assert_matches_reference(inp, scores, dQ, dD, grad, normalize=normalize)


# ----------------------------------------------------------------------------------------------------
# gradcheck (float64, PyTorch path)

GRADCHECK_CASES = {  # name: (Q shape, D shape, masks?)
    "cross": ((2, 3, 5), (3, 4, 5), True),
    "candidates": ((2, 3, 5), (2, 2, 4, 5), True),
    "Q2D": ((3, 5), (3, 4, 5), True),
    "D2D": ((2, 3, 5), (4, 5), False),
    "pairs": ((2, 3, 5), (2, 4, 5), True),
}


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("name", list(GRADCHECK_CASES))
def test_gradcheck(name, normalize, device):
    qs, ds, masks = GRADCHECK_CASES[name]
    seed = seed_of("gradcheck", name)
    Q = randn(qs, seed=seed, device=device).double().requires_grad_()
    D = randn(ds, seed=seed + 1, device=device).double().requires_grad_()
    qm = rand_mask(qs[:-1], seed=seed + 2, device=device) if masks else None
    dm = rand_mask(ds[:-1], seed=seed + 3, device=device) if masks else None
    fn = maxsim.maxsim_pairs if name == "pairs" else maxsim.maxsim
    with maxsim.backend("torch"):
        assert torch.autograd.gradcheck(lambda q, d: fn(q, d, qm, dm, normalize=normalize), (Q, D))


# ----------------------------------------------------------------------------------------------------
# torch.compile


def _loss(layout, Q, D, qm, dm, labels):
    if layout == "pairs":
        s = maxsim.maxsim_pairs(Q, D, qm, dm, normalize=True)
        return (s * labels).sum(), s
    s = maxsim.maxsim(Q, D, qm, dm, normalize=True)
    return F.cross_entropy(s / 0.05, labels), s


@pytest.mark.parametrize("layout", ["cross", "candidates", "pairs"])
def test_compile_fullgraph_forward_backward(layout, backend, device):
    """A training-style function calling ``maxsim`` compiles without graph breaks and matches eager (fwd+bwd)."""
    keep_under_interpreter(layout == "cross", backend, device)
    torch.compiler.reset()
    n, m = 2, 3
    inp = make_inputs(layout, n, m, 5, 9, 16, device=device, masks="holes", seed=seed_of("compile", layout))
    labels = randn((n,), seed=2, device=device) if layout == "pairs" else torch.arange(n, device=device) % m
    # inductor for the PyTorch path; the interpreter path keeps to aot_eager (tiny and fast)
    compiled = torch.compile(_loss, fullgraph=True, backend="aot_eager" if backend == "triton" else "inductor")
    outs = {}
    for mode, fn in (("eager", _loss), ("compiled", compiled)):
        Q = inp.Q.detach().clone().requires_grad_()
        D = inp.D.detach().clone().requires_grad_()
        loss, s = fn(layout, Q, D, inp.q_mask, inp.d_mask, labels)
        loss.backward()
        outs[mode] = (s.detach(), Q.grad, D.grad)
    for a, b in zip(outs["compiled"], outs["eager"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    s_ref = (reference.maxsim_pairs if layout == "pairs" else reference.maxsim)(
        inp.Q.double(), inp.D.double(), inp.q_mask, inp.d_mask, normalize=True
    )
    torch.testing.assert_close(outs["compiled"][0].double(), s_ref, rtol=1e-5, atol=1e-5)


def test_compile_handles_new_shapes(backend, device):
    """The compiled function keeps working (and stays exact) when Nq, Nd and Ld change between calls."""
    torch.compiler.reset()

    def fn(Q, D, dm):
        return maxsim.maxsim(Q, D, None, dm)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for i, (nq, nd, ld) in enumerate([(2, 3, 9), (3, 5, 9), (2, 4, 17)]):
        Q = int_grid((nq, 5, 8), seed=i, device=device)
        D = int_grid((nd, ld, 8), seed=i + 10, device=device)
        dm = rand_mask((nd, ld), seed=i + 20, device=device)
        out = compiled(Q, D, dm)
        assert torch.equal(out.double(), reference.maxsim(Q.double(), D.double(), None, dm))


def test_compile_module(backend, device):
    keep_under_interpreter(False, backend, device)
    torch.compiler.reset()
    compiled = torch.compile(maxsim.MaxSim(normalize=True), fullgraph=True, backend="aot_eager")
    inp = make_inputs("cross", 2, 3, 5, 9, 16, device=device, masks="holes", seed=5)
    Q = inp.Q.detach().clone().requires_grad_()
    s = compiled(Q, inp.D, inp.q_mask, inp.d_mask)
    grad = upstream_grad(s.shape, seed=1, device=device)
    s.backward(grad)
    eager_Q = inp.Q.detach().clone().requires_grad_()
    eager = maxsim.maxsim(eager_Q, inp.D, inp.q_mask, inp.d_mask, normalize=True)
    eager.backward(grad)
    torch.testing.assert_close(s.detach(), eager.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(Q.grad, eager_Q.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "call",
    ["cross", "candidates", "one query", "one document", "pairs", "pair list"],
)
def test_eager_training_graph_is_one_node(call):
    """Eager autograd sees one node per call whatever the layout: the canonical views of the inputs and of the
    result are taken inside the autograd function (each view node would cost a small training step as much host
    time as a kernel launch), and the gradients still come back in the inputs' shapes."""
    dim = 8
    Q3, D3, D4 = torch.randn(3, 4, dim), torch.randn(5, 6, dim), torch.randn(3, 2, 6, dim)
    if call == "pair list":
        Q, D = torch.randn(7, dim), torch.randn(9, dim)
        cu_q, cu_d = torch.tensor([0, 3, 7]), torch.tensor([0, 4, 9])
        pq, pd = torch.tensor([0, 1, 1]), torch.tensor([1, 0, 1])
        fn = lambda q, d: maxsim.maxsim_pairs_varlen(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=4, max_seqlen_d=5)  # noqa: E731
    else:
        Q, D, fn = {
            "cross": (Q3, D3, maxsim.maxsim),
            "candidates": (Q3, D4, maxsim.maxsim),
            "one query": (Q3[0], D3, maxsim.maxsim),
            "one document": (Q3, D3[0], maxsim.maxsim),
            "pairs": (Q3, D3[:3], maxsim.maxsim_pairs),
        }[call]
    Q, D = Q.clone().requires_grad_(), D.clone().requires_grad_()
    s = fn(Q, D)
    assert type(s.grad_fn).__name__ == "_MaxSimFunctionBackward"
    assert all(type(n).__name__ == "AccumulateGrad" for n, _ in s.grad_fn.next_functions if n is not None)
    dQ, dD = torch.autograd.grad(s.sum(), (Q, D))
    assert dQ.shape == Q.shape and dD.shape == D.shape
