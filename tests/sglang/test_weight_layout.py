"""Pure checks of what a weight update moves: HF names/layout, buckets, and the TP/EP shard gather."""

from __future__ import annotations

import pytest
import torch
from weight_sync_support import MODELS, megatron_state, model_parallel_shards, transformers_checkpoint_layout

from labrl.errors import ConfigError
from labrl.harness.models.hf_export import head_dim, hf_weights, megatron_to_hf
from labrl.harness.models.parallel_gather import gather_model_parallel_shards
from labrl.harness.samplers.sglang.dist import plan_buckets

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("case", sorted(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_tensors_are_the_transformers_checkpoint(case, dtype):
    """Names, shapes and dtypes of ``hf_weights`` == the transformers class's checkpoint for the config."""
    cfg = MODELS[case]
    state = {k: v.to(dtype) for k, v in megatron_state(cfg, seed=1).items()}
    sent = {k: (tuple(v.shape), v.dtype) for k, v in hf_weights(state, cfg).items()}
    assert sent == transformers_checkpoint_layout(cfg, dtype)
    assert not any(k.startswith("decoder.") or "linear_fc" in k for k in sent)


def test_export_dtype_follows_training_dtype_unless_forced():
    cfg = MODELS["qwen3_moe"]
    state = megatron_state(cfg, seed=1)
    assert {v.dtype for v in hf_weights(state, cfg).values()} == {torch.float32}
    bf16 = {k: v.bfloat16() for k, v in state.items()}
    assert {v.dtype for v in hf_weights(bf16, cfg).values()} == {torch.bfloat16}
    assert {v.dtype for v in hf_weights(state, cfg, dtype=torch.bfloat16).values()} == {torch.bfloat16}


def test_plan_buckets_bounds_size_keeps_order_and_isolates_big_tensors():
    assert plan_buckets([4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert plan_buckets([4, 20, 4, 3, 1], 8) == [range(0, 1), range(1, 2), range(2, 5)]
    assert plan_buckets([], 8) == []
    assert plan_buckets([3], 1) == [range(0, 1)]
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        plan_buckets([1], 0)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_mixed"])
def test_gather_tp2_ep2_shards_equals_tp1_export(case):
    cfg = MODELS[case]
    state = megatron_state(cfg, seed=2)
    shards = model_parallel_shards(state, tp=2, ep=2, num_experts=cfg.num_experts)
    # a shard is really a piece: rank (1, 1) holds half the qkv rows and the second half of the experts
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[(1, 1)][qkv].shape[0] == state[qkv].shape[0] // 2
    local = cfg.num_experts // 2
    assert f"decoder.layers.0.mlp.experts.local_experts.{local}.linear_fc1.weight" not in shards[(1, 1)]
    assert torch.equal(  # local expert 0 of EP rank 1 is global expert E/2
        shards[(0, 1)]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"],
        state[f"decoder.layers.0.mlp.experts.local_experts.{local}.linear_fc2.weight"].chunk(2, dim=1)[0],
    )
    gathered = gather_model_parallel_shards(shards, tp=2, ep=2, num_experts=cfg.num_experts)
    assert set(gathered) == set(state)
    for name, full in state.items():
        assert torch.equal(gathered[name], full), name
    hf_full, hf_gathered = megatron_to_hf(state, cfg), megatron_to_hf(gathered, cfg)
    assert all(torch.equal(hf_gathered[k], v) for k, v in hf_full.items())
    # the qkv pieces hold whole query groups: the gathered q of head 0 is the TP=1 q of head 0
    d = head_dim(cfg)
    assert torch.equal(
        hf_gathered["model.layers.0.self_attn.q_proj.weight"][:d],
        hf_full["model.layers.0.self_attn.q_proj.weight"][:d],
    )


def test_gather_refuses_missing_ranks_and_diverged_replicas():
    cfg = MODELS["qwen3_moe"]
    state = megatron_state(cfg, seed=2)
    shards = model_parallel_shards(state, tp=2, ep=2, num_experts=cfg.num_experts)
    partial = {k: v for k, v in shards.items() if k != (1, 0)}
    with pytest.raises(ConfigError, match=r"shards cover ranks"):
        gather_model_parallel_shards(partial, tp=2, ep=2, num_experts=cfg.num_experts)
    shards[(1, 0)]["decoder.final_layernorm.weight"] = shards[(1, 0)]["decoder.final_layernorm.weight"] + 1
    with pytest.raises(ConfigError, match="differs across tensor-parallel ranks"):
        gather_model_parallel_shards(shards, tp=2, ep=2, num_experts=cfg.num_experts)


def test_receiver_allocates_on_cuda_for_nccl_and_on_the_host_for_gloo():
    from labrl.harness.samplers.sglang.dist import receive_device

    assert receive_device("nccl") == torch.device("cuda", 0)
    assert receive_device("gloo") == torch.device("cpu")
    assert receive_device("nccl", "cuda:1") == torch.device("cuda:1")
