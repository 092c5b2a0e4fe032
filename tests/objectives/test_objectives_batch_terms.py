"""``batch_terms``: what ``prepare`` computes from the rollout alone, done once (on the host, by a learner)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labrl.errors import ConfigError, LearnerError
from labrl.harness.objectives import (
    M2PO,
    TIS,
    BatchInputs,
    GeoMask,
    IcePop,
    ObjectiveConfig,
    batch_terms,
    prepare,
    prepare_rows,
)

CONFIGS = [
    ObjectiveConfig(),
    ObjectiveConfig(
        loss="ppo", advantages="rloo", corrections=[TIS(level="sequence", c=1.5), M2PO(tau=0.02)]
    ),
    ObjectiveConfig(
        advantages="whiten", corrections=[IcePop(low=0.8, high=1.25), GeoMask(low=0.9, high=1.1)]
    ),
]


def _detached_copy(batch: BatchInputs) -> BatchInputs:
    """The batch as a learner's host copy is: other tensors with the same values."""
    return dataclasses.replace(
        batch,
        **{
            f.name: getattr(batch, f.name).clone()
            for f in dataclasses.fields(batch)
            if f.name != "learner_version"
        },
    )


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "rloo-tis-seq-m2po", "whiten-icepop-geo"])
def test_prepare_with_terms_from_a_copy_equals_prepare_alone(make_batch, cfg) -> None:
    sb = make_batch(B=9, T=8, seed=4, log_w_scale=0.5)
    sb.inputs.behaviour_logprobs_B_T[2, 3] = float("nan")  # a dropped sampler log-prob: not valid
    alone = prepare(cfg, sb.inputs)
    terms = batch_terms(cfg, _detached_copy(sb.inputs.batch))
    given = prepare(cfg, sb.inputs, terms)
    for f in dataclasses.fields(alone):
        a, b = getattr(alone, f.name), getattr(given, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    # the terms' own metrics are those of the rollout alone, and prepare adds the learner's on top
    assert set(terms.metrics) >= {"tokens/valid", "tokens/nonfinite_behaviour", "seqs/valid", "adv/mean"}
    assert any(k.startswith("staleness/") for k in terms.metrics)
    assert not any(k.startswith(("mismatch/", "corrections/")) for k in terms.metrics)
    assert terms.metrics["tokens/nonfinite_behaviour"] == 1.0
    assert terms.num_valid_tokens == int(sb.inputs.loss_mask_B_T.sum()) - 1


def test_terms_without_metrics_read_nothing_more_and_feed_prepare_rows(make_batch) -> None:
    sb = make_batch(B=6, T=7, seed=3, log_w_scale=0.4)
    cfg = ObjectiveConfig(corrections=[TIS(c=1.5)])
    terms = batch_terms(cfg, sb.inputs.batch, metrics=False)
    assert terms.metrics == {}
    with_metrics = batch_terms(cfg, sb.inputs.batch)
    assert torch.equal(terms.advantages_B, with_metrics.advantages_B)
    assert torch.equal(terms.valid_B_T, with_metrics.valid_B_T)
    rows = torch.tensor([4, 1])
    part = prepare_rows(cfg, sb.inputs, rows, terms)
    want = prepare(cfg, sb.inputs).select(rows)
    assert torch.equal(part.weight_B_T, want.weight_B_T) and torch.equal(part.keep_B_T, want.keep_B_T)
    assert part.metrics == {}


def test_the_batch_is_validated_without_the_learner_log_probs(make_batch) -> None:
    sb = make_batch()
    bad = dataclasses.replace(sb.inputs.batch, rewards_B=sb.inputs.rewards_B.clone())
    bad.rewards_B[1] = float("nan")
    with pytest.raises(ConfigError, match="rewards_B has non-finite values"):
        batch_terms(ObjectiveConfig(), bad)
    newer = dataclasses.replace(sb.inputs.batch, learner_version=0)
    with pytest.raises(ConfigError, match="newer than learner_version 0"):
        batch_terms(ObjectiveConfig(), newer)


def test_the_learner_log_probs_are_still_checked_when_terms_are_given(make_batch) -> None:
    sb = make_batch()
    cfg = ObjectiveConfig()
    terms = batch_terms(cfg, sb.inputs.batch)
    old = sb.inputs.old_logprobs_B_T.clone()
    old[0, 0] = float("nan")  # column 0 is on the loss mask in every row
    with pytest.raises(LearnerError, match="1 non-finite values"):
        prepare(cfg, dataclasses.replace(sb.inputs, old_logprobs_B_T=old), terms)
    with pytest.raises(ConfigError, match="old_logprobs_B_T has shape"):
        prepare(cfg, dataclasses.replace(sb.inputs, old_logprobs_B_T=old[:, :-1]), terms)


def test_terms_of_another_batch_are_refused(make_batch) -> None:
    cfg = ObjectiveConfig()
    other = batch_terms(cfg, make_batch(B=6, T=4).inputs.batch)
    sb = make_batch(B=6, T=5)
    with pytest.raises(ConfigError, match=r"batch terms of shape \(6, 4\) for a batch of \(6, 5\)"):
        prepare(cfg, sb.inputs, other)
    with pytest.raises(ConfigError, match="batch terms of shape"):
        prepare_rows(cfg, sb.inputs, torch.tensor([0]), other)


def test_terms_move_their_tensors_only(make_batch) -> None:
    terms = batch_terms(ObjectiveConfig(), make_batch().inputs.batch)
    moved = terms.to(torch.device("cpu"))
    assert torch.equal(moved.valid_B_T, terms.valid_B_T) and torch.equal(
        moved.advantages_B, terms.advantages_B
    )
    assert (moved.num_valid_tokens, moved.num_valid_seqs, moved.metrics) == (
        terms.num_valid_tokens,
        terms.num_valid_seqs,
        terms.metrics,
    )
