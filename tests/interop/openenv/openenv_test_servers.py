"""Real OpenEnv servers on localhost: ``labrl envs serve`` as a subprocess, or the same app under
uvicorn in a thread (for the fixture envs that only the test process registers)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial

import interop_servers as shared
import pytest
from interop_servers import serve_argv, wait_healthy

pytest.importorskip("openenv")

from labrl.lab_adapters.mock.process import free_port

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
    import uvicorn

    from labrl.interop.servers import ServeSettings, app_factory

    port = free_port()
    app = app_factory("openenv")(ServeSettings(env_id=env_id, options=dict(options), tasks_per_split=5))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
