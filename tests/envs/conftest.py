from __future__ import annotations

import pytest
from labrl_test_envs import FIXTURES

from labrl.envs import deregister, register, registered_ids


@pytest.fixture(autouse=True, scope="session")
def fixture_envs():
    registered_ids()  # load built-ins first so fixture ids never shadow them
    for env_id, cls in FIXTURES.items():
        register(env_id, entry_point=f"labrl_test_envs:{cls.__name__}", source="tests")
    yield
    for env_id in FIXTURES:
        deregister(env_id)
