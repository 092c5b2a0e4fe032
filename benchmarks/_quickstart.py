"""The quickstart configs' objective, read from ``configs/quickstart.yaml`` itself, so the benchmarks that
time "the quickstart's objective" follow the config instead of a copy of it.

Imported by the scripts beside it; it lives outside the installed package.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from labrl.harness.config import load_run_config
from labrl.harness.objectives import ObjectiveConfig

QUICKSTART_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


@functools.cache
def _config():
    return load_run_config(QUICKSTART_CONFIG)


def quickstart_objective() -> ObjectiveConfig:
    """``configs/quickstart.yaml``'s objective section (CISPO, GRPO advantages, M2PO, KL 0.1)."""
    return _config().objective


def quickstart_learner_fields() -> dict[str, Any]:
    """The ``LearnerConfig`` fields the quickstart's objective needs: the objective and its KL reference."""
    return {"objective": quickstart_objective(), "reference": _config().learner.reference}
