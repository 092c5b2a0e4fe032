"""Real ORS servers on localhost: ``labrl envs serve --protocol ors`` as a subprocess, or the same
app under uvicorn in a thread (for the fixture envs only the test process registers); and the
commands of docs/interop.md's ORS section, which the tests run as written."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import interop_servers as shared
import pytest

pytest.importorskip("openreward")


SECTION = "## Open Reward Standard"
docs_serve_command = partial(shared.docs_serve_command, SECTION)
docs_python_block = partial(shared.docs_python_block, SECTION)


@contextmanager
def serve_in_thread(env_id: str, max_sessions: int = 1024, **options: object) -> Iterator[str]:
    """The ORS app of ``env_id`` under uvicorn in a thread of this process; yields its URL."""
    from sse_starlette.sse import AppStatus

    from labrl.interop.servers import ServeSettings, app_factory

    # sse-starlette keeps one process-wide shutdown event, bound to the first loop that waits on it;
    # each server here runs its own loop (a served process has one server, so only tests need this)
    AppStatus.should_exit_event = None
    settings = ServeSettings(
        env_id=env_id, options=dict(options), max_sessions=max_sessions, tasks_per_split=5
    )
    with shared.serve_app_in_thread(app_factory("ors")(settings)) as url:
        yield url
