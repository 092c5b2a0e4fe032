"""Any labrl env as a ``gymnasium.Env`` with text spaces.

::

    env = GymnasiumEnv("xrd/phase-id-v0", split="test")
    obs, info = env.reset(seed=3)          # obs: the conversation so far, as text
    obs, reward, terminated, truncated, info = env.step("answer text")

The labrl env is async; the adapter owns a private event loop and runs each
call to completion on it, so it suits synchronous Gymnasium tooling (and
Gymnasium's ``check_env``), not thousands of concurrent episodes: use
``labrl.envs.run_episode`` for those.

Observations are the new messages rendered as ``[role] content`` lines.
Gymnasium's ``Text`` space needs a fixed character set, so characters outside
printable ASCII are written as Python escapes (``Å`` -> ``\\xc5``) and the text
is cut to ``max_observation_chars``. ``reward`` is 0.0 when the env gave none
(mid-episode, or a failed outcome); ``info["outcome"]`` tells which.
"""

from __future__ import annotations

import asyncio
import string
from typing import Any

import gymnasium
from gymnasium import spaces

from labrl.envs.actions import parse_action
from labrl.envs.base import Env
from labrl.envs.registry import make
from labrl.envs.types import Message, Split

CHARSET = string.printable
MAX_ACTION_CHARS = 8192


def render_messages(messages: tuple[Message, ...], limit: int) -> str:
    text = "\n".join(f"[{m.role}] {m.content}" for m in messages)
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(ch if ch in CHARSET else repr(ch)[1:-1] for ch in text)
    return text[:limit]


class GymnasiumEnv(gymnasium.Env[str, str]):
    metadata = {"render_modes": []}  # noqa: RUF012  (Gymnasium's class-level convention)

    def __init__(
        self, env: str | Env, *, split: Split = "train", max_observation_chars: int = 32768, **options: Any
    ) -> None:
        self.env = make(env, **options) if isinstance(env, str) else env
        self.labrl_spec = self.env.spec
        self.split = split
        self.max_observation_chars = max_observation_chars
        self.observation_space = spaces.Text(max_length=max_observation_chars, min_length=0, charset=CHARSET)
        self.action_space = spaces.Text(max_length=MAX_ACTION_CHARS, min_length=0, charset=CHARSET)
        self._loop = asyncio.new_event_loop()
        self._running = False

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        split = (options or {}).get("split", self.split)
        task_seed = seed if seed is not None else int(self.np_random.integers(0, 2**31 - 1))
        task = self.env.make_task(split, task_seed)
        observation = self._run(self.env.reset(task))
        self._running = True
        info = {
            "task_id": task.task_id,
            "tools": [t.name for t in observation.tools or self.labrl_spec.tools],
        }
        return render_messages(observation.messages, self.max_observation_chars), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self._running:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        result = self._run(self.env.step(parse_action(str(action))))
        self._running = not (result.done or result.truncated)
        info = {"outcome": result.outcome.value, **result.info}
        reward = float(result.reward) if result.reward is not None else 0.0
        return (
            render_messages(result.observation.messages, self.max_observation_chars),
            reward,
            result.done,
            result.truncated,
            info,
        )

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self.env.close())
            self._loop.close()
