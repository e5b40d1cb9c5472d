"""Drop-in call surfaces of other MaxSim libraries, implemented on :mod:`maxsim`'s public functions.

* :mod:`maxsim.compat.erikkaum` — the Python API of ``erikkaum/maxsim`` (the Hugging Face ``kernels`` package):
  ``score_candidates_padded``, ``score_contrastive``, ``score_pairs_packed`` and their ``_with_argmax`` / ``_train``
  variants. Replace ``maxsim = get_kernel("erikkaum/maxsim", ...)`` by ``from maxsim.compat import erikkaum as
  maxsim`` and keep the calls.

These modules are thin adapters: they rename and reshape arguments, nothing more. The math, the validation and the
kernels are those of :mod:`maxsim`.
"""

from . import erikkaum

__all__ = ["erikkaum"]
