"""The registered operators ``maxsim::forward`` / ``maxsim::backward``, and the autograd glue around them.

Both ops take the canonical layout (:mod:`maxsim.layout`) and an ``impl`` string (``"triton"`` or ``"torch"``)
chosen in Python beforehand, so ``torch.compile(fullgraph=True)`` sees one opaque call on every device. Autograd
saves the argmax only (never the similarity tensor), as int16 where the documents allow it (see
:func:`maxsim.layout.argmax_dtype`); the public functions return it as int32. (The eager route's small unmasked CPU
steps keep ``max``'s own int64 indices and one scalar instead, :func:`maxsim.cpu.forward_for_step`, and small ragged
CPU steps whose caller does not read the argmax their path's own choices, :func:`maxsim.cpu_ragged.forward_for_step`.)

Eager calls skip the dispatcher: :func:`maxsim_canonical` runs the same implementation functions through a plain
``autograd.Function`` (the custom-op machinery costs ~100 µs of host time per call, more than a small training step's
GPU work); under ``torch.compile`` it calls the registered ops instead. Both routes share every line of math.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor

from . import cpu, cpu_ragged
from .backend import choose_impl, get_backend
from .layout import Ragged, Views, accum_dtype, argmax_dtype, dims, view_as_canonical, view_as_given

_launch = None
_functorch_level = torch._C._functorch.maybe_current_level  # (None outside torch.func transforms)


def _triton_path():
    global _launch
    if _launch is None:
        from .kernels import launch  # imported lazily: the torch path must work without triton

        _launch = launch
    return _launch


# ---- repeated calls ---------------------------------------------------------------------------------------------
# A scores-only call of maxsim.maxsim or maxsim.maxsim_pairs whose signature (function, shapes, strides, dtypes,
# devices, options, backend, and the masks' shapes, strides, dtypes and devices) an earlier call had, and which then
# ran a kept launch plan, was well-formed then and is now: it goes straight to the plan's allocations and launch,
# without the checks, the layout and the layers between (host time of a tiny forward: see docs/performance.md v68).
# On the CPU the same holds for the PyTorch path's mask-free one-block forward without normalize: the repeat runs
# :func:`maxsim.cpu.plain_scores`'s ops, its decisions (and the settings they read, part of the signature) taken by
# the first call (v112, pairs v115). A training call of the Triton path (an input that requires grad) repeats the
# same way through :class:`_RepeatedStep`, its backward plan found without its key (v118): the small training step
# is host time. Masks repeat on the Triton path (v119): the launch reads the caller's, whose canonical views share
# their pointers. A mask-free training call of the PyTorch path repeats through :class:`_RepeatedCpuStep` (v121).
# The ragged functions repeat on the Triton path (v144, :func:`ragged_repeat_key`): their signature adds the offsets',
# lengths' and pair ids' shapes, strides, dtypes and devices and the maxima as given; a plan never reads their values.
# Packed token rows enter plans and signatures by their specialization class, not their count, wherever no decision
# reads the count (v145, :func:`maxsim.kernels.launch_args.rows_class`): batches of other token totals share them.

CPU_REPEATS_MAX = 256
"""Signatures of CPU calls kept for repeats; past this many, the store starts over."""

_cpu_repeats: dict[tuple, object] = {}


def _mask_signature(mask: Tensor | None) -> tuple | None:
    return None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.device)


def repeat_key(
    Q: object, D: object, normalize: object, backward: object, function: str = "maxsim", q_mask: object = None,
    d_mask: object = None,
) -> tuple | None:  # fmt: skip
    """The signature of a call of the public ``function`` (``"maxsim"`` or ``"maxsim_pairs"``, whose tensors of
    one shape mean different problems) with these arguments for :func:`run_repeat` and :func:`keep_repeat`; None
    where the call must take the full path (arguments that are not tensors and options, a compilation, a CPU call
    of the PyTorch path with ``normalize``, masks or a graph to record). A call that records a graph is signed as a
    ``"step"``, with its resolved ``deterministic`` flag."""
    if not (isinstance(Q, Tensor) and isinstance(D, Tensor) and type(normalize) is bool and type(backward) is str):
        return None
    if forward_ad._current_level >= 0 or _functorch_level() is not None:
        return None  # (forward-mode AD, a torch.func transform: the full path, which refuses what it cannot run)
    step = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    masked = q_mask is not None or d_mask is not None
    on_cpu = Q.is_cpu
    backend = get_backend()
    if on_cpu:
        # (the PyTorch path repeats its plain block, a scores-only call without masks or normalize, and its mask-free
        # training step; an interpreted Triton call repeats as on a GPU, but for a scores-only one with normalize)
        if (normalize and not step) or (backend != "triton" and masked):
            return None
    elif _launch is None:  # (no Triton call yet: nothing filed for it)
        return None
    if torch.compiler.is_compiling():
        return None
    masks = None
    if masked:
        if not ((q_mask is None or isinstance(q_mask, Tensor)) and (d_mask is None or isinstance(d_mask, Tensor))):
            return None
        masks = (_mask_signature(q_mask), _mask_signature(d_mask))
    f32 = torch.get_float32_matmul_precision() if Q.dtype is torch.float32 else None
    if step:
        deterministic = backward == "deterministic" or (
            backward == "auto" and torch.are_deterministic_algorithms_enabled()
        )
        return ("step", function, Q.shape, Q.stride(), D.shape, D.stride(), Q.dtype, D.dtype, Q.device, D.device,
                normalize, backward, deterministic, backend, f32, masks,
                cpu.step_settings() if on_cpu else None)  # fmt: skip
    return ("repeat", function, Q.shape, Q.stride(), D.shape, D.stride(), Q.dtype, D.dtype, Q.device, D.device,
            normalize, backward, backend, f32, cpu.plain_settings() if on_cpu else None, masks)  # fmt: skip


def ragged_repeat_key(
    function: str, Q: object, D: object, segments: tuple, max_q: object, max_d: object, normalize: object,
    backward: object, return_argmax: object, validate: object,
) -> tuple | None:  # fmt: skip
    """:func:`repeat_key` for the ragged functions of :mod:`maxsim.ragged` (``function``: the function's name), on
    the Triton path only: ``segments`` the caller's offsets or lengths and pair ids (None, None without a pair list),
    ``max_q``, ``max_d`` the maxima as given (a padded call's: 0, its shapes hold them). None where the call must take
    the full path: the argmax asked for, ``validate=True`` (its checks read values) or maxima to read back (a sync
    the signature cannot know the answer of), arguments of other types, or what :func:`repeat_key` refuses. A
    signature holds the segments' shapes, strides, dtypes and devices, never their values (a plan never reads them),
    and the packed tokens' row counts by their class (:func:`maxsim.kernels.launch_args.rows_class`; a scores-only
    cross product's documents with their bytes' class, :func:`maxsim.kernels.launch_forward.documents_key`), as
    their plans do."""
    if return_argmax is not False or not (validate is None or validate is False):
        return None
    if type(max_q) is not int or type(max_d) is not int:
        return None
    if not (isinstance(Q, Tensor) and isinstance(D, Tensor) and type(normalize) is bool and type(backward) is str):
        return None
    backend = get_backend()
    if _launch is None or (Q.is_cpu and backend != "triton") or torch.compiler.is_compiling():
        return None  # (no Triton call yet; the PyTorch path, which keeps no ragged plans; a compilation)
    if forward_ad._current_level >= 0 or _functorch_level() is not None:
        return None
    q_seg, d_seg, pair_q, pair_d = segments
    if not (isinstance(q_seg, Tensor) and isinstance(d_seg, Tensor)):
        return None
    if pair_q is None:
        pairs = None
    elif isinstance(pair_q, Tensor) and isinstance(pair_d, Tensor):
        pairs = (pair_q.shape, pair_q.stride(), pair_q.dtype, pair_q.device, pair_d.shape, pair_d.stride(),
                 pair_d.dtype, pair_d.device)  # fmt: skip
    else:
        return None
    f32 = torch.get_float32_matmul_precision() if Q.dtype is torch.float32 else None
    step = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    deterministic = step and (
        backward == "deterministic" or (backward == "auto" and torch.are_deterministic_algorithms_enabled())
    )
    q_shape, d_shape = Q.shape, D.shape
    if function != "padded":
        # (packed rows by their class, as the plans hold them: a training loop's batches, whose token totals
        # differ, repeat one signature; a scores-only cross product's with its documents' bytes' class)
        q_shape = _launch.shape_key(Q, Q.dim() == 2)
        d_shape = _launch.documents_key(D, D.dim() == 2, not step and pair_q is None)
    return ("step" if step else "repeat", function, q_shape, Q.stride(), d_shape, D.stride(), Q.dtype, D.dtype,
            Q.device, D.device, q_seg.shape, q_seg.stride(), q_seg.dtype, q_seg.device, d_seg.shape, d_seg.stride(),
            d_seg.dtype, d_seg.device, pairs, max_q, max_d, normalize, backward, deterministic, backend,
            f32)  # fmt: skip


def _direct_apply(function: type[torch.autograd.Function]):
    """``function.apply`` without the Python layer of :meth:`torch.autograd.Function.apply`, which binds default
    arguments (for a ``setup_context`` these Functions do not define), routes torch.func transforms (a repeat runs
    outside them: :func:`repeat_key`) and unwraps tensors of finished transforms (:func:`_plain_pair` sends those
    to the full ``apply``). This CPU, repeated training steps with the GPU's launches stubbed (``tools/host_stub.py``'s
    cases): 2.5-4.7 µs of host time a step less, of 54-72 (docs/performance.md v149). ``function.apply`` itself
    where this torch has no such C method."""
    base = getattr(torch._C, "_FunctionBase", None)
    raw = None if base is None else base.__dict__.get("apply")
    return function.apply if raw is None else raw.__get__(None, function)


def _plain_pair(Q: Tensor, D: Tensor) -> bool:
    """Neither tensor is a torch.func wrapper (one left over from a finished transform)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return not (wrapped(Q) or wrapped(D))


def run_repeat(
    key: tuple, Q: Tensor, D: Tensor, q_mask: Tensor | None = None, d_mask: Tensor | None = None,
    rg: Ragged | None = None,
) -> Tensor | None:  # fmt: skip
    """The scores of a repeated call (see above), or None if no earlier call filed its signature. The masks are the
    caller's (their canonical views share their pointers); ``rg``: a ragged call's description, of the caller's
    tensors (:func:`ragged_repeat_key`)."""
    if key[0] == "step":
        cpu_step = _cpu_repeats.get(key) if Q.is_cpu else None
        if cpu_step is not None:
            return (_cpu_step_apply if _plain_pair(Q, D) else _RepeatedCpuStep.apply)(Q, D, cpu_step)
        step = None if _launch is None else _launch.step_plan(key)
        if step is None:
            return None
        # (one argument for what autograd need not look at: each argument of apply costs host time)
        extras = None if q_mask is None and d_mask is None and rg is None else ((q_mask, d_mask), rg)
        return (_step_apply if _plain_pair(Q, D) else _RepeatedStep.apply)(Q, D, step, extras)
    if Q.is_cpu:  # (a GPU call's signature is never among them: it holds the device)
        run = _cpu_repeats.get(key)
        if run is not None:
            return run(Q, D)
    return None if _launch is None else _launch.run_repeat(key, Q, D, q_mask, d_mask, rg)


def keep_repeat(
    key: tuple, Q: Tensor, D: Tensor, normalize: bool, views: Views | None, deterministic: bool,
    q_mask: Tensor | None = None, d_mask: Tensor | None = None, rg: Ragged | None = None,
) -> None:  # fmt: skip
    """After the full path of a call with signature ``key`` (:func:`repeat_key`, :func:`ragged_repeat_key`): file
    its launch plan, if the Triton path ran and kept one (a training call's: the forward's with the argmax, and the
    backward's options), or the PyTorch path's one-block forward (:func:`maxsim.cpu.plain_scores`, mask-free) or
    mask-free training step (:class:`CpuStep`). The masks are the canonical views the full path planned with;
    ``rg`` its ragged description, whose tensors must be the caller's as given (no contiguous copies: a repeat
    reads the caller's)."""
    if choose_impl(Q) == "triton":
        if key[0] == "step":
            _launch.keep_step(key, Q, D, normalize, deterministic, views, q_mask, d_mask, rg)
        else:
            _launch.keep_repeat(key, Q, D, normalize, views, q_mask, d_mask, rg)
        return
    if rg is not None or q_mask is not None or d_mask is not None or Q.device.type != "cpu":
        return
    Qc, Dc = _in_views(Q, D, views)
    if key[0] == "step":
        if cpu.step_fits(Qc, Dc, None, None, normalize):  # (as the full path's forward_impl decided)
            _file_cpu_repeat(key, CpuStep(views, normalize, argmax_dtype(Dc.shape[2])))
        return
    if normalize or Qc.numel() == 0 or Dc.numel() == 0 or not cpu.one_block(Qc, Dc):
        return
    scores = cpu.plain_scores(*Qc.shape, *Dc.shape[:3], accum_dtype(Q.dtype), Q.dtype)
    out = views.out
    _file_cpu_repeat(key, scores if out is None else (lambda Q, D: scores(Q, D).view(out)))


def _file_cpu_repeat(key: tuple, run: object) -> None:
    if len(_cpu_repeats) >= CPU_REPEATS_MAX:
        _cpu_repeats.clear()
    _cpu_repeats[key] = run


class CpuStep(NamedTuple):
    """A training step of the PyTorch path filed for repeats (:class:`_RepeatedCpuStep`): how the caller's tensors
    are viewed, ``normalize``, and the argmax dtype the full path's step gave :func:`maxsim.cpu.forward_for_step`."""

    views: Views
    normalize: bool
    index_dtype: torch.dtype


class _RepeatedCpuStep(torch.autograd.Function):
    """A repeated mask-free training call of the PyTorch path whose full path took :func:`maxsim.cpu.step_fits`'s
    step: ``apply(Q, D, step)`` -> the scores, through the same :func:`maxsim.cpu.forward_for_step` and
    :func:`maxsim.cpu.backward_for_step` (so the same numbers, and gradients differentiable again as the full
    path's), without the layers between. The argmax stays canonical: it is saved, not returned."""

    @staticmethod
    def forward(ctx, Q, D, step):
        views = step.views
        scores, argmax, sims_sum = cpu.forward_for_step(
            view_as_canonical(Q, views.q), view_as_canonical(D, views.d), step.normalize, step.index_dtype
        )
        ctx.save_for_backward(Q, D, argmax, sims_sum)
        ctx.step = step
        ctx.set_materialize_grads(False)
        return scores if views.out is None else scores.view(views.out)

    @staticmethod
    def backward(ctx, grad_scores):
        if grad_scores is None:
            return None, None, None
        Q, D, argmax, sims_sum = ctx.saved_tensors
        step = ctx.step
        views = step.views
        grad = grad_scores if views.out is None else grad_scores.view(argmax.shape[:2])
        dQ, dD = cpu.backward_for_step(
            grad, view_as_canonical(Q, views.q), view_as_canonical(D, views.d), argmax, step.normalize, sims_sum
        )
        return view_as_given(dQ, views.q), view_as_given(dD, views.d), None


_cpu_step_apply = _direct_apply(_RepeatedCpuStep)


def ragged(
    q_seg: Tensor | None, d_seg: Tensor | None, pair_q: Tensor | None, pair_d: Tensor | None, max_q: int, max_d: int
) -> Ragged | None:
    if q_seg is None and d_seg is None and pair_q is None:
        return None
    return Ragged(q_seg, d_seg, pair_q, pair_d, max_q, max_d)


def forward_impl(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    normalize: bool,
    need_argmax: bool,
    impl: str,
    rg: Ragged | None = None,
    views: Views | None = None,
    step: bool = False,
    argmax_read: bool = True,
) -> tuple[Tensor, Tensor | None, object]:
    """Scores, argmax (None or empty when not asked for) and what the implementation keeps for
    :func:`backward_impl`, or None: the Triton path's tokens' inverse norms of ``normalize=True``; with ``step`` (a
    caller that keeps it for the backward: the eager autograd Function), the PyTorch path's
    :func:`maxsim.cpu.forward_for_step` state, whose argmax is then int64 in the PyTorch path's own order rather
    than :func:`maxsim.layout.argmax_dtype` (a ragged layout's: int32, as its paths compute it), or, where the step's
    caller does not read the argmax (``argmax_read`` False), a ragged CPU path's state
    (:func:`maxsim.cpu_ragged.forward_for_step`) in place of the argmax (then empty). ``views``: ``Q`` and ``D`` are the
    caller's tensors, to be viewed canonically, and the results come in the caller's shape (``views.out``)."""
    if impl == "triton":
        if forward_ad._current_level >= 0 or _functorch_level() is not None:
            _refuse_transformed(Q, D)
        return _triton_path().forward_keeping_norms(Q, D, q_mask, d_mask, normalize, need_argmax, rg, views=views)
    if views is not None:
        Q, D = _in_views(Q, D, views)
    if step and rg is None and cpu.step_fits(Q, D, q_mask, d_mask, normalize):
        scores, argmax, sims_sum = cpu.forward_for_step(Q, D, normalize, argmax_dtype(D.shape[2]))
        if views is not None:
            scores, argmax = _out_views(scores, argmax, views)
        return scores, argmax, (sims_sum,)
    if step and rg is not None and not argmax_read:
        out = cpu_ragged.forward_for_step(Q, D, normalize, rg)
        if out is not None:
            scores = out[0] if views is None else _out_views(out[0], None, views)[0]
            return scores, out[0].new_empty((0,), dtype=torch.int32), out[1]
    if rg is not None:
        scores, argmax = cpu_ragged.forward(Q, D, normalize, need_argmax, rg)
        # The ragged paths compute it as int32, which is also what their backward indexes with: a step (the eager
        # autograd Function) keeps it so; the registered op returns argmax_dtype as its fake does.
        if need_argmax and not step:
            argmax = argmax.to(argmax_dtype(dims(Q, D, rg)[4]))
    else:
        index_dtype = argmax_dtype(D.shape[2]) if need_argmax else torch.int32
        scores, argmax = cpu.forward(Q, D, q_mask, d_mask, normalize, need_argmax, index_dtype)
    if views is not None:
        scores, argmax = _out_views(scores, argmax, views)
    return scores, argmax, None


def _refuse_transformed(Q: Tensor, D: Tensor) -> None:
    """The Triton kernels propagate no forward-mode tangent (a dual input would give scores whose tangent is silently
    zero) and read no tensor of a ``torch.func`` transform (``vmap``'s batched tensors have no storage)."""
    for name, x in (("Q", Q), ("D", D)):
        if forward_ad.unpack_dual(x).tangent is not None:
            raise RuntimeError(
                f"maxsim: {name} carries a forward-mode AD tangent (torch.autograd.forward_ad, torch.func.jvp), which "
                "the Triton path does not propagate; the PyTorch path (maxsim.backend('torch')) propagates it through "
                "its PyTorch ops for inputs that do not require grad"
            )
        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            raise RuntimeError(
                f"maxsim: {name} is a tensor of a torch.func transform (vmap, grad, ...), which the Triton path cannot "
                "read; the PyTorch path (maxsim.backend('torch')) runs under vmap for inputs that do not require grad"
            )


def backward_impl(
    grad: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    normalize: bool,
    deterministic: bool,
    impl: str,
    rg: Ragged | None = None,
    kept: object = None,
    views: Views | None = None,
) -> tuple[Tensor, Tensor]:
    """``(dQ, dD)`` shaped as ``Q`` and ``D``; ``kept``: what :func:`forward_impl` kept, or None; ``views``: ``Q``
    and ``D`` are the caller's tensors, to be viewed canonically, and ``grad`` and ``argmax`` have the caller's
    result shape (as :func:`forward_impl` returned them)."""
    if impl == "triton":
        return _triton_path().backward(grad, Q, D, argmax, normalize, deterministic, rg, kept, views=views)
    if views is None:
        return _torch_backward(grad, Q, D, argmax, normalize, deterministic, rg, kept)
    Qc, Dc = _in_views(Q, D, views)
    if views.out is not None:  # (the caller's result shape: viewed back as the [Nq, K] grid)
        Nq, Lq, _, K, _, _ = dims(Qc, Dc, rg)
        grad = grad.view(Nq, K)
        if not isinstance(kept, cpu_ragged.STEPS):  # (a kept step's argmax is an empty stand-in)
            argmax = argmax.view(Nq, K, Lq)
    dQ, dD = _torch_backward(grad, Qc, Dc, argmax, normalize, deterministic, rg, kept)
    return view_as_given(dQ, views.q), view_as_given(dD, views.d)


def _torch_backward(
    grad: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, normalize: bool, deterministic: bool, rg: Ragged | None,
    kept: object,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`backward_impl` of the PyTorch paths on canonical tensors."""
    if isinstance(kept, cpu_ragged.STEPS):
        return cpu_ragged.backward_for_step(grad, Q, D, normalize, deterministic, rg, kept)
    if kept is not None:  # (forward_for_step's state)
        return cpu.backward_for_step(grad, Q, D, argmax, normalize, *kept)
    if rg is not None:
        argmax = argmax.to(torch.int32)  # (what the ragged paths index with; a no-op after a step's forward)
        return cpu_ragged.backward(grad, Q, D, argmax, normalize, deterministic, rg)
    return cpu.backward(grad, Q, D, argmax, normalize, deterministic)


@torch.library.custom_op("maxsim::forward", mutates_args=())
def forward(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    normalize: bool,
    need_argmax: bool,
    impl: str,
    deterministic: bool = False,
    q_seg: Tensor | None = None,
    d_seg: Tensor | None = None,
    pair_q: Tensor | None = None,
    pair_d: Tensor | None = None,
    max_q: int = 0,
    max_d: int = 0,
    q_axes: list[int] | None = None,
    d_axes: list[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, K]`` (fp32; fp64 for fp64 inputs) and argmax ``[Nq, K, Lq]`` in ``argmax_dtype(Ld)`` (int32
    ``[0]`` if not asked).

    ``Q [Nq, Lq, dim]``, ``D [Bd, K, Ld, dim]`` (``Bd`` = 1 or ``Nq``), ``q_mask [Nq, Lq]``, ``d_mask [Bd, K, Ld]``.
    Ragged layouts (:class:`maxsim.layout.Ragged`): ``q_seg``/``d_seg`` offsets for packed ``[rows, dim]`` tokens
    or lengths for padded ones, an optional pair list (scores ``[1, P]``), and the longest lengths ``max_q``,
    ``max_d``. ``deterministic`` only matters to the backward (it is recorded here for autograd). ``q_axes``,
    ``d_axes``: ``Q`` and ``D`` are the caller's tensors, whose canonical forms insert these unit axes
    (:class:`maxsim.layout.Views`); the masks and results stay canonical.
    """
    rg = ragged(q_seg, d_seg, pair_q, pair_d, max_q, max_d)
    views = _axes_views(q_axes, d_axes)
    scores, argmax, _kept = forward_impl(Q, D, q_mask, d_mask, normalize, need_argmax, impl, rg, views)
    return scores, (scores.new_empty((0,), dtype=torch.int32) if argmax is None else argmax)


def _axes_views(q_axes: list[int] | None, d_axes: list[int] | None) -> Views | None:
    if not q_axes and not d_axes:
        return None
    return Views(tuple(q_axes or ()), tuple(d_axes or ()), None)


@forward.register_fake
def _forward_fake(
    Q, D, q_mask, d_mask, normalize, need_argmax, impl, deterministic=False, q_seg=None, d_seg=None, pair_q=None,
    pair_d=None, max_q=0, max_d=0, q_axes=None, d_axes=None,
):  # fmt: skip
    Q, D = view_as_canonical(Q, tuple(q_axes or ())), view_as_canonical(D, tuple(d_axes or ()))
    Nq, Lq, _, K, Ld, _ = dims(Q, D, ragged(q_seg, d_seg, pair_q, pair_d, max_q, max_d))
    scores = Q.new_empty((Nq, K), dtype=accum_dtype(Q.dtype))
    argmax = Q.new_empty((Nq, K, Lq), dtype=argmax_dtype(Ld)) if need_argmax else Q.new_empty((0,), dtype=torch.int32)
    return scores, argmax


@torch.library.custom_op("maxsim::backward", mutates_args=())
def backward(
    grad: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    normalize: bool,
    deterministic: bool,
    impl: str,
    q_seg: Tensor | None = None,
    d_seg: Tensor | None = None,
    pair_q: Tensor | None = None,
    pair_d: Tensor | None = None,
    max_q: int = 0,
    max_d: int = 0,
    q_axes: list[int] | None = None,
    d_axes: list[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(dQ like Q, dD like D)`` from ``grad [Nq, K]`` and the forward's ``argmax [Nq, K, Lq]`` (``q_axes``,
    ``d_axes``: as the forward's)."""
    rg = ragged(q_seg, d_seg, pair_q, pair_d, max_q, max_d)
    return backward_impl(grad, Q, D, argmax, normalize, deterministic, impl, rg, None, _axes_views(q_axes, d_axes))


@backward.register_fake
def _backward_fake(
    grad, Q, D, argmax, normalize, deterministic, impl, q_seg=None, d_seg=None, pair_q=None, pair_d=None, max_q=0,
    max_d=0, q_axes=None, d_axes=None,
):  # fmt: skip
    return Q.new_empty(Q.shape), D.new_empty(D.shape)


_N_FORWARD_ARGS = 16


def _setup_context(ctx, inputs, output) -> None:
    Q, D, _q_mask, _d_mask, normalize, need_argmax, impl, *rest = inputs
    rest = rest + [False, None, None, None, None, 0, 0, None, None][len(rest) :]
    deterministic, q_seg, d_seg, pair_q, pair_d, max_q, max_d, q_axes, d_axes = rest
    _scores, argmax = output
    ctx.save_for_backward(Q, D, argmax, q_seg, d_seg, pair_q, pair_d)
    ctx.normalize = normalize
    ctx.need_argmax = need_argmax
    ctx.impl = impl
    ctx.deterministic = bool(deterministic)
    ctx.max_lengths = (max_q, max_d)
    ctx.axes = (q_axes, d_axes)


def _backward(ctx, grad_scores: Tensor, _grad_argmax: Tensor | None):
    Q, D, argmax, q_seg, d_seg, pair_q, pair_d = ctx.saved_tensors
    if not ctx.need_argmax:
        raise RuntimeError(
            "maxsim: backward through a forward that was called with need_argmax=False; the public functions set it "
            "whenever an input requires grad"
        )
    dQ, dD = backward(
        grad_scores, Q, D, argmax, ctx.normalize, ctx.deterministic, ctx.impl, q_seg, d_seg, pair_q, pair_d,
        *ctx.max_lengths, *ctx.axes,
    )  # fmt: skip
    return (dQ, dD) + (None,) * (_N_FORWARD_ARGS - 2)


torch.library.register_autograd("maxsim::forward", _backward, setup_context=_setup_context)


class _FirstOrderOnly(torch.autograd.Function):
    """Copies of the Triton path's gradients for a caller that records their graph (``create_graph=True``): the
    kernels' gradients carry no graph of their own, so a second-order term through them (a gradient penalty) would
    be silently dropped; through these copies it raises instead."""

    @staticmethod
    def forward(dQ, dD, *depends_on):
        # (depends_on: the forward's inputs and the upstream gradient, the edges a second-order term would follow)
        return dQ.clone(), dD.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):  # (this form: a Function that torch.func transforms may also run)
        pass

    @staticmethod
    def backward(ctx, *_grads):
        raise RuntimeError(
            "maxsim: the Triton path's gradients are not differentiable (a second-order gradient, such as a gradient "
            "penalty, through maxsim); the PyTorch path supports them: call under maxsim.backend('torch')"
        )


def _first_order_only(dQ: Tensor, dD: Tensor, grad: Tensor, Q: Tensor, D: Tensor) -> tuple[Tensor, Tensor]:
    """The Triton path's gradients as the backward returns them: as they are, or, where the engine records the
    backward's graph (grad mode on inside a backward: ``create_graph=True``), :class:`_FirstOrderOnly`'s copies,
    which depend on the upstream gradient and the forward's inputs ``Q`` and ``D`` (as saved)."""
    if not torch.is_grad_enabled():
        return dQ, dD
    return _FirstOrderOnly.apply(dQ, dD, grad, Q, D)


class _MaxSimFunction(torch.autograd.Function):
    """Eager twin of ``maxsim::forward`` + its registered autograd (same implementation functions).

    ``apply(Q, D, call)``, ``call = (q_mask, d_mask, normalize, impl, deterministic, rg, views, return_argmax)``:
    one argument for what autograd need not look at (each argument of ``apply`` costs host time, twice: in and
    out)."""

    @staticmethod
    def forward(ctx, Q, D, call):
        q_mask, d_mask, normalize, impl, _deterministic, rg, views, return_argmax = call
        # (the caller's Q and D, saved as given: neither pass makes their canonical views on a planned call)
        # (in the caller's shapes: neither pass makes a view of the results either)
        scores, argmax, kept = forward_impl(
            Q, D, q_mask, d_mask, normalize, True, impl, rg, views, step=True, argmax_read=return_argmax
        )
        if isinstance(kept, cpu_ragged.STEPS):  # (its plan is no tensor; its tensors are few and small)
            ctx.save_for_backward(Q, D, argmax)
            ctx.kept = kept  # (made by this forward: no input or output in it, so no reference cycle)
        else:  # (tensors or None: saved as autograd saves them, freed after the backward)
            ctx.save_for_backward(Q, D, argmax, *(kept or ()))
            ctx.kept = None
        ctx.call = call[2:7]  # (not the masks: the backward does not need them alive)
        # No zero-filled gradient for the (non-differentiable) argmax output: one allocation and fill fewer per step.
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(argmax)
        return scores, argmax

    @staticmethod
    def backward(ctx, grad_scores, _grad_argmax):
        if grad_scores is None:
            return None, None, None
        Q, D, argmax, *kept = ctx.saved_tensors
        normalize, impl, deterministic, rg, views = ctx.call
        kept = ctx.kept or tuple(kept) or None
        dQ, dD = backward_impl(grad_scores, Q, D, argmax, normalize, deterministic, impl, rg, kept, views)
        if impl == "triton":
            dQ, dD = _first_order_only(dQ, dD, grad_scores, Q, D)
        return dQ, dD, None


class _TransformedFunction(torch.autograd.Function):
    """:class:`_MaxSimFunction` for a call under a ``torch.func`` transform that differentiates it (``grad``,
    ``grad_and_value``, ``vjp``), which needs the ``setup_context`` form. ``apply(Q, D, call)`` on canonical tensors,
    ``call = (q_mask, d_mask, normalize, impl, deterministic, rg)``. The transform hands the forward plain tensors
    (what the kernels read); the backward runs at the transform's level, on its wrapped tensors: the PyTorch path's
    backward there (its ops are transformed like any others: differentiable again), the Triton path's kernels on the
    plain tensors beneath (:func:`_peeled`; differentiable once). No ``vmap`` rule (``torch.func.vmap`` of a
    gradient, ``jacrev``): PyTorch refuses those by name."""

    @staticmethod
    def forward(Q, D, call):
        q_mask, d_mask, normalize, impl, _deterministic, rg = call
        scores, argmax, _kept = forward_impl(Q, D, q_mask, d_mask, normalize, True, impl, rg)
        return scores, argmax

    @staticmethod
    def setup_context(ctx, inputs, output):
        Q, D, call = inputs
        ctx.save_for_backward(Q, D, output[1])
        ctx.call = call[2:]
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad_scores, _grad_argmax):
        if grad_scores is None:
            return None, None, None
        Q, D, argmax = ctx.saved_tensors
        normalize, impl, deterministic, rg = ctx.call
        if impl != "triton":
            return (*backward_impl(grad_scores, Q, D, argmax, normalize, deterministic, impl, rg), None)
        grad_scores, Q, D, argmax = (_peeled(x) for x in (grad_scores, Q, D, argmax))
        if rg is not None:  # (offsets or lengths derived inside the transform are its tensors too)
            rg = Ragged(*(_peeled(x) if isinstance(x, Tensor) else x for x in rg))
        with torch._C._DisableFuncTorch():  # (else the transform would wrap the buffers the launches allocate)
            dQ, dD = backward_impl(grad_scores, Q, D, argmax, normalize, deterministic, impl, rg)
        if grad_scores.requires_grad or Q.requires_grad or D.requires_grad:
            # (tensors that regular autograd follows around the transform: a second-order term through these
            # gradients raises instead of being dropped, as in eager calls)
            dQ, dD = _FirstOrderOnly.apply(dQ, dD, grad_scores, Q, D)
        return dQ, dD, None  # (plain tensors: the transform lifts them to its level)


def _peeled(x: Tensor) -> Tensor:
    """The plain tensor under the wrapper of the one ``torch.func`` level that differentiates a call of the Triton
    path (the kernels read storage); a second level beneath (a transform of a transform: a second-order gradient)
    is refused."""
    if not torch._C._functorch.is_functorch_wrapped_tensor(x):
        return x
    x = torch._C._functorch.get_unwrapped(x)
    if torch._C._functorch.is_functorch_wrapped_tensor(x):
        raise RuntimeError(
            "maxsim: the Triton path's gradients are not differentiable (a torch.func transform of a gradient of "
            "maxsim, such as torch.func.grad of torch.func.grad); the PyTorch path supports them: call under "
            "maxsim.backend('torch')"
        )
    return x


def _transformed(
    Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, normalize: bool, impl: str, deterministic: bool,
    rg: Ragged | None, views: Views | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Scores and argmax of a differentiated call under a ``torch.func`` transform (:class:`_TransformedFunction`),
    in the caller's shapes: the canonical views are taken outside the Function, where the transform tracks them."""
    if views is not None:
        Q, D = _in_views(Q, D, views)
    scores, argmax = _TransformedFunction.apply(Q, D, (q_mask, d_mask, normalize, impl, deterministic, rg))
    return (scores, argmax) if views is None else _out_views(scores, argmax, views)


class _RepeatedStep(torch.autograd.Function):
    """A repeated training call of the Triton path (:func:`repeat_key`, :func:`ragged_repeat_key`): ``apply(Q, D,
    step, extras)`` -> the scores, with ``step`` the :class:`maxsim.kernels.launch.StepPlan` an earlier call of the
    signature filed and ``extras`` None (no masks, a dense layout) or ``((q_mask, d_mask), rg)``: the caller's masks
    (not saved: the argmax holds what the backward needs) and the call's ragged description or None (kept for the
    backward, as the full path's Function keeps it). The same kernels as :class:`_MaxSimFunction`'s, without the
    layers between; the argmax (and the inverse norms of ``normalize``) are saved, not returned."""

    @staticmethod
    def forward(ctx, Q, D, step, extras):
        (q_mask, d_mask), rg = extras or ((None, None), None)
        scores, argmax, norms = _launch.step_forward(step, Q, D, q_mask, d_mask, rg)
        ctx.save_for_backward(Q, D, argmax, *(norms or ()))
        ctx.step = step
        ctx.rg = rg
        ctx.set_materialize_grads(False)
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        if grad_scores is None:
            return None, None, None, None
        Q, D, argmax, *norms = ctx.saved_tensors
        dQ, dD = _launch.step_backward(ctx.step, grad_scores, Q, D, argmax, tuple(norms) or None, ctx.rg)
        return (*_first_order_only(dQ, dD, grad_scores, Q, D), None, None)


_step_apply = _direct_apply(_RepeatedStep)


def _in_views(Q: Tensor, D: Tensor, views: Views) -> tuple[Tensor, Tensor]:
    return view_as_canonical(Q, views.q), view_as_canonical(D, views.d)


def _out_views(scores: Tensor, argmax: Tensor | None, views: Views) -> tuple[Tensor, Tensor | None]:
    if views.out is None:
        return scores, argmax
    return scores.view(views.out), None if argmax is None else argmax.view(*views.out, argmax.shape[-1])


def maxsim_canonical(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    normalize: bool,
    impl: str,
    deterministic: bool,
    rg: Ragged | None = None,
    return_argmax: bool = False,
    views: Views | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scores ``[Nq, K]`` of canonical inputs, differentiable (and, if asked, the argmax ``[Nq, K, Lq]`` int32);
    the argmax is computed only when a gradient needs it or it is asked for. With ``views``, ``Q`` and ``D`` are
    the caller's tensors, viewed as ``views.q`` and ``views.d``, and the results come back as ``views.out``
    (``[..., Lq]`` for the argmax)."""
    need_grad = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    compiling = torch.compiler.is_compiling()
    if need_grad and not compiling and _functorch_level() is not None:
        out = _transformed(Q, D, q_mask, d_mask, normalize, impl, deterministic, rg, views)
        return (out[0], out[1].to(torch.int32)) if return_argmax else out[0]
    if need_grad and not compiling:
        out = _MaxSimFunction.apply(Q, D, (q_mask, d_mask, normalize, impl, deterministic, rg, views, return_argmax))
        # (contiguous: the PyTorch path's step keeps its argmax in its own order)
        return (out[0], out[1].to(torch.int32, memory_format=torch.contiguous_format)) if return_argmax else out[0]
    need_argmax = need_grad or return_argmax
    if compiling:
        # The caller's Q and D go into the op as they are (it views them): an input that reached the op as a view
        # would be saved for the backward as an intermediate, which PyTorch's aot_autograd does not connect to the
        # input, so a second-order gradient through it would be dropped silently instead of refused.
        r = (None, None, None, None, 0, 0) if rg is None else tuple(rg)
        axes = (None, None) if views is None else (list(views.q), list(views.d))
        out = forward(Q, D, q_mask, d_mask, normalize, need_argmax, impl, deterministic, *r, *axes)
        if views is not None and views.out is not None:
            out = _out_views(out[0], out[1] if return_argmax else None, views)
    else:
        out = forward_impl(Q, D, q_mask, d_mask, normalize, need_argmax, impl, rg, views)[:2]
    return (out[0], out[1].to(torch.int32)) if return_argmax else out[0]
