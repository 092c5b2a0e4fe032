"""Deterministic item scores and the rubric score formula.

The rubric score (the reward) from per-item scores ``s_i`` in [0, 1]::

    P      = sum of w_i over positive items                  (P > 0: validated)
    raw    = sum_{i positive} w_i * s_i  -  sum_{j negative} w_j * s_j
    score  = clip(raw / P, 0, 1)

so an answer that meets every positive item and no negative item scores 1, a
met negative item costs its weight relative to the positive total, and the
penalties never push the reward below 0. For a negative item ``s_j`` is how
fully the response exhibits the fault (1 = the fault is present).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from labrl.verifiers.rubric.items import ContainsItem, NumericItem, RegexItem, Rubric
from labrl.verifiers.rubric.quantities import matches


def score_deterministic(item: RegexItem | ContainsItem | NumericItem, response: str) -> float:
    """1.0 when ``response`` meets ``item`` (see ``items`` for each kind's rule), else 0.0."""
    if isinstance(item, RegexItem):
        flags = re.IGNORECASE if item.ignore_case else 0
        return 1.0 if re.search(item.pattern, response, flags) else 0.0
    if isinstance(item, ContainsItem):
        haystack = response.casefold() if item.ignore_case else response
        found = [(t.casefold() if item.ignore_case else t) in haystack for t in item.terms]
        return 1.0 if (all(found) if item.match == "all" else any(found)) else 0.0
    return 1.0 if matches(response, item.value, item.tolerance, item.units, item.anchor) else 0.0


def rubric_score(rubric: Rubric, item_scores: Mapping[str, float]) -> tuple[float, float]:
    """``(score, raw)`` per the module formula; ``item_scores`` maps every item id to [0, 1]."""
    raw = 0.0
    for item in rubric.items:
        assert item.id is not None
        s = item_scores[item.id]
        if not 0.0 <= s <= 1.0:
            raise ValueError(f"item {item.id!r} has score {s}, outside [0, 1]")
        raw += item.weight * s if item.polarity == "positive" else -item.weight * s
    return min(1.0, max(0.0, raw / rubric.positive_weight)), raw
