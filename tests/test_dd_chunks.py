"""The fast backward of a large cross product sums dD a chunk of documents at a time (launch.py's
SCATTER_BUFFER_MAX_BYTES and SCATTER_CHUNK_*), in an fp32 buffer of one chunk's size, then casts each chunk into dD
(dd_chunks.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import check_parity, make_inputs, seed_of, triton_usable

import maxsim


@pytest.mark.parametrize("fused", [1, 0], ids=["first-chunk-in-gather-launch", "own-launches"])
@pytest.mark.parametrize("chunk_docs", [1, 2, 3])
def test_chunked_atomics_match_the_reference(chunk_docs, fused, device, monkeypatch):
    """Chunks that do not divide the documents (7 of them), masks with holes, many query tokens on few document
    tokens (contended atomics): the reference's gradients, and the plan says it chunked."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    from maxsim.kernels import launch

    monkeypatch.setattr(launch, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(launch, "SHARED_OWNER_MAX_ROWS", 0)
    monkeypatch.setattr(launch, "FUSED_SCATTER", fused)
    inp = make_inputs("cross", 4, 7, 9, 6, 32, dtype=torch.bfloat16, device=device, masks="holes",
                      seed=seed_of("chunks"))  # fmt: skip
    monkeypatch.setattr(launch, "SCATTER_BUFFER_MAX_BYTES", 0)
    monkeypatch.setattr(launch, "SCATTER_CHUNK_BYTES", chunk_docs * 6 * 32 * 4)
    monkeypatch.setattr(launch, "SCATTER_CHUNK_MIN_LINKS", 0)
    launch._bplans.clear()
    with maxsim.backend("triton"):
        check_parity(inp, backward="fast", seed=3)
    plan = next(iter(launch._bplans.values()))
    launch._bplans.clear()
    # (1: chunks of 2, 1, 1, 1 documents in dD, then 1, 1 in a buffer; 2: 2 in dD, then 2, 2, 1; 3: 3, 3, 1)
    assert (plan.dd_chunks, plan.fused_sc) == (launch._dd_chunks(7, chunk_docs)[0], bool(fused))


def test_no_chunks_for_a_buffer_under_the_cap(device, monkeypatch):
    """A buffer within the cap, an fp32 D (no buffer: the atomics add into dD) and normalize (whose projection reads
    the whole buffer) are not chunked."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    from maxsim.kernels import launch

    monkeypatch.setattr(launch, "SHARED_OWNER_MAX_WORK", 0)
    monkeypatch.setattr(launch, "SHARED_OWNER_MAX_ROWS", 0)
    monkeypatch.setattr(launch, "SCATTER_BUFFER_MAX_BYTES", 2 * 6 * 32 * 4)
    monkeypatch.setattr(launch, "SCATTER_CHUNK_BYTES", 2 * 6 * 32 * 4)
    monkeypatch.setattr(launch, "SCATTER_CHUNK_MIN_LINKS", 0)
    cases = [(torch.bfloat16, False, 2), (torch.float32, False, 0), (torch.bfloat16, True, 0)]  # (chunks)
    for dtype, normalize, want in cases:
        inp = make_inputs("cross", 2, 3, 5, 6, 32, dtype=dtype, device=device, seed=seed_of("chunks", dtype))
        launch._bplans.clear()
        with maxsim.backend("triton"):
            check_parity(inp, normalize=normalize, backward="fast", seed=4)
        assert len(next(iter(launch._bplans.values())).dd_chunks) == want, (dtype, normalize)
    inp = make_inputs("cross", 2, 3, 5, 6, 32, dtype=torch.bfloat16, device=device)
    # all 3 documents within the cap; or chunks that would hold fewer links than SCATTER_CHUNK_MIN_LINKS, grown
    # to the 3 documents (2 queries x 5 tokens each): one launch
    for cap, min_links in ((3 * 6 * 32 * 4, 0), (0, 2 * 5 * 3)):
        monkeypatch.setattr(launch, "SCATTER_BUFFER_MAX_BYTES", cap)
        monkeypatch.setattr(launch, "SCATTER_CHUNK_MIN_LINKS", min_links)
        launch._bplans.clear()
        with maxsim.backend("triton"):
            check_parity(inp, backward="fast")
        assert next(iter(launch._bplans.values())).dd_chunks == (), (cap, min_links)
    launch._bplans.clear()


@pytest.mark.parametrize("K", [2, 3, 7, 64, 256, 1000])
@pytest.mark.parametrize("docs", [1, 2, 20, 500])
def test_chunk_plan_covers_every_document_once_and_fits_its_buffers(K, docs):
    """The chunks cover the documents once each; an in-dD chunk's fp32 buffer (the front of dD's storage, 4 bytes
    per element) overlaps neither its own rows nor any already summed (those behind it), and the own buffer holds
    every other chunk."""
    from maxsim.kernels import launch

    chunks, tail = launch._dd_chunks(K, docs)
    covered = sorted(d for k0, n, _ in chunks for d in range(k0, k0 + n))
    assert covered == list(range(K))
    done = K
    for k0, n, in_dd in chunks:
        assert n >= 1
        if in_dd:
            assert k0 + n == done and 4 * n <= 2 * k0 and n >= docs  # (bytes per row element: fp32 vs 16-bit)
            done = k0
        else:
            assert n <= tail <= docs
    assert tail == (min(docs, done) if done else 0)
