"""docs/envs.md's "Register a new science task", run as written from a temporary package.

The package's files are the section's code blocks that open with ``# <path>``, and the commands
are the ``labrl`` lines of its shell block: the docs and this test cannot drift apart.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parents[2] / "docs" / "envs.md"
SECTION = "## Register a new science task"
FENCE = re.compile(r"^ *```(\w+)\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
FILE_HEADER = re.compile(r"# (\S+\.\w+)\n")


def _recipe() -> tuple[dict[str, str], list[list[str]]]:
    """The files (path -> text) and the ``labrl`` command lines of the docs section."""
    text = DOCS.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    files, commands = {}, []
    for language, body in FENCE.findall(section):
        header = FILE_HEADER.match(body)
        if header:
            files[header[1]] = body
        elif language == "bash":
            for line in body.splitlines():
                words = shlex.split(line, comments=True)
                if words[:1] == ["labrl"]:
                    commands.append(words[1:])
    return files, commands


def test_the_docs_recipe_registers_and_passes_the_checker(tmp_path):
    files, commands = _recipe()
    assert set(files) == {"mylab/envs.py", "pyproject.toml"}
    assert [argv[:2] for argv in commands] == [["envs", "check"]]
    package = tmp_path / "mylab-src"
    for path, body in files.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(body)
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(package)],
        check=True, capture_output=True,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    check = subprocess.run(
        [sys.executable, "-m", "labrl.cli", *commands[0]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "mylab/titration-v0" in check.stdout
    assert "FAIL" not in check.stdout.upper(), check.stdout
