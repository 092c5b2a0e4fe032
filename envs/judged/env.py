"""``judged/science-qa-v0``: open materials-science questions graded by a rubric.

Single turn: the model answers a question (synthesis, characterisation, phase
stability) in prose; the answer is graded against the task's rubric by
``labrl.verifiers.rubric`` (deterministic items locally, ``llm`` items by the
configured judges) and the rubric score in [0, 1] is the reward. The step
info keeps every per-item score and the judges' disagreement.

Options (``labrl.envs.make("judged/science-qa-v0", **options)``):

- ``judges``: list of ``JudgeConfig`` dicts (``base_url``, ``model``,
  ``api_key_env``, ``batch``, ``samples``...); default: the in-process mock
  judge (``base_url="mock://"``), which only checks key terms: point it at a
  real endpoint for training;
- ``aggregate``: ``mean`` or ``median`` over judges and samples;
- ``tasks_path``: a JSONL file of your own rubric tasks (format in
  ``labrl.envs.judged.tasks``) instead of the shipped set;
- ``judge_concurrency``: episodes scoring at once in the process (the shared
  ``judge`` pool); ``min_words``, ``max_answer_chars``: what counts as an answer.

Invalid actions (outcome ``invalid_action``): an empty or whitespace answer,
fewer than ``min_words`` words, an answer longer than ``max_answer_chars``,
or any tool call (this env offers no tools).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from labrl.envs.base import Env
from labrl.envs.judged.tasks import QATask, load_tasks
from labrl.envs.types import Action, Budgets, EnvSpec, Message, Observation, Split, StepResult, Task
from labrl.errors import ConfigError, EnvError, InvalidActionError
from labrl.verifiers.rubric import JudgeClient, JudgeConfig, Rubric, RubricGrader

ENV_ID = "judged/science-qa-v0"
SYSTEM_PROMPT = (
    "You are an experienced materials scientist. Answer the question in clear prose, in a few "
    "paragraphs at most. Be specific: name phases, techniques, conditions and the reasons behind them. "
    "Your answer is graded against a rubric of expected points and common mistakes."
)
_WORD = re.compile(r"[^\W\d_]{2,}")


class ScienceQAConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    judges: tuple[JudgeConfig, ...] = Field(default=(JudgeConfig(),), min_length=1)
    aggregate: Literal["mean", "median"] = "mean"
    tasks_path: str | None = None
    judge_concurrency: int = Field(default=16, ge=1)
    min_words: int = Field(default=3, ge=1)
    max_answer_chars: int = Field(default=20_000, ge=1)


class ScienceQAEnv(Env):
    """See the module docstring."""

    def __init__(
        self,
        judges: Sequence[JudgeConfig | dict[str, Any]] | None = None,
        aggregate: str = "mean",
        tasks_path: str | None = None,
        judge_concurrency: int = 16,
        min_words: int = 3,
        max_answer_chars: int = 20_000,
    ) -> None:
        options: dict[str, Any] = {
            "aggregate": aggregate,
            "tasks_path": tasks_path,
            "judge_concurrency": judge_concurrency,
            "min_words": min_words,
            "max_answer_chars": max_answer_chars,
        }
        if judges is not None:
            options["judges"] = judges
        try:
            self.config = ScienceQAConfig.model_validate(options)
        except ValidationError as exc:
            detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"{ENV_ID}: invalid option(s): {detail}") from None
        self.tasks = load_tasks(self.config.tasks_path)
        self._by_split: dict[str, list[QATask]] = {"train": [], "test": []}
        for task in sorted(self.tasks, key=lambda t: t.id):
            self._by_split[task.resolved_split].append(task)
        self.spec = EnvSpec(
            id=ENV_ID,
            description="open materials-science questions (synthesis, characterisation, phase stability) "
            "graded by a weighted rubric with LLM-judged and deterministic items",
            budgets=Budgets(
                reset_timeout_s=10.0,
                step_timeout_s=360.0,
                scoring_timeout_s=300.0,
                max_turns=1,
                pools={"judge": self.config.judge_concurrency},
            ),
            tags=("judged", "rubric", "materials-science", "single-turn"),
            has_gold_answer=all(t.reference_answer is not None for t in self.tasks),
        )
        self._grader: RubricGrader | None = None

    def __repr__(self) -> str:
        return f"ScienceQAEnv(tasks={len(self.tasks)}, judges={[j.model for j in self.config.judges]})"

    # -- tasks --------------------------------------------------------------------

    def make_task(self, split: Split, seed: int) -> Task:
        """Task ``seed mod n`` of the split's tasks sorted by id (seeds 0..n-1 visit every task)."""
        pool = self._by_split.get(split)
        if not pool:
            raise ConfigError(
                f"{ENV_ID}: split {split!r} has no tasks in {self.config.tasks_path or 'the shipped set'}"
            )
        qa = pool[seed % len(pool)]
        return Task(
            env_id=ENV_ID,
            split=split,
            seed=seed,
            task_id=qa.id,
            prompt={"question": qa.question, "topic": qa.topic},
            answer={"rubric": qa.rubric.model_dump(mode="json"), "reference_answer": qa.reference_answer},
            metadata={"topic": qa.topic, "n_items": len(qa.rubric.items)},
        )

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        reference = (task.answer or {}).get("reference_answer")
        return [Action(text=reference)] if reference else None

    def random_action(self, task: Task, rng: random.Random) -> Action:
        """The reference answer of another task: fluent, on-format, and about the wrong question."""
        others = [t for t in self.tasks if t.id != task.task_id and t.reference_answer]
        if not others:
            return Action(text="The answer depends on the material and the conditions used.")
        return Action(text=rng.choice(others).reference_answer)  # type: ignore[arg-type]

    # -- episode ------------------------------------------------------------------

    async def reset(self, task: Task) -> Observation:
        if not isinstance(task.prompt.get("question"), str) or not isinstance(task.answer, dict):
            raise EnvError(f"{ENV_ID}: task {task.task_id!r} has no question or no rubric")
        self._task = task
        return Observation(
            messages=(
                Message(role="system", content=SYSTEM_PROMPT),
                Message(role="user", content=task.prompt["question"]),
            ),
            info={"topic": task.prompt.get("topic"), "task_id": task.task_id},
        )

    def _answer_text(self, action: Action) -> str:
        if action.parse_error is not None:
            raise InvalidActionError(
                f"your answer contains a malformed tool call ({action.parse_error}); this task has no tools: answer in prose"
            )
        if action.tool_calls:
            raise InvalidActionError("this task offers no tools: answer the question in prose")
        text = action.text.strip()
        if not text:
            raise InvalidActionError("the answer is empty: answer the question in prose")
        if len(text) > self.config.max_answer_chars:
            raise InvalidActionError(
                f"the answer has {len(text)} characters; the limit is {self.config.max_answer_chars}"
            )
        words = len(_WORD.findall(text))
        if words < self.config.min_words:
            raise InvalidActionError(
                f"the answer has {words} word(s); write at least {self.config.min_words} words of prose"
            )
        return text

    def _get_grader(self) -> RubricGrader:
        if self._grader is None:
            self._grader = RubricGrader(
                [JudgeClient(c) for c in self.config.judges], aggregate=self.config.aggregate
            )
        return self._grader

    async def step(self, action: Action) -> StepResult:
        task = self.episode_task()
        text = self._answer_text(action)
        rubric = Rubric.model_validate(task.answer["rubric"])
        grader = self._get_grader()
        async with self.pool("judge"):
            result = await self.score(grader.grade, rubric, text, task.prompt["question"])
        return StepResult(
            reward=result.score,
            done=True,
            info={"task_id": task.task_id, "rubric": result.model_dump(mode="json")},
        )

    async def close(self) -> None:
        if self._grader is not None:
            await self._grader.aclose()
            self._grader = None
