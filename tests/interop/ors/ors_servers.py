"""Real ORS servers on localhost: ``labrl envs serve --protocol ors`` as a subprocess, or the same
app under uvicorn in a thread (for the fixture envs only the test process registers); and the
commands of docs/interop.md's ORS section, which the tests run as written."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openreward")

from labrl.lab_adapters.mock.process import free_port

DOCS = Path(__file__).parents[3] / "docs" / "interop.md"
STARTUP_TIMEOUT_S = 120.0  # the xrd envs load their phase library while the tools are listed


def wait_healthy(url: str, process: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {process.stderr.read()}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no healthy server at {url} within {STARTUP_TIMEOUT_S:g} s")


@contextmanager
def serve_argv(argv: list[str], env: dict[str, str] | None = None) -> Iterator[str]:
    """``labrl ARGV`` (a serve command) as a subprocess, its ``--port`` replaced by a free port."""
    port = free_port()
    if "--port" in argv:
        at = argv.index("--port")
        argv = argv[:at] + argv[at + 2 :]
    process = subprocess.Popen(
        [sys.executable, "-m", "labrl.cli", *argv, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})}, cwd=Path(__file__).parent,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


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


def docs_section() -> str:
    """docs/interop.md's ORS section."""
    text = DOCS.read_text()
    start = text.index("## Open Reward Standard")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def docs_serve_command() -> list[str]:
    """The documented ``labrl envs serve ...`` line, split into its arguments after ``labrl``."""
    (line,) = [line for line in docs_section().splitlines() if line.startswith("labrl envs serve ")]
    return line.split()[1:]


def docs_python_block() -> str:
    section = docs_section()
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]
