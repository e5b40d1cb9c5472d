"""The implementations the benchmark compares, behind one small adapter interface.

Each :class:`Impl` turns a workload into a *scorer* ``f(Q, D) -> scores`` computing the workload's quantity
from the same inputs: cross ``[Nq, Nd]``, candidates ``[Nq, K]`` or pairs ``[B]``. In training mode the scorer
must be differentiable with respect to ``Q`` and ``D``; the runner adds the backward. Adapters:

* ``maxsim`` — this library with default settings (:func:`maxsim.maxsim`, :func:`maxsim.maxsim_pairs`;
  ragged: :func:`maxsim.maxsim_varlen`, :func:`maxsim.maxsim_pairs_varlen` on the packed tokens);
* ``maxsim-padded`` — ragged workloads only: :func:`maxsim.maxsim` with masks on the same tokens padded to the
  batch maxima (cross for ``varlen``, candidates for ``pairlist``; masks ``None`` where nothing is padded);
* ``eager`` — PyLate-style ``einsum`` -> ``amax`` over ``Ld`` -> ``sum`` over ``Lq`` in the input dtype (ragged:
  on the padded data, padded document tokens ``-inf`` and padded query tokens 0); in inference it is chunked over
  documents only when the similarity tensor would exceed :data:`EAGER_MEMORY_FRACTION` of the free memory;
* ``compile`` — ``torch.compile(eager, dynamic=False)``, compiled afresh per workload;
* ``lik`` — ``late-interaction-kernels`` (``late_interaction_kernels.maxsim``: 3-D ``D`` for cross, 4-D for
  candidates; ``maxsim_pairs`` for pairs; ragged: ``maxsim_varlen`` and ``score_pairs.score_pairs_packed``, both
  differentiable);
* ``flash`` — ``flash-maxsim`` (``flash_maxsim_batched`` / ``flash_maxsim_rerank_padded`` /
  ``flash_maxsim_pairs`` for inference, ``flash_maxsim_batched_train`` for training; ragged, inference only:
  ``flash_maxsim_packed`` once per query for ``varlen``, ``flash_maxsim_varlen`` on the pair list gathered into
  aligned per-pair segments for ``pairlist``).

A ragged workload's other layouts (padded, per-pair segments) are built by :meth:`Impl.prepare` before timing
and shared between the implementations that use them (see :mod:`.ragged`). The peers need CUDA; where one is
missing or cannot run a workload it says why (``unavailable`` / ``unsupported``) instead of failing.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable
from importlib import metadata

import torch
from torch import Tensor

from . import ragged
from .ragged import Operands
from .workloads import Inputs, Workload

ScoreFn = Callable[[Tensor, Tensor], Tensor]

#: Implementation names in report order.
IMPL_NAMES = ("maxsim", "maxsim-padded", "eager", "compile", "lik", "flash")
#: This library's implementations: never the "best peer".
OURS = ("maxsim", "maxsim-padded")
#: The eager baseline chunks its inference over documents when one similarity tensor would exceed this
#: fraction of the free memory (GPU: free + cached by torch; CPU: available RAM).
EAGER_MEMORY_FRACTION = 0.4
#: Eager training keeps the similarity tensor for the backward and allocates its gradient: its peak is
#: estimated as this many similarity tensors; it is reported "n/a" when that exceeds 90% of the free memory.
EAGER_TRAIN_COPIES = 4

_EINSUM = {"cross": "qid,njd->qnij", "candidates": "qid,qkjd->qkij", "pairs": "bid,bjd->bij"}


def free_memory(device: torch.device) -> int:
    """Bytes that a new allocation on ``device`` can still get."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30


def eager_scores(layout: str, Q: Tensor, D: Tensor) -> Tensor:
    """PyLate-style MaxSim in the input dtype: similarities, max over document tokens, sum over query
    tokens."""
    return torch.einsum(_EINSUM[layout], Q, D).amax(dim=-1).sum(dim=-1)


def eager_chunks(w: Workload, itemsize: int, budget: int) -> int:
    """How many document chunks the eager inference needs so one similarity tensor stays within ``budget``
    (ragged workloads: the similarity tensor of the padded data)."""
    chunks = max(1, math.ceil(w.padded_sims() * itemsize / max(budget, 1)))
    return min(chunks, w.nd if w.layout != "pairs" else w.nq)


def chunked_over_documents(layout: str, fn: Callable[[Tensor, Tensor], Tensor], chunks: int) -> ScoreFn:
    """Apply ``fn`` to ``chunks`` slices of the documents (cross: ``Nd``; candidates: ``K``; pairs: ``B``,
    with the matching queries) and write the pieces into one output in the input dtype."""
    if chunks <= 1:
        return fn

    def run(Q: Tensor, D: Tensor) -> Tensor:
        if layout == "cross":
            n = D.shape[0]
            out = Q.new_empty((Q.shape[0], n))
        elif layout == "candidates":
            n = D.shape[1]
            out = Q.new_empty((Q.shape[0], n))
        else:
            n = D.shape[0]
            out = Q.new_empty((n,))
        step = math.ceil(n / chunks)
        for s in range(0, n, step):
            e = min(n, s + step)
            if layout == "cross":
                out[:, s:e] = fn(Q, D[s:e])
            elif layout == "candidates":
                out[:, s:e] = fn(Q, D[:, s:e])
            else:
                out[s:e] = fn(Q[s:e], D[s:e])
        return out

    return run


def masked_chunked(fn: Callable[..., Tensor], q_mask: Tensor | None, d_mask: Tensor | None, chunks: int) -> ScoreFn:
    """``fn(Q, D, q_mask, d_mask)`` on padded data (3-D ``D``: cross, 4-D: candidates) as a scorer ``(Q, D)``,
    applied to ``chunks`` slices of the documents (cross: ``Nd``; candidates: ``K``) with their masks."""
    if chunks <= 1:
        return lambda Q, D: fn(Q, D, q_mask, d_mask)

    def run(Q: Tensor, D: Tensor) -> Tensor:
        cross = D.dim() == 3
        n = D.shape[0] if cross else D.shape[1]
        out = Q.new_empty((Q.shape[0], n))
        step = math.ceil(n / chunks)
        for s in range(0, n, step):
            e = min(n, s + step)
            if cross:
                out[:, s:e] = fn(Q, D[s:e], q_mask, None if d_mask is None else d_mask[s:e])
            else:
                out[:, s:e] = fn(Q, D[:, s:e], q_mask, None if d_mask is None else d_mask[:, s:e])
        return out

    return run


class Impl:
    """One implementation under test. Subclasses override what they need.

    Class attributes: ``ragged`` — it has entry points for the ragged layouts (otherwise its ragged rows are
    ``n/a``); ``ragged_only`` — it exists for ragged workloads only (no row for a dense workload).
    """

    name: str = ""
    description: str = ""
    ragged: bool = False
    ragged_only: bool = False

    def unavailable(self, device: torch.device) -> str | None:
        """Why this implementation cannot run at all on ``device`` (None when it can)."""
        return None

    def unsupported(self, w: Workload, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this implementation does not run workload ``w`` (None when it does)."""
        return None

    def scorer(self, w: Workload, device: torch.device, dtype: torch.dtype) -> ScoreFn:
        """The function computing ``w``'s scores from ``(Q, D)``; differentiable in training mode."""
        raise NotImplementedError

    def prepare(
        self, w: Workload, inp: Inputs, device: torch.device, dtype: torch.dtype
    ) -> tuple[ScoreFn, Inputs | Operands]:
        """``(scorer, operands)``: the timed function and what it is called on (``operands.Q``, ``.D``, the loss
        weights ``.grad_out``), built before timing. Dense workloads: :meth:`scorer` on the inputs themselves.
        Ragged workloads: override :meth:`prepare_ragged`."""
        if w.ragged:
            return self.prepare_ragged(w, inp, device, dtype)
        return self.scorer(w, device, dtype), inp

    def prepare_ragged(
        self, w: Workload, inp: Inputs, device: torch.device, dtype: torch.dtype
    ) -> tuple[ScoreFn, Inputs | Operands]:
        """:meth:`prepare` for a ragged workload (``inp.ragged`` holds the offsets and pair ids); an
        :class:`~.ragged.Operands` result maps the outputs back to the packed layout."""
        raise NotImplementedError(f"{self.name}: no ragged entry point")

    def reset(self) -> None:
        """Drop per-workload state (compiled graphs, caches) after a workload."""

    def version(self) -> str | None:
        return None


class MaxsimImpl(Impl):
    """This library, default settings. ``cross``/``pairs`` (and the ragged ``varlen``/``pairs_varlen``, called
    as :func:`maxsim.maxsim_varlen` / :func:`maxsim.maxsim_pairs_varlen` with ``max_seqlen_q``/``max_seqlen_d``
    keywords) may be injected (tests use the reference)."""

    name = "maxsim"
    description = "maxsim.maxsim / maxsim_pairs; ragged: maxsim_varlen / maxsim_pairs_varlen (default settings)"
    ragged = True

    def __init__(
        self,
        cross: ScoreFn | None = None,
        pairs: ScoreFn | None = None,
        varlen: Callable[..., Tensor] | None = None,
        pairs_varlen: Callable[..., Tensor] | None = None,
    ) -> None:
        self._cross = cross
        self._pairs = pairs
        self._varlen = varlen
        self._pairs_varlen = pairs_varlen

    def _resolve(self) -> tuple[ScoreFn, ScoreFn]:
        if self._cross is not None and self._pairs is not None:
            return self._cross, self._pairs
        import maxsim

        return self._cross or maxsim.maxsim, self._pairs or maxsim.maxsim_pairs

    def unavailable(self, device: torch.device) -> str | None:
        try:
            self._resolve()
        except (ImportError, AttributeError) as e:
            return f"maxsim.maxsim is not importable ({type(e).__name__}: {e})"
        return None

    def scorer(self, w: Workload, device: torch.device, dtype: torch.dtype) -> ScoreFn:
        cross, pairs = self._resolve()
        return pairs if w.layout == "pairs" else cross

    def prepare_ragged(self, w, inp, device, dtype):
        r = inp.ragged
        assert r is not None
        lengths = {"max_seqlen_q": r.max_seqlen_q, "max_seqlen_d": r.max_seqlen_d}
        cu_q, cu_d = r.cu_seqlens_q, r.cu_seqlens_d
        if w.layout == "varlen":
            varlen = self._varlen or _maxsim_attr("maxsim_varlen")
            return (lambda Q, D: varlen(Q, D, cu_q, cu_d, **lengths)), inp
        pairs_varlen = self._pairs_varlen or _maxsim_attr("maxsim_pairs_varlen")
        pq, pd = r.pair_q, r.pair_d
        return (lambda Q, D: pairs_varlen(Q, D, cu_q, cu_d, pq, pd, **lengths)), inp

    def version(self) -> str | None:
        try:
            import maxsim

            return getattr(maxsim, "__version__", None)
        except ImportError:
            return None


def _maxsim_attr(name: str) -> Callable[..., Tensor]:
    import maxsim

    fn = getattr(maxsim, name, None)
    if fn is None:
        raise AttributeError(f"maxsim.{name} does not exist in this version of maxsim")
    return fn


class MaxsimPaddedImpl(Impl):
    """Ragged workloads on this library's dense path: :func:`maxsim.maxsim` with masks on the tokens padded to
    the batch maxima (cross for ``varlen``, candidates for ``pairlist``). The padded copy is made before timing;
    the row times the padded path alone. ``dense`` may be injected (tests use the reference)."""

    name = "maxsim-padded"
    description = "maxsim.maxsim with masks on the same tokens padded to the batch maxima (copy not timed)"
    ragged = True
    ragged_only = True

    def __init__(self, dense: Callable[..., Tensor] | None = None) -> None:
        self._dense = dense

    def unavailable(self, device: torch.device) -> str | None:
        return MaxsimImpl(cross=self._dense).unavailable(device)

    def prepare_ragged(self, w, inp, device, dtype):
        ops = ragged.padded_operands(w, inp)
        dense = self._dense or _maxsim_attr("maxsim")
        q_mask, d_mask = ops.q_mask, ops.d_mask
        return (lambda Q, D: dense(Q, D, q_mask, d_mask)), ops

    def version(self) -> str | None:
        return MaxsimImpl().version()


class EagerImpl(Impl):
    """PyLate-style einsum + amax + sum in the input dtype (chunked over documents only where it would not
    fit)."""

    name = "eager"
    description = "einsum -> amax -> sum in the input dtype (PyLate-style); ragged: on the padded data, masked"
    ragged = True

    def __init__(self, memory_fraction: float = EAGER_MEMORY_FRACTION) -> None:
        self.memory_fraction = memory_fraction

    def unsupported(self, w: Workload, device: torch.device, dtype: torch.dtype) -> str | None:
        if w.mode == "train":
            need = EAGER_TRAIN_COPIES * w.padded_sims() * dtype.itemsize
            have = free_memory(device)
            if need > 0.9 * have:
                gib = 2**30
                return f"needs ~{need / gib:.1f} GiB for the saved similarities, {have / gib:.1f} GiB free"
        return None

    def _wrap(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        return fn

    def _kernel(self, layout: str) -> Callable[[Tensor, Tensor], Tensor]:
        def fn(Q: Tensor, D: Tensor) -> Tensor:
            return eager_scores(layout, Q, D)

        return self._wrap(fn)

    def _chunks(self, w: Workload, device: torch.device, dtype: torch.dtype) -> int:
        if w.mode == "train":  # chunking would not bound memory: autograd keeps every chunk's similarities
            return 1
        copies = 2 if w.ragged else 1  # masked: the similarities and their masked copy
        return eager_chunks(w, copies * dtype.itemsize, int(self.memory_fraction * free_memory(device)))

    def scorer(self, w: Workload, device: torch.device, dtype: torch.dtype) -> ScoreFn:
        return chunked_over_documents(w.layout, self._kernel(w.layout), self._chunks(w, device, dtype))

    def prepare_ragged(self, w, inp, device, dtype):
        ops = ragged.padded_operands(w, inp)
        fn = self._wrap(ragged.masked_eager_scores)
        return masked_chunked(fn, ops.q_mask, ops.d_mask, self._chunks(w, device, dtype)), ops

    def version(self) -> str | None:
        return torch.__version__


class CompileImpl(EagerImpl):
    """``torch.compile`` of the eager baseline (static shapes; recompiled per workload)."""

    name = "compile"
    description = "torch.compile(eager, dynamic=False)"

    def __init__(self, memory_fraction: float = EAGER_MEMORY_FRACTION) -> None:
        super().__init__(memory_fraction)
        self._compiled = False

    def _wrap(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        self._compiled = True
        return torch.compile(fn, dynamic=False)

    def reset(self) -> None:
        if self._compiled:  # importing torch._dynamo alone takes seconds: not when nothing was compiled
            torch._dynamo.reset()
            self._compiled = False


class _ImportedPeer(Impl):
    """A peer from a third-party package that needs CUDA."""

    module: str = ""
    distribution: str = ""
    expected_version: str = ""

    def _import(self):
        return importlib.import_module(self.module)

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"{self.distribution} needs CUDA (Triton GPU kernels); device is {device.type}"
        try:
            self._import()
        except Exception as e:  # ImportError, or a Triton/driver error raised at import
            return f"{self.distribution} not importable ({type(e).__name__}: {e})"
        return None

    def version(self) -> str | None:
        """The installed distribution's version, else the module's ``__version__`` (None when absent)."""
        try:
            return metadata.version(self.distribution)
        except metadata.PackageNotFoundError:
            pass
        try:
            return getattr(self._import(), "__version__", None)
        except Exception:
            return None


class LikImpl(_ImportedPeer):
    """late-interaction-kernels: ``maxsim(Q, D)`` (3-D D: cross, 4-D D: candidates), ``maxsim_pairs(Q, D)``.

    Default arguments (``normalize=False``, ``backward=None`` = its "auto"). Its forward-only path is taken
    when the inputs do not require grad (inference runs under ``no_grad`` with plain tensors)."""

    name = "lik"
    module = "late_interaction_kernels"
    distribution = "late-interaction-kernels"
    expected_version = "0.4.5"
    description = "late_interaction_kernels.maxsim / maxsim_pairs; ragged: maxsim_varlen / score_pairs_packed"
    ragged = True

    def _import(self):
        # It checks once (one .item()) whether Q is unit-norm and warns; our tokens are unit-norm anyway.
        os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
        return super()._import()

    def scorer(self, w: Workload, device: torch.device, dtype: torch.dtype) -> ScoreFn:
        lik = self._import()
        if w.layout == "pairs":
            return lambda Q, D: lik.maxsim_pairs(Q, D)
        return lambda Q, D: lik.maxsim(Q, D)

    def prepare_ragged(self, w, inp, device, dtype):
        """``maxsim_varlen(Q, D, cu_q, cu_d, max_q, max_d)`` and ``score_pairs_packed(Q, D, cu_q, cu_d, pair_q,
        pair_d, max_seqlen_q=, max_seqlen_d=)`` on the packed tokens (both differentiable; int32 offsets and
        the maxima given, so neither syncs)."""
        r = inp.ragged
        assert r is not None
        cu_q, cu_d, max_q, max_d = r.cu_seqlens_q, r.cu_seqlens_d, r.max_seqlen_q, r.max_seqlen_d
        if w.layout == "varlen":
            varlen = self._import().maxsim_varlen
            return (lambda Q, D: varlen(Q, D, cu_q, cu_d, max_q, max_d)), inp
        score_pairs_packed = importlib.import_module(f"{self.module}.score_pairs").score_pairs_packed
        pq, pd = r.pair_q, r.pair_d
        return (lambda Q, D: score_pairs_packed(Q, D, cu_q, cu_d, pq, pd, max_seqlen_q=max_q, max_seqlen_d=max_d)), inp


class FlashImpl(_ImportedPeer):
    """flash-maxsim. Inference: ``flash_maxsim_batched(Q, D)`` (cross, shared docs),
    ``flash_maxsim_rerank_padded(Q, D)`` (candidates ``[Nq, K, Ld, dim]``), ``flash_maxsim_pairs(Q, D)``
    (dense pairs). Training: ``flash_maxsim_batched_train(Q, D, shared_docs=True)`` (cross),
    ``shared_docs=False`` with 4-D D (candidates), and pairs as candidates with ``K = 1`` (its only
    differentiable entry point for aligned pairs). Its kernels compute in fp16 internally, whatever the input
    dtype.

    Ragged (inference only: its packed kernels have no backward): ``varlen`` as one ``flash_maxsim_packed(q, D,
    cu_seqlens_d)`` per query (one query against packed documents; ``D`` converted to fp16 once per call, as
    each call would otherwise convert it again); ``pairlist`` as ``flash_maxsim_varlen`` (aligned pairs: pair
    ``p`` = query segment ``p`` against document segment ``p``) on the pair list gathered into per-pair segments
    before timing (:func:`.ragged.pair_packed_operands`)."""

    name = "flash"
    module = "flash_maxsim"
    distribution = "flash-maxsim"
    expected_version = "0.3.0"
    description = (
        "flash_maxsim.flash_maxsim_batched / _rerank_padded / _pairs / flash_maxsim_batched_train; "
        "ragged (inference): flash_maxsim_packed per query / flash_maxsim_varlen on per-pair segments"
    )
    ragged = True

    def unsupported(self, w: Workload, device: torch.device, dtype: torch.dtype) -> str | None:
        if w.ragged and w.mode == "train":
            return "flash-maxsim's ragged kernels (flash_maxsim_varlen / _packed) are forward-only"
        return None

    def scorer(self, w: Workload, device: torch.device, dtype: torch.dtype) -> ScoreFn:
        fm = self._import()
        if w.mode == "infer":
            if w.layout == "cross":
                return lambda Q, D: fm.flash_maxsim_batched(Q, D)
            if w.layout == "candidates":
                return lambda Q, D: fm.flash_maxsim_rerank_padded(Q, D)
            return lambda Q, D: fm.flash_maxsim_pairs(Q, D)
        train = fm.flash_maxsim_batched_train
        if w.layout == "cross":
            return lambda Q, D: train(Q, D, shared_docs=True)
        if w.layout == "candidates":
            return lambda Q, D: train(Q, D, shared_docs=False)
        return lambda Q, D: train(Q, D.unsqueeze(1), shared_docs=False)[:, 0]

    def prepare_ragged(self, w, inp, device, dtype):
        fm = self._import()
        r = inp.ragged
        assert r is not None
        if w.layout == "varlen":
            cu_d, max_d = r.cu_seqlens_d, r.max_seqlen_d
            bounds = [0, *r.structure.q_lens.cumsum(0).tolist()]  # host offsets: no device read
            spans = list(zip(bounds[:-1], bounds[1:], strict=True))

            def per_query(Q: Tensor, D: Tensor) -> Tensor:
                Dh = D.half()
                return torch.stack([fm.flash_maxsim_packed(Q[s:e], Dh, cu_d, max_d) for s, e in spans])

            return per_query, inp
        ops = ragged.pair_packed_operands(w, inp)
        x = ops.extra
        cu_q, cu_d, max_q, max_d = x["cu_seqlens_q"], x["cu_seqlens_d"], x["max_seqlen_q"], x["max_seqlen_d"]
        return (lambda Q, D: fm.flash_maxsim_varlen(Q, D, cu_q, cu_d, max_q, max_d)), ops


_FACTORIES: dict[str, Callable[[], Impl]] = {
    "maxsim": MaxsimImpl,
    "maxsim-padded": MaxsimPaddedImpl,
    "eager": EagerImpl,
    "compile": CompileImpl,
    "lik": LikImpl,
    "flash": FlashImpl,
}


def make_impls(names: list[str] | tuple[str, ...]) -> list[Impl]:
    """Adapters for ``names`` (in :data:`IMPL_NAMES` order); ``ValueError`` for an unknown name."""
    unknown = [n for n in names if n not in _FACTORIES]
    if unknown:
        raise ValueError(f"--impl: unknown {unknown}; choose from {list(IMPL_NAMES)}")
    return [_FACTORIES[n]() for n in IMPL_NAMES if n in names]


def default_skips(device: torch.device) -> dict[str, str]:
    """Implementations left out of a run that names no ``--impl``, with the reason printed for each.

    On a CPU, ``compile`` is left out: compiling every workload would take longer than the rest of the run.
    """
    if device.type == "cuda":
        return {}
    why = "not run by default on CPU (compiling each workload dominates the run); pass --impl compile"
    return {"compile": why}
