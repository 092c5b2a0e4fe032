"""Label-based scoring of a phase-identification answer against the known sample.

Phases match on (reduced composition, space-group number). With C the claimed
set and T the true set::

    precision = |C ∩ T| / |C|,   recall = |C ∩ T| / |T|,   F1 = 2PR / (P + R)

Weight-fraction error (only when the answer gives fractions) is the mean
absolute error over C ∪ T, a phase missing on one side counting as 0::

    MAE = mean_{p ∈ C ∪ T} |w_claimed(p) − w_true(p)|

Reward: single-phase tasks score F1. Mixtures score
``(1 − wf_weight) · F1 + wf_weight · max(0, 1 − MAE / mae_scale)``, where the
second term is 0 when no fractions are given. A correct, exact answer scores 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from labrl.verifiers.xrd.answer import ClaimedPhase
from labrl.verifiers.xrd.library import Phase


@dataclass(frozen=True)
class LabelScore:
    precision: float
    recall: float
    f1: float
    wf_mae: float | None
    reward: float


def label_score(
    claimed: list[ClaimedPhase],
    truth: list[tuple[Phase, float]],
    *,
    wf_weight: float = 0.2,
    mae_scale: float = 0.25,
) -> LabelScore:
    claimed_w = {c.phase.key: c.weight_fraction for c in claimed}
    true_w = {p.key: w for p, w in truth}
    hits = len(set(claimed_w) & set(true_w))
    precision = hits / len(claimed_w) if claimed_w else 0.0
    recall = hits / len(true_w)
    f1 = 2 * precision * recall / (precision + recall) if hits else 0.0
    mae = None
    if claimed_w and all(w is not None for w in claimed_w.values()):
        keys = set(claimed_w) | set(true_w)
        mae = sum(abs((claimed_w.get(k) or 0.0) - true_w.get(k, 0.0)) for k in keys) / len(keys)
    if len(truth) == 1:
        reward = f1
    else:
        wf_term = 0.0 if mae is None else max(0.0, 1.0 - mae / mae_scale)
        reward = (1.0 - wf_weight) * f1 + wf_weight * wf_term
    return LabelScore(precision=precision, recall=recall, f1=f1, wf_mae=mae, reward=reward)
