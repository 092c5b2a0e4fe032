"""Shared fixtures for the objectives tests: small synthetic global batches.

With ``--import-mode=importlib`` test modules cannot import this file, so the
helpers are handed out as fixtures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from labrl.harness.objectives import ObjectiveInputs


@dataclass
class SyntheticBatch:
    inputs: ObjectiveInputs
    logits_B_T_V: torch.Tensor  # learner parameters at batch start
    tokens_B_T: torch.Tensor

    def logprobs(self, logits_B_T_V: torch.Tensor, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Log-prob of each token under ``logits`` for the selected rows, shape (b, T)."""
        logp = torch.log_softmax(logits_B_T_V[rows], -1)
        return logp.gather(-1, self.tokens_B_T[rows][..., None]).squeeze(-1)

    def param(self) -> torch.Tensor:
        return self.logits_B_T_V.clone().requires_grad_(True)


def _make_batch(
    B: int = 6,
    T: int = 5,
    seed: int = 0,
    log_w_scale: float = 0.3,
    learner_version: int = 10,
    group_size: int = 3,
    dtype: torch.dtype = torch.float32,
) -> SyntheticBatch:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, 7, generator=g, dtype=dtype)
    tokens = torch.randint(0, 7, (B, T), generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True  # every row has at least one model token
    mu = old - log_w_scale * torch.randn(B, T, generator=g, dtype=dtype)
    versions = torch.where(mask, torch.randint(0, learner_version + 1, (B, T), generator=g), -1)
    rewards = torch.rand(B, generator=g, dtype=dtype)  # continuous: no zero-variance group
    groups = torch.arange(B) // group_size
    inputs = ObjectiveInputs(
        loss_mask_B_T=mask,
        old_logprobs_B_T=old,
        behaviour_logprobs_B_T=mu,
        versions_B_T=versions,
        rewards_B=rewards,
        group_ids_B=groups,
        learner_version=learner_version,
    )
    return SyntheticBatch(inputs, logits, tokens)


@pytest.fixture
def make_batch() -> Callable[..., SyntheticBatch]:
    return _make_batch


@pytest.fixture
def torch_threads() -> int:
    """One intra-op thread a test (tests/conftest.py): the objectives' synthetic batches are too small to split."""
    return 1
