"""Diagnostics on hand-computed batches, and ``prepare`` / ``policy_loss`` input errors."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from labrl.errors import ConfigError, LearnerError
from labrl.harness.objectives import (
    ObjectiveConfig,
    ObjectiveInputs,
    effective_sample_size,
    mismatch_kl,
    policy_loss,
    prepare,
    quantiles,
    ratio_stats,
    staleness_stats,
)

ROW = torch.ones(1, 2, dtype=torch.bool)


def test_mismatch_kl_k1_k3() -> None:
    lw = torch.tensor([[math.log(2.0), math.log(0.5)]])  # w = 2, 0.5
    m = mismatch_kl(lw, ROW)
    assert m["mismatch/kl_k1"] == pytest.approx(0.0, abs=1e-7)
    # k3 = mean(w - 1 - log w) = ((1 - log 2) + (-0.5 + log 2)) / 2
    assert m["mismatch/kl_k3"] == pytest.approx(0.25, abs=1e-7)
    assert m["mismatch/kl_k2"] == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-7)


def test_effective_sample_size() -> None:
    lw = torch.tensor([[0.0, math.log(3.0)]])  # w = 1, 3: (4)^2 / (2 * 10)
    assert effective_sample_size(lw, ROW) == pytest.approx(0.8)
    assert effective_sample_size(torch.zeros(1, 2), ROW) == pytest.approx(1.0)
    extreme = torch.tensor([[50.0, -50.0]])  # one weight dominates: ESS -> 1/n
    assert effective_sample_size(extreme, ROW) == pytest.approx(0.5)
    assert effective_sample_size(lw, torch.zeros(1, 2, dtype=torch.bool)) is None


def test_quantiles_interpolate() -> None:
    v = torch.tensor([5.0, 1.0, 3.0, 2.0, 4.0])
    assert quantiles(v, (0.0, 0.1, 0.5, 0.9, 1.0)) == pytest.approx([1.0, 1.4, 3.0, 4.6, 5.0])


def test_ratio_stats() -> None:
    lw = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]))
    m = ratio_stats(lw, torch.ones(1, 5, dtype=torch.bool))
    assert m["ratio/q50"] == pytest.approx(3.0)
    assert m["ratio/q10"] == pytest.approx(1.4)
    assert (m["ratio/min"], m["ratio/max"], m["ratio/mean"]) == pytest.approx((1.0, 5.0, 3.0))
    assert ratio_stats(lw, torch.zeros(1, 5, dtype=torch.bool)) == {}


def test_staleness_stats() -> None:
    versions = torch.tensor([[5, 4, 2, -1], [0, 5, 5, 5]])
    valid = torch.tensor([[True, True, True, False], [True, False, False, False]])
    m = staleness_stats(versions, valid, learner_version=5)  # staleness 0, 1, 3, 5
    assert m["staleness/mean"] == pytest.approx(9 / 4)
    assert m["staleness/max"] == 5.0
    assert (
        m["staleness/frac_0"]
        == m["staleness/frac_1"]
        == m["staleness/frac_2_3"]
        == m["staleness/frac_4_7"]
        == 0.25
    )
    assert m["staleness/frac_256_plus"] == 0.0
    assert sum(v for k, v in m.items() if k.startswith("staleness/frac")) == pytest.approx(1.0)
    assert staleness_stats(versions, torch.zeros_like(valid), 5) == {}


def test_prepare_reports_every_diagnostic(make_batch) -> None:
    sb = make_batch(seed=3)
    p = prepare(ObjectiveConfig(corrections=["tis", "token_mask", "geo_mask", "veto", "m2po"]), sb.inputs)
    for key in (
        "tokens/valid", "tokens/nonfinite_behaviour", "seqs/valid", "adv/zero_variance_groups",
        "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/ess", "ratio/q01", "ratio/q50", "ratio/q99",
        "staleness/mean", "staleness/max", "staleness/frac_0", "tis_token/truncated_frac",
        "token_mask/masked_frac", "geo_mask/masked_frac", "veto/masked_frac", "m2po/masked_frac",
        "m2po/second_moment_after", "corrections/kept_frac",
    ):  # fmt: skip
        assert key in p.metrics, key
        assert math.isfinite(p.metrics[key])
    assert p.metrics["tokens/valid"] == float(sb.inputs.loss_mask_B_T.sum())


def test_select_keeps_global_denominator(make_batch) -> None:
    sb = make_batch(seed=2)
    p = prepare(ObjectiveConfig(), sb.inputs)
    by_list = p.select([0, 2])
    by_mask = p[torch.tensor([True, False, True, False, False, False])]
    by_slice = p[0:3:2]
    for sub in (by_list, by_mask, by_slice):
        assert sub.batch_size == 2
        assert sub.denominator == p.denominator and sub.metrics is p.metrics
        assert torch.equal(sub.keep_B_T, p.keep_B_T[[0, 2]])


def _inputs(**kw) -> ObjectiveInputs:
    base = dict(
        loss_mask_B_T=torch.tensor([[True, True], [True, False]]),
        old_logprobs_B_T=torch.full((2, 2), -1.0),
        behaviour_logprobs_B_T=torch.full((2, 2), -1.1),
        versions_B_T=torch.tensor([[2, 2], [1, -1]]),
        rewards_B=torch.tensor([1.0, 0.0]),
        group_ids_B=torch.tensor([0, 0]),
        learner_version=3,
    )
    return ObjectiveInputs(**(base | kw))


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"loss_mask_B_T": torch.ones(2, 2)}, ConfigError, "loss_mask_B_T must be bool, got torch.float32"),
        (
            {"behaviour_logprobs_B_T": torch.zeros(2, 3)},
            ConfigError,
            "behaviour_logprobs_B_T has shape (2, 3), expected (2, 2) like loss_mask_B_T",
        ),
        ({"rewards_B": torch.zeros(3)}, ConfigError, "rewards_B has shape (3,), expected (2,)"),
        (
            {"rewards_B": torch.tensor([1.0, float("nan")])},
            ConfigError,
            "rewards_B has non-finite values: untrainable episodes must be dropped before the objective",
        ),
        (
            {"versions_B_T": torch.tensor([[2, 4], [1, -1]])},
            ConfigError,
            "versions_B_T has version 4 newer than learner_version 3",
        ),
        (
            {"versions_B_T": torch.tensor([[2, -1], [1, -1]])},
            ConfigError,
            "versions_B_T has a negative version on a loss-mask token",
        ),
        (
            {"group_ids_B": torch.tensor([0.0, 1.0])},
            ConfigError,
            "group_ids_B must be an integer tensor, got torch.float32",
        ),
        (
            {"old_logprobs_B_T": torch.tensor([[-1.0, float("nan")], [-1.0, float("nan")]])},
            LearnerError,
            "old_logprobs_B_T has 1 non-finite values on loss-mask tokens",
        ),
    ],
)
def test_prepare_rejects_bad_inputs(kw: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        prepare(ObjectiveConfig(), _inputs(**kw))


def test_kl_without_reference_and_wrong_logprob_shape() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("kl_coef > 0 requires ref_logprobs_B_T in ObjectiveInputs")
    ):
        prepare(ObjectiveConfig(kl_coef=0.1), _inputs())
    p = prepare(ObjectiveConfig(), _inputs())
    with pytest.raises(ConfigError, match=re.escape("logprobs_B_T has shape (1, 2), expected (2, 2)")):
        policy_loss(ObjectiveConfig(), torch.zeros(1, 2), p)


def test_padding_garbage_does_not_leak(make_batch) -> None:
    sb = make_batch(seed=7)
    cfg = ObjectiveConfig(loss="ppo")
    p = prepare(cfg, sb.inputs)
    logp = sb.logprobs(sb.logits_B_T_V).detach()
    garbage = torch.where(p.valid_B_T, logp, float("nan")).requires_grad_(True)
    clean = logp.clone().requires_grad_(True)
    lg, _ = policy_loss(cfg, garbage, p)
    lc, _ = policy_loss(cfg, clean, p)
    lg.backward()
    lc.backward()
    assert lg.item() == lc.item()
    assert torch.equal(garbage.grad, clean.grad)


def test_from_train_batch() -> None:
    from labrl.harness.types import TrainBatch

    x = _inputs()
    batch = TrainBatch(
        tokens_B_T=torch.zeros(2, 2, dtype=torch.long),
        attention_mask_B_T=torch.ones(2, 2, dtype=torch.bool),
        loss_mask_B_T=x.loss_mask_B_T,
        behaviour_logprobs_B_T=x.behaviour_logprobs_B_T,
        versions_B_T=x.versions_B_T,
        rewards_B=x.rewards_B,
        group_ids_B=x.group_ids_B,
    )
    built = ObjectiveInputs.from_train_batch(batch, x.old_logprobs_B_T, learner_version=3)
    for f in dataclasses.fields(ObjectiveInputs):
        a, b = getattr(built, f.name), getattr(x, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    assert prepare(ObjectiveConfig(), built).metrics["staleness/mean"] == pytest.approx(4 / 3)
