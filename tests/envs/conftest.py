"""Every test of this folder runs with the fixture envs registered (``tests/conftest.py``)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _registered_fixture_envs(fixture_envs):
    yield
