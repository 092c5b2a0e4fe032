"""Rollouts over fixture envs: token bookkeeping, loss mask, routing, groups -> batch -> train step."""

import numpy as np

from labrl.envs.base import Env
from labrl.envs.types import Action, Budgets, EnvSpec, Message, Observation, StepResult, Task, ToolSpec
from labrl.harness.rollout.batching import collate
from labrl.harness.rollout.play import rollout, rollout_group
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import NO_VERSION, SamplingParams

TOOL = ToolSpec(name="measure", description="measure a sample")


class OneShotEnv(Env):
    spec = EnvSpec(id="test/one-shot-v0")

    def make_task(self, split, seed):
        return Task(env_id=self.spec.id, split=split, seed=seed, task_id=f"t{seed}", answer="a")

    async def reset(self, task):
        return Observation(messages=(Message(role="user", content="say a"),))

    async def step(self, action: Action):
        return StepResult(reward=float("a" in action.text), done=True)


class ToolEnv(Env):
    """Three turns: the first two answered by a tool message, the third scored."""

    spec = EnvSpec(id="test/tool-loop-v0", budgets=Budgets(max_turns=3), tools=(TOOL,))

    def make_task(self, split, seed):
        return Task(env_id=self.spec.id, split=split, seed=seed, task_id=f"tool{seed}")

    async def reset(self, task):
        self.turn = 0
        self.seen: list[str] = []
        return Observation(
            messages=(Message(role="system", content="lab"), Message(role="user", content="go")),
            tools=(TOOL,),
        )

    async def step(self, action: Action):
        self.turn += 1
        self.seen.append(action.text)
        if self.turn < 3:
            return StepResult(
                observation=Observation(messages=(Message(role="tool", content=f"reading {self.turn}"),))
            )
        return StepResult(reward=0.5, done=True)


class RecordingSampler:
    """Wraps a sampler and keeps every result (to check the rollout's bookkeeping)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    @property
    def version(self):
        return self.inner.version

    async def generate(self, requests):
        results = await self.inner.generate(requests)
        self.calls.extend(zip(requests, results, strict=True))
        return results

    async def update_weights(self, weights, version, *, force=False):
        await self.inner.update_weights(weights, version)

    async def pause(self):
        await self.inner.pause()

    async def resume(self):
        await self.inner.resume()


async def test_multi_turn_loss_mask_covers_exactly_the_model_tokens(learner, h):
    tok = ByteTokenizer()
    sampler = RecordingSampler(h.make_sampler(learner, "fp32"))
    env = ToolEnv()
    task = env.make_task("train", 0)
    traj = await rollout(
        env, task, sampler, tok, SamplingParams(max_new_tokens=6, seed=1), return_routed_experts=True
    )
    assert (traj.num_turns, traj.reward, traj.outcome, len(sampler.calls)) == (3, 0.5, "ok", 3)
    tokens, mask = np.array(traj.tokens_T), np.array(traj.loss_mask_T)
    generated = [tid for _, res in sampler.calls for tid in res.output_ids]
    assert tokens[mask == 1].tolist() == generated
    assert traj.num_model_tokens == len(generated)
    # each generate saw the conversation so far as its prompt; the env saw the decoded text
    for req, res in sampler.calls:
        start = len(req.input_ids)
        assert list(req.input_ids) == traj.tokens_T[:start]
        assert traj.tokens_T[start : start + len(res.output_ids)] == res.output_ids
        assert mask[:start].sum() < start and mask[start : start + len(res.output_ids)].all()
    assert env.seen == [tok.decode(res.output_ids) for _, res in sampler.calls]
    # non-model tokens: template and tool replies, no log-prob, no version
    assert all(v == NO_VERSION for v, m in zip(traj.versions_T, traj.loss_mask_T, strict=True) if not m)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs_T, traj.loss_mask_T, strict=True) if not m)
    text = tok.decode(traj.tokens_T, skip_special_tokens=False)
    assert "<|im_start|>tool\nreading 1<|im_end|>" in text and "<|im_start|>tool\nreading 2<|im_end|>" in text
    assert traj.routed_experts_T_L_K.shape == (len(traj.tokens_T), 4, 2)
    # a token keeps the routing of the forward that first processed it
    first_req, first_res = sampler.calls[0]
    n_first = len(first_req.input_ids) + len(first_res.output_ids) - 1
    assert np.array_equal(traj.routed_experts_T_L_K[:n_first], first_res.routed_experts_T_L_K[:n_first])
    assert traj.timings["generation_s"] > 0 and "env_s" in traj.timings
    # the learner reproduces the behaviour log-probs on the multi-turn conversation
    batch = collate([traj], pad_token_id=tok.pad_token_id)
    lp = learner.logprobs(batch.tokens_B_T, batch.routed_experts_B_T_L_K)
    assert float((lp - batch.behaviour_logprobs_B_T)[batch.loss_mask_B_T].abs().max()) < 1e-4


async def test_group_rollouts_collate_and_train(learner, h):
    tok = ByteTokenizer()
    sampler = h.make_sampler(learner, "fp32")
    env = OneShotEnv()
    groups = []
    for seed in range(2):
        groups += await rollout_group(
            OneShotEnv, env.make_task("train", seed), sampler, tok,
            SamplingParams(max_new_tokens=8, seed=10 * seed), group_size=4, return_routed_experts=True,
        )  # fmt: skip
    assert [t.group_id for t in groups] == ["t0"] * 4 + ["t1"] * 4
    assert len({tuple(t.tokens_T) for t in groups[:4]}) > 1  # members sample with different seeds
    batch = collate(groups, pad_token_id=tok.pad_token_id)
    assert batch.group_ids_B.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.rewards_B.tolist() == [t.reward for t in groups]
    metrics = learner.train_step(batch)
    assert metrics["seqs/valid"] == 8.0 and np.isfinite(metrics["loss/total"])
