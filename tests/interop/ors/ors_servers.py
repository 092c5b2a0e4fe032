"""Real ORS servers on localhost: ``labrl envs serve --protocol ors`` as a subprocess, or the same
app under uvicorn in a thread (for the fixture envs only the test process registers); and the
commands of docs/interop.md's ORS section, which the tests run as written."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import interop_servers as shared
import pytest
from interop_servers import wait_healthy

pytest.importorskip("openreward")

from labrl.lab_adapters.mock.process import free_port

SECTION = "## Open Reward Standard"
docs_serve_command = partial(shared.docs_serve_command, SECTION)
docs_python_block = partial(shared.docs_python_block, SECTION)


@contextmanager
def serve_in_thread(env_id: str, max_sessions: int = 1024, **options: object) -> Iterator[str]:
    """The ORS app of ``env_id`` under uvicorn in a thread of this process; yields its URL."""
    import uvicorn
    from sse_starlette.sse import AppStatus

    from labrl.interop.servers import ServeSettings, app_factory

    # sse-starlette keeps one process-wide shutdown event, bound to the first loop that waits on it;
    # each server here runs its own loop (a served process has one server, so only tests need this)
    AppStatus.should_exit_event = None
    port = free_port()
    settings = ServeSettings(
        env_id=env_id, options=dict(options), max_sessions=max_sessions, tasks_per_split=5
    )
    server = uvicorn.Server(uvicorn.Config(app_factory("ors")(settings), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
