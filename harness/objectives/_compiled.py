"""``loss_terms`` through ``torch.compile``: the per-micro-batch objective as a few fused kernels.

Eager, a micro-batch's objective is ~40 elementwise and reduction launches forward and ~12 backward
(``benchmarks/step_profile.py --count-ops``), each over the same (b, T) tokens: a launch-bound GPU
step pays a launch for each, and a large one reads and writes the whole (b, T) again each time.
Inductor fuses them: on CPU the forward is one C++ kernel and the backward another; on CUDA a few
Triton kernels. Each call pays dynamo's guards and AOTAutograd's wrappers instead, so it is opt-in
(``learner.objective_kernel: compiled``): on the CPU it is slower (``benchmarks/compiled_objective.py``),
on a GPU not yet measured.

One compiled graph serves every batch: ``dynamic=True`` makes the sizes symbols, and the global counts
(denominator, valid tokens, valid rows) reach ``loss_terms`` as arguments, which dynamo keeps as
symbols too (as attributes of ``PreparedBatch`` it would specialise on each value and recompile per
batch). A new graph is compiled only for what changes the computation: another ``ObjectiveConfig``,
a reference policy or none, ``proximal_is_current`` or not, a micro-batch of one row (sizes 0 and 1
are always specialised).
``fullgraph=True``: a graph break would be a silent fall back to eager per op, so it is an error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def compiled_loss_terms() -> Callable[..., Any]:
    """``loss_terms`` compiled, once per process (compilation itself happens at the first call)."""
    from ._objective import loss_terms

    return torch.compile(loss_terms, dynamic=True, fullgraph=True)
