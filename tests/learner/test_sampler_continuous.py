"""Continuous batching in LocalSampler: requests join a running batch between decode steps."""

import asyncio

import numpy as np
import pytest
import torch

from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
from labrl.harness.types import GenerateRequest, SamplingParams


def _req(rid: str, n_prompt: int, max_new: int, seed: int) -> GenerateRequest:
    gen = torch.Generator().manual_seed(seed)
    return GenerateRequest(
        rid=rid,
        input_ids=tuple(torch.randint(0, 256, (n_prompt,), generator=gen).tolist()),
        sampling=SamplingParams(max_new_tokens=max_new, seed=seed, stop_token_ids=()),
        return_routed_experts=True,
    )


async def _late_arrival(sampler: LocalSampler) -> tuple[list[str], dict]:
    """A 24-token request runs; after 3 decode steps two short ones arrive. Returns the finish order."""
    order: list[str] = []
    results: dict = {}

    async def run(req):
        (res,) = await sampler.generate([req])
        order.append(req.rid)
        results[req.rid] = res

    long = asyncio.create_task(run(_req("long", 30, 24, 1)))
    while sampler.decode_steps < 3:
        await asyncio.sleep(0.001)
    # a longer prompt than the running row's context and a shorter one: both re-align the cache
    late = [
        asyncio.create_task(run(_req("late-a", 50, 4, 2))),
        asyncio.create_task(run(_req("late-b", 8, 5, 3))),
    ]
    await asyncio.gather(long, *late)
    return order, results


@pytest.mark.parametrize("scheduling", ["continuous", "waves"])
async def test_late_requests_join_the_running_batch(learner, h, scheduling):
    sampler = LocalSampler(
        h.tiny,
        LocalSamplerConfig(scheduling=scheduling),
        weights=learner.export_weights(),
        version=learner.version,
    )
    order, results = await _late_arrival(sampler)
    if scheduling == "waves":
        assert order[0] == "long"  # the late requests waited for the whole first wave
        return
    assert order[-1] == "long" and set(order[:2]) == {"late-a", "late-b"}
    assert results["late-a"].info["batch_size"] == 3  # it ran in one batch with the other two
    # joining mid-run changes nothing: same tokens as alone, log-probs and routing equal to the learner's
    for rid, res in results.items():
        req = {
            "long": _req("long", 30, 24, 1),
            "late-a": _req("late-a", 50, 4, 2),
            "late-b": _req("late-b", 8, 5, 3),
        }[rid]
        (alone,) = await LocalSampler(h.tiny, weights=learner.export_weights()).generate([req])
        assert res.output_ids == alone.output_ids and len(res.output_ids) == req.sampling.max_new_tokens
        tokens = torch.tensor([[*req.input_ids, *res.output_ids]])
        want = learner.logprobs(tokens)[0, len(req.input_ids) :]
        assert float((want - torch.tensor(res.logprobs_T)).abs().max()) < 1e-4
        own = learner.route(tokens)[0, :-1].sort(-1).values.numpy()
        assert np.array_equal(np.sort(res.routed_experts_T_L_K[:-1], -1), own)


async def test_finished_rows_answer_at_once_and_leave_the_cache(learner, h):
    sampler = LocalSampler(h.tiny, weights=learner.export_weights(), version=learner.version)
    reqs = [_req(f"r{i}", 10 + 7 * i, 2 + 3 * i, 10 + i) for i in range(6)]  # 2..17 new tokens
    done_at: dict[str, int] = {}

    async def run(req):
        (res,) = await sampler.generate([req])
        done_at[req.rid] = sampler.decode_steps
        return res

    results = await asyncio.gather(*(run(r) for r in reqs))
    # each request is answered when its last token is sampled, not when the batch ends
    assert [done_at[r.rid] for r in reqs] == [1, 4, 7, 10, 13, 16]
    assert sampler.stats["generated_tokens"] == sum(2 + 3 * i for i in range(6))
    batch = h.as_trajectories(reqs, results)
    from labrl.harness.rollout.batching import collate

    b = collate(batch, pad_token_id=256)
    diff = (learner.logprobs(b.tokens_B_T) - b.behaviour_logprobs_B_T)[b.loss_mask_B_T].abs().max()
    assert float(diff) < 1e-4  # compaction (6 -> 3 rows after 3 finish, 3 -> 1 after 5) keeps rows exact
