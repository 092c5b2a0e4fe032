"""Shared set-up of the pipeline tests: the fakes module is importable from here."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

torch.set_num_threads(1)
