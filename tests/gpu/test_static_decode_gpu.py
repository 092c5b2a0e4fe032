"""The static decode engine on CUDA in bf16: captured decode steps against eager ones and the megatron engine.

The CPU suite (tests/learner/test_static_decode.py) checks the engine's arithmetic against the
megatron engine in fp32, eager. Here ``device.decode_graphs`` turns graphs on: a replayed step must
give exactly what the same step gives eagerly (the same kernels), keep reading the model's
parameters after an in-place weight update, and a static LocalSampler must sample what the
megatron one does to bf16 tolerance.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from labrl.harness.models import device as dev
from labrl.harness.models import get_preset
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
from labrl.harness.samplers.static_batch import pack, static_shape
from labrl.harness.samplers.static_decode import StaticDecodeEngine
from labrl.harness.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.gpu
# grouped-query attention and a dense layer; hidden 128, expert FFN 64: aligned bf16 grouped_mm strides
MODEL = get_preset("tiny-moe").model_copy(
    update={
        "num_layers": 3,
        "moe_layer_freq": 2,
        "num_query_groups": 2,
        "qk_layernorm": True,
        "moe_ffn_hidden_size": 64,
    }
)


def _requests(max_new: int) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(0)
    return [
        GenerateRequest(
            rid=f"r{i}",
            input_ids=tuple(torch.randint(0, 256, (n,), generator=gen).tolist()),
            sampling=SamplingParams(max_new_tokens=max_new, temperature=1.0, top_k=20, seed=i),
            return_routed_experts=True,
        )
        for i, n in enumerate((7, 30, 12))
    ]


@pytest.fixture(scope="module")
def sampler() -> LocalSampler:
    if dev.detect_capabilities().transformer_engine:
        pytest.skip("the static engine runs the local spec (no TransformerEngine)")
    return LocalSampler(MODEL, LocalSamplerConfig(precision="bf16", engine="static"))


def _engine(sampler: LocalSampler, graphs: bool, reqs) -> tuple[StaticDecodeEngine, dict]:
    shape = static_shape(reqs, [16] * len(reqs), (8,), MODEL.max_sequence_length)
    engine = StaticDecodeEngine(
        sampler.model, batch_size=8, capacity=shape.capacity, stop_width=1, graphs=graphs
    )
    return engine, pack(reqs, [16] * len(reqs), [0, 1, 2], shape, pad_token_id=0)


def test_graphs_are_chosen_in_bf16_on_cuda(sampler):
    graphs, reason = dev.decode_graphs(
        sampler.device, dev.detect_capabilities(), torch.bfloat16, disabled=False
    )
    assert graphs, reason


def test_a_replayed_step_equals_the_eager_step_and_follows_weight_updates(sampler):
    reqs = _requests(16)
    graphed, host = _engine(sampler, True, reqs)
    eager, _ = _engine(sampler, False, reqs)
    assert graphed.graphed and not eager.graphed
    for engine in (graphed, eager):
        engine.start_batch(**host)
    for step in range(6):
        if step == 3:  # an in-place update between steps: the graph reads the parameters, not a copy
            with torch.no_grad():
                for p in sampler.model.parameters():
                    p.mul_(0.9)
        graphed.step(truncate=True)
        eager.step(truncate=True)
        torch.testing.assert_close(graphed.logits, eager.logits, rtol=0, atol=0)
    prompt = host["ids_B_P"].shape[1]
    for a, b in zip(graphed.read_back(6, prompt), eager.read_back(6, prompt), strict=True):
        assert torch.equal(a, b)


def test_static_sampler_agrees_with_the_megatron_engine_in_bf16(sampler):
    weights = {k: v for k, v in sampler.model.state_dict().items() if not k.endswith("_extra_state")}
    megatron = LocalSampler(MODEL, LocalSamplerConfig(precision="bf16", scheduling="waves"), weights=weights)
    greedy = [
        r.model_copy(update={"sampling": SamplingParams(max_new_tokens=8, temperature=0.0)})
        for r in _requests(8)
    ]
    ref = asyncio.run(megatron.generate(greedy))
    got = asyncio.run(sampler.generate(greedy))
    for a, b in zip(ref, got, strict=True):
        # bf16 round-off can flip a near-tie; the first token comes from the prefill both run the same way
        assert a.output_ids[0] == b.output_ids[0]
        n = next(
            (i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids, strict=True)) if x != y),
            len(a.output_ids),
        )
        assert np.abs(np.array(a.logprobs_T[:n]) - np.array(b.logprobs_T[:n])).max() <= 2e-2
        agree = (a.routed_experts_T_L_K == b.routed_experts_T_L_K).mean()
        assert agree >= 0.9, agree
