"""Shared set-up of the pipeline tests: the fakes module is importable from here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from labrl.envs import deregister, register

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

torch.set_num_threads(1)


@pytest.fixture
def letter_env():
    register("test/letter-v0", entry_point="pipeline_fakes:LetterEnv")
    yield "test/letter-v0"
    deregister("test/letter-v0")
