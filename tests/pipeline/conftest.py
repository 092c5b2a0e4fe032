"""Shared set-up of the pipeline tests (the fakes module, pipeline_fakes.py, is on pytest's pythonpath)."""

from __future__ import annotations

import pytest

from labrl.envs import deregister, register


@pytest.fixture
def letter_env():
    register("test/letter-v0", entry_point="pipeline_fakes:LetterEnv")
    yield "test/letter-v0"
    deregister("test/letter-v0")


@pytest.fixture
def torch_threads() -> int:
    """One intra-op thread a test (tests/conftest.py): the pipeline's tensors are too small to split, and the runner runs its learner and sampler at `pipeline.torch_threads = 1`."""
    return 1
