"""An env's manifest: what a hub or a protocol's metadata route publishes about it.

Protocol-neutral: the fields both OpenEnv's ``/metadata`` (``name``,
``description``, ``version``, ``author``, ``documentation_url``) and the Open
Reward Standard's environment listing (name, splits, tools) need, plus what a
client needs to act (``action``, ``observation``: a description and a JSON
schema each, from ``labrl.interop.wire``), the budgets, the ``-o`` options and
the Python distributions the env needs (``dependencies``); JSON values only. Each protocol's
server shapes it for its own route; ``labrl envs show ENV_ID --json`` prints it.

- ``version`` is the id's version suffix (``xrd/phase-id-v1`` -> ``v1``): a
  change of meaning gets a new id, so the id's suffix is the env's version.
- ``author`` is the distribution that registered the env (``labrl`` for the
  built-in envs, the plugin's distribution otherwise).
- ``route_name`` is the id with ``/`` replaced by ``--``: protocols that put the
  env's name in a URL path segment (OpenEnv's task routes) cannot carry a ``/``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, metadata, version
from typing import Any, get_args

from pydantic_core import to_jsonable_python

from labrl.envs.registry import env_options, make, registration
from labrl.envs.types import Split
from labrl.interop.wire import WireAction, WireObservation

ACTION_DESCRIPTION = (
    "The model's reply text, as the model wrote it. Tool calls are "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks; an answer is written as the '
    "observation's prompt asks. A reply the env cannot use is outcome invalid_action, with the reason "
    "shown in the next observation."
)
OBSERVATION_DESCRIPTION = (
    "New chat messages (the opening prompt at reset, then the env's replies), the tools the model may "
    "call, and on each step labrl's outcome (ok, invalid_action, timeout, env_error, verifier_failed). "
    "The reward is None for timeout, env_error and verifier_failed: the episode is not scored."
)


def route_name(env_id: str) -> str:
    return env_id.replace("/", "--")


def env_version(env_id: str) -> str:
    return "v" + env_id.rsplit("-v", 1)[1]


def _distribution(name: str) -> str:
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        return name


def manifest(env_id: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of ``env_id`` built with ``options`` (builds the env once, as ``labrl envs show``)."""
    registered = registration(env_id)
    spec = make(env_id, checked=False, **(options or {})).spec
    packages = [_distribution("labrl")]
    if registered.source != "labrl":
        packages.append(_distribution(registered.source))
    shown = {
        "name": env_id,
        "route_name": route_name(env_id),
        "version": env_version(env_id),
        "description": spec.description,
        "author": registered.source,
        "documentation_url": None,
        "license": spec.license,
        "tags": list(spec.tags),
        "splits": list(get_args(Split)),
        "has_gold_answer": spec.has_gold_answer,
        "budgets": spec.budgets.model_dump(),
        "tools": [tool.model_dump() for tool in spec.tools],
        "options": env_options(env_id),
        "action": {"description": ACTION_DESCRIPTION, "schema": WireAction.model_json_schema()},
        "observation": {
            "description": OBSERVATION_DESCRIPTION,
            "schema": WireObservation.model_json_schema(),
        },
        "dependencies": {"python": metadata("labrl")["Requires-Python"], "packages": packages},
    }
    # JSON values only (an option's default may be a config model): the CLI and every route print the same
    jsonable: dict[str, Any] = to_jsonable_python(shown, fallback=str)
    return jsonable


def with_extra(shown: dict[str, Any], extra: str) -> dict[str, Any]:
    """``shown`` with the labrl extra a protocol's server needs added to its dependencies."""
    dependencies = shown["dependencies"]
    packages = [
        f"labrl[{extra}]{p[len('labrl') :]}" if p == "labrl" or p.startswith("labrl==") else p
        for p in dependencies["packages"]
    ]
    return {**shown, "dependencies": {**dependencies, "packages": packages}}
