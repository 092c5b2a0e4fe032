import re

import pytest
import torch

from labrl.errors import ConfigError
from labrl.harness.models import (
    PRESETS,
    MoEModelConfig,
    ParallelConfig,
    build_gpt_model,
    count_parameters,
    ensure_model_parallel,
    get_preset,
)
from labrl.harness.models.cpu_compat import apply_cpu_workarounds


def test_presets_have_moe_shapes():
    tiny = get_preset("tiny-moe")
    assert (tiny.num_experts, tiny.moe_router_topk, tiny.num_moe_layers, tiny.vocab_size) == (8, 2, 4, 264)
    qwen = PRESETS["qwen3-30b-a3b"]
    assert (qwen.num_layers, qwen.num_experts, qwen.moe_router_topk) == (48, 128, 8)
    assert PRESETS["mixtral-8x7b"].num_experts == 8


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(
        ConfigError, match=re.escape("unknown model preset 'gpt-5'; known presets: ['mixtral-8x7b'")
    ):
        get_preset("gpt-5")


def test_topk_above_experts_is_rejected_with_the_fix():
    fields = get_preset("tiny-moe").model_dump() | {"moe_router_topk": 9}
    with pytest.raises(
        ValueError, match=re.escape("moe_router_topk=9 exceeds num_experts=8: lower moe_router_topk")
    ):
        MoEModelConfig(**fields)


def test_model_parallel_on_cpu_is_refused():
    with pytest.raises(ConfigError, match=re.escape("needs CUDA: on CPU set tensor_parallel")):
        get_preset("tiny-moe").transformer_config(ParallelConfig(tensor_parallel=2), cpu=True)


def test_init_is_idempotent_and_rejects_a_different_layout():
    ensure_model_parallel(ParallelConfig())
    ensure_model_parallel(ParallelConfig())
    assert apply_cpu_workarounds() is True
    with pytest.raises(ConfigError, match=re.escape("already initialised as (tp, pp, ep)=(1, 1, 1)")):
        ensure_model_parallel(ParallelConfig(expert_parallel=2))


def test_the_device_is_made_current_before_the_process_group_starts(monkeypatch):
    """NCCL binds a rank's communicators to the current device: under torchrun every rank starts on
    GPU 0, so its own GPU is made current first (``make_current`` is a no-op on CPU: recorded here)."""
    from megatron.core import parallel_state

    from labrl.harness.models import device as dev

    order: list[str] = []
    monkeypatch.setattr(dev, "make_current", lambda d: order.append(f"current {d}"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: order.append("process group"))
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    for size in ("tensor_model_parallel", "pipeline_model_parallel", "expert_model_parallel"):
        monkeypatch.setattr(parallel_state, f"get_{size}_world_size", lambda: 1)
    ensure_model_parallel(ParallelConfig(), "cpu")
    assert order == ["current cpu", "process group"]


def test_same_seed_same_weights_and_router_replays_detached():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    before = len(RouterReplay.global_router_replay_instances)
    a = build_gpt_model(get_preset("tiny-moe"), seed=3)
    b = build_gpt_model(get_preset("tiny-moe"), seed=3)
    c = build_gpt_model(get_preset("tiny-moe"), seed=4)
    assert len(RouterReplay.global_router_replay_instances) == before
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    w = "decoder.layers.0.mlp.router.weight"
    assert torch.equal(sa[w], sb[w]) and not torch.equal(sa[w], sc[w])
    # 4 layers x (attention + 8 SwiGLU experts + router) + embeddings + output layer
    assert count_parameters(a) == 3_480_704
