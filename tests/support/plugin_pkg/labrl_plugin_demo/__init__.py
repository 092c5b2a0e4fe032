"""A third-party science task registered only by being installed."""

from __future__ import annotations

from typing import Any

from labrl.envs import Action, Env, EnvSpec, Message, Observation, StepResult, Task
from labrl.errors import InvalidActionError


class TitrationEnv(Env):
    """Report the equivalence volume (mL) of a strong acid/strong base titration."""

    def __init__(self) -> None:
        self.spec = EnvSpec(id="demo/titration-v0", description="equivalence volume", has_gold_answer=True)
        self.task: Task | None = None

    def make_task(self, split: Any, seed: int) -> Task:
        acid_ml = 10 + (seed % 7) * 5 + (0 if split == "train" else 1)
        volume = acid_ml * 0.1 / 0.2  # 0.1 M acid titrated with 0.2 M base
        return Task(
            env_id=self.spec.id,
            split=split,
            seed=seed,
            task_id=f"titr-{split}-{seed}",
            prompt={"acid_ml": acid_ml},
            answer=volume,
        )

    async def reset(self, task: Task) -> Observation:
        self.task = task
        text = (
            f"{task.prompt['acid_ml']} mL of 0.1 M HCl is titrated with 0.2 M NaOH. Equivalence volume in mL?"
        )
        return Observation(messages=(Message(role="user", content=text),))

    async def step(self, action: Action) -> StepResult:
        assert self.task is not None
        try:
            value = float(action.text.strip())
        except ValueError:
            raise InvalidActionError("answer with a number of millilitres") from None
        return StepResult(reward=float(abs(value - self.task.answer) < 0.05), done=True)

    def gold_actions(self, task: Task) -> list[Action]:
        return [Action(text=str(task.answer))]
