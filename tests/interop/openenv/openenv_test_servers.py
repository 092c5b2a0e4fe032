"""Real OpenEnv servers on localhost: ``labrl envs serve`` as a subprocess, or the same app under
uvicorn in a thread (for the fixture envs that only the test process registers)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial

import interop_servers as shared
import pytest
from interop_servers import serve_argv

pytest.importorskip("openenv")


SECTION = "## OpenEnv"
docs_serve_command = partial(shared.docs_serve_command, SECTION)
docs_python_block = partial(shared.docs_python_block, SECTION)


@contextmanager
def serve_cli(env_id: str, *args: str, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """``labrl envs serve ENV_ID --protocol openenv`` as a subprocess on a free port; yields its URL."""
    with serve_argv(["envs", "serve", env_id, "--protocol", "openenv", *args], env=env) as url:
        yield url


@contextmanager
def serve_in_thread(env_id: str, **options: object) -> Iterator[str]:
    """The OpenEnv app of ``env_id`` under uvicorn in a thread of this process; yields its URL."""
    from labrl.interop.servers import ServeSettings, app_factory

    app = app_factory("openenv")(ServeSettings(env_id=env_id, options=dict(options), tasks_per_split=5))
    with shared.serve_app_in_thread(app) as url:
        yield url
