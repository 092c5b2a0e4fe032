"""The compiled objective (``policy_loss(..., compiled=True)``) is the eager one, in one graph per config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from labrl.harness.objectives import (
    M2PO,
    OPSM,
    TIS,
    ObjectiveConfig,
    batch_terms,
    policy_loss,
    prepare,
)

CONFIGS = {
    # the default: CISPO, token-mean, TIS
    "default": ObjectiveConfig(),
    # the quickstart's: M2PO's mask and a KL term to a reference
    "quickstart": ObjectiveConfig(corrections=[M2PO(tau=0.04)], kl_coef=0.1),
    # the other branches: PPO's dual clip, per-sequence aggregation, OPSM on the current policy
    "ppo-dual-seqmean-opsm": ObjectiveConfig(
        loss="ppo", dual_clip_c=3.0, aggregation="seq_mean_token_mean", corrections=[TIS(), OPSM(delta=0.05)]
    ),
    "sapo-seqsum": ObjectiveConfig(loss="sapo", aggregation="seq_sum_constant", aggregation_constant=16.0),
}

# different sizes and so different token counts, each a new value of every symbol; one graph for all
SHAPES = [(6, 5, 0), (6, 9, 1), (4, 12, 2), (9, 7, 3)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own graphs, and no earlier test's graphs fill dynamo's recompile limit
    (past it dynamo runs eager in silence, and compiled would equal eager trivially)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _prepared(cfg, make_batch, B, T, seed):
    batch = make_batch(B=B, T=T, seed=seed)
    inputs = batch.inputs
    if cfg.kl_coef > 0:
        g = torch.Generator().manual_seed(100 + seed)
        ref = inputs.old_logprobs_B_T - 0.2 * torch.rand(B, T, generator=g)
        inputs = dataclasses.replace(inputs, ref_logprobs_B_T=ref)
    prepared = prepare(cfg, inputs, batch_terms(cfg, inputs.batch))
    return batch, prepared


def _loss_grad_metrics(cfg, batch, prepared, compiled):
    logits = batch.param()
    # a step past the proximal policy, so the ratio moves and the clips act
    logp = batch.logprobs(logits * 2.5)
    loss, metrics = policy_loss(cfg, logp, prepared, device_metrics=True, compiled=compiled)
    loss.backward()
    return loss.detach(), logits.grad, metrics


@pytest.mark.parametrize("name", CONFIGS)
def test_compiled_equals_eager_in_one_graph_for_every_batch(name, make_batch):
    cfg = CONFIGS[name]
    graphs_before = counters["stats"]["unique_graphs"]
    clipped = 0.0
    for B, T, seed in SHAPES:
        batch, prepared = _prepared(cfg, make_batch, B, T, seed)
        loss_c, grad_c, metrics_c = _loss_grad_metrics(cfg, batch, prepared, compiled=True)
        loss_e, grad_e, metrics_e = _loss_grad_metrics(cfg, batch, prepared, compiled=False)
        assert metrics_c.names == metrics_e.names
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad_c, grad_e, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(metrics_c.vector, metrics_e.vector, rtol=1e-5, atol=1e-7)
        assert grad_e.abs().sum() > 0
        clipped += float(metrics_e["policy/clip_frac"])
        assert float(metrics_e["policy/abs_log_ratio_mean"]) > 0.1  # the ratio moved: no branch is idle
    assert clipped > 0 or cfg.loss == "sapo"  # the clip branches ran, and agreed (SAPO gates, never clips)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_a_one_row_micro_batch_compiles_once_more_and_agrees(make_batch):
    """Sizes 1 are specialised by dynamo: a one-row micro-batch is the one extra graph a run sees."""
    cfg = CONFIGS["default"]
    graphs_before = counters["stats"]["unique_graphs"]
    batch, prepared = _prepared(cfg, make_batch, 6, 8, 0)
    for rows in (torch.arange(3), torch.arange(3, 6), torch.tensor([5]), torch.tensor([2])):
        sub = dataclasses.replace(
            batch, logits_B_T_V=batch.logits_B_T_V[rows], tokens_B_T=batch.tokens_B_T[rows]
        )
        got = _loss_grad_metrics(cfg, sub, prepared.select(rows), compiled=True)
        want = _loss_grad_metrics(cfg, sub, prepared.select(rows), compiled=False)
        for g, w in zip(got[:2], want[:2], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[2].vector, want[2].vector, rtol=1e-5, atol=1e-7)
    assert counters["stats"]["unique_graphs"] - graphs_before == 2


def test_compiled_refuses_a_micro_batch_of_the_wrong_shape_as_eager_does(make_batch):
    cfg = CONFIGS["default"]
    _, prepared = _prepared(cfg, make_batch, 6, 8, 0)
    with pytest.raises(Exception, match=r"expected \(6, 8\)"):
        policy_loss(cfg, torch.zeros(6, 7), prepared, compiled=True)


def test_objective_inputs_move_every_tensor_and_keep_the_rest(make_batch):
    inputs = make_batch().inputs
    moved = inputs.to(torch.device("meta"))
    assert moved.learner_version == inputs.learner_version and moved.ref_logprobs_B_T is None
    tensors = [
        f.name for f in dataclasses.fields(inputs) if isinstance(getattr(inputs, f.name), torch.Tensor)
    ]
    assert len(tensors) == 6 and all(getattr(moved, name).device.type == "meta" for name in tensors)


@pytest.mark.parametrize("name", ["default", "ppo-dual-seqmean-opsm"])
def test_compiled_equals_eager_where_the_proximal_is_the_forward(name, make_batch):
    """``proximal_is_current`` is a flag dynamo specialises on: its own graph, the eager terms."""
    cfg = CONFIGS[name]
    graphs_before = counters["stats"]["unique_graphs"]
    for B, T, seed in SHAPES[:2]:
        batch, prepared = _prepared(cfg, make_batch, B, T, seed)
        got, want = [], []
        for compiled, out in ((True, got), (False, want)):
            logits = batch.param()
            loss, metrics = policy_loss(
                cfg,
                batch.logprobs(logits),
                prepared,
                device_metrics=True,
                compiled=compiled,
                proximal_is_current=True,
            )
            loss.backward()
            out += [loss.detach(), logits.grad, metrics]
        assert got[2].names == want[2].names and "policy/ratio_mean" not in got[2].names
        for g, w in zip([got[0], got[1], got[2].vector], [want[0], want[1], want[2].vector], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        assert want[1].abs().sum() > 0
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
