"""Register environments by versioned id and make them.

::

    register("xrd/phase-id-v0", entry_point="labrl.envs.xrd:PhaseIdEnv", tier=1)
    env = make("xrd/phase-id-v0", tier=2, budgets={"step_timeout_s": 30})
    spec("xrd/phase-id-v0")

- Ids are ``namespace/name-vN``; a change of meaning gets a new N.
- Entry points are lazy ``"module:attr"`` strings (or callables): nothing is
  imported until ``make``.
- ``make`` merges keyword defaults from ``register`` with overrides, builds
  the env, applies ``budgets`` overrides to its spec and wraps it in
  ``BudgetedEnv``. Unknown keyword arguments are a ``ConfigError`` that lists
  the accepted ones.
- The registration owns the id (as in Gymnasium): an env that sets no
  ``spec`` gets one built by ``make`` from the registered id and the class
  attributes it declares (``SPEC_CLASS_ATTRIBUTES``: ``description``,
  ``budgets``, ``max_turns``, ``tools``, ``tags``, ``license``,
  ``has_gold_answer``). An env that sets its own ``spec`` keeps it, but its id
  must be the registered id (``RegistryError`` naming both).
- Third-party packages register envs by being installed: each entry point in
  the group ``labrl.envs`` maps an env id to a ``module:attr``::

      [project.entry-points."labrl.envs"]
      "mylab/titration-v0" = "mylab.envs:TitrationEnv"

- An unknown id fails with the closest registered ids.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from pydantic import ValidationError

from labrl.envs.base import Env
from labrl.envs.budgets import BudgetedEnv
from labrl.envs.types import ENV_ID_PATTERN, Budgets, EnvSpec
from labrl.errors import ConfigError, LabrlError, RegistryError

ENTRY_POINT_GROUP = "labrl.envs"

EntryPoint = str | Callable[..., Env]


@dataclass(frozen=True)
class Registration:
    id: str
    entry_point: EntryPoint
    defaults: Mapping[str, Any] = field(default_factory=dict)
    source: str = "labrl"  # "labrl", or the distribution that registered it

    def load(self) -> Callable[..., Env]:
        if callable(self.entry_point):
            return self.entry_point
        module_name, _, attr = self.entry_point.partition(":")
        if not attr:
            raise RegistryError(
                f"entry point {self.entry_point!r} for {self.id} must look like 'module:attr'"
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise RegistryError(
                f"cannot import {module_name!r} for env {self.id} ({self.source}): {exc}"
            ) from exc
        except Exception as exc:  # a plugin module that fails at import: one line naming it, no traceback
            raise RegistryError(
                f"importing {module_name!r} for env {self.id} ({self.source}) failed: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            return getattr(module, attr)
        except AttributeError:
            raise RegistryError(
                f"module {module_name!r} has no {attr!r} (entry point of env {self.id})"
            ) from None


_REGISTRY: dict[str, Registration] = {}
_plugins_loaded = False


def register(env_id: str, entry_point: EntryPoint, *, source: str = "labrl", **defaults: Any) -> None:
    """Register ``env_id``; registering the same id twice is an error."""
    if not ENV_ID_PATTERN.match(env_id):
        raise RegistryError(
            f"env id {env_id!r} must look like 'namespace/name-vN' (lowercase, e.g. 'xrd/phase-id-v0')"
        )
    if env_id in _REGISTRY:
        raise RegistryError(f"env {env_id!r} is already registered (by {_REGISTRY[env_id].source})")
    _REGISTRY[env_id] = Registration(env_id, entry_point, dict(defaults), source)


def deregister(env_id: str) -> None:
    """Remove ``env_id`` (tests and interactive sessions)."""
    _REGISTRY.pop(env_id, None)


def _ensure_loaded() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from labrl.envs.builtin import register_builtin_envs

    register_builtin_envs()
    load_plugins()


def load_plugins() -> list[str]:
    """Register the envs that installed distributions declare in the ``labrl.envs`` group."""
    added = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        dist = ep.dist.name if ep.dist is not None else "unknown distribution"
        try:
            register(ep.name, ep.value, source=dist)
        except RegistryError as exc:  # one broken plugin must not take the others (or the CLI) down
            warnings.warn(f"skipping env entry point of {dist}: {exc}", RuntimeWarning, stacklevel=2)
            continue
        added.append(ep.name)
    return added


def registered_ids() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def registration(env_id: str) -> Registration:
    _ensure_loaded()
    try:
        return _REGISTRY[env_id]
    except KeyError:
        raise RegistryError(_unknown_id_message(env_id)) from None


def _unknown_id_message(env_id: str) -> str:
    known = sorted(_REGISTRY)
    base = env_id.rsplit("-v", 1)[0]
    versions = [k for k in known if k.rsplit("-v", 1)[0] == base]
    if versions:
        return f"unknown env {env_id!r}; registered versions: {', '.join(versions)}"
    close = difflib.get_close_matches(env_id, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown env {env_id!r}{hint} (see `labrl envs list`)"


@functools.cache
def _accepted_options(factory: Callable[..., Env]) -> tuple[str, ...] | None:
    """Keyword names ``factory`` accepts, or None when it takes ``**kwargs`` (or has no signature).

    An env class that validates ``**options`` with a pydantic model names it in ``options_model``;
    its fields are the accepted names. Cached: ``make`` runs once per episode, thousands of times
    a second.
    """
    model = getattr(factory, "options_model", None)
    if model is not None:
        return tuple(model.model_fields)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return tuple(
        n for n, p in signature.parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


def _build(factory: Callable[..., Env], env_id: str, kwargs: dict[str, Any]) -> Env:
    accepted = _accepted_options(factory)
    if accepted is not None:
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, accepted, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"{env_id} does not accept option(s) {', '.join(hints)}; accepted: {', '.join(accepted) or 'none'}"
            )
    try:
        env = factory(**kwargs)
    except LabrlError:
        raise
    except Exception as exc:  # a bug in the env's constructor: one line naming the env and its source
        source = _REGISTRY[env_id].source if env_id in _REGISTRY else "unregistered"
        raise RegistryError(
            f"env {env_id} ({source}) failed to construct: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(env, Env):
        raise RegistryError(f"entry point of {env_id} returned {type(env).__name__}, not a labrl.envs.Env")
    return env


def make(
    env_id: str, *, budgets: Mapping[str, Any] | None = None, checked: bool = True, **overrides: Any
) -> Env:
    """Build ``env_id`` with registered defaults and ``overrides``, wrapped in ``BudgetedEnv``.

    ``budgets`` overrides fields of ``spec.budgets`` (e.g. ``{"step_timeout_s": 30}``);
    ``checked=False`` returns the bare env (for the checker and tests).
    """
    reg = registration(env_id)
    env = _build(reg.load(), env_id, {**reg.defaults, **overrides})
    spec = getattr(env, "spec", None)
    if spec is None:
        spec = env.spec = spec_from_class(type(env), env_id)
    elif not isinstance(spec, EnvSpec):
        raise RegistryError(
            f"{env_id}: env class {type(env).__name__} has a .spec of type {type(spec).__name__}, not "
            f"EnvSpec; leave .spec unset and make() builds it from the registration"
        )
    elif spec.id != env_id:
        raise RegistryError(f"env registered as {env_id!r} reports spec.id {spec.id!r}; they must match")
    if budgets:
        env.spec = spec.model_copy(update={"budgets": _merge_budgets(spec.budgets, budgets, env_id)})
    return BudgetedEnv(env) if checked else env


SPEC_CLASS_ATTRIBUTES = ("description", "budgets", "max_turns", "tools", "tags", "license", "has_gold_answer")


@functools.cache
def spec_from_class(cls: type[Env], env_id: str) -> EnvSpec:
    """The spec of a class that sets none: ``env_id`` plus the ``SPEC_CLASS_ATTRIBUTES`` it declares.

    ``max_turns`` is shorthand for ``budgets.max_turns``; ``budgets`` may be a ``Budgets`` or a dict.
    Cached (specs are frozen): ``make`` runs once per episode.
    """
    declared = {name: getattr(cls, name) for name in SPEC_CLASS_ATTRIBUTES if hasattr(cls, name)}
    max_turns = declared.pop("max_turns", None)
    try:
        budgets = Budgets.model_validate(declared.pop("budgets", {}))
        if max_turns is not None:
            if "max_turns" in budgets.model_fields_set and budgets.max_turns != max_turns:
                raise ValueError(f"max_turns = {max_turns} but budgets.max_turns = {budgets.max_turns}")
            budgets = Budgets.model_validate({**budgets.model_dump(), "max_turns": max_turns})
        return EnvSpec.model_validate({**declared, "id": env_id, "budgets": budgets})
    except ValueError as exc:  # pydantic's ValidationError included
        raise RegistryError(
            f"{env_id}: the spec that class {cls.__name__} declares is invalid: {_one_line(exc)}"
        ) from exc


def _one_line(exc: ValueError) -> str:
    """A pydantic ``ValidationError`` as ``loc: msg; ...``; any other error as it reads."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return str(exc)


def _merge_budgets(current: Budgets, overrides: Mapping[str, Any], env_id: str) -> Budgets:
    unknown = sorted(set(overrides) - set(Budgets.model_fields))
    if unknown:
        raise ConfigError(
            f"{env_id}: unknown budget field(s) {unknown}; known: {sorted(Budgets.model_fields)}"
        )
    try:
        return Budgets.model_validate({**current.model_dump(), **overrides})
    except ValueError as exc:
        raise ConfigError(f"{env_id}: invalid budgets override: {exc}") from exc


def spec(env_id: str) -> EnvSpec:
    """The spec of ``env_id`` (builds the env once with its registered defaults)."""
    return make(env_id, checked=False).spec


def env_options(env_id: str) -> list[dict[str, Any]]:
    """The options ``make(env_id, **options)`` accepts: name, default, type and description.

    From the env's ``options_model`` (pydantic) when it has one, else from its constructor's
    signature (``description`` empty). Registered defaults replace the constructor's.
    """
    reg = registration(env_id)
    factory = reg.load()
    model = getattr(factory, "options_model", None)
    rows: list[dict[str, Any]] = []
    if model is not None:
        for name, info in model.model_fields.items():
            default = None if info.is_required() else info.get_default(call_default_factory=True)
            rows.append({"name": name, "default": default, "type": _type_name(info.annotation),
                         "description": info.description or ""})  # fmt: skip
    else:
        try:
            parameters = inspect.signature(factory).parameters.values()
        except (TypeError, ValueError):
            parameters = []  # type: ignore[assignment]
        for p in parameters:
            if p.kind not in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                continue
            default = None if p.default is inspect.Parameter.empty else p.default
            annotation = "" if p.annotation is inspect.Parameter.empty else p.annotation
            rows.append(
                {"name": p.name, "default": default, "type": _type_name(annotation), "description": ""}
            )
    for row in rows:
        if row["name"] in reg.defaults:
            row["default"] = reg.defaults[row["name"]]
    return rows


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if getattr(annotation, "__origin__", None) is not None:  # Literal[1, 2], list[str], ...
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
