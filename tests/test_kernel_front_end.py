"""Every kernel variant the launch code asks for passes Triton's front end for a Hopper target (no GPU needed).

The interpreter runs the kernels as Python, so it misses what only the compiler checks (types of loop-carried
values, constexpr branches, tensor shapes). ``tools/compile_check.py`` catches those here, before a GPU does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("part", range(4))
def test_all_variants_pass_the_front_end(part):
    """A quarter of the (dtype, normalize) cases each, so that the workers share the two-minute whole."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compile_check.py"), f"--part={part}/4"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "0 failed" in done.stdout


def test_wide_fp32_variants_fit_shared_memory():
    """Through ptxas for sm_90: the wide fp32 tokens' variants (the forward's dim loop, the backward's owners) ask
    for no more shared memory than a Hopper program has. Their split operands (``tf32x3``) take more than
    ``configs.forward_shared_bytes`` counts; the 16-bit ones stay well inside it. (A 256-dim fp32 owner asked for
    237576 bytes at Lq 200 and failed at its first launch on an H200: docs/performance.md v125. Every kernel at seven
    wide shapes, 563 variants, took 8 minutes here: too long for CI.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shapes = "shapes=200x384,32x512"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compile_check.py"), "--full", shapes, "DOT_PRECISION=tf32x3"],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "0 failed" in done.stdout


_TTGIR = """
  tt.func public @k(%BUF: !tt.ptr<f32> {tt.divisibility = 16 : i32}, %OUT: !tt.ptr<bf16>) {
    %x = tt.splat %BUF : !tt.ptr<f32> -> tensor<4096x!tt.ptr<f32>, #blocked> loc(#loc1)
    %x_1 = tt.splat %BUF : !tt.ptr<f32> -> tensor<4096x!tt.ptr<f32>, #blocked1> loc(#loc1)
    %x_2 = tt.addptr %x, %offs : tensor<4096x!tt.ptr<f32>, #blocked>, tensor<4096xi64, #blocked> loc(#loc2)
    %x_3 = tt.addptr %x_1, %offs_1 : tensor<4096x!tt.ptr<f32>, #blocked1>, tensor<4096xi64, #blocked1> loc(#loc2)
    %o = tt.splat %OUT : !tt.ptr<bf16> -> tensor<4096x!tt.ptr<bf16>, #blocked1> loc(#loc3)
    %v = tt.load %x_2, %ok : tensor<4096x!tt.ptr<f32>, #blocked> loc(#loc4)
    %s = tt.load %BUF : !tt.ptr<f32> loc(#loc5)
    tt.store %o, %w, %ok_1 : tensor<4096x!tt.ptr<bf16>, #blocked1> loc(#loc6)
    BARRIER
    tt.store %x_3, %cst, %ok_1 : tensor<4096x!tt.ptr<f32>, #blocked1> loc(#loc7)
    tt.store %BUF, %s : !tt.ptr<f32> loc(#loc8)
    tt.return loc(#loc)
  }
"""


def test_the_hazard_scan_finds_a_buffer_read_and_written_in_two_layouts():
    """``compile_check.layout_hazards`` on TTGIR text: a load and a store of one argument's memory, traced through
    splats and pointer additions, in two layouts with no barrier between (either order), are a hazard; a barrier
    between them, one layout for both, or a scalar's load and store (one thread's) are not."""
    sys.path.insert(0, str(ROOT / "tools"))
    from compile_check import layout_hazards

    assert layout_hazards(_TTGIR.replace("BARRIER", "")) == ["BUF: load #blocked, store #blocked1"]
    for barrier in ("gpu.barrier loc(#loc9)", "ttg.barrier all loc(#loc9)"):
        assert layout_hazards(_TTGIR.replace("BARRIER", barrier)) == []
    assert layout_hazards(_TTGIR.replace("BARRIER", "").replace("#blocked1>", "#blocked>")) == []
    # a store, then a load of what it wrote in another layout (read before another warp wrote it)
    lines = _TTGIR.replace("BARRIER", "").splitlines()
    load = next(n for n, line in enumerate(lines) if "%v = tt.load" in line)
    store = next(n for n, line in enumerate(lines) if "tt.store %x_3" in line)
    lines[load], lines[store] = lines[store], lines[load]
    assert layout_hazards("\n".join(lines)) == ["BUF: store #blocked1, load #blocked"]


def test_no_kernel_reads_and_writes_a_buffer_in_two_layouts_without_a_barrier():
    """``compile_check.py --hazards`` (the whole pipeline for sm_90, then the TTGIR scan) on the kernels that read and
    write one buffer: the chunked dD's cast, alone and inside the atomics' launch. Without v165's barrier both
    fail (a cast program cleared sums before another warp had read them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for kernel in ("cast_clear_kernel", "maxsim_bwd_scatter_kernel"):
        done = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "compile_check.py"), "--hazards", f"kernel={kernel}",
             "shapes=32x128"],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert " 0 failed" in done.stdout and "compiled 0 variants" not in done.stdout, done.stdout[-2000:]
