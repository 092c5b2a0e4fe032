"""``prepare_rows``: a row's share of ``prepare`` from that row's proximal log-probs alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labrl.errors import ConfigError
from labrl.harness.objectives import (
    M2PO,
    OPSM,
    TIS,
    GeoMask,
    IcePop,
    ObjectiveConfig,
    TokenMask,
    Veto,
    prepare,
    prepare_rows,
    whole_batch_terms,
)

ROW_LOCAL = [
    [TIS(c=1.5)],
    [TIS(level="sequence", c=1.5)],
    [TokenMask(low=0.8, high=1.25)],
    [IcePop(low=0.8, high=1.25)],
    [GeoMask(low=0.9, high=1.1), Veto(floor=0.5)],
    [OPSM(delta=0.01), TIS(c=2.0)],
]


def _tensors(p) -> dict[str, torch.Tensor]:
    return {
        f.name: getattr(p, f.name)
        for f in dataclasses.fields(p)
        if isinstance(getattr(p, f.name), torch.Tensor)
    }


def test_whole_batch_terms_name_m2po_only() -> None:
    assert whole_batch_terms(ObjectiveConfig(corrections=[])) == ()
    assert whole_batch_terms(ObjectiveConfig()) == ()  # the default: TIS
    every_row_local = [c for corrs in ROW_LOCAL for c in corrs if not isinstance(c, TIS)]
    assert whole_batch_terms(ObjectiveConfig(corrections=[TIS(), *every_row_local])) == ()
    assert whole_batch_terms(ObjectiveConfig(corrections=[TIS(), M2PO(tau=0.04)])) == ("m2po",)


@pytest.mark.parametrize("corrections", ROW_LOCAL, ids=lambda c: "+".join(x.name for x in c))
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_rows_equal_the_whole_batch_selection_with_other_rows_unknown(
    make_batch, corrections, kl_coef
) -> None:
    sb = make_batch(B=6, T=7, seed=3, log_w_scale=0.4)
    ref = sb.inputs.old_logprobs_B_T - 0.05
    inputs = dataclasses.replace(sb.inputs, ref_logprobs_B_T=ref)
    cfg = ObjectiveConfig(loss="ppo", corrections=corrections, kl_coef=kl_coef)
    whole = prepare(cfg, inputs)
    acts = not torch.equal(whole.keep_B_T, whole.valid_B_T) or bool(
        (whole.weight_B_T[whole.valid_B_T] != 1).any()
    )
    assert acts  # the corrections mask or weight some token, so the comparison below can fail
    for rows in (torch.tensor([0, 1, 2]), torch.tensor([5, 3])):
        # what a learner knows mid-batch: these rows' proximal log-probs, zeros elsewhere
        known = torch.zeros_like(inputs.old_logprobs_B_T)
        known[rows] = inputs.old_logprobs_B_T[rows]
        part = prepare_rows(cfg, dataclasses.replace(inputs, old_logprobs_B_T=known), rows)
        want = whole.select(rows)
        for name, t in _tensors(want).items():
            assert torch.equal(_tensors(part)[name], t), name
        assert (part.denominator, part.num_valid_tokens, part.num_valid_seqs) == (
            want.denominator,
            want.num_valid_tokens,
            want.num_valid_seqs,
        )
        assert part.metrics == {}


def test_m2po_refuses_rows(make_batch) -> None:
    sb = make_batch()
    with pytest.raises(ConfigError, match="m2po read the whole batch"):
        prepare_rows(ObjectiveConfig(corrections=[M2PO(tau=0.01)]), sb.inputs, torch.tensor([0]))


def test_m2po_mask_of_a_row_depends_on_the_other_rows(make_batch) -> None:
    """Why M2PO keeps the separate proximal forward: changing row 5 changes row 0's mask."""
    sb = make_batch(B=6, T=7, seed=3, log_w_scale=0.6)
    cfg = ObjectiveConfig(corrections=[M2PO(tau=0.02)])
    keep_0 = prepare(cfg, sb.inputs).keep_B_T[0]
    moved = sb.inputs.old_logprobs_B_T.clone()
    moved[1:] = sb.inputs.behaviour_logprobs_B_T[1:]  # the other rows on-policy: l = 0, nothing to mask there
    keep_0_alone = prepare(cfg, dataclasses.replace(sb.inputs, old_logprobs_B_T=moved)).keep_B_T[0]
    assert not torch.equal(keep_0, keep_0_alone)
