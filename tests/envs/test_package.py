"""The distribution ships every subpackage and exports what we mean to export."""

from __future__ import annotations

import tomllib
from pathlib import Path

import labrl
import labrl.envs
import labrl.errors

ROOT = Path(__file__).parents[2]
MAPPED = {
    "labrl": "labrl",
    "labrl.envs": "envs",
    "labrl.verifiers": "verifiers",
    "labrl.lab_adapters": "lab_adapters",
    "labrl.harness": "harness",
}


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == MAPPED
    on_disk = set()
    for dotted, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([dotted, *relative.parts]))
    assert sorted(on_disk - set(config["packages"])) == []


def test_license_is_declared_as_an_spdx_expression_with_its_file():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # PEP 639 form: setuptools warns on the old table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a pointer to it


def test_public_surface():
    assert (ROOT / "labrl" / "py.typed").exists()
    assert set(labrl.__all__) == {"ConfigError", "LabrlError", "__version__", "errors"}
    assert {"make", "register", "run_episode", "check_env", "Env", "Outcome", "StepResult"} <= set(
        labrl.envs.__all__
    )
    for name in labrl.envs.__all__:
        assert getattr(labrl.envs, name) is not None
    for name in labrl.errors.__all__:
        error = getattr(labrl.errors, name)
        assert issubclass(error, labrl.errors.LabrlError)


def test_errors_pickle_and_subclass_builtins():
    import pickle

    from labrl.errors import ConfigError, EnvTimeoutError, InvalidActionError, LabTransportError

    for error, builtin in [
        (ConfigError, ValueError),
        (EnvTimeoutError, TimeoutError),
        (InvalidActionError, ValueError),
        (LabTransportError, ConnectionError),
    ]:
        exc = error("what to fix")
        assert isinstance(exc, builtin)
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is error and str(again) == "what to fix"


def test_dependencies_point_one_way():
    """harness -> envs -> verifiers, lab_adapters (ARCHITECTURE.md): no module imports upward."""
    import ast

    forbidden = {
        "verifiers": ("labrl.envs", "labrl.harness", "labrl.lab_adapters"),
        "lab_adapters": ("labrl.envs", "labrl.harness"),
        "envs": ("labrl.harness",),
    }
    offenders = []
    for folder, banned in forbidden.items():
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith(banned)]
    assert offenders == []
