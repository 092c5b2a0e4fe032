from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from labrl.envs import BudgetedEnv, load_plugins, make, register, registered_ids, spec
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
