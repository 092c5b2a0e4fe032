"""Model shapes beyond the presets: dense + MoE layers (moe_layer_freq > 1) and kv_channels != hidden/heads."""

import asyncio
import dataclasses
import re

import pytest
import torch

from labrl.errors import ConfigError
from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import build_gpt_model, count_parameters, get_preset
from labrl.harness.models.routing import model_router_replays
from labrl.harness.rollout.batching import collate
from labrl.harness.samplers import LocalSampler

SMALL = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 96, "moe_ffn_hidden_size": 48}
# layers 0 and 2 carry 8 experts, layers 1 and 3 a dense SwiGLU MLP of width 96
MIXED = get_preset("tiny-moe").model_copy(update={**SMALL, "name": "mixed", "moe_layer_freq": 2})
# 4 heads of width 24 (hidden/heads = 16) with QK-norm and 2 query groups
WIDE_HEADS = get_preset("tiny-moe").model_copy(
    update={
        **SMALL,
        "name": "wide-heads",
        "num_layers": 2,
        "kv_channels": 24,
        "num_query_groups": 2,
        "qk_layernorm": True,
    }
)


def test_moe_layer_freq_builds_dense_and_moe_layers():
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert MIXED.moe_layer_indices == [0, 2] and MIXED.num_moe_layers == 2
    model = build_gpt_model(MIXED, seed=0)
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    assert kinds == [MoELayer, MLP, MoELayer, MLP]
    assert len(model_router_replays(model)) == 2
    state = model.state_dict()
    assert tuple(state["decoder.layers.1.mlp.linear_fc1.weight"].shape) == (2 * 96, 64)
    assert tuple(state["decoder.layers.2.mlp.router.weight"].shape) == (8, 64)
    assert "decoder.layers.1.mlp.router.weight" not in state
    # embeddings 264x64 + output 264x64; per layer: norms 2x64, qkv 192x64, proj 64x64;
    # MoE layer: router 8x64 + 8 experts x (96x64 + 64x48); dense layer: 192x64 + 64x96
    attention = 2 * 64 + 192 * 64 + 64 * 64
    moe = 8 * 64 + 8 * (96 * 64 + 64 * 48)
    dense = 192 * 64 + 64 * 96
    assert count_parameters(model) == 2 * 264 * 64 + 64 + 4 * attention + 2 * moe + 2 * dense


def _round(sampler, reqs):
    return asyncio.run(sampler.generate(reqs))


@pytest.mark.parametrize("cfg", [MIXED, WIDE_HEADS], ids=["mixed", "wide-heads"])
def test_sampler_learner_agree_and_train_with_replay(cfg, h):
    learner = MegatronLearner(LearnerConfig(model=cfg, micro_batch_size=4))
    sampler = LocalSampler(cfg, weights=learner.export_weights(), version=learner.version)
    reqs = h.requests(4, max_new=8)
    results = _round(sampler, reqs)
    for r, res in zip(reqs, results, strict=True):
        # routed experts cover the MoE layers only: [P + N, moe_layers, topk]
        assert res.routed_experts_T_L_K.shape == (len(r.input_ids) + 8, cfg.num_moe_layers, 2)
    batch = collate(h.as_trajectories(reqs, results), pad_token_id=256)
    mask = batch.loss_mask_B_T
    diff = (learner.logprobs(batch.tokens_B_T) - batch.behaviour_logprobs_B_T)[mask].abs().max()
    assert float(diff) < 1e-4
    own = learner.route(batch.tokens_B_T)
    assert own.shape[2] == cfg.num_moe_layers
    real = batch.attention_mask_B_T.clone()
    real[torch.arange(batch.batch_size), batch.attention_mask_B_T.sum(1) - 1] = False
    same = (own.sort(-1).values == batch.routed_experts_B_T_L_K.sort(-1).values).all(-1).all(-1)
    assert bool(same[real].all())
    before = {k: v.clone() for k, v in learner.export_weights().items()}
    metrics = learner.train_step(batch)
    assert metrics["learner/router_replay"] == 1.0 and metrics["learner/grad_norm"] > 0
    after = learner.export_weights()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    # every kind of weight learns: q/k norms (wide-heads), dense MLPs (mixed), experts, routers
    names = " ".join(moved)
    assert "router" in names and "local_experts" in names and "linear_qkv" in names
    if cfg is MIXED:
        assert "decoder.layers.1.mlp.linear_fc1.weight" in moved
    else:
        assert "decoder.layers.0.self_attention.q_layernorm.weight" in moved


def test_wide_heads_have_head_sized_qk_norms():
    model = build_gpt_model(WIDE_HEADS, seed=0)
    state = model.state_dict()
    layer = "decoder.layers.0.self_attention."
    assert tuple(state[layer + "q_layernorm.weight"].shape) == (24,)
    assert tuple(state[layer + "k_layernorm.weight"].shape) == (24,)
    # 4 query heads + 2 key + 2 value heads of 24 = 192 rows; the projection maps 4 x 24 back to 64
    assert tuple(state[layer + "linear_qkv.weight"].shape) == (192, 64)
    assert tuple(state[layer + "linear_proj.weight"].shape) == (64, 96)
    ids = torch.randint(0, 264, (2, 9), generator=torch.Generator().manual_seed(0))
    from labrl.harness.models import causal_attention_mask

    logits = model(ids, torch.arange(9).expand(2, 9), causal_attention_mask(9))
    logits.float().logsumexp(-1).sum().backward()
    grad = model.decoder.layers[0].self_attention.q_layernorm.weight.grad
    assert grad is not None and grad.shape == (24,) and float(grad.abs().sum()) > 0


def test_routing_of_all_layers_is_refused_by_a_mixed_learner(h):
    learner = MegatronLearner(LearnerConfig(model=MIXED, micro_batch_size=4))
    reqs = h.requests(1, max_new=2)
    results = _round(LocalSampler(MIXED, weights=learner.export_weights()), reqs)
    batch = collate(h.as_trajectories(reqs, results), pad_token_id=256)
    B, T = batch.tokens_B_T.shape
    # routing over all 4 layers (SGLang's wire layout) instead of the 2 MoE layers
    wire = dataclasses.replace(batch, routed_experts_B_T_L_K=torch.zeros(B, T, 4, 2, dtype=torch.long))
    msg = f"TrainBatch.routed_experts_B_T_L_K has shape ({B}, {T}, 4, 2), expected ({B}, {T}, 2, 2)"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        learner.train_step(wire)


TIED = get_preset("tiny-moe").model_copy(update={**SMALL, "name": "tied", "tie_embeddings": True})


@pytest.mark.parametrize("cfg", [get_preset("tiny-moe"), MIXED, WIDE_HEADS, TIED], ids=lambda c: c.name)
def test_the_configs_parameter_count_is_the_built_models(cfg):
    """``parameter_count`` (the precision rule reads it before any model exists) counts what is built."""
    assert cfg.parameter_count == count_parameters(build_gpt_model(cfg, seed=0))
