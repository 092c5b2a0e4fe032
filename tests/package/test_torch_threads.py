"""The suite's torch thread count (``tests/conftest.py``): set before every test, an area may override it,
and a count one test sets does not carry into the next; checked in a pytest run of its own, whose
process starts with torch's default."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT_CONFTEST = Path(__file__).parents[1] / "conftest.py"

LEAKY_TESTS = """
import torch


def test_a_sets_its_own_count():
    torch.set_num_threads({leak})  # as an in-process run does (pipeline.torch_threads)


def test_b_starts_with_the_share_of_the_cores():
    assert torch.get_num_threads() == {share}
"""

AREA_CONFTEST = """
import pytest


@pytest.fixture
def torch_threads() -> int:
    return 1
"""

AREA_TESTS = """
import torch


def test_the_area_count():
    assert torch.get_num_threads() == 1
"""


def test_every_test_starts_with_its_area_thread_count(tmp_path):
    shutil.copy(ROOT_CONFTEST, tmp_path / "conftest.py")
    share = len(os.sched_getaffinity(0))  # one process: every core
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS.format(share=share, leak=share + 1))
    area = tmp_path / "area"
    area.mkdir()
    (area / "conftest.py").write_text(AREA_CONFTEST)
    (area / "test_area.py").write_text(AREA_TESTS)
    # the area's test runs after test_a's count and before test_b
    order = [
        "test_leaky.py::test_a_sets_its_own_count",
        "area",
        "test_leaky.py::test_b_starts_with_the_share_of_the_cores",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *order],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
