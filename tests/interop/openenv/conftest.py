"""The xrd tools env served by docs/interop.md's ``labrl envs serve`` command, shared by a module's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("openenv")

from interop_servers import serve_argv
from openenv_test_servers import docs_serve_command


@pytest.fixture(scope="module")
def xrd_server() -> Iterator[str]:
    with serve_argv(docs_serve_command()) as url:  # docs/interop.md's command, on a free port
        yield url
