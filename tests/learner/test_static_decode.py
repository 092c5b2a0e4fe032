"""The static decode engine (``samplers.static_decode``) against the megatron engine, on CPU in fp32.

Same weights (the engine reads the LocalSampler's own model): logits of the prefill and of every
decode step equal to round-off for prompts of different lengths, the same greedy tokens and
log-probs, the same recorded routing; an in-flight weight update tags tokens with the right
version; a decode step copies nothing to the host.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from megatron.core.inference.contexts import StaticInferenceContext
from rollout_builders import pause_after_decode_steps
from torch_modes import op_name, to_host

from labrl.harness.models import get_preset
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
from labrl.harness.samplers.static_batch import pack, static_shape
from labrl.harness.samplers.static_decode import StaticDecodeEngine
from labrl.harness.types import GenerateRequest, SamplingParams

# every branch of the engine: grouped-query attention, QK norm, a dense layer between MoE layers
SHAPE = get_preset("tiny-moe").model_copy(
    update={"num_layers": 3, "moe_layer_freq": 2, "qk_layernorm": True, "num_query_groups": 2}
)
PROMPT_LENGTHS = (5, 17, 3, 11)


def _requests(
    max_new: int, *, temperature: float = 0.0, top_k: int = -1, seed: int = 0
) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(seed)
    return [
        GenerateRequest(
            rid=f"r{i}",
            input_ids=tuple(torch.randint(0, 256, (n,), generator=gen).tolist()),
            sampling=SamplingParams(
                max_new_tokens=max_new, temperature=temperature, top_k=top_k, seed=seed + i
            ),
            return_routed_experts=True,
        )
        for i, n in enumerate(PROMPT_LENGTHS)
    ]


@pytest.fixture(scope="module")
def megatron() -> LocalSampler:
    return LocalSampler(SHAPE, LocalSamplerConfig(device="cpu", precision="fp32", scheduling="waves"))


def _static(megatron: LocalSampler, **config) -> LocalSampler:
    weights = {k: v for k, v in megatron.model.state_dict().items() if not k.endswith("_extra_state")}
    return LocalSampler(
        SHAPE, LocalSamplerConfig(device="cpu", precision="fp32", engine="static", **config), weights=weights
    )


def _megatron_greedy_logits(sampler: LocalSampler, ids: torch.Tensor, start: torch.Tensor, steps: int):
    """The megatron engine's per-step logits and routing, feeding back the argmax (as ``_run_batch`` does)."""
    B, P = ids.shape
    ctx = StaticInferenceContext(B, P + steps + 1)
    keys = torch.arange(P)
    blocked = (keys[None, :] > keys[:, None])[None] | (keys[None, :] < start[:, None])[:, None, :]
    logits, _, routed = sampler._forward(ids, blocked[:, None], ctx, True)
    all_logits, all_routed = [logits], [routed]
    for _ in range(steps):
        S = ctx.sequence_len_offset + 1
        mask = (torch.arange(S)[None] < start[:, None])[:, None, None, :]
        logits, _, routed = sampler._forward(logits.argmax(-1)[:, None], mask, ctx, True)
        all_logits.append(logits)
        all_routed.append(routed)
    return all_logits, torch.cat(all_routed, dim=1)


def test_every_step_equals_the_megatron_engine_on_the_same_weights(megatron):
    reqs = _requests(8)
    shape = static_shape(reqs, [8] * len(reqs), (8,), SHAPE.max_sequence_length)
    host = pack(reqs, [8] * len(reqs), [0] * len(reqs), shape, pad_token_id=0)
    B = len(reqs)
    ids, start = host["ids_B_P"][:B], host["start_B"][:B]
    ref_logits, ref_routed = _megatron_greedy_logits(megatron, ids, start, steps=7)
    engine = StaticDecodeEngine(
        megatron.model, batch_size=shape.batch, capacity=shape.capacity, stop_width=1, graphs=False
    )
    engine.start_batch(**host)
    assert shape.batch == 8 > B  # padding rows ride along and change nothing
    assert float((engine.logits[:B] - ref_logits[0]).abs().max()) < 1e-5
    for step in range(7):
        engine.step(truncate=False)
        assert float((engine.logits[:B] - ref_logits[step + 1]).abs().max()) < 1e-5, step
    tokens, logprobs, routed = engine.read_back(7, shape.prompt)
    ref_tokens = torch.stack([lg.argmax(-1) for lg in ref_logits[:7]], dim=1)
    assert torch.equal(tokens[:B], ref_tokens)
    ref_logp = torch.stack([torch.log_softmax(lg, -1) for lg in ref_logits[:7]], 1).gather(
        2, ref_tokens[..., None]
    )
    assert float((logprobs[:B] - ref_logp[..., 0]).abs().max()) < 1e-5
    for b in range(B):  # the megatron routing covers prompt slots and the fed tokens
        assert torch.equal(routed[b, start[b] :].long(), ref_routed[b, start[b] :].long())


async def test_greedy_generation_equals_the_megatron_engine(megatron):
    static = _static(megatron, finish_check_steps=3)
    reqs = _requests(10)
    ref = await megatron.generate(reqs)
    got = await static.generate(reqs)
    for r, a, b in zip(reqs, ref, got, strict=True):
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason == "length"
        assert np.abs(np.array(b.logprobs_T) - np.array(a.logprobs_T)).max() < 1e-5
        assert b.routed_experts_T_L_K.shape == (
            len(r.input_ids) + 10,
            SHAPE.num_moe_layers,
            SHAPE.moe_router_topk,
        )
        np.testing.assert_array_equal(b.routed_experts_T_L_K, a.routed_experts_T_L_K)
        assert b.versions_T == a.versions_T == [0] * 10


async def test_stop_tokens_and_row_lengths(megatron):
    static = _static(megatron, finish_check_steps=2)
    (free,) = await static.generate(_requests(6)[:1])
    stop_at = free.output_ids[2]
    first = free.output_ids.index(stop_at)
    stopping = GenerateRequest(
        rid="s",
        input_ids=_requests(6)[0].input_ids,
        sampling=SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(999, stop_at)),
        return_routed_experts=True,
    )
    short = _requests(2)[1]
    res_stop, res_short = await static.generate([stopping, short])
    assert res_stop.output_ids == free.output_ids[: first + 1] and res_stop.finish_reason == "stop"
    assert len(res_short.output_ids) == 2 and res_short.finish_reason == "length"
    assert res_stop.routed_experts_T_L_K.shape[0] == len(stopping.input_ids) + first + 1


async def test_seeded_sampling_does_not_depend_on_the_batch(megatron):
    static = _static(megatron)
    reqs = _requests(8, temperature=1.0, top_k=20, seed=3)
    together = await static.generate(reqs)
    alone = await static.generate(reqs[2:3])  # another batch bucket (1), another engine
    assert alone[0].output_ids == together[2].output_ids
    assert len({tuple(r.output_ids) for r in together}) == len(reqs)
    again = await static.generate(reqs)
    assert [r.output_ids for r in again] == [r.output_ids for r in together]


async def test_in_flight_update_tags_both_versions_at_the_boundary(megatron):
    static = _static(megatron, finish_check_steps=1)
    other = LocalSampler(SHAPE, LocalSamplerConfig(device="cpu", precision="fp32", seed=5))
    new_weights = {k: v for k, v in other.model.state_dict().items() if not k.endswith("_extra_state")}
    reqs = _requests(12)
    task = asyncio.create_task(static.generate(reqs))
    await pause_after_decode_steps(static, 3)
    boundary = 1 + static.decode_steps  # tokens sampled from logits of the old weights
    await static.update_weights(new_weights, 7)
    await static.resume()
    results = await task
    # the megatron engine under the same schedule: old weights up to the boundary, then the new ones
    ref_old = await megatron.generate(reqs)
    for ref, res in zip(ref_old, results, strict=True):
        assert res.versions_T == [0] * boundary + [7] * (12 - boundary)
        assert res.output_ids[:boundary] == ref.output_ids[:boundary]
        got, old = np.array(res.logprobs_T), np.array(ref.logprobs_T)
        assert np.abs(got[:boundary] - old[:boundary]).max() < 1e-5
    changed = [
        r.output_ids[boundary:] != o.output_ids[boundary:] for r, o in zip(results, ref_old, strict=True)
    ]
    assert any(changed)  # the new weights drive the rest


class _NoHostCopies(torch.overrides.TorchFunctionMode):
    """Fails on every tensor-to-host conversion made while active."""

    BANNED = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        if name in self.BANNED or (name == "to" and to_host(args, kwargs or {})):
            raise AssertionError(f"host copy in a decode step: {name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("truncate", [False, True])
def test_a_decode_step_makes_no_host_copy(megatron, truncate):
    reqs = _requests(4, temperature=1.0, top_k=5)
    shape = static_shape(reqs, [4] * len(reqs), (8,), SHAPE.max_sequence_length)
    engine = StaticDecodeEngine(
        megatron.model, batch_size=8, capacity=shape.capacity, stop_width=1, graphs=False
    )
    engine.start_batch(**pack(reqs, [4] * len(reqs), list(range(len(reqs))), shape, pad_token_id=0))
    with torch.no_grad(), _NoHostCopies():
        engine.step(truncate)
        engine.step(truncate)
    with pytest.raises(AssertionError, match="host copy"), _NoHostCopies():
        engine.all_done()  # the guard itself sees the one sync the sampler makes per chunk


def test_a_model_the_engine_cannot_run_is_refused():
    from labrl.errors import ConfigError
    from labrl.harness.models.build import build_gpt_model

    sequential = build_gpt_model(SHAPE, device="cpu", experts="sequential")
    with pytest.raises(ConfigError, match="experts other than TorchGroupedMLP"):
        StaticDecodeEngine(sequential, batch_size=1, capacity=128, stop_width=1, graphs=False)


async def test_bf16_follows_the_megatron_engine_to_bf16_round_off():
    """The dtype CUDA graphs run in (eager here): same greedy tokens, log-probs within bf16 round-off."""
    shape = SHAPE.model_copy(update={"moe_ffn_hidden_size": 64})  # 16-byte-aligned bf16 expert strides
    megatron = LocalSampler(shape, LocalSamplerConfig(device="cpu", precision="bf16", scheduling="waves"))
    weights = {k: v for k, v in megatron.model.state_dict().items() if not k.endswith("_extra_state")}
    static = LocalSampler(
        shape, LocalSamplerConfig(device="cpu", precision="bf16", engine="static"), weights=weights
    )
    reqs = _requests(6)
    for a, b in zip(await megatron.generate(reqs), await static.generate(reqs), strict=True):
        assert a.output_ids == b.output_ids
        assert np.abs(np.array(a.logprobs_T) - np.array(b.logprobs_T)).max() < 2e-2
        assert (a.routed_experts_T_L_K == b.routed_experts_T_L_K).mean() >= 0.95
