"""The ``Env`` base class every labrl environment subclasses.

An env instance runs one episode at a time (like a Gymnasium env); the
harness makes one instance per concurrent episode, so per-episode state lives
on ``self``. Heavy shared resources (a phase library, a calculator) belong in
module-level caches, not in each instance.

Subclasses implement ``make_task``, ``reset`` and ``step``; the framework's
``BudgetedEnv`` wrapper (added by ``labrl.envs.make``) enforces the budgets in
``spec.budgets`` around them.

``spec`` (an ``EnvSpec``) belongs to the registration, as in Gymnasium: a
class that leaves it unset gets one from ``make``, built from the registered
id and the class attributes it declares (``description``, ``budgets``,
``max_turns``, ``tools``, ``tags``, ``license``, ``has_gold_answer``; see
``labrl.envs.registry.spec_from_class``). A class may set ``self.spec``
itself, with the registered id. Inside an env:

- raise ``InvalidActionError(msg)`` for an unusable action: the wrapper turns
  it into an ``invalid_action`` step whose observation shows ``msg`` to the
  model, with reward ``spec.invalid_action_reward`` when the episode ends;
- compute rewards with ``await self.score(fn, *args)``: it applies the scoring
  deadline, runs ``fn`` off the loop when asked, and turns any failure into
  ``VerifierError`` (outcome ``verifier_failed``), never a silent 0;
- raise ``TransientEnvError`` for infrastructure hiccups worth a retry;
- wrap scarce resources in ``async with self.pool("lab"):``;
- ``reset`` records the episode's task in ``self._task``; ``step`` reads it
  as ``self.episode_task()``, which raises ``EnvError`` when no episode was
  started (the one place that rule is written, with ``no_episode_error``).

``reset_is_cheap()`` opts in to the pre-flight check that the opening prompt
fits the model's context (say True only when ``reset`` is local and quick).

``gold_actions(task)`` returns actions that score full reward, where the env
knows the answer (the checker and the scripted policy use it);
``random_action(task, rng)`` a plausible but uninformed action (for dry runs).

``task_label(task)`` and ``answer_label(task, final_info)`` opt in to per-class
evaluation: the class a task belongs to and the class the policy answered,
read from the info of the episode's last step. The harness then breaks each
held-out evaluation down by class (``by_label`` in ``eval.jsonl``), which is
how a policy that never names some class shows up. Default None: no breakdown.
"""

from __future__ import annotations

import asyncio
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel

from labrl.envs.pools import get_pool
from labrl.envs.types import Action, EnvSpec, Observation, Split, StepResult, Task
from labrl.errors import ConfigError, CredentialsRefusedError, EnvError, EnvTimeoutError, VerifierError
from labrl.offload import run_cpu

T = TypeVar("T")


def no_episode_error(env_id: str) -> EnvError:
    """The error of a ``step()`` with no episode running (never reset, or already over)."""
    return EnvError(f"{env_id}: step() called with no episode running; call reset() first")


class Env(ABC):
    """One async, possibly very slow, environment. See the module docstring."""

    #: set by ``make`` from the registration unless the constructor sets it (module docstring)
    spec: EnvSpec
    #: reward of an episode that ends on an invalid action
    invalid_action_reward: ClassVar[float] = 0.0
    #: the running episode's task; ``reset`` sets it, ``episode_task()`` reads it
    _task: Task | None = None
    #: the pydantic model an env taking ``**options`` validates them with: ``make`` then knows the
    #: accepted names ("did you mean"), ``labrl envs show`` lists them. None: the constructor's signature.
    options_model: ClassVar[type[BaseModel] | None] = None

    @abstractmethod
    def make_task(self, split: Split, seed: int) -> Task:
        """The task for ``(split, seed)``: pure and deterministic; train and test disjoint."""

    @abstractmethod
    async def reset(self, task: Task) -> Observation:
        """Start an episode on ``task``; returns the opening messages and tools."""

    @abstractmethod
    async def step(self, action: Action) -> StepResult:
        """Apply the model's turn."""

    async def close(self) -> None:
        """Release per-instance resources (connections, subprocesses)."""
        return None

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        """Actions that earn full reward on ``task``, or None when unknown."""
        return None

    def random_action(self, task: Task, rng: random.Random) -> Action:
        """An uninformed action for dry runs; envs override with something on-format."""
        return Action(
            text="".join(rng.choice('abcdefghij {}[]:,"0123456789') for _ in range(rng.randint(0, 40)))
        )

    def task_label(self, task: Task) -> str | None:
        """The class ``task`` belongs to, for per-class evaluation; None (the default): no breakdown."""
        return None

    def answer_label(self, task: Task, final_info: Mapping[str, Any]) -> str | None:
        """The class the policy answered on ``task``, from the ``info`` of the episode's last step.

        Asked only where ``task_label`` gives a label and the episode's outcome is trainable
        (an answer the env judged); None: the answers are not broken down.
        """
        return None

    def reset_is_cheap(self) -> bool:
        """Whether ``reset`` is local and quick: no lab, network, judge, subprocess or deliberate wait.

        An env that says so has its opening prompt measured before training: ``labrl train`` resets
        the run's first train tasks and refuses a model context that cannot hold the prompt
        (``labrl.harness.pipeline.prompt_fit``). Default False: the check is skipped.
        """
        return False

    @property
    def unwrapped(self) -> Env:
        return self

    # -- helpers for subclasses ------------------------------------------------

    def episode_task(self) -> Task:
        """The task ``reset`` started; ``EnvError`` when ``step`` comes before any ``reset``."""
        if self._task is None:
            raise no_episode_error(self.spec.id)
        return self._task

    def pool(self, name: str) -> AbstractAsyncContextManager[Any]:
        """The shared concurrency pool ``name`` declared in ``spec.budgets.pools``."""
        pools = self.spec.budgets.pools
        if name not in pools:
            raise ConfigError(
                f"{self.spec.id} uses concurrency pool {name!r} but its budgets declare only "
                f"{sorted(pools)}: add it to Budgets(pools=...)"
            )
        return get_pool(name, pools[name])

    async def score(
        self,
        fn: Callable[..., T] | Callable[..., Awaitable[T]],
        *args: Any,
        offload: bool = False,
        **kwargs: Any,
    ) -> T:
        """Compute a reward under the scoring deadline; failures become ``VerifierError``, except a
        judge refusing our key (``CredentialsRefusedError``), which stops the run.

        ``fn`` may be a coroutine function (awaited), a plain function run
        inline (fast scorers), or with ``offload=True`` a module-level function
        run in the process pool (CPU-heavy scorers).
        """
        timeout = self.spec.budgets.scoring_timeout_s
        try:
            async with asyncio.timeout(timeout):
                if offload:
                    return await run_cpu(fn, *args, **kwargs)  # type: ignore[arg-type]
                if asyncio.iscoroutinefunction(fn):
                    return await fn(*args, **kwargs)
                return fn(*args, **kwargs)  # type: ignore[return-value]
        except TimeoutError:
            raise EnvTimeoutError(f"{self.spec.id}: scoring did not finish within {timeout:g} s") from None
        except (VerifierError, EnvTimeoutError, CredentialsRefusedError):
            raise
        except Exception as exc:
            raise VerifierError(f"{self.spec.id}: scoring failed: {type(exc).__name__}: {exc}") from exc
