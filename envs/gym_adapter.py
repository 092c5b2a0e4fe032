"""Any labrl env as a ``gymnasium.Env`` with text spaces.

::

    env = GymnasiumEnv("xrd/phase-id-v0", split="test")
    obs, info = env.reset(seed=3)          # obs: the conversation so far, as text
    obs, reward, terminated, truncated, info = env.step("answer text")

The labrl env is async; the adapter owns a private event loop and runs each
call to completion on it, so it suits synchronous Gymnasium tooling (and
Gymnasium's ``check_env``), not thousands of concurrent episodes: use
``labrl.envs.run_episode`` for those.

Gymnasium's registry: importing this module registers every labrl env under
Gymnasium's ``labrl`` namespace, so Gymnasium's own ``make`` finds them::

    import gymnasium
    env = gymnasium.make("labrl.envs.gym_adapter:labrl/xrd-phase-id-v0", tier=2)
    # or: import labrl.envs.gym_adapter; gymnasium.make("labrl/xrd-phase-id-v0")

Gymnasium ids cannot hold a second ``/``, so the mapping is
``namespace/name-vN`` -> ``labrl/namespace-name-vN`` (``gymnasium_id``);
the way back (``labrl_id``) is the table built at registration, which
refuses two labrl ids that would map to the same Gymnasium id (namespaces
may contain ``-``). Keyword arguments of ``gymnasium.make`` are this
adapter's (``split``, ``max_observation_chars``) and the env's options.

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
from labrl.envs.registry import make, registered_ids
from labrl.envs.types import ENV_ID_PATTERN, Message, Split
from labrl.errors import RegistryError

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


GYMNASIUM_NAMESPACE = "labrl"
_GYM_TO_LABRL: dict[str, str] = {}


def gymnasium_id(env_id: str) -> str:
    """``xrd/phase-id-v0`` -> ``labrl/xrd-phase-id-v0`` (see the module docstring)."""
    match = ENV_ID_PATTERN.match(env_id)
    if match is None:
        raise RegistryError(f"{env_id!r} is not a labrl env id ('namespace/name-vN')")
    prefix = f"{match['namespace']}-" if match["namespace"] else ""
    return f"{GYMNASIUM_NAMESPACE}/{prefix}{match['name']}-v{match['version']}"


def labrl_id(gym_id: str) -> str:
    """The labrl env registered under Gymnasium id ``gym_id`` (after ``register_gymnasium_envs``)."""
    try:
        return _GYM_TO_LABRL[gym_id]
    except KeyError:
        raise RegistryError(f"{gym_id!r} is not a registered labrl env in Gymnasium") from None


def register_gymnasium_envs() -> dict[str, str]:
    """Register every labrl env (built-in and plugins) in Gymnasium's registry; returns gym id -> labrl id.

    Idempotent: ids already registered by this function are skipped. A labrl id whose Gymnasium
    id is taken by another labrl id is refused with ``RegistryError``.
    """
    for env_id in registered_ids():
        gym_id = gymnasium_id(env_id)
        owner = _GYM_TO_LABRL.get(gym_id)
        if owner == env_id:
            continue
        if owner is not None:
            raise RegistryError(f"{env_id} and {owner} both map to the Gymnasium id {gym_id}; rename one")
        gymnasium.register(
            id=gym_id,
            entry_point="labrl.envs.gym_adapter:GymnasiumEnv",
            kwargs={"env": env_id},
            disable_env_checker=False,
        )
        _GYM_TO_LABRL[gym_id] = env_id
    return dict(_GYM_TO_LABRL)


register_gymnasium_envs()
