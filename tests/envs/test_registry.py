from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from labrl_test_envs import EchoEnv

from labrl.envs import (
    BudgetedEnv,
    Budgets,
    load_plugins,
    make,
    register,
    registered_ids,
    run_episode,
    scripted_policy,
    spec,
)
from labrl.envs.registry import deregister
from labrl.errors import ConfigError, RegistryError

PLUGIN = Path(__file__).parents[1] / "support" / "plugin_pkg"


def test_make_wraps_in_budgets_and_applies_overrides():
    env = make("test/echo-v0", step_delay=0.0, budgets={"step_timeout_s": 7})
    assert isinstance(env, BudgetedEnv)
    assert env.spec.budgets.step_timeout_s == 7
    assert env.unwrapped.step_delay == 0.0
    assert not isinstance(make("test/echo-v0", checked=False), BudgetedEnv)
    assert spec("test/echo-v0").id == "test/echo-v0"


def test_unknown_id_suggests_closest():
    with pytest.raises(
        RegistryError, match=re.escape("unknown env 'test/ecoh-v0'; did you mean 'test/echo-v0'")
    ):
        make("test/ecoh-v0")
    with pytest.raises(
        RegistryError, match=re.escape("unknown env 'test/echo-v3'; registered versions: test/echo-v0")
    ):
        make("test/echo-v3")


def test_bad_options_name_the_option():
    with pytest.raises(
        ConfigError,
        match=re.escape("test/echo-v0 does not accept option(s) 'step_dlay' (did you mean 'step_delay'?)"),
    ):
        make("test/echo-v0", step_dlay=1)
    with pytest.raises(
        ConfigError, match=re.escape("test/echo-v0: unknown budget field(s) ['step_timeout']")
    ):
        make("test/echo-v0", budgets={"step_timeout": 1})


def test_register_validates_ids_and_duplicates():
    with pytest.raises(RegistryError, match="must look like 'namespace/name-vN'"):
        register("Bad Id", entry_point="x:y")
    with pytest.raises(RegistryError, match=re.escape("env 'test/echo-v0' is already registered (by tests)")):
        register("test/echo-v0", entry_point="x:y")
    register("test/missing-v0", entry_point="no_such_module_xyz:Env")
    try:
        with pytest.raises(RegistryError, match="cannot import 'no_such_module_xyz' for env test/missing-v0"):
            make("test/missing-v0")
    finally:
        deregister("test/missing-v0")


def test_spec_id_must_match_registration():
    register("test/mismatch-v0", entry_point="labrl_test_envs:EchoEnv")
    try:
        with pytest.raises(
            RegistryError,
            match=re.escape("env registered as 'test/mismatch-v0' reports spec.id 'test/echo-v0'"),
        ):
            make("test/mismatch-v0")
    finally:
        deregister("test/mismatch-v0")


class DeclaredEchoEnv(EchoEnv):
    """Echo that sets no ``spec``: ``make`` builds it from the registration and these attributes."""

    description = "repeat the word; spec from the registration"
    max_turns = 2
    tags = ("test",)
    has_gold_answer = True

    def __init__(self) -> None:
        self.step_delay = 0.0
        self.task = None


@pytest.fixture
def declared_ids():
    ids = ("test/declared-v0", "test/declared-v1")
    for env_id in ids:
        register(env_id, entry_point=DeclaredEchoEnv)
    yield ids
    for env_id in ids:
        deregister(env_id)


async def test_a_class_without_a_spec_gets_one_from_its_registration(declared_ids):
    for env_id in declared_ids:  # one class, two ids: each made env carries the id it was made under
        env = make(env_id, budgets={"step_timeout_s": 9})
        assert env.spec.id == env.unwrapped.spec.id == env_id
        assert env.spec.description == "repeat the word; spec from the registration"
        assert (env.spec.tags, env.spec.has_gold_answer) == (("test",), True)
        assert (env.spec.budgets.max_turns, env.spec.budgets.step_timeout_s) == (2, 9)
        task = env.make_task("test", 1)
        episode = await run_episode(env, task, scripted_policy(env.gold_actions(task)))
        assert (task.env_id, episode.reward) == (env_id, 1.0)


def _make_declaring(**attributes):
    """``make`` a fresh ``DeclaredEchoEnv`` subclass with ``attributes``, registered as test/declaring-v0."""
    register("test/declaring-v0", entry_point=type("DeclaringEnv", (DeclaredEchoEnv,), attributes))
    try:
        return make("test/declaring-v0")
    finally:
        deregister("test/declaring-v0")


def test_declared_spec_attributes_are_validated():
    invalid = "test/declaring-v0: the spec that class DeclaringEnv declares is invalid: "
    with pytest.raises(RegistryError, match=re.escape(invalid + "max_turns = 2 but budgets.max_turns = 3")):
        _make_declaring(budgets=Budgets(max_turns=3))
    with pytest.raises(
        RegistryError, match=re.escape(invalid + "step_timeout_s: Input should be greater than 0")
    ):
        _make_declaring(budgets={"step_timeout_s": -1})
    with pytest.raises(RegistryError, match=re.escape("has a .spec of type str, not EnvSpec")):
        _make_declaring(spec="test/declaring-v0")
    assert _make_declaring(budgets={"step_timeout_s": 5}).spec.budgets.model_dump() == {
        **Budgets().model_dump(),
        "step_timeout_s": 5,
        "max_turns": 2,
    }


def test_env_registered_through_an_installed_entry_point(tmp_path, monkeypatch):
    """A third-party distribution registers its env by being installed."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(PLUGIN),
        ],
        check=True,
        capture_output=True,
    )
    monkeypatch.syspath_prepend(str(target))
    try:
        assert "demo/titration-v0" in load_plugins()
        assert "demo/titration-v0" in registered_ids()
        from labrl.envs import check_env

        report = check_env("demo/titration-v0", seeds=4)
        assert report.passed, report
    finally:
        deregister("demo/titration-v0")
