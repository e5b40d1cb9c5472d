"""The thin kernel launcher: the first launch of a signature goes through Triton, later ones call the compiled
kernel directly; anything Triton specializes on (integer values, dtypes, 16-byte alignment, constexprs, launch
options) or an installed launch hook sends the call back through Triton. Runs without a GPU (a fake kernel)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

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
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
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
    assert args[0] is x and args[1:] == [7, 32]


@pytest.mark.parametrize(
    "change",
    ["int", "dtype", "alignment", "constexpr", "warps"],
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
    }[change]
    lc(3, *args)
    assert [e[0] for e in k.log] == ["triton", "triton"]


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
