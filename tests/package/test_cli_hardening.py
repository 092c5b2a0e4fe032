"""The CLI in a pipe, its help texts, env options, typos and broken plugins: one clear line each."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from labrl.cli import build_parser, main


def _undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if not helps.get(name):
                    missing.append(f"{path} {name}")
                missing += _undocumented(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction) and not action.help:
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_command_and_option_has_help():
    assert _undocumented(build_parser(), "labrl") == []


def _torchrun(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2 -m labrl ARGV``: two CPU ranks of the CLI as a module."""
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "labrl", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
    )


@pytest.mark.timeout(360)
def test_torchrun_runs_the_cli_as_a_module_and_train_refuses_it(tmp_path):
    """torchrun runs modules, so ``python -m labrl`` is the CLI; ``labrl train`` under it is refused
    before anything is written (a learner over several processes is not built: docs/gpu.md)."""
    shown = _torchrun(tmp_path, "envs", "show", "xrd/phase-id-v0")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count('"id": "xrd/phase-id-v0"') == 2  # one from each rank
    config = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
    refused = _torchrun(tmp_path, "train", str(config), f"run_dir={tmp_path / 'run'}")
    assert refused.returncode != 0
    # torchrun stops the other rank once one fails, so one error or two
    assert refused.stderr.count("labrl: error: WORLD_SIZE=2: labrl train runs one process") >= 1
    assert not (tmp_path / "run").exists()


def test_output_into_a_closed_pipe_is_quiet():
    """`labrl envs list | head -0`: the reader is gone before labrl writes; no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "labrl.cli", "envs", "show", "xrd/phase-id-v0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader went away
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141  # 128 + SIGPIPE, as a tool killed by SIGPIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_envs_show_lists_the_options(capsys):
    assert main(["envs", "show", "xrd/phase-id-v0"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["id"] == "xrd/phase-id-v0"
    options = {o["name"]: o for o in shown["options"]}
    assert options["tier"]["default"] == 1 and options["tier"]["type"] == "Literal[1, 2, 3]"
    assert options["n_peaks"]["description"] == "peaks listed in the prompt"
    assert main(["envs", "show", "lab/synthesis-v0"]) == 0
    names = [o["name"] for o in json.loads(capsys.readouterr().out)["options"]]
    assert "fresh_journal" in names and "api_key_env" in names


def test_option_typo_says_did_you_mean(capsys):
    assert main(["envs", "sample", "xrd/phase-id-v0", "-o", "tierr=2", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'tierr' (did you mean 'tier'?)" in err


PLUGIN_MODULE = textwrap.dedent(
    """
    from labrl.envs import Env, EnvSpec

    class RaisingEnv(Env):
        def __init__(self):
            raise RuntimeError("calibration file /opt/lab/cal.json not found")

        def make_task(self, split, seed): ...
        async def reset(self, task): ...
        async def step(self, action): ...
    """
)


def _install_fake_plugin(site: Path) -> None:
    """A distribution as pip leaves it: a module and a dist-info declaring labrl.envs entry points."""
    (site / "brokenlab_envs.py").write_text(PLUGIN_MODULE)
    (site / "brokenlab_import.py").write_text("raise RuntimeError('module-level bug')\n")
    info = site / "brokenlab-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenlab\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[labrl.envs]\n"
        "broken/raises-v0 = brokenlab_envs:RaisingEnv\n"
        "broken/import-v0 = brokenlab_import:Env\n"
        "Not A Valid Id = brokenlab_envs:RaisingEnv\n"
    )


def _labrl(site: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "labrl.cli", *argv], env=env, capture_output=True, text=True, timeout=180
    )


@pytest.mark.parametrize(
    ("env_id", "says"),
    [
        (
            "broken/raises-v0",
            "env broken/raises-v0 (brokenlab) failed to construct: RuntimeError: calibration",
        ),
        ("broken/import-v0", "for env broken/import-v0 (brokenlab) failed: RuntimeError: module-level bug"),
    ],
    ids=["constructor", "import"],
)
def test_broken_plugin_is_one_line_naming_it(tmp_path, env_id, says):
    _install_fake_plugin(tmp_path)
    proc = _labrl(tmp_path, "envs", "show", env_id)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    errors = [line for line in lines if line.startswith("labrl: error: ")]
    assert len(errors) == 1 and says in errors[0], proc.stderr
    # the other broken entry point (an invalid id) is one warning line naming its distribution
    assert [line for line in lines if line not in errors] == [
        "labrl: warning: skipping env entry point of brokenlab: env id 'Not A Valid Id' must look like "
        "'namespace/name-vN' (lowercase, e.g. 'xrd/phase-id-v0')"
    ]
    listed = _labrl(tmp_path, "envs", "list")  # the invalid id is skipped, the rest still listed
    assert listed.returncode == 0 and "xrd/phase-id-v0" in listed.stdout and env_id in listed.stdout
    assert "Traceback" not in listed.stderr
