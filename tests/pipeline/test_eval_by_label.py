"""Per-label evaluation: ``by_label`` in the eval record, from envs that label their tasks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from labrl_test_envs import seeded_task

from labrl.envs import Action, Env, EnvSpec, Message, Observation, StepResult, Task
from labrl.envs.budgets import BudgetedEnv
from labrl.errors import EnvError, InvalidActionError
from labrl.harness.pipeline import evaluation
from labrl.harness.pipeline.evaluation import EvalOnTestSplit
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams

TOKENIZER = ByteTokenizer()
# test task i is of class "ABC"[i % 3]; the scripted policy's reply to each ("!" makes the env fail)
REPLIES = ["A", "A", "C", "A", "?", "C", "B", "!", "C"]


class ClassEnv(Env):
    """Single turn: name the task's class (a letter). ``info["said"]`` holds what was named."""

    def __init__(self) -> None:
        self.spec = EnvSpec(id="test/class-v0")

    def make_task(self, split: Any, seed: int) -> Task:
        return seeded_task(self, "class", split, seed, answer={"class": "ABC"[seed % 3]})

    async def reset(self, task: Task) -> Observation:
        self._task = task
        return Observation(messages=(Message(role="user", content="class?"),))

    async def step(self, action: Action) -> StepResult:
        task = self.episode_task()
        if action.text == "!":
            raise EnvError("class backend down")
        if action.text not in "ABC":
            raise InvalidActionError("answer with one letter")
        return StepResult(
            reward=float(action.text == task.answer["class"]), done=True, info={"said": action.text}
        )

    def task_label(self, task: Task) -> str | None:
        return task.answer["class"]

    def answer_label(self, task: Task, final_info: Mapping[str, Any]) -> str | None:
        return final_info.get("said", "(unparsed)")


class UnlabelledClassEnv(ClassEnv):
    def task_label(self, task: Task) -> str | None:
        return None


class ScriptedSampler:
    """Replies ``REPLIES[seed]`` to the eval request of test task ``seed``."""

    version = 3

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        out = []
        for r in requests:
            seed = int(r.rid.rsplit("/", 1)[0].rsplit("-", 1)[1])  # rid: eval{step}:class-test-{seed}/0
            ids = TOKENIZER.encode(REPLIES[seed])
            out.append(GenerateResult(r.rid, ids, [0.0] * len(ids), [3] * len(ids), "stop"))
        return out


async def evaluate(env_cls: type[ClassEnv]) -> dict[str, Any]:
    run = EvalOnTestSplit(
        lambda: BudgetedEnv(env_cls()),
        TOKENIZER,
        SamplingParams(temperature=0.0, max_new_tokens=4),
        size=len(REPLIES),
        concurrency=4,
    )
    return await run.run(ScriptedSampler(), step=7, time_s=lambda: 1.0)


async def test_eval_record_breaks_accuracy_and_answers_down_by_task_label_where_the_env_labels():
    record = await evaluate(ClassEnv)
    assert record["accuracy"] == 5 / 9
    assert record["by_label"] == {
        "A": {"n": 3, "accuracy": 2 / 3, "answers": {"A": 2, "B": 1}},
        "B": {"n": 3, "accuracy": 0.0, "answers": {"A": 1, "(unparsed)": 1, "(env_error)": 1}},
        "C": {"n": 3, "accuracy": 1.0, "answers": {"C": 3}},
    }


async def test_rare_answers_are_summed_as_other(monkeypatch):
    monkeypatch.setattr(evaluation, "TOP_ANSWERS", 1)
    record = await evaluate(ClassEnv)
    assert record["by_label"]["A"]["answers"] == {"A": 2, "(other)": 1}
    assert record["by_label"]["B"]["answers"] == {"A": 1, "(other)": 2}
    assert record["by_label"]["C"]["answers"] == {"C": 3}
    unlabelled = await evaluate(UnlabelledClassEnv)
    assert unlabelled["accuracy"] == 5 / 9
    assert "by_label" not in unlabelled


class SeedRecordingSampler(ScriptedSampler):
    """``ScriptedSampler`` that also records each request's sampling seed by test task."""

    def __init__(self) -> None:
        self.seeds: dict[int, int | None] = {}

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        for r in requests:
            self.seeds[int(r.rid.rsplit("/", 1)[0].rsplit("-", 1)[1])] = r.sampling.seed
        return await super().generate(requests)


async def test_seeded_evaluation_gives_each_task_its_own_draws():
    """Test task i samples with seed + i: one seed for all would give every task the same noise."""
    for seed, expected in [(40, {i: 40 + i for i in range(len(REPLIES))}), (None, dict.fromkeys(range(9)))]:
        sampler = SeedRecordingSampler()
        sampling = SamplingParams(temperature=1.0, max_new_tokens=4, seed=seed)
        run = EvalOnTestSplit(
            lambda: BudgetedEnv(ClassEnv()), TOKENIZER, sampling, size=len(REPLIES), concurrency=4
        )
        await run.run(sampler, step=1, time_s=lambda: 1.0)
        assert sampler.seeds == expected
