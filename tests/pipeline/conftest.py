"""Shared set-up of the pipeline tests (the fakes module, pipeline_fakes.py, is on pytest's pythonpath)."""

from __future__ import annotations

import pytest
import torch

from labrl.envs import deregister, register

torch.set_num_threads(1)


@pytest.fixture
def letter_env():
    register("test/letter-v0", entry_point="pipeline_fakes:LetterEnv")
    yield "test/letter-v0"
    deregister("test/letter-v0")
