"""The fast backward of a large cross product sums dD a chunk of documents at a time (launch_settings.py's
SCATTER_BUFFER_MAX_BYTES and SCATTER_CHUNK_*), in an fp32 buffer of one chunk's size, then casts each chunk into dD
(dd_chunks.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import (
    assert_matches_reference,
    check_parity,
    generator,
    lib_forward_backward,
    make_inputs,
    ref_forward_backward,
    seed_of,
    triton_usable,
)

import maxsim
from maxsim.kernels.sizes import cdiv


@pytest.mark.parametrize("fused", [1, 0], ids=["first-chunk-in-gather-launch", "own-launches"])
@pytest.mark.parametrize("chunk_docs", [1, 2, 3])
def test_chunked_atomics_match_the_reference(chunk_docs, fused, device, monkeypatch):
    """Chunks that do not divide the documents (7 of them), masks with holes, many query tokens on few document
    tokens (contended atomics): the reference's gradients, and the plan says it chunked."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    from maxsim.kernels import dd_chunks, launch_backward, launch_settings

    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    monkeypatch.setattr(launch_settings, "FUSED_SCATTER", fused)
    inp = make_inputs("cross", 4, 7, 9, 6, 32, dtype=torch.bfloat16, device=device, masks="holes",
                      seed=seed_of("chunks"))  # fmt: skip
    monkeypatch.setattr(launch_settings, "SCATTER_BUFFER_MAX_BYTES", 0)
    monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_BYTES", chunk_docs * 6 * 32 * 4)
    monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_MIN_LINKS", 0)
    launch_backward.plans.clear()
    with maxsim.backend("triton"):
        check_parity(inp, backward="fast", seed=3)
    plan = next(iter(launch_backward.plans.values()))
    launch_backward.plans.clear()
    # (1: chunks of 2, 1, 1, 1, 1, 1 documents, in dD, own buffer, dD, then the own buffer three times; 2: 2, 2, 1,
    # 2 in dD and the own buffer in turn; 3: 2 in dD, then 3 and 2 in the own buffer)
    assert (plan.dd_chunks, plan.fused_sc) == (dd_chunks.chunk_plan(7, chunk_docs)[0], bool(fused))


@pytest.mark.parametrize(
    ("chunked", "normalize", "poison"), [(True, False, "nan"), (False, False, "inf"), (False, True, "nan")]
)
def test_atomics_ignore_poisoned_masked_tokens(chunked, normalize, poison, device, monkeypatch):
    """The atomics load a block's query rows once for several documents, before knowing which tokens chose
    anything: NaN / inf in masked query and document tokens must still reach neither the scores nor the gradients
    (chunked or not, with normalize), and masked tokens get a zero gradient."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    from maxsim.kernels import launch_backward, launch_settings

    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    if chunked:
        monkeypatch.setattr(launch_settings, "SCATTER_BUFFER_MAX_BYTES", 0)
        monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_BYTES", 6 * 32 * 4)
        monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_MIN_LINKS", 0)
    clean = make_inputs("cross", 3, 7, 9, 6, 32, dtype=torch.bfloat16, device=device, masks="holes",
                        seed=seed_of("poisoned atomics"))  # fmt: skip
    value = float("nan") if poison == "nan" else float("inf")
    Q, D = clean.Q.clone(), clean.D.clone()
    Q[~clean.q_mask] = value
    D[~clean.d_mask] = value
    launch_backward.plans.clear()
    with maxsim.backend("triton"):
        s, dQ, dD, grad = lib_forward_backward(clean.with_(Q=Q, D=D), normalize=normalize, backward="fast")
    plan = next(iter(launch_backward.plans.values()))
    launch_backward.plans.clear()
    assert not plan.dd_owned and bool(plan.dd_chunks) == chunked
    assert_matches_reference(clean, s, dQ, dD, grad, normalize=normalize)
    assert bool((dQ[~clean.q_mask] == 0).all()), "masked (poisoned) query tokens got a gradient"
    assert bool((dD[~clean.d_mask] == 0).all()), "masked (poisoned) document tokens got a gradient"


def test_no_chunks_for_a_buffer_under_the_cap(device, monkeypatch):
    """A buffer within the cap, an fp32 D (no buffer: the atomics add into dD) and normalize (whose projection reads
    the whole buffer) are not chunked."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    from maxsim.kernels import launch_backward, launch_settings

    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    monkeypatch.setattr(launch_settings, "SCATTER_BUFFER_MAX_BYTES", 2 * 6 * 32 * 4)
    monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_BYTES", 2 * 6 * 32 * 4)
    monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_MIN_LINKS", 0)
    cases = [(torch.bfloat16, False, 2), (torch.float32, False, 0), (torch.bfloat16, True, 0)]  # (chunks)
    for dtype, normalize, want in cases:
        inp = make_inputs("cross", 2, 3, 5, 6, 32, dtype=dtype, device=device, seed=seed_of("chunks", dtype))
        launch_backward.plans.clear()
        with maxsim.backend("triton"):
            check_parity(inp, normalize=normalize, backward="fast", seed=4)
        assert len(next(iter(launch_backward.plans.values())).dd_chunks) == want, (dtype, normalize)
    inp = make_inputs("cross", 2, 3, 5, 6, 32, dtype=torch.bfloat16, device=device)
    # all 3 documents within the cap; chunks that would hold fewer links than SCATTER_CHUNK_MIN_LINKS, grown to the
    # 3 documents (2 queries x 5 tokens each): one launch; grown to 2 documents, past both the cap and the chunk
    # size of 1 document: not chunked either (the own buffer would hold 2 of the 3)
    doc = 6 * 32 * 4
    for cap, chunk, min_links in ((3 * doc, 2 * doc, 0), (0, 2 * doc, 2 * 5 * 3), (doc, doc, 2 * 5 * 2)):
        monkeypatch.setattr(launch_settings, "SCATTER_BUFFER_MAX_BYTES", cap)
        monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_BYTES", chunk)
        monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_MIN_LINKS", min_links)
        launch_backward.plans.clear()
        with maxsim.backend("triton"):
            check_parity(inp, backward="fast")
        assert next(iter(launch_backward.plans.values())).dd_chunks == (), (cap, min_links)
    # (the same with a chunk size of 2 documents: chunked, the own buffer within it)
    monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_BYTES", 2 * doc)
    launch_backward.plans.clear()
    with maxsim.backend("triton"):
        check_parity(inp, backward="fast")
    assert len(next(iter(launch_backward.plans.values())).dd_chunks) == 2
    launch_backward.plans.clear()


@pytest.mark.parametrize("k", [1, 5, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_atomics_cast_their_groups_in_their_launch(k, dtype, device, monkeypatch):
    """FUSED_CAST: programs of the atomics' launch cast each group of documents' fp32 sums into dD once the group's
    atomics are done. On integer tokens and an integer upstream gradient every fp32 sum is exact in any order, so dD
    is the float64 reference's rounded once, bit for bit (a block cast before the last atomic into it lands
    differs); so is a cast launch's (FUSED_CAST off). Groups of 2 documents: odd and even document counts
    (the last group short), one document. On a GPU, at the bench's size (64 x 64 Lq23 Ld333 dim 96: 1472 query
    tokens' programs into each group), three times."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    from maxsim.kernels import launch_backward, launch_settings

    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    gpu = device != "cpu"
    nq, lq, ld, dim = (64, 23, 333, 96) if gpu else (3, 20, 6, 32)
    inp = make_inputs("cross", nq, 8 * k if gpu else k, lq, ld, dim, dtype=dtype, device=device, masks="holes",
                      exact=True, seed=seed_of("cast last", k))  # fmt: skip
    grad = torch.randint(-3, 4, (nq, inp.D.shape[-3]), generator=generator(seed_of("cast last grad", k)))
    grad = grad.float().to(device)
    _rs, rdQ, rdD = ref_forward_backward(inp, grad)
    results = []
    for fused_cast in (1, 0):
        monkeypatch.setattr(launch_settings, "FUSED_CAST_MAX_PROGRAMS", fused_cast << 15)
        for _ in range(3 if gpu and fused_cast else 1):
            launch_backward.plans.clear()
            with maxsim.backend("triton"):
                _s, dQ, dD, _g = lib_forward_backward(inp, backward="fast", grad=grad)
            (plan,) = launch_backward.plans.values()
            assert plan.cast_counters == (cdiv(inp.D.shape[-3], 2) if fused_cast else 0)
            assert not plan.dd_owned and plan.dd_sc is None and not plan.dd_chunks
            assert dD.dtype == dtype and torch.equal(dD, rdD.to(dtype)), "dD is not the exact sums rounded once"
            assert torch.equal(dQ, rdQ.to(dtype))
            results.append(dD)
    launch_backward.plans.clear()
    assert torch.equal(results[0], results[-1])


def test_atomics_cast_their_groups_only_where_a_cast_launch_would_follow(device, monkeypatch):
    """No FUSED_CAST where nothing is cast (fp32 tokens: the atomics add into dD), where normalize's projection reads
    the buffer, for packed documents (a group's rows come from offsets that may be invalid: a cast launch covers
    every row whatever they hold), for a chunked dD (whose chunks' casts are launches' programs already), beside a
    split dQ walk (whose fp32 slices would be alive with dD: a higher peak) and for atomics of more than
    FUSED_CAST_MAX_PROGRAMS programs."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    from maxsim.kernels import launch_backward, launch_settings

    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(launch_settings, "SHARED_OWNER_MAX_ROWS", 0)
    bf16 = torch.bfloat16

    def counters(dtype=bf16, normalize=False, packed=False) -> int:
        inp = make_inputs("cross", 2, 3, 5, 6, 32, dtype=dtype, device=device, seed=seed_of("cast last where"))
        launch_backward.plans.clear()
        with maxsim.backend("triton"):
            if packed:
                Q, D = inp.Q.reshape(-1, 32), inp.D.reshape(-1, 32).detach().requires_grad_()
                cu_q = torch.arange(0, 11, 5, dtype=torch.int32, device=device)
                cu_d = torch.arange(0, 19, 6, dtype=torch.int32, device=device)
                s = maxsim.maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=5, max_seqlen_d=6, backward="fast")
                torch.autograd.grad(s.sum(), D)
            else:
                check_parity(inp, normalize=normalize, backward="fast", seed=4)
        (plan,) = launch_backward.plans.values()
        launch_backward.plans.clear()
        assert (plan.dq_splits > 1) == split
        return plan.cast_counters

    split = False
    assert counters() == 2  # (2 groups of documents)
    assert counters(torch.float32) == counters(normalize=True) == counters(packed=True) == 0
    # (atomics of 2 queries x 1 token block x 2 groups: 4 programs)
    monkeypatch.setattr(launch_settings, "FUSED_CAST_MAX_PROGRAMS", 4)
    assert counters() == 2
    monkeypatch.setattr(launch_settings, "FUSED_CAST_MAX_PROGRAMS", 3)
    assert counters() == 0
    monkeypatch.setattr(launch_settings, "FUSED_CAST_MAX_PROGRAMS", 1 << 15)
    with monkeypatch.context() as m:  # (a split dQ walk: its slices would be alive beside dD)
        m.setattr(launch_settings, "DQ_SPLIT_MIN_K", 1)
        m.setattr(launch_settings, "DQ_SPLIT_MIN_PAIRS", 1)
        m.setattr(launch_settings, "DQ_SPLIT_PROGRAMS_PER_SM", 64)
        split = True
        assert counters() == 0
    split = False
    monkeypatch.setattr(launch_settings, "SCATTER_BUFFER_MAX_BYTES", 0)
    monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_BYTES", 6 * 32 * 4)
    monkeypatch.setattr(launch_settings, "SCATTER_CHUNK_MIN_LINKS", 0)
    assert counters() == 0


@pytest.mark.parametrize("K", [1, 2, 3, 4, 7, 64, 256, 1000])
@pytest.mark.parametrize("docs", [1, 2, 20, 500])
@pytest.mark.parametrize("fused_first", [True, False])
def test_chunk_plan_covers_every_document_once_and_its_launches_never_overlap(K, docs, fused_first):
    """The chunks cover the documents once each, from the end; the own buffer holds every chunk not in dD. Then the
    launches, replayed on byte ranges of dD's storage (in 16-bit rows) and the own buffer: every chunk adds into a
    buffer that is zero (fresh, or cleared by an earlier launch's cast) and that no cast of the same launch reads,
    clears or writes; an in-dD buffer never overlaps rows already written; every chunk is cast once, after its
    atomics, into rows that nothing else in that launch touches."""
    from maxsim.kernels import dd_chunks

    if K == 1:  # (a chunk plan needs docs < K)
        return
    chunks, tail = dd_chunks.chunk_plan(K, docs)
    covered = sorted(d for k0, n, _ in chunks for d in range(k0, k0 + n))
    assert covered == list(range(K))
    done = K
    for k0, n, in_dd in chunks:
        assert n >= 1 and k0 + n == done
        done = k0
        if in_dd:
            assert 2 * n <= k0  # (its fp32 buffer, twice its 16-bit rows, in front of its rows)
        else:
            assert n <= tail <= docs
    assert tail == max([n for _, n, in_dd in chunks if not in_dd], default=0)

    def span(c: int) -> tuple[str, int, int]:  # (storage, first row, rows) of chunk c's fp32 buffer
        return ("dD", 0, 2 * chunks[c][1]) if chunks[c][2] else ("own", 0, 2 * chunks[c][1])

    def overlap(a: tuple, b: tuple) -> bool:
        return a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]

    # (rows zeroed before the first launch: the first chunk's buffer in dD, or the own buffer, made zeroed)
    zero = {"dD": 2 * chunks[0][1] if chunks[0][2] else 0, "own": 2 * tail}
    written: list[tuple] = []
    added, cast = set(), []
    launches = [(0, None, 0)] if fused_first else []
    launches += list(dd_chunks.chunk_steps(chunks, fused_first))
    for scatter, c, clear in launches:
        touched = []
        if c is not None:
            assert c in added and c not in cast
            cast.append(c)
            src, rows = span(c), ("dD", chunks[c][0], chunks[c][1])
            assert not any(overlap(rows, w) for w in written)
            assert not overlap(src, rows) and clear <= chunks[c][1]
            touched += [src, rows]
            written.append(rows)
            zero[src[0]] = 2 * clear
        if scatter is not None:
            dst = span(scatter)
            assert zero[dst[0]] >= dst[2], (scatter, zero)  # (zeroed before, by a memset or a cast's clear)
            assert not any(overlap(dst, t) for t in touched)
            assert not any(overlap(dst, w) for w in written)
            added.add(scatter)
            zero[dst[0]] = 0
    assert sorted(cast) == list(range(len(chunks))) and cast[-1] == len(chunks) - 1


_CAST_CLEAR_TTGIR = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from maxsim.kernels import dd_chunks
src = ASTSource(
    fn=dd_chunks.cast_clear_kernel,
    signature={"BUF": "*fp32", "OUT": "*bf16", "n": "i32", "n_clear": "i32", "BLOCK": "constexpr"},
    constexprs={"BLOCK": dd_chunks.BLOCK},
    attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
)
options = {"num_warps": dd_chunks.NUM_WARPS}
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ttgir"])
"""


def _cast_clear_ttgir() -> str:
    """``dd_chunks.cast_clear_kernel`` compiled for sm_90 as a launch would (16-byte aligned pointers), up to TTGIR:
    no GPU needed, only Triton's NVIDIA backend. In a process of its own: under ``TRITON_INTERPRET=1`` (CI) this
    one's kernels are the interpreter's, which do not compile."""
    import triton

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _CAST_CLEAR_TTGIR], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_cast_clears_its_buffer_only_after_every_thread_read_it():
    """The cast reads each element of a chunk's fp32 buffer in one layout and clears it in another (the 16-bit store's
    8 elements a thread against the fp32 store's 4: Triton 3.6 and 3.9), so one warp clears what another reads: a
    CTA barrier must lie between the load and the clearing store, or both must share a layout. (Without the barrier
    an H200 under Triton 3.9 zeroed 487 of a 256 x 256 Ld300 step's dD elements.) Compiled for sm_90, no GPU."""
    ops = [line.strip() for line in _cast_clear_ttgir().splitlines() if "tt.load" in line or "tt.store" in line
           or "barrier" in line]  # fmt: skip
    loads = [i for i, op in enumerate(ops) if "tt.load" in op and "!tt.ptr<f32>" in op]
    clears = [i for i, op in enumerate(ops) if "tt.store" in op and "!tt.ptr<f32>" in op]
    assert len(loads) == 1 and len(clears) == 1, ops
    load, clear = ops[loads[0]], ops[clears[0]]

    def layout(op: str) -> str:  # (the first "#name>": the operands' encoding; "loc(#loc3)" ends otherwise)
        return re.findall(r"#(\w+)>", op)[0]

    between = ops[loads[0] + 1 : clears[0]]
    assert layout(load) == layout(clear) or any("barrier" in op for op in between), ops


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_the_cast_copies_every_element_before_clearing_it():
    """``cast_clear_kernel`` over 2^25 nonzero sums, all cleared: dD gets every sum rounded (none read after its
    clear), and the buffer is zero. Repeated, since a read overtaken by another warp's clear is a matter of timing."""
    from maxsim.kernels import dd_chunks
    from maxsim.kernels.launcher import Launcher

    n = 1 << 25
    g = torch.Generator(device="cuda").manual_seed(seed_of("cast-clear"))
    sums = torch.rand(n, device="cuda", generator=g) + 0.5
    want = sums.to(torch.bfloat16)
    cast = Launcher(dd_chunks.cast_clear_kernel)
    for _ in range(10):
        buf, out = sums.clone(), torch.empty(n, dtype=torch.bfloat16, device="cuda")
        cast(cdiv(n, dd_chunks.BLOCK), (buf, out), (n, n), dict(BLOCK=dd_chunks.BLOCK), dd_chunks.NUM_WARPS, 3)
        assert torch.equal(out, want) and not buf.any()
