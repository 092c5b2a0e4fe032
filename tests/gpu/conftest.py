"""GPU tests: marked ``gpu`` and skipped where CUDA (or SGLang) is absent.

``tests/sglang`` and this folder are on pytest's ``pythonpath``: the GPU pipeline test shares its run
config, fixture env and checks with the CPU one (``sglang_pipeline_check``), and spawned ranks import
their worker module (``tp2_worker``) by name.
"""

from __future__ import annotations

import pytest
import torch
from sglang_pipeline_check import parity_env  # noqa: F401 (a fixture, shared with tests/sglang)


def pytest_collection_modifyitems(config, items):
    here = str(config.rootpath / "tests" / "gpu")
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
