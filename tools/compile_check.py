"""Compile every kernel variant the launch code asks for, for a Hopper GPU, on a machine without one.

The launch functions run on small CPU tensors with the launcher replaced by a compiler call (Triton's front end and
ptxas, for ``sm_90``), so type and shape errors of the kernels show up here instead of on a lent GPU. Nothing is
executed. Usage: ``python tools/compile_check.py [--full | --regs | --sass | --hazards] [--part=K/N] [NAME=VALUE ...]``
(front end only; the whole pipeline through ptxas, failing a variant that needs more shared memory than sm_90 has;
that plus each variant's registers and spill bytes from ``ptxas -v`` and its shared memory, which say how many
programs fit on a multiprocessor; that plus a histogram of the SASS instructions of each variant's innermost loops,
from ``nvdisasm``; the whole pipeline, failing a variant whose TTGIR loads and stores one buffer in two layouts with
no barrier between, :func:`layout_hazards`); ``--part=K/N`` runs the K-th (from 0) of N shares of the (dtype,
normalize) cases;
``NAME=VALUE`` arguments keep only the variants whose kernel name (``kernel=maxsim_bwd_kernel``), constexprs
(``SCAN_D=True``) or ``num_warps`` match. Exit status 1 if a variant fails.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from maxsim.kernels import (
    configs,
    device_info,
    launch,
    launch_args,
    launch_backward,
    launch_forward,
    launch_settings,
    launcher,
)
from maxsim.layout import Ragged

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes of shared memory a program may use on sm_90 (H100, H200)
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int16: "i16",
          torch.int64: "i64", torch.uint8: "u8"}  # fmt: skip
SASS = "--sass" in sys.argv
REGS = "--regs" in sys.argv or SASS
HAZARDS = "--hazards" in sys.argv
FULL = "--full" in sys.argv or REGS or HAZARDS
FILTERS = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith(("shapes=", "--part=")))
# ``--part=K/N``: a share of the (dtype, normalize) cases, so that tests can spread them over workers
PART = next(
    (tuple(int(v) for v in a[len("--part=") :].split("/")) for a in sys.argv[1:] if a.startswith("--part=")), (0, 1)
)
# (Lq, dim) of the queries: the matrix's, off-matrix ones and wide tokens; ``shapes=32x384,200x768`` replaces them
SHAPES = ((32, 128), (8, 64), (200, 128), (32, 256), (23, 96), (23, 48), (32, 384), (200, 384), (32, 768), (32, 1024))
for _arg in sys.argv[1:]:
    if _arg.startswith("shapes="):
        SHAPES = tuple(tuple(int(v) for v in s.split("x")) for s in _arg[len("shapes=") :].split(","))
seen: dict = {}
failures: list[str] = []


def wanted(kernel_name: str, constexprs: dict, num_warps: int) -> bool:
    """Whether a variant passes the command line's ``NAME=VALUE`` filters."""
    fields = {"kernel": kernel_name, "num_warps": num_warps, **constexprs}
    return all(name in fields and str(fields[name]) == value for name, value in FILTERS.items())


def front_end(src: ASTSource, options: dict) -> None:
    """Triton's front end only (Python AST -> TTIR): where type and shape errors are raised; seconds faster than a
    full compile per variant."""
    backend = make_backend(TARGET)
    opts = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    args = (opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    # (Triton 3.5 added the target as the first argument)
    src.make_ir(*args) if len(inspect.signature(src.make_ir).parameters) == 4 else src.make_ir(TARGET, *args)


def specialization(kernel, tensors: tuple, ints: tuple, constexprs: dict) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` as Triton's launcher specializes them on a GPU: 16-byte aligned pointers
    and integers divisible by 16 marked ``tt.divisibility = 16`` (what makes loads and atomics vector-wide),
    integers equal to 1 made constants, ``do_not_specialize`` parameters left alone."""
    names = kernel.arg_names
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, t in enumerate(tensors):
        sig[names[i]] = "*" + _TYPES[t.dtype]
        if t.data_ptr() % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for i, v in enumerate(ints, start=len(tensors)):
        sig[names[i]] = "i32" if -(2**31) <= v < 2**31 else "i64"
        if kernel.params[i].do_not_specialize:
            continue
        if v == 1:
            sig[names[i]], consts[names[i]] = "constexpr", 1
        elif v % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, consts, attrs


def fake_call(
    self, grid, tensors, ints, constexprs, num_warps, num_stages=3, plan_cache=None, maxnreg=0, foreign=None,
    pointers=None,
):  # fmt: skip
    kernel = self.kernel
    sig, consts, attrs = specialization(kernel, tensors, ints, constexprs)
    key = (kernel.__name__, tuple(sig.items()), tuple(constexprs.items()), num_warps, num_stages, maxnreg)
    if key in seen or not wanted(kernel.__name__, constexprs, num_warps):
        return
    t0 = time.perf_counter()
    try:
        src = ASTSource(kernel, sig, consts, attrs)
        options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
        options.update(launcher.COMPILE_OPTIONS)  # (as the library's launches ask)
        if FULL:
            compiled = triton.compile(src, target=TARGET, options=options)
            if REGS:
                flags = {k: v for k, v in constexprs.items() if isinstance(v, bool | int)}
                data = next((sig[k] for k in ("Q", "QT", "X1") if k in sig), "?").lstrip("*")  # the inputs' dtype
                shared = compiled.metadata.shared
                cap = f" maxnreg={maxnreg}" if maxnreg else ""
                print(f"{kernel.__name__} {data} warps={num_warps}{cap} {flags}: {ptxas_usage(compiled.asm['ptx'])}, "
                      f"{shared} bytes shared", flush=True)  # fmt: skip
            if compiled.metadata.shared > SHARED_LIMIT:  # (found at the first launch on a GPU, not by the compile)
                raise RuntimeError(f"{compiled.metadata.shared} bytes of shared memory, more than {SHARED_LIMIT}")
            if SASS:
                print(f"  loop instructions: {loop_histogram(compiled.asm['cubin'])}", flush=True)
            if HAZARDS and (found := layout_hazards(compiled.asm["ttgir"])):
                raise RuntimeError("a buffer read and written in two layouts, no barrier between: " + "; ".join(found))
        else:
            front_end(src, options)
        seen[key] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        seen[key] = -1
        failures.append(f"{kernel.__name__} {constexprs}: {e}")
        print(f"FAILED NOW: {kernel.__name__} warps={num_warps} stages={num_stages} {constexprs}: {e}", flush=True)
        if "shared memory" not in str(e):
            traceback.print_exc()


# TTGIR: an SSA definition, the ops whose result points where their first operand does, a memory op's operand type
_DEF = re.compile(r"^(%[\w.]+)(?::\d+)? = ([\w.]+) (.*)$")
_SAME_PLACE = {"tt.splat", "tt.addptr", "tt.broadcast", "tt.expand_dims", "ttg.convert_layout", "tt.reshape",
               "tt.bitcast", "tt.trans"}  # fmt: skip
_LAYOUT = re.compile(r":\s*tensor<[^#]*#(\w+)>")


def layout_hazards(ttgir: str) -> list[str]:
    """Loads and stores of one kernel argument's memory in different layouts with no CTA barrier between them (in
    the text's order), as ``"ARG: load #a, store #b"``. Each thread then reads or writes other elements than the
    other op's thread of the same index, so a warp can overwrite an element before another warp has read it, or read
    it before another has written it (v165: the chunked dD cast cleared its fp32 sums in the layout of an fp32 store,
    after loading them in a 16-bit store's). A pointer is traced to the argument it is derived from through
    ``_SAME_PLACE`` ops; loop-carried pointers are left untraced, and two ops on disjoint elements of one buffer are
    reported too (read the kernel before believing one)."""
    root: dict[str, str] = {}
    events: list[tuple[str, str | None, str | None]] = []  # (kind, argument, layout)
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith(("gpu.barrier", "ttg.barrier")):
            events.append(("barrier", None, None))
            continue
        m = _DEF.match(text)
        op, rest = (m.group(2), m.group(3)) if m else (text.split(" ", 1) + [""])[:2]
        if m and op in _SAME_PLACE:
            src = re.match(r"%[\w.]+", rest)
            if src:
                root[m.group(1)] = root.get(src.group(0), src.group(0))
        if op in ("tt.load", "tt.store"):
            ptr, layout = re.match(r"%[\w.]+", rest), _LAYOUT.search(rest)
            if ptr and layout:  # (a scalar's load or store has no layout: one thread's)
                events.append((op, root.get(ptr.group(0), ptr.group(0)), layout.group(1)))
    found = []
    for i, (kind, arg, layout) in enumerate(events):
        for kind2, arg2, layout2 in events[i + 1 :]:
            if kind2 == "barrier":
                break
            if arg2 == arg and layout2 != layout and {kind, kind2} == {"tt.load", "tt.store"}:
                found.append(f"{arg.lstrip('%')}: {kind.split('.')[1]} #{layout}, {kind2.split('.')[1]} #{layout2}")
    return sorted(set(found))


def _ptxas() -> str:
    """The ptxas of Triton's wheel (nvdisasm lies beside it)."""
    from triton.backends.nvidia import compiler as nv

    try:
        return nv.get_ptxas(TARGET.arch).path
    except TypeError:  # (older Triton: no architecture argument)
        return nv.get_ptxas().path


def ptxas_usage(ptx: str) -> str:
    """``N registers, M bytes spill stores`` of a PTX module for sm_90a (ptxas from Triton's wheel)."""
    ptxas = _ptxas()
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        cmd = [ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"]
        out = subprocess.run(cmd, capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr)
    return f"{regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} bytes spill stores"


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin (``nvdisasm -c``, from Triton's wheel)."""
    disasm = Path(_ptxas()).with_name("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(disasm), "-c", f.name], capture_output=True, text=True).stdout


def loop_histogram(cubin: bytes) -> list[tuple[str, int]]:
    """Instruction counts (opcode without modifiers) of the loops that hold an MMA (``HGMMA``), or of every loop
    when none does: the code between a label and the backward branch to it."""
    lines = disassemble(cubin).splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            loops.append(lines[labels[m.group(1)] : i + 1])
    mma = [body for body in loops if any("HGMMA" in x for x in body)]
    counts = Counter(
        m.group(1).split(".")[0]
        for body in (mma or loops)
        for x in body
        if (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", x))
    )
    return counts.most_common(12)


def offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def main() -> None:
    launcher.Launcher.__call__ = fake_call
    launcher.INTERPRETER = False
    launch_args.INTERPRETER = False
    launch_settings.STREAM_L2_RANGE = (
        0.0,
        float("inf"),
    )  # (the streaming scans too: the small shapes here are far below)
    cases = [(dt, normalize) for dt in (torch.bfloat16, torch.float32) for normalize in (False, True)]
    for dt, normalize in cases[PART[0] :: PART[1]]:
        for lq, dim in SHAPES:
            if dim > configs.WIDEST_DIM[dt.itemsize]:  # (the PyTorch path's: backend.choose_impl)
                continue
            Q = torch.randn(4, lq, dim, dtype=dt)
            for D in (torch.randn(1, 5, 40, dim, dtype=dt), torch.randn(4, 3, 40, dim, dtype=dt)):
                for masks in (False, True):
                    qm = torch.ones(Q.shape[:2], dtype=torch.bool) if masks else None
                    dm = torch.ones(D.shape[:3], dtype=torch.bool) if masks else None
                    for sms in (1, 132):  # shared documents: persistent programs, then one per document
                        device_info.INTERPRETER_SMS = sms
                        launch_forward.plans.clear()
                        s, a = launch.forward(Q, D, qm, dm, normalize, True)
                        launch.forward(Q, D, qm, dm, normalize, False)
                        if D.shape[0] == 1:  # 64 queries against shared documents: packed rows (PACK_ROWS)
                            Qp = torch.randn(64, lq, dim, dtype=dt)
                            qmp = torch.ones(Qp.shape[:2], dtype=torch.bool) if masks else None
                            launch.forward(Qp, D, qmp, dm, normalize, True)
                            launch.forward(Qp, D, qmp, dm, normalize, False)
                            # their scores-only blocks halved on a card that PACKED_SCORES_HALF_L2 names
                            card = device_info.card_name, device_info.l2_bytes
                            device_info.card_name = lambda d: "NVIDIA H200"
                            device_info.l2_bytes = lambda d: 1 << 30
                            launch_forward.plans.clear()
                            launch.forward(Qp, D, qmp, dm, normalize, False)
                            device_info.card_name, device_info.l2_bytes = card
                            launch_forward.plans.clear()
                    # few programs against long documents: chunked, and thin blocks deep-pipelined
                    few = launch_settings.DEEP_PIPELINE_MIN_LD, launch_settings.DOC_SPLIT_MIN_TILES
                    (
                        device_info.INTERPRETER_SMS,
                        launch_settings.DEEP_PIPELINE_MIN_LD,
                        launch_settings.DOC_SPLIT_MIN_TILES,
                    ) = 4096, 0, 1
                    Dl = torch.randn(D.shape[:2] + (300, dim), dtype=dt)
                    dml = torch.ones(Dl.shape[:3], dtype=torch.bool) if masks else None
                    launch_forward.plans.clear()
                    launch.forward(Q, Dl, qm, dml, normalize, True)
                    launch.forward(Q, Dl, qm, dml, normalize, False)
                    launch_settings.DEEP_PIPELINE_MIN_LD, launch_settings.DOC_SPLIT_MIN_TILES = few
                    launch_forward.plans.clear()
                    if not masks and D.element_size() == 2:
                        # large once-read scans on a card that ONCE_READ_TABLE_L2 names: the table loop with
                        # configs.once_read_config's tiles (32 and 64 query rows; short and long documents)
                        card = device_info.card_name, device_info.l2_bytes
                        device_info.card_name, device_info.l2_bytes = (lambda d: "NVIDIA H200"), (lambda d: 1)
                        device_info.INTERPRETER_SMS = 1
                        for Qo in (Q[:1], torch.randn(1, 48, dim, dtype=dt)):
                            for ld in (40, 600):
                                Do = torch.randn(1, 5, ld, dim, dtype=dt)
                                launch_forward.plans.clear()
                                launch.forward(Qo, Do, None, None, normalize, False)
                        device_info.card_name, device_info.l2_bytes = card
                        launch_forward.plans.clear()
                    a = torch.zeros(Q.shape[0], D.shape[1], lq, dtype=torch.int32)
                    g = torch.ones(Q.shape[0], D.shape[1])
                    for det in (False, True):
                        for owner_limit in (launch_settings.SHARED_OWNER_MAX_WORK, 0):  # owned dD, then atomics
                            for split_k in (launch_settings.DQ_SPLIT_MIN_K, 2):  # the plain dQ walk, then split
                                before = (
                                    launch_settings.SHARED_OWNER_MAX_WORK,
                                    launch_settings.SHARED_OWNER_MAX_ROWS,
                                )
                                launch_settings.SHARED_OWNER_MAX_WORK = launch_settings.SHARED_OWNER_MAX_ROWS = (
                                    owner_limit
                                )
                                before_split = launch_settings.DQ_SPLIT_MIN_K, launch_settings.DQ_SPLIT_MIN_PAIRS
                                launch_settings.DQ_SPLIT_MIN_K, launch_settings.DQ_SPLIT_MIN_PAIRS = split_k, 1
                                launch_backward.plans.clear()
                                launch.backward(g, Q, D, a, normalize, det)
                                launch_settings.SHARED_OWNER_MAX_WORK, launch_settings.SHARED_OWNER_MAX_ROWS = before
                                launch_settings.DQ_SPLIT_MIN_K, launch_settings.DQ_SPLIT_MIN_PAIRS = before_split
                                launch_backward.plans.clear()
                    if D.shape[0] == 1 and D.element_size() == 2 and not normalize:
                        # dD's atomics in chunks of one document: atomics launches with and without a cast
                        names = ("SHARED_OWNER_MAX_WORK", "SHARED_OWNER_MAX_ROWS", "SCATTER_BUFFER_MAX_BYTES",
                                 "SCATTER_CHUNK_BYTES", "SCATTER_CHUNK_MIN_LINKS")  # fmt: skip
                        before = [getattr(launch_settings, n) for n in names]
                        for n, v in zip(names, (0, 0, 0, D.shape[2] * dim * 4, 0), strict=True):
                            setattr(launch_settings, n, v)
                        launch_backward.plans.clear()
                        launch.backward(g, Q, D, a.to(torch.int16), normalize, False)
                        for n, v in zip(names, before, strict=True):
                            setattr(launch_settings, n, v)
                        launch_backward.plans.clear()
            # ragged: varlen cross, pair list, padded with lengths
            cu_q, cu_d = offsets([3, lq, 1, 0]), offsets([5, 40, 0, 7, 9])
            Qp, Dp = torch.randn(int(cu_q[-1]), dim, dtype=dt), torch.randn(int(cu_d[-1]), dim, dtype=dt)
            pq, pd = torch.tensor([0, 1, 3]), torch.tensor([4, 1, 1])
            for rg in (Ragged(cu_q, cu_d, None, None, lq, 40), Ragged(cu_q, cu_d, pq, pd, lq, 40)):
                s, a = launch.forward(Qp, Dp, None, None, normalize, True, rg)
                a = torch.zeros(s.shape + (lq,), dtype=torch.int32)
                for det in (False, True):
                    for scan_limit in (launch_settings.PAIR_SCAN_MAX_WORK, 0):  # pair ids scanned, then indexed
                        launch_settings.PAIR_SCAN_MAX_WORK, before = scan_limit, launch_settings.PAIR_SCAN_MAX_WORK
                        launch.backward(torch.ones(s.shape), Qp, Dp, a, normalize, det, rg)
                        launch_settings.PAIR_SCAN_MAX_WORK = before
            Dc = torch.randn(4, 3, 40, dim, dtype=dt)
            rg = Ragged(torch.full((4,), 2), torch.full((4, 3), 9), None, None, lq, 40)
            s, a = launch.forward(Q, Dc, None, None, normalize, True, rg)
            launch.backward(torch.ones(s.shape), Q, Dc, a, normalize, False, rg)
    ok = sum(1 for v in seen.values() if v >= 0)
    secs = sum(v for v in seen.values() if v > 0)
    stage = "compiled" if FULL else "front end of"
    print(f"{stage} {ok} variants for sm_90, {len(failures)} failed, {secs:.0f} s")
    for f in failures:
        print("FAILED:", f[:2000])
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
