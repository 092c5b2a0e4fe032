"""Pieces of the run configs that the end-to-end training tests share."""

from __future__ import annotations

from typing import Any


def replay_training(micro_batch_size: int) -> dict[str, Any]:
    """The ``learner`` and ``objective`` blocks of the tests' pipeline runs: CISPO with M2PO
    corrections, lr 1e-3, router replay on."""
    return {
        "learner": {"optimizer": {"lr": 1e-3}, "micro_batch_size": micro_batch_size, "router_replay": True},
        "objective": {"loss": "cispo", "corrections": ["m2po"]},
    }
