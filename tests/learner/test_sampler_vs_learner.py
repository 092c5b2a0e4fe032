"""Sampler/learner agreement, precision mismatch and router replay."""

import asyncio
import re

import numpy as np
import pytest
import torch
from rollout_builders import pause_after_decode_steps

from labrl.errors import SamplerError
from labrl.harness.objectives import mismatch_kl
from labrl.harness.samplers import LocalSampler
from labrl.harness.samplers.local import sample_token
from labrl.harness.types import GenerateRequest, SamplingParams


def _real_rows(batch):
    """Real tokens except each row's last one (its routing row is padding, as in SGLang)."""
    real = batch.attention_mask_B_T.clone()
    last = batch.attention_mask_B_T.sum(1) - 1
    real[torch.arange(batch.batch_size), last] = False
    return real


def test_fp32_sampler_matches_learner(learner, h):
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"))
    mask = batch.loss_mask_B_T
    diff = (learner.logprobs(batch.tokens_B_T) - batch.behaviour_logprobs_B_T)[mask].abs().max()
    assert mask.sum() > 50 and float(diff) < 1e-4
    # the sampler's recorded routing is the learner's own routing in fp32
    same = (
        learner.route(batch.tokens_B_T).sort(-1).values == batch.routed_experts_B_T_L_K.sort(-1).values
    ).all(-1)
    assert bool(same.all(-1)[_real_rows(batch)].all())


def test_bf16_mismatch_and_router_replay(learner, h):
    batch = h.sampled_batch(h.make_sampler(learner, "bf16"), n=12, max_new=16)
    mask, real = batch.loss_mask_B_T, _real_rows(batch)
    behaviour = batch.behaviour_logprobs_B_T
    plain = learner.logprobs(batch.tokens_B_T)
    replayed = learner.logprobs(batch.tokens_B_T, batch.routed_experts_B_T_L_K)
    assert float((plain - behaviour)[mask].abs().max()) > 1e-3  # bf16 mismatch is real
    kl_plain = mismatch_kl(behaviour - plain, mask)["mismatch/kl_k3"]
    kl_replay = mismatch_kl(behaviour - replayed, mask)["mismatch/kl_k3"]
    assert kl_replay < 0.5 * kl_plain, (kl_plain, kl_replay)
    # without replay the learner routes some tokens elsewhere; with replay the routing is the sampler's
    own = learner.route(batch.tokens_B_T).sort(-1).values
    sampler_routing = batch.routed_experts_B_T_L_K.sort(-1).values
    assert float((own != sampler_routing).any(-1).any(-1)[real].float().mean()) > 0
    from labrl.harness.models.routing import model_router_replays, replay_routing

    with replay_routing(learner.model, batch.routed_experts_B_T_L_K), torch.no_grad():
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        # REPLAY_FORWARD hands the given indices to megatron's top-k: check what the routers used
        learner._logits(batch.tokens_B_T)
        for r in model_router_replays(learner.model):
            assert r.router_replay_action == RouterReplayAction.REPLAY_FORWARD
    assert all(r.router_replay_action is None for r in model_router_replays(learner.model))


def test_export_import_reproduces_logprobs_exactly(learner, h):
    fp32 = h.make_sampler(learner, "fp32")
    learner.train_step(h.sampled_batch(fp32, n=4, max_new=8))
    exported = learner.export_weights()
    asyncio.run(fp32.update_weights(exported, learner.version))
    fresh = LocalSampler(h.tiny, weights=exported, version=learner.version)
    reqs = h.requests(3, max_new=8, seed=5)
    a = asyncio.run(fp32.generate(reqs))
    b = asyncio.run(fresh.generate(reqs))
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids and x.logprobs_T == y.logprobs_T
        assert x.versions_T == [learner.version] * len(x.output_ids)
        assert np.array_equal(x.routed_experts_T_L_K, y.routed_experts_T_L_K)
    for name, tensor in learner.model.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(tensor, exported[name])


def test_sampling_controls_and_results(learner, h):
    sampler = h.make_sampler(learner, "fp32")
    prompt = tuple(range(65, 95))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    reqs = [
        GenerateRequest(rid="a", input_ids=prompt, sampling=greedy, return_routed_experts=True),
        GenerateRequest(rid="b", input_ids=prompt[:10], sampling=SamplingParams(max_new_tokens=3, seed=1)),
    ]
    a, b = asyncio.run(sampler.generate(reqs))
    assert (len(a.output_ids), a.finish_reason, len(b.output_ids), b.finish_reason) == (
        6,
        "length",
        3,
        "length",
    )
    assert a.routed_experts_T_L_K.shape == (30 + 6, 4, 2) and a.routed_experts_T_L_K.dtype == np.int32
    assert b.routed_experts_T_L_K is None
    # stop at the first greedy token: finish "stop", the stop token is the single output
    stop = GenerateRequest(
        rid="c", input_ids=prompt, sampling=greedy.model_copy(update={"stop_token_ids": (a.output_ids[0],)})
    )
    (c,) = asyncio.run(sampler.generate([stop]))
    assert (c.output_ids, c.finish_reason) == ([a.output_ids[0]], "stop")
    # same seed, same tokens
    again = asyncio.run(sampler.generate([reqs[1]]))[0]
    assert again.output_ids == b.output_ids
    with pytest.raises(
        SamplerError, match=re.escape("request bad: token ids [999] are outside the vocabulary [0, 264)")
    ):
        asyncio.run(sampler.generate([GenerateRequest(rid="bad", input_ids=(1, 999))]))


def test_top_k_and_top_p_truncate_hand_computed():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    seen_k = {sample_token(logits, SamplingParams(top_k=2), gen)[0] for _ in range(200)}
    seen_p = {sample_token(logits, SamplingParams(top_p=0.8), gen)[0] for _ in range(200)}
    assert seen_k == {0, 1} and seen_p == {0, 1}  # 0.5 + 0.3 reaches 0.8
    token, logprob = sample_token(logits, SamplingParams(temperature=0.0), gen)
    assert token == 0 and logprob == pytest.approx(np.log(0.5), abs=1e-6)


async def test_in_flight_update_tags_both_versions_at_the_boundary(learner, h):
    sampler = h.make_sampler(learner, "fp32")
    other = LocalSampler(h.tiny, weights=None)  # seed 0 init differs from the trained learner
    new_weights = {k: v for k, v in other.model.state_dict().items() if not k.endswith("_extra_state")}
    reqs = [
        GenerateRequest(
            rid=f"r{i}",
            input_ids=tuple(range(40 + i, 70)),
            sampling=SamplingParams(max_new_tokens=12, seed=i),
        )
        for i in range(2)
    ]
    task = asyncio.create_task(sampler.generate(reqs))
    await pause_after_decode_steps(sampler, 3)
    boundary = 1 + sampler.decode_steps  # tokens sampled before the pause
    await sampler.update_weights(new_weights, 7)
    await sampler.resume()
    results = await task
    old_version = learner.version
    for req, res in zip(reqs, results, strict=True):
        assert res.versions_T == [old_version] * boundary + [7] * (12 - boundary)
        tokens = torch.tensor([[*req.input_ids, *res.output_ids]])
        old_lp = learner.logprobs(tokens)[0, len(req.input_ids) :]
        got = torch.tensor(res.logprobs_T)
        assert float((old_lp[:boundary] - got[:boundary]).abs().max()) < 1e-4  # produced by the old weights
        assert float((old_lp[boundary:] - got[boundary:]).abs().max()) > 1e-3  # produced by the new ones
