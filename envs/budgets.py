"""``BudgetedEnv``: the wrapper that enforces ``spec.budgets`` for every env.

``labrl.envs.make`` wraps each env in it, so no env has to remember its own
deadlines. Per step it applies, in order:

1. refusal of a step after the episode ended (a harness bug: ``EnvError``);
2. the step deadline (``asyncio.timeout``, which cancels the env's coroutine);
3. retries of ``TransientEnvError`` only, with the shared backoff
   ``min(retry_backoff_cap_s, retry_backoff_s * 2**attempt)``
   (``labrl.resilience.Backoff``; a wrong answer is never retried);
4. classification of what went wrong into an ``Outcome``::

       InvalidActionError -> invalid_action (message shown to the model)
       VerifierError      -> verifier_failed (episode ends, no reward)
       EnvTimeoutError,
       step deadline      -> timeout         (episode ends, no reward)
       any other error    -> env_error       (episode ends, no reward)
       CredentialsRefusedError -> raised     (STOPS_THE_RUN: a lab or a judge refused our
                                              key; every episode would fail alike)
       BudgetExhaustedError    -> raised     (STOPS_THE_RUN: a cascade stage's budget is spent)

   Outcomes other than invalid_action carry ``info["error"]`` (one line) and
   ``info["traceback"]`` (the full traceback, for the run's error log).
   A step whose reward is NaN or infinite is ``verifier_failed`` too
   (``info["non_finite_reward"]``): a broken scorer never reaches training.
5. ``max_turns``: the step that uses the last turn ends the episode with
   ``truncated=True`` if the env did not finish it.

Expected failures come back as data (a ``StepResult`` with that outcome);
only misuse of the wrapper raises. ``reset`` has no ``StepResult`` to carry an
outcome, so it raises the typed error (``EnvTimeoutError``, ``EnvError``) and
the episode runner records it.
"""

from __future__ import annotations

import asyncio
import math
import random
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from labrl.envs.base import Env, no_episode_error
from labrl.envs.types import Action, Message, Observation, Outcome, Split, StepResult, Task
from labrl.errors import (
    BudgetExhaustedError,
    CredentialsRefusedError,
    EnvError,
    EnvTimeoutError,
    InvalidActionError,
    TransientEnvError,
    VerifierError,
)
from labrl.resilience import Backoff

# Errors that say the setup is wrong (a lab or a judge refusing our key: LabAuthError, JudgeAuthError;
# a cascade stage's run budget spent), not this episode: every episode would fail the same way, so
# they stop the env and the run instead of becoming an outcome or a reward.
STOPS_THE_RUN: tuple[type[BaseException], ...] = (CredentialsRefusedError, BudgetExhaustedError)

T = TypeVar("T")


class BudgetedEnv(Env):
    """Enforces the wrapped env's budgets; see the module docstring."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.spec = env.spec
        self._turn = 0
        self._episode_over = True

    # -- delegation ---------------------------------------------------------------

    @property
    def unwrapped(self) -> Env:
        return self.env.unwrapped

    @property
    def turn(self) -> int:
        return self._turn

    def make_task(self, split: Split, seed: int) -> Task:
        return self.env.make_task(split, seed)

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        return self.env.gold_actions(task)

    def random_action(self, task: Task, rng: random.Random) -> Action:
        return self.env.random_action(task, rng)

    def task_label(self, task: Task) -> str | None:
        return self.env.task_label(task)

    def answer_label(self, task: Task, final_info: Mapping[str, Any]) -> str | None:
        return self.env.answer_label(task, final_info)

    async def close(self) -> None:
        await self.env.close()

    def __repr__(self) -> str:
        return f"BudgetedEnv({self.env!r})"

    # -- enforced phases ----------------------------------------------------------

    async def _with_retries(self, phase: str, timeout: float, call: Callable[[], Awaitable[T]]) -> T:
        budgets = self.spec.budgets
        attempt = 0
        while True:
            deadline = asyncio.timeout(timeout)
            try:
                async with deadline:
                    return await call()
            except TimeoutError as exc:
                if not deadline.expired():  # an inner deadline (scoring) fired: keep its message
                    raise
                raise EnvTimeoutError(f"{self.spec.id}: {phase} did not finish within {timeout:g} s") from exc
            except TransientEnvError:
                if attempt >= budgets.max_retries:
                    raise
                # built here, on a retry, not per step: steps run thousands of times a second
                backoff = Backoff(budgets.retry_backoff_s, budgets.retry_backoff_cap_s)
                await asyncio.sleep(backoff.delay(attempt))
                attempt += 1

    async def reset(self, task: Task) -> Observation:
        if task.env_id != self.spec.id:
            raise EnvError(f"task {task.task_id!r} belongs to {task.env_id!r}, not {self.spec.id!r}")
        self._turn = 0
        self._episode_over = True
        try:
            observation = await self._with_retries(
                "reset", self.spec.budgets.reset_timeout_s, lambda: self.env.reset(task)
            )
        except (EnvTimeoutError, EnvError, *STOPS_THE_RUN):
            raise
        except Exception as exc:
            raise EnvError(f"{self.spec.id}: reset failed: {type(exc).__name__}: {exc}") from exc
        self._episode_over = False
        return observation

    async def step(self, action: Action) -> StepResult:
        if self._episode_over:
            raise no_episode_error(self.spec.id)
        self._turn += 1
        last_turn = self._turn >= self.spec.budgets.max_turns
        try:
            result = await self._with_retries(
                "step", self.spec.budgets.step_timeout_s, lambda: self.env.step(action)
            )
        except STOPS_THE_RUN:
            raise
        except InvalidActionError as exc:
            result = self._invalid_action(str(exc), last_turn)
        except VerifierError as exc:
            result = _failed(Outcome.VERIFIER_FAILED, exc)
        except EnvTimeoutError as exc:
            result = _failed(Outcome.TIMEOUT, exc)
        except Exception as exc:  # a broken env is env_error, never a reward
            result = _failed(Outcome.ENV_ERROR, exc)
        result = _finite_reward(result)
        if last_turn and not (result.done or result.truncated):
            result = result.model_copy(
                update={"truncated": True, "info": {**result.info, "max_turns_reached": True}}
            )
        self._episode_over = result.done or result.truncated
        return result

    def _invalid_action(self, message: str, last_turn: bool) -> StepResult:
        ends = last_turn
        return StepResult(
            observation=Observation(messages=(Message(role="user", content=f"Invalid action: {message}"),)),
            reward=self.env.invalid_action_reward if ends else None,
            done=ends,
            outcome=Outcome.INVALID_ACTION,
            info={"error": message},
        )


def _failed(outcome: Outcome, exc: BaseException) -> StepResult:
    info: dict[str, Any] = {"error": f"{type(exc).__name__}: {exc}", "traceback": format_traceback(exc)}
    return StepResult(done=True, outcome=outcome, info=info)


def _finite_reward(result: StepResult) -> StepResult:
    """A NaN or infinite reward is a broken scorer: ``verifier_failed`` (no reward), flagged for the checker."""
    if result.reward is None or math.isfinite(result.reward):
        return result
    info = {"error": f"the env returned reward {result.reward} (not finite)", "non_finite_reward": True}
    return StepResult(done=True, outcome=Outcome.VERIFIER_FAILED, info=info)


def outcome_of_error(exc: BaseException) -> Outcome:
    """The outcome of an error that escaped an env where no ``StepResult`` can carry it (a reset)."""
    return Outcome.TIMEOUT if isinstance(exc, EnvTimeoutError) else Outcome.ENV_ERROR


def format_traceback(exc: BaseException) -> str:
    """The full traceback of ``exc`` (chained causes included), as the trajectory records it."""
    return "".join(traceback.format_exception(exc))
