"""The distribution ships every subpackage and exports what we mean to export."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
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
    "labrl.interop": "interop",
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


def test_the_wheel_carries_every_file_of_the_package_folders(tmp_path):
    """A non-editable install (a GPU node's, a user's ``pip install labrl``) reads its data from the
    wheel: once the XRD libraries under ``verifiers/xrd/data/`` were left out, and every XRD env
    failed there with "phases.json is missing"."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("labrl-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for dotted, folder in MAPPED.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                expected.add("/".join([*dotted.split("."), *path.relative_to(ROOT / folder).parts]))
    assert sorted(expected - shipped) == []


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


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level?) for every import in ``path``; ``from a import b`` gives a and a.b."""
    import ast

    tree = ast.parse(path.read_text())
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, functions) for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found += [(name, id(node) not in inside) for name in names]
    return found


def test_dependencies_point_one_way():
    """harness -> envs -> verifiers, lab_adapters (docs/architecture.md): no module imports upward."""
    forbidden = {
        "verifiers": ("labrl.envs", "labrl.harness", "labrl.lab_adapters", "labrl.interop"),
        "lab_adapters": ("labrl.envs", "labrl.harness", "labrl.interop"),
        "envs": ("labrl.harness", "labrl.interop"),
        "harness": ("labrl.interop",),
        "interop": ("labrl.harness",),
    }
    offenders = []
    for folder, banned in forbidden.items():
        for path in (ROOT / folder).rglob("*.py"):
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n, _ in _imports(path) if n.startswith(banned)]
    # the protocols sit at the edge: of the core, only the CLI (labrl/commands/) reaches them
    for path in (ROOT / "labrl").rglob("*.py"):
        if path.parent.name != "commands":
            offenders += [
                f"{path.relative_to(ROOT)}: {n}" for n, _ in _imports(path) if n.startswith("labrl.interop")
            ]
    assert offenders == []


def test_a_run_is_assembled_without_a_cycle():
    """runner -> backends -> parts: no backend (nor the Ray actors) imports the runner, and the
    pipeline's loop imports no backend, even inside a function."""
    import labrl.harness.backends.parts
    import labrl.harness.backends.ray.backend  # noqa: F401  (both import cleanly on their own)

    rules = {
        "harness/backends": "labrl.harness.pipeline.runner",
        "harness/pipeline": "labrl.harness.backends",
    }
    offenders = []
    for folder, banned in rules.items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "runner.py":  # the one module that picks a backend
                continue
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n, _ in _imports(path) if n.startswith(banned)]
    assert offenders == []


def test_planning_sits_beside_the_run_and_nothing_that_runs_imports_it():
    """harness/planning reads the pipeline's rules and a run's files; a run never needs the planner."""
    offenders = []
    for folder in (
        "harness/pipeline",
        "harness/backends",
        "harness/rollout",
        "harness/samplers",
        "harness/learners",
    ):
        for path in (ROOT / folder).rglob("*.py"):
            offenders += [
                f"{path.relative_to(ROOT)}: {n}"
                for n, _ in _imports(path)
                if n.startswith("labrl.harness.planning")
            ]
    for path in (ROOT / "harness" / "planning").rglob("*.py"):
        offenders += [
            f"{path.relative_to(ROOT)}: {n}"
            for n, _ in _imports(path)
            if n.startswith(
                (
                    "labrl.harness.backends",
                    "labrl.harness.pipeline.orchestrator",
                    "labrl.harness.pipeline.runner",
                )
            )
        ]
    assert offenders == []


MOCK = "labrl.lab_adapters.mock"
#: the one place outside the mock that may start it: the lab envs' offline default (no ``lab_url``),
#: imported inside the function that opens it, so an env talking to a real lab never loads the mock
MOCK_STARTED_BY = {"envs/lab/session.py"}


def test_no_real_adapter_and_no_env_imports_the_mock():
    offenders = []
    for folder in ("lab_adapters", "envs", "verifiers", "harness"):
        for path in (ROOT / folder).rglob("*.py"):
            where = path.relative_to(ROOT).as_posix()
            if where.startswith("lab_adapters/mock/"):
                continue
            for name, module_level in _imports(path):
                if (name == MOCK or name.startswith(MOCK + ".")) and (
                    module_level or where not in MOCK_STARTED_BY
                ):
                    offenders.append(f"{where}: {name}")
    assert offenders == []


def test_the_mock_imports_only_public_lab_contracts():
    """The mock is a lab: it sees the protocol and the recipe rules, never an env or the harness."""
    allowed = (
        "labrl.lab_adapters.mock",
        "labrl.lab_adapters.protocol",
        "labrl.lab_adapters.recipes",
        "labrl.lab_adapters.calculators",
        "labrl.lab_adapters.structures",
        "labrl.verifiers.xrd",
        "labrl.errors",
        "labrl.offload",
        "labrl.ports",
        "labrl.sqlite_thread",
        "labrl.cli",
    )
    used = set()
    for path in (ROOT / "lab_adapters" / "mock").rglob("*.py"):
        used |= {n for n, _ in _imports(path) if n.startswith("labrl.")}
    unexpected = sorted(n for n in used if not n.startswith(allowed) and n != "labrl.lab_adapters")
    assert unexpected == []


def test_importing_the_envs_and_real_adapters_loads_no_mock_code():
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from labrl.envs import make\n"
        "import labrl.lab_adapters, labrl.lab_adapters.rest, labrl.lab_adapters.journaled_lab\n"
        "env = make('lab/synthesis-v0')\n"
        "task = env.make_task('train', 0)\n"
        "assert env.unwrapped.gold_actions(task)\n"
        "print(sorted(m for m in sys.modules if m.startswith('labrl.lab_adapters.mock')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
