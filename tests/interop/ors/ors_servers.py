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
def serve_in_thread(
    env_id: str, max_sessions: int = 1024, server: dict[str, float] | None = None, **options: object
) -> Iterator[str]:
    """The ORS app of ``env_id`` under uvicorn in a thread of this process; yields its URL.

    ``server``: ``create_app``'s own keywords (the reaper's ``session_ttl_s``, ``reap_every_s``)."""
    from labrl.interop.ors_server import create_app
    from labrl.interop.servers import ServeSettings

    settings = ServeSettings(
        env_id=env_id, options=dict(options), max_sessions=max_sessions, tasks_per_split=5
    )
    with shared.serve_app_in_thread(create_app(settings, **(server or {}))) as url:
        yield url
