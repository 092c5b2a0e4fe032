"""GPU tests: marked ``gpu`` and skipped where CUDA (or SGLang) is absent.

``tests/sglang`` and this folder are put on ``sys.path``: the GPU pipeline test shares its run config,
fixture env and checks with the CPU one (``sglang_pipeline_check``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

SGLANG_TESTS = str(Path(__file__).parent.parent / "sglang")
GPU_TESTS = str(Path(__file__).parent)  # spawned ranks import their worker module (tp2_worker) by name
for _path in (SGLANG_TESTS, GPU_TESTS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from sglang_pipeline_check import parity_env  # noqa: E402, F401 (a fixture, shared with tests/sglang)


def pytest_collection_modifyitems(config, items):
    here = str(config.rootpath / "tests" / "gpu")
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
