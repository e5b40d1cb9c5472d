"""The thin kernel launcher: the first launch of a signature goes through Triton, later ones call the compiled
kernel directly; anything Triton specializes on (integer values, dtypes, 16-byte alignment, constexprs, launch
options) or an installed launch hook sends the call back through Triton. Runs without a GPU (a fake kernel)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers import check_pointers  # noqa: E402

from maxsim.kernels import launcher  # noqa: E402


class FakeCompiled:
    def __init__(self, log):
        self.log = log
        self.function, self.packed_metadata = "fn", "meta"

    def run(self, *args):
        self.log.append(("direct", args))


class FakeKernel:
    arg_names = ["X", "n", "BLOCK"]
    constexprs = [2]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.log)

        return launch


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(launcher, "INTERPRETER", False)
    monkeypatch.setattr(launcher, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_device_of", lambda t: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


def test_second_launch_is_direct_and_passes_every_argument(fake_gpu):
    k = FakeKernel()
    lc = launcher.Launcher(k)
    x = torch.zeros(16)
    lc(3, (x,), (7,), {"BLOCK": 32}, 4)
    lc(3, (x,), (7,), {"BLOCK": 32}, 4)
    assert [e[0] for e in k.log] == ["triton", "direct"]
    grid0, grid1, grid2, stream, fn, meta, _m, enter, exit_, *args = k.log[1][1]
    assert (grid0, grid1, grid2, stream, fn, meta, enter, exit_) == (3, 1, 1, 1234, "fn", "meta", None, None)
    # (the pointer as an integer: Triton's launcher would read it from the tensor and have the driver check it)
    assert args == [x.data_ptr(), 7, 32]


def test_pointers_read_by_the_caller_are_passed_as_given(fake_gpu):
    """With ``pointers``, a direct launch passes them instead of reading each tensor's (the caller read each distinct
    tensor once); the first launch, through Triton, still gets the tensors."""
    k = FakeKernel()
    lc = launcher.Launcher(k)
    x = torch.zeros(16)
    for _ in range(2):
        lc(3, (x,), (7,), {"BLOCK": 32}, 4, 3, {}, pointers=(4096,))
    assert k.log[0][2] == (x, 7)
    assert list(k.log[1][1][9:]) == [4096, 7, 32]


@pytest.mark.parametrize(
    "change",
    ["int", "dtype", "alignment", "constexpr", "warps", "registers"],
)
def test_anything_triton_specializes_on_goes_back_through_triton(fake_gpu, change):
    k = FakeKernel()
    lc = launcher.Launcher(k)
    x = torch.zeros(16)
    lc(3, (x,), (16,), {"BLOCK": 32}, 4)
    args = {
        "int": ((x,), (17,), {"BLOCK": 32}, 4),
        "dtype": ((x.half(),), (16,), {"BLOCK": 32}, 4),
        "alignment": ((x[1:],), (16,), {"BLOCK": 32}, 4),
        "constexpr": ((x,), (16,), {"BLOCK": 64}, 4),
        "warps": ((x,), (16,), {"BLOCK": 32}, 8),
        "registers": ((x,), (16,), {"BLOCK": 32}, 4, 3, None, 128),
    }[change]
    lc(3, *args)
    assert [e[0] for e in k.log] == ["triton", "triton"]


def test_tensors_on_another_gpu_launch_under_their_device(fake_gpu, monkeypatch):
    """Triton compiles for and launches on the current device: tensors on cuda:1 while cuda:0 is current launch
    with cuda:1 made current for the launch (then restored), and their launches are filed under device 1."""
    current = [0]
    switches = []

    class DeviceGuard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            switches.append(self.index)
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(launcher, "current_device", lambda: current[0])
    monkeypatch.setattr(launcher, "_device_of", lambda t: 1 if t.shape[0] == 16 else 0)
    monkeypatch.setattr(torch.cuda, "device", DeviceGuard)
    streams = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: streams.append(device) or 99)
    k = FakeKernel()
    lc = launcher.Launcher(k)
    on_1, on_0 = torch.zeros(16), torch.zeros(32)
    cache: dict = {}
    for x in (on_1, on_1, on_0, on_0, on_1):
        lc(3, (x,), (7,), {"BLOCK": 32}, 4, 3, cache)
    assert switches == [1, 1, 1]
    assert current == [0]
    assert [e[0] for e in k.log] == ["triton", "direct", "triton", "direct", "direct"]
    assert streams == [1, 0, 1]  # (each direct launch on the stream of its tensors' device)
    assert sorted(key[0] for key in cache) == [0, 1]


def test_register_cap_reaches_triton_only_when_set(fake_gpu):
    k = FakeKernel()
    lc = launcher.Launcher(k)
    x = torch.zeros(16)
    lc(3, (x,), (16,), {"BLOCK": 32}, 4)
    lc(3, (x,), (16,), {"BLOCK": 32}, 4, 2, None, 128)
    assert "maxnreg" not in k.log[0][3]
    assert k.log[1][3] == {"BLOCK": 32, "num_warps": 4, "num_stages": 2, "maxnreg": 128, **launcher.COMPILE_OPTIONS}


def test_long_query_forwards_share_one_uncapped_configuration():
    """Long queries run one 128-row block per program with 64-token tiles at dim <= 128, with or without the argmax,
    uncapped (the argmax loop fits its registers since its loads lost their row predicate); nothing in the launch
    table caps registers."""
    from maxsim.kernels.configs import forward_config

    long = forward_config(1024, 128, 32, True)
    assert (long.TQ, long.BQ, long.BLOCK_N, long.num_warps, long.num_stages, long.maxnreg) == (128, 1, 64, 4, 3, 0)
    assert forward_config(1024, 128, 1, True) == long
    assert forward_config(1024, 256, 32, True).BLOCK_N == 32  # dim 256: two dim chunks
    assert all(forward_config(lq, 128, n, s).maxnreg == 0 for lq in (32, 1024) for n in (1, 256) for s in (True, False))


def test_blocks_of_long_queries_leave_no_query_slot_empty():
    """65-128-token queries against shared documents pack as many queries a block as leave the fewest empty slots
    (compute-bound blocks: an empty slot costs what a full one does); shorter queries pack as many as fit."""
    from maxsim.kernels.configs import forward_config

    assert [forward_config(100, 96, n, True).BQ for n in (1, 2, 3, 4, 5, 6, 7, 8)] == [1, 2, 1, 2, 1, 2, 1, 2]
    assert forward_config(100, 96, 3, True).TQ == 128
    assert forward_config(32, 128, 3, True).BQ == 4  # (three 32-token queries: one block of four)
    assert forward_config(64, 128, 3, True).BQ == 4
    assert forward_config(100, 96, 3, False).BQ == 1  # (candidates: one query a block anyway)


def test_plan_cache_launches_directly_and_follows_alignment(fake_gpu):
    """A caller's plan cache (fixed integers, constexprs and dtypes) is keyed by the tensors' alignments: the second
    launch is direct, a misaligned tensor goes back through Triton (its own variant), then is direct too."""
    k = FakeKernel()
    lc = launcher.Launcher(k)
    cache: dict = {}
    x = torch.zeros(32)
    for t in (x, x, x[1:], x[1:], x):
        lc(3, (t,), (16,), {"BLOCK": 32}, 4, 3, cache)
    assert [e[0] for e in k.log] == ["triton", "direct", "triton", "direct", "direct"]
    assert len(cache) == 2
    # a fresh plan cache on a known signature: direct at once (the launcher's own table)
    lc(3, (x,), (16,), {"BLOCK": 32}, 4, 3, {})
    assert k.log[-1][0] == "direct"


def test_plans_tell_index_dtypes_apart():
    """Plans key on the dtypes of offsets and pair ids (a plan's launches reuse its kernel variant)."""
    from maxsim.kernels.launch_args import ragged_plan_key
    from maxsim.layout import Ragged

    cu = torch.tensor([0, 2, 5])
    p32, p64 = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1])
    assert ragged_plan_key(Ragged(cu, cu, p32, p32, 3, 3)) != ragged_plan_key(Ragged(cu, cu, p32, p64, 3, 3))
    assert ragged_plan_key(Ragged(cu.int(), cu, None, None, 3, 3)) != ragged_plan_key(Ragged(cu, cu, None, None, 3, 3))


def test_installed_hook_always_takes_tritons_path(fake_gpu, monkeypatch):
    from triton import knobs

    class Chain:
        calls = [print]

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", Chain(), raising=False)
    k = FakeKernel()
    lc = launcher.Launcher(k)
    x = torch.zeros(16)
    for _ in range(2):
        lc(3, (x,), (7,), {"BLOCK": 32}, 4)
    assert [e[0] for e in k.log] == ["triton", "triton"]


def test_hook_detection():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not launcher._hooked(None)
    assert not launcher._hooked(Chain([]))
    assert launcher._hooked(Chain([print]))
    assert launcher._hooked(print)


def test_backward_plans_describe_every_call_exactly(monkeypatch):
    """A cached backward plan launches exactly what a freshly built one would, whatever changed between calls that
    the plan must follow (the upstream gradient's layout and dtype, flags, pair lists, the scan limit)."""
    from maxsim.kernels import launch, launch_args, launch_backward, launch_settings
    from maxsim.layout import Ragged, Views

    calls: list = []

    def record(
        self, grid, tensors, ints, constexprs, num_warps, num_stages=3, plan_cache=None, maxnreg=0, foreign=None,
        pointers=None,
    ):  # fmt: skip
        calls.append((self.kernel.__name__, grid, tuple((t.shape, t.stride(), t.dtype) for t in tensors), ints,
                      tuple(constexprs.items()), num_warps))  # fmt: skip

    monkeypatch.setattr(launcher.Launcher, "__call__", record)
    monkeypatch.setattr(launch_args, "INTERPRETER", False)
    Q = torch.randn(4, 6, 16)
    D = torch.randn(1, 5, 7, 16)
    Dc = torch.randn(4, 3, 7, 16)
    arg = torch.zeros(4, 5, 6, dtype=torch.int32)
    argc = torch.zeros(4, 3, 6, dtype=torch.int32)
    g = torch.randn(4, 5)
    cu_q, cu_d = torch.tensor([0, 2, 6, 9]), torch.tensor([0, 3, 7, 12, 13])
    Qp, Dp = torch.randn(9, 16), torch.randn(13, 16)
    pq, pd = torch.tensor([0, 2, 1, 2]), torch.tensor([3, 1, 1, 0])
    rg = Ragged(cu_q, cu_d, pq, pd, 4, 5)
    argp = torch.zeros(1, 4, 4, dtype=torch.int32)
    cross_as_given = Views((), (0,), None)
    cases = [
        (g, Q, D, arg, False, False, None),
        (g, Q, D[0], arg, False, False, None, None, cross_as_given),  # the caller's 3-D D, viewed by the plan
        (g, Q, D[0], arg, True, True, None, None, cross_as_given),
        (torch.ones(()).expand(4, 5), Q, D, arg, False, False, None),  # a .sum() loss: stride 0
        (torch.randn(5, 4).t(), Q, D, arg, False, False, None),  # transposed: made contiguous
        (g.double(), Q, D, arg, False, False, None),
        (g, Q, D, arg, True, False, None),
        (g, Q, D, arg, False, True, None),
        (torch.randn(4, 3), Q, Dc, argc, False, False, None),
        (torch.randn(1, 4), Qp, Dp, argp, False, False, rg),
        (torch.randn(1, 4), Qp, Dp, argp, False, True, rg),
        # the caller's [P] result shape (Views.out): contiguous, strided, a .sum() loss's stride 0
        (torch.randn(4), Qp, Dp, argp[0], False, False, rg, None, Views((), (), (4,))),
        (torch.randn(8)[::2], Qp, Dp, argp[0], False, True, rg, None, Views((), (), (4,))),
        (torch.ones(()).expand(4), Qp, Dp, argp[0], False, False, rg, None, Views((), (), (4,))),
    ]
    limits = (launch_settings.PAIR_SCAN_MAX_WORK, 0)
    fresh = {}
    for limit in limits:
        monkeypatch.setattr(launch_settings, "PAIR_SCAN_MAX_WORK", limit)
        for i, case in enumerate(cases):
            calls.clear()
            launch_backward.plans.clear()
            launch.backward(*case)
            fresh[limit, i] = list(calls)
    assert fresh[limits[0], 9] != fresh[0, 9]  # the pair list really takes another path without the scan
    launch_backward.plans.clear()
    for _ in range(2):  # every case after every other, on plans cached along the way
        for limit in limits:
            monkeypatch.setattr(launch_settings, "PAIR_SCAN_MAX_WORK", limit)
            for i, case in enumerate(cases):
                calls.clear()
                launch.backward(*case)
                assert calls == fresh[limit, i], (limit, i)
    assert len(launch_backward.plans) < 2 * len(cases)  # plans were shared where the keys agree


def test_persistent_split_weighs_resident_one_document_programs():
    """Packed queries against shared documents (one persistent program per multiprocessor): long documents go one
    to a program, where the hardware keeps two resident; short ones are still walked several to a program."""
    from maxsim.kernels import launch_forward, launch_settings

    base, K, sms = 8, 64, 132  # 64 queries in blocks of 8 against 64 documents
    gain = launch_settings.ONE_DOC_GAIN
    assert launch_forward.docs_per_program(base, K, sms, 16) == 4  # without the gain: 4 documents of 16 tiles each
    assert launch_forward.docs_per_program(base, K, sms, 16, gain) == 1  # Ld 1024 in 64-token tiles
    assert launch_forward.docs_per_program(base, K, sms, 2, gain) == 4  # Ld 128
    assert launch_forward.docs_per_program(32, 256, sms, 5, gain) > 1  # 256 x 256, Ld 300


def test_plan_cache_keys_on_foreign_tensors_only(fake_gpu):
    """With ``foreign``, a plan cache is keyed by those tensors' alignments alone (the others are the caller's fresh
    allocations); a misaligned foreign tensor still goes back through Triton."""
    k = FakeKernel()
    lc = launcher.Launcher(k)
    cache: dict = {}
    x, out = torch.zeros(32), torch.zeros(32)
    for t in (x, x, x[1:]):
        lc(3, (t, out), (16,), {"BLOCK": 32}, 4, 3, cache, foreign=(t,))
    assert [e[0] for e in k.log] == ["triton", "direct", "triton"]
    assert set(cache) == {(0, 0), (0, x[1:].data_ptr() & 15)}


def _caller_layouts():
    """(name, forward arguments after Q and D, upstream gradient) of every layout the launches see, with inputs the
    caller owns: masks, offsets, lengths, pair ids, misaligned views, a strided gradient."""
    from maxsim.layout import Ragged, Views

    Q, D = torch.randn(4, 6, 16), torch.randn(1, 5, 7, 16)
    qm, dm = torch.rand(4, 6) > 0.3, torch.rand(1, 5, 7) > 0.3
    cu_q, cu_d = torch.tensor([0, 2, 6, 9]), torch.tensor([0, 3, 7, 12, 13])
    Qp, Dp = torch.randn(9, 16), torch.randn(13, 16)
    pair = Ragged(cu_q, cu_d, torch.tensor([0, 2, 1, 2]), torch.tensor([3, 1, 1, 0]), 4, 5)
    lengths = Ragged(torch.tensor([6, 2, 5, 1]), torch.tensor([[7, 3, 0, 5, 1]]), None, None, 6, 7)
    return [
        ("cross", (Q, D, None, None, False, None), None),
        ("cross, 3-D D as given", (Q, D[0], None, None, True, None, Views((), (0,), None)), None),
        ("masks, normalize", (Q, D, qm, dm, True, None), torch.ones(()).expand(4, 5)),
        (
            "misaligned",
            (torch.randn(97)[1:].view(4, 6, 4), torch.randn(141)[1:].view(1, 5, 7, 4), None, None, False, None),
            torch.randn(5, 4).t(),
        ),  # fmt: skip
        ("candidates", (Q, torch.randn(4, 3, 7, 16), None, torch.rand(4, 3, 7) > 0.3, True, None), None),
        ("pair list", (Qp, Dp, None, None, False, pair), None),
        ("packed", (Qp, Dp, None, None, True, Ragged(cu_q, cu_d, None, None, 4, 5)), None),
        ("lengths", (Q, D, None, None, False, lengths), None),
    ]


@pytest.mark.parametrize("name, args, grad", _caller_layouts(), ids=[c[0] for c in _caller_layouts()])
@pytest.mark.parametrize("mode", ["fast", "deterministic"])
def test_launches_name_every_caller_tensor_foreign(monkeypatch, name, args, grad, mode):
    """Every pointer a planned launch passes outside its ``foreign`` tensors is an allocation of this call: a
    caller's tensor left out would be assumed 16-byte aligned, and a misaligned one would run a variant compiled
    for aligned pointers."""
    from maxsim import ops
    from maxsim.kernels import launch_args, launch_backward, launch_forward

    launches: list = []

    def record(self, grid, tensors, ints, constexprs, num_warps, num_stages=3, plan_cache=None, maxnreg=0,
               foreign=None, pointers=None):  # fmt: skip
        launches.append((self.kernel.__name__, tensors, plan_cache, foreign))
        check_pointers(tensors, pointers)

    monkeypatch.setattr(launcher.Launcher, "__call__", record)
    monkeypatch.setattr(launch_args, "INTERPRETER", False)
    Q, D, q_mask, d_mask, normalize, rg, *views = args
    views = views[0] if views else None
    launch_forward.plans.clear()
    launch_backward.plans.clear()
    for _ in range(2):  # planning, then planned
        scores, argmax, norms = ops.forward_impl(Q, D, q_mask, d_mask, normalize, True, "triton", rg, views)
        argmax.zero_()  # (the launches were not run)
        g = torch.randn(scores.shape) if grad is None else grad
        ops.backward_impl(g, Q, D, argmax, normalize, mode == "deterministic", "triton", rg, norms, views)
    launch_forward.plans.clear()
    launch_backward.plans.clear()
    caller = [Q, D, q_mask, d_mask, g, *(() if rg is None else rg[:4])]
    owned = {t.untyped_storage().data_ptr() for t in caller if t is not None}
    planned = [(n, tensors, foreign) for n, tensors, cache, foreign in launches if cache is not None]
    assert {n for n, *_ in planned} >= {"maxsim_fwd_kernel", "maxsim_bwd_kernel"}
    for kernel, tensors, foreign in planned:
        assert foreign is not None, kernel
        named = {id(t) for t in foreign}
        for i, t in enumerate(tensors):
            if id(t) not in named:
                assert t.untyped_storage().data_ptr() not in owned, (kernel, i)


def test_results_in_the_callers_shape_are_no_views(device):
    """Aligned pairs and pair lists come back as ``[P]`` (argmax ``[P, Lq]``) allocated so, not as views of a
    ``[1, P]`` grid (a view costs host time); their gradients follow any upstream layout: contiguous, strided, or
    a ``.sum()`` loss's stride 0."""
    from helpers import randn, triton_usable

    import maxsim
    from maxsim import reference

    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    Q, D = randn((3, 5, 16), seed=1, device=device), randn((3, 7, 16), seed=2, device=device)
    cu_q = torch.tensor([0, 2, 5, 9], dtype=torch.int32, device=device)
    cu_d = torch.tensor([0, 3, 10, 12], dtype=torch.int32, device=device)
    Qp, Dp = randn((9, 16), seed=3, device=device), randn((12, 16), seed=4, device=device)
    pq = torch.tensor([2, 0, 2, 1], device=device)
    pd = torch.tensor([1, 1, 0, 2], device=device)

    def pair_list(q, d, **kw):
        return maxsim.maxsim_pairs_varlen(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=4, max_seqlen_d=7, **kw)

    def ref_pair_list(q, d):
        return reference.maxsim_pairs_varlen(q, d, cu_q, cu_d, pq, pd)

    calls = {
        "pairs": (maxsim.maxsim_pairs, reference.maxsim_pairs, Q, D),
        "pair list": (pair_list, ref_pair_list, Qp, Dp),
    }
    with maxsim.backend("triton"):
        for name, (ours, ref, q, d) in calls.items():
            with torch.no_grad():
                scores, argmax = ours(q, d, return_argmax=True)
            assert scores._base is None and argmax._base is None, name
            qg, dg = q.clone().requires_grad_(), d.clone().requires_grad_()
            n = scores.shape[0]
            for g in (randn((n,), seed=5, device=device), randn((2 * n,), seed=6, device=device)[::2], None):
                out, want = ours(qg, dg), ref(qg, dg)
                got = torch.autograd.grad(out.sum() if g is None else out, (qg, dg), g)
                ref_g = torch.autograd.grad(want.sum() if g is None else want, (qg, dg), g)
                for a, b in zip(got, ref_g, strict=True):
                    torch.testing.assert_close(a, b, msg=name)


def test_inference_plans_tell_the_callers_layouts_apart(device):
    """An inference call's plan is keyed by the caller's tensors and how they are viewed (no views are made on a
    repeat): ``Q [B, Lq, dim]`` with ``D [B, Ld, dim]`` is a cross product for :func:`maxsim.maxsim` and aligned
    pairs for :func:`maxsim.maxsim_pairs`, and each, called in turn on the same tensors, gets its own scores."""
    from helpers import randn, triton_usable

    import maxsim
    from maxsim import reference

    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    Q, D = randn((3, 5, 16), seed=1, device=device), randn((3, 7, 16), seed=2, device=device)
    cross = reference.maxsim(Q, D)
    pairs = reference.maxsim(Q, D[:, None])[:, 0]
    with maxsim.backend("triton"), torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(maxsim.maxsim(Q, D), cross)
            torch.testing.assert_close(maxsim.maxsim_pairs(Q, D), pairs)
            torch.testing.assert_close(maxsim.maxsim(Q[0], D), cross[0])
            torch.testing.assert_close(maxsim.maxsim(Q, D[1]), cross[:, 1])
    # training: the forward saves the caller's tensors and the backward plans from their views too
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    calls = {
        "cross": (maxsim.maxsim, reference.maxsim, (Qg, Dg)),
        "pairs": (maxsim.maxsim_pairs, reference.maxsim_pairs, (Qg, Dg)),
        "2-D Q": (maxsim.maxsim, reference.maxsim, (Qg[1], Dg)),
        "2-D D": (maxsim.maxsim, reference.maxsim, (Qg, Dg[2])),
    }
    with maxsim.backend("triton"):
        for _ in range(2):
            for name, (ours, ref, args) in calls.items():
                g = randn(ref(*args).shape, seed=3, device=device)
                got = torch.autograd.grad(ours(*args), (Qg, Dg), g)
                want = torch.autograd.grad(ref(*args), (Qg, Dg), g)
                for a, b in zip(got, want, strict=True):
                    torch.testing.assert_close(a, b, msg=name)


def test_fp32_runs_on_the_tensor_cores_at_fp32_accuracy(monkeypatch):
    """fp32 similarities are ``tf32x3`` products (fp32 accuracy on the tensor cores; the GPU tests check ~1e-5)
    unless torch's matmul precision allows TF32; 16-bit inputs are exact products either way. The fp32 table keeps
    blocks of at most 64 rows and one program per document (the split operands' shared memory: see configs)."""
    from maxsim.kernels import launch_args
    from maxsim.kernels.configs import forward_config

    monkeypatch.setattr(launch_args, "INTERPRETER", False)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert launch_args.dot_precision(torch.float32) == "tf32x3"
        torch.set_float32_matmul_precision("high")
        assert launch_args.dot_precision(torch.float32) == "tf32"
        assert launch_args.dot_precision(torch.bfloat16) == launch_args.dot_precision(torch.float16) == "ieee"
    finally:
        torch.set_float32_matmul_precision(before)
    for lq in (1, 8, 32, 33, 64, 65, 1024):
        for dim in (48, 128, 256):
            for nq, shared in ((1, True), (256, True), (64, False)):
                cfg = forward_config(lq, dim, nq, shared, True)
                assert cfg.BQ * cfg.TQ <= 64 and cfg.persist == 0 and cfg.maxnreg == 0, (lq, dim, nq, shared, cfg)
                assert min(64, lq) <= cfg.TQ, "a query longer than its block is split over programs"


def test_compiles_ask_for_fused_multiply_adds(fake_gpu):
    """Every compile asks for FMA contraction (Triton 3.10 turns it off unless asked): the kernels' speed and their
    rounding from one variant to another were measured with it."""
    k = FakeKernel()
    lc = launcher.Launcher(k)
    lc(3, (torch.zeros(16),), (7,), {"BLOCK": 32}, 4, maxnreg=96)
    ((kind, _grid, _args, kwargs),) = k.log
    assert kind == "triton" and kwargs["enable_fp_fusion"] is True and kwargs["maxnreg"] == 96


@pytest.mark.parametrize("need_argmax", [False, True])
@pytest.mark.parametrize(
    "lq, nd, ld, normalize",
    [(6, 5, 7, False), (300, 3, 40, True), (8, 1, 256, False), (8, 1, 256, True)],
    ids=["small", "split rows, normalized", "document chunks", "document chunks, normalized"],
)
def test_dense_forward_reads_each_slots_own_pointer(monkeypatch, need_argmax, lq, nd, ld, normalize):
    """A dense forward reads its distinct tensors' pointers once and fills the kernel's thirteen slots from them:
    every slot gets its own tensor's pointer, whichever of the split rows' buffer, the chunks' row buffer, the
    argmax and the pre-pass's norms the plan has (the fold's launch too)."""
    from maxsim.kernels import launch_args, launch_forward

    seen: list = []

    def record(self, grid, tensors, ints, constexprs, num_warps, num_stages=3, plan_cache=None, maxnreg=0,
               foreign=None, pointers=None):  # fmt: skip
        seen.append(self.kernel.__name__)
        check_pointers(tensors, pointers)

    monkeypatch.setattr(launcher.Launcher, "__call__", record)
    monkeypatch.setattr(launch_args, "INTERPRETER", False)
    if ld == 256:  # (the interpreter's one multiprocessor never asks for chunks)
        monkeypatch.setattr(launch_forward, "document_chunks", lambda *args: (2, 128))
    # (chunked documents: each query's own, whose norms a normalized forward computes in a pre-pass)
    Q, D = torch.randn(2, lq, 16), torch.randn(2 if ld == 256 else 1, nd, ld, 16)
    launch_forward.plans.clear()
    for _ in range(2):  # planning, then planned
        launch_forward.forward_keeping_norms(Q, D, None, None, normalize, need_argmax)
    (plan,) = launch_forward.plans.values()
    launch_forward.plans.clear()
    assert seen.count("maxsim_fwd_kernel") == 2
    # (each case reaches the slots it is named for)
    assert (plan.n_rsplit > 1, plan.n_dsplit > 1) == (lq == 300, ld == 256)
    assert plan.norms_given == normalize
    # (a repeat launches leanly only where the launch is the forward's only one and its slots the call's tensors)
    assert (plan.lean is not None) == (plan.n_rsplit == plan.n_dsplit == 1 and not normalize)


def _hooked_call(monkeypatch, call) -> None:
    """``call()`` while a launch hook is installed (a non-empty ``HookChain``, as newer Triton holds)."""
    from triton import knobs

    class Chain:
        calls = [print]

    with monkeypatch.context() as m:
        m.setattr(knobs.runtime, "launch_enter_hook", Chain(), raising=False)
        call()


def _call_on_another_device(monkeypatch, call) -> None:
    """``call()`` while device 0 is current (the fakes' tensors are on device -1)."""
    with monkeypatch.context() as m:
        m.setattr(launcher, "current_device", lambda: 0)
        call()


def _fake_kernel(monkeypatch, log: list, which=None) -> None:
    """A launcher of the library (``which``; the forward's by default) over a fake kernel, as on a GPU whose kernels
    never run: Triton's path appends ``("triton", grid, args, kwargs)`` and hands back a compiled kernel
    whose ``run`` appends ``("direct", args)``; CPU tensors take the Triton path and plan as on a GPU (the
    interpreter's check off), on device -1 (their ``get_device()``)."""
    import inspect
    import sys
    from collections import OrderedDict

    from triton import knobs

    from maxsim.kernels import launch_args, launch_forward

    backend = sys.modules["maxsim.backend"]  # (the module: ``maxsim.backend`` is also the context manager)
    which = launch_forward._fwd if which is None else which
    real = which.kernel
    params = list(inspect.signature(getattr(real, "fn", real)).parameters.values())
    names = [p.name for p in params if "constexpr" in str(p.annotation)]  # (an interpreted kernel has no list)

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            log.append(("direct", args))

    class Kernel:
        arg_names = [p.name for p in params]

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                log.append(("triton", grid, args, kwargs))
                return Compiled()

            return launch

    monkeypatch.setattr(which, "kernel", Kernel())
    monkeypatch.setattr(which, "_names", names)
    monkeypatch.setattr(which, "_known", OrderedDict())
    monkeypatch.setattr(which, "_runtime_knobs", knobs.runtime)
    monkeypatch.setattr(launch_forward, "plans", {})
    monkeypatch.setattr(launcher, "INTERPRETER", False)
    monkeypatch.setattr(launch_args, "INTERPRETER", False)
    monkeypatch.setattr(backend, "_INTERPRETER", True)  # (the Triton path for CPU tensors, asked for)
    monkeypatch.setattr(launcher, "current_device", lambda: -1)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


@pytest.mark.parametrize(
    "q_shape, d_shape, how, masks",
    [
        ((3, 5, 16), (4, 7, 16), "scores", ""),
        ((3, 5, 16), (3, 2, 7, 16), "scores", ""),
        ((5, 16), (4, 7, 16), "scores", ""),
        ((3, 5, 16), (7, 16), "scores", ""),
        ((3, 5, 16), (4, 7, 16), "normalized", ""),
        ((3, 5, 16), (4, 7, 16), "scores", "d"),
        ((3, 5, 16), (3, 2, 7, 16), "scores", "qd"),
        ((3, 5, 16), (4, 7, 16), "step", ""),
        ((3, 5, 16), (3, 2, 7, 16), "step", "qd"),
    ],
    ids=[
        "cross", "candidates", "2-D query", "2-D document", "normalized", "document mask", "both masks", "step",
        "step, masks",
    ],
)  # fmt: skip
def test_a_repeated_dense_call_launches_leanly_as_the_full_path(monkeypatch, q_shape, d_shape, how, masks):
    """A repeated dense call (``launch_forward.run_lean``) calls the compiled kernel with the arguments that the full
    path's planned launch passes, slot for slot (each call's own fresh scores, and a step's argmax, where that
    passes its own), and returns them in the caller's shape; an installed launch hook, another current device and
    tensors of another alignment take the full path again (the last once: Triton's own path for its variant).
    (Normalized scores and a training step's forward: the launch functions themselves, as a GPU call repeats them;
    a CPU call with ``normalize`` never repeats, and a step's backward would run the real kernels here.)"""
    from helpers import spy

    import maxsim
    from maxsim.kernels import launch, launch_forward

    log: list = []
    _fake_kernel(monkeypatch, log)
    full = spy(monkeypatch, launch_forward, "run_forward")
    Q, D = torch.randn(q_shape), torch.randn(d_shape)
    qm = torch.rand(q_shape[:-1]) > 0.3 if "q" in masks else None
    dm = torch.rand(d_shape[:-1]) > 0.3 if "d" in masks else None
    want = maxsim.maxsim(Q.double(), D.double()).shape  # (the PyTorch path's, in the caller's shape)
    first = [True]
    argmaxes = []

    def call(Q=Q):
        with torch.no_grad():
            if how == "scores":
                with maxsim.backend("triton"):
                    return maxsim.maxsim(Q, D, qm, dm)
            Dc = D[None] if D.dim() == 3 else D  # (the canonical layout: shared documents, or candidates)
            step = how == "step"
            if first.pop() if first else False:
                scores, argmax, _ = launch_forward.forward_keeping_norms(Q, Dc, qm, dm, not step, step)
                if step:
                    launch.keep_step("step", Q, Dc, False, False, None, qm, dm)
                else:
                    launch_forward.keep_repeat("repeat", Q, Dc, True, None)
            elif step:
                scores, argmax, _ = launch.step_forward(launch.step_plan("step"), Q, Dc, qm, dm)
            else:
                scores, argmax = launch_forward.run_repeat("repeat", Q, Dc), None
            assert (argmax is not None) == step
            argmaxes.append(argmax)
            return scores

    outs = [call() for _ in range(4)]
    forward_plans = [p.forward if isinstance(p, launch.StepPlan) else p for p in launch_forward.plans.values()]
    (plan,) = {id(p): p for p in forward_plans}.values()
    assert plan.lean is not None
    assert [e[0] for e in log] == ["triton", "direct", "direct", "direct"]
    assert len(full) == 2  # (the first call, and the first repeat, which files the lean entry)
    assert len(plan.lean) == 1

    def marked(args, scores, Q=Q):
        assert args.count(scores.data_ptr()) > 0
        names = {scores.data_ptr(): "scores", Q.data_ptr(): "Q"}
        names.update({m.data_ptr(): name for m, name in ((qm, "q_mask"), (dm, "d_mask")) if m is not None})
        if how == "step":
            (argmax,) = [a for a in argmaxes if a is not None and a.data_ptr() in args]
            assert argmax.shape == (*scores.shape, Q.shape[-2]) and argmax.dtype == plan.argmax_dtype
            names[argmax.data_ptr()] = "argmax"
        return [names.get(a, a) if type(a) is int else a for a in args]

    general = marked(log[1][1], outs[1])
    assert [general.count(m) for m in ("q_mask", "d_mask")] == [int("q" in masks), int("d" in masks)]
    assert marked(log[2][1], outs[2]) == marked(log[3][1], outs[3]) == general
    assert [(o.shape, o.dtype) for o in outs] == [(want, torch.float32)] * 4
    assert len({o.data_ptr() for o in outs}) == 4  # (fresh scores every call)

    _hooked_call(monkeypatch, call)
    assert log[-1][0] == "triton" and len(full) == 3
    _call_on_another_device(monkeypatch, call)
    assert len(full) == 4
    Q_off = torch.randn(Q.numel() + 1)[1:].view(Q.shape)  # (4-byte aligned: another variant of the kernel)
    out = [call(Q_off) for _ in range(3)]
    # (its first call files its variant's entry: the next ones are lean)
    assert [e[0] for e in log[-3:]] == ["triton", "direct", "direct"] and len(full) == 5
    assert marked(log[-1][1], out[-1], Q_off) == general


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("atomics", [False, True], ids=["owner", "atomics"])
def test_a_repeated_plain_backward_launches_leanly_as_the_launcher(monkeypatch, atomics, dtype):
    """A repeated plain backward (``launch_backward._run_plain``) calls the compiled kernel itself with the arguments
    the launcher passes it for the same plan, slot for slot (each call's own fresh dQ); an installed launch hook and
    another current device take the launcher again, and tensors of another alignment Triton's own path once (the
    kernel's variant for them), then the direct call."""
    from maxsim.kernels import launch_backward, launch_settings

    log: list = []
    _fake_kernel(monkeypatch, log, launch_backward._bwd)
    if atomics:
        monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
        monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(launch_backward, "plans", {})
    via_launcher: list = []
    real_call = launcher.Launcher.__call__

    def counted(self, *args, **kwargs):
        via_launcher.append(self.kernel)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(launcher.Launcher, "__call__", counted)
    Q, D = torch.randn(4, 6, 16, dtype=dtype), torch.randn(1, 5, 7, 16, dtype=dtype)
    g, argmax = torch.randn(4, 5), torch.zeros(4, 5, 6, dtype=torch.int32)

    def call(Q=Q):
        return launch_backward.backward(g, Q, D, argmax, False, False)

    outs = [call(), call()]
    (plan,) = launch_backward.plans.values()
    assert plan.plain and plan.dd_owned != atomics and len(plan.lean) == 1
    plan.lean.clear()  # (the next call goes through the launcher's own direct call, and files the entry again)
    outs += [call(), call()]
    assert [e[0] for e in log] == ["triton", "direct", "direct", "direct"]
    assert len(via_launcher) == 2 and len(plan.lean) == 1

    def roles(args, dQ):
        names = {g.data_ptr(): "grad", argmax.data_ptr(): "argmax", Q.data_ptr(): "Q", D.data_ptr(): "D"}
        names[dQ.data_ptr()] = "dQ"
        return [*args[:9], [names.get(p, "fresh") for p in args[9:27]], *args[27:]]

    launched = roles(log[2][1], outs[2][0])
    assert launched[9].count("dQ") == 1 and launched[9].count("fresh") == (2 if plan.cast_counters else 1)
    assert roles(log[1][1], outs[1][0]) == launched == roles(log[3][1], outs[3][0])
    assert len({o[0].data_ptr() for o in outs}) == 4  # (a fresh dQ every call)

    _hooked_call(monkeypatch, call)
    assert log[-1][0] == "triton" and len(via_launcher) == 3
    _call_on_another_device(monkeypatch, call)
    assert log[-1][0] == "direct" and len(via_launcher) == 4
    Q_off = torch.randn(Q.numel() + 8, dtype=dtype)[1:-7].view(Q.shape)  # (misaligned: another variant)
    out = [call(Q_off) for _ in range(3)]
    assert [e[0] for e in log[-3:]] == ["triton", "direct", "direct"] and len(via_launcher) == 5
    assert len(plan.lean) == 2
    assert roles(log[-1][1], out[-1][0])[9] == ["fresh" if n == "Q" else n for n in launched[9]]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("layout", ["varlen", "pairs", "pairs, CSR", "padded"])
def test_ragged_launches_read_each_slots_own_pointer(monkeypatch, layout, normalize):
    """A mask-free ragged forward and its backward read each distinct tensor's pointer once (offsets or lengths,
    pair ids, the pair list's CSR orders) and fill every slot from them: each slot gets its own tensor's pointer,
    on a first (planning) and a planned call of each direction. ("CSR": the backward walks the pairs by query and by
    document through CSR indexes, as longer pair lists do, instead of scanning the list.)"""
    from maxsim.kernels import launch_args, launch_backward, launch_forward, launch_settings
    from maxsim.layout import Ragged, Views

    if layout == "pairs, CSR":
        monkeypatch.setattr(launch_settings, "PAIR_SCAN_MAX_WORK", 0)

    seen: list = []

    def record(self, grid, tensors, ints, constexprs, num_warps, num_stages=3, plan_cache=None, maxnreg=0,
               foreign=None, pointers=None):  # fmt: skip
        seen.append((self.kernel.__name__, pointers is not None))
        check_pointers(tensors, pointers)

    monkeypatch.setattr(launcher.Launcher, "__call__", record)
    monkeypatch.setattr(launch_args, "INTERPRETER", False)
    monkeypatch.setattr(launch_forward, "plans", {})
    monkeypatch.setattr(launch_backward, "plans", {})
    views = None
    if layout == "padded":
        Q, D = torch.randn(3, 6, 16), torch.randn(3, 4, 10, 16)
        rg = Ragged(torch.tensor([6, 2, 0]), torch.tensor([[10, 3, 0, 7]] * 3), None, None, 6, 10)
    else:
        Q, D = torch.randn(12, 16), torch.randn(20, 16)
        cu_q, cu_d = torch.tensor([0, 5, 8, 12]), torch.tensor([0, 7, 7, 16, 20], dtype=torch.int32)
        listed = layout.startswith("pairs")
        pairs = (torch.tensor([0, 2, 2, 1]), torch.tensor([3, 0, 3, 1])) if listed else (None, None)
        rg = Ragged(cu_q, cu_d, *pairs, 5, 9)
        views = Views((), (), (4,)) if listed else None
    for _ in range(2):  # planning, then planned
        scores, argmax, norms = launch_forward.forward_keeping_norms(Q, D, None, None, normalize, True, rg, views=views)
        argmax.zero_()  # (the fake launches write nothing)
        launch_backward.backward(torch.ones_like(scores), Q, D, argmax, normalize, True, rg, norms, views)
    if layout == "pairs, CSR":
        (plan,) = launch_backward.plans.values()
        assert plan.q_csr and plan.d_csr
    assert ("maxsim_fwd_kernel", True) in seen
    main = [p for name, p in seen if name.startswith("maxsim_bwd") and "scatter" not in name]
    assert main and all(main), seen


def _plain_cases():
    """(name, Q, D, views, upstream gradient, launch settings) of backward plans that are plain
    (``BackwardPlan.plain``): the owner's and the atomics', squeezed views, a strided gradient, every dtype."""
    from maxsim.layout import Views

    Q, D = torch.randn(4, 6, 16), torch.randn(1, 5, 7, 16)
    atomics = {"SHARED_OWNER_MAX_ROWS": 0, "SHARED_OWNER_MAX_WORK": 0}
    return [
        ("cross, owner", Q, D, None, torch.randn(4, 5), {}),
        ("cross, atomics", Q, D, None, torch.randn(4, 5), atomics),
        ("cross, atomics, bf16", Q.bfloat16(), D.bfloat16(), None, torch.randn(4, 5), atomics),
        ("cross, owner, fp16", Q.half(), D.half(), None, torch.randn(4, 5), {}),
        ("one query", Q[1], D, Views((0,), (), (5,)), torch.randn(5), {}),
        ("candidates", Q, torch.randn(4, 3, 7, 16), None, torch.randn(4, 3), {}),
        ("strided gradient", Q, D, None, torch.randn(4, 10)[:, ::2], {}),
        ("pairs", Q, torch.randn(4, 1, 7, 16), None, torch.randn(4, 1), {}),
    ]


@pytest.mark.parametrize("case", _plain_cases(), ids=[c[0] for c in _plain_cases()])
@pytest.mark.parametrize("mode", ["fast", "deterministic"])
def test_a_plain_backward_plan_launches_as_the_general_path(monkeypatch, case, mode):
    """``run_backward``'s short path (``BackwardPlan.plain``) makes the launch the general path makes for the same
    plan: the same kernel, grid, integers, constexprs, options and plan cache, the same tensor in every slot (the
    caller's where the general path passes the caller's, a fresh allocation of the same shape and dtype where it
    allocates), the same foreign tensors and each slot's own pointer; its results the same shapes and dtypes."""
    from maxsim.kernels import launch_args, launch_backward, launch_forward, launch_settings
    from maxsim.layout import view_as_canonical

    name, Q, D, views, grad, settings = case
    for key, value in settings.items():
        monkeypatch.setattr(launch_settings, key, value)
    launches: list = []

    def record(self, grid, tensors, ints, constexprs, num_warps, num_stages=3, plan_cache=None, maxnreg=0,
               foreign=None, pointers=None):  # fmt: skip
        check_pointers(tensors, pointers)
        launches.append((self.kernel.__name__, grid, tensors, ints, dict(constexprs), num_warps, num_stages,
                         plan_cache, maxnreg, foreign, tensors[7].clone()))  # fmt: skip

    monkeypatch.setattr(launcher.Launcher, "__call__", record)
    monkeypatch.setattr(launch_args, "INTERPRETER", False)
    monkeypatch.setattr(launch_forward, "plans", {})
    monkeypatch.setattr(launch_backward, "plans", {})
    Qc, Dc = (Q, D) if views is None else (view_as_canonical(Q, views.q), view_as_canonical(D, views.d))
    _scores, argmax, _norms = launch_forward.forward_keeping_norms(Q, D, None, None, False, True, views=views)
    g = grad.float()
    deterministic = mode == "deterministic"
    results = []
    for plain in (True, False):
        launches.clear()
        if not plain:  # (the same plan, through the general path)
            (key,) = launch_backward.plans
            launch_backward.plans[key] = launch_backward.plans[key]._replace(plain=False)
        results.append(launch_backward.backward(g, Q, D, argmax, False, deterministic, views=views))
        if plain:
            (plan,) = launch_backward.plans.values()
            assert plan.plain, name
            assert plan.dd_owned == (deterministic or not settings), name
        results.append(list(launches))

    def roles(tensors, fresh):
        known = {id(g): "grad", id(argmax): "argmax", id(Q): "Q", id(D): "D", id(Qc): "Q", id(Dc): "D"}
        out = []
        for t in tensors:
            if id(t) in known:
                out.append(known[id(t)])
            else:
                fresh.append(t)
                out.append(("fresh", tuple(t.shape), t.dtype, t.stride()))
        return out

    short, general = results[1], results[3]
    assert [x[0] for x in short] == [x[0] for x in general] == ["maxsim_bwd_kernel"]
    for a, b in zip(short, general, strict=True):
        fresh_a, fresh_b = [], []
        assert roles(a[2], fresh_a) == roles(b[2], fresh_b)
        assert a[1] == b[1] and a[3:7] == b[3:7] and a[8] == b[8]
        assert a[7] is b[7] is not None  # (the plan's launch cache)
        assert roles(a[9], []) == roles(b[9], []) == ["grad", "argmax", "Q", "D"]
        assert len(fresh_a) == (3 if plan.cast_counters else 2)  # (dQ and dD's buffer; dD too where cast in it)
        if not plan.dd_owned:  # (the atomics add into it: zeroed before the launch)
            assert not a[10].any() and not b[10].any()
    for out, launch in ((results[0], short[0]), (results[2], general[0])):  # (what comes back is what was written,
        # or its cast: dD in the launch's own slot where it casts the buffer, FUSED_CAST)
        written = launch[2][6], launch[2][8 if plan.cast_counters else 7]
        assert [x is t for x, t in zip(out, written, strict=True)] == [
            t.dtype == want.dtype for t, want in zip(written, (Q, D), strict=True)
        ]
        if plan.cast_counters:
            assert launch[2][7].shape == (D.numel() + plan.cast_counters,) and launch[4]["FUSED_CAST"]
    for x, y in zip(results[0], results[2], strict=True):
        assert (x.shape, x.dtype, x.stride()) == (y.shape, y.dtype, y.stride())


def test_only_dense_raw_single_launch_backward_plans_are_plain(monkeypatch):
    """A normalized step, one whose upstream gradient is copied first, a ragged one and a split dQ walk keep the
    general path."""
    from maxsim.kernels import launch_args, launch_backward, launch_forward, launch_settings
    from maxsim.layout import Ragged

    monkeypatch.setattr(launcher.Launcher, "__call__", lambda self, *a, **k: None)
    monkeypatch.setattr(launch_args, "INTERPRETER", False)
    monkeypatch.setattr(launch_forward, "plans", {})
    monkeypatch.setattr(launch_backward, "plans", {})
    Q, D = torch.randn(4, 6, 16), torch.randn(1, 5, 7, 16)
    g = torch.randn(4, 5)

    def plan_of(Q, D, normalize=False, rg=None, grad=g):
        launch_backward.plans.clear()
        _s, argmax, norms = launch_forward.forward_keeping_norms(Q, D, None, None, normalize, True, rg)
        launch_backward.backward(grad, Q, D, argmax, normalize, False, rg, norms)
        (plan,) = launch_backward.plans.values()
        return plan

    assert plan_of(Q, D).plain
    assert not plan_of(Q, D, normalize=True).plain
    assert not plan_of(Q, D, grad=torch.randn(5, 4).t()).plain  # (made contiguous first)
    rg = Ragged(torch.tensor([6, 2, 5, 1]), torch.tensor([[7, 3, 0, 5, 1]]), None, None, 6, 7)
    assert not plan_of(Q, D, rg=rg).plain
    monkeypatch.setattr(launch_settings, "DQ_SPLIT_MIN_K", 1)
    monkeypatch.setattr(launch_settings, "DQ_SPLIT_MIN_PAIRS", 1)
    monkeypatch.setattr(launch_settings, "DQ_SPLIT_PROGRAMS_PER_SM", 1 << 10)
    split = plan_of(Q, torch.randn(1, 64, 7, 16), grad=torch.randn(4, 64))
    assert split.dq_splits > 1 and not split.plain
