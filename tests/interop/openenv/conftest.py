"""The xrd tools env served by ``labrl envs serve --protocol openenv``, shared by a module's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("openenv")

from openenv_test_servers import serve_cli


@pytest.fixture(scope="module")
def xrd_server() -> Iterator[str]:
    with serve_cli("xrd/phase-id-tools-v0", "--tasks-per-split", "20") as url:
        yield url
