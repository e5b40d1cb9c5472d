"""The implementations the benchmark compares, behind one small adapter interface.

Each :class:`Impl` turns a workload into a *scorer* ``f(Q, D) -> scores`` computing the workload's quantity
from the same inputs: cross ``[Nq, Nd]``, candidates ``[Nq, K]`` or pairs ``[B]``. In training mode the scorer
must be differentiable with respect to ``Q`` and ``D``; the runner adds the backward. Adapters:

* ``maxsim`` — this library with default settings (:func:`maxsim.maxsim`, :func:`maxsim.maxsim_pairs`);
* ``eager`` — PyLate-style ``einsum`` -> ``amax`` over ``Ld`` -> ``sum`` over ``Lq`` in the input dtype; in
  inference it is chunked over documents only when the similarity tensor would exceed
  :data:`EAGER_MEMORY_FRACTION` of the free memory;
* ``compile`` — ``torch.compile(eager, dynamic=False)``, compiled afresh per workload;
* ``lik`` — ``late-interaction-kernels`` (``late_interaction_kernels.maxsim``: 3-D ``D`` for cross, 4-D for
  candidates; ``maxsim_pairs`` for pairs);
* ``flash`` — ``flash-maxsim`` (``flash_maxsim_batched`` / ``flash_maxsim_rerank_padded`` /
  ``flash_maxsim_pairs`` for inference, ``flash_maxsim_batched_train`` for training).

The peers need CUDA; where one is missing or cannot run a workload it says why (``unavailable`` /
``unsupported``) instead of failing.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable
from importlib import metadata

import torch
from torch import Tensor

from .workloads import Workload

ScoreFn = Callable[[Tensor, Tensor], Tensor]

#: Implementation names in report order.
IMPL_NAMES = ("maxsim", "eager", "compile", "lik", "flash")
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
    """How many document chunks the eager inference needs so one similarity tensor stays within ``budget``."""
    chunks = max(1, math.ceil(w.sims() * itemsize / max(budget, 1)))
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


class Impl:
    """One implementation under test. Subclasses override what they need."""

    name: str = ""
    description: str = ""

    def unavailable(self, device: torch.device) -> str | None:
        """Why this implementation cannot run at all on ``device`` (None when it can)."""
        return None

    def unsupported(self, w: Workload, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this implementation does not run workload ``w`` (None when it does)."""
        return None

    def scorer(self, w: Workload, device: torch.device, dtype: torch.dtype) -> ScoreFn:
        """The function computing ``w``'s scores from ``(Q, D)``; differentiable in training mode."""
        raise NotImplementedError

    def reset(self) -> None:
        """Drop per-workload state (compiled graphs, caches) after a workload."""

    def version(self) -> str | None:
        return None


class MaxsimImpl(Impl):
    """This library, default settings. ``cross``/``pairs`` may be injected (tests use the reference)."""

    name = "maxsim"
    description = "maxsim.maxsim / maxsim.maxsim_pairs (this library, default settings)"

    def __init__(self, cross: ScoreFn | None = None, pairs: ScoreFn | None = None) -> None:
        self._cross = cross
        self._pairs = pairs

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

    def version(self) -> str | None:
        try:
            import maxsim

            return getattr(maxsim, "__version__", None)
        except ImportError:
            return None


class EagerImpl(Impl):
    """PyLate-style einsum + amax + sum in the input dtype (chunked over documents only where it would not
    fit)."""

    name = "eager"
    description = "einsum -> amax -> sum in the input dtype (PyLate-style)"

    def __init__(self, memory_fraction: float = EAGER_MEMORY_FRACTION) -> None:
        self.memory_fraction = memory_fraction

    def unsupported(self, w: Workload, device: torch.device, dtype: torch.dtype) -> str | None:
        if w.mode == "train":
            need = EAGER_TRAIN_COPIES * w.sims() * dtype.itemsize
            have = free_memory(device)
            if need > 0.9 * have:
                gib = 2**30
                return f"needs ~{need / gib:.1f} GiB for the saved similarities, {have / gib:.1f} GiB free"
        return None

    def _kernel(self, layout: str) -> Callable[[Tensor, Tensor], Tensor]:
        def fn(Q: Tensor, D: Tensor) -> Tensor:
            return eager_scores(layout, Q, D)

        return fn

    def scorer(self, w: Workload, device: torch.device, dtype: torch.dtype) -> ScoreFn:
        fn = self._kernel(w.layout)
        if w.mode == "train":  # chunking would not bound memory: autograd keeps every chunk's similarities
            return fn
        chunks = eager_chunks(w, dtype.itemsize, int(self.memory_fraction * free_memory(device)))
        return chunked_over_documents(w.layout, fn, chunks)

    def version(self) -> str | None:
        return torch.__version__


class CompileImpl(EagerImpl):
    """``torch.compile`` of the eager baseline (static shapes; recompiled per workload)."""

    name = "compile"
    description = "torch.compile(eager, dynamic=False)"

    def _kernel(self, layout: str) -> Callable[[Tensor, Tensor], Tensor]:
        return torch.compile(super()._kernel(layout), dynamic=False)

    def reset(self) -> None:
        torch._dynamo.reset()


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
    description = "late_interaction_kernels.maxsim / maxsim_pairs"

    def _import(self):
        # It checks once (one .item()) whether Q is unit-norm and warns; our tokens are unit-norm anyway.
        os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
        return super()._import()

    def scorer(self, w: Workload, device: torch.device, dtype: torch.dtype) -> ScoreFn:
        lik = self._import()
        if w.layout == "pairs":
            return lambda Q, D: lik.maxsim_pairs(Q, D)
        return lambda Q, D: lik.maxsim(Q, D)


class FlashImpl(_ImportedPeer):
    """flash-maxsim. Inference: ``flash_maxsim_batched(Q, D)`` (cross, shared docs),
    ``flash_maxsim_rerank_padded(Q, D)`` (candidates ``[Nq, K, Ld, dim]``), ``flash_maxsim_pairs(Q, D)``
    (dense pairs). Training: ``flash_maxsim_batched_train(Q, D, shared_docs=True)`` (cross),
    ``shared_docs=False`` with 4-D D (candidates), and pairs as candidates with ``K = 1`` (its only
    differentiable entry point for aligned pairs). Its kernels compute in fp16 internally, whatever the input
    dtype."""

    name = "flash"
    module = "flash_maxsim"
    distribution = "flash-maxsim"
    expected_version = "0.3.0"
    description = "flash_maxsim.flash_maxsim_batched / _rerank_padded / _pairs / flash_maxsim_batched_train"

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


_FACTORIES: dict[str, Callable[[], Impl]] = {
    "maxsim": MaxsimImpl,
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
