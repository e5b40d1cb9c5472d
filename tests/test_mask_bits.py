"""A masked scan carries each tile's mask as the bits of one integer (forward.py's ``MASK_BITS``;
``launch_settings.STREAM_MASK_BITS`` in the stream, ``PIPE_MASK_BITS`` in the pipelined loops), not as one flag a
column: chosen where the rule says, and computing what the flags computed, bit for bit, on every loop (one program a
document, persistent walks, chunked documents, DOC_ROWS, the argmax of a training forward), with holes on the bits
where a word or a half ends, fully masked documents and NaN in masked tokens."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import INTERPRET, forward_launches, int_grid, kernels_on

from maxsim import maxsim, reference
from maxsim.kernels import configs, device_info, launch, launch_forward, launch_settings

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="Triton kernels: a GPU or TRITON_INTERPRET=1"
)

DTYPE = torch.bfloat16 if torch.cuda.is_available() and not INTERPRET else torch.float16


def _flags(monkeypatch, call) -> list[tuple[bool, bool, int]]:
    """``(STREAM_D, MASK_BITS, BLOCK_N)`` of every forward launch ``call`` makes (recorded, not run)."""
    return forward_launches(monkeypatch, call, lambda c, warps, stages: (c["STREAM_D"], c["MASK_BITS"], c["BLOCK_N"]))


RULE_CASES = {
    # name: (Q shape, D shape, masked, extra settings, expected (STREAM_D, MASK_BITS))
    "thin block, 64-token tiles": ((1, 32, 128), (6, 50, 128), True, {}, (True, True)),
    "64-row block, 32-token tiles": ((1, 48, 128), (6, 50, 128), True, {}, (True, True)),
    "narrow tokens": ((1, 32, 64), (6, 50, 64), True, {}, (True, True)),
    "candidates": ((2, 20, 96), (2, 3, 50, 96), True, {}, (True, True)),
    "no mask": ((1, 32, 128), (6, 50, 128), False, {}, (True, False)),
    "setting off": ((1, 32, 128), (6, 50, 128), True, {"STREAM_MASK_BITS": 0}, (True, False)),
    "pipelined, 64-row block": ((1, 64, 128), (6, 50, 128), True, {"STREAM_ONCE_READ": 0}, (False, 2)),
    "pipelined, shared by row blocks": ((8, 32, 128), (6, 50, 128), True, {}, (False, 2)),
    "pipelined, thin block": ((1, 32, 128), (6, 50, 128), True, {"STREAM_ONCE_READ": 0}, (False, 2)),
    "pipelined, thin block, setting": (
        (1, 32, 128), (6, 50, 128), True, {"STREAM_ONCE_READ": 0, "PIPE_MASK_BITS_MIN_ROWS": 33}, (False, 0),
    ),
    "pipelined, setting off": ((8, 32, 128), (6, 50, 128), True, {"PIPE_MASK_BITS": 0}, (False, 0)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RULE_CASES), ids=list(RULE_CASES))
def test_mask_bits_chosen_where_the_rule_says(case, device, monkeypatch, any_size):
    """A document mask in tiles of at most 64 tokens, streamed or pipelined; never without a mask."""
    q_shape, d_shape, masked, extra, expected = RULE_CASES[case]
    for name, value in extra.items():
        monkeypatch.setattr(launch_settings, name, value)
    Q = torch.randn(q_shape, dtype=DTYPE, device=device)
    D = torch.randn(d_shape, dtype=DTYPE, device=device)
    d_mask = torch.ones(d_shape[:-1], dtype=torch.bool, device=device) if masked else None
    kernels_on(device)
    seen = _flags(monkeypatch, lambda: maxsim(Q, D, d_mask=d_mask))
    assert [s[:2] for s in seen] == [expected]
    assert seen[0][2] <= 64 or not seen[0][1]


@pytest.mark.parametrize("min_rows", [0, 33])
@pytest.mark.parametrize("rows", [32, 64])
def test_mask_bits_of_a_training_forward_chosen_where_the_rule_says(rows, min_rows, device, monkeypatch, any_size):
    """The argmax's pipelined loop carries the next tile's flags (PIPE_MASK_BITS_ARGMAX) in blocks of
    PIPE_MASK_BITS_MIN_ROWS rows or more, the flags of its own tile in thinner ones."""
    monkeypatch.setattr(launch_settings, "PIPE_MASK_BITS_MIN_ROWS", min_rows)
    Q = torch.randn(8, rows, 128, dtype=DTYPE, device=device)
    D = torch.randn(6, 50, 128, dtype=DTYPE, device=device)
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool, device=device)
    kernels_on(device)
    seen = forward_launches(
        monkeypatch,
        lambda: launch.forward(Q, D, None, d_mask, False, True),
        lambda c, w, s: (c["SAVE_ARGMAX"], c["STREAM_D"], c["MASK_BITS"], c["BQ"] * c["TQ"]),
    )
    assert seen == [(True, False, 2 if seen[0][3] >= min_rows else 0, seen[0][3])]
    assert (seen[0][3] > 32) == (rows > 32)


CAP_CASES = {
    # name: (Q shape, D shape, masked, normalize, argmax, expected (PERSIST, DOC_ROWS, maxnreg))
    "thin persistent walk, argmax": ((8, 32, 128), (8, 6, 50, 128), True, False, True, (True, False, 96)),
    "thin persistent walk, no mask": ((8, 32, 128), (8, 6, 50, 128), False, False, True, (True, False, 0)),
    "thin, a document a program": ((8, 32, 128), (8, 1, 50, 128), True, False, True, (False, False, 0)),
    "64-row persistent walk": ((8, 64, 128), (8, 6, 50, 128), True, False, True, (True, False, 0)),
    "normalized DOC_ROWS, a document a program": ((1, 64, 128), (1, 50, 128), True, True, False, (False, True, 168)),
    "normalized DOC_ROWS unmasked": ((1, 64, 128), (1, 50, 128), False, True, False, (False, True, 168)),
    "normalized DOC_ROWS persistent walk": ((1, 64, 128), (6, 50, 128), True, True, False, (True, True, 0)),
    "normalized argmax, not DOC_ROWS": ((1, 64, 128), (1, 50, 128), True, True, True, (False, False, 0)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CAP_CASES), ids=list(CAP_CASES))
def test_register_caps_where_the_rule_says(case, device, monkeypatch, any_size):
    """PIPE_MASK_BITS_THIN_MAXNREG caps thin persistent walks that read their masks ahead, DOC_ROWS_SUMS_MAXNREG the
    DOC_ROWS programs that sum their tiles' squares one document each; nothing else is capped."""
    q_shape, d_shape, masked, normalize, argmax, expected = CAP_CASES[case]
    monkeypatch.setattr(launch_settings, "STREAM_ONCE_READ", 0)
    # (the rule under these settings, whatever their defaults)
    for name, value in (("PIPE_MASK_BITS_MIN_ROWS", 0), ("PIPE_MASK_BITS_THIN_MAXNREG", 96),
                        ("DOC_ROWS_SUMS_MAXNREG", 168)):  # fmt: skip
        monkeypatch.setattr(launch_settings, name, value)
    # (planned for one multiprocessor on any device, as under the interpreter: six documents make a persistent walk)
    monkeypatch.setattr(device_info, "sm_count", lambda device: 1)
    Q = torch.randn(q_shape, dtype=DTYPE, device=device)
    D = torch.randn(d_shape, dtype=DTYPE, device=device)
    d_mask = torch.ones(d_shape[:-1], dtype=torch.bool, device=device) if masked else None
    kernels_on(device)
    seen = forward_launches(
        monkeypatch,
        lambda: launch.forward(Q, D, None, d_mask, normalize, argmax),
        lambda c, w, s, maxnreg: (c["PERSIST"], c["DOC_ROWS"], maxnreg),
        maxnreg=True,
    )
    assert seen == [expected]


def test_mask_bits_not_for_128_token_tiles(device, monkeypatch, any_size):
    """A stream given the launch table's 128-token tiles (a caller's configuration) keeps the flags: the bits of
    a tile fit one int64."""
    Q = torch.randn(1, 12, 32, dtype=DTYPE, device="cpu")
    D = torch.randn(1, 4, 300, 32, dtype=DTYPE, device="cpu")
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool)
    cfg = dataclasses.replace(configs.forward_config(12, 32, 1, True), BLOCK_N=128)
    seen = _flags(monkeypatch, lambda: launch.forward(Q, D, None, d_mask, False, False, cfg=cfg))
    assert seen == [(True, False, 128)]


def _holes(d_shape, device) -> torch.Tensor:
    """A mask with holes on the bits where a 32-bit word and a 64-token tile end (tokens 0, 31, 32, 63, 64, 95),
    random holes elsewhere, one fully masked document and one whose only valid token is its last; the last
    document's last token is valid."""
    g = torch.Generator().manual_seed(11)
    mask = torch.rand(d_shape[:-1], generator=g) < 0.7
    ld = d_shape[-2]
    for t in (0, 31, 32, 63, 64, 95):
        if t < ld:
            mask[..., t] = (t // 31) % 2 == 1
    mask.view(-1, ld)[0] = False
    mask.view(-1, ld)[1] = False
    mask.view(-1, ld)[1, -1] = True
    mask.view(-1, ld)[-1, -1] = True  # (the last document holds a valid token: a NaN goes there)
    return mask.to(device)


EXACT_CASES = {
    # name: (Q shape, D shape, configuration: None (the launch table's) or "persistent")
    "64-row block, 32-token tiles": ((1, 40, 128), (1, 5, 100, 128), None),
    "thin block, 64-token tiles (DOC_ROWS)": ((1, 20, 128), (1, 5, 130, 128), None),
    "candidates, narrow tokens": ((3, 12, 48), (3, 3, 70, 48), None),
    "one-token documents": ((1, 9, 64), (1, 4, 1, 64), None),
    "persistent walk": ((1, 20, 128), (1, 9, 70, 128), "persistent"),
}


#: loop: (the settings that choose it, the setting that turns its bits on and off and its value for on, whether it
#: streams)
LOOPS = {
    "stream": ({}, "STREAM_MASK_BITS", 1, True),
    "pipelined, bits ahead": ({"STREAM_ONCE_READ": 0, "PIPE_MASK_BITS_MIN_ROWS": 0}, "PIPE_MASK_BITS", 1, False),
    "pipelined, flags ahead": ({"STREAM_ONCE_READ": 0, "PIPE_MASK_BITS_MIN_ROWS": 0}, "PIPE_MASK_BITS", 2, False),
}


def _poisoned(q_shape, d_shape, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer queries and documents (ties everywhere) with :func:`_holes`' mask, NaN and inf in masked tokens (never
    read) and a NaN in the last document's last valid token."""
    Q = int_grid(q_shape, seed=1, dtype=DTYPE, device=device)
    D = int_grid(d_shape, seed=2, dtype=DTYPE, device=device)
    d_mask = _holes(d_shape, device)
    D[0, 0, 0, 0] = float("nan")  # (the fully masked document)
    D[0, 2][~d_mask[0, 2]] = float("inf")
    valid = d_mask[-1, -1].nonzero()
    D[-1, -1, valid[-1, 0], 0] = float("nan")
    return Q, D, d_mask


def _with_and_without_bits(monkeypatch, setting: str, on: int, call) -> tuple[dict, dict]:
    """``call()`` with the launch setting ``setting`` at ``on`` and at 0 (plans cleared at each switch):
    ``({bits: its forward launches' (STREAM_D, MASK_BITS, PERSIST)}, {bits: its result})``."""
    launches, runs = {}, {}
    for bits in (on, 0):
        monkeypatch.setattr(launch_settings, setting, bits)
        launch_forward.plans.clear()
        launches[bits] = forward_launches(
            monkeypatch, call, lambda c, w, s: (c["STREAM_D"], c["MASK_BITS"], c["PERSIST"])
        )
        runs[bits] = call()
    launch_forward.plans.clear()
    return launches, runs


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("case", list(EXACT_CASES), ids=list(EXACT_CASES))
def test_mask_bits_match_the_flags(case, normalize, loop, device, monkeypatch, any_size):
    """The scan with its masks as bits gives the flags' scores bit for bit on :func:`_poisoned`'s inputs, and the
    float64 reference's."""
    q_shape, d_shape, how = EXACT_CASES[case]
    chooser, setting, on, streams = LOOPS[loop]
    if streams and normalize and q_shape[1] > 32 and q_shape[2] == 128:
        pytest.skip("masked, normalized 64-row blocks at 128 dims leave the stream (tests/test_doc_rows.py)")
    for name, value in chooser.items():
        monkeypatch.setattr(launch_settings, name, value)
    Q, D, d_mask = _poisoned(q_shape, d_shape, device)
    cfg = None
    if how == "persistent":  # (one multiprocessor: each program walks several documents)
        monkeypatch.setattr(device_info, "sm_count", lambda device: 1)
        cfg = dataclasses.replace(configs.forward_config(q_shape[1], q_shape[2], q_shape[0], True), persist=2)
    elif not streams:  # (the launch table's 128-token tiles for some: a tile's bits fit one int64)
        cfg = configs.forward_config(q_shape[1], q_shape[2], q_shape[0], d_shape[0] == 1)
        cfg = dataclasses.replace(cfg, BLOCK_N=min(cfg.BLOCK_N, 64))
    kernels_on(device)
    launches, runs = _with_and_without_bits(
        monkeypatch, setting, on, lambda: launch.forward(Q, D, None, d_mask, normalize, False, cfg=cfg)[0]
    )
    for bits, seen in launches.items():
        assert seen == [(streams, bits, seen[0][2])] and seen[0][2] >= (how == "persistent")
    torch.testing.assert_close(runs[on], runs[0], rtol=0, atol=0, equal_nan=True)
    ref = reference.maxsim(Q.double(), D.double(), d_mask=d_mask, normalize=normalize)
    torch.testing.assert_close(runs[on].double(), ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert runs[on][0, 0] == 0 and torch.isnan(runs[on][-1, -1])


@pytest.mark.parametrize("on", [1, 2], ids=["bits ahead", "flags ahead"])
@pytest.mark.parametrize("persistent", [False, True], ids=["one program a document", "persistent walk"])
def test_mask_bits_argmax_of_a_training_forward(persistent, on, device, monkeypatch, any_size):
    """The training forward's pipelined loop (with the argmax) with its masks as bits: the flags' scores and argmax
    bit for bit (ties: the first token), -1 for the rows of the fully masked document."""
    Q, D, d_mask = _poisoned((2, 20, 64), (2, 5, 100, 64), device)
    monkeypatch.setattr(launch_settings, "PIPE_MASK_BITS_MIN_ROWS", 0)  # (thin blocks too)
    cfg = dataclasses.replace(configs.forward_config(20, 64, 2, False), BLOCK_N=64, persist=2 if persistent else 0)
    if persistent:
        monkeypatch.setattr(device_info, "sm_count", lambda device: 1)
    kernels_on(device)
    runs = {}
    for bits in (on, 0):
        monkeypatch.setattr(launch_settings, "PIPE_MASK_BITS_ARGMAX", bits)
        launch_forward.plans.clear()

        def call():
            return launch.forward(Q, D, None, d_mask, False, True, cfg=cfg)

        seen = forward_launches(monkeypatch, call, lambda c, w, s: (c["SAVE_ARGMAX"], c["MASK_BITS"], c["PERSIST"]))
        assert seen == [(True, bits, persistent)]
        runs[bits] = call()
    launch_forward.plans.clear()
    torch.testing.assert_close(runs[on][0], runs[0][0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(runs[on][1], runs[0][1])
    assert (runs[on][1][0, 0] == -1).all() and (runs[on][1][0, 1] == D.shape[2] - 1).all()
    ref = reference.maxsim(Q.double(), D.double(), d_mask=d_mask)
    torch.testing.assert_close(runs[on][0].double(), ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def _kept_tiles(d_shape, device) -> torch.Tensor:
    """A mask whose 64-token tiles are fully kept, kept up to a token inside them, or kept with one hole: each
    document ``i`` keeps a prefix of ``(64, 128, 100, Ld, 65, 127)[i % 6]`` tokens, and document ``i % 6 == 5`` loses
    token 70 too (its second tile has a hole, its first none)."""
    ld = d_shape[-2]
    mask = torch.zeros(d_shape[:-1], dtype=torch.bool)
    for i, row in enumerate(mask.view(-1, ld)):
        row[: min(ld, (64, 128, 100, ld, 65, 127)[i % 6])] = True
        if i % 6 == 5 and ld > 70:
            row[70] = False
    return mask.to(device)


@pytest.mark.parametrize("loop", [*LOOPS, "argmax"])
@pytest.mark.parametrize("persistent", [False, True], ids=["one program a document", "persistent walk"])
def test_fully_kept_tiles_skip_the_select(persistent, loop, device, monkeypatch, any_size):
    """A tile whose mask bits are all set skips the select (forward._scan_tile): the flags' scores (and argmax) bit
    for bit where fully kept tiles sit beside tiles kept up to a token and tiles with a hole, with inf and NaN in the
    masked tokens after them (which the skip must not let through)."""
    streams = loop == "stream"
    if streams and persistent:
        pytest.skip("thin streams take one document a program here")
    argmax = loop == "argmax"
    chooser, setting, on, _ = LOOPS["pipelined, flags ahead" if argmax else loop]
    setting = "PIPE_MASK_BITS_ARGMAX" if argmax else setting
    for name, value in chooser.items():
        monkeypatch.setattr(launch_settings, name, value)
    monkeypatch.setattr(launch_settings, "PIPE_MASK_BITS_MIN_ROWS", 0)
    Q = int_grid((2, 20, 64), seed=5, dtype=DTYPE, device=device)
    D = int_grid((2, 6, 150, 64), seed=6, dtype=DTYPE, device=device)
    d_mask = _kept_tiles(D.shape, device)
    D[~d_mask] = float("inf")
    D[..., 149, :] = float("nan")  # (masked in every document but the fully kept one, whose score is NaN)
    cfg = None
    if not streams:
        cfg = configs.forward_config(20, 64, 2, False)
        cfg = dataclasses.replace(cfg, BLOCK_N=64, persist=2 if persistent else 0)
        if persistent:
            monkeypatch.setattr(device_info, "sm_count", lambda device: 1)
    kernels_on(device)
    launches, runs = _with_and_without_bits(
        monkeypatch, setting, on, lambda: launch.forward(Q, D, None, d_mask, False, argmax, cfg=cfg)
    )
    assert launches == {bits: [(streams, bits, persistent)] for bits in (on, 0)}
    torch.testing.assert_close(runs[on][0], runs[0][0], rtol=0, atol=0, equal_nan=True)
    if argmax:
        assert torch.equal(runs[on][1], runs[0][1])
    ref = reference.maxsim(Q.double(), D.double(), d_mask=d_mask)
    torch.testing.assert_close(runs[on][0].double(), ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(runs[on][0][:, 3]).all() and not torch.isnan(runs[on][0][:, :3]).any()


@pytest.mark.parametrize("loop", list(LOOPS))
def test_mask_bits_chunked_documents(loop, device, monkeypatch, any_size):
    """Documents scanned in chunks of tiles by programs of their own (DOC_SPLIT): each chunk's bits start at its own
    first token."""
    chooser, setting, on, streams = LOOPS[loop]
    for name, value in {**chooser, setting: on}.items():
        monkeypatch.setattr(launch_settings, name, value)
    monkeypatch.setattr(device_info, "sm_count", lambda device: 4096)
    monkeypatch.setattr(launch_settings, "DEEP_PIPELINE", 0)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_MIN_TILES", 1)
    Q = int_grid((1, 20, 128), seed=3, dtype=DTYPE, device=device)
    D = int_grid((1, 2, 300, 128), seed=4, dtype=DTYPE, device=device)
    d_mask = _holes(D.shape, device)
    kernels_on(device)
    seen = forward_launches(
        monkeypatch,
        lambda: launch.forward(Q, D, None, d_mask, False, False),
        lambda c, w, s: (c["STREAM_D"], c["MASK_BITS"], c["DOC_SPLIT"]),
    )
    assert seen == [(streams, on, True)]
    launch_forward.plans.clear()
    out = launch.forward(Q, D, None, d_mask, False, False)[0]
    torch.testing.assert_close(out.double(), reference.maxsim(Q.double(), D.double(), d_mask=d_mask), rtol=0, atol=0)


def test_masked_normalized_table_matches_the_stream(device, monkeypatch):
    """Normalized thin blocks with a document mask take the once-read table past the card's bound
    (ONCE_READ_TABLE_MASKED_SUMS): its scores are the stream's within 2 ulp, and the reference's."""
    monkeypatch.setattr(launch_settings, "DEEP_PIPELINE", 0)
    monkeypatch.setattr(launch_settings, "DOC_SPLIT_PROGRAMS_PER_SM", 0)
    monkeypatch.setattr(launch_settings, "STREAM_L2_RANGE", (0.0, math.inf))
    monkeypatch.setattr(device_info, "card_name", lambda device: "NVIDIA H200")
    Q = int_grid((2, 12, 128), seed=5, dtype=DTYPE, device=device)
    D = int_grid((2, 3, 90, 128), seed=6, dtype=DTYPE, device=device)
    d_mask = _holes(D.shape, device)
    kernels_on(device)
    runs = {}
    nbytes = D.numel() * D.element_size()
    for name, l2s in (("stream", 1.0), ("table", 3.0)):
        monkeypatch.setattr(device_info, "l2_bytes", lambda device, n=int(nbytes / l2s): n)
        launch_forward.plans.clear()
        seen = forward_launches(monkeypatch, lambda: maxsim(Q, D, d_mask=d_mask, normalize=True), lambda c, w, s: c)
        assert [c["STREAM_D"] for c in seen] == [name == "stream"]
        runs[name] = maxsim(Q, D, d_mask=d_mask, normalize=True)
    launch_forward.plans.clear()
    torch.testing.assert_close(runs["table"], runs["stream"], rtol=2.5e-7, atol=0)
    ref = reference.maxsim(Q.double(), D.double(), d_mask=d_mask, normalize=True)
    torch.testing.assert_close(runs["table"].double(), ref, rtol=1e-5, atol=1e-5)
    assert runs["table"][0, 0] == 0


@pytest.mark.parametrize("lq", [20, 200], ids=["norms before the product", "norms after it"])
def test_masked_tokens_norms_read_but_dropped(lq, device, monkeypatch, any_size):
    """Normalized scans with the norms' pre-pass (NORMS_GIVEN): the inverse norms read after the product include
    masked tokens' (NaN and inf there: a norm of NaN or 0), whose columns the select drops; read before it, only
    valid tokens'. The reference's scores either way."""
    monkeypatch.setattr(launch_settings, "PRENORM_MIN_ROW_BLOCKS", 1)
    monkeypatch.setattr(launch_settings, "PRENORM_MIN_QUERY_BLOCKS", 1)
    Q, D, d_mask = _poisoned((3, lq, 64), (1, 5, 90, 64), device)
    D[0, 3][~d_mask[0, 3]] = float("nan")
    kernels_on(device)

    def call():
        return launch.forward(Q, D, None, d_mask, True, False)

    seen = forward_launches(monkeypatch, call, lambda c, w, s: (c["NORMS_GIVEN"], c["EARLY_NORMS"]))
    assert seen == [(True, lq <= 32)]
    out = call()[0]
    ref = reference.maxsim(Q.double(), D.double(), d_mask=d_mask, normalize=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert (out[:, 0] == 0).all() and torch.isnan(out[:, -1]).all() and not torch.isnan(out[:, 1:-1]).any()
