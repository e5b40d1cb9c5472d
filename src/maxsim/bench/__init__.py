"""``maxsim bench``: exact MaxSim implementations timed side by side on named workloads.

* :mod:`.workloads` — the named shapes (inference and training) and their random inputs;
* :mod:`.ragged` — ragged workloads (``varlen``, ``pairlist``): seeded skewed lengths, packed inputs, the padded
  and per-pair layouts other implementations run on, the ragged fp32 reference;
* :mod:`.peers` — adapters: this library (ragged functions and, for ragged workloads, its dense path on padded
  data: ``maxsim-padded``), eager PyTorch, ``torch.compile``, late-interaction-kernels, flash-maxsim;
* :mod:`.runner` — correctness against an fp32 reference, timing, peak memory, roofline floor;
* :mod:`.report` — terminal table, JSON, Markdown and PNG outputs.

Run it with ``maxsim bench`` or ``python -m maxsim bench`` (see ``maxsim bench --help``).
"""

from .peers import IMPL_NAMES, make_impls
from .report import markdown, terminal_table, to_json, validate_json, write_outputs
from .runner import Result, Row, run
from .workloads import WORKLOADS, Workload, select

__all__ = [
    "IMPL_NAMES",
    "WORKLOADS",
    "Result",
    "Row",
    "Workload",
    "make_impls",
    "markdown",
    "run",
    "select",
    "terminal_table",
    "to_json",
    "validate_json",
    "write_outputs",
]
