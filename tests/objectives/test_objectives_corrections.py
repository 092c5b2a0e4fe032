"""Behaviour corrections: TIS caps, masks, veto, M2PO; alone and through ``prepare``."""

from __future__ import annotations

import math

import pytest
import torch

from labrl.harness.objectives import (
    M2PO,
    TIS,
    GeoMask,
    ObjectiveConfig,
    ObjectiveInputs,
    TokenMask,
    Veto,
    geo_mask,
    m2po_mask,
    prepare,
    tis_sequence_weights,
    tis_token_truncated,
    tis_token_weights,
    token_mask,
    veto_mask,
)

ALL = torch.ones(1, 5, dtype=torch.bool)


def _lw(*ratios: float) -> torch.Tensor:
    return torch.tensor([[math.log(r) for r in ratios]])


def test_tis_token_saturates_at_c() -> None:
    lw = _lw(3.0, 0.5, 1.5, 1e6, 1.0)
    w, truncated = tis_token_weights(lw, ALL, c=2.0), tis_token_truncated(lw, ALL, c=2.0)
    assert w.tolist()[0] == pytest.approx([2.0, 0.5, 1.5, 2.0, 1.0], abs=1e-6)
    assert truncated.tolist()[0] == [True, False, False, True, False]


def test_tis_token_leaves_invalid_tokens_at_one() -> None:
    valid = torch.tensor([[True, False, True, True, True]])
    lw = _lw(3.0, 3.0, 1.0, 1.0, 1.0)
    w, truncated = tis_token_weights(lw, valid, c=2.0), tis_token_truncated(lw, valid, c=2.0)
    assert w.tolist()[0] == pytest.approx([2.0, 1.0, 1.0, 1.0, 1.0], abs=1e-6)
    assert truncated.tolist()[0] == [True, False, False, False, False]


def test_tis_sequence_caps_the_product() -> None:
    lw = torch.tensor([[math.log(2), math.log(2), 0.0], [math.log(3), math.log(2), 0.0]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    w, truncated_B = tis_sequence_weights(lw, valid, c=5.0)
    # row 0: 2*2 = 4 < 5; row 1: 3*2 = 6 -> 5; one weight for every valid token of the row
    assert w.tolist()[0] == pytest.approx([4.0, 4.0, 1.0], abs=1e-5)
    assert w.tolist()[1] == pytest.approx([5.0, 5.0, 5.0], abs=1e-5)
    assert truncated_B.tolist() == [False, True]


def test_token_mask_removes_exactly_the_tokens_outside_the_band() -> None:
    keep = token_mask(_lw(0.3, 0.6, 1.0, 4.5, 6.0), ALL, low=0.5, high=5.0)
    assert keep.tolist()[0] == [False, True, True, True, False]


def test_geo_mask_drops_whole_sequences() -> None:
    lw = torch.tensor([[0.01, 0.0, 0.0], [0.02, 0.02, 0.02], [-0.02, -0.02, 0.5], [0.9, 0.0, 0.0]])
    valid = torch.tensor(
        [[True, True, False], [True, True, True], [True, True, False], [False, False, False]]
    )
    # means: 0.005 (inside log[0.99, 1.01] = [-0.01005, 0.00995]), 0.02, -0.02 (0.5 is invalid), empty row kept
    assert geo_mask(lw, valid, 0.99, 1.01).tolist() == [True, False, False, True]


def test_veto_drops_the_sequence_with_any_tiny_ratio() -> None:
    lw = torch.tensor([[0.0, math.log(1e-5), 0.0], [0.0, math.log(1e-3), 0.0], [math.log(1e-9), 0.0, 0.0]])
    valid = torch.tensor([[True, True, True], [True, True, True], [False, True, True]])
    assert veto_mask(lw, valid, floor=1e-4).tolist() == [False, True, True]


# M2PO: row 0 has A > 0, row 1 has A < 0.
M2_LW = torch.tensor([[0.5, 0.1, -0.6], [-0.3, 0.4, 0.05]], dtype=torch.float64)
M2_ADV = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
M2_KEEP = torch.ones(2, 3, dtype=torch.bool)


def test_m2po_masks_largest_active_until_bound() -> None:
    # active: 0.5, 0.1 (A>0, w>1) and -0.3 (A<0, w<1); squares 0.25, 0.01, 0.09 -> M2 = 0.35/3
    res = m2po_mask(M2_LW, M2_KEEP, M2_ADV, tau=0.04)
    assert res.active_B_T.tolist() == [[True, True, False], [True, False, False]]
    assert res.second_moment_before == pytest.approx(0.35 / 3)
    # drop 0.25 -> 0.10/2 = 0.05 > 0.04; drop 0.09 -> 0.01 <= 0.04
    assert res.masked_B_T.tolist() == [[True, False, False], [True, False, False]]
    assert res.second_moment_after == pytest.approx(0.01)
    assert res.second_moment_after <= 0.04
    assert not (res.masked_B_T & ~res.active_B_T).any()  # never outside the active quadrants
    assert res.keep_B_T.tolist() == [[False, True, True], [False, True, True]]


def test_m2po_stops_as_soon_as_the_bound_holds() -> None:
    res = m2po_mask(M2_LW, M2_KEEP, M2_ADV, tau=0.06)  # 0.05 <= 0.06 after one token
    assert res.masked_B_T.tolist() == [[True, False, False], [False, False, False]]
    assert res.second_moment_after == pytest.approx(0.05)


def test_m2po_large_tau_masks_nothing() -> None:
    res = m2po_mask(M2_LW, M2_KEEP, M2_ADV, tau=10.0)
    assert not res.masked_B_T.any()
    assert torch.equal(res.keep_B_T, M2_KEEP)


def test_m2po_respects_earlier_masks() -> None:
    keep = M2_KEEP.clone()
    keep[0, 0] = False  # already removed by an earlier correction: 0.01 and 0.09 remain active
    res = m2po_mask(M2_LW, keep, M2_ADV, tau=0.04)
    assert res.second_moment_before == pytest.approx(0.05)
    assert res.masked_B_T.tolist() == [[False, False, False], [True, False, False]]


def test_m2po_bound_holds_on_random_batches() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        lw = torch.randn(8, 16, generator=g, dtype=torch.float64)
        adv = torch.randn(8, 1, generator=g, dtype=torch.float64).expand(8, 16)
        keep = torch.rand(8, 16, generator=g) > 0.2
        res = m2po_mask(lw, keep, adv, tau=0.04)
        kept_active = res.active_B_T & res.keep_B_T
        m2 = lw[kept_active].square().mean().item() if kept_active.any() else 0.0
        assert m2 <= 0.04 + 1e-12
        assert m2 == pytest.approx(res.second_moment_after)
        assert not (res.masked_B_T & ~res.active_B_T).any()
        # minimal: un-masking the smallest masked token would break the bound
        if res.masked_B_T.any():
            smallest = lw[res.masked_B_T].square().min().item()
            vals = torch.cat([lw[kept_active].square(), torch.tensor([smallest], dtype=torch.float64)])
            assert vals.mean().item() > 0.04


def _inputs(
    log_w_B_T: torch.Tensor, rewards: list[float], mask: torch.Tensor | None = None
) -> ObjectiveInputs:
    B, T = log_w_B_T.shape
    mask = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    old = torch.full((B, T), -1.0, dtype=torch.float64)
    return ObjectiveInputs(
        loss_mask_B_T=mask,
        old_logprobs_B_T=old,
        behaviour_logprobs_B_T=old - log_w_B_T.double(),
        versions_B_T=torch.where(mask, 3, -1),
        rewards_B=torch.tensor(rewards, dtype=torch.float64),
        group_ids_B=torch.zeros(B, dtype=torch.long),
        learner_version=4,
    )


def test_prepare_composes_corrections_in_order() -> None:
    lw = torch.tensor(
        [
            [math.log(3.0), 0.0, 0.0],  # token 0 truncated by TIS, outside token mask [0.5, 2.5]
            [0.0, math.log(1e-5), 0.0],  # vetoed: whole row
            [0.0, 0.0, 0.0],  # on-policy
        ],
        dtype=torch.float64,
    )
    cfg = ObjectiveConfig(loss="ppo", corrections=[TIS(c=2.0), TokenMask(low=0.5, high=2.5), Veto()])
    p = prepare(cfg, _inputs(lw, [1.0, 0.0, 0.5]))
    assert p.keep_B_T.tolist() == [[False, True, True], [False, False, False], [True, True, True]]
    assert p.weight_B_T[0].tolist() == pytest.approx([2.0, 1.0, 1.0])
    assert p.weight_B_T[1].tolist() == pytest.approx([1.0, 1e-5, 1.0])
    m = p.metrics
    assert m["tis_token/truncated_frac"] == pytest.approx(1 / 9)
    # the token mask removes (0,0) and (1,1); the veto then removes the rest of row 1
    assert m["token_mask/masked_frac"] == pytest.approx(2 / 9)
    assert m["veto/masked_frac"] == pytest.approx(2 / 9)
    assert m["veto/masked_seq_frac"] == pytest.approx(1 / 3)
    assert m["corrections/kept_frac"] == pytest.approx(5 / 9)
    assert p.denominator == 9.0  # masked tokens stay in the denominator


def test_prepare_geo_mask_and_m2po() -> None:
    lw = torch.tensor([[0.5, 0.1, -0.6], [-0.3, 0.4, 0.05], [0.05, 0.05, 0.05]], dtype=torch.float64)
    # grpo on rewards [1, 0, 0.5] in one group: A = [+1, -1, 0]
    cfg = ObjectiveConfig(corrections=[M2PO(tau=0.04)])
    p = prepare(cfg, _inputs(lw, [1.0, 0.0, 0.5]))
    assert p.advantages_B.tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)
    assert p.keep_B_T.tolist() == [[False, True, True], [False, True, True], [True, True, True]]
    assert p.metrics["m2po/masked_frac"] == pytest.approx(2 / 9)
    assert p.metrics["m2po/active_frac"] == pytest.approx(3 / 9)
    assert p.metrics["m2po/second_moment_after"] == pytest.approx(0.01)
    cfg = ObjectiveConfig(corrections=[GeoMask(low=0.99, high=1.01)])
    p = prepare(cfg, _inputs(lw, [1.0, 0.0, 0.5]))
    # row means: 0.0, 0.05, 0.05 -> only row 0 is inside the band
    assert p.keep_B_T.tolist() == [[True] * 3, [False] * 3, [False] * 3]
    assert p.metrics["geo_mask/masked_seq_frac"] == pytest.approx(2 / 3)


def test_prepare_tis_sequence_level_defaults_to_cap_5() -> None:
    lw = torch.tensor([[math.log(3.0), math.log(2.0)], [0.0, 0.0]], dtype=torch.float64)
    cfg = ObjectiveConfig(corrections=[TIS(level="sequence")])
    assert cfg.corrections[0].c == 5.0
    p = prepare(cfg, _inputs(lw, [1.0, 0.0]))
    assert p.weight_B_T.flatten().tolist() == pytest.approx([5.0, 5.0, 1.0, 1.0])
    assert p.metrics["tis_sequence/truncated_seq_frac"] == pytest.approx(1 / 2)
